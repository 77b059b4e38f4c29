"""The sampling fields, `n` and streamed usage over HTTP, and a huge prompt refused without holding
anyone up: the HTTP app and the engine of `moeray serve --local` in this process (cluster/
local_server.py, the default model), so a test can watch the tokenizer. What each field computes is
tests/stages/test_sampling.py's (against a direct computation) and tests/cluster/test_sampling_engine.py's
(through the engine); here: each reaches the sampler, a bad value is a 400 naming it, `n` choices
share the prompt's KV blocks and each has its own seed, usage comes once."""
from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from moeray.stages.runtime.transport import free_port

MODEL = "m"
MAX_SEQS = 4


@pytest.fixture(scope="module")
def server(default_model_path):
    from moeray.cluster.config import EngineConfig, ServeOptions
    from moeray.cluster.local_server import LocalServer

    opts = ServeOptions(model=str(default_model_path), model_name=MODEL, local=True, metrics=False,
                        engine=EngineConfig(max_seqs=MAX_SEQS, max_len=512))
    srv = LocalServer(opts, "127.0.0.1", free_port(), ready_timeout_s=240)
    srv.url = f"http://127.0.0.1:{srv.server.config.port}"
    yield srv
    srv.close()


def post(server, path: str, body: dict, timeout: float = 120):
    """(status, parsed body) of a POST; an SSE body comes back as its list of data payloads."""
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
            if r.headers["content-type"].startswith("text/event-stream"):
                return r.status, [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
            return r.status, json.loads(raw)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def complete(server, prompt: str, **kw) -> dict:
    status, body = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 8, **kw})
    assert status == 200, body
    return body


def text(server, prompt: str, **kw) -> str:
    return complete(server, prompt, **kw)["choices"][0]["text"]


def chunks(events: list[str]) -> list[dict]:
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


# ---------------------------------------------------------------- out of range: a 400 naming it


