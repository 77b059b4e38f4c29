"""The OpenAI-compatible HTTP server: a FastAPI app over the engine, deployed with Ray Serve.

Who owns what: the Serve deployment (one replica) owns everything behind it. Its constructor
runs the driver (probe -> plan -> load -> wire, `moeray.cluster.driver.launch`), so the stage actors
are its children, then starts the engine thread and the metrics poller. Restarting the
deployment (or `moeray serve` itself) therefore rebuilds the whole pipeline from the model
file, and a replica that dies takes its stages with it: nothing is left half-wired. Within a
run, a stage that dies is restarted by the engine (RayPipeline.recover) and the server goes on.

`Service` is that owner without Serve (tests and `--local` use it with a one-process
pipeline); `build_app(service)` makes the FastAPI app; `deployment(options)` wraps both for
`serve.run`. The server forwards text: the engine detokenises, finds stop strings and end
tokens, and finishes requests (cluster/engine.py, Scheduler.postprocess).

Routes: POST /v1/chat/completions, POST /v1/completions (JSON or SSE streams), GET /v1/models,
GET /health, GET /v1/stages, GET /v1/admin/profile (the routing served so far, as a profile). Errors use OpenAI's shape {"error": {"message", "type", "param",
"code"}}: 400 malformed JSON / wrong field types / a parameter moeray does not do (named in
"param") / prompt over the context / max_tokens out of range, 401 bad API key, 404 unknown model,
429 too many waiting, 503 engine down, 504 a request that got no token within its deadline. An
error nobody foresaw is still that shape (500, "internal_error") and the server goes on.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Optional

from fastapi import Request
from jinja2.exceptions import TemplateError

from moeray.cluster import openai_schema as oa
from moeray.cluster import request_extras as xt
from moeray.cluster.config import ServeOptions, resolve_model
from moeray.cluster.engine_loop import EngineDownError, EngineLoop, Finished, OverloadedError, Stream
from moeray.cluster.tools import ToolCallStream, parse_tool_calls, template_messages
from moeray.errors import MoerayError
from moeray.stages.sampling import SamplingParams

DEFAULT_MAX_TOKENS = 256  # when a request gives none (capped by the room its prompt leaves)
HEAD_RESOURCE = "node:__internal_head__"  # Ray's resource of the head node


def _rss_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


# ---------------------------------------------------------------- the owner of the engine


class Service:
    """Model, tokenizer, pipeline, engine thread and metrics of one server."""

    def __init__(self, opts: ServeOptions, log=print):
        from moeray.cluster.engine import Engine, LocalPipeline
        from moeray.stages.gguf_file import read_gguf_header
        from moeray.stages.tokenizer import Tokenizer

        self.opts = opts
        self.path = resolve_model(opts.model)
        if opts.model_name:
            self.model_name = opts.model_name
        elif opts.model is None:
            from moeray.stages.default_model import MODEL_NAME

            self.model_name = MODEL_NAME
        else:
            self.model_name = Path(self.path).stem
        header = read_gguf_header(self.path)
        self.header_config = header.config
        engine_cfg = opts.engine
        self.tokenizer = Tokenizer.from_metadata(header.metadata, source=self.path)
        self.created = oa.now()
        self.launched = None
        self.lines: list[str] = []
        if opts.local:
            if opts.launch.torch_threads:
                import torch

                torch.set_num_threads(opts.launch.torch_threads)
            if opts.launch.kernels != "auto":
                from moeray.stages.qmatmul import set_route

                set_route(opts.launch.kernels)
            profile = opts.launch.profile
            if profile is None:  # the embedded default model's recorded routing, as the driver uses
                from moeray.stages.default_profile import default_profile_for

                found = default_profile_for(self.path)
                profile = None if found is None else str(found)
            from moeray.cluster.driver import local_kv_plan

            kv = local_kv_plan(header.config, engine_cfg, opts.local_budget)
            engine_cfg = dataclasses.replace(engine_cfg, max_len=kv.context, kv_blocks=kv.blocks)
            self.local = LocalPipeline.from_file(self.path, kv.blocks, opts.local_budget,
                                                 profile, opts.launch.cache_policy)
            pipeline = self.local
            self.lines.append(f"one process: layers 0-{header.config.n_layers - 1} on {self.local.stage.device.name}")
            self.lines.append(kv.line())
        else:
            from moeray.cluster.driver import launch

            self.launched = launch(self.path, opts.launch, engine_cfg, log=self._log(log))
            pipeline = self.launched.pipeline()
            engine_cfg = self.launched.engine  # the context and the KV blocks the plan settled
        self.engine = Engine(pipeline, engine_cfg, self.tokenizer)
        self.metrics = self.poller = None
        try:
            from moeray.cluster.metrics import Metrics, Poller

            self.metrics = Metrics(self.model_name)
            self.poller = Poller(self.metrics, self.stage_stats, lambda: (self.loop.counts["running"],
                                                                          self.loop.counts["waiting"]),
                                 opts.metrics_interval_s, read_kv=self.kv_report, read_faults=self.faults_report)
        except ImportError:  # no Ray: serve without metrics
            pass
        self.loop = EngineLoop(self.engine, max_waiting=opts.max_waiting, on_tokens=self._on_tokens).start()
        if self.poller is not None:
            self.poller.start()

    @property
    def context(self) -> int:
        """Tokens one sequence can hold: the context, and no more than the whole KV pool (which a
        re-plan after a node loss may change)."""
        return min(self.engine.config.max_len, self.engine.scheduler.kv_tokens)

    def faults_report(self) -> dict:
        """What failed and what was done: the driver's counts and events, and why nothing serves
        now (None while serving)."""
        down = self.loop.down if hasattr(self, "loop") else None
        if self.launched is None:
            return {"stage_failures": self.engine.stats.failures, "down": down, "events": [],
                    "stages_serving": 0 if down else 1}
        return {**self.launched.faults, "down": down or self.launched.down, "events": list(self.launched.events),
                "stages_serving": 0 if (down or self.launched.down) else self.launched.group.n_stages}

    def _log(self, log):
        def say(line: str) -> None:
            self.lines.append(line)
            if log is not None:
                log(line)
        return say

    def _on_tokens(self, s: Stream, n: int, now: float) -> None:
        if self.metrics is None:
            return
        ttft = now - s.t_submit if s.t_last is None else None
        itl = None if s.t_last is None else (now - s.t_last) / n
        self.metrics.tokens(n, ttft, itl)

    def stage_stats(self, timeout_s: float = 10.0):
        """Each stage's live numbers (StageActor.stats: StageStats), with a deadline."""
        stats = [self.local.stage.stats()] if self.launched is None else self.launched.stage_stats(timeout_s)
        kv = self.kv_report()
        for s in stats:
            if s.kv is not None:  # one block table for all stages: the engine's ledger counts for each
                s.kv.update(used=kv["used_blocks"], free=kv["free_blocks"], cached=kv["cached_blocks"])
        return stats

    def live_profile(self) -> bytes:
        """GET /v1/admin/profile: every stage's routed picks per (layer, expert) since it started,
        as one moeray profile with counts: re-plan (`--profile`) with the traffic really served."""
        import numpy as np

        from moeray.planner.profile import Profile

        cfg = self.header_config
        counts = np.zeros((cfg.n_layers, cfg.n_experts), dtype=np.int64)
        for st in self.stage_stats():
            if st.cache and st.cache.get("routed"):
                first, end = st.cache["layers"]
                counts[first:end] += np.asarray(st.cache["routed"], dtype=np.int64)
        if counts.sum() == 0:
            raise MoerayError("no routing decisions yet: serve some requests first")
        return Profile.from_counts(counts).to_bytes()

    def stages_report(self) -> dict:
        """GET /v1/stages: the records become JSON here, at the edge."""
        stats = [dataclasses.asdict(s) for s in self.stage_stats()]
        for s in stats:
            if s.get("cache"):
                s["cache"].pop("per_layer", None)  # per-layer rows: ask the stage; this is the summary
                s["cache"].pop("routed", None)  # the per-expert table: GET /v1/admin/profile
        return {
            "model": self.model_name, "path": self.path, "context": self.context,
            "plan": self.launched.lines if self.launched is not None else self.lines, "stages": stats,
            "engine": {**self.loop.counts, **dataclasses.asdict(self.engine.stats),
                       "max_seqs": self.opts.engine.max_seqs, "alive": self.loop.alive,
                       "last_failure": self.loop.last_failure},
            "kv": self.kv_report(),
            "faults": self.faults_report(),
            "server": {"pid": os.getpid(), "rss_bytes": _rss_bytes()},
        }

    def kv_report(self) -> dict:
        """The engine's KV ledger (read from the HTTP thread: plain counters, a moment stale at worst)."""
        bm = self.engine.scheduler.blocks
        return {"blocks": bm.n_blocks, "block_tokens": bm.block_size, "used_blocks": bm.n_used,
                "free_blocks": bm.n_available, "cached_blocks": bm.n_cached,
                "prefix_reuse": bm.prefix_reuse, "prompt_tokens": bm.stats.prompt_tokens,
                "cached_tokens": bm.stats.cached_tokens, "prefix_hit_rate": bm.hit_rate,
                "preemptions": bm.stats.preemptions}

    def close(self) -> None:
        if self.poller is not None:
            self.poller.stop()
        self.loop.stop()
        if self.launched is not None:
            self.launched.shutdown()


