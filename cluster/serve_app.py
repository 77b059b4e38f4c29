"""The OpenAI-compatible HTTP server: a FastAPI app over the engine, deployed with Ray Serve (the
stage pipeline) or served by uvicorn from the `moeray serve --local` process (cluster/local_server.py).

Who owns what: the Serve deployment (one replica) owns everything behind it. Its constructor
builds the Service (cluster/service.py), which runs the driver (probe -> plan -> load -> wire), so
the stage actors are its children, then starts the engine thread and the metrics poller.
Restarting the deployment (or `moeray serve` itself) therefore rebuilds the whole pipeline from
the model file, and a replica that dies takes its stages with it: nothing is left half-wired.
Within a run, a stage that dies is restarted by the engine (RayPipeline.recover) and the server
goes on; when its node left the cluster, the driver re-plans on the devices left (Launched.recover),
and when those cannot hold the model every request is a 503 with that reason until a node joins.
The replica itself is pinned to the head node, so a worker node that leaves never takes it.

`build_app(service)` makes the FastAPI app of module-level handlers (tests and `--local` use it
without Serve); `deployment(options)` wraps both for `serve.run`. Both generation routes share one
path: `prepare_call` checks the request and builds its sampling parameters, `text_deltas` runs it
on the engine thread, and the route only shapes the response (a JSON body, or SSE chunks). The
server forwards text: the engine detokenises, finds stop strings and end tokens, and finishes
requests (cluster/scheduler.py, Scheduler.postprocess).

Routes: POST /v1/chat/completions, POST /v1/completions (JSON or SSE streams), GET /v1/models,
GET /health, GET /v1/stages, GET /v1/stages/timeline (where the last requests' time went),
GET /v1/admin/profile (the routing served so far, as a profile). Errors use OpenAI's shape {"error": {"message", "type", "param",
"code"}}: 400 malformed JSON / wrong field types / a parameter moeray does not do (named in
"param") / prompt over the context / max_tokens out of range, 401 bad API key, 404 unknown model,
429 too many waiting, 503 engine down, 504 a request that got no token within its deadline. An
error nobody foresaw is still that shape (500, "internal_error") and the server goes on.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from dataclasses import dataclass
from typing import AsyncIterator, Iterable, Optional

from fastapi import Request  # at module level: FastAPI resolves the handlers' annotations here
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2.exceptions import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeray.cluster import openai_schema as oa
from moeray.cluster import request_extras as xt
from moeray.cluster import request_sampling as rs
from moeray.cluster.config import ServeOptions
from moeray.cluster import edge
from moeray.cluster.engine_loop import EngineDownError, Finished, OverloadedError, ShuttingDownError
from moeray.cluster.service import Service
from moeray.cluster.timeline import KEEP_REQUESTS, MAX_DELIVERIES, Timeline, now_ns
from moeray.errors import MoerayError
from moeray.stages.text.chat import ChatFormatError, Delta
from moeray.stages.text.detokenize import stop_matcher
from moeray.stages.text.sampling import SamplingParams

HEAD_RESOURCE = "node:__internal_head__"  # Ray's resource of the head node
DEFAULT_MAX_TOKENS = 256  # when a request gives none (capped by the room its prompt leaves)
# A prompt this short (characters, a few messages, no tools) is rendered and tokenised on the event
# loop: well under a millisecond, where the hop to a worker thread and back costs two thread
# wake-ups (milliseconds on a busy machine). Anything longer goes to a worker thread.
INLINE_PROMPT_CHARS = 2048
INLINE_PROMPT_MESSAGES = 8


# ---------------------------------------------------------------- errors


APIError = edge.APIError  # an error a request gets, in the shape of the API it spoke (error_response)


# The tags pydantic puts in an error's location for the member of a union it tried ('int', 'str',
# 'list[int]', 'function-after[...]'): not a part of the request, so not of the param it names.
_UNION_TAG = re.compile(r"^(int|float|str|bool|dict|list|none|json-or-python|[a-z-]+\[.*\])$")

# Errors raised by openai_schema's own checks: their code is their type, their ctx names the parameter.
_SCHEMA_ERRORS = ("unknown_parameter", "unsupported_parameter", "unsupported_value", "invalid_value")


def _validation_error(exc) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "),
                        code="invalid_json")
    loc = [str(p) for p in first.get("loc", []) if p != "body" and not _UNION_TAG.match(str(p))]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if first.get("type") in _SCHEMA_ERRORS:
        param = (first.get("ctx") or {}).get("param", param)
        return APIError(400, msg if param is None or param in msg else f"{param}: {msg}", param=param,
                        code=first["type"])
    if param is None and first.get("type") in ("model_attributes_type", "dict_type"):
        return APIError(400, "the request body must be a JSON object", code="invalid_json")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


def bad_request(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


# ---------------------------------------------------------------- one request: the path both routes share


@dataclass
class Outcome:
    text: str = ""
    finish_reason: Optional[str] = None
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV a cached prefix supplied (known from the first token on)
    done: bool = False
    output_ids: list = dataclasses.field(default_factory=list)  # the tokens generated, once done (end token included)
    logprobs: list = dataclasses.field(default_factory=list)  # TokenLogprobs so far, when asked for


@dataclass
class Call:
    """One choice of a request after its checks: what the engine runs, and what its response is
    made of. A request with `n` > 1 is n Calls (`choices`), one sequence each, sharing the prompt's
    KV blocks through the engine's prefix reuse."""
    service: Service
    prompt: list[int]
    params: SamplingParams
    extras: xt.Extras
    id: str  # "chatcmpl-..." or "cmpl-..."
    created: int
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage and no choices
    out: Outcome = dataclasses.field(default_factory=Outcome)
    index: int = 0  # which of the request's choices
    timeline: Optional[Timeline] = None  # where its time goes (cluster/timeline.py): the first choice's

    @property
    def model(self) -> str:
        return self.service.model_name

    def choices(self, n: int) -> list["Call"]:
        """The request's n choices: this one first, each its own seed stream (request_sampling)."""
        return [self] + [dataclasses.replace(self, params=rs.choice_params(self.params, i), out=Outcome(), index=i,
                                             timeline=None) for i in range(1, n)]


