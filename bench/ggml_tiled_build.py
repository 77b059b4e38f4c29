"""Build ggml-python's libraries with llama.cpp's tiled K/IQ-quant GEMM into a folder of its own,
to measure moeray's prefill with that kernel without touching the venv:

    python bench/ggml_tiled_build.py --llama-cpp /work/llamacpp/src --out /tmp/ggml-tiled
    PYTHONPATH=/tmp/ggml-tiled python bench/prefill_profile.py --model F.gguf --tokens 512 --kernels

Why: at prefill, the routed experts of an IQ3_S (or K-quant) model are most of the time, and
ggml-python 0.0.45's ggml multiplies them row by row (`ggml_vec_dot_iq3_s_q8_K`: a weight row is
decoded again for every token). llama.cpp's ggml has `ggml-cpu/tiled/`, which decodes a weight tile
once for 8+ tokens: 2.8x less CPU on the Qwen3.6 shape's experts (docs/performance-families.md).
That code is self-contained; this script copies it into ggml-python's vendored ggml (from the
sdist, fetched with pip), hooks it where llama.cpp does (`ggml_compute_forward_mul_mat`,
`..._mul_mat_id` per expert, and both ops' work sizes in `ggml_graph_plan`) and builds the three
libraries with the Makefile's flags. IQ1_S / IQ1_M are left out: this ggml's ggml-common.h has no
C++ copy of their grid. Everything else (the Python bindings, the other kernels) is ggml-python's.

The libraries keep ggml-python's own names, and the Python package beside them is the installed
one, so stages/kernels/ggml_lib.py accepts them. `GGML_CPU_TILED_MM=0` turns the path off at run
time (llama.cpp's switch). Numerics: an expert with 8+ tokens takes the tiled path, fewer the
row-by-row one, so a token's result may differ in the last bits with the batch it is in.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# The Makefile's GGML_CMAKE_ARGS (portable AVX2, no OpenMP, no llamafile, RPATH) as cmake -D flags.
CMAKE_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
               "-DGGML_OPENMP=OFF", "-DGGML_LLAMAFILE=OFF", "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,--disable-new-dtags",
               "-DCMAKE_INSTALL_RPATH=$ORIGIN", "-DCMAKE_BUILD_WITH_INSTALL_RPATH=TRUE",
               "-DBUILD_SHARED_LIBS=ON", "-DGGML_BUILD_TESTS=OFF", "-DGGML_BUILD_EXAMPLES=OFF",
               "-DCMAKE_BUILD_TYPE=Release"]

# (text in ggml-python's vendored ggml-cpu.c, what it becomes): llama.cpp's hooks, as it places them.
HOOKS = [
    ('#include "ggml-threading.h"\n', '#include "ggml-threading.h"\n#include "tiled/tiled.h"\n'),
    ("""        ggml_compute_forward_fwht(params, dst);
        return;
    }

    GGML_TENSOR_BINARY_OP_LOCALS
""", """        ggml_compute_forward_fwht(params, dst);
        return;
    }

    // If tiled is supported, it will execute the full op here and we return
    if (ggml_compute_forward_mul_mat_tiled(params, dst)) {
        return;
    }

    GGML_TENSOR_BINARY_OP_LOCALS
