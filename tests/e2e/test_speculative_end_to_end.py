"""Speculative decoding end to end: on the embedded default model under a JSON grammar (log-
probabilities as a plain decode's) and a reasoning budget, served per request by `moeray serve --local` with its counters in
/v1/stages and Prometheus, and a draft model and GLM's next-token-prediction layer across Ray stages.
The rules, the drafters and every family's tiny model in one process: tests/cluster/test_speculative.py."""
from __future__ import annotations

import pytest

from moeray.cluster.config import EngineConfig
from moeray.cluster.engine import Engine
from moeray.cluster.local_pipeline import LocalPipeline
from moeray.stages.runtime.model import load_model
from moeray.stages.text.sampling import SamplingParams
from test_speculative import NoisyOracle, check_ledger, glm_mtp, prompts_for, run_checked  # noqa: F401 (a fixture)


def test_logprobs_and_a_grammar_are_the_plain_decodes(default_model_path):
    """The default model re-formatting JSON under a JSON grammar, greedy and sampled with a seed per
    request: a verify row applies the grammar's mask at every position (a drafted token it forbids is
    refused), and reports each verified token's log-probabilities as a plain decode does."""
    pytest.importorskip("llguidance")
    from moeray.stages.text.grammar import json_grammar
    from moeray.stages.text.tokenizer import Tokenizer

    model = load_model(default_model_path)
    tok = Tokenizer.from_metadata(model.gguf.metadata, source=model.gguf.path)
    text = 'Rewrite as JSON with the same keys: {"name": "Ada", "langs": ["en", "fr"], "age": 36}\n{"name":'
    prompt = tok.encode(text)
    grammar = json_grammar({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                            "required": ["name", "age"], "additionalProperties": False})

    def run(mode, params, drafter=None):
        eng = Engine(LocalPipeline.from_model(model, 32, 1), EngineConfig(max_seqs=1, max_len=512, micro_batches=1,
                                                                         speculative=mode), tok)
        if drafter is not None:
            eng.speculation.new_drafter = drafter
            eng.speculation.PROBE = 1.0
        reqs = run_checked(eng, [prompt], params)
        return reqs[0], eng

    greedy = SamplingParams(max_tokens=24, grammar=grammar, logprobs=2)
    plain, _ = run("off", greedy)
    refs = {tuple(prompt): plain.output}
    spec, eng = run("auto", greedy, lambda toks: NoisyOracle(refs, toks, wrong=0.3, vocab=49152))
    assert spec.output == plain.output and spec.text == plain.text
    assert eng.speculation.stats.accepted_tokens > 0 and eng.speculation.stats.accepted_tokens < \
        eng.speculation.stats.drafted_tokens
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    # sampled: every token stays inside the grammar (a drafted token it forbids is never taken)
    import json
    sampled, eng = run("auto", SamplingParams(max_tokens=40, grammar=grammar, temperature=0.9, seed=3),
                       lambda toks: NoisyOracle(refs, toks, wrong=0.5, vocab=49152))
    assert eng.speculation.stats.verify_rows > 0
    if sampled.finish_reason == "stop":
        obj = json.loads(sampled.text)
        assert set(obj) == {"name", "age"}


@pytest.mark.slow
def test_a_reasoning_budget_closes_the_thinking_at_the_same_token_in_verify_rows(default_model_path):
    """The default model left inside <think> with a budget of 5 tokens: a plain decode writes 5 tokens,
    then the closer's tokens (forced), then goes on; verify rows whose drafts are often wrong give the
    same tokens (a drafted token other than the forced one is refused at its position)."""
    from moeray.stages.text.reasoning_budget import ReasoningBudget
    from moeray.stages.text.tokenizer import Tokenizer

    model = load_model(default_model_path)
    tok = Tokenizer.from_metadata(model.gguf.metadata, source=model.gguf.path)
    prompt = tok.encode("<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n<think>\n")
    forced = tuple(tok.encode("\n</think>\n\n", add_bos=False))
    budget = ReasoningBudget(5, "<think>", "</think>", forced, inside=True)
    params = SamplingParams(max_tokens=16, ignore_eos=True, reasoning=budget)

    def run(mode, drafter=None):
        eng = Engine(LocalPipeline.from_model(model, 32, 1), EngineConfig(max_seqs=1, max_len=512, micro_batches=1,
                                                                         speculative=mode), tok)
        if drafter is not None:
            eng.speculation.new_drafter = drafter
            eng.speculation.PROBE = 1.0
        return run_checked(eng, [prompt], params)[0], eng

    plain, _ = run("off")
    assert plain.output[5:5 + len(forced)] == list(forced) and "</think>" not in tok.decode(plain.output[:5])
    refs = {tuple(prompt): plain.output}
    spec, eng = run("auto", lambda toks: NoisyOracle(refs, toks, wrong=0.3, vocab=49152))
    assert spec.output == plain.output
    assert 0 < eng.speculation.stats.accepted_tokens < eng.speculation.stats.drafted_tokens


