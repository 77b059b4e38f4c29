"""Draft lengths priced per step: how many drafted tokens each sequence verifies (0 allowed).

A verify step runs k + 1 tokens of a sequence as one row. On an MoE the row reads the union of the
experts its tokens route to, so a longer draft costs more than on a dense model, and more on a
stage whose experts miss its cache. The step's price as a function of its token count n is

    T(n) = fixed_ms + token_ms * n + sum over MoE layers l, experts e of cost_ms[l][e] * P(e used | n)

with P(e used | n) = 1 - (1 - heat[l][e])^n: heat is the chance one token routes to e (a routing
profile's share, times k), cost_ms the time expert e costs a step where it is read: the stage's
measured miss time for an expert outside its cache, a resident read otherwise. Consecutive tokens
of one sequence route more alike than independent draws; `overlap` (measured from routing traces:
the distinct experts of n consecutive tokens over the independent expectation, 1 = none) scales
the expert term.

A drafted token is worth its chance of being accepted: with a per-token acceptance rate a (the
drafter's measured rate), the j-th draft token of a row is emitted with probability a^j (every one
before it accepted). A step that also holds `n_plain` tokens (other sequences' decode rows, prompt
chunks) yielding `value` tokens is worth (value + sum of the accepted-token chances) / T(n): the
tokens per ms the whole batch gets. The choice maximises exactly that, so a draft goes in only
where it raises the step's expected throughput: under a full batch, where the experts are already
read and each token's own compute is what grows, drafts shrink to 0 unless they are very sure.

A hybrid model (recurrent DeltaNet layers) pays once more for a rejection: its state absorbed the
whole row, so the sequence's next row restores the state from before the row and feeds the kept
tokens again (cluster/scheduler.py). A draft of k tokens refused after j accepted ones adds j + 1
tokens to a later step, so its expected re-fed tokens are sum_{j<k} a^j (1 - a) (j + 1), and the
k-th drafted token adds a^(k-1) (1 - a) k of them; each is priced at `refeed_ms` (a token's
marginal price in a step) on the choice's side of the cost.

Pure: no torch, no Ray, no environment.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence


@dataclass(frozen=True)
class LayerExperts:
    """One MoE layer as a step sees it: each expert's routing heat and its price when read."""
    heat: tuple[float, ...]  # chance one token routes to each expert (sums to k, the experts per token)
    cost_ms: tuple[float, ...]  # ms each expert costs a step that reads it (miss or resident read)

    def __post_init__(self) -> None:
        if len(self.heat) != len(self.cost_ms):
            raise ValueError(f"layer experts: {len(self.heat)} heats for {len(self.cost_ms)} costs")
        if any(not 0 <= h <= 1 for h in self.heat):
            raise ValueError("layer experts: a heat is the chance one token routes to the expert, in [0, 1]")

    def expected_ms(self, n: int) -> float:
        """The expected price of the experts n independent tokens read."""
        return sum(c * (1.0 - (1.0 - h) ** n) for h, c in zip(self.heat, self.cost_ms))


