"""One family's row set against llama.cpp, in one run: the four targets on a real-width file.

    python bench/families.py qwen3.6-35b-a3b [--rows decode,batch16,prefill,serve] [--repeat 2]
        [--llama-bin DIR] [--json out.json]

llama.cpp's tools (llama-bench, llama-batched-bench, llama-server) come from --llama-bin, else the
folder LLAMA_CPP_BIN names, else PATH (moeray/environment.py llama_cpp_tool).

The file is bench/shapes.py's (written once into the cache dir). Each row runs both engines, with
2 threads each, one after the other, and the pair is repeated `--repeat` times in alternating order
(moeray first, then llama.cpp first ...) so that a drifting load hits both alike; the table gives
each engine's median, the median ratio of the pairs and their spread (lowest-highest).

| row | moeray | llama.cpp | target |
|---|---|---|---|
| decode | bench/decode.py --batch 1, tok/s after a 512-token prompt | llama-bench tg32 at depth 512 (-d 512) | >= 1.0x |
| batch16 | bench/decode.py --batch 16, decode tok/s of 16 sequences after 64-token prompts | llama-batched-bench -npp 64 -ntg 32 -npl 16, S_TG | >= 1.0x |
| prefill | bench/decode.py --batch 1, prefill tok/s of a 512-token prompt | llama-bench pp512 | >= 1.0x |
| serve | bench/serve_sweep.py: `moeray serve --local`, 4 streaming clients (bench/load.py's) | llama-server -np 4 | >= 0.9x, TTFT p50 <= 1.5x |

moeray runs in a child process per measurement (`bench/decode.py ... --no-llama-cpp --json`), so
its memory (a host copy of the experts can be 15 GiB) is gone before llama.cpp maps the file.
Before each run the kernel is asked to compact memory (`/proc/sys/vm/compact_memory`, where
writable): big runs back to back on fragmented memory get few huge pages (README, Decode).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from results import compact_memory, read_results, write_results  # noqa: E402
from shapes import SHAPES, shape_of, write_shape  # noqa: E402

from moeray.environment import llama_cpp_tool  # noqa: E402

ROWS = ("decode", "batch16", "prefill", "serve")
TARGET = {"decode": 1.0, "batch16": 1.0, "prefill": 1.0, "serve": 0.9}


def run(cmd: list[str], timeout: float) -> str:
    print(f"# {' '.join(shlex.quote(c) for c in cmd)}", file=sys.stderr, flush=True)
    compact_memory()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"{Path(cmd[0]).name} failed ({out.returncode}): {out.stderr.strip()[-1500:]}")
    return out.stdout


def moeray_decode(path: str, batch: int, prompt: int, decode: int, threads: int, extra: list[str]) -> dict:
    """bench/decode.py's moeray row (host path: every expert from the file or its host copy)."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "rows.json"
        run([sys.executable, str(HERE / "decode.py"), "--model", path, "--batch", str(batch), "--prompt-tokens",
             str(prompt), "--decode-tokens", str(decode), "--caches", "0", "--threads", str(threads),
             "--no-llama-cpp", "--json", str(out), *extra], timeout=3600)
        got = json.loads(out.read_text())
        if got.get("profile"):  # --moeray-args --profile: where a batch-1 decode token's time goes
            prof = got["profile"]
            print(f"moeray profile, batch 1, host path: {prof['ms_per_token']:.1f} ms a token", file=sys.stderr)
            for part, ms in sorted(prof["parts"].items(), key=lambda kv: -kv[1]):
                print(f"  {part:<70} {ms:7.2f} ms {100 * ms / prof['ms_per_token']:5.1f}%", file=sys.stderr)
        return {**got["rows"][0], "profile": got.get("profile")}


