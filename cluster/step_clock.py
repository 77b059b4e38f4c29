"""The step price speculation pays, kept true by the steps the engine has timed.

The price of a step of n tokens (planner/draft_length.py StepPrice) has two parts. The experts the
tokens read are the cost model's: each MoE layer's routing heat (a profile's counts, or uniform
k/E) and the price of reading one expert there (its stage's measured miss time; a resident expert
on a card costs next to nothing). The rest, the trunk's fixed cost per step and its cost per token
(and per logit row: a verify row needs the head at every position), is fitted to the steps this
engine has run: every step's wall time, its token count and its logit rows, least squares over a
recent window, pulled towards a prior until the window holds steps of more than one size.

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
        self.steps: deque[tuple[int, int, float]] = deque(maxlen=self.WINDOW)
        self._since = 0
        self._price: Optional[StepPrice] = None

    def expert_ms(self, n: int) -> float:
        return StepPrice(0.0, 0.0, self.layers, self.overlap).ms(n) if n > 0 and self.layers else 0.0

    def record(self, n_tokens: int, n_logits: int, ms: float) -> bool:
        """One step's size and wall time; True when the price was refitted."""
        if n_tokens <= 0 or ms <= 0:
            return False
        self.steps.append((n_tokens, n_logits, ms))
        self._since += 1
        if self._price is None or self._since >= self.REFIT_EVERY:
            self._since = 0
            self._price = self.fit()
            return True
        return False

    def fit(self) -> Optional[StepPrice]:
        """fixed + token * n + logit * rows fitted to the window's times less their expert part;
        the step price charges a drafted token both (it is a token and a logit row)."""
        if not self.steps:
            return None
        data = np.array(self.steps, dtype=np.float64)
        n, rows, ms = data[:, 0], data[:, 1], data[:, 2]
        y = ms - np.array([self.expert_ms(int(x)) for x in n])
        # The prior: the smallest steps' median is mostly fixed cost; each token then costs a
        # fifth of it (a step several tokens long costs noticeably more: drafts start cautious).
        small = y[n == n.min()]
        base = max(float(np.median(small)), 1e-3)
        prior = np.array([0.8 * base, 0.1 * base, 0.1 * base])
        X = np.stack([np.ones_like(n), n, rows], axis=1)
        w = self.PRIOR_WEIGHT * float(np.mean(np.sum(X * X, axis=1)))  # ridge on the scale of the data
        A = X.T @ X + w * np.eye(3)
        b = X.T @ y + w * prior
        fixed, token, logit = np.linalg.solve(A, b)
        token, logit = max(float(token), 0.0), max(float(logit), 0.0)
        fixed = max(float(fixed), 0.0)
        return StepPrice(fixed, token + logit, self.layers, self.overlap)

    @property
    def price(self) -> Optional[StepPrice]:
        return self._price
