"""The step price speculation pays, kept true by the steps the engine has timed.

The price of a step of n tokens (planner/draft_length.py StepPrice) has two parts. The experts the
tokens read are the cost model's: each MoE layer's routing heat (a profile's counts, or uniform
k/E) and the price of reading one expert there (its stage's measured miss time; a resident expert
on a card costs next to nothing). The rest, the trunk's fixed cost per step and its cost per token
(and per logit row: a verify row needs the head at every position), is fitted to the steps this
engine has run: every step's wall time, its token count, its logit rows and its drafted tokens,
least squares over a recent window, pulled towards a prior until the window holds steps of more
than one size.

Two more numbers are fitted, because the cost model's shape can be wrong for the machine and the
choice of draft lengths depends on the *marginal* cost of a token at the batch's width:
- the weight of the expert part (1 = as the cost model says). The union of experts saturates
  with n, so at a full batch it says a drafted token reads no new expert and costs only its trunk
  compute; where experts are not what a step waits on (a CPU in one process: every expert already
  in memory, paid per token routed to it) that under-prices each extra token at a full batch and
  over-prices small steps. Measured on the default model, 2 threads, 16 rows (bench/spec_price.py):
  plain steps came in at 0.5-0.8 of their predicted ms, steps with drafts at 0.9-1.0, and a drafted
  token cost 9-30 ms against 8-9 predicted: drafts looked cheap exactly where they were not.
- what a drafted token costs beyond any token (`draft_ms`) and what a row carrying a draft costs
  once (`verify_row_ms`): a verify row's own work (attention queries padded to the longest row of
  the step, the verdict, a step shape of its own), learned from the steps that carried drafts
  against those that did not. On the default model at 1 row a 2-token step took 33 ms against a
  plain step's 14, while longer rows cost ~10 ms a drafted token: the first drafted token of a
  row is the dear one.
Coefficients are kept non-negative (a coefficient the data would push below 0 is fixed at 0 and
the rest refitted).

Pure arithmetic over numbers the pipeline gives; numpy for the fit.
"""
from __future__ import annotations

from collections import deque
from typing import Optional, Sequence

import numpy as np

from moeray.planner.draft_length import LayerExperts, StepPrice


def expert_layers(counts: Optional[np.ndarray], moe_layers: Sequence[int], n_experts: int, k: int,
                  cost_ms: Sequence[Sequence[float]]) -> tuple[LayerExperts, ...]:
    """Each MoE layer's heat (the chance one token routes to each expert: a profile's counts
    [n_layers, n_experts] scaled to sum to k per layer, or k/E without one) and each expert's
    price when read (cost_ms[i][e] for the i-th MoE layer)."""
    out = []
    for i, layer in enumerate(moe_layers):
        row = None if counts is None else np.asarray(counts[layer], dtype=np.float64)
        if row is None or row.sum() <= 0:
            heat = np.full(n_experts, k / n_experts)
        else:
            heat = np.minimum(1.0, k * row / row.sum())
        out.append(LayerExperts(tuple(float(h) for h in heat), tuple(float(c) for c in cost_ms[i])))
    return tuple(out)


