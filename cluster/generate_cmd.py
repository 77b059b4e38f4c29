"""`moeray generate [MODEL.gguf] --prompt TEXT ...`: stream a completion from one process.

Text goes to stdout as it is generated; the timing and memory lines go to stderr, so
`moeray generate ... > out.txt` captures only the text.
"""
from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="GGUF file (default: the embedded upcycled SmolLM2 MoE)")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], metavar="STR", help="stop before this text (repeatable)")
    p.add_argument("--rebuild", action="store_true", help="rebuild the embedded default model first")


def resolve_model(path: str | None, rebuild: bool = False) -> str:
    """The GGUF to run: the given file, or the embedded default model (built on first use)."""
    from pathlib import Path

    if path is None:
        from stages.default_model import default_model_path

        return str(default_model_path(rebuild=rebuild))
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such file")
    return path


def run(args: argparse.Namespace) -> int:
    from stages.errors import MoerayError
    from stages.sampling import SamplingParams

    # Parameter errors before the (slow) load.
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            seed=args.seed, stop=tuple(args.stop),
        )
    except ValueError as exc:
        raise MoerayError(str(exc)) from None
    path = resolve_model(args.model, args.rebuild)

    from stages.gguf_file import GGUFFile
    from stages.generate import Generator
    from stages.model import load_model, memory_report
    from stages.tokenizer import Tokenizer

    gguf = GGUFFile(path)  # validates the whole file before anything is loaded
    tokenizer = Tokenizer.from_metadata(gguf.metadata, source=path)
    model = load_model(gguf)
    prompt = tokenizer.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else tokenizer.encode(args.prompt)

    generator = Generator(model, tokenizer)
    for delta in generator.stream(prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    s = generator.stats
    print(
        f"prefill: {s.prefill_tokens} tokens in {s.prefill_s:.2f} s ({s.prefill_tok_s:.1f} tok/s); "
        f"decode: {s.decode_tokens} tokens in {s.decode_s:.2f} s ({s.decode_tok_s:.1f} tok/s)",
        file=sys.stderr,
    )
    print(_format_memory(memory_report(model)), file=sys.stderr)
    return 0


def _format_memory(report: dict) -> str:
    def mib(n):
        return f"{n / 2**20:.0f} MiB"

    parts = [f"{k.removesuffix('_bytes').replace('_', ' ')} {mib(v)}" for k, v in report.items() if k.endswith("_bytes")]
    return "memory: " + ", ".join(parts)
