"""GET /metrics on the serving port: Prometheus' text format, where gateways, autoscalers and
dashboards look for an inference server's numbers.

vLLM's names where the meaning is the same (labels `model_name` and `engine`), so what reads a vLLM
server reads this one: requests running and waiting, the KV cache's used fraction, prompt and
generated tokens, prefix-cache queries and hits (in tokens), preemptions, finished requests by
reason, and histograms of time to first token, inter-token latency, end-to-end latency, queue time
and each request's prompt and generated tokens. Beside them moeray's own, as `moeray_*`: each
stage's expert-cache lookups, hits, misses, hit rate and the plan's prediction (`stage` label),
its steps, KV blocks and layers, speculative decoding and the faults (the numbers cluster/metrics.py
also exports through Ray, under the same names without Ray's `ray_` prefix).

Counts the engine keeps (tokens, KV, faults, the stages' counters) are read when scraped: the
exported counter is the engine's own count. Latencies are queued by the engine thread and the
event loop (an append, nothing more) and observed at the scrape. The stages are asked at most
every `stage_every_s` seconds (a scrape every second does not cost a Ray call per stage each time).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Optional

LABELS = ("model_name", "engine")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class ServedMetrics:
    """The /metrics registry of one server. `read_*` give the engine's live numbers (Service)."""

    def __init__(self, model: str, read_counts: Callable[[], dict], read_kv: Callable[[], dict],
                 read_stages: Callable[[], list], read_faults: Callable[[], dict],
                 read_spec: Callable[[], dict], read_tokens: Callable[[], int], stage_every_s: float = 2.0):
        from prometheus_client import CollectorRegistry, Histogram

        self.model = model
        self.labels = {"model_name": model, "engine": "0"}
        self.read_counts, self.read_kv, self.read_stages = read_counts, read_kv, read_stages
        self.read_faults, self.read_spec, self.read_tokens = read_faults, read_spec, read_tokens
        self.stage_every_s = stage_every_s
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry

        def hist(name: str, doc: str, buckets) -> "Histogram":
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(**self.labels)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                        REQUEST_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.", REQUEST_BUCKETS)
        self.prompt_hist = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS)
        self.gen_hist = hist("vllm:request_generation_tokens", "Number of generation tokens processed.",
                             TOKEN_BUCKETS)
        self.finished: dict[str, int] = {}  # finished_reason -> requests
        self._events: deque = deque()  # ("tokens", ttfts, itls) | ("done", ...): observed at the scrape
        self._lock = threading.Lock()
        self._stages: list = []
        self._stages_at = -1e9
        r.register(_Live(self))

    # ---------------------------------------------------------------- what the server reports

    def tokens(self, ttfts: list[float], itls: list[float]) -> None:
        """One engine step's deliveries (on the engine thread: an append)."""
        if ttfts or itls:
            self._events.append(("tokens", ttfts, itls))

    def done(self, reason: str, e2e_s: float, queue_s: Optional[float], prompt: int, generated: int) -> None:
        """A request ended (on the event loop: an append)."""
        self._events.append(("done", reason, e2e_s, queue_s, prompt, generated))

    # ---------------------------------------------------------------- the scrape

    def exposition(self) -> tuple[bytes, str]:
        """The text a scraper reads, and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        with self._lock:
            self._observe()
            return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _observe(self) -> None:
        while self._events:
            ev = self._events.popleft()
            if ev[0] == "tokens":
                for t in ev[1]:
                    self.ttft.observe(t)
                for t in ev[2]:
                    self.itl.observe(t)
            else:
                _, reason, e2e, queue, prompt, generated = ev
                self.finished[reason] = self.finished.get(reason, 0) + 1
                self.e2e.observe(e2e)
                if queue is not None:
                    self.queue.observe(queue)
                self.prompt_hist.observe(prompt)
                self.gen_hist.observe(generated)

    def stages(self) -> list:
        """The stages' numbers, asked at most every stage_every_s (the last answer in between; none
        while they are being restarted)."""
        now = time.monotonic()
        if now - self._stages_at >= self.stage_every_s:
            self._stages_at = now
            try:
                self._stages = self.read_stages()
            except Exception:  # noqa: BLE001 - a stage restarting: its numbers come back with it
                self._stages = []
        return self._stages


class _Live:
    """The numbers read when scraped: the engine's gauges and cumulative counts, the stages'."""

    def __init__(self, m: ServedMetrics):
        self.m = m

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self.m
        names, values = list(LABELS), [m.model, "0"]

        def gauge(name: str, doc: str, value: float):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, float(value))
            return g

        def counter(name: str, doc: str, value: float):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, float(value))
            return c

        counts, kv = m.read_counts(), m.read_kv()
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    counts.get("running", 0))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    counts.get("waiting", 0))
        blocks = max(1, kv.get("blocks", 0))
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    kv.get("used_blocks", 0) / blocks)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", kv.get("prompt_tokens", 0))
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", m.read_tokens())
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      kv.get("prompt_tokens", 0))
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      kv.get("cached_tokens", 0))
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      kv.get("preemptions", 0))
        done = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                   labels=[*names, "finished_reason"])
        for reason, n in sorted(m.finished.items()):
            done.add_metric([*values, reason], n)
        yield done
        yield from _moeray(m, names, values)


def _moeray(m: ServedMetrics, names: list, values: list):
    """moeray's own numbers: the stages', speculative decoding's, the faults'."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from moeray.cluster.metrics import METRICS

    def family(name: str, labels: list):
        kind, doc = METRICS[name]
        return (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=labels)

    stage_names = [*names, "stage", "node"]
    fams = {name: family(name, stage_names) for name in STAGE_READERS}
    rate = GaugeMetricFamily("moeray_stage_expert_hit_rate",
                             "hits / lookups of a stage's expert cache since the stage started",
                             labels=stage_names)
    for s in m.stages():
        labels = [*values, str(s.stage), str(s.node_ip or "local")]
        for name, read in STAGE_READERS.items():
            value = read(s)
            if value is not None:
                fams[name].add_metric(labels, float(value))
        c = s.cache or {}
        if c.get("lookups"):
            rate.add_metric(labels, c.get("hits", 0) / c["lookups"])
    yield from fams.values()
    yield rate
    faults, spec = m.read_faults(), m.read_spec()
    for name, key in FAULT_READERS.items():
        f = family(name, names)
        f.add_metric(values, float(faults.get(key, 0) or 0))
        yield f
    for name, key in SPEC_READERS.items():
        f = family(name, names)
        f.add_metric(values, float(spec.get(key, 0) or 0))
        yield f


