"""`moeray serve` on a machine without GPUs, with a model that fits no simulated card: one line that
names the ways out (`--local`, larger `--simulate-devices`, `moeray plan --devices`), exit status 2,
and no traceback from Serve's controller in the log, because the fit is checked before Serve deploys.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from moeray.cluster.commands.serve import check_simulated_fit
from moeray.cluster.config import EngineConfig, LaunchOptions, ServeOptions
from moeray.errors import PlacementError
from moeray.units import parse_size

TRACEBACK = re.compile(r"Traceback \(most recent call last\)|ServeController|RayTaskError")


def options(*sizes: str) -> ServeOptions:
    return ServeOptions(model=None, launch=LaunchOptions(n_stages=len(sizes), simulate=[parse_size(s) for s in sizes]),
                        engine=EngineConfig())


def test_a_model_too_big_for_the_simulated_cards_is_one_line_naming_local_and_simulate_devices(default_model_path):
    with pytest.raises(PlacementError) as err:
        check_simulated_fit(options("16MiB"))
    message = str(err.value)
    assert "\n" not in message
    assert "no placement fits" in message
    assert "moeray serve --local" in message and "--simulate-devices" in message and "--devices" in message


def test_cards_the_model_fits_pass_the_check(default_model_path):
    check_simulated_fit(options("176MiB", "176MiB", "144MiB", "144MiB"))  # make demo's cards: no error


@pytest.mark.slow
def test_moeray_serve_says_it_in_one_line_without_a_controller_traceback(default_model_path, tmp_path):
    """Through the command, as a user meets it: Ray starts, nothing is deployed, exit 2."""
    from moeray.stages.runtime.transport import free_port

    cmd = [sys.executable, "-m", "moeray.cluster.cli", "serve", "--stages", "1", "--simulate-devices", "16MiB",
           "--port", str(free_port()), "--metrics-export-port", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 2, log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("moeray serve: error:")]
    assert len(errors) == 1, log[-3000:]
    assert "--local" in errors[0] and "--simulate-devices" in errors[0], errors[0]
    assert not TRACEBACK.search(log), log[-3000:]
    assert "deploying" not in log  # Serve was never asked to start the replica
