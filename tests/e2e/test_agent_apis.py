"""The APIs coding agents speak, through their own SDKs: `anthropic` on POST /v1/messages (forced
tool_use, the tool_result turn, streaming with usage, count_tokens), `openai` on POST /v1/responses
(a forced function_call, its output turn, streaming, previous_response_id and the store) and the
OpenAI Agents SDK's tool loop, each against `moeray serve` on Ray stages and `--local`.

The model is the tiny Qwen3 of tests/chat_models.py, which learned one tool loop in its family's
chat format through the chat route's messages: the two APIs reach the same template render and the
same reader only if their translation is right, and then the model reasons, calls get_weather for
Paris, and answers from the result exactly as it learned to. One server per mode for the module.
"""
from __future__ import annotations

import asyncio
import http.client
import json

import pytest

from chat_models import ANSWER, FAMILIES, QUESTION, RESULT, THOUGHT_1, THOUGHT_2, WEATHER, family_model

pytestmark = pytest.mark.slow

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

KEY = "agent-key-42"
NAME, ALIAS = "qwen3-tiny", "claude-haiku-4-5"  # an agent's own name for its side calls, served as an alias
STORE = 3  # --responses-store: the eviction test makes more than this
FAMILY = FAMILIES["qwen3"]
CITY = {"city": "Paris"}
TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}  # Anthropic's shape of the same function
FUNCTION = {"type": "function", **WEATHER["function"]}  # the Responses shape


