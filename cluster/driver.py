"""The driver: probe -> plan -> load -> wire.

1. Spawn one StageActor per stage in a placement group (one bundle per stage: {GPU: 1} on a
   cluster with GPUs, a custom `moeray_device` resource where nodes declare one, else a sliver
   of CPU for simulated devices), PACK by default, SPREAD on request.
2. Probe: every actor reports its device, free bytes, node and measured speeds, and the
   model file's size and sampled hash as its node sees it (a node with a different file is named).
3. Plan: the placement search runs over the reported budgets and speeds.
4. Load: each actor loads only its layer range; KV cache allocated.
5. Wire: the stages join one process group (activations go stage to stage over it).

Every remote wait has a timeout: a stage that hangs is reported by name, never waited on forever.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from stages.errors import MoerayError, PlacementError

DEVICE_RESOURCE = "moeray_device"  # declare it on nodes (ray start --resources) to stand in for GPUs
SIM_CPU = 0.01  # what a simulated stage reserves: stages must not hold whole cores (2-core hosts)


class StageFailedError(MoerayError):
    """A stage actor died, raised, or did not answer in time."""


def ensure_ray(address: str | None = None) -> None:
    """Join the cluster at `address`, or start a local one; log lines from actors stay readable."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray

    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=True,
                 logging_level="WARNING", configure_logging=True)


def stage_resources(simulated: bool) -> tuple[dict[str, float], dict[str, Any]]:
    """(bundle, actor options) for one stage on this cluster."""
    import ray

    have = ray.cluster_resources()
    if not simulated:
        if have.get("GPU", 0) < 1:
            raise PlacementError("the Ray cluster has no GPUs; pass --simulate-devices SIZE,... to run on CPU")
        return {"GPU": 1.0}, {"num_gpus": 1, "num_cpus": 0}
    if have.get(DEVICE_RESOURCE, 0) >= 1:
        return {DEVICE_RESOURCE: 1.0}, {"num_cpus": 0, "resources": {DEVICE_RESOURCE: 1.0}}
    return {"CPU": SIM_CPU}, {"num_cpus": SIM_CPU}


def _get(refs, timeout_s: float, what: str, stages: list[int] | None = None):
    """ray.get with a deadline; a dead or slow stage becomes a StageFailedError that names it."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    single = not isinstance(refs, list)
    refs_l = [refs] if single else refs
    stages = stages if stages is not None else list(range(len(refs_l)))
    out = []
    deadline = time.monotonic() + timeout_s
    for i, ref in zip(stages, refs_l):
        try:
            out.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
        except GetTimeoutError as exc:
            raise StageFailedError(f"stage {i}: {what} did not finish within {timeout_s:.0f} s") from exc
        except RayActorError as exc:
            raise StageFailedError(f"stage {i}: its actor died during {what} ({exc.__class__.__name__})") from exc
        except RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            if isinstance(cause, MoerayError):
                raise type(cause)(str(cause)) from exc
            raise StageFailedError(f"stage {i}: {what} failed: {cause}") from exc
    return out[0] if single else out


@dataclass
class StageGroup:
    """The stage actors of one pipeline and the placement group that pins them."""
    n_stages: int
    simulate: list[int] | None = None
    strategy: str = "PACK"
    torch_threads: int | None = None
    timeout_s: float = 120.0
    actors: list[Any] = field(default_factory=list)
    pg: Any = None
    reports: list[dict] = field(default_factory=list)
    _actor_opts: dict = field(default_factory=dict)

    def start(self) -> "StageGroup":
        import ray
        from ray.util.placement_group import placement_group

        if self.simulate is not None and len(self.simulate) != self.n_stages:
            raise MoerayError(f"--simulate-devices lists {len(self.simulate)} devices for {self.n_stages} stages")
        if self.strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise MoerayError(f"placement strategy '{self.strategy}' is not one of PACK, SPREAD")
        bundle, self._actor_opts = stage_resources(self.simulate is not None)
        self.pg = placement_group([dict(bundle) for _ in range(self.n_stages)], strategy=self.strategy)
        try:
            ray.get(self.pg.ready(), timeout=self.timeout_s)
        except Exception as exc:
            ray.util.remove_placement_group(self.pg)
            raise PlacementError(
                f"could not reserve {self.n_stages} x {bundle} ({self.strategy}) within {self.timeout_s:.0f} s; "
                f"the cluster has {ray.available_resources()}") from exc
        self.actors = [self._spawn(i) for i in range(self.n_stages)]
        _get([a.ping.remote() for a in self.actors], self.timeout_s, "start")
        return self

    def _spawn(self, i: int):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from stages.actor import StageActor

        budget = None if self.simulate is None else self.simulate[i]
        return ray.remote(StageActor).options(
            name=None, max_restarts=0, **self._actor_opts,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
        ).remote(i, self.n_stages, budget, self.torch_threads)

    def probe(self, path: str) -> list[dict]:
        """Each actor's report (device, budget, node, speeds); checks every node sees the same file."""
        self.reports = _get([a.probe.remote(path) for a in self.actors], self.timeout_s, "probe")
        ref = self.reports[0]["file"]
        for r in self.reports[1:]:
            if r["file"] != ref:
                raise MoerayError(
                    f"{path} differs between nodes: stage 0 on {self.reports[0]['device']['node_ip']} sees "
                    f"{ref['size']} bytes (sampled sha256 {ref['sha256_sampled'][:12]}), stage {r['stage']} on "
                    f"{r['device']['node_ip']} sees {r['file']['size']} bytes ({r['file']['sha256_sampled'][:12]}); "
                    "copy the same file to every node")
        return self.reports

    def connect(self, timeout_s: float = 30.0) -> None:
        """(Re-)form the stages' process group; stage 0's node hosts the rendezvous."""
        addr = _get(self.actors[0].node_ip.remote(), self.timeout_s, "connect")
        port = _get(self.actors[0].free_port.remote(), self.timeout_s, "connect")
        _get([a.connect.remote(addr, port, timeout_s) for a in self.actors], self.timeout_s + timeout_s, "connect")

    def link_check(self, rows: int, hidden: int, reps: int = 50) -> dict[str, Any]:
        out = _get([a.link_check.remote(rows, hidden, reps) for a in self.actors], self.timeout_s, "link check")
        return out[-1]

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # already dead
                pass
        self.actors = []
        if self.pg is not None:
            try:
                ray.util.remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None
