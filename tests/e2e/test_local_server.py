"""`moeray serve --local` is one process: the model, the engine and the HTTP server live in the
`moeray serve` process itself (cluster/local_server.py), with no Serve proxy or replica between a
client and the engine; Ray runs beside it for the metrics. Started and stopped as a user does."""
from __future__ import annotations

import json
import re
import signal
import time
import urllib.request

import pytest

pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from serve_process import start_serve  # noqa: E402

from moeray.stages.runtime.transport import free_port  # noqa: E402


def _stream(url: str, body: dict) -> list[str]:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]


def test_local_serves_from_its_own_process_exports_metrics_and_stops_with_exit_0(default_model_path):
    metrics_port = free_port()
    server = start_serve([str(default_model_path), "--local", "--max-seqs", "2", "--max-len", "512",
                          "--model-name", "m", "--metrics-export-port", str(metrics_port), "--ready-timeout", "240"],
                         free_port())
    try:
        under = [" ".join(p.cmdline()) for p in psutil.Process(server.proc.pid).children(recursive=True)]
        assert not [c for c in under if "ServeReplica" in c or "ProxyActor" in c], under

        events = _stream(server.url, {"model": "m", "messages": [{"role": "user", "content": "Name a colour."}],
                                      "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True},
                                      "temperature": 0})
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        usage = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == [] and 1 <= usage["completion_tokens"] <= 6 and text

        # The engine's counters reach Prometheus from this process (Ray exports them every few seconds).
        deadline, seen = time.monotonic() + 30, None
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
                page = r.read().decode()
            found = re.search(r'^ray_moeray_tokens_generated_total\{[^}]*model="m"[^}]*\} (\S+)$', page, re.M)
            seen = float(found.group(1)) if found else None
            if seen is not None and seen >= usage["completion_tokens"]:
                break
            time.sleep(1)
        assert seen is not None and seen >= usage["completion_tokens"], seen
    finally:
        server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(90)
    time.sleep(0.5)  # the stderr reader drains the last lines
    err = "".join(server.errors)
    assert rc == 0 and "shutting down the HTTP server, the engine and Ray" in err, err[-2000:]
    assert err.rstrip().endswith("moeray serve: stopped") and "Traceback" not in err, err[-2000:]


def test_local_without_metrics_runs_no_ray_at_all(default_model_path):
    """`--local --no-metrics`: the same API from one process and nothing else (no raylet, no GCS)."""
    server = start_serve([str(default_model_path), "--local", "--no-metrics", "--max-seqs", "2", "--max-len", "512",
                          "--model-name", "m", "--ready-timeout", "240"], free_port())
    try:
        assert psutil.Process(server.proc.pid).children(recursive=True) == []
        assert not any("Ray metrics" in line for line in server.lines)
        events = _stream(server.url, {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": 4, "stream": True, "temperature": 0})
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(60)
    time.sleep(0.5)
    err = "".join(server.errors)
    assert rc == 0 and err.rstrip().endswith("moeray serve: stopped") and "Traceback" not in err, err[-2000:]


# `moeray serve --local` with the engine's step made to fail on its 3rd call (a fault injected at the
# engine's boundary, in the server process itself): the one process cannot restart its engine as
# Serve restarts a replica, so it must exit non-zero with the reason, not linger answering 503s.
_FAILING_SERVE = """
import sys
from moeray.cluster import engine
real, calls = engine.Engine.step, [0]
def step(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] >= 3:
        raise RuntimeError("injected: the step failed")
    return real(self, *args, **kwargs)
engine.Engine.step = step
from moeray.cluster.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_local_exits_with_status_1_and_the_reason_when_its_engine_dies(default_model_path):
    import subprocess
    import sys
    import threading
    import urllib.error

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", _FAILING_SERVE, "serve", str(default_model_path), "--local",
                             "--no-metrics", "--max-seqs", "2", "--max-len", "512", "--model-name", "m",
                             "--port", str(port), "--ready-timeout", "240"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, errors = [], []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True).start()
    try:
        deadline = time.monotonic() + 240
        while not any(line.startswith("curl ") for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(errors[-20:])
            time.sleep(0.5)
        body = {"model": "m", "messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 16,
                "temperature": 0}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(req, timeout=60)
        assert failed.value.code == 503 and "injected: the step failed" in failed.value.read().decode()
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    time.sleep(0.5)  # the stderr reader drains the last lines
    err = "".join(errors)
    assert rc == 1, err[-2000:]
    assert "the engine stopped: RuntimeError: injected: the step failed; exiting with status 1" in err, err[-2000:]
    assert err.rstrip().endswith("moeray serve: stopped"), err[-2000:]
