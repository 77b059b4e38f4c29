"""Planner specs of published shapes, from their configs and quant types (sizes only).

    python -m moeray.planner.shapes qwen3next-80b-a3b IQ3_S > qwen3next.json
    moeray plan --spec qwen3next.json --devices 12GiB,12GiB,8GiB,8GiB --max-seqs 4
    python -m moeray.planner.shapes deepseek-v3 > dsv3.json   # also kimi-k2, glm-4.5, glm-4.5-air
    moeray plan --spec dsv3.json --devices 24GiB,24GiB,16GiB,16GiB --kv-tokens 32768

The MoE shapes (`MOE_SHAPES`) carry their dense leading layers (expert_bytes 0: no slots, no
pairs, trunk only) and their KV per token per layer (`kv_token_bytes`, 16-bit): DeepSeek's and
Kimi's MLA keep the 512-value latent + 64-value rope key, GLM's GQA k and v of 8 heads of 128.

A layer's trunk is offered in named pieces (planner/spec.py TrunkBytes.pieces): in a DeltaNet
layer "dnproj" is the fused input projection (qkv ++ z ++ beta/alpha: one matmul, colibri's
dnproj) plus the output projection, read on every token like every dense byte; a full-attention
layer's "attn" is q (with its output gate), k, v and o. `state_bytes` is one sequence's DeltaNet
state per layer (conv + recurrent, float32), charged per sequence like KV.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from moeray.planner.spec import ModelSpec, TrunkBytes

# Bytes per 256 weights of the GGUF block types these specs use (ggml's block sizes).
BYTES_PER_256 = {"IQ1_S": 50, "IQ1_M": 56, "IQ2_XXS": 66, "IQ2_XS": 74, "IQ2_S": 82, "IQ3_XXS": 98, "IQ3_S": 110,
                 "IQ4_XS": 136, "MXFP4": 136, "Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210,
                 "Q8_0": 272, "F16": 512, "F32": 1024}


@dataclass(frozen=True)
class HybridShape:
    n_layers: int
    hidden: int
    vocab: int
    n_experts: int
    k: int
    expert_ffn: int
    shared_ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    lin_k_heads: int
    lin_v_heads: int
    lin_head_dim: int
    conv_kernel: int
    full_attention_interval: int = 4


SHAPES = {  # the published configs (config.json on the hub)
    "qwen3next-80b-a3b": HybridShape(48, 2048, 151936, 512, 10, 512, 512, 16, 2, 256, 16, 32, 128, 4),
    "qwen3.6-35b-a3b": HybridShape(40, 2048, 248320, 256, 8, 512, 512, 16, 2, 256, 16, 32, 128, 4),
}


def _b(n_weights: int, qtype: str) -> int:
    return n_weights * BYTES_PER_256[qtype] // 256


def hybrid_spec(s: HybridShape, expert_type: str = "IQ3_S", trunk_type: str = "Q8_0",
                head_type: str = "Q6_K") -> ModelSpec:
    H = s.hidden
    key_dim, value_dim = s.lin_k_heads * s.lin_head_dim, s.lin_v_heads * s.lin_head_dim
    conv_dim = 2 * key_dim + value_dim
    f32 = 4
    shared = _b(3 * s.shared_ffn * H, trunk_type) + f32 * H  # + its sigmoid gate
    router = f32 * s.n_experts * H
    norms = 2 * f32 * H
    pieces, state = [], []
    for l in range(s.n_layers):
        common = {"shexp": shared, "router": router}
        if (l + 1) % s.full_attention_interval:
            dnproj = _b(H * (conv_dim + value_dim + 2 * s.lin_v_heads) + value_dim * H, trunk_type)
            small = f32 * (conv_dim * s.conv_kernel + 2 * s.lin_v_heads + s.lin_head_dim) + norms
            pieces.append({"dnproj": dnproj, **common, "norms+conv": small})
            state.append(f32 * (conv_dim * (s.conv_kernel - 1) + s.lin_v_heads * s.lin_head_dim ** 2))
        else:
            q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
            attn = _b(H * (2 * q + 2 * kv) + q * H, trunk_type)
            pieces.append({"attn": attn, **common, "norms": norms + 2 * f32 * s.head_dim})
            state.append(0)
    expert = _b(3 * s.expert_ffn * H, expert_type)
    tb = TrunkBytes(embedding=_b(s.vocab * H, head_type), head=_b(s.vocab * H, head_type) + f32 * H,
                    layers=[sum(p.values()) for p in pieces], pieces=pieces)
    return ModelSpec(s.n_layers, s.n_experts, s.k, [expert] * s.n_layers, tb, state)


@dataclass(frozen=True)
class MoEShape:
    """A decoder of attention + FFN layers whose first `dense_layers` have a dense FFN: GQA
    (GLM-4.5) or MLA (DeepSeek-V3, Kimi-K2: kv_lora > 0), as their config.json publishes them."""
    n_layers: int
    hidden: int
    vocab: int
    n_experts: int
    k: int
    expert_ffn: int
    n_shared: int  # shared experts of expert_ffn each
    dense_ffn: int
    dense_layers: int
    n_heads: int
    n_kv_heads: int = 0
    head_dim: int = 0
    q_lora: int = 0  # MLA
    kv_lora: int = 0
    nope: int = 0
    rope: int = 0
    v_dim: int = 0
    qk_norm: bool = False
    qkv_bias: bool = False
    expert_type: str = "Q4_K"  # the default download's block types
    trunk_type: str = "Q8_0"
    head_type: str = "Q6_K"

    def kv_values(self) -> int:
        """Values one token keeps per layer: MLA's latent + rope key, or k and v of each KV head."""
        return self.kv_lora + self.rope if self.kv_lora else 2 * self.n_kv_heads * self.head_dim


