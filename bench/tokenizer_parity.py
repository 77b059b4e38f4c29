"""moeray's tokenizer against llama.cpp's, as a table: strings tokenized equal, per vocabulary and
per pre-tokenizer.

1. llama.cpp's vocab test files (models/ggml-vocab-*.gguf with .inp/.out, from the
   llama-cpp-python sdist on PyPI, cached as the tests cache them): every string, no BOS, control
   tokens' text read as text (llama.cpp's test-tokenizer-0).
2. Every pre-tokenizer moeray offers (stages/text/pretokenize.py), on llama.cpp's qwen2 vocabulary
   with `tokenizer.ggml.pre` rewritten to it, over tests/pretok_strings.py: against llama.cpp itself
   (llama-cpp-python, vocab_only) with control tokens read as text and parsed; without
   llama-cpp-python, the recorded reference (tests/data/llama_cpp_pretok.json) for the names it holds.

    .venv/bin/python bench/tokenizer_parity.py [--json parity.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from results import write_results  # noqa: E402

VOCABS = ["gpt-2", "llama-bpe", "llama-spm", "qwen2", "qwen35", "deepseek-llm", "deepseek-coder", "falcon", "mpt",
          "starcoder", "refact", "command-r", "phi-3"]


def equal(tok, cases, parse_special=False) -> int:
    return sum(tok.encode(t, add_bos=False, parse_special=parse_special) == want for t, want in cases)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args()

    import pytest

    from llama_vocab import vocab_cases, vocab_dir, with_pre
    from moeray.stages.text.pretokenize import PRE_NAMES
    from moeray.stages.text.tokenizer import Tokenizer
    from pretok_strings import STRINGS

    try:
        d = vocab_dir()
    except pytest.skip.Exception as exc:
        print(f"no vocab files: {exc}")
        return 1
    rows = []
    print(f"{'vocabulary / pre-tokenizer':<44} {'reference':<36} {'equal':>9}")
    for name in VOCABS:
        path = d / f"ggml-vocab-{name}.gguf"
        tok, cases = Tokenizer.from_gguf(path), vocab_cases(path)
        n = equal(tok, cases)
        rows.append({"what": f"ggml-vocab-{name} ({tok.pre or 'spm'})", "reference": "llama.cpp's .out",
                     "equal": n, "strings": len(cases)})
        print(f"{rows[-1]['what']:<44} {rows[-1]['reference']:<36} {n:>4}/{len(cases)}")
    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
    ref = json.loads((ROOT / "tests" / "data" / "llama_cpp_pretok.json").read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted(PRE_NAMES) if llama_cpp else list(ref["ids"]):
            path = with_pre(d / "ggml-vocab-qwen2.gguf", Path(tmp) / "v.gguf", name)
            tok = Tokenizer.from_gguf(path)
            if llama_cpp is None:
                checks = [("recorded llama.cpp ids", False, ref["ids"][name])]
            else:
                m = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
                checks = [(f"llama.cpp {llama_cpp.__version__}{', special' if sp else ''}", sp,
                           [m.tokenize(s.encode(), add_bos=False, special=sp) for s in STRINGS]) for sp in (False, True)]
                m.close()
            for label, sp, want in checks:
                n = equal(tok, list(zip(STRINGS, want)), parse_special=sp)
                rows.append({"what": f"{name} (qwen2 vocab)", "reference": label, "equal": n, "strings": len(STRINGS)})
                print(f"{rows[-1]['what']:<44} {label:<36} {n:>4}/{len(STRINGS)}")
    total = sum(r["equal"] for r in rows), sum(r["strings"] for r in rows)
    print(f"all: {total[0]}/{total[1]} strings equal")
    if args.json:
        write_results(args.json, rows)
    return 0 if total[0] == total[1] else 1


if __name__ == "__main__":
    sys.exit(main())
