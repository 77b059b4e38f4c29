"""The engine's scheduling and finish rules against a scripted pipeline (no Ray, no weights):
lanes and slots, chunked prefill within the token budget, end token / length / stop strings,
abort while a step is in flight, a stage failure failing every running request; the one config
tree behind every command's flags; and the one-process Generator against a plain greedy loop."""
from __future__ import annotations

import time

import pytest

from moeray.cluster.config import EngineConfig, LaunchOptions, ServeOptions
from moeray.cluster.engine import Engine
from moeray.cluster.generator import Generator
from moeray.cluster.remote import StageFailedError
from moeray.cluster.scheduler import RequestStatus
from moeray.errors import MoerayError
from moeray.stages.runtime.step import StepOutput
from moeray.stages.text.sampling import SamplingParams
from fakes import CharTokenizer


class ScriptedPipeline:
    """A pipeline whose model answers each sequence from a script chosen by its prompt's first
    character: the next character per sampled token, then the end token. Results wait until the
    engine asks for them, so steps really are in flight together; `fail_at` makes that step's
    result raise as a dead stage would."""

    n_stages = 1

    def __init__(self, scripts: dict[str, str], fail_at: int | None = None, delay_s: float = 0.0):
        self.scripts, self.fail_at, self.delay_s = scripts, fail_at, delay_s
        self.batches, self.in_flight, self.max_in_flight, self.recovered = [], set(), 0, 0
        self.slot_script: dict[int, tuple[str, int]] = {}
        self.kv_len: dict[int, int] = {}

    def submit(self, batch):
        self.batches.append(batch)
        self.in_flight.add(batch.step_id)
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        return batch

    def result(self, batch, timeout_s):
        time.sleep(self.delay_s)
        self.in_flight.discard(batch.step_id)
        if batch.step_id == self.fail_at:
            raise StageFailedError(f"stage 0 died during step {batch.step_id}")
        out = []
        for slot, n, fresh, toks, want in zip(batch.slots, batch.n_new, batch.fresh, batch.tokens, batch.sample):
            if fresh:
                self.slot_script[slot], self.kv_len[slot] = (self.scripts[chr(toks[0])], 0), 0
            self.kv_len[slot] += n
            if not want:
                out.append(None)
                continue
            script, pos = self.slot_script[slot]
            out.append(ord(script[pos]) if pos < len(script) else 0)
            self.slot_script[slot] = (script, pos + 1)
        return StepOutput(out)

    def recover(self):
        self.recovered += 1


def engine(scripts, fail_at=None, **cfg) -> tuple[Engine, ScriptedPipeline]:
    pipe = ScriptedPipeline(scripts, fail_at)
    return Engine(pipe, EngineConfig(**{"max_seqs": 4, "max_len": 64, "micro_batches": 2, **cfg}), CharTokenizer()), pipe


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_end_token_stop_string_and_length_are_the_engines_rules():
    eng, _ = engine({"0": "hello", "a": "stop here: STOP more", "x": "abcdefghij"})
    reqs = [eng.add(ids("0123456789"), SamplingParams(max_tokens=20)),
            eng.add(ids("ab"), SamplingParams(stop=("STOP",))),
            eng.add(ids("xyz"), SamplingParams(max_tokens=4))]
    seen = [set() for _ in reqs]
    while not all(r.done for r in reqs):
        eng.step()
        for s, r in zip(seen, reqs):
            s.add(r.text)
    assert [r.text for r in reqs] == ["hello", "stop here: ", "abcd"]
    assert [r.finish_reason for r in reqs] == ["stop", "stop", "length"]
    assert reqs[0].output == ids("hello") + [0]  # the end token is an output token, not text
    assert reqs[1].output == ids("stop here: STOP")  # generation ends on the token completing the stop
    # Released text only grows, and no prefix of the stop string was ever released.
    for s, r in zip(seen, reqs):
        assert all(r.text.startswith(t) for t in s)
    assert not any(t.endswith(("S", "ST", "STO")) for t in seen[1])
    assert eng.n_free_slots == 4 and not eng.running


