"""Speculative decoding: drafts verified as one multi-token row, kept only as far as the target agrees.

The engine's greedy tokens with speculation equal its tokens without, for every family's tiny
model, one sequence and sixteen, with a drafter that is right most of the time and wrong often
enough that both the accepted run and the rejection are exercised every few steps; the KV ledger
is checked after every step (a rejected draft's blocks go back). A sequence ends where a plain
decode ends when an accepted run crosses its end token, a stop string or max_tokens. Sampling
through the rejection rule draws from the target's own distribution (chi-square against the
model's exact probabilities, fixed seeds). The pricing of draft lengths (planner/draft_length.py)
and the n-gram drafter (cluster/ngram.py) on their own. On the default model, served, and across
Ray stages: tests/e2e/test_speculative_end_to_end.py.
"""
from __future__ import annotations

import random

import pytest
import torch

from moeray.cluster.config import EngineConfig
from moeray.cluster.engine import Engine
from moeray.cluster.local_pipeline import LocalPipeline
from moeray.cluster.ngram import Draft, NgramConfig, NgramDrafter
from moeray.cluster.speculation import Speculation
from moeray.cluster.step_clock import StepClock
from moeray.planner.draft_length import DraftGuard, LayerExperts, Offer, StepPrice, choose_draft_lengths
from moeray.stages.blocks.kv_cache import blocks_for
from moeray.stages.gguf.writer import write_gguf
from moeray.stages.runtime.model import load_model
from moeray.stages.text.sampling import SamplingParams
from moeray.stages.text.verify import accept_greedy, accept_sampled

# ---------------------------------------------------------------- pricing (pure)


def test_a_draft_goes_in_only_where_it_raises_the_steps_tokens_per_ms():
    flat = StepPrice(fixed_ms=10.0, token_ms=0.1).table(80)  # a memory-bound step: tokens nearly free
    sure, unsure = Offer(0.9, 40), Offer(0.05, 40)
    one = choose_draft_lengths(flat, 1, 1, [sure])
    assert one.lengths[0] >= 20 and one.tokens_per_ms > 4 * one.tokens_per_ms_without
    assert choose_draft_lengths(flat, 1, 1, [unsure]).lengths == [1] or \
        choose_draft_lengths(flat, 1, 1, [unsure]).lengths == [0]
    # a compute-bound full batch: every token costs as much as the step's fixed part shared out
    busy = StepPrice(fixed_ms=10.0, token_ms=2.0).table(200)
    assert choose_draft_lengths(busy, 16, 16, [Offer(0.5, 8)] * 16).lengths == [0] * 16
    # ... but a very sure draft still pays there
    assert sum(choose_draft_lengths(busy, 16, 16, [Offer(0.99, 8)] + [Offer(0.1, 8)] * 15).lengths[1:]) == 0
    # the best m tokens go to the surest offers first
    c = choose_draft_lengths(flat, 2, 2, [Offer(0.3, 10), Offer(0.95, 10)])
    assert c.lengths[1] == 10 and c.lengths[1] > c.lengths[0]


def test_the_experts_a_draft_touches_raise_its_price():
    """Two steps alike but for their experts: one layer of 8 experts (k=2, uniform heat) whose
    every read misses at 2 ms; the union of k+1 tokens' experts grows with k, so drafts shrink."""
    heat = (0.25,) * 8
    cheap = StepPrice(5.0, 0.1, (LayerExperts(heat, (0.0,) * 8),))
    dear = StepPrice(5.0, 0.1, (LayerExperts(heat, (2.0,) * 8),))
    assert dear.ms(1) == pytest.approx(5.1 + 2 * 2.0)  # one token: its k experts
    assert dear.ms(4) == pytest.approx(5.4 + 8 * 2.0 * (1 - 0.75 ** 4))
    offer = [Offer(0.6, 30)]
    assert choose_draft_lengths(dear.table(40), 1, 1, offer).lengths[0] < \
        choose_draft_lengths(cheap.table(40), 1, 1, offer).lengths[0]
    # overlap (consecutive tokens routing alike, from traces) makes the union cheaper
    alike = StepPrice(5.0, 0.1, (LayerExperts(heat, (2.0,) * 8),), overlap=(1.0, 0.6, 0.5, 0.45))
    assert alike.ms(4) < dear.ms(4)


def test_a_hybrid_models_rejections_are_priced_as_the_tokens_they_re_feed():
    """On a hybrid model a rejection after j accepted drafts re-feeds j + 1 tokens in a later row:
    the k-th drafted token costs a^(k-1) (1 - a) k of them more, each at a token's price: a
    drafter right 9 times in 10 drafts shorter than on a model without recurrent layers (8 tokens
    against 10 here), a surely right one (a = 1) as long."""
    flat = StepPrice(fixed_ms=10.0, token_ms=1.0).table(80)
    for a, shorter in ((0.9, True), (1.0, False)):
        plain = choose_draft_lengths(flat, 1, 1, [Offer(a, 30)])
        hybrid = choose_draft_lengths(flat, 1, 1, [Offer(a, 30)], refeed_ms=1.0)
        assert (hybrid.lengths[0] < plain.lengths[0]) == shorter, (a, plain.lengths, hybrid.lengths)
        assert hybrid.lengths[0] > 0
    # the expected re-fed tokens of a k-token draft, summed the way the choice adds them
    a, k = 0.6, 5
    direct = sum(a ** j * (1 - a) * (j + 1) for j in range(k))
    assert sum(a ** (i - 1) * (1 - a) * i for i in range(1, k + 1)) == pytest.approx(direct)


