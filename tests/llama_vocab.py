"""llama.cpp's tokenizer test vocabularies (models/ggml-vocab-*.gguf, vocab-only GGUFs, with their
.inp strings and the .out token ids the original tokenizers give), from the llama-cpp-python sdist
on PyPI. Fetched once per machine into the moeray cache ($MOERAY_CACHE_DIR or ~/.cache/moeray),
never committed; a test that needs them skips, saying why, when PyPI cannot be reached.
$LLAMA_CPP_SDIST names a local copy of the sdist to take them from instead."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist the vectors come from (llama.cpp of that release)
SEP = "\n__ggml_vocab_test__\n"


def _cache() -> Path:
    from moeray.stages.gguf.default_model import cache_dir

    return cache_dir() / f"llama-vocab-{LLAMA_CPP_PYTHON}"


def _sdist(tmp: Path) -> Path:
    local = os.environ.get("LLAMA_CPP_SDIST")
    if local:
        return Path(local)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(tmp)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.skip(f"llama.cpp's vocab test files: `pip download llama-cpp-python=={LLAMA_CPP_PYTHON}` took over "
                    "15 minutes (is PyPI reachable?)")
    found = sorted(tmp.glob("llama_cpp_python-*.tar.gz"))
    if r.returncode != 0 or not found:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"llama.cpp's vocab test files come from the llama-cpp-python sdist on PyPI, which could not be "
                    f"fetched ({last}); set LLAMA_CPP_SDIST to a local copy")
    return found[0]


def vocab_dir() -> Path:
    """The folder holding ggml-vocab-*.gguf with .inp/.out, fetched and unpacked on first use."""
    d = _cache()
    if (d / "ggml-vocab-qwen2.gguf.out").is_file():
        return d
    with tempfile.TemporaryDirectory() as tmp:
        sdist = _sdist(Path(tmp))
        staging = Path(tmp) / "vocab"
        staging.mkdir()
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                name = os.path.basename(m.name)
                if m.isfile() and "/vendor/llama.cpp/models/" in m.name and name.startswith("ggml-vocab-"):
                    with tar.extractfile(m) as src, open(staging / name, "wb") as dst:
                        shutil.copyfileobj(src, dst)
        if not (staging / "ggml-vocab-qwen2.gguf.out").is_file():
            pytest.skip(f"{sdist} holds no vendor/llama.cpp/models/ggml-vocab-* files")
        d.parent.mkdir(parents=True, exist_ok=True)
        try:
            staging.rename(d)  # whole or not at all: another test process may be doing the same
        except OSError:
            if not (d / "ggml-vocab-qwen2.gguf.out").is_file():
                raise
    return d


def vocab_cases(gguf: Path) -> list[tuple[str, list[int]]]:
    """The (text, token ids) pairs of a vocab's .inp/.out, split as llama.cpp's test-tokenizer-0 does."""
    raw = gguf.with_name(gguf.name + ".inp").read_text(encoding="utf-8")
    texts, pos = [], 0
    while pos < len(raw):
        nxt = raw.find(SEP, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(SEP)
    outs = [[int(t) for t in line.split()] for line in gguf.with_name(gguf.name + ".out").read_text().splitlines()]
    assert len(texts) == len(outs), gguf
    return list(zip(texts, outs))


def with_pre(src: Path, dst: Path, pre: str) -> Path:
    """A copy of the vocab-only GGUF `src` whose tokenizer.ggml.pre is `pre`, every other byte as it
    is (the key's value replaced in place; the file holds no tensors to move)."""
    import io
    import struct

    from moeray.stages.gguf.reader import _Cursor

    data = Path(src).read_bytes()
    cur = _Cursor(io.BytesIO(data), str(src), len(data))
    cur.need(24)
    cur.pos = 8
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    assert n_tensors == 0, f"{src}: not a vocab-only GGUF"
    value = pre.encode()
    kv = struct.pack("<Q", 18) + b"tokenizer.ggml.pre" + struct.pack("<IQ", 8, len(value)) + value
    span = None
    for _ in range(n_kv):
        start = cur.pos
        key = cur.string()
        cur.value(cur.unpack("<I"))
        if key == "tokenizer.ggml.pre":
            span = (start, cur.pos)
    if span is None:  # no pre at all: add one
        out = data[:16] + struct.pack("<Q", n_kv + 1) + data[24:cur.pos] + kv + data[cur.pos:]
    else:
        out = data[:span[0]] + kv + data[span[1]:]
    Path(dst).write_bytes(out)
    return Path(dst)
