"""One streamed client, where its time goes: `moeray serve --local` and on Ray stages beside llama-server.

    python bench/stream_timeline.py --llama-server [PATH] [--model X.gguf | --shape qwen3-30b-a3b] \\
        [--servers llama,local,stages] [--requests 8] [--max-tokens 120] [--repeat 1] [--json out.json]

One client sends streamed greedy chat completions one at a time (`--requests` of them after
`--warmup`; `--sample T,TOP_P,TOP_K,MIN_P`: sampled ones, seed 1, the four fields sent to every
server alike), every request the same length: the model's end tokens are banned with logit_bias
(-100) on every server, so each answer is exactly `--max-tokens` tokens. Per server: tok/s over
the whole request (its tokens over send-to-[DONE]), TTFT and inter-token latency (p50 / p99), as
the client sees them, and the ratio to llama-server.

For moeray (GET /v1/stages/timeline: timestamps the server took on each request, on the same
clock as this client's: cluster/timeline.py) the request's time is split:
  TTFT: client to server (connect, send), HTTP and validation, template render and tokenising,
        checks and sampling parameters, the engine thread's inbox, admission, prefill and first
        sample, postprocess, the hand-off to the event loop, the stream, the first SSE write,
        server to client (Ray Serve's proxy on Ray stages)
  each later token: the step (the pipeline's, as the engine waits for it) and its sampling, the
        engine thread between steps, postprocess (detokenising, stop strings), the hand-off,
        the stream, the SSE write, and server to client
beside the engine's own step time: `--engine-alone` also runs the same request in-process (the
engine over the model as `serve --local` loads it, no server), its tok/s and step p50. On Ray
stages the pipeline's per-hop times come from GET /v1/stages (`pipeline`).

`--servers`: llama (needs --llama-server), local (`moeray serve --local`), stages (`moeray serve
--stages 4`: Ray Serve and 4 simulated stages, each on its share of the cores). Extra flags per
moeray server: --local-flags, --stages-flags. `--server "LABEL=COMMAND"` adds any other server
(e.g. another checkout's moeray, for a before / after in one sitting): COMMAND with {model}, {port}
and {metrics} in it; its timeline is read when it serves one. Each server is started, measured and
stopped before the next (one model in memory at a time); --repeat alternates them (A B A B).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from results import write_results  # noqa: E402
from serve_sweep import cpu_seconds, wait_ready  # noqa: E402

from moeray.environment import llama_cpp_tool  # noqa: E402

from moeray.stages.runtime.transport import free_port  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def med(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# The request's sampling fields, the same to every server: greedy, or --sample's.
SAMPLING: dict = {"temperature": 0.0}


def sampling_fields(spec: str | None) -> dict:
    """--sample T,TOP_P,TOP_K,MIN_P -> the request's fields (each server gets all four, so
    llama-server's own defaults, top_k 40 and min_p 0.05, do not cut where moeray does not)."""
    if not spec:
        return {"temperature": 0.0}
    t, top_p, top_k, min_p = (float(x) for x in spec.split(","))
    return {"temperature": t, "top_p": top_p, "top_k": int(top_k), "min_p": min_p, "seed": 1}


