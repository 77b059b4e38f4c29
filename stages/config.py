"""The shape of a model, read from GGUF metadata (llama.cpp's key names).

Torch-free: the planner and the CLI build a ModelConfig from a header alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moeray.errors import GGUFError, UnsupportedArchitectureError

SUPPORTED_ARCHS = ("llama", "qwen2moe", "qwen3moe")


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
    shared_expert_ffn_dim: int  # qwen2moe, else 0
    norm_topk_prob: bool  # renormalise the top-k routing weights to sum to 1
    qk_norm: bool  # qwen3moe: RMSNorm over each head of q and k before RoPE
    tie_embeddings: bool  # no output.weight: the head reuses token_embd
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    qkv_bias: bool = False  # qwen2moe: attn_q/k/v carry a bias
    rope_scale: float = 1.0  # linear rope scaling: positions are divided by this
    # The routed experts' activation (stages/qmatmul.py GLU): "silu" = silu(g) * u; "swiglu_oai"
    # (gpt-oss) clamps g and u at swiglu_limit and computes (u + 1) * g * sigmoid(swiglu_alpha * g).
    expert_act: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0


def _get(meta: dict[str, Any], key: str, path: str, default: Any = ...) -> Any:
    if key in meta:
        return meta[key]
    if default is ...:
        raise GGUFError(f"{path}: metadata key '{key}' is missing; the file was not written by a "
                        "llama.cpp-compatible converter (re-convert it with convert_hf_to_gguf.py)")
    return default


def config_from_metadata(meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]],
                         path: str = "<gguf>") -> ModelConfig:
    """Build the config from metadata plus the tensor directory (shapes settle vocab size and tying)."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedArchitectureError(
            f"{path}: architecture '{arch}' is not supported; moeray runs {', '.join(SUPPORTED_ARCHS)} "
            "(llama with ffn_gate_inp/ffn_*_exps tensors is Mixtral-style MoE)")
    a = arch

    def g(key: str, default: Any = ...) -> Any:
        return _get(meta, f"{a}.{key}", path, default)

    n_layers = int(g("block_count"))
    hidden = int(g("embedding_length"))
    n_heads = int(g("attention.head_count"))
    n_kv_heads = int(g("attention.head_count_kv", n_heads))
    head_dim = int(g("attention.key_length", hidden // n_heads))
    value_dim = int(g("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise UnsupportedArchitectureError(
            f"{path}: attention.value_length {value_dim} != key_length {head_dim}; moeray needs them equal")
    rope_dim = int(g("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise UnsupportedArchitectureError(
            f"{path}: partial rotary embedding (rope.dimension_count {rope_dim} < head_dim {head_dim}) "
            "is not supported")
    scaling = str(g("rope.scaling.type", "none"))
    rope_scale = 1.0
    if scaling == "linear":
        rope_scale = float(g("rope.scaling.factor", 1.0))
    elif scaling != "none":
        raise UnsupportedArchitectureError(
            f"{path}: rope scaling '{scaling}' is not supported (only none and linear)")

    n_experts = int(g("expert_count", 0))
    n_used = int(g("expert_used_count", 0))
    ffn_dim = 0 if (n_experts and a != "llama") else int(g("feed_forward_length", 0))
    expert_ffn = int(g("expert_feed_forward_length", 0)) if n_experts else 0
    if n_experts and not expert_ffn:
        # Mixtral-style llama stores the expert width as feed_forward_length
        shape = tensor_shapes.get("blk.0.ffn_gate_exps.weight")
        expert_ffn = shape[1] if shape else int(g("feed_forward_length"))
    if a == "llama" and n_experts:
        ffn_dim = 0
    shared_ffn = int(g("expert_shared_feed_forward_length", 0)) if a == "qwen2moe" else 0
    if a == "qwen2moe" and not shared_ffn:
        shape = tensor_shapes.get("blk.0.ffn_gate_shexp.weight")
        shared_ffn = shape[0] if shape else 0

    # Mixtral and llama.cpp's qwen3moe renormalise; qwen2moe does not (HF default, llama.cpp agrees).
    norm_default = {"llama": True, "qwen3moe": True, "qwen2moe": False}[a]
    norm_topk = bool(g("expert_weights_norm", norm_default))

    emb = tensor_shapes.get("token_embd.weight")
    vocab = emb[0] if emb else int(g("vocab_size", len(meta.get("tokenizer.ggml.tokens", ())) or 0))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        arch=a, n_layers=n_layers, hidden=hidden, n_heads=n_heads, n_kv_heads=n_kv_heads,
        head_dim=head_dim, vocab_size=int(vocab), context_length=int(g("context_length", 4096)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_style="normal" if a == "llama" else "neox",
        ffn_dim=ffn_dim, n_experts=n_experts, n_experts_used=n_used, expert_ffn_dim=expert_ffn,
        shared_expert_ffn_dim=shared_ffn, norm_topk_prob=norm_topk, qk_norm=(a == "qwen3moe"),
        tie_embeddings="output.weight" not in tensor_shapes,
        bos_token_id=None if bos is None else int(bos), eos_token_id=None if eos is None else int(eos),
        qkv_bias="blk.0.attn_q.bias" in tensor_shapes, rope_scale=rope_scale,
    )
