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
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

KEY = "dash-key-123"
MODEL = "moeray-dash"
N_STAGES = 2


def get(url: str, path: str, key: str | None = KEY, timeout_s: float = 30.0):
    req = urllib.request.Request(url + path)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def complete(url: str, prompt: str, max_tokens: int = 8) -> dict:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture(scope="session")
def dashboard_server(default_model_path):
    pytest.importorskip("ray")
    from moeray.stages.transport import free_port

    port, metrics_port, ray_dashboard_port = free_port(), free_port(), free_port()
    # Ray's metrics agent reports every 10 s by default: every second here, so exports settle fast.
    env = {**os.environ, "RAY_metrics_report_interval_ms": "1000"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moeray.cluster.cli", "serve", str(default_model_path), "--stages", str(N_STAGES),
         "--split", "K=15", "--simulate-devices", "150MiB,150MiB", "--max-seqs", "4", "--max-len", "128", "--model-name", MODEL,
         "--port", str(port), "--metrics-export-port", str(metrics_port), "--dashboard",
         "--dashboard-port", str(ray_dashboard_port), "--api-key", KEY, "--ready-timeout", "400"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    deadline = time.monotonic() + 450
    while not any(line.startswith("curl ") for line in lines):
        assert proc.poll() is None, f"moeray serve exited with {proc.returncode}: {lines}"
        assert time.monotonic() < deadline, f"moeray serve not up in 450 s: {lines}"
        time.sleep(0.5)
    url = f"http://127.0.0.1:{port}"
    printed = next((m.group(1) for line in lines if (m := re.match(r"Ray dashboard .*: (http://\S+)", line))), None)
    try:
        yield {"url": url, "metrics_port": metrics_port, "ray_dashboard": printed,
               "ray_dashboard_port": ray_dashboard_port, "lines": lines}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