MOE_SHAPES = {  # config.json on the hub; the expert types of the widely used GGUFs (unsloth's IQ2_XXS for
    # the 671B / 1T models, Q4_K for GLM), attention, shared experts and dense layers at Q8_0
    "deepseek-v3": MoEShape(61, 7168, 129280, 256, 8, 2048, 1, 18432, 3, 128, q_lora=1536, kv_lora=512,
                            nope=128, rope=64, v_dim=128, expert_type="IQ2_XXS"),
    "kimi-k2": MoEShape(61, 7168, 163840, 384, 8, 2048, 1, 18432, 1, 64, q_lora=1536, kv_lora=512,
                        nope=128, rope=64, v_dim=128, expert_type="IQ2_XXS"),
    "glm-4.5": MoEShape(92, 5120, 151552, 160, 8, 1536, 1, 12288, 3, 96, 8, 128, qk_norm=True, qkv_bias=True),
    "glm-4.5-air": MoEShape(46, 4096, 151552, 128, 8, 1408, 1, 10944, 1, 96, 8, 128, qkv_bias=True),
}


def moe_spec(s: MoEShape, expert_type: str | None = None, trunk_type: str | None = None,
             head_type: str | None = None, kv_itemsize: int = 2) -> ModelSpec:
    """Bytes as the GGUF stores them: matrices in their block types, norms, biases and routers F32."""
    et, tt, ht = expert_type or s.expert_type, trunk_type or s.trunk_type, head_type or s.head_type
    H, f32 = s.hidden, 4
    if s.kv_lora:  # MLA: q_a, q_b, kv_a_mqa, k_b, v_b, o (+ q_a_norm, kv_a_norm)
        qk = s.nope + s.rope
        attn = _b(H * s.q_lora + s.q_lora * s.n_heads * qk + H * (s.kv_lora + s.rope)
                  + s.n_heads * s.kv_lora * (s.nope + s.v_dim) + s.n_heads * s.v_dim * H, tt)
        attn += f32 * (s.q_lora + s.kv_lora)
    else:
        q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
        attn = _b(H * (q + 2 * kv) + q * H, tt) + f32 * ((q + 2 * kv) * s.qkv_bias + 2 * s.head_dim * s.qk_norm)
    norms = 2 * f32 * H
    pieces = []
    for l in range(s.n_layers):
        if l < s.dense_layers:
            pieces.append({"attn": attn, "ffn": _b(3 * s.dense_ffn * H, tt), "norms": norms})
        else:
            pieces.append({"attn": attn, "shexp": _b(3 * s.n_shared * s.expert_ffn * H, tt),
                           "router": f32 * (s.n_experts * H + s.n_experts), "norms": norms})
    expert = _b(3 * s.expert_ffn * H, et)
    tb = TrunkBytes(embedding=_b(s.vocab * H, tt), head=_b(s.vocab * H, ht) + f32 * H,
                    layers=[sum(p.values()) for p in pieces], pieces=pieces)
    return ModelSpec(s.n_layers, s.n_experts, s.k, [0 if l < s.dense_layers else expert for l in range(s.n_layers)],
                     tb, kv_token_bytes=[kv_itemsize * s.kv_values()] * s.n_layers)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in {**SHAPES, **MOE_SHAPES}:
        print(f"usage: python -m moeray.planner.shapes {{{','.join([*SHAPES, *MOE_SHAPES])}}} [EXPERT_TYPE] "
              "[TRUNK_TYPE]", file=sys.stderr)
        return 2
    if argv[0] in MOE_SHAPES:
        print(json.dumps(moe_spec(MOE_SHAPES[argv[0]], *argv[1:3]).to_dict()))
        return 0
    spec = hybrid_spec(SHAPES[argv[0]], *argv[1:3])
    print(json.dumps(spec.to_dict()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
