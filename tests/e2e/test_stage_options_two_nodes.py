"""A stage on another node runs the options the driver sends it (StageOptions, LaunchOptions.stage)
whatever its own environment says, and a driver's MOERAY_* override reaches it only through the
config (tests/cluster/test_stage_options.py: the config itself). Two simulated nodes: a
ray.cluster_utils.Cluster on this machine."""
from __future__ import annotations

import pytest

from moeray.cluster.config import launch_options_from_args
from moeray.stages.kernels.settings import StageOptions
from test_stage_options import MiB, _launch_args


@pytest.fixture(scope="module")
def two_nodes():
    """A head node, and a second node whose processes carry their own MOERAY_* settings: the
    stage placed there must run the driver's options, not these."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from moeray.cluster.driver import DEVICE_RESOURCE

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    worker = c.add_node(num_cpus=1, resources={DEVICE_RESOURCE: 1},
                        env_vars={"MOERAY_REPACK": "on", "MOERAY_FUSED_MOE": "0", "MOERAY_GGML_POLL": "7"})
    ray.init(address=c.address)
    yield worker
    ray.shutdown()
    c.shutdown()


def _stage_on_worker(options: StageOptions, worker, path: str | None = None) -> dict:
    """One stage started by the driver's StageGroup (it lands on the worker: the only node with a
    device), optionally loaded with two layers of `path`; what it reports it runs with."""
    import ray

    from moeray.cluster.driver import StageGroup

    group = StageGroup(1, simulate=[256 * MiB], options=options, torch_threads=1, timeout_s=180).start()
    try:
        if path is not None:
            group.load(path, [(0, 2)], kv_blocks=4)
        stats = ray.get(group.actors[0].stats.remote(), timeout=180)
    finally:
        group.shutdown()
    assert stats.node_id == worker.node_id
    return stats.options


def test_a_stage_on_another_node_runs_the_drivers_options(two_nodes, default_model_path, monkeypatch):
    # set only in the driver's process, after the nodes started: it decides nothing by itself
    monkeypatch.setenv("MOERAY_REPACK", "fast")
    wanted = StageOptions(repack="off", ggml_poll=0, threads=1, host_experts="mapped", stage_graph=False)
    got = _stage_on_worker(wanted, two_nodes, str(default_model_path))
    assert (got["repack"], got["ggml_poll"], got["threads"], got["host_experts"]) == ("off", 0, 1, "mapped")
    assert got["fused_moe"] is True  # the worker's MOERAY_FUSED_MOE=0 is not read
    if got["backend"] == "ggml":  # the run path it chose at load follows the same options
        assert got["run_path"]["fused"] is True and got["run_path"]["stage"] is False


def test_a_drivers_override_reaches_the_other_node_through_the_config(two_nodes, monkeypatch, capsys):
    """The command line path: MOERAY_REPACK where `moeray serve` runs is folded into the config,
    named on a line, and the stage on the other node runs it."""
    monkeypatch.setenv("MOERAY_REPACK", "off")
    opts = launch_options_from_args(_launch_args([]), [256 * MiB])
    assert "debugging override MOERAY_REPACK=off" in capsys.readouterr().err
    got = _stage_on_worker(opts.stage, two_nodes)
    assert got["repack"] == "off" and got["ggml_poll"] == 100  # the default, not the worker's 7