"""),
    ("""        incr_ptr_aligned(&wdata_cur, CACHE_LINE_SIZE * n_as, CACHE_LINE_SIZE);

    GGML_ASSERT(params->wsize""", """        incr_ptr_aligned(&wdata_cur, CACHE_LINE_SIZE * n_as, CACHE_LINE_SIZE);

    char * tiled_scratch = incr_ptr_aligned(&wdata_cur, ggml_tiled_wdata_size(nth, dst), 64);

    GGML_ASSERT(params->wsize"""),
    ("""        if (cne1 == 0) {
            continue;
        }

        const char * src0_cur""", """        if (cne1 == 0) {
            continue;
        }

        if (ggml_compute_forward_mul_mat_id_tiled(params, dst, cur_a, cne1, (const int32_t *) &MMID_MATRIX_ROW(cur_a, 0), tiled_scratch)) {
            continue;
        }

        const char * src0_cur"""),
    ("""                            cur = ggml_row_size(vec_dot_type, ggml_nelements(node->src[1]));
                        }
                    } break;""", """                            cur = ggml_row_size(vec_dot_type, ggml_nelements(node->src[1]));
                        }
                        cur = GGML_PAD(cur, 64);
                        cur += ggml_tiled_wdata_size(n_tasks, node);
                    } break;"""),
    ("""                        cur += CACHE_LINE_SIZE*n_as + CACHE_LINE_SIZE;
                    } break;""", """                        cur += CACHE_LINE_SIZE*n_as + CACHE_LINE_SIZE;
                        cur = GGML_PAD(cur, 64);
                        cur += ggml_tiled_wdata_size(n_tasks, node);
                    } break;"""),
]


def replace_once(text: str, old: str, new: str, where: str) -> str:
    if text.count(old) != 1:
        raise SystemExit(f"{where}: expected one match of {old.strip().splitlines()[0]!r}, found "
                         f"{text.count(old)}: another ggml-python version; compare with llama.cpp's ggml-cpu.c")
    return text.replace(old, new)


def without_iq1(tiled_cpp: str) -> str:
    """tiled.cpp without its IQ1_S / IQ1_M unpackers and cases (their grid is C-only here)."""
    start = tiled_cpp.index("// iq1_s: ")
    body = tiled_cpp.index("static void tiled_unpack_src0(const block_iq1_m", start)
    depth, seen, end = 0, False, None
    for m in re.finditer(r"[{}]", tiled_cpp[body:]):
        depth += 1 if m.group() == "{" else -1
        seen = True
        if seen and depth == 0:
            end = body + m.end()
            break
    text = tiled_cpp[:start] + tiled_cpp[end:]
    text = text.replace("        case GGML_TYPE_IQ1_S:\n        case GGML_TYPE_IQ1_M:\n", "")
    return re.sub(r"        case GGML_TYPE_IQ1_[SM]:\n            return tiled_matmul_dispatch<block_iq1_[sm],[^\n]*\n", "", text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", required=True, help="a llama.cpp source tree with ggml/src/ggml-cpu/tiled/")
    ap.add_argument("--out", required=True, help="the folder to put on PYTHONPATH (it gets ggml/)")
    ap.add_argument("--version", default="0.0.45", help="the ggml-python sdist to patch (the installed one)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--llamafile", action="store_true",
                    help="also llamafile's sgemm (plain Q8_0, Q4_0 and float matrices; not mul_mat_id), which the Makefile leaves out: "
                         "a row's result then depends on its batch")
    args = ap.parse_args()
    import ggml

    work = Path(tempfile.mkdtemp(prefix="ggml-tiled-"))
    subprocess.run([sys.executable, "-m", "pip", "download", f"ggml-python=={args.version}", "--no-deps",
                    "--no-binary", ":all:", "-d", str(work)], check=True)
    with tarfile.open(next(work.glob("ggml_python-*.tar.gz"))) as tar:
        tar.extractall(work)
    vendor = next(work.glob("ggml_python-*/vendor/ggml"))
    cpu = vendor / "src" / "ggml-cpu"
    shutil.copytree(Path(args.llama_cpp) / "ggml" / "src" / "ggml-cpu" / "tiled", cpu / "tiled")
    (cpu / "tiled" / "tiled.cpp").write_text(without_iq1((cpu / "tiled" / "tiled.cpp").read_text()))
    cmake = (cpu / "CMakeLists.txt").read_text()
    (cpu / "CMakeLists.txt").write_text(replace_once(
        cmake, "        ggml-cpu/repack.cpp\n", "        ggml-cpu/repack.cpp\n        ggml-cpu/tiled/tiled.cpp\n"
        "        ggml-cpu/tiled/tiled.h\n        ggml-cpu/tiled/tiled-kernel.cpp\n        ggml-cpu/tiled/tiled-kernel.h\n",
        "ggml-cpu/CMakeLists.txt"))
    src = (cpu / "ggml-cpu.c").read_text()
    for old, new in HOOKS:
        src = replace_once(src, old, new, "ggml-cpu.c")
    (cpu / "ggml-cpu.c").write_text(src)

    build = work / "build"
    flags = [f for f in CMAKE_FLAGS if not (args.llamafile and f.startswith("-DGGML_LLAMAFILE"))]
    flags += ["-DGGML_LLAMAFILE=ON"] if args.llamafile else []
    subprocess.run(["cmake", "-S", str(vendor), "-B", str(build), "-G", "Ninja", *flags], check=True)
    subprocess.run(["ninja", "-C", str(build), f"-j{args.jobs}", "ggml-base", "ggml-cpu", "ggml"], check=True)

    out = Path(args.out) / "ggml"
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(Path(ggml.__file__).parent, out, ignore=shutil.ignore_patterns("__pycache__", "lib"))
    (out / "lib").mkdir()
    for lib in (build / "src").glob("libggml*.so*"):  # the sonames' links too: one copy of each loaded
        shutil.copy(lib, out / "lib" / lib.name, follow_symlinks=False)
    print(f"PYTHONPATH={args.out} puts ggml-python with the tiled GEMM first (GGML_CPU_TILED_MM=0: off)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
