"""Build ggml-python with llama.cpp's tiled K/IQ-quant GEMM (what `make venv` installs).

Why: at prefill the routed experts of a K- or IQ-quant model are most of the time, and the ggml
that ggml-python 0.0.45 (the newest on PyPI) vendors multiplies them row by row (`ggml_vec_dot_*`:
a weight row is decoded again for every token). llama.cpp's ggml has `ggml-cpu/tiled/`, which
decodes a weight tile once for 8+ tokens, in `mul_mat` and per expert in `mul_mat_id`: the
Qwen3.6 4-layer cut's prefill went from 0.51x to 1.00x llama-bench with it
(docs/performance-families.md). That code is self-contained; its four files are vendored beside
this module (`ggml_tiled/`, README.md there names the llama.cpp commit) and this module:

1. downloads the ggml-python sdist (`pip download`, version VERSION: the hooks below are anchored
   in its text),
2. copies the tiled files into its vendored ggml and hooks them where llama.cpp does
   (`ggml_compute_forward_mul_mat`, `..._mul_mat_id` per expert, both ops' work sizes in
   `ggml_graph_plan`, the ggml-cpu CMakeLists),
3. `pip install`s the patched source with the caller's CMAKE_ARGS (the Makefile's GGML_CMAKE_ARGS).

Any step failing (no network, another version, an anchor not found, a compile error) falls back
to the plain `pip install ggml-python`, with one line saying the tiled GEMM is absent. At run time
stages/kernels/ggml_lib.py tells which build loaded (`tiled_gemm()`), and the backend line says it.

    CMAKE_ARGS="..." python stages/kernels/ggml_build.py install              # make venv
    python stages/kernels/ggml_build.py install --target /tmp/g               # a side build: PYTHONPATH=/tmp/g
    python stages/kernels/ggml_build.py vendor --llama-cpp /path/to/llama.cpp # refresh ggml_tiled/

It also builds llamafile's sgemm in (-DGGML_LLAMAFILE=ON: tinyBLAS, plain Q8_0, Q4_0 and float
matrices; llama.cpp takes it for every such product) and adds two run-time switches (SWITCHES
below), which a stage sets from its options before it plans a graph: the tiled GEMM on or off
(StageOptions.tiled_gemm), and the fewest rows a product needs to take llamafile's sgemm
(StageOptions.sgemm_rows: 2), and only for Q8_0, Q4_0 and Q5_0 matrices, whose kernels give
ggml's bits: float and IQ4_NL ones keep ggml's kernels.

Numerics: the tiled kernel sums a row's per-block products in another order than vec_dot, so a
matrix row differs by ~1e-7 relative (the last float32 bit) between a call where it runs tiled
(8+ rows, or 8+ rows routed to its expert) and one where it does not. llamafile's Q8_0 / Q4_0
/ Q5_0 kernels on AVX2 give ggml's bits (tests/stages/test_ggml_tiled.py); its float and IQ4_NL ones would
not, and never run. `tiled_gemm=False` (or
GGML_CPU_TILED_MM=0, llama.cpp's switch) turns the tiled path off, `sgemm_rows=0` the sgemm.
docs/kernels.md#tiled-gemm.

Standard library only: the Makefile runs it before ggml-python exists.
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

from moeray import environment

VERSION = "0.0.45"  # the ggml-python sdist whose text the hooks below are written against
TILED = Path(__file__).resolve().with_name("ggml_tiled")
FILES = ("tiled.h", "tiled.cpp", "tiled-kernel.h", "tiled-kernel.cpp")

# The Makefile's GGML_CMAKE_ARGS, for a side build run without it (CMAKE_ARGS unset): portable AVX2,
# never -march=native; no OpenMP; llamafile's sgemm (Q8_0 / Q4_0 / Q5_0 only, switched at run time); DT_RPATH (ggml_lib.py).
DEFAULT_CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_OPENMP=OFF "
                      "-DGGML_LLAMAFILE=ON -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--disable-new-dtags")

ABSENT = ("moeray: ggml-python goes in WITHOUT llama.cpp's tiled K/IQ-quant GEMM ({why}): the plain sdist "
          "instead (or the one installed), so K- and IQ-quant prefill will be slower (up to ~2x on the routed "
          "experts); the `moeray: kernels:` line says which build runs. docs/kernels.md#tiled-gemm")

# The ggml-cpu CMakeLists: the tiled sources beside repack.cpp, as llama.cpp lists them.
CMAKE_HOOK = ("        ggml-cpu/repack.cpp\n",
              "        ggml-cpu/repack.cpp\n" + "".join(f"        ggml-cpu/tiled/{f}\n" for f in FILES))

# moeray's run-time switches (StageOptions.tiled_gemm and .sgemm_rows, set by stages/kernels/ggml_lib.py
# set_gemm_paths before a graph is planned): which of the two GEMMs a matmul may take, and a count of
# the sgemm's products (tests/stages/test_ggml_tiled.py: its bits are ggml's, so only the count shows it ran). Set between
# graphs, never during one, so every thread of a graph takes the same path.
SWITCHES = """
// moeray: run-time switches (stages/kernels/ggml_build.py). moeray_tiled_on: llama.cpp's tiled
// K/IQ-quant GEMM may run (besides its own GGML_CPU_TILED_MM). moeray_sgemm_rows: llamafile's sgemm
// runs only for a product of at least this many rows, and of a Q8_0, Q4_0 or Q5_0 matrix, whose
// x86 kernels sum a row's blocks in ggml's order (the same bits). Its float and IQ4_NL kernels sum
// in another: a float32 router's last bit flips expert choices at near-ties, and a prompt's answer
// would depend on how it was split into steps.
static int moeray_tiled_on = 1;
static int64_t moeray_sgemm_rows = INT64_MAX;
static int64_t moeray_sgemm_products = 0;  // products the sgemm computed (thread 0 counts): for tests
#define MOERAY_SGEMM(w, rows) ((rows) >= moeray_sgemm_rows && \
    ((w)->type == GGML_TYPE_Q8_0 || (w)->type == GGML_TYPE_Q4_0 || (w)->type == GGML_TYPE_Q5_0))

