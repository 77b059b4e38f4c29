"""Feed-forward blocks: the dense SwiGLU FFN and the MoE block; both are `forward(h)`.

The MoE block routes each token to k experts and hands the routed tokens to the `Experts` it was
built with. `HostExperts` computes every expert from the GGUF mapping's quantised blocks (the host
copy); an ExpertCache (moeray.cache) counts each lookup, computes hot experts from its slots and
passes the rest to the host copy. Weights are quantised blocks, never float32 copies.

On the ggml backend a layer's picks run as one graph over the stacked expert tensor
(stages/blocks/expert_graph.py: mul_mat_id, tokens grouped inside the op); the per-expert path below
(`ExpertWeights`, one call per expert) is the torch backend's, for dequant/exact and CUDA slots.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, NamedTuple, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from moeray.stages.kernels import repack
from moeray.stages.arch import arch_of
from moeray.stages.arch.config import ModelConfig
from moeray.stages.blocks.expert_graph import OneStack, Part, Stack, add_picks, fusable, run
from moeray.stages.gguf.reader import EXPERT_KINDS, GGUFFile, expert_bytes
from moeray.stages.kernels.host_memory import weight_buffer
from moeray.stages.kernels.backend import current_backend
from moeray.stages.kernels.qmatmul import SILU, GLU, ExpertBias, QMatrix, swiglu, to_device
from moeray.stages.gguf.quant import as_uint8_tensor, dequantize
from moeray.stages.blocks.routing import GRAPH_ROUTING, ROUTING

log = logging.getLogger("moeray.kernels")

RouteObserver = Callable[[int, torch.Tensor, torch.Tensor], None]  # (layer, ids [N, k], weights [N, k])


class ExpertWeights(NamedTuple):
    gate: QMatrix  # [F, H]
    up: QMatrix  # [F, H]
    down: QMatrix  # [H, F]
    bias: ExpertBias | None = None  # per-expert biases, where the file has them (gpt-oss)
    act: GLU = SILU  # the model's expert activation (cfg.expert_act)

    @property
    def nbytes(self) -> int:
        n = self.gate.nbytes + self.up.nbytes + self.down.nbytes
        return n if self.bias is None else n + sum(b.numel() * b.element_size() for b in self.bias)

    @property
    def device(self) -> torch.device:
        return self.gate.device

    def to(self, device: torch.device | str) -> "ExpertWeights":
        bias = None if self.bias is None else ExpertBias(*(to_device(b, device) for b in self.bias))
        return ExpertWeights(self.gate.to(device), self.up.to(device), self.down.to(device), bias, self.act)

    def compute(self, h: torch.Tensor) -> torch.Tensor:
        return swiglu(h, self.gate, self.up, self.down, self.act, self.bias)

    def __call__(self, h: torch.Tensor, h_here: torch.Tensor | None = None) -> torch.Tensor:
        """[n, H] -> [n, H] on h's device; a host-held expert on a device stage computes on the host
        (from `h_here`, h already copied to this expert's device, when the caller has it)."""
        if self.device != h.device:
            y = self.compute(h.to(self.device) if h_here is None else h_here)
            return to_device(y, h.device)  # pinned and asynchronous: no wait for the card's queue
        return self.compute(h)


# slot_weights(layer, expert) -> the expert's weights in a slot, or None (compute it from the host)
SlotLookup = Callable[[int, int], "ExpertWeights | None"]


class Experts(Protocol):
    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], ids/weights [N, k] -> Σ_r weights[:, r] · expert_{ids[:, r]}(x), [N, H]."""
        ...

    # Optional (HostExperts, ExpertCache on the ggml backend): the fused MoE layer's side.
    # one_stack(layer) -> OneStack | None: the stack that serves every pick of the coming step;
    # after_one_stack(layer, ids, weights, one): the counting forward would have done, afterwards.


class _OnHost:
    """A step's activations on the host, copied from the card the first time a host-held expert
    needs them (then each miss indexes the host copy instead of copying its rows down again)."""

    def __init__(self):
        self.copy: torch.Tensor | None = None

    def of(self, x: torch.Tensor, tok: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        """x[tok] (all of x when tok is None) on `device` when that is not x's device, else None."""
        if device == x.device:
            return None
        if self.copy is None:
            self.copy = x.to(device)
        return self.copy if tok is None else self.copy[tok]


