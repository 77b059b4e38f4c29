"""The driver: probe -> plan -> load -> wire.

1. Spawn one StageActor per stage in a placement group (one bundle per stage: {GPU: 1} on a
   cluster with GPUs, a custom `moeray_device` resource where nodes declare one, else a sliver
   of CPU for simulated devices), PACK by default, SPREAD on request.
2. Probe: every actor reports its device, free bytes, node and measured speeds, and which of the
   model's files (its parts, for a model cut by gguf-split) its node holds.
3. Plan: the placement search runs over the reported budgets and speeds (cluster/placement.py,
   the arithmetic without Ray). Then each stage checks the files its layers need as its node
   sees them (size and sampled hash): a missing, short or different file is named with its node
   before anything loads.
4. Load: each actor loads only its layer range, mapping only the files that hold it; its KV pool
   allocated (the plan's block count).
5. Wire: the stages join one process group (activations go stage to stage over it).

Every remote wait goes through cluster/remote.py (one deadline, errors that name the stage): a
stage that hangs is reported by name, never waited on forever. RayPipeline, the engine's view of
the wired stages, is here too: the driver owns the stages, the engine only calls submit/result.
"""
from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from moeray import environment
from moeray.cluster.config import EngineConfig, LaunchOptions, local_threads
from moeray.cluster.placement import gpu_share, plan_from_reports, plan_kv_types, state_bytes_by_layer, uses_mtp
from moeray.cluster.remote import StageFailedError, StagesLate, as_ready, error_of, gather, gather_one
from moeray.cluster.timeline import now_ns
from moeray.errors import MoerayError, PlacementError
from moeray.stages.gguf.parts import stage_parts_lines
from moeray.stages.gguf.reader import read_gguf_header
from moeray.stages.kernels.settings import StageOptions
from moeray.stages.runtime.actor import STEP_TIMINGS, StageActor
from moeray.stages.runtime.default_profile import resolve_profile
from moeray.stages.runtime.draft_model import check_draft, draft_bytes
from moeray.stages.runtime.mtp import mtp_bytes
from moeray.stages.runtime.step import LoadReport, ProbeReport, StageStats, StepBatch, StepOutput
from moeray.stages.runtime.transport import TransportError, link_backend

# Ray is imported inside the functions that call it, not here: Ray reads RAY_DEDUP_LOGS when it is
# first imported, and local_ray_env() sets it only when a command starts Ray (ensure_ray, serve's
# start_ray), after this module was imported.

DEVICE_RESOURCE = "moeray_device"  # declare it on nodes (ray start --resources) to stand in for GPUs
SIM_CPU = 0.01  # what a simulated stage reserves: stages must not hold whole cores (2-core hosts)


class NodeLostError(StageFailedError):
    """Stages died with their node: the devices they were planned on left the cluster."""

    def __init__(self, message: str, nodes: list[str]):
        super().__init__(message)
        self.nodes = nodes


def dead_nodes(node_ids) -> set[str]:
    """Those of `node_ids` that Ray's GCS no longer counts as alive."""
    import ray  # late: see the note after the imports

    alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
    return {n for n in node_ids if n and not alive.get(n, False)}


def ray_init_address(address: str | None) -> str:
    """What ray.init is given: `address` (--address), else $RAY_ADDRESS, else "local": a new
    local cluster. Never Ray's own None, which joins whatever /tmp/ray/ray_current_cluster names:
    a `ray start` cluster that may be someone else's, or long dead (then ray.init waits minutes
    for its GCS before it fails)."""
    return address or environment.ray_address() or "local"


def local_ray_env() -> None:
    """Settings the processes of a local Ray cluster inherit (set before ray.init starts them).

    Log lines from actors stay readable (no dedup). Workers run at this process's priority: Ray
    starts every worker (stage actors, the Serve replica) 15 nice levels below the raylet, so on a
    machine with anything else runnable (the HTTP clients, Ray's own daemons) the model's threads
    got the smallest CPU share, and ggml's helper threads lost their cores mid-graph (docs/kernels.md,
    "Threads")."""
    environment.set_default("RAY_DEDUP_LOGS", "0")
    environment.set_default("RAY_worker_niceness", "0")


def ensure_ray(address: str | None = None) -> None:
    """Join the cluster at `address`, or start a local one; log lines from actors stay readable."""
    local_ray_env()
    import ray  # late: see the note after the imports

    if not ray.is_initialized():
        ray.init(address=ray_init_address(address), include_dashboard=False, log_to_driver=True,
                 logging_level="WARNING", configure_logging=True)