@dataclass(frozen=True)
class StepPrice:
    """The predicted ms of one step as a function of its token count."""
    fixed_ms: float  # a step's own cost whatever its size: the trunk's weights read once, hand-offs
    token_ms: float  # each token's own compute through the trunk
    layers: tuple[LayerExperts, ...] = ()
    overlap: tuple[float, ...] = ()  # per token count n (index n - 1): consecutive routing / independent; () = 1
    # What the timed steps say the experts' part is worth: 1 = the cost model's expert prices as
    # they are; below 1 where an expert's read is not what a step waits on (a CPU whose experts
    # all sit in memory pays per token routed, which the token term carries)
    expert_scale: float = 1.0
    # What a drafted token costs beyond any token of the step (its head row is in token_ms), and
    # what a row carrying a draft costs once (the verdict over its positions, queries padded to
    # the longest row of the step, a step shape of its own): measured on the steps that carried
    # drafts against those that did not; charged by the choice per drafted token, per verify row
    draft_ms: float = 0.0
    verify_row_ms: float = 0.0
    # The expert part of n tokens (overlap applied, before expert_scale), kept by whoever refits the
    # price (cluster/step_clock.py): a refit changes the coefficients, not the layers' heat, and
    # summing every layer's experts for each n of a table costs a decode step's worth of Python
    # on a large model. None: summed here.
    expert_curve: Optional[Callable[[int], float]] = field(default=None, compare=False, repr=False)

    def experts_ms(self, n: int) -> float:
        """The expert part of a step of n tokens, before expert_scale."""
        if n <= 0 or not self.layers:
            return 0.0
        if self.expert_curve is not None:
            return self.expert_curve(n)
        ov = self.overlap[min(n, len(self.overlap)) - 1] if self.overlap else 1.0
        return ov * sum(layer.expected_ms(n) for layer in self.layers)

    def ms(self, n: int) -> float:
        if n <= 0:
            return 0.0
        experts = self.experts_ms(n) if self.expert_scale else 0.0
        return self.fixed_ms + self.token_ms * n + self.expert_scale * experts

    def table(self, n_max: int) -> list[float]:
        """T(0..n_max)."""
        return [self.ms(n) for n in range(n_max + 1)]


@dataclass(frozen=True)
class Offer:
    """A sequence that could verify a draft this step."""
    acceptance: float  # the chance each drafted token is accepted (the drafter's measured rate)
    max_tokens: int  # the most it can draft now (what the drafter has, its room left)
    token_ms: float = 0.0  # what the drafter itself spends on each token it drafts (a draft model's step)

    def gain(self, j: int) -> float:
        """The expected tokens the j-th drafted token (1-based) adds."""
        return self.acceptance ** j


@dataclass
class Choice:
    lengths: list[int]  # draft tokens per offer, in the offers' order
    expected_tokens: float  # the step's expected tokens with them
    ms: float  # the step's predicted ms with them
    tokens_per_ms_without: float = field(default=0.0)

    @property
    def tokens_per_ms(self) -> float:
        return self.expected_tokens / self.ms if self.ms > 0 else 0.0


def choose_draft_lengths(step_ms: Sequence[float], n_plain: int, value: float, offers: Sequence[Offer],
                         max_draft: int | None = None, refeed_ms: float = 0.0, draft_ms: float = 0.0,
                         row_ms: float = 0.0) -> Choice:
    """Draft lengths for `offers` that maximise the step's expected tokens per ms.

    step_ms[n]: the predicted ms of a step of n tokens (StepPrice.table), long enough for every
    token the offers could add; n_plain: the step's tokens without drafts; value: the tokens they
    yield (its decode rows). Each offer's drafted tokens are worth a^1, a^2, ... (decreasing), so
    the best m drafted tokens are the m largest of those chances over all offers; every m up to
    the limit is tried, and the best ratio wins (the smallest m on ties: 0 when nothing pays).
    `refeed_ms`: what one token re-fed after a rejection costs a later step (a hybrid model; 0
    where a rejection costs nothing more), charged at each drafted token's expected re-feed.
    `draft_ms`: what each drafted token costs beyond a token of the step (StepPrice.draft_ms);
    `row_ms`: what a row carrying a draft costs once, charged with its first drafted token
    (StepPrice.verify_row_ms).
    """
    limit = sum(o.max_tokens for o in offers)
    if max_draft is not None:
        limit = min(limit, max_draft)
    limit = min(limit, len(step_ms) - 1 - n_plain)
    base = value / step_ms[n_plain] if n_plain > 0 and step_ms[n_plain] > 0 else 0.0
    lengths = [0] * len(offers)
    best = Choice(list(lengths), value, step_ms[n_plain] if n_plain > 0 else 0.0, base)
    if limit <= 0:
        return best
    # the m largest chances, by a heap over each offer's next token
    heap = [(-o.gain(1), i) for i, o in enumerate(offers) if o.max_tokens > 0 and o.acceptance > 0]
    heapq.heapify(heap)
    gained, best_m, best_ratio, drafting_ms = value, 0, base, 0.0
    order: list[int] = []
    while heap and len(order) < limit:
        g, i = heapq.heappop(heap)
        order.append(i)
        lengths[i] += 1
        gained += -g
        drafting_ms += offers[i].token_ms + draft_ms + (row_ms if lengths[i] == 1 else 0.0)
        if refeed_ms:  # the k-th token: a rejection at it or after re-feeds k more tokens, at a^(k-1) (1 - a)
            a, k = offers[i].acceptance, lengths[i]
            drafting_ms += refeed_ms * a ** (k - 1) * (1 - a) * k
        if lengths[i] < offers[i].max_tokens:
            heapq.heappush(heap, (-offers[i].gain(lengths[i] + 1), i))
        n = n_plain + len(order)
        ratio = gained / (step_ms[n] + drafting_ms)
        if ratio > best_ratio * (1 + 1e-9):
            best_m, best_ratio = len(order), ratio
            best = Choice([0] * len(offers), gained, step_ms[n] + drafting_ms, base)
    for i in order[:best_m]:
        best.lengths[i] += 1
    return best


