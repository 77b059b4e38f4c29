"""How a stage computes is one config (StageOptions, LaunchOptions.stage) that the driver sends to
every stage, and a MOERAY_* debugging override (moeray/environment.py) counts only where a command
folds it into the config it builds, and says so. That a stage on another node runs it whatever its
own environment says: tests/e2e/test_stage_options_two_nodes.py."""
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


def test_the_tiled_attentions_row_count_is_a_flag_and_a_bad_one_is_one_line(monkeypatch):
    """--fa-tiled-rows N sets StageOptions.fa_tiled_rows (sent to every stage, which gives it to its
    ggml); a count under 1 is one line naming the field and the fix; MOERAY_FA_TILED_ROWS overrides."""
    monkeypatch.delenv("MOERAY_FA_TILED_ROWS", raising=False)
    assert launch_options_from_args(_launch_args([]), [64 * MiB]).stage.fa_tiled_rows == 64
    assert launch_options_from_args(_launch_args(["--fa-tiled-rows", "16"]), [64 * MiB]).stage.fa_tiled_rows == 16
    with pytest.raises(ConfigError, match=r"^fa_tiled_rows=0: give a count of query rows, 1 or more") as exc:
        launch_options_from_args(_launch_args(["--fa-tiled-rows", "0"]), [64 * MiB])
    assert "\n" not in str(exc.value)
    monkeypatch.setenv("MOERAY_FA_TILED_ROWS", "32")
    assert launch_options_from_args(_launch_args(["--fa-tiled-rows", "16"]), [64 * MiB]).stage.fa_tiled_rows == 32
