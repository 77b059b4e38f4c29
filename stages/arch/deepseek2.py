"""deepseek2: DeepSeek-V2/V3/R1 and Kimi-K2 (llama.cpp's `deepseek2`).

- Multi-head latent attention (stages/blocks/mla.py): q through a LoRA bottleneck with its own RMSNorm
  (attn_q_a, attn_q_a_norm, attn_q_b; or one attn_q), the KV through a compressed latent
  (attn_kv_a_mqa -> kv_lora_rank latent + one shared RoPE key, attn_kv_a_norm), every head's
  key and value from the latent (attn_k_b, attn_v_b). The KV cache holds kv_lora_rank +
  qk_rope_head_dim values per token per layer.
- RoPE on the decoupled qk_rope_head_dim only, adjacent pairs ("normal": DeepSeek's interleaved
  rope, stored unpermuted); YaRN with mscale: the softmax scale is mscale^2 / sqrt(head_dim),
  mscale = 1 + 0.1 * mscale_all_dim * ln(factor), and cos/sin stay unscaled (llama.cpp's
  deepseek2.cpp and transformers agree).
- The first leading_dense_block_count layers have a dense FFN; the rest are MoE with sigmoid
  scores (DeepSeek-V3; V2: softmax, tested against transformers' DeepseekV2), the exp_probs_b score-correction bias, group-limited top-k,
  renormalisation and routed_scaling_factor (stages/blocks/routing.py grouped_topk), and an ungated
  shared expert of expert_shared_count x expert width.

As llama.cpp's current converter (DeepseekV2Model) writes it: head_count_kv 1, key_length
kv_lora + rope and value_length kv_lora (the MQA view), key_length_mla / value_length_mla the
real head widths; kv_b_proj split per head into attn_k_b (transposed) and attn_v_b; MTP layers
beyond num_hidden_layers are not written; yarn_log_multiplier = 0.1 * mscale_all_dim.
"""
from __future__ import annotations

import math
from typing import Any

import gguf
import numpy as np

from moeray.stages.arch.base import Architecture, yarn_mscale

GATING = {1: "softmax", 2: "sigmoid"}  # gguf.ExpertGatingFuncType


