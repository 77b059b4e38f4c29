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

    def to_json(self) -> dict:
        return {"blocks": self.blocks, "block_tokens": self.block_tokens, "tokens": self.tokens,
                "context": self.context, "concurrency": self.concurrency, "rule": self.rule,
                "stage_bytes": list(self.stage_bytes), "tried": [list(t) for t in self.tried],
                "state_checkpoints": self.checkpoints, "host_state_checkpoints": self.host_checkpoints,
                "checkpoint_rule": self.checkpoint_rule}


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


# Host memory for state checkpoints the devices have no room for: this share of what a node has
# available beside the model's files (their page cache must stay: every host expert is read from
# it). llama-server keeps its prompt cache in RAM the same way (up to 8 GiB by default).
HOST_CHECKPOINT_SHARE = 8


def host_checkpoint_room(available_bytes: int | None, model_file_bytes: int) -> int:
    """Host bytes for checkpoints on one node: (MemAvailable - the model's files there) / HOST_CHECKPOINT_SHARE."""
    if available_bytes is None:
        return 0
    return max(0, available_bytes - model_file_bytes) // HOST_CHECKPOINT_SHARE


def host_checkpoints_for(rooms: list[int], per_state: list[int], wanted: int) -> int:
    """Checkpoints every stage can hold in host memory: stage i has `rooms[i]` bytes and one
    checkpoint of its layers' state takes `per_state[i]` (0: no recurrent layer, no limit). One
    count for all stages, the smallest, because a checkpoint slot names the same sequence's state
    on every stage (cluster/state_checkpoints.py)."""
    counts = [checkpoints_within(room, per, wanted) for room, per in zip(rooms, per_state) if per > 0]
    return min(counts) if counts else 0
