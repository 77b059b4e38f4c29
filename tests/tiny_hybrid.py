"""Tiny random hybrid models (Qwen3-Next, Qwen3.5-MoE) for parity tests, on tiny_models' recipe.

Four layers (three Gated DeltaNet, the fourth full attention: the published 3:1 pattern), 2 key
heads and 4 value heads in the DeltaNet layers (so the V-head order matters), head_dim 32 with a
quarter of it rotated (partial RoPE), 8 experts top-2 and a gated shared expert. The decays are
drawn slow (A = exp(A_log) in [0.02, 0.3]) so that the state carries far back: a chunked prefill
that dropped or mangled its state would show.
"""
from __future__ import annotations

import torch

from tiny_models import EXPERT_FFN, HEAD_DIM, HIDDEN, MAX_POS, N_KV_HEADS, SHARED_FFN, VOCAB, _randomise

N_LAYERS = 4
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]


def _hybrid_kwargs(max_pos: int, hidden: int = HIDDEN, expert_ffn: int = EXPERT_FFN) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=N_LAYERS, num_attention_heads=4,
                num_key_value_heads=N_KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=max_pos,
                rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="eager",
                linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
                linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=expert_ffn, shared_expert_intermediate_size=SHARED_FFN,
                layer_types=LAYER_TYPES)


def _slow_decay(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(0.02 + 0.28 * torch.rand(p.shape, generator=gen)))


def _finish(model, seed):
    _randomise(model, seed)
    _slow_decay(model, seed)
    return model.float().eval()


def tiny_qwen3next(seed: int = 11, max_pos: int = MAX_POS, hidden: int = HIDDEN, expert_ffn: int = EXPERT_FFN):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(**_hybrid_kwargs(max_pos, hidden, expert_ffn), intermediate_size=160, norm_topk_prob=True,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.25})
    torch.manual_seed(seed)
    return _finish(Qwen3NextForCausalLM(cfg), seed)


def tiny_qwen35moe(seed: int = 12, max_pos: int = MAX_POS):
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(**_hybrid_kwargs(max_pos),
                               rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                                "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                                                "mrope_interleaved": True})
    torch.manual_seed(seed)
    return _finish(Qwen3_5MoeForCausalLM(cfg), seed)


HYBRID_BUILDERS = {"qwen3next": tiny_qwen3next, "qwen35moe": tiny_qwen35moe}
