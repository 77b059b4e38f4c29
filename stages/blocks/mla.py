"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), over a latent KV cache.

Per token the layer keeps only the compressed latent c = RMSNorm(kv_a(x)[:kv_lora_rank]) and the
one RoPE key shared by all heads, k_pe = RoPE(kv_a(x)[kv_lora_rank:]): kv_lora_rank +
qk_rope_head_dim values per token per layer (576 for DeepSeek-V3, against 2 * 128 * 192 = 49,152
for the same heads as GQA). Every head's key and value come from c through attn_k_b / attn_v_b.

The attention runs in the weight-absorbed form llama.cpp uses (llama.cpp's converter splits
kv_b_proj into exactly these two matrices for it): a head's score is
    q_nope . (k_b c) + q_pe . k_pe = (k_b^T q_nope) . c + q_pe . k_pe,
so the query is moved into latent space once per token (q_lat = k_b^T q_nope) and the cache is
read as it is stored: one key head [c, k_pe] of kv_lora_rank + rope dims shared by every query
head, its first kv_lora_rank values the value. The latent output is moved back through v_b
per head. Nothing is decompressed per cached token, which is what makes the latent cache
cheap to read at long contexts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moeray.stages.arch.config import ModelConfig
from moeray.stages.blocks.kv_cache import KVPool
from moeray.stages.blocks.attention import BatchMeta, read_keys, rms_norm, work_dtype
from moeray.stages.kernels.qmatmul import QMatrix
from moeray.stages.blocks.rope import RoPE


class MLAttention(torch.nn.Module):
    window = 0  # no sliding window

    def __init__(self, cfg: ModelConfig, layer: int, w_q: QMatrix | None, w_q_a: QMatrix | None,
                 q_a_norm: torch.Tensor | None, w_q_b: QMatrix | None, w_kv_a: QMatrix, kv_a_norm: torch.Tensor,
                 w_k_b: QMatrix, w_v_b: QMatrix, w_o: QMatrix):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.w_q, self.w_q_a, self.w_q_b, self.w_kv_a, self.w_o = w_q, w_q_a, w_q_b, w_kv_a, w_o
        self.register_buffer("q_a_norm", q_a_norm, persistent=False)
        self.register_buffer("kv_a_norm", kv_a_norm, persistent=False)
        # attn_k_b [heads * kv_lora, nope] and attn_v_b [heads * v_dim, kv_lora]: one small matrix
        # per head, multiplied as batches (float32 views on the exact backend, dequantised per use
        # on the others: their bytes stay the GGUF's)
        self.w_k_b, self.w_v_b = w_k_b, w_v_b
        self.rope_dim = cfg.rope_dim
        self.nope = cfg.head_dim - cfg.rope_dim
        self.scale = cfg.attn_scale or cfg.head_dim ** -0.5

    def weights(self) -> list:
        """Its weights in the order its trunk-graph form reads them (stages/runtime/trunk_graph.py
        TrunkGraphs._mla_nodes): the q projection (or q_a, its norm, q_b), kv_a, its norm, k_b, v_b, output."""
        q = [self.w_q] if self.w_q is not None else [self.w_q_a, self.q_a_norm, self.w_q_b]
        return q + [self.w_kv_a, self.kv_a_norm, self.w_k_b, self.w_v_b, self.w_o]

    def forward(self, x: torch.Tensor, meta: BatchMeta, kv: KVPool, rope: RoPE,
                cos_sin: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        cfg = self.cfg
        N, nh, C, R = x.shape[0], cfg.n_heads, cfg.kv_lora_rank, self.rope_dim
        if self.w_q is not None:
            q = self.w_q(x)
        else:
            q = self.w_q_b(rms_norm(self.w_q_a(x), self.q_a_norm, cfg.rms_eps))
        q = q.view(N, nh, cfg.head_dim)
        cos, sin, rot = cos_sin
        q_pe = rope.apply(q[..., self.nope:], cos, sin, rot)  # [N, heads, R]
        ckv = self.w_kv_a(x)  # [N, C + R]
        latent = rms_norm(ckv[:, :C], self.kv_a_norm, cfg.rms_eps)
        k_pe = rope.apply(ckv[:, C:].reshape(N, 1, R), cos, sin, rot).view(N, R)

        k_b = self.w_k_b.dequantize().view(nh, C, self.nope)
        q_lat = torch.einsum("nhd,hcd->nhc", q[..., :self.nope], k_b)  # the query in latent space
        query = torch.cat((q_lat, q_pe), dim=-1)  # [N, heads, C + R]

        cache, _ = kv.layer(self.layer)  # [1, rows, C + R]: latent then rope key, in the pool's K type
        work = work_dtype(kv, cache)
        entry = torch.cat((latent, k_pe), dim=-1).view(N, 1, C + R)
        kv.write(cache, "k", meta.row0 if N == 1 else meta.write_rows, entry)
        keys = read_keys(cache, kv.types.k, C + R, meta, work, kv.rot["k"])  # [B, 1, keys_max, C + R]
        values = keys[..., :C]  # the latent is the value
        query = query.to(work)

        # Every query head reads the same single key head, so the heads are laid out as more query
        # rows of one head ([B, 1, T * heads, C + R], row t * heads + h): one plain attention over
        # the cached rows as stored (SDPA's enable_gqa would expand the cache to every head: 10x slower).
        B, T = len(meta.n_new), meta.t_max
        if T == 1:
            qp = query.view(B, 1, nh, C + R)
            mask = meta.mask  # [B, 1, 1, keys]: the same for every head
        else:
            qp = query.new_zeros(B, T, nh, C + R)
            qp[meta.seq_of_token, meta.off_of_token] = query
            qp = qp.view(B, 1, T * nh, C + R)
            mask = meta.mask
            if mask is None:  # one fresh sequence: causal
                mask = torch.ones(T, meta.keys_max, dtype=torch.bool, device=x.device).tril(meta.keys_max - T)
            mask = mask.repeat_interleave(nh, dim=-2)
        out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=mask, scale=self.scale)  # [B, 1, T * heads, C]
        out = out.view(B, T, nh, C)
        out = out.view(N, nh, C) if T == 1 else out[meta.seq_of_token, meta.off_of_token]
        v_b = self.w_v_b.dequantize().view(nh, -1, C)
        o = torch.einsum("nhc,hvc->nhv", out.float(), v_b)  # back out of latent space, per head
        return self.w_o(o.reshape(N, -1))
