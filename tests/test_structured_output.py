"""Structured output, tool calls and log-probabilities without Ray: the grammar mask on the embedded
default model in one process (the engine `moeray generate` runs), the Hermes tool-call parser on
text, and the real FastAPI app over a one-process pipeline of a tiny GGUF whose chat template
renders tools (tests/tool_model.py). The same features through the real `moeray serve` are in
tests/test_serve_api.py."""
from __future__ import annotations

import json

import jsonschema
import pytest

from moeray.cluster.tools import ToolCallStream, parse_tool_calls
from moeray.stages.sampling import SamplingParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]}},
                   "required": ["city"], "additionalProperties": False}}}


# ---------------------------------------------------------------- the parser, on text


def test_tool_calls_are_parsed_out_of_text_and_malformed_blocks_stay_text():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_weather", {"city": "Lima"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    broken = 'x <tool_call>{"name": get_weather}</tool_call>'
    assert parse_tool_calls(broken) == (broken, [])  # nothing the model wrote is dropped
    assert parse_tool_calls("no calls here") == ("no calls here", [])


def test_streamed_content_is_held_back_from_where_a_tool_call_may_start():
    s = ToolCallStream()
    out = [s.push(d) for d in ["Sure", " <to", "ol_call>\n{\"name\": \"f\", ", "\"arguments\": {}}\n</tool_call>"]]
    assert out == ["Sure", " ", "", ""]  # "<to" could start a call: held, never released as content
    rest, calls = s.finish()
    assert rest == "" and [(c.name, c.arguments) for c in calls] == [("f", "{}")]
    s = ToolCallStream()
    assert [s.push(d) for d in ["a <t", "able>"]] == ["a ", "<table>"]  # not a call after all: released
    assert s.finish() == ("", [])


# ---------------------------------------------------------------- the grammar mask, one process


@pytest.fixture(scope="module")
def default_generator(default_model_path):
    from moeray.cluster.engine import Generator
    from moeray.stages.model import load_model
    from moeray.stages.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_model_path)
    return Generator(load_model(default_model_path), tok), tok


def test_json_schema_output_parses_and_validates_greedy_and_sampled_and_ends_by_itself(default_generator):
    from moeray.stages.grammar import json_grammar

    gen, tok = default_generator
    prompt = tok.encode_chat([{"role": "user", "content": "Describe a person as JSON with a name and an age."}])
    grammar = json_grammar(PERSON)
    params = [SamplingParams(max_tokens=32, grammar=grammar),
              SamplingParams(max_tokens=32, grammar=grammar, temperature=1.0, seed=11),
              SamplingParams(max_tokens=4, grammar=grammar),
              SamplingParams(max_tokens=6)]  # one batch: the grammar is per sequence
    greedy, sampled, short, free = gen.generate([prompt] * 4, params)
    for c in (greedy, sampled):
        assert c.finish_reason == "stop", c.text  # the grammar completed, then only the end token was allowed
        assert c.token_ids[-1] in tok.end_ids
        jsonschema.validate(json.loads(c.text), PERSON)
    assert greedy.text != sampled.text
    # Unconstrained, the same model (same batch) answers in prose, not bare JSON:
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.text)
    # max_tokens still wins over an unfinished grammar: "length", and the text is a valid prefix.
    assert short.finish_reason == "length" and len(short.token_ids) == 4
    assert greedy.text.startswith(short.text)


def test_moeray_generate_json_schema_flag(default_model_path, tmp_path, capsys):
    import subprocess
    import sys

    from moeray.cluster.cli import main

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    cmd = [sys.executable, "-m", "moeray.cluster.cli", "generate", str(default_model_path), "--chat",
           "--prompt", "What is the capital of France? Answer as JSON.", "--max-tokens", "20"]
    r = subprocess.run(cmd + ["--json-schema", str(tmp_path / "s.json")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), schema)
    assert main(cmd[3:] + ["--json-schema", '{"type": "nonsense"}']) == 2  # checked before the model loads
    assert "moeray generate: error: --json-schema: Invalid type: nonsense" in capsys.readouterr().err


# ---------------------------------------------------------------- tools through the app, one process


@pytest.fixture(scope="module")
def tool_app(tmp_path_factory):
    from fastapi.testclient import TestClient

    from moeray.cluster.config import EngineConfig, ServeOptions
    from moeray.cluster.serve_app import Service, build_app
    from tool_model import write_tool_model

    path = write_tool_model(tmp_path_factory.mktemp("tools") / "tools.gguf")
    service = Service(ServeOptions(model=str(path), model_name="tools", local=True,
                                   engine=EngineConfig(max_seqs=4, max_len=1024)), log=None)
    try:
        yield TestClient(build_app(service)), service
    finally:
        service.close()


MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat(client, **body):
    r = client.post("/v1/chat/completions", json={"model": "tools", "messages": MSGS, "max_tokens": 60, **body})
    return r.status_code, r.json()


def stream(client, **body) -> list[dict]:
    r = client.post("/v1/chat/completions", json={"model": "tools", "messages": MSGS, "max_tokens": 60,
                                                  "stream": True, **body})
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_the_template_receives_the_tools(tool_app):
    _, service = tool_app
    prompt = service.tokenizer.apply_chat_template(MSGS, tools=[WEATHER])
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    # An earlier call and its result render as the template writes them (arguments as an object).
    from moeray.cluster.tools import template_messages

    history = template_messages(MSGS + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    text = service.tokenizer.apply_chat_template(history, tools=[WEATHER])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


def test_required_and_named_tool_choice_give_openai_tool_calls_streamed_and_not(tool_app):
    client, _ = tool_app
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        status, body = chat(client, tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False)
        assert status == 200, body
        c = body["choices"][0]
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
        (call,) = c["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_") and set(call) == {"id", "type", "function"}
        assert call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
        chunks = stream(client, tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False)
        deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
        assert "".join(d.get("content") or "" for d in deltas) == ""  # the call never leaks as content
        (streamed,) = [t for d in deltas for t in (d.get("tool_calls") or [])]
        assert streamed["index"] == 0 and streamed["function"] == call["function"]
        assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"][0]["finish_reason"]] == ["tool_calls"]


def test_auto_tools_on_a_random_model_return_its_text_and_bad_tool_requests_are_400(tool_app):
    client, _ = tool_app
    status, body = chat(client, tools=[WEATHER], max_tokens=8)  # tool_choice auto: no call in random text
    assert status == 200 and body["choices"][0]["message"]["tool_calls"] is None
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["message"]["content"]
    status, body = chat(client, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert status == 400 and body["error"]["param"] == "tool_choice" and "nope" in body["error"]["message"]
    status, body = chat(client, tool_choice="required")
    assert status == 400 and body["error"]["param"] == "tool_choice"
    status, body = chat(client, tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    assert status == 400 and body["error"]["param"] == "response_format"
