"""Speculative decoding, the engine's side: who drafts, how many tokens each verify row carries,
and what the drafters' acceptance has been.

Each decoding sequence with speculation on keeps a drafter over its own tokens (cluster/ngram.py).
When the scheduler packs a step, every such sequence offers the draft it has; the step's draft
lengths are priced together (planner/draft_length.py): the chance each drafted token is accepted
(the drafter's measured rate on this sequence, pulled towards its rate over all sequences at the
same match length) against what the step's extra tokens cost (StepPrice: the trunk's per-token
compute and the union of experts the tokens read, each at its stage's measured price). A draft
goes in only where it raises the step's expected tokens per ms, so a full batch, or a sequence
whose drafts keep failing, runs plain decode rows (k = 0).

The price is fitted to the steps as timed (cluster/step_clock.py), verify steps included, so a
drafted token is charged what it has cost at this machine's batch widths. What the price and the
acceptance estimates still get wrong is caught by the measured result (`step_done`): the tokens
the drafts kept against the tokens plain decoding would have made in the time they added; where
drafting has been a loss it pauses (planner/draft_length.py DraftGuard), so `auto` does not run
below plain decoding for long. The score is kept per record (a sequence's short n-gram guesses,
its copies: a match of COPY_BAND tokens or more, the draft model, the MTP layer), so short guesses
that lost on one answer pause only short guesses: a copy that starts in the next answer drafts.

The verify row runs on the stages like a prompt chunk; the last stage accepts a prefix of the
draft and adds one token of its own (stages/text/verify.py); the scheduler appends them under the
usual finish rules and gives back the KV blocks past the last accepted token.

Modes (EngineConfig.speculative, default off; a request's `speculative` flag turns it off or on):
  off    never draft (a request's `speculative: true` still drafts with the n-gram lookup)
  ngram  the n-gram drafter, priced per step
  draft  the draft model (--draft MODEL.gguf, stages/runtime/draft_model.py) only
  mtp    the file's next-token-prediction layer (GLM-4.5's nextn, stages/runtime/mtp.py) only
  auto   every drafter the pipeline has (n-gram, and the draft model and MTP layer where loaded),
         priced per step: drafts only where they pay, from the drafter with the surer first token
A model with recurrent (DeltaNet) layers (`recurrent`) verifies drafts too: its state absorbs a
whole verify row, so the scheduler snapshots the sequence's state slot into a spare one before the
row and, after a rejection, restores it and feeds the kept tokens again in the sequence's next row
(cluster/scheduler.py, docs/speculative.md). That re-feed is priced into the draft lengths
(planner/draft_length.py `refeed_ms`): a hybrid model drafts only where the wider rows after its
rejections are paid for too.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from moeray.cluster.ngram import Draft, NgramConfig, NgramDrafter
from moeray.errors import MoerayError
from moeray.planner.draft_length import DraftGuard, Offer, StepPrice, acceptance_estimate, choose_draft_lengths

MODES = ("auto", "off", "ngram", "draft", "mtp")
# Match lengths share acceptance statistics in these bands (a 2-token match guesses; a match of
# dozens of tokens is a copy in progress, which goes on: cluster/ngram.py Draft.match).
MATCH_BANDS = (2, 3, 4, 6, 8, 16, 32, 64)
COPY_BAND = 16  # from here a sequence's own record of its n-gram drafts is kept apart ("copy"): a
# copy's long rows are not judged by the short guesses the same answer made elsewhere
# A verify row's length (k + 1) is one of these: each step shape is a graph the stages build once
# per ROW_KEY_PAD keys (stages/runtime/trunk_graph.py; ~30 ms on the default model's 30 layers at one
# thread, a step or more) and keep, so a few sizes are built once and reused. Powers of two: a
# copy's rows grow 2, 4, 8, ... as its acceptance is measured, and a dozen sizes built a graph
# every few verify rows of a 200-token copy.
ROW_SIZES = (1, 2, 4, 8, 16, 32, 64)


def row_size_below(k: int) -> int:
    """The longest draft <= k whose row (k + 1 tokens) is one of ROW_SIZES."""
    return max(s for s in ROW_SIZES if s <= k + 1) - 1


def match_band(n: int) -> int:
    return max(b for b in MATCH_BANDS if b <= n) if n >= MATCH_BANDS[0] else 0


def band_prior(band: int) -> float:
    """The acceptance assumed for an n-gram draft of this match band before any was judged: a
    2-token match is a coin toss, a match of 32 tokens a copy (0.94)."""
    return band / (band + 2) if band > 0 else 0.5


@dataclass
class Tally:
    """A drafter's record: drafted tokens, how many were accepted, the rows that met a rejection."""
    drafted: int = 0
    accepted: float = 0.0
    rejected: float = 0.0  # rows whose draft met a refused token (the rest of that draft was not judged)
    rows: int = 0

    def add(self, drafted: int, accepted: int, decay: float = 1.0) -> None:
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + (accepted < drafted)
        self.drafted += drafted
        self.rows += 1

    def rate(self, prior: float, strength: float = 4.0) -> float:
        return acceptance_estimate(self.accepted, self.rejected, prior, strength)


