"""After a stage failure the pipeline may come back different (a re-plan on the devices a lost node
left: another KV pool), or not at all (what is left cannot hold the model). The engine and its
thread against a scripted pipeline, no Ray: the engine takes the new pool and fails only the
waiting prompts that no longer fit; a pipeline that cannot serve makes every request an immediate
error with its reason, and serving resumes when a retry succeeds."""
from __future__ import annotations

import asyncio
import time

import pytest

from moeray.cluster.engine_loop import EngineDownError, EngineLoop, Finished
from moeray.cluster.remote import StageFailedError
from moeray.cluster.scheduler import RequestStatus
from moeray.errors import PlacementError
from moeray.stages.blocks.kv_cache import BLOCK_SIZE
from moeray.stages.text.sampling import SamplingParams
from test_engine import engine, ids


class Replanned:
    """recover() of a pipeline whose re-plan gave a pool of `blocks` blocks, or raised `error`."""

    def __init__(self, pipe, blocks: int | None = None, error: str | None = None):
        self.pipe, self.blocks, self.error, self.calls = pipe, blocks, error, 0

    def __call__(self):
        self.calls += 1
        if self.error is not None:
            raise PlacementError(self.error)
        if self.blocks is not None:
            self.pipe.kv_blocks = self.blocks


def test_after_a_replan_the_engine_takes_the_new_kv_pool_and_fails_only_what_no_longer_fits():
    eng, pipe = engine({c: "abcdef" for c in "pqr"}, fail_at=1, max_seqs=2, micro_batches=2, max_len=64,
                       kv_blocks=8)
    pipe.recover = Replanned(pipe, blocks=2)  # 32 tokens after the re-plan, 128 before
    p, q = (eng.add(ids(c) * 3, SamplingParams(max_tokens=6)) for c in "pq")
    long = eng.add(ids("r") * 40, SamplingParams(max_tokens=6))  # fits 128 tokens, not 32
    short = eng.add(ids("r") * 28, SamplingParams(max_tokens=10))  # fits, with 4 tokens of room
    eng.step()
    with pytest.raises(StageFailedError):
        eng.step()
    assert p.status == q.status == RequestStatus.FAILED
    assert eng.scheduler.blocks.n_blocks == 2 and eng.scheduler.kv_tokens == 2 * BLOCK_SIZE
    assert long.status is RequestStatus.FAILED and "holds 32 tokens" in long.error and long not in eng.waiting
    assert short.max_new == 4
    eng.run([short])
    assert short.text == "abcd"


def test_a_pipeline_that_cannot_serve_answers_every_request_with_the_reason_then_serves_again():
    eng, pipe = engine({"a": "hello", "b": "xyz"}, fail_at=0, max_seqs=2, micro_batches=1)
    reason = "cannot serve: no placement fits (after: node ab12 left the cluster with stage 1)"
    pipe.recover = Replanned(pipe, error=reason)
    loop = EngineLoop(eng, idle_wait_s=0.01, retry_s=0.2).start()

    async def finished(stream):
        while True:
            item = await stream.next(10)
            if isinstance(item, Finished):
                return item

    async def main():
        first = await finished(loop.submit(ids("a"), SamplingParams(max_tokens=4)))
        while loop.down is None:
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        with pytest.raises(EngineDownError) as refused:
            loop.submit(ids("b"), SamplingParams(max_tokens=3))
        refused_in = time.monotonic() - t0
        tries = pipe.recover.calls
        await asyncio.sleep(0.5)
        retried = pipe.recover.calls - tries, loop.alive
        pipe.recover.error = None  # a node joined: the next retry re-plans and succeeds
        while loop.down is not None:
            await asyncio.sleep(0.05)
        again = await finished(loop.submit(ids("b"), SamplingParams(max_tokens=3)))
        return first, str(refused.value), refused_in, retried, again

    try:
        first, refused, refused_in, retried, again = asyncio.run(main())
    finally:
        loop.stop()
    assert first.reason is None and "stage 0 died" in first.error  # the request in flight: the stage's error
    assert refused == reason and refused_in < 0.1  # at once, with the reason, not a wait
    assert retried[0] >= 1 and retried[1]  # retried while down; the thread lives on
    assert again.reason == "length" and again.error is None


def test_the_fault_counts_export_as_engine_metrics_and_count_only_what_is_new():
    pytest.importorskip("ray")
    from moeray.cluster.metrics import ENGINE_TAGS, METRICS, Metrics

    m = Metrics("m")
    # Engine-side metrics carry only the model tag (a moeray_stage_* name would want stage and node).
    m.faults({"stage_failures": 2, "restarts": 1, "nodes_lost": 0, "replans": 0, "stages_serving": 3})
    m.faults({"stage_failures": 3, "restarts": 1, "nodes_lost": 1, "replans": 1, "stages_serving": 2,
              "last_recovery_s": 8.2})
    assert {n: v for (n, _), v in m._seen.items()} == {"moeray_failed_steps": 3, "moeray_restarted_stages": 1,
                                                         "moeray_nodes_lost": 1, "moeray_replans": 1}
    assert all(not n.startswith("moeray_stage_") for n, _ in m._seen) and ENGINE_TAGS == ("model",)
    assert METRICS["moeray_stages_serving"][0] == "gauge"


def test_the_driver_restarts_in_place_replans_after_a_node_loss_and_retries_only_when_devices_change():
    from moeray.cluster.driver import Launched, NodeLostError

    class Group:
        def __init__(self, outcome):
            self.outcome = outcome

        def recover(self):
            if isinstance(self.outcome, Exception):
                raise self.outcome
            return self.outcome

    replans = []
    launched = Launched("m.gguf", Group([2]), [], None, [], 0.0, [], log=None)
    launched.replan = lambda cause, t0=None: replans.append(cause)
    launched.recover()  # a stage died on a live node: restarted in place
    assert launched.faults["restarts"] == 1 and launched.events[-1]["event"] == "restarted" and not replans
    lost = NodeLostError("node ab12cd34ef56 (10.0.0.2) left the cluster with stage 1", ["ab12cd34ef56"])
    launched.group = Group(lost)
    launched.recover()  # its node left: re-plan on what is left, naming why
    assert replans == [str(lost)] and launched.faults["nodes_lost"] == 1
    assert [e["event"] for e in launched.events] == ["restarted", "node lost"]
    launched.down, launched.down_devices = "cannot serve: no placement fits (after: ...)", 1
    launched.devices_left = lambda: (1, None)
    with pytest.raises(PlacementError, match="cannot serve"):
        launched.recover()  # nothing joined: the same answer, no new probe
    assert len(replans) == 1 and launched.faults["stage_failures"] == 2  # a retry is not a failure
    launched.devices_left = lambda: (2, None)
    launched.recover()  # a node joined: try again
    assert replans == [str(lost), str(lost)]