def test_the_fitted_price_charges_what_wide_and_drafted_steps_cost():
    """A machine whose steps cost per token (20 ms + 10 ms a token, as a CPU in one process: every
    expert in memory, paid per token routed) and 5 ms more per row carrying a draft, while the cost
    model's expert part saturates with the tokens (the union of 8 experts): fitted with the expert
    part as given, a full batch looked able to take drafts cheaply (16 rows drafted a token each at
    a = 0.9, where each costs 0.9 / 15 ms against the plain 16 / 180 ms). Fitted from the timed
    steps, verify steps included, the full batch drafts nothing and one row still drafts."""
    layers = tuple(LayerExperts((0.25,) * 8, (0.5,) * 8) for _ in range(4))
    clock = StepClock(layers)
    steps = [(r, 0, 0) for r in (1, 2, 4, 8, 12, 16) for _ in range(4)]  # plain rows
    steps += [(16, d, v) for d in (1, 2, 4, 8, 16) for v in (1, 2, 4) if v <= d]  # drafts at a full batch
    steps += [(1, d, 1) for d in (1, 3, 7)]  # and on one row
    for rows, d, v in steps * 4:
        n = rows + d
        clock.record(n, n, 20.0 + 10.0 * n + 5.0 * v, drafted=d, verify_rows=v)
    price = clock.fit()
    assert price.verify_row_ms == pytest.approx(5.0, abs=1.5)
    table = price.table(200)
    for n in (1, 8, 16):  # plain steps as timed, within a few ms
        assert table[n] == pytest.approx(20.0 + 10.0 * n, abs=4.0)
    full = choose_draft_lengths(table, 16, 16, [Offer(0.9, 8)] * 16, draft_ms=price.draft_ms,
                                row_ms=price.verify_row_ms)
    assert full.lengths == [0] * 16
    one = choose_draft_lengths(table, 1, 1, [Offer(0.9, 8)], draft_ms=price.draft_ms, row_ms=price.verify_row_ms)
    assert one.lengths[0] > 0  # 0.9 a 10-ms token beats 1 a 30-ms step


def test_drafting_pauses_while_its_measured_goodput_is_below_plain():
    """Whatever the price says, the steps with drafts are scored as measured: the tokens the drafts
    kept against the tokens plain decoding would have made in the ms they added. A loss over 16
    verify steps pauses drafting (no drafts, no probes) for 64 steps, then it is tried again; a
    drafter that pays is never paused."""
    def engine(ms_with_drafts: float, accepted: int) -> Speculation:
        spec = Speculation("ngram", price=StepPrice(fixed_ms=100.0, token_ms=0.1))  # drafts look nearly free
        seq = spec.start([1, 2, 3, 4, 5, 6] * 4 + [1, 2, 3])
        for _ in range(8):  # plain steps as predicted: 100 ms, a token each
            spec.step_done(1, 0, 0, 1, spec.step_table(1)[1])
        for _ in range(DraftGuard.min_steps):
            k = spec.plan([seq], [8], 1, 1, 8)[0]
            assert k > 0
            spec.observe(seq, k, min(accepted, k), min(accepted, k) + 1)
            spec.step_done(1 + k, k, min(accepted, k), 1, ms_with_drafts)
        return spec, seq

    losing, seq = engine(300.0, 1)  # 200 ms more for 1 kept token: 2 plain tokens' time
    assert losing.stats.pauses == 1
    for _ in range(DraftGuard.first_pause):
        assert losing.plan([seq], [8], 1, 1, 8) == [0]
        losing.step_done(1, 0, 0, 1, 100.0)
    assert losing.stats.paused_steps == DraftGuard.first_pause
    assert losing.plan([seq], [8], 1, 1, 8)[0] > 0  # tried again
    assert losing.guard("copy").pause == 2 * DraftGuard.first_pause  # a second loss in a row pauses longer
    paying, _ = engine(110.0, 3)  # 10 ms more for 3 kept tokens
    assert paying.stats.pauses == 0 and all(g.open for g in paying.guards.values())


def test_short_guesses_that_lost_do_not_pause_a_copy():
    """The score is kept per record: a sequence whose short n-gram matches (a phrase that recurs)
    keep failing pauses short guesses, and a copy in progress (a long match) in the next answer
    still drafts, as its own losses would pause it alone."""
    spec = Speculation("ngram", price=StepPrice(fixed_ms=100.0, token_ms=0.1))
    guessing = spec.start([7, 8, 1, 2, 9, 1, 2])  # "1 2" recurs: a 2-token match
    for _ in range(8):
        spec.step_done(1, 0, 0, 1, spec.step_table(1)[1])
    for _ in range(DraftGuard.min_steps):
        k = spec.plan([guessing], [8], 1, 1, 8)[0]
        assert k > 0 and guessing.draft.match < 16
        spec.observe(guessing, k, 0, 1)
        spec.step_done(1 + k, k, 0, 1, 300.0)  # every guess refused, 200 ms lost
    assert spec.stats.pauses == 1 and not spec.guard("ngram").open
    assert spec.plan([guessing], [8], 1, 1, 8) == [0]  # guesses wait out their pause
    copying = spec.start(list(range(100, 140)) + list(range(100, 120)))  # a 20-token match: a copy
    k = spec.plan([copying], [8], 1, 1, 8)[0]
    assert k > 0 and copying.draft.match >= 16 and copying.draft.tokens[:k] == list(range(120, 120 + k))


# ---------------------------------------------------------------- the n-gram drafter


def test_the_ngram_drafter_copies_what_followed_the_longest_earlier_match():
    d = NgramDrafter(NgramConfig(n_min=2, n_max=4), [5, 6, 7, 8, 9, 1, 2, 6, 7, 8, 3, 4, 1, 2])
    # the suffix (1, 2) was followed by 6 7 8 ...: the copy goes on through the text after it
    assert d.draft(5) == Draft([6, 7, 8, 3, 4], 2)
    d.extend([6, 7, 8])  # now (2, 6, 7, 8) matches 4 long: what followed it last time was 3
    assert d.draft(3) == Draft([3, 4, 1], 5)  # the 1 before it agrees too: a match of 5 (past n_max)
    # a repeat that reaches the present keeps repeating through its own draft
    r = NgramDrafter(NgramConfig(2, 4), [1, 2, 3, 1, 2, 3, 1, 2])
    assert r.draft(7).tokens == [3, 1, 2, 3, 1, 2, 3]
    assert NgramDrafter(NgramConfig(2, 4), [1, 2, 3, 4]).draft(4) == Draft([], 0)


def test_a_long_copy_drafts_longer_rows_than_a_short_match():
    """The same price, no acceptance measured yet: a sequence copying a 40-token passage (its
    match followed back past n_max, as llama-server's ngram-mod waits for 24 tokens) drafts a long
    row; one whose last two tokens merely occurred before drafts a short one, or none."""
    passage = list(range(100, 140))
    copying = NgramDrafter(NgramConfig(), [1, 2, 3] + passage + [7, 8] + passage[:30])
    assert copying.draft(8) == Draft(passage[30:38], 30)
    guessing = NgramDrafter(NgramConfig(), [5, 6, 41, 42, 43, 44, 5, 6])
    assert guessing.draft(8).match == 2
    price = StepPrice(fixed_ms=10.0, token_ms=2.0)  # a token a fifth of a step: drafts pay where sure
    spec = Speculation("ngram", price=price)
    copy_row, guess_row = (spec.plan([spec.start(d.tokens)], [32], 1, 1, 32)[0] for d in (copying, guessing))
    assert copy_row >= 6 and guess_row <= 2


