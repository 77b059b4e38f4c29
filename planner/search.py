"""Layer-split search: every placement of S contiguous layer ranges, priced exactly.

Cost model: one decode step takes
    sum_i [ (b_i - a_i)*layer_ms[i] + k*L*(routed(a_i, b_i) - held_i)*miss_ms[i] ] + (S-1)*handoff_ms
(+ the host time of trunk pieces left off the card, when the trunk is priced). A stage's
fill depends only on (i, a, b), so every (stage, range) is priced once, in one vectorised
pass (planner.fill.RangeTables), into a table C[i][a, b]. Then:
  * enumeration (S <= 4): all placements scored from the table, as Strata does;
  * an exact dynamic program over (stage, boundary) for any S: latency minimises the sum,
    throughput minimises the slowest stage (then the sum among those that tie).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from moeray.planner.devices import DeviceSpec
from moeray.planner.fill import RangeTables, slot_fill_ranks
from moeray.planner.mass import MassModel, mass_model
from moeray.planner.slots import GIB, SlotLayout, per_layer_slots
from moeray.planner.spec import ModelSpec
from moeray.planner.trunk import TrunkPolicy, TrunkPricer, expert_read_probability
from moeray.errors import PlacementError

DEFAULT_HANDOFF_MS = 1.0  # one stage-to-stage hop (a Ray call carrying a hidden vector)
DEFAULT_CPU_FACTOR = 1.0  # moeray's host copy of an expert is the same GGUF bytes as the card's
ENUMERATE_MAX_STAGES = 4


@dataclass
class StagePlan:
    index: int
    device: str
    first_layer: int
    end_layer: int
    free_bytes: int
    trunk_bytes: int  # trunk placed on the card
    expert_room: int  # free_bytes - trunk_bytes
    held_pairs: np.ndarray  # [n, 2] (layer, expert) rows in rank order
    held_bytes: int
    held_mass: float
    routed_mass: float
    dense_ms: float
    miss_ms: float  # expected host time of missed experts per step
    host_trunk_ms: float
    stage_ms: float
    trunk: list  # decisions
    slots: SlotLayout | None
    held_per_layer: list
    slot_pairs: int = 0  # pairs its slots hold after the profile fill (what the runtime holds)
    slot_mass: float = 0.0

    @property
    def n_layers(self) -> int:
        return self.end_layer - self.first_layer

    @property
    def predicted_hit_rate(self) -> float:
        """Share of this stage's lookups its cache should serve: the mass its slots hold over the
        mass routed to its layers (with counts: the hit rate on the profiled routing)."""
        return self.slot_mass / self.routed_mass if self.routed_mass > 0 else 0.0


@dataclass
class Plan:
    objective: str
    method: str  # enumeration | dp | explicit
    split: list  # [(first, end)] per stage
    predicted_ms: float
    slowest_stage_ms: float
    placements_scored: int
    stages: list
    n_pairs: int
    mass_mode: str
    trunk_mode: str
    handoff_ms: float
    search_ms: float = 0.0
    notes: list = field(default_factory=list)
    mass: MassModel | None = None
    kv: object | None = None  # planner.kv.KVPlan: the KV budget this plan was searched with (set by the driver)

    @property
    def boundaries(self) -> list[int]:
        return [a for a, _ in self.split[1:]]

    @property
    def held_pairs(self) -> int:
        return sum(len(s.held_pairs) for s in self.stages)

    @property
    def held_mass(self) -> float:
        return sum(s.held_mass for s in self.stages)

    @property
    def routed_mass(self) -> float:
        return sum(s.routed_mass for s in self.stages)

    def startup_line(self) -> str:
        k = ",".join(str(x) for x in self.boundaries) or "-"
        share = self.held_mass / self.routed_mass if self.routed_mass > 0 else 0.0
        head = "layer split auto" if self.method != "explicit" else "layer split as given"
        tail = (f"best of {self.placements_scored} placements" if self.method == "enumeration" else
                f"best of {self.placements_scored} placements (exact DP)" if self.method == "dp" else
                "1 placement scored")
        obj = "" if self.objective == "latency" else f", slowest stage {self.slowest_stage_ms:.1f} ms (throughput)"
        return (f"{head}: K={k} - predicted {self.predicted_ms:.1f} ms per decode step{obj}; the caches hold "
                f"{self.held_pairs} of {self.n_pairs} profiled pairs (~{100 * share:.1f}% of the routed mass), {tail}")

    def lines(self, verbose: bool = False) -> list[str]:
        """The plan as text: one line per stage and per departure from the default; `verbose`:
        every trunk decision and slot layout (planner/report.py)."""
        from moeray.planner.report import plan_lines

        return plan_lines(self, verbose)

    def to_json(self) -> dict:
        return {
            "split": [[a, b] for a, b in self.split], "boundaries": self.boundaries,
            "predicted_ms": self.predicted_ms, "slowest_stage_ms": self.slowest_stage_ms,
            "objective": self.objective, "method": self.method, "placements_scored": self.placements_scored,
            "held_pairs": self.held_pairs, "n_pairs": self.n_pairs, "held_mass": self.held_mass,
            "routed_mass": self.routed_mass, "mass": self.mass_mode, "trunk": self.trunk_mode,
            "handoff_ms": self.handoff_ms, "search_ms": self.search_ms,
            "mass_b": self.mass.b if self.mass else None, "mass_b_source": self.mass.source if self.mass else None,
            "profile_picks": self.mass.picks if self.mass else 0,
            "stages": [{
                "device": s.device, "layers": [s.first_layer, s.end_layer], "free_bytes": s.free_bytes,
                "trunk_bytes": s.trunk_bytes, "expert_room": s.expert_room, "held_pairs": len(s.held_pairs),
                "held_bytes": s.held_bytes, "held_mass": s.held_mass, "routed_mass": s.routed_mass,
                "held_per_layer": s.held_per_layer, "stage_ms": s.stage_ms, "dense_ms": s.dense_ms,
                "miss_ms": s.miss_ms, "host_trunk_ms": s.host_trunk_ms, "trunk_decisions": s.trunk,
                "slots_per_layer": s.slots.quota if s.slots else 0,
                "slots": s.slots.n_slots if s.slots else 0,
                "slot_pairs": s.slot_pairs, "predicted_hit_rate": s.predicted_hit_rate,
            } for s in self.stages],
            "kv": self.kv.to_json() if self.kv is not None else None,
        }


def n_placements(n_layers: int, min_layers: list[int]) -> int:
    """Placements of S contiguous ranges with at least min_layers[i] layers on stage i."""
    free = n_layers - sum(min_layers)
    return math.comb(free + len(min_layers) - 1, len(min_layers) - 1) if free >= 0 else 0


def combinations(n: int, r: int) -> np.ndarray:
    """All r-subsets of range(n) as sorted rows, in lexicographic order (numpy, no Python loop per row)."""
    c = np.zeros((1, 0), dtype=np.int64)
    for col in range(r):
        start = c[:, -1] + 1 if col else np.zeros(1, dtype=np.int64)
        stop = n - (r - 1 - col)  # leave room for the columns still to come
        counts = np.maximum(stop - start, 0)
        rows = np.repeat(np.arange(len(c)), counts)
        offs = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        c = np.hstack([c[rows], (np.repeat(start, counts) + offs)[:, None]])
    return c


def enumerate_boundaries(n_layers: int, min_layers: list[int]) -> np.ndarray:
    """All placements as an [N, S+1] array of boundaries 0 = k_0 < ... < k_S = L (stars and bars)."""
    S = len(min_layers)
    F = n_layers - sum(min_layers)
    if F < 0:
        return np.zeros((0, S + 1), dtype=np.int64)
    c = combinations(F + S - 1, S - 1)
    N = len(c)
    M = np.cumsum(min_layers)[:-1]
    k = c - np.arange(S - 1) + M
    return np.hstack([np.zeros((N, 1), dtype=np.int64), k, np.full((N, 1), n_layers, dtype=np.int64)])


def proportional_split(n_layers: int, devices: list[DeviceSpec]) -> list[int]:
    """The guess Strata's search replaced: layers in proportion to speed (1/layer_ms), VRAM ignored."""
    speed = np.array([1.0 / max(d.layer_ms, 1e-9) for d in devices])
    edges = np.rint(np.cumsum(speed) / speed.sum() * n_layers).astype(int)
    bounds, prev = [], 0
    for i, e in enumerate(edges[:-1]):
        e = int(min(max(e, prev + 1), n_layers - (len(devices) - 1 - i)))
        bounds.append(e)
        prev = e
    return bounds


