"""glm4moe: GLM-4.5 / 4.6 / 4.5-Air (llama.cpp's `glm4moe`).

GQA attention with q/k/v biases, an optional per-head q/k RMSNorm (GLM-4.5 has it, Air not),
partial NeoX RoPE (the first half of each head: rope.dimension_count = head_dim / 2); the first
leading_dense_block_count layers dense, then MoE: sigmoid scores with the exp_probs_b
correction bias, top-k renormalised and scaled by routed_scaling_factor (stages/blocks/routing.py
grouped_topk, one group), plus an ungated shared expert. The pre-FFN norm is stored as
post_attention_norm (llama.cpp's ATTN_POST_NORM).

MTP: llama.cpp's converter appends the next-token-prediction layers (`nextn_predict_layers`,
one for GLM-4.5) after the decoder as blk.{n}.* with nextn.* tensors and counts them in
block_count. moeray serves the decoder only: those layers are neither loaded nor priced
(n_layers excludes them), and reading such a file says so once.
"""
from __future__ import annotations

import logging
from typing import Any

import gguf

from moeray.stages.arch.base import Architecture

log = logging.getLogger("moeray.arch")
_told: set[str] = set()


class Glm4Moe(Architecture):
    name = "glm4moe"
    routing = "grouped_topk"
    rope_style = "neox"
    norm_topk_default = False  # llama.cpp's default when expert_weights_norm is absent
    ffn_norm_name = "post_attention_norm"
    hf_classes = ("Glm4MoeForCausalLM",)
    hf_model_types = ("glm4_moe",)

    def config_fields(self, g, meta, shapes):
        f = super().config_fields(g, meta, shapes)
        nextn = int(g("nextn_predict_layers", 0))
        if nextn:
            f["n_layers"] -= nextn  # the MTP layers after the decoder: not loaded, not priced
            if g.path not in _told:
                _told.add(g.path)
                log.info("%s: skipping %d MTP (next-token prediction) layer(s) blk.%d-%d: moeray serves the decoder "
                         "only; they are neither loaded nor priced", g.path, nextn, f["n_layers"], f["n_layers"] + nextn - 1)
        gating = int(g("expert_gating_func", 2))
        f.update(shared_expert_ffn_dim=f["expert_ffn_dim"] * int(g("expert_shared_count", 0)),
                 shared_expert_gate=False, expert_gating="sigmoid" if gating == 2 else "softmax",
                 score_bias=f"blk.{f['n_dense_leading']}.exp_probs_b.bias" in shapes,
                 qk_norm="blk.0.attn_q_norm.weight" in shapes,
                 expert_groups=int(g("expert_group_count", 1)), expert_groups_used=int(g("expert_group_used_count", 1)),
                 expert_weights_scale=float(g("expert_weights_scale", 1.0)))
        return f

    # --- the converter's side ---------------------------------------------------------------

    def hf_dense_layers(self, hf):
        return set(range(int(hf.first_k_dense_replace or 0)))

    def hf_rope_dim(self, hf, head_dim):
        params = getattr(hf, "rope_parameters", None) or {}
        return int(head_dim * params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 0.5)))

    def write_metadata(self, w: Any, hf: Any) -> None:
        w.add_expert_shared_count(int(hf.n_shared_experts or 0))
        w.add_leading_dense_block_count(int(hf.first_k_dense_replace or 0))
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(float(hf.routed_scaling_factor))
        if hf.n_group:
            w.add_expert_group_count(int(hf.n_group))
            w.add_expert_group_used_count(int(hf.topk_group))
        nextn = int(getattr(hf, "num_nextn_predict_layers", 0) or 0)
        if nextn:  # the converter counts the MTP layers in block_count
            w.add_block_count(int(hf.num_hidden_layers) + nextn)
            w.add_nextn_predict_layers(nextn)

    def hf_extra_tensors(self, hf, tensors: dict) -> dict:
        """The MTP layers the converter appends (transformers does not build them): layer n as a
        copy of the last decoder layer plus its nextn.* tensors, so a file has what a published one does."""
        import numpy as np

        nextn = int(getattr(hf, "num_nextn_predict_layers", 0) or 0)
        n, H, V = int(hf.num_hidden_layers), int(hf.hidden_size), int(hf.vocab_size)
        last, out = f"blk.{n - 1}.", {}
        for i in range(n, n + nextn):
            p = f"blk.{i}."
            out.update({p + k[len(last):]: a.copy() for k, a in tensors.items() if k.startswith(last)})
            out[p + "nextn.eh_proj.weight"] = np.zeros((H, 2 * H), np.float32)
            out[p + "nextn.enorm.weight"] = np.ones(H, np.float32)
            out[p + "nextn.hnorm.weight"] = np.ones(H, np.float32)
            out[p + "nextn.shared_head_norm.weight"] = np.ones(H, np.float32)
        return out

    _NAMES = {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
        "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
        "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
        "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    }

    def hf_tensor(self, layer, rest, a, hf):
        if layer is not None and rest in self._NAMES:
            return [(f"blk.{layer}.{self._NAMES[rest]}", a)]
        return None

    def hf_tensor_from_gguf(self, key, g):
        for rest, name in self._NAMES.items():
            if key.startswith("model.layers.") and key.endswith("." + rest):
                return g[f"blk.{key.split('.')[2]}.{name}"]
        return None


ARCH = Glm4Moe()