def usage(calls: list[Call]) -> oa.Usage:
    """The usage of a request's choices: the prompt once (as OpenAI counts it), every choice's tokens."""
    n = len(calls[0].prompt)
    done = sum(c.out.completion_tokens for c in calls)
    return oa.Usage(prompt_tokens=n, completion_tokens=done, total_tokens=n + done,
                    prompt_tokens_details=oa.PromptTokensDetails(cached_tokens=calls[0].out.cached_tokens))


async def prepare_call(service: Service, body: oa._Request, prompt: list[int], extras: xt.Extras,
                       id_prefix: str, timeline: Optional[Timeline] = None) -> Call:
    """Check the model, the prompt length and max_tokens; build the sampling params with what the
    request asks beyond text (log-probabilities, a grammar: compiled here, off the event loop)."""
    if not service.serves(body.model):
        names = ", ".join(f"'{n}'" for n in service.model_names)
        raise APIError(404, f"the model '{body.model}' does not exist; this server serves {names} (serve with "
                       "--served-model-name to add names, or --any-model to answer any)", param="model",
                       code="model_not_found")
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
    room = service.context - len(prompt)
    if room < 1:
        raise APIError(400, f"this model's context is {service.context} tokens; the prompt has {len(prompt)} "
                       "tokens, which leaves no room for a completion", param="messages"
                       if isinstance(body, oa.ChatCompletionRequest) else "prompt", code="context_length_exceeded")
    wanted = body.wanted_tokens()
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    if wanted is None:
        wanted = min(service.opts.default_max_tokens or DEFAULT_MAX_TOKENS, room)
    elif wanted < 1:
        raise APIError(400, f"{param} must be at least 1, got {wanted}", param=param, code="invalid_value")
    elif wanted > room:
        raise APIError(400, f"{param} is {wanted}, but this model's context is {service.context} tokens and the "
                       f"prompt has {len(prompt)}: at most {room} can be generated", param=param,
                       code="context_length_exceeded")
    if not service.tokenizer.vocab_size > max(prompt) >= 0 or min(prompt) < 0:
        raise APIError(400, f"token ids must be in [0, {service.tokenizer.vocab_size})", param="prompt",
                       code="invalid_value")
    if body.n > service.engine.config.max_seqs:
        raise APIError(400, f"n is {body.n}, but this server runs at most {service.engine.config.max_seqs} sequences "
                       "at once (--max-seqs) and each choice is one", param="n", code="invalid_value")
    params = rs.sampling_params(body, wanted, service.tokenizer.vocab_size, bad_request)
    if extras.grammar is not None:
        await compile_grammar(service, extras)
    if params.stop:  # the stop strings' matcher, built here once (not on the engine thread)
        await asyncio.to_thread(stop_matcher, params.stop)
    call = Call(service, prompt, xt.apply(params, extras), extras, oa.new_id(id_prefix), oa.now(),
                body.include_usage_in_stream(), timeline=timeline)
    if timeline is not None:
        timeline.id, timeline.prompt_tokens = call.id, len(prompt)
        timeline.mark("prepared")
        service.timelines.add(timeline)
    return call


