"""Import ggml-python and make sure its kernels are the libggml it was built with.

ggml-python opens its own `lib/libggml*.so` by absolute path, but those libraries name each other
by bare file name (NEEDED libggml-base.so, libggml-cpu.so) and carry a RUNPATH of $ORIGIN, which
the dynamic loader reads only AFTER LD_LIBRARY_PATH. A llama.cpp build directory on
LD_LIBRARY_PATH therefore slips its own libggml-base.so / libggml-cpu.so in underneath, ctypes
then binds some functions to the foreign build, and the first graph dies with SIGSEGV.

The Makefile links ggml-python with DT_RPATH (-Wl,--disable-new-dtags), searched BEFORE
LD_LIBRARY_PATH, so a build made by `make` cannot be diverted. A ggml-python built any other way
may still be: after the import every libggml mapped into the process is checked against
ggml-python's own folder, and a foreign one makes `load()` raise ForeignGgmlError (one line naming
the library and the fix). The caller then runs without ggml: nothing ever calls into the mix.
"""
from __future__ import annotations

import ctypes
import os
import re
import sys
from pathlib import Path

from moeray import environment
from moeray.errors import MoerayError
from moeray.stages.kernels import settings

_LIB = re.compile(r"(^|/)libggml(-[\w-]+)?\.so(\.[\d.]+)?$")  # libggml.so, libggml-cpu.so.0.25.3


class ForeignGgmlError(MoerayError):
    """A libggml other than ggml-python's own was loaded into this process."""


def mapped_libraries(maps: str = "/proc/self/maps") -> set[str]:
    """Paths of the libggml* shared objects mapped into this process (Linux; empty elsewhere)."""
    try:
        with open(maps) as f:
            return {p for line in f if (p := line.split(maxsplit=5)[-1].strip()) and _LIB.search(p)}
    except OSError:
        return set()


def foreign_libraries(own_dir: Path, mapped: set[str]) -> list[str]:
    own = os.path.realpath(own_dir)
    return sorted(p for p in mapped if os.path.dirname(os.path.realpath(p)) != own)


def foreign_line(foreign: list[str], own_dir: Path, ld_library_path: str) -> str:
    dirs = sorted({os.path.dirname(p) for p in foreign})
    via = " (found through LD_LIBRARY_PATH)" if any(d in ld_library_path.split(os.pathsep) for d in dirs) else ""
    return (f"ggml-python ({own_dir}) was given another build's {', '.join(foreign)}{via}, which would crash its "
            f"kernels; running without ggml (the slower dequant backend). Fix: take {', '.join(dirs)} off "
            "LD_LIBRARY_PATH for moeray, or rebuild ggml-python with `make venv` (it links by RPATH)")


def load():
    """ggml-python's `ggml.ggml` module, its libraries checked; ForeignGgmlError if they are mixed."""
    from ggml import ggml as G

    own_dir = Path(G.__file__).resolve().parent / "lib"
    foreign = foreign_libraries(own_dir, mapped_libraries())
    if foreign:
        line = foreign_line(foreign, own_dir, environment.library_path())
        print(f"moeray: {line}", file=sys.stderr, flush=True)
        raise ForeignGgmlError(line)
    return G


_loaded: tuple | None = None


def load_once() -> tuple:
    """(ggml-python's module, None) for this process, loaded and checked on the first call; (None,
    why) where it does not load (ImportError, an OSError from a library that does not load, a
    foreign libggml)."""
    global _loaded
    if _loaded is None:
        try:
            _loaded = (load(), None)
        except Exception as exc:
            _loaded = (None, f"{type(exc).__name__}: {exc}")
    return _loaded


# llama.cpp's tiled K/IQ-quant GEMM (stages/kernels/ggml_build.py puts it into the ggml that `make
# venv` builds; ggml-python's PyPI sdist lacks it): one of these, for the backend line and a stage's options.
TILED_ON, TILED_OFF, TILED_ABSENT = "on", "off", "absent"
TILED_SYMBOL = "ggml_compute_forward_mul_mat_tiled"


def tiled_gemm(G=None, environ: dict | None = None, enabled: bool | None = None) -> str:
    """"on": this process's libggml-cpu has the tiled GEMM and will take it (8+ rows of a K/IQ-quant
    matrix, or routed to one expert); "off": it has it, but the stage's options (`enabled`, default
    StageOptions.tiled_gemm) or GGML_CPU_TILED_MM=0 (ggml's own switch, read at its first matmul)
    turn it off; "absent": a ggml-python built without it (or none)."""
    if G is None:
        G = load_once()[0]
    if G is None or not hasattr(G.lib, TILED_SYMBOL):  # G.lib looks names up in ggml-python's libggml*
        return TILED_ABSENT
    if enabled is None:
        enabled = settings.current().tiled_gemm
    value = environment.ggml_tiled_switch() if environ is None else environ.get("GGML_CPU_TILED_MM")
    try:  # ggml's own test: atoi(value) != 0
        on = value is None or int(re.match(r"\s*[-+]?\d*", value).group().strip() or 0) != 0
    except ValueError:
        on = False
    return TILED_ON if on and enabled else TILED_OFF