class HostExperts:
    """Every routed expert computed from the quantised blocks in the GGUF mapping (zero-copy views:
    the mapping is the host copy). `on_route` sees every routing decision (a trace writer)."""

    def __init__(self, gguf: GGUFFile, backend: str | None = None, on_route: RouteObserver | None = None):
        self.gguf, self.config = gguf, gguf.config
        self.backend = backend or current_backend()
        self.act = GLU.of(self.config)
        self.on_route = on_route
        self.computed = 0  # experts computed from the host copy so far (a measure of host work)
        self._stacks: dict[int, Stack | None] = {}
        # StageOptions.host_experts: "mapped" (the file's bytes in place), "repacked" (a copy), "auto"
        # (a copy when it fits, decided per prepare() call); _packed: the layers copied or to copy.
        self.layout = repack.host_experts()
        self._packed: set[int] = set()
        self._one: dict[int, OneStack] = {}  # one_stack's answer per layer (the mapping's stack)
        self._arena: torch.Tensor | None = None  # while prepare() copies: one buffer for its layers
        self._arena_used = 0

    def prepare(self, first: int, end: int, reserve: int = 0) -> None:
        """Build the stacks of layers [first, end) now (a stage's load, not its first step): with
        host_experts "repacked" that copies their routed experts into one huge-page buffer
        (repacked where ggml can), after checking that it fits in the memory the system has
        available; with "auto" only when 4 GiB stay free beside `reserve` bytes (a cache's slots,
        which fill later)."""
        todo = [l for l in range(first, end) if l not in self._stacks]
        need = sum(self._copy_bytes(l) for l in todo) if self.backend == "ggml" else 0
        what = f"layers [{first}, {end})"
        if need and self.layout == "repacked":
            repack.check_fits(need, what)
            self._packed.update(todo)
        elif need and self.layout == "auto":
            if repack.fits(need + reserve, repack.AUTO_HEADROOM_BYTES):  # reserve: the stage's slots
                self._packed.update(todo)
            log.info(repack.auto_line(need, what, todo[0] in self._packed))
        if todo and todo[0] in self._packed:  # one buffer for them all: far fewer page faults
            self._arena, self._arena_used = weight_buffer(need + 64 * 3 * len(todo)), 0
        for l in range(first, end):
            self.stack(l)
        self._arena = None  # the stacks' views keep it alive

    def _copy_bytes(self, layer: int) -> int:
        """Bytes a host copy of the layer's routed experts takes (0: a dense layer, or float32
        experts, which keep the exact torch math and are read in place)."""
        if f"blk.{layer}.ffn_gate_exps.weight" not in self.gguf.tensors:
            return 0
        infos = [self.gguf.info(f"blk.{layer}.ffn_{kind}_exps.weight") for kind in EXPERT_KINDS]
        return sum(t.n_bytes for t in infos) if fusable(t.ggml_type for t in infos) else 0

    def stack(self, layer: int) -> Stack | None:
        """The layer's experts in the mapping as one stacked tensor per kind, for ggml's
        mul_mat_id (None off the ggml backend, or for float32 experts: they keep the exact math)."""
        if layer not in self._stacks:
            self._stacks[layer] = None
            if f"blk.{layer}.ffn_gate_exps.weight" not in self.gguf.tensors:  # a dense layer
                return None
            infos = [self.gguf.info(f"blk.{layer}.ffn_{kind}_exps.weight") for kind in EXPERT_KINDS]
            if self.backend == "ggml" and fusable(t.ggml_type for t in infos):
                raws = [as_uint8_tensor(self.gguf.raw(t.name)) for t in infos]
                parts = tuple(Part(r.data_ptr(), t.ggml_type, t.shape[1], t.shape[2], t.n_bytes // t.shape[0])
                              for r, t in zip(raws, infos))
                stack = Stack(parts, infos[0].shape[0], raws, self.biases(layer))
                if self.layout == "repacked" or layer in self._packed:
                    if layer not in self._packed:  # built lazily, without prepare()
                        repack.check_fits(self._copy_bytes(layer), f"layer {layer}")
                    stack = self._copied(stack, [t.name for t in infos])
                self._stacks[layer] = stack
        return self._stacks[layer]

    # Memory for streamed weights (huge pages, stages/kernels/host_memory.py), also for a CPU stage's slots
    # (cache/slot_store.py asks the host: cache/ does not import stages/).
    weight_buffer = staticmethod(weight_buffer)

    def _buffer(self, n: int) -> torch.Tensor:
        """n bytes for a copied kind: the next 64-byte aligned piece of prepare()'s buffer, or a
        buffer of its own for a layer built lazily."""
        if self._arena is None:
            return weight_buffer(n)
        start = self._arena_used
        self._arena_used = start + (n + 63) // 64 * 64
        return self._arena[start:start + n]

    def _copied(self, stack: Stack, names: list[str]) -> Stack:
        """A copy of the mapped stack in huge-page memory (stages/kernels/host_memory.py), every kind ggml
        has repacked kernels for repacked (whole groups of 8 rows never straddle two experts:
        rows % 8 == 0, so the stacked tensor repacks as one matrix of n * rows rows), the others
        as the file's blocks. Read from the file, not through the mapping (GGUFFile.read_into)."""
        parts, owners, plain = [], [], None
        for p, raw, name in zip(stack.parts, stack.owner, names):
            buf = self._buffer(raw.numel())
            if repack.wanted(p.ggml_type, p.rows, p.cols):
                if plain is None or plain.numel() < raw.numel():
                    plain = torch.empty(raw.numel(), dtype=torch.uint8)  # reused for the next kinds
                self.gguf.read_into(name, plain[:raw.numel()])
                repack.repack_into(buf.data_ptr(), plain.data_ptr(), p.ggml_type, p.rows * stack.n, p.cols, raw.numel())
                p = replace(p, repacked=True)
            else:
                self.gguf.read_into(name, buf)
            parts.append(replace(p, base=buf.data_ptr()))
            owners.append(buf)
        return Stack(tuple(parts), stack.n, owners, stack.biases)

    def stack_in(self, layer: int, base: int, row: int, n: int, owner, biases=(None, None, None)) -> Stack:
        """The layer's experts laid out as the rows of another buffer (a stage's slots): row i
        holds one expert's gate, up and down blocks back to back from base + i * row, each kind in
        the host stack's layout (so a pick gets the same bits from either stack), or repacked
        wherever ggml can under repack "fast"."""
        parts, off = [], 0
        for p in self.stack(layer).parts:
            packed = p.repacked or (repack.mode() == "fast" and repack.wanted(p.ggml_type, p.rows, p.cols))
            parts.append(Part(base + off, p.ggml_type, p.rows, p.cols, row, packed))
            off += p.nbytes
        return Stack(tuple(parts), n, owner, biases)

    @staticmethod
    def write_part(src: QMatrix, part: Part, dst: torch.Tensor) -> None:
        """Write one kind of an expert (its plain blocks, `src`) into `dst` (a slot row's bytes) in
        `part`'s layout: a copy, or ggml's repack."""
        if part.repacked:
            data = src.data.contiguous()
            repack.repack_into(dst.data_ptr(), data.data_ptr(), part.ggml_type, part.rows, part.cols, dst.numel())
        else:
            dst.copy_(src.data)

    def biases(self, layer: int) -> tuple:
        """float32 [E, rows] per kind where the file has blk.L.ffn_{kind}_exps.bias, else None."""
        out = []
        for kind in EXPERT_KINDS:
            name = f"blk.{layer}.ffn_{kind}_exps.bias"
            if name in self.gguf.tensors:
                t = self.gguf.info(name)
                out.append(dequantize(self.gguf.raw(name), t.ggml_type, t.shape).reshape(t.shape[0], -1).contiguous())
            else:
                out.append(None)
        return tuple(out)

    def info(self, layer: int, kind: str):
        """(ggml_type, per-expert shape) of one kind of expert tensor of a layer."""
        t = self.gguf.info(f"blk.{layer}.ffn_{kind}_exps.weight")
        return t.ggml_type, t.shape[1:]

    def weights(self, layer: int, expert: int) -> ExpertWeights:
        parts = []
        for kind in EXPERT_KINDS:
            gtype, shape = self.info(layer, kind)
            parts.append(QMatrix.from_raw(self.gguf.expert_raw(layer, kind, expert), gtype, shape,
                                          self.backend, copy=False))
        bias = None
        if self.config.expert_bias:  # float32 rows of the mapping, no copy (F32 as stored)
            bias = ExpertBias(*(self._bias_row(layer, kind, expert) for kind in EXPERT_KINDS))
        return ExpertWeights(*parts, bias, self.act)

    def _bias_row(self, layer: int, kind: str, expert: int) -> torch.Tensor:
        t = self.gguf.info(f"blk.{layer}.ffn_{kind}_exps.bias")
        return dequantize(self.gguf.expert_raw(layer, kind, expert, "bias"), t.ggml_type, t.shape[1:])

    def slot_bytes(self, layer: int) -> int:
        """Bytes a device copy of one expert of `layer` holds: its GGUF bytes on the quantised
        backends, float32 on the exact backend."""
        return expert_bytes(self.gguf.tensors, layer, self.backend)

    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                slot_weights: SlotLookup | None = None) -> torch.Tensor:
        if self.on_route is not None:
            self.on_route(layer, ids, weights)
        if slot_weights is None and self.stack(layer) is not None:
            return self.forward_stacks(layer, x, ids, weights)
        # One host sync per layer (ids may already be on the host: ExpertCache moves them once);
        # the grouping below is plain Python.
        rows = ids.tolist()
        host = _OnHost()  # x on the host, copied at most once per layer, for the experts a miss computes there
        if len(rows) == 1:  # decode of one sequence: x [1, H] through its k experts
            ys = []
            for e in rows[0]:
                w = self._expert(layer, e, slot_weights)
                ys.append(w(x, host.of(x, None, w.device)))
            ys = torch.cat(ys)  # [k, H]
            return (weights.view(1, -1) @ ys).view(1, -1)
        k = len(rows[0])
        by_expert: dict[int, list[int]] = {}
        for t, row in enumerate(rows):
            for r, e in enumerate(row):
                by_expert.setdefault(e, []).append(t * k + r)  # flat (token, rank) index
        experts = sorted(by_expert)  # a fixed order: the same sum whatever serves each expert
        flat = torch.tensor([i for e in experts for i in by_expert[e]])
        flat_here = flat.to(x.device)  # every expert's picks in one copy, not one per expert
        out = torch.zeros_like(x)
        flat_weights = weights.reshape(-1)
        lo = 0
        for e in experts:
            hi = lo + len(by_expert[e])
            picks, tok_host = flat_here[lo:hi], flat[lo:hi] // k
            tok = picks // k
            w = self._expert(layer, e, slot_weights)
            y = w(x[tok], host.of(x, tok_host, w.device))  # once per step, for all its tokens
            out.index_add_(0, tok, y * flat_weights[picks].unsqueeze(1))
            lo = hi
        return out

    def one_stack(self, layer: int, slots: Stack | None = None, slot_of: torch.Tensor | None = None
                  ) -> OneStack | None:
        """The mapping's stack serves every pick (None off the ggml backend, or for float32
        experts); or the stack `slots` (a stage's slot buffer) by `slot_of`, int32 [E]."""
        stack = self.stack(layer)
        if stack is None:
            return None
        if slots is not None:
            return OneStack(slots, slot_of)
        one = self._one.get(layer)  # the same object every step: the stage graph's key is then cheap
        if one is None or one.stack is not stack:
            one = self._one[layer] = OneStack(stack)
        return one

    def after_one_stack(self, layer: int, ids: torch.Tensor, weights: torch.Tensor, one: OneStack) -> None:
        """What forward counts, for a step whose experts ran inside the layer's graph."""
        if self.on_route is not None:
            self.on_route(layer, ids, weights)
        self.computed += _n_distinct(ids.numpy())

    def after_stage(self, layers: list[int], ids: torch.Tensor, weights: torch.Tensor, ones: list) -> None:
        """after_one_stack for every MoE layer of a step that ran as one stage graph (ids, weights
        [L, N, k]): the distinct experts of each layer counted in one bincount."""
        if self.on_route is not None:
            for l, i, w, one in zip(layers, ids, weights, ones):
                self.after_one_stack(l, i, w, one)
            return
        L = ids.shape[0]
        if L:
            flat = (np.arange(L)[:, None] * self.config.n_experts + ids.numpy().reshape(L, -1)).ravel()
            self.computed += int(np.count_nonzero(np.bincount(flat)))

    def forward_stacks(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       slot_of: np.ndarray | None = None, slots: Stack | None = None) -> torch.Tensor:
        """Every pick of the layer in at most two ggml calls: picks whose `slot_of` entry is >= 0
        from the slot stack `slots` (indexed by slot), the rest from the mapping (by expert).
        Misses are computed on the host; x is copied there once if it lives on a card."""
        ids = ids.to("cpu")  # a no-op when the caller (ExpertCache) already moved them
        xh = x if x.device.type == "cpu" else x.float().to("cpu")
        wh = weights.to("cpu", torch.float32)
        N, k = ids.shape
        # numpy over the [N, k] picks: a few microseconds, against a few tens for torch ops on them
        hit = None if slot_of is None else slot_of >= 0
        if hit is None or not hit.any():
            self.computed += _n_distinct(ids.numpy())
            out = run(self.stack(layer), self.act, xh, ids, wh)
        elif hit.all():
            out = run(slots, self.act, xh, torch.from_numpy(slot_of.astype(np.int32)), wh)
        else:  # split: each stack gets its own picks, one row of x per pick (gathered in numpy)
            flat = hit.reshape(-1)
            flat_hit, flat_miss = np.flatnonzero(flat), np.flatnonzero(~flat)
            x_np, w_np = xh.numpy(), wh.numpy().reshape(-1, 1)
            ids_np = ids.numpy().reshape(-1, 1)
            self.computed += _n_distinct(ids_np[flat_miss])
            slot_ids = slot_of.reshape(-1, 1)[flat_hit].astype(np.int32)
            t = torch.from_numpy
            y_hit = run(slots, self.act, t(x_np[flat_hit // k]), t(slot_ids), t(w_np[flat_hit]))
            y_miss = run(self.stack(layer), self.act, t(x_np[flat_miss // k]), t(ids_np[flat_miss]), t(w_np[flat_miss]))
            out = add_picks(N, k, [(flat_hit, y_hit), (flat_miss, y_miss)], xh.shape[1])
        return out if out.device == x.device else to_device(out, x.device)

    def _expert(self, layer: int, expert: int, slot_weights: SlotLookup | None) -> ExpertWeights:
        w = slot_weights(layer, expert) if slot_weights is not None else None
        if w is None:
            self.computed += 1
            w = self.weights(layer, expert)
        return w

    def close(self) -> None:
        close = getattr(self.on_route, "close", None)
        if close is not None:
            close()


def _n_distinct(ids: np.ndarray) -> int:
    """Distinct experts among a call's picks (bincount: linear, no sort)."""
    return int(np.count_nonzero(np.bincount(ids.reshape(-1)))) if ids.size else 0


class DenseFFN(torch.nn.Module):
    """SwiGLU: down(silu(gate h) * up h)."""

    def __init__(self, gate: QMatrix, up: QMatrix, down: QMatrix):
        super().__init__()
        self.gate, self.up, self.down = gate, up, down

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return swiglu(h, self.gate, self.up, self.down)


class MoEBlock(torch.nn.Module):
    """Router -> the architecture's routing function (stages/blocks/routing.py) -> experts; plus a shared
    expert, gated (qwen2moe: sigmoid(w . h) scales it) or not."""

    def __init__(self, cfg: ModelConfig, layer: int, w_router: torch.Tensor, experts: Experts,
                 shared: DenseFFN | None = None, w_shared_gate: torch.Tensor | None = None,
                 router_bias: torch.Tensor | None = None):
        super().__init__()
        self.cfg, self.layer, self.experts = cfg, layer, experts
        self.register_buffer("w_router", w_router, persistent=False)  # [E, H] float32: small
        self.register_buffer("router_bias", router_bias, persistent=False)  # [E]: a selection bias, where the family has one
        rule = arch_of(cfg).routing
        self.routing = ROUTING[rule]
        # the same rule as graph nodes (the trunk graph routes with it, router_bias its input), where it has them
        self.graph_routing = GRAPH_ROUTING.get(rule)
        self.shared = shared
        self.register_buffer("w_shared_gate", w_shared_gate, persistent=False)

    def route(self, h: torch.Tensor, logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, H] -> (expert ids [N, k], weights [N, k]) in rank order; `logits`: the router's
        output [N, E] when the caller computed it already (the trunk graph does)."""
        if logits is None:
            logits = F.linear(h, self.w_router)
        ids, weights = self.routing(logits, self.cfg, self.router_bias)
        return ids, weights.to(h.dtype)

    def forward(self, h: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        ids, weights = self.route(h, logits)
        return self._with_shared(h, self.experts.forward(self.layer, h, ids, weights))

    def _with_shared(self, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared is not None:
            shared = self.shared(h)
            if self.w_shared_gate is not None:
                shared = torch.sigmoid(F.linear(h, self.w_shared_gate.view(1, -1))) * shared
            out = out + shared
        return out

    # --- the fused layer: routing and routed experts inside the trunk graph (stages/runtime/trunk_graph.py)

    def one_stack(self) -> OneStack | None:
        """The stack that serves every pick of the coming step whatever the ids (Experts.one_stack),
        so the routed experts can run inside the layer's trunk graph after its routing; else None."""
        one = getattr(self.experts, "one_stack", None)
        return one(self.layer) if one is not None else None

    def after_graph(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, one: OneStack | None,
                    experts: torch.Tensor | None = None, shared: torch.Tensor | None = None) -> torch.Tensor:
        """The FFN output of a layer whose routing ran in its trunk graph (ids, weights) but not
        the whole FFN: the routed experts computed now from h, or with `one` already in the graph
        (`experts`, their output) and only counted (as forward counts them); the shared expert's
        output added: `shared` where the graph computed it, else computed now from h."""
        if one is None:
            out = self.experts.forward(self.layer, h, ids, weights)
            return out + shared if shared is not None else self._with_shared(h, out)
        self.count_graph(ids, weights, one)
        return self._with_shared(h, experts)

    def count_graph(self, ids: torch.Tensor, weights: torch.Tensor, one: OneStack) -> None:
        """The experts' counting for a step whose routed experts ran inside a graph."""
        self.experts.after_one_stack(self.layer, ids, weights, one)