def test_ignore_eos_runs_to_max_tokens_and_no_tokenizer_means_token_ids_only():
    eng, _ = engine({"A": "hi"})
    r = eng.generate([ids("A")], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert r.finish_reason == "length" and r.output == ids("hi") + [0, 0, 0] and r.text == "hi"
    bare = Engine(ScriptedPipeline({"A": "hi"}), EngineConfig(max_seqs=2, max_len=16))
    r = bare.generate([ids("A")], SamplingParams(max_tokens=4))[0]
    assert r.output == ids("hi") + [0, 0] and r.text == "" and r.finish_reason == "length"
    with pytest.raises(MoerayError, match="stop strings need"):
        bare.add(ids("A"), SamplingParams(stop=("x",)))


def test_lanes_own_slot_ranges_and_run_one_step_each_in_flight():
    eng, pipe = engine({c: "abcdef" for c in "pqrs"}, max_seqs=4, micro_batches=2)
    reqs = [eng.add(ids(c * 3), SamplingParams(max_tokens=6)) for c in "pqrs"]
    eng.run(reqs)
    assert [(r.lane, r.slot) for r in reqs] == [(0, 0), (1, 2), (0, 1), (1, 3)]
    assert pipe.max_in_flight == 2  # both lanes moved down the pipeline together
    for b in pipe.batches:
        assert b.slots == sorted(b.slots) and len({s // 2 for s in b.slots}) == 1  # one lane, slot order
    assert all(r.text == "abcdef" for r in reqs)


def test_chunked_prefill_shares_the_token_budget_with_decodes_first():
    eng, pipe = engine({"A": "zzzzzz", "B": "yyyyyy"}, max_seqs=2, micro_batches=1, prefill_chunk=4, token_budget=6,
                       prefill_alone=4)
    a = eng.add(ids("AA"), SamplingParams(max_tokens=6))
    b = eng.add(ids("B" * 10), SamplingParams(max_tokens=2))
    eng.run([a, b])
    first = pipe.batches[:3]
    assert [x.n_new for x in first] == [[2, 4], [1, 4], [1, 2]]  # A decodes first; B in chunks of <= 4
    assert [x.fresh for x in first] == [[True, True], [False, False], [False, False]]
    assert [x.sample for x in first] == [[True, False], [True, False], [True, True]]
    assert b.text == "yy" and a.text == "zzzzzz"
    assert eng.stats.prefill_tokens == 12 and eng.stats.decode_tokens == sum(len(r.output) - 1 for r in (a, b))


def test_a_prompt_no_decode_waits_on_takes_bigger_chunks():
    """While no sequence decodes nothing waits on a step: a lone prompt's chunks (and the step's
    budget) grow to prefill_alone; once a sequence decodes, the next prompt beside it goes back to
    prefill_chunk within token_budget."""
    eng, pipe = engine({"A": "zzzzzz", "B": "yy"}, max_seqs=2, micro_batches=1, prefill_chunk=4, token_budget=6,
                       prefill_alone=16)
    a = eng.add(ids("A" * 40), SamplingParams(max_tokens=6))
    eng.step()
    eng.step()
    b = eng.add(ids("B" * 20), SamplingParams(max_tokens=2))
    eng.run([a, b])
    # A's last 8 and B's first 8 share a step no decode waits on; then A decodes beside B's chunks
    assert [x.n_new for x in pipe.batches[:6]] == [[16], [16], [8, 8], [1, 4], [1, 4], [1, 4]]
    assert a.text == "zzzzzz" and b.text == "yy"


def test_abort_while_its_step_is_in_flight_frees_the_slot_when_the_step_returns():
    eng, pipe = engine({"p": "abcdefgh", "q": "abcdefgh"}, max_seqs=2, micro_batches=2)
    p = eng.add(ids("p"), SamplingParams(max_tokens=8))
    q = eng.add(ids("q"), SamplingParams(max_tokens=8))
    eng.step()  # both lanes launched; lane 0's result taken, lane 1's (q) still in flight
    assert q.busy and pipe.in_flight
    eng.abort(q)
    assert q.status is RequestStatus.FINISHED and q.finish_reason == "abort"
    assert q in eng.running and eng.n_free_slots == 0  # its step still holds the slot
    eng.step()
    assert q not in eng.running and q.output == [] and eng.n_free_slots >= 1
    again = eng.add(ids("q"), SamplingParams(max_tokens=3))  # the freed slot serves a new request
    eng.run([p, again])
    assert again.text == "abc" and p.text == "abcdefgh"


def test_a_stage_failure_fails_every_running_request_and_the_waiting_ones_go_on():
    eng, pipe = engine({c: "abcdef" for c in "pqr"}, fail_at=1, max_seqs=2, micro_batches=2)
    p, q, r = (eng.add(ids(c), SamplingParams(max_tokens=6)) for c in "pqr")
    eng.step()  # step 0 (lane 0) returns; step 1 (lane 1) is in flight
    with pytest.raises(StageFailedError, match="stage 0 died"):
        eng.step()
    assert p.status is q.status is RequestStatus.FAILED and "stage 0 died" in p.error
    assert r.status is RequestStatus.WAITING and pipe.recovered == 1 and not eng.in_flight
    assert eng.stats.failures == 1 and eng.n_free_slots == 2
    eng.run([r])
    assert r.text == "abcdef"


def test_prompts_that_do_not_fit_are_refused_before_they_run():
    eng, _ = engine({"a": "x"}, max_len=8)
    with pytest.raises(MoerayError, match="empty prompt"):
        eng.add([], SamplingParams())
    with pytest.raises(MoerayError, match="max_len of 8"):
        eng.add(ids("a" * 8), SamplingParams())
    assert eng.add(ids("a" * 5), SamplingParams(max_tokens=50)).max_new == 3
    with pytest.raises(MoerayError, match="micro_batches"):
        EngineConfig(max_seqs=1, micro_batches=2)


# ---------------------------------------------------------------- one config tree


def test_every_command_takes_its_defaults_from_the_config_dataclasses():
    from moeray.cluster.cli import build_parser
    from moeray.cluster.config import engine_config_from_args, launch_options_from_args

    for command in ("serve", "run"):
        argv = [command] + (["--prompt", "hi"] if command == "run" else [])
        args = build_parser(argv)[0].parse_args(argv)
        assert engine_config_from_args(args) == EngineConfig(), command
        assert launch_options_from_args(args, None) == LaunchOptions(), command
    serve = ServeOptions()
    assert serve.engine == EngineConfig() and serve.launch == LaunchOptions()
    args = build_parser(["serve"])[0].parse_args(["serve", "--cache-policy", "lru", "--profile", "p.msgpack"])
    opts = launch_options_from_args(args, None)
    assert (opts.cache_policy, opts.profile) == ("lru", "p.msgpack")
    with pytest.raises(MoerayError, match="cache policy 'mru'"):
        LaunchOptions(cache_policy="mru")


def test_the_cache_policy_reaches_the_stage_cache(tmp_path):
    from moeray.cluster.local_pipeline import LocalPipeline
    from test_gguf_file import tiny_config, write_synthetic_gguf

    path = write_synthetic_gguf(tmp_path / "moe.gguf", tiny_config("qwen2moe"), seed=3)
    pipe = LocalPipeline.from_file(str(path), 4, 64 << 20, cache_policy="lru")  # 4 KV blocks
    assert pipe.stage.stats().cache["policy"] == "lru"
    r = Engine(pipe, EngineConfig(max_seqs=2, max_len=32)).generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0]
    assert len(r.output) == 3


# ---------------------------------------------------------------- the one-process pipeline


def test_generator_greedy_equals_a_plain_model_loop_and_streams_the_same_text(tmp_path):
    import torch

    from moeray.stages.runtime.model import load_model
    from test_gguf_file import tiny_config, write_synthetic_gguf

    model = load_model(write_synthetic_gguf(tmp_path / "tiny.gguf", tiny_config("qwen3moe"), seed=5))
    prompts = [[5, 17, 99, 3, 150, 42, 8, 77, 21, 64, 130], [1, 9]]
    want = []
    for prompt in prompts:
        kv, toks, feed = model.new_kv_cache(1, 32), [], prompt
        for _ in range(6):
            toks.append(int(torch.argmax(model.step([feed], [0], kv)[0])))
            feed = [toks[-1]]
        want.append(toks)
    gen = Generator(model, CharTokenizer(), EngineConfig(prefill_chunk=4, token_budget=6))
    streamed = {0: "", 1: ""}
    got = gen.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True),
                       on_text=lambda i, d: streamed.__setitem__(i, streamed[i] + d))
    assert [c.token_ids for c in got] == want
    assert [streamed[i] for i in range(2)] == [c.text for c in got]
    assert gen.stats.prefill_tokens == 13 and gen.stats.decode_tokens == 10
    assert "".join(gen.stream(prompts[1], SamplingParams(max_tokens=6, ignore_eos=True))) == got[1].text