def tool(bin_dir: str | None, name: str) -> str:
    """llama.cpp's tool `name`: in --llama-bin when given, else LLAMA_CPP_BIN's folder, else on PATH."""
    found = (str(Path(bin_dir) / name) if (Path(bin_dir) / name).is_file() else None) if bin_dir \
        else llama_cpp_tool(name)
    if found is None:
        where = f"in {bin_dir}" if bin_dir else "in LLAMA_CPP_BIN's folder or on PATH"
        raise SystemExit(f"{name}: not found {where}; build llama.cpp's tools and set LLAMA_CPP_BIN to their "
                         "folder (or put them on PATH, or pass --llama-bin DIR)")
    return found


def llama_bench(bin_dir: str | None, path: str, threads: int, prompt: int, decode: int, reps: int) -> dict:
    """llama-bench's pp{prompt} and tg{decode}, tok/s (the mean of its repetitions). The decode runs
    at depth {prompt} (`-d`: after a prompt of that many tokens in its context), as moeray's decode
    row runs after its prompt; llama-bench's own tg starts from an empty context, which costs an
    attention-heavy model (MLA, 64 heads) far less per token than 512 keys do."""
    out = run([tool(bin_dir, "llama-bench"), "-m", path, "-t", str(threads), "-p", str(prompt), "-n", "0",
               "-r", str(reps), "-o", "json"], timeout=3600)
    pp = next(r["avg_ts"] for r in json.loads(out) if r["n_prompt"] == prompt and r["n_gen"] == 0)
    out = run([tool(bin_dir, "llama-bench"), "-m", path, "-t", str(threads), "-p", "0", "-n", str(decode),
               "-d", str(prompt), "-r", str(reps), "-o", "json"], timeout=3600)
    tg = next(r["avg_ts"] for r in json.loads(out) if r["n_gen"] == decode and r["n_prompt"] == 0)
    return {"prefill_tok_s": pp, "decode_tok_s": tg}


def llama_batched_bench(bin_dir: str | None, path: str, threads: int, seqs: int, prompt: int, decode: int) -> dict:
    out = run([tool(bin_dir, "llama-batched-bench"), "-m", path, "-t", str(threads), "-c",
               str(seqs * (prompt + decode) + 64), "-b", str(seqs * prompt), "-ub", "512", "-npp", str(prompt),
               "-ntg", str(decode), "-npl", str(seqs), "--output-format", "jsonl"], timeout=3600)
    r = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    return {"prefill_tok_s": r["speed_pp"], "decode_tok_s": r["speed_tg"]}


