"""Routing functions: router logits -> (expert ids, weights), the rule an architecture names.

Each takes the router's logits [N, E] (float32) and the config, and returns ids [N, k] int64 and
weights [N, k] in rank order (the experts then compute sum_r weights[:, r] * expert_ids[:, r](x)).
Everything a family does to its scores (softmax or sigmoid, a bias, groups, scaling,
renormalisation) happens here, before the experts.
"""
from __future__ import annotations

import torch

from moeray.stages.config import ModelConfig


def softmax_topk(logits: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, the k largest, renormalised to sum to 1 when the config says
    (Mixtral, Qwen-MoE)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, cfg.n_experts_used, dim=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def topk_softmax(logits: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits (the router's bias added to them first), softmax over those k only
    (gpt-oss; llama.cpp's SOFTMAX_WEIGHT gating). Equal to softmax_topk renormalised, without
    the softmax over every expert."""
    if bias is not None:
        logits = logits + bias
    top, ids = torch.topk(logits, cfg.n_experts_used, dim=-1)
    return ids, torch.softmax(top, dim=-1, dtype=torch.float32)


ROUTING = {"softmax_topk": softmax_topk, "topk_softmax": topk_softmax}