def stage_resources(simulated: bool, n_stages: int = 1, gpus_per_stage: float | None = None
                    ) -> tuple[dict[str, float], dict[str, Any]]:
    """(bundle, actor options) for one stage on this cluster."""
    import ray  # late: see the note after the imports

    have = ray.cluster_resources()
    if not simulated:
        if have.get("GPU", 0) < 1:
            raise PlacementError("the Ray cluster has no GPUs; pass --simulate-devices SIZE,... to run on CPU")
        share = gpu_share(n_stages, have["GPU"], gpus_per_stage)
        return {"GPU": share}, {"num_gpus": share, "num_cpus": 0}
    if have.get(DEVICE_RESOURCE, 0) >= 1:
        return {DEVICE_RESOURCE: 1.0}, {"num_cpus": 0, "resources": {DEVICE_RESOURCE: 1.0}}
    return {"CPU": SIM_CPU}, {"num_cpus": SIM_CPU}


@dataclass
class StageGroup:
    """The stage actors of one pipeline and the placement group that pins them."""
    n_stages: int
    simulate: list[int] | None = None
    strategy: str = "PACK"
    torch_threads: int | None = None
    timeout_s: float = 120.0
    options: StageOptions = field(default_factory=StageOptions)  # how every stage computes, whatever its node
    gpus_per_stage: float | None = None  # a share of a card per stage; None: whole cards while they last
    actors: list[Any] = field(default_factory=list)
    pg: Any = None
    reports: list[ProbeReport] = field(default_factory=list)
    load_args: list[tuple] = field(default_factory=list)  # per stage, to reload it after a restart
    load_kwargs: list[dict] = field(default_factory=list)  # ... and its drafters (speculative decoding)
    kv_blocks: int | None = None  # every stage's KV pool, once loaded
    state_slots: int = 0  # sequence states the stages hold (a model with recurrent layers), once loaded
    state_checkpoints: int = 0  # ... and checkpoint slots of that state (cluster/state_checkpoints.py)
    host_blocks: int = 0  # KV blocks every stage's host tier holds (stages/blocks/host_kv.py), once loaded
    kv_host: str = "auto"  # the host tier's size as asked (LaunchOptions.kv_host), measured by each probe
    draft: str | None = None  # speculative decoding's draft model, on the first stage (--draft)
    draft_token_ms: float = 0.0  # its measured ms per drafted token, once loaded
    mtp: bool = False  # the last stage runs the file's next-token-prediction layer (speculative decoding)
    mtp_token_ms: float = 0.0  # its measured ms per proposed token, once loaded
    header: Any = None  # the model's header as the driver read it: every stage gets it (a Ray object)
    model_header: Any = None  # ... and the header itself
    hung: set = field(default_factory=set)
    # The sampling rows' slots of the last step whose tokens the last stage sends to the first
    # (StepBatch.loop_back), until a step takes them there (RayPipeline.submit); none once re-formed
    looped: list[int] | None = None
    _actor_opts: dict = field(default_factory=dict)

    def start(self) -> "StageGroup":
        import ray  # late: see the note after the imports
        from ray.util.placement_group import placement_group

        if self.simulate is not None and len(self.simulate) != self.n_stages:
            raise MoerayError(f"--simulate-devices lists {len(self.simulate)} devices for {self.n_stages} stages")
        if self.strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise MoerayError(f"placement strategy '{self.strategy}' is not one of PACK, SPREAD")
        bundle, self._actor_opts = stage_resources(self.simulate is not None, self.n_stages, self.gpus_per_stage)
        self.pg = placement_group([dict(bundle) for _ in range(self.n_stages)], strategy=self.strategy)
        try:
            ray.get(self.pg.ready(), timeout=self.timeout_s)
        except Exception as exc:
            ray.util.remove_placement_group(self.pg)
            raise PlacementError(
                f"could not reserve {self.n_stages} x {bundle} ({self.strategy}) within {self.timeout_s:.0f} s; "
                f"the cluster has {ray.available_resources()}") from exc
        self.actors = [self._spawn(i) for i in range(self.n_stages)]
        gather([a.ping.remote() for a in self.actors], self.timeout_s, "start")
        return self

    def _spawn(self, i: int):
        import ray  # late: see the note after the imports
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        budget = None if self.simulate is None else self.simulate[i]
        return ray.remote(StageActor).options(
            name=None, max_restarts=0, **self._actor_opts,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
        ).remote(i, self.n_stages, budget, self.torch_threads, self.options,
                 card_share=self._actor_opts.get("num_gpus", 1.0))

    def share_header(self, header) -> Any:
        """The model's header as one Ray object every stage call takes (a tokenizer's metadata is
        megabytes: sent once, not per call)."""
        import ray  # late: see the note after the imports

        if self.header is None:
            self.header, self.model_header = ray.put(header), header
        return self.header

    def probe(self, path: str, header=None) -> list[ProbeReport]:
        """Each actor's report (device, budget, node, speeds, the model's files on its node)."""
        ref = self.share_header(header or read_gguf_header(path))
        self.reports = gather([a.probe.remote(path, ref, self.kv_host) for a in self.actors], self.timeout_s, "probe")
        return self.reports

    def check_parts(self, header, ranges: list[tuple[int, int]]) -> list[str]:
        """Every stage checks, on its node, the files (parts) its layers need: present, complete,
        the file the header describes, and the same bytes (size and sampled sha256) on every node
        that reads it. One MoerayError naming each file, node and the fix, else the lines to print."""
        ref = self.share_header(header)
        needs = [header.stage_parts(a, b) for a, b in ranges]
        seen = gather([a.check_parts.remote(ref, need) for a, need in zip(self.actors, needs)], self.timeout_s,
                      "checking the model's files")
        problems, first_seen = [], {}
        for i, found in enumerate(seen):
            for j in needs[i]:
                got = found[j]
                if isinstance(got, str):
                    problems.append(f"stage {i} ({self.where(i)}) needs {got}")
                    continue
                if j not in first_seen:
                    first_seen[j] = (i, got)
                    continue
                k, ref_print = first_seen[j]
                if got != ref_print:
                    problems.append(
                        f"{header.parts[j].path} differs between nodes: stage {k} on {self.where(k)} sees "
                        f"{ref_print.size} bytes (sampled sha256 {ref_print.sha256_sampled[:12]}), stage {i} on "
                        f"{self.where(i)} sees {got.size} bytes ({got.sha256_sampled[:12]}); copy the same file to "
                        "every node that reads it")
        if problems:
            raise MoerayError("; ".join(problems))
        if not header.in_parts:
            return []
        return [f"{line}; checked on {self.where(i)}" for i, line in enumerate(stage_parts_lines(header, ranges))]

    def connect(self, timeout_s: float = 30.0) -> None:
        """(Re-)form the stages' process group; stage 0's node hosts the rendezvous."""
        addr = gather_one(self.actors[0].node_ip.remote(), self.timeout_s, "connect")
        port = gather_one(self.actors[0].free_port.remote(), self.timeout_s, "connect")
        backend = (link_backend([(r.device.kind, r.device.node_id, r.device.pci_bus_id) for r in self.reports])
                   if self.reports else None)
        gather([a.connect.remote(addr, port, timeout_s, backend) for a in self.actors], self.timeout_s + timeout_s,
               "connect")
        self.looped = None  # a new group: no tokens on their way

    def where(self, i: int) -> str:
        """'simulated device 2 (8.00 MiB on CPU) on 192.0.2.2' -- for error messages."""
        if i < len(self.reports):
            d = self.reports[i].device
            return f"{d.name} on {d.node_ip or d.hostname}"
        return "not probed yet"

    def load(self, path: str, ranges: list[tuple[int, int]], kv_blocks: int,
             progress=None, trunk_on_card: list[int] | None = None, profile: str | None = None,
             cache_policy: str = "static", state_slots: int = 1, state_checkpoints: int = 0,
             host_checkpoints: int = 0, kv_types: list | None = None, host_blocks: int = 0) -> list[LoadReport]:
        """Each stage loads only its layer range, a KV pool of `kv_blocks` blocks and (recurrent
        layers) `state_slots` sequence states and `state_checkpoints` checkpoint slots after them
        on its device, `host_checkpoints` more in host memory; `kv_types`: each stage's cache types
        (planner/kv.py KVTypes; None: the stages' options), `host_blocks`: KV blocks of each stage's
        host tier; `progress(stage, report)` as each one finishes."""
        trunk_on_card = trunk_on_card or [0] * len(ranges)
        if self.header is None:
            self.share_header(read_gguf_header(path))
        self.kv_blocks = kv_blocks
        hybrid = any(state_bytes_by_layer(self.model_header.config, 1))
        self.state_slots = state_slots if hybrid else 0
        self.state_checkpoints = state_checkpoints + host_checkpoints if hybrid else 0  # the engine's ledger: all
        last = len(ranges) - 1
        self.load_args = [(path, a, b, kv_blocks, t, profile, cache_policy, state_slots, False, state_checkpoints)
                          for (a, b), t in zip(ranges, trunk_on_card)]
        # speculative decoding's drafters: a draft model on the first stage, an MTP layer on the last
        self.host_blocks = host_blocks
        self.load_kwargs = [{"draft": self.draft if i == 0 else None, "mtp": self.mtp and i == last,
                             "host_checkpoints": host_checkpoints if hybrid else 0, "host_blocks": host_blocks,
                             "kv_types": (kv_types[i].k, kv_types[i].v) if kv_types else None}
                            for i in range(len(ranges))]
        refs = [a.load.remote(*args, header=self.header, **kw)
                for a, args, kw in zip(self.actors, self.load_args, self.load_kwargs)]
        reports = gather(refs, self.timeout_s, "loading", progress=progress)
        self.draft_token_ms = reports[0].draft_token_ms if reports else 0.0
        self.mtp_token_ms = reports[-1].mtp_token_ms if reports else 0.0
        return reports

    def record_routing(self, folder: str) -> None:
        """Every stage appends its routing to folder/stage<i>.trace."""
        gather([a.record_routing.remote(os.path.join(os.path.abspath(folder), f"stage{i}.trace"))
                for i, a in enumerate(self.actors)], self.timeout_s, "starting the routing trace")

    def mark_hung(self, i: int) -> None:
        """A stage stopped answering: kill it so its peers' waits end, and restart it in recover()."""
        import ray  # late: see the note after the imports

        self.hung.add(i)
        ray.kill(self.actors[i], no_restart=True)

    def alive(self, timeout_s: float = 5.0) -> list[bool]:
        """Which stages answer a ping in time (a hung one does not count, even if it answers)."""
        ok = [False] * len(self.actors)
        try:
            for i, ref in as_ready([a.ping.remote() for a in self.actors], timeout_s):
                ok[i] = i not in self.hung and error_of(ref) is None
        except StagesLate:
            pass
        return ok

    def node_of(self, i: int) -> str:
        return self.reports[i].device.node_id if i < len(self.reports) else ""

    def lost(self, stages: list[int]) -> NodeLostError | None:
        """A NodeLostError naming the nodes of `stages` that left the cluster, or None."""
        gone = dead_nodes({self.node_of(i) for i in stages})
        if not gone:
            return None
        which = [i for i in stages if self.node_of(i) in gone]
        nodes = ", ".join(f"{n[:12]} ({self.reports[which[0]].device.node_ip})" for n in sorted(gone))
        return NodeLostError(f"node {nodes} left the cluster with stage{'s' if len(which) > 1 else ''} "
                             f"{', '.join(map(str, which))} ({', '.join(self.where(i) for i in which)})", sorted(gone))

    def recover(self) -> list[int]:
        """Restart every stage that died or hung (same bundle, same layers), then re-form the
        process group among all stages. Returns the restarted stages. NodeLostError when a dead
        stage's node has left the cluster (before or while its replacement waits for a place):
        its bundle's device is gone with it, and only a re-plan on what is left can serve."""
        import ray  # late: see the note after the imports

        dead = [i for i, ok in enumerate(self.alive()) if not ok]
        if (lost := self.lost(dead)) is not None:
            raise lost
        for i in dead:
            try:
                ray.kill(self.actors[i], no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            self.actors[i] = self._spawn(i)
        self.hung.clear()
        if dead:
            self._await_restart(dead)
            if self.load_args:
                gather([self.actors[i].load.remote(*self.load_args[i], header=self.header, **self.load_kwargs[i])
                        for i in dead],
                       self.timeout_s, "reload", dead)
        self.connect()
        return dead

    def _await_restart(self, dead: list[int]) -> None:
        """The restarted stages answer a ping; while they wait for a place, their old nodes are
        watched: Ray may take seconds to declare a crashed node dead, and a bundle whose node left
        waits for a device that is never coming back."""
        import ray  # late: see the note after the imports

        refs = [self.actors[i].ping.remote() for i in dead]
        deadline = time.monotonic() + self.timeout_s
        while True:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=1.0)
            if len(ready) == len(refs):
                try:
                    gather(refs, 1.0, "restart", dead)
                except StageFailedError:  # a restarted actor that died: name the node that left, if one did
                    if (lost := self.lost(dead)) is not None:
                        for i in dead:
                            ray.kill(self.actors[i], no_restart=True)
                        raise lost from None
                    raise
                return
            if (lost := self.lost(dead)) is not None:
                for i in dead:
                    ray.kill(self.actors[i], no_restart=True)
                raise lost
            if time.monotonic() > deadline:
                gather(refs, 0.0, "restart", dead)  # raises, naming the late stages

    def link_check(self, rows: int, hidden: int, reps: int = 50) -> dict[str, Any]:
        out = gather([a.link_check.remote(rows, hidden, reps) for a in self.actors], self.timeout_s, "link check")
        return out[-1]

    def shutdown(self) -> None:
        import ray  # late: see the note after the imports

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


