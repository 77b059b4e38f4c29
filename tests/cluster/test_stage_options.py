"""How a stage computes is one config (StageOptions, LaunchOptions.stage) that the driver sends to
every stage: a stage on another node runs it whatever its own environment says, and a MOERAY_*
debugging override (moeray/environment.py) counts only where a command folds it into the config
it builds, and says so. Two simulated nodes: a ray.cluster_utils.Cluster on this machine."""
from __future__ import annotations

import argparse
import logging

import pytest

from moeray import environment
from moeray.cluster.config import LaunchOptions, add_launch_arguments, launch_options_from_args
from moeray.errors import ConfigError, MoerayError
from moeray.stages.kernels import repack, settings
from moeray.stages.kernels.settings import StageOptions

MiB = 1 << 20


def test_a_process_given_no_options_reads_its_overrides_once_and_names_them(monkeypatch, caplog):
    monkeypatch.setenv("MOERAY_REPACK", "off")
    monkeypatch.setenv("MOERAY_FUSED_MOE", "0")
    settings.reset()
    with caplog.at_level(logging.INFO, logger="moeray.kernels"):
        opts = settings.current()
    assert (opts.repack, opts.fused_moe, repack.mode()) == ("off", False, "off")
    lines = [r.getMessage() for r in caplog.records]
    assert "moeray: debugging override MOERAY_REPACK=off -> stage.repack = 'off' (default 'fast')" in lines
    monkeypatch.setenv("MOERAY_REPACK", "on")  # read once: a later change is not seen ...
    assert repack.mode() == "off"
    settings.use(StageOptions())  # ... and options given replace them whatever the environment says
    assert repack.mode() == "fast" and settings.current().fused_moe


def test_a_bad_option_is_one_line_naming_where_it_came_from(monkeypatch):
    with pytest.raises(ConfigError, match=r"^host_experts='copy': choose auto"):
        StageOptions(host_experts="copy")
    monkeypatch.setenv("MOERAY_STAGE_GRAPH", "maybe")
    with pytest.raises(MoerayError, match=r"^MOERAY_STAGE_GRAPH='maybe': give 1 or 0"):
        environment.fold(StageOptions(), "stage")
    monkeypatch.delenv("MOERAY_STAGE_GRAPH")
    monkeypatch.setenv("MOERAY_BACKEND", "fp8")
    with pytest.raises(MoerayError, match=r"^MOERAY_BACKEND='fp8': choose one of auto, ggml, dequant, exact"):
        environment.fold(StageOptions(), "stage")


def test_nothing_is_read_at_import_time():
    """Importing the kernels and the stage model reads no variable (two were read at import once):
    a bad override fails where the options are first asked for, as one line."""
    import subprocess
    import sys

    code = ("import moeray.stages.kernels.qmatmul, moeray.stages.runtime.model, moeray.cluster.driver\n"
            "print('imported')\n"
            "from moeray.stages.kernels import settings\n"
            "settings.current()\n")
    env = {"PATH": "/usr/bin:/bin", "MOERAY_GGML_POLL": "lots", "MOERAY_SCRATCH_REUSE": "2"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.stdout.strip() == "imported" and r.returncode != 0
    assert "MOERAY_GGML_POLL='lots'" in r.stderr.strip().splitlines()[-1]


def _launch_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_launch_arguments(p)
    return p.parse_args(argv)


def test_flags_build_the_options_and_an_override_is_folded_in_loudly(monkeypatch, capsys):
    args = _launch_args(["--repack", "on", "--no-stage-graph", "--ggml-poll", "0", "--kernels", "exact"])
    monkeypatch.delenv("MOERAY_REPACK", raising=False)
    opts = launch_options_from_args(args, [64 * MiB])
    assert (opts.stage.repack, opts.stage.stage_graph, opts.stage.ggml_poll, opts.stage.backend) == \
        ("on", False, 0, "exact")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("MOERAY_REPACK", "off")
    assert launch_options_from_args(args, [64 * MiB]).stage.repack == "off"
    assert "debugging override MOERAY_REPACK=off -> stage.repack = 'off' (default 'on')" in capsys.readouterr().err


# ---------------------------------------------------------------- two nodes


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


def test_launch_options_carry_the_stage_options():
    assert LaunchOptions().stage == StageOptions()
    with pytest.raises(MoerayError, match="cover_b"):
        LaunchOptions(cover_b=0)


def test_serves_config_file_spells_them_as_the_flags():
    """ray_configs/serve.yaml's `args` go through `moeray serve`'s parser (cluster/serve_build.py):
    a stage option there is the flag without its dashes, a switch true turns it on."""
    from moeray.cluster.config import stage_options_from_args
    from moeray.cluster.serve_build import _parser, argv_from

    args = _parser().parse_args(argv_from({"repack": "off", "no_fused_moe": True, "ggml_adapt": "on",
                                           "backend": "dequant", "host_experts": "mapped"}))
    got = stage_options_from_args(args)
    assert (got.repack, got.fused_moe, got.ggml_adapt, got.backend, got.host_experts) == \
        ("off", False, True, "dequant", "mapped")
    assert stage_options_from_args(_parser().parse_args([])) == StageOptions()
