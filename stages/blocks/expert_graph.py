"""All routed experts of a layer in one ggml graph, as llama.cpp's `build_moe_ffn` runs them.

`mul_mat_id` multiplies each token's row by the experts its ids name, over one stacked tensor
[experts, rows, cols] of block-quantised weights: ggml groups the tokens by expert inside the op,
so a layer costs one graph call from Python whatever the batch (before: one call per expert).

A stack is where a layer's experts lie: the GGUF mapping's `blk.L.ffn_{gate,up,down}_exps`
tensors (the host copy) or a stage's slot buffer (hits: a slot is an index into it). ggml reads
an expert at `base + index * stride`, so a slot buffer whose rows are larger than one layer's
expert (the global layout holds the largest blob) serves every layer through its own strides.

One graph: x [N, H], ids/w [N, k] -> Σ_r w[:, r] · expert_{ids[:, r]}(x) [N, H], the weighted
sum inside (a step whose picks one stack serves: all misses, or all hits). A step whose picks are
split between the slots and the mapping runs it with k = 1 over each stack's picks (a row of x per
pick) and `add_picks` sums them in rank order, the graph's own order: a token's output does not
depend on which stack served each of its experts, bit for bit.

Activations (qmatmul.GLU, the model's `expert_act`): "silu" silu(g)·u, or "swiglu_oai" (gpt-oss),
with optional per-expert biases on gate, up and down (ggml's add_id, the op llama.cpp uses).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from moeray.stages.kernels import repack
from moeray.stages.kernels.backend import ggml_lib
from moeray.stages.kernels.graphs import ggml_graph
from moeray.stages.kernels.qmatmul import FLOAT_TYPES, GLU, row_bytes

KINDS = ("gate", "up", "down")


@dataclass(frozen=True)
class Part:
    """One kind (gate, up or down) of a stack: expert i's [rows, cols] blocks at base + i * stride,
    in ggml's plain layout or its repacked one (stages/kernels/repack.py: as many bytes, 8 rows
    interleaved; mul_mat_id then runs ggml's repacked GEMV, row by row at every batch size)."""
    base: int
    ggml_type: T
    rows: int
    cols: int
    stride: int
    repacked: bool = False

    @property
    def nbytes(self) -> int:
        return self.rows * row_bytes(self.ggml_type, self.cols)


@dataclass(frozen=True)
class Stack:
    """A layer's experts as ggml reads them. `owner` keeps the memory alive; `biases` are float32
    [n, rows] per kind (or None), indexed like the weights."""
    parts: tuple[Part, Part, Part]
    n: int
    owner: object = None
    biases: tuple = (None, None, None)

    @cached_property
    def _key(self) -> tuple:
        return tuple((int(p.ggml_type), p.rows, p.cols, p.stride, p.repacked) for p in self.parts) + (
            self.n, tuple(None if b is None else b.shape[1] for b in self.biases))

    def key(self) -> tuple:
        """What a graph over this stack depends on (computed once: a decode step asks per layer)."""
        return self._key


@dataclass(frozen=True)
class OneStack:
    """One stack serves every pick of a layer's step, known before its routing runs (every expert
    of the layer resident, or none; the host path), so routing and experts can join the layer's
    trunk graph. `slot_of`: int32 [E], expert -> row of a slot stack (None: the mapping's stack,
    indexed by expert)."""
    stack: Stack
    slot_of: torch.Tensor | None = None

    def key(self) -> tuple:
        return self.stack.key() + (self.slot_of is not None,)


def fusable(types) -> bool:
    """ggml's fused path serves block-quantised (and 16-bit) experts; float32 files keep the
    exact torch math (their tests compare against float references)."""
    return all(T(t) not in FLOAT_TYPES for t in types)


def stack_tensors(ctx, stack: Stack) -> tuple[list, list]:
    """The placeholders of a stack in a graph being built: its three weight tensors (data assigned
    per call from the parts' bases) and its biases (None where absent), in input order."""
    G = ggml_lib()
    ws, bias = [], []
    for p in stack.parts:
        t = G.ggml_new_tensor_3d(ctx, int(p.ggml_type), p.cols, p.rows, stack.n)
        t.contents.nb[2] = p.stride  # a slot row may be longer than this layer's expert
        t.contents.nb[3] = p.stride * stack.n
        if p.repacked:
            repack.mark(t, p.ggml_type, p.rows, p.cols)
        ws.append(t)
    for b, p in zip(stack.biases, stack.parts):
        if b is None:
            bias.append(None)
            continue
        bt = G.ggml_new_tensor_2d(ctx, G.GGML_TYPE_F32, p.rows, stack.n)
        bt.contents.nb[1] = b.stride(0) * 4  # slot biases are rows of the widest layer
        bt.contents.nb[2] = bt.contents.nb[3] = b.stride(0) * 4 * stack.n
        bias.append(bt)
    return ws, bias