@dataclass
class SpecStats:
    """What speculation did, for /v1/stages, the live page and Prometheus."""
    verify_rows: int = 0  # decode rows that carried a draft
    drafted_tokens: int = 0
    accepted_tokens: int = 0  # drafted tokens the target accepted
    emitted_tokens: int = 0  # tokens verify rows gave (accepted + one each)
    by_drafter: dict[str, Tally] = field(default_factory=dict)
    pauses: int = 0  # times drafting paused: its measured goodput fell below plain decoding's
    paused_steps: int = 0  # steps run without drafts for it
    # measured / predicted ms of the steps without drafts and with them (the price's bias, decayed)
    plain_fit: float = 1.0
    verify_fit: float = 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_verify_row(self) -> float:
        return self.emitted_tokens / self.verify_rows if self.verify_rows else 0.0

    def as_dict(self) -> dict:
        return {"verify_rows": self.verify_rows, "drafted_tokens": self.drafted_tokens,
                "accepted_tokens": self.accepted_tokens, "emitted_tokens": self.emitted_tokens,
                "acceptance_rate": round(self.acceptance_rate, 4),
                "tokens_per_verify_row": round(self.tokens_per_verify_row, 3),
                "by_drafter": {k: {"verify_rows": t.rows, "drafted_tokens": t.drafted,
                                   "accepted_tokens": int(t.accepted)} for k, t in self.by_drafter.items()},
                "pauses": self.pauses, "paused_steps": self.paused_steps,
                "measured_over_predicted": {"plain": round(self.plain_fit, 3), "verify": round(self.verify_fit, 3)}}


@dataclass
class SeqSpec:
    """One sequence's speculation: its n-gram drafter, whether the draft model serves it, and a
    record per drafter."""
    drafter: Any  # NgramDrafter, or any object with extend(tokens) and draft(max_tokens) -> Draft
    model: bool = False  # the first stage's draft model mirrors this sequence and may draft for it
    tallies: dict[str, Tally] = field(default_factory=dict)
    draft: Optional[Draft] = None  # the n-gram draft offered this step (its tokens, its match length)
    kind: str = "ngram"  # the drafter of this step's row: "ngram" | "draft" | "mtp"
    proposal: list[int] = field(default_factory=list)  # the MTP layer's tokens after the last one

    def tally(self, kind: str) -> Tally:
        return self.tallies.setdefault(kind, Tally())