# ---------------------------------------------------------------- acceptance on logits (pure)


def test_greedy_acceptance_is_the_longest_prefix_the_target_agrees_with():
    logits = torch.full((4, 10), -5.0)
    for j, t in enumerate([3, 7, 2, 9]):
        logits[j, t] = 5.0
    assert accept_greedy(logits, [3, 7, 2]) == [3, 7, 2, 9]  # every draft kept, and the bonus token
    assert accept_greedy(logits, [3, 1, 2]) == [3, 7]  # refused at the second: the target's own there
    assert accept_greedy(logits, [0, 7, 2]) == [3]


def test_rejection_sampling_keeps_each_positions_distribution():
    """One position, a drafter that always proposes token 0: accepted with p(0), else a token of the
    residual; over many draws the emitted token is distributed as p (chi-square, fixed seed)."""
    p = torch.tensor([0.1, 0.5, 0.25, 0.15])
    logits = p.log().view(1, 4).expand(2, 4).contiguous()
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(4)
    n = 20000
    params = SamplingParams(temperature=1.0)
    for _ in range(n):
        counts[accept_sampled(logits, [0], params, gen)[0]] += 1
    assert chi_square(counts, p * n) < chi_square_limit(3)


def chi_square(observed: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((observed - expected) ** 2 / expected).sum())


def chi_square_limit(df: int, z: float = 3.09) -> float:
    """The chi-square value a fit exceeds with probability 0.001 (z = 3.09) at `df` degrees of
    freedom (Wilson-Hilferty; 16.3 at df 3, as the tables give)."""
    c = 2 / (9 * df)
    return df * (1 - c + z * c ** 0.5) ** 3


# ---------------------------------------------------------------- the engine on tiny models


class NoisyOracle:
    """A drafter that knows the greedy continuation of each prompt and proposes it with one token
    in `wrong` replaced at random: right often, wrong often enough that rejections come every few
    steps. Deterministic (a seed per drafter)."""

    def __init__(self, refs: dict[tuple, list[int]], tokens: list[int], wrong: float = 0.25, vocab: int = 100):
        self.refs, self.wrong, self.vocab = refs, wrong, vocab
        self.prompt = next(p for p in refs if tuple(tokens[:len(p)]) == p)
        self.n = len(tokens)
        self.rng = random.Random(len(tokens) * 7919 + sum(tokens))

    def extend(self, tokens) -> None:
        self.n += len(list(tokens))

    def draft(self, max_tokens: int) -> Draft:
        ref = self.refs[self.prompt]
        at = self.n - len(self.prompt)
        out = [t if self.rng.random() > self.wrong else self.rng.randrange(self.vocab) for t in ref[at:at + max_tokens]]
        return Draft(out, 8 if out else 0)


def check_ledger(eng: Engine) -> None:
    """The KV ledger after a step: every block free, cached or held, its count of holders right,
    and no sequence holding blocks past the ones its kept tokens (and the next one) need."""
    bm, sched = eng.scheduler.blocks, eng.scheduler
    holders = [0] * bm.n_blocks
    for r in sched.running:
        for b in r.table:
            holders[b] += 1
        if r.copy is not None:
            holders[r.copy[0]] += 1
        for src, _, _ in r.moves:
            holders[src] += 1
        if not r.busy and r.fed == len(r.prefill):  # decoding: its KV is its tokens but the last
            assert r.kv_len == len(r.prompt) + len(r.output) - 1
            assert blocks_for(r.kv_len) <= len(r.table) <= blocks_for(r.kv_len + 1), (r.kv_len, len(r.table))
    assert holders == bm.ref
    free, cached = set(bm.free), set(bm.cached)
    assert not free & cached and len(free) == len(bm.free)
    assert all((b in free or b in cached) == (bm.ref[b] == 0) for b in range(bm.n_blocks))


def engine_for(model, max_seqs: int, mode: str, drafter=None, n_blocks: int = 160, **cfg) -> Engine:
    eng = Engine(LocalPipeline.from_model(model, n_blocks, max_seqs),
                 EngineConfig(max_seqs=max_seqs, max_len=256, micro_batches=1, speculative=mode, **cfg))
    if drafter is not None:
        eng.speculation.new_drafter = drafter
        eng.speculation.PROBE = 1.0  # always draft at least one token: every step verifies
    return eng


def run_checked(eng: Engine, prompts, params) -> list:
    reqs = [eng.add(p, params) for p in prompts]
    while not all(r.done for r in reqs):
        eng.step()
        check_ledger(eng)
    assert eng.scheduler.blocks.n_used == 0 or eng.config.prefix_reuse
    return reqs


FAMILIES = ["qwen3moe", "qwen2moe", "deepseek2", "glm4moe", "gpt-oss", "mixtral"]


def _tiny(family: str):
    import tiny_models as tm

    return {"qwen3moe": tm.tiny_qwen3moe, "qwen2moe": tm.tiny_qwen2moe, "deepseek2": tm.tiny_deepseek2,
            "glm4moe": tm.tiny_glm4moe, "gpt-oss": tm.tiny_gpt_oss, "mixtral": tm.tiny_mixtral}[family]()


class Models(dict):
    """Each family's tiny model, written and loaded the first time a test asks for it."""

    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def __missing__(self, family):
        self[family] = load_model(write_gguf(_tiny(family), self.folder / f"{family}.gguf", "Q8_0"))
        return self[family]


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    return Models(tmp_path_factory.mktemp("spec"))


def prompts_for(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 290) for _ in range(6 + 5 * (i % 4))] for i in range(n)]