# ---------------------------------------------------------------- probe -> plan -> load -> wire


@dataclass
class Launched:
    path: str
    group: StageGroup
    reports: list[ProbeReport]
    plan: Any  # planner.search.Plan, or None for a dense model
    ranges: list[tuple[int, int]]
    handoff_ms: float
    lines: list[str]
    engine: EngineConfig = field(default_factory=EngineConfig)  # as launched: max_len and kv_blocks resolved
    kv: Any = None  # planner.kv.KVPlan
    # What a re-plan needs: the options and engine config as asked, the model's header, the log.
    opts: LaunchOptions | None = None
    requested: EngineConfig | None = None
    header: Any = None
    log: Any = None
    events: list[dict] = field(default_factory=list)  # faults and what was done about them, oldest first
    faults: dict = field(default_factory=lambda: {"stage_failures": 0, "restarts": 0, "nodes_lost": 0,
                                                  "replans": 0, "last_recovery_s": 0.0})
    down: str | None = None  # why nothing serves now (what is left cannot hold the model)
    down_devices: int = -1  # the devices there were when that was found: retried when they change
    lost_cause: str = ""  # the node loss that started it
    recovering: str | None = None  # what a recovery under way is about (None when none is): the stages
    # are being restarted or re-planned, so there is nobody to ask for their numbers

    def pipeline(self) -> "RayPipeline":
        return RayPipeline(self.group, self)

    # ------------------------------------------------------------ faults

    def _event(self, kind: str, detail: str, t0: float | None = None) -> None:
        ev = {"at": time.time(), "event": kind, "detail": detail}
        if t0 is not None:
            ev["seconds"] = round(time.monotonic() - t0, 2)
        self.events.append(ev)
        del self.events[:-50]

    def _say(self, line: str) -> None:
        if self.log is not None:
            self.log(line)

    def recover(self, cause: str = "") -> None:
        """After a failed step: restart dead stages in place; when their node left the cluster,
        re-plan on the devices that are left (probe, plan, load, wire: a new split, caches filled
        again, KV pools sized anew). PlacementError when what is left cannot hold the model; the
        next call tries again (a node may have come back)."""
        self.recovering = cause or "a stage failure"
        try:
            self._recover(cause)
        finally:
            self.recovering = None

    def _recover(self, cause: str) -> None:
        t0 = time.monotonic()
        if self.down is None:  # a retry while nothing serves is not another failure
            self.faults["stage_failures"] += 1
            try:
                restarted = self.group.recover()
                if restarted:
                    self.faults["restarts"] += len(restarted)
                    self.faults["last_recovery_s"] = round(time.monotonic() - t0, 2)
                    self._event("restarted", f"stage(s) {', '.join(map(str, restarted))} restarted in place"
                                + (f" after: {cause}" if cause else ""), t0)
                return
            except NodeLostError as lost:
                self.faults["nodes_lost"] += len(lost.nodes)
                self._event("node lost", str(lost))
                self._say(f"moeray: {lost}; re-planning on the devices left")
                self.lost_cause = cause = str(lost)
        elif self.devices_left()[0] == self.down_devices:
            raise PlacementError(self.down)  # nothing joined since: the same answer, no probing
        self.replan(cause or self.lost_cause or "a stage failure", t0)

    def devices_left(self) -> tuple[int, list[int] | None]:
        """(stages the cluster can hold now, their simulated budgets): one per device left, at most
        as many as were asked for; simulated budgets of the stages still alive first."""
        import ray  # late: see the note after the imports

        opts, actor = self.opts, self.group._actor_opts
        have = ray.cluster_resources()
        if "num_gpus" in actor:
            total = int(have.get("GPU", 0) / actor["num_gpus"] + 1e-6)
        elif "resources" in actor:
            total = int(have.get(DEVICE_RESOURCE, 0) + 1e-6)
        else:  # CPU-simulated stages: any node takes one
            total = opts.n_stages
        n = min(opts.n_stages, total)
        if opts.simulate is None:
            return n, None
        gone = dead_nodes({r.device.node_id for r in self.reports})
        alive = [i for i, r in enumerate(self.reports) if r.device.node_id not in gone]
        order = alive + [i for i in range(len(opts.simulate)) if i not in alive]
        return n, [opts.simulate[i] for i in order][:n]

    def replan(self, cause: str, t0: float | None = None) -> None:
        t0 = time.monotonic() if t0 is None else t0
        self.group.shutdown()
        self.down, n = None, 0
        try:
            n, budgets = self.devices_left()
            if n < 1:
                raise PlacementError("no device is left in the cluster for a stage")
            opts = replace(self.opts, n_stages=n, simulate=budgets, split="auto")
            group = StageGroup(n, budgets, opts.strategy, opts.torch_threads, opts.timeout_s, opts.stage,
                               opts.gpus_per_stage, kv_host=opts.kv_host)
            lines: list[str] = []

            def say(line: str) -> None:
                lines.append(line)
                self._say(line)

            say(f"re-plan on the devices left ({n} stage{'s' if n > 1 else ''}) after: {cause}")
            group.start()
            try:
                reports, plan, ranges, handoff_ms, kv = bring_up(group, self.header, self.path, opts,
                                                                 self.requested, say)
            except BaseException:
                group.shutdown()
                raise
        except MoerayError as exc:
            self.down, self.down_devices = f"cannot serve: {exc} (after: {cause})", n
            self._event("cannot serve", self.down, t0)
            self._say(f"moeray: {self.down}")
            raise PlacementError(self.down) from None
        self.group, self.reports, self.plan, self.ranges, self.handoff_ms, self.kv = (
            group, reports, plan, ranges, handoff_ms, kv)
        self.lines = lines
        self.engine = replace(self.requested, max_len=kv.context, kv_blocks=kv.blocks)
        self.faults["replans"] += 1
        self.faults["last_recovery_s"] = round(time.monotonic() - t0, 2)
        split = ", ".join(f"{a}-{b - 1}" for a, b in ranges)
        self._event("re-planned", f"{n} stage(s), layers {split}, {kv.blocks} KV blocks", t0)
        self._say(f"moeray: serving again on {n} stage(s) (layers {split}, {kv.blocks} KV blocks) "
                  f"{time.monotonic() - t0:.1f} s after the fault")

    def stage_stats(self, timeout_s: float | None = None) -> list[StageStats]:
        stats = gather([a.stats.remote() for a in self.group.actors], timeout_s or self.group.timeout_s, "stats")
        for s, planned in zip(stats, self.plan.stages if self.plan is not None else []):
            s.predicted_hit_rate = planned.predicted_hit_rate  # the plan's promise, next to what it measures
        return stats

    def stage_stat_lines(self) -> list[str]:
        out = []
        for s in self.stage_stats():
            a, b = s.layers
            line = (f"stage {s.stage} ({s.device} on {s.node_ip}): layers {a}-{b - 1}, {s.steps} steps, "
                    f"{1e3 * s.step_s / max(1, s.steps):.1f} ms per step (incl. waiting for the stage before)")
            c = s.cache
            if c:
                line += (f", expert cache {c.get('hits', 0)} hits of {c.get('lookups', 0)} lookups "
                         f"({100 * c.get('hit_rate', 0.0):.1f}%")
                line += "" if s.predicted_hit_rate is None else f", predicted {100 * s.predicted_hit_rate:.1f}%"
                line += f", {c.get('policy')})"
            out.append(line)
        return out

    def shutdown(self) -> None:
        self.group.shutdown()


