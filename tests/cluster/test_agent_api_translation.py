"""The agent APIs' translations onto the chat route's request, without a server: Anthropic's Messages
and OpenAI's Responses requests become the chat messages an OpenAI client would have sent for the
same conversation (tests/chat_models.py's tool loop), thinking settings become a budget and the
family's switch, and fields outside each API are 400s naming them. The served round trips are
tests/e2e/test_agent_apis.py."""
from __future__ import annotations

import json
import logging

import pytest

from chat_models import FAMILIES, QUESTION, RESULT, THOUGHT_1, WEATHER, tool_loop

from moeray.cluster import api_anthropic as an
from moeray.cluster import api_responses as rs
from moeray.cluster import chat_edge as edge
from moeray.cluster import openai_schema as oa
from moeray.cluster.serve_app import APIError

TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}
CALL_ID = "call_0"


def messages_request(**kw) -> an.MessagesRequest:
    return an.MessagesRequest.model_validate({"model": "m", "max_tokens": 16, **kw})


def chat_of(request) -> list[dict]:
    """The chat messages as the chat route hands them to the template (serve_app.chat_prompt)."""
    return [m.model_dump(exclude_none=True) for m in request.messages]


def openai_conversation() -> list[dict]:
    """The tool loop's second request as an OpenAI client sends it (what the tiny models learned)."""
    _, second = tool_loop(FAMILIES["qwen3"], CALL_ID)
    return chat_of(oa.ChatCompletionRequest.model_validate({"model": "m", "messages": second}))


def test_anthropic_tool_loop_is_the_chat_routes_conversation():
    body = messages_request(tools=[TOOL], messages=[
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": THOUGHT_1, "signature": "sig"},
                                          {"type": "tool_use", "id": CALL_ID, "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": CALL_ID, "content": [
            {"type": "text", "text": RESULT}]}]}])
    chat = an.to_chat(body)
    assert chat_of(chat) == openai_conversation()
    assert [t.model_dump(exclude_none=True) for t in chat.tools] == [WEATHER]
    assert chat.max_tokens == 16 and chat.tool_choice is None


def test_anthropic_system_blocks_turns_and_results():
    body = messages_request(
        system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abcde;"},
                {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "CWD: /w"}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "<reminder/>"}, {"type": "text", "text": "hi"}]},
                  {"role": "system", "content": "Agents: none."},
                  {"role": "user", "content": "again"},
                  {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "opaque"},
                                                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "boom",
                                                "is_error": True}, {"type": "text", "text": "fix it"}]}])
    assert chat_of(an.to_chat(body)) == [
        # the billing header says nothing to the model; a system message within joins the system prompt
        {"role": "system", "content": "You are terse.\nCWD: /w\nAgents: none."},
        {"role": "user", "content": "<reminder/>\nhi\nagain"},  # consecutive turns of a role are one
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "content": "Error: boom", "tool_call_id": "t1"},
        {"role": "user", "content": "fix it"}]


@pytest.mark.parametrize("body, param, words", [
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "u"}}]}]),
     "messages[0].content[0]", "text only"),
    (dict(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]), "messages", "prefill"),
    (dict(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]),
     "messages[0].content[0]", "cannot hold"),
    (dict(messages=[{"role": "user", "content": "hi"}], tool_choice={"type": "tool"}), "tool_choice.name", "name"),
    (dict(messages=[{"role": "user", "content": "hi"}], thinking={"type": "enabled"}), "thinking.budget_tokens",
     "budget_tokens"),
])
def test_anthropic_what_cannot_be_run_is_a_400_naming_it(body, param, words):
    with pytest.raises(APIError) as exc:
        req = messages_request(**body)
        an.to_chat(req)
        an.thinking_of(req)
    assert exc.value.status == 400 and exc.value.param == param and words in exc.value.message


@pytest.mark.parametrize("extra, code, words", [
    ({"top_n": 1}, "unknown_parameter", "top_n"),
    ({"container": "c1"}, "unsupported_parameter", "container"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "unsupported_value", "server tool"),
])
def test_anthropic_fields_outside_the_api(extra, code, words):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as exc:
        messages_request(messages=[{"role": "user", "content": "hi"}], **extra)
    err = exc.value.errors()[0]
    assert err["type"] == code and words in err["msg"]
    # what Claude Code sends beside the conversation is taken
    messages_request(messages=[{"role": "user", "content": "hi"}], metadata={"user_id": "u"}, stream=True,
                     thinking={"type": "adaptive"}, output_config={"effort": "high"},
                     context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]})


def test_anthropic_thinking_as_a_budget_and_the_switch():
    def thinking(**kw):
        return an.thinking_of(messages_request(messages=[{"role": "user", "content": "hi"}], **kw))

    assert thinking(thinking={"type": "enabled", "budget_tokens": 2048}) == edge.Thinking(2048, True, None)
    assert thinking(thinking={"type": "disabled"}) == edge.Thinking(0, False, "low")
    assert thinking(thinking={"type": "adaptive"}, output_config={"effort": "low"}) == edge.Thinking(1024, None, "low")
    assert thinking() == edge.Thinking()


