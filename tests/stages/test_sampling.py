"""Sampling (greedy, temperature, top-k, top-p, min-p, logit_bias, the repetition / frequency /
presence penalties, seeds) and stop strings on streamed text. Each processor is checked against a
direct computation written here element by element, in vLLM's order; the engine carrying them to
the last stage is tests/cluster/test_sampling_engine.py's. The generation loop's finish rules and
scheduling are tests/cluster/test_engine.py's."""
from __future__ import annotations

import pytest
import torch

from moeray.stages.text.sampling import (SamplingParams, TokenHistory, adjust_logits, draw,
                                        filtered_probs, process_logits, sample)

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


@pytest.mark.parametrize("scale", [12.0, 2.5, 0.3])  # nuclei of a few, ~hundreds and ~40k tokens
def test_top_p_over_a_whole_vocabulary_keeps_the_nucleus_a_full_sort_keeps(scale):
    """A 49,152-token row whose nucleus is found after ranking 64 tokens, after ranking 4,096, and
    only by sorting the whole row: the kept tokens and their probabilities are those of the
    definition (sort everything, keep a token while the mass before it is < top_p)."""
    g = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(49152, generator=g) * scale
    params = SamplingParams(temperature=0.8, top_p=0.95)
    probs = torch.softmax(logits / 0.8, -1)
    top, order = torch.sort(probs, descending=True)
    kept = order[(torch.cumsum(top, -1) - top) < 0.95]
    want = torch.zeros_like(probs)
    want[kept] = probs[kept] / probs[kept].sum()
    got = filtered_probs(logits, params)
    assert set(torch.nonzero(got).flatten().tolist()) == set(kept.tolist())
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-9)


def test_a_draw_follows_the_probabilities_and_never_takes_a_zero():
    """draw() over a vocabulary-sized row with 6 tokens left (a nucleus): each drawn about as often
    as its probability says, no other ever; one seed, the same draws."""
    probs = torch.zeros(49152)
    ids = torch.tensor([0, 7, 500, 12000, 49150, 49151])
    probs[ids] = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.2, 0.1]) * 3  # unnormalised, as a residual is
    g = torch.Generator().manual_seed(5)
    drawn = torch.tensor([draw(probs, g) for _ in range(4000)])
    assert set(drawn.tolist()) <= set(ids.tolist())
    freq = torch.bincount(drawn, minlength=49152)[ids].float() / 4000
    assert torch.allclose(freq, probs[ids] / probs.sum(), atol=0.03)
    again = torch.Generator().manual_seed(5)
    assert [draw(probs, again) for _ in range(50)] == drawn[:50].tolist()


def test_a_top_p_row_draws_its_nucleus_as_often_as_its_renormalised_probabilities():
    """sample() draws a top-p row among the nucleus' ids alone: each as often as its share of the
    nucleus' mass, no token outside it."""
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
    g = p.new_generator()
    drawn = torch.tensor([sample(logits[None], [p], [g])[0] for _ in range(4000)])
    freq = torch.bincount(drawn, minlength=4).float() / 4000
    assert freq[0] == 0
    assert torch.allclose(freq, torch.tensor([0.0, 0.5, 0.15, 0.3]) / 0.95, atol=0.03)


def test_temperature_sampling_follows_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0])
    p = SamplingParams(temperature=2.0, seed=7)
    g = p.new_generator()
    drawn = torch.tensor([sample(logits[None], [p], [g])[0] for _ in range(3000)])
    freq = torch.bincount(drawn, minlength=3).float() / 3000
    assert torch.allclose(freq, torch.softmax(logits / 2.0, -1), atol=0.03)