def greedy_with_and_without(build, run, model, batch: int):
    """`batch` prompts decoded greedily without speculation, then with it through a drafter that
    knows the plain answer but is wrong one token in four: (the speculating engine, its tokens, the
    plain tokens). `build(model, batch, mode, drafter=...)` makes an engine, `run` drives it with
    its ledgers checked after every step."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = prompts_for(batch, seed=batch)
    plain = [r.output for r in run(build(model, batch, "off"), prompts, params)]
    refs = {tuple(p): o for p, o in zip(prompts, plain)}
    eng = build(model, batch, "auto", drafter=lambda toks: NoisyOracle(refs, toks, vocab=300))
    return eng, [r.output for r in run(eng, prompts, params)], plain


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_are_the_same_with_and_without_speculation(family_models, family):
    model = family_models[family]
    for batch in (1, 16):
        eng, got, plain = greedy_with_and_without(engine_for, run_checked, model, batch)
        assert got == plain, (family, batch)
        s = eng.speculation.stats
        # both paths ran: accepted runs and refused drafts
        assert s.accepted_tokens > 0 and s.accepted_tokens < s.drafted_tokens and s.verify_rows > 0
        assert eng.stats.steps < run_steps_plain(plain)


def run_steps_plain(outputs) -> int:
    return sum(len(o) for o in outputs)  # a bound: plain decode needs one step a token


def test_the_ngram_drafter_on_a_copying_sequence_gains_tokens_per_step(family_models):
    """A prompt that repeats a phrase: the model (tiny, random) falls into repeating it, the n-gram
    drafter proposes the repeat, and greedy tokens stay the plain ones with fewer steps."""
    model = family_models["qwen3moe"]
    phrase = [11, 57, 203, 9, 88, 140, 31, 7]
    prompts = [phrase * 4, phrase[:5] * 5]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    off = engine_for(model, 2, "off")
    plain = [r.output for r in run_checked(off, prompts, params)]
    on = engine_for(model, 2, "ngram")
    got = [r.output for r in run_checked(on, prompts, params)]
    assert got == plain
    assert on.speculation.stats.accepted_tokens > 0


def test_a_verify_rows_graph_serves_the_next_hundred_keys_and_its_build_is_not_priced(family_models):
    """A verify row of 4 tokens builds its step graph once for ROW_KEY_PAD keys: the same row a
    hundred tokens later runs it again (a copy-heavy answer verifies rows of a few lengths all
    along). The step that built it says so (StepOutput.cold); the one after does not."""
    from moeray.stages.runtime.step import StepBatch
    from moeray.stages.runtime.trunk_graph import KEY_PAD, ROW_KEY_PAD, MultiGraph

    model = family_models["qwen3moe"]
    runner = LocalPipeline.from_model(model, 32, 1).stage
    ids = prompts_for(1, seed=3)[0] * 30
    table, greedy = list(range(16)), SamplingParams(max_tokens=500)
    runner.step(StepBatch(step_id=0, slots=[0], n_new=[120], fresh=[True], tokens=[ids[:120]], sample=[True],
                          params=[greedy], starts=[0], tables=[table]))
    built, outs = [], []
    for start in (20, 20 + 100):  # rewritten in place: a verify row at each position
        row = ids[start:start + 4]
        before = MultiGraph.built
        outs.append(runner.step(StepBatch(step_id=1, slots=[0], n_new=[4], fresh=[False], tokens=[row],
                                          sample=[True], starts=[start], tables=[table], drafts=[row[1:]])))
        built.append(MultiGraph.built - before)
    assert ROW_KEY_PAD > 100 + 4 + KEY_PAD
    if built[0] == 0:
        pytest.skip("this model's steps run without the ggml stage graphs")
    assert built[1] == 0 and outs[0].cold and not outs[1].cold


def test_a_steps_price_counts_the_engines_work_between_steps_and_skips_graph_builds(family_models):
    """The step clock times a step from the result before it while the engine stays busy: the
    server's work between steps (here a 30-ms pause) is paid per step, so it is in the price a
    verify row saves; a step whose graph was built during it is no price of its size and is left
    out."""
    import time

    from moeray.stages.runtime.trunk_graph import MultiGraph

    eng = engine_for(family_models["qwen3moe"], 1, "ngram")
    req = eng.add(prompts_for(1, seed=4)[0], SamplingParams(max_tokens=10, ignore_eos=True))
    steps, before = 0, MultiGraph.built
    while not req.done:
        eng.step()
        steps += 1
        time.sleep(0.03)
    timed = [ms for *_, ms in eng.clock.steps]
    # A step that built a graph is not priced; which ones build depends on what earlier tests left
    # (graphs are kept per shape), so the first priced step may be the prompt's, timed from its
    # submission: every later one is charged the pause before it.
    if MultiGraph.built > before:
        assert 0 < len(timed) < steps
    else:
        assert len(timed) == steps
    assert all(ms >= 30.0 for ms in timed[1:])


class CharModelTokenizer:
    """Token id t is the character chr(65 + t % 58) (end token 0 is no text)."""

    end_ids = frozenset({0})

    def decode(self, ids):
        return "".join(chr(65 + i % 58) for i in ids if i)


def test_an_accepted_run_ends_where_a_plain_decode_ends(family_models):
    """A draft the target accepts whole runs past the sequence's end: the stop string, the end
    token and max_tokens each stop it at the very token a plain decode stops at, with the same text."""
    model = family_models["qwen3moe"]
    prompts = prompts_for(3, seed=5)
    long = SamplingParams(max_tokens=30, ignore_eos=True)
    mk = lambda mode, drafter=None: Engine(LocalPipeline.from_model(model, 64, 3), EngineConfig(
        max_seqs=3, max_len=256, micro_batches=1, speculative=mode), CharModelTokenizer())
    ref = [r.output for r in mk("off").generate(prompts, long)]
    refs = {tuple(p): o for p, o in zip(prompts, ref)}
    tok = CharModelTokenizer()
    stops = [tok.decode(o[9:11]) for o in ref]  # a stop string inside the run: ends before its text
    cases = [SamplingParams(max_tokens=13, ignore_eos=True)] + [
        SamplingParams(max_tokens=30, ignore_eos=True, stop=(s,)) for s in stops]
    for params in cases:
        plain = mk("off").generate(prompts, params)
        eng = mk("auto")
        eng.speculation.new_drafter = lambda toks: NoisyOracle(refs, toks, wrong=0.0, vocab=300)
        spec = eng.generate(prompts, params)
        assert [(r.output, r.text, r.finish_reason) for r in spec] == \
               [(r.output, r.text, r.finish_reason) for r in plain]
        assert eng.speculation.stats.accepted_tokens > 0
    # the end token: a model whose greedy run reaches a token we call the end
    end = ref[0][7]
    eos = type("T", (CharModelTokenizer,), {"end_ids": frozenset({end})})()
    long = SamplingParams(max_tokens=30)
    plain = Engine(LocalPipeline.from_model(model, 64, 3), EngineConfig(max_seqs=3, max_len=256, micro_batches=1,
                                                                         speculative="off"), eos).generate(prompts, long)
    eng = Engine(LocalPipeline.from_model(model, 64, 3), EngineConfig(max_seqs=3, max_len=256, micro_batches=1,
                                                                       speculative="auto"), eos)
    eng.speculation.new_drafter = lambda toks: NoisyOracle(refs, toks, wrong=0.0, vocab=300)
    spec = eng.generate(prompts, long)
    assert [r.output for r in spec] == [r.output for r in plain] and spec[0].output[-1] == end
    assert spec[0].finish_reason == "stop" and spec[0].text == plain[0].text


@pytest.mark.slow  # thousands of sampled steps per family
@pytest.mark.parametrize("family", ["qwen3moe", "qwen3next"])
def test_sampled_tokens_keep_the_targets_distribution_with_an_often_wrong_drafter(request, family):
    """3,000 seeded requests of 3 tokens at temperature 0.8, top-k 3, top-p 0.9, min-p, the three
    penalties and a logit bias on a tiny model,
    with a drafter that proposes the target's least likely token of the cut, its likeliest, or a junk token: the
    joint distribution of the 3 tokens (the 2nd and 3rd through verify rows) is the model's exact
    one, computed from its logits with the same filters (chi-square at p = 0.001; fixed seeds, so
    the verdict is the same every run). On the hybrid model (qwen3next) a 3rd token often comes from
    the row that restored the state after the 2nd's rejection and re-fed it."""
    from moeray.stages.text.sampling import TokenHistory, adjust_logits, filtered_probs

    hybrid = family == "qwen3next"
    model = request.getfixturevalue("hybrid_models" if hybrid else "family_models")[family]
    prompt = [17, 203, 88, 5, 140, 61, 9]
    params = SamplingParams(max_tokens=3, temperature=0.8, top_k=3, top_p=0.9, min_p=0.02, repetition_penalty=1.3,
                            frequency_penalty=0.7, presence_penalty=0.4, logit_bias={61: 1.5, 88: -1.0},
                            ignore_eos=True)

    def dist(out):
        logits = model.logits_all(prompt + out)[-1]
        return filtered_probs(adjust_logits(logits, params, TokenHistory(logits.shape[-1], prompt, out)), params)

    exact: dict[tuple, float] = {}
    likely: dict[tuple, list[int]] = {}
    p1 = dist([])
    for a in p1.nonzero().flatten().tolist():
        p2 = dist([a])
        likely[(a,)] = sorted(p2.nonzero().flatten().tolist(), key=lambda t: -float(p2[t]))
        for b in likely[(a,)]:
            p3 = dist([a, b])
            likely[(a, b)] = sorted(p3.nonzero().flatten().tolist(), key=lambda t: -float(p3[t]))
            for c in likely[(a, b)]:
                exact[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    rng = random.Random(99)

    class Guess:
        def __init__(self, tokens):
            self.tokens = list(tokens)

        def extend(self, tokens):
            self.tokens += list(tokens)

        def draft(self, max_tokens):
            out = []
            for _ in range(max_tokens):
                ctx = tuple(self.tokens[len(prompt):] + out)
                pool = likely.get(ctx, [])
                u = rng.random()  # unevenly: a uniform guess over the support would hide a wrong residual
                out.append(pool[-1] if pool and u < 0.6 else pool[0] if pool and u < 0.7 else rng.randrange(300))
            return Draft(out, 8)

    n, batch = 3000, 16
    eng = (hybrid_engine(model, batch, "auto", drafter=Guess) if hybrid else
           engine_for(model, batch, "auto", drafter=Guess, n_blocks=64))
    counts: dict[tuple, int] = {}
    for start in range(0, n, batch):
        reqs = [eng.add(prompt, SamplingParams(**{**params.__dict__, "seed": s}))
                for s in range(start, min(n, start + batch))]
        eng.run(reqs)
        for r in reqs:
            counts[tuple(r.output)] = counts.get(tuple(r.output), 0) + 1
    s = eng.speculation.stats
    assert s.verify_rows >= n and 0 < s.accepted_tokens < s.drafted_tokens  # both verdicts, every request
    assert not hybrid or eng.stats.state_restores > n // 10
    assert set(counts) <= set(exact)  # nothing outside top-k / top-p
    cells = sorted(exact, key=exact.get, reverse=True)
    big = [c for c in cells if exact[c] * n >= 5]  # the rare cells pooled into one
    obs = torch.tensor([counts.get(c, 0) for c in big] + [sum(counts.get(c, 0) for c in cells if c not in big)], dtype=torch.float64)
    exp = torch.tensor([exact[c] * n for c in big] + [sum(exact[c] for c in cells if c not in big) * n], dtype=torch.float64)
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    assert chi_square(obs, exp) < chi_square_limit(len(obs) - 1), (obs, exp)


def test_penalties_and_logit_bias_count_the_drafted_tokens(family_models):
    """Greedy under repetition, frequency and presence penalties and a logit bias: the penalty at
    each verified position counts the drafted tokens before it as generated, so the tokens equal a
    plain decode's (a penalty that missed them would let a repeat through a verify row)."""
    model = family_models["qwen3moe"]
    params = SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.4, frequency_penalty=0.6,
                            presence_penalty=0.5, logit_bias={7: 3.0, 12: -2.0})
    prompts = prompts_for(4, seed=11)
    plain = [r.output for r in run_checked(engine_for(model, 4, "off"), prompts, params)]
    refs = {tuple(p): o for p, o in zip(prompts, plain)}
    eng = engine_for(model, 4, "auto", drafter=lambda toks: NoisyOracle(refs, toks, wrong=0.2, vocab=300))
    assert [r.output for r in run_checked(eng, prompts, params)] == plain
    assert eng.speculation.stats.accepted_tokens > 20


