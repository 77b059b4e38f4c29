"""Quantised matrices: a weight W [N, K] kept in its GGUF block form, multiplied without ever
expanding it to float32 for good.

A `QMatrix` holds the stored bytes (a view of the file mapping for host experts, an owned copy for
trunk weights and cache slots) and computes y = x @ W.T by one of three backends:

- "ggml": ggml's CPU kernels (the ones llama.cpp runs) straight on the blocks, through the
  `ggml-python` binding. Activations are quantised to 8 bits inside, as llama.cpp does, so results
  differ from float32 by ~5e-3 relative. Fastest on CPU for every block type we meet (docs/kernels.md).
- "dequant": dequantise the blocks on each use (stages/gguf/quant.py) and run F.linear. The pure-torch
  fallback when ggml is not installed. On CUDA devices the blocks are read on the card by the
  Triton kernels of stages/kernels/triton_kernels.py instead, when triton imports (StageOptions.triton).
- "exact": dequantised to float32 once at load (4 bytes a weight). For debugging and for parity
  tests against float references (`--exact`); never the serving default.

The backend is one of the stage's options (stages/kernels/settings.py: StageOptions.backend, "auto" the
best this process has; `set_backend` in a one-process run) and logged once, so a run always says
which kernels it used.
"""
from __future__ import annotations

import ctypes
import logging
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from moeray.errors import MoerayError
from moeray.stages.kernels import repack, settings
from moeray.stages.kernels.host_memory import weight_buffer
from moeray.stages.gguf.quant import as_uint8_tensor, dequantize

log = logging.getLogger("moeray.kernels")

BACKENDS = ("ggml", "dequant", "exact")
# Types kept as plain float tensors whatever the backend: they are tiny (norms, routers, biases) or
# already a float format a torch matmul reads directly.
FLOAT_TYPES = frozenset((T.F32, T.F64))

try:  # ggml-python: optional, built from source by `make` (docs/kernels.md#building-ggml)
    from moeray.stages.kernels.ggml_lib import load as _load_ggml

    _G = _load_ggml()  # its own libggml, checked: a foreign one on LD_LIBRARY_PATH would segfault
    _GGML_ERROR = None
except Exception as exc:  # ImportError, an OSError from a library that does not load, a foreign libggml
    _G = None
    _GGML_ERROR = f"{type(exc).__name__}: {exc}"


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
                f"{repack.layout_line()}")
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


# --- ggml ------------------------------------------------------------------------------------------

_pool_lock = threading.Lock()
_pools: dict[tuple, object] = {}  # (threads, poll) -> ggml thread pool pointer, one per setting used
_threads: int | None = None  # ggml's threads in this process: the options', else torch's count at first use


@dataclass
class ThreadSettings:
    """How ggml's threads are used (docs/kernels.md#threads; the measurements behind each: docs/performance.md#served).

    poll: how long ggml's workers spin for the next graph before they sleep (ggml's poll level:
      0 sleeps at once; each level is ~131k pause rounds, ~1-5 ms here: level 1 bridges the torch
      ops between a step's graphs but not the wait between steps; 100 spins for a good part of a
      second).
    parallel_bytes: a graph that reads fewer weight bytes starts on one thread (0: every graph
      uses all threads): waking a worker and meeting it at every barrier costs more than it saves
      on a graph of a few hundred microseconds.
    adapt: each graph learns from its own calls whether one thread or all of them compute it
      faster, and keeps trying the other now and then: big graphs split on a quiet machine, and
      stop splitting on a loaded one (a helper thread preempted mid-graph stalls every barrier).
    """
    poll: int = 100
    parallel_bytes: int = 0
    adapt: bool = False

    @classmethod
    def of(cls, opts: "settings.StageOptions", d: "ThreadSettings | None" = None) -> "ThreadSettings":
        """The stage options' ggml_poll, ggml_parallel_kb and ggml_adapt, each over `d`'s value where unset."""
        d = d or cls()
        return cls(d.poll if opts.ggml_poll is None else opts.ggml_poll,
                   d.parallel_bytes if opts.ggml_parallel_kb is None else opts.ggml_parallel_kb << 10,
                   d.adapt if opts.ggml_adapt is None else opts.ggml_adapt)

    def options(self) -> dict:
        """These settings as StageOptions fields."""
        return dict(ggml_poll=self.poll, ggml_parallel_kb=self.parallel_bytes >> 10, ggml_adapt=self.adapt)