async def compile_grammar(service: Service, extras: xt.Extras) -> None:
    """Compile (and check) the request's grammar on a worker thread, bounded in time: a schema
    that takes longer than --grammar-timeout is a 400 naming its field. The compiled grammar is
    kept for the stage that applies it (stages/text/grammar.py), so no step waits on a compile."""
    timeout = service.opts.limits.grammar_timeout_s
    try:
        await asyncio.wait_for(asyncio.to_thread(service.prepare_grammar, extras, bad_request), timeout)
    except asyncio.TimeoutError:
        raise APIError(400, f"{extras.grammar_param}: the grammar did not compile within {timeout:g} s "
                       "(--grammar-timeout); give a smaller or simpler schema", param=extras.grammar_param,
                       code="schema_too_complex") from None


async def text_deltas(call: Call) -> AsyncIterator[str]:
    """The request's text as the engine releases it; `call.out` holds the finish reason and token
    count when it ends. A consumer that stops early (a client that went away) frees the sequence."""
    service, outcome, tl = call.service, call.out, call.timeline
    try:
        stream = service.loop.submit(call.prompt, call.params, edge.take_ticket(), tl)
    except OverloadedError as exc:
        raise APIError(429, str(exc), type_="rate_limit_error", code="overloaded") from None
    except ShuttingDownError as exc:
        raise APIError(503, str(exc), type_="server_error", code="shutting_down") from None
    except EngineDownError as exc:
        raise APIError(503, str(exc), type_="server_error", code="engine_unavailable") from None
    # The first token waits for a slot and a prefill; later ones for a step or two.
    deadline_s = max(30.0, 3 * service.opts.engine.step_timeout_s)
    parts: list[str] = []
    try:
        while True:
            try:
                item = await stream.next(deadline_s)
            except asyncio.TimeoutError:
                raise APIError(504, f"no token within {deadline_s:.0f} s; the request was cancelled",
                               type_="server_error", code="timeout") from None
            if isinstance(item, Finished):
                if item.error is not None:
                    raise APIError(503, f"the request failed: {item.error}", type_="server_error",
                                   code="shutting_down" if service.loop.draining else "pipeline_failed")
                outcome.finish_reason, outcome.done = item.reason, True
                if stream.req is not None:
                    outcome.cached_tokens, outcome.output_ids = stream.req.cached_tokens, list(stream.req.output)
                return
            if outcome.completion_tokens == 0 and stream.req is not None:  # admitted: its cached prefix is known
                outcome.cached_tokens = stream.req.cached_tokens
            if tl is not None and len(tl.taken) < MAX_DELIVERIES:
                tl.taken.append(now_ns())
            outcome.completion_tokens += item.n_tokens
            outcome.logprobs.extend(item.logprobs)
            if item.text:
                parts.append(item.text)
                yield item.text  # back here once the consumer wants more: its chunk is written
            if tl is not None and len(tl.written) < MAX_DELIVERIES:
                tl.written.append(now_ns())
    finally:
        outcome.text = "".join(parts)
        if tl is not None:
            tl.done = now_ns()
        service.loop.abort(stream)  # gone early (client left, error): the engine drops the sequence
        service.request_done(stream, outcome.finish_reason if outcome.done else "abort")


async def choice_deltas(calls: list[Call]) -> AsyncIterator[tuple[int, Optional[str]]]:
    """The text of a request's choices as it is released, as (index, text), and (index, None) when
    that choice is done; closing it (a client that went away) frees every choice's sequence."""
    gens = [text_deltas(c) for c in calls]
    if len(gens) == 1:  # the common case, without the fan-in's tasks
        try:
            async for text in gens[0]:
                yield 0, text
            yield 0, None
        finally:
            await gens[0].aclose()
        return
    pending = {asyncio.ensure_future(gens[i].__anext__()): i for i in range(len(gens))}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                try:
                    text = task.result()
                except StopAsyncIteration:
                    yield i, None
                    continue
                pending[asyncio.ensure_future(gens[i].__anext__())] = i
                yield i, text
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for gen in gens:
            await gen.aclose()