def ask(port: int, model: str, max_tokens: int, ban: dict, timeout_s: float = 600.0) -> dict:
    """One streamed chat completion (greedy unless --sample): perf_counter_ns when it was sent,
    when each chunk with text arrived, its id, and the completion tokens its usage gives."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
                       **SAMPLING, "logit_bias": ban, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    t0 = time.perf_counter_ns()
    arrivals, text, usage, cid = [], [], None, None
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300].decode(errors='replace')}")
        for line in r:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter_ns()
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message", "error in stream"))
            cid = cid or chunk.get("id")
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                arrivals.append(now)
                text.extend(c["delta"]["content"] for c in chunk["choices"] if (c.get("delta") or {}).get("content"))
        done = time.perf_counter_ns()
    finally:
        conn.close()
    tokens = int(usage["completion_tokens"]) if usage else len(arrivals)
    return {"id": cid, "sent": t0, "arrivals": arrivals, "done": done, "tokens": tokens, "text": "".join(text)}


def get_json(port: int, path: str) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60) as r:
            return json.loads(r.read())
    except (OSError, ValueError, http.client.HTTPException):
        return None


def client_figures(rs: list[dict]) -> dict:
    itl = [(b - a) / 1e6 for r in rs for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    ttft = [(r["arrivals"][0] - r["sent"]) / 1e6 for r in rs if r["arrivals"]]
    tokens = sum(r["tokens"] for r in rs)
    seconds = sum(r["done"] - r["sent"] for r in rs) / 1e9
    return {"requests": len(rs), "tokens": tokens, "tok_s": tokens / seconds if seconds else 0.0,
            "ttft_p50_ms": percentile(ttft, 0.5), "itl_p50_ms": percentile(itl, 0.5),
            "itl_p99_ms": percentile(itl, 0.99)}


# TTFT parts, in order: (name, from mark, to mark); "sent"/"arrived" are the client's
TTFT_PARTS = [("client to server", "sent", "http"), ("HTTP and validation", "http", "parsed"),
              ("render and tokenise", "parsed", "rendered"), ("checks and params", "rendered", "prepared"),
              ("submit", "prepared", "submitted"), ("engine inbox", "submitted", "taken"),
              ("admission", "taken", "admitted"), ("to the first step", "admitted", "scheduled"),
              ("prefill and first sample", "scheduled", "first_result"),
              ("postprocess and hand-off", "first_result", "first_handed"),
              ("to the event loop", "first_handed", "first_queued"), ("stream", "first_queued", "first_taken"),
              ("first SSE write", "first_taken", "first_written"), ("server to client", "first_written", "arrived")]
TOKEN_PARTS = ["step", "of which sampling", "engine between steps", "postprocess", "of which detokenise",
               "of which stop strings", "to the event loop", "stream", "SSE write", "server to client", "interval"]


def server_split(r: dict, t: dict) -> tuple[dict, dict]:
    """One request's TTFT parts (ms) and its later tokens' parts (lists of ms), from the client's
    record `r` and the server's timeline `t` (same clock)."""
    m = dict(t["marks"], sent=r["sent"])
    if t["step_end"]:
        m.update(first_result=t["step_end"][0], first_handed=t["handed"][0])
    for name, key in (("first_queued", "queued"), ("first_taken", "taken"), ("first_written", "written")):
        if t[key]:
            m[name] = t[key][0]
    if r["arrivals"]:
        m["arrived"] = r["arrivals"][0]
    ttft = {name: (m[b] - m[a]) / 1e6 for name, a, b in TTFT_PARTS if a in m and b in m}
    parts: dict[str, list] = {k: [] for k in TOKEN_PARTS}
    # The deliveries that released text are the client's chunks (a plain chat reply): in order.
    with_text = [i for i, n in enumerate(t["chars"]) if n]
    arrival = dict(zip(with_text, r["arrivals"])) if len(r["arrivals"]) == len(with_text) else {}
    for i in range(1, len(t["handed"])):
        ms = lambda ns: ns / 1e6  # noqa: E731
        parts["step"].append(ms(t["step_end"][i] - t["step_start"][i]))
        parts["of which sampling"].append(ms(t["sample_ns"][i]))
        parts["engine between steps"].append(ms(t["step_start"][i] - t["step_end"][i - 1]))
        parts["postprocess"].append(ms(t["post_ns"][i]))
        parts["of which detokenise"].append(ms(t["detok_ns"][i]))
        parts["of which stop strings"].append(ms(t["stop_ns"][i]))
        if i < len(t["queued"]):
            parts["to the event loop"].append(ms(t["queued"][i] - t["handed"][i]))
        if i < len(t["taken"]) and i < len(t["queued"]):
            parts["stream"].append(ms(t["taken"][i] - t["queued"][i]))
        if i < len(t["written"]) and i < len(t["taken"]):
            parts["SSE write"].append(ms(t["written"][i] - t["taken"][i]))
        if i in arrival and i < len(t["written"]):
            parts["server to client"].append(ms(arrival[i] - t["written"][i]))
        parts["interval"].append(ms(t["handed"][i] - t["handed"][i - 1]))
    return ttft, parts


