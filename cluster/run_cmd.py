"""`moeray run [MODEL.gguf] --stages 4 [--simulate-devices 256MiB,...] --prompt TEXT ...`

Runs the whole product path once: Ray stage actors probe their devices, the planner places
the model over what they reported, each stage loads its layers, and the pipelined engine
generates every prompt as one continuous batch. Prints the plan, each completion, tokens/s
and each stage's expert-cache hit rate. Plan and timing lines go to stderr, texts to stdout.
"""
from __future__ import annotations

import argparse
import sys
import time

# With no GPU and no --simulate-devices, the default model runs on four simulated cards
# scaled to it: in float32 its trunk is ~330 MB and its 240 experts ~2.5 GB, so the caches
# hold a part of each stage's experts, as they would on real cards with a large model.
DEFAULT_SIMULATED = "256MiB,256MiB,192MiB,192MiB"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="GGUF file (default: the embedded upcycled SmolLM2 MoE)")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn with the chat template")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages, one device each (default 4)")
    p.add_argument("--simulate-devices", metavar="SIZES",
                   help="run the stages on CPU devices with these byte budgets, e.g. 256MiB,256MiB,192MiB,192MiB")
    p.add_argument("--spread", action="store_true", help="place stages on different nodes (SPREAD), not PACK")
    p.add_argument("--address", help="join this Ray cluster (default: start a local one)")
    p.add_argument("--objective", choices=("latency", "throughput"), default="latency")
    p.add_argument("--split", default="auto", help="auto, or K=8,15,23: the first layer of stages 1..S-1")
    p.add_argument("--profile", help="routing profile for the planner and the caches")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-seqs", type=int, default=8, help="sequences running at once (KV slots)")
    p.add_argument("--max-len", type=int, default=256, help="prompt + output tokens per sequence")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches in flight")
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument("--token-budget", type=int, default=128, help="new tokens per micro-batch step")
    p.add_argument("--step-timeout", type=float, default=120.0, help="seconds before a step counts as hung")


def run(args: argparse.Namespace) -> int:
    from moeray.cluster.cli import CLIError
    from moeray.stages.device import parse_sizes
    from moeray.stages.sampling import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if args.stages < 1:
        raise CLIError("--stages must be >= 1")
    sim = args.simulate_devices
    if sim is None and not _has_gpus(args.address):
        sim = ",".join(DEFAULT_SIMULATED.split(",")[: args.stages]) if args.stages <= 4 else None
        if sim is None:
            raise CLIError("no GPUs here: pass --simulate-devices with one size per stage")
        print(f"moeray run: no GPUs in the cluster, simulating {sim}", file=sys.stderr)
    simulate = parse_sizes(sim) if sim else None

    from moeray.cluster.driver import LaunchOptions, launch
    from moeray.cluster.engine import Engine, EngineConfig
    from moeray.cluster.generate_cmd import resolve_model
    from moeray.stages.gguf_file import GGUFFile
    from moeray.stages.tokenizer import Tokenizer

    path = resolve_model(args.model)
    gguf = GGUFFile(path)  # validate the whole file before any actor starts
    tok = Tokenizer.from_metadata(gguf.metadata, source=path)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) if args.chat else tok.encode(p) for p in args.prompt]
    del gguf

    opts = LaunchOptions(n_stages=args.stages, simulate=simulate, strategy="SPREAD" if args.spread else "PACK",
                         objective=args.objective, split=args.split, profile=args.profile,
                         max_seqs=args.max_seqs, max_len=args.max_len,
                         torch_threads=1 if simulate else None, address=args.address)
    launched = launch(path, opts, log=lambda line: print(line, file=sys.stderr))
    try:
        engine = Engine(launched.pipeline(), EngineConfig(
            max_seqs=args.max_seqs, max_len=args.max_len, token_budget=args.token_budget,
            prefill_chunk=args.prefill_chunk, micro_batches=args.micro_batches,
            step_timeout_s=args.step_timeout), eos_ids=tok.end_ids)
        t = time.perf_counter()
        reqs = engine.generate(prompts, params, timeout_s=max(600.0, args.step_timeout * 4))
        wall = time.perf_counter() - t
        for i, r in enumerate(reqs):
            if len(reqs) > 1:
                print(f"--- prompt {i + 1} ({r.finish_reason}):")
            print(tok.decode(r.output))
        n_out = sum(len(r.output) for r in reqs)
        first = [r.t_first - r.t_arrive for r in reqs if r.t_first is not None]
        print(f"generated {n_out} tokens for {len(reqs)} prompts in {wall:.2f} s: {n_out / wall:.2f} tok/s "
              f"({engine.stats['steps']} steps, first token after {max(first):.2f} s)", file=sys.stderr)
        for line in launched.stage_stat_lines():
            print(line, file=sys.stderr)
    finally:
        launched.shutdown()
    return 0


def _has_gpus(address: str | None) -> bool:
    from moeray.cluster.driver import ensure_ray

    ensure_ray(address)
    import ray

    return ray.cluster_resources().get("GPU", 0) >= 1
