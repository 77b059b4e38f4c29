"""Dequantisation equals gguf.quants (llama.cpp's reference in Python) and ggml's own, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as reference
from gguf.quants import quantize

from moeray.stages.kernels.backend import ggml_available
from moeray.stages.kernels.qmatmul import QMatrix
from moeray.stages.gguf.quant import dequantize
from quant_blocks import ggml_to_float, random_blocks, with_random_experts
from test_gguf_file import smollm2_path

SHAPE = (48, 512)  # two K-quant super-blocks per row


def random_raw(qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """SHAPE's rows of random valid blocks (finite scales, every other bit random)."""
    block, size = GGML_QUANT_SIZES[qtype]
    return random_blocks(qtype, SHAPE[0] * SHAPE[1] // block, rng).reshape(SHAPE[0], -1)


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
    raw = random_raw(qtype, np.random.default_rng(int(qtype)))
    out = dequantize(torch.from_numpy(raw.reshape(-1)), qtype, SHAPE)
    assert torch.isfinite(out).all()
    np.testing.assert_array_equal(out.numpy(), reference(raw, qtype).reshape(SHAPE))


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.7.ffn_down.weight", "blk.29.attn_k.weight"])
def test_matches_reference_on_smollm2_tensors(name):
    from moeray.stages.gguf.reader import GGUFFile
    g = GGUFFile(smollm2_path())
    info = g.tensors[name]
    raw = g.raw(name)
    rows = 512 if name == "token_embd.weight" else info.shape[0]  # a slice of the 49152-row embedding
    row_bytes = info.n_bytes // info.shape[0]
    part = np.asarray(raw[:rows * row_bytes])
    out = dequantize(part, info.ggml_type, (rows,) + info.shape[1:])
    np.testing.assert_array_equal(out.numpy(), reference(part.reshape(rows, -1), info.ggml_type))


# The codebook types of IQ "dynamic" quants (DeepSeek, GLM, Kimi downloads) and gpt-oss's MXFP4.
CODEBOOK_TYPES = [QT.MXFP4, QT.IQ4_NL, QT.IQ4_XS, QT.IQ3_XXS, QT.IQ3_S, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S,
                  QT.IQ1_S, QT.IQ1_M]
# 8-bit activations against float32 ones, relative to max |y|: measured worst 1.3e-2 (IQ3_S), 0.7e-2
# (MXFP4) to 1.07e-2 (IQ1_M) over 5 seeds of random blocks; a wrong layout is off by O(1).
GGML_TOLERANCE = 0.02
needs_ggml = pytest.mark.skipif(not ggml_available(), reason="ggml-python is not installed (`make` builds it: docs/kernels.md#building-ggml)")


@pytest.mark.parametrize("qtype", CODEBOOK_TYPES, ids=lambda t: t.name)
def test_codebook_types_match_gguf_reference_on_random_blocks(qtype):
    raw = random_raw(qtype, np.random.default_rng(int(qtype)))
    out = dequantize(torch.from_numpy(raw.reshape(-1)), qtype, SHAPE)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert out.abs().max() > 0  # not a table of zeros
    np.testing.assert_array_equal(out.numpy(), reference(raw, qtype).reshape(SHAPE))


@needs_ggml
@pytest.mark.parametrize("qtype", CODEBOOK_TYPES + [QT.Q4_K, QT.Q6_K, QT.Q4_1], ids=lambda t: t.name)
def test_dequantize_matches_ggml_to_float(qtype):
    """ggml's own dequantisation (the C code llama.cpp runs), not only gguf-py's port of it."""
    raw = random_raw(qtype, np.random.default_rng(100 + int(qtype)))
    out = dequantize(torch.from_numpy(raw.reshape(-1)), qtype, SHAPE)
    np.testing.assert_array_equal(out.numpy().reshape(-1), ggml_to_float(raw, qtype))


@needs_ggml
@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_1, QT.Q4_K, QT.Q6_K] + CODEBOOK_TYPES,
                         ids=lambda t: t.name)
def test_an_embedding_lookup_on_ggml_reads_the_rows_dequantised_bit_for_bit(qtype):
    """QMatrix.rows on the ggml backend (ggml_get_rows, as llama.cpp reads its token embedding)
    gives the rows' dequantisation exactly, repeated and out-of-order ids too."""
    rng = np.random.default_rng(300 + int(qtype))
    if qtype in (QT.F32, QT.F16, QT.BF16):
        dense = torch.from_numpy(rng.standard_normal(SHAPE).astype(np.float32))
        raw = (dense if qtype == QT.F32 else dense.to(torch.float16 if qtype == QT.F16 else torch.bfloat16)).reshape(-1)
        raw = raw.view(torch.uint8).numpy()
    else:
        raw = random_raw(qtype, rng).reshape(-1)
    w = QMatrix.from_raw(raw, qtype, SHAPE, "ggml")
    if w.backend != "ggml":
        pytest.skip(f"{qtype.name} is kept as a plain float tensor")
    ids = torch.tensor([5, 0, 47, 5, 13])
    want = dequantize(torch.from_numpy(raw), qtype, SHAPE)[ids]
    assert torch.equal(w.rows(ids), want)


