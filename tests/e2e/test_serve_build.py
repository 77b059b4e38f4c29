"""Ray Serve's own deployment route: the shipped ray_configs/serve.yaml passes the schema `serve
deploy` checks, its builder takes `moeray serve`'s options, and `serve run` of that file (port and
args changed for this machine) serves the OpenAI API."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
pytest.importorskip("ray.serve")

from ray.serve.schema import ServeDeploySchema  # noqa: E402

from moeray.cluster.serve_build import argv_from  # noqa: E402
from moeray.errors import MoerayError  # noqa: E402

SERVE_YAML = Path(__file__).resolve().parents[2] / "ray_configs" / "serve.yaml"


def test_the_shipped_file_is_a_valid_serve_deploy_config_naming_the_builder():
    config = ServeDeploySchema.model_validate(yaml.safe_load(SERVE_YAML.read_text()))
    (app,) = config.applications
    assert app.import_path == "moeray.cluster.serve_build:build" and app.route_prefix == "/"
    from ray._common.utils import import_attr

    assert callable(import_attr(app.import_path))
    assert argv_from(app.args) == ["--stages", "4", "--max-seqs", "16"]


def test_builder_args_are_moeray_serves_flags_and_a_wrong_one_is_one_line():
    assert argv_from({"model": "/m.gguf", "stages": 2, "simulate-devices": "1MiB,2MiB", "spread": True,
                      "no_prefix_reuse": False, "api_key": "k"}) == \
        ["/m.gguf", "--stages", "2", "--simulate-devices", "1MiB,2MiB", "--spread", "--api-key", "k"]
    with pytest.raises(MoerayError, match="'port' is not an application option.*http_options.port"):
        argv_from({"port": 8001})
    with pytest.raises(MoerayError, match="unknown option 'stagez'"):
        argv_from({"stagez": 2})
    with pytest.raises(MoerayError, match="'spread' is a switch"):
        argv_from({"spread": "sometimes"})


def _get(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def test_serve_run_of_the_config_file_answers_a_chat_completion(tmp_path, default_model_path):
    from moeray.stages.runtime.transport import free_port

    port = free_port()
    config = yaml.safe_load(SERVE_YAML.read_text())
    config["http_options"]["port"] = port
    # This machine's size: two simulated stages (the shipped default is four), a short context.
    config["applications"][0]["args"].update(model=str(default_model_path), stages=2,
                                             simulate_devices="1600MiB,1600MiB", max_seqs=4, max_len=256)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    env = dict(os.environ, RAY_DEDUP_LOGS="0")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "ray.serve.scripts", "run", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    out: list[str] = []
    import threading

    threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 400
        while True:
            assert proc.poll() is None, f"serve run exited with {proc.returncode}: {''.join(out[-40:])}"
            assert time.monotonic() < deadline, f"not up in 400 s: {''.join(out[-40:])}"
            try:
                if _get(f"{url}/health", 5):
                    break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(1)
        body = {"model": _get(f"{url}/v1/models")["data"][0]["id"], "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}]}
        req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            reply = json.loads(r.read())
        assert reply["object"] == "chat.completion"
        assert "Paris" in reply["choices"][0]["message"]["content"]
        stages = _get(f"{url}/v1/stages")
        assert [s["stage"] for s in stages["stages"]] == [0, 1]  # two stage actors, as the file asked
        assert any("layer split" in line for line in stages["plan"])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: serve run shuts Serve and its local Ray down
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