# ---------------------------------------------------------------- errors


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self):
        from fastapi.responses import Response

        body = oa.ErrorResponse(error=oa.ErrorBody(message=self.message, type=self.type, param=self.param,
                                                   code=self.code))
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        # ASCII JSON: a message or param may quote what the client sent, lone surrogates included,
        # which UTF-8 cannot carry; escaped, it goes back as the client wrote it.
        return Response(json.dumps(body.model_dump(), ensure_ascii=True), status_code=self.status,
                        headers=headers, media_type="application/json")


# Errors raised by openai_schema's own checks: their code is their type, their ctx names the parameter.
_SCHEMA_ERRORS = ("unknown_parameter", "unsupported_parameter", "unsupported_value", "invalid_value")


def _validation_error(exc) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "),
                        code="invalid_json")
    loc = [str(p) for p in first.get("loc", []) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if first.get("type") in _SCHEMA_ERRORS:
        param = (first.get("ctx") or {}).get("param", param)
        return APIError(400, msg if param is None or param in msg else f"{param}: {msg}", param=param,
                        code=first["type"])
    if param is None and first.get("type") in ("model_attributes_type", "dict_type"):
        return APIError(400, "the request body must be a JSON object", code="invalid_json")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


# ---------------------------------------------------------------- one request, as text


@dataclass
class Prepared:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int


def prepare(service: Service, body: oa._Request, prompt: list[int]) -> Prepared:
    """Check the model, the prompt length and max_tokens; build the sampling params."""
    if body.model != service.model_name:
        raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{service.model_name}'",
                       param="model", code="model_not_found")
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
        wanted = min(DEFAULT_MAX_TOKENS, room)
    elif wanted < 1:
        raise APIError(400, f"{param} must be at least 1, got {wanted}", param=param, code="invalid_value")
    elif wanted > room:
        raise APIError(400, f"{param} is {wanted}, but this model's context is {service.context} tokens and the "
                       f"prompt has {len(prompt)}: at most {room} can be generated", param=param,
                       code="context_length_exceeded")
    if not service.tokenizer.vocab_size > max(prompt) >= 0 or min(prompt) < 0:
        raise APIError(400, f"token ids must be in [0, {service.tokenizer.vocab_size})", param="prompt",
                       code="invalid_value")
    try:
        params = SamplingParams(max_tokens=wanted, temperature=float(body.temperature or 0.0),
                                top_p=float(body.top_p if body.top_p is not None else 1.0),
                                seed=body.seed, stop=body.stop_strings())
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from None
    return Prepared(prompt, params, wanted)


