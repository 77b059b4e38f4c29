"""Where one sequence's decode token goes at a context depth, moeray beside llama.cpp on the same file.

    python bench/hybrid_decode.py --model F.gguf [--depth 64 4096] [--tokens 16] [--threads 1] [--json out.json]
    python bench/hybrid_decode.py --model F.gguf --depth 64 4096 --kernels     # by kernel class, under perf

Both engines prefill `depth` tokens (in chunks of --chunk, as a served prompt is) and then decode
--tokens tokens greedily, one at a time, in this order: moeray in a child process, then llama.cpp
(llama-cpp-python's bindings of llama.h, its graph and its kernels) in another, so that only one
16 GiB mapping is resident at a time. Each reports wall and CPU ms per decode token: the CPU
time of the process (all its threads) over the decode steps only. At --threads 1 no thread waits
on another, so CPU time is the work itself and moves little on a machine other jobs share; the
wall clock measures the neighbours as much as the engine. This is the figure to compare engines
by on such a machine: `llama-bench -p 0 -n 32 -d DEPTH` times the same decode on the wall clock.

--kernels runs both under `perf record` (cpu-clock samples, enabled around the decode steps only,
through perf's control fifo) and prints CPU ms per token by kernel class side by side (the classes
of bench/prefill_profile.py: the routed experts' IQ3_S dot products, the Q6_K head, the Q8_0 trunk,
the Gated DeltaNet rule, flash attention, the short conv, ...). moeray's ggml must be an
unstripped build for perf to name its kernels (bench/prefill_profile.py says how to make one);
llama-cpp-python's library keeps its symbols.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


class PerfGate:
    """perf's control fifo (None: not under perf): sampling on around the timed steps only."""

    def __init__(self, path: str | None):
        self.f = open(path, "w") if path else None

    def __call__(self, on: bool) -> None:
        if self.f is not None:
            self.f.write("enable\n" if on else "disable\n")
            self.f.flush()


def timed_decode(step, first: int, n: int, gate: PerfGate) -> dict:
    """n greedy decode steps (`step(token) -> next token`), each timed on both clocks."""
    walls, cpus = [], []
    tok = first
    gate(True)
    for _ in range(n):
        w, c = time.perf_counter(), time.process_time()
        tok = step(tok)
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    gate(False)
    return {"wall_ms": 1e3 * statistics.median(walls), "cpu_ms": 1e3 * statistics.median(cpus),
            "cpu_ms_mean": 1e3 * sum(cpus) / n, "wall_ms_mean": 1e3 * sum(walls) / n}


def moeray_depths(path: str, depths: list[int], n: int, chunk: int, gate: PerfGate) -> list[dict]:
    import torch

    from decode import prompt_ids
    from moeray.stages.runtime.model import load_model
    from moeray.stages.text.tokenizer import Tokenizer

    model = load_model(path)
    tok = Tokenizer.from_gguf(path)
    rows = []
    for depth in depths:
        ids = prompt_ids(tok, depth, 0)
        kv = model.new_kv_cache(1, depth + n + 16)
        with torch.inference_mode():
            for i in range(0, depth, chunk):
                logits = model.step([ids[i:i + chunk]], [0], kv)
            first = int(logits[0].argmax())
            # two steps first: the decode graph of this key count built, the pages touched
            for _ in range(2):
                first = int(model.step([[first]], [0], kv)[0].argmax())

            def step(t: int) -> int:
                return int(model.step([[t]], [0], kv)[0].argmax())

            rows.append({"engine": "moeray", "depth": depth, **timed_decode(step, first, n, gate)})
        del kv
    return rows


def llama_depths(path: str, depths: list[int], n: int, chunk: int, threads: int, gate: PerfGate) -> list[dict]:
    import ctypes

    import llama_cpp as L

    from decode import _quiet, llama_greedy_step, prompt_ids
    from moeray.stages.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(path)
    quiet = L.llama_log_callback(_quiet)
    L.llama_log_set(quiet, ctypes.c_void_p())
    L.llama_backend_init()
    model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    cp = L.llama_context_default_params()
    cp.n_ctx = max(depths) + n + 16
    cp.n_batch = cp.n_ubatch = chunk
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    batch = L.llama_batch_init(chunk, 0, 1)
    rows = []
    for depth in depths:
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        ids = prompt_ids(tok, depth, 0)
        for i in range(0, depth, chunk):
            nxt = llama_greedy_step(L, ctx, batch, n_vocab, [ids[i:i + chunk]], i)
        pos = [depth]
        first = nxt[0]

        def step(t: int) -> int:
            got = llama_greedy_step(L, ctx, batch, n_vocab, [[t]], pos[0])[0]
            pos[0] += 1
            return got

        for _ in range(2):
            first = step(first)
        rows.append({"engine": "llama.cpp", "depth": depth, **timed_decode(step, first, n, gate)})
    return rows