def test_bad_params_are_rejected_naming_the_parameter():
    for kwargs in ({"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"max_tokens": 0}, {"min_p": 1.5},
                   {"min_p": -0.1}, {"repetition_penalty": 0}, {"repetition_penalty": float("inf")},
                   {"presence_penalty": 2.5}, {"frequency_penalty": -2.01}, {"presence_penalty": float("nan")},
                   {"logit_bias": {5: 101}}, {"logit_bias": {-1: 1}}):
        with pytest.raises(ValueError, match=next(iter(kwargs)).split("_")[0]):
            SamplingParams(**kwargs)
    # vLLM's spellings of "off" and OpenAI's edges are taken
    assert SamplingParams(top_k=-1).top_k == 0
    p = SamplingParams(presence_penalty=-2, frequency_penalty=2, min_p=1, logit_bias={"7": -100, 3: 100})
    assert p.logit_bias == ((3, 100.0), (7, -100.0)) and p.needs_history and p.adjusts_logits
    assert not SamplingParams(top_k=5, min_p=0.1).adjusts_logits


# ---------------------------------------------------------------- the processors, against a direct computation

V = 50


def direct(logits: torch.Tensor, p: SamplingParams, prompt=(), output=()) -> list[float]:
    """logit_bias, then repetition, frequency and presence penalties, one token at a time in float64
    (vLLM's order and definitions, written out)."""
    out = [float(x) for x in logits]
    for token, bias in p.logit_bias:
        out[token] += bias
    for t in range(len(out)):
        count = list(output).count(t)
        if p.repetition_penalty != 1 and (t in prompt or count):
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def direct_probs(logits: list[float], p: SamplingParams) -> torch.Tensor:
    """temperature, then min_p (relative to the likeliest token), then top_k, then top_p, in float64."""
    x = torch.tensor(logits, dtype=torch.float64) / p.temperature
    probs = torch.softmax(x, -1)
    keep = probs >= p.min_p * probs.max()
    if p.top_k:
        kth = sorted((v for v, k in zip(x.tolist(), keep.tolist()) if k), reverse=True)[:p.top_k][-1]
        keep &= x >= kth
    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum()
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    mass, kept = 0.0, torch.zeros_like(probs)
    for t in order:
        if mass >= p.top_p or probs[t] == 0:
            break
        kept[t], mass = probs[t], mass + float(probs[t])
    return (kept / kept.sum()).float()


PROMPT, OUTPUT = [3, 7, 7, 12, 40], [7, 9, 9, 9, 21, 3]
ROW = torch.randn(V, generator=torch.Generator().manual_seed(1)) * 4


@pytest.mark.parametrize("p", [
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.5),  # < 1 encourages repeats: positive x 2, negative / 2
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(presence_penalty=1.5),
    SamplingParams(presence_penalty=-2, frequency_penalty=-0.5),
    SamplingParams(logit_bias={9: 100, 0: -100, 33: 2.5}),
    # logit_bias before the repetition penalty: token 9's 0.8 + (-3) = -2.2 is then multiplied (-4.4);
    # the other order (0.4 - 3 = -2.6) would be wrong
    SamplingParams(logit_bias={9: -3.0, 21: 5}, repetition_penalty=2, frequency_penalty=0.25, presence_penalty=0.5),
], ids=["repetition", "repetition<1", "frequency", "presence", "negative", "bias", "all"])
def test_logit_bias_and_penalties_are_what_vllm_and_openai_define(p):
    row = ROW.clone()
    row[9] = 0.8
    got = adjust_logits(row, p, TokenHistory(V, PROMPT, OUTPUT))
    assert got.tolist() == pytest.approx(direct(row, p, PROMPT, OUTPUT), abs=1e-5)
    assert torch.equal(row[9], torch.tensor(0.8))  # the caller's logits are untouched


def test_a_history_counts_each_sampled_token_once_as_a_recount_would():
    import random

    rng = random.Random(0)
    output = OUTPUT + [rng.randrange(V) for _ in range(300)]  # more distinct tokens than its first arrays hold
    h = TokenHistory(V, PROMPT, output[:2])
    for t in output[2:]:
        h.add(t)
    held = dict(zip(h.ids.tolist(), zip(h.counts.tolist(), h.in_prompt.tolist())))
    assert held == {t: (float(output.count(t)), t in PROMPT) for t in set(PROMPT) | set(output)}


def test_several_positions_of_one_sequence_see_the_tokens_drafted_before_them():
    """Speculative decoding verifies k drafted tokens at once: position j has also generated drafted[:j]."""
    p = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.6, logit_bias={5: 1})
    rows = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    drafted = [9, 30, 9]
    got = adjust_logits(rows, p, TokenHistory(V, PROMPT, OUTPUT), drafted)
    for j in range(4):
        assert got[j].tolist() == pytest.approx(direct(rows[j], p, PROMPT, OUTPUT + drafted[:j]), abs=1e-5)


@pytest.mark.parametrize("p", [
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.5, min_p=0.3),  # min_p after temperature: a colder row keeps fewer
    SamplingParams(temperature=1.5, min_p=0.05, top_k=4),
    SamplingParams(temperature=0.8, min_p=0.02, top_k=10, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=3),
], ids=["min_p", "min_p-cold", "min_p+top_k", "min_p+top_k+top_p", "top_k"])
def test_min_p_and_top_k_cut_the_distribution_as_defined(p):
    got = filtered_probs(ROW, p)
    want = direct_probs(ROW.tolist(), p)
    assert torch.equal(got > 0, want > 0) and torch.allclose(got, want, atol=1e-6)
    assert 1 <= int((got > 0).sum()) < V


