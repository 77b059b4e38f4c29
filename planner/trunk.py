"""Trunk placement: which dense pieces of a stage go on its card.

Each trunk component is priced in bytes saved on the host's memory bus per token, per byte of
VRAM. A dense component is read on every token: value 1.0 per byte (the embedding is read one
row per token: value 0, so it only takes room no expert would use). A routed expert is read
with probability p_e (its heat share within its layer times k, capped at 1; k/E without
counts) and its host copy reads `cpu_factor` times its card bytes: value cpu_factor*p_e per
byte. A component goes on the card when the experts it would push out of the cache (the
coldest held ones) are worth less than it; room that no expert would use always goes to the
trunk. Concretely (TrunkPricer): the held experts worth at least a dense byte are protected,
the trunk takes the rest of the room (head, then the layers in order while they fit), the
experts fill what is left with the stop rule, and the embedding takes leftover room. That is
O(1) fills per (stage, a, b), so the search prices the trunk inside every range.

p_e follows the issue/seed (heat share x k, or k/E) rather than the mass the cost model
uses, so with `auto` a little more VRAM can, rarely, predict a slightly slower step (the trunk
takes room the H curve values more than k/E does); with `off` the prediction is monotone.

Modes: `auto` (default); `off` (the planner places no trunk: free_bytes is taken to be net of
it, as Strata and colibri do, and no trunk time is priced); or an explicit list obeyed as
written and charged to the expert budget:

    head=gpu,embed=cpu,layers=0-20+30-47      (ranges inclusive, global layer indices)

Names: `head` (alias lmhead, output), `embed` (embedding), `layers` (alias attn, trunk);
values gpu|cpu for head/embed, all|none|ranges for layers; anything not named stays on the host.

Time: a component left on the host costs its bytes at the host's speed, which `miss_ms`
measures: one miss reads cpu_factor*blob[l] host bytes in miss_ms, so a dense byte costs
miss_ms / (cpu_factor*blob[l]). With `off` nothing of this is added and the step-time formula
in planner/search.py is exact.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moeray.errors import PlacementError
from moeray.units import format_bytes

MIB = 1 << 20


def fmt_p(p: float) -> str:
    return f"{p:.2f}" if p >= 0.01 or p == 0 else f"{p:.2g}"


@dataclass
class TrunkPolicy:
    mode: str = "auto"  # auto | off | explicit
    head: bool = False
    embed: bool = False
    layers: set[int] = field(default_factory=set)
    text: str = "auto"

    @classmethod
    def parse(cls, text: str | None, n_layers: int) -> "TrunkPolicy":
        text = (text or "auto").strip()
        if text in ("auto", "off"):
            return cls(mode=text, text=text)
        pol = cls(mode="explicit", text=text)
        for item in text.split(","):
            name, sep, where = item.strip().partition("=")
            name, where = name.strip().lower(), where.strip().lower()
            if not sep:
                raise PlacementError(f"--trunk {text!r}: {item!r} is not NAME=WHERE (e.g. head=gpu,layers=0-20)")
            if name in ("head", "lmhead", "output"):
                pol.head = _gpu_cpu(where, item, text)
            elif name in ("embed", "embedding"):
                pol.embed = _gpu_cpu(where, item, text)
            elif name in ("layers", "attn", "trunk"):
                pol.layers |= _layer_set(where, n_layers, item, text)
            else:
                raise PlacementError(f"--trunk {text!r}: unknown component {name!r}; use head, embed or layers")
        return pol


def _gpu_cpu(where: str, item: str, text: str) -> bool:
    if where in ("gpu", "cuda", "card", "1", "on"):
        return True
    if where in ("cpu", "host", "0", "off"):
        return False
    raise PlacementError(f"--trunk {text!r}: {item!r} must be gpu or cpu")


def _layer_set(where: str, n_layers: int, item: str, text: str) -> set[int]:
    if where in ("all", "gpu"):
        return set(range(n_layers))
    if where in ("none", "cpu", ""):
        return set()
    out: set[int] = set()
    for part in where.split("+"):
        lo, dash, hi = part.partition("-")
        try:
            lo_i, hi_i = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise PlacementError(f"--trunk {text!r}: {item!r}: layers are all, none or ranges like 0-20+30-35") from None
        if not 0 <= lo_i <= hi_i < n_layers:
            raise PlacementError(f"--trunk {text!r}: layers {part} are outside 0-{n_layers - 1}")
        out |= set(range(lo_i, hi_i + 1))
    return out


def _pieces_text(tb, layer: int) -> str:
    """" [dnproj 35.7 MiB + attn ...]": what a layer's trunk is made of, when the spec says."""
    if not tb.pieces:
        return ""
    return " [" + " + ".join(f"{k} {format_bytes(v)}" for k, v in tb.pieces[layer].items() if v) + "]"


