"""moeray's logits equal transformers' on tiny random models written to GGUF by moeray's writer.

F32: moeray on the file vs transformers on the original model. F16 / Q8_0: vs transformers on
the weights dequantised from the same file (so the comparison measures the engine, not the
rounding). Tolerance: max |difference| <= 1e-4 * max |logit|, float32 all the way.
For qwen2moe / qwen3moe, transformers' own GGUF loader also reads moeray's file.
"""
from __future__ import annotations

import pytest
import torch

from moeray.stages.gguf.writer import dequantized_state_dict, write_gguf
from moeray.stages.runtime.model import load_model as _load_model
from moeray.stages.kernels.backend import ggml_available
from tiny_models import (
    EXPERT_FFN,
    HEAD_DIM,
    SHARED_FFN,
    tiny_llama,
    tiny_mixtral,
    tiny_qwen2moe,
    tiny_deepseek2,
    tiny_deepseek3,
    tiny_glm4moe,
    tiny_qwen3moe,
    token_ids,
)

RTOL = 1e-4  # of the largest |logit|


def load_model(path):
    return _load_model(path, backend="exact")

MODELS = {
    "llama": tiny_llama,
    "mixtral": tiny_mixtral,
    "qwen2moe": tiny_qwen2moe,
    "qwen2moe-normtopk": lambda: tiny_qwen2moe(norm_topk_prob=True),
    "qwen3moe": tiny_qwen3moe,
    "deepseek3": tiny_deepseek3,  # MLA over the latent KV, YaRN + mscale, a dense layer, grouped sigmoid routing
    "deepseek2": tiny_deepseek2,  # V2-Lite: MLA without the q LoRA, softmax routing unnormalised x2, 2 shared experts
    "deepseek2-qlora": lambda: tiny_deepseek2(q_lora_rank=64),  # V2 / V2.5: the q LoRA
    "glm4moe": tiny_glm4moe,  # partial rope, q/k norm, qkv biases, a dense layer, sigmoid + bias, an MTP layer
    "glm4moe-air": lambda: tiny_glm4moe(use_qk_norm=False),
}
FILE_TYPES = ("F32", "F16", "Q8_0")
IDS = token_ids(20)


def _assert_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert got.shape == ref.shape, what
    scale = ref.abs().max().item()
    diff = (got - ref).abs().max().item()
    assert diff <= RTOL * scale, f"{what}: max |diff| {diff:.3g} > {RTOL} * max |logit| {scale:.3g}"


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """(name, file type) -> (path of the GGUF, transformers model holding the file's weights)."""
    root = tmp_path_factory.mktemp("parity")
    out = {}
    for name, build in MODELS.items():
        model = build()
        for ft in FILE_TYPES:
            path = write_gguf(model, root / f"{name}-{ft}.gguf", ft)
            if ft == "F32":
                ref = model  # the original weights, untouched
            else:
                ref = build()
                ref.load_state_dict(dequantized_state_dict(path, ref))
            out[name, ft] = (path, ref)
    return out


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("ft", FILE_TYPES)
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_transformers(cases, name, ft):
    path, ref = cases[name, ft]
    got = load_model(path).logits_all(IDS)
    _assert_close(got, _hf_logits(ref, IDS), f"{name} {ft}")


@pytest.mark.parametrize("ft", ("F32", "Q8_0"))
@pytest.mark.parametrize("name", list(MODELS))
def test_prefill_then_decode_matches_transformers(cases, name, ft):
    """A chunked prefill then single-token steps reproduce transformers' logits at those positions."""
    path, ref = cases[name, ft]
    engine = load_model(path)
    want = _hf_logits(ref, IDS)
    kv = engine.new_kv_cache(max_seqs=2, max_len=32)
    slot = 1  # not slot 0: the slot a sequence lives in must not matter
    got = [engine.step([IDS[:9]], [slot], kv)[0], engine.step([IDS[9:14]], [slot], kv)[0]]
    for t in range(14, len(IDS)):
        got.append(engine.step([[IDS[t]]], [slot], kv)[0])
    positions = [8, 13, *range(14, len(IDS))]
    _assert_close(torch.stack(got), want[positions], f"{name} {ft} prefill+decode")


