"""A sequence's sampling parameters travel to the last stage once, on the row it starts its slot
with (stages/runtime/step.py StepBatch.params), and the stage keeps them until the sequence ends:
what a user would notice is that a request's logit_bias still holds after its sequence was
preempted (admitted again: sent again) and after the stage was restarted (an empty stage: the
sequences it serves next carry theirs), and that a slot's next sequence never samples with the
last one's. A tiny random model in one process; the stage's restart is a new StageRunner."""
from __future__ import annotations

import pytest

from moeray.cluster.config import EngineConfig
from moeray.cluster.engine import Engine
from moeray.cluster.remote import StageFailedError
from moeray.cluster.scheduler import RequestStatus
from moeray.errors import MoerayError
from moeray.stages.runtime.runner import StageRunner
from moeray.stages.runtime.step import StepBatch
from moeray.stages.text.sampling import SamplingParams
from test_gguf_file import tiny_config, write_synthetic_gguf
from test_sampling_engine import _prompt


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from moeray.stages.runtime.model import load_model

    path = write_synthetic_gguf(tmp_path_factory.mktemp("once") / "dense.gguf", tiny_config("llama", n_experts=0),
                                seed=7)
    return load_model(str(path))


class RestartingPipeline:
    """The whole model on one StageRunner that dies at step `fail_at` (its step raises as a dead
    stage's does) and comes back empty from recover(): no KV, no params, no samplers."""

    n_stages = 1

    def __init__(self, model, n_blocks: int, fail_at: int | None = None):
        self.model, self.kv_blocks, self.fail_at = model, n_blocks, fail_at
        self.runner = StageRunner(model, model.new_kv_pool(n_blocks))
        self.batches: list[StepBatch] = []
        self.restarts = 0

    def submit(self, batch: StepBatch):
        self.batches.append(batch)
        if len(self.batches) == self.fail_at:
            return StageFailedError("stage 0 died during a step")
        return self.runner.step(batch)

    def result(self, handle, timeout_s: float):
        if isinstance(handle, Exception):
            raise handle
        return handle

    def recover(self) -> None:
        self.runner = StageRunner(self.model, self.model.new_kv_pool(self.kv_blocks))
        self.restarts += 1


def _engine(pipe: RestartingPipeline, **cfg) -> Engine:
    config = EngineConfig(**{"max_seqs": 4, "max_len": 256, "micro_batches": 1, "token_budget": 64,
                             "prefill_chunk": 8, "kv_blocks": pipe.kv_blocks, **cfg})
    return Engine(pipe, config)


def _biased(token: int, n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, logit_bias={token: 100.0})


def test_a_preempted_sequence_keeps_its_logit_bias_and_its_params_travel_once_per_admission(tiny_model):
    """7 blocks (112 tokens) for 4 sequences growing to 41 tokens: the youngest give way mid-decode
    and are admitted again. Each request's bias forces its own token: every token it got is that
    one, before and after its preemption, whichever slot it had."""
    pipe = RestartingPipeline(tiny_model, n_blocks=7)
    eng = _engine(pipe)
    forced = [11, 42, 99, 150]
    reqs = eng.run([eng.add(_prompt(i), _biased(t, 30)) for i, t in enumerate(forced)])
    assert sum(r.preemptions for r in reqs) >= 1
    for r, t in zip(reqs, forced):
        assert r.finish_reason == "length" and r.output == [t] * 30, (r.preemptions, r.output)
    # Sent once per admission: on the fresh rows only, never with a decode row.
    sent = sum(1 for b in pipe.batches for p in b.params or () if p is not None)
    assert sent == len(reqs) + sum(r.preemptions for r in reqs)
    assert all(b.params is None for b in pipe.batches if not any(b.fresh))


def test_after_a_stage_restart_the_sequences_it_serves_bring_their_params(tiny_model):
    """One slot: the first request runs when the stage dies at its third step (it fails, as its KV
    is gone); the second waited, and is served by the restarted stage, with its own bias."""
    pipe = RestartingPipeline(tiny_model, n_blocks=16, fail_at=3)
    eng = _engine(pipe, max_seqs=1)
    running = eng.add(_prompt(1), _biased(11, 8))
    waiting = eng.add(_prompt(2), _biased(42, 8))
    with pytest.raises(StageFailedError):
        eng.run([running, waiting])
    assert running.status is RequestStatus.FAILED and pipe.restarts == 1
    assert not pipe.runner.params  # the new stage holds nothing yet
    eng.run([waiting])
    assert waiting.output == [42] * 8
    # The slot's next sequence samples with its own params, not the last one's.
    plain = eng.run([eng.add(_prompt(3), SamplingParams(max_tokens=8, ignore_eos=True))])[0]
    assert plain.output != [42] * 8 and list(pipe.runner.params.values()) == [plain.params]


def test_a_stage_asked_for_a_token_without_the_sequences_params_says_so(tiny_model):
    runner = StageRunner(tiny_model, tiny_model.new_kv_pool(4))
    batch = StepBatch(step_id=0, slots=[0], n_new=[3], fresh=[True], tokens=[[1, 2, 3]], sample=[True],
                      starts=[0], tables=[[0]])
    with pytest.raises(MoerayError, match="sampling parameters never came"):
        runner.step(batch)