def ggml_threads() -> int:
    """ggml's threads in this process: the options' `threads`, else torch's count at first use."""
    want = settings.current().threads
    if _threads is None or (want and want != _threads):
        _use_threads(want or torch.get_num_threads())
    return _threads


def _use_threads(n: int) -> None:
    global _threads
    _threads = max(1, int(n))
    if _threads > 1:
        torch.set_num_threads(1)
    _graphs.clear()


def _forget() -> None:
    """The options changed: resolve the backend again, build graphs with the new settings."""
    global _backend
    _backend = None
    _graphs.clear()


settings.on_change(_forget)


def set_threads(n: int, threads: ThreadSettings | None = None) -> None:
    """Give ggml `n` threads, used as `threads` say (default: as the options say): this process's
    options' `threads` (and ggml_* fields) from now on.

    A decode token makes ~120 small graph calls (40-200 us each), so with more than one thread
    ggml's workers spin between graphs (measured: 34 ms/token against 54 ms when they sleep, 2
    cores). torch's own ops (norms, RoPE, attention: small at decode) then run on one thread: a
    second torch thread would fight the spinning worker for the cores (268 ms/token measured).
    """
    settings.update(threads=max(1, int(n)), **(threads.options() if threads is not None else {}))
    _use_threads(n)


def thread_settings() -> ThreadSettings:
    return ThreadSettings.of(settings.current())


def _threadpool(n: int):
    """The process's ggml thread pool of `n` threads: spinning `poll` for the next graph when it
    has helpers to keep warm, none to wake with one thread."""
    poll = thread_settings().poll if n > 1 else 0
    with _pool_lock:
        pool = _pools.get((n, poll))
        if pool is None:
            params = _G.ggml_threadpool_params_default(n)
            params.poll = poll
            pool = _pools[(n, poll)] = _G.ggml_threadpool_new(ctypes.byref(params))
        return pool


def _weight_bytes(graph) -> int:
    """Bytes of weights one call of `graph` reads: every matmul's first operand, and of a
    mul_mat_id's expert stack only the rows of the experts its ids can name."""
    total = 0
    for i in range(_G.ggml_graph_n_nodes(graph)):
        t = _G.ggml_graph_node(graph, i).contents
        if t.op == _G.GGML_OP_MUL_MAT:
            total += _G.ggml_nbytes(t.src[0])
        elif t.op == _G.GGML_OP_MUL_MAT_ID:
            w, ids = t.src[0], t.src[2].contents
            n_experts = max(1, w.contents.ne[2])
            total += _G.ggml_nbytes(w) * min(n_experts, ids.ne[0] * ids.ne[1]) // n_experts
    return total


class ThreadChoice:
    """One thread or all of them for one graph, chosen by the mean time of its own recent calls
    with each (an exponential average), the other tried every `explore` calls so a change of load
    is seen. The first call of each is not counted: it pays for cold caches and page faults."""

    def __init__(self, first: int, explore: int = 32, weight: float = 0.25):
        self.current, self.explore, self.weight = first, explore, weight
        self.cost: list[float | None] = [None, None]  # seconds per call: [one thread, all]
        self.seen = [0, 0]
        self.calls = 0

    def pick(self) -> int:
        """0: one thread, 1: all of them. The other is tried less often the worse it was (every
        `explore` x its cost ratio calls), so trying costs at most ~1/explore of the time."""
        self.calls += 1
        other = 1 - self.current
        if self.cost[other] is None:
            return other if self.seen[self.current] >= 2 else self.current
        every = self.explore * max(1, round(self.cost[other] / max(self.cost[self.current], 1e-9)))
        return other if self.calls % every == 0 else self.current

    def record(self, i: int, seconds: float) -> None:
        self.seen[i] += 1
        if self.seen[i] == 1:
            return
        c = self.cost[i]
        self.cost[i] = seconds if c is None else c + self.weight * (seconds - c)
        if None not in self.cost:
            self.current = 0 if self.cost[0] <= self.cost[1] else 1