async def collect(request: Request, calls: list[Call]) -> list[str]:
    """Each choice's whole text; stops (and frees the sequences) if the client disconnects."""
    parts: list[list[str]] = [[] for _ in calls]
    gen = choice_deltas(calls)
    next_part = None
    try:
        while True:
            next_part = asyncio.ensure_future(gen.__anext__())
            while True:
                done, _ = await asyncio.wait({next_part}, timeout=0.5)
                if done:
                    break
                if await request.is_disconnected():
                    raise asyncio.CancelledError("client disconnected")
            try:
                i, text = next_part.result()
            except StopAsyncIteration:
                return ["".join(p) for p in parts]
            if text is not None:
                parts[i].append(text)
    finally:
        if next_part is not None and not next_part.done():
            next_part.cancel()
            try:
                await next_part
            except BaseException:  # noqa: BLE001 - its own cancellation
                pass
        await gen.aclose()


# ---------------------------------------------------------------- the generation routes


def chat_prompt(service: Service, body: oa.ChatCompletionRequest, extras: xt.Extras) -> list[int]:
    """The prompt's tokens, rendered as the model's chat format calls its template (extras.turn); a
    worker thread runs this (rendering and tokenizing a long conversation take a while)."""
    messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text(),
                 **m.model_dump(include={"name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning"},
                                exclude_none=True)}
                for m in body.messages]
    try:
        extras.turn = service.chat.render(service.tokenizer, messages, extras.tools, extras.variables,
                                          read_calls=extras.read_calls, budget=xt.budget_tokens(service, extras))
    except ChatFormatError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
    except MoerayError as exc:
        raise APIError(400, str(exc), param="messages") from None
    except TemplateError as exc:  # the template's own raise_exception(...): roles out of order, ...
        raise APIError(400, f"the model's chat template rejected the messages: {exc}", param="messages",
                       code="invalid_value") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, RecursionError) as exc:
        # A template (or a format's reading of the messages) meeting a shape it did not expect: the
        # messages' fault as far as the client can tell, and one it can fix; never a 500.
        raise APIError(400, f"the messages could not be rendered by the model's chat template: {type(exc).__name__}: "
                       f"{exc}", param="messages", code="invalid_value") from None
    refuse_untokenized(service, extras.turn.prompt, "messages")
    xt.force_call(service, extras, bad_request)
    return service.tokenizer.encode(extras.turn.prompt)


def encode_prompt(service: Service, text: str, param: str) -> list[int]:
    """A prompt text's token ids (a worker thread runs this: tokenizing lets go of the GIL, so the
    engine thread steps and the event loop answers meanwhile)."""
    refuse_untokenized(service, text, param)
    return service.tokenizer.encode(text)


def refuse_untokenized(service: Service, text: str, param: str) -> None:
    """A 400 before any tokenizing when a prompt's bytes alone show it cannot fit: no token stands
    for more than `max_token_bytes` of text (Tokenizer.min_tokens; a 20 MB prompt is refused in
    milliseconds, not tokenized for 40 s)."""
    floor = service.tokenizer.min_tokens(text)
    if floor >= service.context:
        raise APIError(400, f"this model's context is {service.context} tokens; the prompt has at least {floor} "
                       f"tokens (no token stands for more than {service.tokenizer.max_token_bytes} of its "
                       "bytes), which leaves no room for a completion", param=param, code="context_length_exceeded")


def request_timeline(request: Request) -> Timeline:
    """A request's timeline from its arrival (the edge noted it) and now, when its handler runs."""
    tl = Timeline()
    tl.mark("http", request.scope.get(ARRIVED))
    tl.mark("parsed")
    return tl


def _short_chat(body: oa.ChatCompletionRequest, extras: xt.Extras) -> bool:
    """Short enough to render on the event loop: few messages of little text, no tools."""
    return (extras.tools is None and extras.forced is None and len(body.messages) <= INLINE_PROMPT_MESSAGES
            and sum(len(m.text()) for m in body.messages) <= INLINE_PROMPT_CHARS)


async def chat_completions(body: oa.ChatCompletionRequest, request: Request):
    service: Service = request.app.state.service
    tl = request_timeline(request)
    # off the event loop: the tools' and response_format's schemas checked, a long conversation
    # rendered and tokenised (a few short messages are rendered here: a thread hop costs more)
    extras = await asyncio.to_thread(xt.chat_extras, service, body, bad_request)
    if _short_chat(body, extras):
        prompt = chat_prompt(service, body, extras)
    else:
        prompt = await asyncio.to_thread(chat_prompt, service, body, extras)
    tl.mark("rendered")
    calls = (await prepare_call(service, body, prompt, extras, "chatcmpl", tl)).choices(body.n)
    if body.stream:
        return await sse_response(calls, [ChatChunks(c) for c in calls])
    texts = await collect(request, calls)
    return oa.ChatCompletion(id=calls[0].id, created=calls[0].created, model=calls[0].model,
                             choices=[chat_choice(c, text) for c, text in zip(calls, texts)], usage=usage(calls))


