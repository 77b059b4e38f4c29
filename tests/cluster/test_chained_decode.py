"""A lone stream's chained decode (cluster/engine.py): on a pipeline whose last stage sends its
tokens to the first, the engine issues a decode step before the one it continues comes back. A
scripted pipeline that behaves as the stages do (steps run in the order they are handed out; a
looped step takes the last stage's tokens of the step before it) checks what a user would see: the
same text and finish as without chaining, a stop string or max_tokens met inside the chain, an abort,
and a second request arriving mid-chain; and that every decode row is fed the token its sequence
sampled last."""
from __future__ import annotations

from dataclasses import replace

import pytest

from moeray.cluster.config import EngineConfig
from moeray.cluster.engine import Engine
from moeray.stages.runtime.step import LOOPED, StepOutput
from moeray.stages.text.sampling import SamplingParams
from fakes import CharTokenizer
from test_engine import ids


class RingPipeline:
    """Stages that compute when a result is asked for (in the order steps were handed out), answer
    each sequence from a script chosen by its prompt's first character (then the end token 0), and
    loop a step's sampled tokens back to the first stage when it says so."""

    n_stages = 4
    async_submit = True

    def __init__(self, scripts: dict[str, str], loops_back: bool = True):
        self.scripts, self.loops_back = scripts, loops_back
        self.batches, self.pending, self.max_in_flight = [], [], 0
        self.slot_script: dict[int, tuple[str, int]] = {}
        self.last_token: dict[int, int] = {}  # slot -> the token it sampled last (what it must be fed next)
        self.ring: list[int] | None = None  # tokens on their way from the last stage to the first
        self.expect_looped: list[int] | None = None  # the slots whose tokens the next step takes

    def submit(self, batch):
        # As RayPipeline: the step after one that loops back takes its tokens at the first stage.
        assert batch.looped is None
        if self.expect_looped is not None:
            batch, self.expect_looped = replace(batch, looped=self.expect_looped), None
        if batch.loop_back:
            self.expect_looped = [s for s, want in zip(batch.slots, batch.sample) if want]
        assert batch.looped is not None or not any(t == [LOOPED] for t in batch.tokens)
        self.batches.append(batch)
        self.pending.append(batch)
        self.max_in_flight = max(self.max_in_flight, len(self.pending))
        return batch

    def result(self, batch, timeout_s):
        assert self.pending[0] is batch  # stages run steps in the order they were handed out
        self.pending.pop(0)
        tokens = batch.tokens
        if batch.looped is not None:
            looped = dict(zip(batch.looped, self.ring))
            tokens = batch.with_looped(looped).tokens
        out = []
        for slot, fresh, toks, want in zip(batch.slots, batch.fresh, tokens, batch.sample):
            assert LOOPED not in toks
            if fresh:
                self.slot_script[slot] = (self.scripts[chr(toks[0])], 0)
            elif len(toks) == 1:  # a decode row is fed what its sequence sampled last
                assert toks[0] == self.last_token[slot], (batch.step_id, slot, toks, self.last_token[slot])
            if not want:
                out.append(None)
                continue
            script, pos = self.slot_script[slot]
            tok = ord(script[pos]) if pos < len(script) else 0
            self.slot_script[slot] = (script, pos + 1)
            self.last_token[slot] = tok
            out.append(tok)
        if batch.loop_back:
            self.ring = [t for t, want in zip(out, batch.sample) if want]
        return StepOutput(out)

    def recover(self):
        pass


def engine(scripts, loops_back=True, **cfg):
    pipe = RingPipeline(scripts, loops_back)
    return Engine(pipe, EngineConfig(**{"max_seqs": 4, "max_len": 128, "micro_batches": 2, **cfg}),
                  CharTokenizer()), pipe


def test_a_lone_stream_runs_a_step_ahead_and_gives_the_same_text():
    text = "the quick brown fox jumps over the lazy dog"
    for loops in (True, False):
        eng, pipe = engine({"a": text}, loops_back=loops)
        r = eng.generate([ids("a")], SamplingParams(max_tokens=100))[0]
        assert r.text == text and r.finish_reason == "stop" and r.output == ids(text) + [0]
        chained = [b for b in pipe.batches if b.looped is not None]
        assert bool(chained) == loops and pipe.max_in_flight == (2 if loops else 1)
        assert all(t == [LOOPED] for b in chained for t in b.tokens)
        assert eng.n_free_slots == 4 and not eng.running and not eng.in_flight


def test_a_stop_string_or_max_tokens_inside_the_chain_ends_where_it_would_have():
    eng, pipe = engine({"a": "hello STOP and more", "b": "abcdefghijklmnop"})
    r = eng.generate([ids("a")], SamplingParams(max_tokens=100, stop=("STOP",)))[0]
    assert (r.text, r.finish_reason, r.output) == ("hello ", "stop", ids("hello STOP"))
    before = len(pipe.batches)
    r = eng.generate([ids("b")], SamplingParams(max_tokens=7))[0]
    assert (r.text, r.finish_reason) == ("abcdefg", "length")
    # No row past max_tokens was handed out: 1 prefill and 6 decode rows give 7 tokens.
    assert [b.n_new for b in pipe.batches[before:]] == [[1]] * 7
    assert eng.n_free_slots == 4 and not eng.in_flight


def test_an_abort_mid_chain_frees_the_slot_once_its_steps_are_back():
    eng, pipe = engine({"a": "x" * 60})
    r = eng.add(ids("a"), SamplingParams(max_tokens=60))
    while len(r.output) < 5:
        eng.step()
    assert len(eng.in_flight) == 2
    eng.abort(r)
    assert r.finish_reason == "abort" and eng.n_free_slots == 3  # its steps are still out
    while eng.has_work():
        eng.step()
    assert eng.n_free_slots == 4 and not eng.running


def test_a_request_arriving_mid_chain_stops_it_and_both_finish_right():
    eng, pipe = engine({"a": "abcdefghijklmnopqrstuvwxyz", "b": "0123456789"})
    a = eng.add(ids("a"), SamplingParams(max_tokens=26, ignore_eos=True))
    while len(a.output) < 4:
        eng.step()
    assert len(eng.in_flight) == 2  # the chain runs a step ahead
    n = len(pipe.batches)
    b = eng.add(ids("b") * 3, SamplingParams(max_tokens=10, ignore_eos=True))
    eng.run([a, b])
    assert a.text == "abcdefghijklmnopqrstuvwxyz" and b.text == "0123456789"
    # The next step handed out (b's prompt, in the other lane) took the tokens on their way; no
    # step went ahead while both ran, and a's chain went on once b was done.
    assert pipe.batches[n].looped is not None and a.slot not in pipe.batches[n].slots
    last_b = max(i for i, x in enumerate(pipe.batches) if b.slot in x.slots)
    assert not any(t == [LOOPED] for x in pipe.batches[n:last_b + 1] for t in x.tokens)
    assert any(t == [LOOPED] for x in pipe.batches[last_b + 1:] for t in x.tokens)


@pytest.mark.parametrize("flag", [True, False])
def test_the_chain_is_a_config_switch(flag):
    eng, pipe = engine({"a": "hello world"}, chained_decode=flag)
    eng.generate([ids("a")], SamplingParams(max_tokens=20))
    assert any(b.looped for b in pipe.batches) == flag
