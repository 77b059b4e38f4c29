"""The quantised backends: what a stage holds is the GGUF's own bytes, the kernels read them, a run
says which kernels it used, and the text stays the model's."""
from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from moeray.stages.kernels import backend
from moeray.stages.gguf.reader import GGUFFile
from moeray.stages.runtime.model import load_cached, load_model, stage_trunk_bytes
from moeray.stages.kernels.backend import ggml_available
from moeray.stages.kernels.qmatmul import QMatrix

needs_ggml = pytest.mark.skipif(not ggml_available(), reason="ggml-python is not installed (`make` builds it: docs/kernels.md#building-ggml)")


@pytest.fixture(scope="module")
def gguf(default_model_path):
    return GGUFFile(default_model_path)


def test_slots_and_trunk_hold_the_gguf_bytes(gguf):
    """Issue target: slot bytes / GGUF expert bytes <= 1.1 and trunk bytes / GGUF trunk bytes <= 1.1;
    here both are exactly 1 (the blocks themselves; vectors and routers are float32 in the file too)."""
    cfg = gguf.config
    model, cache = load_cached(gguf, (0, 10), backend="dequant", n_slots=12, layout="global")
    st = cache.stats()
    assert st["held_bytes_per_slot"] == st["gguf_bytes_per_expert"] == [gguf.expert_bytes(l) for l in range(10)]
    held = sum(w.nbytes for w in cache._weights.values())
    assert held == cache.budget.used == 12 * gguf.expert_bytes(0)
    assert model.trunk_bytes() == stage_trunk_bytes(gguf, 0, 10, backend=None) == stage_trunk_bytes(gguf, 0, 10)
    # The exact (debugging) backend holds float32: 6.4x the Q4_1 bytes, as the planner is told.
    exact, _ = load_cached(gguf, (28, 30), backend="exact", n_slots=1, layout="global")
    assert exact.experts.held_bytes[0] == 4 * 3 * cfg.expert_ffn_dim * cfg.hidden
    assert exact.trunk_bytes() == stage_trunk_bytes(gguf, 28, 30, backend="exact")


def test_a_slot_is_a_copy_not_a_view_of_the_mapping(gguf):
    _, cache = load_cached(gguf, (0, 1), backend="dequant", n_slots=1, layout="global")
    w = next(iter(cache._weights.values()))
    host = cache.host.weights(0, 0)
    assert torch.equal(w.gate.data, host.gate.data)
    assert w.gate.data.data_ptr() != host.gate.data.data_ptr()


@needs_ggml
def test_ggml_rows_do_not_depend_on_the_batch(gguf):
    """Built without llamafile's sgemm, ggml runs the same dot products at every batch size, so a
    sequence's logits do not change with what it is batched with (given the same inputs)."""
    for name in ("blk.3.attn_q.weight", "token_embd.weight"):
        info = gguf.info(name)
        w = QMatrix.from_raw(gguf.raw(name), info.ggml_type, info.shape, "ggml")
        x = torch.randn(5, info.shape[1])
        assert torch.equal(w(x), torch.cat([w(x[i:i + 1]) for i in range(5)]))


def test_dequant_route_is_the_exact_math(gguf):
    ids = list(range(1, 24))
    exact = load_model(gguf, backend="exact").logits_all(ids)
    assert torch.equal(load_model(gguf, backend="dequant").logits_all(ids), exact)


@needs_ggml
def test_ggml_greedy_tokens_are_ones_the_exact_model_rates_best(gguf, default_model_path):
    """8-bit activations (llama.cpp's own numerics) against float32 weights. Greedy text may part
    where the float32 model's top two logits nearly tie, so the check is on every token the ggml
    backend picks: teacher-forced through the exact backend, its logit is within 1.0 of the best,
    and nearly every pick is the exact backend's own argmax. Measured on these prompts: the largest
    gaps 0.08, 0.08 and 0 a prompt (with ggml's tiled flash attention from 16 query rows,
    MOERAY_FA_TILED_ROWS=16: 0.08, 0.08, 0.17, 45 of 48 picks the argmax)."""
    from moeray.cluster.generator import Generator
    from moeray.stages.gguf import default_model as dm
    from moeray.stages.text.sampling import SamplingParams
    from moeray.stages.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_model_path)
    prompts = dm.prompt_token_ids(tok)[::4][:3]  # a chat, a code and a prose prompt
    got = Generator(load_model(gguf, backend="ggml"), tok).generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    exact = load_model(gguf, backend="exact")
    gaps = []
    for prompt, c in zip(prompts, got):
        ids = prompt + c.token_ids
        logits = exact.logits_all(ids)[len(prompt) - 1:len(ids) - 1]  # the logits each pick was made from
        picked = logits.gather(1, torch.tensor(c.token_ids).view(-1, 1)).view(-1)
        gaps += (logits.max(-1).values - picked).tolist()
    assert max(gaps) <= 1.0, gaps
    assert sum(g == 0 for g in gaps) >= 0.85 * len(gaps), gaps  # and nearly always the very same token (45 of 48)


def test_the_route_is_announced_and_a_wrong_one_is_refused(gguf, caplog):
    with caplog.at_level(logging.INFO, logger="moeray.kernels"):
        backend._announced.clear()
        load_model(gguf, backend="dequant")
    assert any("kernels: dequant" in r.getMessage() for r in caplog.records)
    with pytest.raises(Exception, match="choose one of ggml, dequant, exact"):
        backend.set_backend("fp32")
    r = subprocess.run([sys.executable, "-c", "from moeray.stages.kernels.backend import current_backend; current_backend()"],
                       env={"MOERAY_BACKEND": "fast", "PATH": ""}, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "MOERAY_BACKEND='fast'" in r.stderr
