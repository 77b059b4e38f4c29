"""Perplexity of a text with each KV cache type, moeray beside llama.cpp's llama-perplexity run with the
same cache types (-ctk / -ctv, flash attention on) on the same file and the same text.

The text is scored as llama-perplexity scores it: tokenised whole (a BOS first where the vocabulary
adds one), cut into chunks of --ctx tokens, each chunk evaluated fresh with its first token replaced
by BOS (where the vocabulary adds one), and every token of its second half predicted from the
ones before it: perplexity = exp(mean negative log-likelihood). moeray runs the chunk as one prompt
through one stage in this process (StageModel.logits_all, the pool in the type under test).

    python bench/perplexity.py --text FILE [--model F.gguf | --toy deepseek-v2-lite]
                               [--types f16,q8_0,q4_0,q4_0/f16] [--ctx 512] [--chunks N] [--threads 2]
                               [--llama-bin DIR] [--json out.json]

--toy NAME writes (once, into the cache dir) bench/shapes.py's toy-width copy of that family
(random blocks, the default model's tokeniser): an MLA file (deepseek-v2-lite) or a hybrid one
(qwen3.6-35b-a3b) on real text. Its perplexity is a random model's, but the same in both engines
and nearly the same at every cache type, which is what it checks.

A type is K and V alike (`q8_0`), or K/V apart (`q4_0/f16`: -ctk q4_0 -ctv f16).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moeray.environment import llama_cpp_tool  # noqa: E402


def toy_path(name: str) -> str:
    """bench/shapes.py's toy-width copy of `name` in the cache dir, written the first time."""
    from moeray.stages.gguf.default_model import cache_dir
    from shapes import SHAPES, shrink, write_shape

    if name not in SHAPES:
        raise SystemExit(f"--toy {name!r}: choose one of {', '.join(SHAPES)}")
    return str(write_shape(f"toy-{name}", shape=shrink(SHAPES[name]), path=cache_dir() / f"toy-{name}.gguf",
                           pool_blocks=1024))


