"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}): what Codex, the
OpenAI Agents SDK and `client.responses.create` speak, translated onto the chat path
(cluster/chat_edge.py).

A request becomes the chat route's request: `instructions` a system message; `input` a user
message, or items: messages (input/output text parts), `function_call` items an assistant turn's
tool calls, `function_call_output` items tool messages, `reasoning` items the assistant turn's
reasoning; function `tools`, `tool_choice`, `parallel_tool_calls`, `max_output_tokens`,
`text.format` (response_format) and `reasoning.effort` (a reasoning budget). The reply, read by the
model's chat format, becomes output items (reasoning, message, function_call), streamed as the
Responses events. Responses are kept in a bounded in-memory store (ServeOptions.responses_store):
`previous_response_id` continues one (its conversation and output come before the new input),
GET reads one, and one evicted (or never stored: `store: false`) is a 404. docs/api.md lists
every field.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError, \
    model_validator
from pydantic_core import PydanticCustomError

from moeray.cluster import chat_edge as edge
from moeray.cluster import openai_schema as oa

Number = Union[StrictInt, StrictFloat]

# Fields that change nothing here, at any value: tags for OpenAI's monitoring and caching, its
# service tiers, stream obfuscation, Codex's client_metadata.
ACCEPTED = ("user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier",
            "stream_options", "client_metadata")
# Fields that ask for what this server does not do, with the values that ask for nothing.
UNSUPPORTED: dict[str, tuple] = {"background": (False,), "conversation": (), "prompt": (), "truncation": ("disabled",),
                                 "max_tool_calls": (), "top_logprobs": (0,), "context_management": ()}
# `include` values: encrypted reasoning is asked for by clients that keep no store (Codex); the
# reasoning item carries its text in `content`, and that is what comes back.
INCLUDABLE = ("reasoning.encrypted_content",)


# ---------------------------------------------------------------- the request


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: StrictStr
    description: Optional[StrictStr] = None
    parameters: Optional[dict] = None
    strict: Optional[StrictBool] = None


class Reasoning(BaseModel):
    model_config = ConfigDict(extra="ignore")  # summary, generate_summary: the reasoning is given whole

    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")  # verbosity: a hint this server's models have no control for

    format: Optional[dict] = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # the check below names any field it does not know

    model: StrictStr
    input: Union[StrictStr, list[dict]]
    instructions: Optional[StrictStr] = None
    tools: Optional[list[dict]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None
    parallel_tool_calls: Optional[StrictBool] = None
    max_output_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    temperature: Optional[Number] = Field(default=None, ge=0, le=2)
    top_p: Optional[Number] = Field(default=None, gt=0, le=1)
    text: Optional[TextConfig] = None
    reasoning: Optional[Reasoning] = None
    store: StrictBool = True
    previous_response_id: Optional[StrictStr] = None
    stream: StrictBool = False
    metadata: Optional[dict[StrictStr, StrictStr]] = None
    include: Optional[list[StrictStr]] = None
    # vLLM's sampling extensions, as on the chat route
    seed: Optional[StrictInt] = None
    top_k: Optional[StrictInt] = None
    min_p: Optional[Number] = None
    repetition_penalty: Optional[Number] = None
    chat_template_kwargs: Optional[dict[StrictStr, Any]] = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, value in data.items():
            if name in cls.model_fields or name in ACCEPTED:
                continue
            if name in oa.FOREIGN:
                oa._foreign(name, value)
                continue
            if name in UNSUPPORTED:
                neutral = UNSUPPORTED[name]
                if not oa._asks_nothing(value, neutral):
                    allowed = " or ".join(json.dumps(n) for n in neutral)
                    raise PydanticCustomError("unsupported_parameter", "'{param}' is not supported by this server; "
                                              "leave it out" + (" or send {allowed}" if neutral else ""),
                                              {"param": name, "allowed": allowed})
                continue
            raise PydanticCustomError("unknown_parameter", "unknown parameter '{shown}': /v1/responses has no such "
                                      "parameter; remove it", {"param": oa._printable(name), "shown": oa._shown(name)})
        for value in data.get("include") or ():
            if value not in INCLUDABLE:
                raise PydanticCustomError("unsupported_value", "include: {value} is not supported by this server "
                                          "(only {ok})", {"param": "include", "value": json.dumps(value),
                                                          "ok": ", ".join(INCLUDABLE)})
        return data


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore")  # id, status: no effect on the conversation


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[StrictStr, list[dict]]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: Union[StrictStr, list[dict]]


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[dict] = []
    content: Optional[list[dict]] = None


ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
         "reasoning": ReasoningItem}


# ---------------------------------------------------------------- onto the chat path


