"""qwen35moe: Qwen3.5 / Qwen3.6 MoE (llama.cpp's `qwen35moe`): Qwen3-Next's hybrid stack
(stages/arch/qwen3next.py) with separate projections and llama.cpp's V-head order.

As llama.cpp's converter (Qwen3_5MoeTextModel, via _LinearAttentionVReorderBase) writes it:
- in_proj_qkv -> attn_qkv, in_proj_z -> attn_gate, in_proj_b -> ssm_beta, in_proj_a -> ssm_alpha
  (no fused qkvz / ba);
- the V heads reordered from transformers' grouped order to tiled (v head h reads k head
  h % H_k, the order ggml broadcasts in without a copy) in every tensor that carries them: the v
  rows of attn_qkv and of the conv kernel, attn_gate, ssm_beta / ssm_alpha, ssm_a, ssm_dt and the
  columns of ssm_out;
- rope.dimension_sections (interleaved multimodal RoPE, default [11, 11, 10, 0]). On text every
  position id is the same in the temporal, height and width sections, so the sections pick the
  same angle whichever section a frequency belongs to: plain partial NeoX RoPE on the text
  position (tests/stages/test_hybrid_models.py checks transformers' rotary against it). Images and
  video, where the sections differ, are not served.
- the router always renormalises its top-k (transformers' Qwen3_5MoeTopKRouter does).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from moeray.stages.arch.qwen3next import Qwen3Next

DEFAULT_MROPE_SECTION = [11, 11, 10, 0]  # llama.cpp's converter writes it when the config omits it


def reorder_v_heads(a: np.ndarray, axis: int, n_k: int, r: int, head_dim: int) -> np.ndarray:
    """llama.cpp's _reorder_v_heads: along `axis`, [k0: v0..v(r-1), k1: ...] -> [v0: k0..k(n-1), ...]."""
    a = np.moveaxis(a, axis, 0)
    shape = a.shape
    a = a.reshape(n_k, r, head_dim, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.ascontiguousarray(np.moveaxis(a, 0, axis))


class Qwen35Moe(Qwen3Next):
    name = "qwen35moe"
    hf_classes = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
    hf_model_types = ("qwen3_5_moe_text", "qwen3_5_moe")
    v_order = "tiled"

    def config_fields(self, g, meta, shapes):
        f = super().config_fields(g, meta, shapes)
        g("rope.dimension_sections")  # llama.cpp requires it; on text it reduces to plain RoPE (above)
        return f

    def beta_alpha_tensors(self, cfg, p):
        n = cfg.deltanet.n_v_heads
        return {p + "ssm_beta.weight": (n, cfg.hidden), p + "ssm_alpha.weight": (n, cfg.hidden)}

    def beta_alpha_rows(self, cfg, layer):
        return [(f"blk.{layer}.ssm_beta.weight", None), (f"blk.{layer}.ssm_alpha.weight", None)]

    def hf_norm_topk(self, hf_config) -> bool:
        return True

    def write_metadata(self, w: Any, hf: Any) -> None:
        super().write_metadata(w, hf)
        params = getattr(hf, "rope_parameters", None) or {}
        w.add_rope_dimension_sections(list(params.get("mrope_section", DEFAULT_MROPE_SECTION)))

    def reorder_v(self, sub: str, a: np.ndarray, hf: Any) -> np.ndarray:
        n_k, n_v = hf.linear_num_key_heads, hf.linear_num_value_heads
        if n_k == n_v:
            return a
        r, Dk, Dv = n_v // n_k, hf.linear_key_head_dim, hf.linear_value_head_dim
        if sub == "in_proj_qkv.weight":
            qk = 2 * n_k * Dk
            return np.concatenate([a[:qk], reorder_v_heads(a[qk:], 0, n_k, r, Dv)])
        if sub == "conv1d.weight":
            qk = 2 * n_k * Dk
            return np.concatenate([a[:qk], reorder_v_heads(a[qk:], 0, n_k, r, Dv)])
        if sub == "in_proj_z.weight":
            return reorder_v_heads(a, 0, n_k, r, Dv)
        if sub in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
            return reorder_v_heads(a, 0, n_k, r, 1)
        if sub == "out_proj.weight":
            return reorder_v_heads(a, 1, n_k, r, Dv)
        return a

    def hf_projection(self, p: str, sub: str, a: np.ndarray, hf: Any):
        names = {"in_proj_qkv.weight": "attn_qkv.weight", "in_proj_z.weight": "attn_gate.weight",
                 "in_proj_b.weight": "ssm_beta.weight", "in_proj_a.weight": "ssm_alpha.weight"}
        if sub not in names:
            raise ValueError(f"no GGUF name for transformers tensor linear_attn.{sub}")
        return [(p + names[sub], a)]


ARCH = Qwen35Moe()
