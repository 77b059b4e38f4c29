"""What serving does with the plan's hit-rate prediction (issue 11): stages are served with the
adaptive policy by default, each stage's report carries its predicted hit rate beside the
measured one, and a stage that falls more than 10 points short after 1,000 lookups is named once."""
from __future__ import annotations

import logging
import math

import pytest

from moeray.cluster.config import LaunchOptions
from moeray.stages.runtime.step import StageStats


def test_stages_learn_by_default():
    # bench/cache.py's replay of the default model: adaptive is within 0.2 points of static when the
    # profile is the traffic and better when it is not (docs/performance.md, expert cache hit rates).
    assert LaunchOptions().cache_policy == "adaptive"


def stats(stage, lookups, hit_rate, predicted):
    return StageStats(stage, "sim", "127.0.0.1", layers=(0, 8), predicted_hit_rate=predicted,
                      cache={"lookups": lookups, "hits": int(lookups * hit_rate), "misses": 0,
                             "hit_rate": hit_rate, "policy": "static"})


def test_a_stage_short_of_its_prediction_is_named_once(caplog):
    pytest.importorskip("ray")
    from moeray.cluster.metrics import _STAGE_GAUGES, Metrics

    m = Metrics.__new__(Metrics)  # only the check: no Ray metrics are registered
    m._warned = set()
    with caplog.at_level(logging.WARNING, logger="moeray"):
        m._check_prediction(stats(0, 999, 0.40, 0.90))    # too few lookups to judge
        m._check_prediction(stats(1, 5000, 0.85, 0.90))   # within 10 points
        m._check_prediction(stats(2, 5000, 0.55, 0.90))
        m._check_prediction(stats(2, 6000, 0.50, 0.90))   # already named
        m._check_prediction(stats(3, 5000, 0.50, None))   # no plan (--local)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("stage 2: expert cache hits 55.0% of 5000 lookups, "
                                                   "the plan predicted 90.0%")
    read = _STAGE_GAUGES["moeray_stage_predicted_hit_rate"]
    assert read(stats(0, 1, 1.0, 0.93)) == 0.93 and math.isnan(read(stats(0, 1, 1.0, None)))