# ---------------------------------------------------------------- a draft model (--draft)


def test_a_draft_model_on_the_first_stage_drafts_what_it_would_generate(family_models, tmp_path):
    """The target itself as its own draft model: every greedy draft is what the target would say,
    so every drafted token is accepted, through the draft model's own KV kept in step (prompt
    chunks mirrored, the last drafted token fed when every draft was kept). A different model of
    the same vocabulary drafts worse; the tokens are the plain ones either way."""
    import tiny_models as tm

    model = family_models["qwen3moe"]
    prompts = prompts_for(3, seed=21)
    params = SamplingParams(max_tokens=28, ignore_eos=True)
    plain = [r.output for r in run_checked(engine_for(model, 3, "off"), prompts, params)]

    def with_draft(path, mode="draft"):
        eng = Engine(LocalPipeline.from_model(model, 96, 3, draft=str(path)),
                     EngineConfig(max_seqs=3, max_len=256, micro_batches=1, speculative=mode))
        eng.speculation.PROBE = 1.0
        return eng

    same = with_draft(model.gguf.path)
    assert [r.output for r in run_checked(same, prompts, params)] == plain
    # the verify row's logits are the plain decode's: each kept token's log-probabilities and top 4
    scored = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=4)
    assert_same_logprobs(run_checked(with_draft(model.gguf.path), prompts, scored),
                         run_checked(engine_for(model, 3, "off"), prompts, scored))
    s = same.speculation.stats
    assert s.verify_rows > 0 and s.accepted_tokens == s.drafted_tokens and s.by_drafter["draft"].rows == s.verify_rows
    other = with_draft(write_gguf(tm.tiny_llama(seed=9), tmp_path / "draft.gguf", "Q8_0"), mode="auto")
    assert [r.output for r in run_checked(other, prompts, params)] == plain
    assert other.speculation.stats.verify_rows > 0


