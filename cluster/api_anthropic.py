"""Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens): what Claude Code
and the `anthropic` SDK speak, translated onto the chat path (cluster/chat_edge.py).

A request becomes the chat route's request: `system` a system message; user text blocks a user
message, `tool_result` blocks tool messages; assistant text, `thinking` and `tool_use` blocks one
assistant message with its reasoning and calls; `tools` function tools (`input_schema` as
`parameters`); `tool_choice` auto / any / tool / none as auto / required / a named function / none;
`thinking` and `output_config.effort` the reasoning budget and the family's thinking switch. The
reply, read by the model's chat format, becomes `thinking`, `text` and `tool_use` blocks, streamed as
Anthropic's events. Errors have Anthropic's shape {"type": "error", "error": {"type", "message"}}.
docs/api.md lists every field.
"""
from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any, Literal, Optional, Union

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator
from pydantic_core import PydanticCustomError

from moeray.cluster import chat_edge as edge
from moeray.cluster import openai_schema as oa

Number = Union[StrictInt, StrictFloat]

# Request fields Anthropic defines that change nothing here (caching is automatic: every prompt's
# prefix is reused; one service tier; context editing of thinking blocks: the template decides
# what earlier reasoning the model sees).
ACCEPTED = ("cache_control", "service_tier", "speed", "inference_geo", "context_management", "diagnostics")
# Fields that ask for what this server does not have: a 400 unless null.
UNSUPPORTED = ("container", "mcp_servers")
# Claude Code's first system block: billing metadata for Anthropic's API, which changes on every
# request (it would end the prompt's cached prefix right there) and says nothing to the model.
BILLING_HEADER = "x-anthropic-billing-header:"

# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


# ---------------------------------------------------------------- the request


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations: no effect here


class TextBlock(_Block):
    type: Literal["text"]
    text: StrictStr


class ImageBlock(_Block):
    type: Literal["image"]
    source: Optional[dict] = None


class DocumentBlock(_Block):
    type: Literal["document"]
    source: Optional[dict] = None


ResultPart = Annotated[Union[TextBlock, ImageBlock, DocumentBlock], Field(discriminator="type")]


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: Union[StrictStr, list[ResultPart], None] = None
    is_error: Optional[StrictBool] = None


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: StrictStr
    signature: Optional[StrictStr] = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: Optional[StrictStr] = None


