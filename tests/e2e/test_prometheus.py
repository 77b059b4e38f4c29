"""The Grafana dashboard's queries against a real Prometheus scraping a real `moeray serve`.

Prometheus (Debian's `prometheus` binary; .ci/run installs it as root) scrapes Ray's metrics export
port every second. After traffic, every series a panel of ray_configs/moeray-dashboard.json names
exists with the model and stage labels, every panel's query evaluates, and the hit-rate panel's own
expression, over a window from one settled scrape to another, equals what GET /v1/stages reports
for the lookups between those two moments. A panel that names a series moeray no longer exports,
or a hit-rate query that computes something else, fails here.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from serve_process import stop

pytest_plugins = ["live_dashboard_server"]  # the session's one `moeray serve --dashboard --api-key ...`
MODEL = "moeray-dash"  # the name that server serves under (checked below)

DASHBOARD = Path(__file__).resolve().parents[2] / "ray_configs" / "moeray-dashboard.json"
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def prometheus(request, tmp_path_factory):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary (Debian: apt-get install prometheus; .ci/run installs it as root)")
    from moeray.stages.runtime.transport import free_port

    dashboard_server = request.getfixturevalue("dashboard_server")  # started only when Prometheus is here

    root = tmp_path_factory.mktemp("prometheus")
    config = root / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: ray\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{dashboard_server.metrics_port}']\n")
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={root / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    api = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{api}/-/ready", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        assert time.monotonic() < deadline, "prometheus not ready in 60 s"
        time.sleep(0.5)
    try:
        yield api
    finally:
        stop(proc, 30)


def query(api: str, promql: str, at: float | None = None) -> list[dict]:
    params = {"query": promql, **({"time": f"{at:.3f}"} if at is not None else {})}
    with urllib.request.urlopen(f"{api}/api/v1/query?{urllib.parse.urlencode(params)}", timeout=30) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", (promql, body)
    return body["data"]["result"]


def series(api: str, name: str) -> list[dict]:
    with urllib.request.urlopen(f"{api}/api/v1/series?{urllib.parse.urlencode({'match[]': name})}", timeout=30) as r:
        return json.loads(r.read())["data"]


def dashboard_queries() -> tuple[list[str], set[str]]:
    """Every panel's PromQL, and every ray_moeray_* series the dashboard names (variables too)."""
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    texts = exprs + [v.get("query", "") for v in board["templating"]["list"]]
    return exprs, {n for t in texts for n in re.findall(r"\bray_moeray_[a-z_]+", t)}


def concrete(expr: str, window: str) -> str:
    """A panel's query as Grafana sends it: this server's model, every stage, a rate window."""
    return expr.replace("$model", MODEL).replace("$stage", ".*").replace("$__rate_interval", window)


def settled(api: str, server: dict, timeout_s: float = 60.0) -> tuple[dict, float]:
    """Wait until Prometheus' latest scrape of every stage's hits and lookups equals GET /v1/stages
    (no traffic meanwhile); returns those stage numbers and the timestamp of that scrape."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        stages = {str(s["stage"]): s for s in server.get("/v1/stages")["stages"]}
        samples = {}
        for what in ("hits", "lookups"):
            for r in query(api, f'ray_moeray_stage_expert_{what}_total{{model="{MODEL}"}}[5s]'):
                samples.setdefault(what, {}).setdefault(r["metric"]["stage"], []).append(r["values"][-1])
        last = (samples, {k: (v["cache"]["hits"], v["cache"]["lookups"]) for k, v in stages.items()})
        ok = set(samples.get("lookups", {})) == set(stages) == set(samples.get("hits", {}))
        if ok:
            ts = {t for what in samples.values() for vals in what.values() for t, _ in vals}
            ok = len(ts) == 1 and all(len(v) == 1 for what in samples.values() for v in what.values())  # one scrape
            ok = ok and all(float(samples["hits"][k][0][1]) == s["cache"]["hits"]
                            and float(samples["lookups"][k][0][1]) == s["cache"]["lookups"] for k, s in stages.items())
            if ok:
                return stages, float(ts.pop())
        time.sleep(1.0)
    pytest.fail(f"Prometheus did not catch up with /v1/stages in {timeout_s:.0f} s: {last}")


def test_every_dashboard_series_exists_and_the_hit_rate_query_equals_v1_stages(prometheus, dashboard_server):
    api = prometheus
    assert dashboard_server.model == MODEL
    dashboard_server.complete(PROMPTS[0], max_tokens=4)
    before, t0 = settled(api, dashboard_server)
    for p in PROMPTS:
        dashboard_server.complete(p, max_tokens=8)
    after, t1 = settled(api, dashboard_server)
    assert t1 > t0

    # Every series a panel names exists, for this model, and per stage where it is a stage metric.
    exprs, names = dashboard_queries()
    stages = {str(i) for i in range(dashboard_server.n_stages)}
    for name in sorted(names):
        found = series(api, name)
        assert found, f"{name}: the dashboard queries it, Prometheus has no such series"
        assert {s["model"] for s in found} == {MODEL}, (name, found)
        if name.startswith("ray_moeray_stage_"):
            assert {s["stage"] for s in found} == stages, (name, found)

    # Every panel's query evaluates to something (a query naming a missing series gives nothing).
    for expr in exprs:
        assert query(api, concrete(expr, "1m")), f"no result: {concrete(expr, '1m')}"

    # The hit-rate panel's expression, over [t0, t1], is the hit rate of the lookups in between as
    # the stages count them. The window starts 1 ms before the t0 scrape so that scrape is its first
    # sample: both rates then extrapolate by the same factor and their ratio is exact.
    board = json.loads(DASHBOARD.read_text())
    hit_panel = next(p for p in board["panels"] if p.get("repeat") == "stage" and "hit rate" in p["title"])
    expr = concrete(hit_panel["targets"][0]["expr"], f"{round((t1 - t0) * 1000) + 1}ms")
    got = {r["metric"]["stage"]: float(r["value"][1]) for r in query(api, expr, at=t1)}
    want = {}
    for k in stages:
        hits = after[k]["cache"]["hits"] - before[k]["cache"]["hits"]
        lookups = after[k]["cache"]["lookups"] - before[k]["cache"]["lookups"]
        assert lookups > 0 and 0 < hits < lookups, (k, hits, lookups)  # a rate worth comparing
        want[k] = hits / lookups
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)

    # ... and the prediction drawn beside it is the plan's, as /v1/stages reports it.
    predicted = concrete(hit_panel["targets"][1]["expr"], "1m")
    got = {r["metric"]["stage"]: float(r["value"][1]) for r in query(api, predicted, at=t1)}
    assert got == pytest.approx({k: after[k]["predicted_hit_rate"] for k in stages})
