"""Dequantisation equals gguf.quants (llama.cpp's reference in Python), bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as reference
from gguf.quants import quantize

from moeray.stages.quant import dequantize
from test_gguf_file import smollm2_path

SHAPE = (48, 512)  # two K-quant super-blocks per row


def random_blocks(qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """Random quantised bytes for formats gguf.quants cannot quantise to (the K-quants), with finite
    float16 scale fields so the reference stays finite."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(SHAPE[0], SHAPE[1] // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)

    def f16(n):
        return rng.uniform(-1, 1, size=(blocks.shape[0], n)).astype(np.float16).view(np.uint8)
    if qtype in (QT.Q4_K, QT.Q5_K):
        blocks[:, 0:4] = f16(2)  # d, dmin
    elif qtype in (QT.Q6_K, QT.Q3_K):
        blocks[:, -2:] = f16(1)  # d
    elif qtype == QT.Q2_K:
        blocks[:, -4:] = f16(2)  # d, dmin
    return raw


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1])
def test_matches_reference_on_quantised_random_data(qtype):
    x = np.random.default_rng(int(qtype)).standard_normal(SHAPE).astype(np.float32)
    q = np.ascontiguousarray(quantize(x, qtype)).view(np.uint8)
    out = dequantize(q.reshape(-1), qtype, SHAPE)
    assert out.dtype == torch.float32 and tuple(out.shape) == SHAPE
    ref = reference(q, qtype).reshape(SHAPE)
    np.testing.assert_array_equal(out.numpy(), ref)
    if qtype in (QT.F32, QT.F16, QT.BF16, QT.Q8_0):  # and is close to what was quantised
        assert np.abs(out.numpy() - x).max() < 0.05 * np.abs(x).max()


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q3_K, QT.Q2_K])
def test_k_quants_match_reference_on_random_blocks(qtype):
    raw = random_blocks(qtype, np.random.default_rng(int(qtype)))
    out = dequantize(torch.from_numpy(raw.reshape(-1)), qtype, SHAPE)
    assert torch.isfinite(out).all()
    np.testing.assert_array_equal(out.numpy(), reference(raw, qtype).reshape(SHAPE))


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.7.ffn_down.weight", "blk.29.attn_k.weight"])
def test_matches_reference_on_smollm2_tensors(name):
    from moeray.stages.gguf_file import GGUFFile
    g = GGUFFile(smollm2_path())
    info = g.tensors[name]
    raw = g.raw(name)
    rows = 512 if name == "token_embd.weight" else info.shape[0]  # a slice of the 49152-row embedding
    row_bytes = info.n_bytes // info.shape[0]
    part = np.asarray(raw[:rows * row_bytes])
    out = dequantize(part, info.ggml_type, (rows,) + info.shape[1:])
    np.testing.assert_array_equal(out.numpy(), reference(part.reshape(rows, -1), info.ggml_type))
