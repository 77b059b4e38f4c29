"""Sampling (greedy, temperature, top-k, top-p, seeds) and stop strings on streamed text. The
generation loop's finish rules and scheduling are tests/test_engine.py's."""
from __future__ import annotations

import pytest
import torch

from moeray.stages.text.sampling import SamplingParams, StopStringStream, filtered_probs, sample
from fakes import CharTokenizer

torch.manual_seed(0)
LOGITS = torch.randn(3, 50) * 3


def test_greedy_is_argmax_and_rows_keep_their_own_params():
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1, seed=5), SamplingParams()]
    gens = [p.new_generator() for p in params]
    assert sample(LOGITS, params, gens) == LOGITS.argmax(-1).tolist()  # top_k=1 is greedy too


def test_seed_reproducible_and_independent_of_batch():
    p = SamplingParams(temperature=1.5, seed=1234)
    alone = [sample(LOGITS[1:2], [p], [g])[0] for g in [p.new_generator()] for _ in range(20)]
    other = SamplingParams(temperature=0.7, seed=99)
    g1, g2 = p.new_generator(), other.new_generator()
    batched = [sample(LOGITS[:2], [other, p], [g2, g1])[1] for _ in range(20)]
    assert alone == batched
    assert len(set(alone)) > 1  # it really samples


def test_top_k_and_top_p_cut_the_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0, 0]))
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))  # 0.5 + 0.3 reaches 0.7
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0, 0]))
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert torch.allclose(probs, torch.tensor([1.0, 0, 0, 0]))
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=0)
    g = p.new_generator()
    drawn = [sample(logits[None], [p], [g])[0] for _ in range(300)]
    assert set(drawn) == {0, 1, 2}


def test_temperature_sampling_follows_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0])
    p = SamplingParams(temperature=2.0, seed=7)
    g = p.new_generator()
    drawn = torch.tensor([sample(logits[None], [p], [g])[0] for _ in range(3000)])
    freq = torch.bincount(drawn, minlength=3).float() / 3000
    assert torch.allclose(freq, torch.softmax(logits / 2.0, -1), atol=0.03)


def test_bad_params_are_rejected():
    for kwargs in ({"temperature": -1}, {"top_p": 0}, {"top_k": -1}, {"max_tokens": 0}):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)


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


def test_partial_utf8_is_held_back(smollm2_dense_path):
    from moeray.stages.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_dense_path)
    text = "ok 🙂🙂 done"
    s = StopStringStream(tok)
    deltas = [s.push(i) for i in tok.encode(text)] + [s.finish()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_a_grammar_mask_limits_greedy_and_sampled_rows_and_logprobs_are_the_models_own():
    from moeray.stages.text.sampling import token_logprobs

    allowed = torch.zeros(50, dtype=torch.bool)
    allowed[[3, 17, 41]] = True
    params = [SamplingParams(), SamplingParams(temperature=2.0, seed=1), SamplingParams()]
    gens = [p.new_generator() for p in params]
    picks = [sample(LOGITS, params, gens, [allowed, allowed, None]) for _ in range(30)]
    assert all(row[0] == max([3, 17, 41], key=lambda i: LOGITS[0, i]) for row in picks)  # greedy among the allowed
    assert {row[1] for row in picks} <= {3, 17, 41} and len({row[1] for row in picks}) > 1
    assert all(row[2] == LOGITS[2].argmax() for row in picks)  # an unmasked row is untouched
    lp = token_logprobs(LOGITS[0], 17, 3)
    want = torch.log_softmax(LOGITS[0], -1)  # before the mask and temperature, as vLLM reports
    assert lp.logprob == pytest.approx(want[17].item())
    assert [i for i, _ in lp.top] == want.topk(3).indices.tolist()
    assert [v for _, v in lp.top] == pytest.approx(want.topk(3).values.tolist())
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(logprobs=21)


class CountingTokenizer:
    """A tokenizer that records how many ids each decode call was given."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids):
        self.sizes.append(len(ids))
        return self.tok.decode(ids)


def _tokenizers(smollm2_dense_path):
    from test_tokenizer import _spm_metadata

    from moeray.stages.text.tokenizer import Tokenizer

    yield "byte-level BPE", Tokenizer.from_gguf(smollm2_dense_path)
    yield "sentencepiece (byte fallback)", Tokenizer.from_metadata(_spm_metadata()[1])


def test_window_decoder_text_is_the_whole_decode_at_every_token_and_its_cost_stays_flat(smollm2_dense_path):
    """Detokenising token by token decodes a bounded window, yet the text is always decode(all ids):
    multi-byte characters split over tokens, SentencePiece's leading spaces, random ids."""
    import random

    from moeray.stages.text.sampling import WindowDecoder

    rng = random.Random(0)
    texts = ["Héllo wörld!  日本語のテキスト 🙂🙂 emoji, tabs\tand\nnewlines. The quick brown fox 12345. " * 8,
             "  leading  spaces\n\n and   runs   of spaces " * 20]
    for name, tok in _tokenizers(smollm2_dense_path):
        sequences = [tok.encode(t)[:300] for t in texts] + [[rng.randrange(tok.vocab_size) for _ in range(200)]]
        for ids in sequences:
            counting = CountingTokenizer(tok)
            d = WindowDecoder(counting)
            for i, t in enumerate(ids):
                assert d.push(t) == tok.decode(ids[:i + 1]), (name, i)
        ids = sequences[1]
        counting = CountingTokenizer(tok)
        d = WindowDecoder(counting)
        for t in ids:
            d.push(t)
        # Plain text settles: no decode call sees more than a window of ids, however long the output.
        assert max(counting.sizes[-50:]) <= WindowDecoder.CONTEXT + 2 * WindowDecoder.SETTLE, name
