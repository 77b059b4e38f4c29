"""A layer's trunk (GQA or MLA attention) as one ggml graph on the ggml backend, as llama.cpp builds it.

One call per layer computes, from the residual stream x (plus the previous layer's FFN output r,
added first, so that residual add joins this graph):

    x = x + r;  a = rms_norm(x) * attn_norm;  qkv = W_qkv a (+ b);  q/k RMSNorm per head (qwen3);
    RoPE (ggml_rope_ext: NORM for llama, NEOX for qwen);  k, v written into the stage's KV pool
    (ggml_set_rows at the step's rows);  flash attention over the pool's keys (ggml_flash_attn_ext,
    a step mask, padded keys masked);  x = x + W_o o (+ b);  h = rms_norm(x) * ffn_norm;
    logits = W_router h  (MoE layers)

and returns x, h and the router logits. An MoE layer whose routing rule has a graph form
(stages/blocks/routing.py GRAPH_ROUTING: softmax top-k; DeepSeek's / GLM's sigmoid scores with the
exp_probs_b bias, group-limited top-k, renormalised and scaled) routes inside the graph too, as
llama.cpp's build_moe_ffn does, and returns the ids and weights; when one stack serves every pick
(the host path, or every expert of the layer resident: MoEBlock.one_stack) its routed experts'
mul_mat_id nodes join as well (stages/blocks/expert_graph.py moe_ffn), and its shared expert (`Dense`,
gated or not) beside them, so the layer is one call. A dense layer's FFN (DeepSeek's first
layers, GLM's first) is graph nodes too. Otherwise the experts (and the shared expert) run
between two such calls. One graph serves every layer of the same shape: weights, norms, pool and
step inputs are placeholders whose data pointers are assigned per call (graphs.graph_weight /
graph_key / graph_ptr for the weights).

`TrunkGraphs.stage` chains every layer of a stage into one graph for a decode-sized step when
each runs whole inside (`LayerSpec.whole`): one call a step, the next layer's residual add inside,
as llama.cpp runs a token. The caller counts each MoE layer's experts from the ids it returns.

Keys are read where they lie: a view of the pool when the step's block tables allow one
(BatchMeta.read_view), else the step's whole blocks gathered with ggml_get_rows. The pool's rows are
in its cache types (float32, float16, q8_0, q4_0 for K and V apart, llama.cpp's -ctk / -ctv):
ggml_set_rows writes (quantises) them and ggml_flash_attn_ext reads them as stored. Their count is
padded to KEY_PAD (masked) so a decode step reuses its graph for KEY_PAD tokens; a step of
several tokens a row (a verify row of drafted tokens, a prompt chunk) to ROW_KEY_PAD, so that a
verify row of each length is built once for that many keys, not every KEY_PAD.

A step whose sequences add different token counts (prefill chunks beside decode tokens) pads
its queries to [B, t_max] inside the graph (get_rows there and back), as the torch path pads them.
`TrunkGraphs.step(meta, kv)` returns None where a step has no graph form (a pool on a card, a pool
view that would run past the pool's end); which layers can at all is decided at load
(`supports`): split qkv weights, other attention kinds (gated, DeltaNet) and the other backends
keep the torch path. gpt-oss's attention is in: its sinks through flash_attn_ext's sinks, its
sliding windows through a mask per window size (Step.windows), YaRN through rope_ext's
freq_factors (`rope_factors`).

MLA (DeepSeek-V2/V3, Kimi-K2; stages/blocks/mla.py) is in too, in the weight-absorbed form of llama.cpp's
deepseek2.cpp (`_mla_nodes`): q (or q_a -> norm -> q_b), kv_a split into the latent (normed) and
the rope key, RoPE on q_pe and k_pe, [latent, k_pe] written into the layer's one latent pool,
q_lat = k_b^T q_nope per head (a batched mul_mat), flash_attn_ext with every query head over the
one key head of C + R values and the value a view of its first C, then v_b per head and the
output. Where k_b / v_b are float in the file they are multiplied as float32, as the torch path does.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch

from moeray.stages.blocks.expert_graph import OneStack, moe_ffn, stack_pointers, stack_tensors
from moeray.planner.kv import KVTypes
from moeray.stages.blocks.kv_cache import BLOCK_SIZE, KVPool
from moeray.stages.blocks.kv_rotation import hadamard, rotation
from moeray.stages.blocks.attention import Attention, BatchMeta, GatedAttention
from moeray.stages.blocks.deltanet import GatedDeltaNet
from moeray.stages.blocks.mla import MLAttention
from moeray.stages.kernels.backend import ggml_lib
from moeray.stages.kernels import settings
from moeray.stages.kernels.ggml_lib import fa_rows_settable
from moeray.stages.kernels.graphs import graph_mul_mat, graph_weight, place_scratch
from moeray.stages.kernels.qmatmul import GLU, QMatrix
from moeray.stages.kernels.threads import GraphPlans

L2_EPS = 1e-6  # the DeltaNet's q/k L2 norm: x / sqrt(sum x^2 + L2_EPS) (stages/blocks/deltanet.l2norm)
KEY_PAD = 64  # keys per graph shape: a decode step builds a new graph every KEY_PAD tokens
# Keys per graph shape of a step whose rows hold several tokens. Speculation's verify rows come in
# several lengths (cluster/speculation.py ROW_SIZES), each a graph of its own at each key count, and a
# graph costs a decode step or more to build (~30 ms on the default model's 30 layers, in Python):
# at KEY_PAD a copy-heavy answer built a new one every few verify rows. Padded keys cost next to
# nothing there: ggml's flash attention skips the masked ones (a key, or a tile of them). A
# one-token step keeps KEY_PAD: its attention splits the keys among the threads, and padded keys
# would leave a thread idle.
ROW_KEY_PAD = 4 * KEY_PAD
# A graph's intermediates share scratch once their last reader has run (graphs.place_scratch), so
# a stage graph needs about one layer's intermediates; a stage graph over this much (a step far
# bigger than decode) runs per layer instead. At most STAGE_GRAPHS_BYTES of them are kept, the least
# recently used dropped first: served steps move between a few hot shapes (every sequence decoding,
# at one or two key lengths) and rarer ones (a batch that is not full, a prompt's chunk).
STAGE_SCRATCH_BYTES = 96 << 20
STAGE_GRAPHS_BYTES = 4 * STAGE_SCRATCH_BYTES
STAGE_GRAPHS = 64  # shapes remembered at most (those too big for one graph included)
# Query rows a sequence needs in a step for its quantised keys and values to be read as float32
# first (ggml_get_rows dequantises them): ggml's CPU flash attention runs its tiled kernel (a tile
# of up to 64 query rows of a head against a tile of 64 keys, float32 GEMMs) only over float rows,
# and its query-by-query kernel over q8_0 / q4_0 ones, which also rounds each query to q8_0 for
# the dot products. A 512-token chunk at depth 4,096 took 2.6x as long in q8_0 as in f16 for it
# (llama.cpp's too); the dequantised copy costs one read of the rows (a few ms a chunk). moeray's
# ggml runs the tiled kernel from StageOptions.fa_tiled_rows rows (default 64, as llama.cpp:
# stages/kernels/ggml_build.py TILED_FA_ROWS), so float rows and quantised ones take it from the
# same count. A decode step (one query row) keeps reading the rows as stored: a copy would cost it
# more than its attention.
FLOAT_READ_ROWS = 64


_ZERO, _NEG_INF = np.float16(0), np.float16(-np.inf)  # the attention mask's two values


def float_read_rows() -> int:
    """StageOptions.fa_tiled_rows where this process's ggml takes it (a `make venv` build), else
    FLOAT_READ_ROWS (ggml's own count)."""
    return settings.current().fa_tiled_rows if fa_rows_settable() else FLOAT_READ_ROWS


_KEY_ROWS: list[torch.Tensor] = [torch.arange(4096, dtype=torch.int32)]


def _key_rows(keys: int) -> torch.Tensor:
    """int32 0, 1, .. at least `keys` long: the rows ggml_get_rows reads of a [D, keys, heads, seqs]
    read (_float_reads), one for the process, doubled when a step needs more. Graphs point at it,
    so every one made stays alive (together at most twice the longest)."""
    while len(_KEY_ROWS[-1]) < keys:
        _KEY_ROWS.append(torch.arange(2 * len(_KEY_ROWS[-1]), dtype=torch.int32))
    return _KEY_ROWS[-1]


class MultiGraph:
    """A ggml graph with several outputs over placeholder tensors: inputs and outputs point at
    torch storage assigned per call; views of them are re-pointed per call; every other node
    gets a fixed place in one scratch buffer."""

    built = 0  # graphs built in this process: a step that built one ran slower than its shape does

    def __init__(self, build, n_nodes: int = 256):
        MultiGraph.built += 1
        G = self._G = ggml_lib()
        slots = max(2048, 2 * n_nodes)  # the graph's node table (ggml's default is 2048)
        size = G.ggml_tensor_overhead() * n_nodes + G.ggml_graph_overhead_custom(slots, False) + 4096
        self.ctx = G.ggml_init(G.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=True))
        self.inputs, self.outputs, effects = build(self.ctx)
        self.graph = G.ggml_new_graph_custom(self.ctx, slots, False)
        for t in effects + self.outputs:  # side effects (KV writes) first: graph order is run order
            G.ggml_build_forward_expand(self.graph, t)
        fixed = {ctypes.addressof(t.contents) for t in self.inputs + self.outputs}
        nodes = [G.ggml_graph_node(self.graph, i) for i in range(G.ggml_graph_n_nodes(self.graph))]
        scratch = [t for t in nodes if ctypes.addressof(t.contents) not in fixed and not t.contents.view_src]
        self.scratch = place_scratch(scratch, nodes)
        # Views look into their source's bytes: placed once when it is an intermediate, re-pointed
        # per call (each after its source) when it is an input or output, or a view of one.
        self._views, moving = [], set(fixed)
        for t in self._all_views(nodes):
            v = (t.contents, t.contents.view_src.contents, t.contents.view_offs)
            if ctypes.addressof(v[1]) in moving:
                moving.add(ctypes.addressof(v[0]))
                self._views.append(v)
            else:
                v[0].data = v[1].data + v[2]
        self.plans = GraphPlans(self.graph)  # ggml's threads as every qmatmul graph uses them
        self._in = [t.contents for t in self.inputs]
        self._out = [t.contents for t in self.outputs]
        self._fixed = None  # the `fixed` pointers the inputs hold now (see __call__)
        self._compute = self.plans.compute

    def _all_views(self, nodes):
        """Every view tensor the graph reads, its sources before it."""
        seen, order = set(), []

        def visit(t):
            a = ctypes.addressof(t.contents)
            if a in seen or not t.contents.view_src:
                return
            seen.add(a)
            visit(t.contents.view_src)
            order.append(t)

        for n in nodes:
            visit(n)
            for s in n.contents.src:
                if s:
                    visit(s)
        return order

    def __call__(self, inputs: list[int], outputs: list[int], fixed: tuple[int, ...] | None = None) -> None:
        """Point the placeholders at this call's storage and compute. `fixed`: the pointers of the
        inputs after `inputs` (a stage's weights and pools: hundreds of them), written only when
        it is not the very object the last call passed (a stage keeps it while nothing moved)."""
        for t, p in zip(self._in, inputs):
            t.data = p
        if fixed is None:
            self._fixed = None
        elif fixed is not self._fixed:
            for t, p in zip(self._in[len(inputs):], fixed):
                t.data = p
            self._fixed = fixed
        for t, p in zip(self._out, outputs):
            t.data = p
        for t, src, offs in self._views:
            t.data = src.data + offs
        self._compute(self.graph)

    def __del__(self):
        if getattr(self, "ctx", None) and getattr(self, "_G", None) is not None:
            self._G.ggml_free(self.ctx)