@pytest.fixture(scope="module", params=["local", "ray"])
def server(request):
    """`moeray serve` on the tiny tool-loop model: in one process (--local), or over two Ray stage actors."""
    from serve_process import start_serve

    from moeray.stages.runtime.transport import free_port

    args = [str(family_model(FAMILY)), "--max-seqs", "2", "--max-len", "1024", "--served-model-name", NAME, ALIAS,
            "--api-key", KEY, "--responses-store", str(STORE), "--ready-timeout", "300"]
    if request.param == "local":
        args += ["--local", "--no-metrics"]
    else:
        args += ["--stages", "2", "--simulate-devices", "64MiB,64MiB", "--metrics-export-port", "0"]
    proc = start_serve(args, free_port(), timeout_s=420)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def raw(server, method: str, path: str, body=None, headers=None):
    """(status, parsed body) of a request sent by hand."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request(method, path, body=None if body is None else json.dumps(body),
                 headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, json.loads(data)


# ---------------------------------------------------------------- anthropic


def test_anthropic_forced_tool_use_then_the_tool_result_turn(claude):
    first = [{"role": "user", "content": QUESTION}]
    r = claude.messages.create(model=ALIAS, max_tokens=120, messages=first, tools=[TOOL],
                               tool_choice={"type": "tool", "name": "get_weather"})
    assert r.stop_reason == "tool_use" and r.model == NAME and r.role == "assistant", r
    thinking, call = r.content
    assert thinking.type == "thinking" and thinking.thinking == THOUGHT_1
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == CITY and call.id
    # Anthropic's usage: the prompt is input_tokens plus the part read from the prefix cache
    counted = claude.messages.count_tokens(model=NAME, messages=first, tools=[TOOL]).input_tokens
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == counted and r.usage.output_tokens > 0

    # The client runs the tool and sends the reply it got back with the result: the model answers.
    second = first + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": RESULT}]}]
    r2 = claude.messages.create(model=NAME, max_tokens=120, messages=second, tools=[TOOL])
    assert r2.stop_reason == "end_turn", r2
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in r2.content] == [
        ("thinking", THOUGHT_2), ("text", ANSWER)]
    # the second turn's prompt starts with the first one's: its KV came from the prefix cache
    assert r2.usage.cache_read_input_tokens >= counted - 16, r2.usage
    assert r2.usage.input_tokens + r2.usage.cache_read_input_tokens == claude.messages.count_tokens(
        model=NAME, messages=second, tools=[TOOL]).input_tokens


def test_anthropic_stream_adds_up_to_the_message_with_its_usage(claude):
    kw = dict(model=NAME, max_tokens=120, messages=[{"role": "user", "content": QUESTION}], tools=[TOOL])
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert [b.type for b in final.content] == [b.type for b in whole.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == whole.content[0].thinking == THOUGHT_1
    assert (final.content[1].name, final.content[1].input) == (whole.content[1].name, whole.content[1].input)
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == THOUGHT_1
    assert json.loads("".join(d.partial_json for d in deltas if d.type == "input_json_delta")) == CITY
    assert final.stop_reason == "tool_use"
    (end,) = [e for e in events if e.type == "message_delta"]
    assert end.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_anthropic_stop_sequences_max_tokens_and_errors(claude, server):
    kw = dict(model=NAME, messages=[{"role": "user", "content": QUESTION}], tools=[TOOL])
    r = claude.messages.create(max_tokens=3, **kw)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3
    r = claude.messages.create(max_tokens=120, stop_sequences=["weather in"], **kw)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "weather in", r
    # max_tokens far beyond the context (as agents send it) is capped to the room the prompt leaves
    assert claude.messages.create(max_tokens=64000, **kw).stop_reason == "tool_use"

    with pytest.raises(anthropic.NotFoundError) as exc:
        claude.messages.create(model="no-such-model", max_tokens=8, messages=kw["messages"])
    assert exc.value.body["error"]["type"] == "not_found_error" and "--any-model" in exc.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as exc:
        claude.messages.create(max_tokens=8, model=NAME, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert "text only" in exc.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(max_tokens=8, **kw)
    # by hand: Anthropic's error shape, an unknown field named, x-api-key and anthropic-version taken
    status, body = raw(server, "POST", "/v1/messages", {**kw, "max_tokens": 8, "tools": [TOOL], "top_n": 2},
                       {"x-api-key": KEY, "anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14"})
    assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "top_n" in body["error"]["message"]


# ---------------------------------------------------------------- the Responses API


def test_responses_forced_function_call_then_its_output_turn(oai):
    r = oai.responses.create(model=NAME, input=QUESTION, tools=[FUNCTION], max_output_tokens=120,
                             tool_choice={"type": "function", "name": "get_weather"})
    assert r.status == "completed" and r.model == NAME
    reasoning, call = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == THOUGHT_1
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == CITY
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0

    output = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
    # continued from the stored response: its conversation and output come first
    r2 = oai.responses.create(model=NAME, previous_response_id=r.id, input=[output], tools=[FUNCTION],
                              max_output_tokens=120)
    assert r2.output_text == ANSWER and r2.previous_response_id == r.id
    assert r2.output[0].type == "reasoning" and r2.output[0].content[0].text == THOUGHT_2
    assert r2.usage.input_tokens_details.cached_tokens > 0  # the first turn's KV, from the prefix cache
    # ... and as a client that keeps no store sends it (Codex): every item again, store false
    items = [{"role": "user", "content": QUESTION}] + [i.model_dump(exclude_none=True) for i in r.output] + [output]
    r3 = oai.responses.create(model=NAME, input=items, tools=[FUNCTION], max_output_tokens=120, store=False,
                              include=["reasoning.encrypted_content"])
    assert r3.output_text == ANSWER
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r3.id)


def test_responses_stream_adds_up_to_the_response(oai):
    kw = dict(model=NAME, input=QUESTION, tools=[FUNCTION], max_output_tokens=120)
    whole = oai.responses.create(**kw)
    events = list(oai.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed", kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT_1
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == CITY
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == [i.type for i in whole.output] == ["reasoning", "function_call"]
    final = events[-1].response
    assert final.output[1].arguments == whole.output[1].arguments and final.usage.output_tokens == whole.usage.output_tokens
    assert oai.responses.retrieve(final.id).output[1].call_id == final.output[1].call_id

    cut = list(oai.responses.create(model=NAME, input=QUESTION, max_output_tokens=4, stream=True))
    assert cut[-1].type == "response.incomplete" and cut[-1].response.incomplete_details.reason == "max_output_tokens"


def test_responses_store_keeps_the_last_ones_and_404s_the_evicted(oai, server):
    first = oai.responses.create(model=NAME, input=QUESTION, max_output_tokens=4)
    assert oai.responses.retrieve(first.id).output_text == first.output_text
    later = [oai.responses.create(model=NAME, input=QUESTION, max_output_tokens=2).id for _ in range(STORE)]
    with pytest.raises(openai.NotFoundError) as exc:
        oai.responses.retrieve(first.id)
    assert "evicted" in exc.value.body["message"] and "--responses-store" in exc.value.body["message"]
    with pytest.raises(openai.NotFoundError) as exc:
        oai.responses.create(model=NAME, input="and now?", previous_response_id=first.id, max_output_tokens=2)
    assert exc.value.body["param"] == "previous_response_id"
    oai.responses.delete(later[-1])
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(later[-1])
    # other tool types are a 400 naming them; unknown fields too (OpenAI's error shape)
    status, body = raw(server, "POST", "/v1/responses", {"model": NAME, "input": "hi", "tools": [
        {"type": "web_search"}]}, {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and body["error"]["param"] == "tools[0].type" and "web_search" in body["error"]["message"]


def test_the_agents_sdk_tool_loop(server):
    """The OpenAI Agents SDK runs its loop on the Responses API: the model calls the tool, the SDK
    runs it and sends its output back with the conversation, and the model answers from it."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    async def get_weather(_ctx, arguments: str) -> str:
        calls.append(json.loads(arguments))
        return RESULT

    tool = agents.FunctionTool(name="get_weather", description=WEATHER["function"]["description"],
                               params_json_schema=WEATHER["function"]["parameters"], on_invoke_tool=get_weather)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    agent = agents.Agent(name="weather", tools=[tool], model=agents.OpenAIResponsesModel(model=NAME, openai_client=client),
                         model_settings=agents.ModelSettings(max_tokens=120))
    result = asyncio.run(agents.Runner.run(agent, QUESTION, max_turns=4))
    assert calls == [CITY]
    assert result.final_output == ANSWER
    kinds = [type(i).__name__ for i in result.new_items]
    assert kinds == ["ReasoningItem", "ToolCallItem", "ToolCallOutputItem", "ReasoningItem", "MessageOutputItem"], kinds


# ---------------------------------------------------------------- names and tokens


def test_model_names_and_tokenize(server, claude):
    status, models = raw(server, "GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert [m["id"] for m in models["data"]] == [NAME, ALIAS]
    messages = [{"role": "user", "content": QUESTION}]
    status, tok = raw(server, "POST", "/tokenize", {"model": ALIAS, "messages": messages, "tools": [WEATHER]},
                      {"x-api-key": KEY})
    assert status == 200 and tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 1024
    # the tokens the chat path runs: what count_tokens counts for the same conversation
    assert tok["count"] == claude.messages.count_tokens(model=NAME, messages=messages, tools=[TOOL]).input_tokens
    status, text = raw(server, "POST", "/detokenize", {"tokens": tok["tokens"]}, {"x-api-key": KEY})
    assert status == 200 and QUESTION in text["prompt"] and "get_weather" in text["prompt"]
    status, body = raw(server, "POST", "/tokenize", {"prompt": QUESTION, "return_token_strs": True}, {"x-api-key": KEY})
    assert "".join(body["token_strs"]).endswith(QUESTION[-6:]) and body["count"] == len(body["tokens"])
    assert raw(server, "POST", "/tokenize", {"prompt": QUESTION})[0] == 401  # the key guards it too