def expert_read_probability(profile, k: int) -> np.ndarray:
    """p_e of each ranked pair: heat share within its layer times k, capped at 1; k/E without counts."""
    T = len(profile.pairs)
    if profile.counts is None:
        return np.full(T, min(1.0, k / profile.n_experts))
    lay = profile.layers_array()
    c = profile.counts_array().astype(np.float64)
    per_layer = np.bincount(lay, weights=c, minlength=profile.n_layers)
    share = np.divide(c, per_layer[lay], out=np.zeros(T), where=per_layer[lay] > 0)
    return np.minimum(1.0, share * k)


@dataclass
class TrunkResult:
    """Per question (stage, a, b): the expert room left and what that room holds."""
    room: np.ndarray
    trunk_bytes: np.ndarray  # placed on the card
    host_ms: np.ndarray  # time of the components left on the host
    fill: object  # fill.Fill for `room`
    feasible: np.ndarray


class TrunkPricer:
    """Trunk decisions for many (stage, a, b) questions at once.

    auto: the held experts worth at least a dense byte (cpu_factor*p_e >= 1) are protected:
    the run of them at the head of the range's ranking (with p_e falling along the ranking, as
    it does when the ranking is by heat, that is all of them). The trunk takes the rest of the
    room, so it only ever pushes out experts worth less than itself: the head first (the
    last stage), then the layers' trunks in order while they fit; then the experts fill what
    is left with the stop rule, and the embedding (value 0) takes room no expert would use.
    """

    def __init__(self, tables, spec, policy: TrunkPolicy, p_e, layer_of_rank, cpu_factor: float):
        L = spec.n_layers
        self.tables, self.spec, self.policy, self.cf = tables, spec, policy, cpu_factor
        blob = self.blob = np.asarray(spec.expert_bytes, dtype=np.float64)
        tl = np.asarray(spec.trunk_bytes.layers, dtype=np.float64)
        self.layer_prefix = np.concatenate([[0.0], np.cumsum(tl)])
        # host time of a layer's trunk = miss_ms * tl / (cf * blob): keep the factor of miss_ms. A
        # dense layer (blob 0) reads its host bytes at the rate of the largest blob's miss.
        rate = np.where(blob > 0, blob, blob.max())
        self.host_prefix = np.concatenate([[0.0], np.cumsum(tl / (cpu_factor * rate))])
        self.head_host = spec.trunk_bytes.head / (cpu_factor * rate[L - 1])
        if policy.mode == "explicit":
            want = np.zeros(L)
            want[sorted(policy.layers)] = 1.0
            self.want_prefix = np.concatenate([[0.0], np.cumsum(tl * want)])
            self.want_host_prefix = np.concatenate([[0.0], np.cumsum(tl * want / (cpu_factor * rate))])
        if policy.mode == "auto":
            T = len(layer_of_rank)
            cold = cpu_factor * np.asarray(p_e) < 1.0
            first_cold = np.full(L, T, dtype=np.int64)
            idx = np.flatnonzero(cold)
            np.minimum.at(first_cold, layer_of_rank[idx], idx)
            # first_cold_range[a, b] = first cold rank among layers [a, b)
            fc = np.full((L + 1, L + 1), T, dtype=np.int64)
            for a in range(L):
                fc[a, a + 1:] = np.minimum.accumulate(first_cold[a:])
            self.first_cold_range = fc

    def price(self, a, b, free, first, last, miss_ms) -> TrunkResult:
        a = np.asarray(a, dtype=np.int64)
        b = np.asarray(b, dtype=np.int64)
        free = np.asarray(free, dtype=np.float64)
        first = np.asarray(first, dtype=bool)
        last = np.asarray(last, dtype=bool)
        miss_ms = np.asarray(miss_ms, dtype=np.float64)
        tb, mode = self.spec.trunk_bytes, self.policy.mode
        Q = len(a)
        if mode == "off":
            return TrunkResult(free, np.zeros(Q), np.zeros(Q), self.tables.query(a, b, free), np.ones(Q, dtype=bool))
        if mode == "explicit":
            head = np.where(last & self.policy.head, float(tb.head), 0.0)
            emb = np.where(first & self.policy.embed, float(tb.embedding), 0.0)
            placed = head + emb + self.want_prefix[b] - self.want_prefix[a]
            host_units = (np.where(last & ~np.array(self.policy.head), self.head_host, 0.0)
                          + (self.host_prefix[b] - self.host_prefix[a]) - (self.want_host_prefix[b] - self.want_host_prefix[a]))
            room = free - placed
            f = self.tables.query(a, b, np.maximum(room, 0.0))
            return TrunkResult(room, placed, miss_ms * host_units, f, room >= 0)
        # auto
        r_cold = self.first_cold_range[a, b]
        hot = self.tables.bytes_before(a, b, r_cold)
        # Hot experts that do not all fit: the card holds only experts that outrank the trunk,
        # and the trunk gets the room their stop rule leaves.
        crowded = hot > free
        f_full = None
        if crowded.any():
            i = np.flatnonzero(crowded)
            f_full = self.tables.query(a[i], b[i], free[i])
            hot[i] = f_full.bytes
        budget = free - hot
        head_on = last & (tb.head > 0) & (tb.head <= budget)
        budget = budget - np.where(head_on, float(tb.head), 0.0)
        # layers a, a+1, ... while they fit: a prefix, like the expert fill
        end = np.searchsorted(self.layer_prefix, self.layer_prefix[a] + budget, side="right") - 1
        n_end = np.clip(end, a, b)
        placed = np.where(head_on, float(tb.head), 0.0) + self.layer_prefix[n_end] - self.layer_prefix[a]
        room = free - placed
        f = self.tables.query(a, b, room)
        emb_on = first & (tb.embedding > 0) & (room - f.bytes >= tb.embedding)
        placed = placed + np.where(emb_on, float(tb.embedding), 0.0)
        room = room - np.where(emb_on, float(tb.embedding), 0.0)
        host_units = np.where(last & ~head_on, self.head_host, 0.0) + self.host_prefix[b] - self.host_prefix[n_end]
        self._last = dict(head_on=head_on, n_end=n_end, emb_on=emb_on, r_cold=r_cold, hot=hot)
        return TrunkResult(room, placed, miss_ms * host_units, f, np.ones(Q, dtype=bool))

    def decisions(self, q, a, b, free, first, last, profile_pairs_layers, p_e) -> list[dict]:
        """The [place] decisions of question q of the last price() call (one stage's range), with
        the numbers behind them."""
        tb, mode, cf = self.spec.trunk_bytes, self.policy.mode, self.cf
        blob = self.blob
        comps = []
        if last and tb.head > 0:
            comps.append(("lm_head", -1, tb.head, 1.0))
        comps += [(f"layer {l} trunk" + _pieces_text(tb, l), l, tb.layers[l], 1.0) for l in range(a, b)
                  if tb.layers[l] > 0]
        if first and tb.embedding > 0:
            comps.append(("embedding", -1, tb.embedding, 0.0))
        if mode == "off" or not comps:
            return []
        st = {k: v[q:q + 1] for k, v in self._last.items()} if mode == "auto" else {}
        # The stage's ranks and their running cost, once: a fill for any room is then a bisection.
        ranks = np.flatnonzero((profile_pairs_layers >= a) & (profile_pairs_layers < b))
        cost = np.cumsum(blob[profile_pairs_layers[ranks]])

        def fill(r):
            return ranks[: int(np.searchsorted(cost, r, side="right"))]

        out, room = [], float(free)
        for name, layer, nbytes, value in comps:
            if mode == "explicit":
                on = (self.policy.head if name == "lm_head" else self.policy.embed if name == "embedding"
                      else layer in self.policy.layers)
                why = "as written"
            else:
                on = bool(st["head_on"][0] if name == "lm_head" else st["emb_on"][0] if name == "embedding"
                          else layer < st["n_end"][0])
                before = fill(room)
                after = fill(room - nbytes) if nbytes <= room else before[:0]
                out_ranks = before[len(after):]
                if nbytes > room:
                    why = "too big for the card"
                elif on and out_ranks.size == 0:
                    why = "room no expert would use"
                elif on:
                    p = float(p_e[out_ranks].max())
                    why = (f"saves {format_bytes(value * nbytes)}/token; the {out_ranks.size} experts it pushes out are "
                           f"worth {cf:g}*p = {fmt_p(cf * p)} per byte at most (p_marginal {fmt_p(p)})")
                else:
                    kept = before[before < st["r_cold"][0]]
                    p = float(p_e[kept[-1]]) if kept.size else 0.0
                    why = (f"the experts it would push out are worth more per byte: {cf:g}*p = {fmt_p(cf * p)} >= "
                           f"{value:g} (p_marginal {fmt_p(p)})" if value > 0 else
                           "read one row per token: only room no expert would use")
            if on:
                room -= nbytes
            out.append({"component": name, "layer": int(layer), "bytes": int(nbytes), "on_card": bool(on),
                        "why": why, "expert_room_after": int(room)})
        return out