# The run-time switches ggml_build.py adds to ggml-cpu.c: which GEMM a matmul may take.
SWITCH_SYMBOL = "moeray_ggml_set_gemm_paths"
_applied: tuple | None = None  # (tiled on, sgemm rows) last given to this process's ggml


def set_gemm_paths(options, G=None) -> bool:
    """Give this process's ggml the options' tiled_gemm and sgemm_rows (called before a graph is
    planned, so never during a graph: every thread of one takes the same path). False where the
    ggml-python was not built by ggml_build.py (no switches: tiled as GGML_CPU_TILED_MM says,
    llamafile's sgemm as it was built)."""
    global _applied
    if G is None:
        G = load_once()[0]
    if G is None or not hasattr(G.lib, SWITCH_SYMBOL):
        return False
    want = (bool(options.tiled_gemm), int(options.sgemm_rows))
    if want != _applied:
        fn = getattr(G.lib, SWITCH_SYMBOL)
        fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int64], None
        fn(*want)
        _applied = want
    return True


# The switch ggml_build.py adds to ops.cpp: the fewest query rows that take the tiled flash attention.
FA_ROWS_SYMBOL = "moeray_ggml_set_fa_tiled_rows"
_fa_rows_applied: int | None = None  # the count last given to this process's ggml


def set_fa_tiled_rows(options, G=None) -> bool:
    """Give this process's ggml the options' fa_tiled_rows (called where set_gemm_paths is: before a
    graph is planned and when the options change, never during a graph). False where the ggml-python
    was not built by ggml_build.py: its tiled flash attention runs from ggml's 64 rows whatever the
    options say (trunk_graph.float_read_rows then says 64 too)."""
    global _fa_rows_applied
    if G is None:
        G = load_once()[0]
    if G is None or not hasattr(G.lib, FA_ROWS_SYMBOL):
        return False
    want = int(options.fa_tiled_rows)
    if want != _fa_rows_applied:
        fn = getattr(G.lib, FA_ROWS_SYMBOL)
        fn.argtypes, fn.restype = [ctypes.c_int64], None
        fn(want)
        _fa_rows_applied = want
    return True


def fa_rows_settable(G=None) -> bool:
    """Whether this process's ggml takes StageOptions.fa_tiled_rows (a `make venv` build)."""
    if G is None:
        G = load_once()[0]
    return G is not None and hasattr(G.lib, FA_ROWS_SYMBOL)


def _apply_changed_options() -> None:
    """New options: given to ggml at once, not only when the next graph is planned (one that is cached
    would otherwise run with the old paths). After a reset, the next graph's plan reads them."""
    opts = settings.snapshot()
    if opts is not None and _loaded is not None and _loaded[0] is not None:
        set_gemm_paths(opts, _loaded[0])
        set_fa_tiled_rows(opts, _loaded[0])


settings.on_change(_apply_changed_options)


def sgemm_products(G=None) -> int | None:
    """How many matmuls llamafile's sgemm has computed in this process (None: no switch built in)."""
    if G is None:
        G = load_once()[0]
    if G is None or not hasattr(G.lib, "moeray_ggml_sgemm_products"):
        return None
    fn = G.lib.moeray_ggml_sgemm_products
    fn.argtypes, fn.restype = [], ctypes.c_int64
    return int(fn())


def sgemm_built(G=None) -> bool:
    """Whether this process's libggml-cpu has llamafile's sgemm in it (-DGGML_LLAMAFILE=ON)."""
    if G is None:
        G = load_once()[0]
    return G is not None and hasattr(G.lib, "ggml_cpu_has_llamafile") and bool(G.lib.ggml_cpu_has_llamafile())


def tiled_line(state: str, sgemm_rows: int | None = None, G=None) -> str:
    """The backend line's words for tiled_gemm()'s state and where llamafile's sgemm runs."""
    tiled = {TILED_ON: "tiled K/IQ-quant GEMM at 8+ rows",
             TILED_OFF: "tiled K/IQ-quant GEMM off",
             TILED_ABSENT: "no tiled K/IQ-quant GEMM in this ggml-python: K/IQ-quant prefill is slower "
                           "(`make venv` builds it, docs/kernels.md#tiled-gemm)"}[state]
    if sgemm_rows is None:
        return tiled
    G = load_once()[0] if G is None else G
    if not sgemm_built(G):
        sgemm = "no llamafile sgemm in this build"
    elif not hasattr(G.lib, SWITCH_SYMBOL):
        sgemm = "llamafile sgemm at every width (a ggml-python not built by `make venv`)"
    else:
        sgemm = f"llamafile sgemm for Q8_0/Q4_0/Q5_0 at {sgemm_rows}+ rows" if sgemm_rows else "llamafile sgemm off"
    return f"{tiled}; {sgemm}"
