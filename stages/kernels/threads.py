"""ggml's threads in this process: how many, and how each graph uses them (one thread or all,
spinning or sleeping between graphs, learnt per graph), with the thread pools and each graph's plans.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from moeray.stages.kernels import settings
from moeray.stages.kernels.ggml_lib import load_once, set_fa_tiled_rows, set_gemm_paths

_G = load_once()[0]  # ggml-python's module (None without it: nothing here is called then)

_pool_lock = threading.Lock()
_pools: dict[tuple, object] = {}  # (threads, poll) -> ggml thread pool pointer, one per setting used
_threads: int | None = None  # ggml's threads in this process: the options', else torch's count at first use
_on_new_threads: list[Callable[[], None]] = []  # graph caches planned for the old count (graphs.py)


@dataclass
class ThreadSettings:
    """How ggml's threads are used (docs/kernels.md#threads; the measurements behind each: docs/performance.md#served).

    poll: how long ggml's workers spin for the next graph before they sleep (ggml's poll level:
      0 sleeps at once; each level is ~131k pause rounds, ~1-5 ms here: level 1 bridges the torch
      ops between a step's graphs but not the wait between steps; 100 spins for a good part of a
      second).
    parallel_bytes: a graph that reads fewer weight bytes starts on one thread (0: every graph
      uses all threads): waking a worker and meeting it at every barrier costs more than it saves
      on a graph of a few hundred microseconds.
    adapt: each graph learns from its own calls whether one thread or all of them compute it
      faster, and keeps trying the other now and then: big graphs split on a quiet machine, and
      stop splitting on a loaded one (a helper thread preempted mid-graph stalls every barrier).
    """
    poll: int = 100
    parallel_bytes: int = 0
    adapt: bool = False

    @classmethod
    def of(cls, opts: "settings.StageOptions", d: "ThreadSettings | None" = None) -> "ThreadSettings":
        """The stage options' ggml_poll, ggml_parallel_kb and ggml_adapt, each over `d`'s value where unset."""
        d = d or cls()
        return cls(d.poll if opts.ggml_poll is None else opts.ggml_poll,
                   d.parallel_bytes if opts.ggml_parallel_kb is None else opts.ggml_parallel_kb << 10,
                   d.adapt if opts.ggml_adapt is None else opts.ggml_adapt)

    def options(self) -> dict:
        """These settings as StageOptions fields."""
        return dict(ggml_poll=self.poll, ggml_parallel_kb=self.parallel_bytes >> 10, ggml_adapt=self.adapt)


def ggml_threads() -> int:
    """ggml's threads in this process: the options' `threads` (0: every core the process may run
    on), else torch's count at first use."""
    want = settings.current().threads
    n = len(os.sched_getaffinity(0)) if want == 0 else want
    if _threads is None or (n and n != _threads):
        _use_threads(n or torch.get_num_threads())
    return _threads



def _use_threads(n: int) -> None:
    global _threads
    _threads = max(1, int(n))
    if _threads > 1:
        torch.set_num_threads(1)
    for forget in _on_new_threads:
        forget()


def on_new_threads(forget: Callable[[], None]) -> None:
    """Call `forget` whenever ggml's thread count changes (a cache of graphs planned for the old one)."""
    _on_new_threads.append(forget)


def set_threads(n: int, threads: ThreadSettings | None = None) -> None:
    """Give ggml `n` threads, used as `threads` say (default: as the options say): this process's
    options' `threads` (and ggml_* fields) from now on.

    A decode token makes ~120 small graph calls (40-200 us each), so with more than one thread
    ggml's workers spin between graphs (measured: 34 ms/token against 54 ms when they sleep, 2
    cores). torch's own ops (norms, RoPE, attention: small at decode) then run on one thread: a
    second torch thread would fight the spinning worker for the cores (268 ms/token measured).
    """
    settings.update(threads=max(1, int(n)), **(threads.options() if threads is not None else {}))
    _use_threads(n)


def thread_settings() -> ThreadSettings:
    return ThreadSettings.of(settings.current())


def _threadpool(n: int):
    """The process's ggml thread pool of `n` threads: spinning `poll` for the next graph when it
    has helpers to keep warm, none to wake with one thread."""
    poll = thread_settings().poll if n > 1 else 0
    with _pool_lock:
        pool = _pools.get((n, poll))
        if pool is None:
            params = _G.ggml_threadpool_params_default(n)
            params.poll = poll
            pool = _pools[(n, poll)] = _G.ggml_threadpool_new(ctypes.byref(params))
        return pool


