"""Prefill and decode tokens/s of moeray on a GGUF (default: the embedded upcycled SmolLM2 MoE) at
batch 1 and 16, and of llama.cpp (llama-cpp-python, when installed) on the same file with the same
thread count in the same run, with the ratio, the weight bytes a decode token reads and the tok/s
the machine's measured read bandwidth allows for them.

    python bench/decode.py [--model X.gguf | --shape qwen3-30b-a3b] [--threads 2] [--batch 1 16]
                           [--backend auto] [--json out.json]

--shape writes (once, into the cache dir) a GGUF of a real model's exact shape with random valid
Q4_K blocks (bench/shapes.py: qwen3-30b-a3b, 16 GiB; qwen1.5-moe-a2.7b) and runs both engines on it,
every expert on the host path (cache 0: a copy of every expert would not fit beside the mapping).

Greedy decoding with end tokens ignored, so every run decodes exactly --decode-tokens per sequence.
Decode tokens/s at batch B counts all B sequences' tokens. --repeat N runs both engines N times, one
after the other, and shows each row's median (single runs on a shared 2-core machine vary by 5-10%).
--forced-tokens makes sequence i's every token FORCED_TOKEN + i in both engines (a logit bias on
moeray's side, the token fed on llama.cpp's), so both compute the same token streams: on a
random-weight shape file each engine's greedy text differs from the first token, and at batch > 1
its sequences then route to another number of distinct experts a step (bench/load.py
--forced-tokens does the same for served runs).
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/shapes.py, bench/results.py

from load import FORCED_TOKEN  # noqa: E402  (sequence i's token with --forced-tokens)
from results import write_results  # noqa: E402


def prompt_ids(tokenizer, n_tokens: int, index: int) -> list[int]:
    """A prompt of exactly n_tokens made from the bundled prompts, different for each index."""
    from moeray.stages.gguf.default_model import load_prompts

    prompts = load_prompts()
    ids: list[int] = []
    k = index
    while len(ids) < n_tokens:
        ids += tokenizer.encode(prompts[k % len(prompts)]["text"] + "\n")
        k += 1
    return ids[:n_tokens]


def bytes_per_token(model) -> int:
    """Weight bytes one decode token of one sequence reads: every trunk matrix once (the head
    included) and k routed experts per MoE layer, in the form the backend holds them."""
    cfg = model.config
    n = model.trunk_bytes()
    if cfg.is_moe:
        n += cfg.n_experts_used * sum(model.experts.slot_bytes(l) for l in range(model.first, model.end))
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


def use_layout(layout: str | None) -> str:
    """Apply a weight layout "REPACK:HOST" (StageOptions.repack on|fast|off, .host_experts
    mapped|repacked, stages/kernels/repack.py) to the models loaded next; None: this process's own."""
    from moeray.stages.kernels import repack, settings

    if layout is not None:
        mode, _, host = layout.partition(":")
        settings.update(repack=mode, host_experts=host or "mapped")  # a bad name fails here, before any load
    return f"{repack.mode()}:{repack.host_experts()}"


