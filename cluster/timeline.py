"""Where a served request's time goes: timestamps carried on the request, read by a bench.

Every mark is `time.perf_counter_ns()` (Linux: CLOCK_MONOTONIC, one clock for every process of a
host, so a client on the same machine can set its own arrival times beside them). Taking one
costs about 50 ns; nothing is printed or formatted on the serving path: the records are read
through `GET /v1/stages/timeline` (the last requests, raw) and summed up in `GET /v1/stages`
(`stream`: medians of the last requests).

A request's marks, in order (TTFT):
    http        the request reached the app (its ASGI entry, before the body is read)
    parsed      the handler runs: body read and validated
    rendered    chat template rendered and the prompt tokenised (a worker thread)
    prepared    checks done, sampling parameters built (a grammar compiled)
    submitted   posted to the engine thread's inbox
    taken       the engine thread took it (Engine.add)
    admitted    it got a sequence slot and its prompt's KV blocks
    scheduled   its first row was handed to the pipeline (prefill starts)
and per delivery (one per engine step that released tokens of it), parallel lists:
    tokens, chars          its tokens and the characters of text they released
    step_start, step_end   the step's batch handed to the pipeline, its result back
    sample_ns              of that step, the last stage's head and sampling
    post_ns                the step's postprocess (every row: tokens appended, finish rules)
    detok_ns, stop_ns      of that, this request's detokenising and stop-string matching
    handed                 the engine thread posted it to the event loop
    queued                 the event loop put it on the request's stream
    taken                  the handler took it
    written                its SSE chunk was written (the send returned)
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional

now_ns = time.perf_counter_ns

MARKS = ("http", "parsed", "rendered", "prepared", "submitted", "taken", "admitted", "scheduled")
KEEP_REQUESTS = 64  # requests whose records a server keeps for the bench
MAX_DELIVERIES = 512  # deliveries recorded per request (a long generation keeps its first ones)


@dataclass
class StepTiming:
    """One engine step, as the engine saw it: when its batch was handed to the pipeline, when its
    result came back, the last stage's sampling time, and the postprocess that followed."""
    start: int = 0
    end: int = 0
    sample_ns: int = 0
    post_ns: int = 0


@dataclass
class Timeline:
    id: str = ""
    prompt_tokens: int = 0
    marks: dict[str, int] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)
    chars: list[int] = field(default_factory=list)  # characters of text it released (0: held back)
    step_start: list[int] = field(default_factory=list)
    step_end: list[int] = field(default_factory=list)
    sample_ns: list[int] = field(default_factory=list)
    post_ns: list[int] = field(default_factory=list)
    detok_ns: list[int] = field(default_factory=list)
    stop_ns: list[int] = field(default_factory=list)
    handed: list[int] = field(default_factory=list)
    queued: list[int] = field(default_factory=list)
    taken: list[int] = field(default_factory=list)
    written: list[int] = field(default_factory=list)
    done: int = 0  # the response's last byte was handed to the server (0: not yet)

    def mark(self, name: str, t: Optional[int] = None) -> None:
        self.marks.setdefault(name, now_ns() if t is None else t)

    def delivered(self, n_tokens: int, n_chars: int, step: StepTiming, detok_ns: int, stop_ns: int,
                  handed: int) -> None:
        """On the engine thread: one delivery of `n_tokens` (and `n_chars` of text) from `step`."""
        self.tokens.append(n_tokens)
        self.chars.append(n_chars)
        self.step_start.append(step.start)
        self.step_end.append(step.end)
        self.sample_ns.append(step.sample_ns)
        self.post_ns.append(step.post_ns)
        self.detok_ns.append(detok_ns)
        self.stop_ns.append(stop_ns)
        self.handed.append(handed)

    def as_dict(self) -> dict:
        return asdict(self)


class TimelineLog:
    """The last KEEP_REQUESTS requests' timelines (a deque: appends and reads from two threads)."""

    def __init__(self, keep: int = KEEP_REQUESTS):
        self.records: deque[Timeline] = deque(maxlen=keep)

    def add(self, t: Timeline) -> None:
        self.records.append(t)

    def last(self, n: int) -> list[dict]:
        return [t.as_dict() for t in list(self.records)[-n:]]

    def summary(self) -> dict:
        """Medians over the kept requests (ms): TTFT by part and a delivery's time by part."""
        return summarize(list(self.records))


def _ms(ns: Iterable[float]) -> Optional[float]:
    xs = list(ns)
    return round(statistics.median(xs) / 1e6, 3) if xs else None


