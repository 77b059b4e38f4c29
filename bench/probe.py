"""A hostile client's probe of a running moeray server: clients that leave, a burst, malformed and
oversized requests, the network edge and operations.

    python bench/probe.py --url http://127.0.0.1:8000 --api-key KEY [--json out.json]
    python bench/probe.py --url ... --only leave,input         # some groups
    python bench/probe.py --url ... --sigterm PID              # last: SIGTERM the server mid-stream

Each case sends what a careless or hostile client sends and checks what a user would notice: the
HTTP status, the error's `param` and `code`, and (for a request that costs the server work) that a
small request sent beside it finishes within a bound (--beside-s; default five times the small
request's own latency, at least 1.5 s). A client that leaves must free what it held at once: the
engine's running and waiting counts (GET /v1/stages) are back where they were within --abort-s.
Prints one line per case and exits 1 when any fails; --json PATH writes every case.

The cases want a server started with a key (--api-key), a small context (--max-len 1024), a few
sequence slots (--max-seqs 4) and a short queue (--max-waiting 8): tests/e2e/test_hostile_probe.py
starts `moeray serve` so, on Ray stages and with --local. `INPUTS` (the malformed and oversized
bodies) is what bench/chaos.py mixes into its traffic.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional
from urllib.parse import urlparse

MiB = 1 << 20

# ---------------------------------------------------------------- HTTP, plainly


@dataclass
class Reply:
    status: int = 0
    headers: dict = field(default_factory=dict)
    body: bytes = b""
    seconds: float = 0.0
    error: str = ""  # a reset, a timeout, a refused connection: no HTTP answer

    def json(self):
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    @property
    def err(self) -> dict:
        obj = self.json()
        return obj.get("error") or {} if isinstance(obj, dict) and isinstance(obj.get("error"), dict) else {}


class Server:
    def __init__(self, url: str, key: Optional[str]):
        u = urlparse(url)
        self.url, self.host, self.port, self.key = url, u.hostname, u.port, key
        self.model = ""
        self.end_ids: list[int] = []
        self.context = 1024
        self.max_seqs = 4

    def headers(self, extra: Optional[dict] = None, key: bool = True) -> dict:
        h = {"Content-Type": "application/json"}
        if key and self.key:
            h["Authorization"] = f"Bearer {self.key}"
        h.update(extra or {})
        return h

    def request(self, method: str, path: str, body: bytes | None = None, headers: Optional[dict] = None,
                timeout: float = 120.0, key: bool = True, chunked: bool = False) -> Reply:
        t = time.monotonic()
        c = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            h = self.headers(headers, key)
            if chunked:
                c.putrequest(method, path, skip_host="Host" in h)
                for k, v in {**h, "Transfer-Encoding": "chunked"}.items():
                    c.putheader(k, v)
                c.endheaders()
                for i in range(0, len(body or b""), MiB):
                    part = body[i:i + MiB]
                    try:
                        c.send(b"%x\r\n%s\r\n" % (len(part), part))
                    except OSError:
                        break  # the server answered (413) and closed before the body ended
                else:
                    c.send(b"0\r\n\r\n")
            else:
                c.request(method, path, body=body, headers=h)
            r = c.getresponse()
            return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read(), time.monotonic() - t)
        except (OSError, http.client.HTTPException) as exc:
            return Reply(error=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - t)
        finally:
            c.close()

    def post(self, path: str, obj, **kw) -> Reply:
        return self.request("POST", path, json.dumps(obj).encode() if not isinstance(obj, bytes) else obj, **kw)

    def get(self, path: str, **kw) -> Reply:
        return self.request("GET", path, **kw)

    def stages(self) -> dict:
        r = self.get("/v1/stages", timeout=30)
        return r.json() or {}

    def engine(self) -> dict:
        return self.stages().get("engine", {})

    def chat(self, content: str, **extra) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": content}], **extra}

    def no_end(self) -> dict:
        """logit_bias that bans the end tokens: a request then runs to its max_tokens."""
        return {str(i): -100 for i in self.end_ids}

    def small(self) -> float:
        """The small request a case sends beside its own: seconds until its whole answer."""
        r = self.post("/v1/chat/completions", self.chat("Say hi.", max_tokens=4), timeout=60)
        return r.seconds if r.status == 200 else float("inf")


def open_socket(srv: Server, method: str, path: str, body: bytes, extra_headers: str = "") -> socket.socket:
    """A raw connection that has sent a whole request: the case decides when to leave."""
    s = socket.create_connection((srv.host, srv.port), timeout=30)
    auth = f"Authorization: Bearer {srv.key}\r\n" if srv.key else ""
    s.sendall(f"{method} {path} HTTP/1.1\r\nHost: {srv.host}:{srv.port}\r\nContent-Type: application/json\r\n"
              f"{auth}{extra_headers}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


# ---------------------------------------------------------------- results


@dataclass
class Result:
    name: str
    group: str
    ok: bool
    status: int | str = ""
    param: str | None = None
    code: str | None = None
    beside_s: float | None = None
    detail: str = ""


@dataclass
class Input:
    """One malformed or oversized request: what it sends, the answer it must get."""
    name: str
    build: Callable[[Server], tuple]  # -> (method, path, body bytes, extra headers, chunked)
    status: int | tuple  # the status (or any of several) it must get
    param: str | None = None  # the error's param, when it must name one ("*": any)
    code: str | None = None  # the error's code, when it must be one
    beside: bool = True  # check that a small request beside it is not slowed


def _deep(n: int, leaf=None) -> dict:
    obj = leaf if leaf is not None else {"type": "string"}
    for _ in range(n):
        obj = {"type": "object", "properties": {"x": obj}}
    return obj


def _chat_body(extra: dict, content: str = "Hi.", **msg) -> Callable[[Server], tuple]:
    def build(srv: Server):
        body = {"model": srv.model, "messages": [{"role": "user", "content": content, **msg}], "max_tokens": 4, **extra}
        return "POST", "/v1/chat/completions", json.dumps(body).encode(), {}, False
    return build


def _raw(path: str, body: bytes, headers: Optional[dict] = None, method: str = "POST", chunked: bool = False):
    return lambda srv: (method, path, body, headers or {}, chunked)


def _messages(srv: Server, messages: list, **extra) -> bytes:
    return json.dumps({"model": srv.model, "messages": messages, "max_tokens": 4, **extra}).encode()


def _big_body(n: int) -> Callable[[Server], bytes]:
    return lambda srv: json.dumps({"model": srv.model, "max_tokens": 4,
                                   "messages": [{"role": "user", "content": "a " * (n // 2)}]}).encode()


def _fields(n: int) -> dict:
    return {"type": "object", "properties": {f"f{i}": {"type": "integer"} for i in range(n)}}


INPUTS: list[Input] = [
    # the body itself
    Input("invalid JSON", _raw("/v1/chat/completions", b'{"model": '), 400, code="invalid_json"),
    Input("a JSON array as the body", _raw("/v1/chat/completions", b"[1, 2]"), 400, code="invalid_json"),
    Input("an empty body", _raw("/v1/chat/completions", b""), 400),
    Input("a body of 20 MiB", lambda srv: ("POST", "/v1/chat/completions", _big_body(20 * MiB)(srv), {}, False),
          413, code="request_too_large"),
    Input("a body of 20 MiB, chunked", lambda srv: ("POST", "/v1/chat/completions", _big_body(20 * MiB)(srv), {}, True),
          413, code="request_too_large"),
    Input("a prompt of 15 MiB (under the body bound)",
          lambda srv: ("POST", "/v1/chat/completions", _big_body(15 * MiB)(srv), {}, False), 400, param="messages",
          code="context_length_exceeded"),
    Input("JSON nested 100,000 deep", lambda srv: ("POST", "/v1/chat/completions", (
        b'{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "metadata": ' % srv.model.encode()
        + b"[" * 100_000 + b"]" * 100_000 + b"}"), {}, False), 400, code="json_too_deep"),
    # counts and sizes of fields
    Input("50,000 messages", lambda srv: ("POST", "/v1/chat/completions", _messages(
        srv, [{"role": "user", "content": "hi"}] * 50_000), {}, False), 400, param="messages",
        code="array_above_max_length"),
    Input("20,000 logit_bias entries", _chat_body({"logit_bias": {str(i): 1 for i in range(20_000)}}), 400,
          param="logit_bias", code="object_above_max_size"),
    Input("a stop string of 1 MB", _chat_body({"stop": ["x" * 1_000_000]}), 400, param="stop",
          code="string_above_max_length"),
    Input("1,000 stop strings", _chat_body({"stop": [f"s{i}" for i in range(1000)]}), 400, param="stop",
          code="array_above_max_length"),
    Input("300 tools", _chat_body({"tools": [{"type": "function", "function": {"name": f"f{i}"}}
                                             for i in range(300)]}), 400, param="tools", code="array_above_max_length"),
    Input("a tool schema nested 300 deep", _chat_body({"tools": [{"type": "function", "function": {
        "name": "deep", "parameters": _deep(300)}}]}), 400, param="tools", code="schema_too_deep"),
    Input("a response_format schema nested 300 deep", _chat_body({"response_format": {
        "type": "json_schema", "json_schema": {"name": "deep", "schema": _deep(300)}}}), 400,
          param="response_format", code="schema_too_deep"),
    Input("a response_format schema of 5,000 fields", _chat_body({"response_format": {
        "type": "json_schema", "json_schema": {"name": "wide", "schema": _fields(5000)}}}), 200),
    Input("a response_format schema of 50,000 fields", _chat_body({"response_format": {
        "type": "json_schema", "json_schema": {"name": "wider", "schema": _fields(50_000)}}}), 400,
          param="response_format", code="schema_too_large"),
    # messages of the wrong shape
    Input("tool_calls[].function as a string", lambda srv: ("POST", "/v1/chat/completions", _messages(srv, [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": "get_weather"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]), {}, False), 400, param="*"),
    Input("tool_calls as a string", lambda srv: ("POST", "/v1/chat/completions", _messages(srv, [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "tool_calls": "get_weather"},
        {"role": "user", "content": "and?"}]), {}, False), 400, param="*"),
    Input("a tool call without a name", lambda srv: ("POST", "/v1/chat/completions", _messages(srv, [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                "function": {"arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]), {}, False), 400, param="*"),
    Input("an image part", _chat_body({}, content=[{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]),
          400, param="*"),
    Input("an unknown role", lambda srv: ("POST", "/v1/chat/completions", _messages(
        srv, [{"role": "wizard", "content": "hi"}]), {}, False), 400, param="*"),
    Input("no messages", lambda srv: ("POST", "/v1/chat/completions", _messages(srv, []), {}, False), 400,
          param="messages"),
    # values out of range
    Input("an unknown model", lambda srv: ("POST", "/v1/chat/completions", json.dumps({
        "model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}).encode(), {}, False), 404, param="model"),
    Input("max_tokens 0", _chat_body({"max_tokens": 0}), 400, param="max_tokens"),
    Input("max_tokens as a string", _chat_body({"max_tokens": "10"}), 400, param="max_tokens"),
    Input("max_tokens of a billion", _chat_body({"max_tokens": 10 ** 9}), 400, param="max_tokens",
          code="context_length_exceeded"),
    Input("temperature 'hot'", _chat_body({"temperature": "hot"}), 400, param="temperature"),
    Input("n 1000", _chat_body({"n": 1000}), 400, param="n"),
    Input("top_logprobs 50", _chat_body({"logprobs": True, "top_logprobs": 50}), 400, param="top_logprobs"),
    Input("stream_options without stream", _chat_body({"stream_options": {"include_usage": True}}), 400,
          param="stream_options"),
    Input("an unknown parameter", _chat_body({"frobnicate": 1}), 400, param="frobnicate", code="unknown_parameter"),
    Input("store: true", _chat_body({"store": True}), 400, param="store", code="unsupported_parameter"),
    Input("logit_bias key not a token id", _chat_body({"logit_bias": {"hello": 5}}), 400, param="logit_bias"),
    Input("logit_bias value 1000", _chat_body({"logit_bias": {"5": 1000}}), 400, param="*"),
    Input("logit_bias id outside the vocabulary", _chat_body({"logit_bias": {"99999999": 5}}), 400, param="logit_bias"),
    Input("response_format of an unknown type", _chat_body({"response_format": {"type": "yaml"}}), 400, param="*"),
    Input("a schema the grammar engine refuses", _chat_body({"response_format": {
        "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": 12}}}}), 400, param="response_format"),
    Input("tool_choice required without tools", _chat_body({"tool_choice": "required"}), 400, param="tool_choice"),
    Input("a seed that is a float", _chat_body({"seed": 1.5}), 400, param="seed"),
    Input("prompt token ids outside the vocabulary", lambda srv: ("POST", "/v1/completions", json.dumps({
        "model": srv.model, "prompt": [1, 2, 10 ** 9], "max_tokens": 4}).encode(), {}, False), 400, param="prompt"),
    Input("a negative prompt token id", lambda srv: ("POST", "/v1/completions", json.dumps({
        "model": srv.model, "prompt": [-5], "max_tokens": 4}).encode(), {}, False), 400, param="prompt"),
    Input("an empty prompt", lambda srv: ("POST", "/v1/completions", json.dumps({
        "model": srv.model, "prompt": "", "max_tokens": 4}).encode(), {}, False), 400, param="prompt"),
    Input("a prompt of nested lists", lambda srv: ("POST", "/v1/completions", json.dumps({
        "model": srv.model, "prompt": [[1, 2], [3]], "max_tokens": 4}).encode(), {}, False), 400, param="*"),
    # what must still be served
    Input("lone surrogates and NUL bytes in a message", _chat_body({}, content="a\ud800b\x00c"), 200),
    Input("four stop strings", _chat_body({"stop": ["a", "b", "c", "d"]}), 200),
    Input("text/plain with a JSON body", lambda srv: ("POST", "/v1/chat/completions", json.dumps(
        srv.chat("Hi.", max_tokens=4)).encode(), {"Content-Type": "text/plain"}, False), (200, 400), beside=False),
    # routes
    Input("GET on a POST route", _raw("/v1/chat/completions", b"", method="GET"), 405, beside=False),
    Input("an unknown route", _raw("/v1/nothing", b"{}"), 404, beside=False),
]


def run_input(srv: Server, case: Input, beside_s: float) -> Result:
    method, path, body, headers, chunked = case.build(srv)
    reply: list[Reply] = []
    t = threading.Thread(target=lambda: reply.append(srv.request(method, path, body, headers, chunked=chunked,
                                                                 timeout=120)))
    t.start()
    beside = None
    if case.beside:
        time.sleep(0.05)
        beside = srv.small()
    t.join(180)
    r = reply[0] if reply else Reply(error="no answer in 180 s")
    res = Result(case.name, "input", False, r.status or r.error, r.err.get("param"), r.err.get("code"),
                 None if beside is None else round(beside, 2))
    wanted = case.status if isinstance(case.status, tuple) else (case.status,)
    problems = []
    if r.status not in wanted:
        problems.append(f"status {r.status or r.error} (want {case.status}): {r.body[:200]!r}")
    elif r.status >= 400:
        if not r.err.get("message"):
            problems.append(f"not OpenAI's error shape: {r.body[:200]!r}")
        if case.param == "*" and not res.param:
            problems.append("the error names no param")
        elif case.param not in (None, "*") and res.param != case.param:
            problems.append(f"param {res.param!r} (want {case.param!r})")
        if case.code is not None and res.code != case.code:
            problems.append(f"code {res.code!r} (want {case.code!r})")
    if beside is not None and beside > beside_s:
        problems.append(f"a small request beside it took {beside:.2f} s (bound {beside_s:.2f} s)")
    res.ok, res.detail = not problems, "; ".join(problems) or (r.err.get("message", "")[:120] if r.err else "")
    return res


# ---------------------------------------------------------------- clients that leave


def _idle(srv: Server, timeout_s: float, running: int = 0) -> tuple[bool, dict]:
    """Wait until the engine runs `running` sequences and none waits; (reached, last counts)."""
    deadline = time.monotonic() + timeout_s
    e = {}
    while True:
        e = srv.engine()
        if e.get("running") == running and e.get("waiting") == 0:
            return True, e
        if time.monotonic() > deadline:
            return False, e
        time.sleep(0.1)


def _long(srv: Server, content: str, stream: bool, tokens: Optional[int] = None) -> bytes:
    return json.dumps(srv.chat(content, max_tokens=tokens or min(400, srv.context - 96), stream=stream,
                               logit_bias=srv.no_end())).encode()


def leave_case(srv: Server, name: str, stream: bool, when: str, abort_s: float) -> Result:
    """A client that leaves before its first token, after it, or by a read timeout (non-streaming)."""
    ok, before = _idle(srv, 60)
    if not ok:
        return Result(name, "leave", False, detail=f"the server is not idle before the case: {before}")
    s = open_socket(srv, "POST", "/v1/chat/completions", _long(srv, f"Count to a thousand ({name}).", stream))
    if when == "after first token":
        s.settimeout(60)
        got = b""
        while b"data: {" not in got:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
    elif when == "read timeout":
        s.settimeout(1.0)
        try:
            s.recv(4096)
        except socket.timeout:
            pass
    s.close()
    t = time.monotonic()
    freed, e = _idle(srv, abort_s)
    took = time.monotonic() - t
    after = srv.engine()
    made = after.get("decode_tokens", 0) - before.get("decode_tokens", 0)
    detail = f"freed {took:.1f} s after it left, {made} tokens decoded meanwhile" if freed else \
        f"still held {abort_s:.0f} s after it left: {e}"
    return Result(name, "leave", freed, "left", detail=detail)


def queued_leave_case(srv: Server, stream: bool, abort_s: float) -> Result:
    """Every slot busy; a client whose request waits for one leaves: it must never be admitted."""
    name = f"a client leaves while queued ({'streaming' if stream else 'not streaming'})"
    ok, e = _idle(srv, 60)
    if not ok:
        return Result(name, "leave", False, detail=f"the server is not idle before the case: {e}")
    blockers = [open_socket(srv, "POST", "/v1/chat/completions", _long(srv, f"Blocker {i}: count on.", True))
                for i in range(srv.max_seqs)]
    try:
        full, e = _idle(srv, 60, running=srv.max_seqs)
        if not full:
            return Result(name, "leave", False, detail=f"the blockers did not fill the slots: {e}")
        prompt_before = srv.stages().get("kv", {}).get("prompt_tokens", 0)
        waiter = open_socket(srv, "POST", "/v1/chat/completions",
                             _long(srv, "A queued question nobody will read. " * 20, stream, tokens=32))
        deadline = time.monotonic() + 30
        while srv.engine().get("waiting", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        if srv.engine().get("waiting", 0) < 1:
            return Result(name, "leave", False, detail="the queued request never showed as waiting")
        waiter.close()
        t = time.monotonic()
        freed, e = _idle(srv, abort_s, running=srv.max_seqs)
        took = time.monotonic() - t
        prompt_after = srv.stages().get("kv", {}).get("prompt_tokens", 0)
    finally:
        for b in blockers:
            b.close()
    _idle(srv, 60)
    admitted = prompt_after - prompt_before
    ok = freed and admitted == 0
    detail = (f"left the queue {took:.1f} s after it left" if freed else f"still waiting {abort_s:.0f} s later: {e}") \
        + (f"; admitted and prefilled for nobody ({admitted} prompt tokens)" if admitted else "")
    return Result(name, "leave", ok, "left", detail=detail)


# ---------------------------------------------------------------- a burst


def burst_case(srv: Server, n: int, bound_429_s: float) -> Result:
    """n clients at once: each gets its answer or a 429 (OpenAI's shape, Retry-After) fast; no 5xx."""
    replies: list[Reply] = [Reply()] * n
    body = json.dumps(srv.chat("Name a colour.", max_tokens=4)).encode()

    def one(i: int) -> None:
        replies[i] = srv.request("POST", "/v1/chat/completions", body, timeout=300)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(400)
    by: dict = {}
    for r in replies:
        by.setdefault(r.status or r.error[:40], []).append(r)
    problems = [f"{len(v)} x {k}" for k, v in by.items() if k not in (200, 429)]
    refused = by.get(429, [])
    bad_429 = [r for r in refused if r.err.get("code") is None or "retry-after" not in r.headers]
    if bad_429:
        problems.append(f"{len(bad_429)} 429s without OpenAI's error shape or Retry-After: {bad_429[0].body[:120]!r}")
    times = sorted(r.seconds for r in refused)
    slowest = times[-1] if times else 0.0
    median = times[len(times) // 2] if times else 0.0
    if slowest > bound_429_s:
        problems.append(f"the slowest 429 took {slowest:.2f} s (bound {bound_429_s:.1f} s; median {median:.2f} s)")
    summary = ", ".join(f"{len(v)} x {k}" for k, v in sorted(by.items(), key=lambda kv: str(kv[0])))
    return Result(f"a burst of {n}", "burst", not problems, 429 if refused else 200,
                  code=refused[0].err.get("code") if refused else None,
                  detail="; ".join(problems) or f"{summary}; 429s in {median:.2f} s (median), {slowest:.2f} s at most")


# ---------------------------------------------------------------- the network edge and the key


def _local_ip() -> Optional[str]:
    """This machine's address on its network (not loopback), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
        return None if ip.startswith("127.") else ip
    except OSError:
        return None


def net_cases(srv: Server, ray_metrics_port: Optional[int]) -> list[Result]:
    out = []

    def check(name: str, r: Reply, status: int, code: Optional[str] = None, must: tuple = ()) -> None:
        problems = []
        if r.status != status:
            problems.append(f"status {r.status or r.error} (want {status}): {r.body[:160]!r}")
        if code is not None and r.err.get("code") != code:
            problems.append(f"code {r.err.get('code')!r} (want {code!r})")
        missing = [m for m in must if m.encode() not in r.body]
        if missing:
            problems.append(f"missing {', '.join(missing)}")
        out.append(Result(name, "net", not problems, r.status or r.error, r.err.get("param"), r.err.get("code"),
                          detail="; ".join(problems)))

    evil = {"Host": f"rebind.attacker.example:{srv.port}"}
    check("a Host header naming another site (DNS rebinding)", srv.get("/v1/models", headers=evil), 403,
          "host_not_allowed")
    check("a POST with a Host header naming another site",
          srv.post("/v1/chat/completions", srv.chat("hi", max_tokens=2), headers=evil), 403, "host_not_allowed")
    check("Host: localhost", srv.get("/v1/models", headers={"Host": f"localhost:{srv.port}"}), 200)
    check("Host: [::1]", srv.get("/v1/models", headers={"Host": f"[::1]:{srv.port}"}), 200)
    if srv.key:
        check("no API key", srv.get("/v1/models", key=False), 401, "invalid_api_key")
        check("a wrong API key", srv.get("/v1/models", key=False, headers={"Authorization": "Bearer nope"}), 401,
              "invalid_api_key")
        check("/metrics without the key", srv.get("/metrics", key=False), 401, "invalid_api_key")
    check("/health needs no key", srv.get("/health", key=False), 200)
    check("GET /metrics: Prometheus text with vLLM's names", srv.get("/metrics"), 200, must=(
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket", "vllm:prefix_cache_hits_total", "moeray_stage_expert_hit_rate"))
    if ray_metrics_port:
        ip = _local_ip()
        if ip is None:
            out.append(Result("Ray's metrics port is not on the network", "net", True, "skipped",
                              detail="this machine has no address but loopback"))
        else:
            try:
                socket.create_connection((ip, ray_metrics_port), timeout=3).close()
                reachable = True
            except OSError:
                reachable = False
            out.append(Result("Ray's metrics port is not on the network", "net", not reachable,
                              "open" if reachable else "refused",
                              detail=f"{ip}:{ray_metrics_port} " + ("answers: the exporter listens on every interface"
                                                                    if reachable else "refuses")))
    return out


# ---------------------------------------------------------------- operations


def stage_kill_case(srv: Server, timeout_s: float = 300.0) -> Result:
    """A stage SIGKILLed: /health is 503 with the reason while it is restarted, then 200 again."""
    name = "a stage killed: /health 503 while recovering, then 200"
    stages = [s for s in srv.stages().get("stages", []) if s.get("pid")]
    if not stages:
        return Result(name, "ops", True, "skipped", detail="no stage processes (--local)")
    os.kill(stages[-1]["pid"], signal.SIGKILL)
    # A request notices the dead stage if nothing else does first.
    threading.Thread(target=lambda: srv.post("/v1/chat/completions", srv.chat("hi", max_tokens=4)),
                     daemon=True).start()
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = srv.get("/health", key=False, timeout=10)
        if r.status == 503:
            seen.append(r.err.get("code") or r.err.get("message", "")[:60])
        elif r.status == 200 and seen:
            return Result(name, "ops", True, 200, detail=f"503 {sorted(set(map(str, seen)))} for "
                          f"{len(seen)} polls, then 200")
        time.sleep(0.1)
    return Result(name, "ops", False, "no 503" if not seen else 503,
                  detail="never answered 503 while recovering" if not seen else "not 200 again in time")


def sigterm_case(srv: Server, pid: int, drain_s: float) -> Result:
    """SIGTERM while a stream runs: new requests get a 503, the stream ends (its finish or an error
    event) and [DONE] comes; the server stops."""
    name = "SIGTERM mid-stream: the stream ends with [DONE], new requests 503"
    s = open_socket(srv, "POST", "/v1/chat/completions", _long(srv, "Count to a thousand, slowly.", True,
                                                                 tokens=srv.context - 96))
    s.settimeout(drain_s + 60)
    got = b""
    while b"data: {" not in got:
        chunk = s.recv(4096)
        if not chunk:
            break
        got += chunk
    os.kill(pid, signal.SIGTERM)
    time.sleep(0.5)
    during = srv.post("/v1/chat/completions", srv.chat("hi", max_tokens=2), timeout=10)
    t = time.monotonic()
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
            if b"data: [DONE]" in got:
                break
    except OSError as exc:
        got += f"<{exc}>".encode()
    took = time.monotonic() - t
    s.close()
    problems = []
    if b"data: [DONE]" not in got:
        problems.append(f"no [DONE] (ended with {got[-200:]!r})")
    ended_by = "an error event" if b'data: {"error"' in got else "its finish"
    if during.status not in (503, 0):
        problems.append(f"a new request during the drain got {during.status} (want 503 or refused)")
    return Result(name, "ops", not problems, during.status or "refused", code=during.err.get("code"),
                  detail="; ".join(problems) or f"the stream ended by {ended_by} {took:.1f} s after SIGTERM")


# ---------------------------------------------------------------- the run


def connect(url: str, key: Optional[str]) -> Server:
    srv = Server(url, key)
    st = srv.stages()
    srv.model = (srv.get("/v1/models").json() or {"data": [{"id": ""}]})["data"][0]["id"]
    srv.context = st.get("context", 1024)
    srv.max_seqs = st.get("engine", {}).get("max_seqs", 4)
    try:
        from moeray.stages.gguf.reader import read_gguf_header
        from moeray.stages.text.tokenizer import Tokenizer

        srv.end_ids = sorted(Tokenizer.from_metadata(read_gguf_header(st["path"]).metadata).end_ids)
    except Exception:  # noqa: BLE001 - the model file is not on this machine: the default model's
        srv.end_ids = [0, 2, 4]
    return srv


def run(url: str, key: Optional[str], groups: set[str], beside_s: Optional[float] = None, abort_s: float = 5.0,
        burst: int = 300, bound_429_s: float = 2.0, ray_metrics_port: Optional[int] = None,
        sigterm_pid: Optional[int] = None, drain_s: float = 3.0, kill_stage: bool = False,
        beside_factor: float = 5.0, beside_floor_s: float = 1.5, say=print) -> list[Result]:
    srv = connect(url, key)
    base = statistics.median(srv.small() for _ in range(3))
    bound = beside_s if beside_s is not None else max(beside_floor_s, beside_factor * base)
    say(f"probe: {url}, model {srv.model}, context {srv.context}, {srv.max_seqs} slots; a small request takes "
        f"{base:.2f} s alone, {bound:.2f} s allowed beside a case")
    results: list[Result] = []

    def add(r: Result) -> None:
        results.append(r)
        say(f"  {'ok  ' if r.ok else 'FAIL'} [{r.group}] {r.name}: {r.status}"
            + (f" param={r.param}" if r.param else "") + (f" code={r.code}" if r.code else "")
            + (f" beside {r.beside_s:.2f} s" if r.beside_s is not None else "") + (f" - {r.detail}" if r.detail else ""))

    if "leave" in groups:
        add(leave_case(srv, "a streaming client leaves before its first token", True, "at once", abort_s))
        add(leave_case(srv, "a streaming client leaves after its first token", True, "after first token", abort_s))
        add(leave_case(srv, "a non-streaming client gives up (read timeout)", False, "read timeout", abort_s))
        add(queued_leave_case(srv, True, abort_s))
        add(queued_leave_case(srv, False, abort_s))
    if "input" in groups:
        for case in INPUTS:
            add(run_input(srv, case, bound))
    if "burst" in groups:
        add(burst_case(srv, burst, bound_429_s))
    if "net" in groups:
        for r in net_cases(srv, ray_metrics_port):
            add(r)
    if "ops" in groups:
        r = srv.get("/health", key=False)
        add(Result("/health while serving", "ops", r.status == 200 and (r.json() or {}).get("status") == "ok",
                   r.status or r.error, detail=r.body[:120].decode(errors="replace")))
        if kill_stage:
            add(stage_kill_case(srv))
        if sigterm_pid:
            add(sigterm_case(srv, sigterm_pid, drain_s))
    say(f"probe: {sum(r.ok for r in results)} of {len(results)} cases pass")
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--api-key", default=None)
    p.add_argument("--only", default="leave,input,burst,net,ops", help="groups: leave, input, burst, net, ops")
    p.add_argument("--beside-s", type=float, default=None,
                   help="bound on a small request beside a case (default: --beside-factor times its time alone, "
                        "at least --beside-floor)")
    p.add_argument("--beside-factor", type=float, default=5.0)
    p.add_argument("--beside-floor", type=float, default=1.5)
    p.add_argument("--abort-s", type=float, default=5.0, help="a client that left frees its sequence within this")
    p.add_argument("--burst", type=int, default=300)
    p.add_argument("--bound-429-s", type=float, default=2.0, help="every 429 of the burst within this")
    p.add_argument("--ray-metrics-port", type=int, default=None, help="check Ray's exporter is not on the network")
    p.add_argument("--kill-stage", action="store_true", help="SIGKILL a stage and watch /health (Ray stages)")
    p.add_argument("--sigterm", type=int, default=None, metavar="PID", help="last: SIGTERM the server mid-stream")
    p.add_argument("--drain-s", type=float, default=3.0, help="the server's drain time (--drain-timeout)")
    p.add_argument("--json", help="write every case here")
    args = p.parse_args()
    results = run(args.url, args.api_key, set(args.only.split(",")), args.beside_s, args.abort_s, args.burst,
                  args.bound_429_s, args.ray_metrics_port, args.sigterm, args.drain_s, args.kill_stage,
                  args.beside_factor, args.beside_floor)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([asdict(r) for r in results], fh, indent=1)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