def supports(attn, cfg) -> bool:
    """Whether a layer's attention runs as a trunk graph (else the stage keeps the torch path):
    GQA with fused qkv on the ggml backend, sinks, sliding windows and YaRN (gpt-oss) included, and
    the hybrid families' gated attention; MLA (DeepSeek, Kimi) with every matrix on the ggml backend
    (k_b / v_b also float); a Gated DeltaNet whose projections are on the ggml backend."""
    if type(attn) is GatedDeltaNet:
        return all(w.backend == "ggml" for w in attn.w_in) and attn.w_out.backend == "ggml"
    if cfg.rope_style not in ("normal", "neox"):
        return False
    if type(attn) is MLAttention:  # k_b / v_b may be float (read as float32 by the per-head products)
        heads = (attn.w_k_b, attn.w_v_b)
        rest = [w for w in attn.weights() if isinstance(w, QMatrix) and all(w is not h for h in heads)]
        return all(w.backend == "ggml" for w in rest) and all(
            w.backend == "ggml" or (w.backend == "exact" and w.data.device.type == "cpu") for w in heads)
    return (type(attn) in (Attention, GatedAttention) and len(attn.w_qkv) == 1 and attn.w_qkv[0].backend == "ggml"
            and attn.w_o.backend == "ggml")


def rope_factors(cfg) -> torch.Tensor | None:
    """YaRN as ggml_rope_ext's per-dimension frequency divisors (its `freq_factors` input, with
    ext_factor 0): base_i / yarn_i, so that ggml turns each pair by exactly the torch path's
    frequency (stages/blocks/rope.py, truncated correction dims or not); None without YaRN."""
    if cfg.rope_scaling != "yarn":
        return None
    from moeray.stages.blocks.rope import RoPE

    rope = RoPE.from_config(cfg)
    dim = rope.dim
    base = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    return (base / rope.inv_freq).float().contiguous()


@dataclass
class Step:
    """What every layer's call of one step shares: its shape and its per-step inputs."""
    key: tuple
    n: int
    positions: torch.Tensor  # int32 [N]
    write_rows: torch.Tensor  # int64 [N]
    mask: torch.Tensor  # float16 [B, 1, t, keys_pad]
    read_base: int  # view mode: the first key row; gather mode: -1
    gather: torch.Tensor | None  # int32 [n_kv_heads, B * blocks]: the blocks each head reads
    pad: torch.Tensor | None = None  # int32 [B * t]: the packed token of each padded query row
    unpad: torch.Tensor | None = None  # int32 [N]: the padded row of each packed token
    rows: int = 0  # rows of the pool
    gap: int = 0  # view mode: rows from one sequence's keys to the next's
    windows: tuple = ()  # float16 masks like `mask` for each sliding window (TrunkGraphs.windows' order)
    types: KVTypes = KVTypes()  # the pool's cache types (its K and V rows' ggml types)
    # Recurrent (DeltaNet) layers: the state slot of each sequence, int32 [B]; with padded queries
    # each padded row's weight in the state (1, or 0 for a pad row: it neither decays nor writes
    # the state), float32 [B * t], and each sequence's new token count (its conv state's end)
    state_idx: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    n_new: tuple = ()
    n_slots: int = 0  # slots of the state pools
    state_base: int = -1  # the first state slot when the step's slots are consecutive (read as views), else -1
    # The rows the caller reads after the stage's last layer (the head's: each sampling sequence's
    # last token), int32 [M], or None: every row. With them the last layer's FFN runs for those
    # rows only, after its attention has written every row's keys (llama.cpp's inp_out_ids): a
    # 512-token prefill chunk takes its last layer's experts for 1 token, not 512.
    out_rows: torch.Tensor | None = None
    float_reads: bool = False  # quantised keys and values read as float32 copies (TrunkGraphs._float_reads)


@dataclass(frozen=True)
class Routed:
    """An MoE layer's routing inside its trunk graph: the rule as graph nodes (stages/blocks/routing.py
    GRAPH_ROUTING) with its selection bias [E] (None: none), and with `one` (the stack that serves
    every pick) the routed experts too; keep_h: the caller needs the normed input still (the
    experts run after the graph)."""
    rule: Callable
    one: OneStack | None = None
    keep_h: bool = True
    bias: torch.Tensor | None = None


