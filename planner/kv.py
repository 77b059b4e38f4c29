"""The KV budget: how many KV blocks every stage holds, traded against expert slots.

Every stage holds the same number of blocks (one block table serves the whole pipeline), each
block `block_tokens` tokens of k and v for the stage's own layers, so a block costs a stage
bytes in proportion to its layer count: exactly what the search charges when a layer's KV is
priced into its trunk bytes. More blocks mean more tokens in flight (sequences x their length)
and fewer expert slots, so a slower decode step.

Three ways to fix the count:
  * `--kv-blocks N`        as given;
  * `--kv-fraction f`      a share f of the devices' free bytes;
  * auto (default)         start from one sequence at the full context (the least that serves
                           the model's context, as llama.cpp's server does), and double while the
                           plan's predicted decode step stays within `tolerance` of the smallest
                           budget's (the experts the KV pushes out cost under 2% of a step), up to
                           `max_seqs` full-context sequences (more cannot be used).

Every KV sizing rule lives here (the driver and `serve --local` give it the bytes, which the
architecture decides: stages/blocks/kv_cache.py). Pure: no torch, no Ray. `plan_for(blocks)` is
the caller's placement search at that budget.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from moeray.errors import PlacementError

TRADE_TOLERANCE = 0.02  # auto: extra KV may slow the predicted decode step by at most this share

# ---------------------------------------------------------------- cache types

# How K and V rows are stored, llama.cpp's cache types (`-ctk` / `-ctv`): (values per block, bytes
# per block), ggml's block layouts. A quantised row is its width / 32 blocks of a float16 scale and
# 32 codes (q8_0: int8; q4_0: 4-bit pairs), so a head's width must be a multiple of 32.
CACHE_TYPES = {"f32": (1, 4), "f16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18)}
CACHE_TYPE_CHOICES = ("auto",) + tuple(CACHE_TYPES)


# What one cached value costs a decode step to read, in ns, by cache type: one query's ggml flash
# attention on the CPU over 8,192 keys, one thread, moeray's ggml build (`.venv/bin/python
# bench/kv_types.py --read-cost --types f32,f16,q8_0,q4_0 --read-depth 8192 --threads 1`, the
# default model's heads, 12 layers), which reads a quantised row as stored (q8_0: its dot products
# on the int8 codes; q4_0's values widened per row). Measured after the build split a quantised
# pool's keys among the threads as a float one's (stages/kernels/ggml_build.py OPS_HOOKS): q4_0 had
# been 10.7. The planner adds tokens x values x this to a stage's step when it weighs a cache type
# against the expert slots its bytes would buy.
READ_NS_PER_VALUE = {"f32": 0.69, "f16": 0.87, "q8_0": 1.02, "q4_0": 1.68}


def value_bytes(cache_type: str) -> float:
    """Bytes one value takes in a row of `cache_type` (its block's bytes over its values)."""
    block, size = CACHE_TYPES[cache_type]
    return size / block


def row_bytes(cache_type: str, width: int) -> int:
    """Bytes of one row of `width` values of `cache_type` (width a multiple of its block)."""
    block, size = CACHE_TYPES[cache_type]
    return width // block * size


@dataclass(frozen=True)
class KVTypes:
    """The cache types of a stage's K rows and V rows (an MLA latent is a K row: its value is a
    view of it, so V follows K there)."""
    k: str = "f32"
    v: str = "f32"

    def __post_init__(self):
        for which, t in (("k", self.k), ("v", self.v)):
            if t not in CACHE_TYPES:
                raise PlacementError(f"cache type {which} {t!r} is not one of {', '.join(CACHE_TYPES)}")

    @classmethod
    def same(cls, t: str) -> "KVTypes":
        return cls(t, t)

    @property
    def label(self) -> str:
        """"q8_0", or "q8_0/f16" (K/V) where they differ."""
        return self.k if self.k == self.v else f"{self.k}/{self.v}"

    @property
    def quantised(self) -> bool:
        return CACHE_TYPES[self.k][0] > 1 or CACHE_TYPES[self.v][0] > 1

    def token_bytes(self, heads: int, k_width: int, v_width: int) -> int:
        """Bytes one token's rows take in one layer of `heads` KV heads (v_width 0: the latent layout)."""
        return heads * (row_bytes(self.k, k_width) + (row_bytes(self.v, v_width) if v_width else 0))

    def problem(self, heads: int, k_width: int, v_width: int) -> str | None:
        """Why these types cannot hold a layer's rows (None: they can): a quantised type stores a
        row in blocks of 32 values; an MLA latent is one row that is both its key and its value."""
        if not v_width and self.v != self.k:
            return (f"this model's attention keeps one latent row per token (MLA), which is its key and its "
                    f"value, so V cannot be {self.v} while K is {self.k}; give the same type for both, or only "
                    f"the K type")
        for which, t, w in (("K", self.k, k_width), ("V", self.v, v_width)):
            block = CACHE_TYPES[t][0]
            if w and w % block:
                return (f"{t} stores a row in blocks of {block} values and this model's {which} rows are {w} "
                        f"values wide; choose f16 or f32 for {which}")
        return None


def resolve_kv_types(k: str, v: str, default: "KVTypes", latent: bool = False) -> "KVTypes":
    """The types a stage holds for asked K and V types ("auto": `default`'s; an MLA latent's V
    follows its K, which is the one row it keeps)."""
    kt = default.k if k == "auto" else k
    if latent:
        return KVTypes(kt, kt if v == "auto" else v)
    return KVTypes(kt, default.v if v == "auto" else v)


def default_kv_types(kinds) -> KVTypes:
    """The cache types the stages hold when nothing asks for others (and where a plan's `auto`
    starts): float16 when every stage is a card (what its attention kernels read), else float32:
    the CPU's ggml flash attention reads a float32 row fastest (READ_NS_PER_VALUE), and a stage
    whose bytes are better spent elsewhere gets smaller rows from the plan (docs/kv-cache.md)."""
    kinds = list(kinds)
    return KVTypes.same("f16" if kinds and all(k == "cuda" for k in kinds) else "f32")


@dataclass
class KVPlan:
    blocks: int  # on every stage
    block_tokens: int
    context: int  # tokens one sequence may hold (the model's, or --max-len)
    rule: str  # how the count was chosen
    stage_bytes: list = field(default_factory=list)  # KV bytes each stage allocates
    tried: list = field(default_factory=list)  # auto: (blocks, predicted ms per step or None: did not fit)
    # A hybrid model's recurrent-state checkpoints on every stage (trade_checkpoints), and why that many
    checkpoints: int = 0
    checkpoint_rule: str = ""
    # ... and more of them in host memory (one-process serving), copied over when taken or restored
    host_checkpoints: int = 0
    # Each stage's cache types (KVTypes), why, and the tokens the same pool bytes hold at each type
    types: list = field(default_factory=list)
    type_rule: str = ""
    tokens_by_type: dict = field(default_factory=dict)
    # KV blocks every stage keeps in its node's host memory (the host tier: cluster/kv_blocks.py)
    host_blocks: int = 0
    host_rule: str = ""

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_tokens

    @property
    def concurrency(self) -> float:
        """Sequences at the full context the KV holds at once."""
        return self.tokens / self.context

    def line(self) -> str:
        per_stage = ", ".join(f"{b / 2**20:.0f} MiB" for b in self.stage_bytes)
        out = (f"[kv] {self.blocks} blocks of {self.block_tokens} tokens on every stage: {self.tokens} tokens of KV "
               f"per stage ({per_stage}), {self.concurrency:.2f} sequences at the {self.context}-token context; "
               f"{self.rule}")
        if len(self.tried) > 1:
            out += "; tried " + ", ".join(f"{b}: {'no fit' if ms is None else f'{ms:.1f} ms'}" for b, ms in self.tried)
        return out

    def types_line(self) -> str:
        """[kv] each stage's cache types, its bytes per token, and the context the same bytes buy at each type."""
        from moeray.units import format_bytes

        labels = [t.label for t in self.types]
        if len(set(labels)) == 1:
            stages = f"{labels[0]} on every stage"
        else:
            stages = ", ".join(f"stage {i} {label}" for i, label in enumerate(labels))
        per_token = ", ".join(format_bytes(b // max(1, self.tokens)) for b in self.stage_bytes)
        out = f"[kv] cache types {stages} ({per_token} per token per stage)"
        if self.tokens_by_type:
            buys = ", ".join(f"{t} {n}" for t, n in self.tokens_by_type.items())
            out += f"; the same bytes hold, in tokens: {buys}"
        return out + (f"; {self.type_rule}" if self.type_rule else "")

    def host_line(self) -> str:
        return f"[kv] host tier: {self.host_blocks} blocks ({self.host_blocks * self.block_tokens} tokens) per stage; {self.host_rule}"

    def to_json(self) -> dict:
        return {"blocks": self.blocks, "block_tokens": self.block_tokens, "tokens": self.tokens,
                "context": self.context, "concurrency": self.concurrency, "rule": self.rule,
                "stage_bytes": list(self.stage_bytes), "tried": [list(t) for t in self.tried],
                "state_checkpoints": self.checkpoints, "host_state_checkpoints": self.host_checkpoints,
                "checkpoint_rule": self.checkpoint_rule,
                "cache_types": [{"k": t.k, "v": t.v} for t in self.types], "type_rule": self.type_rule,
                "tokens_by_type": dict(self.tokens_by_type), "host_blocks": self.host_blocks,
                "host_rule": self.host_rule}


def blocks_for_fraction(fraction: float, free_bytes: int, block_bytes_all_layers: int) -> int:
    """Blocks whose k/v over all layers take `fraction` of the devices' free bytes."""
    return int(fraction * free_bytes // block_bytes_all_layers)


def context_tokens(model_context: int, max_len: int | None) -> int:
    """Tokens one sequence may hold: the model's context, unless --max-len lowers it."""
    return min(max_len or model_context, model_context)


def itemsize_for(kinds) -> int:
    """Bytes per KV element the stages will hold: 16-bit when every stage is a CUDA card, else
    float32 (stages/blocks/kv_cache.kv_dtype); one size for all, the larger, so no stage is under-charged."""
    kinds = list(kinds)
    return 2 if kinds and all(k == "cuda" for k in kinds) else 4


def fixed_blocks(kv_blocks: int | None, kv_fraction: float | None, free_bytes: int,
                 block_bytes_all_layers: int) -> tuple[int | None, str]:
    """(blocks, rule) when --kv-blocks or --kv-fraction fixes the budget, (None, "") for auto."""
    if kv_blocks is not None:
        return kv_blocks, "--kv-blocks"
    if kv_fraction is not None:
        n = blocks_for_fraction(kv_fraction, free_bytes, block_bytes_all_layers)
        if n < 1:
            raise PlacementError(f"--kv-fraction {kv_fraction} of {free_bytes} free bytes is less than one "
                                 "KV block; raise it or give --kv-blocks")
        return n, f"--kv-fraction {kv_fraction}"
    return None, ""


def local_plan(model_context: int, max_len: int | None, kv_blocks: int | None, kv_fraction: float | None,
               free_bytes: int, block_bytes_all_layers: int, block_tokens: int) -> KVPlan:
    """The KV budget of a one-process server (no expert trade: its device holds every expert):
    --kv-blocks / --kv-fraction, else one sequence at the full context, or, where that would take
    over half of `free_bytes` (Qwen3-30B-A3B: 40,960 tokens, 7.5 GiB of float32 KV), one sequence
    of what half of it holds, unless --max-len asked for a length. `free_bytes`: the device less
    the trunk and the sequences' states (cluster/placement.py local_kv_plan)."""
    context = context_tokens(model_context, max_len)
    n, rule = fixed_blocks(kv_blocks, kv_fraction, free_bytes, block_bytes_all_layers)
    if n is None:
        n, rule = -(-context // block_tokens), "one sequence at the full context (--kv-blocks or --kv-fraction for more)"
        fit = (free_bytes // 2) // max(1, block_bytes_all_layers)
        if max_len is None and 1 <= fit < n:
            n, context = fit, fit * block_tokens
            rule = (f"one sequence of {context} tokens, half of what the device has left beside the trunk "
                    f"(the model's {model_context} would not fit; --max-len or --kv-blocks to choose)")
    return KVPlan(n, block_tokens, context, rule, [n * block_bytes_all_layers])


def trade_kv(plan_for: Callable[[int], object], min_blocks: int, max_blocks: int,
             tolerance: float = TRADE_TOLERANCE) -> tuple[int, object, list]:
    """Auto budget: (blocks, plan at that budget, [(blocks, predicted ms or None)] tried).

    `plan_for(n)` returns a plan with `predicted_ms`, or raises PlacementError when n blocks do
    not fit. The smallest budget must fit; then doubling, then bisection between the last budget
    within tolerance and the first beyond it (or not fitting)."""
    tried: list = []

    def score(n: int) -> Optional[object]:
        try:
            plan = plan_for(n)
        except PlacementError:
            tried.append((n, None))
            return None
        tried.append((n, plan.predicted_ms))
        return plan

    best_plan = plan_for(min_blocks)  # its PlacementError is the caller's: nothing serves the context
    tried.append((min_blocks, best_plan.predicted_ms))
    limit = best_plan.predicted_ms * (1 + tolerance)
    good, bad = min_blocks, None
    while good < max_blocks:
        n = min(2 * good, max_blocks)
        plan = score(n)
        if plan is None or plan.predicted_ms > limit:
            bad = n
            break
        good, best_plan = n, plan
    if bad is not None:
        for _ in range(4):  # the boundary to within 1/16 of the last step
            if bad - good <= max(1, good // 16):
                break
            n = (good + bad) // 2
            plan = score(n)
            if plan is None or plan.predicted_ms > limit:
                bad = n
            else:
                good, best_plan = n, plan
    return good, best_plan, tried


def trade_checkpoints(plan_for: Callable[[int], object], base_ms: float, wanted: int,
                      tolerance: float = TRADE_TOLERANCE) -> tuple[int, object | None, list]:
    """Auto count of a hybrid model's recurrent-state checkpoints (cluster/state_checkpoints.py):
    (n, plan at n or None for n = 0, [(n, predicted ms or None: did not fit)] tried).

    A checkpoint is one sequence's state on every recurrent layer's card (Qwen3-Next-80B: 75 MiB,
    the KV of ~200 blocks), so it is priced as the KV is: `plan_for(n)` is the placement with n of
    them charged beside the KV pool, and n is the most, up to `wanted` (two per sequence slot: a
    prompt's end and its answer's last block boundary), whose predicted decode step stays within
    `tolerance` of `base_ms` (the plan without them): the experts they push out cost under 2% of
    a step. `wanted` first; else the count its cost per checkpoint affords (the experts a
    checkpoint pushes out cost about the same each), stepped down until it fits (halved when none fit, then bisected
    up to the room)."""
    tried: list = []
    limit = base_ms * (1 + tolerance)

    def score(n: int):
        try:
            plan = plan_for(n)
        except PlacementError:
            tried.append((n, None))
            return None, None
        tried.append((n, plan.predicted_ms))
        return plan, plan.predicted_ms

    if wanted < 1:
        return 0, None, tried
    plan, ms = score(wanted)
    if plan is not None and ms <= limit:
        return wanted, plan, tried
    unfit = wanted if plan is None else None  # the fewest tried that did not fit the cards
    n = wanted // 2 if ms is None or ms <= base_ms else min(wanted - 1, int((limit - base_ms) / ((ms - base_ms) / wanted)))
    while n >= 1:
        plan, ms = score(n)
        if plan is not None and ms <= limit:
            break
        if plan is None:
            unfit = n
        n = n // 2 if ms is None or ms <= base_ms else min(n - 1, int((limit - base_ms) / ((ms - base_ms) / n)))
    else:
        return 0, None, tried
    # Halving past room: what fits lies between n and the fewest that did not; bisect it.
    while unfit is not None and unfit - n > 1:
        mid = (n + unfit) // 2
        p, m = score(mid)
        if p is not None and m <= limit:
            n, plan = mid, p
        else:
            unfit = mid
    return n, plan, tried


def checkpoints_within(budget_bytes: int, per_checkpoint: int, wanted: int) -> int:
    """Checkpoints of `per_checkpoint` bytes that fit `budget_bytes`, at most `wanted`: a device
    that holds every expert (one-process serving) has nothing to trade them against but room."""
    if per_checkpoint <= 0:
        return 0
    return max(0, min(wanted, budget_bytes // per_checkpoint))


# The host tier: host memory for what the devices have no room for, state checkpoints first, then
# KV blocks the pools evict (cluster/kv_blocks.py). By default this share of what a node has
# available beside the model's files (their page cache must stay: every host expert is read from
# it). llama-server keeps its prompt cache in RAM the same way (--cache-ram, 8 GiB by default).
HOST_TIER_SHARE = 8
HOST_CHECKPOINT_SHARE = HOST_TIER_SHARE  # the name the checkpoints' lines use


def check_host_tier(asked: str) -> str:
    """`--kv-host` as written, checked: auto, off (or 0), a share 0 < f < 1, or a size (8GiB)."""
    from moeray.units import parse_size

    text = str(asked).strip().lower()
    if text in ("auto", "off", "0"):
        return text
    try:
        f = float(text)
    except ValueError:
        try:
            parse_size(text)
        except Exception:
            raise PlacementError(f"--kv-host {asked!r}: give auto, off, a share of the node's available memory "
                                 "(0.25) or a size (8GiB)") from None
        return text
    if not 0 < f < 1:
        raise PlacementError(f"--kv-host {asked!r}: a share is between 0 and 1 (0.25), a size has a unit (8GiB), "
                             "off turns the host tier off")
    return text


def host_tier_room(asked: str, available_bytes: int | None, model_file_bytes: int, where: str = "this node") -> int:
    """Host bytes of the tier on one node: `--kv-host` auto ((MemAvailable - the model's files there)
    / HOST_TIER_SHARE), off, a share of that, or a size, which must fit in it (one line naming
    the value and the fix otherwise)."""
    from moeray.units import format_bytes, parse_size

    text = check_host_tier(asked)
    if text in ("off", "0") or available_bytes is None:
        return 0
    room = max(0, available_bytes - model_file_bytes)
    if text == "auto":
        return room // HOST_TIER_SHARE
    try:
        return int(float(text) * room)
    except ValueError:
        size = parse_size(text)
    if size > room:
        raise PlacementError(f"--kv-host {asked}: {where} has {format_bytes(room)} available beside the model's "
                             f"files (MemAvailable {format_bytes(available_bytes)}); give at most that, a share "
                             "such as 0.25, or auto")
    return size


def host_checkpoint_room(available_bytes: int | None, model_file_bytes: int) -> int:
    """Host bytes of the tier on one node by default: (MemAvailable - the model's files there) / HOST_TIER_SHARE."""
    return host_tier_room("auto", available_bytes, model_file_bytes)


def host_blocks_for(rooms: list[int], block_bytes: list[int]) -> int:
    """KV blocks every stage can keep in its host tier: stage i has `rooms[i]` bytes left (after
    its checkpoints) and one block of its layers takes `block_bytes[i]` (0: no KV layer, no
    limit). One count for all, the smallest: a block's host slot holds it on every stage."""
    counts = [room // b for room, b in zip(rooms, block_bytes) if b > 0]
    return max(0, min(counts)) if counts else 0


def host_checkpoints_for(rooms: list[int], per_state: list[int], wanted: int) -> int:
    """Checkpoints every stage can hold in host memory: stage i has `rooms[i]` bytes and one
    checkpoint of its layers' state takes `per_state[i]` (0: no recurrent layer, no limit). One
    count for all stages, the smallest, because a checkpoint slot names the same sequence's state
    on every stage (cluster/state_checkpoints.py)."""
    counts = [checkpoints_within(room, per, wanted) for room, per in zip(rooms, per_state) if per > 0]
    return min(counts) if counts else 0