def simulated_stage_options(stage: StageOptions, token_bytes: int) -> StageOptions:
    """How simulated stages use ggml's threads, where `stage` leaves it unset: every core of the
    stage's process (threads 0), as `serve --local` uses them for a model whose decode token reads
    `token_bytes` (cluster/config.py local_threads). Simulated stages share their host's cores,
    and one stream's step passes through them one after another: the stage computing has the
    cores (the others' workers rest: StageActor.step), where one thread each left a core idle
    (bench/stream_timeline.py, docs/performance.md#served); with several streams in flight the
    stages compute at once, and each graph learns whether splitting still pays (ggml_adapt)."""
    from moeray.stages.kernels.threads import ThreadSettings

    threads = ThreadSettings.of(stage, ThreadSettings(**local_threads(token_bytes)))
    return replace(stage, threads=0 if stage.threads is None else stage.threads, **threads.options())


def launch(path: str, opts: LaunchOptions = LaunchOptions(), engine: EngineConfig = EngineConfig(),
           log=print) -> Launched:
    """Probe -> plan -> load -> wire, with KV pools of the plan's block count; `Launched.engine` is
    `engine` with max_len (the context) and kv_blocks resolved: build the Engine with it.
    `log` gets every line a user should see at startup."""
    header = read_gguf_header(path)
    if opts.draft:
        check_draft(opts.draft, header.config)
    ensure_ray(opts.address)
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        log(line)

    opts = replace(opts, profile=resolve_profile(opts.profile, path, say))
    if opts.simulate is not None:
        opts = replace(opts, stage=simulated_stage_options(opts.stage, header.token_bytes()))
    group = StageGroup(opts.n_stages, opts.simulate, opts.strategy, opts.torch_threads, opts.timeout_s,
                       opts.stage, opts.gpus_per_stage, kv_host=opts.kv_host)
    group.start()
    try:
        reports, plan, ranges, handoff_ms, kv = bring_up(group, header, path, opts, engine, say)
    except BaseException:
        group.shutdown()
        raise
    return Launched(path, group, reports, plan, ranges, handoff_ms, lines,
                    replace(engine, max_len=kv.context, kv_blocks=kv.blocks,
                            state_checkpoints=kv.checkpoints + kv.host_checkpoints), kv,
                    opts=opts, requested=engine, header=header, log=log)


