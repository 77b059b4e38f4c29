"""A hostile client against a real `moeray serve`, on Ray stages and with --local: bench/probe.py's
cases, one server start per mode shared by all of them.

Clients that leave (before their first token, after it, by a read timeout, while queued) free what
they held at once; a burst of 300 gets its answers or OpenAI-shaped 429s within seconds; ~50
malformed or oversized requests each get their status and the error's field (413 for a body over
the bound, a 400 naming `tools` for a schema nested 300 deep, never a 5xx or a reset) while a small
request beside each is served within a bound; a Host header naming another site is a 403 (DNS
rebinding); /metrics wants the key and speaks vLLM's names; Ray's metrics exporter is not on the
network; on stages a killed stage makes /health a 503 with the reason until it is back; and SIGTERM
mid-stream ends the stream with [DONE] (an error event after the drain time) while new requests get
a 503, and the server exits 0. The bounds are loose multiples of this machine's own small-request
time (a shared 2-core machine): slowness here is a latency bound missed, not a correctness bound.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import probe  # noqa: E402
from serve_process import start_serve  # noqa: E402

from moeray.stages.runtime.transport import free_port  # noqa: E402

KEY = "probe-key"
DRAIN_S = 3.0
COMMON = ["--api-key", KEY, "--max-seqs", "4", "--max-waiting", "8", "--max-len", "512", "--kv-blocks", "128",
          "--metrics-export-port", "0", "--drain-timeout", str(DRAIN_S),
          # a loaded 2-core machine compiles a 5,000-field schema in seconds, not the default's budget
          "--grammar-timeout", "120", "--ready-timeout", "500"]
MODES = {"local": ["--local"], "stages": ["--stages", "2"]}
# The slowest 429 of a burst of 300: in one process the door answers it; on stages every request
# crosses Serve's proxy first, whose own cost for 300 requests is seconds on a shared 2-core machine.
BURST_429_S = {"local": 2.0, "stages": 4.0}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_the_probe_passes_every_case(mode, default_model_path):
    server = start_serve([str(default_model_path), *MODES[mode], *COMMON], free_port(), timeout_s=600)
    try:
        ray_port = next(int(m.group(1)) for line in server.lines
                        if (m := re.match(r"Ray metrics \(Prometheus\): http://127\.0\.0\.1:(\d+)/metrics", line)))
        lines: list[str] = []
        results = probe.run(server.url, KEY, {"leave", "input", "burst", "net", "ops"}, abort_s=10.0,
                            burst=300, bound_429_s=BURST_429_S[mode], ray_metrics_port=ray_port, sigterm_pid=server.proc.pid,
                            drain_s=DRAIN_S, kill_stage=mode == "stages", beside_factor=6.0, beside_floor_s=3.0,
                            say=lines.append)
        print("\n".join(lines))
        failed = [f"{r.name}: {r.status} {r.detail}" for r in results if not r.ok]
        assert not failed, "\n".join(failed)
        assert len(results) >= 60
        rc = server.proc.wait(120)  # the probe's last case sent SIGTERM
        assert rc == 0, "".join(server.errors[-30:])
        err = "".join(server.errors)
        assert "draining" in err and "moeray serve: stopped" in err
        assert "Traceback (most recent call last)" not in err, err[-3000:]
    finally:
        if server.proc.poll() is None:
            server.stop()
