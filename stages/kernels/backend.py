"""The kernel backend of this process: which kernels every QMatrix multiplies with ("ggml",
"dequant", "exact"; stages/kernels/qmatmul.py says what each is), chosen from the stage's options
(StageOptions.backend, "auto" the best this process has; `set_backend` in a one-process run) and
logged once, so a run always says which kernels it used.
"""
from __future__ import annotations

import logging

import torch

from moeray.errors import MoerayError
from moeray.stages.kernels import repack, settings
from moeray.stages.kernels.ggml_lib import load_once, tiled_gemm, tiled_line
from moeray.stages.kernels.threads import ggml_threads

log = logging.getLogger("moeray.kernels")

BACKENDS = ("ggml", "dequant", "exact")

# ggml-python: optional, built from source by `make` (docs/kernels.md#building-ggml); its own
# libggml, checked: a foreign one on LD_LIBRARY_PATH would segfault (_GGML_ERROR says why it is None)
_G, _GGML_ERROR = load_once()


def ggml_available() -> bool:
    return _G is not None


def _checked(backend: str, where: str) -> str:
    if backend not in BACKENDS:
        raise MoerayError(f"{where}={backend!r}: choose one of {', '.join(BACKENDS)}")
    if backend == "ggml" and not ggml_available():
        raise MoerayError(f"{where}=ggml needs ggml-python, which does not load here ({_GGML_ERROR}); "
                          "install it with `make venv` or `pip install '.[ggml]'`")
    return backend


def default_backend() -> str:
    """This process's backend: its options' (settings.current()), "auto" resolved to the best it has."""
    chosen = settings.current().backend
    if chosen == "auto":
        return "ggml" if ggml_available() else "dequant"
    return _checked(chosen, "backend")


_backend: str | None = None  # resolved from the options at first use; forgotten when they change
_announced: set[str] = set()


def current_backend() -> str:
    global _backend
    if _backend is None:
        _backend = default_backend()
    return _backend


def set_backend(backend: str) -> None:
    """Choose the kernels for every QMatrix made after this call in this process."""
    settings.update(backend=_checked(backend, "backend"))



def backend_line(backend: str, device: torch.device) -> str:
    if backend == "ggml":
        n = ggml_threads()
        spin = "; torch's own ops on 1 thread" if n > 1 else ""
        return (f"moeray: kernels: ggml (quantised blocks, 8-bit activations; a GQA or MLA layer's trunk, softmax "
                f"top-k routing and routed experts in one ggml graph where one stack serves its picks, else "
                f"the experts in mul_mat_id graphs after it) on cpu, {n} thread(s){spin}; "
                f"{tiled_line(tiled_gemm(_G), settings.current().sgemm_rows, _G)}; {repack.layout_line()}")
    if backend == "exact":
        return f"moeray: kernels: exact (float32 copies of every weight, debugging) on {device}"
    if _card_kernels(device) is not None:
        return f"moeray: kernels: triton (GGUF blocks read on the card, float32 activations) on {device}"
    why = "" if device.type != "cpu" or ggml_available() else f"; ggml-python unavailable: {_GGML_ERROR}"
    return f"moeray: kernels: dequant (torch dequantise per use) on {device}{why}"


def _card_kernels(device: torch.device):
    """stages/triton_kernels when it serves `device` (imported on first use: a CPU process never
    imports triton), else None."""
    if device.type == "cpu" and settings.current().triton != "on":
        return None
    from moeray.stages.kernels import triton_kernels

    return triton_kernels if triton_kernels.enabled_for(device) else None


def announce(backend: str, device: torch.device) -> None:
    """Log the kernel backend once per process and device kind (and fix ggml's threads: that must
    happen before torch's first op, see set_threads)."""
    if backend == "ggml":
        ggml_threads()
    key = f"{backend}:{device.type}"
    if key not in _announced:
        _announced.add(key)
        log.info(backend_line(backend, device))


def ggml_lib():
    """The ggml binding module (callers check ggml_available() first)."""
    return _G


def _forget() -> None:
    """The options changed: resolve the backend again."""
    global _backend
    _backend = None


settings.on_change(_forget)
