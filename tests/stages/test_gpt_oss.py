"""gpt-oss (stages/arch/gpt_oss.py) against transformers' own GptOssForCausalLM: a tiny random
model (float32, eager attention) written as llama.cpp's converter writes it, with MXFP4 experts.
Its sliding window (8) is shorter than the test sequences, so windowed and full layers differ."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from gpt_oss_model import write_gpt_oss
from moeray.stages.gguf.reader import GGUFFile, read_gguf_header
from moeray.stages.runtime.model import load_model
from moeray.stages.kernels.backend import ggml_available
from tiny_models import EXPERT_FFN, HIDDEN, N_HEADS, token_ids

RTOL = 1e-4  # of the largest |logit|, the exact backend
# ggml's 8-bit activations through Q8_0 attention and MXFP4 experts: measured 5.1e-2 of the largest
# logit on these 20 tokens (F32 trunk, ggml for the experts only: 2.6e-2), the bound the other
# families' ggml parity uses (tests/stages/test_parity_transformers.py). Longer inputs can flip a near-tie
# top-2 choice on rounding alone (0.44 at 40 tokens), which no tolerance on logits covers.
GGML_RTOL = 1e-1
IDS = token_ids(20)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt-oss")
    return {ft: write_gpt_oss(root / f"gpt-oss-{ft}.gguf", ft) for ft in ("F32", "Q8_0")}


def _hf(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _close(got, ref, rtol, what):
    diff, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    assert diff <= rtol * scale, f"{what}: max |diff| {diff:.3g} > {rtol} * max |logit| {scale:.3g}"


def test_the_file_is_laid_out_as_llama_cpps_converter_writes_it(files):
    path, _ = files["F32"]
    h = read_gguf_header(path)
    cfg = h.config
    assert h.arch == cfg.arch == "gpt-oss"
    assert cfg.swa_layers == (True, False, True) and cfg.sliding_window == 8
    assert (cfg.expert_act, cfg.swiglu_alpha, cfg.swiglu_limit) == ("swiglu_oai", 1.702, 7.0)
    assert cfg.rope_scaling == "yarn" and cfg.rope_scale == 4.0 and cfg.rope_orig_context == 64
    t = h.tensors
    for name in ("attn_sinks.weight", "post_attention_norm.weight", "attn_output.bias", "ffn_gate_inp.bias"):
        assert t[f"blk.1.{name}"].ggml_type == QT.F32
    for kind in ("gate", "up", "down"):
        assert t[f"blk.1.ffn_{kind}_exps.weight"].ggml_type == QT.MXFP4
        assert t[f"blk.1.ffn_{kind}_exps.bias"].shape == (6, HIDDEN if kind == "down" else EXPERT_FFN)
    assert "blk.1.ffn_norm.weight" not in t
    # one expert's slot: its MXFP4 blocks (17 bytes per 32 weights) and its three bias rows
    assert h.expert_bytes(1) == 3 * EXPERT_FFN * HIDDEN // 32 * 17 + 4 * (2 * EXPERT_FFN + HIDDEN)
    assert t["blk.1.attn_sinks.weight"].shape == (N_HEADS,)


def test_logits_match_transformers_on_the_exact_route(files):
    path, model = files["F32"]
    _close(load_model(path, backend="exact").logits_all(IDS), _hf(model, IDS), RTOL, "gpt-oss exact")


def test_prefill_then_decode_past_the_window_matches_transformers(files):
    path, model = files["F32"]
    engine = load_model(path, backend="dequant")  # per-use dequantisation: the same math as exact
    want = _hf(model, IDS)
    kv = engine.new_kv_cache(max_seqs=2, max_len=32)
    got = [engine.step([IDS[:5]], [1], kv)[0], engine.step([IDS[5:11]], [1], kv)[0]]
    for t in range(11, len(IDS)):
        got.append(engine.step([[IDS[t]]], [1], kv)[0])
    _close(torch.stack(got), want[[4, 10, *range(11, len(IDS))]], RTOL, "gpt-oss prefill+decode")


def test_batched_sequences_of_different_lengths_match_transformers(files):
    path, model = files["F32"]
    engine = load_model(path, backend="exact")
    seqs = [IDS, IDS[3:9], IDS[:13]]
    kv = engine.new_kv_cache(max_seqs=3, max_len=32)
    got = engine.step(seqs, [0, 1, 2], kv)
    for i, s in enumerate(seqs):
        _close(got[i:i + 1], _hf(model, s)[-1:], RTOL, f"sequence {i} of a batch")


@pytest.mark.skipif(not ggml_available(), reason="ggml-python is not installed (`make` builds it: docs/kernels.md#building-ggml)")
def test_ggml_route_within_its_measured_tolerance(files):
    path, model = files["Q8_0"]
    ref = _hf(model, IDS)
    got = load_model(path, backend="ggml").logits_all(IDS)
    exact = load_model(path, backend="exact").logits_all(IDS)
    _close(exact, ref, RTOL, "gpt-oss Q8_0 exact")
    _close(got, ref, GGML_RTOL, "gpt-oss Q8_0 ggml")


def test_harmony_chat_template_and_end_tokens_come_from_the_gguf(files):
    from moeray.stages.text.tokenizer import Tokenizer

    path, _ = files["F32"]
    tok = Tokenizer.from_gguf(path)
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "What is the capital of France?"}])
    assert text.startswith("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n")
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>" in text
    assert text.endswith("<|start|>user<|message|>What is the capital of France?<|end|><|start|>assistant")
    ids = {t: tok.backend.token_to_id(t) for t in ("<|return|>", "<|call|>", "<|end|>", "<|channel|>")}
    # llama.cpp's harmony rules: a reply is messages ending in <|end|>, the last in <|return|>
    assert ids["<|return|>"] in tok.end_ids and ids["<|call|>"] in tok.end_ids and ids["<|end|>"] not in tok.end_ids
    reply = tok.encode("<|channel|>final<|message|>Paris<|end|><|return|>", add_bos=False)
    assert tok.decode(reply) == "<|channel|>final<|message|>Paris<|end|>"


def test_published_gpt_oss_120b_is_planned_from_its_header(tmp_path, capsys):
    """bench/headers.py writes gpt-oss-120b's header (36 x 128 experts top-4, MXFP4 experts):
    priced at its real bytes, planned by `moeray plan` on a 2x24 + 2x16 GiB rig."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from headers import write_gpt_oss_header

    from moeray.cluster.cli import main

    path = write_gpt_oss_header("gpt-oss-120b", tmp_path / "gpt-oss-120b.gguf")
    h = read_gguf_header(path)
    cfg = h.config
    assert (cfg.n_layers, cfg.n_experts, cfg.n_experts_used, cfg.sliding_window) == (36, 128, 4, 128)
    assert cfg.swa_layers == tuple(i % 2 == 0 for i in range(36))
    # gate, up, down: 2880 x 2880 each at 17 bytes per 32 weights, plus the expert's three bias rows
    assert h.expert_bytes(0) == 3 * 2880 * 2880 // 32 * 17 + 4 * 3 * 2880
    assert main(["plan", str(path), "--devices", "24GiB,24GiB,16GiB,16GiB"]) == 0
    out = capsys.readouterr().out
    assert "layer split auto: K=" in out and sum(line.startswith("stage ") for line in out.splitlines()) == 4
