"""What the Messages and Responses routes share: a request of another API run on the chat path.

Each agent API (cluster/api_anthropic.py, cluster/api_responses.py) translates its request into
the chat route's request model (openai_schema.ChatCompletionRequest) and its thinking settings
into a `Thinking`; `start` then does exactly what POST /v1/chat/completions does (the request's
extras, the template render `serve_app.chat_prompt`, the checks `serve_app.prepare_call`) and
returns the Call that `serve_app.text_deltas` runs. The route reads the reply with the same chat
format reader (`call.extras.turn`) and only shapes what it read into its API's response and
stream events (`sse`). There is no second engine path.
"""
from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import AsyncIterator, Iterable, Optional

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from moeray.cluster import openai_schema as oa
from moeray.cluster import request_extras as xt
from moeray.cluster import serve_app as app
from moeray.stages.text.chat import Message

# What the agent APIs use of the chat path: they reach it through this module only.
APIError, Call, bad_request, refuse_untokenized = app.APIError, app.Call, app.bad_request, app.refuse_untokenized


def validation_error(exc: ValidationError) -> APIError:
    """A pydantic error as the 400 the chat route would answer (the parameter named)."""
    return app._validation_error(exc)

# Reasoning efforts as token budgets of the thinking block: the chat route's table, one for every API.
EFFORT_BUDGETS = xt.EFFORT_BUDGETS


@dataclass
class Thinking:
    """What a request asks of the model's reasoning, in the API's terms made neutral."""
    budget: Optional[int] = None  # tokens the thinking block may take (None: the server's default, 0: none)
    on: Optional[bool] = None  # turn the family's thinking switch on / off (None: the template's default)
    effort: Optional[str] = None  # a reasoning effort, for the families whose template reads one (gpt-oss)


def switch_variable(template: str) -> Optional[str]:
    """The template variable that turns a family's thinking on and off: `enable_thinking` (Qwen3,
    Qwen3.5/3.6, GLM-4.5/4.6), `thinking` (DeepSeek-V3.1), else None (the model always reasons, or
    never)."""
    if "enable_thinking" in template:
        return "enable_thinking"
    if re.search(r"\bthinking\s+is\s+(defined|true|sameas)|\bif\s+thinking\b", template):
        return "thinking"
    return None


def apply_thinking(service, extras: xt.Extras, thinking: Thinking) -> None:
    """The budget on the extras (the chat format enforces it) and the family's switch or effort as
    template variables, unless the client set that variable itself (chat_template_kwargs win)."""
    if thinking.budget is not None:
        extras.reasoning_budget = thinking.budget
    switch = switch_variable(service.chat.template)
    if thinking.on is not None and switch is not None:
        extras.variables.setdefault(switch, thinking.on)
    if thinking.effort is not None and "reasoning_effort" in service.chat.template:
        extras.variables.setdefault("reasoning_effort", thinking.effort)


def chat_request(data: dict) -> oa.ChatCompletionRequest:
    """The chat route's request model of a translated request (its checks are the chat route's)."""
    try:
        return oa.ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


async def start(service, chat: oa.ChatCompletionRequest, thinking: Thinking, id_prefix: str) -> app.Call:
    """The chat route's steps for one translated request: extras, render, checks. The requested
    output is capped to the room the prompt leaves, not refused: Anthropic's max_tokens is required
    and agents send 32000 or more whatever the model; Responses' max_output_tokens is optional."""
    extras = xt.chat_extras(service, chat, app.bad_request)
    apply_thinking(service, extras, thinking)
    prompt = await asyncio.to_thread(app.chat_prompt, service, chat, extras)  # off the event loop
    room = service.context - len(prompt)
    if chat.max_tokens is None and service.opts.default_max_tokens is not None:
        chat.max_tokens = service.opts.default_max_tokens
    if room >= 1 and (chat.max_tokens is None or chat.max_tokens > room):
        chat.max_tokens = room
    return await app.prepare_call(service, chat, prompt, extras, id_prefix)


def prompt_tokens(service, chat: oa.ChatCompletionRequest, thinking: Thinking) -> tuple[list[int], str]:
    """The prompt a request would run on (count_tokens, /tokenize), rendered as `start` renders it:
    its tokens and its text."""
    extras = xt.chat_extras(service, chat, app.bad_request)
    apply_thinking(service, extras, thinking)
    extras.forced = None  # a forced call's grammar is not part of the prompt
    ids = app.chat_prompt(service, chat, extras)
    return ids, extras.turn.prompt


async def whole_reply(request: Request, call: app.Call) -> Message:
    """The reply of a call, run to its end and read by the model's chat format (a call that
    max_tokens cut is dropped, the complete ones kept)."""
    text = (await app.collect(request, [call]))[0]
    return call.extras.turn.parse(text, call.out.finish_reason == "length")


def stop_sequence(call: app.Call, stops: Iterable[str]) -> Optional[str]:
    """The stop string that ended the reply, or None (it ended on an end token, or by length). The
    engine's text stops before the string; the tokens it generated go past it."""
    out, stops = call.out, [s for s in stops if s]
    if out.finish_reason != "stop" or not stops or not out.output_ids:
        return None
    tokenizer = call.service.tokenizer
    if out.output_ids[-1] in tokenizer.end_ids:
        return None
    full = tokenizer.decode(out.output_ids)
    found = [(at, s) for s in stops if (at := full.find(s, max(0, len(out.text) - len(s)))) >= 0]
    return min(found)[1] if found else stops[0]


def arguments_object(arguments: str) -> Optional[dict]:
    """A call's JSON arguments as the object Anthropic's `input` is (None: not a JSON object)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def count_tokens(service, text: str) -> int:
    return len(service.tokenizer.encode(text, add_bos=False)) if text else 0


# ---------------------------------------------------------------- streams


def sse_event(kind: str, data: dict) -> str:
    """One server-sent event with its name, as Anthropic's and OpenAI's Responses streams write them."""
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class Events:
    """An API's stream events for one call: what opens it, what each text delta of the reply
    becomes, what closes it, and an error after the 200 went out."""

    def opening(self) -> Iterable[str]:
        return ()

    def text(self, text: str) -> Iterable[str]:
        raise NotImplementedError

    def closing(self) -> Iterable[str]:
        return ()

    def error(self, exc: app.APIError) -> Iterable[str]:
        raise NotImplementedError


async def sse(call: app.Call, events: Events) -> StreamingResponse:
    """The call's SSE response. Waits for its first text before the 200 goes out, so an error before
    any token (overload, a failed pipeline) still gets its own HTTP status, as the chat route does."""
    gen = app.choice_deltas([call])
    try:
        first = await gen.__anext__()
    except BaseException:
        await gen.aclose()
        raise
    return StreamingResponse(_body(first, gen, events), media_type="text/event-stream")


async def _body(first, gen: AsyncIterator, events: Events):
    async def items():
        yield first
        async for item in gen:
            yield item

    try:
        for line in events.opening():
            yield line
        async for _, text in items():
            for line in (events.closing() if text is None else events.text(text)):
                yield line
    except app.APIError as exc:
        for line in events.error(exc):
            yield line
    except Exception as exc:  # noqa: BLE001 - a bug after the 200 went out: still an error event
        for line in events.error(app.APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                              type_="server_error", code="internal_error")):
            yield line
    finally:
        await gen.aclose()
