"""Attention sinks and the sliding window (gpt-oss) against a per-query reference written out
here, and the same numbers whichever way a step is cut: one prefill, chunks, single-token decode,
sequences batched at different lengths, block tables that are not consecutive."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moeray.stages.arch.config import ModelConfig
from moeray.stages.blocks.kv_cache import KVCache, KVPool
from moeray.stages.blocks.attention import Attention, make_batch_meta, slot_batch_meta
from moeray.stages.kernels.qmatmul import QMatrix

H, NH, NKV, D, T = 48, 4, 2, 16, 40
CFG = ModelConfig("test", 1, H, NH, NKV, D, 100, 256, 10000.0, 1e-5, "neox", 0, 0, 0, 0, 0, False, False, False,
                  qkv_bias=True)


def _rope():
    from moeray.stages.blocks.rope import RoPE

    return RoPE(D, 10000.0, "neox")


def _attention(sinks: bool, window: int, seed: int = 0) -> Attention:
    g = torch.Generator().manual_seed(seed)

    def mat(n, k):
        w = (torch.randn(n, k, generator=g) / k ** 0.5).numpy()
        return QMatrix.from_raw(np.ascontiguousarray(w).view(np.uint8).reshape(-1), 0, (n, k), "exact")
    qkv = mat((NH + 2 * NKV) * D, H)
    with torch.no_grad():
        qkv.data.mul_(3.0)  # peaked attention: a wrong mask moves the output
    return Attention(CFG, 0, [qkv], torch.randn((NH + 2 * NKV) * D, generator=g) * 0.3, mat(H, NH * D), None, None,
                     b_o=torch.randn(H, generator=g), sinks=torch.randn(NH, generator=g) * 2 if sinks else None,
                     window=window)


def reference(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    """One sequence, query by query: softmax over the visible keys and the head's sink."""
    rope = _rope()
    pos = torch.arange(x.shape[0])
    cos, sin, rot = rope.cos_sin(pos)
    qkv = attn.w_qkv[0](x) + attn.b_qkv
    q = rope.apply(qkv[:, :NH * D].view(-1, NH, D), cos, sin, rot)
    k = rope.apply(qkv[:, NH * D:(NH + NKV) * D].view(-1, NKV, D), cos, sin, rot)
    v = qkv[:, (NH + NKV) * D:].view(-1, NKV, D)
    out = torch.zeros(x.shape[0], NH, D)
    for t in range(x.shape[0]):
        lo = max(0, t - attn.window + 1) if attn.window else 0
        for h in range(NH):
            kh = h // (NH // NKV)
            s = (k[lo:t + 1, kh] @ q[t, h]) / D ** 0.5
            if attn.sinks is not None:
                s = torch.cat((s, attn.sinks[h:h + 1]))
            p = torch.softmax(s, dim=0)[:t + 1 - lo]
            out[t, h] = p @ v[lo:t + 1, kh]
    return attn.w_o(out.reshape(x.shape[0], NH * D)) + attn.b_o


def run(attn, x, chunks):
    """x [T, H] fed in `chunks` (token counts) through a fixed-slot cache."""
    rope, kv = _rope(), KVCache(0, 1, 1, NKV, T, D)
    outs, at = [], 0
    for n in chunks:
        meta = slot_batch_meta([n], [0], kv)
        outs.append(attn(x[at:at + n], meta, kv, rope, rope.cos_sin(meta.positions)))
        kv.advance([0], [n])
        at += n
    return torch.cat(outs)


@pytest.mark.parametrize("sinks,window", [(True, 0), (False, 8), (True, 8)], ids=["sinks", "window", "both"])
def test_matches_the_per_query_reference_however_the_steps_are_cut(sinks, window):
    attn = _attention(sinks, window)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = reference(attn, x)
        for chunks in ([T], [5, 7, 20] + [1] * 8, [1] * T):
            got = run(attn, x, chunks)
            assert (got - ref).abs().max() <= 1e-5 * ref.abs().max(), chunks
    full = _attention(False, 0)
    with torch.no_grad():  # the options change the numbers (the test would see a dropped one)
        assert (reference(full, x) - ref).abs().max() > 0.05 * ref.abs().max()


def test_batched_sequences_on_scattered_blocks_equal_each_alone():
    attn = _attention(True, 8)
    g = torch.Generator().manual_seed(2)
    xa, xb = torch.randn(30, H, generator=g), torch.randn(19, H, generator=g)
    rope, pool = _rope(), KVPool(0, 1, 12, NKV, D)
    ta, tb = [7, 2, 9], [4, 11]  # not consecutive: keys are gathered block by block
    with torch.no_grad():
        ref_a, ref_b = reference(attn, xa), reference(attn, xb)
        meta = make_batch_meta([25, 12], [0, 0], [ta, tb])  # prefill both at once
        out = attn(torch.cat((xa[:25], xb[:12])), meta, pool, rope, rope.cos_sin(meta.positions))
        got_a, got_b = [out[:25]], [out[25:]]
        for step in range(5):  # then a few decode steps, b one token behind in its chunk
            meta = make_batch_meta([1, 1], [25 + step, 12 + step], [ta, tb])
            out = attn(torch.stack((xa[25 + step], xb[12 + step])), meta, pool, rope, rope.cos_sin(meta.positions))
            got_a.append(out[:1])
            got_b.append(out[1:])
    assert (torch.cat(got_a) - ref_a).abs().max() <= 1e-5 * ref_a.abs().max()
    assert (torch.cat(got_b) - ref_b[:17]).abs().max() <= 1e-5 * ref_b.abs().max()