def test_served_speculation_per_request_with_its_counters_in_stages_and_prometheus(default_model_path):
    """`moeray serve --local --speculative off`: a request that asks `speculative: true` drafts (the
    n-gram drafter on a prompt the answer repeats) and gets the very text it gets without; /v1/stages
    and Prometheus count the verify rows, drafted and accepted tokens; a non-boolean flag is a 400."""
    import json
    import re
    import time
    import urllib.error
    import urllib.request

    pytest.importorskip("ray")
    from serve_process import start_serve

    from moeray.stages.runtime.transport import free_port

    metrics_port = free_port()
    server = start_serve([str(default_model_path), "--local", "--max-seqs", "2", "--max-len", "1024",
                          "--speculative", "off", "--model-name", "m", "--metrics-export-port", str(metrics_port),
                          "--ready-timeout", "240"], free_port())

    def post(body):
        req = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def stages():
        with urllib.request.urlopen(server.url + "/v1/stages", timeout=60) as r:
            return json.loads(r.read())["speculation"]

    text = ("Repeat this list exactly: apples, pears, plums, cherries, apricots, peaches, grapes, figs, dates, "
            "lemons, limes, oranges.")
    ask = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 48, "temperature": 0}
    try:
        status, plain = post(ask)
        assert status == 200 and stages()["verify_rows"] == 0  # the server's default: off
        status, spec = post({**ask, "speculative": True})
        assert status == 200
        assert spec["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
        s = stages()
        assert s["mode"] == "off" and s["verify_rows"] > 0 and 0 < s["accepted_tokens"] <= s["drafted_tokens"]
        status, bad = post({**ask, "speculative": "yes"})
        assert status == 400 and "speculative" in json.dumps(bad)
        deadline, seen = time.monotonic() + 30, None  # Ray exports metrics every few seconds: poll
        while time.monotonic() < deadline and seen != s["accepted_tokens"]:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
                found = re.search(r'^ray_moeray_spec_accepted_tokens_total\{[^}]*model="m"[^}]*\} (\S+)$',
                                  r.read().decode(), re.M)
            seen = float(found.group(1)) if found else None
            if seen != s["accepted_tokens"]:
                time.sleep(1)
        assert seen == s["accepted_tokens"]
    finally:
        server.stop()


@pytest.mark.slow
def test_a_draft_model_across_ray_stages(tmp_path):
    """`--draft` over three Ray stages: the draft model on stage 0 (priced there as trunk, said in a
    line), its tokens carried in the status row to the last stage; the target as its own draft,
    so every draft is kept, and the greedy tokens are the one-process ones."""
    ray = pytest.importorskip("ray")
    from greedy import one_process_greedy
    from moeray.cluster.config import LaunchOptions
    from moeray.cluster.driver import launch
    from test_gguf_file import tiny_config, write_synthetic_gguf

    path = str(write_synthetic_gguf(tmp_path / "t.gguf", tiny_config("qwen3moe"), seed=5))
    prompts = prompts_for(3, seed=4)
    prompts = [[t % 160 for t in p] for p in prompts]
    reference = one_process_greedy(load_model(path), prompts, 12, 64)
    lines = []
    opts = LaunchOptions(3, simulate=[64 << 20] * 3, torch_threads=1, timeout_s=180, draft=path)
    launched = launch(path, opts, EngineConfig(max_seqs=3, max_len=64), log=lines.append)
    try:
        assert any(l.startswith("draft model t.gguf:") and "on stage 0" in l for l in lines), lines
        assert any(k.startswith("draft model") for k in launched.stage_stats()[0].placed)
        eng = Engine(launched.pipeline(), EngineConfig(max_seqs=3, max_len=64, micro_batches=2, speculative="draft"))
        eng.speculation.PROBE = 1.0
        reqs = [eng.add(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
        while not all(r.done for r in reqs):
            eng.step()
            check_ledger(eng)
        assert [r.output for r in reqs] == reference
        s = eng.speculation.stats
        assert s.verify_rows > 0 and s.accepted_tokens == s.drafted_tokens
    finally:
        launched.shutdown()
        ray.shutdown()


@pytest.mark.slow
def test_mtp_across_ray_stages(glm_mtp):
    """`--speculative mtp` over two Ray stages: the last stage loads the nextn layer (charged there),
    gets the token ids it reads, and its proposals drive the verify rows; the greedy tokens are the
    one-process ones."""
    ray = pytest.importorskip("ray")
    from greedy import one_process_greedy
    from moeray.cluster.config import LaunchOptions
    from moeray.cluster.driver import launch

    path, _, _ = glm_mtp
    prompts = prompts_for(2, seed=6)
    reference = one_process_greedy(load_model(path), prompts, 10, 64)
    engine_cfg = EngineConfig(max_seqs=2, max_len=64, micro_batches=2, speculative="mtp")
    launched = launch(str(path), LaunchOptions(2, simulate=[96 << 20] * 2, torch_threads=1, timeout_s=180),
                      engine_cfg, log=lambda _: None)
    try:
        assert any(k.startswith("next-token-prediction layer") for k in launched.stage_stats()[-1].placed)
        eng = Engine(launched.pipeline(), engine_cfg)
        eng.speculation.PROBE = 1.0
        reqs = [eng.add(p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in prompts]
        while not all(r.done for r in reqs):
            eng.step()
            check_ledger(eng)
        assert [r.output for r in reqs] == reference
        assert eng.speculation.stats.by_drafter["mtp"].rows > 0
    finally:
        launched.shutdown()
        ray.shutdown()
