"""StageModel: layers [first, end) of a GGUF model, the unit a pipeline stage runs.

The trunk (attention, norms, router, shared expert, dense FFN, embedding, head) is dequantised to
contiguous float32 at load. Routed experts stay quantised in the file mapping and come from
`expert_source` when a step uses them. Only the tensors of the requested layers are read.
"""
from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from moeray.errors import MoerayError
from moeray.stages.gguf_file import GGUFFile, is_routed_expert
from moeray.stages.kv_cache import KVCache
from moeray.stages.layers import Attention, BatchMeta, RoPE, make_batch_meta, rms_norm
from moeray.stages.moe import DenseFFN, ExpertSource, HostExperts, MoEBlock
from moeray.stages.quant import dequantize


class TransformerLayer(torch.nn.Module):
    def __init__(self, attn_norm: torch.Tensor, attn: Attention, ffn_norm: torch.Tensor,
                 ffn: DenseFFN | MoEBlock):
        super().__init__()
        self.register_buffer("attn_norm", attn_norm, persistent=False)
        self.register_buffer("ffn_norm", ffn_norm, persistent=False)
        self.attn, self.ffn = attn, ffn


class StageModel(torch.nn.Module):
    """Layers [first, end) of a GGUF model; embedding if first == 0; final norm + lm_head if end == n_layers."""

    def __init__(self, gguf: GGUFFile, first: int, end: int, device: str | torch.device = "cpu"):
        super().__init__()
        cfg = gguf.config
        if not 0 <= first < end <= cfg.n_layers:
            raise MoerayError(f"{gguf.path}: layer range [{first}, {end}) is not within the model's "
                              f"{cfg.n_layers} layers")
        self.gguf, self.config, self.first, self.end = gguf, cfg, first, end
        self.device = torch.device(device)
        self.has_embedding, self.has_head = first == 0, end == cfg.n_layers
        self.rope = RoPE(cfg.head_dim, cfg.rope_theta, cfg.rope_style, cfg.rope_scale, device=self.device)
        self.expert_source: ExpertSource = HostExperts(gguf)
        self.routing_hook: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None

        self.register_buffer("tok_embd", self._load("token_embd.weight") if self.has_embedding else None,
                             persistent=False)
        self.layers = torch.nn.ModuleList(self._load_layer(i) for i in range(first, end))
        self.register_buffer("out_norm", None, persistent=False)
        self.register_buffer("w_out", None, persistent=False)
        if self.has_head:
            self.out_norm = self._load("output_norm.weight")
            if cfg.tie_embeddings:
                self.w_out = self.tok_embd if self.tok_embd is not None else self._load("token_embd.weight")
            else:
                self.w_out = self._load("output.weight")

    # --- loading ---------------------------------------------------------------------------

    def _load(self, name: str) -> torch.Tensor:
        info = self.gguf.info(name)
        t = dequantize(self.gguf.raw(name), info.ggml_type, info.shape)
        if info.ggml_type == GGMLQuantizationType.F32:
            t = t.clone()  # a view of the read-only mapping otherwise
        return t.to(self.device).contiguous()

    def _load_layer(self, i: int) -> TransformerLayer:
        cfg, p, ld = self.config, f"blk.{i}.", self._load
        w_qkv = torch.cat((ld(p + "attn_q.weight"), ld(p + "attn_k.weight"), ld(p + "attn_v.weight")))
        b_qkv = None
        if cfg.qkv_bias:
            b_qkv = torch.cat((ld(p + "attn_q.bias"), ld(p + "attn_k.bias"), ld(p + "attn_v.bias")))
        q_norm = ld(p + "attn_q_norm.weight") if cfg.qk_norm else None
        k_norm = ld(p + "attn_k_norm.weight") if cfg.qk_norm else None
        attn = Attention(cfg, i, w_qkv, b_qkv, ld(p + "attn_output.weight"), q_norm, k_norm)
        if cfg.is_moe:
            shared = gate = None
            if cfg.shared_expert_ffn_dim:
                shared = DenseFFN(torch.cat((ld(p + "ffn_gate_shexp.weight"), ld(p + "ffn_up_shexp.weight"))),
                                  ld(p + "ffn_down_shexp.weight"))
                gate = ld(p + "ffn_gate_inp_shexp.weight").reshape(-1)
            ffn = MoEBlock(cfg, i, ld(p + "ffn_gate_inp.weight"), shared, gate)
        else:
            ffn = DenseFFN(torch.cat((ld(p + "ffn_gate.weight"), ld(p + "ffn_up.weight"))),
                           ld(p + "ffn_down.weight"))
        return TransformerLayer(ld(p + "attn_norm.weight"), attn, ld(p + "ffn_norm.weight"), ffn)

    @classmethod
    def from_gguf(cls, path_or_gguf: str | os.PathLike | GGUFFile, layers: tuple[int, int] | None = None,
                  device: str | torch.device = "cpu") -> "StageModel":
        gguf = path_or_gguf if isinstance(path_or_gguf, GGUFFile) else GGUFFile(path_or_gguf)
        first, end = layers if layers is not None else (0, gguf.config.n_layers)
        return cls(gguf, first, end, device)

    # --- running ---------------------------------------------------------------------------

    def new_kv_cache(self, max_seqs: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(self.first, self.end - self.first, max_seqs, c.n_kv_heads, max_len, c.head_dim,
                       dtype=torch.float32, device=self.device)

    def batch_meta(self, n_new: list[int], slots: list[int], kv: KVCache) -> BatchMeta:
        """Where each new token goes; each stage builds its own from its own KV lengths."""
        return make_batch_meta(n_new, slots, kv, self.device)

    def embed(self, tokens: list[list[int]] | torch.Tensor) -> torch.Tensor:
        """Token ids (a list per sequence, or a flat tensor) -> packed hidden states [N, hidden]."""
        if not self.has_embedding:
            raise MoerayError(f"stage [{self.first}, {self.end}) has no embedding; feed it hidden states")
        if not isinstance(tokens, torch.Tensor):
            tokens = torch.tensor([t for seq in tokens for t in seq], dtype=torch.long)
        return F.embedding(tokens.to(self.device), self.tok_embd)

    @torch.inference_mode()
    def run_layers(self, hidden: torch.Tensor, meta: BatchMeta, kv: KVCache) -> torch.Tensor:
        """Packed hidden [N, hidden] through this stage's layers; appends the step's k/v to `kv`."""
        eps, source, hook = self.config.rms_eps, self.expert_source, self.routing_hook
        cos_sin = self.rope.cos_sin(meta.positions)
        x = hidden
        for layer in self.layers:
            x = x + layer.attn(rms_norm(x, layer.attn_norm, eps), meta, kv, self.rope, cos_sin)
            h = rms_norm(x, layer.ffn_norm, eps)
            x = x + (layer.ffn(h, source, hook) if isinstance(layer.ffn, MoEBlock) else layer.ffn(h))
        kv.advance(meta.slots, meta.n_new)
        return x

    @torch.inference_mode()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head: [n, hidden] -> [n, vocab] float32."""
        if not self.has_head:
            raise MoerayError(f"stage [{self.first}, {self.end}) has no head; pass its output to the next stage")
        return F.linear(rms_norm(hidden, self.out_norm, self.config.rms_eps), self.w_out)

    @torch.inference_mode()
    def step(self, tokens: list[list[int]], slots: list[int], kv: KVCache) -> torch.Tensor:
        """Append tokens[i] to the sequence in KV slot slots[i] (a prefill chunk or one decode token);
        returns the logits of each sequence's last new position, [n_seqs, vocab]."""
        if not self.has_embedding or not self.has_head:
            raise MoerayError(f"step() needs the whole model; stage [{self.first}, {self.end}) is a part, "
                              "use embed/run_layers/head")
        if any(len(t) == 0 for t in tokens):
            raise ValueError("every sequence in a step needs at least one new token")
        meta = self.batch_meta([len(t) for t in tokens], slots, kv)
        x = self.run_layers(self.embed(tokens), meta, kv)
        return self.head(x[meta.last_index])

    @torch.inference_mode()
    def logits_all(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of one fresh sequence, [T, vocab] float32."""
        kv = self.new_kv_cache(1, len(token_ids))
        meta = self.batch_meta([len(token_ids)], [0], kv)
        return self.head(self.run_layers(self.embed([list(token_ids)]), meta, kv))


def load_model(path: str | os.PathLike | GGUFFile, device: str | torch.device = "cpu") -> StageModel:
    return StageModel.from_gguf(path, None, device)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def memory_report(model: StageModel) -> dict:
    """What loading cost: the resident float32 trunk, the quantised expert bytes left in the mapping,
    and what the same layers would take fully dequantised to float32. `process_rss` is the whole
    process (torch, Python, tokenizer, ...), for context."""
    seen, trunk = set(), 0
    for t in model.buffers():
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            trunk += t.numel() * t.element_size()
    g, cfg = model.gguf, model.config
    expert_q = dequant = stored = 0
    for name, info in g.tensors.items():
        if name.startswith("blk."):
            if not model.first <= int(name.split(".")[1]) < model.end:
                continue
        elif name == "token_embd.weight":
            if not (model.has_embedding or (model.has_head and cfg.tie_embeddings)):
                continue
        elif not model.has_head:
            continue
        n = 1
        for d in info.shape:
            n *= d
        dequant += 4 * n
        stored += info.n_bytes
        if is_routed_expert(name):
            expert_q += info.n_bytes
    return {"trunk_resident_bytes": trunk, "experts_quantized_mapped_bytes": expert_q,
            "stored_bytes": stored, "fully_dequantized_bytes": dequant, "process_rss_bytes": _rss_bytes()}
