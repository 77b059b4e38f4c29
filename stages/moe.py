"""Feed-forward blocks: the dense SwiGLU FFN and the MoE block with its ExpertSource.

Routed experts are not part of the trunk: the MoE block asks an ExpertSource for the weights of
each expert the step uses, once per step. HostExperts dequantises them from the GGUF's mmap'd
quantised bytes; the cache/ package plugs in a source that serves hot experts from device slots.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from moeray.stages.config import ModelConfig
from moeray.stages.gguf_file import EXPERT_KINDS, GGUFFile
from moeray.stages.quant import dequantize

RoutingHook = Callable[[int, torch.Tensor, torch.Tensor], None]


class ExpertSource(Protocol):
    def get(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w_gate [F, H], w_up [F, H], w_down [H, F]) of one routed expert."""
        ...


class HostExperts:
    """Experts served from the quantised bytes in the GGUF mapping, dequantised when asked for."""

    def __init__(self, gguf: GGUFFile):
        self.gguf = gguf
        self.dequantized = 0  # experts dequantised so far (a measure of host work)

    def info(self, layer: int, kind: str):
        """(ggml_type, per-expert shape) of one kind of expert tensor of a layer."""
        t = self.gguf.info(f"blk.{layer}.ffn_{kind}_exps.weight")
        return t.ggml_type, t.shape[1:]

    def quantized(self, layer: int, expert: int) -> tuple:
        """The expert's stored bytes (gate, up, down) as uint8 views of the mapping (for slot copies)."""
        return tuple(self.gguf.expert_raw(layer, kind, expert) for kind in EXPERT_KINDS)

    def get(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.dequantized += 1
        out = []
        for kind in EXPERT_KINDS:
            gtype, shape = self.info(layer, kind)
            out.append(dequantize(self.gguf.expert_raw(layer, kind, expert), gtype, shape))
        return tuple(out)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


class DenseFFN(torch.nn.Module):
    """SwiGLU with gate and up fused into one matmul."""

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor):
        super().__init__()
        self.register_buffer("w_gate_up", w_gate_up, persistent=False)
        self.register_buffer("w_down", w_down, persistent=False)
        self.ffn = w_down.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = F.linear(x, self.w_gate_up)
        return F.linear(F.silu(gu[:, :self.ffn]) * gu[:, self.ffn:], self.w_down)


class MoEBlock(torch.nn.Module):
    """Router -> softmax -> top-k (-> renormalise) -> experts; plus qwen2moe's gated shared expert."""

    def __init__(self, cfg: ModelConfig, layer: int, w_router: torch.Tensor,
                 shared: DenseFFN | None = None, w_shared_gate: torch.Tensor | None = None):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.register_buffer("w_router", w_router, persistent=False)
        self.shared = shared
        self.register_buffer("w_shared_gate", w_shared_gate, persistent=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, H] -> (expert ids [N, k], weights [N, k]) in rank order."""
        probs = torch.softmax(F.linear(x, self.w_router), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.cfg.n_experts_used, dim=-1)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor, source: ExpertSource, hook: RoutingHook | None = None) -> torch.Tensor:
        ids, weights = self.route(x)
        if hook is not None:
            hook(self.layer, ids, weights)
        k = ids.shape[1]
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # (token, rank) pairs grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.cfg.n_experts).tolist()
        token_of = order // k
        weight_of = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            tok = token_of[start:start + n]
            w_gate, w_up, w_down = source.get(self.layer, expert)  # once per step, for all its tokens
            h = x[tok]
            if w_gate.device != x.device:  # a host-held expert on a device stage: compute it on the host
                y = swiglu(h.to(w_gate.device), w_gate, w_up, w_down).to(x.device)
            else:
                y = swiglu(h, w_gate, w_up, w_down)
            out.index_add_(0, tok, y * weight_of[start:start + n].unsqueeze(1))
            start += n
        if self.shared is not None:
            gate = torch.sigmoid(F.linear(x, self.w_shared_gate.view(1, -1)))
            out = out + gate * self.shared(x)
        return out
