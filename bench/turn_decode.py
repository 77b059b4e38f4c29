"""A conversation's next turn decodes as fast as its first: the decode time per token of turn 1 and
of turn 2 (whose prompt is turn 1's prompt, its answer and more, its prefix reused from the KV
cache) in moeray and in llama-server, on the same file with the same threads, in the same run.

Why: attention reads a sequence's keys as one view of the KV pool only where its blocks are
consecutive; any other block table is gathered into a copy, every layer, every step
(stages/blocks/kv_cache.py). A returning turn reuses its prefix's blocks, so where its new blocks
do not follow them every token of the turn pays that copy, which grows with the context
(cluster/kv_blocks.py, "Where blocks go"). The "consecutive" column says whether turn 2's blocks
were one run when it ended.

Turn 1 sends --prompt-tokens and decodes --decode-tokens (greedy, end tokens ignored); turn 2 sends
that prompt, turn 1's answer and --new-tokens more and decodes as many. moeray runs in this process
over the pipeline `moeray serve --local` builds (LocalPipeline.from_file), its figure the median of
the engine's decode steps; llama-server runs as a child (/completion with token ids, one slot),
its figure its own `timings.predicted_per_token_ms`.

    python bench/turn_decode.py [--model F.gguf | --shape qwen3-30b-a3b] [--prompt-tokens 3000]
                                [--decode-tokens 64] [--new-tokens 32] [--threads 2]
                                [--llama-server PATH] [--json out.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from multi_turn import _post, llama_server  # noqa: E402
from results import write_results  # noqa: E402

from moeray.cluster.kv_blocks import consecutive  # noqa: E402
from moeray.environment import llama_cpp_tool  # noqa: E402


def moeray_turns(path: str, prompt: list[int], n_decode: int, new: list[int]) -> dict:
    """Turn 1 then turn 2 through a one-process engine with room for both conversations' blocks."""
    import torch

    from moeray.cluster.config import EngineConfig, ServeOptions
    from moeray.cluster.engine import Engine
    from moeray.cluster.local_pipeline import LocalPipeline
    from moeray.stages.blocks.kv_cache import blocks_for
    from moeray.stages.text.sampling import SamplingParams

    total = len(prompt) + 2 * n_decode + len(new) + 16
    blocks = 2 * blocks_for(total) + 8
    pipe = LocalPipeline.from_file(path, blocks, ServeOptions().local_budget, max_seqs=1)
    eng = Engine(pipe, EngineConfig(max_seqs=1, max_len=total, micro_batches=1, kv_blocks=blocks))
    params = SamplingParams(max_tokens=n_decode, ignore_eos=True)

    def turn(ids: list[int]) -> tuple[list[int], list[float], bool, int]:
        req = eng.add(ids, params)
        steps, joined = [], True
        while not req.done:
            eng.step()
            if len(req.output) > 1:  # a decode step (the first token ends the prefill)
                steps.append((eng.last_step.end - eng.last_step.start) / 1e6)
            if req.table:
                joined = consecutive(req.table)
        return list(req.output), steps, joined, req.cached_tokens

    with torch.inference_mode():
        turn(prompt[:64])  # warm the graphs
        answer, steps1, joined1, _ = turn(prompt)
        _, steps2, joined2, reused = turn(prompt + answer + new)
    return {"engine": "moeray", "turn1_ms": statistics.median(steps1), "turn2_ms": statistics.median(steps2),
            "turn1_consecutive": joined1, "turn2_consecutive": joined2, "turn2_reused": reused,
            "turn2_prompt": len(prompt) + len(answer) + len(new)}


def llama_server_turns(exe: str, path: str, threads: int, prompt: list[int], n_decode: int,
                       new: list[int]) -> dict | None:
    if not (exe and Path(exe).exists()):
        return None
    ctx = len(prompt) + 2 * n_decode + len(new) + 64
    with llama_server(exe, path, threads, ctx) as port:
        base = {"temperature": 0, "ignore_eos": True, "cache_prompt": True, "return_tokens": True,
                "n_predict": n_decode}
        _post(port, {**base, "prompt": prompt[:64]}, 3600)  # warm-up
        first, _ = _post(port, {**base, "prompt": prompt}, 3600)
        second, _ = _post(port, {**base, "prompt": prompt + first["tokens"] + new}, 3600)
        return {"engine": "llama-server", "turn1_ms": first["timings"]["predicted_per_token_ms"],
                "turn2_ms": second["timings"]["predicted_per_token_ms"],
                "turn2_reused": len(prompt) + len(first["tokens"]) + len(new) - second["timings"]["prompt_n"],
                "turn2_prompt": len(prompt) + len(first["tokens"]) + len(new)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the embedded default model)")
    ap.add_argument("--shape", help="a real model's shape with random blocks (bench/shapes.py), e.g. qwen3-30b-a3b")
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="both engines this many times, in turn")
    ap.add_argument("--llama-server", default=llama_cpp_tool("llama-server"),
                    help="llama.cpp's llama-server (default: in the folder LLAMA_CPP_BIN names, else on PATH)")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    import torch

    from decode import prompt_ids
    from moeray.stages.kernels.threads import set_threads
    from moeray.stages.text.tokenizer import Tokenizer

    if args.shape:
        from shapes import write_shape

        args.model = str(write_shape(args.shape))
    elif not args.model:
        from moeray.stages.gguf.default_model import default_model_path

        args.model = str(default_model_path())
    torch.set_num_threads(args.threads)
    set_threads(args.threads)
    tok = Tokenizer.from_gguf(args.model)
    prompt = prompt_ids(tok, args.prompt_tokens, 0)
    new = prompt_ids(tok, args.new_tokens, 7)
    rounds = []
    for _ in range(args.repeat):
        mine = moeray_turns(args.model, prompt, args.decode_tokens, new)
        ref = None if args.no_llama_cpp else llama_server_turns(args.llama_server, args.model, args.threads,
                                                                 prompt, args.decode_tokens, new)
        rounds.append((mine, ref))
    print(f"model {Path(args.model).name}, {args.threads} threads; turn 1: {args.prompt_tokens} prompt tokens, "
          f"{args.decode_tokens} decoded; turn 2: those + {args.new_tokens} new, {args.decode_tokens} decoded")
    print("| engine | turn 1 ms/token | turn 2 ms/token | turn 2 / turn 1 | turn 2 reused | consecutive | "
          "turn 2 vs llama-server |")
    print("|---|---|---|---|---|---|---|")
    for mine, ref in rounds:
        for r in (ref, mine):
            if r is None:
                continue
            vs = f"{ref['turn2_ms'] / r['turn2_ms']:.2f}x" if ref is not None and r is mine else ""
            joined = {True: "yes", False: "no"}.get(r.get("turn2_consecutive"), "")
            print(f"| {r['engine']} | {r['turn1_ms']:.2f} | {r['turn2_ms']:.2f} | {r['turn2_ms'] / r['turn1_ms']:.2f} | "
                  f"{r['turn2_reused']} of {r['turn2_prompt']} | {joined} | {vs} |")
    rows = [r for pair in rounds for r in pair if r is not None]
    if args.json:
        write_results(args.json, {"model": args.model, "threads": args.threads, "prompt_tokens": args.prompt_tokens,
                                  "decode_tokens": args.decode_tokens, "new_tokens": args.new_tokens, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