class Deepseek2(Architecture):
    name = "deepseek2"
    routing = "grouped_topk"
    rope_style = "normal"
    norm_topk_default = False  # llama.cpp's default when expert_weights_norm is absent
    hf_classes = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
    hf_model_types = ("deepseek_v3", "kimi_k2", "deepseek_v2")

    # --- metadata -> config ----------------------------------------------------------------

    def head_fields(self, g, hidden, n_heads):
        if "deepseek2.attention.key_length_mla" not in g.meta:
            raise g.unsupported("no attention.key_length_mla: a GGUF from before llama.cpp split kv_b_proj into "
                                "attn_k_b / attn_v_b; re-convert it with a current convert_hf_to_gguf.py")
        k_mla, v_mla = int(g("attention.key_length_mla")), int(g("attention.value_length_mla"))
        return dict(n_kv_heads=int(g("attention.head_count_kv", 1)), head_dim=k_mla,
                    rope_dim=int(g("rope.dimension_count")), attention="mla",
                    q_lora_rank=int(g("attention.q_lora_rank", 0)), kv_lora_rank=int(g("attention.kv_lora_rank")),
                    v_head_dim=v_mla)

    def config_fields(self, g, meta, shapes):
        f = super().config_fields(g, meta, shapes)
        first_moe = f["n_dense_leading"]
        gating = int(g("expert_gating_func", 1))
        if gating not in GATING:
            raise g.unsupported(f"expert_gating_func {gating} is not supported (softmax 1, sigmoid 2)")
        f.update(shared_expert_ffn_dim=f["expert_ffn_dim"] * int(g("expert_shared_count", 0)),
                 shared_expert_gate=False, expert_gating=GATING[gating],
                 score_bias=f"blk.{first_moe}.exp_probs_b.bias" in shapes,
                 expert_groups=int(g("expert_group_count", 1)), expert_groups_used=int(g("expert_group_used_count", 1)),
                 expert_weights_scale=float(g("expert_weights_scale", 1.0)))
        # the softmax scale: mscale^2 / sqrt(head_dim) under YaRN (1 / sqrt(head_dim) without)
        mscale = 1.0
        if f.get("rope_scaling") == "yarn":
            mscale_all_dim = float(g("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1  # the converter wrote 0.1 * it
            mscale = yarn_mscale(f["rope_scale"], mscale_all_dim) if mscale_all_dim else 1.0
        f["attn_scale"] = mscale * mscale / math.sqrt(f["head_dim"])
        return f

    def rope_scaling_fields(self, g):
        f = super().rope_scaling_fields(g)
        if f.get("rope_scaling") == "yarn":
            # DeepSeek's mscale == mscale_all_dim: cos/sin unscaled (llama-context.cpp's deepseek2 case)
            f["yarn_attn_factor"] = float(g("rope.scaling.yarn_attn_factor", 1.0))
        return f

    # --- the converter's side ---------------------------------------------------------------

    def hf_dense_layers(self, hf):
        return set(range(int(hf.first_k_dense_replace or 0)))

    def hf_rope_dim(self, hf, head_dim):
        return int(hf.qk_rope_head_dim)

    def hf_heads(self, hf, head_dim):
        C = int(hf.kv_lora_rank)  # MLA as MQA: one latent "head" of the latent + rope key
        return 1, C + int(hf.qk_rope_head_dim), C

    def write_metadata(self, w: Any, hf: Any) -> None:
        C, R = int(hf.kv_lora_rank), int(hf.qk_rope_head_dim)
        w.add_key_length_mla(int(hf.qk_nope_head_dim) + R)
        w.add_value_length_mla(int(hf.v_head_dim))
        w.add_kv_lora_rank(C)
        if hf.q_lora_rank:
            w.add_q_lora_rank(int(hf.q_lora_rank))
        w.add_leading_dense_block_count(int(hf.first_k_dense_replace or 0))
        w.add_expert_shared_count(int(hf.n_shared_experts or 0))
        w.add_expert_weights_scale(float(hf.routed_scaling_factor))
        if getattr(hf, "model_type", "") == "deepseek_v2":
            # DeepseekV2TopkRouter: softmax scores, no score bias, the weights as picked (times
            # routed_scaling_factor). As llama.cpp's converter does, no groups are written: V2's
            # group_limited_greedy (a group's best expert decides) has no GGUF field, and
            # llama.cpp's group rule is V3's (a group's two best), so a V2 file routes over all
            # experts (V2-Lite's "greedy" exactly; V2/V2.5's grouped choice approximately).
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
        else:
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)  # DeepseekV3TopkRouter (config.json's scoring_func)
            if hf.n_group:
                w.add_expert_group_count(int(hf.n_group))
                w.add_expert_group_used_count(int(hf.topk_group))
        params = getattr(hf, "rope_parameters", None) or {}
        if params.get("rope_type") == "yarn" and params.get("mscale_all_dim") is not None:
            w.add_rope_scaling_yarn_log_mul(0.1 * float(params["mscale_all_dim"]))

    _NAMES = {
        "self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
        "self_attn.q_b_proj.weight": "attn_q_b.weight", "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
        "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
        "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
        "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
        "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
        "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    }

    def hf_tensor(self, layer, rest, a, hf):
        if layer is None:
            return None
        p = f"blk.{layer}."
        if rest == "self_attn.kv_b_proj.weight":  # [heads * (nope + v), C] -> k_b [h, C, nope], v_b [h, v, C]
            nh, nope, v = int(hf.num_attention_heads), int(hf.qk_nope_head_dim), int(hf.v_head_dim)
            kv_b = a.reshape(nh, nope + v, a.shape[-1])
            return [(p + "attn_k_b.weight", kv_b[:, :nope].transpose(0, 2, 1)), (p + "attn_v_b.weight", kv_b[:, nope:])]
        if rest in self._NAMES:
            return [(p + self._NAMES[rest], a)]
        return None

    def hf_tensor_from_gguf(self, key, g):
        for rest, name in self._NAMES.items():
            if key.endswith("." + rest) and key.startswith("model.layers."):
                return g[f"blk.{key.split('.')[2]}.{name}"]
        if key.endswith("self_attn.kv_b_proj.weight"):
            p = f"blk.{key.split('.')[2]}."
            k_b, v_b = g[p + "attn_k_b.weight"], g[p + "attn_v_b.weight"]
            kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
            return kv_b.reshape(-1, kv_b.shape[-1])
        return None


ARCH = Deepseek2()
