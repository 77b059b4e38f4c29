"""qwen3next: Qwen3-Next, the hybrid linear-attention MoE (llama.cpp's `qwen3next`).

Three of every four layers are Gated DeltaNet (stages/blocks/deltanet.py: a short causal conv and a
fixed-size recurrent state per sequence, no KV); every fourth is full attention whose q
projection also yields a per-head output gate (sigmoid(gate) * attention before attn_output),
with per-head q/k RMSNorm and partial NeoX RoPE (the first rope.dimension_count dims of each
head, a quarter of it). Every layer is MoE: softmax top-k renormalised, plus a shared expert
behind a sigmoid gate.

As llama.cpp's converter (Qwen3NextModel) writes it:
- every RMSNorm weight except the DeltaNet's gated norm is stored +1 (transformers keeps 1 + w);
- A_log is stored as ssm_a = -exp(A_log), dt_bias as ssm_dt.bias, conv1d squeezed to [C, K] (F32);
- in_proj_qkvz, grouped per key head as [q, k, v, z], is split into attn_qkv = [all q; all k;
  all v] and attn_gate = [all z]; the V heads keep transformers' grouped order (v head h reads
  k head h // (H_v/H_k)); in_proj_ba stays grouped as ssm_ba = per key head [b.., a..];
- the layer types as attention.recurrent_layers (and full_attention_interval).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from moeray.stages.arch.base import Architecture, moe_tensors
from moeray.stages.arch.config import ModelConfig
from moeray.stages.arch.deltanet_shape import DeltaNetShape


class Qwen3Next(Architecture):
    name = "qwen3next"
    norm_topk_default = True
    qk_norm = True
    hf_classes = ("Qwen3NextForCausalLM",)
    hf_model_types = ("qwen3_next",)
    ffn_norm_name = "post_attention_norm"  # llama.cpp's ATTN_POST_NORM, where other families say ffn_norm
    v_order = "grouped"

    # --- metadata -> config ----------------------------------------------------------------

    def config_fields(self, g, meta, shapes):
        f = super().config_fields(g, meta, shapes)
        # The converter counts the multi-token-prediction blocks in block_count (after the trunk's
        # layers); they are a draft head, not run in the main pass (llama.cpp skips them too).
        f["n_layers"] -= int(g("nextn_predict_layers", 0))
        L = f["n_layers"]
        recurrent = g("attention.recurrent_layers", None)
        if recurrent is None:
            interval = int(g("full_attention_interval", 4))
            recurrent = [(i + 1) % interval != 0 for i in range(L)]
        recurrent = tuple(bool(x) for x in list(recurrent)[:L])  # MTP blocks beyond n_layers are not run
        shared = int(g("expert_shared_feed_forward_length", 0))
        dn = DeltaNetShape(n_k_heads=int(g("ssm.group_count")), n_v_heads=int(g("ssm.time_step_rank")),
                           head_k_dim=int(g("ssm.state_size")),
                           head_v_dim=int(g("ssm.inner_size")) // int(g("ssm.time_step_rank")),
                           conv_kernel=int(g("ssm.conv_kernel")), v_order=self.v_order)
        f.update(shared_expert_ffn_dim=shared, shared_expert_gate=True, deltanet=dn, recurrent=recurrent)
        return f

    # --- layers ----------------------------------------------------------------------------

    def attention_kind(self, cfg: ModelConfig, layer: int) -> str:
        return "deltanet" if cfg.recurrent[layer] else "gated_gqa"

    def layer_tensors(self, cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
        p, H = f"blk.{layer}.", cfg.hidden
        t = {p + "attn_norm.weight": (H,), p + "post_attention_norm.weight": (H,)}
        if cfg.recurrent[layer]:
            dn = cfg.deltanet
            t.update({p + "attn_qkv.weight": (dn.conv_dim, H), p + "attn_gate.weight": (dn.value_dim, H),
                      p + "ssm_conv1d.weight": (dn.conv_dim, dn.conv_kernel), p + "ssm_dt.bias": (dn.n_v_heads,),
                      p + "ssm_a": (dn.n_v_heads,), p + "ssm_norm.weight": (dn.head_v_dim,),
                      p + "ssm_out.weight": (H, dn.value_dim)})
            t.update(self.beta_alpha_tensors(cfg, p))
        else:
            D, nq, nkv = cfg.head_dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
            t.update({p + "attn_q.weight": (2 * nq, H), p + "attn_k.weight": (nkv, H),
                      p + "attn_v.weight": (nkv, H), p + "attn_output.weight": (H, nq),
                      p + "attn_q_norm.weight": (D,), p + "attn_k_norm.weight": (D,)})
        t.update(moe_tensors(cfg, p))
        return t

    def beta_alpha_tensors(self, cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
        return {p + "ssm_ba.weight": (2 * cfg.deltanet.n_v_heads, cfg.hidden)}

    def beta_alpha_rows(self, cfg: ModelConfig, layer: int) -> list[tuple[str, np.ndarray | None]]:
        """(tensor, rows) whose rows, stacked, are [beta (H_v, v-head order); alpha (H_v)]:
        ssm_ba holds per key head [b_0..b_{r-1}, a_0..a_{r-1}]."""
        dn = cfg.deltanet
        r = dn.n_v_heads // dn.n_k_heads
        rows = np.arange(2 * dn.n_v_heads).reshape(dn.n_k_heads, 2, r)
        name = f"blk.{layer}.ssm_ba.weight"
        return [(name, rows[:, 0].reshape(-1)), (name, rows[:, 1].reshape(-1))]

    def kv_values(self, cfg: ModelConfig, layer: int) -> int:
        return 0 if cfg.recurrent[layer] else 2 * cfg.n_kv_heads * cfg.head_dim

    def state_bytes(self, cfg: ModelConfig, layer: int) -> int:
        """One sequence's DeltaNet state in this layer (conv + recurrent, float32)."""
        return cfg.deltanet.state_bytes() if cfg.recurrent[layer] else 0

    # --- the converter's side (stages/gguf/writer.py) ---------------------------------------

    def write_metadata(self, w: Any, hf: Any) -> None:
        w.add_expert_shared_feed_forward_length(int(hf.shared_expert_intermediate_size))
        w.add_ssm_conv_kernel(int(hf.linear_conv_kernel_dim))
        w.add_ssm_state_size(int(hf.linear_key_head_dim))
        w.add_ssm_group_count(int(hf.linear_num_key_heads))
        w.add_ssm_time_step_rank(int(hf.linear_num_value_heads))
        w.add_ssm_inner_size(int(hf.linear_value_head_dim) * int(hf.linear_num_value_heads))
        w.add_array(f"{self.name}.attention.recurrent_layers",
                    [t == "linear_attention" for t in hf.layer_types])
        w.add_full_attention_interval(int(getattr(hf, "full_attention_interval", 4)))

    def hf_rope_dim(self, hf: Any, head_dim: int) -> int:
        return int(head_dim * (getattr(hf, "rope_parameters", None) or {}).get("partial_rotary_factor", 0.25))

    def hf_tensor(self, layer: int | None, rest: str, a: np.ndarray, hf: Any) -> list[tuple[str, np.ndarray]] | None:
        """GGUF tensors for one transformers tensor (`rest` after "model.layers.{layer}.", or the
        whole key when layer is None); None: the common mapping applies."""
        if rest.endswith("norm.weight") or rest.endswith("layernorm.weight"):
            if not rest.endswith("linear_attn.norm.weight"):
                a = a + 1.0  # the converter stores 1 + w; the gated norm stays as it is
            if layer is None:
                return [("output_norm.weight", a)] if rest == "model.norm.weight" else None
            names = {"input_layernorm.weight": "attn_norm.weight",
                     "post_attention_layernorm.weight": "post_attention_norm.weight",
                     "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
                     "linear_attn.norm.weight": "ssm_norm.weight"}
            return [(f"blk.{layer}.{names[rest]}", a)]
        if layer is None or not rest.startswith("linear_attn."):
            return None
        p, sub = f"blk.{layer}.", rest[len("linear_attn."):]
        a = self.reorder_v(sub, a, hf)
        if sub == "A_log":
            return [(p + "ssm_a", -np.exp(a))]
        if sub == "dt_bias":
            return [(p + "ssm_dt.bias", a)]
        if sub == "conv1d.weight":
            return [(p + "ssm_conv1d.weight", a.reshape(a.shape[0], -1))]
        if sub == "out_proj.weight":
            return [(p + "ssm_out.weight", a)]
        return self.hf_projection(p, sub, a, hf)

    def reorder_v(self, sub: str, a: np.ndarray, hf: Any) -> np.ndarray:
        """The file's V-head order from transformers' (grouped): unchanged here."""
        return a

    def hf_projection(self, p: str, sub: str, a: np.ndarray, hf: Any) -> list[tuple[str, np.ndarray]]:
        Hk, Hv = hf.linear_num_key_heads, hf.linear_num_value_heads
        Dk, Dv = hf.linear_key_head_dim, hf.linear_value_head_dim
        r = Hv // Hk
        if sub == "in_proj_qkvz.weight":  # per key head [q, k, v, z] -> [all q; all k; all v], [all z]
            g = a.reshape(Hk, 2 * Dk + 2 * r * Dv, -1)
            q, k, v, z = np.split(g, [Dk, 2 * Dk, 2 * Dk + r * Dv], axis=1)
            H = a.shape[1]
            qkv = np.concatenate([q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)])
            return [(p + "attn_qkv.weight", qkv), (p + "attn_gate.weight", z.reshape(-1, H))]
        if sub == "in_proj_ba.weight":
            return [(p + "ssm_ba.weight", a)]
        raise ValueError(f"no GGUF name for transformers tensor linear_attn.{sub}")


ARCH = Qwen3Next()
