"""`moeray serve` at its edges, driven with the real command as a user would: a port already in
use fails fast in one line; Ctrl-C and `kill` stop Serve, the stages and Ray cleanly (exit 0,
no stack trace); every request body, however odd (random JSON, lone surrogates, control
characters), gets what it asks or an OpenAI-shaped 4xx naming the parameter, never a 5xx.

One server (one stage, a small context, so every generating request is short) for the request
tests, stopped with SIGTERM by the last test; a second start is stopped with Ctrl-C while it deploys.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("ray")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from moeray.cluster.commands.serve import _port_problem  # noqa: E402
from moeray.stages.runtime.transport import free_port  # noqa: E402

MODEL = "edge"
CONTEXT = 48
# What a crash looks like on stderr: a Python traceback, or the C++ signal handler's stack lines.
CRASH = re.compile(r"Traceback \(most recent call last\)|\*\*\* SIGTERM received|\*\*\* SIGABRT|PC: @|logging\.cc|Aborted")


def serve_command(port: int, metrics_port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "moeray.cluster.cli", "serve", "--stages", "1", "--simulate-devices", "1600MiB",
            "--max-seqs", "4", "--max-len", str(CONTEXT), "--model-name", MODEL, "--port", str(port),
            "--metrics-export-port", str(metrics_port), "--ready-timeout", "240", *extra]


def start(cmd: list[str], err_path: Path):
    """`moeray serve` in its own session (as a terminal runs it: Ray's processes share its group);
    its stdout lines collect in a list as they come."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_path.open("w"), text=True,
                            start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return proc, lines


def stopped_cleanly(proc, err_path: Path, since: int = 0, timeout_s: float = 120) -> str:
    """Waits for the exit; asserts exit 0, no stack trace on stderr from byte `since` on (the
    shutdown's part), and no process of its group left."""
    try:
        rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"moeray serve did not stop within {timeout_s:.0f} s") from None
    err = err_path.read_bytes()[since:].decode(errors="replace")
    assert rc == 0, err[-3000:]
    assert not CRASH.search(err), err[-3000:]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # Ray's own processes (raylet, GCS, workers) go with it
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        left = subprocess.run(["ps", "-o", "pid,cmd", "-g", str(proc.pid)], capture_output=True, text=True).stdout
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"processes of the server were left running:\n{left}")
    return err


# ---------------------------------------------------------------- ports and shutdown