def bench_moeray(path: str, batch_sizes, n_prompt: int, n_decode: int, caches=("0", "all"),
                 backend: str | None = None, layouts=(None,), forced: bool = False) -> list[dict]:
    """One row per (layout, expert cache, batch). Cache "0": every routed expert is computed from
    the GGUF mapping (the host path a miss takes); "all": every expert is resident in a slot (a
    card with room for the whole model); a size such as "200MiB" is a simulated budget filled
    uniformly. Each layout (see use_layout) loads the model again, one after the other."""
    import gc

    from moeray.cluster.config import EngineConfig
    from moeray.cluster.generator import Generator
    from moeray.stages.gguf.reader import GGUFFile
    from moeray.stages.runtime.model import load_cached, load_model
    from moeray.stages.text.sampling import SamplingParams
    from moeray.stages.text.tokenizer import Tokenizer
    from moeray.units import parse_size

    tokenizer = Tokenizer.from_gguf(path)
    params = SamplingParams(max_tokens=n_decode + 1, ignore_eos=True)  # +1: the first token comes from prefill
    config = EngineConfig(max_seqs=max(batch_sizes), max_len=n_prompt + n_decode + 8, token_budget=512,
                          prefill_chunk=n_prompt, micro_batches=1)
    rows = []
    cfg = GGUFFile(path).config
    for layout in layouts:
        name = use_layout(layout)
        for cache in caches if cfg.is_moe else ("0",):
            t0 = time.perf_counter()
            if cache == "0":
                model = load_model(path, backend=backend)
            else:
                n_slots = cfg.n_layers * cfg.n_experts if cache == "all" else None
                budget = None if cache == "all" else parse_size(cache)
                model, _ = load_cached(path, backend=backend, budget_bytes=budget, n_slots=n_slots)
            load_s = time.perf_counter() - t0
            gen = Generator(model, tokenizer, config)
            gen.generate([prompt_ids(tokenizer, 16, 0)], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
            per_token = bytes_per_token(model)
            for b in batch_sizes:
                done = gen.generate([prompt_ids(tokenizer, n_prompt, i) for i in range(b)],
                                    [SamplingParams(max_tokens=n_decode + 1, ignore_eos=True,
                                                    logit_bias=((FORCED_TOKEN + i, 100.0),)) for i in range(b)]
                                    if forced else params)
                if forced and any(c.token_ids != [FORCED_TOKEN + i] * (n_decode + 1) for i, c in enumerate(done)):
                    raise SystemExit("--forced-tokens: a sequence's tokens were not the forced ones; the streams "
                                     "would differ from llama.cpp's")
                s = gen.stats
                rows.append({"engine": "moeray", "backend": model.backend, "layout": name, "cache": cache,
                             "batch": b, "prefill_tok_s": s.prefill_tok_s, "decode_tok_s": s.decode_tok_s,
                             "prefill_tokens": s.prefill_tokens, "decode_tokens": s.decode_tokens,
                             "weight_bytes_per_token": per_token, "load_s": load_s})
            del gen, model
            gc.collect()  # a repacked host copy is gigabytes: gone before the next load
    return rows



def llama_greedy_step(L, ctx, batch, n_vocab: int, seqs: list[list[int]], start: int) -> list[int]:
    """One llama_decode through llama-cpp-python's low-level API: append seqs[i] to sequence i
    (positions from start) in `batch`; the greedy next token of each."""
    import ctypes

    import numpy as np

    n, last = 0, []
    for i, toks in enumerate(seqs):
        for j, t in enumerate(toks):
            batch.token[n], batch.pos[n], batch.n_seq_id[n] = t, start + j, 1
            batch.seq_id[n][0] = i
            batch.logits[n] = j == len(toks) - 1
            n += 1
        last.append(n - 1)
    batch.n_tokens = n
    if L.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed")
    return [int(np.ctypeslib.as_array(ctypes.cast(L.llama_get_logits_ith(ctx, k), ctypes.POINTER(ctypes.c_float)),
                                      shape=(n_vocab,)).argmax()) for k in last]

def profile_decode(path: str, n_prompt: int, n_decode: int, backend: str | None = None) -> dict:
    """Where a decode token's time goes at batch 1, every expert on the host path: wall time of
    each part of the stage's step (timers around the model's own methods), ms per token."""
    import torch

    from moeray.stages.blocks import attention as layers
    from moeray.stages.runtime import model as model_mod
    from moeray.stages.blocks import moe
    from moeray.stages.runtime import trunk_graph
    from moeray.stages.runtime.model import load_model
    from moeray.stages.text.tokenizer import Tokenizer

    model = load_model(path, backend=backend)
    spent: dict[str, float] = {}

    def timed(owner, name, part):
        real = getattr(owner, name)

        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                spent[part] = spent.get(part, 0.0) + time.perf_counter() - t
        setattr(owner, name, wrapper)
        return owner, name, real

    from moeray.stages.blocks import deltanet

    patches = [timed(layers.Attention, "forward", "attention (qkv, rope, kv write, sdpa, out proj)"),
               timed(deltanet.GatedDeltaNet, "forward", "Gated DeltaNet layers (torch ops between graphs)"),
               timed(trunk_graph.TrunkGraphs, "layer", "trunk graph (norms, qkv, rope, kv write, attention, "
                                                       "out proj, residual, router logits)"),
               timed(trunk_graph.TrunkGraphs, "stage", "stage graph (every layer's trunk, routing, experts)"),
               timed(trunk_graph.TrunkGraphs, "step", "trunk graph step inputs (positions, mask)"),
               timed(moe.MoEBlock, "route", "router + top-k"),
               timed(type(model.experts), "forward", "routed experts"),
               timed(model_mod, "rms_norm", "norms"),
               timed(model_mod.StageModel, "head", "final norm + lm head"),
               timed(model_mod.StageModel, "embed", "embedding"),
               timed(model_mod.StageModel, "batch_meta", "batch metadata")]
    try:
        ids = prompt_ids(Tokenizer.from_gguf(path), n_prompt, 0)
        kv = model.new_kv_cache(1, n_prompt + n_decode + 8)
        logits = model.step([ids], [0], kv)
        spent.clear()
        t0 = time.perf_counter()
        for _ in range(n_decode):
            logits = model.step([[int(logits[0].argmax())]], [0], kv)
        total = time.perf_counter() - t0
    finally:
        for owner, name, real in patches:
            setattr(owner, name, real)
    # The MoE block's own time holds the experts and the router: count each once.
    parts = {k: 1e3 * v / n_decode for k, v in spent.items()}
    parts["other (residual adds, python)"] = 1e3 * total / n_decode - sum(parts.values())
    return {"ms_per_token": 1e3 * total / n_decode, "parts": parts, "threads": torch.get_num_threads()}


def _quiet(level, text, user_data):  # llama.cpp logs every context it makes; the table is the output
    pass


def llama_cpp_in_child(path: str, threads: int, batch_sizes, n_prompt: int, n_decode: int,
                       forced: bool = False) -> list[dict]:
    """bench_llama_cpp in a child process: llama-cpp-python brings its own libggml, and one mapped
    beside ggml-python's would turn moeray's kernels off in this process (stages/kernels/ggml_lib.py)."""
    import subprocess

    cmd = [sys.executable, __file__, "--llama-cpp-child", "--model", path, "--threads", str(threads),
           "--prompt-tokens", str(n_prompt), "--decode-tokens", str(n_decode),
           "--batch", *map(str, batch_sizes), *(["--forced-tokens"] if forced else [])]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        print(f"llama.cpp: the child failed: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return []
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_llama_cpp(path: str, threads: int, batch_sizes, n_prompt: int, n_decode: int,
                    forced: bool = False) -> list[dict]:
    """llama.cpp (llama-cpp-python's bindings of llama.h) on the same file with the same threads:
    B sequences prefilled in one batch, then decoded together greedily, B tokens per llama_decode
    (what llama-batched-bench does). End tokens are ignored, as on moeray's side."""
    try:
        import llama_cpp as L
    except ImportError:
        return []
    import ctypes

    from moeray.stages.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(path)
    quiet = L.llama_log_callback(_quiet)  # kept referenced while C holds the pointer
    L.llama_log_set(quiet, ctypes.c_void_p())
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(path.encode(), mparams)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    rows = []
    for b in batch_sizes:
        cparams = L.llama_context_default_params()
        cparams.n_seq_max, cparams.kv_unified = b, True
        cparams.n_ctx = b * (n_prompt + n_decode + 16)
        cparams.n_batch = cparams.n_ubatch = max(b * n_prompt, 512)
        cparams.n_threads = cparams.n_threads_batch = threads
        ctx = L.llama_init_from_model(model, cparams)
        batch = L.llama_batch_init(b * n_prompt, 0, b)

        def decode(seqs: list[list[int]], start: int) -> list[int]:
            return llama_greedy_step(L, ctx, batch, n_vocab, seqs, start)

        decode([prompt_ids(tokenizer, 16, 0)], 0)  # warm-up
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        prompts = [prompt_ids(tokenizer, n_prompt, i) for i in range(b)]
        t0 = time.perf_counter()
        nxt = decode(prompts, 0)
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for step in range(n_decode):
            if forced:
                nxt = [FORCED_TOKEN + i for i in range(b)]
            nxt = decode([[t] for t in nxt], n_prompt + step)
        decode_s = time.perf_counter() - t0
        rows.append({"engine": "llama.cpp", "backend": "ggml", "cache": "-", "batch": b,
                     "prefill_tok_s": b * n_prompt / prefill_s, "decode_tok_s": b * n_decode / decode_s,
                     "prefill_tokens": b * n_prompt, "decode_tokens": b * n_decode})
        L.llama_batch_free(batch)
        L.llama_free(ctx)
    L.llama_model_free(model)
    return rows


def median_rows(rounds: list[list[dict]]) -> list[dict]:
    """One row per engine, layout, cache and batch: the first round's row with the median prefill and
    decode tok/s over the rounds (each round's figures kept as `decode_runs`, `prefill_runs`)."""
    import statistics

    out: dict[tuple, dict] = {}
    for rows in rounds:
        for r in rows:
            key = (r["engine"], r.get("layout"), r["cache"], r["batch"])
            row = out.setdefault(key, {**r, "decode_runs": [], "prefill_runs": []})
            row["decode_runs"].append(r["decode_tok_s"])
            row["prefill_runs"].append(r["prefill_tok_s"])
    for row in out.values():
        row["decode_tok_s"] = statistics.median(row["decode_runs"])
        row["prefill_tok_s"] = statistics.median(row["prefill_runs"])
    return list(out.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the embedded default model)")
    ap.add_argument("--shape", help="a real model's shape with random blocks (bench/shapes.py): "
                                    "qwen3-30b-a3b, qwen1.5-moe-a2.7b")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads for both engines (default 2)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--caches", default="0,all",
                    help="moeray expert caches to run: 0 (host path only), all (every expert resident), or sizes")
    ap.add_argument("--backend", "--kernels", dest="backend", choices=("auto", "ggml", "dequant", "exact"), default="auto",
                    help="moeray's matmul backend (auto: ggml when installed)")
    ap.add_argument("--layouts", help="moeray weight layouts to run one after the other, REPACK:HOST each "
                                      "(repack on|fast|off : host experts mapped|repacked), "
                                      "e.g. off:mapped,on:mapped,on:repacked (default: the environment's)")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp reference")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--profile", action="store_true",
                    help="also print where a batch-1 decode token's time goes (moeray, host path)")
    ap.add_argument("--forced-tokens", action="store_true",
                    help="sequence i's every token is token %d + i in both engines: the same token streams "
                         "(random-weight shape files, whose greedy text differs between engines)" % FORCED_TOKEN)
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of both engines one after the other; each row then shows the median (this machine's "
                         "single runs vary by 5-10%%)")
    ap.add_argument("--llama-cpp-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_cpp_child:  # the reference alone, rows as one JSON line (see llama_cpp_in_child)
        print(json.dumps(bench_llama_cpp(args.model, args.threads, args.batch, args.prompt_tokens,
                                         args.decode_tokens, args.forced_tokens)))
        return 0

    import torch

    torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    if args.shape:
        from shapes import write_shape

        path = str(write_shape(args.shape))
        if args.caches == ap.get_default("caches"):
            args.caches = "0"
    elif args.model:
        path = args.model
    else:
        from moeray.stages.gguf.default_model import default_model_path

        path = str(default_model_path())

    backend = None if args.backend == "auto" else args.backend
    layouts = args.layouts.split(",") if args.layouts else (None,)
    rounds, profile = [], None
    for n in range(args.repeat):  # the engines one after the other, round after round
        rows = bench_moeray(path, args.batch, args.prompt_tokens, args.decode_tokens, args.caches.split(","),
                            backend, layouts, args.forced_tokens)
        if args.profile and n == 0:  # before llama.cpp runs: the same pages in memory as moeray's rows saw
            profile = profile_decode(path, args.prompt_tokens, args.decode_tokens, backend)
        # The model's reference cycles keep a repacked host copy (15.5 GiB at the 30B shape) alive
        # until a collection: without this llama.cpp's child ran beside it and paged from disk.
        gc.collect()
        if not args.no_llama_cpp:
            rows += llama_cpp_in_child(path, threads, args.batch, args.prompt_tokens, args.decode_tokens,
                                       args.forced_tokens)
        rounds.append(rows)
    rows = median_rows(rounds)
    bandwidth = read_bandwidth_gb_s()
    reference = {r["batch"]: r for r in rows if r["engine"] == "llama.cpp"}
    for r in rows:
        ref = reference.get(r["batch"])
        if r["engine"] == "moeray" and ref:
            r["prefill_vs_llama_cpp"] = r["prefill_tok_s"] / ref["prefill_tok_s"]
            r["decode_vs_llama_cpp"] = r["decode_tok_s"] / ref["decode_tok_s"]
        if r.get("weight_bytes_per_token") and r["batch"] == 1:
            # One sequence reads every weight it uses once per token: the bandwidth bound.
            r["bandwidth_bound_tok_s"] = bandwidth * 1e9 / r["weight_bytes_per_token"]

    print(f"model {Path(path).name}, {threads} threads, {args.prompt_tokens} prompt tokens, "
          f"{args.decode_tokens} decode tokens per sequence"
          f"{f', median of {args.repeat} rounds' if args.repeat > 1 else ''}, {platform.processor() or platform.machine()}, "
          f"torch {torch.backends.cpu.get_cpu_capability()}, read bandwidth {bandwidth:.1f} GB/s")
    print(f"{'engine':<10} {'backend':>8} {'layout':>13} {'cache':>6} {'batch':>5} {'prefill tok/s':>14} "
          f"{'decode tok/s':>13} "
          f"{'prefill x':>10} {'decode x':>9} {'MB/token':>9} {'bound tok/s':>12}")
    for r in rows:
        px = f"{r['prefill_vs_llama_cpp']:.2f}" if "prefill_vs_llama_cpp" in r else "-"
        dx = f"{r['decode_vs_llama_cpp']:.2f}" if "decode_vs_llama_cpp" in r else "-"
        mb = f"{r['weight_bytes_per_token'] / 1e6:.0f}" if r.get("weight_bytes_per_token") else "-"
        bound = f"{r['bandwidth_bound_tok_s']:.0f}" if "bandwidth_bound_tok_s" in r else "-"
        print(f"{r['engine']:<10} {r['backend']:>8} {r.get('layout', '-'):>13} {r['cache']:>6} {r['batch']:>5} "
              f"{r['prefill_tok_s']:>14.1f} "
              f"{r['decode_tok_s']:>13.1f} {px:>10} {dx:>9} {mb:>9} {bound:>12}")
    if profile is not None:
        print(f"where a decode token's time goes (batch 1, host path): {profile['ms_per_token']:.1f} ms/token")
        for part, ms in sorted(profile["parts"].items(), key=lambda kv: -kv[1]):
            print(f"  {part:<52} {ms:7.2f} ms  {100 * ms / profile['ms_per_token']:5.1f}%")
    if not reference and not args.no_llama_cpp:
        print("llama.cpp: not measured (pip install llama-cpp-python, i.e. the `llamacpp` extra)")
    if args.json:
        write_results(args.json, {"model": path, "threads": threads, "read_bandwidth_gb_s": bandwidth,
                                  "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
                                  "forced_tokens": args.forced_tokens, "rounds": args.repeat,
                                  "rows": rows, "profile": profile})
    return 0


if __name__ == "__main__":
    sys.exit(main())