class Speculation:
    """The engine's drafters and the per-step choice of draft lengths."""

    PRIOR = 0.5  # a drafter's assumed acceptance before it has drafted (a mid guess, updated fast)
    # Offers refused for a low rate are tried with one token this often (rates move), where a
    # surer drafter (PROBE_RATE) would have been drafted: a probe where no rate could pay (a full
    # batch on a machine whose drafted tokens cost what plain rows do) is a cost with nothing to
    # learn. PROBE = 1 (tests): every refused offer verifies one token every step, guard or not.
    PROBE = 1 / 32
    PROBE_RATE = 0.95
    DECAY = 0.97  # a sequence's record forgets old rows: a copy starts or ends mid-answer
    FIT_DECAY = 0.98  # per step, the measured / predicted sums

    def __init__(self, mode: str = "auto", price: Optional[StepPrice] = None, ngram: NgramConfig = NgramConfig(),
                 max_draft: int = 32, seed: int = 0, drafter: Optional[Callable[[list[int]], Any]] = None,
                 draft_model: bool = False, draft_token_ms: float = 0.0, mtp: bool = False,
                 mtp_token_ms: float = 0.0, recurrent: bool = False):
        """`drafter(tokens)`: a sequence's engine-side drafter (extend(tokens), draft(max_tokens) ->
        Draft), default the n-gram drafter; `draft_model`: the pipeline's first stage has a draft
        model (stages/runtime/draft_model.py), whose every drafted token costs `draft_token_ms`;
        `mtp`: its last stage has a next-token-prediction layer (stages/runtime/mtp.py), which
        proposes tokens after each step at `mtp_token_ms` each; `recurrent`: the model has
        recurrent layers, whose rejected drafts are re-fed in a later row (priced in)."""
        if mode not in MODES:
            raise MoerayError(f"speculative mode {mode!r} is not one of {', '.join(MODES)}")
        if mode == "draft" and not draft_model:
            raise MoerayError("--speculative draft needs a draft model: give --draft MODEL.gguf (a small model of "
                              "the same vocabulary), or use --speculative auto or ngram")
        if mode == "mtp" and not mtp:
            raise MoerayError("--speculative mtp needs a model file with next-token-prediction (nextn) layers, "
                              "which this one has not; use --speculative auto or ngram")
        self.mode, self.ngram, self.max_draft = mode, ngram, max_draft
        self.recurrent = recurrent
        self.new_drafter = drafter or (lambda tokens: NgramDrafter(ngram, tokens))
        self.draft_model, self.draft_token_ms = draft_model and mode in ("auto", "draft"), draft_token_ms
        self.mtp, self.mtp_token_ms = mtp and mode in ("auto", "mtp"), mtp_token_ms
        self.mtp_tally = Tally()  # the MTP layer, over every sequence
        self.price = price
        self._table: list[float] = []
        self.stats = SpecStats()
        self.bands: dict[int, Tally] = {}  # per n-gram match band, over every sequence
        self.model_tally = Tally()  # the draft model, over every sequence
        self._rng = random.Random(seed)
        # the measured score per record (_record: "ngram", "copy", "draft", "mtp"): what lost pauses alone
        self.guards: dict[str, DraftGuard] = {}
        self._verdicts: dict[str, list[int]] = {}  # this step's verify rows per record: drafted, accepted
        # decayed sums of measured and predicted ms: steps without drafts, steps with them
        self._fit = {False: [0.0, 0.0], True: [0.0, 0.0]}

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def wants(self, params) -> bool:
        """Whether a request drafts: its own flag where it set one, else the engine's mode."""
        flag = getattr(params, "speculative", None)
        return self.enabled if flag is None else bool(flag)

    def start(self, tokens) -> SeqSpec:
        return SeqSpec(self.new_drafter(list(tokens)), model=self.draft_model)

    def set_price(self, price: StepPrice) -> None:
        self.price, self._table = price, []

    def step_table(self, n: int) -> list[float]:
        if len(self._table) <= n:
            price = self.price or StepPrice(fixed_ms=1.0, token_ms=0.05)
            self._table = price.table(max(n, 2 * len(self._table), 64))
        return self._table

    def rate(self, seq: SeqSpec, kind: str, band: int = 0) -> float:
        """The acceptance rate a drafter is expected to have on this sequence: its record here,
        pulled towards its record over all sequences (for the n-gram drafter at this match band,
        whose own prior grows with the band)."""
        if kind in ("draft", "mtp"):
            over_all, prior = (self.model_tally if kind == "draft" else self.mtp_tally), self.PRIOR
        else:
            over_all, prior = self.bands.get(band), band_prior(band)
        if over_all is not None:
            prior = over_all.rate(prior)
        return seq.tally(self._record(kind, band)).rate(prior)

    @staticmethod
    def _record(kind: str, band: int) -> str:
        """Which of a sequence's records a draft is judged by: its drafter's, the n-gram drafter's
        copies (a long match) apart from its guesses."""
        return "copy" if kind == "ngram" and band >= COPY_BAND else kind

    def guard(self, record: str) -> DraftGuard:
        return self.guards.setdefault(record, DraftGuard())

    def _paused(self, record: str) -> bool:
        """Whether drafts of this record wait out a pause (tests' PROBE = 1 never pauses)."""
        g = self.guards.get(record)
        return g is not None and not g.open and self.PROBE < 1

    def _offer(self, s: SeqSpec, room: int) -> Offer:
        """The better of the sequence's drafters this step (the surer first token), and which; a
        drafter whose record is paused offers nothing."""
        n = min(room, self.max_draft)
        d = s.drafter.draft(n) if n > 0 and self.mode not in ("draft", "mtp") else Draft([], 0)
        s.draft, s.kind = d, "ngram"
        band = match_band(d.match)
        best = Offer(self.rate(s, "ngram", band), 0 if self._paused(self._record("ngram", band)) else len(d.tokens))
        others = []
        if s.model and n > 0 and not self._paused("draft"):
            others.append(("draft", Offer(self.rate(s, "draft"), n, self.draft_token_ms)))
        if self.mtp and s.proposal and n > 0 and not self._paused("mtp"):  # already drafted, by the last step: no cost now
            others.append(("mtp", Offer(self.rate(s, "mtp"), min(n, len(s.proposal)))))
        for kind, offer in others:
            if not best.max_tokens or offer.acceptance > best.acceptance:
                s.kind, best = kind, offer
        return best

    def mtp_length(self, s: SeqSpec, left: int) -> int:
        """Tokens the MTP layer is asked to propose after a row (each one a chained pass of the
        layer and the head): as far as the run is likely to survive, a^k >= 1/5 at its measured
        rate a, at most MAX_CHAIN; 0 when it is not this sequence's drafter."""
        if not self.mtp or left < 2:
            return 0
        from moeray.stages.runtime.mtp import MAX_CHAIN

        a = min(self.rate(s, "mtp"), 0.99)
        k = 1 if a <= 0.2 else int(math.log(0.2) / math.log(a))
        return max(1, min(k, MAX_CHAIN, self.max_draft, left - 1))

    def plan(self, seqs: list[SeqSpec], room: list[int], n_plain: int, value: float, budget: int) -> list[int]:
        """Draft lengths for these sequences in a step of `n_plain` tokens yielding `value`:
        room[i] is the most sequence i may draft (its tokens left, KV it may take); each sequence's
        `kind` says which drafter its row's tokens come from."""
        if not seqs or budget <= 0:
            return [0] * len(seqs)
        offers = [self._offer(s, r) for s, r in zip(seqs, room)]
        table = self.step_table(n_plain + 1 + min(budget, sum(o.max_tokens for o in offers)))
        # a re-fed token costs a later step what one more token costs this one
        refeed_ms = max(0.0, table[n_plain + 1] - table[n_plain]) if self.recurrent else 0.0
        price = self.price or StepPrice(0.0, 0.0)
        choice = choose_draft_lengths(table, n_plain, value, offers, budget, refeed_ms, price.draft_ms,
                                      price.verify_row_ms)
        lengths = [row_size_below(k) for k in choice.lengths]
        refused = [i for i, (o, k) in enumerate(zip(offers, lengths)) if k == 0 and o.max_tokens > 0]
        if refused and self.PROBE < 1:  # only where a surer rate would change the choice
            surer = [replace(o, acceptance=max(o.acceptance, self.PROBE_RATE)) if k == 0 else o
                     for o, k in zip(offers, lengths)]
            could = choose_draft_lengths(table, n_plain, value, surer, budget, refeed_ms, price.draft_ms,
                                         price.verify_row_ms).lengths
            refused = [i for i in refused if could[i] > 0]
        for i in refused:  # a drafter never verified on this sequence is tried once for sure: its rate is a guess
            s = seqs[i]
            band = match_band(s.draft.match) if s.kind == "ngram" and s.draft is not None else 0
            first = s.tally(self._record(s.kind, band)).rows == 0
            if sum(lengths) < budget and (first or self._rng.random() < self.PROBE):
                lengths[i] = 1  # keep measuring a rate the choice has stopped trying
        return lengths

    def step_done(self, n_tokens: int, drafted: int, accepted: int, value: int, ms: float, verify_rows: int = 0,
                  cold: bool = False) -> None:
        """A step came back: its tokens (`drafted` of them drafted, `accepted` of those kept), the
        tokens its rows gave without the drafts (`value`: its decode rows) and its measured ms
        (`cold`: the stages built a graph for it, so its time says nothing of its size; its verify
        rows' verdicts are dropped). Keeps the price's measured / predicted ratio for steps without
        and with drafts, and scores the drafts per record (DraftGuard; the verdicts `observe` kept
        for this step's rows): the ms they added is the step's measured ms less the same step
        without them (its predicted ms, times what plain steps measured over their prediction),
        shared among the records by their drafted tokens."""
        verdicts, self._verdicts = self._verdicts, {}
        if cold or n_tokens <= 0 or ms <= 0 or self.mode == "off" and not drafted:
            return
        if any(not g.open for g in self.guards.values()):
            self.stats.paused_steps += 1
        table = self.step_table(n_tokens)
        price = self.price or StepPrice(0.0, 0.0)
        predicted = table[n_tokens] + drafted * price.draft_ms + verify_rows * price.verify_row_ms
        sums = self._fit[drafted > 0]
        sums[0] = sums[0] * self.FIT_DECAY + ms
        sums[1] = sums[1] * self.FIT_DECAY + predicted
        plain = self._fit[False]
        r_plain = plain[0] / plain[1] if plain[1] > 0 else 1.0
        self.stats.plain_fit = r_plain
        if sums is not plain:
            self.stats.verify_fit = sums[0] / sums[1] if sums[1] > 0 else 1.0
        without = r_plain * table[n_tokens - drafted] if n_tokens > drafted else 0.0
        rate = value / without if without > 0 else 0.0
        for record in verdicts:
            self.guard(record)
        for record, g in self.guards.items():  # every guard counts its pause down, judges its own rows
            d, a = verdicts.get(record, (0, 0))
            if g.step(d, a, (ms - without) * d / max(drafted, d, 1), rate):
                self.stats.pauses += 1

    def observe(self, seq: SeqSpec, drafted: int, accepted: int, emitted: int) -> None:
        """A verify row came back: `accepted` of its `drafted` tokens, `emitted` tokens in all
        (fewer than accepted + 1 where the sequence finished inside the row)."""
        kind = seq.kind
        band = match_band(seq.draft.match if seq.draft is not None else 0) if kind == "ngram" else 0
        record = self._record(kind, band)
        seq.tally(record).add(drafted, accepted, self.DECAY)
        v = self._verdicts.setdefault(record, [0, 0])  # scored with the step (step_done)
        v[0] += drafted
        v[1] += accepted
        if kind in ("draft", "mtp"):
            (self.model_tally if kind == "draft" else self.mtp_tally).add(drafted, accepted, self.DECAY)
        else:
            self.bands.setdefault(band, Tally()).add(drafted, accepted, self.DECAY)
        self.stats.by_drafter.setdefault(kind, Tally()).add(drafted, accepted)
        s = self.stats
        s.verify_rows += 1
        s.drafted_tokens += drafted
        s.accepted_tokens += accepted
        s.emitted_tokens += emitted
