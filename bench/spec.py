"""Speculative decoding, served: moeray with and without drafts beside llama-server's n-gram modes.

    python bench/spec.py --llama-server \\
        [--model X.gguf | --shape qwen3-30b-a3b] [--modes off auto] [--llama-modes none ngram-simple ngram-mod] \\
        [--clients 1 16] [--max-tokens 192] [--json out.json]

Every server runs the same model file and gets the same greedy chat requests over HTTP (temperature
0, max_tokens fixed): the bundled prompts of bench/spec_prompts.json, three kinds where the answer
repeats its prompt (rewrite code with one change, quote a passage, re-format JSON: drafts pay) and
free chat (they mostly do not). One client: each prompt in turn, decode tokens/s = (tokens - 1) /
(last token - first token), as a user sees it stream; N clients: N requests of the kind at once,
the tokens of all of them over the wall time. moeray runs as `moeray serve --local --speculative
MODE` (one process, the engine a user gets); llama-server with `--spec-type MODE` and the same
threads. moeray's acceptance (drafted and accepted tokens, from /v1/stages) is printed with its rows.
The greedy answers of moeray with and without speculation are compared: they must be the same text.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from results import write_results  # noqa: E402

from moeray.environment import llama_cpp_tool  # noqa: E402

from moeray.stages.runtime.transport import free_port  # noqa: E402

PROMPTS = json.loads((HERE / "spec_prompts.json").read_text())
KINDS = ("code", "quotes", "json", "chat")


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float) -> str:
    """The served model's id, once /v1/models answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return json.loads(r.read())["data"][0]["id"]
        except (OSError, http.client.HTTPException, KeyError, IndexError, ValueError):
            pass
        time.sleep(1.0)
    proc.kill()
    raise SystemExit(f"server not ready in {timeout_s:.0f} s")


def ask(port: int, model: str, prompt: str, max_tokens: int, timeout_s: float = 600.0) -> dict:
    """One streamed greedy chat completion: its text, tokens, and when its first and last tokens came."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    t0 = time.perf_counter()
    first = last = None
    text, usage, chunks = [], None, 0
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
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(piece)
                    chunks += 1
    finally:
        conn.close()
    n = int(usage["completion_tokens"]) if usage else chunks
    return {"text": "".join(text), "tokens": n, "t0": t0, "first": first or t0, "last": last or t0}


def one_client(port: int, model: str, kind: str, max_tokens: int, reps: int) -> dict:
    tokens = seconds = 0.0
    texts = []
    for _ in range(reps):
        for prompt in PROMPTS[kind]:
            r = ask(port, model, prompt, max_tokens)
            texts.append(r["text"])
            if r["tokens"] > 1 and r["last"] > r["first"]:
                tokens += r["tokens"] - 1
                seconds += r["last"] - r["first"]
    return {"tok_s": tokens / seconds if seconds else 0.0, "tokens": tokens, "texts": texts}


def many_clients(port: int, model: str, kind: str, max_tokens: int, clients: int, per_client: int) -> dict:
    results, errors = [], []

    def client(i: int) -> None:
        for j in range(per_client):
            prompt = PROMPTS[kind][(i + j) % len(PROMPTS[kind])]
            try:
                results.append(ask(port, model, prompt, max_tokens))
            except Exception as exc:  # noqa: BLE001 - counted and printed
                errors.append(f"{type(exc).__name__}: {exc}"[:200])

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    return {"tok_s": tokens / wall, "tokens": tokens, "errors": errors}


def spec_stats(port: int) -> dict | None:
    """moeray's speculation counters from /v1/stages (None: not moeray)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/stages", timeout=30) as r:
            return json.loads(r.read()).get("speculation")
    except (OSError, ValueError, http.client.HTTPException):
        return None