def test_min_p_keeps_exactly_the_tokens_at_least_min_p_times_the_likeliest():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.12, 0.05, 0.03]))
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, min_p=0.2))  # cut at 0.1
    assert torch.allclose(probs, torch.tensor([0.5, 0.3, 0.12, 0, 0]) / 0.92)
    p = SamplingParams(temperature=1.0, min_p=0.2, seed=3)
    g = p.new_generator()
    assert {sample(logits[None], [p], [g])[0] for _ in range(300)} == {0, 1, 2}
    # After temperature (vLLM's order): at 0.5 token 1's ratio to the likeliest is 0.6^2 = 0.36 < 0.4,
    # so it goes; before temperature it would have stayed (0.6 >= 0.4).
    probs = filtered_probs(logits, SamplingParams(temperature=0.5, min_p=0.4))
    assert probs.nonzero().flatten().tolist() == [0]


def test_a_mixed_batch_changes_only_the_rows_that_ask_and_their_neighbours_draw_as_alone():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(3)) * 3
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[[2, 9, 40]] = True
    params = [SamplingParams(),  # plain greedy
              SamplingParams(presence_penalty=1.2, repetition_penalty=1.5),  # greedy, penalised
              SamplingParams(temperature=0.9, top_k=8, seed=11),  # plain sampled
              SamplingParams(temperature=1.1, min_p=0.05, frequency_penalty=0.8, logit_bias={4: 3}, seed=12),
              SamplingParams(temperature=0.7, top_p=0.9, seed=13),  # plain sampled
              SamplingParams(logit_bias={40: -5})]  # greedy, biased, under a grammar
    histories = [None, TokenHistory(V, PROMPT, OUTPUT), None, TokenHistory(V, [1, 2], [4, 4, 8]), None, None]
    masks = [None] * 5 + [allowed]
    out = process_logits(logits, params, histories, masks)
    for row in (0, 2, 4):
        assert torch.equal(out[row], logits[row])  # bit for bit
    assert out[1].tolist() == pytest.approx(direct(logits[1], params[1], PROMPT, OUTPUT), abs=1e-5)
    assert out[3].tolist() == pytest.approx(direct(logits[3], params[3], [1, 2], [4, 4, 8]), abs=1e-5)
    want5 = torch.tensor(direct(logits[5], params[5])).float().masked_fill(~allowed, float("-inf"))
    assert torch.allclose(out[5], want5)
    # The tokens: greedy rows take the processed argmax; sampled rows draw from the processed cut.
    gens = [p.new_generator() for p in params]
    drawn = [sample(logits, params, gens, masks, histories) for _ in range(200)]
    assert {d[1] for d in drawn} == {int(torch.tensor(direct(logits[1], params[1], PROMPT, OUTPUT)).argmax())}
    assert {d[5] for d in drawn} == {int(want5.argmax())}
    support3 = set(direct_probs(direct(logits[3], params[3], [1, 2], [4, 4, 8]), params[3]).nonzero().flatten().tolist())
    assert {d[3] for d in drawn} <= support3
    # The plain rows drew what they draw alone, with the same seeds.
    for row in (0, 2, 4):
        g = params[row].new_generator()
        assert [d[row] for d in drawn] == [sample(logits[row:row + 1], [params[row]], [g])[0] for _ in range(200)]


def test_a_huge_penalty_never_makes_a_token_impossible_only_a_grammar_does():
    """repetition_penalty 1e38 on negative logits overflows float32: such a token becomes the least
    likely, never -inf, so a grammar that allows only repeated tokens still has a distribution."""
    logits = -torch.rand(V, generator=torch.Generator().manual_seed(4)) * 50 - 1  # all negative
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[[7, 9]] = True  # both in the prompt: both penalised
    p = SamplingParams(temperature=1.0, repetition_penalty=1e38, seed=1)
    out = process_logits(logits[None], [p], [TokenHistory(V, PROMPT, OUTPUT)], [allowed])[0]
    assert torch.isfinite(out[allowed]).all() and torch.isneginf(out[~allowed]).all()
    g = p.new_generator()
    assert {sample(logits[None], [p], [g], [allowed], [TokenHistory(V, PROMPT, OUTPUT)])[0] for _ in range(50)} <= {7, 9}
    assert SamplingParams(temperature=1e-9).greedy  # as vLLM: dividing by it would overflow


def test_a_seeded_penalised_row_repeats_its_draws_and_its_counts_steer_them():
    logits = torch.zeros(V)  # all alike: only the penalties tell the tokens apart
    p = SamplingParams(temperature=1.0, presence_penalty=2, frequency_penalty=2, seed=5)

    def run():
        h, g, out = TokenHistory(V), p.new_generator(), []
        for _ in range(30):
            out.append(sample(logits[None], [p], [g], None, [h])[0])
            h.add(out[-1])
        return out

    first = run()
    assert first == run()
    assert len(set(first)) >= 20  # a token drawn once is e^-4 as likely: repeats are rare


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