def rest_threads() -> int:
    """Put this process's ggml workers to sleep now, instead of letting them spin `poll` for a next
    graph: what a pipeline stage does when its part of a step is done. Stages that share a host's
    cores compute one after another on a single stream, so a stage's workers spinning on after its
    graphs take the cores the next stage computes on (bench/stream_timeline.py). The next graph
    wakes them (ggml resumes a paused pool at its kickoff): one wake-up per step, against a spin
    per graph. Only between graphs: a worker that finds its pool paused before it joined a graph
    never joins it. Returns the pools paused."""
    with _pool_lock:
        pools = [pool for (n, poll), pool in _pools.items() if n > 1 and poll > 0]
    for pool in pools:
        _G.ggml_threadpool_pause(pool)
    return len(pools)


def _weight_bytes(graph) -> int:
    """Bytes of weights one call of `graph` reads: every matmul's first operand, and of a
    mul_mat_id's expert stack only the rows of the experts its ids can name."""
    total = 0
    for i in range(_G.ggml_graph_n_nodes(graph)):
        t = _G.ggml_graph_node(graph, i).contents
        if t.op == _G.GGML_OP_MUL_MAT:
            total += _G.ggml_nbytes(t.src[0])
        elif t.op == _G.GGML_OP_MUL_MAT_ID:
            w, ids = t.src[0], t.src[2].contents
            n_experts = max(1, w.contents.ne[2])
            total += _G.ggml_nbytes(w) * min(n_experts, ids.ne[0] * ids.ne[1]) // n_experts
    return total


class ThreadChoice:
    """One thread or all of them for one graph, chosen by the mean time of its own recent calls
    with each (an exponential average), the other tried every `explore` calls so a change of load
    is seen. The first call of each is not counted: it pays for cold caches and page faults."""

    def __init__(self, first: int, explore: int = 32, weight: float = 0.25):
        self.current, self.explore, self.weight = first, explore, weight
        self.cost: list[float | None] = [None, None]  # seconds per call: [one thread, all]
        self.seen = [0, 0]
        self.calls = 0

    def pick(self) -> int:
        """0: one thread, 1: all of them. The other is tried less often the worse it was (every
        `explore` x its cost ratio calls), so trying costs at most ~1/explore of the time."""
        self.calls += 1
        other = 1 - self.current
        if self.cost[other] is None:
            return other if self.seen[self.current] >= 2 else self.current
        every = self.explore * max(1, round(self.cost[other] / max(self.cost[self.current], 1e-9)))
        return other if self.calls % every == 0 else self.current

    def record(self, i: int, seconds: float) -> None:
        self.seen[i] += 1
        if self.seen[i] == 1:
            return
        c = self.cost[i]
        self.cost[i] = seconds if c is None else c + self.weight * (seconds - c)
        if None not in self.cost:
            self.current = 0 if self.cost[0] <= self.cost[1] else 1


class GraphPlans:
    """ggml's plan(s) for one graph as the thread settings say: one plan (one thread, or all of
    them for a graph that reads at least `parallel_bytes` of weights), or with `adapt` a plan for
    each and a ThreadChoice between them. Every graph class computes through this."""

    def __init__(self, graph):
        n, how = ggml_threads(), thread_settings()
        set_gemm_paths(settings.current(), _G)  # which GEMMs its matmuls may take (tiled_gemm, sgemm_rows)
        set_fa_tiled_rows(settings.current(), _G)  # and from how many query rows its attention runs tiled
        split = n > 1 and _weight_bytes(graph) >= how.parallel_bytes
        counts = (1, n) if n > 1 and how.adapt else (n if split else 1,)
        self.plans = [_G.ggml_graph_plan(graph, c, _threadpool(c)) for c in counts]
        # One work buffer for every plan (they never run at once): the largest any of them needs.
        self.work = torch.empty(max(1, *(p.work_size for p in self.plans)), dtype=torch.uint8)
        for p in self.plans:
            p.work_data = ctypes.cast(self.work.data_ptr(), ctypes.POINTER(ctypes.c_uint8))
        self.n_threads = self.plans[-1 if split else 0].n_threads  # the first choice
        self.choice = ThreadChoice(1 if split else 0) if len(self.plans) > 1 else None
        self._refs = [ctypes.byref(p) for p in self.plans]

    def compute(self, graph) -> None:
        if self.choice is None:
            _G.ggml_graph_compute(graph, self._refs[0])
            return
        i = self.choice.pick()
        t0 = time.perf_counter()
        _G.ggml_graph_compute(graph, self._refs[i])
        self.choice.record(i, time.perf_counter() - t0)