def parse_split(split, n_layers: int, n_stages: int) -> list[int] | None:
    """'auto' -> None; 'K=14,31,41' or [14, 31, 41] -> the first layer of stages 1..S-1."""
    if split is None or split == "auto":
        return None
    if isinstance(split, str):
        text = split.strip()
        body = text[2:] if text.upper().startswith("K=") else text
        try:
            ks = [int(x) for x in body.split(",") if x.strip()]
        except ValueError:
            raise PlacementError(f"--split {split!r}: write auto or K=14,31,41 (the first layer of stages 1..S-1)") from None
    else:
        ks = [int(x) for x in split]
    if len(ks) != n_stages - 1:
        raise PlacementError(f"--split {split!r}: {n_stages} stages need {n_stages - 1} boundaries, got {len(ks)}")
    full = [0] + ks + [n_layers]
    if not all(x < y for x, y in zip(full[:-1], full[1:])):
        raise PlacementError(f"--split {split!r}: boundaries must rise strictly inside 1..{n_layers - 1}")
    return ks


class _Context:
    """Everything priced once per (model, devices, profile)."""

    def __init__(self, spec, devices, profile, mass: MassModel, cpu_factor, policy):
        self.spec, self.devices, self.profile, self.policy, self.cpu_factor = spec, devices, profile, policy, cpu_factor
        self.layers = profile.layers_array()
        self.mass_model = mass
        self.mass = mass.pair_mass(profile)
        # p_e prices experts against the trunk; with the trunk off nothing needs it
        self.p_e = expert_read_probability(profile, spec.n_experts_used) if policy.mode == "auto" else None
        self.tables = RangeTables(self.layers, spec.expert_bytes, self.mass)
        self.pricer = TrunkPricer(self.tables, spec, policy, self.p_e, self.layers, cpu_factor)

    def price(self, stage, a, b):
        """Stage time of many (stage, a, b) questions, and the trunk and fill behind it."""
        devs = self.devices
        S, L, k = len(devs), self.spec.n_layers, self.spec.n_experts_used
        n_moe = len(self.spec.moe_layers)  # k experts are routed per token in each MoE layer
        free = np.array([d.free_bytes for d in devs], dtype=np.float64)[stage]
        layer_ms = np.array([d.layer_ms for d in devs])[stage]
        miss_ms = np.array([d.miss_ms for d in devs])[stage]
        first, last = stage == 0, stage == S - 1
        # The fill and the trunk depend on (free bytes, first?, last?, a, b) only: cards of one
        # size share their answers, and the stage's speeds are applied afterwards.
        middle = [d.free_bytes for d in devs[1:-1]]
        if len(set(middle)) == len(middle) or len(stage) <= S:
            pick = inv = np.arange(len(a))  # no two questions can be the same
        else:
            rooms, room_id = np.unique(free, return_inverse=True)
            key = (((room_id.reshape(-1) * 2 + first) * 2 + last) * (L + 1) + a) * (L + 1) + b
            _, pick, inv = np.unique(key, return_index=True, return_inverse=True)
            inv = inv.reshape(-1)
        tr = self.pricer.price(a[pick], b[pick], free[pick], first[pick], last[pick], np.ones(len(pick)))
        routed = self.tables.routed(a, b)
        held = tr.fill.mass[inv]
        dense = (b - a) * layer_ms
        missed = k * n_moe * (routed - held) * miss_ms
        host = tr.host_ms[inv] * miss_ms  # priced with miss_ms = 1 above
        ms = dense + missed + host
        return np.where(tr.feasible[inv], ms, np.inf), tr, inv, routed, dense, missed, host


