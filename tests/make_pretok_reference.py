"""Write tests/data/llama_cpp_pretok.json: llama.cpp's own token ids (llama-cpp-python, vocab_only)
for every string of tests/pretok_strings.py, on llama.cpp's qwen2 test vocabulary with its
`tokenizer.ggml.pre` rewritten to each pre-tokenizer that has no vocab test file of its own.

    .venv/bin/python tests/make_pretok_reference.py

CI has no llama-cpp-python; tests/stages/test_tokenizer_llama_cpp.py holds moeray to this file there, and
to llama.cpp itself where llama-cpp-python is installed (which also checks this file is current).
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from llama_vocab import LLAMA_CPP_PYTHON, vocab_dir, with_pre  # noqa: E402
from pretok_strings import STRINGS  # noqa: E402

# The pre-tokenizers without a vocab test file in llama.cpp's models/ (plus llama-bpe's rule
# under glm4's name, with merges ignored, and smollm's).
PRES = ["deepseek-v3", "glm4", "kimi-k2", "gpt-4o", "smollm"]
OUT = Path(__file__).parent / "data" / "llama_cpp_pretok.json"


def llama_cpp_ids(path: Path, texts: list[str], special: bool = False) -> list[list[int]]:
    import llama_cpp

    m = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        return [m.tokenize(t.encode(), add_bos=False, special=special) for t in texts]
    finally:
        m.close()


def _one_row_per_line(out: dict) -> str:
    """JSON with one string, or one string's ids, per line (diffs stay readable)."""
    dump = lambda x: json.dumps(x, ensure_ascii=False)  # noqa: E731
    head = ",\n".join(f" {dump(k)}: {dump(v)}" for k, v in out.items() if k not in ("strings", "ids"))
    strings = ",\n".join(f"  {dump(s)}" for s in out["strings"])
    ids = ",\n".join(f"  {dump(pre)}: [\n" + ",\n".join(f"   {dump(row)}" for row in rows) + "\n  ]"
                     for pre, rows in out["ids"].items())
    return "{\n" + head + ',\n "strings": [\n' + strings + '\n ],\n "ids": {\n' + ids + "\n }\n}\n"


def main() -> None:
    import llama_cpp

    src = vocab_dir() / "ggml-vocab-qwen2.gguf"
    out = {"made_by": "tests/make_pretok_reference.py", "llama_cpp_python": llama_cpp.__version__,
           "vocab": f"{src.name} (llama-cpp-python {LLAMA_CPP_PYTHON} sdist), tokenizer.ggml.pre rewritten",
           "strings": STRINGS, "ids": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for pre in PRES:
            out["ids"][pre] = llama_cpp_ids(with_pre(src, Path(tmp) / f"{pre}.gguf", pre), STRINGS)
    OUT.write_text(_one_row_per_line(out), encoding="utf-8")
    print(f"wrote {OUT}: {len(PRES)} pre-tokenizers x {len(STRINGS)} strings")


if __name__ == "__main__":
    main()