def place_scratch(tensors, nodes=None) -> torch.Tensor:
    """Fixed places for a graph's intermediate results, 64-byte aligned, in one buffer (returned:
    the graph keeps it alive). With `nodes` (the graph's nodes in run order) a place is reused once
    every node that reads the result (directly or through a view of it) has run, as ggml's own
    allocator does: ggml computes the nodes one after the other, so a stage graph of 30 layers
    needs about one layer's intermediates, not 30 (the default model's 16-token step: 0.7 MiB, not
    34; CPU time per token measured unchanged, so this is memory, and stage graphs for steps that
    did not fit before)."""
    sizes = [(_G.ggml_nbytes(t) + 63) // 64 * 64 for t in tensors]
    if nodes is None or not settings.current().scratch_reuse:  # off: every intermediate its own place
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += n
    else:
        offsets, total = _reused_offsets(tensors, sizes, nodes)
    buf = torch.empty(total + 64, dtype=torch.uint8)
    base = (buf.data_ptr() + 63) // 64 * 64
    for t, off in zip(tensors, offsets):
        t.contents.data = base + off
    return buf


def _reused_offsets(tensors, sizes, nodes) -> tuple[list[int], int]:
    """Offsets for `tensors` (intermediates, each a node) such that two share bytes only when one's
    last reader, and the node after it, run before the other is computed: first fit in a free
    list, walking the nodes in run order. Returns (offsets, bytes)."""
    key = ctypes.addressof
    index = {key(t.contents): i for i, t in enumerate(tensors)}
    free_after: dict[int, int] = {}  # tensor -> the node after which its bytes may be reused
    for step, node in enumerate(nodes):
        free_after.setdefault(index.get(key(node.contents)), step)  # read by nobody: free after itself
        for src in node.contents.src:
            j = index.get(key((src.contents.view_src or src).contents)) if src else None  # a view's root
            if j is not None:
                # read until the NEXT node too: ggml-cpu fuses RMS_NORM + MUL (ggml_cpu_try_fuse_ops),
                # and the fused MUL then reads the norm's source while it writes its own result
                free_after[j] = step + 1
    ending: dict[int, list[int]] = {}
    for i, step in free_after.items():
        if i is not None:
            ending.setdefault(step, []).append(i)
    offsets: list[int | None] = [None] * len(tensors)
    free: list[list[int]] = []  # [offset, size] holes, sorted by offset, coalesced
    top = 0
    for step, node in enumerate(nodes):
        i = index.get(key(node.contents))
        if i is not None:
            hole = next((f for f in free if f[1] >= sizes[i]), None)
            if hole is None:
                offsets[i], top = top, top + sizes[i]
            else:
                offsets[i] = hole[0]
                hole[0] += sizes[i]
                hole[1] -= sizes[i]
        for j in ending.get(step, ()):
            free.append([offsets[j], sizes[j]])
        free.sort()
        merged: list[list[int]] = []
        for f in free:
            if merged and merged[-1][0] + merged[-1][1] == f[0]:
                merged[-1][1] += f[1]
            elif f[1]:
                merged.append(f)
        free = merged
    for i, off in enumerate(offsets):
        if off is None:  # not a node of the graph (never computed): a place of its own
            offsets[i], top = top, top + sizes[i]
    return offsets, top


class GraphPlans:
    """ggml's plan(s) for one graph as the thread settings say: one plan (one thread, or all of
    them for a graph that reads at least `parallel_bytes` of weights), or with `adapt` a plan for
    each and a ThreadChoice between them. Every graph class computes through this."""

    def __init__(self, graph):
        n, how = ggml_threads(), thread_settings()
        split = n > 1 and _weight_bytes(graph) >= how.parallel_bytes
        counts = (1, n) if n > 1 and how.adapt else (n if split else 1,)
        self.plans = [_G.ggml_graph_plan(graph, c, _threadpool(c)) for c in counts]
        # One work buffer for every plan (they never run at once): the largest any of them needs.
        self.work = torch.empty(max(1, *(p.work_size for p in self.plans)), dtype=torch.uint8)
        for p in self.plans:
            p.work_data = ctypes.cast(self.work.data_ptr(), ctypes.POINTER(ctypes.c_uint8))
        self.n_threads = self.plans[-1 if split else 0].n_threads  # the first choice
        self.choice = ThreadChoice(1 if split else 0) if len(self.plans) > 1 else None
        self._refs = [ctypes.byref(p) for p in self.plans]

    def compute(self, graph) -> None:
        if self.choice is None:
            _G.ggml_graph_compute(graph, self._refs[0])
            return
        i = self.choice.pick()
        t0 = time.perf_counter()
        _G.ggml_graph_compute(graph, self._refs[i])
        self.choice.record(i, time.perf_counter() - t0)


class _Graph:
    """One ggml compute graph over tensors that own no memory: weights, input and output point at
    torch storage that is re-assigned on every call, so one graph serves every expert of a shape."""

    def __init__(self, build, n_nodes: int = 64):
        size = _G.ggml_tensor_overhead() * n_nodes + _G.ggml_graph_overhead() + 4096
        self.ctx = _G.ggml_init(_G.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=True))
        self.inputs, self.output, scratch = build(self.ctx)
        self.graph = _G.ggml_new_graph(self.ctx)
        _G.ggml_build_forward_expand(self.graph, self.output)
        views = []
        if scratch is None:  # every intermediate node of the graph; views share their source's bytes
            out = ctypes.addressof(self.output.contents)
            nodes = [_G.ggml_graph_node(self.graph, i) for i in range(_G.ggml_graph_n_nodes(self.graph))]
            scratch = [t for t in nodes if ctypes.addressof(t.contents) != out and not t.contents.view_src]
            views = [t for t in nodes if t.contents.view_src]
        self.scratch = place_scratch(scratch)
        placed = {ctypes.addressof(t.contents) for t in scratch}
        for t in views:  # in graph order, so a view of a view finds its source placed
            src = t.contents.view_src.contents
            if ctypes.addressof(src) not in placed:
                raise ValueError("a graph view must look into an intermediate result, not an input")
            t.contents.data = src.data + t.contents.view_offs
            placed.add(ctypes.addressof(t.contents))
        self.plans = GraphPlans(self.graph)
        self.n_threads = self.plans.n_threads
        # The structs themselves, resolved once: a call then only writes pointers (decode makes
        # ~100 calls per token, so Python-side cost matters).
        self._in = [t.contents for t in self.inputs]
        self._out = self.output.contents
        self._compute = self.plans.compute

    def __call__(self, pointers: list[int], out_ptr: int) -> None:
        for t, p in zip(self._in, pointers):
            t.data = p
        self._out.data = out_ptr
        self._compute(self.graph)

    def __del__(self):
        if _G is not None and getattr(self, "ctx", None):
            _G.ggml_free(self.ctx)


