"""`ray up` for real: the shipped ray_configs/onprem-gpu.yaml (local provider) brings up a one-node
cluster on this machine over SSH, `moeray serve` runs on it through `ray exec` and answers, then
`ray down` takes it away.

This machine stands in for the head node: a throwaway sshd on a loopback port (a fresh host key,
a throwaway client key, reached through `auth.ssh_proxy_command`, since Ray's SSH runner has no
port option) lets `ray up` in as this user. The file's own commands then run as written: its
file_mounts copy the source tree and the model to /opt/moeray, its setup_commands pip-install
moeray from /opt/moeray/src (into a node venv that sees this checkout's packages, so nothing big is downloaded) and
check the model, its head_start_ray_commands start Ray. Only the addresses (head_ip, worker_ips,
ssh user, key, proxy) are substituted. Skips, saying why, without sshd / rsync / root.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"

PROXY = textwrap.dedent("""\
    import socket, sys, threading
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    def up():
        while True:
            b = sys.stdin.buffer.raw.read(65536)
            if not b:
                s.shutdown(socket.SHUT_WR)
                return
            s.sendall(b)
    threading.Thread(target=up, daemon=True).start()
    while True:
        b = s.recv(65536)
        if not b:
            break
        sys.stdout.buffer.write(b)
        sys.stdout.buffer.flush()
