"""gpt-oss: OpenAI's gpt-oss-20b and gpt-oss-120b (llama.cpp's `gpt-oss`, LLM_ARCH_OPENAI_MOE).

Every layer is GQA attention then an MoE FFN:
- q/k/v and output biases; attention sinks, a learned logit per head that joins each query's
  softmax and attends to nothing (stages/blocks/attention.py);
- alternating windows: layers 0, 2, 4, ... see the last `sliding_window` (128) tokens, the odd
  layers the whole context (llama.cpp's swa pattern 2, transformers' layer_types). Their KV is
  kept whole and the window is a mask (docs/models.md, "gpt-oss");
- YaRN RoPE over NeoX halves, with transformers' un-truncated correction range (the model's own
  rope: its HF config says truncate=False; llama.cpp's ggml rounds the range outwards, a small
  difference; moeray's trunk graph hands ggml these frequencies as freq_factors and keeps them);
- the FFN's norm is stored as post_attention_norm;
- the router has a bias; the k largest logits are softmaxed among themselves (routing
  `topk_softmax`); experts carry biases and use the clamped SwiGLU (expert_act "swiglu_oai",
  alpha 1.702, limit 7: llama.cpp hard-codes both, a file may carry `swiglu_clamp_exp`).

As llama.cpp's converter (conversion/gpt_oss.py, GptOssModel) writes it:
- `self_attn.sinks` as attn_sinks.weight;
- the interleaved experts.gate_up_proj [E, H, 2F] transposed, gate = rows ::2, up = rows 1::2
  (its bias split the same way); down_proj [E, F, H] transposed to [E, H, F];
- the published files hold MXFP4 experts (the MXFP4 checkpoint's blocks repacked).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from moeray.stages.arch.base import Architecture

_SWIGLU_ALPHA, _SWIGLU_LIMIT = 1.702, 7.0  # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants


class GptOss(Architecture):
    name = "gpt-oss"
    routing = "topk_softmax"
    hf_classes = ("GptOssForCausalLM",)
    hf_model_types = ("gpt_oss",)
    ffn_norm_name = "post_attention_norm"

    # --- metadata -> config ----------------------------------------------------------------

    def config_fields(self, g, meta, shapes):
        f = super().config_fields(g, meta, shapes)
        n = f["n_layers"]
        pattern = g("attention.sliding_window_pattern", 2)
        if isinstance(pattern, list):  # per layer, as llama.cpp also accepts
            swa = tuple(bool(x) for x in pattern[:n])
        else:  # every n-th layer is full, the others slide (llama_hparams::set_swa_pattern)
            swa = tuple(int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(n))
        limit = g("swiglu_clamp_exp", _SWIGLU_LIMIT)
        if isinstance(limit, list):
            if len(set(limit)) > 1:
                raise g.unsupported(f"swiglu_clamp_exp differs between layers ({sorted(set(limit))}); "
                                    "moeray applies one limit to every layer")
            limit = limit[0]
        f.update(
            expert_act="swiglu_oai", swiglu_alpha=_SWIGLU_ALPHA, swiglu_limit=float(limit),
            expert_bias=True, router_bias=True, attn_out_bias=True, attn_sinks=True,
            sliding_window=int(g("attention.sliding_window")), swa_layers=swa,
            norm_topk_prob=True, yarn_truncate=False,
        )
        return f

    # --- the converter's side (stages/gguf/writer.py) ---------------------------------------

    def write_metadata(self, w: Any, hf_config: Any) -> None:
        w.add_sliding_window(int(hf_config.sliding_window))

    def hf_norm_topk(self, hf_config: Any) -> bool:
        return True  # softmax over the top k: weights sum to 1

    def hf_tensor(self, layer, rest, a, hf_config):
        """The converter's own layout of gpt-oss's tensors (renamed, split, transposed)."""
        if layer is None:
            return None
        p = f"blk.{layer}."
        if rest in _RENAMED:
            return [(p + _RENAMED[rest], a)]
        if rest == "mlp.experts.gate_up_proj":  # [E, H, 2F], gate and up interleaved
            t = a.transpose(0, 2, 1)
            return [(p + "ffn_gate_exps.weight", t[:, ::2]), (p + "ffn_up_exps.weight", t[:, 1::2])]
        if rest == "mlp.experts.gate_up_proj_bias":
            return [(p + "ffn_gate_exps.bias", a[:, ::2]), (p + "ffn_up_exps.bias", a[:, 1::2])]
        if rest == "mlp.experts.down_proj":  # [E, F, H]
            return [(p + "ffn_down_exps.weight", a.transpose(0, 2, 1))]
        return None

    def hf_tensor_from_gguf(self, key: str, g: dict[str, np.ndarray]) -> np.ndarray | None:
        """The inverse of hf_tensor: one transformers tensor from the GGUF's (dequantised) ones."""
        layer, rest = _split(key)
        if rest is None:
            return None
        p = f"blk.{layer}."
        if rest in _RENAMED:
            return g[p + _RENAMED[rest]]
        if rest == "mlp.experts.gate_up_proj":
            return _interleave(g[p + "ffn_gate_exps.weight"], g[p + "ffn_up_exps.weight"]).transpose(0, 2, 1)
        if rest == "mlp.experts.gate_up_proj_bias":
            return _interleave(g[p + "ffn_gate_exps.bias"], g[p + "ffn_up_exps.bias"])
        if rest == "mlp.experts.down_proj":
            return g[p + "ffn_down_exps.weight"].transpose(0, 2, 1)
        return None


_RENAMED = {  # transformers name (after model.layers.L.) -> GGUF name (after blk.L.)
    "self_attn.sinks": "attn_sinks.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
}


def _split(key: str) -> tuple[str | None, str | None]:
    parts = key.split(".", 3)
    if len(parts) < 4 or parts[:2] != ["model", "layers"]:
        return None, None
    return parts[2], parts[3]


def _interleave(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[E, n, ...] twice -> [E, 2n, ...] with a in the even rows of axis 1, b in the odd."""
    out = np.empty((a.shape[0], 2 * a.shape[1]) + a.shape[2:], np.float32)
    out[:, ::2], out[:, 1::2] = a, b
    return out


ARCH = GptOss()
