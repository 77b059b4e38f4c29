"""One real `moeray serve --dashboard --api-key ...` for the page, Ray dashboard and Prometheus tests.

A pytest plugin (`pytest_plugins = ["live_dashboard_server"]` in each module that uses it), so the
session-scoped server is started once however many of those modules run. Two simulated stages whose
caches hold part of the experts (the hit rate is neither 0 nor 1, and misses are counted), the Ray
dashboard on a free port, Ray's metrics export on a free port, reported every second.
"""
from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from dataclasses import dataclass

import pytest


@dataclass
class LiveServer:
    """What the tests need of the running server; the tests import nothing from this plugin."""
    url: str
    metrics_port: int
    ray_dashboard: str | None  # the URL `moeray serve` printed for the Ray dashboard
    ray_dashboard_port: int
    lines: list[str]  # what `moeray serve` printed on stdout
    key: str = "dash-key-123"
    model: str = "moeray-dash"
    n_stages: int = 2

    def get(self, path: str, timeout_s: float = 30.0):
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {self.key}"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())

    def complete(self, prompt: str, max_tokens: int = 8) -> dict:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())


def _start(d: "LiveServer", default_model_path, port: int, metrics_port: int, ray_dashboard_port: int):
    from serve_process import start_serve

    # Ray's metrics agent reports every 10 s by default: every second here, so exports settle fast.
    env = {**os.environ, "RAY_metrics_report_interval_ms": "1000"}
    return start_serve([str(default_model_path), "--stages", str(d.n_stages), "--split", "K=15",
                        "--simulate-devices", "150MiB,150MiB", "--max-seqs", "4", "--max-len", "128",
                        "--model-name", d.model, "--metrics-export-port", str(metrics_port), "--dashboard",
                        "--dashboard-port", str(ray_dashboard_port), "--api-key", d.key, "--ready-timeout", "400"],
                       port, timeout_s=450, env=env, require_up=False)


@pytest.fixture(scope="session")
def dashboard_server(default_model_path):
    pytest.importorskip("ray")
    from moeray.stages.runtime.transport import free_port

    d = LiveServer("", 0, None, 0, [])  # the defaults: key, model name, stages
    for attempt in (1, 2):  # on a loaded machine Ray's own startup can time out once
        port, metrics_port, ray_dashboard_port = free_port(), free_port(), free_port()
        server = _start(d, default_model_path, port, metrics_port, ray_dashboard_port)
        if server.up:
            break
        time.sleep(0.5)
        assert attempt == 1 and "timed out during startup" in "".join(server.errors), (
            f"moeray serve exited with {server.proc.returncode}: {server.lines} {''.join(server.errors[-20:])}")
    lines = server.lines
    url = f"http://127.0.0.1:{port}"
    printed = next((m.group(1) for line in lines if (m := re.match(r"Ray dashboard .*: (http://\S+)", line))), None)
    try:
        yield LiveServer(url, metrics_port, printed, ray_dashboard_port, lines)
    finally:
        server.stop()