class Dense:
    """A SwiGLU FFN as graph nodes, down(silu(gate h) * up h), over the trunk's QMatrix weights: a
    dense layer's FFN (DeepSeek's first layers, GLM's first), or an MoE layer's shared expert,
    scaled by sigmoid(w_gate . h) where it is gated (qwen2moe). The same ggml ops as the torch
    path's qmatmul.swiglu on the same h, so the same bits (the gate's dot product aside)."""
    __slots__ = ("w", "w_gate", "_key", "_ptrs")

    def __init__(self, gate: QMatrix, up: QMatrix, down: QMatrix, w_gate: torch.Tensor | None = None):
        self.w, self.w_gate = (gate, up, down), w_gate
        self._key = tuple(m.graph_key for m in self.w) + (w_gate is not None,)
        self._ptrs = [m.graph_ptr for m in self.w] + ([] if w_gate is None else [w_gate.data_ptr()])

    @staticmethod
    def of(gate: QMatrix, up: QMatrix, down: QMatrix, w_gate: torch.Tensor | None = None) -> "Dense | None":
        """The FFN's graph form, or None where its weights are not on the ggml backend (float32)."""
        ok = all(m.backend == "ggml" and m.device.type == "cpu" for m in (gate, up, down))
        return Dense(gate, up, down, w_gate) if ok else None

    def key(self) -> tuple:
        return self._key

    def nodes(self, ctx, new, h):
        """(its inputs, in `_ptrs` order; its output [H, N]) from h [H, N]."""
        G = ggml_lib()
        ws = [graph_weight(ctx, m) for m in self.w]
        gate, up, down = self.w
        y = graph_mul_mat(ctx, down, ws[2], G.ggml_mul(ctx, G.ggml_silu(ctx, graph_mul_mat(ctx, gate, ws[0], h)),
                                                       graph_mul_mat(ctx, up, ws[1], h)))
        if self.w_gate is None:
            return ws, y
        w_gate = new(h.contents.ne[0], 1)
        return ws + [w_gate], G.ggml_mul(ctx, y, G.ggml_sigmoid(ctx, G.ggml_mul_mat(ctx, w_gate, h)))


class LayerOut(NamedTuple):
    """A trunk graph's outputs, in the graph's order (at most one of ffn, experts and shared is set):

    x        the residual stream after attention
    h        the FFN's normed input, where the caller still computes part of the FFN from it
    logits   the router's logits [N, E] (an MoE layer routed outside the graph)
    ffn      the layer's whole FFN output [N, H], where it ran inside: a dense layer's FFN, or an MoE
             layer's routed experts with its shared expert (if any) added
    experts  the routed experts' output alone (they ran inside; the shared expert runs after, from h)
    shared   the shared expert's output alone (it ran inside; the routed experts run after, from h)
    ids      with the routing inside: each token's k experts [N, k] int32 ...
    weights  ... and their weights [N, k]"""
    x: torch.Tensor
    h: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    ffn: torch.Tensor | None = None
    experts: torch.Tensor | None = None
    shared: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    weights: torch.Tensor | None = None


class LayerSpec:
    """What one layer's trunk graph reads: its norms, attention, router [E, H] (MoE layers) and
    with `routed` its routing (and experts) inside the graph. A stage makes one per layer once
    (its key and the pointers of its weights, fixed after load, computed then) and derives each
    step's with `with_routed`: a decode step pays no per-layer tuple building for them. `dense`:
    the FFN inside the graph (a dense layer's), or an MoE layer's shared expert."""
    __slots__ = ("attn_norm", "attn", "ffn_norm", "router", "routed", "dense", "_key", "_ptrs", "_full_key")

    def __init__(self, attn_norm: torch.Tensor, attn: Attention, ffn_norm: torch.Tensor,
                 router: torch.Tensor | None = None, routed: Routed | None = None, dense: Dense | None = None):
        self.attn_norm, self.attn, self.ffn_norm, self.router, self.routed = attn_norm, attn, ffn_norm, router, routed
        self.dense = dense
        self._full_key = None
        a = attn
        E = None if router is None else router.shape[0]
        if type(a) is MLAttention:  # its weights in MLAttention.weights' order
            ws = a.weights()
            self._key = (("mla",) + tuple(w.graph_key if isinstance(w, QMatrix) else w.shape for w in ws), E, 0)
            fixed = [w.graph_ptr if isinstance(w, QMatrix) else w.data_ptr() for w in ws]
        elif type(a) is GatedDeltaNet:  # the input projection's parts, the output, then the vectors
            self._key = (("deltanet",) + tuple(w.graph_key for w in a.w_in) + (a.w_out.graph_key,), E, 0)
            fixed = ([w.graph_ptr for w in a.w_in] + [a.w_out.graph_ptr]
                     + [t.data_ptr() for t in (a.conv_w, a.dt_bias, a.a, a.norm_w)])
        else:
            opt = self.optional()
            self._key = (a.w_qkv[0].graph_key, a.w_o.graph_key, tuple(o is not None for o in opt), E, a.window,
                         type(a) is GatedAttention)
            fixed = [a.w_qkv[0].graph_ptr, a.w_o.graph_ptr] + [o.data_ptr() for o in opt if o is not None]
        self._ptrs = ([attn_norm.data_ptr(), ffn_norm.data_ptr()] + fixed, [] if router is None else [router.data_ptr()])

    def with_routed(self, routed: Routed | None, dense: Dense | None = None) -> "LayerSpec":
        spec = object.__new__(LayerSpec)
        for name in LayerSpec.__slots__:
            setattr(spec, name, getattr(self, name))
        spec.routed, spec.dense, spec._full_key = routed, dense, None
        return spec

    @property
    def whole(self) -> bool:
        """The layer's whole FFN runs inside its graph (it can join a stage graph)."""
        r = self.routed
        return (r.one is not None and not r.keep_h) if r is not None else self.router is None and self.dense is not None

    def optional(self) -> tuple:
        a = self.attn
        return a.b_qkv, a.q_norm, a.k_norm, a.b_o, a.sinks

    def key(self) -> tuple:
        """Everything the layer's nodes depend on (layers of one key share a graph); made once per
        spec (a stage keeps its step's specs while their stacks stay the same)."""
        if self._full_key is None:
            r, d = self.routed, self.dense
            self._full_key = self._key + (
                None if r is None else (r.rule, r.one and r.one.key(), r.keep_h, r.bias is not None),
                None if d is None else d.key())
        return self._full_key

    def ptrs(self, step: Step, kv: KVPool) -> list[int]:
        """The data pointers of the layer's inputs, in _layer_nodes' order."""
        if type(self.attn) is GatedDeltaNet:  # its conv and recurrent state pools (and their step's rows)
            pools = kv.state.layer(self.attn.layer)
            ptrs = self._ptrs[0] + [p.data_ptr() for p in pools]
            if step.state_base >= 0:
                ptrs += [p.data_ptr() + step.state_base * p[0].numel() * 4 for p in pools]
        else:
            pools = [p for p in kv.layer(self.attn.layer) if p is not None]  # k and v; MLA's one latent pool
            ptrs = self._ptrs[0] + [p.data_ptr() for p in pools]
            if step.read_base >= 0:  # the keys as views of the pool from the step's first row
                ptrs += [p.data_ptr() + step.read_base * p.stride(1) * p.element_size() for p in pools]
                if type(self.attn) is MLAttention:  # its values: the same rows (_mla_nodes)
                    ptrs.append(ptrs[-1])
            else:  # gathered: a pool not of float32 rows is read again as raw blocks (TrunkGraphs._pools)
                ptrs += [p.data_ptr() for p in pools if p.dtype != torch.float32]
        ptrs += self._ptrs[1]
        routed = self.routed
        if routed is not None:
            if routed.bias is not None:
                ptrs.append(routed.bias.data_ptr())
            one = routed.one
            if one is not None:
                ptrs += stack_pointers(one.stack)
                if one.slot_of is not None:
                    ptrs.append(one.slot_of.data_ptr())
        if self.dense is not None:
            ptrs += self.dense._ptrs
        return ptrs