def assert_same_logprobs(spec_reqs, plain_reqs) -> None:
    """Every token's log-probability and top alternatives (with theirs) as the plain decode's."""
    for a_req, b_req in zip(spec_reqs, plain_reqs):
        assert a_req.output == b_req.output and len(a_req.logprobs) == len(b_req.logprobs) > 0
        for a, b in zip(a_req.logprobs, b_req.logprobs):
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [lp for _, lp in a.top] == pytest.approx([lp for _, lp in b.top], abs=1e-4)


def test_a_draft_model_of_another_vocabulary_is_refused(family_models, tmp_path):
    from moeray.errors import MoerayError
    from test_gguf_file import tiny_config, write_synthetic_gguf

    other = write_synthetic_gguf(tmp_path / "v160.gguf", tiny_config("llama", n_experts=0))
    with pytest.raises(MoerayError, match="its vocabulary has 160 tokens, the model's 300"):
        LocalPipeline.from_model(family_models["qwen3moe"], 16, 1, draft=str(other))
    with pytest.raises(MoerayError, match="needs a draft model: give --draft"):
        Engine(LocalPipeline.from_model(family_models["qwen3moe"], 16, 1),
               EngineConfig(max_seqs=1, max_len=64, micro_batches=1, speculative="draft"))


# ---------------------------------------------------------------- a next-token-prediction layer (GLM-4.5's nextn)