def test_the_thinking_switch_of_each_family():
    from llama_templates import template

    # llama.cpp's DeepSeek-V3.1 template reads enable_thinking too (as its `thinking`)
    want = {"qwen3": "enable_thinking", "qwen3.5": "enable_thinking", "glm-4.6": "enable_thinking",
            "deepseek-v3.1": "enable_thinking", "kimi-k2": None, "kimi-k2-thinking": None, "gpt-oss": None}
    assert {f: edge.switch_variable(template(f)) for f in want} == want


def test_responses_items_are_the_chat_routes_conversation():
    body = rs.ResponsesRequest.model_validate({"model": "m", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": THOUGHT_1}]},
        {"type": "function_call", "id": "fc_1", "call_id": CALL_ID, "name": "get_weather",
         "arguments": json.dumps({"city": "Paris"}), "status": "completed"},
        {"type": "function_call_output", "call_id": CALL_ID, "output": RESULT}],
        "tools": [{"type": "function", "strict": True, **WEATHER["function"]}], "max_output_tokens": 16})
    chat, conversation = rs.to_chat(body, [])
    assert chat_of(chat) == openai_conversation() == [
        oa.ChatMessage.model_validate(m).model_dump(exclude_none=True) for m in conversation]
    # `strict` is for the server, not part of the function the model reads
    assert [t.model_dump(exclude_none=True) for t in chat.tools] == [WEATHER]


def test_responses_instructions_history_and_formats():
    body = rs.ResponsesRequest.model_validate({
        "model": "m", "instructions": "Be brief.", "input": [{"role": "developer", "content": "Rules."},
                                                              {"role": "user", "content": "next"}],
        "text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}}},
        "reasoning": {"effort": "none"}})
    history = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"}]
    chat, conversation = rs.to_chat(body, history)
    assert chat_of(chat) == [{"role": "system", "content": "Be brief."}, *history,
                             {"role": "system", "content": "Rules."}, {"role": "user", "content": "next"}]
    assert conversation[0] == history[0]  # the instructions are not carried to a continuation
    assert chat.response_format.json_schema.name == "p"
    assert rs.thinking_of(body) == edge.Thinking(0, False, "low")


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0]"),
    ({"input": "hi", "tools": [{"type": "namespace", "name": "x", "tools": []}]}, "tools[0].type"),
    ({"input": "hi", "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text.format"),
])
def test_responses_what_cannot_be_run_is_a_400_naming_it(body, param):
    with pytest.raises(APIError) as exc:
        rs.to_chat(rs.ResponsesRequest.model_validate({"model": "m", **body}), [])
    assert exc.value.status == 400 and exc.value.param == param, exc.value.message


def test_the_response_store_evicts_the_least_recently_used():
    store = rs.ResponseStore(2)
    for name in ("a", "b"):
        store.put(rs.Stored({"id": name}, []))
    store.get("a", "response_id")  # used: now the newest
    store.put(rs.Stored({"id": "c"}, []))
    assert store.get("a", "response_id").response == {"id": "a"}
    with pytest.raises(APIError) as exc:
        store.get("b", "previous_response_id")
    assert exc.value.status == 404 and exc.value.param == "previous_response_id" and "evicted" in exc.value.message
    none = rs.ResponseStore(0)
    none.put(rs.Stored({"id": "x"}, []))
    with pytest.raises(APIError):
        none.get("x", "response_id")


def test_other_servers_fields_are_done_or_ignored_with_one_warning(caplog):
    """llama-server's and vLLM's fields: ignore_eos does what it does there, repeat_penalty and
    n_predict are renamed, the FOREIGN ones are accepted (a warning once a field asks for
    something), and a truly unknown field stays a 400."""
    from pydantic import ValidationError

    from moeray.cluster import request_sampling

    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body = oa.ChatCompletionRequest.model_validate({**base, "ignore_eos": True, "repeat_penalty": 1.3, "n_predict": 9})
    params = request_sampling.sampling_params(body, 9, 1000, lambda m, p: ValueError(m))
    assert params.ignore_eos and params.repetition_penalty == 1.3 and body.max_tokens == 9
    oa._warned.discard("typical_p")
    oa._warned.discard("id_slot")
    with caplog.at_level(logging.WARNING, logger="moeray"):
        for _ in range(2):
            oa.ChatCompletionRequest.model_validate({**base, "cache_prompt": True, "id_slot": 3, "typical_p": 0.9,
                                                     "samplers": None})
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "'id_slot'" in warned[0] and "'typical_p'" in warned[1]
    with pytest.raises(ValidationError) as exc:
        oa.ChatCompletionRequest.model_validate({**base, "top_q": 0.5})
    assert exc.value.errors()[0]["type"] == "unknown_parameter"
