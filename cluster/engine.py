"""The engine: the one generation loop of moeray (`moeray generate`, `moeray run`, `moeray serve`).

Where a token goes, in the order this file runs it:

    Engine.add(prompt)         a Request waits in the scheduler (cluster/scheduler.py)
    Engine.step():
      scheduler.admit()        waiting requests take a sequence slot and their prompt's KV blocks
      scheduler.schedule(lane) ──▶ pipeline.submit(batch)      for every idle lane
      pipeline.result(oldest)  ──▶ scheduler.postprocess(step, out)
                               the tokens are appended, detokenised and the finish rules applied:
                               `Request.text` grows, `Request.done` turns true

Each running request belongs to one of `micro_batches` lanes; every lane has at most one step in
flight, so with M lanes up to M micro-batches move down the pipeline at once and the stages work
on different ones at the same time (stage 0 embeds lane 1 while stage 3 samples lane 0). A lone
lane's plain decode is chained instead (`_may_chain`): its next step goes out before its result
is back, the last stage sending its tokens to the first itself, so the stages do not wait for this
loop between a stream's tokens.

Speculative decoding (cluster/speculation.py, docs/speculative.md): a decode row may carry drafted
tokens, verified by the last stage; on a model with recurrent layers each verify row also snapshots
its sequence's state into a spare state slot (borrowed from the checkpoint slots) so a rejected
draft can be undone (cluster/scheduler.py). Without any such slot a hybrid model does not draft.

A pipeline is three calls (submit, result, recover): RayPipeline (cluster/driver.py) runs the
stages as Ray actors; LocalPipeline (cluster/local_pipeline.py) runs a whole model in this
process. A step that does not come back within `step_timeout_s` is reported with the stage it is
stuck on; a stage failure fails every running request (their KV state is gone) and the pipeline
restarts the stage.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import replace
from typing import Any, Callable, Protocol, Sequence

from moeray.cluster.config import EngineConfig
from moeray.cluster.remote import StageFailedError
from moeray.cluster.scheduler import EngineStats, Request, ScheduledStep, Scheduler
from moeray.cluster.state_checkpoints import CheckpointLedger
from moeray.cluster.speculation import Speculation
from moeray.cluster.step_clock import StepClock
from moeray.cluster.timeline import StepTiming, Timeline, now_ns
from moeray.errors import MoerayError
from moeray.stages.runtime.step import StepBatch, StepOutput
from moeray.stages.text.detokenize import StopStringStream
from moeray.stages.text.sampling import SamplingParams

log = logging.getLogger("moeray")

# A model with recurrent layers reuses a cached prefix only as far as a checkpoint of its state
# reaches (cluster/state_checkpoints.py, docs/hybrid.md): cached KV blocks hold attention's past but not a DeltaNet
# layer's, one state per sequence, as large as ~200 blocks of KV (Qwen3-Next-80B: 75 MiB against
# 384 KiB of float16 KV per 16-token block), so the stages keep a few chosen ones. Without any:
PREFIX_REUSE_OFF = ("prefix reuse off: this model's recurrent (DeltaNet) layers keep one state per sequence, "
                    "which cached KV blocks cannot restore, and the stages hold no checkpoints of it "
                    "(--state-checkpoints 0, or none fit); every prompt is prefilled whole")
# Speculation on a hybrid model snapshots a verifying sequence's state into a spare state slot,
# borrowed from the checkpoint slots (cluster/scheduler.py); with none of those there is no spare:
SPEC_OFF_NO_SPARES = ("speculative decoding off: this model's recurrent (DeltaNet) layers need a spare state slot "
                      "to snapshot a verifying sequence into (borrowed from the checkpoint slots), and the stages "
                      "hold none (--state-checkpoints 0, or none fit)")


class Pipeline(Protocol):
    n_stages: int

    def submit(self, batch: StepBatch) -> Any: ...

    def result(self, handle: Any, timeout_s: float) -> StepOutput: ...

    def recover(self) -> None: ...


class Engine:
    def __init__(self, pipeline: Pipeline, config: EngineConfig = EngineConfig(), tokenizer=None):
        """`tokenizer` (anything with decode() and end_ids) gives requests their text, end tokens and
        stop strings; without one the engine works in token ids (no end token, no stop strings)."""
        # The KV budget is the pipeline's pool (its stages allocated it); a config may ask for less.
        pool = getattr(pipeline, "kv_blocks", None)
        if pool is not None and config.kv_blocks is not None and config.kv_blocks > pool:
            raise MoerayError(f"kv_blocks {config.kv_blocks} is more than the {pool} blocks the stages allocated")
        # Recurrent layers: each sequence slot is also a state slot of the stages (allocated at
        # admission, freed at finish or preemption with the slot; a fresh slot starts from zeros).
        state_slots = getattr(pipeline, "state_slots", 0) or 0
        checkpoints = spares = None
        if state_slots:
            if config.max_seqs > state_slots:
                raise MoerayError(f"max_seqs {config.max_seqs} is more than the {state_slots} sequence states the "
                                  "stages allocated; lower --max-seqs or load the stages with more")
            n_ckpt = getattr(pipeline, "state_checkpoints", 0) or 0
            if config.prefix_reuse and n_ckpt:  # checkpoint slots follow the sequence slots
                checkpoints = CheckpointLedger(n_ckpt, base=state_slots)
            elif config.prefix_reuse:
                log.info(PREFIX_REUSE_OFF)
                config = replace(config, prefix_reuse=False)
            # verify rows borrow their spare state slots from the checkpoint slots (only them without prefix reuse)
            spares = checkpoints or (CheckpointLedger(n_ckpt, base=state_slots) if n_ckpt else None)
        self.pipeline, self.config, self.tokenizer = pipeline, config, tokenizer
        # Drafts go only to a pipeline whose last stage verifies them (StageRunner.sample).
        self.speculation = None
        # A hybrid model's verify rows need a spare state slot each (cluster/speculation.py).
        if getattr(pipeline, "verifies", False):
            if state_slots and spares is None:
                if config.speculative != "off":
                    log.info(SPEC_OFF_NO_SPARES)
            else:
                self.speculation = Speculation(config.speculative, getattr(pipeline, "step_price", None),
                                               max_draft=config.max_draft,
                                               draft_model=getattr(pipeline, "draft_model", False),
                                               draft_token_ms=getattr(pipeline, "draft_token_ms", 0.0),
                                               mtp=getattr(pipeline, "mtp", False),
                                               mtp_token_ms=getattr(pipeline, "mtp_token_ms", 0.0),
                                               recurrent=bool(state_slots))
        self.scheduler = Scheduler(config, tokenizer.end_ids if tokenizer is not None else (),
                                   config.kv_blocks or pool, checkpoints, self.speculation, spares,
                                   getattr(pipeline, "host_blocks", 0) or 0)
        self.in_flight: deque[tuple[ScheduledStep, Any]] = deque()
        self._ids = itertools.count()
        # Every step timed (its size and wall time), so speculation prices drafts at what steps cost here.
        self.clock = StepClock(getattr(pipeline, "step_experts", ()) or ()) if self.speculation is not None else None
        self._t_submit: dict[int, int] = {}  # step id -> when it was handed to the pipeline (ns)
        self._t_last = 0
        # A pipeline whose submit only sends the step (it computes meanwhile), and one whose last
        # stage can send its tokens to the first (chained decode: _may_chain)
        self.async_submit = bool(getattr(pipeline, "async_submit", False))
        self.loops_back = bool(getattr(pipeline, "loops_back", False)) and config.chained_decode
        self.last_step = StepTiming()  # the step whose result came back last (cluster/timeline.py)
        # After a stage failure step() restarts the pipeline itself (`moeray generate`, `run`); the
        # server's engine thread sets this False and recovers on a thread of its own
        # (cluster/engine_loop.py), so that recovery never holds the thread that takes requests.
        self.recovers_inline = True

    # ---------------------------------------------------------------- requests

    def add(self, prompt: Sequence[int], params: SamplingParams = SamplingParams(),
            timeline: Timeline | None = None) -> Request:
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise MoerayError("an empty prompt cannot be continued; give at least one token")
        max_len = self.config.max_len or self.scheduler.kv_tokens
        limit = min(max_len, self.scheduler.kv_tokens)
        room = limit - len(prompt)
        if room < 1:
            why = (f"max_len of {max_len} tokens" if limit == max_len else
                   f"KV cache of {self.scheduler.kv_tokens} tokens (raise --kv-blocks or --kv-fraction)")
            raise MoerayError(f"prompt of {len(prompt)} tokens leaves no room in the engine's {why}")
        if params.stop and self.tokenizer is None:
            raise MoerayError("stop strings need an engine with a tokenizer")
        detok = StopStringStream(self.tokenizer, params.stop) if self.tokenizer is not None else None
        req = Request(next(self._ids), prompt, params, min(params.max_tokens, room), detok, timeline=timeline)
        if timeline is not None:
            timeline.mark("taken")
        self.scheduler.waiting.append(req)
        return req

    def abort(self, req: Request) -> None:
        """Stop a request (a client went away); its slot frees once no step of it is in flight."""
        self.scheduler.abort(req)

    @property
    def waiting(self) -> deque[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def stats(self) -> EngineStats:
        return self.scheduler.stats

    @property
    def n_free_slots(self) -> int:
        return self.scheduler.n_free_slots

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.in_flight)

    # ---------------------------------------------------------------- the loop

    def step(self, on_submitted: Callable[[], None] | None = None) -> bool:
        """Admit, fill every idle lane with a micro-batch, then take the oldest result.
        `on_submitted`: called once the steps are on their way, before this waits for a result
        (before them on a pipeline that computes a step as it is handed one). False when there was
        nothing to run (every running sequence waits on something else): the caller should wait for
        news rather than call again at once."""
        self.scheduler.admit()
        if on_submitted is not None and not self.async_submit:
            on_submitted()
            on_submitted = None
        busy = {s.lane for s, _ in self.in_flight}
        submitted = False
        for lane in range(self.config.micro_batches):
            if lane not in busy and (step := self.scheduler.schedule(lane)) is not None:
                cont = self.scheduler.continue_decode(step) if self._may_chain(step) else None
                step.loop_back = cont is not None
                submitted = True
                if self._submit(step) and cont is not None:  # (a step that failed took its rows with it)
                    self._submit(cont)
        if on_submitted is not None:
            on_submitted()
        if not self.in_flight:
            self._t_last = 0.0  # nothing ran: the next step's time starts at its submission
            return submitted
        step, handle = self.in_flight.popleft()
        try:
            out = self.pipeline.result(handle, self.config.step_timeout_s)
        except StageFailedError as exc:
            self._fail_all(exc)
            raise
        end = now_ns()
        cold = getattr(out, "cold", False)
        ms, start = self._time(step, end, cold)
        spec = self.speculation
        accepted = spec.stats.accepted_tokens if spec is not None else 0
        self.scheduler.postprocess(step, out)
        if step.loop_back:  # a chained decode: the step after it runs; issue the one after that now
            ahead = [s for s, _ in self.in_flight if s.chained and s.lane == step.lane]
            if ahead and self._may_chain(ahead[-1]):
                cont = self.scheduler.continue_decode(ahead[-1])
                if cont is not None:
                    self._submit(cont)
        self.last_step = StepTiming(start, end, out.sample_ns, now_ns() - end)
        if spec is not None:  # the drafts' measured worth (cluster/speculation.py step_done); a cold step is not judged
            spec.step_done(sum(len(r.tokens) for r in step.rows), sum(len(r.draft) for r in step.rows),
                           spec.stats.accepted_tokens - accepted, sum(1 for r in step.rows if r.sample), ms,
                           sum(1 for r in step.rows if r.draft), cold=cold)
        if not self.has_work():  # idle from here: the next step's time starts at its submission
            self._t_last = 0.0
        return True

    def _submit(self, step: ScheduledStep) -> bool:
        """Hand `step` to the pipeline (which sees that the step after one that loops its tokens back
        takes them at the first stage: RayPipeline.submit). False when the submission raised a
        MoerayError: the step's rows failed and were freed."""
        t = self._t_submit[step.id] = now_ns()
        for row in step.rows:
            if row.req.timeline is not None:
                row.req.timeline.mark("scheduled", t)
        if step.chained:
            step.loop_back = True  # whether it is continued in turn is known later: its tokens go anyway
        try:
            handle = self.pipeline.submit(step.batch())
        except StageFailedError:
            raise  # a stage died: the pipeline's failure, recovered as such (step's caller)
        except Exception as exc:
            # In one process a step runs as it is submitted: a step that raised (a MoerayError of
            # the stage, a bug) fails its own rows, whose KV it may have half written; their slots
            # and blocks go back now, never left marked busy.
            self._t_submit.pop(step.id, None)
            self.scheduler.fail_step(step, f"the step failed: {type(exc).__name__}: {exc}")
            log.error("a step failed on submission; its %d request(s) failed: %s: %s", len(step.rows),
                      type(exc).__name__, exc)
            if not isinstance(exc, MoerayError):
                raise
            return False
        self.in_flight.append((step, handle))
        return True

    def _may_chain(self, step: ScheduledStep) -> bool:
        """A chained decode (docs/architecture.md): on a pipeline whose last stage can send its
        tokens to the first, a lone lane's plain decode step is continued before it comes back, so
        the stages never wait for the engine's round trip between a stream's tokens. Only while
        nothing waits and every running sequence is in that lane (another lane's step would take
        the looped tokens), and not for a sequence that drafts."""
        sched = self.scheduler
        return (self.loops_back and step.plain_decode and not sched.waiting
                and all(r.lane == step.lane for r in sched.running) and all(r.req.spec is None for r in step.rows))

    def _time(self, step: ScheduledStep, now: int, cold: bool = False) -> tuple[float, int]:
        """The step's cost (ms) and when it began: the result before it while the engine stayed busy
        (the step, and this loop's own work between steps: the last step's postprocess, the hand-off
        to the server, scheduling this one: a verify row that emits k tokens pays it once, k plain
        steps k times), else its submission. Steps in flight together overlap: each is charged the
        time between its result and the one before. A `cold` step (the stages built a graph for it)
        is not priced: that time is once per shape, not its size's."""
        t0 = self._t_last or self._t_submit.pop(step.id, now)
        self._t_submit.pop(step.id, None)
        self._t_last = now
        ms = (now - t0) / 1e6
        if self.clock is not None and not cold:
            n_logits = sum(len(r.draft) + 1 for r in step.rows if r.sample)
            drafted = sum(len(r.draft) for r in step.rows)
            verify_rows = sum(1 for r in step.rows if r.draft)
            if self.clock.record(sum(len(r.tokens) for r in step.rows), n_logits, ms, drafted, verify_rows):
                self.speculation.set_price(self.clock.price)
        return ms, t0

    def run(self, reqs: Sequence[Request], timeout_s: float = 600.0) -> list[Request]:
        """Step until these requests are done (others keep running alongside)."""
        deadline = time.monotonic() + timeout_s
        while not all(r.done for r in reqs):
            if time.monotonic() > deadline:
                raise StageFailedError(f"requests not done within {timeout_s:.0f} s")
            self.step()
        # A chained step past a sequence's end (_may_chain): its slot frees once it is back.
        while self.in_flight and all(row.req.done for s, _ in self.in_flight for row in s.rows):
            self.step()
        return list(reqs)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams(),
                 timeout_s: float = 600.0) -> list[Request]:
        return self.run([self.add(p, params) for p in prompts], timeout_s)

    def _fail_all(self, exc: Exception) -> None:
        """A stage failed: drain what is still in flight (bounded, those steps are lost with it),
        fail every running request, and let the pipeline restart what died."""
        self.stats.failures += 1
        for _step, handle in self.in_flight:
            try:
                self.pipeline.result(handle, min(10.0, self.config.step_timeout_s))
            except Exception:  # noqa: BLE001 - lost with the stage
                pass
        self.in_flight.clear()
        self._t_submit.clear()
        self.scheduler.fail_running(str(exc))
        if self.recovers_inline:
            self.recover()

    def recover(self) -> None:
        """Let the pipeline restart what died (or re-plan), then take its KV pool: after a re-plan
        on fewer devices it may hold another number of blocks."""
        self.pipeline.recover()
        self.recovered()

    def recovered(self) -> None:
        """After the pipeline recovered (on any thread): take its KV pool and state slots, on the
        thread that owns the engine."""
        pool = getattr(self.pipeline, "kv_blocks", None)
        host = getattr(self.pipeline, "host_blocks", 0) or 0  # a re-plan sizes the host tier again too
        if pool is not None and (pool != self.scheduler.blocks.n_blocks or host != self.scheduler.host_blocks):
            self.scheduler.host_blocks = host
            self.scheduler.resize_kv(pool)
        sched = self.scheduler
        ledger = sched.spares  # the checkpoint ledger, or the spares' own over the same slots
        if ledger is not None:  # a re-plan may hold another number of checkpoints (0: none found again)
            n, base = getattr(self.pipeline, "state_checkpoints", 0) or 0, getattr(self.pipeline, "state_slots", 0)
            if (n, base) != (ledger.n, ledger.base):
                sched.spares = CheckpointLedger(n, base)
                if sched.checkpoints is not None:
                    sched.checkpoints = sched.spares