def _bad(message: str, param: str) -> edge.APIError:
    return edge.APIError(400, message, param=param, code="invalid_value")


def _parts_text(parts: list[dict], kinds: tuple[str, ...], where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise _bad(f"{where}[{j}]: {kind} is not supported: this model reads text only", f"{where}[{j}]")
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{j}]: expected a part of type {' or '.join(kinds)} with a text", f"{where}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _item(raw: Any, where: str):
    if not isinstance(raw, dict):
        raise _bad(f"{where}: an input item is an object", where)
    kind = raw.get("type", "message" if "role" in raw else None)
    model = ITEMS.get(kind)
    if model is None:
        raise _bad(f"{where}: an input item of type {json.dumps(kind)} is not supported (this server takes "
                   f"{', '.join(ITEMS)})", f"{where}.type")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        err = edge.validation_error(exc)
        raise _bad(f"{where}: {err.message}", f"{where}.{err.param}" if err.param else where) from None


def input_messages(body: ResponsesRequest) -> list[dict]:
    """The new input as chat messages: an assistant turn's output items (its text, reasoning and
    function calls) are one assistant message; function call outputs are tool messages."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    if not body.input:
        raise _bad("input is an empty list: give a text or at least one item", "input")
    out: list[dict] = []

    def assistant() -> dict:
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        return out[-1]

    for i, raw in enumerate(body.input):
        where = f"input[{i}]"
        item = _item(raw, where)
        if isinstance(item, MessageItem):
            kinds = ("output_text", "input_text") if item.role == "assistant" else ("input_text",)
            text = item.content if isinstance(item.content, str) else _parts_text(item.content, kinds, f"{where}.content")
            if item.role == "assistant":
                turn = assistant()
                turn["content"] = "\n".join(t for t in (turn["content"], text) if t)
            else:
                out.append({"role": "system" if item.role == "developer" else item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            turn = assistant()
            turn.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else _parts_text(
                item.output, ("input_text", "output_text"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        else:  # reasoning: its text, else its summary
            parts = item.content or item.summary
            text = "\n".join(p.get("text", "") for p in parts if isinstance(p, dict))
            if text:
                turn = assistant()
                turn["reasoning_content"] = "\n".join(t for t in (turn.get("reasoning_content"), text) if t)
    return out


def _tools(body: ResponsesRequest) -> Optional[list[dict]]:
    if not body.tools:
        return None
    tools = []
    for i, raw in enumerate(body.tools):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind != "function":
            hint = " (Codex: -c web_search=\"disabled\")" if kind == "web_search" else ""
            raise _bad(f"tools[{i}]: a tool of type {json.dumps(kind)} is not supported: this server runs function "
                       f"tools only; leave it out{hint}", f"tools[{i}].type")
        try:
            tool = FunctionTool.model_validate(raw)
        except ValidationError as exc:
            err = edge.validation_error(exc)
            raise _bad(f"tools[{i}]: {err.message}", f"tools[{i}]") from None
        # `strict` is an instruction to the server (forced arguments are confined to the schema
        # whatever it says: docs/chat-formats.md), not part of what the model reads of the function
        tools.append({"type": "function", "function": tool.model_dump(exclude={"type", "strict"}, exclude_none=True)})
    return tools


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice: give \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\": ...}",
               "tool_choice")


def _response_format(body: ResponsesRequest) -> Optional[dict]:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name") or "output", "schema": fmt.get("schema"),
            **({"strict": fmt["strict"]} if fmt.get("strict") is not None else {})}}
    raise _bad(f"text.format: the type {json.dumps(fmt.get('type'))} is not one of text, json_object, json_schema",
               "text.format")


def thinking_of(body: ResponsesRequest) -> edge.Thinking:
    """reasoning.effort as a budget (chat_edge.EFFORT_BUDGETS); "none" turns the family's switch off."""
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is None:
        return edge.Thinking()
    return edge.Thinking(budget=edge.EFFORT_BUDGETS[effort], on=False if effort == "none" else None,
                         effort={"none": "low", "minimal": "low", "xhigh": "high"}.get(effort, effort))


def to_chat(body: ResponsesRequest, history: list[dict]) -> tuple[oa.ChatCompletionRequest, list[dict]]:
    """The chat request, and the conversation it runs (without the instructions: a continuation
    does not carry them over, as OpenAI's does not)."""
    conversation = history + input_messages(body)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions is not None else []) \
        + conversation
    data = {"model": body.model, "messages": messages, "tools": _tools(body), "tool_choice": _tool_choice(body.tool_choice),
            "parallel_tool_calls": body.parallel_tool_calls, "max_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed, "top_k": body.top_k,
            "min_p": body.min_p, "repetition_penalty": body.repetition_penalty,
            "response_format": _response_format(body), "chat_template_kwargs": body.chat_template_kwargs}
    return edge.chat_request({k: v for k, v in data.items() if v is not None}), conversation


