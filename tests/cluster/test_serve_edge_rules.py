"""The serve edge's rules without a model (cluster/edge.py, cluster/engine_loop.py): the request
bounds, the Host check, the body bound, the door's 429 before a route runs, a client that leaves
cancelling its route; and the engine thread's side: recovery on a thread of its own while requests
still queue, the drain on SIGTERM, and a step that raises on submission freeing its rows."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from fastapi import Request  # at module level: FastAPI resolves the route's annotations here

from moeray.cluster import edge
from moeray.cluster.config import RequestLimits, ServeOptions
from moeray.cluster.engine_loop import EngineLoop, Finished, OverloadedError, ShuttingDownError
from moeray.cluster.remote import StageFailedError
from moeray.cluster.scheduler import RequestStatus
from moeray.errors import MoerayError
from moeray.stages.text.sampling import SamplingParams
from test_engine import engine, ids

LIMITS = RequestLimits()
NESTED_20: list = []
for _ in range(19):
    NESTED_20 = [NESTED_20]


@pytest.mark.parametrize("body, param, code", [
    ({"messages": [{"role": "user", "content": "x"}] * 5000}, "messages", "array_above_max_length"),
    ({"input": [{"role": "user", "content": "x"}] * 5000}, "input", "array_above_max_length"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop", "array_above_max_length"),
    ({"stop": "x" * 1025}, "stop", "string_above_max_length"),
    ({"stop_sequences": ["y" * 2000]}, "stop_sequences", "string_above_max_length"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "object_above_max_size"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools",
     "array_above_max_length"),
    ({"tools": [{"type": "function", "function": {"name": "d", "parameters": {"a": NESTED_20}}}]},
     None, None),  # 21 deep: within the bound
    ({"tools": [{"name": "d", "input_schema": {"p": {"q": 1}}}]}, None, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {
        "type": "object", "properties": {f"f{i}": {"type": "integer"} for i in range(10_001)}}}}},
     "response_format", "schema_too_large"),
    ({"text": {"format": {"type": "json_schema", "schema": {"x": {"x": {"x": {"x": {}}}}}}}}, None, None),
])
def test_each_bound_is_a_400_naming_its_field(body, param, code):
    if code is None:
        edge.check_body(body, LIMITS)
        return
    with pytest.raises(edge.BoundError) as err:
        edge.check_body(body, LIMITS)
    assert (err.value.param, err.value.code, err.value.status) == (param, code, 400)
    assert "(--" in err.value.message  # names the flag that moves the bound


def deep(n: int):
    obj: dict = {}
    for _ in range(n):
        obj = {"type": "object", "properties": {"x": obj}}
    return obj


@pytest.mark.parametrize("where", ["chat", "messages", "responses"])
def test_a_schema_nested_too_deep_is_named_whatever_api_carries_it(where):
    schema = deep(40)  # 80 levels of JSON
    body = {"chat": {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]},
            "messages": {"tools": [{"name": "f", "input_schema": schema}]},
            "responses": {"tools": [{"type": "function", "name": "f", "parameters": schema}]}}[where]
    with pytest.raises(edge.BoundError) as err:
        edge.check_body(body, LIMITS)
    assert (err.value.param, err.value.code) == ("tools", "schema_too_deep")
    with pytest.raises(edge.BoundError) as err:  # nested past the body's own bound anywhere else
        edge.check_body({"metadata": deep(40)}, LIMITS)
    assert err.value.code == "json_too_deep"
    with pytest.raises(edge.BoundError) as err:  # a body that is no object at all: its nesting is bounded too
        edge.check_body([deep(40)], LIMITS)
    assert err.value.code == "json_too_deep"


@pytest.mark.parametrize("header, host", [("localhost:8000", "localhost"), ("[::1]:8000", "::1"), ("[::1]", "::1"),
                                          ("127.0.0.1", "127.0.0.1"), ("Evil.Example:80", "evil.example")])
def test_the_host_a_header_names(header, host):
    assert edge.host_of(header) == host


# ---------------------------------------------------------------- the edge in front of an app


def app_with_edge(opts: ServeOptions, loop: EngineLoop, started: list, gate: asyncio.Event | None = None):
    """A FastAPI app as build_app makes it (the edge, the checked route class) with one generating
    route that records that it ran and waits on `gate`."""
    from fastapi import FastAPI

    app = FastAPI()
    app.router.route_class = edge.CheckedRoute
    service = SimpleNamespace(opts=opts, loop=loop)
    app.state.service = service
    app.add_middleware(edge.Edge, service=service)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        started.append(body)
        try:
            if gate is not None:
                await gate.wait()
        except asyncio.CancelledError:
            started.append("cancelled")
            raise
        return {"ok": True, "ticket": edge.take_ticket() is not None}

    return app


@pytest.fixture
def idle_loop():
    eng, _ = engine({"a": "hello"}, max_seqs=1, micro_batches=1)
    loop = EngineLoop(eng, max_waiting=1, idle_wait_s=0.01).start()
    yield loop
    loop.stop()


def test_host_key_body_and_bounds_refuse_before_the_route_runs(idle_loop):
    from starlette.testclient import TestClient

    opts = ServeOptions(api_key="k", allowed_hosts=("localhost", "127.0.0.1", "::1"),
                        limits=RequestLimits(max_body_bytes=1000, max_stop=2))
    started: list = []
    client = TestClient(app_with_edge(opts, idle_loop, started), base_url="http://localhost")
    auth = {"Authorization": "Bearer k"}
    r = client.post("/v1/chat/completions", json={"m": 1}, headers={**auth, "Host": "rebind.example:8000"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    r = client.post("/v1/chat/completions", json={"m": 1})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = client.post("/v1/chat/completions", content=b"{" + b" " * 2000 + b"}", headers=auth)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = client.post("/v1/chat/completions", json={"stop": ["a", "b", "c"]}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    r = client.post("/v1/chat/completions", content=b'{"a": ' + b"[" * 300 + b"]" * 300 + b"}", headers=auth)
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_too_deep"
    assert started == []  # none of them reached the route
    r = client.post("/v1/chat/completions", json={"stop": ["a"]}, headers={**auth, "Host": "[::1]:9"})
    assert r.status_code == 200 and r.json() == {"ok": True, "ticket": True}


def wait_until(ready, timeout_s: float = 10.0) -> None:
    """Poll `ready()` until it holds; fail (never hang) past the deadline."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, "timed out waiting on the engine thread"
        time.sleep(0.01)


