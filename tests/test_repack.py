"""ggml's repacked weight layout (CPU_REPACK, stages/repack.py): the same products as the plain
layout on real GGUF blocks, a row's bits independent of its batch, the trunk repacked on load with
the embedding left readable, expert slots filled repacked, and the setting's errors."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from moeray.errors import MoerayError
from moeray.stages import qmatmul, repack
from moeray.stages.qmatmul import QMatrix, ggml_available, swiglu

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from quant_blocks import random_blocks  # noqa: E402

pytestmark = pytest.mark.skipif(not ggml_available() or repack.handle() is None,
                                reason="ggml-python with its CPU_REPACK buffer type is not installed")

# What this build repacks (AVX2): ggml picks the kernels; these four have them.
REPACKED_TYPES = (T.Q4_0, T.Q4_K, T.IQ4_NL, T.MXFP4)
# Measured: 1.6e-7 .. 2.7e-7 of the largest output (the same 8-bit activations; only the order
# of the float sums differs).
TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def default_mode():
    repack.set_mode(None)
    yield
    repack.set_mode(None)


def matrix(qtype: T, rows: int, cols: int, seed: int = 0) -> QMatrix:
    blocks = random_blocks(qtype, rows * cols // GGML_QUANT_SIZES[qtype][0], np.random.default_rng(seed), 0.01)
    return QMatrix.from_raw(blocks.reshape(-1), qtype, (rows, cols), "ggml")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("qtype", REPACKED_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("mode", ["on", "fast"])
def test_a_repacked_matrix_multiplies_as_the_plain_one(qtype, mode):
    repack.set_mode(mode)
    plain, packed = matrix(qtype, 64, 512), matrix(qtype, 64, 512)
    assert packed.repack() and packed.layout == "repacked" and packed.nbytes == plain.nbytes
    assert packed.graph_key != plain.graph_key  # a graph built for one layout never serves the other
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(1))
    for rows in (x[:1], x):
        assert rel(packed(rows), plain(rows)) < TOLERANCE


@pytest.mark.parametrize("qtype", REPACKED_TYPES, ids=lambda t: t.name)
def test_a_repacked_rows_bits_do_not_depend_on_its_batch(qtype):
    """The default ("on") keeps the plain layout's promise: a row alone or among 8 others gives
    the same bits (Q4_K runs each row through the GEMV; its GEMM would round differently)."""
    w = matrix(qtype, 64, 512)
    assert w.repack()
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(2))
    assert torch.equal(w(x), torch.cat([w(x[i:i + 1]) for i in range(9)]))
    g, u, d = matrix(qtype, 256, 512, 1), matrix(qtype, 256, 512, 2), matrix(qtype, 512, 256, 3)
    for m in (g, u, d):
        m.repack()
    assert torch.equal(swiglu(x, g, u, d), torch.cat([swiglu(x[i:i + 1], g, u, d) for i in range(9)]))


def test_off_and_unsupported_types_stay_plain():
    repack.set_mode("off")
    assert not matrix(T.Q4_K, 64, 512).repack()
    repack.set_mode("on")
    assert not matrix(T.Q4_1, 64, 512).repack()  # ggml has no repacked Q4_1
    assert not matrix(T.Q4_0, 60, 512).repack()  # rows not a multiple of 8


def test_a_repacked_matrix_refuses_to_be_read_as_rows():
    w = matrix(T.Q4_0, 64, 512)
    w.repack()
    with pytest.raises(MoerayError, match="repacked"):
        w.rows(torch.tensor([1]))


def test_the_setting_names_its_choices(monkeypatch):
    monkeypatch.setenv("MOERAY_REPACK", "yes")
    repack.set_mode(None)
    with pytest.raises(MoerayError, match=r"MOERAY_REPACK='yes': choose one of on, fast, off"):
        repack.mode()


@pytest.fixture(scope="module")
def q4k_model(tmp_path_factory):
    """A tiny qwen3moe with every matrix Q4_K (bench/shapes.py's random valid blocks)."""
    from shapes import Shape, write_shape

    s = Shape("qwen3moe", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=4, used=2,
              expert_ff=256, vocab=4096)
    return write_shape("tiny", shape=s, path=tmp_path_factory.mktemp("repack") / "tiny.gguf", pool_blocks=1024)


def test_the_trunk_is_repacked_on_load_and_computes_the_same(q4k_model):
    from moeray.stages.gguf_file import GGUFFile
    from moeray.stages.model import load_model

    g = GGUFFile(q4k_model)
    repack.set_mode("off")
    plain = load_model(g, route="ggml")
    repack.set_mode("on")
    packed = load_model(g, route="ggml")
    assert plain.repacked == 0
    # every matrix but the embedding (read as rows): fused qkv, attention output, the head
    assert packed.repacked == len(packed.matrices()) - 1 and packed.tok_embd.layout == "plain"
    assert packed.trunk_bytes() == plain.trunk_bytes()
    ids = [1, 5, 9, 200, 7, 3]
    assert rel(packed.logits_all(ids), plain.logits_all(ids)) < TOLERANCE
