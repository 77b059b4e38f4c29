"""`moeray logits [MODEL.gguf] --tokens "1 2 3" -o out.npy`: float32 logits [T, vocab] at every
position of one sequence, for parity checks against other engines."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="GGUF file (default: the embedded upcycled SmolLM2 MoE)")
    p.add_argument("--tokens", required=True, help='token ids separated by spaces or commas, e.g. "1 2 3"')
    p.add_argument("-o", "--output", required=True, help="the .npy file to write")
    p.add_argument("--exact", action="store_true",
                   help="float32 weights (dequantised once) instead of the quantised backend: for comparing "
                        "with float references such as transformers")


def parse_tokens(text: str) -> list[int]:
    from moeray.errors import MoerayError

    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise MoerayError(f"--tokens must be integers separated by spaces, got {text!r}") from None
    if not ids:
        raise MoerayError("--tokens is empty")
    return ids


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from moeray.cluster.config import resolve_model
    from moeray.errors import MoerayError

    ids = parse_tokens(args.tokens)
    path = resolve_model(args.model)

    from moeray.stages.runtime.model import load_model

    model = load_model(path, backend="exact" if args.exact else None)
    vocab = model.config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise MoerayError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    if len(ids) > model.config.context_length:
        raise MoerayError(f"{len(ids)} tokens exceed the context length {model.config.context_length}")
    logits = model.logits_all(ids).float().cpu().numpy()
    np.save(args.output, logits.astype(np.float32, copy=False))
    print(f"wrote {args.output}: float32 {list(logits.shape)}")
    return 0
