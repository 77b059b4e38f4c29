"""`moeray serve --local`: the HTTP app served by uvicorn from this process, over the model loaded here.

One process for real: the Service (model, engine thread, metrics) and the FastAPI app
(cluster/serve_app.py, the same handlers Serve runs) live in the `moeray serve` process, with
uvicorn on a thread of its own. Serve's proxy and replica are not in the way: through them each
streamed chunk crossed two processes and Ray's streaming calls, whose threads took CPU from ggml's
on every token. Ray still
runs beside it for the metrics (`ray.util.metrics` from this driver, Prometheus on
--metrics-export-port) and the optional dashboard, unless `--no-metrics` leaves Ray out too; the stage pipeline (`moeray serve` without
--local) keeps Serve, whose replica owns the stage actors.
"""
from __future__ import annotations

import sys
import threading
import time

from moeray.cluster.config import ServeOptions
from moeray.errors import MoerayError


class LocalServer:
    """The Service and its HTTP server in this process; `close()` stops both (bounded)."""

    def __init__(self, opts: ServeOptions, host: str, port: int, ready_timeout_s: float = 600.0):
        import uvicorn

        from moeray.cluster.serve_app import build_app
        from moeray.cluster.service import Service

        self.service = Service(opts, log=lambda line: print(line, file=sys.stderr, flush=True))
        # No access log (a line per request on the serving path); no lifespan: the app has no hooks.
        config = uvicorn.Config(build_app(self.service), host=host, port=port, log_level="warning",
                                access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        # Off the main thread uvicorn installs no signal handlers: `moeray serve` keeps its own
        # (SIGTERM / SIGINT -> an orderly shutdown, cluster/commands/serve.py stop_on_signals).
        self.thread = threading.Thread(target=self.server.run, name="moeray-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + ready_timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                self.service.close()
                raise MoerayError(f"the HTTP server did not start on {host}:{port} (see the error above)")
            if time.monotonic() > deadline:
                self.close()
                raise MoerayError(f"the HTTP server did not start on {host}:{port} within {ready_timeout_s:.0f} s")
            time.sleep(0.05)

    def failure(self) -> str | None:
        """Why this server can no longer serve (its engine thread or its HTTP thread died), else
        None. Under Serve a dead replica is restarted; one process cannot restart itself, so
        `moeray serve --local` exits on it and leaves the restart to a supervisor."""
        loop = self.service.loop
        if not loop.alive:
            return f"the engine stopped: {loop.fatal or 'its thread ended'}"
        if not self.thread.is_alive():
            return "the HTTP server's thread ended"
        return None

    def wait(self, poll_s: float = 1.0) -> str:
        """Block until failure() says why (a signal interrupts it first, as `moeray serve` stops)."""
        while (why := self.failure()) is None:
            time.sleep(poll_s)
        return why

    def close(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.service.close()
