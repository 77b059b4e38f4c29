"""Trunk placement (seed 003): which dense pieces of a stage go on its card.

Each trunk component is priced in bytes saved on the host's memory bus per token, per byte of
VRAM. A dense component is read on every token: value 1.0 per byte (the embedding is read one
row per token: value 0, so it only takes room no expert would use). A routed expert is read
with probability p_e (its heat share within its layer times k, capped at 1; k/E without
counts) and its host copy reads `cpu_factor` times its card bytes: value cpu_factor*p_e per
byte. A component goes on the card when the experts it would push out of the cache (the
coldest held ones) are worth less than it; room that no expert would use always goes to the
trunk.

Modes: `auto` (default); `off` (the planner places no trunk: free_bytes is taken to be net of
it, as the seeds' engines do, and no trunk time is priced); or an explicit list obeyed as
written and charged to the expert budget:

    head=gpu,embed=cpu,layers=0-20+30-47      (ranges inclusive, global layer indices)

Names: `head` (alias lmhead, output), `embed` (embedding), `layers` (alias attn, trunk);
values gpu|cpu for head/embed, all|none|ranges for layers; anything not named stays on the host.

Time: a component left on the host costs its bytes at the host's speed, which `miss_ms`
measures: one miss reads cpu_factor*blob[l] host bytes in miss_ms, so a dense byte costs
miss_ms / (cpu_factor*blob[l]). With `off` nothing of this is added and DESIGN.md's formula
is exact.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from stages.errors import PlacementError

MIB = 1 << 20


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


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


def expert_read_probability(profile, k: int) -> np.ndarray:
    """p_e of each ranked pair: heat share within its layer times k, capped at 1; k/E without counts."""
    T = len(profile.pairs)
    if profile.counts is None:
        return np.full(T, min(1.0, k / profile.n_experts))
    lay = profile.layers_array()
    c = np.asarray(profile.counts, dtype=np.float64)
    per_layer = np.bincount(lay, weights=c, minlength=profile.n_layers)
    share = np.divide(c, per_layer[lay], out=np.zeros(T), where=per_layer[lay] > 0)
    return np.minimum(1.0, share * k)


@dataclass
class Component:
    label: str
    layer: int  # -1 for the embedding and the head
    bytes: int
    value: float  # bytes saved per byte on the card


@dataclass
class TrunkResult:
    """Per question (stage, a, b): the expert room left and what that room holds."""
    room: np.ndarray
    trunk_bytes: np.ndarray  # placed on the card
    host_ms: np.ndarray  # time of the components left on the host
    fill: object  # fill.Fill for `room`
    feasible: np.ndarray
    decisions: list  # per question: list of dicts (only when record=True)


def place_trunk(tables, spec, policy: TrunkPolicy, a, b, free, first, last, miss_ms, cpu_factor: float,
                record: bool = False) -> TrunkResult:
    """Decide the trunk of many (stage, a, b) questions at once, in component order:
    head (last stage), layers a..b-1, embedding (first stage)."""
    a = np.asarray(a, dtype=np.int64)
    b = np.asarray(b, dtype=np.int64)
    room = np.asarray(free, dtype=np.float64).copy()
    first = np.asarray(first, dtype=bool)
    last = np.asarray(last, dtype=bool)
    miss_ms = np.asarray(miss_ms, dtype=np.float64)
    Q, L = len(a), spec.n_layers
    blob = np.asarray(spec.expert_bytes, dtype=np.float64)
    tb = spec.trunk_bytes
    layer_bytes = np.asarray(tb.layers, dtype=np.float64)
    placed = np.zeros(Q)
    host = np.zeros(Q)
    decisions: list = [[] for _ in range(Q)] if record else []
    if policy.mode == "off":
        f = tables.query(a, b, room)
        return TrunkResult(room, placed, host, f, np.ones(Q, dtype=bool), decisions)

    # (label, layer per question, bytes per question, value, host ms/byte per question, active)
    steps = [("head", np.full(Q, -1), np.full(Q, float(tb.head)), 1.0,
              miss_ms / (cpu_factor * blob[L - 1]), last)]
    for j in range(int((b - a).max(initial=0))):
        lay = np.minimum(a + j, L - 1)
        steps.append(("layer", lay, layer_bytes[lay], 1.0, miss_ms / (cpu_factor * blob[lay]), a + j < b))
    steps.append(("embed", np.full(Q, -1), np.full(Q, float(tb.embedding)), 0.0, np.zeros(Q), first))

    if policy.mode == "explicit":
        for label, lay, nbytes, _, per_byte, active in steps:
            if label == "head":
                want = np.full(Q, policy.head)
            elif label == "embed":
                want = np.full(Q, policy.embed)
            else:
                want = np.isin(lay, list(policy.layers))
            on = active & want & (nbytes > 0)
            room -= np.where(on, nbytes, 0.0)
            placed += np.where(on, nbytes, 0.0)
            host += np.where(active & ~want, nbytes * per_byte, 0.0)
            if record:
                for q in np.flatnonzero(active & (nbytes > 0)):
                    decisions[q].append(_decision(label, lay[q], nbytes[q], bool(on[q]), "as written", room[q]))
        feasible = room >= 0
        f = tables.query(a, b, np.maximum(room, 0.0))
        return TrunkResult(room, placed, host, f, feasible, decisions)

    f = tables.query(a, b, room)
    for label, lay, nbytes, value, per_byte, active in steps:
        act = active & (nbytes > 0)
        if not act.any():
            continue
        fits = act & (nbytes <= room)
        # Nothing held is pushed out when the fill leaves this much room unused: the stop rank stays.
        spare = fits & (f.bytes <= room - nbytes)
        need = np.flatnonzero(fits & ~spare)
        put = spare.copy()
        after = None
        if need.size:
            after = tables.query(a[need], b[need], room[need] - nbytes[need])
            pushed_out = f.count[need] - after.count
            lost = cpu_factor * (f.value[need] - after.value)  # bytes/token the displaced experts saved
            win = (pushed_out == 0) | (value * nbytes[need] > lost)
            put[need] = win
        if record:
            lost_all = np.zeros(Q)
            out_all = np.zeros(Q, dtype=np.int64)
            if need.size:
                lost_all[need] = lost
                out_all[need] = pushed_out
            for q in np.flatnonzero(act):
                why = ("too big for the card" if not fits[q] else
                       "room no expert would use" if spare[q] or out_all[q] == 0 else
                       f"saves {fmt_bytes(value * nbytes[q])}/token, the {out_all[q]} experts it pushes out "
                       f"save {fmt_bytes(lost_all[q])}/token (p_marginal "
                       f"{lost_all[q] / max(cpu_factor * (f.bytes[q] - _after_bytes(after, need, q)), 1.0):.2f})")
                decisions[q].append(_decision(label, lay[q], nbytes[q], bool(put[q]), why,
                                              room[q] - (nbytes[q] if put[q] else 0.0)))
        if need.size:
            won = need[win]
            sub = np.flatnonzero(win)
            f.stop[won], f.bytes[won], f.count[won] = after.stop[sub], after.bytes[sub], after.count[sub]
            f.mass[won], f.value[won] = after.mass[sub], after.value[sub]
        room -= np.where(put, nbytes, 0.0)
        placed += np.where(put, nbytes, 0.0)
        host += np.where(act & ~put, nbytes * per_byte, 0.0)
    return TrunkResult(room, placed, host, f, np.ones(Q, dtype=bool), decisions)


def _after_bytes(after, need, q):
    i = np.searchsorted(need, q)
    return after.bytes[i] if after is not None and i < len(need) and need[i] == q else 0.0


def _decision(label, layer, nbytes, on_card, why, room_after) -> dict:
    name = "lm_head" if label == "head" else "embedding" if label == "embed" else f"layer {int(layer)} trunk"
    return {"component": name, "layer": int(layer), "bytes": int(nbytes), "on_card": on_card, "why": why,
            "expert_room_after": int(room_after)}