@needs_ggml
@pytest.mark.parametrize("qtype", CODEBOOK_TYPES, ids=lambda t: t.name)
def test_ggml_matmul_on_codebook_blocks_matches_dequantised_linear(qtype):
    """ggml's CPU kernels take each type as the weight (8-bit activations inside: Q8_K for the
    256-blocks, Q8_0 for MXFP4 / IQ4_NL), within GGML_TOLERANCE of float32 math."""
    raw = random_raw(qtype, np.random.default_rng(200 + int(qtype)))
    w = QMatrix.from_raw(raw.reshape(-1), qtype, SHAPE, "ggml")
    assert w.backend == "ggml"
    x = torch.randn(3, SHAPE[1], generator=torch.Generator().manual_seed(int(qtype)))
    want = torch.nn.functional.linear(x, dequantize(torch.from_numpy(raw.reshape(-1)), qtype, SHAPE))
    got = w(x)
    assert got.shape == want.shape
    assert (got - want).abs().max() <= GGML_TOLERANCE * want.abs().max()


@pytest.fixture(scope="module")
def moe_256(tmp_path_factory):
    """A tiny qwen3moe whose expert rows fit 256-value blocks (hidden and expert width 256). One
    layer: its routing then reads only float32 trunk math, the same on every backend, so the backends
    differ by the experts' 8-bit activations alone (a second layer's near-tie could flip)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moeray.stages.gguf.writer import write_gguf
    cfg = Qwen3MoeConfig(vocab_size=300, hidden_size=256, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, intermediate_size=256, moe_intermediate_size=256,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    return write_gguf(Qwen3MoeForCausalLM(cfg).float().eval(), tmp_path_factory.mktemp("moe256") / "f32.gguf")


@needs_ggml
@pytest.mark.parametrize("qtype", CODEBOOK_TYPES, ids=lambda t: t.name)
def test_model_with_codebook_experts_is_priced_at_its_bytes_and_runs_on_every_route(moe_256, tmp_path, qtype):
    from moeray.cluster.placement import held_spec
    from moeray.stages.gguf.reader import read_gguf_header
    from moeray.stages.runtime.model import load_model

    path = with_random_experts(moe_256, tmp_path / f"{qtype.name}.gguf", qtype, np.random.default_rng(int(qtype)))
    header = read_gguf_header(path)
    block, size = GGML_QUANT_SIZES[qtype]
    real = 3 * 256 * (256 // block * size)  # gate, up, down: 256 rows of 256 values each
    assert header.expert_bytes(0) == real
    for backend in ("ggml", "dequant"):  # what the planner charges a slot is what the stage holds
        assert held_spec(header, backend=backend).expert_bytes == [real]
    ids = list(range(1, 17))
    ref = load_model(path, backend="dequant").logits_all(ids)
    got = load_model(path, backend="ggml").logits_all(ids)
    assert torch.isfinite(ref).all()
    # through attention, norm and head, relative to the largest logit: measured 1.2e-2 .. 2.9e-2
    assert (got - ref).abs().max() <= 0.05 * ref.abs().max()


@needs_ggml
@pytest.mark.parametrize("qtype", [QT.F16, QT.Q8_0, QT.Q4_1, QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 5])
def test_a_head_on_ggml_takes_its_final_norm_inside_the_matmul_graph(qtype, rows):
    """QMatrix.normed (the head: rms_norm(x) * norm, then the matmul) as one ggml graph gives
    what torch's rms_norm followed by the ggml matmul gives, and the exact backend's float32
    reference within ggml's tolerance."""
    rng = np.random.default_rng(400 + int(qtype))
    if qtype == QT.F16:
        raw = torch.from_numpy(rng.standard_normal(SHAPE).astype(np.float16)).reshape(-1).view(torch.uint8).numpy()
    else:
        raw = random_raw(qtype, rng).reshape(-1)
    w = QMatrix.from_raw(raw, qtype, SHAPE, "ggml")
    assert w.backend == "ggml"
    g = torch.Generator().manual_seed(rows)
    x, norm = 3 * torch.randn(rows, SHAPE[1], generator=g), 1 + torch.rand(SHAPE[1], generator=g)
    eps = 1e-5
    normed = torch.nn.functional.rms_norm(x, (SHAPE[1],), norm, eps)
    got, apart = w.normed(x, norm, eps), w(normed)
    want = torch.nn.functional.linear(normed, dequantize(torch.from_numpy(raw), qtype, SHAPE))
    assert got.shape == want.shape == (rows, SHAPE[0])
    assert (got - apart).abs().max() <= 1e-3 * apart.abs().max()
    assert (got - want).abs().max() <= GGML_TOLERANCE * want.abs().max()
    exact = QMatrix.from_raw(raw, qtype, SHAPE, "exact")
    assert (exact.normed(x, norm, eps) - want).abs().max() <= 1e-5 * want.abs().max()