def chat_choice(call: Call, text: str) -> oa.ChatChoice:
    """One choice's message: what the chat format's reader makes of its text."""
    cut = call.out.finish_reason == "length"  # a call max_tokens cut is dropped, and the reason stays length
    reply = call.extras.turn.parse(text, cut)
    calls = reply.tool_calls
    message = oa.ResponseMessage(content=(reply.content or None) if calls else reply.content,
                                 reasoning_content=reply.reasoning or None, tool_calls=[
        oa.ToolCallOut(id=c.id, function=oa.ToolCallFunction(name=c.name, arguments=c.arguments))
        for c in calls] or None)
    return oa.ChatChoice(index=call.index, message=message,
                         finish_reason="tool_calls" if calls and not cut else call.out.finish_reason,
                         logprobs=_chat_logprobs(call, call.out.logprobs))


async def completions(body: oa.CompletionRequest, request: Request):
    service: Service = request.app.state.service
    tl = request_timeline(request)
    extras = await asyncio.to_thread(xt.completion_extras, service, body, bad_request)
    if not isinstance(body.prompt, str):
        prompt = list(body.prompt)
    elif len(body.prompt) <= INLINE_PROMPT_CHARS:
        prompt = encode_prompt(service, body.prompt, "prompt")
    else:
        prompt = await asyncio.to_thread(encode_prompt, service, body.prompt, "prompt")  # off the event loop
    tl.mark("rendered")
    calls = (await prepare_call(service, body, prompt, extras, "cmpl", tl)).choices(body.n)
    chunks = [CompletionChunks(c) for c in calls]
    if body.stream:
        return await sse_response(calls, chunks)
    texts = await collect(request, calls)
    return oa.Completion(id=calls[0].id, created=calls[0].created, model=calls[0].model, choices=[
        oa.CompletionChoice(index=c.index, text=text, finish_reason=c.out.finish_reason, logprobs=ch.logprobs())
        for c, text, ch in zip(calls, texts, chunks)], usage=usage(calls))


def _chat_logprobs(call: Call, lps: list) -> Optional[oa.ChatLogprobs]:
    return xt.chat_logprobs(call.service.tokenizer, lps) if call.extras.logprobs is not None else None


# ---------------------------------------------------------------- streamed responses (SSE)


def _sse(obj) -> str:
    data = obj if isinstance(obj, str) else obj.model_dump_json(exclude_none=False)
    return f"data: {data}\n\n"


class TextChunk:
    """The bytes of one request's plain text chunk with the text spliced in: the JSON pydantic writes
    for that chunk is made once per request, not once per token (json.dumps writes the same string)."""

    MARK = "\x00"  # a text no chunk holds; pydantic writes it as "\u0000"

    def __init__(self, line_with_mark: str):
        head, tail = line_with_mark.split('"\\u0000"')
        self.head, self.tail = head.encode(), tail.encode()

    def __call__(self, text: str) -> bytes:
        return b"".join((self.head, json.dumps(text, ensure_ascii=False).encode(), self.tail))


class ChatChunks:
    """The SSE chunks of a streamed chat completion: the role, then what the chat format's reader
    makes of each text delta (reasoning, content, a tool call's id and name, then its argument
    fragments; a possible marker held back until it is whole), and the finish reason."""

    def __init__(self, call: Call):
        self.call = call
        turn = call.extras.turn
        self.reader = turn.reader() if turn is not None and not turn.text_only else None
        self.sent_logprobs = 0
        self.plain = TextChunk(self._chunk(oa.Delta(content=TextChunk.MARK)))

    def _chunk(self, delta: oa.Delta, finish=None, lps=None) -> str:
        c = self.call
        return _sse(oa.ChatCompletionChunk(id=c.id, created=c.created, model=c.model, choices=[
            oa.ChatChunkChoice(index=c.index, delta=delta, finish_reason=finish, logprobs=lps)]))

    def _new_logprobs(self):
        all_lps = self.call.out.logprobs
        lps, self.sent_logprobs = all_lps[self.sent_logprobs:], len(all_lps)
        return _chat_logprobs(self.call, lps) if lps else None

    def _read(self, d: Delta, lps=None) -> str:
        if not d and lps is None:
            return ""
        calls = [{"index": c.index, **({"id": c.id, "type": "function"} if c.id else {}),
                  "function": {**({"name": c.name} if c.name else {}), "arguments": c.arguments}} for c in d.calls]
        return self._chunk(oa.Delta(content=d.content or None, reasoning_content=d.reasoning or None,
                                    tool_calls=calls or None), lps=lps)

    def opening(self) -> Iterable[str]:
        yield self._chunk(oa.Delta(role="assistant", content=""))

    def text(self, text: str) -> str | bytes:
        if self.reader is None:
            if self.call.extras.logprobs is None:
                return self.plain(text) if text else ""  # what nearly every chunk is: text alone
            lps = self._new_logprobs()
            return self._chunk(oa.Delta(content=text), lps=lps) if text or lps else ""
        return self._read(self.reader.feed(text), self._new_logprobs())

    def closing(self) -> Iterable[str]:
        c = self.call
        finish = c.out.finish_reason
        if self.reader is not None:
            cut = finish == "length"
            if line := self._read(self.reader.close(cut), self._new_logprobs()):
                yield line
            if self.reader.message.tool_calls and not cut:
                finish = "tool_calls"
        elif lps := self._new_logprobs():
            yield self._chunk(oa.Delta(content=""), lps=lps)
        yield self._chunk(oa.Delta(), finish)

    @staticmethod
    def usage_chunk(calls: list[Call]) -> str:
        c = calls[0]
        return _sse(oa.ChatCompletionChunk(id=c.id, created=c.created, model=c.model, choices=[], usage=usage(calls)))


