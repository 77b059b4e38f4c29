"""Prefill and decode at depth with each KV cache type, moeray beside llama.cpp's llama-bench run with
the same cache types (-ctk / -ctv, flash attention on), on the same file with the same threads.

For each type and depth moeray holds one sequence of `depth` tokens (prefilled in 512-token chunks,
not timed), then times a 512-token prompt chunk on top of it (llama-bench's pp512 @ dN) and,
the sequence cut back to `depth` tokens, --decode-tokens greedy tokens from there (tg @ dN: over
`depth` keys and on, as llama-bench's; not over the chunk's 512 more), every routed expert on the host path, one
stage in this process: what `moeray serve --local` runs. The decode is timed --decode-rounds times
after an untimed round that builds its graphs (llama-bench warms up too), and the median reported
(a round that builds them ran q8_0 at 4,096 at 23.8 tok/s, the next two 24.6, default model).
llama-bench's -d fills its context to the same depth before each measured run.

    python bench/kv_types.py [--model F.gguf | --shape qwen3-30b-a3b] [--types f16,q8_0]
                             [--depths 0,4096,16384] [--threads 2] [--decode-tokens 32] [--decode-rounds 3]
                             [--llama-bin DIR] [--json out.json]

A 30B-shaped file maps ~16 GiB: run one such bench at a time on a shared machine.
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

from moeray.environment import llama_cpp_tool  # noqa: E402

CHUNK = 512


def moeray_rows(path: str, types: list[str], depths: list[int], n_decode: int, rounds: int = 3) -> list[dict]:
    import torch

    from decode import prompt_ids
    from moeray.planner.kv import KVTypes
    from moeray.stages.runtime.model import load_model
    from moeray.stages.text.tokenizer import Tokenizer

    model = load_model(path)
    tok = Tokenizer.from_gguf(path)
    ids = prompt_ids(tok, max(depths) + CHUNK + 64, 0)
    rows = []
    with torch.inference_mode():
        for t in types:
            for depth in depths:
                kv = model.new_kv_cache(1, depth + CHUNK + n_decode + 8, KVTypes.same(t))
                for start in range(0, depth, CHUNK):  # the context, not timed
                    model.step([ids[start:min(depth, start + CHUNK)]], [0], kv)
                if depth == 0:  # the graphs built once before the timed chunk, as at any depth
                    model.step([ids[:8]], [0], kv)
                    kv.reset(0)
                t0 = time.perf_counter()
                logits = model.step([ids[depth:depth + CHUNK]], [0], kv)
                prefill_s = time.perf_counter() - t0
                first = int(logits[0].argmax())
                rates = []
                # decode from `depth`, as llama-bench's tg @ dN does (not after the chunk): a warm-up round,
                # then `rounds`; a model with a recurrent state decodes once, after the chunk (its state
                # cannot be cut back)
                for _ in range(rounds + 1 if kv.state is None else 1):
                    if kv.state is None:
                        kv.lengths[0] = depth
                    nxt = first
                    t0 = time.perf_counter()
                    for _ in range(n_decode):
                        nxt = int(model.step([[nxt]], [0], kv)[0].argmax())
                    rates.append(n_decode / (time.perf_counter() - t0))
                if kv.state is None:  # the first round built the decode graphs: a warm-up, as llama-bench's
                    rates = rates[1:]
                rows.append({"engine": "moeray", "type": t, "depth": depth, "prefill_tok_s": CHUNK / prefill_s,
                             "decode_tok_s": statistics.median(rates), "decode_rounds": rates, "kv_bytes": kv.nbytes()})
                print(f"moeray    {t:5s} d{depth:<6d} pp{CHUNK} {rows[-1]['prefill_tok_s']:8.1f} tok/s  "
                      f"tg{n_decode} {rows[-1]['decode_tok_s']:7.2f} tok/s (median of {' '.join(f'{x:.2f}' for x in rates)})",
                      flush=True)
                del kv
    return rows


def read_cost(types: list[str], depth: int = 8192, layers: int = 12, heads: int = 9, kv_heads: int = 3,
              width: int = 64, reps: int = 10, threads: int = 2) -> dict[str, float]:
    """ns per cached value of a decode step's attention in each cache type: one query's ggml flash
    attention over `depth` keys in each of `layers` layers (the default model's heads: one stage's
    reads of a long sequence, out of the CPU's caches as a real step's are), the types in turn,
    the best of `reps` each (planner/kv.py READ_NS_PER_VALUE)."""
    import ctypes

    import torch

    from moeray.stages.kernels.backend import ggml_lib

    G = ggml_lib()
    per = depth * kv_heads * width * 4 * 2 * layers  # the float32 rows, the largest
    ctx = G.ggml_init(G.ggml_init_params(mem_size=len(types) * per + (64 << 20), mem_buffer=None, no_alloc=False))
    q = G.ggml_new_tensor_4d(ctx, G.GGML_TYPE_F32, width, 1, heads, 1)
    mask = G.ggml_new_tensor_4d(ctx, G.GGML_TYPE_F16, depth, 1, 1, 1)
    ctypes.memset(G.ggml_get_data(mask), 0, depth * 2)
    data = torch.randn(width * heads)
    ctypes.memmove(G.ggml_get_data(q), data.data_ptr(), data.numel() * 4)
    src = torch.randn(kv_heads * depth, width)
    graphs = {}
    for t in types:
        kind = getattr(G, f"GGML_TYPE_{t.upper()}")
        gf = G.ggml_new_graph(ctx)
        for _ in range(layers):
            k, v = (G.ggml_new_tensor_3d(ctx, kind, width, depth, kv_heads) for _ in range(2))
            for x in (k, v):  # random rows, as stored (quantised by ggml itself)
                if t == "f32":
                    ctypes.memmove(G.ggml_get_data(x), src.data_ptr(), src.numel() * 4)
                else:
                    G.ggml_quantize_chunk(kind, ctypes.cast(src.data_ptr(), ctypes.POINTER(ctypes.c_float)),
                                          G.ggml_get_data(x), 0, kv_heads * depth, width, None)
            o = G.ggml_flash_attn_ext(ctx, q, k, v, mask, width ** -0.5, 0.0, 0.0)
            G.ggml_flash_attn_ext_set_prec(o, G.GGML_PREC_F32)
            G.ggml_build_forward_expand(gf, o)
        graphs[t] = gf
    best = {t: float("inf") for t in types}
    for _ in range(reps):
        for t in types:  # in turn: a busy machine slows them alike
            t0 = time.perf_counter()
            G.ggml_graph_compute_with_ctx(ctx, graphs[t], threads)
            best[t] = min(best[t], time.perf_counter() - t0)
    G.ggml_free(ctx)
    values = depth * kv_heads * width * 2 * layers
    return {t: best[t] * 1e9 / values for t in types}


def llama_rows(llama_bench: str, path: str, types: list[str], depths: list[int], n_decode: int,
               threads: int, reps: int) -> list[dict]:
    rows = []
    for t in types:
        cmd = [llama_bench, "-m", path, "-t", str(threads), "-fa", "1", "-ctk", t, "-ctv", t,
               "-p", str(CHUNK), "-n", str(n_decode), "-d", ",".join(map(str, depths)), "-r", str(reps), "-o", "json"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"llama-bench {t} failed: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            continue
        got = {}
        for r in json.loads(out.stdout):
            kind = "prefill_tok_s" if r["n_prompt"] else "decode_tok_s"
            got.setdefault(r["n_depth"], {})[kind] = r["avg_ts"]
        for depth in depths:
            row = {"engine": "llama.cpp", "type": t, "depth": depth, **got.get(depth, {})}
            rows.append(row)
            print(f"llama.cpp {t:5s} d{depth:<6d} pp{CHUNK} {row.get('prefill_tok_s', 0):8.1f} tok/s  "
                  f"tg{n_decode} {row.get('decode_tok_s', 0):7.2f} tok/s", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the embedded default model)")
    ap.add_argument("--shape", help="a real model's shape with random blocks (bench/shapes.py), e.g. qwen3-30b-a3b")
    ap.add_argument("--types", default="f16,q8_0", help="cache types, both K and V (f32, f16, q8_0, q4_0)")
    ap.add_argument("--depths", default="0,4096,16384")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--decode-rounds", type=int, default=3,
                    help="moeray's timed decode rounds from `depth` (after one untimed round that builds the graphs, "
                         "as llama-bench warms up); the median is reported")
    ap.add_argument("--llama-bin", default=(str(Path(t).parent) if (t := llama_cpp_tool("llama-bench")) else None),
                    help="the folder of llama-bench (default: LLAMA_CPP_BIN's, or llama-bench on PATH); none: moeray alone")
    ap.add_argument("--llama-reps", type=int, default=1)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--read-cost", action="store_true",
                    help="only time one decode query's flash attention over --read-depth cached keys per type: the "
                         "planner's READ_NS_PER_VALUE")
    ap.add_argument("--read-depth", type=int, default=8192, help="--read-cost's cached keys (default 8192)")
    args = ap.parse_args()
    if args.read_cost:
        cost = read_cost(args.types.split(","), depth=args.read_depth, threads=args.threads)
        for t, ns in cost.items():
            print(f"{t:5s} {ns:.4f} ns per cached value")
        if args.json:
            Path(args.json).write_text(json.dumps({"read_ns_per_value": cost}, indent=1) + "\n")
        return 0

    import torch

    torch.set_num_threads(args.threads)
    from moeray.stages.kernels import settings

    settings.update(threads=args.threads)
    from shapes import bench_model

    path = bench_model(args.shape, args.model)
    types, depths = args.types.split(","), [int(d) for d in args.depths.split(",")]
    rows = moeray_rows(path, types, depths, args.decode_tokens, args.decode_rounds)
    if args.llama_bin and args.llama_bin != "none":  # "none": moeray alone, as --help says
        rows += llama_rows(str(Path(args.llama_bin) / "llama-bench"), path, types, depths, args.decode_tokens,
                           args.threads, args.llama_reps)
    print(f"\n{'type':6s} {'depth':>6s}  {'prefill x llama.cpp':>20s}  {'decode x llama.cpp':>19s}")
    ratios = []
    for t in types:
        for d in depths:
            m = next((r for r in rows if r["engine"] == "moeray" and r["type"] == t and r["depth"] == d), None)
            ll = next((r for r in rows if r["engine"] == "llama.cpp" and r["type"] == t and r["depth"] == d), None)
            if m and ll and ll.get("prefill_tok_s") and ll.get("decode_tok_s"):
                pr, dr = m["prefill_tok_s"] / ll["prefill_tok_s"], m["decode_tok_s"] / ll["decode_tok_s"]
                ratios.append({"type": t, "depth": d, "prefill_ratio": pr, "decode_ratio": dr})
                print(f"{t:6s} {d:6d}  {pr:19.2f}x  {dr:18.2f}x")
    if args.json:
        from results import write_results  # the run record (command, commit, date) docs tables need

        write_results(args.json, {"model": path, "threads": args.threads, "rows": rows, "ratios": ratios})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