STAGE_READERS = {  # moeray_stage_* from a stage's StageStats
    "moeray_stage_expert_lookups": lambda s: (s.cache or {}).get("lookups", 0),
    "moeray_stage_expert_hits": lambda s: (s.cache or {}).get("hits", 0),
    "moeray_stage_expert_misses": lambda s: (s.cache or {}).get("misses", 0),
    "moeray_stage_steps": lambda s: s.steps,
    "moeray_stage_step_seconds": lambda s: s.step_s,
    "moeray_stage_resident_experts": lambda s: (s.cache or {}).get("resident", 0),
    "moeray_stage_cache_slots": lambda s: (s.cache or {}).get("slots", 0),
    "moeray_stage_cache_bytes": lambda s: (s.cache or {}).get("used_bytes", 0),
    "moeray_stage_predicted_hit_rate": lambda s: s.predicted_hit_rate,
    "moeray_stage_first_layer": lambda s: s.layers[0] if s.layers else None,
    "moeray_stage_last_layer": lambda s: s.layers[1] - 1 if s.layers else None,
    "moeray_stage_kv_blocks_used": lambda s: (s.kv or {}).get("used"),
    "moeray_stage_kv_blocks_free": lambda s: (s.kv or {}).get("free"),
}
FAULT_READERS = {"moeray_failed_steps": "stage_failures", "moeray_restarted_stages": "restarts",
                 "moeray_nodes_lost": "nodes_lost", "moeray_replans": "replans",
                 "moeray_stages_serving": "stages_serving", "moeray_recovery_seconds": "last_recovery_s"}
SPEC_READERS = {"moeray_spec_verify_rows": "verify_rows", "moeray_spec_drafted_tokens": "drafted_tokens",
                "moeray_spec_accepted_tokens": "accepted_tokens", "moeray_spec_acceptance_rate": "acceptance_rate",
                "moeray_spec_tokens_per_verify_row": "tokens_per_verify_row"}
