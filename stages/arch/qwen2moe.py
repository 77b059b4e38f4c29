"""qwen2moe: Qwen1.5/Qwen2-MoE. Softmax top-k without renormalisation (transformers' default,
llama.cpp agrees), a shared expert behind a sigmoid gate, q/k/v biases, NeoX RoPE."""
from __future__ import annotations

from moeray.stages.arch.base import Architecture


class Qwen2Moe(Architecture):
    name = "qwen2moe"
    norm_topk_default = False
    hf_classes = ("Qwen2MoeForCausalLM",)
    hf_model_types = ("qwen2_moe",)

    def config_fields(self, g, meta, shapes):
        f = super().config_fields(g, meta, shapes)
        shared = int(g("expert_shared_feed_forward_length", 0))
        if not shared:
            shape = shapes.get("blk.0.ffn_gate_shexp.weight")
            shared = shape[0] if shape else 0
        f.update(shared_expert_ffn_dim=shared, shared_expert_gate=True)
        return f

    def write_metadata(self, w, hf_config) -> None:
        w.add_expert_shared_feed_forward_length(int(hf_config.shared_expert_intermediate_size))


ARCH = Qwen2Moe()
