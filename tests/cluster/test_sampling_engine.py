"""logit_bias and the penalties through the engine, on a tiny random model in one process: the
last stage gets each penalised sequence's prompt once, counts what it samples, gets the output
again after a preemption, and every token it picks is the one a direct computation on that step's
raw logits gives (the sampler is watched, not replaced: its inputs and outputs are recorded). Rows
without these parameters, batched beside them, give what they give alone; seeds still reproduce."""
from __future__ import annotations

import random

import pytest
import torch

from moeray.cluster.config import EngineConfig
from moeray.cluster.engine import Engine
from moeray.cluster.local_pipeline import LocalPipeline
from moeray.stages.runtime.step import StepBatch
from moeray.stages.text import sampling
from moeray.stages.text.sampling import SamplingParams
from test_gguf_file import tiny_config, write_synthetic_gguf
from test_sampling import direct


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from moeray.stages.runtime.model import load_model

    path = write_synthetic_gguf(tmp_path_factory.mktemp("pen") / "dense.gguf", tiny_config("llama", n_experts=0), seed=5)
    return load_model(str(path))


def _engine(model, n_blocks: int = 64, **cfg) -> Engine:
    config = EngineConfig(**{"max_seqs": 8, "max_len": model.config.context_length, "micro_batches": 1,
                             "token_budget": 64, "prefill_chunk": 8, "kv_blocks": n_blocks, **cfg})
    return Engine(LocalPipeline.from_model(model, n_blocks, config.max_seqs), config)


def _prompt(seed: int, n: int = 11) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 160) for _ in range(n)]


@pytest.fixture
def recorded(monkeypatch):
    """Every call of the sampler on the last stage: (raw logits, params per row, tokens picked)."""
    calls = []
    real = sampling.sample

    def watch(logits, params, generators, allowed=None, histories=None):
        raw = logits.clone()
        toks = real(logits, params, generators, allowed, histories)
        calls.append((raw, list(params), toks))
        return toks

    monkeypatch.setattr(sampling, "sample", watch)
    return calls


def _check_greedy_rows(calls, req) -> int:
    """Each greedy token of `req` is the argmax of the direct computation on its step's raw logits,
    with the prompt and the output before it; returns how many steps the processing changed."""
    k, changed = 0, 0
    for raw, params, toks in calls:
        for row, p in enumerate(params):
            if p is not req.params:
                continue
            want = direct(raw[row], p, req.prompt, req.output[:k])
            assert toks[row] == req.output[k]
            assert want[toks[row]] >= max(want) - 1e-4, (req.id, k, toks[row], max(range(len(want)), key=want.__getitem__))
            changed += toks[row] != int(raw[row].argmax())
            k += 1
    assert k == len(req.output)
    return changed


def test_penalised_and_biased_rows_pick_what_the_definition_gives_and_plain_neighbours_are_untouched(
        tiny_model, recorded):
    plain = SamplingParams(max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=21)
    penalised = [SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.6, presence_penalty=0.8),
                 SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=1.5, logit_bias={17: 2.0, 3: -100}),
                 SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=0.7, presence_penalty=-1.0)]
    seeded_pen = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=22, frequency_penalty=2,
                                min_p=0.05, top_k=30)
    params = [plain, penalised[0], seeded, penalised[1], seeded_pen, penalised[2]]
    eng = _engine(tiny_model)
    reqs = eng.run([eng.add(_prompt(i), p) for i, p in enumerate(params)])
    assert max(len(ps) for _, ps, _ in recorded) == len(params)  # they really shared steps
    for r in (reqs[1], reqs[3], reqs[5]):
        assert _check_greedy_rows(recorded, r) > 0  # the processing changed some picks
    # Alone, each request gives the same tokens: plain rows were not touched by their neighbours,
    # the seeded ones drew from their own generators, the penalised ones from their own histories.
    for i, (r, p) in enumerate(zip(reqs, params)):
        alone = _engine(tiny_model).generate([_prompt(i)], p)[0]
        assert alone.output == r.output, (i, p)
    # A large logit_bias pins the greedy choice; -100 forbids it.
    pinned = _engine(tiny_model).generate([_prompt(9)], SamplingParams(max_tokens=6, logit_bias={42: 100}))[0]
    assert pinned.output == [42] * 6
    first = reqs[0].output[0]
    banned = _engine(tiny_model).generate([_prompt(0)], SamplingParams(max_tokens=6, logit_bias={first: -100}))[0]
    assert first not in banned.output


def test_a_preempted_sequence_keeps_its_output_counts(tiny_model, recorded):
    """8 blocks (128 tokens) for 4 sequences growing to 51: the youngest gives way mid-decode and is
    prefilled again as prompt + output; its last stage starts from both, not from the prompt alone."""
    hungry = SamplingParams(max_tokens=40, ignore_eos=True)
    strict = SamplingParams(max_tokens=40, ignore_eos=True, repetition_penalty=1.4, frequency_penalty=0.9,
                            presence_penalty=0.5)
    eng = _engine(tiny_model, n_blocks=8, max_seqs=4, micro_batches=1)
    reqs = eng.run([eng.add(_prompt(i), hungry) for i in range(3)] + [eng.add(_prompt(7), strict)])
    assert reqs[3].preemptions >= 1 and all(r.finish_reason == "length" for r in reqs)
    assert _check_greedy_rows(recorded, reqs[3]) > 0


def test_the_history_and_params_travel_to_the_last_stage_only():
    b = StepBatch(step_id=0, slots=[0, 1], n_new=[3, 1], fresh=[True, False], tokens=[[1, 2, 3], [4]],
                  sample=[True, False], params=[SamplingParams(presence_penalty=1), None], starts=[0, 9],
                  tables=[[0], [1]], history=[([1, 2, 3], []), None], ended=[5])
    for i in (0, 1):
        s = b.for_stage(i, 3)
        assert s.history is None and s.params is None and s.sample is None and s.ended is None
    last = b.for_stage(2, 3)
    assert last.history == [([1, 2, 3], []), None] and last.params == b.params and last.ended == [5]
