"""The `ray up` files pass Ray's own cluster-config schema check after defaults are filled in as
`ray up` fills them, and the Grafana dashboard only queries metrics that moeray exports."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
pytest.importorskip("ray")
pytest.importorskip("jsonschema")

from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402

from moeray.cluster.metrics import METRICS, exported_name  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "ray_configs"
CLUSTER_FILES = ["onprem-gpu.yaml", "aws-gpu.yaml"]


def prepared(name: str) -> dict:
    return prepare_config(copy.deepcopy(yaml.safe_load((CONFIGS / name).read_text())))


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_cluster_file_passes_rays_schema_check(name):
    config = prepared(name)
    validate_config(config)
    assert config["provider"]["type"] == {"onprem-gpu.yaml": "local", "aws-gpu.yaml": "aws"}[name]


def test_schema_check_is_not_vacuous():
    config = prepared("aws-gpu.yaml")
    config["available_node_types"]["gpu_worker"]["max_workerz"] = 4
    with pytest.raises(Exception):
        validate_config(config)


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_every_node_installs_moeray_gets_the_model_and_exports_metrics_on_a_fixed_port(name):
    config = prepared(name)
    assert "/opt/moeray/model.gguf" in config["file_mounts"]  # same path on every node
    for who in ("head", "worker"):
        setup = " && ".join(config[f"{who}_setup_commands"])
        assert "pip install" in setup and "/opt/moeray/src" in setup
        assert "test -r /opt/moeray/model.gguf" in setup
        start = " ".join(config[f"{who}_start_ray_commands"])
        assert "--metrics-export-port=8080" in start


def _queries(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_queries_name_metrics_moeray_defines():
    dashboard = json.loads((CONFIGS / "moeray-dashboard.json").read_text())
    exported = {exported_name(n) for n in METRICS}
    histograms = {exported_name(n) for n, (kind, _) in METRICS.items() if kind == "histogram"}
    used = set()
    for q in _queries(dashboard):
        for name in re.findall(r"\bray_moeray_[a-z_]+", q):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert name in exported or base in histograms, f"{name} in {q!r} is not a moeray metric"
            used.add(base)
    for var in dashboard["templating"]["list"]:
        for name in re.findall(r"\bray_moeray_[a-z_]+", var.get("query", "")):
            assert name in exported
    # The latency histograms and the stage counters behind the hit rate all have panels.
    assert {exported_name("moeray_time_to_first_token_seconds"),
            exported_name("moeray_inter_token_latency_seconds"),
            exported_name("moeray_stage_expert_hits"), exported_name("moeray_stage_expert_lookups"),
            exported_name("moeray_stage_predicted_hit_rate")} <= used


def test_dashboard_has_a_hit_rate_panel_per_stage():
    dashboard = json.loads((CONFIGS / "moeray-dashboard.json").read_text())
    hit = [p for p in dashboard["panels"] if p["type"] != "row" and "hit rate" in p["title"]]
    assert len(hit) == 1 and hit[0]["repeat"] == "stage"  # Grafana repeats it for every stage
    expr = hit[0]["targets"][0]["expr"]
    hits, lookups = expr.split(" / ")
    assert "rate(ray_moeray_stage_expert_hits_total" in hits and 'stage=~"$stage"' in hits
    assert "rate(ray_moeray_stage_expert_lookups_total" in lookups
    assert any(v["name"] == "stage" for v in dashboard["templating"]["list"])
