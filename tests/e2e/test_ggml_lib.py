"""A foreign libggml on LD_LIBRARY_PATH (a llama.cpp build directory, say) never crashes moeray:
ggml-python keeps its own libraries, or moeray says in one line which foreign one it was given and
runs without ggml. The foreign build here is a stub compiled in the test whose ggml_init, like an
ABI-incompatible build's, dies with SIGSEGV when called."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ggml")

from moeray.stages.kernels.ggml_lib import foreign_libraries, foreign_line, mapped_libraries  # noqa: E402

STUB = r"""
#include <signal.h>
void *ggml_init(void *params) { (void)params; raise(SIGSEGV); return 0; }
int ggml_cpu_has_avx2(void) { raise(SIGSEGV); return 0; }
"""


@pytest.fixture(scope="module")
def foreign_dir(tmp_path_factory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc) to build the foreign stub libggml")
    d = tmp_path_factory.mktemp("foreign-ggml")
    (d / "stub.c").write_text(STUB)
    for name in ("libggml-base.so", "libggml-cpu.so", "libggml.so"):
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / name), str(d / "stub.c")], check=True)
    return d


def _env(foreign: Path) -> dict:
    env = dict(os.environ, LD_LIBRARY_PATH=f"{foreign}{os.pathsep}{os.environ.get('LD_LIBRARY_PATH', '')}")
    env.pop("MOERAY_BACKEND", None)
    return env


def test_generate_with_a_foreign_libggml_on_the_path_gives_tokens_not_sigsegv(foreign_dir, smollm2_dense_path):
    env = _env(foreign_dir)
    # What the dynamic loader does with this ggml-python build: does the stub get in at all?
    probe = subprocess.run([sys.executable, "-c", "import ggml.ggml; print(open('/proc/self/maps').read())"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert probe.returncode == 0, probe.stderr
    diverted = str(foreign_dir) in probe.stdout
    r = subprocess.run([sys.executable, "-m", "moeray.cluster.cli", "generate", str(smollm2_dense_path),
                        "--prompt", "The capital of France is", "--max-tokens", "3"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])  # 139 was SIGSEGV
    assert "Paris" in r.stdout
    lines = [ln for ln in r.stderr.splitlines() if "another build's" in ln]
    if diverted:  # a RUNPATH build of ggml-python: moeray saw it and said so, once, with the fix
        assert len(lines) == 1 and str(foreign_dir / "libggml-base.so") in lines[0]
        assert "LD_LIBRARY_PATH" in lines[0] and "make venv" in lines[0]
    else:  # an RPATH build (the Makefile's): the stub never got in, ggml ran
        assert lines == []


def test_the_check_names_exactly_the_libraries_outside_ggml_pythons_folder(tmp_path):
    own = tmp_path / "ggml" / "lib"
    own.mkdir(parents=True)
    maps = tmp_path / "maps"
    maps.write_text(
        f"7f00-7f01 r-xp 00000000 08:01 1 {own}/libggml-base.so\n"
        f"7f01-7f02 r-xp 00000000 08:01 2 {own}/libggml.so\n"
        "7f02-7f03 r-xp 00000000 08:01 3 /opt/llama.cpp/build/bin/libggml-cpu.so.0.25.3\n"
        "7f03-7f04 r-xp 00000000 08:01 4 /usr/lib/libggmlish-other.so\n"
        "7f04-7f05 rw-p 00000000 00:00 0 \n"
        "7f05-7f06 r-xp 00000000 08:01 5 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    mapped = mapped_libraries(str(maps))
    assert mapped == {f"{own}/libggml-base.so", f"{own}/libggml.so", "/opt/llama.cpp/build/bin/libggml-cpu.so.0.25.3"}
    foreign = foreign_libraries(own, mapped)
    assert foreign == ["/opt/llama.cpp/build/bin/libggml-cpu.so.0.25.3"]
    line = foreign_line(foreign, own, "/opt/llama.cpp/build/bin:/usr/local/cuda/lib64")
    assert "\n" not in line and "found through LD_LIBRARY_PATH" in line and "/opt/llama.cpp/build/bin off" in line
    assert foreign_libraries(own, {f"{own}/libggml.so"}) == []