""")


def _needs() -> str | None:
    if not os.path.exists(SSHD):
        return "no sshd (apt-get install openssh-server; .ci/run installs it as root)"
    if not shutil.which("rsync"):
        return "no rsync (ray up copies file_mounts with it; .ci/run installs it as root)"
    if os.geteuid() != 0:
        return "not root: the file's setup writes /opt/moeray and sshd's session needs root"
    if os.path.exists("/opt/moeray"):
        return "/opt/moeray exists here (a real install?); not overwriting it"
    return None


def _run(args, timeout, env, cwd=None):
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    assert r.returncode == 0, f"{args[3:5]} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _ray(*args) -> list[str]:
    return [sys.executable, "-m", "ray.scripts.scripts", *args]


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.fixture
def node(tmp_path):
    """An sshd on 127.0.0.1:PORT whose sessions run as root with their own HOME (so the node's
    dotfiles, venv, Ray temp dir and token are the test's, not this machine's)."""
    why = _needs()
    if why:
        pytest.skip(why)
    from moeray.stages.runtime.transport import free_port

    home = Path(tempfile.mkdtemp(prefix="mru", dir="/tmp"))  # short: Ray's socket paths must stay < 108 chars
    key = tmp_path / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "hostkey")], check=True)
    (tmp_path / "authorized_keys").write_text((tmp_path / "key.pub").read_text())
    # The node's Python: a venv seeing this checkout's packages (offline: nothing to download), into
    # which the file's `pip install -e /opt/moeray/src` installs moeray as on a real node.
    venv = home / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    (site / "zz_moeray_ci.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    (venv / "bin" / "ray").write_text(f"#!{venv}/bin/python\nimport sys\nfrom ray.scripts.scripts import main\n"
                                      "sys.exit(main())\n")
    (venv / "bin" / "ray").chmod(0o755)
    rc = (f"export PATH={venv}/bin:$PATH PIP_DISABLE_PIP_VERSION_CHECK=1\n"
          f"export RAY_TMPDIR={home}/r RAY_DEDUP_LOGS=0\n")
    (home / ".bashrc").write_text(rc)
    (home / ".profile").write_text(". ~/.bashrc\n")
    wrap = tmp_path / "session.sh"
    wrap.write_text(f'#!/bin/bash\nexport HOME={home}\ncd "$HOME"\nexec /bin/bash -c "$SSH_ORIGINAL_COMMAND"\n')
    wrap.chmod(0o755)
    port = free_port()
    (tmp_path / "sshd_config").write_text(textwrap.dedent(f"""\
        ListenAddress 127.0.0.1
        Port {port}
        HostKey {tmp_path}/hostkey
        AuthorizedKeysFile {tmp_path}/authorized_keys
        PidFile {tmp_path}/sshd.pid
        PermitRootLogin prohibit-password
        PasswordAuthentication no
        KbdInteractiveAuthentication no
        UsePAM no
        StrictModes no
        ForceCommand {wrap}
        MaxSessions 50
        MaxStartups 50
        """))
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
    sshd = subprocess.Popen([SSHD, "-D", "-e", "-f", str(tmp_path / "sshd_config")],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "sshd.log", "w"))
    (tmp_path / "proxy.py").write_text(PROXY)
    try:
        yield {"home": home, "key": key, "port": port,
               "proxy": f"{sys.executable} {tmp_path / 'proxy.py'} {port}"}
    finally:
        sshd.terminate()
        sshd.wait(10)
        shutil.rmtree("/opt/moeray", ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


def test_ray_up_the_onprem_file_then_moeray_serve_answers_then_ray_down(node, tmp_path):
    from moeray.stages.runtime.transport import free_port

    sys.path.insert(0, str(REPO / "tests"))
    from tool_model import write_tool_model

    config = yaml.safe_load((REPO / "ray_configs" / "onprem-gpu.yaml").read_text())
    config["provider"].update(head_ip="127.0.0.1", worker_ips=[])
    config["auth"] = {"ssh_user": "root", "ssh_private_key": str(node["key"]),
                      "ssh_proxy_command": node["proxy"]}
    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text(yaml.safe_dump(config))
    # `ray up` runs from a checkout: its tracked files, and the model the file mounts (a tiny
    # GGUF here: the point is the cluster, not the model).
    checkout = tmp_path / "checkout"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        if (REPO / rel).is_file():
            (checkout / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, checkout / rel)
    write_tool_model(checkout / "model.gguf")
    (checkout / ".venv").mkdir()  # what a real checkout has, and no node should get
    (checkout / ".venv" / "torch-sized").write_text("x")
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    port = free_port()
    t0 = time.monotonic()
    serve = None
    try:
        _run(_ray("up", "-y", "--no-config-cache", str(cluster_file)), 300, env, cwd=checkout)
        assert Path("/opt/moeray/src/pyproject.toml").is_file() and Path("/opt/moeray/model.gguf").is_file()
        assert not Path("/opt/moeray/src/.venv").exists()  # rsync_filter: .gitignore
        t_up = time.monotonic() - t0
        serve = subprocess.Popen(
            _ray("exec", str(cluster_file),
                 f"moeray serve /opt/moeray/model.gguf --address auto --host 127.0.0.1 --port {port} --stages 1 "
                 f"--simulate-devices 256MiB --max-seqs 2 --max-len 128 & echo $! > ~/serve.pid; wait"),
            cwd=checkout, env=env, stdout=open(tmp_path / "serve.log", "w"), stderr=subprocess.STDOUT,
            start_new_session=True)
        deadline, models = time.monotonic() + 240, None
        while models is None:
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                    models = json.loads(r.read())
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(1)
        reply = _post(f"http://127.0.0.1:{port}/v1/completions",
                      {"model": models["data"][0]["id"], "prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert reply["object"] == "text_completion" and reply["usage"]["completion_tokens"] >= 1
        # The stage ran on the cluster `ray up` started (its node is this machine, Ray's head).
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/stages", timeout=30) as r:
            stages = json.loads(r.read())
        assert len(stages["stages"]) == 1 and stages["path"] == "/opt/moeray/model.gguf"
        print(f"ray up {t_up:.0f} s, serving after {time.monotonic() - t0:.0f} s")
        _run(_ray("exec", str(cluster_file), "kill $(cat ~/serve.pid)"), 60, env, cwd=checkout)
        serve.wait(90)
        assert "moeray serve: stopped" in (tmp_path / "serve.log").read_text()
    finally:
        if serve is not None and serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
        down = subprocess.run(_ray("down", "-y", str(cluster_file)), capture_output=True, text=True, timeout=120,
                              env=env, cwd=checkout)
    assert down.returncode == 0, down.stdout[-2000:] + down.stderr[-2000:]
    # Nothing of the cluster is left: Ray's GCS port of the file (6379) is free again.
    from moeray.cluster.commands.serve import _port_problem

    deadline = time.monotonic() + 30
    while _port_problem("", 6379) and time.monotonic() < deadline:
        time.sleep(1)
    assert _port_problem("", 6379) is None
