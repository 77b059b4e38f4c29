"""moeray's metrics, exported through Ray (`ray.util.metrics`) to Prometheus and Grafana.

Low cardinality on purpose: the only tags are `model`, `stage` and `node` (a handful of
values each, never a request id or a prompt). Ray exports every metric with a `ray_` prefix
(and counters with a `_total` suffix); `exported_name` gives the name a dashboard queries.

Stage counters are cumulative in the stage actors (`StageActor.stats()`); a poller adds the
difference since its last look, so the exported counter equals the stage's own count. A stage
that restarted starts from zero again: its new count is the difference.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable, Optional, Sequence

log = logging.getLogger("moeray")

# name -> (kind, description). Tags: STAGE_TAGS for moeray_stage_*, ENGINE_TAGS for the rest.
METRICS: dict[str, tuple[str, str]] = {
    "moeray_stage_expert_lookups": ("counter", "routed (layer, expert) lookups in a stage's expert cache"),
    "moeray_stage_expert_hits": ("counter", "lookups served from the expert cache on the device"),
    "moeray_stage_expert_misses": ("counter", "lookups computed from host RAM (not cached)"),
    "moeray_stage_steps": ("counter", "micro-batch steps a stage ran"),
    "moeray_stage_step_seconds": ("counter", "seconds a stage spent in steps (incl. waiting for the stage before)"),
    "moeray_stage_resident_experts": ("gauge", "experts resident in a stage's cache"),
    "moeray_stage_cache_slots": ("gauge", "expert slots of a stage's cache"),
    "moeray_stage_cache_bytes": ("gauge", "device bytes a stage's expert cache holds"),
    "moeray_stage_predicted_hit_rate": ("gauge", "the hit rate the plan predicts for a stage's expert cache"),
    "moeray_stage_first_layer": ("gauge", "first layer of a stage's range"),
    "moeray_stage_last_layer": ("gauge", "last layer of a stage's range"),
    "moeray_stage_kv_blocks_used": ("gauge", "KV blocks of a stage's pool held by running sequences"),
    "moeray_stage_kv_blocks_free": ("gauge", "KV blocks of a stage's pool free or holding a cached prefix"),
    "moeray_kv_prefix_hit_rate": ("gauge", "share of prompt tokens whose KV came from a cached prefix"),
    "moeray_kv_cached_tokens": ("counter", "prompt tokens whose prefill a cached prefix skipped"),
    "moeray_kv_preemptions": ("counter", "sequences preempted (KV freed, prefilled again later) for lack of KV blocks"),
    "moeray_tokens_generated": ("counter", "output tokens handed to clients"),
    "moeray_spec_verify_rows": ("counter", "decode rows that carried drafted tokens (speculative decoding)"),
    "moeray_spec_drafted_tokens": ("counter", "drafted tokens sent to the target for verification"),
    "moeray_spec_accepted_tokens": ("counter", "drafted tokens the target accepted"),
    "moeray_spec_acceptance_rate": ("gauge", "accepted / drafted tokens since the server started"),
    "moeray_spec_tokens_per_verify_row": ("gauge", "tokens a verify row gave on average (accepted drafts + 1)"),
    # Engine-side (tag `model` only: a name that starts moeray_stage_ would carry the stage tags).
    "moeray_failed_steps": ("counter", "failed pipeline steps (a stage died, hung or raised): the requests running failed"),
    "moeray_restarted_stages": ("counter", "stages restarted in place after a failure"),
    "moeray_nodes_lost": ("counter", "nodes that left the cluster with a stage on them"),
    "moeray_replans": ("counter", "re-plans on the devices left after a node loss (probe, plan, load, wire)"),
    "moeray_stages_serving": ("gauge", "stages wired and serving now (0: what is left cannot hold the model)"),
    "moeray_recovery_seconds": ("gauge", "seconds the last recovery took, from the failed step to serving again"),
    "moeray_requests_running": ("gauge", "sequences holding a KV slot"),
    "moeray_requests_waiting": ("gauge", "sequences waiting for a KV slot"),
    "moeray_time_to_first_token_seconds": ("histogram", "request arrival to its first token"),
    "moeray_inter_token_latency_seconds": ("histogram", "time between two deliveries of a request's tokens"),
}
STAGE_TAGS = ("model", "stage", "node")
ENGINE_TAGS = ("model",)
LATENCY_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]

_STAGE_COUNTERS = {  # metric -> how to read it from a StageStats (StageActor.stats())
    "moeray_stage_expert_lookups": lambda s: (s.cache or {}).get("lookups", 0),
    "moeray_stage_expert_hits": lambda s: (s.cache or {}).get("hits", 0),
    "moeray_stage_expert_misses": lambda s: (s.cache or {}).get("misses", 0),
    "moeray_stage_steps": lambda s: s.steps,
    "moeray_stage_step_seconds": lambda s: s.step_s,
}
_STAGE_GAUGES = {
    "moeray_stage_resident_experts": lambda s: (s.cache or {}).get("resident", 0),
    "moeray_stage_cache_slots": lambda s: (s.cache or {}).get("slots", 0),
    "moeray_stage_cache_bytes": lambda s: (s.cache or {}).get("used_bytes", 0),
    "moeray_stage_predicted_hit_rate": lambda s: float("nan") if s.predicted_hit_rate is None else s.predicted_hit_rate,
    "moeray_stage_first_layer": lambda s: s.layers[0] if s.layers else -1,
    "moeray_stage_last_layer": lambda s: s.layers[1] - 1 if s.layers else -1,
    "moeray_stage_kv_blocks_used": lambda s: (s.kv or {}).get("used", 0),
    "moeray_stage_kv_blocks_free": lambda s: (s.kv or {}).get("free", 0),
}
_KV_COUNTERS = {"moeray_kv_cached_tokens": "cached_tokens", "moeray_kv_preemptions": "preemptions"}
_SPEC_COUNTERS = {"moeray_spec_verify_rows": "verify_rows", "moeray_spec_drafted_tokens": "drafted_tokens",
                  "moeray_spec_accepted_tokens": "accepted_tokens"}
_FAULT_COUNTERS = {"moeray_failed_steps": "stage_failures", "moeray_restarted_stages": "restarts",
                   "moeray_nodes_lost": "nodes_lost", "moeray_replans": "replans"}


def exported_name(name: str) -> str:
    """The name Prometheus sees: Ray adds `ray_`, and counters end in `_total`."""
    kind = METRICS[name][0]
    return f"ray_{name}" + ("_total" if kind == "counter" else "")


class Metrics:
    def __init__(self, model: str):
        from ray.util.metrics import Counter, Gauge, Histogram

        self.model = model
        self.m = {}
        for name, (kind, desc) in METRICS.items():
            tags = STAGE_TAGS if name.startswith("moeray_stage_") else ENGINE_TAGS
            if kind == "counter":
                self.m[name] = Counter(name, desc, tag_keys=tags)
            elif kind == "gauge":
                self.m[name] = Gauge(name, desc, tag_keys=tags)
            else:
                self.m[name] = Histogram(name, desc, boundaries=LATENCY_BOUNDARIES, tag_keys=tags)
        self._seen: dict[tuple[str, int], float] = {}  # (metric, stage) -> last cumulative value
        self._warned: set[int] = set()  # stages whose hit rate fell short of the plan (warned once)
        self._tags = {"model": model}
        self._lock = threading.Lock()
        self._pending: deque = deque()  # (tokens, ttfts, itls) of engine steps, not yet recorded

    # ---------------------------------------------------------------- engine side

    def tokens(self, n: int, ttfts: Sequence[float] = (), itls: Sequence[float] = ()) -> None:
        """One engine step's tokens (n, over all requests), with their requests' latencies. Called on
        the engine thread, so it only queues them: recording into Ray's metrics cost the engine
        thread ~4% of a served token (py-spy, one client); the poller's thread
        records them (`flush_tokens`), one counter increment per poll."""
        self._pending.append((n, ttfts, itls))  # deque.append: safe beside the poller's popleft

    def flush_tokens(self) -> None:
        """Record the tokens and latencies the engine queued since the last flush."""
        n, ttfts, itls = 0, [], []
        while self._pending:
            k, t, i = self._pending.popleft()
            n += k
            ttfts.extend(t)
            itls.extend(i)
        if n:
            self.m["moeray_tokens_generated"].inc(n, self._tags)
        for t in ttfts:
            self.m["moeray_time_to_first_token_seconds"].observe(t, self._tags)
        for t in itls:
            self.m["moeray_inter_token_latency_seconds"].observe(t, self._tags)

    def queue(self, running: int, waiting: int) -> None:
        self.m["moeray_requests_running"].set(running, self._tags)
        self.m["moeray_requests_waiting"].set(waiting, self._tags)

    def _counters(self, counters: dict[str, str], report: dict) -> None:
        """Engine-side counters that `report` holds as cumulative values: add what is new."""
        for name, key in counters.items():
            value = float(report.get(key, 0))
            last = self._seen.get((name, -1), 0.0)
            if value > last:
                self.m[name].inc(value - last, self._tags)
            self._seen[name, -1] = value

    def kv(self, report: dict) -> None:
        """The engine's KV ledger (Service.kv_report): prefix hit rate, cached tokens, preemptions."""
        with self._lock:
            self.m["moeray_kv_prefix_hit_rate"].set(float(report.get("prefix_hit_rate", 0.0)), self._tags)
            self._counters(_KV_COUNTERS, report)

    def spec(self, report: dict) -> None:
        """Speculative decoding's counters (Service.spec_report): verify rows, drafted and accepted
        tokens, the acceptance rate and the tokens a verify row gives."""
        with self._lock:
            self._counters(_SPEC_COUNTERS, report)
            self.m["moeray_spec_acceptance_rate"].set(float(report.get("acceptance_rate", 0.0)), self._tags)
            self.m["moeray_spec_tokens_per_verify_row"].set(float(report.get("tokens_per_verify_row", 0.0)),
                                                            self._tags)

    def faults(self, report: dict) -> None:
        """The driver's fault counts (Service.faults_report): failures, restarts, lost nodes,
        re-plans; the stages serving now and how long the last recovery took."""
        with self._lock:
            self._counters(_FAULT_COUNTERS, report)
            self.m["moeray_stages_serving"].set(float(report.get("stages_serving", 0)), self._tags)
            self.m["moeray_recovery_seconds"].set(float(report.get("last_recovery_s", 0.0)), self._tags)

    # ---------------------------------------------------------------- stage side

    def stages(self, stats: list) -> None:
        """Export what the stages report (StageStats: their cumulative counters, their gauges)."""
        with self._lock:
            for s in stats:
                tags = {"model": self.model, "stage": str(s.stage), "node": str(s.node_ip or "local")}
                for name, read in _STAGE_COUNTERS.items():
                    value = float(read(s))
                    last = self._seen.get((name, s.stage), 0.0)
                    delta = value - last if value >= last else value  # a restarted stage counts from 0
                    if delta > 0:
                        self.m[name].inc(delta, tags)
                    self._seen[name, s.stage] = value
                for name, read in _STAGE_GAUGES.items():
                    self.m[name].set(float(read(s)), tags)
                self._check_prediction(s)

    def _check_prediction(self, s) -> None:
        """One warning per stage whose measured hit rate, after 1,000 lookups, is more than 10 points
        below the plan's: the plan's promise is the product's headline, so a broken one is named."""
        c, predicted = s.cache or {}, s.predicted_hit_rate
        if predicted is None or s.stage in self._warned or c.get("lookups", 0) < 1000:
            return
        if c["hit_rate"] < predicted - 0.10:
            self._warned.add(s.stage)
            log.warning(f"stage {s.stage}: expert cache hits {100 * c['hit_rate']:.1f}% of {c['lookups']} lookups, "
                        f"the plan predicted {100 * predicted:.1f}%; likely causes: no profile or one recorded on "
                        f"other traffic (re-plan with --profile from this traffic), or cache policy "
                        f"{c.get('policy')} (adaptive learns the hot experts)")


