"""A node that leaves the cluster with a stage on it: a ray.cluster_utils.Cluster on this machine
(a head, three worker nodes each holding ONE simulated card as a custom resource, so a lost node's
card is really gone) serves the default model over HTTP on three stages while clients stream.

1. A stage's node is removed (as in a crash, not gracefully): the requests in flight get an error
   naming that node; the driver probes the two cards left, re-plans (a new split, caches and KV
   pools sized anew) and serving resumes; /v1/stages and the metrics say what happened.
2. A second node is removed: one card cannot hold the model, so every request is a 503 saying so,
   at once (never a hang), and the server stays up.
3. A node joins again: the engine re-plans on two cards and serves.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

ray = pytest.importorskip("ray")
uvicorn = pytest.importorskip("uvicorn")

from moeray.cluster.config import EngineConfig, LaunchOptions, ServeOptions  # noqa: E402
from moeray.cluster.driver import DEVICE_RESOURCE  # noqa: E402

MiB = 1 << 20
# Two of these cards hold the default model (its trunk is ~74 MiB, all on the cards); one does not.
CARD = 72 * MiB


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(3):
        c.add_node(num_cpus=1, resources={DEVICE_RESOURCE: 1})
    c.wait_for_nodes()
    ray.init(address=c.address)
    yield c
    ray.shutdown()
    c.shutdown()


def _get(url: str, timeout: float = 30.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _chat(url: str, max_tokens: int, stream: bool, timeout: float = 180.0) -> tuple[int, dict | list]:
    """(status, body): the JSON body, or for a stream the list of its data objects."""
    body = {"model": "m", "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": "Tell me a long story about the sea."}]}
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            if not stream:
                return r.status, json.loads(r.read())
            events = []
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
            return r.status, events
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


class Streams:
    """Clients streaming long answers back to back; every outcome kept."""

    def __init__(self, url: str, n: int = 3):
        self.url, self.out, self.stop = url, [], threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            status, body = _chat(self.url, 40, stream=True)
            self.out.append((t0, time.monotonic(), status, body))

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(200)
            assert not t.is_alive(), "a client hung"


def _stage_node(report: dict, stage: int) -> str:
    return next(s["node_id"] for s in report["stages"] if s["stage"] == stage)


def _serving_again(url: str, deadline_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        status, body = _chat(url, 4, stream=False)
        if status == 200:
            return time.monotonic() - t0
        time.sleep(1)
    raise AssertionError(f"not serving again within {deadline_s:.0f} s: {status} {body}")


def _recovered(url: str, replans: int, deadline_s: float) -> dict:
    """/v1/stages once the engine has noticed the loss and finished re-plan number `replans`. A
    request right after the node is removed may still be served by the old stages (its processes
    die a moment later), so serving alone does not say the loss was handled. While a recovery is
    under way the report answers (no stages, `recovering` says why); before the engine notices,
    asking the dead stage may be a 503."""
    t0, seen = time.monotonic(), None
    while time.monotonic() - t0 < deadline_s:
        try:
            seen = _get(f"{url}/v1/stages")
        except urllib.error.HTTPError as exc:
            seen = exc.code
        else:
            if seen["faults"]["recovering"] is not None:
                assert seen["stages"] == [] and seen["faults"]["stages_serving"] == 0, seen
            elif seen["faults"]["replans"] >= replans:
                return seen
        time.sleep(0.5)
    raise AssertionError(f"no re-plan {replans} within {deadline_s:.0f} s: {seen}")


def test_a_lost_node_is_replanned_around_and_too_little_left_is_a_503_with_the_reason(cluster, default_model_path):
    from moeray.cluster.serve_app import build_app
    from moeray.cluster.service import Service
    from moeray.stages.runtime.transport import free_port

    lines: list[str] = []
    opts = ServeOptions(model=str(default_model_path), model_name="m",
                        launch=LaunchOptions(3, simulate=[CARD] * 3, strategy="SPREAD", torch_threads=1,
                                             timeout_s=240),
                        engine=EngineConfig(max_seqs=4, max_len=128, micro_batches=1, step_timeout_s=60),
                        metrics_interval_s=1.0)
    service = Service(opts, log=lines.append)
    service.loop.retry_s = 2.0
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(service), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        while not server.started:
            time.sleep(0.2)
        before = _get(f"{url}/v1/stages")
        assert len(before["stages"]) == 3
        workers = {n.node_id: n for n in cluster.worker_nodes}

        # 1. A node with a stage on it crashes while clients stream.
        clients = Streams(url)
        time.sleep(8)  # answers under way
        lost = _stage_node(before, 1)
        t_lost = time.monotonic()
        cluster.remove_node(workers.pop(lost), allow_graceful=False)
        _recovered(url, 1, 180)
        _serving_again(url, 60)
        print(f"node loss -> serving again after {time.monotonic() - t_lost:.1f} s")
        clients.join()
        failed = [b for _, t1, status, b in clients.out if t1 >= t_lost and
                  (status != 200 or any("error" in e for e in b))]
        assert failed, "no request was in flight at the node loss"
        for b in failed:
            msg = (b["error"] if isinstance(b, dict) else next(e["error"] for e in b if "error" in e))["message"]
            assert lost[:12] in msg, msg  # the error names the node that left
        after = _get(f"{url}/v1/stages")
        assert len(after["stages"]) == 2  # re-planned onto the two cards left
        assert {s["node_id"] for s in after["stages"]} == set(workers)
        assert after["faults"]["nodes_lost"] == 1 and after["faults"]["replans"] == 1
        assert after["faults"]["recovering"] is None and after["faults"]["stages_serving"] == 2
        assert [e["event"] for e in after["faults"]["events"]][-2:] == ["node lost", "re-planned"]
        assert any(line.startswith("layer split") for line in after["plan"])  # the new split, printed
        assert after["kv"]["blocks"] == after["stages"][0]["kv"]["blocks"]  # the engine took the new pool
        assert any("re-plan on the devices left (2 stages)" in line for line in lines)
        faults = service.faults_report()  # what the metrics poller exports (moeray_nodes_lost, ...)
        assert (faults["nodes_lost"], faults["replans"], faults["stages_serving"]) == (1, 1, 2)

        # 2. Another node goes: one card cannot hold the model.
        cluster.remove_node(workers.pop(_stage_node(after, 0)), allow_graceful=False)
        deadline = time.monotonic() + 180
        while True:
            t0 = time.monotonic()
            status, body = _chat(url, 4, stream=False, timeout=200)
            # the server down with its reason (a request in flight at the loss fails first, its
            # message "the request failed: cannot serve ...")
            if status == 503 and body["error"]["message"].startswith("cannot serve"):
                break
            assert time.monotonic() < deadline, (status, body)
        reason = body["error"]["message"]
        print(f"503: {reason}")
        assert "no placement fits" in reason and "\n" not in reason
        t0 = time.monotonic()
        status, body = _chat(url, 4, stream=True, timeout=30)
        assert status == 503 and body["error"]["message"] == reason and time.monotonic() - t0 < 5  # at once
        down = _get(f"{url}/v1/stages")
        assert down["stages"] == [] and down["faults"]["down"] == reason

        # 3. A node joins: two cards again, and the engine serves.
        t_join = time.monotonic()
        cluster.add_node(num_cpus=1, resources={DEVICE_RESOURCE: 1})
        _recovered(url, 2, 240)
        _serving_again(url, 60)
        print(f"node joined -> serving again after {time.monotonic() - t_join:.1f} s")
        print("\n".join(line for line in lines if "re-plan" in line or "serving again" in line or "cannot serve" in line
                        or line.startswith(("layer split", "stage ", "moeray: node"))))
        back = _get(f"{url}/v1/stages")
        assert len(back["stages"]) == 2 and back["faults"]["down"] is None and back["faults"]["replans"] == 2
        time.sleep(2 * opts.metrics_interval_s)
        assert service.poller.last_error is None  # the metrics poller went through it all
    finally:
        server.should_exit = True
        service.close()
