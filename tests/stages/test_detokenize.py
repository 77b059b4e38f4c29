"""Generated tokens to released text (stages/text/detokenize.py): the incremental decoder gives
decode(all ids) while decoding a bounded window, and stop strings are found in one pass per step,
as a client streaming the text would see: cut before the earliest stop string, wherever it lies
across tokens, steps and multi-byte characters, and no part of one ever released."""
from __future__ import annotations

import random
import re

import pytest

from moeray.stages.text.detokenize import IncrementalDecoder, StopMatcher, StopStringStream
from fakes import CharTokenizer


def _stream(text, stop):
    s = StopStringStream(CharTokenizer(), stop)
    deltas = []
    for ch in text:
        deltas.append(s.push(ord(ch)))
        if s.stopped:
            break
    deltas.append(s.finish())
    return deltas, s


def test_stop_string_is_cut_and_its_prefix_held_back():
    deltas, s = _stream("abc<END>def", ["<END>"])
    assert "".join(deltas) == s.text == "abc"
    # "<", "<E", ... are held until they turn out to be the stop string: never emitted.
    assert all("<" not in d for d in deltas)
    deltas, s = _stream("a<b<ENx", ["<END>"])
    assert "".join(deltas) == "a<b<ENx"
    assert deltas[:3] == ["a", "", "<b"]  # "<" waited until "b" showed it is not a stop


def test_earliest_of_several_stop_strings_wins():
    _, s = _stream("one. two\n\nthree", ["\n\n", "two"])
    assert s.text == "one. "


def test_overlapping_stop_strings_cut_at_the_earliest_start():
    # "bc" ends first, but "abcd" starts earlier and is whole one character later: held until then?
    # No: the first stop string completed ends the generation, cut where it starts.
    _, s = _stream("xabcdy", ["abcd", "bc"])
    assert s.text == "xa"
    _, s = _stream("xab", ["ab", "abc"])  # a stop string that begins another
    assert s.text == "x"
    deltas, s = _stream("aaab", ["aab"])  # held "aa" gives way to "a" + "aab"
    assert s.text == "a" and deltas[:2] == ["", ""]
    _, s = _stream("a\n\n\nb", ["\n\n\n", "\n\n"])  # the same start: either, cut there
    assert s.text == "a"


def _reference(chars: list[str], stops) -> tuple[str, int]:
    """What the stream must give for these tokens (one character each here, or a token's text):
    the text cut before the earliest stop string, and the tokens up to the one completing it."""
    text = ""
    for n, c in enumerate(chars, 1):
        text += c
        hits = [i for s in stops if s and (i := text.find(s)) >= 0]
        if hits:
            return text[:min(hits)], n
    return text, len(chars)


def test_stop_strings_against_a_reference_tokens_and_steps_of_any_size():
    """Random texts and stop sets (overlapping, nested, repeated letters), fed one token at a time
    and in steps of 1-5 tokens (accepted drafts): the same text, the same last token, and the text
    released along the way is always a start of the final text and never holds a stop string."""
    rng = random.Random(0)
    alphabet = "ab<>\n E"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        stops = tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(0, 4)))
        want_text, want_n = _reference(list(text), stops)
        for step in (1, None):
            s = StopStringStream(CharTokenizer(), stops)
            ids, taken, released = [ord(c) for c in text], 0, ""
            while taken < len(ids) and not s.stopped:
                k = step or rng.randint(1, 5)
                n, delta = s.push_many(ids[taken:taken + k])
                taken += n
                released += delta
                assert want_text.startswith(released), (text, stops)
            released += s.finish()
            assert (released, s.text, taken) == (want_text, want_text, want_n), (text, stops, step)


def _tokenizers(smollm2_dense_path):
    from test_tokenizer import _spm_metadata

    from moeray.stages.text.tokenizer import Tokenizer

    yield "byte-level BPE", Tokenizer.from_gguf(smollm2_dense_path)
    yield "sentencepiece (byte fallback)", Tokenizer.from_metadata(_spm_metadata()[1])


def test_stop_strings_spanning_tokens_and_steps_of_a_real_tokenizer(smollm2_dense_path):
    for name, tok in _tokenizers(smollm2_dense_path):
        text = "The waves of the ocean, a silent beauty.\nA gentle lapping of the shore,\n\nA reminder."
        ids = tok.encode(text, add_bos=False)
        pieces = [tok.decode(ids[:i + 1])[len(tok.decode(ids[:i])):] for i in range(len(ids))]
        for stops in (("lapping of",), ("\n\n",), ("gentle", "silent beauty"), ("ocean, a s",), ("no such",)):
            want_text, want_n = _reference(pieces, stops)
            for k in (1, 3):
                s = StopStringStream(tok, stops)
                taken = 0
                while taken < len(ids) and not s.stopped:
                    taken += s.push_many(ids[taken:taken + k])[0]
                s.finish()
                assert (s.text, taken) == (want_text, want_n), (name, stops, k)


