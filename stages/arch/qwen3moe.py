"""qwen3moe: Qwen3-MoE. Softmax top-k, renormalised (as llama.cpp runs it), per-head q/k RMSNorm
before NeoX RoPE, no shared expert."""
from __future__ import annotations

from moeray.stages.arch.base import Architecture


class Qwen3Moe(Architecture):
    name = "qwen3moe"
    norm_topk_default = True
    qk_norm = True
    hf_classes = ("Qwen3MoeForCausalLM",)
    hf_model_types = ("qwen3_moe",)


ARCH = Qwen3Moe()
