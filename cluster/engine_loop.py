"""Drives an Engine from one background thread and hands each request its text on the event loop.

The Engine is not thread-safe and its step() blocks (it waits on the stages), so it lives on one
thread: HTTP handlers never touch it, they post commands (add, abort) to an inbox that the
thread drains before every step. After each step the thread hands every request its new text (a
Delta: the text the engine released, and how many tokens it took) in one batch per event loop: a
single `loop.call_soon_threadsafe` (one wake-up of the loop, not one per request) appends every
request's items to its stream and resolves the future its handler awaits, so neither side waits
on the other and an item reaches its handler in one hop (no queue task between them). The engine decides
when a request is finished (end token, length, stop string); the server only forwards. Every wait is
bounded: the thread sleeps at most `idle_wait_s` when there is no work, and a consumer's wait
for its next tokens has a deadline.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from moeray.cluster.remote import StageFailedError
from moeray.cluster.scheduler import RequestStatus
from moeray.cluster.timeline import MAX_DELIVERIES, Timeline, now_ns
from moeray.errors import MoerayError
from moeray.stages.text.sampling import SamplingParams


class OverloadedError(MoerayError):
    """Too many requests waiting for a KV slot: the caller should retry later (HTTP 429)."""


class EngineDownError(MoerayError):
    """The engine thread stopped or the pipeline failed (HTTP 503)."""


@dataclass
class Delta:
    text: str  # newly released text ("" while held back: a possible stop string, a partial character)
    n_tokens: int  # tokens generated since the last Delta
    logprobs: list = field(default_factory=list)  # their TokenLogprobs, when the request asked for them


@dataclass
class Finished:
    reason: Optional[str]  # "stop" | "length" | "abort" | None on error
    error: Optional[str] = None


@dataclass
class Stream:
    """One request as its HTTP handler sees it: Deltas, then one Finished, from `next()`."""
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    items: deque = field(default_factory=deque)  # handed over, not yet taken (event loop only)
    waiter: Optional[asyncio.Future] = None  # what the handler awaits while `items` is empty
    req: Any = None  # the engine's Request, set on the engine thread
    sent_tokens: int = 0  # of req.output, already handed over
    sent_pieces: int = 0  # of req.detok.pieces (the released text), already handed over
    done: bool = False
    t_submit: float = field(default_factory=time.perf_counter)
    t_last: Optional[float] = None  # when the last token was handed over (inter-token latency)
    timeline: Optional[Timeline] = None  # where its time goes (cluster/timeline.py), when the server keeps it
    seen_ns: tuple[int, int] = (0, 0)  # its detokenising and stop-matching time already counted

    def _put(self, item) -> None:
        self.loop.call_soon_threadsafe(_put_all, [(self, item)])

    async def next(self, timeout_s: float):
        """The next item: a Delta or Finished. Raises TimeoutError past the deadline."""
        if not self.items:
            self.waiter = self.loop.create_future()
            try:
                async with asyncio.timeout(timeout_s):
                    await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


def _put_all(items: list[tuple[Stream, Any]]) -> None:
    """On the event loop: one step's items for every stream of this loop, each stream's waiting
    handler woken (its future resolved: the handler runs at the loop's next turn)."""
    t = now_ns()
    for s, item in items:
        s.items.append(item)
        tl = s.timeline
        if tl is not None and type(item) is Delta and len(tl.queued) < MAX_DELIVERIES:
            tl.queued.append(t)
        w = s.waiter
        if w is not None and not w.done():
            w.set_result(None)


class EngineLoop:
    def __init__(self, engine, max_waiting: int = 64, idle_wait_s: float = 0.05,
                 on_tokens: Optional[Callable[[list[tuple[Stream, int]], float], None]] = None,
                 retry_s: float = 10.0):
        self.engine = engine
        self.max_waiting = max_waiting
        self.idle_wait_s = idle_wait_s
        self.on_tokens = on_tokens  # ([(stream, n_new), ...], now) after a step's deliveries, for metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0  # adds posted but not yet taken by the thread
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: list[Stream] = []
        self._thread = threading.Thread(target=self._run, name="moeray-engine-loop", daemon=True)
        self.fatal: Optional[str] = None  # set when the thread died: the server answers 503
        self.last_failure: Optional[str] = None  # the last stage failure (the engine recovered)
        # Set while the pipeline cannot serve (after a node left, what is left cannot hold the
        # model): requests get 503 with this reason, and every `retry_s` the engine tries to
        # recover again (a node may have joined). The thread lives on: not a fatal error.
        self.down: Optional[str] = None
        self.retry_s = retry_s
        self.counts = {"running": 0, "waiting": 0, "free_slots": engine.n_free_slots}

    # ---------------------------------------------------------------- called from the event loop

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal is None

    def submit(self, prompt: Sequence[int], params: SamplingParams, timeline: Optional[Timeline] = None) -> Stream:
        if not self.alive:
            raise EngineDownError(f"the engine is not running: {self.fatal or 'stopped'}")
        if self.down is not None:
            raise EngineDownError(self.down)
        with self._lock:
            # Requests that would have to wait for a KV slot if this one were taken too.
            queued = self.counts["waiting"] + self._pending - self.counts["free_slots"]
            if queued >= self.max_waiting:
                raise OverloadedError(
                    f"all {self.counts['running'] + self.counts['free_slots']} sequence slots are busy and "
                    f"{max(queued, 0)} requests are already waiting (limit {self.max_waiting}); retry later")
            self._pending += 1
        stream = Stream(list(prompt), params, asyncio.get_running_loop(), timeline=timeline)
        if timeline is not None:
            timeline.mark("submitted")
        self._inbox.put(("add", stream))
        self._wake.set()
        return stream

    def abort(self, stream: Stream) -> None:
        """The client went away or has what it wants (a stop string): free its sequence."""
        if not stream.done:
            self._inbox.put(("abort", stream))
            self._wake.set()

    # ---------------------------------------------------------------- the engine thread

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if self.down is not None:
                    self._while_down()
                elif self.engine.has_work():
                    self._step()
                else:
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - reported to every client, then 503s
            self.fatal = f"{exc.__class__.__name__}: {exc}"
            traceback.print_exc()
        finally:
            reason = self.fatal or "the server is shutting down"
            for s in self._streams:
                self._finish(s, Finished(None, reason))
            self._streams.clear()
            while True:  # requests posted after the end get the same answer
                try:
                    op, s = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if op == "add":
                    self._finish(s, Finished(None, reason))

    def _drain_inbox(self) -> None:
        while True:
            try:
                op, s = self._inbox.get_nowait()
            except queue.Empty:
                break
            if op == "add":
                with self._lock:
                    self._pending -= 1
                if s.done:
                    continue
                try:
                    s.req = self.engine.add(s.prompt, s.params, s.timeline)
                except MoerayError as exc:
                    self._finish(s, Finished(None, str(exc)))
                    continue
                self._streams.append(s)
            elif op == "abort" and not s.done:
                if s.req is not None and not s.req.done:
                    self.engine.abort(s.req)
                self._finish(s, Finished("abort"))
                if s in self._streams:
                    self._streams.remove(s)
        self._count()

    def _step(self) -> None:
        failed = True
        try:
            # What the last step released goes to the event loop once the next step is on its way
            # (Engine.step: on a pipeline that computes as it is handed a step, just before).
            self.engine.step(on_submitted=self._deliver)
            failed = False
        except StageFailedError as exc:
            # The engine failed its running requests and restarted the stage; waiting ones go on.
            self.last_failure = str(exc)
        except MoerayError as exc:
            # The recovery found no way to serve (the devices left cannot hold the model).
            self.last_failure = self.down = str(exc)
        if failed or not self.engine.has_work():  # no next step to wait for
            self._deliver()
        self._count()

    def _while_down(self) -> None:
        """Fail what waits with the reason, then try to recover every `retry_s` (bounded waits)."""
        for s in self._streams:
            if s.req is not None and not s.req.done:
                self.engine.abort(s.req)
            self._finish(s, Finished(None, self.down))
        self._streams.clear()
        self._count()
        if self._stop.wait(self.retry_s):
            return
        try:
            self.engine.recover()
            self.down = None
        except MoerayError as exc:
            self.down = str(exc)
        self._count()

    def _deliver(self) -> None:
        now = time.perf_counter()
        still, delivered = [], []
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for s in self._streams:
            req = s.req
            items = batches.setdefault(s.loop, [])
            n_new = len(req.output) - s.sent_tokens
            if n_new:
                text = ""
                if req.detok is not None:  # the pieces released since the last hand-over
                    pieces = req.detok.pieces
                    text = "".join(pieces[s.sent_pieces:])
                    s.sent_pieces = len(pieces)
                logprobs = req.logprobs[s.sent_tokens:len(req.output)] if req.logprobs else []
                s.sent_tokens = len(req.output)
                items.append((s, Delta(text, n_new, logprobs)))
                delivered.append((s, n_new, len(text)))
            if req.status is RequestStatus.FAILED:
                s.done = True
                items.append((s, Finished(None, req.error or "the pipeline failed")))
            elif req.done:
                s.done = True
                items.append((s, Finished(req.finish_reason)))
            else:
                still.append(s)
        self._streams = still
        handed = now_ns()
        for s, n_new, n_chars in delivered:
            tl = s.timeline
            if tl is not None and len(tl.handed) < MAX_DELIVERIES:
                d = s.req.detok
                spent = (d.detok_ns, d.stop_ns) if d is not None else (0, 0)
                tl.delivered(n_new, n_chars, self.engine.last_step, spent[0] - s.seen_ns[0], spent[1] - s.seen_ns[1],
                             handed)
                s.seen_ns = spent
        for loop, items in batches.items():
            if items:
                loop.call_soon_threadsafe(_put_all, items)
        if delivered and self.on_tokens is not None:
            self.on_tokens([(s, n) for s, n, _ in delivered], now)
        for s, _, _ in delivered:
            s.t_last = now

    def _finish(self, s: Stream, item: Finished) -> None:
        if not s.done:
            s.done = True
            s._put(item)

    def _count(self) -> None:
        self.counts = {"running": len(self.engine.running), "waiting": len(self.engine.waiting),
                       "free_slots": self.engine.n_free_slots}