Block = Annotated[Union[TextBlock, ImageBlock, DocumentBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock,
                        RedactedThinkingBlock], Field(discriminator="type")]


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant", "system"]  # system: mid-conversation instructions (Claude Code sends them)
    content: Union[StrictStr, list[Block]]

    def blocks(self) -> list:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, strict, input_examples, defer_loading, ...

    type: Optional[Literal["custom"]] = None
    name: StrictStr = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")
    description: Optional[StrictStr] = None
    input_schema: dict


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: Optional[StrictStr] = None
    disable_parallel_tool_use: Optional[StrictBool] = None


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")  # display: summarized / omitted

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[StrictInt] = Field(default=None, ge=0)


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = None
    format: Optional[dict] = None  # {"type": "json_schema", "schema": {...}}


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # the check below names any field it does not know

    model: StrictStr
    messages: list[InputMessage] = Field(min_length=1)
    max_tokens: StrictInt = Field(ge=1)
    system: Union[StrictStr, list[TextBlock], None] = None
    stop_sequences: Optional[list[StrictStr]] = None
    stream: StrictBool = False
    temperature: Optional[Number] = Field(default=None, ge=0, le=1)
    top_p: Optional[Number] = Field(default=None, gt=0, le=1)
    top_k: Optional[StrictInt] = Field(default=None, ge=0)
    metadata: Optional[dict] = None  # user_id: for Anthropic's abuse monitoring, no effect here
    tools: Optional[list[ToolSpec]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[ThinkingConfig] = None
    output_config: Optional[OutputConfig] = None
    # llama-server's extension: the chat template's variables, as on the chat route
    chat_template_kwargs: Optional[dict[StrictStr, Any]] = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, value in data.items():
            if name in cls.model_fields or name in ACCEPTED:
                continue
            if name in UNSUPPORTED:
                if value is not None:
                    raise PydanticCustomError("unsupported_parameter", "'{param}' is not supported by this server; "
                                              "leave it out", {"param": name})
                continue
            raise PydanticCustomError("unknown_parameter", "unknown parameter '{shown}': /v1/messages has no such "
                                      "parameter; remove it", {"param": oa._printable(name), "shown": oa._shown(name)})
        for i, tool in enumerate(data.get("tools") or ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in (None, "custom"):
                raise PydanticCustomError(
                    "unsupported_value", "tools[{i}]: the server tool {kind} is not supported: this server runs "
                    "client tools (name, description, input_schema) only", {"param": f"tools.{i}.type", "i": i,
                                                                            "kind": json.dumps(kind)})
        return data


class CountTokensRequest(MessagesRequest):
    max_tokens: Optional[StrictInt] = None  # not asked for when counting


# ---------------------------------------------------------------- onto the chat path


def _bad(message: str, param: str) -> edge.APIError:
    return edge.APIError(400, message, param=param, code="invalid_value")


def _refuse_media(block, where: str) -> None:
    if isinstance(block, (ImageBlock, DocumentBlock)):
        raise _bad(f"{where}: {block.type} content is not supported: this model reads text only; send the "
                   "content as text", where)


def _system(body: MessagesRequest) -> Optional[str]:
    if body.system is None:
        return None
    if isinstance(body.system, str):
        return body.system
    texts = [b.text for b in body.system if not b.text.startswith(BILLING_HEADER)]
    return "\n".join(texts) if texts else None


def _result_text(block: ToolResultBlock, where: str) -> str:
    if block.content is None:
        text = ""
    elif isinstance(block.content, str):
        text = block.content
    else:
        for j, part in enumerate(block.content):
            _refuse_media(part, f"{where}.content[{j}]")
        text = "\n".join(part.text for part in block.content)
    return f"Error: {text}" if block.is_error else text


def chat_messages(body: MessagesRequest) -> list[dict]:
    """The conversation as chat messages: consecutive turns of one role are one turn (as Anthropic
    combines them), a user turn's tool results come before its text, as tool messages. A system
    message within the conversation joins the system prompt (most templates take a system message
    only first; an agent resends it at the same place each turn, so the prompt's prefix stays)."""
    out: list[dict] = []
    system = [text] if (text := _system(body)) is not None else []
    for i, m in enumerate(body.messages):
        if m.role == "system":
            for j, block in enumerate(m.blocks()):
                if not isinstance(block, TextBlock):
                    raise _bad(f"messages[{i}].content[{j}]: a system message holds text blocks only",
                               f"messages[{i}].content[{j}]")
                system.append(block.text)
    if system:
        out.append({"role": "system", "content": "\n".join(system)})

    def add(message: dict) -> None:
        last = out[-1] if out else None
        if last is not None and last["role"] == message["role"] and message["role"] in ("user", "assistant"):
            joined = "\n".join(t for t in (last.get("content") or "", message.get("content") or "") if t)
            last["content"] = joined
            for key in ("tool_calls",):
                if message.get(key):
                    last[key] = (last.get(key) or []) + message[key]
            if message.get("reasoning_content"):
                last["reasoning_content"] = "\n".join(
                    t for t in (last.get("reasoning_content") or "", message["reasoning_content"]) if t)
            return
        out.append(message)

    for i, m in enumerate(body.messages):
        if m.role == "system":
            continue
        texts, reasoning, calls = [], [], []
        for j, block in enumerate(m.blocks()):
            where = f"messages[{i}].content[{j}]"
            _refuse_media(block, where)
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif m.role == "user" and isinstance(block, ToolResultBlock):
                add({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block, where)})
            elif m.role == "assistant" and isinstance(block, ThinkingBlock):
                reasoning.append(block.thinking)
            elif m.role == "assistant" and isinstance(block, RedactedThinkingBlock):
                continue  # encrypted by Anthropic: nothing a model here can read
            elif m.role == "assistant" and isinstance(block, ToolUseBlock):
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
            else:
                raise _bad(f"{where}: a {m.role} message cannot hold a {block.type} block", where)
        if m.role == "user":
            if texts:
                add({"role": "user", "content": "\n".join(texts)})
        else:
            message = {"role": "assistant", "content": "\n".join(texts)}
            if reasoning:
                message["reasoning_content"] = "\n".join(reasoning)
            if calls:
                message["tool_calls"] = calls
            add(message)
    if out and out[-1]["role"] == "assistant":
        raise _bad("the conversation ends with an assistant message (prefill), which this server does not "
                   "continue; end it with a user message", "messages")
    return out


def _tool_choice(choice: Optional[ToolChoice]):
    if choice is None or choice.type == "auto":
        return None if choice is None else "auto"
    if choice.type == "any":
        return "required"
    if choice.type == "none":
        return "none"
    if not choice.name:
        raise _bad("tool_choice of type 'tool' needs the tool's 'name'", "tool_choice.name")
    return {"type": "function", "function": {"name": choice.name}}


def _response_format(config: Optional[OutputConfig]) -> Optional[dict]:
    fmt = config.format if config is not None else None
    if fmt is None:
        return None
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _bad("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}", "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def thinking_of(body: MessagesRequest) -> edge.Thinking:
    """`thinking` and `output_config.effort` as a reasoning budget and the family's switch:
    enabled -> budget_tokens (switch on), disabled -> no thinking (switch off), adaptive -> the
    effort's budget (docs/api.md), or the server's default."""
    effort = body.output_config.effort if body.output_config is not None else None
    budget = edge.EFFORT_BUDGETS[effort] if effort else None
    t = body.thinking
    if t is None or t.type == "adaptive":
        return edge.Thinking(budget=budget, effort=_harmony_effort(effort))
    if t.type == "disabled":
        return edge.Thinking(budget=0, on=False, effort="low")
    if t.budget_tokens is None:
        raise _bad("thinking of type 'enabled' needs budget_tokens", "thinking.budget_tokens")
    return edge.Thinking(budget=t.budget_tokens, on=t.budget_tokens > 0, effort=_harmony_effort(effort))


def _harmony_effort(effort: Optional[str]) -> Optional[str]:
    """Anthropic's efforts as gpt-oss's template takes them (low, medium, high)."""
    if effort is None:
        return None
    return {"xhigh": "high", "max": "high"}.get(effort, effort)


def to_chat(body: MessagesRequest, count_only: bool = False) -> oa.ChatCompletionRequest:
    data: dict = {"model": body.model, "messages": chat_messages(body)}
    if body.tools:
        data["tools"] = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description is not None else {}),
            "parameters": t.input_schema}} for t in body.tools]
    choice = _tool_choice(body.tool_choice)
    if choice is not None:
        data["tool_choice"] = choice
    if body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use:
        data["parallel_tool_calls"] = False
    if not count_only:
        data.update(max_tokens=body.max_tokens, stop=body.stop_sequences or None, temperature=body.temperature,
                    top_p=body.top_p, top_k=body.top_k, response_format=_response_format(body.output_config))
    if body.chat_template_kwargs is not None:
        data["chat_template_kwargs"] = body.chat_template_kwargs
    return edge.chat_request({k: v for k, v in data.items() if v is not None})