class Poller:
    """Every `interval_s`, read the stages' stats and the engine's queue into the metrics."""

    def __init__(self, metrics: Metrics, read_stages: Callable[[], list],
                 read_queue: Callable[[], tuple[int, int]], interval_s: float = 2.0,
                 read_kv: Optional[Callable[[], dict]] = None, read_faults: Optional[Callable[[], dict]] = None,
                 read_spec: Optional[Callable[[], dict]] = None):
        self.metrics, self.read_stages, self.read_queue = metrics, read_stages, read_queue
        self.read_kv, self.read_faults, self.read_spec = read_kv, read_faults, read_spec
        self.interval_s = interval_s
        self.last_error: Optional[str] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moeray-metrics", daemon=True)

    def start(self) -> "Poller":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.metrics.flush_tokens()  # the last steps' tokens

    def poll_once(self) -> None:
        self.metrics.flush_tokens()
        self.metrics.queue(*self.read_queue())
        if self.read_kv is not None:
            self.metrics.kv(self.read_kv())
        if self.read_spec is not None:
            self.metrics.spec(self.read_spec())
        if self.read_faults is not None:  # before the stages: they may be gone (a node left)
            self.metrics.faults(self.read_faults())
        self.metrics.stages(self.read_stages())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll_once()
                self.last_error = None
            except Exception as exc:  # noqa: BLE001 - a stage restarting; try again next time
                self.last_error = f"{exc.__class__.__name__}: {exc}"
