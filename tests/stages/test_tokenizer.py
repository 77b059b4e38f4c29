"""The tokeniser built from a GGUF's own metadata matches the references: transformers' GGUF
tokenizer for SmolLM2 (byte-level BPE) and sentencepiece itself for an SPM vocabulary."""
from __future__ import annotations

import io

import pytest

from moeray.stages.text.tokenizer import Tokenizer

TEXTS = [
    "Hello world!",
    "In 2024, π≈3.14159 — naïve café, 日本語のテキスト, emoji 🙂👍🏽 and Ελληνικά.",
    "def f(x):\n    return x**2  # square\n\n\t\ttabs and\r\nCRLF",
    "  leading spaces, trailing spaces  ",
    "<|im_start|>user\nspecial tokens stay whole<|im_end|>\n",
    "",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_dense_path):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_gguf(smollm2_dense_path)
    theirs = AutoTokenizer.from_pretrained(str(smollm2_dense_path.parent), gguf_file=smollm2_dense_path.name)
    return ours, theirs


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_encode_decode_match_transformers(smollm2, text):
    ours, theirs = smollm2
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    if "<|" not in text:
        assert ours.decode(ids) == text  # byte-level BPE round-trips any text


def test_smollm2_special_ids(smollm2):
    ours, _ = smollm2
    assert ours.encode("<|im_start|>") == [1]
    assert ours.bos_id == 1 and ours.eos_id == 2 and not ours.add_bos
    # <|im_end|> ends a chat turn, <|endoftext|> a document: both end a generation; llama.cpp also
    # takes <reponame> (4) for a fill-in-the-middle repository token, which ends one too (its EOG set).
    assert ours.end_ids == {0, 2, 4}


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another?"},
        ],
    ],
)
def test_smollm2_chat_template_matches_transformers(smollm2, messages):
    ours, theirs = smollm2
    text = ours.apply_chat_template(messages)
    assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert ours.encode_chat(messages) == theirs.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]


def _spm_metadata():
    """A tiny sentencepiece BPE vocabulary trained here, stored as llama.cpp's converter stores
    one (tokens, scores, token types, special ids), with llama's normalisation (none)."""
    spm = pytest.importorskip("sentencepiece")
    corpus = (
        "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a step.\n"
        "To be, or not to be, that is the question. Hello world, hello moeray! Numbers 12345 and 3.14.\n"
        "Café naïve résumé. Pack my box with five dozen liquor jugs.\n"
    ) * 20
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus.splitlines()), model_writer=model, vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    n = sp.get_piece_size()

    def token_type(i):  # llama.cpp's LLAMA_TOKEN_TYPE_*
        return 2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1

    metadata = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": [token_type(i) for i in range(n)],
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
    }
    return sp, metadata


@pytest.mark.parametrize(
    "text",
    ["The quick brown fox", "Hello world, hello moeray!", "  two leading spaces", "日本語 🙂 unseen",
     "Numbers 12345\nnew line", "x"],
)
def test_spm_matches_sentencepiece(text):
    sp, metadata = _spm_metadata()
    tok = Tokenizer.from_metadata(metadata)
    ids = tok.encode(text)
    # llama.cpp adds BOS to an SPM vocabulary that does not say otherwise; sentencepiece never does.
    assert ids == [sp.bos_id()] + sp.encode(text)
    assert tok.decode(ids) == sp.decode(ids) == text
    assert tok.end_ids == {sp.eos_id()}


def test_missing_tokenizer_is_a_clear_error():
    from moeray.errors import GGUFError

    with pytest.raises(GGUFError, match="no tokenizer"):
        Tokenizer.from_metadata({"general.architecture": "llama"}, source="x.gguf")


def test_a_lone_surrogate_is_read_as_the_replacement_character(smollm2_dense_path):
    """"\\ud800" is valid JSON and a Python str can hold it (argv's undecodable bytes arrive as
    "\\udcff"), but it is no character: `tokenizers` refused the whole text (the server's 500).
    It is read as U+FFFD, the character a replacing UTF-8 encoder writes, and the rest is intact."""
    tok = Tokenizer.from_gguf(smollm2_dense_path)
    for text, read_as in (("a\ud800b", "a\ufffdb"), ("\udfff", "\ufffd"), ("x\udcff y \ud83d", "x\ufffd y \ufffd")):
        assert tok.encode(text) == tok.encode(read_as)
    assert tok.decode(tok.encode("a\ud800b")) == "a\ufffdb"
    chat = tok.encode_chat([{"role": "user", "content": "\ud800"}])
    assert chat == tok.encode_chat([{"role": "user", "content": "\ufffd"}])


def test_a_vocab_only_gguf_of_an_architecture_moeray_does_not_run_tokenizes(smollm2, smollm2_dense_path, tmp_path):
    """Only the tokenizer keys are read: no tensors, an unknown architecture, and the text is the
    model file's own tokenizer's."""
    import gguf

    from moeray.errors import UnsupportedArchitectureError
    from moeray.stages.gguf.reader import read_gguf_header
    from moeray.stages.text.tokenizer import read_tokenizer_metadata

    meta = read_tokenizer_metadata(smollm2_dense_path)
    path = tmp_path / "vocab-only.gguf"
    w = gguf.GGUFWriter(path, "not-an-architecture")
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError):
        read_gguf_header(path)
    ours, model = Tokenizer.from_gguf(path), smollm2[0]
    for text in TEXTS:
        assert ours.encode(text) == model.encode(text)
    assert (ours.pre, ours.bos_id, ours.end_ids) == ("smollm", 1, model.end_ids)


