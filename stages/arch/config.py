"""The shape of a model: the one config dataclass every architecture fills (stages/arch/).

Torch-free: the planner and the CLI build a ModelConfig from a header alone
(`moeray.stages.arch.config_from_metadata`).
"""
from __future__ import annotations

from dataclasses import dataclass

from moeray.stages.arch.deltanet_shape import DeltaNetShape


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rope_theta: float
    rms_eps: float
    rope_style: str  # "normal": llama (q/k rows permuted by the converter -> rotate adjacent pairs); "neox": halves
    ffn_dim: int  # dense FFN width, 0 when the layers have none
    n_experts: int  # 0 = dense
    n_experts_used: int
    expert_ffn_dim: int
    shared_expert_ffn_dim: int  # 0 = no shared expert
    norm_topk_prob: bool  # renormalise the top-k routing weights to sum to 1
    qk_norm: bool  # RMSNorm over each head of q and k before RoPE (qwen3moe)
    tie_embeddings: bool  # no output.weight: the head reuses token_embd
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    qkv_bias: bool = False  # attn_q/k/v carry a bias (qwen2moe)
    rope_scale: float = 1.0  # the rope scaling factor (linear: positions are divided by it; yarn: its factor)
    rope_scaling: str = "none"  # "none", "linear" or "yarn" (stages/blocks/rope.py)
    rope_dim: int = 0  # values of each head that RoPE rotates; 0 = all of head_dim (< head_dim: partial)
    rope_orig_context: int = 0  # yarn: the context the model was trained at
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_attn_factor: float = 1.0  # yarn: cos and sin are scaled by it
    yarn_truncate: bool = True  # yarn: correction dims rounded outwards (ggml's rule)
    shared_expert_gate: bool = True  # the shared expert's output is scaled by sigmoid(w . h) (qwen2moe)
    n_dense_leading: int = 0  # the first layers of an MoE model have a dense FFN instead (DeepSeek, GLM)
    attention: str = "gqa"  # the attention block's kind (stages/arch/base.py ATTENTION_TENSORS)
    attn_scale: float = 0.0  # the softmax scale; 0 = 1/sqrt(head_dim) (DeepSeek's YaRN: mscale^2/sqrt(head_dim))
    # MLA (stages/blocks/mla.py): head_dim is qk_nope + qk_rope (rope_dim), each token's KV the latent + rope key
    q_lora_rank: int = 0  # q through a rank-r bottleneck with its own RMSNorm (0: one q projection)
    kv_lora_rank: int = 0  # the compressed latent every head's key and value come from
    v_head_dim: int = 0  # values per head (0: head_dim)
    # Routing (stages/blocks/routing.py grouped_topk): scores, score-correction bias, groups, scaling
    expert_gating: str = "softmax"  # "softmax" or "sigmoid" over the router's logits
    score_bias: bool = False  # exp_probs_b: added to the scores for choosing only, not to the weights
    expert_groups: int = 1  # experts split in this many groups ...
    expert_groups_used: int = 1  # ... and only the best groups (by their top-2 scores) are chosen from
    expert_weights_scale: float = 1.0  # routed_scaling_factor: the routed weights are multiplied by it
    # Hybrid models (stages/arch/qwen3next.py): the Gated DeltaNet layers' sizes, and per layer
    # whether it is one (a recurrent state per sequence instead of KV).
    deltanet: DeltaNetShape | None = None
    recurrent: tuple[bool, ...] = ()
    # The routed experts' activation (stages/kernels/qmatmul.py GLU): "silu" = silu(g) * u; "swiglu_oai"
    # (gpt-oss) clamps g and u at swiglu_limit and computes (u + 1) * g * sigmoid(swiglu_alpha * g).
    expert_act: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_bias: bool = False  # blk.L.ffn_{gate,up,down}_exps.bias: per-expert biases (gpt-oss)
    router_bias: bool = False  # blk.L.ffn_gate_inp.bias added to the router's logits (gpt-oss)
    attn_out_bias: bool = False  # blk.L.attn_output.bias (gpt-oss)
    attn_sinks: bool = False  # blk.L.attn_sinks.weight: a learned softmax logit per head (gpt-oss)
    sliding_window: int = 0  # tokens a sliding-window layer attends over (itself included)
    swa_layers: tuple[bool, ...] = ()  # per layer: True = sliding window, False (or absent) = full

    @property
    def is_moe(self) -> bool:
        """Any layer routes to experts."""
        return self.n_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Layer `layer` has routed experts (slots, profile pairs); False: a dense FFN, priced as trunk."""
        return self.n_experts > 0 and layer >= self.n_dense_leading

    @property
    def moe_layers(self) -> list[int]:
        return [l for l in range(self.n_layers) if self.is_moe_layer(l)]
