"""`moeray serve` on a machine without GPUs, with a model that fits no simulated card, through the
command as a user meets it: Ray starts, nothing is deployed, one line naming `--local` and
`--simulate-devices`, exit 2, and no traceback from Serve's controller in the log."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

TRACEBACK = re.compile(r"Traceback \(most recent call last\)|ServeController|RayTaskError")


@pytest.mark.slow
def test_moeray_serve_says_it_in_one_line_without_a_controller_traceback(default_model_path):
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
