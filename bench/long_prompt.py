"""Prefill of one long prompt (default 8,192 tokens): moeray's engine at a few prefill chunk sizes
against llama.cpp's llama-bench pp on the same file with the same threads, in the same run, with
the ratio. moeray's time is the first token's (the engine's whole path: scheduler, every chunk's
step, sampling), one sequence, every expert from the host mapping; llama-bench's is its own
prompt-processing rate (its default batch 2048 / ubatch 512, flash attention auto), one repetition,
no warm-up run (its warm-up would run the whole prompt once more).

Each side also reports its CPU seconds (moeray: this process's, every thread, around the request;
llama-bench: the child's, its load included): on a machine other jobs share, the wall clock
measures the neighbours as much as the engine, CPU time far less, so the ratio is given for both.

    python bench/long_prompt.py [--model F.gguf] [--tokens 8192] [--chunks 512 2048] [--threads 2]
                                [--llama-bench PATH] [--json out.json]

The default model by default; a hybrid file (Qwen3.6-35B-A3B's shape, bench/shapes.py) runs the
same way (take the bigmem lock for a file of many GiB).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import write_results  # noqa: E402

from moeray.environment import llama_cpp_tool  # noqa: E402



def moeray_prefill(path: str, n_tokens: int, chunks: list[int], rounds: int = 1) -> list[dict]:
    """Seconds to the first token of an n_tokens prompt at each prefill chunk size (the best of
    `rounds`), one model loaded once. A served lone prompt takes EngineConfig.prefill_alone."""
    import torch

    from decode import prompt_ids
    from moeray.cluster.config import EngineConfig
    from moeray.cluster.engine import Engine
    from moeray.cluster.local_pipeline import LocalPipeline
    from moeray.stages.blocks.kv_cache import blocks_for
    from moeray.stages.runtime.model import load_model
    from moeray.stages.text.sampling import SamplingParams
    from moeray.stages.text.tokenizer import Tokenizer

    model = load_model(path)
    ids = prompt_ids(Tokenizer.from_gguf(path), n_tokens, 0)
    blocks = blocks_for(n_tokens + 16)
    rows = []
    for chunk in chunks:
        best, best_cpu = float("inf"), float("inf")
        for r in range(rounds + 1):  # round 0 warms the graphs of this chunk's shapes on a short prompt
            cfg = EngineConfig(max_seqs=1, max_len=n_tokens + 16, token_budget=chunk, prefill_chunk=chunk,
                               prefill_alone=chunk, micro_batches=1, kv_blocks=blocks, prefix_reuse=False)
            eng = Engine(LocalPipeline.from_model(model, blocks, 1), cfg)
            prompt = ids if r else ids[:min(n_tokens, 2 * chunk + 5)]
            t, c = time.perf_counter(), time.process_time()
            with torch.inference_mode():
                eng.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True), timeout_s=4 * 3600)
            if r:
                best, best_cpu = min(best, time.perf_counter() - t), min(best_cpu, time.process_time() - c)
            del eng
        rows.append({"engine": "moeray", "chunk": chunk, "tokens": n_tokens, "seconds": best, "cpu_s": best_cpu,
                     "prefill_tok_s": n_tokens / best, "backend": model.backend,
                     "graphs": model.trunk is not None})
        print(f"moeray chunk {chunk}: {n_tokens / best:.1f} tok/s ({best:.1f} s, {best_cpu:.1f} CPU s)", flush=True)
    return rows


def llama_bench(path: str, n_tokens: int, threads: int, exe: str) -> list[dict]:
    if not (exe and Path(exe).exists()):
        return []
    cmd = [exe, "-m", path, "-p", str(n_tokens), "-n", "0", "-t", str(threads), "-r", "1", "--no-warmup", "-o", "json"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if out.returncode != 0:
        print(f"llama-bench failed: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return []
    rows = []
    for r in json.loads(out.stdout):
        rows.append({"engine": "llama.cpp", "chunk": r.get("n_ubatch"), "tokens": n_tokens,
                     "prefill_tok_s": r["avg_ts"], "seconds": n_tokens / r["avg_ts"], "cpu_s": cpu,
                     "flash_attn": r.get("flash_attn"), "n_batch": r.get("n_batch")})
        print(f"llama-bench pp{n_tokens}: {r['avg_ts']:.1f} tok/s ({cpu:.1f} CPU s)", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the embedded default model)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunks", type=int, nargs="+", default=[512, 2048],
                    help="prefill chunk sizes to time (a served lone prompt takes --prefill-alone's 512)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--llama-bench", default=llama_cpp_tool("llama-bench"),
                    help="llama.cpp's llama-bench (default: in the folder LLAMA_CPP_BIN names, else on PATH)")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    import torch

    from moeray.stages.kernels.threads import set_threads

    torch.set_num_threads(args.threads)
    set_threads(args.threads)
    if args.model:
        path = args.model
    else:
        from moeray.stages.gguf.default_model import default_model_path

        path = str(default_model_path())
    load = os.getloadavg()
    rows = moeray_prefill(path, args.tokens, args.chunks, args.rounds)
    if not args.no_llama_cpp:
        rows += llama_bench(path, args.tokens, args.threads, args.llama_bench)
    ref = next((r for r in rows if r["engine"] == "llama.cpp"), None)
    print(f"model {Path(path).name}, {args.tokens}-token prompt, {args.threads} threads, "
          f"load average {load[0]:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"{'engine':<10} {'chunk':>6} {'seconds':>8} {'prefill tok/s':>14} {'x llama.cpp':>12} {'CPU s':>8} "
          f"{'tok/CPU s':>10} {'x llama.cpp (CPU)':>18}")
    for r in rows:
        mine = ref and r["engine"] == "moeray"
        x = f"{r['prefill_tok_s'] / ref['prefill_tok_s']:.2f}" if mine else "-"
        xc = f"{ref['cpu_s'] / r['cpu_s']:.2f}" if mine else "-"
        print(f"{r['engine']:<10} {r['chunk']!s:>6} {r['seconds']:>8.1f} {r['prefill_tok_s']:>14.1f} {x:>12} "
              f"{r['cpu_s']:>8.1f} {r['tokens'] / r['cpu_s']:>10.1f} {xc:>18}")
    if args.json:
        write_results(args.json, {"model": path, "tokens": args.tokens, "threads": args.threads, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
