"""Transformer pieces: RMSNorm and attention over the KV cache (RoPE variants: stages/blocks/rope.py).

Tokens of a step are packed: all sequences' new tokens in one [N, hidden] matrix, so every
projection is one matmul. Only the attention itself is per sequence, done as one padded SDPA
call over [B, heads, T_max, keys_max] with a mask built from each sequence's length.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from moeray.stages.arch.config import ModelConfig
from moeray.stages.blocks import kv_quant
from moeray.stages.blocks.kv_rotation import rotate
from moeray.stages.blocks.kv_cache import BLOCK_SIZE, KVCache, KVPool, blocks_for
from moeray.stages.kernels.qmatmul import QMatrix
from moeray.stages.blocks.rope import RoPE


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim (torch's op: fewer calls than spelling it out)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


@dataclass
class BatchMeta:
    """Where each new token of a step sits and where its keys are read: built once per step per
    stage from the step's start positions and block tables (see stages/blocks/kv_cache.py)."""
    n_new: list[int]  # new tokens per sequence
    starts: list[int]  # tokens the sequence held before this step
    positions: torch.Tensor  # [N] absolute position of each packed token
    seq_of_token: torch.Tensor  # [N] sequence index (0..B-1)
    off_of_token: torch.Tensor  # [N] index within its sequence's new tokens
    write_rows: torch.Tensor  # [N] pool row each new token's k/v goes to
    row0: int  # write_rows[0] as a Python int (a single decode token indexes with it, no sync)
    last_index: torch.Tensor  # [B] packed index of each sequence's last new token
    t_max: int
    keys_max: int  # longest sequence after the step
    mask: torch.Tensor | None  # [B, 1, t_max, keys_max] bool, None when no masking is needed
    # How keys are read: a view when the tables allow one (first row, rows between sequences),
    # else whole blocks gathered once per layer: `read_blocks` [B * blocks of keys_max] (whole
    # blocks are contiguous 16-row runs: 3x faster than gathering rows, measured at batch 16).
    read_view: tuple[int, int] | None
    read_blocks: torch.Tensor | None
    slots: list[int] | None = None  # fixed-slot KVCache callers: the slots whose lengths advance
    # Recurrent (DeltaNet) layers: the state slot each sequence continues (the engine's sequence
    # slots; stages/blocks/deltanet.py); a sequence starting at position 0 begins from zeros.
    state_slots: list[int] | None = None
    # (slot, slot) copies of the recurrent state before and after the step (StepBatch.state_before)
    state_before: list[tuple[int, int]] | None = None
    state_after: list[tuple[int, int]] | None = None
    _window_masks: dict = field(default_factory=dict, repr=False)

    def window_mask(self, window: int) -> torch.Tensor:
        """[B, 1, t_max, keys_max] bool: query t of sequence i (absolute position q) sees keys
        q - window < k <= q, llama.cpp's standard sliding window (LLAMA_SWA_TYPE_STANDARD) and
        transformers' sliding_window. Made once per step per window size, shared by its layers."""
        m = self._window_masks.get(window)
        if m is None:
            B = len(self.n_new)
            q_pos = torch.tensor(self.starts).view(B, 1, 1) + torch.arange(self.t_max).view(1, self.t_max, 1)
            k = torch.arange(self.keys_max).view(1, 1, self.keys_max)
            m = ((k <= q_pos) & (k > q_pos - window)).unsqueeze(1).to(self.positions.device)
            self._window_masks[window] = m
        return m

    @property
    def n_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.t_max == 1


def _consecutive(table: list[int], n_blocks: int) -> bool:
    return n_blocks <= len(table) and table[n_blocks - 1] - table[0] == n_blocks - 1 and all(
        table[i + 1] == table[i] + 1 for i in range(n_blocks - 1))


