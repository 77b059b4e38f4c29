"""Sampling (greedy, temperature, top-k, top-p, seeds), stop strings on streamed text, and the
generation loop's bookkeeping (EOS, stop strings, max_tokens, batching, streaming)."""
from __future__ import annotations

import pytest
import torch

from moeray.stages.generate import Generator
from moeray.stages.sampling import SamplingParams, StopStringStream, filtered_probs, sample

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


class CharTokenizer:
    """One token per character (id = code point), decode = join; 0 is the end token."""

    end_ids = frozenset({0})

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i)


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
    from moeray.stages.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_dense_path)
    text = "ok 🙂🙂 done"
    s = StopStringStream(tok)
    deltas = [s.push(i) for i in tok.encode(text)] + [s.finish()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


class ScriptedModel:
    """A model whose next token is the next character of a script: enough to test the loop's
    bookkeeping (prefill chunks, slots, batching) without weights. Slot i follows script i."""

    class config:
        context_length = 64

    def __init__(self, scripts):
        self.scripts = scripts
        self.calls = []

    def new_kv_cache(self, max_seqs, max_len):
        return {"len": [0] * max_seqs, "max_len": max_len}

    def step(self, tokens, slots, kv):
        self.calls.append([len(t) for t in tokens])
        out = torch.full((len(slots), 256), -1e9)
        for row, (t, slot) in enumerate(zip(tokens, slots)):
            kv["len"][slot] += len(t)
            assert kv["len"][slot] <= kv["max_len"]
            script = self.scripts[slot]
            pos = kv["len"][slot] - self.prompt_len[slot]
            out[row, ord(script[pos]) if 0 <= pos < len(script) else 0] = 0.0
        return out


def _generator(scripts, prompts, chunk=4):
    model = ScriptedModel(scripts)
    model.prompt_len = [len(p) for p in prompts]
    return Generator(model, CharTokenizer(), prefill_chunk=chunk), model


def test_generate_batches_eos_stop_and_length():
    prompts = [[ord(c) for c in "0123456789"], [ord(c) for c in "ab"], [ord(c) for c in "xyz"]]
    gen, model = _generator(["hello", "stop here: STOP more", "abcdefghij"], prompts)
    streamed = {0: "", 1: "", 2: ""}
    out = gen.generate(
        prompts,
        [SamplingParams(max_tokens=20), SamplingParams(stop=("STOP",)), SamplingParams(max_tokens=4)],
        on_text=lambda i, d: streamed.__setitem__(i, streamed[i] + d),
    )
    assert [c.text for c in out] == ["hello", "stop here: ", "abcd"]
    assert [c.finish_reason for c in out] == ["stop", "stop", "length"]
    assert out[0].token_ids[-1] == 0 and len(out[2].token_ids) == 4
    assert [streamed[i] for i in range(3)] == [c.text for c in out]
    # Prefill: chunks of <= 4 tokens, all prompts in the same steps while they last.
    assert model.calls[:3] == [[4, 2, 3], [4], [2]]
    assert gen.stats.prefill_tokens == 15


def test_stream_yields_text_and_ignore_eos_runs_to_max_tokens():
    gen, _ = _generator(["hi"], [[65]])
    assert "".join(gen.stream([65], SamplingParams())) == "hi"
    out = gen.generate([[65]], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