# ---------------------------------------------------------------- a text's bytes bound its tokens


def _bound_tokenizers(smollm2_dense_path):
    import glob

    yield "byte-level BPE (SmolLM2)", Tokenizer.from_gguf(smollm2_dense_path)
    yield "sentencepiece BPE, byte fallback", Tokenizer.from_metadata(_spm_metadata()[1])
    # llama.cpp's reference vocabularies where tests/llama_vocab.py has fetched them into the cache (no
    # download here): every one moeray reads
    from llama_vocab import _cache as vocab_cache

    for path in sorted(glob.glob(str(vocab_cache() / "ggml-vocab-*.gguf"))):
        try:
            yield path.rsplit("/", 1)[-1], Tokenizer.from_gguf(path)
        except Exception:  # noqa: BLE001 - an architecture transformers' converter does not know
            continue


@pytest.mark.slow  # every bundled vocabulary, hundreds of random texts each
def test_no_text_has_fewer_tokens_than_its_bytes_over_the_longest_token(smollm2_dense_path):
    """Tokenizer.min_tokens, the server's refusal of a prompt before tokenizing it, is a true lower
    bound: texts of every kind (runs of spaces and newlines, the vocabulary's longest tokens, special
    tokens written out, multi-byte characters, lone surrogates) never tokenize into fewer."""
    import random

    for name, tok in _bound_tokenizers(smollm2_dense_path):
        assert tok.max_token_bytes is not None, name
        rng = random.Random(0)
        vocab = tok.backend.get_vocab()
        longest = sorted(vocab.values(), key=lambda i: -len(tok.backend.id_to_token(i).encode()))[:20]
        vocab = list(vocab)
        pieces = [" ", "  ", "\n", "\n\n  ", "\t", "a", "the ", "日本", "🙂", "é", "ﬁ", "Ａ", "0123", "x" * 40,
                  " " * 200, "\ud800", "<|im_start|>", "<s>"] + [tok.token_text(i) for i in longest]
        for _ in range(60):
            parts = rng.choices(pieces + rng.sample(vocab, 5), k=rng.randrange(1, 300))
            text = "".join(parts)
            assert len(tok.encode(text, add_bos=False)) >= tok.min_tokens(text), (name, text[:80])
        # Each of the longest tokens written 50 times: the bound holds, and is not vacuous.
        for i in longest:
            text = tok.decode([i] * 50)
            assert len(tok.encode(text, add_bos=False)) >= tok.min_tokens(text), (name, text[:80])
        if name.startswith("ggml-vocab-"):  # llama.cpp's splits may cut a long token's repeats apart
            continue  # (gpt-neox: 50 runs of 39 spaces are 1067 tokens there, and here)
        text = tok.decode([longest[0]] * 50)
        assert len(tok.encode(text, add_bos=False)) <= 8 * tok.min_tokens(text), name


def test_a_special_token_longer_than_every_other_sets_the_bound(smollm2_dense_path):
    from tokenizers import AddedToken

    tok = Tokenizer.from_gguf(smollm2_dense_path)
    long = "<|" + "reserved_" * 30 + "|>"  # 274 bytes, one token when written in a text
    tok.backend.add_special_tokens([AddedToken(long, special=True, normalized=False)])
    text = long * 100
    assert len(tok.encode(text, add_bos=False)) == 100 >= tok.min_tokens(text)


def test_a_normalizer_that_may_shrink_a_text_gives_no_bound(smollm2_dense_path):
    """NFKC writes "ﬁ" (3 bytes) as "fi" (2), a full-width "Ａ" (3) as "A" (1): bytes no longer bound
    tokens, so no prompt is refused on its bytes (it is tokenized and counted instead)."""
    import dataclasses

    from tokenizers import normalizers

    tok = Tokenizer.from_gguf(smollm2_dense_path)
    backend = tok.backend.__class__.from_str(tok.backend.to_str())
    backend.normalizer = normalizers.NFKC()
    shrinking = dataclasses.replace(tok, backend=backend)
    assert shrinking.max_token_bytes is None and shrinking.min_tokens("Ａ" * 10_000) == 0
    assert tok.min_tokens("word " * 4_000_000) > 200_000  # a 20 MB prompt: refused on its bytes alone


def test_tokenizing_lets_other_threads_run(smollm2_dense_path):
    """A server tokenizes one request's prompt on a worker thread while its engine thread steps and
    its event loop answers others: Tokenizer.encode must let go of Python's GIL while it works
    (`tokenizers`' `encode` holds it; `encode_batch` does not). While a long text is being
    tokenized, this thread runs 20 times round a loop and finds the tokenizing still going on."""
    import threading

    tok = Tokenizer.from_gguf(smollm2_dense_path)
    text = "The quick brown fox jumps over the lazy dog. " * 25_000  # 1.1 MB: a second or more of tokenizing
    started, finished = threading.Event(), threading.Event()

    def work():
        started.set()
        tok.encode(text)
        finished.set()

    worker = threading.Thread(target=work)
    worker.start()
    started.wait()
    for _ in range(20):
        finished.wait(0.001)  # a Python-level wait: needs the GIL back after each
    still_going = not finished.is_set()
    worker.join()
    assert still_going, "this thread could not run while the text was being tokenized"