def bring_up(group: StageGroup, header, path: str, opts: LaunchOptions, engine: EngineConfig, say):
    """Probe, plan, check the files, load and wire a started group: (reports, plan, ranges, handoff_ms, kv)."""
    reports = group.probe(path, header)
    for r in reports:
        say(_probe_line(r))
    group.connect()
    hop = group.link_check(1, header.config.hidden, reps=20)
    handoff_ms = hop["ms_per_pass"] / max(1, group.n_stages - 1)
    say(f"stage links: {handoff_ms:.3f} ms per hop for a decode activation (measured)")
    plan, ranges, plan_lines, kv = plan_from_reports(header, reports, opts, engine, handoff_ms)
    for line in plan_lines:
        say(line)
    for line in group.check_parts(header, ranges):  # before any weight loads: each node has its files
        say(line)
    # The plan's trunk includes its layers' KV pool and sequence states (see held_spec); the
    # actor charges those itself.
    checkpoints = getattr(kv, "checkpoints", 0)
    state = state_bytes_by_layer(header.config, engine.max_seqs + checkpoints)
    trunk_on_card = ([int(s.trunk_bytes) - kv_bytes - sum(state[a:b])
                      for s, kv_bytes, (a, b) in zip(plan.stages, kv.stage_bytes, ranges)]
                     if plan is not None else [0] * len(ranges))
    itemsize = plan_kv_types(header.config, (opts.stage.cache_type_k, opts.stage.cache_type_v),
                             [r.device.kind for r in reports])  # the draft model's and MTP layer's pools
    if opts.draft and plan is not None:  # the first stage charges its draft model itself
        trunk_on_card[0] -= draft_bytes(opts.draft, kv.blocks, itemsize)
    group.draft, group.mtp = opts.draft, uses_mtp(header, engine)
    if group.mtp and plan is not None:  # and the last stage its next-token-prediction layer
        trunk_on_card[-1] -= mtp_bytes(header, kv.blocks, engine.max_seqs, itemsize, len(ranges) == 1)
    group.load(path, ranges, kv.blocks, lambda i, rep: say(_load_line(rep)),
               trunk_on_card, opts.profile, opts.cache_policy, engine.max_seqs, checkpoints,
               getattr(kv, "host_checkpoints", 0), kv.types or None, kv.host_blocks)
    if opts.draft:
        n = draft_bytes(opts.draft, kv.blocks, itemsize)
        say(f"draft model {os.path.basename(opts.draft)}: {n / 2**20:.1f} MiB on stage 0 (its weights and a KV pool "
            f"of {kv.blocks} blocks), priced as that stage's trunk; {group.draft_token_ms:.2f} ms a drafted token "
            "(measured)")
    if opts.record_routing:
        group.record_routing(opts.record_routing)
        say(f"recording every stage's routing to {opts.record_routing}/stage<i>.trace")
    return reports, plan, ranges, handoff_ms, kv


