"""A huge prompt beside a small request, on llama-server and `moeray serve --local` in one sitting.

    python bench/huge_prompt.py --llama-server --mb 20

Each server (the same GGUF, the same context) is started, asked a small chat request alone (its
latency is the yardstick), then sent a chat request whose one message is `--mb` megabytes of
words, far over the context, and `--delay` seconds later the same small request. The table gives the huge
request's status and time to its answer, and the small request's latency beside it and alone.
`--python` runs `moeray serve` from another checkout's venv (e.g. main before a change).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from results import write_results  # noqa: E402

from moeray.environment import llama_cpp_tool  # noqa: E402

from serve_sweep import wait_ready  # noqa: E402

from moeray.stages.runtime.transport import free_port  # noqa: E402


def chat(url: str, content: str, max_tokens: int, timeout: float) -> tuple[int, float, str]:
    """(status, seconds, error message or "") of one chat request."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status, time.perf_counter() - t, ""
    except urllib.error.HTTPError as exc:
        return exc.code, time.perf_counter() - t, json.loads(exc.read()).get("error", {}).get("message", "")[:100]


def measure(label: str, cmd: list[str], url: str, args) -> dict:
    print(f"# {label}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_ready(proc, url, args.ready_timeout)
        chat(url, "Hi", 4, 120)  # warm
        alone = min(chat(url, "Hi", 4, 120)[1] for _ in range(3))
        huge = "word " * (args.mb * 200_000)
        out = {}
        big = threading.Thread(target=lambda: out.update(big=chat(url, huge, 4, 600)))
        big.start()
        time.sleep(args.delay)
        out["small"] = chat(url, "Hi", 4, 600)
        big.join(600)
        (status, big_s, message), (small_status, small_s, _) = out["big"], out["small"]
        row = dict(label=label, big_status=status, big_s=big_s, message=message, small_status=small_status,
                   small_s=small_s, alone_s=alone, load=os.getloadavg()[0])
        print(f"#   {row}", file=sys.stderr, flush=True)
        return row
    finally:
        proc.terminate()
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded default model)")
    p.add_argument("--llama-server", metavar="PATH", nargs="?", const="",
                   help="llama-server beside moeray: PATH, or alone for the one in LLAMA_CPP_BIN's folder or on PATH")
    p.add_argument("--python", default=sys.executable, help="the Python whose moeray serves (default: this one)")
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--mb", type=int, default=20, help="megabytes of the huge message")
    p.add_argument("--delay", type=float, default=1.0, help="seconds between the huge request and the small one")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = p.parse_args(argv)
    if args.llama_server == "":
        args.llama_server = llama_cpp_tool("llama-server")
        if args.llama_server is None:
            p.error("--llama-server: none in LLAMA_CPP_BIN's folder or on PATH; set LLAMA_CPP_BIN to the folder "
                    "of llama.cpp's tools or give its path")
    if args.model is None:
        from moeray.stages.gguf.default_model import default_model_path

        args.model = str(default_model_path(quiet=True))
    rows = []
    if args.llama_server:
        port = free_port()
        rows.append(measure("llama-server", [args.llama_server, "-m", args.model, "-c", str(args.ctx), "-np", "1",
                                             "--port", str(port), "-a", "m"], f"http://127.0.0.1:{port}", args))
    port = free_port()
    rows.append(measure("moeray serve --local", [args.python, "-m", "moeray.cluster.cli", "serve", args.model,
                                                 "--local", "--no-metrics", "--max-len", str(args.ctx),
                                                 "--model-name", "m", "--port", str(port)],
                        f"http://127.0.0.1:{port}", args))
    print(f"| server | {args.mb} MB prompt: status | its answer after | small request beside it | small alone | load |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['big_status']} | {r['big_s']:.2f} s | {r['small_s']:.2f} s | {r['alone_s']:.2f} s "
              f"| {r['load']:.1f} |")
    if args.json:
        write_results(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