def ttft_parts(t: Timeline) -> dict[str, int]:
    """A request's time to its first written chunk, by part (ns), from its marks and first delivery."""
    m = dict(t.marks)
    if t.step_end:
        m["first_result"] = t.step_end[0]
        m["first_handed"] = t.handed[0]
    if t.queued:
        m["first_queued"] = t.queued[0]
    if t.taken:
        m["first_taken"] = t.taken[0]
    if t.written:
        m["first_written"] = t.written[0]
    order = [*MARKS, "first_result", "first_handed", "first_queued", "first_taken", "first_written"]
    names = {"parsed": "http_and_validation", "rendered": "render_and_tokenise", "prepared": "prepare",
             "submitted": "submit", "taken": "inbox", "admitted": "admission", "scheduled": "schedule",
             "first_result": "prefill_and_first_sample", "first_handed": "postprocess_and_hand_off",
             "first_queued": "to_event_loop", "first_taken": "queue", "first_written": "first_sse_write"}
    out, last = {}, None
    for k in order:
        if k not in m:
            continue
        if last is not None:
            out[names[k]] = m[k] - m[last]
        last = k
    return out


def token_parts(t: Timeline) -> dict[str, list[int]]:
    """Each delivery after the first, by part (ns): the step itself and what lies around it."""
    out: dict[str, list[int]] = {k: [] for k in (
        "step", "sample", "engine_gap", "postprocess", "detokenise", "stop_strings", "hand_off",
        "to_event_loop", "queue", "sse_write", "interval")}
    for i in range(1, len(t.handed)):
        out["step"].append(t.step_end[i] - t.step_start[i])
        out["sample"].append(t.sample_ns[i])
        out["engine_gap"].append(t.step_start[i] - t.step_end[i - 1])  # the engine thread between steps
        out["postprocess"].append(t.post_ns[i])
        out["detokenise"].append(t.detok_ns[i])
        out["stop_strings"].append(t.stop_ns[i])
        out["hand_off"].append(t.handed[i] - t.step_end[i])  # result back -> posted (postprocess included)
        if i < len(t.queued):
            out["to_event_loop"].append(t.queued[i] - t.handed[i])
        if i < len(t.taken) and i < len(t.queued):
            out["queue"].append(t.taken[i] - t.queued[i])
        if i < len(t.written) and i < len(t.taken):
            out["sse_write"].append(t.written[i] - t.taken[i])
        out["interval"].append(t.handed[i] - t.handed[i - 1])
    return out


def summarize(records: list[Timeline]) -> dict:
    """Medians (ms) over requests: TTFT parts, and every delivery's parts after each first."""
    if not records:
        return {"requests": 0}
    ttft: dict[str, list[int]] = {}
    per_token: dict[str, list[int]] = {}
    for t in records:
        for k, v in ttft_parts(t).items():
            ttft.setdefault(k, []).append(v)
        for k, vs in token_parts(t).items():
            per_token.setdefault(k, []).extend(vs)
    return {"requests": len(records),
            "ttft_ms": {k: _ms(v) for k, v in ttft.items()},
            "token_ms": {k: _ms(v) for k, v in per_token.items() if v}}


def stage_hops(driver: list[tuple], stages: list[list[tuple]], same_clock: bool) -> dict:
    """Per-hop times of the pipeline's recent steps (ms, medians), from the driver's record of each
    step (step id, submit start, submit end, result back) and each stage's (step id, call start,
    input ready, layers done, output sent or sampled). Across stages and the driver the timestamps
    compare only on one host's clock (`same_clock`); without it only each stage's own durations
    are given."""
    n = len(stages)
    out: dict = {"stages": []}
    for i, recs in enumerate(stages):
        last = i == n - 1
        out["stages"].append({
            "stage": i,
            "wait_input_ms": _ms(r[2] - r[1] for r in recs),  # the call's start to its input (received, or embedded)
            "compute_ms": _ms(r[3] - r[2] for r in recs),  # its layers
            ("sample_ms" if last else "send_ms"): _ms(r[4] - r[3] for r in recs),  # the head and sampling, or the send
        })
    if not same_clock or not driver or not n:
        return out
    by_stage = [{r[0]: r for r in recs} for recs in stages]
    steps = [d for d in driver if all(d[0] in s for s in by_stage)]
    out["steps"] = len(steps)
    if not steps:
        return out
    at = [[by_stage[i][d[0]] for i in range(n)] for d in steps]
    out["step_ms"] = _ms(d[3] - d[1] for d in steps)  # submitted to result back, as the engine waits
    out["submit_ms"] = _ms(d[2] - d[1] for d in steps)  # the driver's remote calls to every stage
    out["call_to_first_stage_ms"] = _ms(a[0][1] - d[1] for d, a in zip(steps, at))
    out["hops_ms"] = [_ms(a[i][2] - a[i - 1][3] for a in at) for i in range(1, n)]  # send start to input ready
    out["return_ms"] = _ms(d[3] - a[-1][4] for d, a in zip(steps, at))  # sampled to the driver's hands
    out["compute_ms"] = _ms(sum(r[3] - r[2] for r in a) + a[-1][4] - a[-1][3] for a in at)
    return out