def _transformers_gguf_model(path, name: str):
    """transformers' GGUF loader on moeray's file, told what its metadata mapping ignores."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    # transformers maps neither expert_feed_forward_length nor (for qwen2moe) key_length,
    # expert_shared_feed_forward_length and expert_weights_norm; llama.cpp reads them all.
    config.moe_intermediate_size = EXPERT_FFN
    if name.startswith("qwen2moe"):
        config.head_dim = HEAD_DIM
        config.shared_expert_intermediate_size = SHARED_FFN
        config.norm_topk_prob = name.endswith("normtopk")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                 dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@pytest.mark.parametrize("name,ft", [("qwen2moe", "F32"), ("qwen2moe-normtopk", "Q8_0"),
                                     ("qwen3moe", "F32"), ("qwen3moe", "Q8_0")])
def test_transformers_gguf_loader_reads_moerays_file(cases, name, ft):
    path, ref = cases[name, ft]
    loaded = _transformers_gguf_model(path, name)
    if name == "qwen3moe":  # read from attention.key_length, not told
        assert loaded.config.head_dim == HEAD_DIM
    hf = _hf_logits(loaded, IDS)
    _assert_close(hf, _hf_logits(ref, IDS), f"{name} {ft}: transformers-from-GGUF vs dequantised weights")
    _assert_close(load_model(path).logits_all(IDS), hf, f"{name} {ft}: moeray vs transformers-from-GGUF")


@pytest.mark.parametrize("name", ["mixtral", "qwen2moe", "deepseek3"])
def test_batched_sequences_of_different_lengths_match_transformers(cases, name):
    """Three sequences of different lengths prefilled in one step, then decoded together: each gets
    the logits transformers computes for it alone (no attention leaks across packed sequences)."""
    path, ref = cases[name, "F32"]
    engine = load_model(path)
    seqs = [token_ids(11, seed=1), token_ids(4, seed=2), token_ids(8, seed=3)]
    prompt = [s[:-3] for s in seqs]  # 8, 1 and 5 tokens
    kv = engine.new_kv_cache(max_seqs=4, max_len=16)
    slots = [2, 0, 3]
    steps = [engine.step(prompt, slots, kv)]
    for j in (3, 2, 1):
        steps.append(engine.step([[s[-j]] for s in seqs], slots, kv))
    got = torch.stack(steps, dim=1)  # [seq, step, vocab]
    for i, s in enumerate(seqs):
        want = _hf_logits(ref, s)[len(s) - 4:]
        _assert_close(got[i], want, f"{name} sequence {i} (length {len(s)}) in a batch")


def test_tied_embeddings_use_token_embd_as_head(tmp_path):
    """A tied model is written without output.weight; the head must reuse token_embd."""
    import gguf

    model = tiny_llama(tie_word_embeddings=True)
    path = write_gguf(model, tmp_path / "tied.gguf", "F32")
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(path).tensors}
    _assert_close(load_model(path).logits_all(IDS), _hf_logits(model, IDS), "tied llama")


# Measured on these files (2-core AVX2 machine): the dequant backend is the exact backend's math on
# weights dequantised per use (identical here); ggml quantises activations to 8 bits (F16 weights:
# to float16), as llama.cpp does: max |diff| / max |logit| is 0.5-7% per position after three
# layers. A token whose top-k routing sits on a near-tie can pick another expert under that
# rounding (llama.cpp's too), and its logits then differ far more; those positions are counted,
# not compared.
BACKEND_RTOL = {"dequant": 1e-5, "ggml": 1e-1}  # ggml measured: up to 7e-2 (qwen3moe Q8_0: its q/k norms rescale the rounding)


def _logits_and_routing(path, backend):
    from moeray.stages.gguf.reader import GGUFFile
    from moeray.stages.blocks.moe import HostExperts

    gguf, seen = GGUFFile(path), []
    host = HostExperts(gguf, backend, on_route=lambda layer, ids, w: seen.append(ids.sort(-1).values))
    logits = _load_model(gguf, experts=host, backend=backend).logits_all(IDS)
    return logits, torch.stack(seen) if seen else None  # [layers, positions, k]


@pytest.mark.parametrize("backend", ["dequant", "ggml"])
@pytest.mark.parametrize("ft", ("F16", "Q8_0"))
@pytest.mark.parametrize("name", ["llama", "mixtral", "qwen2moe", "qwen3moe", "deepseek3", "deepseek2", "glm4moe"])
def test_quantised_routes_stay_within_their_measured_tolerance(cases, name, ft, backend):
    if backend == "ggml" and not ggml_available():
        pytest.skip("ggml-python is not installed (`make` builds it: docs/kernels.md#building-ggml)")
    path, _ = cases[name, ft]
    exact, exact_routing = _logits_and_routing(path, "exact")
    got, routing = _logits_and_routing(path, backend)
    same = torch.ones(len(IDS), dtype=torch.bool)
    if routing is not None:  # positions whose experts agree in every layer
        same = (routing == exact_routing).all(-1).all(0)
    assert same.float().mean() >= 0.75, f"{name} {ft} {backend}: routing differs at {int((~same).sum())} positions"
    err = (got - exact).abs().max(-1).values / exact.abs().max()
    assert err[same].max() <= BACKEND_RTOL[backend], f"{name} {ft} {backend}: {err[same].max():.2e} of max |logit|"
    if backend == "ggml":  # and the quantised kernels really ran, not float32 copies
        assert err.max() > 0