def plan_placement(spec: ModelSpec, devices: list[DeviceSpec], profile=None, objective: str = "latency",
                   split="auto", trunk: str | TrunkPolicy = "auto", handoff_ms: float = DEFAULT_HANDOFF_MS,
                   min_layers: int | list[int] = 1, mass: str = "auto", cpu_factor: float = DEFAULT_CPU_FACTOR,
                   method: str = "auto", cover_b: float | None = None) -> Plan:
    t0 = time.perf_counter()
    from moeray.planner.profile import Profile

    L, S = spec.n_layers, len(devices)
    if S < 1:
        raise PlacementError("no devices to place the model on")
    if objective not in ("latency", "throughput"):
        raise PlacementError(f"objective {objective!r}: use latency or throughput")
    # Decided before a missing profile becomes the uniform ranking: without one the caches hold
    # arbitrary experts, and the mass must say so (planner.mass.mass_model).
    mass_used = mass_model(profile, mass, cover_b)  # cover_b: b of the mass curve, None: fitted / default
    if profile is None:
        profile = Profile.uniform(L, spec.n_experts)
    profile.check_model(L, spec.n_experts)
    profile = profile.for_layers(spec.moe_layers)  # dense layers have no pairs
    mins = [int(min_layers)] * S if np.isscalar(min_layers) else [int(x) for x in min_layers]
    if len(mins) != S or min(mins) < 1:
        raise PlacementError(f"min_layers must be >= 1 for each of the {S} stages")
    policy = trunk if isinstance(trunk, TrunkPolicy) else TrunkPolicy.parse(trunk, L)
    ctx = _Context(spec, devices, profile, mass_used, cpu_factor, policy)
    given = parse_split(split, L, S)

    if given is not None:
        bounds = [0] + given + [L]
        method_used, scored = "explicit", 1
    else:
        total = n_placements(L, mins)
        if total == 0:
            raise PlacementError(f"{L} layers cannot give {S} stages at least {mins} layers each")
        # Every (stage, a, b) a placement can use.
        lo_a = np.concatenate([[0], np.cumsum(mins)[:-1]])
        hi_b = L - (np.cumsum(mins[::-1])[::-1] - mins)
        A, B = np.meshgrid(np.arange(L + 1), np.arange(L + 1), indexing="ij")
        st, aa, bb = [], [], []
        for i in range(S):
            ok = (A >= lo_a[i]) & (B - A >= mins[i]) & (B <= hi_b[i])
            ok &= (A == 0) if i == 0 else True
            ok &= (B == L) if i == S - 1 else True
            ia, ib = np.nonzero(ok)
            st.append(np.full(ia.size, i)), aa.append(ia), bb.append(ib)
        st, aa, bb = np.concatenate(st), np.concatenate(aa), np.concatenate(bb)
        ms = ctx.price(st, aa, bb)[0]
        C = np.full((S, L + 1, L + 1), np.inf)
        C[st, aa, bb] = ms
        if not np.isfinite(ms).any():
            if policy.mode == "explicit":
                raise PlacementError(f"no placement fits: no layer range's trunk fits on a card (--trunk {policy.text}: "
                                     "the trunk a stage holds on its card needs more VRAM than the card has)")
            raise PlacementError("no placement fits: no layer range fits on a card even with its trunk on the "
                                 "host (a stage's KV cache and buffers need more VRAM than the card has)")
        if method == "auto":
            method = "enumeration" if S <= ENUMERATE_MAX_STAGES else "dp"
        if method == "enumeration":
            bounds = _best_enumerated(C, L, mins, objective)
        elif method == "dp":
            bounds = _best_dp(C, L, S, objective)
        else:
            raise PlacementError(f"search method {method!r}: use auto, enumeration or dp")
        if bounds is None:
            raise PlacementError("no placement fits the devices (every candidate needs more VRAM than a card has)")
        method_used, scored = method, total

    plan = _build_plan(ctx, bounds, objective, method_used, scored, handoff_ms, mass_used.mode)
    plan.search_ms = (time.perf_counter() - t0) * 1e3
    return plan


