"""Structured output and tool calls: the grammar mask on the embedded default model in one process
(`moeray generate --json-schema`, the engine `moeray serve` runs), and tools through the real `moeray serve --local` on a tiny GGUF whose chat template renders
them (tests/tool_model.py). Log-probabilities, response_format over Ray stages and the 400 for a
tool schema the grammar engine refuses are in tests/e2e/test_serve_api.py (its server runs the
default model); every family's chat format, its parser and its forced calls in
tests/stages/test_chat_formats.py, and forced calls on the default model under every family's
template in tests/e2e/test_forced_calls.py."""
from __future__ import annotations

import json

import jsonschema
import pytest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]}},
                   "required": ["city"], "additionalProperties": False}}}


# ---------------------------------------------------------------- the grammar mask, one process


def test_moeray_generate_json_schema_flag(default_model_path, tmp_path, capsys):
    import subprocess
    import sys

    from moeray.cluster.cli import main

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    cmd = [sys.executable, "-m", "moeray.cluster.cli", "generate", str(default_model_path), "--chat",
           "--prompt", "What is the capital of France? Answer as JSON.", "--max-tokens", "20"]
    # Sampled here; greedy, sampled and max_tokens over Ray stages are tests/e2e/test_serve_api.py's (the same
    # StageRunner.sample masks both). The grammar completes, then only the end token is allowed: it stops.
    r = subprocess.run(cmd + ["--json-schema", str(tmp_path / "s.json"), "--temperature", "0.8", "--seed", "11"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), schema)
    assert "decode: " in r.stderr and int(r.stderr.split("decode: ")[1].split()[0]) < 19  # ended before max_tokens
    assert main(cmd[3:] + ["--json-schema", '{"type": "nonsense"}']) == 2  # checked before the model loads
    assert "moeray generate: error: --json-schema: Invalid type: nonsense" in capsys.readouterr().err


# ---------------------------------------------------------------- tools through `moeray serve --local`


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """`moeray serve TOOLS.gguf --local` as a user starts it (the whole model and the HTTP server in one process)."""
    openai = pytest.importorskip("openai")
    from serve_process import start_serve
    from tool_model import write_tool_model

    from moeray.stages.runtime.transport import free_port

    path = write_tool_model(tmp_path_factory.mktemp("tools") / "tools.gguf")
    server = start_serve([str(path), "--local", "--max-seqs", "4", "--max-len", "1024", "--model-name", "tools",
                          "--metrics-export-port", str(free_port()), "--ready-timeout", "240"], free_port())
    try:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120), server.url, path
    finally:
        server.stop()


MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


def post(url: str, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_template_receives_the_tools(tool_server):
    from moeray.stages.text.chat import chat_format, template_renders_tools
    from moeray.stages.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(tool_server[2])
    assert template_renders_tools(tok)
    fmt = chat_format(tok.chat_template)
    assert fmt.name == "hermes"
    prompt = fmt.render(tok, MSGS, [WEATHER]).prompt
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    # An earlier call and its result render as the template writes them (arguments as an object).
    history = MSGS + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = fmt.render(tok, history, [WEATHER]).prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    # ... and the server takes such a conversation (prompt tokens: the rendered history).
    status, body = post(tool_server[1], {"model": "tools", "messages": history[:1] + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "tools": [WEATHER], "max_tokens": 2})
    assert status == 200 and body["usage"]["prompt_tokens"] == len(tok.encode(text))


def test_required_and_named_tool_choice_give_openai_tool_calls_streamed_and_not(tool_server):
    client = tool_server[0]
    kw = dict(model="tools", messages=MSGS, max_tokens=60, tools=[WEATHER], parallel_tool_calls=False)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(**kw, tool_choice=choice)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        chunks = list(client.chat.completions.create(**kw, tool_choice=choice, stream=True))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        assert "".join(d.content or "" for d in deltas) == ""  # the call never leaks as content
        first, *fragments = [t for d in deltas for t in (d.tool_calls or [])]
        # OpenAI's shape: the id and name first, then the arguments in fragments (as they are generated)
        assert first.index == 0 and first.id.startswith("call_") and first.function.name == "get_weather"
        assert all(f.index == 0 and f.id is None and f.function.name is None for f in fragments) and fragments
        streamed = first.function.arguments + "".join(f.function.arguments for f in fragments)
        assert streamed == call.function.arguments  # the grammar and greedy: the same call
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["tool_calls"]


def test_auto_tools_on_a_random_model_return_its_text_and_bad_tool_requests_are_400(tool_server):
    url = tool_server[1]
    base = {"model": "tools", "messages": MSGS, "max_tokens": 8}
    status, body = post(url, {**base, "tools": [WEATHER]})  # tool_choice auto: no call in random text
    assert status == 200 and body["choices"][0]["message"]["tool_calls"] is None
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["message"]["content"]
    with_tools = body["usage"]["prompt_tokens"]
    status, body = post(url, {**base, "tools": [WEATHER], "tool_choice": "none"})  # the template gets no tools
    assert status == 200 and body["usage"]["prompt_tokens"] < with_tools and body["choices"][0]["message"]["tool_calls"] is None
    status, body = post(url, {**base, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert status == 400 and body["error"]["param"] == "tool_choice" and "nope" in body["error"]["message"]
    status, body = post(url, {**base, "tool_choice": "required"})
    assert status == 400 and body["error"]["param"] == "tool_choice"
    status, body = post(url, {**base, "tools": [WEATHER], "tool_choice": "required",
                              "response_format": {"type": "json_object"}})
    assert status == 400 and body["error"]["param"] == "response_format"
