"""The serve edge: what every request meets before a route runs, the same for every route (the
OpenAI routes and any API added beside them), so a new route has these defences by construction.

`Edge`, the app's outermost middleware of its own (plain ASGI, cluster/serve_app.py build_app):

1. **Host**: a Host header the server does not answer (`--allowed-hosts`; by default the loopback
   names when it binds a loopback address) is a 403. A web page that rebinds its own DNS name to
   127.0.0.1 can make a browser send requests here, but they name the page's host.
2. **The API key** (`--api-key`) on every route but `/health`, the live page (which checks its own
   cookie) and, with `--open-metrics`, `/metrics`; compared in constant time.
3. **The body**: a Content-Length over `max_body_bytes` is a 413 before a byte of it is read; a
   chunked body is counted as it arrives and cut off there.
4. **The door** (a generating POST: chat, completions, messages, responses): while the server
   drains (SIGTERM) a 503; when the queue is full a 429 with Retry-After, before the body is read,
   rendered or tokenised, so a burst is refused in milliseconds (EngineLoop.door). The ticket the
   door gives is taken over when the request is submitted (`take_ticket`), else let go at its end.
5. **A client that leaves** (it closes the connection before its first token, while it waits for a
   slot, or gives up on a non-streaming reply): the route's task is cancelled at once; the
   engine's sequence is aborted on the way out (serve_app.text_deltas).

`CheckedRoute`, the app's route class: the JSON body is parsed once (on a worker thread when it is
large) and checked against the request bounds (`check_body`) before FastAPI validates it into a
model: JSON nested too deep, too many messages, stop strings, logit_bias entries or tools, a JSON
schema too deep or too large are each a 400 naming the field, never a crash, a reset or a 500.
"""
from __future__ import annotations

import asyncio
import contextvars
import hmac
import json
import time
from typing import Any, Optional

from fastapi.routing import APIRoute

from moeray.cluster.config import RequestLimits

# Routes that generate: POSTs to these pass the door (any prefix: /v1/..., an alias without it).
GENERATING = ("/chat/completions", "/completions", "/messages", "/responses")
# Open without the key: load balancers' health checks; the live page checks its own cookie.
OPEN_PATHS = ("/health",)
OPEN_PREFIXES = ("/dashboard",)
PARSE_ON_THREAD_BYTES = 1 << 20  # a body larger than this is parsed off the event loop

ARRIVED = "moeray.arrived"  # the scope key of a request's arrival time (perf_counter_ns: cluster/timeline.py)
_ticket: contextvars.ContextVar = contextvars.ContextVar("moeray_door_ticket", default=None)


def take_ticket():
    """The door's ticket of the request being served (None when it passed no door): the engine
    loop's submit takes it over."""
    return _ticket.get()


class APIError(Exception):
    """An error a request gets: its HTTP status, OpenAI's error fields (cluster/serve_app.py
    error_response gives it the shape of the API the request spoke)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self):
        from fastapi.responses import Response

        from moeray.cluster import openai_schema as oa

        body = oa.ErrorResponse(error=oa.ErrorBody(message=self.message, type=self.type, param=self.param,
                                                   code=self.code))
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        # ASCII JSON: a message or param may quote what the client sent, lone surrogates included,
        # which UTF-8 cannot carry; escaped, it goes back as the client wrote it.
        return Response(json.dumps(body.model_dump(), ensure_ascii=True), status_code=self.status,
                        headers=headers, media_type="application/json")


def error_body(message: str, type_: str, code: Optional[str], param: Optional[str] = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}},
                      ensure_ascii=True).encode()


async def send_error(send, status: int, message: str, type_: str = "invalid_request_error",
                     code: Optional[str] = None, param: Optional[str] = None, close: bool = False) -> None:
    body = error_body(message, type_, code, param)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status in (429, 503):
        headers.append((b"retry-after", b"1"))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def host_of(value: str) -> str:
    """The name in a Host header, without its port ('[::1]:8000' -> '::1')."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value[1:]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


DISCARD_BYTES = 256 << 20  # of a body over the bound, read and dropped before the 413 (then: closed)
DISCARD_S = 30.0