@pytest.fixture(scope="module")
def glm_mtp(tmp_path_factory):
    """The tiny GLM-4.5 with its MTP layer (a copy of its last decoder layer, as the converter's
    test files have it) given random eh_proj and norms, written as F32, and its transformers model."""
    import numpy as np
    import tiny_models as tm
    from moeray.stages.gguf.reader import read_gguf_header

    hf = tm.tiny_glm4moe()
    path = write_gguf(hf, tmp_path_factory.mktemp("mtp") / "glm.gguf", "F32")
    n = hf.config.num_hidden_layers
    header = read_gguf_header(path)
    rng = np.random.default_rng(0)
    mm = np.memmap(path, dtype=np.uint8, mode="r+")
    for name, make in [("eh_proj.weight", lambda s: rng.standard_normal(s) / np.sqrt(s[-1])),
                       ("enorm.weight", lambda s: 1 + 0.3 * rng.standard_normal(s)),
                       ("hnorm.weight", lambda s: 1 + 0.3 * rng.standard_normal(s)),
                       ("shared_head_norm.weight", lambda s: 1 + 0.3 * rng.standard_normal(s))]:
        t = header.tensors[f"blk.{n}.nextn.{name}"]
        values = make(t.shape).astype(np.float32)
        mm[t.offset:t.offset + t.n_bytes] = np.frombuffer(values.tobytes(), dtype=np.uint8)
    mm.flush()
    del mm
    return path, hf, {k: read_back(path, f"blk.{n}.nextn.{k}") for k in
                      ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head_norm.weight")}


def read_back(path, name):
    from moeray.stages.gguf.reader import GGUFFile

    g = GGUFFile(path)
    info = g.info(name)
    import numpy as np
    return torch.from_numpy(np.frombuffer(bytes(g.raw(name)), dtype=np.float32).reshape(info.shape).copy())


def mtp_reference(hf, nextn, tokens: list[int], chain: int) -> list[int]:
    """The MTP layer by its definition, with transformers' own GLM decoder layer as the block:
    position j reads embed(t_j) and the target's final normed state at j - 1 (zeros at 0); the
    tokens after `tokens`, chaining the layer's own normed output as the state."""
    from transformers.masking_utils import create_causal_mask

    m, cfg, eps = hf.model, hf.config, hf.config.rms_norm_eps
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    with torch.no_grad():
        h = m(torch.tensor([tokens])).last_hidden_state[0]
        toks, prev = list(tokens), [torch.zeros(cfg.hidden_size)] + list(h[:-1])
        out = []
        for _ in range(chain):
            e = m.embed_tokens(torch.tensor(toks))
            x = torch.cat([rms(e, nextn["enorm.weight"]), rms(torch.stack(prev), nextn["hnorm.weight"])], -1)
            x = (x @ nextn["eh_proj.weight"].T).unsqueeze(0)
            pos = torch.arange(len(toks)).unsqueeze(0)
            mask = create_causal_mask(config=cfg, inputs_embeds=x, attention_mask=None, cache=None, position_ids=pos)
            y = m.layers[-1](x, attention_mask=mask, position_ids=pos, position_embeddings=m.rotary_emb(x, pos))[0]
            state = rms(y, nextn["shared_head_norm.weight"])
            nxt = int(hf.lm_head(state[-1]).argmax())
            out.append(nxt)
            prev.append(state[-1])  # the chain: its own state stands in for the target's
            toks.append(nxt)
        return out


def test_the_mtp_layer_proposes_what_its_definition_gives(glm_mtp):
    """GLM-4.5's nextn layer on the last stage: after prompt chunks and after verify rows kept in
    part, the proposals returned with the step are the reference's (transformers' decoder layer as
    the block, the definition around it), chained 3 tokens; its KV kept by the catch-up of every row."""
    path, hf, nextn = glm_mtp
    model = load_model(path, backend="exact")
    prompts = [[5, 77, 120, 33, 9, 250, 18, 61, 4, 199, 87], [12, 240, 3]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = [r.output for r in run_checked(engine_for(model, 2, "off"), prompts, params)]
    refs = {tuple(p): o for p, o in zip(prompts, plain)}
    pipe = LocalPipeline.from_model(model, 32, 2, mtp=True)
    from moeray.stages.runtime.mtp import mtp_bytes
    priced = mtp_bytes(model.gguf.header, 32, 2, stage_has_embedding=True)  # the price, from the header: what it holds
    assert abs(pipe.stage.mtp.nbytes() - priced) <= 0.05 * priced, (pipe.stage.mtp.nbytes(), priced)
    eng = Engine(pipe, EngineConfig(max_seqs=2, max_len=128, micro_batches=1, prefill_chunk=5, speculative="auto"))
    spec = eng.speculation
    spec.new_drafter = lambda toks: NoisyOracle(refs, toks, wrong=0.5, vocab=300)
    spec.mtp_length = lambda s, left: 3 if left > 1 else 0

    def plan(seqs, room, n_plain, value, budget):  # n-gram-style verify rows, kept in part: the state after
        for s, r in zip(seqs, room):                # the last kept position is what the next proposal reads
            spec._offer(s, r)
            s.kind = "ngram"
        return [min(2, len(s.draft.tokens)) for s in seqs]

    spec.plan = plan
    reqs = [eng.add(p, params) for p in prompts]
    seen = 0
    while not all(r.done for r in reqs):
        eng.step()
        for r in reqs:
            if r.spec.proposal and not r.done:
                assert r.spec.proposal == mtp_reference(hf, nextn, r.prompt + r.output, 3), (r.prompt, r.output)
                seen += 1
    assert [r.output for r in reqs] == plain
    assert seen >= 6 and 0 < spec.stats.accepted_tokens < spec.stats.drafted_tokens


def test_mtp_speculation_keeps_the_greedy_tokens(glm_mtp):
    path, _, _ = glm_mtp
    model = load_model(path, backend="exact")
    prompts = prompts_for(3, seed=8)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = [r.output for r in run_checked(engine_for(model, 3, "off"), prompts, params)]
    eng = Engine(LocalPipeline.from_model(model, 160, 3, mtp=True),
                 EngineConfig(max_seqs=3, max_len=256, micro_batches=1, speculative="mtp"))
    eng.speculation.PROBE = 1.0
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=4)
    assert_same_logprobs(run_checked(eng, prompts, params), run_checked(engine_for(model, 3, "off"), prompts, params))
    s = eng.speculation.stats
    assert s.verify_rows > 0 and s.by_drafter["mtp"].rows == s.verify_rows and s.accepted_tokens > 0


# ---------------------------------------------------------------- a hybrid model (recurrent DeltaNet state)


class HybridModels(Models):
    """The tiny hybrid families (tests/tiny_hybrid.py): Q8_0 on the default backend (the stage
    graphs), and ("exact", family) F32 on the exact backend."""

    def __missing__(self, key):
        from tiny_hybrid import HYBRID_BUILDERS

        exact = isinstance(key, tuple)
        family = key[1] if exact else key
        path = write_gguf(HYBRID_BUILDERS[family](), self.folder / f"{family}{'-f32' if exact else ''}.gguf",
                          "F32" if exact else "Q8_0")
        self[key] = load_model(path, backend="exact") if exact else load_model(path)
        return self[key]


@pytest.fixture(scope="module")
def hybrid_models(tmp_path_factory):
    return HybridModels(tmp_path_factory.mktemp("hspec"))


def hybrid_engine(model, max_seqs: int, mode: str, drafter=None, checkpoints: int | None = None, **cfg) -> Engine:
    """A hybrid model's engine: `checkpoints` state slots after the sequence slots (default one per
    sequence), from which verify rows borrow their spares."""
    n_ckpt = max_seqs if checkpoints is None else checkpoints
    eng = Engine(LocalPipeline.from_model(model, 160, max_seqs, state_checkpoints=n_ckpt),
                 EngineConfig(max_seqs=max_seqs, max_len=256, micro_batches=1, speculative=mode, **cfg))
    if drafter is not None:
        eng.speculation.new_drafter = drafter
        eng.speculation.PROBE = 1.0
    return eng


def check_spares(eng: Engine) -> None:
    """The state-slot ledger after a step: every checkpoint slot free, cached or held, held exactly
    by the sequences that name it (a checkpoint to restore, a rolling one, a verify row's spare);
    a sequence holds a spare only while its verify row is in flight or its restore is pending."""
    from collections import Counter

    sched = eng.scheduler
    led = sched.spares
    held = Counter(s for r in sched.running + list(sched.waiting)
                   for s in (r.restore, r.rolling, r.spare) if s is not None)
    assert dict(held) == led.ref
    free, cached = set(led.free), set(led.cached)
    assert len(free) == len(led.free) and not free & cached and not (free | cached) & set(led.ref)
    assert len(free) + len(cached) + len(led.ref) == led.n
    for r in sched.running:
        assert (r.spare is not None) == (r.busy and any(row.req is r and row.draft for s, _ in eng.in_flight
                                                        for row in s.rows) or r.refeed > 0), r.id
        assert r.refeed == 0 or r.spare is not None
    for r in list(sched.waiting):
        assert r.spare is None and r.refeed == 0


def run_hybrid_checked(eng: Engine, prompts, params) -> list:
    reqs = [eng.add(p, params) for p in prompts]
    while not all(r.done for r in reqs):
        eng.step()
        check_ledger(eng)
        check_spares(eng)
    assert not eng.scheduler.spares.ref or eng.config.prefix_reuse  # only checkpoints' holders, if any
    assert all(r.spare is None for r in reqs)
    return reqs


HYBRIDS = ["qwen3next", "qwen35moe"]


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_greedy_tokens_are_the_same_with_and_without_speculation(hybrid_models, family):
    """A hybrid model drafts: each verify row snapshots its sequence's DeltaNet state into a spare
    slot, and a rejected draft's next row restores it and feeds the kept tokens again. With a
    drafter wrong one token in four (rejections every few rows) the greedy tokens are the plain
    decode's, one sequence and sixteen; the KV ledger and the state-slot ledger are checked after
    every step and no spare is left held."""
    model = hybrid_models[family]
    for batch in (1, 16):
        eng, got, plain = greedy_with_and_without(hybrid_engine, run_hybrid_checked, model, batch)
        assert got == plain, (family, batch)
        s = eng.speculation.stats
        # both verdicts: accepted runs, and rows whose draft met a refused token (restored after)
        assert s.accepted_tokens > 0 and s.by_drafter["ngram"].rejected > 0 and s.verify_rows > 0
        assert eng.stats.state_restores > 0 and eng.stats.refeed_tokens >= eng.stats.state_restores
        assert eng.stats.steps < run_steps_plain(plain)


def test_after_a_rejection_the_recurrent_state_is_the_plain_decodes(hybrid_models):
    """The state itself (exact backend, F32, tiny Qwen3-Next): after each step whose row restored
    the snapshot and re-fed the kept tokens, the sequence's conv and recurrent state over every
    DeltaNet layer equals, within 1e-4 of its largest value, the state a plain decode holds after
    the same tokens; and the next step's log-probabilities are the plain decode's."""
    model = hybrid_models["exact", "qwen3next"]
    prompt = prompts_for(1, seed=5)[0]
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=3)

    def states(eng):
        """Each step's (tokens in KV, the state after it, restored this step?), for the one sequence."""
        req = eng.add(prompt, params)
        kv, out = eng.pipeline.stage.kv, []
        while not req.done:
            restores = eng.stats.state_restores
            eng.step()
            check_ledger(eng)
            check_spares(eng)
            if not req.done and req.refeed == 0:  # not waiting on a restore: the state is its tokens'
                out.append((req.kv_len, kv.state.conv[:, req.slot].clone(), kv.state.rec[:, req.slot].clone(),
                            eng.stats.state_restores > restores))
        return req, out

    plain_req, plain = states(hybrid_engine(model, 1, "off"))
    by_len = {n: (c, r) for n, c, r, _ in plain}
    refs = {tuple(prompt): plain_req.output}
    eng = hybrid_engine(model, 1, "auto", drafter=lambda toks: NoisyOracle(refs, toks, wrong=0.4, vocab=300))
    got_req, got = states(eng)
    restored = [(n, c, r) for n, c, r, was in got if was]
    assert len(restored) >= 2 and eng.speculation.stats.by_drafter["ngram"].rejected > 0
    for n, conv, rec in restored:
        want_conv, want_rec = by_len[n]
        assert (conv - want_conv).abs().max() <= 1e-4 * want_conv.abs().max(), n
        assert (rec - want_rec).abs().max() <= 1e-4 * want_rec.abs().max(), n
    assert got_req.output == plain_req.output
    a = torch.tensor([[lp.logprob] + [p for _, p in lp.top] for lp in got_req.logprobs])
    b = torch.tensor([[lp.logprob] + [p for _, p in lp.top] for lp in plain_req.logprobs])
    assert (a - b).abs().max() <= 1e-4 * b.abs().max()