def test_a_stop_string_inside_a_multibyte_character_waits_for_the_whole_character(smollm2_dense_path):
    """"é" as two byte tokens: after the first, nothing is released or matched (U+FFFD is a character
    still being built); the second completes it, and with it the stop string."""
    from moeray.stages.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_dense_path)
    byte = {b: tok.backend.token_to_id(c) for b, c in ((0xC3, "Ã"), (0xA9, "©"))}  # GPT-2's byte alphabet
    assert tok.decode([byte[0xC3], byte[0xA9]]) == "é"
    ids = tok.encode("caf", add_bos=False) + [byte[0xC3], byte[0xA9]] + tok.encode(" au lait", add_bos=False)
    for stops, want in ((("é",), "caf"), (("fé au",), "ca"), (("éx",), "café au lait"), (("\ufffd",), "café au lait")):
        s = StopStringStream(tok, stops)
        released, n = [], len(ids)
        for i, t in enumerate(ids):
            released.append(s.push(t))
            if s.stopped:
                n = i + 1
                break
        released.append(s.finish())
        assert "".join(released) == s.text == want, stops
        assert all("\ufffd" not in r for r in released)
        if stops == ("é",):
            assert n == len(tok.encode("caf", add_bos=False)) + 2  # the second byte completes it
    # The held "é" of "éx" goes out once the next character shows it is not the stop string.
    s = StopStringStream(tok, ("éx",))
    out = [s.push(t) for t in ids[:-len(tok.encode(" au lait", add_bos=False)) + 1]]
    assert "".join(out) == "café au"[:len("".join(out))] and "é" in "".join(out)


def test_partial_utf8_is_held_back(smollm2_dense_path):
    from moeray.stages.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_dense_path)
    text = "ok 🙂🙂 done"
    s = StopStringStream(tok)
    deltas = [s.push(i) for i in tok.encode(text)] + [s.finish()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_many_and_long_stop_strings_are_matched_the_same():
    """A thousand stop strings and one of a million characters (what a hostile request may send):
    the same cut as with the one that matters alone."""
    rng = random.Random(1)
    noise = ["".join(rng.choice("xyz") for _ in range(rng.randint(5, 40))) for _ in range(1000)]
    stops = noise + ["q" * 1_000_000, "STOP"]
    text = "some text with xyzzy but no noise string... then STOP and more"
    _, s = _stream(text, stops)
    want = min((text.find(x) for x in stops if x in text), default=len(text))
    assert s.text == text[:want]
    m = StopMatcher(stops)
    assert m.longest == 1_000_000 and m.find("...STOP", 0) == 3 and m.held("...STO", 0) == 3


class CountingTokenizer:
    """A tokenizer that records how many ids each decode call was given."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids):
        self.sizes.append(len(ids))
        return self.tok.decode(ids)


def test_incremental_text_is_the_whole_decode_at_every_token_and_its_cost_stays_flat(smollm2_dense_path):
    """Token by token, the settled text and what is still pending are decode(all ids so far)
    wherever that ends in a whole character, the settled text only grows and is the start of the
    final text, and the whole is decode(all ids): multi-byte characters split over tokens,
    SentencePiece's leading spaces, random ids; no decode call sees more than a few ids, however
    long the output. (Mid-character, sentencepiece's byte fallback turns the character before too
    into U+FFFD until the next one is whole: that text is not final, and is not released.)"""
    rng = random.Random(0)
    texts = ["Héllo wörld!  日本語のテキスト 🙂🙂 emoji, tabs\tand\nnewlines. The quick brown fox 12345. " * 8,
             "  leading  spaces\n\n and   runs   of spaces " * 20]
    byte_token = re.compile(r"<0x[0-9A-F]{2}>")
    for name, tok in _tokenizers(smollm2_dense_path):
        # Random ids, but not sentencepiece's byte tokens at random: a run of them that is no UTF-8
        # decodes to U+FFFD per byte, ASCII bytes included, so the text of a prefix is not final there.
        words = [i for i in range(tok.vocab_size) if not byte_token.fullmatch(tok.backend.id_to_token(i) or "")]
        sequences = [tok.encode(t)[:300] for t in texts] + [[rng.choice(words) for _ in range(200)] for _ in range(3)]
        for ids in sequences:
            counting = CountingTokenizer(tok)
            d, text, final = IncrementalDecoder(counting), "", tok.decode(ids)
            for i, t in enumerate(ids):
                text += d.push([t])
                now = tok.decode(ids[:i + 1])
                assert final.startswith(text) and (now.endswith("\ufffd") or text + d.pending() == now), (name, i)
            assert text + d.flush() == final
            if ids is sequences[1]:  # plain text: every decode a window of a few ids
                assert max(counting.sizes) <= 8, name
