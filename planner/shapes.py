"""Planner specs of published hybrid shapes, from their configs and quant types (sizes only).

    python -m moeray.planner.shapes qwen3next-80b-a3b IQ3_S > qwen3next.json
    moeray plan --spec qwen3next.json --devices 12GiB,12GiB,8GiB,8GiB --max-seqs 4

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
BYTES_PER_256 = {"IQ3_XXS": 98, "IQ3_S": 110, "Q4_K": 144, "Q6_K": 210, "Q8_0": 272, "F16": 512, "F32": 1024}


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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SHAPES:
        print(f"usage: python -m moeray.planner.shapes {{{','.join(SHAPES)}}} [EXPERT_TYPE] [TRUNK_TYPE]",
              file=sys.stderr)
        return 2
    spec = hybrid_spec(SHAPES[argv[0]], *argv[1:3])
    print(json.dumps(spec.to_dict()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
