"""HTTP load on several servers in one sitting: llama-server beside `moeray serve` variants.

    python bench/serve_sweep.py --llama-server --clients 16 1 \\
        --variant "1 thread=MOERAY_THREADS=1" --variant "2 threads, no spin=MOERAY_THREADS=2 MOERAY_GGML_POLL=0"

Each server is started, driven by bench/load.py's streaming clients for every client count
(`--duration` seconds each, after a short warm-up), and stopped before the next starts, so only
one model is in memory at a time (memory compacted before each start). A variant is
`LABEL=ENV...[ -- SERVE FLAGS]`: environment settings for `moeray serve --local` and optional extra
flags (with `--stages N` among them, the pipeline of stage actors instead of --local). The table
gives out tok/s, TTFT and ITL, errors, the ratio to llama-server at the same client count, and the
CPU cores the server's processes used over the run (their CPU time / wall time: the replica and everything Ray starts),
with the machine's load average at the start of each row. `--llama-server` alone finds llama.cpp's
server in the folder LLAMA_CPP_BIN names, else on PATH; `--llama-server PATH` runs that binary.
"""
from __future__ import annotations

import argparse
import http.client
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from load import Client, model_id, percentile, system_prompt  # noqa: E402

from results import compact_memory, write_results  # noqa: E402

from moeray.environment import llama_cpp_tool  # noqa: E402
from moeray.stages.runtime.transport import free_port  # noqa: E402


def log_tail(log, lines: int = 15) -> str:
    """The last lines a server wrote (its error, when it dies before it is ready)."""
    if log is None:
        return ""
    log.flush()
    log.seek(0)
    return "".join(log.read().decode(errors="replace").splitlines(keepends=True)[-lines:])


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float, log=None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before it was ready; its last lines:\n"
                             f"{log_tail(log)}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(1.0)
    proc.kill()
    raise SystemExit(f"server not ready in {timeout_s:.0f} s; its last lines:\n{log_tail(log)}")