@dataclass
class Outcome:
    text: str = ""
    finish_reason: Optional[str] = None
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV a cached prefix supplied
    done: bool = False
    logprobs: list = dataclasses.field(default_factory=list)  # TokenLogprobs so far, when asked for


async def text_deltas(service: Service, prep: Prepared, outcome: Outcome) -> AsyncIterator[str]:
    """The request's text as the engine releases it; `outcome` holds the finish reason and token
    count when it ends. A consumer that stops early (a client that went away) frees the sequence."""
    try:
        stream = service.loop.submit(prep.prompt, prep.params)
    except OverloadedError as exc:
        raise APIError(429, str(exc), type_="rate_limit_error", code="overloaded") from None
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
                                   code="pipeline_failed")
                outcome.finish_reason, outcome.done = item.reason, True
                outcome.cached_tokens = stream.req.cached_tokens if stream.req is not None else 0
                return
            outcome.completion_tokens += item.n_tokens
            outcome.logprobs.extend(item.logprobs)
            if item.text:
                parts.append(item.text)
                yield item.text
    finally:
        outcome.text = "".join(parts)
        service.loop.abort(stream)  # gone early (client left, error): the engine drops the sequence


# ---------------------------------------------------------------- the app


def _sse(obj) -> str:
    data = obj if isinstance(obj, str) else obj.model_dump_json(exclude_none=False)
    return f"data: {data}\n\n"


