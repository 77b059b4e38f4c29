"""Routing functions: router logits -> (expert ids, weights), the rule an architecture names.

Each takes the router's logits [N, E] (float32) and the config, and returns ids [N, k] int64 and
weights [N, k] in rank order (the experts then compute sum_r weights[:, r] * expert_ids[:, r](x)).
Everything a family does to its scores (softmax or sigmoid, a bias, groups, scaling,
renormalisation) happens here, before the experts.
"""
from __future__ import annotations

import torch

from moeray.stages.arch.config import ModelConfig


def softmax_topk(logits: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, the k largest, renormalised to sum to 1 when the config says
    (Mixtral, Qwen-MoE)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, cfg.n_experts_used, dim=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def grouped_topk(logits: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router (transformers' DeepseekV3TopkRouter, llama.cpp's build_moe_ffn):
    sigmoid (or softmax) scores; the score-correction bias (exp_probs_b) added for choosing only;
    experts in `expert_groups` groups, each group scored by its two best, only the best
    `expert_groups_used` groups chosen from; the k best experts there, weighted by their
    uncorrected scores, renormalised when the config says, times routed_scaling_factor."""
    if cfg.expert_gating == "sigmoid":
        scores = torch.sigmoid(logits.float())
    else:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    choice = scores if bias is None else scores + bias
    G = cfg.expert_groups
    if G > 1:
        N, E = choice.shape
        per_group = choice.view(N, G, E // G)
        group_score = per_group.topk(min(2, E // G), dim=-1).values.sum(dim=-1)  # [N, G]
        keep = torch.zeros(N, G, dtype=torch.bool, device=choice.device)
        keep.scatter_(1, group_score.topk(cfg.expert_groups_used, dim=-1).indices, True)
        choice = per_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(N, E)
    ids = choice.topk(cfg.n_experts_used, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * cfg.expert_weights_scale


def topk_softmax(logits: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits (the router's bias added to them first), softmax over those k only
    (gpt-oss; llama.cpp's SOFTMAX_WEIGHT gating). Equal to softmax_topk renormalised, without
    the softmax over every expert."""
    if bias is not None:
        logits = logits + bias
    top, ids = torch.topk(logits, cfg.n_experts_used, dim=-1)
    return ids, torch.softmax(top, dim=-1, dtype=torch.float32)


ROUTING = {"softmax_topk": softmax_topk, "topk_softmax": topk_softmax, "grouped_topk": grouped_topk}


# --- the same rules as ggml graph nodes (the fused MoE layer, stages/runtime/trunk_graph.py) ----------
# Each: (ctx, logits [E, N], cfg, bias [E] placeholder or None) -> (ids [k, N] int32 in rank
# order, weights [k, N] float32), both new tensors (graph outputs), as llama.cpp's build_moe_ffn
# builds them.

def _picked(ctx, G, scores, ids, E: int, N: int, k: int):
    """scores [E, N] at ids [k, N] -> [k, N] (a view of get_rows' result)."""
    return G.ggml_reshape_2d(ctx, G.ggml_get_rows(ctx, G.ggml_reshape_3d(ctx, scores, 1, E, N), ids), k, N)


def graph_softmax_topk(ctx, logits, cfg: ModelConfig, bias=None):
    """softmax_topk inside a ggml graph (no bias: the rule has none)."""
    from moeray.stages.kernels.backend import ggml_lib

    G = ggml_lib()
    E, N = logits.contents.ne[0], logits.contents.ne[1]
    k = cfg.n_experts_used
    probs = G.ggml_soft_max(ctx, logits)
    ids = G.ggml_cont(ctx, G.ggml_argsort_top_k(ctx, probs, k))  # descending: rank order
    weights = _picked(ctx, G, probs, ids, E, N, k)
    if cfg.norm_topk_prob:  # the sum clamped as llama.cpp does (a top-k of a softmax never nears it)
        total = G.ggml_clamp(ctx, G.ggml_sum_rows(ctx, weights), 6.103515625e-5, float("inf"))
        weights = G.ggml_div(ctx, weights, total)
    else:
        weights = G.ggml_cont(ctx, weights)
    return ids, weights


def graph_grouped_topk(ctx, logits, cfg: ModelConfig, bias=None):
    """grouped_topk inside a ggml graph (DeepSeek-V3, GLM-4.5, Kimi-K2), as build_moe_ffn does it:
    sigmoid (or softmax) scores; + bias for choosing; with groups, each group's two best summed,
    the best `expert_groups_used` groups kept (the others' scores set to -inf through get_rows /
    fill / set_rows); the k best; their uncorrected scores, renormalised (+1e-20, as the torch
    rule), times expert_weights_scale."""
    from moeray.stages.kernels.backend import ggml_lib

    G = ggml_lib()
    E, N = logits.contents.ne[0], logits.contents.ne[1]
    k = cfg.n_experts_used
    scores = G.ggml_sigmoid(ctx, logits) if cfg.expert_gating == "sigmoid" else G.ggml_soft_max(ctx, logits)
    choice = scores if bias is None else G.ggml_add(ctx, scores, bias)
    n_groups = cfg.expert_groups
    if n_groups > 1:
        per = E // n_groups
        groups = G.ggml_reshape_3d(ctx, choice, per, n_groups, N)
        best = G.ggml_cont(ctx, G.ggml_argsort_top_k(ctx, groups, min(2, per)))  # [2, groups, N]
        best = G.ggml_get_rows(ctx, G.ggml_reshape_4d(ctx, groups, 1, per, n_groups, N), best)  # [1, 2, groups, N]
        group_score = G.ggml_reshape_2d(ctx, G.ggml_sum_rows(ctx, G.ggml_reshape_3d(ctx, best, min(2, per), n_groups, N)),
                                        n_groups, N)
        keep = G.ggml_cont(ctx, G.ggml_argsort_top_k(ctx, group_score, cfg.expert_groups_used))  # [used, N]
        kept = G.ggml_get_rows(ctx, groups, keep)  # [per, used, N]
        choice = G.ggml_reshape_2d(ctx, G.ggml_set_rows(ctx, G.ggml_fill(ctx, groups, float("-inf")), kept, keep), E, N)
    ids = G.ggml_cont(ctx, G.ggml_argsort_top_k(ctx, choice, k))
    weights = _picked(ctx, G, scores, ids, E, N, k)
    if cfg.norm_topk_prob:
        weights = G.ggml_div(ctx, weights, G.ggml_scale_bias(ctx, G.ggml_sum_rows(ctx, weights), 1.0, 1e-20))
    if cfg.expert_weights_scale != 1.0:
        weights = G.ggml_scale(ctx, weights, cfg.expert_weights_scale)
    elif not cfg.norm_topk_prob:
        weights = G.ggml_cont(ctx, weights)
    return ids, weights


def graph_topk_softmax(ctx, logits, cfg: ModelConfig, bias=None):
    """topk_softmax inside a ggml graph (gpt-oss; build_moe_ffn's SOFTMAX_WEIGHT gating): the
    router's bias added to the logits, the k largest, soft_max over those k."""
    from moeray.stages.kernels.backend import ggml_lib

    G = ggml_lib()
    E, N = logits.contents.ne[0], logits.contents.ne[1]
    k = cfg.n_experts_used
    if bias is not None:
        logits = G.ggml_add(ctx, logits, bias)
    ids = G.ggml_cont(ctx, G.ggml_argsort_top_k(ctx, logits, k))
    return ids, G.ggml_soft_max(ctx, _picked(ctx, G, logits, ids, E, N, k))


# The routings that have a graph form (every rule of ROUTING has one); a rule without one would run
# in torch between the trunk and experts graphs.
GRAPH_ROUTING = {"softmax_topk": graph_softmax_topk, "grouped_topk": graph_grouped_topk,
                 "topk_softmax": graph_topk_softmax}