class CompletionChunks:
    """The SSE chunks of a streamed completion (and the log-probabilities of a whole one)."""

    def __init__(self, call: Call):
        self.call = call
        self.sent = [0, 0]  # log-probabilities and characters already sent
        self.plain = TextChunk(self._chunk(TextChunk.MARK)) if call.extras.logprobs is None else None

    def logprobs(self) -> Optional[oa.CompletionLogprobs]:
        c = self.call
        if c.extras.logprobs is None:
            return None
        lps = xt.completion_logprobs(c.service.tokenizer, c.out.logprobs[self.sent[0]:], self.sent[1])
        self.sent = [len(c.out.logprobs), self.sent[1] + sum(map(len, lps.tokens))]
        return lps

    def _chunk(self, text: str, finish=None) -> str:
        c = self.call
        return _sse(oa.Completion(id=c.id, created=c.created, model=c.model, choices=[
            oa.CompletionChoice(index=c.index, text=text, finish_reason=finish, logprobs=self.logprobs())]))

    def opening(self) -> Iterable[str]:
        return ()

    def text(self, text: str) -> str | bytes:
        return self.plain(text) if self.plain is not None else self._chunk(text)

    def closing(self) -> Iterable[str]:
        yield self._chunk("", self.call.out.finish_reason)

    @staticmethod
    def usage_chunk(calls: list[Call]) -> str:
        c = calls[0]
        return _sse(oa.Completion(id=c.id, created=c.created, model=c.model, choices=[], usage=usage(calls)))


async def sse_response(calls: list[Call], chunks: list) -> StreamingResponse:
    """Wait for the first delta before the 200 goes out, so errors that happen before any text
    (overload, a failed pipeline) still get their own HTTP status."""
    gen = choice_deltas(calls)
    try:
        first = await gen.__anext__()
    except BaseException:
        await gen.aclose()
        raise
    return StreamingResponse(_events(first, gen, calls, chunks), media_type="text/event-stream")


def _lines(chunks: list, item: tuple[int, Optional[str]]) -> Iterable[str | bytes]:
    """The chunks of one (index, text) item: a text delta ("" sends none: held back, a possible tool
    call), or that choice's closing chunks (its finish reason) when the text is None."""
    i, text = item
    if text is None:
        return chunks[i].closing()
    line = chunks[i].text(text)
    return (line,) if line else ()


async def _events(first: tuple[int, Optional[str]], gen: AsyncIterator, calls: list[Call], chunks: list):
    """The SSE body of a streamed response: each choice's opening chunk, a chunk per text delta, each
    choice's closing chunk (its finish reason) as it ends, then with stream_options.include_usage one
    last chunk with the usage and no choices (OpenAI's shape: usage nowhere else). An error after
    the 200 went out travels in the stream as an OpenAI error object; the stream always ends with [DONE]."""
    try:
        for c in chunks:
            for line in c.opening():
                yield line
        for line in _lines(chunks, first):
            yield line
        async for item in gen:
            for line in _lines(chunks, item):
                yield line
        if calls[0].include_usage:
            yield chunks[0].usage_chunk(calls)
    except APIError as exc:
        yield _sse(json.dumps({"error": {"message": exc.message, "type": exc.type, "code": exc.code}}))
    except Exception as exc:  # noqa: BLE001 - a bug after the 200 went out: still an error event, then [DONE]
        yield _sse(json.dumps({"error": {"message": f"internal error: {type(exc).__name__}: {exc}",
                                         "type": "server_error", "code": "internal_error"}}))
    finally:
        await gen.aclose()
    yield _sse("[DONE]")


