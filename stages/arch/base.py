"""What every architecture shares, and the one class a model family fills in.

An `Architecture` turns GGUF metadata into a `ModelConfig`, names each layer's tensors, says how
each layer is built (its attention kind and its FFN kind: dense or MoE), which routing function
its MoE blocks use (stages/blocks/routing.py), and how many KV values a token takes in each layer (the
KV pool and the planner price KV from it). The blocks themselves (attention variants, RoPE
variants, the dense FFN, the MoE block) stay shared in stages/blocks/attention.py, stages/blocks/rope.py and
stages/blocks/moe.py; an architecture only picks and wires them.

Torch-free: the planner and `moeray plan` read configs and tensor tables from headers alone.
"""
from __future__ import annotations

import math
from typing import Any

from moeray.errors import GGUFError, UnsupportedArchitectureError
from moeray.stages.arch.config import ModelConfig

Shapes = dict[str, tuple[int, ...]]


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale 0.1 * mscale * ln(factor) + 1 (1 when the context is not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class Meta:
    """`{arch}.KEY` lookups in a GGUF's metadata; a missing required key is one clear error."""

    def __init__(self, meta: dict[str, Any], arch: str, path: str):
        self.meta, self.arch, self.path = meta, arch, path

    def __call__(self, key: str, default: Any = ...) -> Any:
        full = f"{self.arch}.{key}"
        if full in self.meta:
            return self.meta[full]
        if default is ...:
            raise GGUFError(f"{self.path}: metadata key '{full}' is missing; the file was not written by a "
                            "llama.cpp-compatible converter (re-convert it with convert_hf_to_gguf.py)")
        return default

    def unsupported(self, what: str) -> UnsupportedArchitectureError:
        return UnsupportedArchitectureError(f"{self.path}: {what}")


# --- the tensors of the shared blocks (numpy shapes) -----------------------------------------

def gqa_tensors(cfg: ModelConfig, p: str) -> Shapes:
    """Grouped-query attention: q/k/v/o, optional q/k/v biases and per-head q/k RMSNorm."""
    H, D, q_out, kv_out = cfg.hidden, cfg.head_dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    t = {p + "attn_q.weight": (q_out, H), p + "attn_k.weight": (kv_out, H), p + "attn_v.weight": (kv_out, H),
         p + "attn_output.weight": (H, q_out)}
    if cfg.qkv_bias:
        t.update({p + "attn_q.bias": (q_out,), p + "attn_k.bias": (kv_out,), p + "attn_v.bias": (kv_out,)})
    if cfg.qk_norm:
        t.update({p + "attn_q_norm.weight": (D,), p + "attn_k_norm.weight": (D,)})
    if cfg.attn_out_bias:
        t[p + "attn_output.bias"] = (H,)
    if cfg.attn_sinks:
        t[p + "attn_sinks.weight"] = (cfg.n_heads,)
    return t


def dense_ffn_tensors(cfg: ModelConfig, p: str) -> Shapes:
    H, F = cfg.hidden, cfg.ffn_dim
    return {p + "ffn_gate.weight": (F, H), p + "ffn_up.weight": (F, H), p + "ffn_down.weight": (H, F)}


def moe_tensors(cfg: ModelConfig, p: str) -> Shapes:
    """Router + stacked experts, and the shared expert (gated when `cfg.shared_expert_gate`)."""
    H, E, F = cfg.hidden, cfg.n_experts, cfg.expert_ffn_dim
    t = {p + "ffn_gate_inp.weight": (E, H), p + "ffn_gate_exps.weight": (E, F, H),
         p + "ffn_up_exps.weight": (E, F, H), p + "ffn_down_exps.weight": (E, H, F)}
    if cfg.shared_expert_ffn_dim:
        S = cfg.shared_expert_ffn_dim
        t.update({p + "ffn_gate_shexp.weight": (S, H), p + "ffn_up_shexp.weight": (S, H),
                  p + "ffn_down_shexp.weight": (H, S)})
        if cfg.shared_expert_gate:
            t[p + "ffn_gate_inp_shexp.weight"] = (H,)
    if cfg.router_bias:
        t[p + "ffn_gate_inp.bias"] = (E,)
    if cfg.score_bias:
        t[p + "exp_probs_b.bias"] = (E,)
    if cfg.expert_bias:
        t.update({p + "ffn_gate_exps.bias": (E, F), p + "ffn_up_exps.bias": (E, F), p + "ffn_down_exps.bias": (E, H)})
    return t


def mla_tensors(cfg: ModelConfig, p: str) -> Shapes:
    """Multi-head latent attention (stages/blocks/mla.py) as llama.cpp's current converter writes it:
    kv_b_proj split per head into attn_k_b [heads, kv_lora, nope] and attn_v_b [heads, v, kv_lora]."""
    H, nh, C, R = cfg.hidden, cfg.n_heads, cfg.kv_lora_rank, cfg.rope_dim
    nope, v = cfg.head_dim - R, cfg.v_head_dim or cfg.head_dim
    t = {p + "attn_kv_a_mqa.weight": (C + R, H), p + "attn_kv_a_norm.weight": (C,),
         p + "attn_k_b.weight": (nh, C, nope), p + "attn_v_b.weight": (nh, v, C),
         p + "attn_output.weight": (H, nh * v)}
    if cfg.q_lora_rank:
        Q = cfg.q_lora_rank
        t.update({p + "attn_q_a.weight": (Q, H), p + "attn_q_a_norm.weight": (Q,),
                  p + "attn_q_b.weight": (nh * cfg.head_dim, Q)})
    else:
        t[p + "attn_q.weight"] = (nh * cfg.head_dim, H)
    return t


ATTENTION_TENSORS = {"gqa": gqa_tensors, "mla": mla_tensors}
# (heads, key width, value width) one token takes in one layer's KV pool, per attention kind:
# k and v of every KV head; MLA's latent + RoPE key, one row, no separate value.
KV_LAYOUT = {"gqa": lambda cfg: (cfg.n_kv_heads, cfg.head_dim, cfg.head_dim),
             "mla": lambda cfg: (1, cfg.kv_lora_rank + cfg.rope_dim, 0)}


class Architecture:
    """One model family. Subclasses set `name` and override what differs from the defaults here
    (a llama-like stack of [attention, FFN] layers with GQA and softmax top-k routing)."""

    name: str = ""
    routing: str = "softmax_topk"  # a function of stages/blocks/routing.py
    rope_style: str = "neox"  # "normal" where the converter permutes q/k rows (llama)
    norm_topk_default: bool = True  # renormalise the top-k weights when the file does not say
    qk_norm: bool = False  # per-head q/k RMSNorm required in every layer
    # The converter's side (stages/gguf/writer.py): transformers classes and model_types written
    # as this architecture, and whether q/k rows are permuted for "normal" RoPE.
    hf_classes: tuple[str, ...] = ()
    hf_model_types: tuple[str, ...] = ()
    permute_qk: bool = False
    ffn_norm_name: str = "ffn_norm"  # the pre-FFN norm's tensor (qwen3next: post_attention_norm)

    # --- metadata -> config ----------------------------------------------------------------

    def config(self, meta: dict[str, Any], shapes: Shapes, path: str) -> ModelConfig:
        return ModelConfig(**self.config_fields(Meta(meta, self.name, path), meta, shapes))

    def config_fields(self, g: Meta, meta: dict[str, Any], shapes: Shapes) -> dict[str, Any]:
        """The fields every family reads the same way; subclasses adjust the dict."""
        n_heads = int(g("attention.head_count"))
        hidden = int(g("embedding_length"))
        heads = self.head_fields(g, hidden, n_heads)
        head_dim, rope_dim = heads["head_dim"], heads["rope_dim"] or heads["head_dim"]
        if not 0 < rope_dim <= head_dim or rope_dim % 2:
            raise g.unsupported(f"rope.dimension_count {rope_dim} does not fit head_dim {head_dim}")
        n_experts = int(g("expert_count", 0))
        expert_ffn = int(g("expert_feed_forward_length", 0)) if n_experts else 0
        # DeepSeek's first_k_dense_replace, GLM's first layer: dense FFN layers before the MoE ones
        dense_lead = int(g("leading_dense_block_count", 0)) if n_experts else 0
        emb = shapes.get("token_embd.weight")
        vocab = emb[0] if emb else int(g("vocab_size", len(meta.get("tokenizer.ggml.tokens", ())) or 0))
        bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
        return dict(
            arch=self.name, n_layers=int(g("block_count")), hidden=hidden, n_heads=n_heads, **heads,
            vocab_size=int(vocab),
            context_length=int(g("context_length", 4096)), rope_theta=float(g("rope.freq_base", 10000.0)),
            rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)), rope_style=self.rope_style,
            ffn_dim=int(g("feed_forward_length", 0)) if dense_lead or not n_experts else 0, n_experts=n_experts,
            n_dense_leading=dense_lead,
            n_experts_used=int(g("expert_used_count", 0)), expert_ffn_dim=expert_ffn,
            shared_expert_ffn_dim=0, norm_topk_prob=bool(g("expert_weights_norm", self.norm_topk_default)),
            qk_norm=self.qk_norm, tie_embeddings="output.weight" not in shapes,
            bos_token_id=None if bos is None else int(bos), eos_token_id=None if eos is None else int(eos),
            qkv_bias="blk.0.attn_q.bias" in shapes, **self.rope_scaling_fields(g),
        )

    def head_fields(self, g: Meta, hidden: int, n_heads: int) -> dict[str, Any]:
        """KV heads, head width and rotary width (0: all of the head) of GQA attention."""
        head_dim = int(g("attention.key_length", hidden // n_heads))
        value_dim = int(g("attention.value_length", head_dim))
        if value_dim != head_dim:
            raise g.unsupported(f"attention.value_length {value_dim} != key_length {head_dim}; moeray needs "
                                "them equal for this architecture")
        rope_dim = int(g("rope.dimension_count", head_dim))
        return dict(n_kv_heads=int(g("attention.head_count_kv", n_heads)), head_dim=head_dim,
                    rope_dim=0 if rope_dim == head_dim else rope_dim)

    def rope_scaling_fields(self, g: Meta) -> dict[str, Any]:
        """rope.scaling.*: none, linear, or YaRN with its attention factor as llama.cpp derives it
        (llama-context.cpp: 0.1 ln(factor) + 1, or the ratio of two such scales when the file
        carries yarn_log_multiplier); an explicit yarn_attn_factor wins, as in transformers."""
        scaling = str(g("rope.scaling.type", "none"))
        factor = float(g("rope.scaling.factor", 1.0))
        if scaling == "none" or (scaling == "linear" and factor == 1.0):
            return {}
        if scaling == "linear":
            return dict(rope_scaling="linear", rope_scale=factor)
        if scaling != "yarn":
            raise g.unsupported(f"rope scaling '{scaling}' is not supported for {self.name} (none, linear, yarn)")
        log_mul = float(g("rope.scaling.yarn_log_multiplier", 0.0))
        if log_mul:
            attn = yarn_mscale(factor) / yarn_mscale(factor, log_mul)
        else:
            attn = yarn_mscale(factor)
        return dict(rope_scaling="yarn", rope_scale=factor,
                    rope_orig_context=int(g("rope.scaling.original_context_length")),
                    yarn_beta_fast=float(g("rope.scaling.yarn_beta_fast", 32.0)),
                    yarn_beta_slow=float(g("rope.scaling.yarn_beta_slow", 1.0)),
                    yarn_attn_factor=float(g("rope.scaling.yarn_attn_factor", attn)))

    # --- layers ----------------------------------------------------------------------------

    def is_moe_layer(self, cfg: ModelConfig, layer: int) -> bool:
        return cfg.is_moe_layer(layer)

    def attention_kind(self, cfg: ModelConfig, layer: int) -> str:
        """Which shared attention block layer `layer` is built with (stages/runtime/model.py builds it)."""
        return cfg.attention

    def attention_window(self, cfg: ModelConfig, layer: int) -> int:
        """Tokens layer `layer` attends over (itself included); 0: the whole context."""
        return cfg.sliding_window if layer < len(cfg.swa_layers) and cfg.swa_layers[layer] else 0

    def ffn_kind(self, cfg: ModelConfig, layer: int) -> str:
        return "moe" if self.is_moe_layer(cfg, layer) else "dense"

    def layer_tensors(self, cfg: ModelConfig, layer: int) -> Shapes:
        """Every tensor of one layer the engine reads, with its numpy shape."""
        p = f"blk.{layer}."
        t = {p + "attn_norm.weight": (cfg.hidden,), p + f"{self.ffn_norm_name}.weight": (cfg.hidden,)}
        t.update(ATTENTION_TENSORS[self.attention_kind(cfg, layer)](cfg, p))
        t.update(moe_tensors(cfg, p) if self.ffn_kind(cfg, layer) == "moe" else dense_ffn_tensors(cfg, p))
        return t

    def tensors(self, cfg: ModelConfig) -> Shapes:
        """Every tensor the engine reads from a file of this config."""
        t = {"token_embd.weight": (cfg.vocab_size, cfg.hidden), "output_norm.weight": (cfg.hidden,)}
        if not cfg.tie_embeddings:
            t["output.weight"] = (cfg.vocab_size, cfg.hidden)
        for i in range(cfg.n_layers):
            t.update(self.layer_tensors(cfg, i))
        return t

    def kv_layout(self, cfg: ModelConfig, layer: int) -> tuple[int, int, int]:
        """(heads, key width, value width) of layer `layer`'s KV pool (stages/blocks/kv_cache.py KVPool);
        value width 0: the latent layout, the key row is all a token holds."""
        return KV_LAYOUT.get(self.attention_kind(cfg, layer), KV_LAYOUT["gqa"])(cfg)

    def kv_values(self, cfg: ModelConfig, layer: int) -> int:
        """Values one token holds in layer `layer`'s KV cache (the KV pool's and the planner's price)."""
        heads, k_dim, v_dim = self.kv_layout(cfg, layer)
        return heads * (k_dim + v_dim)

    def state_bytes(self, cfg: ModelConfig, layer: int) -> int:
        """Bytes one sequence's recurrent state takes in layer `layer` (0: the layer keeps KV only);
        the stage holds it for every sequence slot, the planner and driver charge it like KV."""
        return 0

    # --- the converter's side (stages/gguf/writer.py) ---------------------------------------

    def write_metadata(self, w: Any, hf_config: Any) -> None:
        """Keys beyond the common ones that llama.cpp's converter writes for this family."""

    def hf_rope_dim(self, hf_config: Any, head_dim: int) -> int:
        """rope.dimension_count as written: the values of a head RoPE turns."""
        return head_dim

    def hf_heads(self, hf_config: Any, head_dim: int) -> tuple[int, int, int]:
        """(head_count_kv, key_length, value_length) as written."""
        return int(hf_config.num_key_value_heads), head_dim, head_dim

    def hf_tensor(self, layer: int | None, rest: str, a: Any, hf_config: Any) -> list | None:
        """The GGUF tensors [(name, array)] of one transformers tensor (`rest`: its key after
        "model.layers.{layer}.", or the whole key when layer is None), for a family whose
        converter transforms it; None: the common name mapping applies."""
        return None

    def hf_tensor_from_gguf(self, key: str, tensors: dict[str, Any]) -> Any | None:
        """The inverse of `hf_tensor` for reading a file back: one transformers tensor from the
        GGUF's dequantised ones (None: the common mapping)."""
        return None

    def hf_extra_tensors(self, hf_config: Any, tensors: dict) -> dict:
        """Tensors the converter writes that the transformers model does not have (GLM's MTP layers)."""
        return {}

    def hf_dense_layers(self, hf_config: Any) -> set[int]:
        """Layers of an MoE model the converter writes with a dense FFN (leading_dense_block_count)."""
        return set()

    def hf_norm_topk(self, hf_config: Any) -> bool:
        """expert_weights_norm as written: what the transformers model really does."""
        return bool(getattr(hf_config, "norm_topk_prob", False))

    def __repr__(self) -> str:
        return f"<architecture {self.name}>"
