"""llama: dense llama models and Mixtral-style MoE (llama.cpp stores Mixtral as arch "llama" with
ffn_gate_inp + ffn_{gate,up,down}_exps). The converter permutes q/k rows, so RoPE rotates
adjacent pairs ("normal" style)."""
from __future__ import annotations

from moeray.stages.arch.base import Architecture


class Llama(Architecture):
    name = "llama"
    rope_style = "normal"
    norm_topk_default = True  # Mixtral renormalises its top-2
    hf_classes = ("LlamaForCausalLM", "MixtralForCausalLM")
    hf_model_types = ("llama", "mixtral")
    permute_qk = True

    def config_fields(self, g, meta, shapes):
        f = super().config_fields(g, meta, shapes)
        if f["n_experts"] and not f["expert_ffn_dim"]:
            # Mixtral-style llama stores the expert width as feed_forward_length
            shape = shapes.get("blk.0.ffn_gate_exps.weight")
            f["expert_ffn_dim"] = shape[1] if shape else int(g("feed_forward_length"))
        return f

    def hf_norm_topk(self, hf_config) -> bool:
        return True  # llama.cpp hard-codes Mixtral's renormalisation


ARCH = Llama()
