"""The hybrid families (qwen3next, qwen35moe) against transformers: tiny random checkpoints
written as llama.cpp's converter lays them out (stages/gguf/writer.py + stages/arch/), logits
within 1e-4 of max |logit| on the exact backend, the ggml backend at its measured tolerance, and
prefill in chunks equal to one-shot prefill; Qwen3.5's multimodal RoPE on text positions is
plain partial RoPE."""
from __future__ import annotations

import pytest
import torch

from moeray.stages.gguf.reader import GGUFFile
from moeray.stages.gguf.writer import write_gguf
from moeray.stages.blocks.attention import RoPE
from moeray.stages.runtime.model import load_model
from moeray.stages.kernels.backend import ggml_available
from tiny_hybrid import HYBRID_BUILDERS
from tiny_models import token_ids

RTOL = 1e-4  # of the largest |logit|
IDS = token_ids(150)  # past two DeltaNet chunks of 64


def _close(got, ref, what, rtol=RTOL):
    scale = ref.abs().max().item()
    diff = (got - ref).abs().max().item()
    assert diff <= rtol * scale, f"{what}: max |diff| {diff:.3g} > {rtol} * max |logit| {scale:.3g}"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    out = {}
    for name, build in HYBRID_BUILDERS.items():
        model = build()
        out[name] = (model, write_gguf(model, root / f"{name}-F32.gguf", "F32"),
                     {ft: write_gguf(model, root / f"{name}-{ft}.gguf", ft) for ft in GGML_RTOL})
    return out


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("name", list(HYBRID_BUILDERS))
def test_file_is_laid_out_as_llama_cpp_writes_it(files, name):
    model, path, _ = files[name]
    g = GGUFFile(path)
    assert g.arch == name and g.config.recurrent == (True, True, True, False)
    t = g.tensors
    assert "blk.0.attn_qkv.weight" in t and "blk.0.attn_gate.weight" in t and "blk.0.ssm_a" in t
    assert ("blk.0.ssm_ba.weight" in t) == (name == "qwen3next")
    assert ("blk.0.ssm_beta.weight" in t) == (name == "qwen35moe")
    assert "blk.3.attn_q.weight" in t and "blk.3.post_attention_norm.weight" in t and "blk.3.ssm_a" not in t
    assert t["blk.0.ssm_conv1d.weight"].shape == (256, 4)  # [conv_dim, K], F32 as llama.cpp keeps it
    # A_log stored as -exp(A_log)
    a_log = model.model.layers[0].linear_attn.A_log.detach()
    stored = torch.from_numpy(g.raw("blk.0.ssm_a").copy()).view(torch.float32)
    if name == "qwen35moe":  # tiled V order: v head h = (k group h % 2, index h // 2)
        a_log = a_log.view(2, 2).t().reshape(-1)
    assert torch.allclose(stored, -a_log.exp())
    assert g.config.rope_dim == 8 and g.config.deltanet.v_order == ("tiled" if name == "qwen35moe" else "grouped")


def test_mtp_blocks_counted_in_block_count_are_not_layers(files):
    """llama.cpp's converter adds the multi-token-prediction blocks to block_count and writes
    nextn_predict_layers; the trunk is the layers before them."""
    from moeray.stages.arch import config_from_metadata

    g = GGUFFile(files["qwen3next"][1])
    meta = dict(g.metadata, **{"qwen3next.block_count": 5, "qwen3next.nextn_predict_layers": 1})
    cfg = config_from_metadata(meta, {n: t.shape for n, t in g.tensors.items()})
    assert cfg.n_layers == 4 and cfg.recurrent == (True, True, True, False)


@pytest.mark.parametrize("name", list(HYBRID_BUILDERS))
def test_logits_match_transformers_exact_route(files, name):
    model, path, _ = files[name]
    _close(load_model(path, backend="exact").logits_all(IDS), _hf_logits(model, IDS), name)


@pytest.mark.parametrize("name", list(HYBRID_BUILDERS))
def test_chunked_prefill_then_decode_match_transformers(files, name):
    """Prefill in pieces (the state carried between them), then decode token by token."""
    model, path, _ = files[name]
    m = load_model(path, backend="exact")
    kv = m.new_kv_cache(1, len(IDS))
    got = []
    for lo, hi in ((0, 40), (40, 107), (107, 140)):
        got.append(m.step([IDS[lo:hi]], [0], kv))
    for t in IDS[140:]:
        got.append(m.step([[t]], [0], kv))
    ref = _hf_logits(model, IDS)
    _close(torch.cat(got), ref[[39, 106] + list(range(139, len(IDS)))], name)


# Measured (2-core AVX2): the ggml backend against the exact backend on the same file, positions whose
# top-k routing agrees in every layer. F16 (activations rounded to float16): <= 3e-3 (qwen3next),
# 8e-3 (qwen35moe). Q8_0 (activations rounded to 8 bits, as llama.cpp does): 0.23 and 0.16, and
# the routing differs at 28-38% of positions: the DeltaNet's L2-normalised q/k and the norm-gated
# output rescale the rounding of four random layers. ggml_gated_delta_net itself equals the torch
# rule to 1e-6 (tests/stages/test_deltanet.py), so the error is the matmuls' activation rounding.
GGML_RTOL = {"F16": 2e-2, "Q8_0": 0.3}
GGML_SAME_ROUTING = {"F16": 0.9, "Q8_0": 0.5}


