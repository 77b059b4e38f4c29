"""Weights in ggml's repacked layout (CPU_REPACK, what llama.cpp loads its weights into by default).

ggml-cpu can hold a weight's blocks with 8 rows interleaved block by block (Q4_0, Q4_K, IQ4_NL,
MXFP4 on AVX2; more types on ARM and AVX-512 builds) and then multiplies them with its faster
GEMV/GEMM kernels, for mul_mat and mul_mat_id alike (measured on a 4096 x 2048 Q4_K matrix, 2
threads: 1.4x at one row, 1.7x at 64). The repacked bytes are exactly as many as the plain ones,
and whole groups of 8 rows stay together, so a matrix whose rows split into groups of 8 (an
expert in a stack, q/k/v concatenated) is repacked piece by piece.

ggml learns that a tensor is repacked from two fields: `buffer` (a buffer of the CPU_REPACK type:
its kernels are chosen by the buffer type) and `extra` (the kernel family for the block type,
which ggml picks from type and shape). Both must be set before `ggml_graph_plan`. The bytes
themselves may lie anywhere: here they live in torch storage (a QMatrix's `data`, a slot row),
and one small CPU_REPACK buffer serves as the handle every repacked tensor points at. Repacking
goes through ggml's own `set_tensor` of that buffer type, onto any destination address.

Batch invariance. ggml's repacked matmul runs a GEMM over each 4 rows of activations and a GEMV
over the rest. For Q4_K the two round differently (~1e-7 relative), so a row's result would depend
on how many rows share its call; for Q4_0, IQ4_NL and MXFP4 they agree bit for bit. mul_mat_id
(experts) runs the GEMV per row always. The setting (StageOptions.repack, stages/kernels/settings.py):
- "fast" (default): repack wherever ggml has kernels and let ggml take its GEMM for every 4 rows,
  as llama.cpp does: a Q4_K row's result then differs by ~1e-7 relative between batch sizes;
- "on": the batch-invariant choice: a matrix of a type whose GEMM differs sees its activations as
  one-row planes (`rows_alone`: ggml then runs the GEMV for each row), so every row gets the same
  bits at every batch size, as with the plain layout. It costs ~1.5x on those projections at 16
  rows (the GEMV reads the weights once per row); padding rows to the GEMM's 4 instead would keep
  invariance at 3.4x the GEMV's time for one row (measured on a 4096 x 2048 Q4_K matrix, 2 threads),
  which batch-1 decode cannot afford;
- "off": ggml's plain layout everywhere.
"""
from __future__ import annotations

import ctypes
import threading

from gguf import GGMLQuantizationType as T

from moeray import environment
from moeray.errors import MoerayError
from moeray.stages.kernels import settings
from moeray.stages.kernels.settings import HOST_EXPERTS, REPACK_MODES as MODES

# Types whose repacked GEMM and GEMV give a row the same bits (tested: tests/stages/test_repack.py); a
# trunk matrix of another type would make a row's result depend on how many rows share its call.
BATCH_INVARIANT = frozenset((T.Q4_0, T.IQ4_NL, T.MXFP4))

_lock = threading.Lock()
_handle = None  # the CPU_REPACK buffer every repacked tensor names; None: not looked up yet
_unavailable = ""  # why repacking is off in this process ("" when it is available)
_traits: dict[tuple, int] = {}


def mode() -> str:
    """The layout setting of this process (StageOptions.repack)."""
    return settings.current().repack


def set_mode(m: str | None) -> None:
    """The layout of matrices made after this call (None: the default, or this process's
    debugging override MOERAY_REPACK: moeray/environment.py)."""
    if m is None:
        m = environment.fold(settings.StageOptions(), "stage")[0].repack
    settings.update(repack=m)


# Left free when copying host experts: what the rest of the process and the system still need
# (an explicit "repacked" is held to the first, "auto" copies only when the second stays free).
HEADROOM_BYTES = 1 << 30
AUTO_HEADROOM_BYTES = 4 << 30


def host_experts() -> str:
    """StageOptions.host_experts: "auto" (default: copied at load when that leaves AUTO_HEADROOM_BYTES
    of memory available, else read in place), "mapped" (routed experts read in place from the GGUF
    mapping, no copy) or "repacked" (always copied, as llama.cpp does). The copy lies in huge pages
    (stages/kernels/host_memory.py), each kind in ggml's repacked layout where ggml has kernels for it
    (stages/kernels/repack.py), as the file's blocks otherwise."""
    return settings.current().host_experts


def fits(n_bytes: int, headroom: int, available: int | None = None) -> bool:
    available = mem_available() if available is None else available
    return available is None or n_bytes + headroom <= available


def auto_line(n_bytes: int, what: str, packed: bool) -> str:
    gib = n_bytes / (1 << 30)
    if packed:
        return f"moeray: host experts of {what}: a copy in huge pages, repacked where ggml can, {gib:.1f} GiB (host_experts auto)"
    return (f"moeray: host experts of {what}: read in place from the mapping; a copy ({gib:.1f} GiB) "
            f"would leave under {AUTO_HEADROOM_BYTES >> 30} GiB available (host_experts auto)")


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable in bytes (the page cache of the mapping counts: it is reclaimable), or None."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(n_bytes: int, what: str, available: int | None = None) -> None:
    """Raise a one-line MoerayError when copying `n_bytes` of host experts would not leave
    HEADROOM_BYTES of the memory available."""
    if n_bytes <= 0:
        return
    available = mem_available() if available is None else available
    if not fits(n_bytes, HEADROOM_BYTES, available):
        gib = 1 << 30
        raise MoerayError(f"host_experts repacked: the routed experts of {what} take {n_bytes / gib:.1f} GiB "
                          f"as a copy, {available / gib:.1f} GiB of memory is available (1 GiB is kept free); "
                          "use host_experts mapped (--host-experts mapped, or MOERAY_HOST_EXPERTS=mapped: read in "
                          "place from the file mapping) or free memory")