# ---------------------------------------------------------------- the store


@dataclass
class Stored:
    response: dict  # the response as it was returned
    conversation: list[dict]  # chat messages it ran on (no instructions) and its own reply: what a continuation reads


class ResponseStore:
    """The last `capacity` responses, least recently used evicted first (a continuation or a GET
    uses one). In the server's one process (under Ray Serve: its one replica)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items: OrderedDict[str, Stored] = OrderedDict()
        self.lock = threading.Lock()

    def put(self, stored: Stored) -> None:
        if self.capacity < 1:
            return
        with self.lock:
            self.items[stored.response["id"]] = stored
            self.items.move_to_end(stored.response["id"])
            while len(self.items) > self.capacity:
                self.items.popitem(last=False)

    def get(self, response_id: str, param: str) -> Stored:
        with self.lock:
            stored = self.items.get(response_id)
            if stored is not None:
                self.items.move_to_end(response_id)
                return stored
        raise edge.APIError(404, f"no stored response with id '{response_id}': it was made with store: false, or it "
                           f"was evicted (this server keeps the {self.capacity} most recently used responses: "
                           "moeray serve --responses-store N)", type_="not_found_error", param=param,
                           code="response_not_found")

    def delete(self, response_id: str) -> None:
        with self.lock:
            if self.items.pop(response_id, None) is None:
                raise edge.APIError(404, f"no stored response with id '{response_id}'", type_="not_found_error",
                                   param="response_id", code="response_not_found")


# ---------------------------------------------------------------- the response


def _id(prefix: str) -> str:
    return oa.new_id(prefix).replace("-", "_")


def output_items(reply, status: str = "completed") -> list[dict]:
    items: list[dict] = []
    if reply.reasoning:
        items.append(reasoning_item(_id("rs"), reply.reasoning, status))
    if reply.content or not reply.tool_calls:
        items.append(message_item(_id("msg"), reply.content, status))
    for c in reply.tool_calls:
        items.append(call_item(_id("fc"), c.id, c.name, c.arguments, status))
    return items


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else [], "encrypted_content": None,
            "status": status}


def message_item(item_id: str, text: Optional[str], status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def reply_message(reply) -> dict:
    """The reply as the assistant message a continuation reads."""
    message: dict = {"role": "assistant", "content": reply.content}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = [c.as_openai() for c in reply.tool_calls]
    return message


class Turn:
    """One request's response object, from its start (status in_progress) to its end."""

    def __init__(self, body: ResponsesRequest, call: edge.Call, conversation: list[dict]):
        self.body, self.call, self.conversation = body, call, conversation
        self.id, self.created = _id("resp"), call.created

    def response(self, status: str, output: list[dict], reply=None) -> dict:
        b, c = self.body, self.call
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        out = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": c.model,
            "output": output, "error": None, "incomplete_details": incomplete, "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens, "previous_response_id": b.previous_response_id,
            "parallel_tool_calls": b.parallel_tool_calls is not False, "temperature": b.temperature, "top_p": b.top_p,
            "tool_choice": b.tool_choice or "auto", "tools": b.tools or [], "store": b.store,
            "reasoning": {"effort": b.reasoning.effort if b.reasoning else None, "summary": None},
            "text": {"format": (b.text.format if b.text and b.text.format else {"type": "text"})},
            "truncation": "disabled", "metadata": b.metadata or {}, "usage": None,
        }
        if reply is not None:
            n, cached, done = len(c.prompt), c.out.cached_tokens, c.out.completion_tokens
            out["usage"] = {"input_tokens": n, "input_tokens_details": {"cached_tokens": cached},
                            "output_tokens": done,
                            "output_tokens_details": {"reasoning_tokens": min(done, edge.count_tokens(c.service, reply.reasoning))},
                            "total_tokens": n + done}
        return out

    def status(self) -> str:
        return "incomplete" if self.call.out.finish_reason == "length" else "completed"

    def finish(self, request: Request, reply, output: list[dict]) -> dict:
        """The final response, kept in the store unless `store: false`."""
        response = self.response(self.status(), output, reply)
        if self.body.store:
            request.app.state.responses.put(Stored(response, self.conversation + [reply_message(reply)]))
        return response


async def create(body: ResponsesRequest, request: Request):
    service = request.app.state.service
    history = []
    if body.previous_response_id is not None:
        history = request.app.state.responses.get(body.previous_response_id, "previous_response_id").conversation
    chat, conversation = to_chat(body, history)
    call = await edge.start(service, chat, thinking_of(body), "resp")
    turn = Turn(body, call, conversation)
    if body.stream:
        return await edge.sse(call, ResponseEvents(request, turn))
    reply = await edge.whole_reply(request, call)
    return turn.finish(request, reply, output_items(reply, "completed"))


