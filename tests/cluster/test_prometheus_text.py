"""GET /metrics' text (cluster/prometheus.py) without a server: what a Prometheus or a gateway that
reads vLLM parses out of it, from an engine's and stages' numbers given here."""
from __future__ import annotations

import pytest

from moeray.stages.runtime.step import StageStats

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def served(stages=None, counts=None, kv=None, faults=None):
    from moeray.cluster.prometheus import ServedMetrics

    stages = stages if stages is not None else [
        StageStats(0, "sim", "127.0.0.1", layers=(0, 15), steps=10, step_s=0.5, predicted_hit_rate=0.8,
                   cache={"lookups": 200, "hits": 150, "misses": 50, "resident": 40, "slots": 48, "used_bytes": 1 << 20},
                   kv={"used": 3, "free": 61}),
        StageStats(1, "sim", "127.0.0.1", layers=(15, 30), steps=10, step_s=0.7, predicted_hit_rate=0.7,
                   cache={"lookups": 100, "hits": 60, "misses": 40, "resident": 30, "slots": 48, "used_bytes": 1 << 20},
                   kv={"used": 3, "free": 61})]
    tokens = {"n": 0}
    m = ServedMetrics("m1", lambda: counts or {"running": 2, "waiting": 5},
                      lambda: kv or {"blocks": 64, "used_blocks": 16, "prompt_tokens": 900, "cached_tokens": 300,
                                     "preemptions": 2},
                      lambda: stages, lambda: faults or {"stage_failures": 1, "restarts": 1, "stages_serving": 2},
                      lambda: {"accepted_tokens": 0}, lambda: tokens["n"])
    return m, tokens


def samples(m) -> dict[str, list]:
    body, content_type = m.exposition()
    assert content_type.startswith("text/plain")
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def exposition_names() -> set[str]:
    """Every series name GET /metrics exports (test_ray_configs checks the Grafana JSON against it)."""
    m, _ = served()
    m.tokens([0.2], [0.05])
    m.done("stop", 1.5, 0.1, 30, 12)
    return set(samples(m))


def value(s: dict, name: str, **labels) -> float:
    hits = [x.value for x in s[name] if all(x.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, s.get(name))
    return hits[0]


def test_vllm_names_with_the_engine_numbers():
    m, tokens = served()
    tokens["n"] = 42
    m.tokens([0.25, 0.5], [0.02, 0.03, 0.04])
    m.done("stop", 2.0, 0.3, 30, 12)
    m.done("abort", 0.5, None, 10, 1)
    s = samples(m)
    lab = {"model_name": "m1", "engine": "0"}
    assert value(s, "vllm:num_requests_running", **lab) == 2
    assert value(s, "vllm:num_requests_waiting", **lab) == 5
    assert value(s, "vllm:kv_cache_usage_perc", **lab) == 16 / 64
    assert value(s, "vllm:prompt_tokens_total", **lab) == 900
    assert value(s, "vllm:generation_tokens_total", **lab) == 42
    assert value(s, "vllm:prefix_cache_queries_total", **lab) == 900
    assert value(s, "vllm:prefix_cache_hits_total", **lab) == 300
    assert value(s, "vllm:num_preemptions_total", **lab) == 2
    assert value(s, "vllm:time_to_first_token_seconds_count", **lab) == 2
    assert value(s, "vllm:time_to_first_token_seconds_sum", **lab) == pytest.approx(0.75)
    assert value(s, "vllm:inter_token_latency_seconds_count", **lab) == 3
    assert value(s, "vllm:e2e_request_latency_seconds_count", **lab) == 2
    assert value(s, "vllm:request_queue_time_seconds_count", **lab) == 1  # the aborted one never queued out
    assert value(s, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(s, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(s, "vllm:request_generation_tokens_sum", **lab) == 13
    # the histogram's buckets are cumulative, as Prometheus' histogram_quantile wants them
    buckets = sorted((float(x.labels["le"]), x.value) for x in s["vllm:time_to_first_token_seconds_bucket"])
    assert [v for _, v in buckets] == sorted(v for _, v in buckets) and buckets[-1] == (float("inf"), 2)
    # observed once: a second scrape reports the same counts, not twice them
    again = samples(m)
    assert value(again, "vllm:time_to_first_token_seconds_count", **lab) == 2


def test_each_stages_hit_rate_beside_its_counters_and_the_plans_prediction():
    m, _ = served()
    s = samples(m)
    for stage, (hits, lookups, predicted) in {"0": (150, 200, 0.8), "1": (60, 100, 0.7)}.items():
        assert value(s, "moeray_stage_expert_hits_total", stage=stage) == hits
        assert value(s, "moeray_stage_expert_lookups_total", stage=stage) == lookups
        assert value(s, "moeray_stage_expert_hit_rate", stage=stage) == hits / lookups
        assert value(s, "moeray_stage_predicted_hit_rate", stage=stage) == predicted
    assert value(s, "moeray_stages_serving", model_name="m1") == 2
    assert value(s, "moeray_failed_steps_total", model_name="m1") == 1


def test_stages_being_restarted_leave_their_series_out_not_the_scrape():
    def gone():
        raise RuntimeError("stage 1 is being restarted")

    from moeray.cluster.prometheus import ServedMetrics

    m = ServedMetrics("m1", lambda: {"running": 0, "waiting": 0}, lambda: {"blocks": 8, "used_blocks": 0}, gone,
                      lambda: {}, lambda: {}, lambda: 0)
    s = samples(m)
    assert "moeray_stage_expert_hits_total" not in s and value(s, "vllm:num_requests_running", model_name="m1") == 0