def child(engine: str, args, perf: tuple[str, str] | None = None) -> list[dict]:
    """One engine in its own process (its mapping gone before the other's), optionally under perf."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "rows.json"
        cmd = [sys.executable, __file__, "--child", engine, "--model", args.model, "--threads", str(args.threads),
               "--tokens", str(args.tokens), "--chunk", str(args.chunk), "--depth", *map(str, args.depth),
               "--json", str(out)]
        if perf is not None:
            data, ctl = perf
            cmd = ["perf", "record", "-q", "-F", str(PERF_HZ), "-e", "cpu-clock", "-D", "-1", "--control",
                   f"fifo:{ctl}", "-o", data, "--"] + cmd + ["--perf-ctl", ctl]
        got = subprocess.run(cmd, capture_output=True, text=True)
        if got.returncode != 0:
            raise SystemExit(f"{engine}: the child failed ({got.returncode}): {got.stderr.strip()[-1500:]}")
        return json.loads(out.read_text())


PERF_HZ = 499


def kernels(args) -> dict[tuple[str, int], dict[str, float]]:
    """CPU ms per decode token by kernel class, per (engine, depth): each depth its own perf run."""
    from prefill_profile import kernel_table

    table: dict[tuple[str, int], dict[str, float]] = {}
    for depth in args.depth:
        one = argparse.Namespace(**{**vars(args), "depth": [depth]})
        for engine in ("moeray", "llama.cpp"):
            with tempfile.TemporaryDirectory() as d:
                ctl = Path(d) / "ctl"
                os.mkfifo(ctl)
                data = Path(args.perf_dir or d) / f"perf-{engine}-{depth}.data"
                child(engine, one, (str(data), str(ctl)))
                parts: dict[str, float] = {}
                for label, sec in kernel_table(str(data), args.tokens):
                    parts[label] = parts.get(label, 0.0) + 1e3 * sec
                table[(engine, depth)] = parts
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--depth", type=int, nargs="+", default=[64, 4096], help="context tokens before the decode")
    ap.add_argument("--tokens", type=int, default=16, help="decode tokens timed at each depth")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kernels", action="store_true", help="both engines under perf: CPU ms a token per kernel class")
    ap.add_argument("--perf-dir", help="--kernels: keep perf's data files here (perf report -i ...)")
    ap.add_argument("--json")
    ap.add_argument("--child", choices=("moeray", "llama.cpp"), help=argparse.SUPPRESS)
    ap.add_argument("--perf-ctl", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        gate = PerfGate(args.perf_ctl)
        if args.child == "moeray":
            import torch

            from moeray.stages.kernels.threads import set_threads

            torch.set_num_threads(args.threads)
            set_threads(args.threads)
            rows = moeray_depths(args.model, args.depth, args.tokens, args.chunk, gate)
        else:
            rows = llama_depths(args.model, args.depth, args.tokens, args.chunk, args.threads, gate)
        Path(args.json).write_text(json.dumps(rows))
        return 0
    load = os.getloadavg()[0]
    if args.kernels:
        table = kernels(args)
        labels = sorted({k for parts in table.values() for k in parts},
                        key=lambda k: -max(parts.get(k, 0.0) for parts in table.values()))
        for depth in args.depth:
            m, l = table[("moeray", depth)], table[("llama.cpp", depth)]
            print(f"\ndepth {depth}: CPU ms a decode token by kernel (perf cpu-clock), {args.threads} thread(s)")
            print(f"{'kernel':<70} {'moeray':>8} {'llama.cpp':>9}")
            for k in labels:
                if max(m.get(k, 0.0), l.get(k, 0.0)) >= 0.05:
                    print(f"{k:<70} {m.get(k, 0.0):8.2f} {l.get(k, 0.0):9.2f}")
            tm, tl = sum(m.values()), sum(l.values())
            print(f"{'total':<70} {tm:8.2f} {tl:9.2f}   llama.cpp/moeray: {tl / tm:.2f}x")
        if args.json:
            Path(args.json).write_text(json.dumps({f"{e} {d}": v for (e, d), v in table.items()}, indent=1))
        return 0
    rows = child("moeray", args) + child("llama.cpp", args)
    print(f"\n{Path(args.model).name}, batch 1, {args.threads} thread(s), median of {args.tokens} decode tokens, "
          f"load {load:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'engine':<10} {'depth':>6} {'wall ms':>9} {'CPU ms':>9} {'x llama.cpp (CPU)':>18} {'x llama.cpp (wall)':>19}")
    ref = {r["depth"]: r for r in rows if r["engine"] == "llama.cpp"}
    for r in rows:
        x = ref.get(r["depth"])
        cpu = f"{x['cpu_ms'] / r['cpu_ms']:.2f}" if x else "-"
        wall = f"{x['wall_ms'] / r['wall_ms']:.2f}" if x else "-"
        print(f"{r['engine']:<10} {r['depth']:>6} {r['wall_ms']:9.1f} {r['cpu_ms']:9.1f} {cpu:>18} {wall:>19}")
    if args.json:
        from results import write_results

        write_results(args.json, {"model": Path(args.model).name, "threads": args.threads, "tokens": args.tokens,
                                  "rows": rows, "load": [load, os.getloadavg()[0]]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
