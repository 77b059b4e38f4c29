"""The engine carries a hybrid model's DeltaNet state: 4 stages give the one-process greedy
tokens; a long prompt prefilled in 512-token chunks gives the one-shot logits; a preempted
hybrid sequence resumes with the same greedy tokens; the state ledger (one state slot per running
sequence, the engine's sequence slots) is checked after every step as the KV ledger is; prefix
reuse is off for a model with recurrent state, with a line saying why; a stage failure leaves no
stale state behind. The tiny random qwen3next of tests/tiny_hybrid.py, exact backend."""
from __future__ import annotations

import logging
import random

import pytest
import torch

from moeray.cluster.config import EngineConfig
from moeray.cluster.engine import Engine
from moeray.cluster.local_pipeline import LocalPipeline
from moeray.stages.runtime.runner import StageRunner
from moeray.stages.gguf.writer import write_gguf
from moeray.stages.blocks.kv_cache import blocks_for
from moeray.stages.runtime.model import StageModel
from moeray.stages.text.sampling import SamplingParams
from tiny_hybrid import tiny_qwen3next

MAX_SEQS = 8


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_gguf(tiny_qwen3next(max_pos=4096), tmp_path_factory.mktemp("hy") / "qwen3next.gguf", "F32")


@pytest.fixture(scope="module")
def whole(path):
    return StageModel.from_gguf(str(path), backend="exact")


class StagedPipeline:
    """Stages in this process, each its own StageRunner (own KV pool and state), the hidden states
    handed from one to the next: the 4-stage pipeline without Ray."""

    def __init__(self, models, n_blocks: int, max_seqs: int):
        self.stages = [StageRunner(m, m.new_kv_pool(n_blocks, max_seqs)) for m in models]
        self.n_stages, self.kv_blocks, self.state_slots = len(models), n_blocks, max_seqs

    def submit(self, batch):
        x = None
        for i, st in enumerate(self.stages):
            b = batch.for_stage(i, self.n_stages)
            meta = st.begin(b)
            x = st.layers(st.model.embed(b.tokens) if i == 0 else x, meta)
        return self.stages[-1].sample(batch.for_stage(self.n_stages - 1, self.n_stages), x, meta)

    def result(self, handle, timeout_s):
        return handle

    def recover(self):
        pass


def _greedy(model, prompt, n):
    """The plain one-process loop: the whole model, one sequence, one fixed slot."""
    kv = model.new_kv_cache(1, len(prompt) + n)
    out, logits = [], model.step([prompt], [0], kv)[0]
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = model.step([[out[-1]]], [0], kv)[0]
    return out


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, 290) for _ in range(20 + 9 * i)] for i in range(n)]


def _check_state_ledger(eng):
    """One state slot per running sequence, none shared, every one inside the stages' pools; the
    free slots and the held ones are all the slots."""
    held = [r.slot for r in eng.scheduler.running]
    assert len(held) == len(set(held)) and all(0 <= s < eng.pipeline.state_slots for s in held)
    assert sorted(held + [s for lane in eng.scheduler.lane_slots for s in lane]) == list(range(MAX_SEQS))


def _run(eng, prompts, n, check=None):
    reqs = [eng.add(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts]
    while not all(r.done for r in reqs):
        eng.step()
        if check is not None:
            check(eng)
    return reqs


def _config(**kw):
    return EngineConfig(**{"max_seqs": MAX_SEQS, "max_len": 1024, "micro_batches": 2, "token_budget": 48,
                           "prefill_chunk": 16, **kw})


def test_four_stages_give_the_one_process_greedy_tokens(path, whole, caplog):
    models = [StageModel.from_gguf(str(path), (i, i + 1), backend="exact") for i in range(4)]
    with caplog.at_level(logging.INFO, logger="moeray"):
        eng = Engine(StagedPipeline(models, 200, MAX_SEQS), _config())
    # prefix reuse would resume a sequence mid-prompt without its state: off, and said why
    assert not eng.scheduler.blocks.prefix_reuse
    assert any("prefix reuse off" in r.getMessage() for r in caplog.records)
    prompts = _prompts(5)
    reqs = _run(eng, prompts + [prompts[0]], 12, _check_state_ledger)  # a repeated prompt: nothing cached
    assert all(r.cached_tokens == 0 for r in reqs)
    for r, p in zip(reqs, prompts + [prompts[0]]):
        assert r.output == _greedy(whole, p, 12), r.id


def test_a_long_prompt_in_512_token_chunks_equals_one_shot(whole):
    rng = random.Random(3)
    prompt = [rng.randrange(1, 290) for _ in range(3000)]
    one = whole.logits_all(prompt)  # the whole prompt in one step
    kv = whole.new_kv_pool(blocks_for(3000) + 4, 2)
    table = list(range(blocks_for(3000)))
    rows = []
    for start in range(0, 3000, 512):
        toks = prompt[start:start + 512]
        meta = whole.table_meta([len(toks)], [start], [table], kv, [1])
        rows.append(whole.head(whole.run_layers(whole.embed([toks]), meta, kv)))
    got = torch.cat(rows)
    scale = one.abs().max().item()
    assert (got - one).abs().max().item() <= 1e-4 * scale


def test_preempted_hybrid_sequences_resume_with_the_same_greedy_tokens(path, whole):
    # 10 blocks: not enough for 4 sequences of 36-63 tokens, so decodes preempt the youngest
    eng = Engine(LocalPipeline.from_model(whole, 10, MAX_SEQS), _config(kv_blocks=10))
    prompts = _prompts(4, seed=1)
    reqs = _run(eng, prompts, 16, _check_state_ledger)
    assert eng.scheduler.stats.preemptions > 0
    for r, p in zip(reqs, prompts):
        assert r.error is None and r.output == _greedy(whole, p, 16)


def test_a_stage_failure_leaves_no_stale_state(path, whole):
    eng = Engine(LocalPipeline.from_model(whole, 100, MAX_SEQS), _config())
    first = _prompts(3, seed=2)
    reqs = [eng.add(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in first]
    for _ in range(4):
        eng.step()
    eng.scheduler.fail_running("stage 0 restarted")  # what the engine does when a stage dies
    assert all(r.error for r in reqs) and not eng.scheduler.running
    # the same slots start new sequences: from zeros, not from what the failed ones left there
    again = _run(eng, _prompts(3, seed=4), 8, _check_state_ledger)
    for r, p in zip(again, _prompts(3, seed=4)):
        assert r.output == _greedy(whole, p, 8)