def make_batch_meta(n_new: list[int], starts: list[int], tables: list[list[int]],
                    device: torch.device | str = "cpu", slots: list[int] | None = None,
                    state_slots: list[int] | None = None) -> BatchMeta:
    """`tables[i]` holds the blocks of sequence i, at least up to its last new token.

    Built in Python lists and made into ONE int64 tensor (one host-to-device copy on a card) whose
    slices are the per-token fields: a decode step's metadata costs a few tens of microseconds,
    on every stage, instead of ~10 small torch ops."""
    B, t_max = len(n_new), max(n_new)
    if t_max == 1:  # decode: one token per sequence
        positions, seq_of_token, off_of_token = list(starts), list(range(B)), [0] * B
    else:
        positions, seq_of_token, off_of_token = [], [], []
        for i, (s, n) in enumerate(zip(starts, n_new)):
            positions += range(s, s + n)
            seq_of_token += [i] * n
            off_of_token += range(n)
    write_rows = [tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for i, p in zip(seq_of_token, positions)]
    last_index, n = [], 0
    for k in n_new:
        n += k
        last_index.append(n - 1)
    ends = [s + n for s, n in zip(starts, n_new)]
    keys_max = max(ends)
    blocks_needed = [blocks_for(e) for e in ends]
    read_view = read_blocks = None
    if all(_consecutive(t, n) for t, n in zip(tables, blocks_needed)):
        bases = [t[0] * BLOCK_SIZE for t in tables]
        gap = bases[1] - bases[0] if B > 1 else 0
        if (B == 1 or gap >= keys_max) and all(b == bases[0] + i * gap for i, b in enumerate(bases)):
            read_view = (bases[0], gap)  # sequence i's keys start at row bases[0] + i * gap
    if read_view is None:  # [B, blocks of keys_max], short tables padded with block 0 (masked)
        width = max(blocks_needed)
        read_blocks = [b for t in tables for b in list(t[:width]) + [0] * (width - len(t[:width]))]
    N = len(positions)
    dev = torch.device(device)
    flat = torch.tensor(positions + seq_of_token + off_of_token + write_rows + last_index
                        + (read_blocks or []), dtype=torch.long).to(dev)
    fields = flat.split([N, N, N, N, B, len(read_blocks or [])])
    mask = None
    if not (B == 1 and n_new[0] == 1) and not (B == 1 and starts[0] == 0) and not (
            t_max == 1 and len(set(ends)) == 1):
        # query t of sequence i (absolute position starts[i] + t) sees keys 0..starts[i] + t
        q_pos = torch.tensor(starts).view(B, 1, 1) + torch.arange(t_max).view(1, t_max, 1)
        mask = (torch.arange(keys_max).view(1, 1, keys_max) <= q_pos).unsqueeze(1).to(dev)
    return BatchMeta(n_new=list(n_new), starts=list(starts), positions=fields[0], seq_of_token=fields[1],
                     off_of_token=fields[2], write_rows=fields[3], row0=int(write_rows[0]), last_index=fields[4],
                     t_max=t_max, keys_max=keys_max, mask=mask, read_view=read_view,
                     read_blocks=fields[5] if read_blocks is not None else None,
                     slots=None if slots is None else list(slots),
                     state_slots=None if state_slots is None else list(state_slots))


def slot_batch_meta(n_new: list[int], slots: list[int], kv: KVCache, device: torch.device | str = "cpu"
                    ) -> BatchMeta:
    """The fixed-slot cache's step: each slot's own blocks, its own length."""
    kv.check_room(slots, n_new)
    if len(set(slots)) != len(slots):
        raise ValueError(f"a step may hold each KV slot once, got slots {slots}")
    return make_batch_meta(n_new, [kv.lengths[s] for s in slots], [kv.table(s) for s in slots], device, slots,
                           slots)


