"""The embedded default model: a deterministic byte-for-byte upcycling of SmolLM2-135M-Instruct
into an 8-expert top-2 MoE that computes exactly the dense model, with a skewed router."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from moeray.stages.gguf import default_model as dm
from moeray.stages.gguf.reader import GGUFFile


@pytest.fixture(scope="module")
def tokenizer(smollm2_dense_path):
    from moeray.stages.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_dense_path)


# The exact backend (float32 weights): these tests check the upcycling's math (the MoE computes
# exactly what the dense model computes) and the dense model against transformers to 1e-5, which
# ggml's 8-bit activation rounding would blur. The quantised backend has its own test below.
@pytest.fixture(scope="module")
def dense(smollm2_dense_path):
    from moeray.stages.runtime.model import load_model

    return load_model(smollm2_dense_path, backend="exact")


@pytest.fixture(scope="module")
def routing_observers() -> list:
    return []


@pytest.fixture(scope="module")
def moe(default_model_path, routing_observers):
    from moeray.stages.runtime.model import load_model
    from moeray.stages.blocks.moe import HostExperts

    gguf = GGUFFile(default_model_path)
    host = HostExperts(gguf, "exact", on_route=lambda *a: [f(*a) for f in routing_observers])
    return load_model(gguf, experts=host, backend="exact")


def test_build_is_deterministic(default_model_path, tmp_path):
    again = dm.build(tmp_path / "again.gguf")
    assert dm.sha256_of(again) == dm.sha256_of(default_model_path) == dm.REFERENCE_SHA256


def test_experts_are_the_dense_ffn_bytes(default_model_path, smollm2_dense_path):
    up, dense = GGUFFile(default_model_path), GGUFFile(smollm2_dense_path)
    cfg = up.config
    assert (cfg.arch, cfg.n_experts, cfg.n_experts_used, cfg.expert_ffn_dim) == ("llama", 8, 2, 1536)
    assert up.metadata["general.name"] == dm.MODEL_NAME
    changed = {"general.name", "llama.expert_count", "llama.expert_used_count", "llama.expert_feed_forward_length"}
    assert {k: v for k, v in up.metadata.items() if k not in changed} == {
        k: v for k, v in dense.metadata.items() if k not in changed
    }  # tokenizer and chat template included
    for layer in range(cfg.n_layers):
        router = up.info(f"blk.{layer}.ffn_gate_inp.weight")
        assert router.shape == (8, 576) and router.ggml_type.name == "F32"
        for kind in ("gate", "up", "down"):
            info = up.info(f"blk.{layer}.ffn_{kind}_exps.weight")
            assert info.ggml_type.name == "Q4_1" and info.shape[0] == 8
            assert info.shape[1:] == dense.info(f"blk.{layer}.ffn_{kind}.weight").shape
            dense_bytes = dense.raw(f"blk.{layer}.ffn_{kind}.weight").reshape(-1)
            for e in range(8):
                assert np.array_equal(up.expert_raw(layer, kind, e).reshape(-1), dense_bytes)
    for name, info in dense.tensors.items():  # everything else is copied unchanged
        if ".ffn_gate." not in name and ".ffn_up." not in name and ".ffn_down." not in name:
            assert np.array_equal(up.raw(name), dense.raw(name)), name


def test_moe_greedy_text_equals_dense(dense, moe, tokenizer):
    from moeray.cluster.generator import Generator
    from moeray.stages.text.sampling import SamplingParams

    prompts = [p for p in dm.prompt_token_ids(tokenizer)][::4][:3]  # a chat, a code and a prose prompt
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    want = Generator(dense, tokenizer).generate(prompts, params)
    got = Generator(moe, tokenizer).generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert all(len(c.token_ids) == 32 for c in got)


def test_router_is_skewed_and_input_dependent(moe, tokenizer, routing_observers):
    n_layers = moe.config.n_layers
    counts = np.zeros((n_layers, 8))
    pairs = [set() for _ in range(n_layers)]

    def hook(layer, ids, weights):
        np.add.at(counts[layer], ids.reshape(-1).numpy(), 1)
        pairs[layer].update(map(tuple, ids.sort(dim=1).values.tolist()))
        assert torch.allclose(weights.sum(1), torch.ones(len(ids)), atol=1e-5)  # renormalised top-2

    routing_observers.append(hook)
    try:
        mean, std = dm.derive_router_directions(moe, tokenizer)
    finally:
        routing_observers.remove(hook)
    # The hottest quarter (2 of 8 per layer) takes at least half of the routed picks.
    hot_share = np.sort(counts, axis=1)[:, -2:].sum() / counts.sum()
    assert hot_share >= 0.5, hot_share
    # Input-dependent: every layer routes tokens to several experts, in many different pairs.
    assert ((counts > 0).sum(axis=1) >= 5).all()
    assert min(len(p) for p in pairs) >= 8
    # The stored directions are what this forward pass measures, wherever the sign is clear.
    stored = dm.router_directions()
    clear = np.abs(mean) > 2 * dm.DIRECTION_THRESHOLD_STD * std
    assert np.array_equal(stored[clear], np.sign(mean[clear]).astype(np.int8))
    assert (stored[np.abs(mean) < 0.5 * dm.DIRECTION_THRESHOLD_STD * std] == 0).all()


def test_dense_logits_match_transformers(dense, smollm2_dense_path, tokenizer):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(smollm2_dense_path.parent), gguf_file=smollm2_dense_path.name, dtype=torch.float32
    )
    ids = tokenizer.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}])
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    got = dense.logits_all(ids)
    # Both dequantise the same Q4_1 / Q8_0 blocks to the same float32 weights, so only the order
    # of float32 operations differs (fused gate/up, SDPA vs eager attention, RoPE formulation).
    # Measured on this prompt (38 tokens): max |diff| 9.0e-5 with the largest |logit| 37.6, i.e.
    # 2.4e-6 relative, mean |diff| 1.1e-5: float32 rounding (eps 1.2e-7) accumulated over 30
    # layers. We allow 1e-5 relative (~4x the measurement); any real error (a wrong permutation,
    # norm, RoPE or dequantisation) moves logits by O(0.1-1).
    diff = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert diff <= 1e-5 * scale, (diff, scale)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