GGML_BACKEND_API int64_t moeray_ggml_sgemm_products(void) {
    return moeray_sgemm_products;
}

GGML_BACKEND_API void moeray_ggml_set_gemm_paths(int tiled_on, int64_t sgemm_rows) {
    moeray_tiled_on = tiled_on != 0;
    moeray_sgemm_rows = sgemm_rows > 0 ? sgemm_rows : INT64_MAX;
}
"""

# (text in ggml-python's vendored ggml-cpu.c, what it becomes): llama.cpp's hooks, as it places them.
HOOKS = [
    ('#include "ggml-threading.h"\n', '#include "ggml-threading.h"\n#include "tiled/tiled.h"\n' + SWITCHES),
    ("""        ggml_compute_forward_fwht(params, dst);
        return;
    }

    GGML_TENSOR_BINARY_OP_LOCALS
""", """        ggml_compute_forward_fwht(params, dst);
        return;
    }

    // If tiled is supported, it will execute the full op here and we return
    if (moeray_tiled_on && ggml_compute_forward_mul_mat_tiled(params, dst)) {
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

        if (moeray_tiled_on && ggml_compute_forward_mul_mat_id_tiled(params, dst, cur_a, cne1, (const int32_t *) &MMID_MATRIX_ROW(cur_a, 0), tiled_scratch)) {
            continue;
        }

        const char * src0_cur"""),
    # llamafile's sgemm (built in with -DGGML_LLAMAFILE=ON) only at moeray_sgemm_rows rows and more
    ("""    if (src1_cont) {
        for (int64_t i13 = 0; i13 < ne13; i13++)""", """    if (src1_cont && MOERAY_SGEMM(src0, ne11)) {
        for (int64_t i13 = 0; i13 < ne13; i13++)"""),
    ("""#if GGML_USE_LLAMAFILE
    if (src1->type != vec_dot_type) {""", """#if GGML_USE_LLAMAFILE
    if (src1->type != vec_dot_type && MOERAY_SGEMM(src0, ne11)) {"""),
    ("""                    goto UseGgmlGemm1;
        return;""", """                    goto UseGgmlGemm1;
        if (params->ith == 0) moeray_sgemm_products++;
        return;"""),
    ("""                    goto UseGgmlGemm2;
        return;""", """                    goto UseGgmlGemm2;
        if (params->ith == 0) moeray_sgemm_products++;
        return;"""),
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


# The tiled flash attention (a tile of up to GGML_FA_TILE_Q = 64 query rows of one head against a
# tile of 64 keys: float32 GEMMs) as llama.cpp's is and more. (1) Its float16 V rows are converted
# with the SIMD ggml_cpu_fp16_to_fp32 (llama.cpp's; ggml-python's calls ggml-base's scalar one: 7.5%
# of a 65-token chunk's CPU at depth 4,096, 1.8% in llama.cpp). (2) A tile of fewer rows than 64
# computes only its rows (ggml zero-pads the queries to 64 and runs both GEMMs and the softmax over
# them all): a 65-token chunk is a 64-row and a 1-row tile per head. (3) Threads take whole tiles,
# one head's 64 rows at a time, rather than 4 ranges per thread cut across heads and tiles (at 65
# rows and 9 heads those cut 24 tiles where 18 do). (4) StageOptions.fa_tiled_rows (MOERAY_FA_TILED_ROWS
# its override) sets the query rows it runs from, through moeray_ggml_set_fa_tiled_rows (ggml_lib.py
# set_fa_tiled_rows: in-process, whenever the options change); the default stays ggml's 64: the two
# kernels round differently (the tiled one keeps the query float32, the row-by-row one rounds it to
# float16, or q8_0 over q8_0 keys), and
# from 16 rows a prompt's last token got other logits than the same token recomputed alone (n choices
# sharing a prompt's blocks sampled other text than one request with the same seed; logprobs
# differed streamed and not). From 16 a returning turn's 16- to 63-token chunk over thousands of keys
# is faster (16 tokens over 4,160: 0.66 s a step, 0.43 s tiled, default model, 2 threads): an
# opt-in until both kernels give a row the same bits. Each row's values are computed as before (a
# GEMM row does not depend on the rows beside it), so (1) to (3) change no bit.
TILED_FA_ROWS = [
    ("ggml_fp16_to_fp32_row((const ggml_fp16_t *)v_data, V32 + tk * DV, DV);",
     "ggml_cpu_fp16_to_fp32((const ggml_fp16_t *)v_data, V32 + tk * DV, DV);  // moeray: SIMD, as llama.cpp"),
    ("memset(KQ, 0, Q_TILE_SZ * KV_TILE_SZ * sizeof(float));",
     "memset(KQ, 0, tile_rows * KV_TILE_SZ * sizeof(float));  // moeray: the tile's rows only"),
    ("simd_gemm(KQ, (const float *)Q_q, K_f32, Q_TILE_SZ, DK, KV_TILE_SZ);",
     "simd_gemm(KQ, (const float *)Q_q, K_f32, tile_rows, DK, KV_TILE_SZ);"),
    ("ggml_vec_scale_f32(Q_TILE_SZ * KV_TILE_SZ, KQ, scale);", "ggml_vec_scale_f32(tile_rows * KV_TILE_SZ, KQ, scale);"),
    ("simd_gemm(VKQ32, KQ, V32, Q_TILE_SZ, KV_TILE_SZ, DV);", "simd_gemm(VKQ32, KQ, V32, tile_rows, KV_TILE_SZ, DV);"),
]
TILED_FA_HOOKS = [
    ("""            if (kv_tile < KV_TILE_SZ) {
                for (int tq = 0; tq < Q_TILE_SZ; tq++) {""", """            if (kv_tile < KV_TILE_SZ) {
                for (int tq = 0; tq < tile_rows; tq++) {"""),
    ("""            bool skip[Q_TILE_SZ] = {};

            for (int tq = 0; tq < Q_TILE_SZ; tq++) {""", """            bool skip[Q_TILE_SZ] = {};

            for (int tq = 0; tq < tile_rows; tq++) {"""),
    ("""            for (int tq = 0; tq < Q_TILE_SZ; tq++) {
                if (skip[tq]) {""", """            for (int tq = 0; tq < tile_rows; tq++) {
                if (skip[tq]) {"""),
    ("""                                neq1 >= Q_TILE_SZ);""", """                                neq1 >= moeray_fa_tiled_rows());"""),
    ("""        int current_chunk = ith;

        while (current_chunk < nchunk) {""", """        int current_chunk = ith;

        if (use_tiled) {  // moeray: whole tiles, one head's Q_TILE_SZ rows at a time
            const int64_t per_head = (neq1 + Q_TILE_SZ - 1) / Q_TILE_SZ;
            const int64_t n_units = per_head * neq2 * neq3;
            for (int64_t u = ith; u < n_units; u = ggml_threadpool_chunk_add(params->threadpool, 1)) {
                const int64_t head = u / per_head;
                const int64_t r0 = head * neq1 + (u % per_head) * Q_TILE_SZ;
                ggml_compute_forward_flash_attn_ext_tiled(params, dst, r0, MIN(r0 + Q_TILE_SZ, (head + 1) * neq1));
            }
            return;
        }

        while (current_chunk < nchunk) {"""),
    ("""static void ggml_compute_forward_flash_attn_ext_f16(
        const ggml_compute_params * params,
        ggml_tensor * dst) {
""", """// moeray: the fewest query rows of a sequence that take the tiled flash attention (float32 / float16
// rows): StageOptions.fa_tiled_rows, given by stages/kernels/ggml_lib.py set_fa_tiled_rows when the
// options change and before a graph is planned (never during one: every thread of a graph takes the
// same kernel); 64, ggml's own count, until then (stages/kernels/ggml_build.py TILED_FA_ROWS)
static int64_t moeray_fa_rows = 64;

static int64_t moeray_fa_tiled_rows(void) {
    return moeray_fa_rows;
}

extern "C" {
GGML_BACKEND_API void moeray_ggml_set_fa_tiled_rows(int64_t rows) {
    moeray_fa_rows = rows > 0 ? rows : 64;
}
}

static void ggml_compute_forward_flash_attn_ext_f16(
        const ggml_compute_params * params,
        ggml_tensor * dst) {
"""),
]


# (text in ggml-python's vendored ops.cpp, what it becomes). A one-token step's flash attention over
# 512+ keys splits the KEYS among the threads (each thread every head over its share, then the
# partial softmaxes merged) only for float32 / float16 rows in ggml; over q8_0 / q4_0 rows it splits
# the query heads, and the default model's 9 heads over 2 threads leave one thread 5 heads, the
# other 4 and then waiting: perf showed the q8_0 decode's barrier wait 8.6 CPU ms a token at depth
# 4,096 against f16's 1.6. The split path is ggml's one_chunk kernel per key range for any type
# (it quantises q for K's dot product and dequantises V rows as the head split does), so quantised
# rows take it too when K and V have one type, as f16's do.
OPS_HOOKS = [
    ("""    const bool use_split_kv_path = !use_ref && (neq1 == 1 && neq3 == 1) && kv_is_f32_or_f16 && (k->type == v->type)""",
     """    // moeray: quantised rows split by keys too (stages/kernels/ggml_build.py OPS_HOOKS)
    const bool kv_split_type = kv_is_f32_or_f16 || k->type == GGML_TYPE_Q8_0 || k->type == GGML_TYPE_Q4_0;
    const bool use_split_kv_path = !use_ref && (neq1 == 1 && neq3 == 1) && kv_split_type && (k->type == v->type)"""),
    # q8_0 / q4_0 V rows widened here, in ggml-cpu (built with AVX2), not by ggml-base's dequantize_row_*
    # (built for SSE2 only: ggml's CMake gives the CPU flags to ggml-cpu alone); the same products
    # code * scale, so the same bits. A one-token step over 4,096 keys widens 30 x 9 x 4,096 rows of 64
    # (default model; every query head its own, as ggml's query-by-query kernel does).
    ("""                if (v_to_float) {
                    v_to_float(v_data, V32, DV);""", """                if (v->type == GGML_TYPE_Q8_0 || v->type == GGML_TYPE_Q4_0) {  // moeray: SIMD (ggml_build.py OPS_HOOKS)
                    if (v->type == GGML_TYPE_Q8_0) {
                        moeray_q8_0_to_f32(v_data, V32, DV);
                    } else {
                        moeray_q4_0_to_f32(v_data, V32, DV);
                    }
                    ggml_vec_mad_f32(DV, VKQ32, V32, vs);
                } else if (v_to_float) {
                    v_to_float(v_data, V32, DV);"""),
    ("""static void ggml_compute_forward_flash_attn_ext_f16_one_chunk(""",
     """// moeray: a q8_0 row (blocks of an fp16 scale and 32 int8) as float32, as dequantize_row_q8_0 computes it
static inline void moeray_q8_0_to_f32(const char * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t n) {
    for (int64_t i = 0; i < n / 32; i++) {
        const char * b = x + i * (sizeof(ggml_fp16_t) + 32);
        ggml_fp16_t h;
        memcpy(&h, b, sizeof(h));
        const float d = GGML_CPU_FP16_TO_FP32(h);
        const int8_t * qs = (const int8_t *) (b + sizeof(ggml_fp16_t));
        for (int j = 0; j < 32; j++) {
            y[i*32 + j] = qs[j]*d;
        }
    }
}

// moeray: a q4_0 row (blocks of an fp16 scale and 32 4-bit codes) as float32, as dequantize_row_q4_0 computes it
static inline void moeray_q4_0_to_f32(const char * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t n) {
    for (int64_t i = 0; i < n / 32; i++) {
        const char * b = x + i * (sizeof(ggml_fp16_t) + 16);
        ggml_fp16_t h;
        memcpy(&h, b, sizeof(h));
        const float d = GGML_CPU_FP16_TO_FP32(h);
        const uint8_t * qs = (const uint8_t *) (b + sizeof(ggml_fp16_t));
        for (int j = 0; j < 16; j++) {
            const int x0 = (qs[j] & 0x0F) - 8;
            const int x1 = (qs[j] >>   4) - 8;
            y[i*32 + j + 0 ] = x0*d;
            y[i*32 + j + 16] = x1*d;
        }
    }
}

static void ggml_compute_forward_flash_attn_ext_f16_one_chunk("""),
] + [(f"            {old}", f"            {new}") for old, new in TILED_FA_ROWS] + TILED_FA_HOOKS


class PatchError(Exception):
    """The sdist's text is not what the hooks expect (another ggml-python version)."""


def replace_once(text: str, old: str, new: str, where: str) -> str:
    if text.count(old) != 1:
        raise PatchError(f"{where}: expected one match of {old.strip().splitlines()[0]!r}, found {text.count(old)} "
                         "(another ggml-python version? compare with llama.cpp's ggml-cpu.c)")
    return text.replace(old, new)


def patch(sdist: Path, tiled: Path = TILED) -> None:
    """Put the tiled GEMM into an unpacked ggml-python sdist at `sdist` (PatchError: it does not fit)."""
    cpu = sdist / "vendor" / "ggml" / "src" / "ggml-cpu"
    if not (cpu / "ggml-cpu.c").is_file():
        raise PatchError(f"{cpu}/ggml-cpu.c not found")
    cmake = replace_once((cpu / "CMakeLists.txt").read_text(), *CMAKE_HOOK, "ggml-cpu/CMakeLists.txt")
    src = (cpu / "ggml-cpu.c").read_text()
    for old, new in HOOKS:
        src = replace_once(src, old, new, "ggml-cpu.c")
    ops = (cpu / "ops.cpp").read_text()
    for old, new in OPS_HOOKS:
        ops = replace_once(ops, old, new, "ops.cpp")
    (cpu / "tiled").mkdir(exist_ok=True)
    for f in FILES:
        shutil.copyfile(tiled / f, cpu / "tiled" / f)
    (cpu / "CMakeLists.txt").write_text(cmake)
    (cpu / "ggml-cpu.c").write_text(src)
    (cpu / "ops.cpp").write_text(ops)


def fetch_sdist(python: str, version: str, work: Path) -> Path:
    """ggml-python's sdist of `version`, downloaded with pip and unpacked under `work`."""
    subprocess.run([python, "-m", "pip", "download", "-q", f"ggml-python=={version}", "--no-deps",
                    "--no-binary", ":all:", "-d", str(work)], check=True)
    archive = next(work.glob("ggml_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):  # 3.11.4+: no links or paths out of `work`
            tar.extractall(work, filter="data")
        else:
            tar.extractall(work)
    return next(p for p in work.glob("ggml_python-*") if p.is_dir())


def pip_install(python: str, what: str, cmake_args: str, target: str | None, quiet: bool) -> None:
    # --no-cache-dir: pip would otherwise reuse a wheel it built earlier with other CMAKE_ARGS
    cmd = [python, "-m", "pip", "install", "--no-cache-dir", *(["-q"] if quiet else []), what]
    if target:  # a side folder for PYTHONPATH: ggml only (the venv has numpy); replace what is there
        cmd += ["--target", target, "--no-deps", "--upgrade"]
    subprocess.run(cmd, check=True, env=environment.with_variable("CMAKE_ARGS", cmake_args))


def install(python: str = sys.executable, cmake_args: str | None = None, version: str = VERSION,
            target: str | None = None, fallback: bool = True, quiet: bool = True) -> bool:
    """Install ggml-python with the tiled GEMM into `python`'s environment (or `target`); True when
    the tiled build went in. Else the plain sdist (`fallback`), with one line saying so."""
    cmake_args = environment.cmake_args(DEFAULT_CMAKE_ARGS) if cmake_args is None else cmake_args
    if "-march=native" in cmake_args or "GGML_NATIVE=ON" in cmake_args.upper():
        raise SystemExit("ggml_build: never -march=native (GGML_NATIVE=ON): the library dies with SIGILL on an older CPU")
    work = Path(tempfile.mkdtemp(prefix="moeray-ggml-"))
    try:
        try:
            sdist = fetch_sdist(python, version, work)
            patch(sdist)
            print(f"moeray: building ggml-python {version} with llama.cpp's tiled K/IQ-quant GEMM "
                  f"(stages/kernels/ggml_tiled/; a few minutes)", flush=True)
            pip_install(python, str(sdist), cmake_args, target, quiet)
            return True
        except (subprocess.CalledProcessError, PatchError, OSError, StopIteration, tarfile.TarError) as exc:
            why = exc if isinstance(exc, PatchError) else f"{type(exc).__name__}: {exc}"
            print(ABSENT.format(why=why), file=sys.stderr, flush=True)
            if not fallback:
                raise
        pip_install(python, f"ggml-python>={version}", cmake_args, target, quiet)
        return False
    finally:
        shutil.rmtree(work, ignore_errors=True)


def without_iq1(tiled_cpp: str) -> str:
    """tiled.cpp without its IQ1_S / IQ1_M unpackers and cases: ggml-python 0.0.45's ggml-common.h
    has no C++ copy of their grid (those types then run ggml's row-by-row kernels)."""
    start = tiled_cpp.index("// iq1_s: ")
    body = tiled_cpp.index("static void tiled_unpack_src0(const block_iq1_m", start)
    depth, end = 0, None
    for m in re.finditer(r"[{}]", tiled_cpp[body:]):
        depth += 1 if m.group() == "{" else -1
        if depth == 0:
            end = body + m.end()
            break
    text = tiled_cpp[:start] + tiled_cpp[end:]
    text = text.replace("        case GGML_TYPE_IQ1_S:\n        case GGML_TYPE_IQ1_M:\n", "")
    return re.sub(r"        case GGML_TYPE_IQ1_[SM]:\n            return tiled_matmul_dispatch<block_iq1_[sm],[^\n]*\n", "", text)


HEADER = ("// From llama.cpp ({origin}), MIT License, Copyright (c) 2023-2026 The ggml authors:\n"
          "// see LICENSE and README.md beside this file.{note}\n\n")


def vendor(llama_cpp: Path, origin: str, dest: Path = TILED) -> None:
    """Copy llama.cpp's ggml/src/ggml-cpu/tiled/ into `dest`, IQ1 stripped, each file headed with
    where it comes from (README.md there names the commit: update it by hand)."""
    src = llama_cpp / "ggml" / "src" / "ggml-cpu" / "tiled"
    for f in FILES:
        text = (src / f).read_text()
        note = ""
        if f == "tiled.cpp":
            text, note = without_iq1(text), "\n// Changed for moeray: IQ1_S / IQ1_M removed (stages/kernels/ggml_build.py without_iq1)."
        (dest / f).write_text(HEADER.format(origin=origin, note=note) + text)
    shutil.copyfile(llama_cpp / "LICENSE", dest / "LICENSE")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("install", help="pip install ggml-python with the tiled GEMM (CMAKE_ARGS from the environment)")
    i.add_argument("--target", help="install into this folder (for PYTHONPATH) instead of the environment")
    i.add_argument("--version", default=VERSION)
    i.add_argument("--no-fallback", action="store_true", help="fail instead of installing the plain ggml-python")
    i.add_argument("-v", "--verbose", action="store_true", help="show pip's and the compiler's output")
    v = sub.add_parser("vendor", help="refresh ggml_tiled/ from a llama.cpp source tree")
    v.add_argument("--llama-cpp", required=True, type=Path)
    v.add_argument("--origin", required=True, help="what README.md and the headers name, e.g. 'commit 0c1e57098'")
    args = ap.parse_args(argv)
    if args.cmd == "vendor":
        vendor(args.llama_cpp, args.origin)
        return 0
    ok = install(version=args.version, target=args.target, fallback=not args.no_fallback, quiet=not args.verbose)
    if args.target:
        print(f"PYTHONPATH={args.target} puts this ggml-python first (MOERAY_TILED_GEMM=0: the tiled GEMM off, MOERAY_SGEMM_ROWS=0: the sgemm)")
    return 0 if ok or not args.no_fallback else 1


if __name__ == "__main__":
    sys.exit(main())