def run_server(label: str, cmd: list[str], env: dict, port: int, args) -> list[dict]:
    print(f"# {label}: {' '.join(shlex.quote(c) for c in cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    rows = []
    try:
        model = wait_ready(proc, f"http://127.0.0.1:{port}", args.ready_timeout)
        for kind in args.kinds:  # warm: every prompt once (graphs built, prompt caches filled)
            one_client(port, model, kind, 16, 1)
        for n in args.clients:
            for kind in args.kinds:
                before = spec_stats(port)
                load = os.getloadavg()[0]
                if n == 1:
                    r = one_client(port, model, kind, args.max_tokens, args.reps)
                else:
                    r = many_clients(port, model, kind, args.max_tokens, n, args.per_client)
                after = spec_stats(port)
                if before is not None and after is not None:
                    drafted = after["drafted_tokens"] - before["drafted_tokens"]
                    accepted = after["accepted_tokens"] - before["accepted_tokens"]
                    rowsv = after["verify_rows"] - before["verify_rows"]
                    r["spec"] = {"drafted": drafted, "accepted": accepted, "verify_rows": rowsv}
                r.update(label=label, kind=kind, clients=n, load=load)
                rows.append(r)
                extra = f", accepted {r['spec']['accepted']}/{r['spec']['drafted']}" if r.get("spec") else ""
                print(f"#   {kind:6s} {n:2d} clients: {r['tok_s']:.1f} tok/s{extra}, load {load:.1f}",
                      file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF file (default: the embedded default model)")
    p.add_argument("--shape", help="a real model's shape with random blocks (bench/shapes.py), e.g. qwen3-30b-a3b")
    p.add_argument("--llama-server", metavar="PATH", nargs="?", const="",
                   help="llama-server beside moeray: PATH, or alone for the one in LLAMA_CPP_BIN's folder or on PATH")
    p.add_argument("--llama-modes", nargs="+", default=["none", "ngram-simple", "ngram-mod"],
                   help="llama-server --spec-type values, one server each (none: no speculation)")
    p.add_argument("--modes", nargs="+", default=["off", "auto"], help="moeray --speculative values, one server each")
    p.add_argument("--threads", type=int, default=2, help="threads of both servers")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--reps", type=int, default=1, help="one client: each prompt this many times")
    p.add_argument("--per-client", type=int, default=2, help="N clients: requests each client sends")
    p.add_argument("--ctx", type=int, default=16384, help="llama-server's context (all slots together)")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--json", help="also write every row here")
    args = p.parse_args(argv)
    if args.llama_server == "":
        args.llama_server = llama_cpp_tool("llama-server")
        if args.llama_server is None:
            p.error("--llama-server: none in LLAMA_CPP_BIN's folder or on PATH; set LLAMA_CPP_BIN to the folder "
                    "of llama.cpp's tools or give its path")
    if args.shape:
        from shapes import write_shape

        args.model = str(write_shape(args.shape))
    if args.model is None:
        from moeray.stages.gguf.default_model import default_model_path

        args.model = str(default_model_path())
    slots = max(args.clients)
    servers = []
    for mode in args.modes:
        cmd = [sys.executable, "-m", "moeray.cluster.cli", "serve", "--local", args.model, "--port", "{port}",
               "--no-metrics", "--threads", str(args.threads), "--max-seqs", str(slots), "--micro-batches", "1", "--speculative", mode]
        servers.append((f"moeray --speculative {mode}", cmd, dict(os.environ)))
    for mode in args.llama_modes if args.llama_server else []:
        cmd = [args.llama_server, "-m", args.model, "-np", str(slots), "-c", str(args.ctx), "-t", str(args.threads),
               "--host", "127.0.0.1", "--port", "{port}"] + ([] if mode == "none" else ["--spec-type", mode])
        env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
        servers.append((f"llama-server --spec-type {mode}", cmd, env))
    rows = []
    for label, cmd, env in servers:
        port = free_port()
        rows += run_server(label, [c.replace("{port}", str(port)) for c in cmd], env, port, args)

    def rate(label_start: str, kind: str, n: int) -> float | None:
        found = [r["tok_s"] for r in rows if r["label"].startswith(label_start) and r["kind"] == kind
                 and r["clients"] == n]
        return max(found) if found else None

    print(f"\nmodel {Path(args.model).name}, {args.threads} threads, greedy, max_tokens {args.max_tokens}\n")
    print("| server | prompts | clients | tok/s | vs moeray off | vs llama-server's best n-gram | accepted / drafted |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        off = rate("moeray --speculative off", r["kind"], r["clients"])
        best = max((x for m in args.llama_modes if m.startswith("ngram")
                    if (x := rate(f"llama-server --spec-type {m}", r["kind"], r["clients"])) is not None), default=None)
        s = r.get("spec")
        cells = [r["label"], r["kind"], str(r["clients"]), f"{r['tok_s']:.1f}",
                 f"{r['tok_s'] / off:.2f}×" if off else "", f"{r['tok_s'] / best:.2f}×" if best else "",
                 f"{s['accepted']} / {s['drafted']}" if s else ""]
        print("| " + " | ".join(cells) + " |")
    plain = {(r["kind"], r["clients"]): r.get("texts") for r in rows if r["label"] == "moeray --speculative off"}
    for r in rows:
        if r["label"].startswith("moeray") and r.get("texts") and plain.get((r["kind"], r["clients"])):
            same = r["texts"] == plain[(r["kind"], r["clients"])]
            if not same:
                print(f"# {r['label']} {r['kind']}: greedy text differs from --speculative off", file=sys.stderr)
    if args.json:
        write_results(args.json, {"model": args.model, "max_tokens": args.max_tokens,
                                  "rows": [{k: v for k, v in r.items() if k != "texts"} for r in rows]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