def _best_enumerated(C, L, mins, objective):
    """Score every placement: the scores of all boundary tuples (k_1, ..., k_{S-1}) as one
    (L+1)^(S-1) array built by broadcasting the stage tables (inf where a tuple is not a
    placement), then the best in lexicographic order of the boundaries."""
    S = len(mins)
    if S == 1:
        return [0, L] if np.isfinite(C[0, 0, L]) else None
    # total[k_1, ..., k_{S-1}] = C0[0, k_1] + C1[k_1, k_2] + ... + C_{S-1}[k_{S-1}, L]
    total = C[0, 0]
    worst = C[0, 0]
    for i in range(1, S):
        step = C[i] if i < S - 1 else C[i][:, L]
        shape = (1,) * (i - 1) + step.shape
        step = step.reshape(shape)
        total = total[..., None] + step if i < S - 1 else total + step
        worst = np.maximum(worst[..., None], step) if i < S - 1 else np.maximum(worst, step)
    if objective == "throughput":
        total = np.where(worst <= worst.min(), total, np.inf)
    else:
        # Equal steps (e.g. every expert fits anywhere): the most even one, so micro-batches in
        # flight do not all queue behind one overloaded stage.
        best = total.min()
        if np.isfinite(best):
            tied = total <= best * (1 + 1e-9) + 1e-12
            total = np.where(tied & (worst <= worst[tied].min()), total, np.inf)
    j = int(np.argmin(total))
    if not np.isfinite(total.flat[j]):
        return None
    return [0] + [int(x) for x in np.unravel_index(j, total.shape)] + [L]


