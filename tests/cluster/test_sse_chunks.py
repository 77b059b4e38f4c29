"""The SSE chunks a stream sends for its text are the bytes pydantic writes for the same chunk
(they are spliced into a template made once per request), for any text a model can release."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from moeray.cluster import openai_schema as oa
from moeray.cluster import request_extras as xt
from moeray.cluster.serve_app import Call, ChatChunks, CompletionChunks
from moeray.stages.text.chat import Turn, chat_format
from moeray.stages.text.sampling import SamplingParams

TEXTS = ["Paris", " the", "", "é", "日本語", "🙂 emoji", 'quote " and \\ backslash', "new\nline\ttab\r",
         "\x00\x01\x1f\x7f", "\u2028\u2029", "\ufffd", "</script>", "{\"json\": [1, 2]}"]


def call(**extras) -> Call:
    service = SimpleNamespace(model_name="SmolLM2-135M-Instruct-upcycled-8x")
    return Call(service, [1, 2, 3], SamplingParams(), xt.Extras(**extras), "chatcmpl-0123456789abcdef", 1764580000,
                include_usage=True)


@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_chat_text_chunk_is_what_pydantic_writes(text):
    c = call()
    want = oa.ChatCompletionChunk(id=c.id, created=c.created, model=c.model, choices=[
        oa.ChatChunkChoice(delta=oa.Delta(content=text), finish_reason=None, logprobs=None)], usage=None)
    got = ChatChunks(c).text(text)
    assert got == f"data: {want.model_dump_json(exclude_none=False)}\n\n".encode()
    assert json.loads(got[6:])["choices"][0]["delta"]["content"] == text


@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_completion_text_chunk_is_what_pydantic_writes(text):
    c = call()
    want = oa.Completion(id=c.id, created=c.created, model=c.model, choices=[
        oa.CompletionChoice(text=text, finish_reason=None, logprobs=None)], usage=None)
    assert CompletionChunks(c).text(text) == f"data: {want.model_dump_json(exclude_none=False)}\n\n".encode()


def test_an_empty_delta_sends_no_chat_chunk_and_logprobs_or_tools_take_the_full_path():
    assert ChatChunks(call()).text("") == ""
    # With tools the text is held back while it may be a tool call: no chunk yet.
    tools = [{"type": "function", "function": {"name": "f"}}]
    turn = Turn(chat_format("{{ '<tool_call>' }}", name="hermes"), "", tools, "off")
    assert ChatChunks(call(tools=tools, turn=turn)).text("<tool_call>") == ""
    assert CompletionChunks(call(logprobs=0)).plain is None
