"""moeray's tokenizer equals llama.cpp's, from the tokenizer keys of a GGUF alone.

- llama.cpp's own test vectors: its vocab-only GGUFs (models/ggml-vocab-*.gguf) with the strings
  (.inp) and the ids the original tokenizers give (.out), every string of every vocabulary, read
  as llama.cpp's test-tokenizer-0 reads them (no BOS, control tokens' text read as text);
- the pre-tokenizers with no vocab file (deepseek-v3, glm4, kimi-k2, gpt-4o, smollm): llama.cpp's
  ids on its qwen2 vocabulary with `tokenizer.ggml.pre` rewritten, over digits, CJK, punctuation,
  code and whitespace (tests/pretok_strings.py), as recorded by tests/make_pretok_reference.py;
- where llama-cpp-python is installed, llama.cpp itself: every pre-tokenizer moeray offers, special
  tokens parsed and not, and each vocabulary's BOS, add_bos, special tokens and end-of-generation set.
The vocab files come from the llama-cpp-python sdist on PyPI (tests/llama_vocab.py: cached once
per machine, skipped saying why when PyPI cannot be reached).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from llama_vocab import vocab_cases, vocab_dir, with_pre
from moeray.stages.text.tokenizer import Tokenizer

# llama.cpp's vocab test files: byte-level BPE with their pre-tokenizers, and sentencepiece (spm, phi-3).
VOCABS = ["gpt-2", "llama-bpe", "llama-spm", "qwen2", "qwen35", "deepseek-llm", "deepseek-coder", "falcon", "mpt",
          "starcoder", "refact", "command-r", "phi-3"]
REFERENCE = Path(__file__).parents[1] / "data" / "llama_cpp_pretok.json"


@pytest.fixture(scope="module")
def vocabs() -> Path:
    return vocab_dir()


def _mismatches(tok: Tokenizer, cases, parse_special: bool = False) -> list[str]:
    bad = []
    for text, want in cases:
        got = tok.encode(text, add_bos=False, parse_special=parse_special)
        if got != want:
            bad.append(f"{text[:40]!r}: llama.cpp {want[:10]}, moeray {got[:10]}")
    return bad


@functools.cache
def _vocab_tokenizer(path: Path) -> Tokenizer:
    """One Tokenizer per bundled vocab file, shared by the tests that read it (building one takes
    about a second: the vocabulary and merges of a 150k-token BPE)."""
    return Tokenizer.from_gguf(path)  # a vocab-only GGUF: no model, no architecture moeray runs


@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpps_vocab_test_vectors(vocabs, name):
    path = vocabs / f"ggml-vocab-{name}.gguf"
    tok = _vocab_tokenizer(path)
    cases = vocab_cases(path)
    bad = _mismatches(tok, cases)
    assert not bad, f"{name} ({tok.pre or 'spm'}): {len(cases) - len(bad)}/{len(cases)} equal; " + "; ".join(bad[:5])


def _reference() -> dict:
    return json.loads(REFERENCE.read_text(encoding="utf-8"))


@pytest.mark.parametrize("pre", list(_reference()["ids"]))
def test_pre_tokenizers_without_a_vocab_file_split_as_llama_cpp(vocabs, tmp_path, pre):
    ref = _reference()
    tok = Tokenizer.from_gguf(with_pre(vocabs / "ggml-vocab-qwen2.gguf", tmp_path / f"{pre}.gguf", pre))
    assert tok.pre == pre
    cases = list(zip(ref["strings"], ref["ids"][pre]))
    bad = _mismatches(tok, cases)
    assert not bad, f"{pre}: {len(cases) - len(bad)}/{len(cases)} equal; " + "; ".join(bad[:5])


def test_an_unknown_pre_stops_naming_the_known_ones(vocabs, tmp_path):
    from moeray.errors import GGUFError

    path = with_pre(vocabs / "ggml-vocab-qwen2.gguf", tmp_path / "x.gguf", "not-a-pre")
    with pytest.raises(GGUFError) as err:
        Tokenizer.from_gguf(path)
    msg = str(err.value)
    assert "\n" not in msg and "unknown pre-tokenizer 'not-a-pre'" in msg and str(path) in msg
    assert "deepseek-v3" in msg and "kimi-k2" in msg and "qwen2" in msg


# ---------------------------------------------------------------- llama.cpp itself, where installed


def _llama_cpp():
    return pytest.importorskip("llama_cpp")  # the reason names what is missing (llama_cpp itself, or diskcache)


def _llama_vocab(llama_cpp, path: Path):
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


@pytest.mark.slow  # the recorded reference itself, against llama.cpp: one vocab per pre-tokenizer
def test_the_recorded_reference_is_what_llama_cpp_gives(vocabs, tmp_path):
    llama_cpp = _llama_cpp()
    ref = _reference()
    for pre, ids in ref["ids"].items():
        m = _llama_vocab(llama_cpp, with_pre(vocabs / "ggml-vocab-qwen2.gguf", tmp_path / f"{pre}.gguf", pre))
        assert [m.tokenize(s.encode(), add_bos=False, special=False) for s in ref["strings"]] == ids, pre
        m.close()


@pytest.mark.slow
def test_every_pre_tokenizer_offered_splits_as_llama_cpp(vocabs, tmp_path):
    """Each distinct rule moeray offers (one name per rule and merge setting), on the qwen2
    vocabulary, with control tokens parsed and not."""
    from pretok_strings import STRINGS

    from moeray.stages.text.pretokenize import PRE_NAMES

    llama_cpp = _llama_cpp()
    seen, report, failed = set(), [], []
    for name, pre in sorted(PRE_NAMES.items()):
        if (pre.rule, pre.ignore_merges) in seen:
            continue
        seen.add((pre.rule, pre.ignore_merges))
        path = with_pre(vocabs / "ggml-vocab-qwen2.gguf", tmp_path / "v.gguf", name)
        tok, m = Tokenizer.from_gguf(path), _llama_vocab(llama_cpp, path)
        for special in (False, True):
            want = [m.tokenize(s.encode(), add_bos=False, special=special) for s in STRINGS]
            bad = _mismatches(tok, list(zip(STRINGS, want)), parse_special=special)
            report.append(f"{name}{' (special)' if special else ''}: {len(STRINGS) - len(bad)}/{len(STRINGS)}")
            if bad:
                failed.append(f"{name}: {bad[:3]}")
        m.close()
    assert not failed, "; ".join(report) + " -- " + " | ".join(failed)


@pytest.mark.parametrize("name", VOCABS)
def test_special_tokens_add_bos_and_end_of_generation_as_llama_cpp(vocabs, name):
    llama_cpp = _llama_cpp()
    path = vocabs / f"ggml-vocab-{name}.gguf"
    tok, m = _vocab_tokenizer(path), _llama_vocab(llama_cpp, path)
    vocab = llama_cpp.llama_model_get_vocab(m.model)
    n = llama_cpp.llama_vocab_n_tokens(vocab)
    bos = llama_cpp.llama_vocab_bos(vocab)
    assert tok.bos_id == (None if bos < 0 else bos)
    assert tok.add_bos == bool(llama_cpp.llama_vocab_get_add_bos(vocab))
    assert tok.end_ids == {i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    whole = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
    assert tok.special_ids | tok.rendered_ids == {i for i in range(n) if llama_cpp.llama_vocab_get_attr(vocab, i) & whole}
    # a prompt with special tokens written in it, parsed as llama-server parses a prompt
    for text, _ in vocab_cases(path)[:12] + [("<|im_start|>user\nhi<|im_end|>\n<s>x</s><|endoftext|>", None)]:
        want = m.tokenize(text.encode(), add_bos=tok.add_bos, special=True)
        assert tok.encode(text, parse_special=True) == want, (name, text)
    m.close()