def stack_pointers(stack: Stack) -> list[int]:
    """The data pointers of stack_tensors' placeholders, in the same order."""
    return [p.base for p in stack.parts] + [b.data_ptr() for b in stack.biases if b is not None]


def moe_ffn(ctx, ws, bias, act: GLU, x, ids, w):
    """Σ_r w[r] · expert_{ids[r]}(x) for every token: x [H, 1, N] float32 (one row per token,
    broadcast over its picks), ids [k, N] int32, w [1, k, N] float32 -> [H, N] (a new tensor, not
    a view: a graph may make it an output). The standalone graph below and the fused MoE layer
    (stages/runtime/trunk_graph.py) both build their experts here."""
    G = ggml_lib()
    k = ids.contents.ne[0]

    def biased(y, i):
        return y if bias[i] is None else G.ggml_add_id(ctx, y, bias[i], ids)

    gate = biased(G.ggml_mul_mat_id(ctx, ws[0], x, ids), 0)  # [F, k, N]
    up = biased(G.ggml_mul_mat_id(ctx, ws[1], x, ids), 1)
    if act.kind == "swiglu_oai":
        h = G.ggml_swiglu_oai(ctx, gate, up, act.alpha, act.limit)
    else:
        h = G.ggml_swiglu_split(ctx, gate, up)
    y = biased(G.ggml_mul_mat_id(ctx, ws[2], h, ids), 2)  # [H, k, N]
    y = G.ggml_mul(ctx, y, w)
    if k == 1:  # [H, 1, N] -> [H, N]: a copy, not a view, so a graph may make it an output and
        return G.ggml_cont_2d(ctx, y, y.contents.ne[0], y.contents.ne[2])  # the stage graph can add it
    # Σ over the k picks in rank order (llama.cpp's order)
    H, N = y.contents.ne[0], y.contents.ne[2]
    views = [G.ggml_view_2d(ctx, y, H, N, y.contents.nb[2], r * y.contents.nb[1]) for r in range(k)]
    out = views[0]
    for v in views[1:]:
        out = G.ggml_add(ctx, out, v)
    return out


def _build(stack: Stack, act: GLU, N: int, k: int):
    """A builder for qmatmul's graph cache: inputs are (gate, up, down, x, ids, w, biases...)."""
    G = ggml_lib()
    H = stack.parts[0].cols

    def build(ctx):
        ws, bias = stack_tensors(ctx, stack)
        x = G.ggml_new_tensor_3d(ctx, G.GGML_TYPE_F32, H, 1, N)  # one row per token, broadcast over its k picks
        ids = G.ggml_new_tensor_2d(ctx, G.GGML_TYPE_I32, k, N)
        w = G.ggml_new_tensor_3d(ctx, G.GGML_TYPE_F32, 1, k, N)
        inputs = [*ws, x, ids, w] + [b for b in bias if b is not None]
        return inputs, moe_ffn(ctx, ws, bias, act, x, ids, w), None

    return build


def run(stack: Stack, act: GLU, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, H] float32 on the host, ids/w [N, k] -> Σ_r w[:, r] · expert_{ids[:, r]}(x), [N, H]."""
    N, k = ids.shape
    x = x.contiguous()
    ids32 = ids.to(torch.int32).contiguous()
    w32 = w.to(torch.float32).contiguous()
    g = ggml_graph(("moe", N, k, act, stack.key()), _build(stack, act, N, k))
    out = torch.empty(N, stack.parts[0].cols)
    ptrs = stack_pointers(stack)
    g(ptrs[:3] + [x.data_ptr(), ids32.data_ptr(), w32.data_ptr()] + ptrs[3:], out.data_ptr())
    return out


def add_picks(n_tokens: int, k: int, parts: list[tuple[np.ndarray, torch.Tensor]], H: int) -> torch.Tensor:
    """Σ_r of weighted picks given as (flat pick index t*k + r, [P, H]) groups -> [n_tokens, H],
    added in rank order as the graph adds them (float32 adds in numpy: the same sums, a few
    microseconds where torch's indexed copies cost tens)."""
    picks = np.empty((n_tokens * k, H), dtype=np.float32)
    for flat, y in parts:
        picks[flat] = y.numpy()
    picks = picks.reshape(n_tokens, k, H)
    out = picks[:, 0].copy()
    for r in range(1, k):
        out += picks[:, r]
    return torch.from_numpy(out)