class TrunkGraphs:
    """The trunk graphs of one stage's layers (all GQA with the same shape)."""

    def __init__(self, cfg, windows=()):
        self.cfg = cfg
        self.act = GLU.of(cfg)
        self.windows = tuple(sorted(windows))  # the stage's sliding-window sizes (0 excluded)
        self.factors = rope_factors(cfg)  # YaRN's frequency divisors, a step input
        self._graphs: dict[tuple, MultiGraph] = {}
        self._stages: dict[tuple, MultiGraph | bool] = {}  # stage graphs, oldest first
        self._kept_ptrs = None  # (specs, pool, read_base, their pointers): see _layer_ptrs

    def step(self, meta: BatchMeta, kv: KVPool, out_rows: torch.Tensor | None = None) -> Step | None:
        """The step's shared inputs, or None when its shape has no graph form: sequences adding
        different token counts (mixed prefill + decode), a pool on a card.
        out_rows: the rows read after the last layer (Step.out_rows), None: all."""
        B, t = len(meta.n_new), meta.t_max
        if meta.positions.device.type != "cpu":
            return None
        state = kv.state
        if state is not None and meta.state_slots is None:
            return None
        pad = unpad = valid = None
        if any(n != t for n in meta.n_new):  # queries padded to [B, t] (pad rows copy token 0, unread)
            unpad = (meta.seq_of_token * t + meta.off_of_token).to(torch.int32)
            pad = torch.zeros(B * t, dtype=torch.int32)
            pad[unpad.long()] = torch.arange(meta.n_tokens, dtype=torch.int32)
            if state is not None:  # a pad row leaves the recurrent state as it is
                valid = torch.zeros(B * t)
                valid[unpad.long()] = 1.0
        recurrent, state_base = (), -1
        if state is not None:  # the pool's slots, how states are read, where each conv state ends (padded)
            slots = meta.state_slots
            if slots == list(range(slots[0], slots[0] + B)):  # consecutive: read in place, as views
                state_base = slots[0]
            recurrent = (state.n_slots, state_base >= 0) + (tuple(meta.n_new) if pad is not None else ())
        quantum = KEY_PAD if t == 1 else ROW_KEY_PAD
        keys_pad = -(-meta.keys_max // quantum) * quantum
        rows = kv.k[0].shape[1] if kv.k else 0
        if not kv.k:  # a stage of DeltaNet layers only: no keys to read (the mask unread)
            base, gap, gather, mode, keys_pad = 0, 0, None, ("none",), KEY_PAD
        elif meta.read_view is not None:
            base, gap = meta.read_view
            keys_pad = min(keys_pad, rows - base - (B - 1) * gap)
            if keys_pad < meta.keys_max:
                return None
            mode, gather = ("view", gap), None
        else:
            base, nb = -1, keys_pad // BLOCK_SIZE
            blocks = meta.read_blocks.view(B, -1)
            have = blocks.shape[1]
            if have < nb:  # padded blocks point at block 0: masked
                blocks = torch.cat((blocks, blocks.new_zeros(B, nb - have)), 1)
            gather = blocks[:, :nb].reshape(1, -1).to(torch.int32).expand(kv.k[0].shape[0], -1).contiguous()
            mode, gap = ("gather",), 0
        # query t of sequence i (position starts[i] + t) sees keys 0 .. starts[i] + t; a pad row key 0.
        # Built in numpy: a decode step's few small arrays cost a tenth of torch's dispatch.
        ts = np.arange(t)
        q_pos = np.asarray(meta.starts)[:, None] + ts  # [B, t]
        q_pos = np.where(ts < np.asarray(meta.n_new)[:, None], q_pos, 0)[:, None, :, None]  # [B, 1, t, 1]
        key = np.arange(keys_pad)
        mask = torch.from_numpy(np.where(key <= q_pos, _ZERO, _NEG_INF))  # [B, 1, t, keys_pad] float16
        # a sliding window of w: also keys more than w - 1 before the query hidden (layers.window_mask)
        windows = tuple(torch.from_numpy(np.where((key <= q_pos) & (key > q_pos - w), _ZERO, _NEG_INF))
                        for w in self.windows)
        # quantised keys and values read as float32 copies first (_float_reads): the options' count
        # decides, so a changed count builds other graphs
        float_reads = t >= float_read_rows() and not all(c in ("f32", "f16") for c in (kv.types.k, kv.types.v))
        # the key: everything a graph's shapes depend on (the pool's rows, the step's tokens too)
        return Step((B, t, keys_pad, pad is not None) + mode + (rows, meta.n_tokens, kv.types) + recurrent
                    + (float_reads,), meta.n_tokens,
                    meta.positions.to(torch.int32), meta.write_rows.to(torch.int64).contiguous(), mask, base, gather,
                    pad, unpad, rows, gap, windows, kv.types,
                    None if state is None else torch.tensor(meta.state_slots, dtype=torch.int32), valid,
                    tuple(meta.n_new), 0 if state is None else state.n_slots, state_base,
                    None if out_rows is None else out_rows.to(torch.int32).contiguous(), float_reads)

    def layer(self, step: Step, x: torch.Tensor, r: torch.Tensor | None, layer: LayerSpec, kv: KVPool,
              last: bool = False) -> LayerOut:
        """x + r + attention, and after it the FFN's input h and the router's logits, or with
        `layer.routed` the routing (and the routed experts) too (see LayerOut). last: the stage's
        last layer, whose outputs keep only step.out_rows (where set)."""
        prune = last and step.out_rows is not None
        n_out = step.out_rows.numel() if prune else None
        g = self._graph((step.key, r is not None, layer.key(), n_out),
                        lambda: self._builder(step, [layer], r is not None, False, prune),
                        256 + (6 * step.key[0] if step.valid is not None else 0))  # padded DeltaNet: a write per sequence
        ptrs = ([x.data_ptr()] + ([r.data_ptr()] if r is not None else []) + self._step_ptrs(step, prune)
                + layer.ptrs(step, kv))
        N, H = x.shape
        if prune:
            N = n_out
        routed = layer.routed
        if routed is None and layer.dense is not None:  # a dense layer's FFN inside
            out = LayerOut(torch.empty(N, H), ffn=torch.empty(N, H))
        elif routed is None:
            router = layer.router
            out = LayerOut(torch.empty(N, H), torch.empty(N, H), None if router is None else torch.empty(N, router.shape[0]))
        else:
            k = self.cfg.n_experts_used
            y = torch.empty(N, H)
            if routed.one is None:  # the routed experts after the graph; the shared expert inside, or none
                ffn_out = dict(shared=y) if layer.dense is not None else {}
            else:  # the routed experts inside: the whole FFN, or without the shared expert (kept h)
                ffn_out = dict(experts=y) if routed.keep_h else dict(ffn=y)
            out = LayerOut(torch.empty(N, H), torch.empty(N, H) if routed.keep_h else None,
                           ids=torch.empty(N, k, dtype=torch.int32), weights=torch.empty(N, k), **ffn_out)
        g(ptrs, [t.data_ptr() for t in out if t is not None])  # LayerOut's order is the graph's
        return out

    def stage(self, step: Step, x: torch.Tensor, layers: list[LayerSpec], kv: KVPool) -> tuple | None:
        """Every layer of the stage in one graph, as llama.cpp runs a token: each layer's FFN
        inside (every `layer.whole`: an MoE layer's routing, routed experts and shared expert, or
        a dense layer's FFN), its output added to the residual inside. x [N, H] -> (the stream
        after the last layer's FFN: step.out_rows' rows where set, ids [M, N, k] int32 and weights
        [M, N, k] of its M MoE layers in order, and None or, where the last layer is an MoE layer
        that ran for step.out_rows only, its (ids, weights) apart), for the caller's counting per
        layer; None when the step's graph would hold more than STAGE_SCRATCH_BYTES of intermediates."""
        prune = step.out_rows is not None
        key = (step.key, step.out_rows.numel() if prune else None) + tuple(l.key() for l in layers)
        g = self._stages.pop(key, None)
        if g is None:
            per_layer = 160 + (6 * step.key[0] if step.valid is not None else 0)  # padded DeltaNet: a write per sequence
            g = MultiGraph(self._builder(step, layers, False, True, prune), per_layer * len(layers))
            if g.scratch.numel() > STAGE_SCRATCH_BYTES:
                g = False  # too big a step for one graph (remembered): one graph per layer
            kept = g.scratch.numel() if g else 0
            for old in self._stages.values():
                kept += old.scratch.numel() if old else 0
            while kept > STAGE_GRAPHS_BYTES or len(self._stages) >= STAGE_GRAPHS:  # least recently used first
                old = self._stages.pop(next(iter(self._stages)))
                kept -= old.scratch.numel() if old else 0
        self._stages[key] = g  # the most recently used last
        if g is False:
            return None
        N, H = x.shape
        M = step.out_rows.numel() if prune else N
        cut = prune and layers[-1].routed is not None  # the last layer's picks: M rows, kept apart
        L, k = sum(l.routed is not None for l in layers) - cut, self.cfg.n_experts_used
        out, ids, weights = torch.empty(M, H), torch.empty(L, N, k, dtype=torch.int32), torch.empty(L, N, k)
        size = N * k * 4  # bytes of one layer's ids (and weights)
        outs = [out.data_ptr()]
        for l in range(L):
            outs += [ids.data_ptr() + l * size, weights.data_ptr() + l * size]
        tail = (torch.empty(M, k, dtype=torch.int32), torch.empty(M, k)) if cut else None
        if tail is not None:
            outs += [t.data_ptr() for t in tail]
        g([x.data_ptr()] + self._step_ptrs(step, prune), outs, self._layer_ptrs(layers, step, kv))
        return out, ids, weights, tail

    def _layer_ptrs(self, layers: list[LayerSpec], step: Step, kv: KVPool) -> tuple[int, ...]:
        """The stage graph's per-layer input pointers (weights, pools, stacks), made again only
        when the caller's specs, the pool or the step's first key row change: a decode step then
        neither builds nor writes them (~0.5 ms a token for 30 layers)."""
        kept = self._kept_ptrs
        where = (step.read_base, step.state_base)
        if kept is not None and kept[0] is layers and kept[1] is kv and kept[2] == where:
            return kept[3]
        ptrs = []
        for layer in layers:
            ptrs += layer.ptrs(step, kv)
        self._kept_ptrs = (layers, kv, where, tuple(ptrs))
        return self._kept_ptrs[3]

    def _graph(self, key: tuple, builder, n_nodes: int = 256) -> MultiGraph:
        g = self._graphs.get(key)
        if g is None:
            if len(self._graphs) > 256:
                self._graphs.clear()
            g = self._graphs[key] = MultiGraph(builder(), n_nodes)
        return g

    def _step_ptrs(self, step: Step, prune: bool = False) -> list[int]:
        ptrs = [step.positions.data_ptr(), step.write_rows.data_ptr(), step.mask.data_ptr()]
        ptrs += [m.data_ptr() for m in step.windows]
        if self.factors is not None:
            ptrs.append(self.factors.data_ptr())
        if step.read_base < 0:
            ptrs.append(step.gather.data_ptr())
        if step.pad is not None:
            ptrs += [step.pad.data_ptr(), step.unpad.data_ptr()]
        if step.state_idx is not None:
            ptrs.append(step.state_idx.data_ptr())
            if step.valid is not None:
                ptrs.append(step.valid.data_ptr())
        if prune:
            ptrs.append(step.out_rows.data_ptr())
        return ptrs

    def _builder(self, step: Step, layers: list[LayerSpec], has_r: bool, whole: bool, prune: bool = False):
        """A MultiGraph builder: the step's shared inputs, then each layer's nodes (whole: chained
        through their FFN outputs, the stage's graph; else the one layer's graph). prune: the last
        layer's outputs keep step.out_rows only."""
        G = ggml_lib()
        B, t, keys_pad, padded = step.key[:4]
        N, H = step.n, self.cfg.hidden

        def build(ctx):
            def new(*ne, type=G.GGML_TYPE_F32):
                return getattr(G, f"ggml_new_tensor_{len(ne)}d")(ctx, type, *ne)

            x = new(H, N)
            inputs = [x]
            if has_r:
                r = new(H, N)
                inputs.append(r)
                x = G.ggml_add(ctx, x, r)
            shared = dict(pos=new(N, type=G.GGML_TYPE_I32), write_rows=new(N, type=G.GGML_TYPE_I64),
                          mask=new(keys_pad, t, 1, B, type=G.GGML_TYPE_F16))
            inputs += list(shared.values())
            shared["windows"] = {w: new(keys_pad, t, 1, B, type=G.GGML_TYPE_F16) for w in self.windows}
            inputs += list(shared["windows"].values())
            shared["factors"] = None
            shared["hadamard"] = {}  # order -> its matrix (_hadamard)
            if self.factors is not None:
                shared["factors"] = new(self.factors.numel())
                inputs.append(shared["factors"])
            if step.read_base < 0:
                shared["idx"] = new(B * (keys_pad // BLOCK_SIZE), step.gather.shape[0], type=G.GGML_TYPE_I32)  # per pool head
                inputs.append(shared["idx"])
            if padded:
                shared["pad"], shared["unpad"] = new(B * t, type=G.GGML_TYPE_I32), new(N, type=G.GGML_TYPE_I32)
                inputs += [shared["pad"], shared["unpad"]]
            if step.state_idx is not None:
                shared["state_idx"] = new(B, type=G.GGML_TYPE_I32)
                inputs.append(shared["state_idx"])
                if step.valid is not None:
                    shared["valid"] = new(1, B * t)
                    inputs.append(shared["valid"])
            if prune:
                shared["out_rows"] = new(step.out_rows.numel(), type=G.GGML_TYPE_I32)
                inputs.append(shared["out_rows"])
            outputs, effects = [], []
            for i, layer in enumerate(layers):
                ins, outs, writes = self._layer_nodes(ctx, new, step, shared, x, layer, prune and i == len(layers) - 1)
                inputs += ins
                effects += writes
                if whole:  # the next layer's input: the residual plus this layer's routed experts
                    x = G.ggml_add(ctx, outs[0], outs[1])
                    outputs += outs[2:]
                else:
                    outputs += outs
            # the layers' KV writes first, in layer order: graph order is run order, and a layer's
            # attention (reached only through later layers or the outputs) then follows its write
            return inputs, ([x] if whole else []) + outputs, effects

        return build

    def _layer_nodes(self, ctx, new, step: Step, shared: dict, x, layer: LayerSpec, prune: bool = False):
        """One layer's nodes from its input x: (its inputs, in LayerSpec.ptrs' order; its outputs,
        in LayerOut's order; its KV writes). prune: after the attention only shared["out_rows"]
        go on (the FFN and every output then have those rows)."""
        cfg = self.cfg
        G = ggml_lib()
        N, H = step.n, cfg.hidden
        attn, router, routed = layer.attn, layer.router, layer.routed
        one = None if routed is None else routed.one

        attn_norm, ffn_norm = new(H), new(H)
        a = G.ggml_mul(ctx, G.ggml_rms_norm(ctx, x, cfg.rms_eps), attn_norm)
        nodes = (self._mla_nodes if type(attn) is MLAttention else
                 self._deltanet_nodes if type(attn) is GatedDeltaNet else self._gqa_nodes)
        ins, o, writes = nodes(ctx, new, step, shared, a, layer)
        inputs = [attn_norm, ffn_norm] + ins
        w_router = r_bias = None
        if router is not None:
            w_router = new(H, router.shape[0])
            inputs.append(w_router)
        if routed is not None and routed.bias is not None:
            r_bias = new(router.shape[0])
            inputs.append(r_bias)
        if one is not None:  # the stack (weights, biases), then the slot table
            ws, bias = stack_tensors(ctx, one.stack)
            inputs += ws + [b for b in bias if b is not None]
            if one.slot_of is not None:
                slot_of = new(1, router.shape[0], type=G.GGML_TYPE_I32)
                inputs.append(slot_of)

        x_out = G.ggml_add(ctx, x, o)
        if prune:  # every row's keys are written above; only the rows read later take the FFN
            x_out = G.ggml_get_rows(ctx, x_out, shared["out_rows"])
            N = x_out.contents.ne[1]
        h = G.ggml_mul(ctx, G.ggml_rms_norm(ctx, x_out, cfg.rms_eps), ffn_norm)
        dense = None
        if layer.dense is not None:  # a dense layer's FFN, or the shared expert (its inputs last)
            ins, dense = layer.dense.nodes(ctx, new, h)
            inputs += ins
        if routed is None:
            if dense is not None:
                return inputs, [x_out, dense], writes
            outputs = [x_out, h]
            if w_router is not None:
                outputs.append(G.ggml_mul_mat(ctx, w_router, h))
            return inputs, outputs, writes
        # the routing (llama.cpp's build_moe_ffn) and, from one stack, the routed experts
        ids, weights = routed.rule(ctx, G.ggml_mul_mat(ctx, w_router, h), cfg, r_bias)  # [k, N] each
        outputs = [x_out] + ([h] if routed.keep_h else [])
        if one is not None:
            n_k = ids.contents.ne[0]
            picks = ids
            if one.slot_of is not None:  # expert -> its slot's row of the slot stack
                picks = G.ggml_reshape_2d(ctx, G.ggml_get_rows(ctx, slot_of, G.ggml_reshape_1d(ctx, ids, n_k * N)), n_k, N)
            y = moe_ffn(ctx, ws, bias, self.act, G.ggml_reshape_3d(ctx, h, H, 1, N), picks,
                        G.ggml_reshape_3d(ctx, weights, 1, n_k, N))
            if dense is not None:  # routed + shared, the torch path's order
                y = G.ggml_add(ctx, G.ggml_reshape_2d(ctx, y, H, N), dense)
            outputs.append(y)
        elif dense is not None:  # the experts run after the graph; the shared expert already ran
            outputs.append(dense)
        return inputs, outputs + [ids, weights], writes

    def _pools(self, ctx, new, step: Step, shared: dict, D: int, heads: int, types: tuple):
        """A layer's KV pools [D, rows, heads], one per cache type in `types` (its K and V rows, or
        MLA's one latent), and the step's keys read from each, [D, keys_pad, heads, B], as stored
        (a float16 or quantised row is what flash attention reads): (the inputs, the pools then in
        view mode the reads, in gather mode the raw aliases; pools; reads).

        Gathering whole blocks: ggml_get_rows would dequantise a float16 or quantised row into
        float32, so such a pool is read again as raw blocks (an int32 alias of the same bytes: a
        16-token block is a multiple of 4 bytes in every type), gathered as they are, and the
        gathered bytes are seen as rows of the pool's type (a view whose type is set after it is
        made: ggml has no op that reinterprets bytes)."""
        G = ggml_lib()
        B, t, keys_pad = step.key[:3]
        rows = step.rows
        kinds = [getattr(G, f"GGML_TYPE_{c.upper()}") for c in types]  # f32 -> GGML_TYPE_F32, q8_0 -> ..._Q8_0
        pools = [new(D, rows, heads, type=k) for k in kinds]
        row = [p.contents.nb[1] for p in pools]  # bytes of one token's row of one head
        if step.read_base >= 0:
            reads = []
            for k, rb in zip(kinds, row):  # [D, keys, heads, B] over the pool: head-major rows
                kr = new(D, keys_pad, heads, B, type=k)
                kr.contents.nb[2] = rows * rb
                kr.contents.nb[3] = step.gap * rb
                reads.append(kr)
            return pools + reads, pools, reads
        nb = keys_pad // BLOCK_SIZE
        reads, aliases = [], []
        for pool, k, rb in zip(pools, kinds, row):
            if k == G.GGML_TYPE_F32:
                blocks = G.ggml_view_3d(ctx, pool, BLOCK_SIZE * D, rows // BLOCK_SIZE, heads,
                                        rb * BLOCK_SIZE, pool.contents.nb[2], 0)
                got = G.ggml_get_rows(ctx, blocks, shared["idx"])  # [16 D, B * nb, heads]
                reads.append(G.ggml_view_4d(ctx, got, D, keys_pad, heads, B, rb, got.contents.nb[2],
                                            nb * BLOCK_SIZE * rb, 0))
                continue
            words = BLOCK_SIZE * rb // 4  # one block of one head, as int32 words
            raw = new(words, rows // BLOCK_SIZE, heads, type=G.GGML_TYPE_I32)  # the pool's bytes again
            aliases.append(raw)
            got = G.ggml_get_rows(ctx, raw, shared["idx"])  # [words, B * nb, heads]: the blocks as stored
            kr = G.ggml_view_4d(ctx, got, words, nb, heads, B, words * 4, got.contents.nb[2], nb * words * 4, 0)
            c = kr.contents  # the same bytes, seen as [D, keys_pad, heads, B] rows of the pool's type
            c.type, c.ne[0], c.ne[1], c.nb[0], c.nb[1] = k, D, keys_pad, G.ggml_type_size(k), rb
            reads.append(kr)
        return pools + aliases, pools, reads

    @staticmethod
    def _float_reads(ctx, step: Step, reads: tuple) -> tuple:
        """The step's key and value reads ([D, keys_pad, heads, B]) as float32 copies where a
        sequence brings float_read_rows() (StageOptions.fa_tiled_rows) query rows or more and one of
        them is quantised (ggml's tiled flash attention then runs: FLOAT_READ_ROWS says why), else
        as they are (step.float_reads)."""
        G = ggml_lib()
        B, t, keys_pad = step.key[:3]
        if not step.float_reads:
            return reads
        heads = reads[0].contents.ne[2]
        # rows 0 .. keys_pad - 1 for every head and sequence: one run of them, its head and
        # sequence strides 0; a constant leaf, as _hadamard's matrix
        idx = G.ggml_new_tensor_3d(ctx, G.GGML_TYPE_I32, keys_pad, heads, B)
        idx.contents.nb[1] = idx.contents.nb[2] = idx.contents.nb[3] = 0
        idx.contents.data = _key_rows(keys_pad).data_ptr()
        return tuple(G.ggml_get_rows(ctx, r, idx) for r in reads)  # [D, keys_pad, heads, B] float32

    @staticmethod
    def _hadamard(ctx, shared: dict, x, n: int):
        """x with each run of n values turned by the Walsh-Hadamard matrix H (n = 0: x itself), as
        llama.cpp's llama_mul_mat_hadamard: a mul_mat hinted GGML_HINT_SRC0_IS_HADAMARD, which
        ggml's CPU backend runs as a fast transform (stages/blocks/kv_rotation.py says why)."""
        if not n:
            return x
        G = ggml_lib()
        h = shared["hadamard"].get(n)
        if h is None:  # a constant leaf of the graph, never an input: it keeps the process's one copy
            h = shared["hadamard"][n] = G.ggml_new_tensor_2d(ctx, G.GGML_TYPE_F32, n, n)
            h.contents.data = hadamard(n).data_ptr()
        ne = list(x.contents.ne)
        rows = ne[0] * ne[1] * ne[2] * ne[3] // n
        flat = G.ggml_reshape_2d(ctx, x, n, rows) if G.ggml_is_contiguous(x) else G.ggml_cont_2d(ctx, x, n, rows)
        y = G.ggml_mul_mat(ctx, h, flat)
        G.ggml_mul_mat_set_hint(y, G.GGML_HINT_SRC0_IS_HADAMARD)
        return G.ggml_reshape_4d(ctx, y, *ne)

    def _rope(self, ctx, shared: dict, x, n_rot: int):
        """ggml_rope_ext as the torch path's RoPE turns x (stages/blocks/rope.py): its style, linear
        scaling, YaRN through its frequencies as divisors and its attention factor on cos/sin."""
        cfg, G = self.cfg, ggml_lib()
        mode = G.GGML_ROPE_TYPE_NORMAL if cfg.rope_style == "normal" else G.GGML_ROPE_TYPE_NEOX
        freq_scale = 1.0 / cfg.rope_scale if cfg.rope_scaling == "linear" else 1.0
        factors = shared["factors"]
        mscale = cfg.yarn_attn_factor if factors is not None else 1.0
        return G.ggml_rope_ext(ctx, x, shared["pos"], factors, n_rot, mode, 0, cfg.rope_theta, freq_scale, 0.0,
                               mscale, 0.0, 0.0)

    def _gqa_nodes(self, ctx, new, step: Step, shared: dict, a, layer: LayerSpec):
        """GQA from the normed input a [H, N]: (its inputs: weights, optional vectors, pools and
        reads; its output W_o o (+ b) [H, N]; its KV writes)."""
        cfg = self.cfg
        G = ggml_lib()
        B, t, keys_pad, padded = step.key[:4]
        N, H, D = step.n, cfg.hidden, cfg.head_dim
        nh, nkv = cfg.n_heads, cfg.n_kv_heads
        Q, KV = nh * D, nkv * D
        eps = cfg.rms_eps
        n_rot = cfg.rope_dim or D
        scale = cfg.attn_scale or D ** -0.5
        attn = layer.attn
        w_qkv, w_o = attn.w_qkv[0], attn.w_o
        write_rows, mask = shared["write_rows"], shared["mask"]
        gated = type(attn) is GatedAttention  # attn_q yields per head [q, gate] (qwen3next, qwen35moe)
        Qg = 2 * Q if gated else Q  # the q part's width in the projection

        wq, wo = graph_weight(ctx, w_qkv), graph_weight(ctx, w_o)
        b_qkv, q_norm, k_norm, b_o, sinks = (new(n) if o is not None else None
                                             for o, n in zip(layer.optional(), (Q + 2 * KV, D, D, H, nh)))
        inputs = [wq, wo] + [e for e in (b_qkv, q_norm, k_norm, b_o, sinks) if e is not None]
        ins, (k_pool, v_pool), (k_read, v_read) = self._pools(ctx, new, step, shared, D, nkv,
                                                              (step.types.k, step.types.v))
        inputs += ins
        k_read, v_read = self._float_reads(ctx, step, (k_read, v_read))

        qkv = graph_mul_mat(ctx, w_qkv, wq, a)  # [Q + 2 KV, N]
        if b_qkv is not None:
            qkv = G.ggml_add(ctx, qkv, b_qkv)
        nb1 = qkv.contents.nb[1]
        q = G.ggml_view_3d(ctx, qkv, D, nh, N, (Qg // nh) * 4, nb1, 0)
        k = G.ggml_view_3d(ctx, qkv, D, nkv, N, D * 4, nb1, Qg * 4)
        v = G.ggml_view_3d(ctx, qkv, D, nkv, N, D * 4, nb1, (Qg + KV) * 4)
        gate = None
        if gated:
            gate = G.ggml_cont_2d(ctx, G.ggml_view_3d(ctx, qkv, D, nh, N, 2 * D * 4, nb1, D * 4), Q, N)
        if q_norm is not None:
            q = G.ggml_mul(ctx, G.ggml_rms_norm(ctx, q, eps), q_norm)
            k = G.ggml_mul(ctx, G.ggml_rms_norm(ctx, k, eps), k_norm)
        q, k = self._rope(ctx, shared, q, n_rot), self._rope(ctx, shared, k, n_rot)
        # a quantised pool's rows turned first, as llama.cpp turns them (stages/blocks/kv_rotation.py):
        # q with k (their dot products unchanged), v now and the output back after attention
        rot_k, rot_v = rotation(step.types.k, D, "k"), rotation(step.types.v, D, "v")
        q, k = self._hadamard(ctx, shared, q, rot_k), self._hadamard(ctx, shared, k, rot_k)
        v = self._hadamard(ctx, shared, v, rot_v)
        # the step's k/v into the pool: [D, N, kv heads] rows at write_rows, every head
        wk = G.ggml_set_rows(ctx, k_pool, G.ggml_permute(ctx, k, 0, 2, 1, 3), write_rows)
        wv = G.ggml_set_rows(ctx, v_pool, G.ggml_permute(ctx, v, 0, 2, 1, 3), write_rows)
        if padded:  # packed tokens -> [B, t] query rows
            q = G.ggml_get_rows(ctx, G.ggml_reshape_2d(ctx, q, Q, N), shared["pad"])
        q4 = G.ggml_permute(ctx, G.ggml_reshape_4d(ctx, q, D, nh, t, B), 0, 2, 1, 3)  # [D, t, heads, B]
        if attn.window:
            mask = shared["windows"][attn.window]
        o = G.ggml_flash_attn_ext(ctx, q4, k_read, v_read, mask, scale, 0.0, 0.0)  # [D, heads, t, B]
        G.ggml_flash_attn_ext_set_prec(o, G.GGML_PREC_F32)
        if sinks is not None:  # a learned logit per head in each softmax's denominator (gpt-oss)
            G.ggml_flash_attn_ext_add_sinks(o, sinks)
        o = G.ggml_reshape_2d(ctx, self._hadamard(ctx, shared, o, rot_v), Q, B * t)
        if padded:  # and back to the packed tokens
            o = G.ggml_get_rows(ctx, o, shared["unpad"])
        if gate is not None:  # the per-head output gate
            o = G.ggml_mul(ctx, o, G.ggml_sigmoid(ctx, gate))
        o = graph_mul_mat(ctx, w_o, wo, o)
        if b_o is not None:
            o = G.ggml_add(ctx, o, b_o)
        return inputs, o, [wk, wv]

    def _deltanet_nodes(self, ctx, new, step: Step, shared: dict, a, layer: LayerSpec):
        """A Gated DeltaNet token mixer (stages/blocks/deltanet.py, llama.cpp's qwen3next.cpp /
        qwen35moe.cpp) from the normed input a [H, N]: (its inputs: the projections, conv kernel,
        dt bias, A, gated norm weight, then the layer's conv and recurrent state pools; its output
        [H, N]; its two state writes).

        The step's sequences read their states from the pools where they lie when their slots are
        consecutive (views: an engine lane's neighbouring slots), else by slot (ggml_get_rows at the
        step's state slots), run as [B, t] (padded queries where their token counts differ: a pad row's
        beta and decay are 0, so it leaves the state as it is), and write the new states back in
        place (ggml_set_rows): the conv state is the last K-1 inputs of each sequence's real
        tokens, the recurrent state ggml_gated_delta_net's final one."""
        cfg, G = self.cfg, ggml_lib()
        dn = cfg.deltanet
        B, t, _, padded = step.key[:4]
        N, M = step.n, B * t
        C, Vd, Hv, Hk, Dk, Dv, K = (dn.conv_dim, dn.value_dim, dn.n_v_heads, dn.n_k_heads, dn.head_k_dim,
                                     dn.head_v_dim, dn.conv_kernel)
        Kd = dn.key_dim
        attn = layer.attn
        idx = shared["state_idx"]

        ws = [graph_weight(ctx, w) for w in attn.w_in]
        wo = graph_weight(ctx, attn.w_out)
        conv_w, dt_bias, A, norm_w = new(K, C), new(Hv), new(Hv), new(Dv)
        conv_pool, rec_pool = new((K - 1) * C, step.n_slots), new(Dk * Dv * Hv, step.n_slots)
        inputs = ws + [wo, conv_w, dt_bias, A, norm_w, conv_pool, rec_pool]
        if step.state_base >= 0:  # consecutive slots: the states read where they lie (views of the pools)
            conv_rows, rec_rows = new((K - 1) * C, B), new(Dk * Dv * Hv, B)
            inputs += [conv_rows, rec_rows]
        else:  # gathered by slot
            conv_rows, rec_rows = G.ggml_get_rows(ctx, conv_pool, idx), G.ggml_get_rows(ctx, rec_pool, idx)

        # [qkv (C); z (Vd); beta (Hv); alpha (Hv)] per token: one matmul where the parts share a type
        parts = [graph_mul_mat(ctx, w, wt, a) for w, wt in zip(attn.w_in, ws)]
        proj = parts[0]
        for p in parts[1:]:
            proj = G.ggml_concat(ctx, proj, p, 0)
        R = C + Vd + 2 * Hv
        rp = G.ggml_get_rows(ctx, proj, shared["pad"]) if padded else proj  # [R, B * t]
        rb = R * 4
        qkv = G.ggml_view_3d(ctx, rp, C, t, B, rb, rb * t, 0)
        beta = G.ggml_sigmoid(ctx, G.ggml_cont(ctx, G.ggml_view_2d(ctx, rp, Hv, M, rb, (C + Vd) * 4)))
        alpha = G.ggml_cont(ctx, G.ggml_view_2d(ctx, rp, Hv, M, rb, (C + Vd + Hv) * 4))
        g = G.ggml_mul(ctx, G.ggml_softplus(ctx, G.ggml_add(ctx, alpha, dt_bias)), A)  # log decay, <= 0
        if padded:
            beta, g = G.ggml_mul(ctx, beta, shared["valid"]), G.ggml_mul(ctx, g, shared["valid"])
        beta, g = G.ggml_reshape_4d(ctx, beta, 1, Hv, t, B), G.ggml_reshape_4d(ctx, g, 1, Hv, t, B)

        # the short conv over [conv state (K-1), the step's tokens] per sequence, time first
        state = G.ggml_reshape_3d(ctx, conv_rows, K - 1, C, B)
        conv_in = G.ggml_concat(ctx, state, G.ggml_transpose(ctx, qkv), 0)  # [K-1+t, C, B]
        ci = conv_in.contents
        writes = []
        ends = [t] * B if not padded else list(step.n_new)
        if not padded:  # every sequence's new conv state: its last K-1 inputs
            last = G.ggml_cont(ctx, G.ggml_view_3d(ctx, conv_in, K - 1, C, B, ci.nb[1], ci.nb[2], t * 4))
            writes.append(G.ggml_set_rows(ctx, conv_pool, G.ggml_reshape_2d(ctx, last, (K - 1) * C, B), idx))
        else:  # each its own: its real tokens end at its own count
            for i, n in enumerate(ends):
                last = G.ggml_cont(ctx, G.ggml_view_2d(ctx, conv_in, K - 1, C, ci.nb[1], i * ci.nb[2] + n * 4))
                writes.append(G.ggml_set_rows(ctx, conv_pool, G.ggml_reshape_2d(ctx, last, (K - 1) * C, 1),
                                              G.ggml_view_1d(ctx, idx, 1, i * 4)))
        mixed = G.ggml_silu(ctx, G.ggml_ssm_conv(ctx, conv_in, conv_w))  # [C, t, B]

        cb = C * 4
        q = G.ggml_view_4d(ctx, mixed, Dk, Hk, t, B, Dk * 4, cb, cb * t, 0)
        k = G.ggml_view_4d(ctx, mixed, Dk, Hk, t, B, Dk * 4, cb, cb * t, Kd * 4)
        v = G.ggml_cont(ctx, G.ggml_view_4d(ctx, mixed, Dv, Hv, t, B, Dv * 4, cb, cb * t, 2 * Kd * 4))
        # L2 normalised as the torch rule's l2norm (x / sqrt(sum x^2 + 1e-6)), llama.cpp's form
        q, k = (G.ggml_scale(ctx, G.ggml_rms_norm(ctx, x, L2_EPS / Dk), Dk ** -0.5) for x in (q, k))
        if Hv != Hk and dn.v_order == "grouped":  # v head h reads k head h // r: repeat each k head r times
            r = Hv // Hk
            q, k = (G.ggml_reshape_4d(ctx, G.ggml_repeat_4d(ctx, G.ggml_reshape_4d(ctx, x, Dk, 1, Hk, t * B),
                                                             Dk, r, Hk, t * B), Dk, Hv, t, B) for x in (q, k))
        s = G.ggml_reshape_4d(ctx, rec_rows, Dk, Dv, Hv, B)
        out = G.ggml_gated_delta_net(ctx, q, k, v, g, beta, s, 1)  # [o (Vd x M); final states (B of them)]
        o = G.ggml_view_2d(ctx, out, Vd, M, Vd * 4, 0)
        new_s = G.ggml_view_2d(ctx, out, Dk * Dv * Hv, B, Dk * Dv * Hv * 4, Vd * M * 4)
        writes.append(G.ggml_set_rows(ctx, rec_pool, new_s, idx))
        if padded:  # back to the packed tokens
            o = G.ggml_get_rows(ctx, o, shared["unpad"])
        # the norm-gated output, RMSNorm(o) * w * silu(z) per head, and the output projection
        z = G.ggml_cont(ctx, G.ggml_view_3d(ctx, proj, Dv, Hv, N, Dv * 4, proj.contents.nb[1], C * 4))
        o = G.ggml_mul(ctx, G.ggml_rms_norm(ctx, G.ggml_reshape_3d(ctx, o, Dv, Hv, N), cfg.rms_eps), norm_w)
        o = G.ggml_reshape_2d(ctx, G.ggml_mul(ctx, o, G.ggml_silu(ctx, z)), Vd, N)
        return inputs, graph_mul_mat(ctx, attn.w_out, wo, o), writes

    def _mla_nodes(self, ctx, new, step: Step, shared: dict, a, layer: LayerSpec):
        """MLA (stages/blocks/mla.py, the weight-absorbed form of llama.cpp's deepseek2.cpp) from the normed
        input a [H, N]: (its inputs: MLAttention.weights, the latent pool and its read; its output
        [H, N]; its latent KV write). Every query head reads the one key head [latent, k_pe] of
        C + R values a cached token; the value is the first C of the same rows: a view of the
        gathered keys, or in view mode a second input at the keys' address (ggml checks a view's
        dense size against its source's strided size, which sequences' overlapping windows make
        smaller: two prompts of 20 and 13 tokens in blocks 0-1 and 2-3 aborted the process)."""
        cfg = self.cfg
        G = ggml_lib()
        B, t, keys_pad, padded = step.key[:4]
        N, nh, C = step.n, cfg.n_heads, cfg.kv_lora_rank
        attn = layer.attn
        R, nope, Dv = attn.rope_dim, attn.nope, cfg.v_head_dim
        D = nope + R  # a query head's width as the file has it
        eps = cfg.rms_eps

        def weight(w):
            if not isinstance(w, QMatrix):
                return new(w.numel())
            if w.backend == "exact":  # a float k_b / v_b, held as float32
                return new(w.shape[1], w.shape[0])
            return graph_weight(ctx, w)

        ws = [weight(w) for w in attn.weights()]
        if attn.w_q is not None:
            wq, wkv, kv_norm, wk_b, wv_b, wo = ws
            q = graph_mul_mat(ctx, attn.w_q, wq, a)
        else:  # q through its LoRA bottleneck and its norm
            wq_a, q_norm, wq_b, wkv, kv_norm, wk_b, wv_b, wo = ws
            q = graph_mul_mat(ctx, attn.w_q_a, wq_a, a)
            q = graph_mul_mat(ctx, attn.w_q_b, wq_b, G.ggml_mul(ctx, G.ggml_rms_norm(ctx, q, eps), q_norm))
        # k_b / v_b as one matrix per head (plain blocks: MLAttention keeps them unrepacked)
        wk_b = G.ggml_reshape_3d(ctx, wk_b, nope, C, nh)  # [nope, C, heads]
        wv_b = G.ggml_reshape_3d(ctx, wv_b, C, Dv, nh)  # [C, v, heads]
        ins, (pool,), (k_read,) = self._pools(ctx, new, step, shared, C + R, 1, (step.types.k,))
        inputs = ws + ins

        nb1 = q.contents.nb[1]
        q_nope = G.ggml_view_3d(ctx, q, nope, nh, N, D * 4, nb1, 0)
        q_pe = self._rope(ctx, shared, G.ggml_view_3d(ctx, q, R, nh, N, D * 4, nb1, nope * 4), R)  # [R, heads, N]
        ckv = graph_mul_mat(ctx, attn.w_kv_a, wkv, a)  # [C + R, N]
        latent = G.ggml_mul(ctx, G.ggml_rms_norm(ctx, G.ggml_view_2d(ctx, ckv, C, N, ckv.contents.nb[1], 0), eps),
                            kv_norm)
        k_pe = self._rope(ctx, shared, G.ggml_view_3d(ctx, ckv, R, 1, N, ckv.contents.nb[1], ckv.contents.nb[1], C * 4), R)
        # the step's latent and rope key into the pool: one row of C + R per token
        entry = G.ggml_concat(ctx, latent, G.ggml_reshape_2d(ctx, k_pe, R, N), 0)  # [C + R, N]
        rot = rotation(step.types.k, C + R, "k")  # a quantised latent turned first (kv_rotation.py)
        entry = self._hadamard(ctx, shared, entry, rot)
        write = G.ggml_set_rows(ctx, pool, G.ggml_reshape_3d(ctx, entry, C + R, N, 1), shared["write_rows"])

        # the query into latent space per head: q_lat = k_b^T q_nope, then [q_lat, q_pe]
        q_lat = G.ggml_mul_mat(ctx, wk_b, G.ggml_permute(ctx, q_nope, 0, 2, 1, 3))  # [C, N, heads]
        query = G.ggml_concat(ctx, G.ggml_permute(ctx, q_lat, 0, 2, 1, 3), q_pe, 0)  # [C + R, heads, N]
        query = self._hadamard(ctx, shared, query, rot)
        if padded:  # packed tokens -> [B, t] query rows
            query = G.ggml_get_rows(ctx, G.ggml_reshape_2d(ctx, query, (C + R) * nh, N), shared["pad"])
        q4 = G.ggml_permute(ctx, G.ggml_reshape_4d(ctx, query, C + R, nh, t, B), 0, 2, 1, 3)  # [C + R, t, heads, B]
        kr = k_read.contents
        if step.read_base >= 0:  # view mode: the value is a second input at the key's address (below)
            v_read = new(C, kr.ne[1], kr.ne[2], kr.ne[3], type=kr.type)
            for i in (1, 2, 3):
                v_read.contents.nb[i] = kr.nb[i]
            inputs.append(v_read)
        (k_float,) = self._float_reads(ctx, step, (k_read,))
        if k_float is not k_read or step.read_base < 0:  # the value: the first C of each (float) key row
            k_read, kr = k_float, k_float.contents  # (view mode's second input then unread)
            v_read = G.ggml_view_4d(ctx, k_read, C, kr.ne[1], kr.ne[2], kr.ne[3], kr.nb[1], kr.nb[2], kr.nb[3], 0)
        o = G.ggml_flash_attn_ext(ctx, q4, k_read, v_read, shared["mask"], attn.scale, 0.0, 0.0)  # [C, heads, t, B]
        G.ggml_flash_attn_ext_set_prec(o, G.GGML_PREC_F32)
        o = G.ggml_reshape_2d(ctx, self._hadamard(ctx, shared, o, rot), C * nh, B * t)  # the value's rows turned back
        if padded:  # and back to the packed tokens
            o = G.ggml_get_rows(ctx, o, shared["unpad"])
        # out of latent space per head through v_b, then the output projection
        o = G.ggml_mul_mat(ctx, wv_b, G.ggml_permute(ctx, G.ggml_reshape_3d(ctx, o, C, nh, N), 0, 2, 1, 3))  # [v, N, heads]
        o = G.ggml_cont_2d(ctx, G.ggml_permute(ctx, o, 0, 2, 1, 3), Dv * nh, N)
        return inputs, graph_mul_mat(ctx, attn.w_o, wo, o), [write]