def test_a_hybrid_model_with_an_attention_draft_model_keeps_the_greedy_tokens(hybrid_models, tmp_path):
    """A transformer draft model (tiny llama, the same vocabulary, mostly wrong) drafting for a hybrid
    target: its rejected rows restore the target's state and re-feed, and the draft model's own KV
    is rewritten at the re-fed positions like the target's; the greedy tokens are the plain ones."""
    import tiny_models as tm

    model = hybrid_models["qwen3next"]
    prompts = prompts_for(3, seed=22)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = [r.output for r in run_hybrid_checked(hybrid_engine(model, 3, "off"), prompts, params)]
    draft = write_gguf(tm.tiny_llama(seed=9), tmp_path / "draft.gguf", "Q8_0")
    eng = Engine(LocalPipeline.from_model(model, 96, 3, draft=str(draft), state_checkpoints=3),
                 EngineConfig(max_seqs=3, max_len=256, micro_batches=1, speculative="draft"))
    eng.speculation.PROBE = 1.0
    assert [r.output for r in run_hybrid_checked(eng, prompts, params)] == plain
    assert eng.speculation.stats.by_drafter["draft"].rows > 0 and eng.stats.state_restores > 0


def test_a_hybrid_model_without_spare_slots_decodes_plainly_and_says_why(hybrid_models, caplog):
    """No checkpoint slots (--state-checkpoints 0): no spare to snapshot a verifying sequence's
    state into, so the hybrid model runs without speculation whatever the mode or a request's flag
    asks, says so in one line, and gives the plain greedy tokens."""
    import logging

    from moeray.cluster.engine import SPEC_OFF_NO_SPARES

    model = hybrid_models["qwen3next"]
    prompts = prompts_for(4, seed=3)
    plain = [r.output for r in run_checked(hybrid_engine(model, 4, "off", checkpoints=0), prompts,
                                           SamplingParams(max_tokens=16, ignore_eos=True))]
    with caplog.at_level(logging.INFO, logger="moeray"):
        eng = hybrid_engine(model, 4, "auto", checkpoints=0)
    assert any(r.getMessage() == SPEC_OFF_NO_SPARES for r in caplog.records)
    assert eng.speculation is None
    got = run_checked(eng, prompts, SamplingParams(max_tokens=16, ignore_eos=True, speculative=True))
    assert [r.output for r in got] == plain


def test_a_hybrid_sequence_without_a_free_spare_decodes_plainly(hybrid_models):
    """Two sequence slots, one checkpoint slot (prefix reuse off, so it only lends spares): at most
    one sequence verifies a draft at a time; the other runs plain rows, and the tokens are the
    plain decode's."""
    model = hybrid_models["qwen3next"]
    prompts = prompts_for(2, seed=7)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = [r.output for r in run_hybrid_checked(hybrid_engine(model, 2, "off", checkpoints=1), prompts, params)]
    refs = {tuple(p): o for p, o in zip(prompts, plain)}
    eng = hybrid_engine(model, 2, "auto", drafter=lambda toks: NoisyOracle(refs, toks, vocab=300), checkpoints=1,
                        prefix_reuse=False)
    assert eng.scheduler.checkpoints is None and eng.scheduler.spares.n == 1
    reqs = [eng.add(p, params) for p in prompts]
    most = 0
    while not all(r.done for r in reqs):
        eng.step()
        check_ledger(eng)
        check_spares(eng)
        most = max(most, sum(r.spare is not None for r in reqs))
    assert most == 1 and [r.output for r in reqs] == plain
    assert eng.speculation.stats.verify_rows > 0