def acceptance_estimate(accepted: float, rejected: float, prior: float, strength: float = 4.0) -> float:
    """The per-token acceptance rate of a drafter on one sequence: its accepted drafted tokens and
    its rejections (a row's first refused token; the tokens after it were never judged), as the
    success chance of a geometric run, pulled towards `prior` (the drafter's rate over every
    sequence) by `strength` pseudo-observations."""
    return (accepted + strength * prior) / (accepted + rejected + strength)


@dataclass
class DraftGuard:
    """Drafting's measured worth, and a pause where it has been a loss.

    The choice above is only as right as its step price and its acceptance estimates. This keeps
    the score on the steps that carried drafts, as they were measured: the drafted tokens kept
    (won) against the tokens plain decoding would have made in the time the drafts added to those
    steps (spent: each step's measured ms less what the same step without its drafts costs, times
    the plain rate of its decode rows). Where won falls below spent over `min_steps` such steps,
    drafts lowered throughput whatever the price said: drafting pauses for `pause` steps, doubled
    at each trip in a row (a workload where drafts never pay is tried less and less often), back
    to `first_pause` after a run of steps that paid; each try starts with a clean score.
    """
    min_steps: int = 16  # verify steps judged before a verdict (a step's time is noisy)
    decay: float = 0.95  # per judged step: the score follows the workload as it changes
    first_pause: int = 64  # steps
    max_pause: int = 1024  # at a full batch of 150-ms steps, 2.5 minutes
    won: float = 0.0
    spent: float = 0.0
    judged: int = 0
    paused: int = 0  # steps left without drafts
    pause: int = 0  # the next pause's length (first_pause until a trip)
    trips: int = 0

    def __post_init__(self) -> None:
        self.pause = self.pause or self.first_pause

    @property
    def open(self) -> bool:
        return self.paused <= 0

    def step(self, drafted: int, accepted: int, extra_ms: float, plain_rate: float) -> bool:
        """One step done: its drafted tokens, how many were kept, the ms its drafts added and the
        plain rate (tokens per ms) of its decode rows. True when it trips a pause."""
        if self.paused > 0:
            self.paused -= 1
            return False
        if drafted <= 0:
            return False
        self.won = self.won * self.decay + accepted
        self.spent = self.spent * self.decay + max(extra_ms, 0.0) * plain_rate
        self.judged += 1
        if self.judged < self.min_steps:
            return False
        if self.won < self.spent:
            self.paused, self.trips = self.pause, self.trips + 1
            self.pause = min(2 * self.pause, self.max_pause)
            self.won = self.spent = 0.0
            self.judged = 0
            return True
        if self.judged >= 4 * self.min_steps:
            self.pause = self.first_pause
        return False