def _probe_line(r: ProbeReport) -> str:
    d = r.device
    share = "" if d.card_share >= 1 else f" ({d.card_share:g} of the card, shared with other stages)"
    return (f"stage {r.stage}: {d.name}{share} on {d.node_ip}, {d.free_bytes / 2**20:.0f} MiB free of "
            f"{d.total_bytes / 2**20:.0f} MiB ({d.memory_source}), measured {r.layer_ms:.3f} ms per "
            f"layer, {r.miss_ms:.3f} ms per missed expert")


def _load_line(rep: LoadReport) -> str:
    a, b = rep.layers
    cache = f", expert cache {rep.cache_resident} experts in {rep.cache_slots} slots" if rep.cache_slots else ""
    return (f"loaded stage {rep.stage}: layers {a}-{b - 1} in {rep.load_s:.1f} s{cache}, "
            f"{rep.free_bytes / 2**20:.1f} MiB left on its device")


# ---------------------------------------------------------------- the engine's view of the stages


FAILURE_CHECK_S = 0.5  # while a step's results are not all in, how often the driver looks for a failed stage


class RayPipeline:
    """Stages as Ray actors: every stage gets the step at once (stage 0 the token ids, the last
    stage the sampling params); activations flow over their process group; the last stage's
    sampled tokens come back."""

    verifies = True  # the last stage accepts drafted tokens (StepBatch.drafts): speculative decoding
    async_submit = True  # submit only sends the step: the stages compute while the engine goes on
    loops_back = True  # the last stage can send its tokens to the first (StepBatch.loop_back): chained decode

    @property
    def draft_model(self) -> bool:
        """The first stage runs a draft model (--draft): speculation may draft with it."""
        return self.group.draft is not None

    @property
    def draft_token_ms(self) -> float:
        return self.group.draft_token_ms

    @property
    def mtp(self) -> bool:
        """The last stage runs the file's next-token-prediction layer: speculation drafts with it."""
        return self.group.mtp

    @property
    def mtp_token_ms(self) -> float:
        return self.group.mtp_token_ms

    def __init__(self, group: StageGroup, launched: Launched | None = None):
        self.group = group
        self.launched = launched  # owns the plan: re-plans when a node leaves
        self.n_stages = group.n_stages
        self.kv_blocks = group.kv_blocks  # the engine's block budget: what every stage allocated
        # Sequence states the stages hold (recurrent layers), 0 for a model without them, and checkpoints.
        self.state_slots = group.state_slots
        self.state_checkpoints = group.state_checkpoints
        self.host_blocks = group.host_blocks  # every stage's host tier (the engine's ledger: kv_blocks.HostTier)
        # The last steps as the driver saw them (step id, submit start, submit end, result back;
        # perf_counter_ns): beside the stages' own, the per-hop times of GET /v1/stages
        self.timings: deque[tuple[int, int, int, int]] = deque(maxlen=STEP_TIMINGS)
        self._sent: dict[int, tuple[int, int, int]] = {}

    def submit(self, batch: StepBatch) -> list:
        t0 = now_ns()
        group = self.group
        # The step after one whose last stage sent its tokens to the first takes them there, whatever
        # it holds (the send waits for it): known to the group, whichever engine hands out the steps.
        if group.looped is not None:
            batch, group.looped = replace(batch, looped=group.looped), None
        if batch.loop_back:
            group.looped = [slot for slot, want in zip(batch.slots, batch.sample) if want]
        refs = [a.step.remote(batch.for_stage(i, self.n_stages)) for i, a in enumerate(group.actors)]
        self._sent[id(refs)] = (batch.step_id, t0, now_ns())
        return refs

    def result(self, handle: list, timeout_s: float) -> StepOutput:
        import ray  # late: see the note after the imports

        sent = self._sent.pop(id(handle), None)
        # Every stage's result in one wait and one get (a step's calls cost the driver four of each
        # otherwise); a stage that died or raised is looked for every FAILURE_CHECK_S meanwhile, so it
        # is reported then, not after the stages behind it give up waiting for its activations.
        pending, deadline = list(handle), time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                stuck = handle.index(pending[0])
                self.group.mark_hung(stuck)
                raise StageFailedError(
                    f"stage {stuck} ({self.group.where(stuck)}) did not finish a step within {timeout_s:.0f} s; "
                    "it was stopped and will be restarted")
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=min(left, FAILURE_CHECK_S))
            if pending and any(error_of(ref) is not None for ref in ready):
                raise self._root_cause(handle)
        try:
            out = ray.get(handle, timeout=1.0)[-1]
        except Exception:  # noqa: BLE001 - a stage's failure: which one is the cause
            raise self._root_cause(handle) from None
        if sent is not None:
            self.timings.append((*sent, now_ns()))
        return out

    def same_clock(self) -> bool:
        """Every stage on this process's node: their step times and the driver's are on one clock."""
        import ray  # late: see the note after the imports

        here = ray.get_runtime_context().get_node_id()
        return all(self.group.node_of(i) == here for i in range(self.n_stages))

    def recover(self, cause: str = "") -> None:
        """Restart what died; after a re-plan the stage count and the KV pool may differ (the
        engine reads kv_blocks again)."""
        if self.launched is None:
            self.group.recover()
            return
        try:
            self.launched.recover(cause)
        finally:
            self.group = self.launched.group
            self.n_stages = self.group.n_stages
            self.kv_blocks = self.group.kv_blocks
            self.state_slots = self.group.state_slots
            self.state_checkpoints = self.group.state_checkpoints
            self.host_blocks = self.group.host_blocks

    def _root_cause(self, handle: list) -> StageFailedError:
        """Among a step's per-stage errors: a dead actor first, else the earliest stage whose error
        is its own (not the 'failed upstream' the stages after it report). The other stages get a
        moment to report too: the root cause is often not the first to come back."""
        import ray  # late: see the note after the imports
        from ray.exceptions import RayActorError

        ray.wait(handle, num_returns=len(handle), timeout=2.0)
        errors = [(i, exc) for i, ref in enumerate(handle) if (exc := error_of(ref)) is not None]
        where = self.group.where
        for i, exc in errors:
            if isinstance(exc, RayActorError):
                node = self.group.node_of(i)
                gone = "its node left the cluster; " if node and (dead_nodes({node}) or "node has died" in str(exc)) else ""
                return StageFailedError(f"stage {i} ({where(i)}, node {node[:12] or '?'}) died during a step: {gone}"
                                        "the requests it was serving failed, the stage is being restarted")
        for i, exc in errors:
            cause = getattr(exc, "cause", None) or exc
            if isinstance(cause, MoerayError) and not isinstance(cause, TransportError):
                return StageFailedError(f"stage {i}: {cause}")
            if not isinstance(cause, TransportError):
                return StageFailedError(f"stage {i} ({where(i)}) failed a step: {cause!r}")
        i, exc = errors[0]
        return StageFailedError(f"stage {i} ({where(i)}): {getattr(exc, 'cause', None) or exc}")