class Attention(torch.nn.Module):
    """GQA self-attention with fused qkv projection, optional qkv bias (qwen2moe), per-head q/k
    RMSNorm (qwen3moe), output bias, attention sinks and a sliding window (gpt-oss).

    Sinks: one learned logit per head that joins every query's softmax and attends to nothing
    (out = sum_j e^s_j v_j / (sum_j e^s_j + e^sink)). Window: a query sees only the `window` most
    recent positions (itself included). The KV pool still holds every position of a windowed
    layer; the mask bounds what is read (docs/models.md, "gpt-oss")."""

    def __init__(self, cfg: ModelConfig, layer: int, w_qkv: list[QMatrix], b_qkv: torch.Tensor | None,
                 w_o: QMatrix, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                 b_o: torch.Tensor | None = None, sinks: torch.Tensor | None = None, window: int = 0):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.w_qkv = w_qkv  # [q; k; v] as one matrix, or three where their block types differ
        self.w_o = w_o
        self.register_buffer("b_qkv", b_qkv, persistent=False)
        self.register_buffer("q_norm", q_norm, persistent=False)
        self.register_buffer("k_norm", k_norm, persistent=False)
        self.register_buffer("b_o", b_o, persistent=False)
        self.register_buffer("sinks", sinks, persistent=False)  # [n_heads] float32
        self.window = int(window)  # 0: full attention
        self.q_out = cfg.n_heads * cfg.head_dim
        self.kv_out = cfg.n_kv_heads * cfg.head_dim

    def forward(self, x: torch.Tensor, meta: BatchMeta, kv: KVPool, rope: RoPE,
                cos_sin: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        out = self.w_o(self.attend(*self.project(x, rope, cos_sin), meta, kv))
        return out if self.b_o is None else out + self.b_o

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_qkv[0](x) if len(self.w_qkv) == 1 else torch.cat([w(x) for w in self.w_qkv], dim=1)

    def project(self, x: torch.Tensor, rope: RoPE, cos_sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> q [N, heads, D], k, v [N, kv_heads, D], normed and rotated."""
        cfg = self.cfg
        N, D = x.shape[0], cfg.head_dim
        qkv = self.qkv(x)
        if self.b_qkv is not None:
            qkv = qkv + self.b_qkv
        v = qkv[:, self.q_out + self.kv_out:].view(N, cfg.n_kv_heads, D)
        cos, sin, rot = cos_sin
        if self.q_norm is None:  # q and k rotated as one [N, heads + kv_heads, D] tensor: half the ops
            qk = rope.apply(qkv[:, :self.q_out + self.kv_out].view(N, cfg.n_heads + cfg.n_kv_heads, D), cos, sin, rot)
            return qk[:, :cfg.n_heads], qk[:, cfg.n_heads:], v
        q = rms_norm(qkv[:, :self.q_out].view(N, cfg.n_heads, D), self.q_norm, cfg.rms_eps)
        k = rms_norm(qkv[:, self.q_out:self.q_out + self.kv_out].view(N, cfg.n_kv_heads, D), self.k_norm,
                     cfg.rms_eps)
        return rope.apply(q, cos, sin, rot), rope.apply(k, cos, sin, rot), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: BatchMeta, kv: KVPool) -> torch.Tensor:
        """Append the step's k/v to the pool and attend: [N, heads * D] float32 (before w_o)."""
        cfg = self.cfg
        N, D = q.shape[0], cfg.head_dim
        k_cache, v_cache = kv.layer(self.layer)
        types, work = kv.types, work_dtype(kv, k_cache)
        rows = meta.row0 if N == 1 else meta.write_rows  # one decode token: plain indexing, no index tensor
        kv.write(k_cache, "k", rows, k)
        kv.write(v_cache, "v", rows, v)
        keys = read_keys(k_cache, types.k, D, meta, work, kv.rot["k"])
        values = read_keys(v_cache, types.v, D, meta, work, kv.rot["v"])
        q = q.to(work)

        B = len(meta.n_new)
        if meta.t_max == 1:  # decode: one query per sequence, packed order is sequence order
            qp = q.view(B, 1, cfg.n_heads, D).transpose(1, 2)
        else:
            qp = q.new_zeros(B, meta.t_max, cfg.n_heads, D)
            qp[meta.seq_of_token, meta.off_of_token] = q
            qp = qp.transpose(1, 2)
        mask = meta.mask
        if self.window and meta.keys_max > self.window:  # shorter: every key is within the window
            mask = meta.window_mask(self.window)
        if self.sinks is not None:
            out = _attention_with_sinks(qp, keys, values, mask, self.sinks)
        else:
            out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=mask,
                                                 is_causal=mask is None and meta.t_max > 1,
                                                 enable_gqa=cfg.n_heads != cfg.n_kv_heads)
        out = out.transpose(1, 2)  # [B, T, heads, D]
        if meta.t_max == 1:
            out = out.reshape(N, self.q_out)
        else:
            out = out[meta.seq_of_token, meta.off_of_token].reshape(N, self.q_out)
        return out.float()


class GatedAttention(Attention):
    """Qwen3-Next's full attention: attn_q yields per head [q (D), gate (D)]; the attention output
    is scaled by sigmoid(gate) before attn_output. Per-head q/k RMSNorm, no biases."""

    def forward(self, x, meta, kv, rope, cos_sin):
        cfg = self.cfg
        N, D = x.shape[0], cfg.head_dim
        qkv = self.qkv(x)
        qg = qkv[:, :2 * self.q_out].view(N, cfg.n_heads, 2 * D)
        k = qkv[:, 2 * self.q_out:2 * self.q_out + self.kv_out].view(N, cfg.n_kv_heads, D)
        v = qkv[:, 2 * self.q_out + self.kv_out:].view(N, cfg.n_kv_heads, D)
        cos, sin, rot = cos_sin
        q = rope.apply(rms_norm(qg[..., :D], self.q_norm, cfg.rms_eps), cos, sin, rot)
        k = rope.apply(rms_norm(k, self.k_norm, cfg.rms_eps), cos, sin, rot)
        gate = torch.sigmoid(qg[..., D:].reshape(N, self.q_out))
        return self.w_o(self.attend(q, k, v, meta, kv) * gate)


def _attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                          sinks: torch.Tensor) -> torch.Tensor:
    """softmax([q.k / sqrt(D), sink]) without the sink's column, times v, in float32.
    q [B, H, T, D], k/v [B, H_kv, K, D], mask [B, 1, T, K] bool or None (causal)."""
    B, H, T, D = q.shape
    rep = H // k.shape[1]
    k, v = k.float().repeat_interleave(rep, dim=1), v.float().repeat_interleave(rep, dim=1)
    scores = (q.float() @ k.transpose(-1, -2)) * D ** -0.5  # [B, H, T, K]
    if mask is None and T > 1:
        K = k.shape[2]
        mask = torch.ones(T, K, dtype=torch.bool, device=q.device).tril(K - T)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, H, 1, 1).expand(B, H, T, 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return (probs @ v).to(q.dtype)


def work_dtype(kv: KVPool, cache: torch.Tensor) -> torch.dtype:
    """What the torch path attends in: float16 over a float16 pool on a card (its kernels' type),
    else float32 (CPU SDPA has no fast 16-bit path; quantised rows are dequantised to it)."""
    return torch.float16 if cache.device.type == "cuda" and kv.types.k == kv.types.v == "f16" else torch.float32


def read_keys(cache: torch.Tensor, cache_type: str, width: int, meta: BatchMeta, work: torch.dtype,
              rot: int = 0) -> torch.Tensor:
    """[B, heads, keys_max, width] of the step's sequences in `work`: a view of a float pool of
    that dtype, else the rows converted (dequantised: stages/blocks/kv_quant.py, and turned back
    by the pool's rotation `rot` where it has one: stages/blocks/kv_rotation.py)."""
    rows = _read(cache, meta)
    if cache_type not in kv_quant.FLOAT:
        rows = rotate(kv_quant.dequantize_rows(rows, cache_type, width), rot)
    return rows if rows.dtype == work else rows.to(work)


def _read(cache: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
    """[heads, rows, D] pool -> [B, heads, keys_max, D] keys of the step's sequences."""
    H, _, D = cache.shape
    B = len(meta.n_new)
    if meta.read_view is not None:  # consecutive blocks: a view, no copy
        base, gap = meta.read_view
        return cache.as_strided((B, H, meta.keys_max, D), (gap * D, cache.stride(0), D, 1),
                                cache.storage_offset() + base * D)
    blocks = cache.view(H, -1, BLOCK_SIZE, D).index_select(1, meta.read_blocks)  # [H, B * nb, 16, D]
    return blocks.view(H, B, -1, D)[:, :, :meta.keys_max].transpose(0, 1)