def test_the_door_answers_429_before_the_route_and_a_ticket_is_let_go():
    from starlette.testclient import TestClient

    eng, pipe = engine({"a": "a" * 100}, max_seqs=1, micro_batches=1)
    pipe.delay_s = 0.05  # a slow step: the one slot stays busy
    loop = EngineLoop(eng, max_waiting=1, idle_wait_s=0.01).start()
    started: list = []
    client = TestClient(app_with_edge(ServeOptions(max_waiting=1), loop, started))
    # The two requests that fill the engine read their streams on an event loop that lives as long
    # as the test (as the server's does): one closed under them would leave the engine thread
    # delivering to nobody.
    aio = asyncio.new_event_loop()
    aio_thread = threading.Thread(target=aio.run_forever, daemon=True)
    aio_thread.start()

    async def fill():
        return (loop.submit(ids("a"), SamplingParams(max_tokens=90)),
                loop.submit(ids("a"), SamplingParams(max_tokens=90)))

    try:
        running, waiting = asyncio.run_coroutine_threadsafe(fill(), aio).result(10)
        wait_until(lambda: loop.counts["running"] == 1 and loop.counts["waiting"] == 1)
        t = time.monotonic()
        r = client.post("/v1/chat/completions", json={"x": 1})
        assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded" and r.headers["retry-after"] == "1"
        assert time.monotonic() - t < 2 and started == []  # refused at the door: the route never ran
        loop.abort(waiting)
        wait_until(lambda: loop.counts["waiting"] == 0)
        assert client.post("/v1/chat/completions", json={"x": 1}).status_code == 200
        assert loop._at_door == 0  # the route ended without submitting: its ticket went back
        ticket = loop.door()
        with pytest.raises(OverloadedError):  # the one let in counts as waiting from the door on
            loop.door()
        ticket.release()
        ticket.release()  # idempotent
        assert loop._at_door == 0
        loop.draining = True
        r = client.post("/v1/chat/completions", json={"x": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down" and len(started) == 1
        assert loop.fatal is None  # the engine thread lived through it all
    finally:
        loop.stop()
        aio.call_soon_threadsafe(aio.stop)
        aio_thread.join(5)
        aio.close()


def test_a_client_that_leaves_cancels_its_route():
    """At the ASGI level: the body arrives, then the client disconnects while the route waits (for
    a slot, its first token, or a non-streaming answer): the route's task is cancelled at once."""
    async def main():
        eng, _ = engine({"a": "hello"})
        loop = EngineLoop(eng, idle_wait_s=0.01).start()  # running (the door refuses otherwise), idle
        started: list = []
        app = app_with_edge(ServeOptions(), loop, started, gate=asyncio.Event())
        inbox: asyncio.Queue = asyncio.Queue()
        await inbox.put({"type": "http.request", "body": b'{"q": 1}', "more_body": False})
        sent: list = []

        async def send(msg):
            sent.append(msg)

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [
            (b"content-type", b"application/json"), (b"host", b"localhost")], "query_string": b"",
            "root_path": "", "scheme": "http", "server": ("127.0.0.1", 8000), "http_version": "1.1",
            "client": ("127.0.0.1", 5), "app": app}
        task = asyncio.ensure_future(app(scope, inbox.get, send))
        try:
            for _ in range(500):
                if started or task.done():
                    break
                await asyncio.sleep(0.01)
            assert started and sent == [], f"the route did not run: {sent}"
            t = time.monotonic()
            await inbox.put({"type": "http.disconnect"})
            await asyncio.wait_for(task, 5)
            return started, time.monotonic() - t, sent, loop._at_door
        finally:
            task.cancel()
            loop.stop()

    started, took, sent, at_door = asyncio.run(main())
    assert started[-1] == "cancelled" and took < 1.0 and sent == [] and at_door == 0


# ---------------------------------------------------------------- the engine thread


def test_recovery_runs_off_the_engine_thread_while_requests_queue():
    eng, pipe = engine({"a": "hello", "b": "xyz"}, fail_at=0, max_seqs=2, micro_batches=1)
    release = threading.Event()
    threads = []

    def slow_recover():
        threads.append(threading.current_thread().name)
        release.wait(10)

    pipe.recover = slow_recover
    loop = EngineLoop(eng, idle_wait_s=0.01).start()

    async def finished(stream):
        while True:
            item = await stream.next(10)
            if isinstance(item, Finished):
                return item

    async def main():
        first = await finished(loop.submit(ids("a"), SamplingParams(max_tokens=4)))
        while loop.recovering is None:
            await asyncio.sleep(0.01)
        during = loop.recovering
        queued = loop.submit(ids("b"), SamplingParams(max_tokens=3))  # taken, not refused, while recovering
        aborted = loop.submit(ids("b"), SamplingParams(max_tokens=3))
        loop.abort(aborted)
        await asyncio.sleep(0.3)
        counts = dict(loop.counts)
        release.set()
        again = await finished(queued)
        return first, during, counts, again

    try:
        first, during, counts, again = asyncio.run(main())
    finally:
        release.set()
        loop.stop()
    assert first.error and "stage 0 died" in first.error
    assert "stage 0 died" in during and threads == ["moeray-recovery"]  # not the engine thread
    assert counts["waiting"] == 1  # the queued one waits for the stages; the aborted one is gone
    assert again.reason == "length" and again.error is None and loop.recovering is None


def test_a_failed_recovery_leaves_the_server_down_with_the_reason_and_retries():
    eng, pipe = engine({"a": "hello"}, fail_at=0, max_seqs=2, micro_batches=1)
    calls = []

    def broken():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("the restarted stage did not load")

    pipe.recover = broken
    loop = EngineLoop(eng, idle_wait_s=0.01, retry_s=0.2).start()

    async def main():
        s = loop.submit(ids("a"), SamplingParams(max_tokens=4))
        while not isinstance(await s.next(10), Finished):
            pass
        while loop.down is None:
            await asyncio.sleep(0.01)
        down = loop.down
        while loop.down is not None:
            await asyncio.sleep(0.05)
        return down

    try:
        down = asyncio.run(main())
    finally:
        loop.stop()
    assert "recovery failed (RuntimeError: the restarted stage did not load)" in down and len(calls) == 3


def test_the_drain_lets_running_requests_finish_then_ends_the_rest_with_the_reason():
    eng, pipe = engine({"a": "a" * 50, "b": "hi"}, max_seqs=2, micro_batches=1)
    pipe.delay_s = 0.05
    loop = EngineLoop(eng, idle_wait_s=0.01).start()

    async def main():
        long = loop.submit(ids("a"), SamplingParams(max_tokens=40))
        short = loop.submit(ids("b"), SamplingParams(max_tokens=8))  # "hi", then its end
        await asyncio.sleep(0.05)
        ended = await asyncio.to_thread(loop.drain, 0.4, "the server is shutting down")
        items = []
        for s in (short, long):
            while True:
                item = await s.next(5)
                if isinstance(item, Finished):
                    items.append(item)
                    break
        return ended, items

    try:
        ended, (short, long) = asyncio.run(main())
        with pytest.raises(ShuttingDownError):
            loop.submit(ids("b"), SamplingParams(max_tokens=2))
    finally:
        loop.stop()
    assert short.reason == "stop" and short.error is None  # finished within the drain
    assert long.error == "the server is shutting down" and ended == 1


class RaisingOnSubmit:
    """One process runs a step as it is submitted: this one raises a MoerayError on its second."""

    def __init__(self, inner):
        self.inner, self.n_stages, self.calls = inner, 1, 0

    def submit(self, batch):
        self.calls += 1
        if self.calls == 2:
            raise MoerayError("the grammar engine refused a token mask")
        return self.inner.submit(batch)

    def result(self, handle, timeout_s):
        return self.inner.result(handle, timeout_s)

    def recover(self):
        pass


def test_a_step_that_raises_on_submission_fails_its_rows_and_frees_their_slots():
    from moeray.cluster.engine import Engine
    from moeray.cluster.config import EngineConfig
    from fakes import CharTokenizer

    _, scripted = engine({"a": "hello world", "b": "ok"})
    eng = Engine(RaisingOnSubmit(scripted), EngineConfig(max_seqs=2, max_len=64, micro_batches=1), CharTokenizer())
    hit = eng.add(ids("a"), SamplingParams(max_tokens=8))
    eng.step()  # the prompt
    eng.step()  # raises inside: the row fails, nothing is left busy
    assert hit.status is RequestStatus.FAILED and "grammar engine refused" in hit.error
    assert eng.n_free_slots == 2 and not eng.running and not eng.has_work()
    assert eng.scheduler.blocks.n_used == 0
    later = eng.add(ids("b"), SamplingParams(max_tokens=4))
    eng.run([later], timeout_s=10)
    assert later.text == "ok"
    with pytest.raises(StageFailedError):  # a dead stage is still the stage failure it was
        eng2, _ = engine({"a": "x"}, fail_at=0)
        eng2.recovers_inline = False
        eng2.add(ids("a"), SamplingParams(max_tokens=2))
        eng2.step()
