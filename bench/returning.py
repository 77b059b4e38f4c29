"""A returning conversation: its long prefix pushed out of the KV pool by other traffic, then sent again
with a new turn. Time to its first token in moeray with the host tier (the prefix's blocks were
saved to host memory as the pool gave them away, and come back by prefix hash), without it (a full
re-prefill), and in llama-server with its RAM prompt cache (--cache-ram), on the same file with the
same threads, in the same run.

Turn 1 sends --prefix-tokens of prompt and takes --answer-tokens of greedy answer; then a different
prompt of the same length fills the pool (moeray: a pool of one conversation's blocks; llama-server:
its one slot), pushing turn 1's KV out; turn 2 sends turn 1's prompt, its answer and --new-tokens
more, asking for one token. moeray runs in this process over the pipeline `moeray serve --local`
builds (LocalPipeline.from_file), its time the engine's from the request's arrival to its first
token; llama-server runs as a child over HTTP (/completion with token ids, one slot), its time the
request's wall time.

    python bench/returning.py [--model F.gguf | --shape qwen3-30b-a3b] [--prefix-tokens 8192]
                              [--new-tokens 64] [--cache-type f16] [--threads 2] [--llama-server PATH]
                              [--json out.json]

The default model's context is 8,192 tokens: with it, pass a shorter --prefix-tokens (8000).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moeray.environment import llama_cpp_tool  # noqa: E402


def moeray_turns(path: str, prompt: list[int], other: list[int], n_answer: int, new: list[int], host: bool,
                 cache_type: str) -> dict:
    import torch

    from moeray.cluster.config import EngineConfig
    from moeray.cluster.engine import Engine
    from moeray.cluster.local_pipeline import LocalPipeline
    from moeray.planner.kv import KVTypes
    from moeray.stages.blocks.kv_cache import blocks_for
    from moeray.stages.text.sampling import SamplingParams

    total = len(prompt) + n_answer + len(new) + 16
    blocks = blocks_for(total)  # one conversation: the other prompt takes every block back
    budget = 4 << 30  # moeray serve --local's device: its trunk and KV; the experts on the host path
    pipe = LocalPipeline.from_file(path, blocks, budget, max_seqs=1, kv_types=KVTypes.same(cache_type),
                                   host_blocks=2 * blocks if host else 0)
    eng = Engine(pipe, EngineConfig(max_seqs=1, max_len=total, micro_batches=1, kv_blocks=blocks))
    greedy = SamplingParams(max_tokens=n_answer, ignore_eos=True)
    with torch.inference_mode():
        eng.generate([prompt[:64]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm the graphs
        t = time.perf_counter()
        first = eng.generate([prompt], greedy)[0]
        turn1 = time.perf_counter() - t
        eng.generate([other], greedy)
        second = eng.add(prompt + first.output + new, SamplingParams(max_tokens=1, ignore_eos=True))
        eng.run([second])
    host_tier = eng.scheduler.blocks.host
    return {"engine": "moeray", "host_tier": host, "cache_type": cache_type, "turn1_s": turn1,
            "turn2_ttft_s": second.t_first - second.t_arrive, "turn2_prompt": len(second.prompt),
            "turn2_reused": second.cached_tokens, "turn2_prefilled": len(second.prompt) - second.cached_tokens,
            "host_blocks_loaded": host_tier.stats.hits if host_tier else 0}


def llama_server_turns(exe: str, path: str, threads: int, prompt: list[int], other: list[int], n_answer: int,
                       new: list[int], cache_type: str) -> dict | None:
    from multi_turn import _post, llama_server

    if not (exe and Path(exe).exists()):
        return None
    ctx = len(prompt) + n_answer + len(new) + 64
    cache = ("--cache-ram", "8192", "-fa", "on", "-ctk", cache_type, "-ctv", cache_type)
    with llama_server(exe, path, threads, ctx, cache) as port:
        base = {"temperature": 0, "ignore_eos": True, "cache_prompt": True, "return_tokens": True}
        _post(port, {**base, "prompt": prompt[:64], "n_predict": 2}, 3600)  # warm-up
        t = time.perf_counter()
        first, _ = _post(port, {**base, "prompt": prompt, "n_predict": n_answer}, 3600)
        turn1 = time.perf_counter() - t
        _post(port, {**base, "prompt": other, "n_predict": n_answer}, 3600)  # the slot now holds another prompt
        answer = first["tokens"]
        second, wall = _post(port, {**base, "prompt": prompt + answer + new, "n_predict": 1}, 3600)
        tm = second["timings"]
        n = len(prompt) + len(answer) + len(new)
        return {"engine": "llama-server", "cache_ram_mib": 8192, "cache_type": cache_type, "turn1_s": turn1,
                "turn2_ttft_s": wall, "turn2_prompt_ms": tm["prompt_ms"], "turn2_prompt": n,
                "turn2_prefilled": tm["prompt_n"], "turn2_reused": n - tm["prompt_n"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the embedded default model)")
    ap.add_argument("--shape", help="a real model's shape with random blocks (bench/shapes.py), e.g. qwen3-30b-a3b")
    ap.add_argument("--prefix-tokens", type=int, default=8192)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--cache-type", default="f16", help="the KV cache type of both engines, K and V alike "
                                                        "(default f16, llama-server's own)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", default=llama_cpp_tool("llama-server"),
                    help="llama-server (default: LLAMA_CPP_BIN's, or llama-server on PATH); none: moeray alone")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    import torch

    from decode import prompt_ids
    from moeray.stages.gguf.reader import read_gguf_header
    from moeray.stages.kernels.threads import set_threads
    from moeray.stages.text.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    set_threads(args.threads)
    from shapes import bench_model

    path = bench_model(args.shape, args.model)
    context = read_gguf_header(path).config.context_length
    need = args.prefix_tokens + args.answer_tokens + args.new_tokens + 16
    if need > context:
        raise SystemExit(f"{Path(path).name} holds {context} tokens of context, fewer than the {need} this run needs; "
                         f"lower --prefix-tokens (to {context - need + args.prefix_tokens}) or use --shape qwen3-30b-a3b")
    tok = Tokenizer.from_gguf(path)
    prompt = prompt_ids(tok, args.prefix_tokens, 0)
    other = prompt_ids(tok, args.prefix_tokens, 5)
    new = prompt_ids(tok, args.new_tokens, 7)
    load = os.getloadavg()
    rows = [moeray_turns(path, prompt, other, args.answer_tokens, new, False, args.cache_type),
            moeray_turns(path, prompt, other, args.answer_tokens, new, True, args.cache_type)]
    if args.llama_server:
        got = llama_server_turns(args.llama_server, path, args.threads, prompt, other, args.answer_tokens, new,
                                 args.cache_type)
        if got is not None:
            rows.append(got)
    ref = next((r for r in rows if r["engine"] == "llama-server"), None)
    full = rows[0]["turn2_ttft_s"]
    print(f"model {Path(path).name}, {args.threads} threads, KV {args.cache_type}; turn 1: {args.prefix_tokens} "
          f"prompt tokens, {args.answer_tokens} answered; another prompt of as many; turn 2: turn 1 + "
          f"{args.new_tokens} new")
    print(f"{'engine':<13} {'host tier':>9} {'turn 2 prefilled':>17} {'TTFT s':>8} {'of re-prefill':>14} "
          f"{'x llama-server':>15}")
    for r in rows:
        tier = {True: "on", False: "off"}.get(r.get("host_tier"), f"{r.get('cache_ram_mib', '-')} MiB")
        x = f"{ref['turn2_ttft_s'] / r['turn2_ttft_s']:.2f}" if ref and r is not ref else "-"
        print(f"{r['engine']:<13} {tier:>9} {r['turn2_prefilled']:>9} of {r['turn2_prompt']:<5} "
              f"{r['turn2_ttft_s']:>8.3f} {r['turn2_ttft_s'] / full:>14.3f} {x:>15}")
    if args.json:
        from results import write_results  # the run record (command, commit, date) docs tables need

        write_results(args.json, {"model": path, "threads": args.threads, "load_avg": [load, os.getloadavg()],
                                  "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
