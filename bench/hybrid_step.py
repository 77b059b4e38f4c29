"""A hybrid model's decode step, before and after it became one graph, beside llama.cpp: moeray's
stage graph (DeltaNet and gated attention as ggml nodes, the state in place) and its torch path
(the rule and attention as torch ops between ggml graphs, what hybrid models ran before),
alternated in one process, and llama.cpp (llama-cpp-python in a child) on the same file, at batch
1 and 16 sequences after a prompt of --prompt-tokens each.

Each row gives wall time and CPU time (the process's, all its threads) per decode step. On a
machine other jobs share, the wall clock measures the neighbours as much as the engine; CPU time
at --threads 1 does not (no thread waits on another), so it is the fairer side-by-side there.

    python bench/hybrid_step.py --model F.gguf [--batch 1 16] [--steps 8] [--rounds 2] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import write_results  # noqa: E402


def _clock():
    return time.perf_counter(), time.process_time()


def moeray_steps(path: str, batch: int, n_prompt: int, steps: int, rounds: int) -> list[dict]:
    import torch

    from decode import prompt_ids
    from moeray.stages.runtime.model import load_model
    from moeray.stages.text.tokenizer import Tokenizer

    model = load_model(path)
    tok = Tokenizer.from_gguf(path)
    graphs = model.trunk
    prompts = [prompt_ids(tok, n_prompt, i) for i in range(batch)]
    res = {"graph": [], "torch": []}
    for r in range(rounds + 1):  # round 0 warms both modes' graphs
        for mode in res:
            model.trunk = graphs if mode == "graph" else None
            kv = model.new_kv_cache(batch, n_prompt + steps + 8)
            with torch.inference_mode():
                t0 = _clock()
                logits = model.step(prompts, list(range(batch)), kv)
                t1 = _clock()
                for _ in range(steps):
                    logits = model.step([[int(x)] for x in logits.argmax(-1)], list(range(batch)), kv)
                t2 = _clock()
            if r:
                res[mode].append((t1[0] - t0[0], t1[1] - t0[1], (t2[0] - t1[0]) / steps, (t2[1] - t1[1]) / steps))
    model.trunk = graphs
    rows = []
    for mode, runs in res.items():
        med = [statistics.median(x[i] for x in runs) for i in range(4)]
        rows.append({"engine": f"moeray {mode}", "batch": batch, "prefill_s": med[0], "prefill_cpu_s": med[1],
                     "step_s": med[2], "step_cpu_s": med[3]})
    return rows


def llama_cpp_steps(path: str, batch: int, n_prompt: int, steps: int, rounds: int, threads: int) -> list[dict]:
    """In this process: the llama-cpp-python bindings (run from a child: see main)."""
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
    cp.n_seq_max, cp.kv_unified = batch, True
    cp.n_ctx = batch * (n_prompt + steps + 16)
    cp.n_batch = cp.n_ubatch = max(batch * n_prompt, 512)
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    lb = L.llama_batch_init(batch * n_prompt, 0, batch)
    prompts = [prompt_ids(tok, n_prompt, i) for i in range(batch)]

    def decode(seqs, start):
        return llama_greedy_step(L, ctx, lb, n_vocab, seqs, start)

    runs = []
    for r in range(rounds + 1):
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        t0 = _clock()
        nxt = decode(prompts, 0)
        t1 = _clock()
        for s in range(steps):
            nxt = decode([[t] for t in nxt], n_prompt + s)
        t2 = _clock()
        if r:
            runs.append((t1[0] - t0[0], t1[1] - t0[1], (t2[0] - t1[0]) / steps, (t2[1] - t1[1]) / steps))
    med = [statistics.median(x[i] for x in runs) for i in range(4)]
    return [{"engine": "llama.cpp", "batch": batch, "prefill_s": med[0], "prefill_cpu_s": med[1],
             "step_s": med[2], "step_cpu_s": med[3]}]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--llama-cpp-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.llama_cpp_child:  # llama-cpp-python's libggml must not meet ggml-python's (stages/kernels/ggml_lib.py)
        rows = [r for b in args.batch for r in llama_cpp_steps(args.model, b, args.prompt_tokens, args.steps,
                                                              args.rounds, args.threads)]
        print(json.dumps(rows))
        return 0

    import torch

    from moeray.stages.kernels.threads import set_threads

    torch.set_num_threads(args.threads)
    set_threads(args.threads)
    rows = [r for b in args.batch for r in moeray_steps(args.model, b, args.prompt_tokens, args.steps, args.rounds)]
    if not args.no_llama_cpp:
        cmd = [sys.executable, __file__, "--llama-cpp-child", "--model", args.model, "--threads", str(args.threads),
               "--prompt-tokens", str(args.prompt_tokens), "--steps", str(args.steps), "--rounds", str(args.rounds),
               "--batch", *map(str, args.batch)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode == 0:
            rows += json.loads(out.stdout.strip().splitlines()[-1])
        else:
            print(f"llama.cpp: the child failed: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
    print(f"model {Path(args.model).name}, {args.threads} thread(s), {args.prompt_tokens} prompt tokens a sequence, "
          f"{args.steps} decode steps, median of {args.rounds}")
    print(f"{'engine':<14} {'batch':>5} {'step ms':>9} {'step CPU ms':>12} {'tok/s (CPU)':>12} "
          f"{'x llama.cpp (CPU)':>18} {'prefill CPU s':>14}")
    ref = {r["batch"]: r for r in rows if r["engine"] == "llama.cpp"}
    for r in rows:
        x = ref.get(r["batch"])
        ratio = f"{x['step_cpu_s'] / r['step_cpu_s']:.2f}" if x and x is not r else "-"
        print(f"{r['engine']:<14} {r['batch']:>5} {1e3 * r['step_s']:>9.1f} {1e3 * r['step_cpu_s']:>12.1f} "
              f"{r['batch'] / r['step_cpu_s']:>12.2f} {ratio:>18} {r['prefill_cpu_s']:>14.2f}")
    if args.json:
        write_results(args.json, {"model": args.model, "threads": args.threads, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