def _logits_and_routing(path, backend):
    from moeray.stages.blocks.moe import HostExperts

    gguf, seen = GGUFFile(path), []
    host = HostExperts(gguf, backend, on_route=lambda layer, ids, w: seen.append(ids.sort(-1).values))
    return load_model(gguf, experts=host, backend=backend).logits_all(IDS[:40]), torch.stack(seen)


@pytest.mark.skipif(not ggml_available(), reason="ggml-python is not installed")
@pytest.mark.parametrize("ft", list(GGML_RTOL))
@pytest.mark.parametrize("name", list(HYBRID_BUILDERS))
def test_ggml_route_within_its_measured_tolerance(files, name, ft):
    """ggml's matmuls and ggml_gated_delta_net against the exact backend on the same file."""
    path = files[name][2][ft]
    exact, exact_routing = _logits_and_routing(path, "exact")
    got, routing = _logits_and_routing(path, "ggml")
    same = (routing == exact_routing).all(-1).all(0)
    assert same.float().mean() >= GGML_SAME_ROUTING[ft], f"{name} {ft}: routing differs at {int((~same).sum())}"
    err = (got - exact).abs().max(-1).values / exact.abs().max()
    assert 0 < err[same].max() <= GGML_RTOL[ft], f"{name} {ft}: {err[same].max():.2e} of max |logit|"


@pytest.mark.skipif(not ggml_available(), reason="ggml-python is not installed")
@pytest.mark.parametrize("name", list(HYBRID_BUILDERS))
def test_ggml_route_batched_decode_equals_each_sequence_alone(files, name):
    """Two sequences decoding together (one ggml_gated_delta_net call for both, each state in its
    own slot) give what each gives decoding alone, and the one-shot prefill's logits, within the
    backend's rounding (measured on these F16 files: 3e-4 and 5e-4 of max |logit|; the exact
    backend's prefill-vs-decode difference is 4e-6). A state read from the wrong slot is off by O(1)."""
    m = load_model(files[name][2]["F16"], backend="ggml")
    seqs = [(IDS[:30], 20), (IDS[50:71], 12)]

    def decode(pairs, slots):
        kv = m.new_kv_cache(2, 40)
        m.step([ids[:n0] for ids, n0 in pairs], slots, kv)  # prefill pieces of different lengths
        rows = [m.step([[ids[n0 + i]] for ids, n0 in pairs], slots, kv) for i in range(8)]
        return [torch.stack([r[j] for r in rows]) for j in range(len(pairs))]

    together = decode(seqs, [0, 1])
    for j, (ids, n0) in enumerate(seqs):
        alone = decode([seqs[j]], [1 - j])[0]  # the other slot: slots are only addresses
        _close(together[j], alone, f"{name} seq {j} alone", rtol=1e-3)
        _close(together[j], m.logits_all(ids[:n0 + 8])[n0:], f"{name} seq {j}", rtol=2e-3)


@pytest.mark.skipif(not ggml_available(), reason="ggml-python is not installed")
@pytest.mark.parametrize("qtype", ["IQ3_S", "IQ3_XXS"])
def test_iq3_experts_load_price_and_run(tmp_path, qtype):
    """The Strata rigs' expert types: a hybrid file whose experts are IQ3_S / IQ3_XXS blocks (rows
    of 256: hidden and expert width 256) is priced at its bytes and runs on both backends."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

    from moeray.cluster.placement import held_spec
    from moeray.stages.gguf.reader import read_gguf_header
    from quant_blocks import with_random_experts
    from tiny_hybrid import tiny_qwen3next

    t = QT[qtype]
    f32 = write_gguf(tiny_qwen3next(hidden=256, expert_ffn=256), tmp_path / "f32.gguf", "F32")
    path = with_random_experts(f32, tmp_path / f"{qtype}.gguf", t, np.random.default_rng(int(t)))
    header = read_gguf_header(path)
    block, size = GGML_QUANT_SIZES[t]
    assert header.expert_bytes(0) == 3 * 256 * (256 // block * size)
    assert held_spec(header, backend="ggml").expert_bytes == [header.expert_bytes(0)] * 4
    ref = load_model(path, backend="dequant").logits_all(IDS[:16])
    got = load_model(path, backend="ggml").logits_all(IDS[:16])
    assert torch.isfinite(ref).all()
    assert (got[0] - ref[0]).abs().max() <= 0.05 * ref.abs().max()  # before any near-tie can compound


def test_qwen35_multimodal_rope_on_text_is_plain_partial_rope():
    """Interleaved MRoPE with every section at the text position is NeoX RoPE on the rotated dims
    (transformers computes angles in float32: ~1e-4 off at position 5000)."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    cfg = Qwen3_5MoeTextConfig(head_dim=256, rope_parameters={
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    hf = Qwen3_5MoeTextRotaryEmbedding(cfg)
    pos = torch.arange(0, 5000, 7)
    cos, sin = hf(torch.zeros(1), pos.view(1, -1))  # text: one position id for all sections
    c, s, _ = RoPE(64, 1e7, "neox").cos_sin(pos)
    assert (torch.cat([c[:, 0]] * 2, -1) - cos[0]).abs().max() <= 1e-3
    assert (torch.cat([s[:, 0]] * 2, -1) - sin[0]).abs().max() <= 1e-3
    # sections at different positions (an image grid) are not that: moeray serves text only
    cos3, _ = hf(torch.zeros(1), torch.stack([pos, 0 * pos, 0 * pos]).view(3, 1, -1))
    assert (cos3[0] - cos[0]).abs().max() > 0.5