def cpu_seconds(root: int) -> dict[int, float]:
    """CPU seconds (user + system) of `root` and every process under it, by pid."""
    out = {}
    try:
        procs = [psutil.Process(root)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return out


def drive(url: str, clients: int, seconds: float, max_tokens: int, system: str = "",
          forced_tokens: bool = False) -> dict:
    """bench/load.py's clients for `seconds` (`system`: the system prompt before every question;
    `forced_tokens`: load.py's --forced-tokens): its figures for the window."""
    u = urlparse(url)
    args = argparse.Namespace(max_tokens=max_tokens, temperature=0.0, api_key=None, timeout=300.0, system=system,
                              forced_tokens=forced_tokens)
    model = model_id(u, None, 30.0)
    stop_at = time.monotonic() + seconds
    cs = [Client(i, u, model, args, stop_at) for i in range(clients)]
    t0 = time.perf_counter()
    for c in cs:
        c.start()
    for c in cs:
        c.join(seconds + args.timeout + 10)
    wall = time.perf_counter() - t0
    ttft = [x for c in cs for x in c.ttft]
    itl = [x for c in cs for x in c.itl]
    return {"wall": wall, "requests": sum(c.requests for c in cs), "tokens": sum(c.tokens for c in cs),
            "tok_s": sum(c.tokens for c in cs) / wall, "ttft_p50": percentile(ttft, 0.5),
            "ttft_p99": percentile(ttft, 0.99), "prompt_tokens": sum(c.prompt_tokens for c in cs),
            "cached_tokens": sum(c.cached_tokens for c in cs), "itl_p50": percentile(itl, 0.5), "itl_p99": percentile(itl, 0.99),
            "errors": [e for c in cs for e in c.errors]}


def run_server(label: str, cmd: list[str], env: dict, url: str, args) -> list[dict]:
    print(f"# {label}: {' '.join(shlex.quote(c) for c in cmd)}", file=sys.stderr, flush=True)
    log = tempfile.TemporaryFile()  # the server's output, shown if it fails to come up
    compact_memory()  # the previous server's gigabytes were just freed
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    rows = []
    try:
        wait_ready(proc, url, args.ready_timeout, log)
        drive(url, max(args.clients), args.warmup, args.max_tokens, args.system, args.forced_tokens)  # graphs built, caches warm
        for n in args.clients:
            load = os.getloadavg()[0]
            before = cpu_seconds(proc.pid)
            r = drive(url, n, args.duration, args.max_tokens, args.system, args.forced_tokens)
            after = cpu_seconds(proc.pid)
            used = {pid: after[pid] - before.get(pid, 0.0) for pid in after}
            r.update(label=label, clients=n, load=load, cores=sum(used.values()) / r["wall"],
                     top_cores=max(used.values(), default=0.0) / r["wall"])
            rows.append(r)
            print(f"#   {n} clients: {r['tok_s']:.1f} tok/s, ITL {r['itl_p50'] * 1e3:.0f} ms, "
                  f"{len(r['errors'])} errors, {r['cores']:.2f} cores", file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
    return rows


def parse_variant(text: str) -> tuple[str, dict, list[str]]:
    label, _, rest = text.partition("=")
    settings, _, flags = rest.partition(" -- ")
    env = dict(kv.split("=", 1) for kv in settings.split())
    return label.strip(), env, shlex.split(flags)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded default model)")
    p.add_argument("--llama-server", metavar="PATH", nargs="?", const="",
                   help="llama-server to run first (same model): PATH, or alone for LLAMA_CPP_BIN's or PATH's")
    p.add_argument("--llama-threads", type=int, nargs="+", default=[2],
                   help="llama-server's -t, one run each (the first is the yardstick of the ratios)")
    p.add_argument("--ctx", type=int, default=8192, help="llama-server's context (all slots together)")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=ENV... [-- FLAGS]")
    p.add_argument("--clients", type=int, nargs="+", default=[16, 1])
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--system-prompt-tokens", type=int, default=0,
                   help="the same system prompt of about this many tokens before every question (bench/load.py's)")
    p.add_argument("--forced-tokens", action="store_true",
                   help="every server computes the same token streams (bench/load.py --forced-tokens): for "
                        "random-weight shape files, whose free-running greedy text differs between engines")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every server this many times, in turn (A B A B: drifting load hits all alike)")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--json", metavar="PATH", help="also write every row (server, clients, figures) as JSON")
    args = p.parse_args(argv)
    args.system = system_prompt(args.system_prompt_tokens) if args.system_prompt_tokens > 0 else ""
    if args.model is None:
        from moeray.stages.gguf.default_model import FILE_NAME, cache_dir

        args.model = str(cache_dir() / FILE_NAME)

    if args.llama_server == "":
        args.llama_server = llama_cpp_tool("llama-server")
        if args.llama_server is None:
            p.error("--llama-server: no llama-server in LLAMA_CPP_BIN's folder or on PATH; set LLAMA_CPP_BIN "
                    "to the folder of llama.cpp's tools or give its path")
    servers = []  # (label, command with "{port}" and "{metrics}", env)
    for t in args.llama_threads if args.llama_server else []:
        cmd = [args.llama_server, "-m", args.model, "-np", str(max(args.clients)), "-c", str(args.ctx),
               "-t", str(t), "--host", "127.0.0.1", "--port", "{port}"]
        env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
        servers.append((f"llama-server -np {max(args.clients)} -t {t}", cmd, env))
    for text in args.variant or ["moeray serve --local="]:
        label, settings, flags = parse_variant(text)
        local = [] if "--stages" in flags else ["--local"]  # --stages N: the pipeline of stage actors
        cmd = [sys.executable, "-m", "moeray.cluster.cli", "serve", *local, args.model, "--port", "{port}",
               "--metrics-export-port", "{metrics}", *flags]
        servers.append((label, cmd, {**os.environ, **settings}))
    rows = []
    for _ in range(args.repeat):
        for label, cmd, env in servers:
            # Ports picked just before each start: one picked minutes earlier may be taken by then.
            port, metrics = free_port(), free_port()
            cmd = [c.replace("{port}", str(port)).replace("{metrics}", str(metrics)) for c in cmd]
            rows += run_server(label, cmd, env, f"http://127.0.0.1:{port}", args)
    rows.sort(key=lambda r: [s[0] for s in servers].index(r["label"]))  # each server's runs together

    base = {}  # the first llama-server's best run per client count: the yardstick
    for r in rows:
        if r["label"] == (servers[0][0] if args.llama_server else None) and \
                r["tok_s"] > base.get(r["clients"], {}).get("tok_s", 0):
            base[r["clients"]] = r
    print(f"max_tokens {args.max_tokens}, {args.duration:.0f} s per row, {Path(args.model).name}")
    print("| server | clients | out tok/s | TTFT p50 | ITL p50 | ITL p99 | errors | vs llama-server | cores | load |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = base.get(r["clients"])
        ratio = f"{r['tok_s'] / b['tok_s']:.2f}×" if b and b is not r else ""
        print(f"| {r['label']} | {r['clients']} | {r['tok_s']:.1f} | {r['ttft_p50'] * 1e3:.0f} ms | "
              f"{r['itl_p50'] * 1e3:.0f} ms | {r['itl_p99'] * 1e3:.0f} ms | {len(r['errors'])} | {ratio} | "
              f"{r['cores']:.2f} ({r['top_cores']:.2f}) | {r['load']:.1f} |")
    if args.json:
        write_results(args.json, {"model": args.model, "max_tokens": args.max_tokens, "duration": args.duration,
                                  "system_prompt_tokens": args.system_prompt_tokens,
                                  "forced_tokens": args.forced_tokens, "rows": rows})
    for r in rows:
        for e in r["errors"][:3]:
            print(f"  {r['label']}: {e}", file=sys.stderr)
    return 0 if not any(r["errors"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
