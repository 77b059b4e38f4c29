"""A real headless Chromium driven over the DevTools protocol (CDP), for the page tests.

Debian's `chromium` binary, started with --remote-debugging-port=0 (it writes the port it took to
DevToolsActivePort in its profile folder), and a small synchronous CDP client over `websockets`:
send a command, wait for its answer, and keep every event that arrives meanwhile (console
messages, exceptions, network requests) for the test to inspect. Every wait is bounded.
"""
from __future__ import annotations

import base64
import contextlib
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

CONSOLE_ERRORS = ("error", "assert")


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


class CDPError(RuntimeError):
    pass


class Page:
    """One page target's CDP session."""

    def __init__(self, ws_url: str):
        from websockets.sync.client import connect

        self._stack = contextlib.ExitStack()
        self.ws = self._stack.enter_context(connect(ws_url, max_size=None, open_timeout=20))
        self.events: list[dict] = []
        self._id = 0

    def _recv(self, timeout_s: float) -> dict:
        return json.loads(self.ws.recv(timeout=max(0.01, timeout_s)))

    def send(self, method: str, timeout_s: float = 30.0, **params) -> dict:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CDPError(f"{method}: no answer within {timeout_s:.0f} s")
            msg = self._recv(left)
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise CDPError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def wait_event(self, method: str, timeout_s: float = 30.0) -> dict:
        for ev in self.events:
            if ev.get("method") == method:
                return ev
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                msg = self._recv(deadline - time.monotonic())
            except TimeoutError:
                break
            self.events.append(msg)
            if msg.get("method") == method:
                return msg
        raise CDPError(f"no {method} event within {timeout_s:.0f} s")

    def evaluate(self, expression: str, timeout_s: float = 30.0):
        out = self.send("Runtime.evaluate", timeout_s, expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in out:
            raise CDPError(f"{expression!r} threw: {out['exceptionDetails']}")
        return out["result"].get("value")

    def drain(self, quiet_s: float = 0.5) -> None:
        """Collect the events already on their way."""
        while True:
            try:
                self.events.append(self._recv(quiet_s))
            except TimeoutError:
                return

    def console_errors(self) -> list[str]:
        """Console errors, uncaught exceptions and browser-logged errors (e.g. a 404 resource)."""
        out = []
        for ev in self.events:
            m, p = ev.get("method"), ev.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in CONSOLE_ERRORS:
                out.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
            elif m == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                out.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append(f"log: {p['entry'].get('text')} {p['entry'].get('url', '')}")
        return out

    def requested_urls(self) -> list[str]:
        return [ev["params"]["request"]["url"] for ev in self.events if ev.get("method") == "Network.requestWillBeSent"]

    def screenshot(self, path: Path) -> bytes:
        data = base64.b64decode(self.send("Page.captureScreenshot", 60.0, format="png", captureBeyondViewport=True)["data"])
        path.write_bytes(data)
        return data

    def close(self) -> None:
        self._stack.close()


class Chromium:
    """`chromium --headless` with a private profile; `open(url)` gives a Page with the console,
    log and network domains on."""

    def __init__(self, binary: str, profile_dir: Path, width: int = 1280, height: int = 800, timeout_s: float = 60.0):
        self.width, self.height = width, height
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
             "--disable-component-update", "--hide-scrollbars", "--remote-debugging-address=127.0.0.1",
             "--remote-debugging-port=0", f"--user-data-dir={profile_dir}", f"--window-size={width},{height}",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        marker = profile_dir / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while not (marker.exists() and marker.read_text().strip()):
            if self.proc.poll() is not None:
                raise CDPError(f"chromium exited with {self.proc.returncode}: {self.proc.stderr.read()[-2000:]}")
            if time.monotonic() > deadline:
                self.close()
                raise CDPError(f"chromium opened no DevTools port within {timeout_s:.0f} s")
            time.sleep(0.2)
        self.port = int(marker.read_text().split()[0])

    def open(self, url: str, timeout_s: float = 60.0) -> Page:
        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list", timeout=10).read())
        page = Page(next(t for t in targets if t["type"] == "page")["webSocketDebuggerUrl"])
        for domain in ("Runtime", "Log", "Network", "Page"):
            page.send(f"{domain}.enable")
        page.send("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height, deviceScaleFactor=1,
                  mobile=False)
        page.send("Page.navigate", url=url)
        page.wait_event("Page.loadEventFired", timeout_s)
        return page

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
