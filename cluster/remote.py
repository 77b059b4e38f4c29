"""Waiting on the stage actors: one deadline for a call made to every stage, and errors that name
the stage. The driver (probe, load, connect, stats) and the engine's RayPipeline (steps) both
wait through `as_ready`, so no wait on a stage is ever unbounded.

Ray is imported inside the functions: the engine catches StageFailedError without needing Ray
(`moeray generate` runs the same engine in one process).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Optional, Sequence

from moeray.errors import MoerayError


class StageFailedError(MoerayError):
    """A stage actor died, raised, or did not answer in time."""


class StagesLate(StageFailedError):
    """The deadline passed with these stages (in pipeline order) still working."""

    def __init__(self, stages: list[int], timeout_s: float):
        self.stages, self.timeout_s = stages, timeout_s
        super().__init__(f"stages {stages} did not answer within {timeout_s:.0f} s")


def as_ready(refs: Sequence[Any], timeout_s: float, stages: Optional[Sequence[int]] = None) -> Iterator[tuple[int, Any]]:
    """(stage, ref) for each ref as it becomes ready, all within one deadline; StagesLate past it.
    `stages[i]` names refs[i] (default: its index)."""
    import ray

    stages = list(range(len(refs))) if stages is None else list(stages)
    index = {ref: i for ref, i in zip(refs, stages)}
    pending, deadline = list(refs), time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise StagesLate(sorted(index[r] for r in pending), timeout_s)
        yield index[ready[0]], ready[0]


def error_of(ref: Any) -> Optional[BaseException]:
    """The exception a ready ref holds (a dead actor, a raising task), None if it succeeded or is not ready."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        ray.get(ref, timeout=0)
        return None
    except GetTimeoutError:
        return None
    except Exception as exc:  # noqa: BLE001 - the stage's failure, returned to be judged
        return exc


def gather(refs: Sequence[Any], timeout_s: float, what: str, stages: Optional[Sequence[int]] = None,
           progress: Optional[Callable[[int, Any], None]] = None) -> list:
    """The results of one call per stage, in order, within one deadline; `progress(stage, result)`
    as each comes in. A MoerayError raised inside a stage keeps its type and message (a model that
    does not fit is the user's to fix, not a stage failure); anything else names the stage."""
    import ray

    stages = list(range(len(refs))) if stages is None else list(stages)
    out: dict[int, Any] = {}
    try:
        for i, ref in as_ready(refs, timeout_s, stages):
            exc = error_of(ref)
            if exc is not None:
                raise _named(exc, i, what) from exc
            out[i] = ray.get(ref, timeout=1.0)
            if progress is not None:
                progress(i, out[i])
    except StagesLate as late:
        which = f"stage {late.stages[0]}" if len(late.stages) == 1 else f"stages {late.stages}"
        raise StageFailedError(f"{which}: {what} did not finish within {timeout_s:.0f} s") from None
    return [out[i] for i in stages]


def gather_one(ref: Any, timeout_s: float, what: str, stage: int = 0) -> Any:
    return gather([ref], timeout_s, what, [stage])[0]


def _named(exc: BaseException, stage: int, what: str) -> Exception:
    from ray.exceptions import RayActorError

    if isinstance(exc, RayActorError):
        return StageFailedError(f"stage {stage}: its actor died during {what} ({exc.__class__.__name__})")
    cause = getattr(exc, "cause", None) or exc
    if isinstance(cause, MoerayError):
        return type(cause)(str(cause))
    return StageFailedError(f"stage {stage}: {what} failed: {cause}")