class StepClock:
    """Timed steps -> the StepPrice speculation plans with."""

    WINDOW = 512  # recent steps the fit uses
    PRIOR_WEIGHT = 3.0  # the prior counts as this many steps in the fit
    REFIT_EVERY = 16  # steps between refits

    def __init__(self, layers: tuple[LayerExperts, ...] = (), overlap: tuple[float, ...] = ()):
        self.layers, self.overlap = layers, overlap
        self.steps: deque[tuple[int, int, int, int, float]] = deque(maxlen=self.WINDOW)
        self._since = 0
        self._price: Optional[StepPrice] = None
        self._expert: dict[int, float] = {}

    def expert_ms(self, n: int) -> float:
        """The cost model's expert part of a step of n tokens (before the fitted weight)."""
        if n <= 0 or not self.layers:
            return 0.0
        if n not in self._expert:
            self._expert[n] = StepPrice(0.0, 0.0, self.layers, self.overlap).experts_ms(n)
        return self._expert[n]

    def record(self, n_tokens: int, n_logits: int, ms: float, drafted: int = 0, verify_rows: int = 0) -> bool:
        """One step's size (tokens, logit rows, drafted tokens among its tokens, rows carrying
        them) and wall time; True when the price was refitted."""
        if n_tokens <= 0 or ms <= 0:
            return False
        self.steps.append((n_tokens, n_logits, drafted, verify_rows, ms))
        self._since += 1
        # the first steps (graphs built, caches cold) price poorly: refitted after 1, 2, 4, 8 steps
        early = len(self.steps) < self.REFIT_EVERY and len(self.steps) & (len(self.steps) - 1) == 0
        if self._price is None or early or self._since >= self.REFIT_EVERY:
            self._since = 0
            self._price = self.fit()
            return True
        return False

    def fit(self) -> Optional[StepPrice]:
        """ms = fixed + token * n + logit * rows + draft * drafted + verify * verify rows + weight *
        experts(n), least squares over the window with a ridge towards the prior (each
        coefficient's pull worth PRIOR_WEIGHT steps), coefficients >= 0. The step price charges a
        token both its token and logit parts (a drafted token is both), a drafted token `draft_ms`
        on top and a verify row `verify_row_ms`."""
        if not self.steps:
            return None
        data = np.array(self.steps, dtype=np.float64)
        n, rows, drafted, verify, ms = data[:, 0], data[:, 1], data[:, 2], data[:, 3], data[:, 4]
        experts = np.array([self.expert_ms(int(x)) for x in n])
        # The prior: the smallest steps' median is mostly fixed cost; each token then costs a
        # fifth of it (a step several tokens long costs noticeably more: drafts start cautious); a
        # drafted token or verify row costs what any token does; the expert part is the cost model's, unless it
        # alone would be more than half of the smallest steps' time (then it is scaled to that).
        n0 = int(n.min())
        base = max(float(np.median(ms[n == n0])), 1e-3)
        e0 = self.expert_ms(n0)
        weight0 = 1.0 if e0 <= 0.5 * base else 0.5 * base / e0
        rest = base - weight0 * e0
        prior = np.array([0.8 * rest, 0.1 * rest, 0.1 * rest, 0.0, 0.0, weight0])
        X = np.stack([np.ones_like(n), n, rows, drafted, verify, experts], axis=1)
        # each coefficient's prior weighs PRIOR_WEIGHT steps that have its feature (a window with
        # one verify step among hundreds of plain ones must not let that one step set the
        # drafted tokens' price)
        nonzero = np.maximum((X != 0).sum(axis=0), 1)
        w = self.PRIOR_WEIGHT * np.maximum((X * X).sum(axis=0) / nonzero, 1e-6)
        # A step that a busy machine held up (another process, a page fault) is no price of its
        # size: Huber weights, refitted twice, keep such steps from pulling the fit. Not the steps
        # with drafts: fewer, and dearer than the rest is what they are there to show.
        weights = np.ones_like(ms)
        plain = drafted == 0
        for _ in range(3):
            coef = self._solve(X, ms, weights, w, prior)
            resid = ms - X @ coef
            scale = 1.4826 * float(np.median(np.abs(resid[plain]) if plain.any() else np.abs(resid))) + 1e-6
            weights = np.where(plain, np.minimum(1.0, 2.0 * scale / np.maximum(np.abs(resid), 1e-12)), 1.0)
        fixed, token, logit, draft, row, weight = (max(float(c), 0.0) for c in coef)
        return StepPrice(fixed, token + logit, self.layers, self.overlap, expert_scale=weight, draft_ms=draft,
                         verify_row_ms=row, expert_curve=self.expert_ms)

    @staticmethod
    def _solve(X: np.ndarray, y: np.ndarray, weights: np.ndarray, ridge: np.ndarray, prior: np.ndarray) -> np.ndarray:
        """Weighted least squares with a ridge towards `prior`, coefficients >= 0 (those the data
        would push below 0 fixed at 0, the rest refitted)."""
        coef = np.zeros(len(prior))
        free = np.ones(len(prior), dtype=bool)
        for _ in range(len(prior)):
            Xf = X[:, free]
            A = (Xf * weights[:, None]).T @ Xf + np.diag(ridge[free])
            b = (Xf * weights[:, None]).T @ y + ridge[free] * prior[free]
            coef[:] = 0.0
            coef[free] = np.linalg.solve(A, b)
            if (coef >= 0).all():
                break
            free &= coef > 0
        return coef

    @property
    def price(self) -> Optional[StepPrice]:
        return self._price
