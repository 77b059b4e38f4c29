"""ggml compute graphs over torch storage: a graph's intermediates placed in one scratch buffer
(reused once their last reader has run, as ggml's own allocator does), the process's cache of
graphs by key, and the placeholders through which a graph reads a QMatrix.
"""
from __future__ import annotations

import ctypes

import torch

from moeray.stages.kernels import repack, settings
from moeray.stages.kernels.ggml_lib import load_once
from moeray.stages.kernels.threads import GraphPlans, on_new_threads

_G = load_once()[0]  # ggml-python's module (None without it: nothing here is called then)


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



# A changed option or thread count: graphs are built again with the new settings.
settings.on_change(_graphs.clear)
on_new_threads(_graphs.clear)