_graphs: dict[tuple, _Graph] = {}


def ggml_lib():
    """The ggml binding module (callers check ggml_available() first)."""
    return _G


def ggml_graph(key: tuple, build) -> _Graph:
    """The cached graph for `key`, built by `build(ctx) -> (inputs, output, scratch or None)`
    on first use (None: every intermediate node gets scratch, views are placed in their source)."""
    return _graph(key, build)


def _graph(key: tuple, build) -> _Graph:
    g = _graphs.get(key)
    if g is None:
        if len(_graphs) > 4096:  # shapes are few; M varies with batch and prompt chunk
            _graphs.clear()
        g = _graphs[key] = _Graph(build)
    return g


def _ggml_linear(w: "QMatrix", x: torch.Tensor) -> torch.Tensor:
    M, (N, K) = x.shape[0], w.shape

    def build(ctx):
        wt = graph_weight(ctx, w)
        xt = _activations(ctx, K, M, [w])
        return [wt, xt], _G.ggml_mul_mat(ctx, wt, xt), []

    g = _graph(("linear", w.graph_key, M), build)
    out = torch.empty(M, N)
    g([w.graph_ptr, x.data_ptr()], out.data_ptr())
    return out


def graph_weight(ctx, w: "QMatrix"):
    """The placeholder tensor of weight `w` in a graph being built: its type and shape (and
    whatever else ggml must know at plan time: a repacked weight's buffer and kernels); each call
    assigns its data from `w.graph_ptr`. Every graph that reads a QMatrix makes its tensor here
    and puts `w.graph_key` in its cache key, so one graph serves every weight of the same key."""
    N, K = w.shape
    t = _G.ggml_new_tensor_2d(ctx, int(w.ggml_type), K, N)
    if w.layout == "repacked":
        repack.mark(t, w.ggml_type, N, K)
    return t


def _activations(ctx, K: int, M: int, weights: list["QMatrix"]):
    """The float32 input x [M, K] of a graph whose matmuls read `weights`: [K, M], or [K, 1, M]
    (the same bytes: M planes of one row) when a repacked weight must see its rows alone."""
    if M >= 4 and any(w.rows_alone for w in weights):
        return _G.ggml_new_tensor_3d(ctx, _G.GGML_TYPE_F32, K, 1, M)
    return _G.ggml_new_tensor_2d(ctx, _G.GGML_TYPE_F32, K, M)