# ---------------------------------------------------------------- the response


def new_id() -> str:
    return oa.new_id("msg").replace("msg-", "msg_")


def usage(call: edge.Call) -> dict:
    """Anthropic's usage: input_tokens are the prompt's tokens not read from the cache (Anthropic
    counts cache reads apart: input_tokens + cache_read_input_tokens is the whole prompt)."""
    cached = call.out.cached_tokens
    return {"input_tokens": len(call.prompt) - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": call.out.completion_tokens}


def stop_reason(call: edge.Call, has_calls: bool, stops) -> tuple[str, Optional[str]]:
    """(stop_reason, stop_sequence): max_tokens when cut by length (even after whole calls),
    tool_use when it called, stop_sequence when a stop string ended it, else end_turn."""
    if call.out.finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    hit = edge.stop_sequence(call, stops)
    return ("stop_sequence", hit) if hit is not None else ("end_turn", None)


def content_blocks(reply) -> list[dict]:
    blocks: list[dict] = []
    if reply.reasoning:
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    text = reply.content
    calls = []
    for c in reply.tool_calls:
        args = edge.arguments_object(c.arguments)
        if args is None:  # not an object: what the model wrote stays visible, as text
            text = "\n".join(t for t in (text, c.arguments) if t)
        else:
            calls.append({"type": "tool_use", "id": c.id, "name": c.name, "input": args})
    if text or not (blocks or calls):
        blocks.append({"type": "text", "text": text})
    return blocks + calls


async def messages(body: MessagesRequest, request: Request):
    service = request.app.state.service
    chat = to_chat(body)
    call = await edge.start(service, chat, thinking_of(body), "msg")
    call.id = new_id()
    stops = body.stop_sequences or ()
    if body.stream:
        return await edge.sse(call, MessageEvents(call, stops))
    reply = await edge.whole_reply(request, call)
    blocks = content_blocks(reply)
    reason, hit = stop_reason(call, any(b["type"] == "tool_use" for b in blocks), stops)
    return {"id": call.id, "type": "message", "role": "assistant", "model": call.model, "content": blocks,
            "stop_reason": reason, "stop_sequence": hit, "usage": usage(call)}


async def count_tokens(body: CountTokensRequest, request: Request):
    service = request.app.state.service
    if not service.serves(body.model):
        raise edge.APIError(404, f"the model '{body.model}' does not exist", param="model", code="model_not_found")
    chat = to_chat(body, count_only=True)
    tokens, _ = await asyncio.to_thread(edge.prompt_tokens, service, chat, thinking_of(body))
    return {"input_tokens": len(tokens)}


class MessageEvents(edge.Events):
    """Anthropic's stream: message_start, ping, then a content block per kind of text the reader
    finds (thinking, text, tool_use: content_block_start, its deltas, content_block_stop), then
    message_delta (stop_reason, usage) and message_stop."""

    def __init__(self, call: edge.Call, stops):
        self.call, self.stops = call, stops
        self.reader = call.extras.turn.reader()
        self.index = -1  # the open block's index
        self.open: Optional[str] = None  # its kind: "thinking", "text", a call's index as "call:N"
        self.called = False

    def _event(self, kind: str, **data) -> str:
        return edge.sse_event(kind, {"type": kind, **data})

    def opening(self):
        message = {"id": self.call.id, "type": "message", "role": "assistant", "model": self.call.model,
                   "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage(self.call)}
        yield self._event("message_start", message=message)
        yield self._event("ping")

    def _block(self, kind: str, block: dict):
        """Open a block of `kind` (closing the open one) unless it is the open one."""
        if self.open == kind:
            return
        yield from self._close()
        self.index += 1
        self.open = kind
        yield self._event("content_block_start", index=self.index, content_block=block)

    def _close(self):
        if self.open is not None:
            yield self._event("content_block_stop", index=self.index)
            self.open = None

    def _delta(self, delta):
        if delta.reasoning:
            yield from self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            yield self._event("content_block_delta", index=self.index,
                              delta={"type": "thinking_delta", "thinking": delta.reasoning})
        if delta.content:
            yield from self._block("text", {"type": "text", "text": ""})
            yield self._event("content_block_delta", index=self.index,
                              delta={"type": "text_delta", "text": delta.content})
        for piece in delta.calls:
            kind = f"call:{piece.index}"
            if piece.name:
                self.called = True
                yield from self._block(kind, {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}})
            if piece.arguments and self.open == kind:
                yield self._event("content_block_delta", index=self.index,
                                  delta={"type": "input_json_delta", "partial_json": piece.arguments})

    def text(self, text: str):
        yield from self._delta(self.reader.feed(text))

    def closing(self):
        yield from self._delta(self.reader.close(self.call.out.finish_reason == "length"))  # a cut call is dropped
        yield from self._close()
        reason, hit = stop_reason(self.call, bool(self.reader.message.tool_calls), self.stops)
        u = usage(self.call)
        yield self._event("message_delta", delta={"stop_reason": reason, "stop_sequence": hit},
                          usage={"output_tokens": u["output_tokens"], "input_tokens": u["input_tokens"],
                                 "cache_read_input_tokens": u["cache_read_input_tokens"],
                                 "cache_creation_input_tokens": 0})
        yield self._event("message_stop")

    def error(self, exc: edge.APIError):
        yield edge.sse_event("error", error_body(exc))


# ---------------------------------------------------------------- errors


def error_body(exc: edge.APIError) -> dict:
    kind = ERROR_TYPES.get(exc.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def error_response(exc: edge.APIError) -> Response:
    """Anthropic's error shape, with the same status the chat route gives the same problem."""
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    return Response(json.dumps(error_body(exc), ensure_ascii=True), status_code=exc.status, headers=headers,
                    media_type="application/json")


def add_routes(app_, service) -> None:
    app_.state.error_shapes.append(("/v1/messages", error_response))
    app_.post("/v1/messages")(messages)
    app_.post("/v1/messages/count_tokens")(count_tokens)