# ---------------------------------------------------------------- the other routes


async def models(request: Request):
    service: Service = request.app.state.service
    return oa.ModelList(data=[oa.ModelCard(id=name, created=service.created) for name in service.model_names])


async def health(request: Request):
    """200 while serving; 503 with the reason otherwise: the engine stopped, a drain before the
    server stops, stages being restarted or re-planned, or a recovery that failed (what is left of
    the cluster cannot hold the model). A load balancer sends traffic elsewhere meanwhile."""
    service: Service = request.app.state.service
    loop = service.loop
    if not loop.alive:
        return APIError(503, f"the engine is not running: {loop.fatal}", type_="server_error",
                        code="engine_unavailable").response()
    if loop.draining:
        return APIError(503, "the server is shutting down", type_="server_error", code="shutting_down").response()
    if loop.recovering is not None:
        return APIError(503, f"the stages are being restarted or re-planned after: {loop.recovering}",
                        type_="server_error", code="recovering").response()
    if loop.down is not None:  # a recovery failed: what a lost node left cannot hold the model, ...
        return APIError(503, loop.down, type_="server_error", code="engine_unavailable").response()
    return {"status": "ok", "model": service.model_name, **loop.counts}


async def metrics(request: Request):
    """GET /metrics: Prometheus' text format, vLLM's names where the meaning is the same, beside
    moeray's per-stage numbers (cluster/prometheus.py)."""
    service: Service = request.app.state.service
    body, content_type = await asyncio.to_thread(service.prometheus.exposition)
    return Response(content=body, media_type=content_type)


async def live_profile(request: Request):
    service: Service = request.app.state.service
    try:
        data = await asyncio.to_thread(service.live_profile)
    except MoerayError as exc:
        raise APIError(409, str(exc), type_="invalid_request_error", code="no_routing_yet") from None
    except Exception as exc:  # noqa: BLE001 - a stage not answering right now
        raise APIError(503, f"the stages did not report: {exc}", type_="server_error",
                       code="stages_unavailable") from None
    return Response(content=data, media_type="application/msgpack",
                    headers={"Content-Disposition": 'attachment; filename="profile.msgpack"'})


async def stages(request: Request):
    service: Service = request.app.state.service
    try:
        return JSONResponse(await asyncio.to_thread(service.stages_report))
    except Exception as exc:  # noqa: BLE001 - a stage not answering right now
        raise APIError(503, f"the stages did not report: {exc}", type_="server_error",
                       code="stages_unavailable") from None


async def stages_timeline(request: Request, last: int = 16):
    """The last requests' timelines, raw (cluster/timeline.py): where each one's time went."""
    service: Service = request.app.state.service
    if not 1 <= last <= KEEP_REQUESTS:
        raise APIError(400, f"last must be in [1, {KEEP_REQUESTS}], got {last}", param="last", code="invalid_value")
    return JSONResponse({"requests": service.timelines.last(last)})


# ---------------------------------------------------------------- the app


def error_response(request: Request, exc: APIError) -> Response:
    """An error in the shape of the API the request spoke: OpenAI's, unless an API registered
    another for its paths (app.state.error_shapes: Anthropic's on /v1/messages)."""
    for prefix, shape in getattr(request.app.state, "error_shapes", ()):
        if request.url.path.startswith(prefix):
            return shape(exc)
    return exc.response()


async def _api_error(request, exc: APIError):
    return error_response(request, exc)


async def _invalid(request, exc):
    return error_response(request, _validation_error(exc))


async def _http(request, exc):
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(request, APIError(exc.status_code, str(exc.detail), type_=type_))


async def _unexpected(request: Request, exc: Exception):
    """A bug, not the client's fault: still the API's error shape, logged with its traceback, and the
    server goes on (Starlette answers with this, then re-raises for the log)."""
    return error_response(request, APIError(500, f"internal error while serving {request.url.path}: "
                                            f"{type(exc).__name__}: {exc}", type_="server_error", code="internal_error"))


ARRIVED = edge.ARRIVED  # the scope key of a request's arrival time (perf_counter_ns), noted by the edge