@pytest.mark.parametrize("field,value", [
    ("top_k", -2), ("top_k", 1.5), ("min_p", 1.5), ("min_p", -0.1), ("repetition_penalty", 0),
    ("repetition_penalty", -1), ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("frequency_penalty", 3),
    ("frequency_penalty", "1"), ("logit_bias", {"x": 1}), ("logit_bias", {"-5": 1}), ("logit_bias", {"12": 101}),
    ("logit_bias", {"12": -100.5}), ("logit_bias", {"49152": 1}), ("logit_bias", [1]), ("n", 0), ("n", 129),
    ("n", MAX_SEQS + 1),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_value_out_of_range_is_a_400_naming_it(server, path, field, value):
    body = {"model": MODEL, "max_tokens": 2, field: value}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    status, data = post(server, path, body)
    assert status == 400, data
    err = data["error"]
    assert err["param"].split(".")[0] == field and field in err["message"] and err["type"] == "invalid_request_error"


def test_the_edges_of_each_range_are_served(server):
    body = complete(server, "The capital of France is", max_tokens=2, top_k=-1, min_p=0, repetition_penalty=1e-3,
                    presence_penalty=-2, frequency_penalty=2, logit_bias={"0": -100, "49151": 100})
    assert body["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------- each field reaches the sampler


def test_each_field_changes_what_is_sampled(server):
    prompt = "The capital of France is"
    greedy = complete(server, prompt, logprobs=0)
    plain = greedy["choices"][0]["text"]
    first = greedy["choices"][0]["logprobs"]["tokens"][0]
    tok = server.service.tokenizer
    (first_id,) = tok.encode(first, add_bos=False)
    # logit_bias: +100 pins a token, -100 forbids the one greedy took
    assert text(server, prompt, max_tokens=4, logit_bias={"42": 100}) == tok.decode([42] * 4)
    assert not text(server, prompt, logit_bias={str(first_id): -100}).startswith(first)
    # min_p = 1 keeps only the likeliest token, top_k = 1 too: sampling at any temperature is greedy
    assert text(server, prompt, temperature=1.5, min_p=1, seed=1) == plain
    assert text(server, prompt, temperature=1.5, top_k=1, seed=1) == plain
    assert text(server, prompt, temperature=1.5, seed=1, max_tokens=16) != plain  # it does sample otherwise
    # the penalties: a prompt that invites repeating, greedy; each penalty breaks the repetition
    loop = "a b a b a b a b a b"

    def tokens(**kw) -> list[str]:
        return complete(server, loop, max_tokens=8, logprobs=0, **kw)["choices"][0]["logprobs"]["tokens"]

    assert tokens() == [" a", " b"] * 4
    for field, value in (("repetition_penalty", 3.0), ("presence_penalty", 2.0), ("frequency_penalty", 2.0)):
        got = tokens(**{field: value})
        assert got.count(" a") <= 1 and got.count(" b") <= 1, (field, got)


def test_seeds_still_repeat_with_every_field_set(server):
    kw = dict(max_tokens=12, temperature=1.0, seed=1234, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.2,
              presence_penalty=0.5, frequency_penalty=0.3, logit_bias={"30": 2})
    a, b = text(server, "Once upon a time", **kw), text(server, "Once upon a time", **kw)
    assert a == b and a


# ---------------------------------------------------------------- n choices


def test_n_choices_share_the_prompt_blocks_and_each_has_its_own_seed(server):
    prompt = ("Words for the n-choices test: river, lantern, copper, meadow, violin, harbor, thunder, orchard, "
              "glacier, saddle, pepper, canyon. A sentence using some of them:")  # ~40 tokens
    n_prompt = len(server.service.tokenizer.encode(prompt))
    kv = server.service.kv_report
    before = kv()
    body = complete(server, prompt, n=3, temperature=1.3, seed=77, max_tokens=10)
    after = kv()
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    texts = [c["text"] for c in choices]
    assert len(set(texts)) == 3  # three seed streams: 77, 78, 79
    assert texts[0] == text(server, prompt, temperature=1.3, seed=77, max_tokens=10)  # choice 0 is seed 77 itself
    assert texts[2] == text(server, prompt, temperature=1.3, seed=79, max_tokens=10)  # choice i is seed + i
    usage = body["usage"]
    assert usage["prompt_tokens"] == n_prompt  # the prompt counted once, as OpenAI does
    assert usage["completion_tokens"] == 30 and usage["total_tokens"] == n_prompt + 30
    # The prompt ran once: the other two choices took its full KV blocks from the first one.
    assert after["prompt_tokens"] - before["prompt_tokens"] == 3 * n_prompt
    assert after["cached_tokens"] - before["cached_tokens"] >= 2 * (n_prompt // 16) * 16 > 0


def test_n_choices_stream_with_their_index_and_a_finish_each(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 6,
            "temperature": 1.0, "seed": 5, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    status, events = post(server, "/v1/chat/completions", body)
    assert status == 200
    got = chunks(events)
    streamed = {0: "", 1: ""}
    finishes = {0: [], 1: []}
    for c in got[:-1]:
        (choice,) = c["choices"]
        streamed[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finishes[choice["index"]].append(choice["finish_reason"])
    assert all(len(f) == 1 for f in finishes.values()), finishes
    whole = post(server, "/v1/chat/completions", {**body, "stream": False, "stream_options": None})[1]
    assert [streamed[0], streamed[1]] == [c["message"]["content"] for c in whole["choices"]]
    assert got[-1]["choices"] == []
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: the second run found the prompt
    assert [got[-1]["usage"][k] for k in counts] == [whole["usage"][k] for k in counts]


# ---------------------------------------------------------------- usage, once


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_usage_comes_once_on_the_last_chunk_and_only_when_asked(server, path):
    body = {"model": MODEL, "max_tokens": 5, "stream": True}
    body.update({"prompt": "Hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]})
    asked = chunks(post(server, path, {**body, "stream_options": {"include_usage": True}})[1])
    with_usage = [c for c in asked if c.get("usage")]
    assert with_usage == [asked[-1]] and asked[-1]["choices"] == []
    assert asked[-1]["usage"]["completion_tokens"] == 5
    plain = chunks(post(server, path, body)[1])
    assert not [c for c in plain if c.get("usage")]
    assert plain[-1]["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------- a huge prompt holds nobody up


def test_a_huge_prompt_is_refused_untokenized_while_a_small_request_is_served(server, monkeypatch):
    """A 12 MB conversation: its rendering is held at a latch until a small request sent after it has
    been answered. Rendering on the event loop (or the engine thread) would block the small one behind
    the latch, which then gives up after its bound: the small one must finish while the big one is
    still inside its rendering. The big one is then refused without ever reaching the tokenizer."""
    tok = server.service.tokenizer
    big_text = "word " * 2_400_000
    entered, release = threading.Event(), threading.Event()
    encoded: list[int] = []
    real_render, real_encode = tok.apply_chat_template, tok.encode
    held = {}

    def render(messages, **kw):
        if len(messages[-1]["content"]) > 1_000_000:
            entered.set()
            held["released"] = release.wait(120)  # False: nobody released it, the bound ran out
        return real_render(messages, **kw)

    def encode(text, *a, **kw):
        encoded.append(len(text))
        return real_encode(text, *a, **kw)

    monkeypatch.setattr(tok, "apply_chat_template", render)
    monkeypatch.setattr(tok, "encode", encode)
    results = {}
    big = threading.Thread(target=lambda: results.update(big=post(
        server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": big_text}]},
        timeout=300)))
    big.start()
    assert entered.wait(120), "the huge request never reached its rendering"
    try:
        results["small"] = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 3},
                                timeout=100)
    finally:
        small_done_while_held = not held  # the big one is still inside its rendering
        release.set()
        big.join(300)
    assert small_done_while_held and results["small"][0] == 200, results["small"]
    assert held["released"] is True
    status, data = results["big"]
    assert status == 400 and data["error"]["code"] == "context_length_exceeded", data
    assert data["error"]["param"] == "messages" and "at least" in data["error"]["message"]
    assert max(encoded) < 1_000_000  # the small prompt was tokenized; the 12 MB one never was


def test_a_prompt_just_over_the_context_is_counted_and_refused(server):
    status, data = post(server, "/v1/completions", {"model": MODEL, "prompt": "word " * 600})
    assert status == 400 and data["error"]["code"] == "context_length_exceeded"
    assert "the prompt has 6" in data["error"]["message"]  # tokenized: its bytes could not rule it out