@pytest.mark.parametrize("flag", ["--port", "--metrics-export-port"])
def test_a_port_in_use_is_one_line_and_exit_2_within_seconds(flag, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1" if flag == "--port" else "", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        port, metrics = (busy, free_port()) if flag == "--port" else (free_port(), busy)
        t = time.monotonic()
        r = subprocess.run(serve_command(port, metrics), capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip()
    assert err == (f"moeray serve: error: {flag} {busy}: port {busy} is already in use"
                   f"{' on 127.0.0.1' if flag == '--port' else ''}; stop what holds it or pass another {flag}")
    assert took < 30, f"{took:.1f} s"  # no Ray was started: seconds, not a node timing out after 240 s


def test_ctrl_c_while_it_deploys_stops_everything_with_exit_0(tmp_path):
    """Ctrl-C sends SIGINT to the terminal's whole process group: moeray serve and the Ray
    processes it started. It stops Serve and Ray in order; nothing crashes, nothing is left."""
    err_path = tmp_path / "stderr.txt"
    proc, _ = start(serve_command(free_port(), free_port()), err_path)
    deadline = time.monotonic() + 180
    while "deploying" not in err_path.read_text(errors="replace"):
        assert proc.poll() is None, err_path.read_text()
        assert time.monotonic() < deadline, "moeray serve did not start deploying in 180 s"
        time.sleep(0.5)
    time.sleep(3)  # the Serve controller and the replica are coming up
    os.killpg(proc.pid, signal.SIGINT)
    err = stopped_cleanly(proc, err_path)
    assert "moeray serve: SIGINT: shutting down" in err and err.rstrip().endswith("moeray serve: stopped")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    err_path = tmp_path_factory.mktemp("serve") / "stderr.txt"
    proc, lines = start(serve_command(port, 0), err_path)
    deadline = time.monotonic() + 300
    while not any(line.startswith("curl ") for line in lines):
        assert proc.poll() is None, f"moeray serve exited with {proc.returncode}: {err_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"moeray serve not up in 300 s: {lines}"
        time.sleep(0.5)
    yield {"url": f"http://127.0.0.1:{port}", "port": port, "proc": proc, "lines": lines, "err": err_path}
    if proc.poll() is None:  # the last test stops it; if that test did not run, stop it here
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def post(server, path: str, body: bytes, timeout: float = 120):
    """(status, content type, body bytes) of a raw POST."""
    conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=timeout)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, r.getheader("content-type", ""), data


def post_json(server, path: str, body: dict):
    status, _, data = post(server, path, json.dumps(body).encode())
    return status, json.loads(data)


def chat(content, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **kw}


def test_metrics_export_port_0_picks_a_free_port_and_says_which(server):
    line = next(ln for ln in server["lines"] if ln.startswith("Ray metrics (Prometheus): "))
    port = int(re.fullmatch(r"Ray metrics \(Prometheus\): http://127\.0\.0\.1:(\d+)/metrics\n", line).group(1))
    assert port != 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        assert r.status == 200
    server["metrics_port"] = port


# ---------------------------------------------------------------- requests


def test_lone_surrogates_and_control_characters_are_text_not_a_500(server):
    # "\ud800" is valid JSON (json.dumps writes it escaped, as the client did)
    status, data = post_json(server, "/v1/chat/completions", chat("Say \ud800 and \udfff\x00\x1b\u2028 ok"))
    assert status == 200, data
    assert isinstance(data["choices"][0]["message"]["content"], str) and data["usage"]["completion_tokens"] >= 1
    status, data = post_json(server, "/v1/completions", {"model": MODEL, "prompt": "\ud800x", "max_tokens": 1})
    assert status == 200, data
    # an error that quotes what was sent: the surrogate goes back escaped, as it came
    status, _, raw = post(server, "/v1/completions", json.dumps({"model": "\ud800", "prompt": "x"}).encode())
    assert status == 404 and b"\\ud800" in raw and json.loads(raw)["error"]["param"] == "model"


@pytest.mark.parametrize("path,extra,param,code", [
    ("/v1/chat/completions", {"frequency_penalty": 2.5}, "frequency_penalty", "invalid_value"),
    ("/v1/chat/completions", {"presence_penalty": -3}, "presence_penalty", "invalid_value"),
    ("/v1/chat/completions", {"logit_bias": {"50256": -100}}, "logit_bias", "invalid_value"),  # not in its vocabulary
    ("/v1/chat/completions", {"store": True}, "store", "unsupported_parameter"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities", "unsupported_parameter"),
    ("/v1/chat/completions", {"top_k": -5}, "top_k", "invalid_value"),
    ("/v1/chat/completions", {"min_k": 5}, "min_k", "unknown_parameter"),
    ("/v1/chat/completions", {"n": 5}, "n", "invalid_value"),  # more choices than the 4 sequences it runs
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ("/v1/chat/completions", {"seed": 1 << 64}, "seed", "invalid_value"),
    ("/v1/completions", {"echo": True}, "echo", "unsupported_parameter"),
    ("/v1/completions", {"best_of": 3}, "best_of", "unsupported_parameter"),
    ("/v1/completions", {"suffix": "end"}, "suffix", "unsupported_parameter"),
    ("/v1/completions", {"messages": []}, "messages", "unknown_parameter"),
])
def test_a_parameter_the_server_does_not_do_is_a_400_naming_it(server, path, extra, param, code):
    body = chat("hi", **extra) if path == "/v1/chat/completions" else {"model": MODEL, "prompt": "hi",
                                                                       "max_tokens": 2, **extra}
    status, data = post_json(server, path, body)
    assert status == 400, data
    err = data["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["code"] == code
    assert f"'{param}'" in err["message"] or err["message"].startswith(f"{param}")


def test_do_nothing_values_and_image_parts(server):
    # A client library may send a parameter at its default: that asks for nothing and is served.
    status, data = post_json(server, "/v1/chat/completions", chat(
        "hi", frequency_penalty=0, presence_penalty=0.0, logit_bias={}, store=False, n=1, parallel_tool_calls=True,
        user="u1", metadata={"k": "v"}, top_k=-1, min_p=0, repetition_penalty=1))
    assert status == 200, data
    status, data = post_json(server, "/v1/chat/completions", chat([{"type": "text", "text": "hi"},
                                                                   {"type": "image_url", "image_url": {"url": "x"}}]))
    assert status == 400 and data["error"]["param"] == "messages.0.content" and "image_url" in data["error"]["message"]


# Random bodies: JSON of any shape, and near-valid requests (most fields valid, so that many reach
# the engine) whose every field may still be odd.
_odd_text = st.one_of(
    st.text(alphabet=st.characters(exclude_categories=()), max_size=12),  # any code point: controls, surrogates
    st.sampled_from(["\ud800", "\udfff", "a\udc80b", "\x00", "\x1b[31m", "\u2028", "\ufeff", "<|im_end|>",
                     "<|im_start|>assistant\n", "{{ raise_exception('x') }}", "", " ", "\n" * 3]))
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _odd_text,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_odd_text, inner, max_size=3),
                     max_leaves=6)


def _mostly(valid, odd, n_valid: int = 4):
    """`valid` about n_valid times out of n_valid + 1 (one_of would treat its branches alike)."""
    return st.sampled_from([True] * n_valid + [False]).flatmap(lambda ok: valid if ok else odd)


_part = _mostly(st.fixed_dictionaries({"type": st.just("text"), "text": _odd_text}),
                st.dictionaries(st.sampled_from(["type", "text", "image_url"]), _json, max_size=2))
_message = st.fixed_dictionaries(
    {"role": _mostly(st.sampled_from(["user", "system", "assistant", "developer"]),
                     st.sampled_from(["tool", "function", "", "\ud800"])),
     "content": _mostly(_odd_text, st.one_of(st.lists(_part, max_size=2), st.none(), _json))},
    optional={"name": _odd_text})
_common = {  # parameter -> values, mostly valid
    "max_tokens": _mostly(st.sampled_from([1, 2]), st.sampled_from([0, -1, "2", 1.5, 1 << 70])),  # never long
    "temperature": _mostly(st.sampled_from([0, 0.7, 2]), st.one_of(st.sampled_from([2.5, -1, "hot"]), st.floats())),
    "top_p": _mostly(st.sampled_from([0.5, 1]), st.sampled_from([0, 1.5, None])),
    "seed": st.one_of(st.integers(), st.none()),
    "stop": st.one_of(_odd_text, st.lists(_odd_text, max_size=3), st.none()),
    "stream": _mostly(st.booleans(), st.just("yes")),
    "stream_options": st.one_of(st.none(), st.just({"include_usage": True}), _json),
    "n": st.sampled_from([1, 1, 2, 0]),
    "frequency_penalty": st.sampled_from([0, 0.5, 2.5]),
    "presence_penalty": _mostly(st.sampled_from([0, -1.5, 2]), st.one_of(st.floats(), st.just("1"))),
    "repetition_penalty": _mostly(st.sampled_from([1, 1.3, 0.5]), st.sampled_from([0, -1, 1e308, "2"])),
    "top_k": _mostly(st.sampled_from([-1, 0, 1, 40]), st.sampled_from([-2, 1.5, 1 << 70])),
    "min_p": _mostly(st.sampled_from([0, 0.05, 1]), st.sampled_from([-0.1, 1.5, None])),
    "logit_bias": st.one_of(st.just({}), st.just({"1": -100, "300": 5}), _json),
    "user": _odd_text,
}
_extra = st.dictionaries(_odd_text, _json, min_size=1, max_size=2)  # unknown parameters, any names


STATUSES: list[int] = []  # what the random bodies got


@st.composite
def request_bodies(draw):
    """(path, body bytes)."""
    kind = draw(st.sampled_from(["chat"] * 4 + ["completion"] * 4 + ["json", "bytes"]))
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    if kind == "bytes":
        return path, draw(st.binary(max_size=40))
    if kind == "json":
        return path, json.dumps(draw(_json)).encode()
    body = {"model": draw(_mostly(st.just(MODEL), st.sampled_from(["gpt-4o", "", "\ud800"]) | _odd_text, 6))}
    if kind == "chat":
        path = "/v1/chat/completions"
        body["messages"] = draw(_mostly(st.lists(_message, min_size=1, max_size=3), st.lists(_message, max_size=0)))
    else:
        path = "/v1/completions"
        body["prompt"] = draw(_mostly(_odd_text, st.one_of(st.lists(st.integers(-5, 60000), max_size=5),
                                                           st.lists(st.integers(), max_size=3), _json)))
    body["max_tokens"] = 1
    for name in draw(st.lists(st.sampled_from(sorted(_common)), max_size=3, unique=True)):
        body[name] = draw(_common[name])
    if draw(st.sampled_from([False] * 4 + [True])):  # False first: the example hypothesis favours
        body.update(draw(_extra))
    return path, json.dumps(body).encode()  # ensure_ascii: a lone surrogate travels as "\ud800"


def _check_response(status: int, ctype: str, data: bytes) -> None:
    assert status < 500, (status, data[:500])
    if status != 200:
        assert ctype.startswith("application/json"), (status, ctype, data[:300])
        err = json.loads(data)["error"]
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
        assert "param" in err and "code" in err
    elif ctype.startswith("text/event-stream"):
        events = [ln[len("data: "):] for ln in data.decode().split("\n\n") if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", data[-300:]
        for e in events[:-1]:
            assert "error" not in json.loads(e), e
    else:
        assert json.loads(data)["choices"], data[:300]


@settings(max_examples=150, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(case=request_bodies())
def test_random_bodies_never_get_a_5xx_or_a_non_json_error(server, case):
    path, body = case
    status, ctype, data = post(server, path, body)
    STATUSES.append(status)
    _check_response(status, ctype, data)


def test_the_server_still_serves_after_all_that(server):
    if len(STATUSES) >= 100:  # the random bodies ran: many of them were served, not only refused
        assert STATUSES.count(200) >= 20, sorted(STATUSES)
    status, data = post_json(server, "/v1/chat/completions", chat("What is the capital of France?", max_tokens=4))
    assert status == 200 and data["choices"][0]["message"]["content"]
    with urllib.request.urlopen(server["url"] + "/health", timeout=30) as r:
        assert json.loads(r.read())["status"] == "ok"


def test_the_stage_and_the_replica_compute_at_the_priority_serve_was_started_with(server):
    """Ray starts its workers 15 nice levels down; the model's processes (the stage actor, the
    Serve replica) must not get the smallest CPU share beside the HTTP clients and Ray's daemons."""
    import psutil

    serve = psutil.Process(server["proc"].pid)
    mine = serve.nice()
    workers = {}
    for p in serve.children(recursive=True):  # Ray's workers live in their own process groups
        try:
            cmd = p.cmdline()
            if cmd and cmd[0].startswith("ray::"):
                workers[cmd[0]] = p.nice()
        except psutil.Error:
            continue
    model = {name: ni for name, ni in workers.items() if "StageActor" in name or "ServeReplica" in name}
    assert any("StageActor" in n for n in model) and any("ServeReplica" in n for n in model), workers
    assert set(model.values()) == {mine}, (mine, workers)


def test_kill_stops_serve_the_stages_and_ray_with_exit_0(server):
    """`kill PID` (SIGTERM) of a running server: exit 0, no stack trace (Ray's C++ handler printed
    one and aborted), nothing of Ray left, and both ports free for the next start."""
    since = server["err"].stat().st_size
    server["proc"].send_signal(signal.SIGTERM)
    err = stopped_cleanly(server["proc"], server["err"], since)
    assert "moeray serve: SIGTERM: shutting down" in err and err.rstrip().endswith("moeray serve: stopped")
    assert _port_problem("127.0.0.1", server["port"]) is None
    if "metrics_port" in server:
        assert _port_problem("", server["metrics_port"]) is None
