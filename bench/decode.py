"""Prefill and decode tokens/s of moeray on a GGUF (default: the embedded upcycled SmolLM2 MoE) at
batch 1 and 8, and of llama.cpp (llama-cpp-python, when installed) on the same file with the same
thread count, with the ratio.

    python bench/decode.py [--model X.gguf] [--threads N] [--prompt-tokens 128] [--decode-tokens 32] [--json out.json]

Greedy decoding with end tokens ignored, so every run decodes exactly --decode-tokens per sequence.
Decode tokens/s at batch B counts all B sequences' tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def prompt_ids(tokenizer, n_tokens: int, index: int) -> list[int]:
    """A prompt of exactly n_tokens made from the bundled prompts, different for each index."""
    from moeray.stages.default_model import load_prompts

    prompts = load_prompts()
    ids: list[int] = []
    k = index
    while len(ids) < n_tokens:
        ids += tokenizer.encode(prompts[k % len(prompts)]["text"] + "\n")
        k += 1
    return ids[:n_tokens]


def bytes_per_token(model) -> int:
    """Weight bytes one decode token of one sequence reads: every trunk matrix once (the head
    included) and k routed experts per MoE layer, in the form the route holds them."""
    cfg = model.config
    n = model.trunk_bytes()
    if cfg.is_moe:
        n += cfg.n_experts_used * sum(model.experts.host.slot_bytes(l) if hasattr(model.experts, "host")
                                      else model.experts.slot_bytes(l) for l in range(model.first, model.end))
    return n


def read_bandwidth_gb_s(n_bytes: int = 512 << 20, reps: int = 5) -> float:
    """What this machine reads from DRAM with torch's threads: the physical limit of decode."""
    import torch

    buf = torch.ones(n_bytes // 4)
    buf.sum()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return n_bytes / best / 1e9


def bench_moeray(path: str, batch_sizes, n_prompt: int, n_decode: int, caches=("0", "all"),
                 route: str | None = None) -> list[dict]:
    """One row per (expert cache, batch). Cache "0": every routed expert is computed from the GGUF
    mapping (the host path a miss takes); "all": every expert is resident in a slot (a card with
    room for the whole model); a size such as "200MiB" is a simulated budget filled uniformly."""
    from moeray.cluster.config import EngineConfig
    from moeray.cluster.engine import Generator
    from moeray.stages.gguf_file import GGUFFile
    from moeray.stages.model import load_cached, load_model
    from moeray.stages.sampling import SamplingParams
    from moeray.stages.tokenizer import Tokenizer
    from moeray.units import parse_size

    tokenizer = Tokenizer.from_gguf(path)
    params = SamplingParams(max_tokens=n_decode + 1, ignore_eos=True)  # +1: the first token comes from prefill
    config = EngineConfig(max_seqs=max(batch_sizes), max_len=n_prompt + n_decode + 8, token_budget=512,
                          prefill_chunk=n_prompt, micro_batches=1)
    rows = []
    cfg = GGUFFile(path).config
    for cache in caches if cfg.is_moe else ("0",):
        if cache == "0":
            model = load_model(path, route=route)
        else:
            n_slots = cfg.n_layers * cfg.n_experts if cache == "all" else None
            budget = None if cache == "all" else parse_size(cache)
            model, _ = load_cached(path, route=route, budget_bytes=budget, n_slots=n_slots)
        gen = Generator(model, tokenizer, config)
        gen.generate([prompt_ids(tokenizer, 16, 0)], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        per_token = bytes_per_token(model)
        for b in batch_sizes:
            gen.generate([prompt_ids(tokenizer, n_prompt, i) for i in range(b)], params)
            s = gen.stats
            rows.append({"engine": "moeray", "route": model.route, "cache": cache, "batch": b,
                         "prefill_tok_s": s.prefill_tok_s, "decode_tok_s": s.decode_tok_s,
                         "prefill_tokens": s.prefill_tokens, "decode_tokens": s.decode_tokens,
                         "weight_bytes_per_token": per_token})
        del gen, model
    return rows


def bench_llama_cpp(path: str, threads: int, n_prompt: int, n_decode: int) -> list[dict]:
    """llama-cpp-python's Llama runs one sequence, so batch 1 only."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return []
    from moeray.stages.tokenizer import Tokenizer

    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_prompt + n_decode + 8,
                n_batch=max(n_prompt, 8), logits_all=True, verbose=False)
    ids = prompt_ids(Tokenizer.from_gguf(path), n_prompt, 0)
    llm.reset()
    llm.eval(ids[:16])  # warm-up
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    prefill_s = time.perf_counter() - t0
    token = int(llm.scores[llm.n_tokens - 1].argmax())
    t0 = time.perf_counter()
    for _ in range(n_decode):
        llm.eval([token])
        token = int(llm.scores[llm.n_tokens - 1].argmax())
    decode_s = time.perf_counter() - t0
    return [{"engine": "llama.cpp", "cache": "-", "batch": 1, "prefill_tok_s": n_prompt / prefill_s, "decode_tok_s": n_decode / decode_s,
             "prefill_tokens": n_prompt, "decode_tokens": n_decode}]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the embedded default model)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for both engines (default: torch's)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--caches", default="0,all",
                    help="moeray expert caches to run: 0 (host path only), all (every expert resident), or sizes")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    if args.model:
        path = args.model
    else:
        from moeray.stages.default_model import default_model_path

        path = str(default_model_path())

    rows = bench_moeray(path, args.batch, args.prompt_tokens, args.decode_tokens, args.caches.split(","))
    rows += bench_llama_cpp(path, threads, args.prompt_tokens, args.decode_tokens)
    reference = {r["batch"]: r for r in rows if r["engine"] == "llama.cpp"}
    for r in rows:
        ref = reference.get(r["batch"])
        if r["engine"] == "moeray" and ref:
            r["prefill_vs_llama_cpp"] = r["prefill_tok_s"] / ref["prefill_tok_s"]
            r["decode_vs_llama_cpp"] = r["decode_tok_s"] / ref["decode_tok_s"]

    print(f"model {Path(path).name}, {threads} threads, {args.prompt_tokens} prompt tokens, "
          f"{args.decode_tokens} decode tokens per sequence, {platform.processor() or platform.machine()}")
    print(f"{'engine':<10} {'cache':>6} {'batch':>5} {'prefill tok/s':>14} {'decode tok/s':>13} {'prefill x':>10} {'decode x':>9}")
    for r in rows:
        px = f"{r['prefill_vs_llama_cpp']:.2f}" if "prefill_vs_llama_cpp" in r else "-"
        dx = f"{r['decode_vs_llama_cpp']:.2f}" if "decode_vs_llama_cpp" in r else "-"
        print(f"{r['engine']:<10} {r['cache']:>6} {r['batch']:>5} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.1f} {px:>10} {dx:>9}")
    if not reference:
        print("llama.cpp: not measured (pip install llama-cpp-python, i.e. the `llamacpp` extra)")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": path, "threads": threads, "cpu_count": os.cpu_count(),
                                               "prompt_tokens": args.prompt_tokens,
                                               "decode_tokens": args.decode_tokens, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