def layout_line() -> str:
    """The layout part of the backend line at start-up."""
    m = mode()
    if m == "off":
        return "weights in ggml's plain layout (repack off)"
    if handle() is None:
        return f"weights in ggml's plain layout ({_unavailable})"
    rows = ("rows batch-invariant" if m == "on"
            else "Q4_K rows vary ~1e-7 with the batch; MOERAY_REPACK=on keeps them batch-invariant")
    return (f"weights repacked where ggml has kernels (repack {m}: {rows}); "
            f"host experts {host_experts()}")


def _G():
    """ggml-python's module: qmatmul has loaded and checked it (stages/kernels/ggml_lib.py) before any
    weight reaches this file; imported by name so that the two modules do not import each other."""
    from ggml import ggml as G

    return G


_LOG_DEBUG, _LOG_CONT = 1, 5


def _quiet_debug_log(G) -> None:
    """ggml's repack logs one DEBUG line per tensor it repacks (thousands: every slot fill) and its
    default logger prints every level: drop DEBUG, print the rest to stderr as before."""
    import sys

    last = [0]

    def log(level, text, _user):
        if level != _LOG_CONT:
            last[0] = level
        if last[0] != _LOG_DEBUG and text:
            sys.stderr.write(text.decode(errors="replace"))

    cb = G.ggml_log_callback(log)
    _quiet_debug_log.keep = cb  # ggml holds the pointer: keep the Python object alive
    G.ggml_log_set(cb, None)


def handle():
    """The CPU_REPACK buffer, or None when this ggml has none (then every weight stays plain)."""
    global _handle, _unavailable
    with _lock:
        if _handle is None and not _unavailable:
            G = _G()
            fp = G.ggml_backend_reg_get_proc_address(G.ggml_backend_cpu_reg(), b"ggml_backend_dev_get_extra_bufts")
            bufts = []
            if fp:
                get = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fp)
                arr = get(G.ggml_backend_dev_by_type(G.GGML_BACKEND_DEVICE_TYPE_CPU))
                i = 0
                while arr and arr[i]:
                    bufts.append(arr[i])
                    i += 1
            buft = next((b for b in bufts if G.ggml_backend_buft_name(ctypes.c_void_p(b)) == b"CPU_REPACK"), None)
            if buft is None:
                _unavailable = "this ggml build has no CPU_REPACK buffer type"
            else:
                _quiet_debug_log(G)
                # A handle only: no tensor's bytes live in it (64 bytes: ggml allocates nothing for 0).
                _handle = G.ggml_backend_buft_alloc_buffer(ctypes.c_void_p(buft), 64)
        return _handle


def traits(ggml_type: T, rows: int, cols: int) -> int | None:
    """ggml's repacked kernels for a [rows, cols] matrix of `ggml_type` (its `extra`), or None
    where it has none for this type, shape or CPU."""
    key = (int(ggml_type), rows % 16, cols % 8)  # what ggml's choice and its repack check read
    if key in _traits:
        return _traits[key] or None
    h = handle()
    extra = 0
    if h is not None and cols % 8 == 0 and rows > 0:  # the repack functions also need columns % 8
        G = _G()
        ctx = G.ggml_init(G.ggml_init_params(mem_size=G.ggml_tensor_overhead() + 256, mem_buffer=None, no_alloc=True))
        try:
            t = G.ggml_new_tensor_2d(ctx, int(ggml_type), cols, rows)
            G.ggml_backend_buffer_init_tensor(h, t)
            extra = t.contents.extra or 0
        finally:
            G.ggml_free(ctx)
    _traits[key] = extra
    return extra or None


def wanted(ggml_type: T, rows: int, cols: int) -> bool:
    """Whether the setting repacks such a matrix (ggml has kernels for its type and shape)."""
    return mode() != "off" and traits(ggml_type, rows, cols) is not None


def rows_alone(ggml_type: T) -> bool:
    """Whether a repacked matrix of this type must multiply each activation row on its own (by the
    GEMV) to give the same bits at every batch size."""
    return mode() == "on" and T(ggml_type) not in BATCH_INVARIANT


def repack_into(dst: int, src: int, ggml_type: T, rows: int, cols: int, nbytes: int) -> None:
    """Write the repacked form of the plain [rows, cols] blocks at address `src` (nbytes) to `dst`
    (nbytes too). The caller checked traits() first: ggml aborts the process on a shape it cannot repack."""
    extra = traits(ggml_type, rows, cols)
    if extra is None:
        raise ValueError(f"ggml has no repacked kernels for {T(ggml_type).name} [{rows}, {cols}]")
    G = _G()
    ctx = G.ggml_init(G.ggml_init_params(mem_size=G.ggml_tensor_overhead() + 256, mem_buffer=None, no_alloc=True))
    try:
        t = G.ggml_new_tensor_2d(ctx, int(ggml_type), cols, rows)
        if G.ggml_nbytes(t) != nbytes:
            raise ValueError(f"{T(ggml_type).name} [{rows}, {cols}] is {G.ggml_nbytes(t)} bytes, got {nbytes}")
        t.contents.data, t.contents.buffer, t.contents.extra = dst, handle(), extra
        G.ggml_backend_tensor_set(t, ctypes.c_void_p(src), 0, nbytes)
    finally:
        G.ggml_free(ctx)


def mark(t, ggml_type: T, rows: int, cols: int) -> None:
    """Make graph tensor `t` read its bytes as repacked (before the graph is planned)."""
    t.contents.buffer = handle()
    t.contents.extra = traits(ggml_type, rows, cols)