def chunks_of(tokens: list[int], ctx: int, n_chunks: int | None, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: consecutive ctx-token windows, the first token of each BOS (if any)."""
    n = len(tokens) // ctx if n_chunks is None else min(n_chunks, len(tokens) // ctx)
    out = []
    for i in range(n):
        c = list(tokens[i * ctx:(i + 1) * ctx])
        if bos is not None:
            c[0] = bos
        out.append(c)
    return out


def kv_pair(spec: str) -> tuple[str, str]:
    """`q8_0` -> (q8_0, q8_0); `q4_0/f16` -> K q4_0, V f16."""
    k, _, v = spec.partition("/")
    return k, v or k


def moeray_ppl(path: str, text: str, types: list[str], ctx: int, n_chunks: int | None) -> list[dict]:
    import torch

    from moeray.planner.kv import KVTypes
    from moeray.stages.runtime.model import load_model
    from moeray.stages.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(path)
    tokens = tok.encode(text, parse_special=False)
    chunks = chunks_of(tokens, ctx, n_chunks, tok.bos_id if tok.add_bos else None)
    if not chunks:
        raise SystemExit(f"the text holds {len(tokens)} tokens, fewer than one chunk of {ctx}")
    model = load_model(path)
    first = ctx // 2
    rows = []
    for t in types:
        nll, count, t0 = 0.0, 0, time.perf_counter()
        with torch.inference_mode():
            for c in chunks:
                logits = model.logits_all(c, KVTypes(*kv_pair(t)))[first:ctx - 1].double()
                target = torch.tensor(c[first + 1:ctx])
                nll += float(-torch.log_softmax(logits, -1).gather(1, target.view(-1, 1)).sum())
                count += ctx - 1 - first
        rows.append({"engine": "moeray", "type": t, "ppl": math.exp(nll / count), "tokens": len(tokens),
                     "chunks": len(chunks), "scored": count, "seconds": time.perf_counter() - t0})
        print(f"moeray    {t:8s} PPL {rows[-1]['ppl']:.4f} ({len(chunks)} chunks of {ctx}, {len(tokens)} tokens)",
              flush=True)
    return rows


def llama_ppl(tool: str, path: str, text_file: str, types: list[str], ctx: int, n_chunks: int | None,
              threads: int) -> list[dict]:
    rows = []
    for t in types:
        cmd = [tool, "-m", path, "-f", text_file, "-c", str(ctx), "-t", str(threads), "-fa", "on",
               "-ctk", kv_pair(t)[0], "-ctv", kv_pair(t)[1]] + ([] if n_chunks is None else ["--chunks", str(n_chunks)])
        out = subprocess.run(cmd, capture_output=True, text=True)
        log = out.stdout + out.stderr
        m = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
        if out.returncode != 0 or m is None:
            print(f"llama-perplexity {t} failed: {log.strip().splitlines()[-1:]}", file=sys.stderr)
            continue
        n = re.search(r"over (\d+) chunks", log)
        rows.append({"engine": "llama.cpp", "type": t, "ppl": float(m.group(1)),
                     "chunks": int(n.group(1)) if n else None})
        print(f"llama.cpp {t:8s} PPL {rows[-1]['ppl']:.4f} ({rows[-1]['chunks']} chunks)", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", required=True, help="a plain-text file (a license, a book chapter): real text")
    ap.add_argument("--model", help="GGUF file (default: the embedded default model)")
    ap.add_argument("--toy", help="bench/shapes.py's toy-width copy of a family instead, e.g. deepseek-v2-lite (MLA), "
                                  "qwen3.6-35b-a3b (hybrid)")
    ap.add_argument("--types", default="f16,q8_0,q4_0",
                    help="cache types (f32, f16, q8_0, q4_0), K and V alike, or K/V apart: q4_0/f16")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama-perplexity -c)")
    ap.add_argument("--chunks", type=int, help="score at most this many chunks (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-bin", default=(str(Path(t).parent) if (t := llama_cpp_tool("llama-perplexity")) else None),
                    help="the folder of llama-perplexity (default: LLAMA_CPP_BIN's, or llama-perplexity on PATH); none: moeray alone")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from moeray.stages.kernels import settings

    settings.update(threads=args.threads)
    if args.toy:
        path = toy_path(args.toy)
    elif args.model:
        path = args.model
    else:
        from moeray.stages.gguf.default_model import default_model_path

        path = str(default_model_path())
    text = Path(args.text).read_text()
    types = args.types.split(",")
    rows = moeray_ppl(path, text, types, args.ctx, args.chunks)
    if args.llama_bin and args.llama_bin != "none":  # "none": moeray alone, as --help says
        rows += llama_ppl(str(Path(args.llama_bin) / "llama-perplexity"), path, args.text, types, args.ctx,
                          args.chunks, args.threads)
    mine = {r["type"]: r["ppl"] for r in rows if r["engine"] == "moeray"}
    ref = {r["type"]: r["ppl"] for r in rows if r["engine"] == "llama.cpp"}
    print(f"\n{'type':9s} {'moeray':>10s} {'vs f16':>8s} {'llama.cpp':>10s} {'vs llama.cpp':>13s}")
    for t in types:
        vs_f16 = f"{100 * (mine[t] / mine['f16'] - 1):+.2f}%" if "f16" in mine else "-"
        vs_ref = f"{100 * (mine[t] / ref[t] - 1):+.2f}%" if t in ref else "-"
        print(f"{t:9s} {mine[t]:10.4f} {vs_f16:>8s} {ref.get(t, float('nan')):10.4f} {vs_ref:>13s}")
    if args.json:
        from results import write_results  # the run record (command, commit, date) docs tables need

        write_results(args.json, {"model": path, "text": args.text, "ctx": args.ctx, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