def graph_mul_mat(ctx, w: "QMatrix", wt, x):
    """ggml_mul_mat(wt, x) for weight `w` (wt its graph_weight placeholder) and x [K, M]. Graphs
    over QMatrix weights multiply here: a repacked weight with `rows_alone` multiplies x as M
    planes of one row, so ggml runs its GEMV for each row and a row's bits do not depend on M (its
    GEMM would round differently). The result is [N, M] either way; the planes are copies (ggml_cont,
    K x M and N x M floats), not views, so any graph can place them as ordinary intermediates."""
    M = x.contents.ne[1]
    if not w.rows_alone or M < 4 or x.contents.ne[2] != 1:  # below 4 rows ggml runs the GEMV anyway
        return _G.ggml_mul_mat(ctx, wt, x)
    planes = _G.ggml_cont_3d(ctx, x, x.contents.ne[0], 1, M)
    return _G.ggml_cont_2d(ctx, _G.ggml_mul_mat(ctx, wt, planes), w.shape[0], M)


def _ggml_swiglu(gate: "QMatrix", up: "QMatrix", down: "QMatrix", x: torch.Tensor, act: "GLU",
                 bias: "ExpertBias | None") -> torch.Tensor:
    """down(act(gate x [+ b_g], up x [+ b_u])) [+ b_d] as one graph: one call from Python for the
    three matmuls (ggml_swiglu_oai is ggml's own kernel for gpt-oss's clamped form)."""
    M, (Fd, K), H = x.shape[0], gate.shape, down.shape[0]

    def build(ctx):
        wg, wu, wd = graph_weight(ctx, gate), graph_weight(ctx, up), graph_weight(ctx, down)
        xt = _activations(ctx, K, M, [gate, up, down])  # h, from x, keeps its planes for down
        inputs, scratch = [wg, wu, wd, xt], []
        g = _G.ggml_mul_mat(ctx, wg, xt)
        u = _G.ggml_mul_mat(ctx, wu, xt)
        scratch += [g, u]
        if bias is not None:
            bg, bu, bd = (_G.ggml_new_tensor_1d(ctx, _G.GGML_TYPE_F32, n) for n in (Fd, Fd, H))
            inputs += [bg, bu, bd]
            g, u = _G.ggml_add(ctx, g, bg), _G.ggml_add(ctx, u, bu)
            scratch += [g, u]
        if act.kind == "swiglu_oai":
            h = _G.ggml_swiglu_oai(ctx, g, u, act.alpha, act.limit)
            scratch.append(h)
        else:
            s = _G.ggml_silu(ctx, g)
            h = _G.ggml_mul(ctx, s, u)
            scratch += [s, h]
        y = _G.ggml_mul_mat(ctx, wd, h)
        if bias is not None:
            scratch.append(y)
            y = _G.ggml_add(ctx, y, bd)
        return inputs, y, scratch

    key = ("swiglu", gate.graph_key, up.graph_key, down.graph_key, M, act, bias is not None)
    g = _graph(key, build)
    out = torch.empty(M, H)
    ptrs = [gate.graph_ptr, up.graph_ptr, down.graph_ptr, x.data_ptr()]
    if bias is not None:
        ptrs += [b.data_ptr() for b in bias]
    g(ptrs, out.data_ptr())
    return out


# --- device copies ---------------------------------------------------------------------------------

def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """An owned copy of `t` on `device`. Host to CUDA goes through pinned memory with an
    asynchronous copy: from pageable memory CUDA first waits for the card's queued work (a stream
    sync per copy: per slot swap, per missed expert's result)."""
    device = torch.device(device)
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)  # the pinned block is held until the copy ends
    return t.to(device=device, copy=True)


# The most float32 scratch one dequantised matmul may take on a card: a larger weight (the
# default model's head is 49152 x 576, 113 MiB as float32) is expanded and multiplied a block of
# rows at a time, so the card's transient use stays within what the plan's reserve allows.
DEVICE_SCRATCH_BYTES = 16 << 20


