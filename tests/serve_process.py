"""`moeray serve` in a subprocess, as a user starts it: the one way the tests launch and stop it."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field


@dataclass
class ServeProcess:
    proc: subprocess.Popen
    port: int
    lines: list[str] = field(default_factory=list)  # stdout, as printed
    errors: list[str] = field(default_factory=list)  # stderr, drained and kept for a failure

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def up(self) -> bool:
        """The server printed its curl line (the last thing it prints once it serves)."""
        return any(line.startswith("curl ") for line in self.lines)

    def stop(self) -> None:
        """SIGTERM, as `kill` sends it; a server that does not stop within a minute is killed."""
        stop(self.proc)


def start_serve(args: list[str], port: int, timeout_s: float = 300.0, env: dict | None = None,
                require_up: bool = True) -> ServeProcess:
    """Run `moeray serve ARGS --port PORT` and wait until it serves or exits. With require_up, an
    exit or a timeout fails the test with what it printed; otherwise the caller looks at `proc`."""
    proc = subprocess.Popen([sys.executable, "-m", "moeray.cluster.cli", "serve", *args, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    s = ServeProcess(proc, port)
    threading.Thread(target=lambda: s.lines.extend(proc.stdout), daemon=True).start()
    threading.Thread(target=lambda: s.errors.extend(proc.stderr), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not s.up:
        if proc.poll() is not None:
            assert not require_up, f"moeray serve exited with {proc.returncode}: {s.lines} {''.join(s.errors[-20:])}"
            return s
        if time.monotonic() > deadline:
            stop(proc)
            raise AssertionError(f"moeray serve not up in {timeout_s:.0f} s: {s.lines} {''.join(s.errors[-20:])}")
        time.sleep(0.5)
    return s


def stop(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