# ---------------------------------------------------------------- the server's engine thread


def test_the_engine_thread_forwards_the_engines_text_and_frees_what_the_client_drops():
    import asyncio

    from moeray.cluster.engine_loop import EngineLoop, Finished

    eng, pipe = engine({"a": "hello STOP more", "b": "abcdefghijklmnop"}, max_seqs=2)
    pipe.delay_s = 0.02  # a step takes a while, as on real stages: the abort lands mid-generation
    loop = EngineLoop(eng, idle_wait_s=0.01).start()

    async def read(stream, n_items=None):
        text, n_tokens, items = "", 0, 0
        while n_items is None or items < n_items:
            item = await stream.next(10)
            if isinstance(item, Finished):
                return text, n_tokens, item
            text, n_tokens, items = text + item.text, n_tokens + item.n_tokens, items + 1
        return text, n_tokens, None

    async def main():
        done = await read(loop.submit(ids("a"), SamplingParams(stop=("STOP",))))
        dropped = loop.submit(ids("b"), SamplingParams(max_tokens=16))
        first = await read(dropped, 1)
        loop.abort(dropped)
        return done, first, await read(dropped)

    try:
        (text, n, end), (first_text, _, _), (_, _, dropped_end) = asyncio.run(main())
    finally:
        loop.stop()
    assert (text, n, end.reason) == ("hello ", len("hello STOP"), "stop")  # the server decodes nothing
    assert first_text.startswith("a") and dropped_end.reason == "abort"
    assert not eng.running and eng.n_free_slots == 2


def test_serve_local_runs_one_micro_batch_unless_told_otherwise():
    """One stage has no other stage to overlap: `--local` steps every running sequence as one batch."""
    from moeray.cluster.cli import build_parser
    from moeray.cluster.commands.serve import options_from_args

    def engine_of(*flags):
        argv = ["serve", *flags]
        return options_from_args(build_parser(argv)[0].parse_args(argv)).engine

    assert engine_of("--local").micro_batches == 1
    assert engine_of("--local", "--micro-batches", "2").micro_batches == 2
    # A pipeline keeps the config's default (the test above: serve's flags give EngineConfig()).