def build_app(service: Service):
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="moeray", description="OpenAI-compatible endpoint over a pipeline of MoE stages")
    api_key = service.opts.api_key

    @app.exception_handler(APIError)
    async def _api_error(_request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, exc):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request, exc):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type_=type_).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        """A bug, not the client's fault: still OpenAI's shape, logged with its traceback, and the
        server goes on (Starlette answers with this, then re-raises for the log)."""
        return APIError(500, f"internal error while serving {request.url.path}: {type(exc).__name__}: {exc}",
                        type_="server_error", code="internal_error").response()

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            token = given[7:].strip() if given[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), api_key.encode()):
                return APIError(401, "incorrect API key provided" if token else "no API key provided "
                                "(send 'Authorization: Bearer KEY')", code="invalid_api_key").response()
        return await call_next(request)

    def usage(prompt_tokens: int, out: Outcome) -> oa.Usage:
        return oa.Usage(prompt_tokens=prompt_tokens, completion_tokens=out.completion_tokens,
                        total_tokens=prompt_tokens + out.completion_tokens,
                        prompt_tokens_details=oa.PromptTokensDetails(cached_tokens=out.cached_tokens))

    async def collect(request: Request, prep: Prepared, out: Outcome) -> str:
        """A whole completion; stops (and frees the sequence) if the client disconnects."""
        parts: list[str] = []
        gen = text_deltas(service, prep, out)
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
                    parts.append(next_part.result())
                except StopAsyncIteration:
                    return "".join(parts)
        finally:
            if next_part is not None and not next_part.done():
                next_part.cancel()
                try:
                    await next_part
                except BaseException:  # noqa: BLE001 - its own cancellation
                    pass
            await gen.aclose()

    def bad_request(message: str, param: str) -> APIError:
        return APIError(400, message, param=param, code="invalid_value")

    @app.post("/v1/chat/completions")
    async def chat(body: oa.ChatCompletionRequest, request: Request):
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text(),
                     **m.model_dump(include={"name", "tool_calls", "tool_call_id"}, exclude_none=True)}
                    for m in body.messages]
        extras = xt.chat_extras(service, body, bad_request)
        try:
            prompt = service.tokenizer.encode_chat(template_messages(messages), tools=extras.tools)
        except MoerayError as exc:
            raise APIError(400, str(exc), param="messages") from None
        except TemplateError as exc:  # the template's own raise_exception(...): roles out of order, ...
            raise APIError(400, f"the model's chat template rejected the messages: {exc}", param="messages",
                           code="invalid_value") from None
        prep = prepare(service, body, prompt)
        await asyncio.to_thread(xt.check_extras, service, extras, bad_request)
        prep.params = xt.apply(prep.params, extras)
        rid, created, out = oa.new_id("chatcmpl"), oa.now(), Outcome()

        def logprobs(lps):
            return xt.chat_logprobs(service.tokenizer, lps) if extras.logprobs is not None else None

        if not body.stream:
            text = await collect(request, prep, out)
            content, calls = parse_tool_calls(text) if extras.tools else (text, [])
            message = oa.ResponseMessage(content=(content or None) if calls else content, tool_calls=[
                oa.ToolCallOut(id=c.id, function=oa.ToolCallFunction(name=c.name, arguments=c.arguments))
                for c in calls] or None)
            return oa.ChatCompletion(id=rid, created=created, model=service.model_name, choices=[
                oa.ChatChoice(message=message, finish_reason="tool_calls" if calls else out.finish_reason,
                              logprobs=logprobs(out.logprobs))],
                usage=usage(len(prompt), out))
        gen = text_deltas(service, prep, out)
        first = await _first_or_error(gen)
        held = ToolCallStream() if extras.tools else None
        sent_lp = [0]

        def new_logprobs():
            lps, sent_lp[0] = out.logprobs[sent_lp[0]:], len(out.logprobs)
            return logprobs(lps) if lps else None

        def chunk(delta: oa.Delta, finish=None, use=None, lps=None) -> str:
            return _sse(oa.ChatCompletionChunk(id=rid, created=created, model=service.model_name, choices=[
                oa.ChatChunkChoice(delta=delta, finish_reason=finish, logprobs=lps)], usage=use))

        def content_chunk(text: str) -> str:
            if held is not None:
                text = held.push(text)
            lps = new_logprobs()
            return chunk(oa.Delta(content=text), lps=lps) if text or lps else ""

        def closing():
            finish = out.finish_reason
            rest, calls = held.finish() if held is not None else ("", [])
            lps = new_logprobs()
            if rest or lps:
                yield chunk(oa.Delta(content=rest), lps=lps)
            if calls:
                finish = "tool_calls"
                yield chunk(oa.Delta(tool_calls=[
                    oa.ToolCallDelta(index=i, id=c.id, function=oa.ToolCallFunction(name=c.name, arguments=c.arguments))
                    for i, c in enumerate(calls)]))
            yield chunk(oa.Delta(), finish, usage(len(prompt), out))
            if body.include_usage_in_stream():
                yield _sse(oa.ChatCompletionChunk(id=rid, created=created, model=service.model_name,
                                                  choices=[], usage=usage(len(prompt), out)))

        events = _events(first, gen, content_chunk, closing,
                         opening=chunk(oa.Delta(role="assistant", content="")))
        return StreamingResponse(events, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: oa.CompletionRequest, request: Request):
        prompt = service.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        extras = xt.completion_extras(service, body, bad_request)
        prep = prepare(service, body, prompt)
        await asyncio.to_thread(xt.check_extras, service, extras, bad_request)
        prep.params = xt.apply(prep.params, extras)
        rid, created, out = oa.new_id("cmpl"), oa.now(), Outcome()
        sent = [0, 0]  # log-probabilities and characters already sent

        def logprobs():
            if extras.logprobs is None:
                return None
            lps = xt.completion_logprobs(service.tokenizer, out.logprobs[sent[0]:], sent[1])
            sent[0], sent[1] = len(out.logprobs), sent[1] + sum(map(len, lps.tokens))
            return lps

        if not body.stream:
            text = await collect(request, prep, out)
            return oa.Completion(id=rid, created=created, model=service.model_name, choices=[
                oa.CompletionChoice(text=text, finish_reason=out.finish_reason, logprobs=logprobs())],
                usage=usage(len(prompt), out))
        gen = text_deltas(service, prep, out)
        first = await _first_or_error(gen)

        def chunk(text: str, finish=None, use=None) -> str:
            return _sse(oa.Completion(id=rid, created=created, model=service.model_name, choices=[
                oa.CompletionChoice(text=text, finish_reason=finish, logprobs=logprobs())], usage=use))

        def closing():
            yield chunk("", out.finish_reason, usage(len(prompt), out))
            if body.include_usage_in_stream():
                yield _sse(oa.Completion(id=rid, created=created, model=service.model_name, choices=[],
                                         usage=usage(len(prompt), out)))

        return StreamingResponse(_events(first, gen, chunk, closing), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models():
        return oa.ModelList(data=[oa.ModelCard(id=service.model_name, created=service.created)])

    @app.get("/health")
    async def health():
        if not service.loop.alive:
            return APIError(503, f"the engine is not running: {service.loop.fatal}", type_="server_error",
                            code="engine_unavailable").response()
        if service.loop.down is not None:
            return APIError(503, service.loop.down, type_="server_error", code="engine_unavailable").response()
        return {"status": "ok", "model": service.model_name, **service.loop.counts}

    @app.get("/v1/admin/profile")
    async def live_profile():
        try:
            data = await asyncio.to_thread(service.live_profile)
        except MoerayError as exc:
            raise APIError(409, str(exc), type_="invalid_request_error", code="no_routing_yet") from None
        except Exception as exc:  # noqa: BLE001 - a stage not answering right now
            raise APIError(503, f"the stages did not report: {exc}", type_="server_error",
                           code="stages_unavailable") from None
        return Response(content=data, media_type="application/msgpack",
                        headers={"Content-Disposition": 'attachment; filename="profile.msgpack"'})

    @app.get("/v1/stages")
    async def stages():
        try:
            return JSONResponse(await asyncio.to_thread(service.stages_report))
        except Exception as exc:  # noqa: BLE001 - a stage not answering right now
            raise APIError(503, f"the stages did not report: {exc}", type_="server_error",
                           code="stages_unavailable") from None

    from moeray.cluster.dashboard import add_dashboard

    add_dashboard(app, api_key)  # GET /dashboard: the live page of the stages (after _auth: see there)
    return app


_NOTHING = object()


async def _first_or_error(gen: AsyncIterator[str]):
    """Wait for the first delta before the 200 goes out, so errors that happen before any text
    (overload, a failed pipeline) still get their own HTTP status."""
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return _NOTHING
    except BaseException:
        await gen.aclose()
        raise


async def _chain(first, gen: AsyncIterator[str]) -> AsyncIterator[str]:
    if first is not _NOTHING:
        yield first
        async for delta in gen:
            yield delta


async def _events(first, gen: AsyncIterator[str], text_chunk, closing, opening: str | None = None):
    """The SSE body of a streamed response: the opening chunk, one chunk per text delta, then the
    closing chunks (finish reason, usage), read once the text is done. An error after the 200 went
    out travels in the stream as an OpenAI error object; the stream always ends with [DONE]."""
    try:
        if opening is not None:
            yield opening
        async for delta in _chain(first, gen):
            if line := text_chunk(delta):  # "" while text is held back (a possible tool call)
                yield line
        for line in closing():
            yield line
    except APIError as exc:
        yield _sse(json.dumps({"error": {"message": exc.message, "type": exc.type, "code": exc.code}}))
    except Exception as exc:  # noqa: BLE001 - a bug after the 200 went out: still an error event, then [DONE]
        yield _sse(json.dumps({"error": {"message": f"internal error: {type(exc).__name__}: {exc}",
                                         "type": "server_error", "code": "internal_error"}}))
    finally:
        await gen.aclose()
    yield _sse("[DONE]")


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
        if not self.service.loop.alive:
            raise RuntimeError(f"the engine is not running: {self.service.loop.fatal}")

    def __del__(self):
        try:
            self.service.close()
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass


def deployment(opts: ServeOptions):
    """The Serve application: one replica that owns the driver and the engine. It reserves no
    CPU (the stages do the work; on a 2-core host a whole-CPU replica would starve them)."""
    from ray import serve

    cls = serve.ingress()(MoerayServer)
    dep = serve.deployment(
        # On the head node: a worker node that leaves takes only its stages, never the engine.
        cls, name="moeray", num_replicas=1, ray_actor_options={"num_cpus": 0, "resources": {HEAD_RESOURCE: 0.001}},
        # Requests beyond the engine's waiting limit must reach it to get their 429.
        max_ongoing_requests=opts.engine.max_seqs + opts.max_waiting + 16,
        health_check_period_s=10, health_check_timeout_s=30, graceful_shutdown_timeout_s=5,
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