def build_app(service: Service):
    from fastapi import FastAPI

    from moeray.cluster.dashboard import add_dashboard

    app = FastAPI(title="moeray", description="OpenAI-compatible endpoint over a pipeline of MoE stages")
    # Every route's JSON body is checked against the request bounds before its model validates it,
    # and every request passes the edge (Host, key, body size, the door, a client that leaves):
    # cluster/edge.py. Routes added later get both.
    app.router.route_class = edge.CheckedRoute
    app.state.service = service
    app.state.error_shapes = []  # (path prefix, APIError -> Response) of the APIs with their own
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _unexpected)
    app.add_middleware(edge.Edge, service=service)
    app.get("/metrics")(metrics)
    app.post("/v1/chat/completions")(chat_completions)
    app.post("/v1/completions")(completions)
    app.get("/v1/models")(models)
    app.get("/health")(health)
    app.get("/v1/admin/profile")(live_profile)
    app.get("/v1/stages")(stages)
    app.get("/v1/stages/timeline")(stages_timeline)
    # The APIs agents speak, each a translation onto the chat path above
    from moeray.cluster import api_anthropic, api_responses, api_tokens

    for api in (api_anthropic, api_responses, api_tokens):
        api.add_routes(app, service)
    add_dashboard(app, service.opts.api_key)  # GET /dashboard: the live page of the stages (after the edge: see there)
    return app


# ---------------------------------------------------------------- Ray Serve


class MoerayServer:
    """The Serve replica: builds the Service (driver included) in its constructor."""

    def __init__(self, opts: ServeOptions):
        import sys

        # Progress goes to stderr (Ray forwards it to `moeray serve`'s stderr as it happens);
        # `moeray serve` prints the clean plan on stdout once the server is up.
        self.service = Service(opts, log=lambda line: print(line, file=sys.stderr, flush=True))

    def __serve_build_asgi_app__(self):
        return build_app(self.service)

    def check_health(self) -> None:
        # Only a dead engine makes Serve restart the replica (and its stages with it); recovering
        # stages or a drain are /health's 503, not a reason to start over.
        if not self.service.loop.alive:
            raise RuntimeError(f"the engine is not running: {self.service.loop.fatal}")

    async def drain(self, timeout_s: float) -> int:
        """Before Serve stops this replica (`moeray serve` calls it on SIGTERM): admit nothing new,
        let running requests finish for up to `timeout_s`, end the rest with an error (a stream: an
        error event and [DONE]). Returns how many were ended so."""
        ended = await asyncio.to_thread(self.service.loop.drain, timeout_s)
        await asyncio.sleep(0.5)  # the streams write their last events before Serve closes them
        return ended

    def __del__(self):
        try:
            self.service.close()
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass


def deployment(opts: ServeOptions):
    """The Serve application: one replica that owns the driver and the engine. It reserves no
    CPU (the stages do the work; on a 2-core host a whole-CPU replica would starve them)."""
    from ray import serve

    from ray.serve.config import BackpressureConfig

    cls = serve.ingress()(MoerayServer)
    dep = serve.deployment(
        # On the head node: a worker node that leaves takes only its stages, never the engine.
        cls, name="moeray", num_replicas=1, ray_actor_options={"num_cpus": 0, "resources": {HEAD_RESOURCE: 0.001}},
        # A burst must reach the replica's door, which answers a 429 (or a 4xx) in milliseconds, not
        # wait in Serve's queue: room for every running and waiting request and `door_requests` more
        # being answered. Beyond that Serve queues `serve_queue`, then answers 429 itself.
        max_ongoing_requests=opts.engine.max_seqs + opts.max_waiting + opts.door_requests,
        max_queued_requests=opts.serve_queue,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=1),
        # SIGTERM: `moeray serve` drains the replica for drain_s (MoerayServer.drain); Serve's own
        # shutdown (serve run, serve deploy) then waits that long too before it stops the replica.
        health_check_period_s=10, health_check_timeout_s=30, graceful_shutdown_timeout_s=opts.drain_s + 10,
        graceful_shutdown_wait_loop_s=1,
        # A constructor that fails (no placement fits, a bad file) fails the same way again.
        max_constructor_retry_count=1)
    return dep.bind(opts)


def wait_ready(url: str, timeout_s: float = 60.0, api_key: Optional[str] = None) -> dict:
    """Poll GET {url}/health until it answers 200 (bounded)."""
    import urllib.request

    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                return json.loads(r.read())
        except Exception as exc:  # noqa: BLE001 - not up yet
            last = exc
            time.sleep(0.5)
    raise MoerayError(f"{url} did not become ready within {timeout_s:.0f} s ({last})")


__all__ = ["ServeOptions", "Service", "build_app", "deployment", "MoerayServer", "wait_ready",
           "APIError"]
