"""`moeray run [MODEL.gguf] --stages 4 [--simulate-devices 256MiB,...] --prompt TEXT ...`

Runs the whole product path once: Ray stage actors probe their devices, the planner places
the model over what they reported, each stage loads its layers, and the pipelined engine
generates every prompt as one continuous batch. Prints the plan, each completion, tokens/s
and each stage's expert-cache hit rate. Plan and timing lines go to stderr, texts to stdout.
Defaults (stages, simulated cards, KV slots, step packing) are those of `moeray serve`
(cluster/config.py).
"""
from __future__ import annotations

import argparse
import sys
import time

from moeray.cluster.config import (add_chat_format_argument, add_engine_arguments, add_launch_arguments,
                                   engine_config_from_args,
                                   launch_options_from_args, simulated_devices)
from moeray.cluster.commands.generate import add_sampling_arguments, check_logit_bias, sampling_params_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="GGUF file (default: the embedded upcycled SmolLM2 MoE)")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn with the chat template")
    add_sampling_arguments(p)
    add_chat_format_argument(p)
    add_launch_arguments(p)
    add_engine_arguments(p)


def run(args: argparse.Namespace) -> int:
    from moeray.cluster.cli import CLIError

    params = sampling_params_from_args(args)
    if args.stages < 1:
        raise CLIError("--stages must be >= 1")
    engine_cfg = engine_config_from_args(args)
    opts = launch_options_from_args(args, simulated_devices(args, _has_gpus(args.address), "run"))

    from moeray.cluster.config import resolve_model
    from moeray.cluster.driver import launch
    from moeray.cluster.engine import Engine
    from moeray.stages.gguf.reader import GGUFFile
    from moeray.stages.text.chat import chat_format
    from moeray.stages.text.tokenizer import Tokenizer

    path = resolve_model(args.model)
    # The directory validated before any actor starts; the files themselves (every part) are
    # checked on the nodes that read them, once the plan says which (cluster/driver.py).
    gguf = GGUFFile(path, parts=())
    tok = Tokenizer.from_metadata(gguf.metadata, source=path)
    check_logit_bias(params, tok.vocab_size)
    fmt = chat_format(tok.chat_template, gguf.metadata.get("general.architecture"), getattr(args, "chat_format", None))
    tok = tok.with_rendered(fmt.markers())
    prompts = [tok.encode(fmt.render(tok, [{"role": "user", "content": p}]).prompt) if args.chat else tok.encode(p)
               for p in args.prompt]
    del gguf

    launched = launch(path, opts, engine_cfg, log=lambda line: print(line, file=sys.stderr))
    try:
        engine = Engine(launched.pipeline(), launched.engine, tok)  # the context and KV blocks the plan settled
        t = time.perf_counter()
        reqs = engine.generate(prompts, params, timeout_s=max(600.0, engine_cfg.step_timeout_s * 4))
        wall = time.perf_counter() - t
        for i, r in enumerate(reqs):
            if len(reqs) > 1:
                print(f"--- prompt {i + 1} ({r.finish_reason}):")
            print(r.text)
        n_out = sum(len(r.output) for r in reqs)
        first = [r.t_first - r.t_arrive for r in reqs if r.t_first is not None]
        print(f"generated {n_out} tokens for {len(reqs)} prompts in {wall:.2f} s: {n_out / wall:.2f} tok/s "
              f"({engine.stats.steps} steps, first token after {max(first):.2f} s)", file=sys.stderr)
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