def measure(label: str, port: int, args, ban: dict, moeray: bool) -> dict:
    model = get_json(port, "/v1/models")["data"][0]["id"]
    for _ in range(args.warmup):
        ask(port, model, args.max_tokens, ban)
    rs = [ask(port, model, args.max_tokens, ban) for _ in range(args.requests)]
    row = {"label": label, **client_figures(rs), "text": rs[-1]["text"]}
    if moeray is None:
        moeray = get_json(port, "/v1/stages/timeline?last=1") is not None
    if not moeray:
        return row
    tls = {t["id"]: t for t in (get_json(port, f"/v1/stages/timeline?last={min(64, args.requests)}") or {})
           .get("requests", [])}
    ttft: dict[str, list] = {}
    tok: dict[str, list] = {}
    for r in rs:
        t = tls.get(r["id"])
        if t is None:
            continue
        a, b = server_split(r, t)
        for k, v in a.items():
            ttft.setdefault(k, []).append(v)
        for k, v in b.items():
            tok.setdefault(k, []).extend(v)
    row["ttft_parts_ms"] = {name: med(ttft.get(name, [])) for name, _, _ in TTFT_PARTS}
    row["token_parts_ms"] = {k: med(tok.get(k, [])) for k in TOKEN_PARTS}
    row["token_parts_mean_ms"] = {k: sum(v) / len(v) for k in TOKEN_PARTS if (v := tok.get(k))}
    row["steps_ms"] = [round(x, 2) for x in tok.get("step", [])]  # every later token's step, request by request
    stages = get_json(port, "/v1/stages") or {}
    row["pipeline"] = stages.get("pipeline")
    return row


