"""GET /dashboard, the live page of the stages, in a real headless Chromium against a real
`moeray serve` (tests/live_dashboard_server.py); the API key as a browser passes it; the stage
actors as the Ray dashboard names them.

The browser test writes a screenshot: to $MOERAY_DASHBOARD_SCREENSHOT when set (the README's and docs/operations.md's copy:
MOERAY_DASHBOARD_SCREENSHOT=docs/dashboard.png), else to the test's temporary folder.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

from headless_chromium import Chromium, chromium_binary

pytest_plugins = ["live_dashboard_server"]  # the session's one `moeray serve --dashboard --api-key ...`

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colours are"]


def request(url: str, method: str, path: str, headers: dict | None = None, body: bytes | None = None):
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read().decode(errors="replace")
    finally:
        conn.close()


# ---------------------------------------------------------------- the API key, as a browser passes it


def test_the_page_wants_the_key_and_keeps_it_in_a_cookie_that_opens_only_the_stage_numbers(dashboard_server):
    url, key, model = dashboard_server.url, dashboard_server.key, dashboard_server.model
    status, _, body = request(url, "GET", "/dashboard")
    assert status == 401 and "/dashboard?key=" in body  # says how to open it
    status, _, body = request(url, "GET", "/dashboard?key=wrong")
    assert status == 401 and "not this server's" in body

    status, headers, _ = request(url, "GET", f"/dashboard?key={key}")
    assert status == 303 and headers["location"] == "/dashboard"  # the key leaves the address bar
    cookie = headers["set-cookie"]
    assert cookie.startswith(f"moeray_key={key};") and "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert request(url, "GET", f"/dashboard?every=5&key={key}")[1]["location"] == "/dashboard?every=5"
    jar = {"Cookie": f"moeray_key={key}"}
    status, headers, body = request(url, "GET", "/dashboard", jar)
    assert status == 200 and headers["content-type"].startswith("text/html") and "dashboard.js" in body
    status, _, body = request(url, "GET", "/v1/stages", jar)
    assert status == 200 and f'"model":"{model}"' in body.replace(" ", "")

    # A wrong cookie is refused, and the cookie opens nothing but the stage numbers.
    assert request(url, "GET", "/v1/stages", {"Cookie": "moeray_key=wrong"})[0] == 401
    assert request(url, "GET", "/v1/models", jar)[0] == 401
    status, _, body = request(url, "POST", "/v1/completions", {**jar, "Content-Type": "application/json"},
                              b'{"model": "%s", "prompt": "Hi", "max_tokens": 1}' % model.encode())
    assert status == 401 and "Authorization: Bearer" in body


def test_the_chart_library_is_served_by_the_server_itself(dashboard_server):
    url = dashboard_server.url
    status, headers, body = request(url, "GET", "/dashboard/static/uPlot.iife.min.js")
    assert status == 200 and "javascript" in headers["content-type"] and "uPlot" in body[:200]
    status, _, body = request(url, "GET", "/dashboard/static/uPlot.LICENSE")
    assert status == 200 and "MIT License" in body
    assert request(url, "GET", "/dashboard/static/no-such.js")[0] == 404


def test_without_an_api_key_the_page_is_open_like_the_rest():
    """The route alone, on a bare app (no server needed): no key, no cookie, the page itself."""
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from moeray.cluster.dashboard import add_dashboard

    app = FastAPI()
    add_dashboard(app, None)
    r = TestClient(app).get("/dashboard?key=anything", follow_redirects=False)
    assert r.status_code == 200 and "set-cookie" not in r.headers and "dashboard.js" in r.text


# ---------------------------------------------------------------- the page in a real browser


@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no chromium binary (Debian: apt-get install chromium; .ci/run installs it as root)")
    pytest.importorskip("websockets")
    browser = Chromium(binary, tmp_path_factory.mktemp("chromium-profile"))
    yield browser
    browser.close()


def _traffic(server, stop: threading.Event, errors: list) -> None:
    i = 0
    while not stop.is_set():
        try:
            server.complete(PROMPTS[i % len(PROMPTS)], max_tokens=6)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(repr(exc))
            return
        i += 1


def test_the_page_draws_one_series_per_stage_in_chromium_without_console_errors(chromium, dashboard_server,
                                                                                tmp_path):
    url, n_stages = dashboard_server.url, dashboard_server.n_stages
    stop, errors = threading.Event(), []
    driver = threading.Thread(target=_traffic, args=(dashboard_server, stop, errors), daemon=True)
    driver.start()
    try:
        page = chromium.open(f"{url}/dashboard?key={dashboard_server.key}&every=1")
        # Enough polls under traffic that every stage has a measured hit rate and a step time.
        deadline, state = time.monotonic() + 120, None
        while time.monotonic() < deadline:
            state = page.evaluate("""(() => { const d = window.moerayDashboard; return d && d.nStages && {
                polls: d.polls, failures: d.failures, lastError: d.lastError, n: d.nStages,
                hit: d.rows.hit.map(r => r.filter(v => v != null).length),
                step: d.rows.step.map(r => r.filter(v => v != null).length) }; })()""")
            if state and state["n"] == n_stages and state["polls"] >= 8 and all(state["hit"]) and all(state["step"]):
                break
            time.sleep(1.0)
    finally:
        stop.set()
        driver.join(120)
    assert not errors, errors
    assert state and state["n"] == n_stages and all(state["hit"]) and all(state["step"]), state
    assert state["lastError"] is None, state
    assert page.evaluate("location.search") == "?every=1"  # the key left the address bar, the options stayed

    charts = page.evaluate("""Object.fromEntries(Object.entries(window.moerayDashboard.charts).map(
        ([k, c]) => [k, c.series.slice(1).map(s => s.label)]))""")
    per_stage = [f"stage {i}" for i in range(n_stages)]
    assert charts["hit"] == [f"stage {i} {what}" for i in range(n_stages) for what in ("measured", "predicted")]
    for name in ("tps", "step", "kv"):
        assert charts[name] == per_stage, (name, charts[name])
    # Each chart is drawn: a canvas per chart, a legend row per series.
    assert page.evaluate("document.querySelectorAll('figure canvas').length") == 4
    assert page.evaluate("document.querySelectorAll('#chart-hit .u-legend .u-series').length") == 1 + 2 * n_stages

    # The layer split and the table say what /v1/stages says.
    report = dashboard_server.get("/v1/stages")
    split = page.evaluate("[...document.querySelectorAll('#split div')].map(d => d.textContent)")
    assert split == [f"stage {s['stage']}: layers {s['layers'][0]}-{s['layers'][1] - 1}" for s in report["stages"]]
    assert page.evaluate("document.querySelectorAll('#stages tr').length") == 1 + n_stages
    # KV use is drawn from each stage's block pool: a share of it, for every stage.
    assert all(s["kv"]["blocks"] > 0 for s in report["stages"])
    assert page.evaluate("document.getElementById('kv-note').textContent") == ""
    kv_rows = page.evaluate("window.moerayDashboard.rows.kv")
    assert len(kv_rows) == n_stages and all(r and all(v is not None and 0 <= v <= 1 for v in r) for r in kv_rows), kv_rows
    predicted = page.evaluate("window.moerayDashboard.rows.predicted.map(r => r[r.length - 1])")
    assert predicted == pytest.approx([s["predicted_hit_rate"] for s in report["stages"]])

    page.drain()
    assert page.console_errors() == []
    origin = url + "/"
    foreign = [u for u in page.requested_urls() if not u.startswith(origin) and not u.startswith("data:")]
    assert foreign == []  # no CDN: the page works offline

    out = Path(os.environ.get("MOERAY_DASHBOARD_SCREENSHOT") or tmp_path / "dashboard.png")
    png = page.screenshot(out)
    page.close()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size < 200_000


# ---------------------------------------------------------------- the stage actors in the Ray dashboard


def test_serve_prints_the_ray_dashboard_and_page_urls(dashboard_server):
    lines, port = dashboard_server.lines, dashboard_server.ray_dashboard_port
    assert dashboard_server.ray_dashboard == f"http://127.0.0.1:{port}", lines
    assert f"live stage page: {dashboard_server.url}/dashboard?key=$MOERAY_API_KEY\n" in lines


def _stage_actor_reprs(address: str) -> list[str]:
    """Ray's state API (ray.util.state.list_actors), as `ray list actors` runs it: in its own
    process, which uses the cluster's token (~/.ray/auth_token) when Ray enabled token auth."""
    code = ("import json, sys; from ray.util.state import list_actors; print(json.dumps(sorted(a.repr_name for a in "
            "list_actors(address=sys.argv[1], filters=[('class_name', '=', 'StageActor'), ('state', '=', 'ALIVE')], "
            "detail=True, timeout=20))))")
    env = dict(os.environ)
    if "RAY_AUTH_MODE" not in env and (Path.home() / ".ray" / "auth_token").exists():
        env["RAY_AUTH_MODE"] = "token"
    out = subprocess.run([sys.executable, "-c", code, address], capture_output=True, text=True, timeout=90, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_ray_dashboard_names_each_stage_actor(dashboard_server):
    n_stages = dashboard_server.n_stages
    deadline, names = time.monotonic() + 60, []
    while time.monotonic() < deadline:
        names = _stage_actor_reprs(dashboard_server.ray_dashboard)
        if len(names) == n_stages:
            break
        time.sleep(1.0)
    assert len(names) == n_stages, names
    for i, name in enumerate(names):
        assert re.fullmatch(rf"StageActor\(stage={i}/{n_stages}, device=simulated device {i} \(.+\)\)", name), name


def test_a_stage_repr_carries_its_layers_and_live_hit_rate(default_model_path):
    """In process (what a log line or ray.get(actor.describe.remote()) shows after loading)."""
    from moeray.stages.runtime.actor import StageActor
    from moeray.stages.runtime.step import StepBatch

    stage = StageActor(0, 1, simulated_budget=150 << 20, torch_threads=1)
    assert repr(stage).startswith("StageActor(stage=0/1, device=simulated device 0")
    stage.load(str(default_model_path), 0, 30, kv_blocks=1)
    stage.step(StepBatch(step_id=0, slots=[0], n_new=[6], fresh=[True], tokens=[[1, 504, 3458, 282, 4649, 314]], sample=[False],
                         starts=[0], tables=[[0]]))
    cache = stage.stats().cache
    assert 0 < cache["hits"] < cache["lookups"]
    assert stage.describe() == f"StageActor(stage=0/1, layers=0-29, hit={100 * cache['hit_rate']:.0f}%)"
