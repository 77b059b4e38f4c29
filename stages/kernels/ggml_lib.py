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

import os
import re
import sys
from pathlib import Path

from moeray import environment
from moeray.errors import MoerayError

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


def tiled_gemm(G=None, environ: dict | None = None) -> str:
    """"on": this process's libggml-cpu has the tiled GEMM and will take it (8+ rows of a K/IQ-quant
    matrix, or routed to one expert); "off": it has it, GGML_CPU_TILED_MM=0 turns it off (ggml reads
    the variable once, at its first matmul); "absent": a ggml-python built without it (or none)."""
    if G is None:
        G = load_once()[0]
    if G is None or not hasattr(G.lib, TILED_SYMBOL):  # G.lib looks names up in ggml-python's libggml*
        return TILED_ABSENT
    value = environment.ggml_tiled_switch() if environ is None else environ.get("GGML_CPU_TILED_MM")
    try:  # ggml's own test: atoi(value) != 0
        on = value is None or int(re.match(r"\s*[-+]?\d*", value).group().strip() or 0) != 0
    except ValueError:
        on = False
    return TILED_ON if on else TILED_OFF


def tiled_line(state: str) -> str:
    """The backend line's words for tiled_gemm()'s state."""
    return {TILED_ON: "tiled K/IQ-quant GEMM at 8+ rows (GGML_CPU_TILED_MM=0: off)",
            TILED_OFF: "tiled K/IQ-quant GEMM off (GGML_CPU_TILED_MM=0)",
            TILED_ABSENT: "no tiled K/IQ-quant GEMM in this ggml-python: K/IQ-quant prefill is slower "
                          "(`make venv` builds it, docs/kernels.md#tiled-gemm)"}[state]