def cpu_by_name(before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """CPU seconds between two cpu_seconds() snapshots, by process name (Ray names its workers by
    the actor they run: ray::StageActor, ray::ServeReplica:...; stage actors numbered in pid order)."""
    import psutil

    out: dict[str, float] = {}
    stage = 0
    for pid in sorted(after):
        try:
            p = psutil.Process(pid)
            name, title = p.name(), " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "StageActor" in title:
            name, stage = f"ray::StageActor {stage}", stage + 1
        elif "ServeReplica" in title:
            name = "ray::ServeReplica"
        elif "ServeController" in title or "ProxyActor" in title:
            name = "ray::" + ("ServeController" if "ServeController" in title else "ProxyActor")
        out[name] = out.get(name, 0.0) + after[pid] - before.get(pid, 0.0)
    return out


def start_py_spy(root: int, label: str, args) -> list[subprocess.Popen]:
    """py-spy (sampling, --nonblocking) on the server's engine process (Ray Serve's replica, or the
    `--local` server itself) and stage 0's actor for the first `--py-spy-seconds` of the measured
    requests: collapsed stacks in --py-spy DIR, one file per process."""
    import psutil

    out = Path(args.py_spy)
    out.mkdir(parents=True, exist_ok=True)
    targets = {"server": root}
    for p in psutil.Process(root).children(recursive=True):
        try:
            title = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "ServeReplica" in title:
            targets["replica"] = p.pid
        elif "StageActor" in title and "stage0" not in targets:
            targets["stage0"] = p.pid
    if "replica" in targets:
        del targets["server"]
    tag = "".join(c if c.isalnum() else "-" for c in label)[:40]
    spy = str(Path(sys.executable).with_name("py-spy"))
    return [subprocess.Popen([spy, "record", "--nonblocking", "-r", "100", "-d", str(args.py_spy_seconds),
                              "-p", str(pid), "-f", "raw", "-o", str(out / f"{tag}-{name}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for name, pid in targets.items()]


def run_server(label: str, cmd: list[str], env: dict, args, ban: dict, moeray: bool) -> dict:
    port, metrics = free_port(), free_port()
    cmd = [c.replace("{port}", str(port)).replace("{metrics}", str(metrics)) for c in cmd]
    print(f"# {label}: {' '.join(shlex.quote(c) for c in cmd)}", file=sys.stderr, flush=True)
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}", args.ready_timeout, log)
        spies = start_py_spy(proc.pid, label, args) if args.py_spy else []
        before = cpu_seconds(proc.pid)
        t0 = time.perf_counter()
        row = measure(label, port, args, ban, moeray)
        after = cpu_seconds(proc.pid)
        for spy in spies:
            spy.wait()
        row["cores"] = sum(after[p] - before.get(p, 0.0) for p in after) / (time.perf_counter() - t0)
        # CPU a streamed token costs each kind of process (the server, Ray Serve's replica: the engine
        # and the driver's calls, each stage actor), over the warm-up and measured requests
        tokens = (args.warmup + args.requests) * args.max_tokens
        row["cpu_ms_per_token"] = {name: round(1e3 * secs / tokens, 3)
                                   for name, secs in cpu_by_name(before, after).items() if secs > 0}
        print(f"#   {row['tok_s']:.1f} tok/s, TTFT {row['ttft_p50_ms']:.0f} ms, ITL p50 {row['itl_p50_ms']:.1f} ms",
              file=sys.stderr, flush=True)
        return row
    finally:
        proc.terminate()
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def engine_alone(args, ban: dict) -> dict:
    """The same request in this process, no server: the engine over the model as `serve --local`
    loads it (its thread settings and device budget): tok/s over the request and step p50."""
    import dataclasses

    from moeray.cluster.config import EngineConfig, ServeOptions
    from moeray.cluster.engine import Engine
    from moeray.cluster.local_pipeline import LocalPipeline
    from moeray.cluster.service import local_stage_options
    from moeray.stages.gguf.reader import read_gguf_header
    from moeray.stages.kernels import settings
    from moeray.stages.kernels.backend import ggml_available
    from moeray.stages.kernels.threads import ggml_threads
    from moeray.stages.runtime.default_profile import resolve_profile
    from moeray.stages.text.sampling import SamplingParams
    from moeray.stages.text.tokenizer import Tokenizer

    header = read_gguf_header(args.model)
    stage = local_stage_options(settings.current(), header.token_bytes())
    settings.use(stage)
    if ggml_available():
        ggml_threads()
    opts = ServeOptions()
    pipe = LocalPipeline.from_file(args.model, 256, opts.local_budget, resolve_profile(None, args.model), "static",
                                   1, stage)
    tok = Tokenizer.from_metadata(header.metadata, source=args.model)
    eng = Engine(pipe, dataclasses.replace(EngineConfig(), max_seqs=1, micro_batches=1, max_len=4096, kv_blocks=256),
                 tok)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
    fields = {k: v for k, v in sampling_fields(args.sample).items() if k != "top_k" or v > 0}
    params = SamplingParams(max_tokens=args.max_tokens, logit_bias={int(k): v for k, v in ban.items()}, **fields)
    walls, steps = [], []
    for i in range(args.warmup + args.requests):
        t0 = time.perf_counter()
        req = eng.add(prompt, params)
        while not req.done:
            eng.step()
            if i >= args.warmup and req.t_first is not None:
                steps.append((eng.last_step.end - eng.last_step.start) / 1e6)
        if i >= args.warmup:
            walls.append((time.perf_counter() - t0, len(req.output)))
    return {"label": "engine alone (in process)", "tok_s": sum(n for _, n in walls) / sum(w for w, _ in walls),
            "step_p50_ms": percentile(steps[1:], 0.5)}


def fmt(x, spec=".2f") -> str:
    return "" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF file (default: the embedded default model)")
    p.add_argument("--shape", help="a real model's shape with random blocks (bench/shapes.py), e.g. qwen3-30b-a3b")
    p.add_argument("--llama-server", metavar="PATH", nargs="?", const="",
                   help="llama-server binary (the yardstick): PATH, or alone for LLAMA_CPP_BIN's or PATH's")
    p.add_argument("--servers", default="llama,local,stages", help="which servers, in order: llama,local,stages")
    p.add_argument("--threads", type=int, default=2, help="llama-server's -t (moeray --local takes every core)")
    p.add_argument("--local-flags", default="", help="more flags for `moeray serve --local`")
    p.add_argument("--stages-flags", default="--stages 4", help="flags for `moeray serve` on Ray stages")
    p.add_argument("--server", action="append", default=[], metavar="LABEL=COMMAND",
                   help="another server, after --servers: a command with {model}, {port}, {metrics}")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--repeat", type=int, default=1, help="run every server this many times, in turn")
    p.add_argument("--engine-alone", action="store_true", help="also the same request in process, no server")
    p.add_argument("--sample", metavar="T,TOP_P,TOP_K,MIN_P",
                   help="sampled answers (seed 1) with these fields on every server, e.g. 0.8,0.95,40,0.05; default greedy")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--json", metavar="PATH", help="also write every row as JSON")
    p.add_argument("--py-spy", metavar="DIR", help="py-spy the engine's process and stage 0 while measuring")
    p.add_argument("--py-spy-seconds", type=int, default=20)
    args = p.parse_args(argv)
    if args.shape:
        from shapes import write_shape

        args.model = str(write_shape(args.shape))
    if args.model is None:
        from moeray.stages.gguf.default_model import default_model_path

        args.model = str(default_model_path())
    from moeray.stages.text.tokenizer import Tokenizer

    ban = {str(i): -100 for i in sorted(Tokenizer.from_gguf(args.model).end_ids)}  # every answer max_tokens long
    SAMPLING.clear()
    SAMPLING.update(sampling_fields(args.sample))

    servers = []  # (label, command, env, moeray?)
    wanted = [s.strip() for s in args.servers.split(",") if s.strip()]
    for name in wanted:
        if name == "llama":
            if args.llama_server == "":
                args.llama_server = llama_cpp_tool("llama-server")
            if not args.llama_server:
                raise SystemExit("--servers llama needs --llama-server [PATH]: no llama-server in LLAMA_CPP_BIN's "
                                 "folder or on PATH; set LLAMA_CPP_BIN to the folder of llama.cpp's tools or give its path")
            cmd = [args.llama_server, "-m", args.model, "-np", "1", "-c", "8192", "-t", str(args.threads),
                   "--host", "127.0.0.1", "--port", "{port}"]
            env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
            servers.append((f"llama-server -t {args.threads}", cmd, env, False))
        elif name in ("local", "stages"):
            flags = ["--local", *shlex.split(args.local_flags)] if name == "local" else shlex.split(args.stages_flags)
            cmd = [sys.executable, "-m", "moeray.cluster.cli", "serve", args.model, "--port", "{port}",
                   "--metrics-export-port", "{metrics}", *flags]
            servers.append(("moeray serve " + " ".join(flags), cmd, dict(os.environ), True))
        else:
            raise SystemExit(f"--servers: {name} is not one of llama, local, stages")
    for text in args.server:
        label, _, command = text.partition("=")
        cmd = [c.replace("{model}", args.model) for c in shlex.split(command)]
        servers.append((label.strip(), cmd, dict(os.environ), None))  # None: moeray if it keeps timelines
    rows = []
    if args.engine_alone:  # first, and in a child: its model is gone before the servers load theirs
        out = subprocess.run([sys.executable, __file__, "--_engine-only", "--model", args.model, "--requests",
                              str(args.requests), "--warmup", str(args.warmup), "--max-tokens", str(args.max_tokens)]
                             + (["--sample", args.sample] if args.sample else []), capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"engine alone failed:\n{out.stderr[-2000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    for _ in range(args.repeat):
        for label, cmd, env, moeray in servers:
            rows.append(run_server(label, cmd, env, args, ban, moeray))

    base = next((r for r in rows if r["label"].startswith("llama-server")), None)
    kind = f"sampled ({args.sample})" if args.sample else "greedy"
    print(f"one client, streamed {kind} chat, {args.max_tokens} tokens a request, {args.requests} requests "
          f"after {args.warmup}, {Path(args.model).name}")
    print("| server | tok/s (whole request) | TTFT p50 | ITL p50 | ITL p99 | vs llama-server tok/s | ITL p50 vs llama-server | cores |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "step_p50_ms" in r:
            print(f"| {r['label']} | {r['tok_s']:.1f} | | step {r['step_p50_ms']:.2f} ms | | "
                  f"{fmt(r['tok_s'] / base['tok_s'] if base else None)} | | |")
            continue
        ratio = fmt(r["tok_s"] / base["tok_s"]) + "×" if base and r is not base else ""
        itl = fmt(r["itl_p50_ms"] / base["itl_p50_ms"]) + "×" if base and r is not base and base["itl_p50_ms"] else ""
        print(f"| {r['label']} | {r['tok_s']:.1f} | {fmt(r['ttft_p50_ms'], '.0f')} ms | {fmt(r['itl_p50_ms'])} ms | "
              f"{fmt(r['itl_p99_ms'])} ms | {ratio} | {itl} | {fmt(r.get('cores'))} |")
    split = [r for r in rows if "ttft_parts_ms" in r]
    if split:
        print("\nTTFT, by part (ms, median over the requests)")
        print("| part | " + " | ".join(r["label"] for r in split) + " |")
        print("|---|" + "---|" * len(split))
        for name, _, _ in TTFT_PARTS:
            print(f"| {name} | " + " | ".join(fmt(r["ttft_parts_ms"].get(name), ".3f") for r in split) + " |")
        # the mean beside the median: a few slow steps cost a stream's tok/s but not its ITL p50
        print("\nEvery later token, by part (ms, median / mean over the tokens)")
        print("| part | " + " | ".join(r["label"] for r in split) + " |")
        print("|---|" + "---|" * len(split))
        for name in TOKEN_PARTS:
            print(f"| {name} | " + " | ".join(f'{fmt(r["token_parts_ms"].get(name), ".3f")} / '
                                              f'{fmt(r.get("token_parts_mean_ms", {}).get(name), ".3f")}'
                                              for r in split) + " |")
        for r in split:
            pipe = r.get("pipeline") or {}
            if pipe.get("hops_ms") is not None:
                print(f"\n{r['label']}: pipeline (ms, medians of the last steps): step {pipe.get('step_ms')}, "
                      f"compute {pipe.get('compute_ms')}, driver's calls {pipe.get('submit_ms')}, to stage 0 "
                      f"{pipe.get('call_to_first_stage_ms')}, hops {pipe.get('hops_ms')}, back {pipe.get('return_ms')}")
        for r in split:
            cpu = sorted((r.get("cpu_ms_per_token") or {}).items(), key=lambda kv: -kv[1])[:8]
            if cpu:
                print(f"{r['label']}: CPU ms a token by process: " + ", ".join(f"{k} {v:.2f}" for k, v in cpu))
    texts = {r["text"] for r in rows if "ttft_parts_ms" in r}
    if len(texts) > 1:
        print("\nnote: the moeray servers' answers differ", file=sys.stderr)
    if args.json:
        write_results(args.json, {"model": args.model, "max_tokens": args.max_tokens, "requests": args.requests,
                                  "rows": rows})
    return 0


if __name__ == "__main__":
    if "--_engine-only" in sys.argv:
        p = argparse.ArgumentParser()
        p.add_argument("--_engine-only", action="store_true")
        p.add_argument("--model")
        p.add_argument("--requests", type=int)
        p.add_argument("--warmup", type=int)
        p.add_argument("--max-tokens", type=int)
        p.add_argument("--sample")
        a = p.parse_args()
        from moeray.stages.text.tokenizer import Tokenizer

        ban = {str(i): -100 for i in sorted(Tokenizer.from_gguf(a.model).end_ids)}
        print(json.dumps(engine_alone(a, ban)))
        sys.exit(0)
    sys.exit(main())
