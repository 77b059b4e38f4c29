"""`moeray serve` on a machine without GPUs, with a model that fits no simulated card: the check
that runs before Serve deploys (cluster/commands/serve.py check_simulated_fit) refuses it in one
line naming the ways out (`--local`, larger `--simulate-devices`, `moeray plan --devices`), and
lets through the cards a model fits. The command itself, Ray started: tests/e2e/test_serve_no_fit_cli.py.
"""
from __future__ import annotations

import pytest

from moeray.cluster.commands.serve import check_simulated_fit
from moeray.cluster.config import EngineConfig, LaunchOptions, ServeOptions
from moeray.errors import PlacementError
from moeray.units import parse_size


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