async def retrieve(response_id: str, request: Request):
    return request.app.state.responses.get(response_id, "response_id").response


async def delete(response_id: str, request: Request):
    request.app.state.responses.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


class ResponseEvents(edge.Events):
    """The Responses stream: response.created and response.in_progress, then an output item per
    kind of text the reader finds (reasoning: reasoning_text deltas; message: output_text deltas;
    function_call: function_call_arguments deltas), each added, filled and done, then
    response.completed (or response.incomplete when cut by max_output_tokens) with the usage."""

    def __init__(self, request: Request, turn: Turn):
        self.request, self.turn = request, turn
        self.reader = turn.call.extras.turn.reader()
        self.seq = 0
        self.items: list[dict] = []  # the output so far; the last one may be open
        self.open: Optional[str] = None  # "reasoning", "message", or "call:N"
        self.text_of_open = ""

    def _event(self, kind: str, **data) -> str:
        self.seq += 1
        return edge.sse_event(kind, {"type": kind, "sequence_number": self.seq - 1, **data})

    def opening(self):
        snapshot = self.turn.response("in_progress", [])
        yield self._event("response.created", response=snapshot)
        yield self._event("response.in_progress", response=snapshot)

    def _start(self, kind: str, item: dict):
        if self.open == kind:
            return
        yield from self._close()
        self.open, self.text_of_open = kind, ""
        self.items.append(item)
        yield self._event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))
        part = {"reasoning": {"type": "reasoning_text", "text": ""},
                "message": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}.get(kind)
        if part is not None:
            yield self._event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                              content_index=0, part=part)

    def _close(self):
        if self.open is None:
            return
        item, index, text = self.items[-1], len(self.items) - 1, self.text_of_open
        if self.open == "reasoning":
            item.update(reasoning_item(item["id"], text, "completed"))
            yield self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=text)
            yield self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                              part={"type": "reasoning_text", "text": text})
        elif self.open == "message":
            item.update(message_item(item["id"], text, "completed"))
            yield self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                              text=text, logprobs=[])
            yield self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                              part=item["content"][0])
        else:
            item.update(status="completed", arguments=text)
            yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              name=item["name"], arguments=text)
        yield self._event("response.output_item.done", output_index=index, item=item)
        self.open = None

    def _delta(self, delta):
        if delta.reasoning:
            yield from self._start("reasoning", reasoning_item(_id("rs"), "", "in_progress"))
            self.text_of_open += delta.reasoning
            yield self._event("response.reasoning_text.delta", item_id=self.items[-1]["id"],
                              output_index=len(self.items) - 1, content_index=0, delta=delta.reasoning)
        if delta.content:
            yield from self._start("message", message_item(_id("msg"), None, "in_progress"))
            self.text_of_open += delta.content
            yield self._event("response.output_text.delta", item_id=self.items[-1]["id"],
                              output_index=len(self.items) - 1, content_index=0, delta=delta.content, logprobs=[])
        for piece in delta.calls:
            kind = f"call:{piece.index}"
            if piece.name:
                yield from self._start(kind, call_item(_id("fc"), piece.id, piece.name, "", "in_progress"))
            if piece.arguments and self.open == kind:
                self.text_of_open += piece.arguments
                yield self._event("response.function_call_arguments.delta", item_id=self.items[-1]["id"],
                                  output_index=len(self.items) - 1, delta=piece.arguments)

    def text(self, text: str):
        yield from self._delta(self.reader.feed(text))

    def closing(self):
        yield from self._delta(self.reader.close(self.turn.call.out.finish_reason == "length"))  # a cut call is dropped
        reply = self.reader.message
        if not self.items:  # an empty reply is still a message, as the whole response has
            yield from self._start("message", message_item(_id("msg"), None, "in_progress"))
        yield from self._close()
        response = self.turn.finish(self.request, reply, self.items)
        yield self._event(f"response.{response['status']}", response=response)

    def error(self, exc: edge.APIError):
        yield self._event("error", code=exc.code, message=exc.message, param=exc.param)
        failed = self.turn.response("failed", self.items)
        failed["error"] = {"code": exc.code or "server_error", "message": exc.message}
        yield self._event("response.failed", response=failed)


def add_routes(app_, service) -> None:
    app_.state.responses = ResponseStore(service.opts.responses_store)
    app_.post("/v1/responses")(create)
    app_.get("/v1/responses/{response_id}")(retrieve)
    app_.delete("/v1/responses/{response_id}")(delete)