def _dp(C, L, S, combine):
    """best[i][b]: best score of stages 0..i covering layers [0, b); arg[i][b]: where stage i starts."""
    best = C[0, 0].copy()
    args = [np.zeros(L + 1, dtype=np.int64)]
    for i in range(1, S):
        M = combine(best[:, None], C[i])
        args.append(np.argmin(M, axis=0))
        best = M[args[-1], np.arange(L + 1)]
    if not np.isfinite(best[L]):
        return None, None
    bounds = [L]
    for i in range(S - 1, 0, -1):
        bounds.append(int(args[i][bounds[-1]]))
    return best[L], [0] + bounds[::-1]


def _best_dp(C, L, S, objective):
    if objective == "throughput":
        worst, _ = _dp(C, L, S, np.maximum)
        if worst is None:
            return None
        # Among placements whose slowest stage is that fast, the quickest step.
        C = np.where(C <= worst, C, np.inf)
    return _dp(C, L, S, np.add)[1]


def _build_plan(ctx, bounds, objective, method, scored, handoff_ms, mass_mode) -> Plan:
    S = len(ctx.devices)
    st = np.arange(S)
    aa, bb = np.array(bounds[:-1]), np.array(bounds[1:])
    ms, tr, inv, routed, dense, missed, host = ctx.price(st, aa, bb)
    if not np.isfinite(ms).all():
        bad = int(np.flatnonzero(~np.isfinite(ms))[0])
        raise PlacementError(f"stage {bad} ({ctx.devices[bad].name}) cannot hold the trunk --trunk "
                             f"{ctx.policy.text!r} puts on it: {ctx.devices[bad].free_bytes / GIB:.2f} GiB free")
    stages = []
    for i in range(S):
        u = inv[i]
        held = ctx.layers[:int(tr.fill.stop[u])]
        ranks = np.flatnonzero((held >= aa[i]) & (held < bb[i]))
        pairs = ctx.profile.pairs_array()[ranks]
        per_layer = np.bincount(held[ranks] - aa[i], minlength=bb[i] - aa[i]).tolist()
        blobs = ctx.spec.expert_bytes[aa[i]:bb[i]]
        room = int(tr.room[u])
        slots = per_layer_slots(room // max(blobs), blobs) if max(blobs) and room >= max(blobs) else None
        in_slots = slot_fill_ranks(ctx.layers, int(aa[i]), int(bb[i]), slots)
        decisions = ctx.pricer.decisions(u, int(aa[i]), int(bb[i]), ctx.devices[i].free_bytes, i == 0, i == S - 1,
                                         ctx.layers, ctx.p_e)
        stages.append(StagePlan(
            index=i, device=ctx.devices[i].name, first_layer=int(aa[i]), end_layer=int(bb[i]),
            free_bytes=int(ctx.devices[i].free_bytes), trunk_bytes=int(tr.trunk_bytes[u]), expert_room=room,
            held_pairs=pairs, held_bytes=int(tr.fill.bytes[u]), held_mass=float(tr.fill.mass[u]),
            routed_mass=float(routed[i]), dense_ms=float(dense[i]), miss_ms=float(missed[i]),
            host_trunk_ms=float(host[i]), stage_ms=float(ms[i]), trunk=decisions, slots=slots,
            held_per_layer=per_layer, slot_pairs=int(in_slots.size), slot_mass=float(ctx.mass[in_slots].sum())))
    predicted = float(ms.sum()) + (S - 1) * handoff_ms
    return Plan(objective=objective, method=method, split=list(zip(bounds[:-1], bounds[1:])),
                predicted_ms=predicted, slowest_stage_ms=float(ms.max()), placements_scored=scored, stages=stages,
                n_pairs=len(ctx.profile.pairs), mass_mode=mass_mode, trunk_mode=ctx.policy.text,
                handoff_ms=handoff_ms, mass=ctx.mass_model)
