"""Tiny random transformers models for parity tests.

Dims are chosen so that a wrong layout cannot hide: hidden 96 with 6 heads but head_dim 32 (not
96/6), 2 KV heads (GQA), expert width 64 and shared-expert width 160 (not powers of two, yet every
row width is a multiple of 32 so Q8_0 blocks fit), 300 tokens, 3 layers, a non-default rope theta.

transformers initialises norms to 1, biases to 0 and every matrix with std 0.02, which makes a
model where swapping two norms or dropping a bias changes nothing and where attention is almost
uniform. We re-draw every parameter: norms around 1, biases non-zero, matrices large enough that
attention is peaked, and routers large enough that top-k choices are clear-cut (a near tie could
flip between two correct engines on rounding noise alone).
"""
from __future__ import annotations

import math

import torch

VOCAB = 300
HIDDEN = 96
N_HEADS = 6
N_KV_HEADS = 2
HEAD_DIM = 32
N_LAYERS = 3
MAX_POS = 256
EXPERT_FFN = 64
SHARED_FFN = 160
DENSE_FFN = 160


def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # the router: decisive top-k
                p.copy_(torch.randn(p.shape, generator=gen) * (2.0 / math.sqrt(p.shape[-1])))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))


def _finish(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    _randomise(model, seed)
    return model.float().eval()


def _common() -> dict:
    return dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=N_LAYERS,
        num_attention_heads=N_HEADS, num_key_value_heads=N_KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS, rms_norm_eps=1e-5, tie_word_embeddings=False,
        attn_implementation="eager",
    )


def tiny_llama(seed: int = 0, tie_word_embeddings: bool = False):
    """Dense llama (the reference architecture)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**_common(), "tie_word_embeddings": tie_word_embeddings},
                      intermediate_size=DENSE_FFN, rope_theta=5000.0)
    torch.manual_seed(seed)
    return _finish(LlamaForCausalLM(cfg), seed)


def tiny_mixtral(seed: int = 1):
    """Mixtral: 6 experts, top-2, renormalised; llama.cpp stores it as arch "llama"."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(**_common(), intermediate_size=EXPERT_FFN, num_local_experts=6,
                        num_experts_per_tok=2, rope_theta=20000.0)
    torch.manual_seed(seed)
    return _finish(MixtralForCausalLM(cfg), seed)


def tiny_qwen2moe(seed: int = 2, norm_topk_prob: bool = False):
    """Qwen2-MoE: 8 experts, top-2, a sigmoid-gated shared expert, q/k/v biases.

    Qwen2MoeConfig does not declare head_dim, but its attention reads `config.head_dim` when set,
    and llama.cpp reads attention.key_length for every architecture, so we use 32 here too.
    """
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(**_common(), intermediate_size=DENSE_FFN, moe_intermediate_size=EXPERT_FFN,
                         shared_expert_intermediate_size=SHARED_FFN, num_experts=8,
                         num_experts_per_tok=2, norm_topk_prob=norm_topk_prob, rope_theta=10000.0)
    torch.manual_seed(seed)
    return _finish(Qwen2MoeForCausalLM(cfg), seed)