def _dequant_linear(w: "QMatrix", x: torch.Tensor, max_scratch: int | None) -> torch.Tensor:
    """x @ W.T with W dequantised per use; at most `max_scratch` bytes of float32 W at a time."""
    N, K = w.shape
    rows = N if max_scratch is None else max(1, min(N, max_scratch // (4 * K)))
    if rows >= N:
        return F.linear(x, w.dequantize(x.dtype).to(x.device))
    per_row = w.data.view(N, -1)
    out = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
    for r in range(0, N, rows):
        block = per_row[r:r + rows]
        out[:, r:r + block.shape[0]] = F.linear(x, dequantize(block, w.ggml_type, (block.shape[0], K)).to(x.dtype))
    return out


# --- the matrix ------------------------------------------------------------------------------------

def row_bytes(ggml_type: T, k: int) -> int:
    block, type_size = GGML_QUANT_SIZES[T(ggml_type)]
    return k // block * type_size


class QMatrix:
    """W [N, K] in GGUF block form (`data`: uint8 [N * row_bytes]) or, on the exact backend, float32.

    `layout` is "plain" (the GGUF's bytes) or "repacked" (ggml's interleaved rows, stages/kernels/repack.py:
    `data` then holds those, as many bytes; only ggml's matmuls read them)."""

    def __init__(self, data: torch.Tensor, ggml_type: T, shape: tuple[int, int], backend: str,
                 layout: str = "plain"):
        self.ggml_type, self.shape, self.backend = T(ggml_type), (int(shape[0]), int(shape[1])), backend
        self.layout = layout
        self.rows_alone = False  # repacked, and each activation row must run alone (repack.rows_alone)
        self.keep_plain = False  # read as rows or dequantised too (embedding, MLA's k_b/v_b): never repacked
        if backend == "exact" or self.ggml_type in FLOAT_TYPES:
            self.backend = "exact"
            self.data = data if data.dtype == torch.float32 else dequantize(data, self.ggml_type, self.shape)
        else:
            if data.dtype != torch.uint8 or data.numel() != self.shape[0] * row_bytes(self.ggml_type, self.shape[1]):
                raise ValueError(f"{self.ggml_type.name} {self.shape}: got {data.numel()} bytes")
            self.data = data
            if backend == "ggml" and data.device.type != "cpu":
                self.backend = "dequant"  # ggml-python runs on the CPU only

    @classmethod
    def from_raw(cls, raw, ggml_type: T, shape: tuple[int, int], backend: str | None = None,
                 device: torch.device | str = "cpu", copy: bool = True) -> "QMatrix":
        """From stored bytes (a numpy view of the mapping). copy=False keeps the view (host experts:
        the mapping is the host copy); otherwise the bytes are copied onto `device`."""
        backend = backend or current_backend()
        b = as_uint8_tensor(raw)
        if backend == "exact" or T(ggml_type) in FLOAT_TYPES:
            w = dequantize(b, ggml_type, shape)  # F32: still a view of the mapping
            return cls(to_device(w, device) if copy or torch.device(device).type != "cpu" else w,
                       ggml_type, shape, "exact")
        if torch.device(device).type == "cpu" and copy:
            b = weight_buffer(b.numel()).copy_(b.reshape(-1))  # huge pages: a token streams it whole
        elif copy or torch.device(device).type != "cpu":
            b = to_device(b, device)
        return cls(b.reshape(-1), ggml_type, shape, backend)

    @classmethod
    def cat_rows(cls, parts: list["QMatrix"]) -> "QMatrix | None":
        """[W1; W2; ...] along N: block rows are independent, so their bytes simply concatenate
        (None when the parts differ in block type or backend)."""
        first = parts[0]
        if any(p.ggml_type != first.ggml_type or p.shape[1] != first.shape[1] or p.backend != first.backend
               or p.layout != first.layout for p in parts):
            return None
        n = sum(p.shape[0] for p in parts)
        # Repacked parts hold whole groups of 8 rows each, so their bytes concatenate too.
        out = cls(torch.cat([p.data for p in parts]), first.ggml_type, (n, first.shape[1]), first.backend,
                  first.layout)
        out.rows_alone = first.rows_alone
        return out

    def repack(self) -> bool:
        """Hold the blocks in ggml's repacked layout when the setting and ggml allow it (the ggml
        backend on the host, a type and shape ggml has kernels for); True when it now does. Same
        bytes, so memory is unchanged; the plain copy is dropped."""
        if (self.layout != "plain" or self.keep_plain or self.backend != "ggml" or self.data.device.type != "cpu"
                or not repack.wanted(self.ggml_type, *self.shape)):
            return self.layout == "repacked"
        out = weight_buffer(self.data.numel()).view(self.data.shape)  # huge pages: a token streams it whole
        repack.repack_into(out.data_ptr(), self.data.data_ptr(), self.ggml_type, *self.shape, self.nbytes)
        self.data, self.layout, self.rows_alone = out, "repacked", repack.rows_alone(self.ggml_type)
        return True

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def graph_key(self) -> tuple:
        """What a ggml graph built for this weight depends on (see graph_weight)."""
        return (int(self.ggml_type), self.shape[0], self.shape[1], self.layout, self.rows_alone)

    @property
    def graph_ptr(self) -> int:
        """The address a graph's placeholder for this weight reads (see graph_weight)."""
        return self.data.data_ptr()

    def to(self, device: torch.device | str) -> "QMatrix":
        """An owned copy on `device` (a cache slot)."""
        self._plain("copied to another device")
        return QMatrix(to_device(self.data, device), self.ggml_type, self.shape, self.backend)

    def _plain(self, what: str) -> None:
        if self.layout != "plain":
            raise MoerayError(f"a repacked {self.ggml_type.name} {self.shape} matrix cannot be {what}: only "
                              "ggml's matmuls read that layout (mark it keep_plain before repacking, or "
                              "StageOptions.repack off)")

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        self._plain("dequantised")
        if self.backend == "exact":
            return self.data.to(dtype)
        return dequantize(self.data, self.ggml_type, self.shape).to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W as float32 [len(ids), K] (an embedding lookup reads only those blocks)."""
        if self.backend == "exact":
            return F.embedding(ids, self.data)
        self._plain("read as rows")
        per_row = self.data.view(self.shape[0], -1)
        return dequantize(per_row[ids.to(per_row.device)], self.ggml_type, (ids.numel(), self.shape[1]))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 -> x @ W.T [M, N] float32."""
        if self.backend == "ggml":
            return _ggml_linear(self, x.contiguous())
        if self.backend == "exact":
            return F.linear(x, self.data)
        tk = _card_kernels(self.data.device)
        if tk is not None and tk.supports(self.ggml_type):
            return tk.qlinear(self.data, int(self.ggml_type), self.shape, x)
        return _dequant_linear(self, x, DEVICE_SCRATCH_BYTES if self.data.device.type == "cuda" else None)

    def __repr__(self) -> str:
        layout = ", repacked" if self.layout == "repacked" else ""
        return f"QMatrix({self.ggml_type.name}, {self.shape}, {self.backend}{layout}, {self.nbytes} B)"


@dataclass(frozen=True)
class GLU:
    """The gated activation between an FFN's up and down projections.

    "silu" (default): silu(g) * u. "swiglu_oai" (gpt-oss): g = min(g, limit), u = clamp(u, -limit,
    limit), out = (u + 1) * g * sigmoid(alpha * g)."""
    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    @classmethod
    def of(cls, cfg) -> "GLU":
        """The experts' activation of a ModelConfig (`expert_act`, `swiglu_alpha`, `swiglu_limit`)."""
        kind = getattr(cfg, "expert_act", "silu")
        if kind == "silu":
            return SILU
        if kind != "swiglu_oai":
            raise MoerayError(f"expert activation {kind!r} is unknown; moeray has silu and swiglu_oai")
        return cls(kind, float(cfg.swiglu_alpha), float(cfg.swiglu_limit))

    def __call__(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(g) * u
        g = g.clamp(max=self.limit)
        u = u.clamp(-self.limit, self.limit)
        return (u + 1) * (g * torch.sigmoid(g * self.alpha))  # transformers' GptOssExperts order


SILU = GLU()


class ExpertBias(NamedTuple):
    """Per-expert biases of gate, up ([F]) and down ([H]), float32 (gpt-oss)."""
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


def swiglu(x: torch.Tensor, gate: QMatrix, up: QMatrix, down: QMatrix, act: GLU = SILU,
           bias: ExpertBias | None = None) -> torch.Tensor:
    """down(act(gate x + b_g, up x + b_u)) + b_d for x [M, K] (no biases: b = 0)."""
    if gate.backend == up.backend == down.backend == "ggml":
        return _ggml_swiglu(gate, up, down, x.contiguous(), act, bias)
    g, u = gate(x), up(x)
    if bias is not None:
        g, u = g + bias.gate, u + bias.up
    y = down(act(g, u))
    return y if bias is None else y + bias.down
