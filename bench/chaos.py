"""Faults under load: streaming clients against moeray serve while stages are SIGKILLed (and, on
a simulated multi-node cluster, nodes removed and added back).

    python bench/chaos.py --minutes 5                       # starts moeray serve (2 simulated stages)
    python bench/chaos.py --url http://127.0.0.1:8000       # a server already running on this machine
    python bench/chaos.py --nodes 3 --minutes 5             # a ray.cluster_utils cluster: head + 3 nodes,
                                                            # one simulated card each; also removes a
                                                            # stage's node and adds one back

Every --kill-every seconds a random stage's process gets SIGKILL (its pid from GET /v1/stages);
with --nodes, every --node-every seconds the node of a random stage is removed from the cluster
and a fresh one with the same card joins --node-back seconds later. --clients threads stream chat
completions back to back. Reported:

- requests succeeded / failed, and of those NOT in flight at a fault, the share that succeeded;
- that every failure was an OpenAI-shaped error (an HTTP error with {"error": {...}}, or an error
  event in the stream followed by [DONE]) and none a hang (no byte for --hang-s) or a reset;
- per fault, the time until a request sent after it got its first token (serving again);
- the server's RSS (the Serve replica: driver + engine, from /v1/stages) after warm-up and at the end.

Writes the table and, with --json PATH, every request and fault.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

from results import write_results  # noqa: E402

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Why is the sky blue?",
           "List three uses of copper.", "What does a pipeline stage do?", "Name a famous painting."]


@dataclass
class Result:
    client: int
    t0: float
    t1: float = 0.0
    t_first: float | None = None  # first content token
    outcome: str = ""  # ok | error (OpenAI-shaped) | bad (reset, hang, non-JSON error)
    status: int = 0
    detail: str = ""


@dataclass
class Fault:
    t: float
    kind: str  # kill | node-remove | node-add
    target: str
    recovered_s: float | None = None


def get_json(url: str, path: str, timeout: float = 30.0) -> dict:
    u = urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return json.loads(r.read())
    finally:
        c.close()


def one_request(url: str, model: str, i: int, max_tokens: int, hang_s: float) -> Result:
    """One streamed chat completion, classified."""
    u = urlparse(url)
    res = Result(i, time.monotonic())
    body = json.dumps({"model": model, "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": random.choice(PROMPTS)}]})
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=hang_s)
    try:
        c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        res.status = r.status
        if r.status != 200:
            data = r.read()
            try:
                err = json.loads(data)["error"]
                res.outcome, res.detail = "error", f"{r.status} {err.get('code')}: {err.get('message', '')[:200]}"
            except Exception:  # noqa: BLE001 - not OpenAI's shape
                res.outcome, res.detail = "bad", f"{r.status} non-JSON error: {data[:200]!r}"
            return res
        error, done = None, False
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                error = obj["error"]
            elif res.t_first is None and any(ch.get("delta", {}).get("content") for ch in obj.get("choices", [])):
                res.t_first = time.monotonic()
        if error is not None:
            res.outcome = "error" if done else "bad"
            res.detail = f"stream {error.get('code')}: {error.get('message', '')[:200]}" + ("" if done else " (no [DONE])")
        elif done:
            res.outcome = "ok"
        else:
            res.outcome, res.detail = "bad", "stream ended without [DONE]"
    except TimeoutError:
        res.outcome, res.detail = "bad", f"hang: no byte for {hang_s:.0f} s"
    except (ConnectionError, http.client.HTTPException, OSError) as exc:
        res.outcome, res.detail = "bad", f"reset: {type(exc).__name__}: {exc}"
    finally:
        res.t1 = time.monotonic()
        c.close()
    return res


class Clients:
    def __init__(self, url: str, model: str, n: int, max_tokens: int, hang_s: float):
        self.url, self.model, self.max_tokens, self.hang_s = url, model, max_tokens, hang_s
        self.results: list[Result] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def _run(self, i: int) -> None:
        while not self.stop.is_set():
            r = one_request(self.url, self.model, i, self.max_tokens, self.hang_s)
            with self.lock:
                self.results.append(r)
            if r.outcome != "ok":
                time.sleep(0.5)  # as a client with a retry delay would

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self, timeout_s: float) -> None:
        self.stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))


# ---------------------------------------------------------------- the server and the cluster


class Server:
    """`moeray serve` in a subprocess (its own process group), stopped with SIGTERM."""

    def __init__(self, args: list[str], port: int, log_path: str):
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "moeray.cluster.cli", "serve", *args, "--port", str(port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_up(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"moeray serve exited with {self.proc.returncode}; see {self.log.name}")
            try:
                get_json(self.url, "/health", 5)
                return
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(1)
        raise SystemExit(f"moeray serve not up in {timeout_s:.0f} s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def start_cluster(n_nodes: int):
    from ray.cluster_utils import Cluster

    from moeray.cluster.driver import DEVICE_RESOURCE

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(n_nodes):
        c.add_node(num_cpus=1, resources={DEVICE_RESOURCE: 1})
    c.wait_for_nodes()
    return c


def node_faults(cluster, url: str, every_s: float, back_s: float, faults: list[Fault], end: float,
                start_delay_s: float) -> None:
    """Until `end`: remove the node of a random stage, then add a node with the same card back.
    Runs on the main thread (ray.cluster_utils installs signal handlers when it adds a node)."""
    from moeray.cluster.driver import DEVICE_RESOURCE

    def wait(s: float) -> bool:  # False once the run is over
        time.sleep(max(0.0, min(s, end - time.monotonic())))
        return time.monotonic() < end

    if not wait(start_delay_s):
        return
    while True:
        try:
            stages = get_json(url, "/v1/stages")["stages"]
        except Exception:  # noqa: BLE001 - server busy recovering: try later
            stages = []
        nodes = {s["node_id"] for s in stages if s.get("node_id")}
        victims = [n for n in cluster.worker_nodes if n.node_id in nodes]
        if victims:
            node = random.choice(victims)
            faults.append(Fault(time.monotonic(), "node-remove", node.node_id[:12]))
            cluster.remove_node(node, allow_graceful=False)
            wait(back_s)  # the node comes back even when the run ends meanwhile
            new = cluster.add_node(num_cpus=1, resources={DEVICE_RESOURCE: 1})
            faults.append(Fault(time.monotonic(), "node-add", new.node_id[:12]))
        if not wait(every_s):
            return


def stage_kills(url: str, every_s: float, faults: list[Fault], stop: threading.Event, rng: random.Random) -> None:
    while not stop.wait(every_s):
        try:
            stages = [s for s in get_json(url, "/v1/stages")["stages"] if s.get("pid")]
        except Exception:  # noqa: BLE001 - server busy recovering: the next round
            continue
        if not stages:
            continue
        s = rng.choice(stages)
        try:
            os.kill(s["pid"], signal.SIGKILL)
            faults.append(Fault(time.monotonic(), "kill", f"stage {s['stage']} pid {s['pid']}"))
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------- report


def recovery_times(faults: list[Fault], results: list[Result]) -> None:
    """For each fault: the first token of a request sent after it (serving again)."""
    for f in faults:
        firsts = [r.t_first for r in results if r.t0 >= f.t and r.t_first is not None and r.outcome == "ok"]
        f.recovered_s = round(min(firsts) - f.t, 2) if firsts else None


def summary(results: list[Result], faults: list[Fault], rss: tuple[int, int], minutes: float) -> dict:
    hit = [f.t for f in faults if f.kind != "node-add"]

    def in_flight(r: Result) -> bool:
        return any(r.t0 <= t <= r.t1 for t in hit)

    clear = [r for r in results if not in_flight(r)]
    bad = [r for r in results if r.outcome == "bad"]
    rec = [f.recovered_s for f in faults if f.kind != "node-add"]
    done = sorted(x for x in rec if x is not None)
    return {
        "minutes": minutes, "requests": len(results), "succeeded": sum(r.outcome == "ok" for r in results),
        "failed": sum(r.outcome != "ok" for r in results),
        "failed_openai_shaped": sum(r.outcome == "error" for r in results),
        "failed_bad": len(bad), "bad_examples": [r.detail for r in bad[:5]],
        "not_in_flight": len(clear), "not_in_flight_succeeded": sum(r.outcome == "ok" for r in clear),
        "not_in_flight_success_rate": round(sum(r.outcome == "ok" for r in clear) / max(1, len(clear)), 4),
        "faults": len(hit), "recovered": len(done),
        "recovery_s_median": done[len(done) // 2] if done else None, "recovery_s_max": done[-1] if done else None,
        "rss_before_mib": round(rss[0] / 2**20, 1), "rss_after_mib": round(rss[1] / 2**20, 1),
        "rss_growth": round(rss[1] / rss[0] - 1, 4) if rss[0] else None,
    }


def server_rss(url: str) -> int:
    return int(get_json(url, "/v1/stages").get("server", {}).get("rss_bytes", 0))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a moeray server already running on this machine (else one is started)")
    p.add_argument("--nodes", type=int, default=0, help="run on a ray.cluster_utils cluster of this many device nodes")
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--kill-every", type=float, default=20.0, help="seconds between stage SIGKILLs")
    p.add_argument("--node-every", type=float, default=60.0, help="seconds between node removals (--nodes)")
    p.add_argument("--node-back", type=float, default=20.0, help="seconds until a node joins again (--nodes)")
    p.add_argument("--warmup", type=float, default=20.0, help="seconds of traffic before the first fault")
    p.add_argument("--hang-s", type=float, default=120.0, help="no byte for this long counts as a hang")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--serve-args", default="--stages 2 --simulate-devices 1600MiB,1600MiB --max-seqs 16 --max-len 512",
                   help="moeray serve's flags when this script starts it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default="chaos-serve.log", help="the started server's output")
    p.add_argument("--json", help="write the summary, faults and requests here")
    args = p.parse_args()
    rng = random.Random(args.seed)
    random.seed(args.seed)
    cluster = server = None
    try:
        if args.url:
            url = args.url
        else:
            serve_args = args.serve_args.split()
            if args.nodes:
                cluster = start_cluster(args.nodes)
                serve_args += ["--address", cluster.address, "--spread"]
            else:
                serve_args += ["--metrics-export-port", "0"]  # Ray holds a stopped server's port a while
            server = Server(serve_args, args.port, args.log)
            server.wait_up(900)
            url = server.url
        model = get_json(url, "/v1/models")["data"][0]["id"]
        clients = Clients(url, model, args.clients, args.max_tokens, args.hang_s)
        clients.start()
        time.sleep(args.warmup)
        rss_before = server_rss(url)
        faults: list[Fault] = []
        stop = threading.Event()
        killer = threading.Thread(target=stage_kills, args=(url, args.kill_every, faults, stop, rng), daemon=True)
        killer.start()
        end = time.monotonic() + args.minutes * 60
        if cluster is not None:
            node_faults(cluster, url, args.node_every, args.node_back, faults, end, args.node_every / 2)
        time.sleep(max(0.0, end - time.monotonic()))
        stop.set()
        killer.join(60)
        time.sleep(min(30.0, args.hang_s))  # the last fault's recovery
        clients.join(args.hang_s + 10)
        rss_after = server_rss(url)
        results = list(clients.results)
        recovery_times(faults, results)
        out = summary(results, faults, (rss_before, rss_after), args.minutes)
        try:
            out["server_faults"] = get_json(url, "/v1/stages").get("faults")
        except Exception:  # noqa: BLE001
            pass
    finally:
        if server is not None:
            server.stop()
        if cluster is not None:
            cluster.shutdown()
    print(f"chaos: {args.minutes:g} min, {args.clients} streaming clients, a stage SIGKILLed every "
          f"{args.kill_every:g} s" + (f", a node removed every {args.node_every:g} s (back after {args.node_back:g} s)"
                                      if args.nodes else ""))
    print(f"  requests {out['requests']}: {out['succeeded']} succeeded, {out['failed']} failed "
          f"({out['failed_openai_shaped']} OpenAI-shaped errors, {out['failed_bad']} hangs/resets/other)")
    print(f"  not in flight at a fault: {out['not_in_flight_succeeded']} of {out['not_in_flight']} succeeded "
          f"({100 * out['not_in_flight_success_rate']:.1f}%)")
    for f in faults:
        rec = "not recovered" if f.recovered_s is None else f"serving again after {f.recovered_s:.1f} s"
        print(f"  fault {f.kind:<11} {f.target:<26} {rec}" if f.kind != "node-add" else f"  {f.kind:<17} {f.target}")
    print(f"  server RSS {out['rss_before_mib']} MiB after warm-up, {out['rss_after_mib']} MiB at the end "
          f"({100 * (out['rss_growth'] or 0):+.1f}%)")
    if args.json:
        write_results(args.json, {"clients": args.clients, "kill_every": args.kill_every, "nodes": args.nodes,
                                  "summary": out, "faults": [asdict(f) for f in faults],
                                  "requests": [asdict(r) for r in results]})
    return 0 if out["failed_bad"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