async def _discard(receive, most: int) -> None:
    """Read and drop what is left of a request's body (at most `most` bytes, DISCARD_S seconds):
    a client still sending it then reads the 413 instead of a reset."""

    async def drop() -> None:
        n = 0
        while n <= min(most, DISCARD_BYTES):
            msg = await receive()
            if msg["type"] != "http.request" or not msg.get("more_body", False):
                return
            n += len(msg.get("body", b""))

    try:
        await asyncio.wait_for(drop(), DISCARD_S)
    except asyncio.TimeoutError:
        pass


class Edge:
    """ASGI middleware: Host, key, body size, the door, and a client that leaves (module doc)."""

    def __init__(self, app, service):
        self.app, self.service = app, service
        opts = service.opts
        self.allowed = None if opts.allowed_hosts is None else {h.lower() for h in opts.allowed_hosts}
        self.key = opts.api_key
        self.metrics_need_key = opts.metrics_need_key
        self.max_body = opts.limits.max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[ARRIVED] = time.perf_counter_ns()
        headers = dict(scope.get("headers") or [])
        path = scope.get("path", "")
        if self.allowed is not None:
            host = host_of(headers.get(b"host", b"").decode("latin-1"))
            if host not in self.allowed:
                return await send_error(
                    send, 403, f"this server does not answer requests for host {host!r}; it answers "
                    f"{', '.join(sorted(self.allowed))} (--allowed-hosts)", code="host_not_allowed", close=True)
        if self.key and self._needs_key(path):
            # `Authorization: Bearer KEY` as OpenAI's clients send it, or `x-api-key: KEY` as Anthropic's do
            given = headers.get(b"authorization", b"").decode("latin-1")
            token = (given[7:] if given[:7].lower() == "bearer " else headers.get(b"x-api-key", b"").decode("latin-1"))
            token = token.strip()
            if not hmac.compare_digest(token.encode(), self.key.encode()):
                return await self._refuse(scope, receive, send, 401, "incorrect API key provided" if token else
                                          "no API key provided (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                                          code="invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await _discard(receive, int(length))  # so the client, still sending, reads the answer
            return await send_error(send, 413, self._too_large(int(length)), code="request_too_large", close=True)
        ticket = None
        if scope.get("method") == "POST" and path.rstrip("/").endswith(GENERATING):
            from moeray.cluster.engine_loop import EngineDownError, OverloadedError, ShuttingDownError

            try:
                ticket = self.service.loop.door()
            except OverloadedError as exc:
                return await self._refuse(scope, receive, send, 429, str(exc), "rate_limit_error", "overloaded")
            except ShuttingDownError as exc:
                return await self._refuse(scope, receive, send, 503, str(exc), "server_error", "shutting_down",
                                          close=True)
            except EngineDownError as exc:
                return await self._refuse(scope, receive, send, 503, str(exc), "server_error", "engine_unavailable")
        token = _ticket.set(ticket)
        try:
            await self._until_disconnect(scope, receive, send)
        finally:
            _ticket.reset(token)
            if ticket is not None:
                ticket.release()

    async def _refuse(self, scope, receive, send, status: int, message: str, type_: str = "invalid_request_error",
                      code: Optional[str] = None, close: bool = False) -> None:
        """An error the edge answers itself, in the shape of the API the request spoke: an API with
        its own shape registers it for its paths (app.state.error_shapes: Anthropic's on
        /v1/messages); OpenAI's otherwise."""
        path = scope.get("path", "")
        state = getattr(scope.get("app"), "state", None)
        shape = next((fn for prefix, fn in getattr(state, "error_shapes", ()) if path.startswith(prefix)), None)
        if shape is None:
            return await send_error(send, status, message, type_, code, close=close)
        response = shape(APIError(status, message, type_=type_, code=code))
        if status in (429, 503):
            response.headers["retry-after"] = "1"
        if close:
            response.headers["connection"] = "close"
        await response(scope, receive, send)

    def _needs_key(self, path: str) -> bool:
        if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return False
        return self.metrics_need_key or path != "/metrics"

    def _too_large(self, n: int) -> str:
        return (f"the request body is {n} bytes or more; this server takes at most {self.max_body} "
                "(--max-body-bytes)")

    async def _until_disconnect(self, scope, receive, send) -> None:
        """Run the route on a task of its own; one reader of `receive` hands the body over as the
        route asks for it and, once the body is in, waits for the client to leave: then the
        route's task is cancelled (unless its answer is complete)."""
        messages: asyncio.Queue = asyncio.Queue()
        state = {"answered": False, "left": False, "too_large": 0, "started": False}
        discarded = asyncio.Event()

        async def read() -> None:
            size = 0
            while True:
                msg = await receive()
                if msg["type"] == "http.request":
                    size += len(msg.get("body", b""))
                    if size > self.max_body:
                        state["too_large"] = size
                        route.cancel()
                        if msg.get("more_body", False):
                            await _discard(receive, DISCARD_BYTES)
                        discarded.set()
                        return
                    await messages.put(msg)
                    continue
                await messages.put(msg)  # http.disconnect: the route's own reads see it too
                if msg["type"] == "http.disconnect":
                    state["left"] = True
                    if not state["answered"]:
                        route.cancel()
                    return

        async def sending(msg) -> None:
            if msg["type"] == "http.response.start":
                state["started"] = True
            elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
                state["answered"] = True
            await send(msg)

        route = asyncio.ensure_future(self.app(scope, messages.get, sending))
        reader = asyncio.ensure_future(read())
        try:
            await route
        except asyncio.CancelledError:
            if state["too_large"] and not state["started"]:
                try:
                    await asyncio.wait_for(discarded.wait(), DISCARD_S)
                except asyncio.TimeoutError:
                    pass
                await send_error(send, 413, self._too_large(state["too_large"]), code="request_too_large",
                                 close=True)
                return
            if not state["left"]:
                raise  # cancelled from outside (the server stops): not ours to swallow
        finally:
            reader.cancel()
            if not route.done():
                route.cancel()


# ---------------------------------------------------------------- the body's bounds


class BoundError(Exception):
    """A request beyond one of the bounds: the 400 (or 413) to answer, naming the field."""

    def __init__(self, message: str, param: Optional[str], code: str, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


def _depth_and_size(obj: Any, max_depth: int, max_nodes: int) -> tuple[int, int]:
    """(nesting depth, values) of a JSON value, walked without recursion; stops early past either
    bound (then the figures are the bound + 1)."""
    stack, depth, nodes = [(obj, 1)], 0, 0
    while stack:
        x, d = stack.pop()
        nodes += 1
        if d > depth:
            depth = d
        if depth > max_depth or nodes > max_nodes:
            return depth, nodes
        if isinstance(x, dict):
            stack.extend((v, d + 1) for v in x.values())
        elif isinstance(x, list):
            stack.extend((v, d + 1) for v in x)
    return depth, nodes


def _schemas(body: dict) -> list[tuple[str, str, Any]]:
    """(param, where, schema) of every JSON schema a body carries, whatever API it speaks:
    chat's tools[].function.parameters and response_format.json_schema.schema; the Responses
    API's tools[].parameters and text.format.schema; Messages' tools[].input_schema."""
    out = []
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function")
        for where, schema in ((f"tools[{i}].function.parameters", fn.get("parameters") if isinstance(fn, dict) else None),
                              (f"tools[{i}].parameters", tool.get("parameters")),
                              (f"tools[{i}].input_schema", tool.get("input_schema"))):
            if schema is not None:
                out.append(("tools", where, schema))
    fmt = body.get("response_format")
    if isinstance(fmt, dict):
        js = fmt.get("json_schema")
        if isinstance(js, dict) and js.get("schema") is not None:
            out.append(("response_format", "response_format.json_schema.schema", js["schema"]))
        elif fmt.get("schema") is not None:
            out.append(("response_format", "response_format.schema", fmt["schema"]))
    text = body.get("text")
    if isinstance(text, dict) and isinstance(text.get("format"), dict) and text["format"].get("schema") is not None:
        out.append(("text", "text.format.schema", text["format"]["schema"]))
    return out


def check_body(body: Any, limits: RequestLimits) -> None:
    """Raise BoundError for the first bound `body` (a parsed JSON request) goes beyond."""
    if not isinstance(body, dict):
        body = {"": body}  # not an object (the route's validation says so): only its nesting is bounded
    for name in ("messages", "input"):
        items = body.get(name)
        if isinstance(items, list) and len(items) > limits.max_messages:
            raise BoundError(f"'{name}' has {len(items)} items; this server takes at most {limits.max_messages} "
                             "(--max-messages)", name, "array_above_max_length")
    for name in ("stop", "stop_sequences"):
        stop = body.get(name)
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
        if len(stops) > limits.max_stop:
            raise BoundError(f"'{name}' has {len(stops)} stop strings; this server takes at most {limits.max_stop} "
                             "(--max-stop)", name, "array_above_max_length")
        for s in stops:
            if isinstance(s, str) and len(s) > limits.max_stop_chars:
                raise BoundError(f"a stop string of '{name}' has {len(s)} characters; this server takes at most "
                                 f"{limits.max_stop_chars} (--max-stop-chars)", name, "string_above_max_length")
    bias = body.get("logit_bias")
    if isinstance(bias, dict) and len(bias) > limits.max_logit_bias:
        raise BoundError(f"'logit_bias' has {len(bias)} entries; this server takes at most {limits.max_logit_bias} "
                         "(--max-logit-bias)", "logit_bias", "object_above_max_size")
    tools = body.get("tools")
    if isinstance(tools, list) and len(tools) > limits.max_tools:
        raise BoundError(f"'tools' has {len(tools)} tools; this server takes at most {limits.max_tools} (--max-tools)",
                         "tools", "array_above_max_length")
    for param, where, schema in _schemas(body):
        depth, nodes = _depth_and_size(schema, limits.max_schema_depth, limits.max_schema_nodes)
        if depth > limits.max_schema_depth:
            raise BoundError(f"the JSON schema {where} is nested more than {limits.max_schema_depth} deep "
                             "(--max-schema-depth)", param, "schema_too_deep")
        if nodes > limits.max_schema_nodes:
            raise BoundError(f"the JSON schema {where} has more than {limits.max_schema_nodes} values "
                             "(--max-schema-nodes)", param, "schema_too_large")
    depth, _ = _depth_and_size(body, limits.max_json_depth, 1 << 62)
    if depth > limits.max_json_depth:
        raise BoundError(f"the request's JSON is nested more than {limits.max_json_depth} deep (--max-json-depth)",
                         None, "json_too_deep")


class CheckedRoute(APIRoute):
    """A route whose JSON body is parsed once (off the event loop when large: FastAPI then reuses
    it) and checked against the server's RequestLimits before the route's model validates it."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def checked(request):
            if request.method in ("POST", "PUT", "PATCH"):
                problem = await _parse_and_check(request)
                if problem is not None:
                    from fastapi.responses import Response

                    return Response(error_body(problem.message, "invalid_request_error", problem.code, problem.param),
                                    status_code=problem.status, media_type="application/json")
            return await handler(request)

        return checked


async def _parse_and_check(request) -> Optional[BoundError]:
    body = await request.body()
    if not body:
        return None
    try:
        obj = await asyncio.to_thread(json.loads, body) if len(body) > PARSE_ON_THREAD_BYTES else json.loads(body)
    except RecursionError:
        limits = request.app.state.service.opts.limits
        return BoundError(f"the request's JSON is nested more than {limits.max_json_depth} deep (--max-json-depth)",
                          None, "json_too_deep")
    except ValueError:
        return None  # not JSON: FastAPI's own parse names the error
    request._json = obj  # what FastAPI's handler reads (Request.json() keeps it)
    limits = request.app.state.service.opts.limits
    try:
        if len(body) > PARSE_ON_THREAD_BYTES:
            await asyncio.to_thread(check_body, obj, limits)
        else:
            check_body(obj, limits)
    except BoundError as exc:
        return exc
    return None