def tiny_qwen3moe(seed: int = 3, norm_topk_prob: bool = True, top_k: int = 2):
    """Qwen3-MoE: 8 experts, top-2 (or top_k), renormalised (as llama.cpp runs it), per-head q/k RMSNorm."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**_common(), intermediate_size=DENSE_FFN, moe_intermediate_size=EXPERT_FFN,
                         num_experts=8, num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob,
                         rope_theta=1000000.0)
    torch.manual_seed(seed)
    return _finish(Qwen3MoeForCausalLM(cfg), seed)


def tiny_deepseek3(seed: int = 4, n_layers: int = N_LAYERS):
    """DeepSeek-V3: MLA (q LoRA 64, kv LoRA 64, nope 32 + rope 16 per head, v 32), YaRN with
    mscale, layer 0 dense, then 8 experts in 4 groups (2 groups used), top-2 by sigmoid scores
    with a score-correction bias, renormalised, x2.5, plus an ungated shared expert."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=n_layers, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=MAX_POS, rms_norm_eps=1e-5, tie_word_embeddings=False,
        attn_implementation="eager", intermediate_size=DENSE_FFN, moe_intermediate_size=EXPERT_FFN,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=64,
        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0})
    torch.manual_seed(seed)
    model = _finish(DeepseekV3ForCausalLM(cfg), seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # a buffer, not a parameter: a bias that changes some choices
        for layer in model.model.layers[1:]:
            b = layer.mlp.gate.e_score_correction_bias
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    return model


def tiny_deepseek2(seed: int = 6, n_layers: int = N_LAYERS, q_lora_rank: int | None = None):
    """DeepSeek-V2-Lite: MLA without the q LoRA (one attn_q; q_lora_rank: V2's LoRA'd q), YaRN with
    mscale, layer 0 dense, then 8 experts top-2 by softmax scores (no bias, no groups: topk_method
    "greedy"), the weights not renormalised but x2.0, two ungated shared experts."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=n_layers, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=MAX_POS, rms_norm_eps=1e-5, tie_word_embeddings=False,
        attn_implementation="eager", intermediate_size=DENSE_FFN, moe_intermediate_size=EXPERT_FFN,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
        routed_scaling_factor=2.0, norm_topk_prob=False, topk_method="greedy", q_lora_rank=q_lora_rank,
        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 0.707, "mscale_all_dim": 0.707})
    torch.manual_seed(seed)
    return _finish(DeepseekV2ForCausalLM(cfg), seed)


def tiny_glm4moe(seed: int = 5, use_qk_norm: bool = True, groups: tuple[int, int] = (1, 1)):
    """GLM-4.5: q/k/v biases, per-head q/k norm (GLM-4.5; Air: none), partial NeoX RoPE over half of
    each head, layer 0 dense, then 8 experts top-2 by sigmoid scores with a correction bias,
    renormalised, x2.5, an ungated shared expert; one MTP layer in the file (skipped).
    groups: (n_group, topk_group), DeepSeek-V3's group-limited choice (GLM-4.5 has one group)."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    cfg = Glm4MoeConfig(**_common(), intermediate_size=DENSE_FFN, moe_intermediate_size=EXPERT_FFN,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=groups[0], topk_group=groups[1],
                        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                        use_qk_norm=use_qk_norm, attention_bias=True, num_nextn_predict_layers=1,
                        rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5})
    torch.manual_seed(seed)
    model = _finish(Glm4MoeForCausalLM(cfg), seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            b = layer.mlp.gate.e_score_correction_bias
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    return model


def tiny_gpt_oss(seed: int = 4, n_layers: int = N_LAYERS):
    """gpt-oss: 6 experts, top-2 (softmax over the top-2 logits), router and expert biases, the
    clamped SwiGLU (experts scaled so that |g| and |u| pass the limit 7), attention sinks, q/k/v/o
    biases, a sliding window of 8 on layers 0 and 2 (20-token tests cross it), YaRN (factor 4
    over an original context of 64, un-truncated as gpt-oss's own config has it)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    rope = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 64, "rope_theta": 150000.0}
    cfg = GptOssConfig(**{**_common(), "num_hidden_layers": n_layers}, intermediate_size=EXPERT_FFN,
                       num_local_experts=6, num_experts_per_tok=2, sliding_window=8, rope_parameters=rope,
                       attention_bias=True)
    torch.manual_seed(seed)
    model = _finish(GptOssForCausalLM(cfg), seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(4.0)
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=gen) * 2.0)
    return model


BUILDERS = {
    "llama": tiny_llama,
    "mixtral": tiny_mixtral,
    "qwen2moe": tiny_qwen2moe,
    "qwen3moe": tiny_qwen3moe,
}


def token_ids(n: int = 20, seed: int = 7) -> list[int]:
    """A fixed sequence of token ids spanning the vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=gen).tolist()