def serve_pair(bin_dir: str | None, path: str, args) -> tuple[dict, dict]:
    """bench/serve_sweep.py: llama-server -np 4 -t 2, then moeray serve --local, 4 clients each."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "serve.json"
        run([sys.executable, str(HERE / "serve_sweep.py"), "--model", path, "--llama-server",
             tool(bin_dir, "llama-server"), "--llama-threads", str(args.threads), "--clients", "4",
             "--duration", str(args.serve_seconds), "--warmup", str(args.serve_warmup), "--max-tokens", "32",
             "--json", str(out)], timeout=3600)
        rows = read_results(out)["rows"]
    llama = next(r for r in rows if r["label"].startswith("llama-server"))
    mine = next(r for r in rows if not r["label"].startswith("llama-server"))
    return mine, llama


def measure(row: str, path: str, args, engine: str) -> dict:
    b = args.llama_bin
    if row in ("decode", "prefill"):  # one run gives both: 512-token prompt, then 32 decode steps
        if engine == "moeray":
            return moeray_decode(path, 1, 512, args.decode_tokens, args.threads, args.moeray_args)
        return llama_bench(b, path, args.threads, 512, args.decode_tokens, args.llama_reps)
    if row == "batch16":
        if engine == "moeray":
            return moeray_decode(path, 16, 64, args.decode_tokens, args.threads, args.moeray_args)
        return llama_batched_bench(b, path, args.threads, 16, 64, args.decode_tokens)
    raise ValueError(row)


def value(row: str, r: dict) -> float:
    return r["prefill_tok_s"] if row == "prefill" else r["decode_tok_s"] if row != "serve" else r["tok_s"]


def command(name: str, row: str, args) -> str:
    layers = f" --layers {args.layers}" if args.layers else ""
    return f"python bench/families.py {name}{layers} --rows {row} --repeat {args.repeat}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, help="the first N layers instead of the shape's own cut")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--repeat", type=int, default=2, help="pairs per row, in alternating order")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--llama-bin", metavar="DIR",
                    help="the folder of llama-bench, llama-batched-bench, llama-server "
                         "(default: LLAMA_CPP_BIN's folder, else PATH)")
    ap.add_argument("--llama-reps", type=int, default=2, help="llama-bench -r")
    ap.add_argument("--serve-seconds", type=float, default=60.0)
    ap.add_argument("--serve-warmup", type=float, default=20.0)
    ap.add_argument("--moeray-args", default="", help="extra bench/decode.py flags for moeray's runs")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    args.moeray_args = shlex.split(args.moeray_args)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if bad := [r for r in rows if r not in ROWS]:
        raise SystemExit(f"--rows {','.join(bad)}: choose from {', '.join(ROWS)}")
    for name in ("llama-bench", "llama-batched-bench", "llama-server"):
        tool(args.llama_bin, name)  # each found before an hour of measuring, or one line saying where to put it

    s = shape_of(args.name, args.layers)
    path = str(write_shape(args.name, shape=s))
    results: dict[str, list[tuple[dict, dict]]] = {r: [] for r in rows}
    t0 = time.time()
    for i in range(args.repeat):
        order = ("moeray", "llama.cpp") if i % 2 == 0 else ("llama.cpp", "moeray")
        done: dict[tuple[str, str], dict] = {}
        for row in rows:
            if row == "serve":
                mine, llama = serve_pair(args.llama_bin, path, args)
                results[row].append((mine, llama))
                continue
            key = "decode" if row == "prefill" else row  # decode and prefill come from the same runs
            for engine in order:
                if (key, engine) not in done:
                    done[(key, engine)] = measure(row, path, args, engine)
            results[row].append((done[(key, "moeray")], done[(key, "llama.cpp")]))

    cut = f", first {s.layers} of {s.full_layers} layers" if s.full_layers else ""
    print(f"{args.name} ({s.arch}{cut}, experts {s.experts_type}, trunk {s.trunk_type}), {Path(path).name}, "
          f"{args.threads} threads, {args.repeat} pairs a row, {(time.time() - t0) / 60:.0f} min, "
          f"load {os.getloadavg()[0]:.1f}")
    print("| row | moeray | llama.cpp | ratio (spread) | target | met | command |")
    print("|---|---|---|---|---|---|---|")
    table = []
    for row in rows:
        pairs = results[row]
        mine = statistics.median(value(row, m) for m, _ in pairs)
        ref = statistics.median(value(row, l) for _, l in pairs)
        ratios = [value(row, m) / value(row, l) for m, l in pairs]
        ratio = statistics.median(ratios)
        met = ratio >= TARGET[row]
        extra, ttft = "", None
        if row == "serve":
            ttft = statistics.median(m["ttft_p50"] / l["ttft_p50"] for m, l in pairs)
            met = met and ttft <= 1.5
            extra = f", TTFT p50 {ttft:.2f}x"
        unit = "tok/s"
        print(f"| {row} | {mine:.2f} {unit} | {ref:.2f} {unit} | {ratio:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}){extra} "
              f"| >= {TARGET[row]}x | {'yes' if met else 'no'} | `{command(args.name, row, args)}` |")
        table.append({"row": row, "moeray": mine, "llama_cpp": ref, "ratio": ratio, "ratios": ratios, "met": met,
                      "ttft_ratio": ttft, "pairs": pairs})
    if args.json:
        write_results(args.json, {"name": args.name, "path": path, "shape": asdict(s), "rows": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
