"""The pipelined engine: continuous batching over a pipeline of stages.

Requests wait until a KV slot is free, then run. Each running request belongs to one of
`micro_batches` lanes; every lane has at most one step in flight, so with M lanes up to M
micro-batches move down the pipeline at once and the stages work on different ones at the
same time (stage 0 embeds lane 1 while stage 3 samples lane 0). A lane's step packs one decode
token per decoding request, then prompt chunks (at most `prefill_chunk` tokens of a prompt per
step, chunked prefill) until the step's `token_budget` is spent, so a long prompt never stalls
the decodes that share its lane.

The engine talks to a pipeline through three calls (submit, result, recover): RayPipeline runs
the stages as Ray actors, LocalPipeline runs a whole model in this process (the reference and
the one-stage baseline). Every wait has a deadline: a step that does not come back in
`step_timeout_s` is reported with the stage it is stuck on.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from moeray.cluster.driver import StageFailedError
from moeray.stages.actor import StepBatch
from moeray.errors import MoerayError
from moeray.stages.sampling import SamplingParams


@dataclass
class EngineConfig:
    max_seqs: int = 16  # KV slots: requests running at once
    max_len: int = 1024  # prompt + output tokens per request
    token_budget: int = 256  # new tokens per micro-batch step
    prefill_chunk: int = 128  # prompt tokens of one request per step
    micro_batches: int = 2  # lanes: steps in flight at once
    step_timeout_s: float = 60.0


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    max_new: int  # params.max_tokens capped by the KV length
    output: list[int] = field(default_factory=list)
    status: str = "waiting"  # waiting | running | finished | failed
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    error: str | None = None
    slot: int = -1
    lane: int = -1
    fed: int = 0  # prompt tokens handed to the pipeline so far
    busy: bool = False  # in a micro-batch that is in flight
    t_arrive: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_done: float | None = None

    @property
    def done(self) -> bool:
        return self.status in ("finished", "failed")


class Pipeline(Protocol):
    n_stages: int

    def submit(self, batch: StepBatch) -> Any: ...

    def result(self, handle: Any, timeout_s: float) -> list[int | None]: ...

    def recover(self) -> None: ...


class Engine:
    def __init__(self, pipeline: Pipeline, config: EngineConfig = EngineConfig(), eos_ids: Sequence[int] = ()):
        self.pipeline, self.config = pipeline, config
        self.eos_ids = frozenset(eos_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        if config.micro_batches < 1 or config.max_seqs < config.micro_batches:
            raise MoerayError(f"need 1 <= micro_batches ({config.micro_batches}) <= max_seqs ({config.max_seqs})")
        # Each lane owns a contiguous range of KV slots, and a micro-batch lists its slots in
        # order: a lane whose requests hold neighbouring slots reads the KV cache as one view.
        m = config.micro_batches
        self.lane_slots = [list(range(l * config.max_seqs // m, (l + 1) * config.max_seqs // m)) for l in range(m)]
        self.in_flight: deque[tuple[Any, StepBatch, list[Request]]] = deque()
        self._ids = itertools.count()
        self._steps = itertools.count()
        self.stats = {"steps": 0, "decode_tokens": 0, "prefill_tokens": 0, "failures": 0}

    # ---------------------------------------------------------------- requests

    def add(self, prompt: Sequence[int], params: SamplingParams = SamplingParams()) -> Request:
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise MoerayError("an empty prompt cannot be continued; give at least one token")
        room = self.config.max_len - len(prompt)
        if room < 1:
            raise MoerayError(f"prompt of {len(prompt)} tokens leaves no room in the engine's "
                              f"max_len of {self.config.max_len} tokens")
        req = Request(next(self._ids), prompt, params, min(params.max_tokens, room))
        self.waiting.append(req)
        return req

    def abort(self, req: Request) -> None:
        """Stop a request (a client went away); its slot frees once no step of it is in flight."""
        if req.status == "waiting":
            self.waiting.remove(req)
        if not req.done:
            self._finish(req, "abort")

    @property
    def n_free_slots(self) -> int:
        return sum(len(s) for s in self.lane_slots)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.in_flight)

    # ---------------------------------------------------------------- the loop

    def step(self) -> None:
        """Admit, fill every idle lane with a micro-batch, then take the oldest result."""
        self._admit()
        busy_lanes = {reqs[0].lane for _, _, reqs in self.in_flight}
        for lane in range(self.config.micro_batches):
            if lane not in busy_lanes:
                self._launch(lane)
        if not self.in_flight:
            return
        handle, batch, reqs = self.in_flight.popleft()
        try:
            tokens = self.pipeline.result(handle, self.config.step_timeout_s)
        except StageFailedError as exc:
            self._fail_all(exc)
            raise
        self.stats["steps"] += 1
        now = time.perf_counter()
        for req, tok in zip(reqs, tokens):
            req.busy = False
            if req.done:  # aborted while in flight: free its slot now
                self._release(req)
                continue
            if tok is None:
                continue
            if req.t_first is None:
                req.t_first = now
            req.output.append(tok)
            if tok in self.eos_ids and not req.params.ignore_eos:
                self._finish(req, "stop")
            elif len(req.output) >= req.max_new:
                self._finish(req, "length")

    def run(self, reqs: Sequence[Request], timeout_s: float = 600.0) -> list[Request]:
        """Step until these requests are done (others keep running alongside)."""
        deadline = time.monotonic() + timeout_s
        while not all(r.done for r in reqs):
            if time.monotonic() > deadline:
                raise StageFailedError(f"requests not done within {timeout_s:.0f} s")
            self.step()
        return list(reqs)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams(),
                 timeout_s: float = 600.0) -> list[Request]:
        return self.run([self.add(p, params) for p in prompts], timeout_s)

    # ---------------------------------------------------------------- internals

    def _admit(self) -> None:
        while self.waiting and any(self.lane_slots):
            req = self.waiting.popleft()
            req.lane = max(range(len(self.lane_slots)), key=lambda l: len(self.lane_slots[l]))
            free = self.lane_slots[req.lane]
            req.slot = free.pop(free.index(min(free)))
            req.status = "running"
            self.running.append(req)

    def _launch(self, lane: int) -> None:
        budget = self.config.token_budget
        reqs, n_new, tokens, fresh, sample = [], [], [], [], []
        members = [r for r in self.running if r.lane == lane and not r.busy and not r.done]
        # Decodes first: one token each, they are what users wait on between tokens.
        for r in members:
            if r.fed == len(r.prompt) and budget >= 1:
                reqs.append(r), n_new.append(1), tokens.append([r.output[-1]]), fresh.append(False)
                sample.append(r.params)
                budget -= 1
        for r in members:
            if r.fed < len(r.prompt) and budget >= 1:
                n = min(self.config.prefill_chunk, len(r.prompt) - r.fed, budget)
                reqs.append(r), n_new.append(n), tokens.append(r.prompt[r.fed:r.fed + n])
                fresh.append(r.fed == 0)
                r.fed += n
                sample.append(r.params if r.fed == len(r.prompt) else None)
                budget -= n
        if not reqs:
            return
        order = sorted(range(len(reqs)), key=lambda i: reqs[i].slot)
        reqs, n_new, tokens, fresh, sample = ([xs[i] for i in order] for xs in (reqs, n_new, tokens, fresh, sample))
        for r in reqs:
            r.busy = True
        batch = StepBatch(next(self._steps), [r.slot for r in reqs], n_new, fresh, tokens, sample)
        n_decode = sum(1 for f, n, s in zip(fresh, n_new, sample) if n == 1 and s is not None and not f)
        self.stats["decode_tokens"] += n_decode
        self.stats["prefill_tokens"] += sum(n_new) - n_decode
        self.in_flight.append((self.pipeline.submit(batch), batch, reqs))

    def _finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason, req.t_done = "finished", reason, time.perf_counter()
        if not req.busy:
            self._release(req)

    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
            self.lane_slots[req.lane].append(req.slot)

    def _fail_all(self, exc: Exception) -> None:
        """A stage failed: every running request lost its KV state. Fail them, drain what is still
        in flight (bounded), and let the pipeline restart what died; waiting requests stay."""
        self.stats["failures"] += 1
        msg = str(exc)
        for _handle, _batch, _reqs in list(self.in_flight):
            try:
                self.pipeline.result(_handle, min(10.0, self.config.step_timeout_s))
            except Exception:  # noqa: BLE001 - these steps are lost with the stage
                pass
        self.in_flight.clear()
        for req in list(self.running):
            req.status, req.error, req.busy, req.t_done = "failed", msg, False, time.perf_counter()
            self._release(req)
        self.pipeline.recover()


# ---------------------------------------------------------------- pipelines


class LocalPipeline:
    """The whole model in this process, one stage: the reference and the one-stage baseline."""

    n_stages = 1

    def __init__(self, path: str, max_seqs: int, max_len: int, simulated_budget: int | None = None):
        from moeray.stages.actor import StageActor

        budget = simulated_budget if simulated_budget is not None else 1 << 62
        self.stage = StageActor(0, 1, budget)
        from moeray.stages.gguf_file import read_gguf_header

        n_layers = read_gguf_header(path).config.n_layers
        self.load_report = self.stage.load(path, 0, n_layers, max_seqs, max_len)

    def submit(self, batch: StepBatch) -> Any:
        return self.stage.step(batch)

    def result(self, handle: Any, timeout_s: float) -> list[int | None]:
        return handle

    def recover(self) -> None:
        pass


class RayPipeline:
    """Stages as Ray actors: every stage gets the step at once; activations flow over their
    process group; the last stage's sampled tokens come back."""

    def __init__(self, group):
        self.group = group
        self.n_stages = group.n_stages

    def submit(self, batch: StepBatch) -> Any:
        return [a.step.remote(batch.for_stage(i, self.n_stages)) for i, a in enumerate(self.group.actors)]

    def result(self, handle: Any, timeout_s: float) -> list[int | None]:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        # Take results as they come, so a stage that died or raised is reported at once, not
        # after the stages behind it give up waiting for its activations.
        index = {ref: i for i, ref in enumerate(handle)}
        pending, deadline = list(handle), time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                stuck = min(index[r] for r in pending)
                self.group.mark_hung(stuck)
                raise StageFailedError(
                    f"stage {stuck} ({self.group.where(stuck)}) did not finish a step within {timeout_s:.0f} s; "
                    "it was stopped and will be restarted")
            errors = []
            if any(_failed(ref) for ref in ready) and pending:
                # Give the other stages a moment to report too: the root cause is the earliest.
                more, pending = ray.wait(pending, num_returns=len(pending), timeout=2.0)
                ready = ready + more
            for ref in ready:
                try:
                    ray.get(ref, timeout=1.0)
                except (RayActorError, RayTaskError) as exc:
                    errors.append((index[ref], exc))
            if errors:
                raise _blame(errors, self.group)
        return ray.get(handle[-1], timeout=1.0)

    def recover(self) -> None:
        self.group.recover()


def _failed(ref) -> bool:
    import ray

    try:
        ray.get(ref, timeout=0)
        return False
    except Exception:  # noqa: BLE001 - an error result (or, with timeout 0, one not ready: not ours)
        return True


def _blame(errors: list[tuple[int, Exception]], group) -> StageFailedError:
    """The root cause among a step's per-stage errors: a dead actor first, else the earliest stage
    whose error is its own (not the 'failed upstream' the stages after it report)."""
    from ray.exceptions import RayActorError

    from moeray.stages.transport import TransportError

    for i, exc in errors:
        if isinstance(exc, RayActorError):
            return StageFailedError(f"stage {i} ({group.where(i)}) died during a step; "
                                    "the requests it was serving failed, the stage is being restarted")
    for i, exc in errors:
        cause = getattr(exc, "cause", None) or exc
        if not isinstance(cause, TransportError):
            if isinstance(cause, MoerayError):
                return StageFailedError(f"stage {i}: {cause}")
            return StageFailedError(f"stage {i} ({group.where(i)}) failed a step: {cause!r}")
    i, exc = errors[0]
    return StageFailedError(f"stage {i} ({group.where(i)}): {getattr(exc, 'cause', None) or exc}")
