"""Placement arithmetic: what the planner is given and what a plan costs, from the model's header
and what the stages reported (ProbeReport), without Ray.

`plan_from_reports` runs the placement search over the stages' measured budgets and speeds and
sizes the KV pool (and a hybrid model's state checkpoints) with it; `local_kv_plan` sizes them
for one process (`moeray serve --local`); `held_spec` is the planner's ModelSpec in the bytes a
stage really holds. The driver (cluster/driver.py) wires Ray around these; the service, tests and
benches call them directly.
"""
from __future__ import annotations

import math
import statistics
from collections import Counter

from moeray.cluster.config import EngineConfig, LaunchOptions
from moeray.errors import MoerayError, PlacementError
from moeray.planner.devices import DeviceSpec
from moeray.planner.kv import (CACHE_TYPES, READ_NS_PER_VALUE, KVPlan, KVTypes, checkpoints_within, context_tokens,
                               default_kv_types, fixed_blocks, host_blocks_for, host_checkpoints_for, local_plan,
                               resolve_kv_types, trade_checkpoints, trade_kv)
from moeray.planner.profile import Profile
from moeray.planner.report import checkpoint_line, state_line
from moeray.planner.search import parse_split, plan_placement, proportional_split
from moeray.planner.spec import ModelSpec, TrunkBytes
from moeray.stages.arch import arch_of
from moeray.stages.blocks.kv_cache import (BLOCK_SIZE, as_kv_types, blocks_for, check_kv_types, kv_block_bytes,
                                           kv_bytes_by_layer, kv_layer_bytes)
from moeray.stages.gguf import reader
from moeray.stages.runtime.draft_model import draft_bytes
from moeray.stages.runtime.mtp import mtp_bytes, mtp_layers
from moeray.stages.runtime.step import ProbeReport


def gpu_share(n_stages: int, n_gpus: float, gpus_per_stage: float | None = None) -> float:
    """The part of a GPU each stage reserves: `gpus_per_stage` as given (0 < x <= 1), else a whole
    card while there are cards enough, else 1/k of one with k = ceil(stages / GPUs), so that k
    stages share each card (Ray packs fractional GPU bundles onto one card: 0.5 + 0.5)."""
    if gpus_per_stage is not None:
        if not 0 < gpus_per_stage <= 1:
            raise MoerayError(f"--gpus-per-stage {gpus_per_stage}: a stage runs on one card, give a share "
                              "0 < x <= 1 (0.5: two stages per card)")
        return float(gpus_per_stage)
    if n_gpus < 1:
        raise PlacementError("the Ray cluster has no GPUs; pass --simulate-devices SIZE,... to run on CPU")
    k = math.ceil(n_stages / int(n_gpus))
    return 1.0 if k <= 1 else math.floor(1e4 / k) / 1e4  # Ray counts resources to 4 decimals


def local_kv_plan(config, engine: EngineConfig, free_bytes: int, itemsize: KVTypes | int = 4, trunk_bytes: int = 0,
                  expert_bytes: int = 0, host_bytes: int = 0):
    """The KV budget of a one-process server (planner/kv.py local_plan), for this model's layers.

    `trunk_bytes`: what the trunk will hold of the same device (stages/runtime/model.py
    stage_trunk_bytes). The stage charges the KV pool, the sequences' recurrent states and the
    trunk to one budget (stages/runtime/actor.py load), so the KV is planned within what the trunk
    and the states leave: on a 4 GiB device, half of it for Qwen3.6's KV beside its 2.25 GiB trunk
    and 1.2 GiB of states did not fit and the server did not start.

    A hybrid model's checkpoints (auto): up to two per sequence slot. `expert_bytes`: every routed
    expert; where what the KV leaves of the device cannot hold them all, they stay in host memory
    (the stage caches them only whole: load_cached's whole_cache_only) and the checkpoints take
    all of it, else a quarter. `host_bytes`: host memory for the checkpoints the device has no
    room for (llama-server keeps its prompt cache in RAM the same way): Qwen3.6 on a 4 GiB device
    held 1, and 4 clients cycling 8 prompts (bench/families.py --rows serve) prefilled every prompt
    whole: 3.4 tok/s against llama-server's 5.1; with 8 checkpoints 5.0. What the host bytes leave
    after the checkpoints is the host tier's KV blocks (cluster/kv_blocks.py).

    `itemsize`: the pool's cache types (KVTypes), or the older bytes per value (4, 2)."""
    types = as_kv_types(itemsize)
    per_state = sum(state_bytes_by_layer(config, 1))
    room = max(0, free_bytes - trunk_bytes - engine.max_seqs * per_state)
    plan = local_plan(config.context_length, engine.max_len, engine.kv_blocks, engine.kv_fraction, room,
                      kv_block_bytes(config, config.n_layers, types), BLOCK_SIZE)
    plan.types = [types]
    plan.tokens_by_type = tokens_by_type(config, [(0, config.n_layers)], plan.stage_bytes)
    if per_state and engine.prefix_reuse:  # recurrent state: checkpoints for prefix reuse
        if engine.state_checkpoints is not None:
            plan.checkpoints, plan.checkpoint_rule = engine.state_checkpoints, "as given (--state-checkpoints)"
        else:
            wanted = 2 * engine.max_seqs
            room -= plan.stage_bytes[0]
            if expert_bytes and room < expert_bytes:  # nothing else would use what the KV leaves
                plan.checkpoints = checkpoints_within(room, per_state, wanted)
                plan.checkpoint_rule = ("auto: up to two per sequence slot, in what the KV leaves of the device "
                                        "(the experts stay in host memory: they do not all fit there)")
            else:  # beside experts the device can hold: a quarter of what is left
                plan.checkpoints = checkpoints_within(room // 4, per_state, wanted)
                plan.checkpoint_rule = "auto: up to two per sequence slot, within a quarter of the device left"
            plan.host_checkpoints = checkpoints_within(host_bytes, per_state, wanted - plan.checkpoints)
            if plan.host_checkpoints:
                plan.checkpoint_rule += (f"; {plan.host_checkpoints} more in host memory "
                                         f"({plan.host_checkpoints * per_state / 2**20:.0f} MiB, copied when taken or restored)")
    if engine.prefix_reuse and host_bytes:  # the rest of the host tier: KV blocks the pool evicts
        from moeray.units import format_bytes

        left = host_bytes - plan.host_checkpoints * per_state
        plan.host_blocks = host_blocks_for([left], [kv_block_bytes(config, config.n_layers, types)])
        plan.host_rule = (f"{format_bytes(host_bytes)} of host memory (--kv-host) less its checkpoints; a block the "
                          "pool evicts is saved there and copied back on a prefix hit")
    return plan


def state_bytes_by_layer(config, n_seqs: int) -> list[int]:
    """Each layer's recurrent state for `n_seqs` sequence slots (0 where the layer keeps only KV):
    held on the layer's card for every sequence that may run, so priced with its KV."""
    arch = arch_of(config)
    return [n_seqs * arch.state_bytes(config, l) for l in range(config.n_layers)]


def held_spec(header, kv_bytes_per_layer: int | list[int] = 0, backend: str | None = None):
    """The planner's ModelSpec in the bytes a stage really holds on its device.

    On the quantised backends a slot and the trunk hold the GGUF's own blocks (float32 only for
    vectors and routers), on the exact backend float32 copies: `held_bytes` in stages/gguf/reader.py
    prices both, and the stage is charged the same numbers. A layer's KV cache is on the card with
    its trunk whatever the split, so it is priced as part of that layer's trunk: the search then
    charges every candidate range exactly the KV it would allocate. `kv_bytes_per_layer`: one
    figure for every layer, or a list (kv_bytes_by_layer) where the layers' KV differ.
    """
    backend = "exact" if backend == "exact" else "quantised"  # ggml and dequant hold the same blocks
    cfg = header.config
    t = reader.trunk_bytes(header.tensors, cfg, backend)
    kv = kv_bytes_per_layer if isinstance(kv_bytes_per_layer, list) else [kv_bytes_per_layer] * cfg.n_layers
    layers = [k + n for k, n in zip(kv, t["layers"])]
    experts = [reader.expert_bytes(header.tensors, l, backend) for l in range(cfg.n_layers)]
    pieces = []  # a hybrid model's layers are offered in pieces: dnproj, attn, ..., and its KV + sequence states
    if any(state_bytes_by_layer(cfg, 1)):
        pieces = [dict(p, **{"kv+state": k}) if k else p for p, k in zip(reader.trunk_pieces(header.tensors, cfg, backend), kv)]
    return ModelSpec(cfg.n_layers, cfg.n_experts, cfg.n_experts_used, experts,
                     TrunkBytes(t["embedding"], t["head"], layers, pieces))


def plan_kv_types(config, asked: tuple[str, str], kinds) -> KVTypes:
    """The cache types every stage starts from: the asked K and V types ("auto": the default,
    planner/kv.py default_kv_types), checked against the model's attention (one line if it cannot
    keep them)."""
    arch = arch_of(config)
    kv = [l for l in range(config.n_layers) if arch.kv_values(config, l)]
    latent = bool(kv) and arch.kv_layout(config, kv[0])[2] == 0
    what = f"--cache-type-k {asked[0]} --cache-type-v {asked[1]}"
    types = resolve_kv_types(asked[0], asked[1], default_kv_types(list(kinds)), latent)
    check_kv_types(config, types, what=what)
    return types


def kv_by_layer(config, n_blocks: int, ranges, types_by_stage) -> list[int]:
    """Each layer's KV pool of `n_blocks` blocks in the types of the stage that holds it."""
    out = [0] * config.n_layers
    for (a, b), t in zip(ranges, types_by_stage):
        for layer in range(a, b):
            out[layer] = kv_layer_bytes(config, n_blocks, t, layer)
    return out


def tokens_by_type(config, ranges, stage_bytes: list[int]) -> dict[str, int]:
    """The tokens the stages' pool bytes would hold at each cache type (K and V alike): one count
    for all stages, the smallest, as a block table serves them all."""
    out = {}
    for t in CACHE_TYPES:
        types = KVTypes.same(t)
        try:
            check_kv_types(config, types)
        except MoerayError:
            continue  # the model's rows cannot be kept in this type
        per = [kv_block_bytes(config, range(a, b), types) for a, b in ranges]
        fits = [n // p for n, p in zip(stage_bytes, per) if p]
        out[t] = min(fits) * BLOCK_SIZE if fits else 0
    return out


def attention_ms(config, ranges, types_by_stage, tokens: int) -> list[float]:
    """Each stage's price for reading `tokens` cached tokens in one decode step in its cache types
    (planner/kv.py READ_NS_PER_VALUE)."""
    arch = arch_of(config)
    out = []
    for (a, b), t in zip(ranges, types_by_stage):
        ns = 0.0
        for layer in range(a, b):
            if arch.kv_values(config, layer):
                heads, kd, vd = arch.kv_layout(config, layer)
                ns += heads * (kd * READ_NS_PER_VALUE[t.k] + vd * READ_NS_PER_VALUE[t.v])
        out.append(ns * tokens * 1e-6)
    return out


def plan_from_reports(header, reports: list[ProbeReport], opts: LaunchOptions, engine: EngineConfig,
                      handoff_ms: float):
    """The planner over what the actors reported. Returns (plan or None, ranges, lines, kv).

    Each card offers its free bytes less its reserve; the trunk the stage holds (all of it:
    StageModel computes the trunk on its own device) and the KV pool of its layers are charged per
    candidate range inside the search, so a split is never chosen that its KV cannot fit. The KV
    budget (blocks, the same on every stage) is --kv-blocks, --kv-fraction, or traded against the
    expert slots (planner/kv.py); so are the cache types where --cache-type-k / -v are auto
    (`auto_kv_types`). What the nodes' host memory keeps (state checkpoints, then evicted KV
    blocks) follows: `host_tier`.
    """
    cfg, S, L = header.config, len(reports), header.config.n_layers
    kinds = [r.device.kind for r in reports]
    asked = (opts.stage.cache_type_k, opts.stage.cache_type_v)
    base = plan_kv_types(cfg, asked, kinds)
    itemsize = base  # a draft model's and an MTP layer's pools: the stages' options' types (kv_cache.as_kv_types)
    context = context_tokens(cfg.context_length, engine.max_len)
    speeds, speed_lines = shared_host_speeds(reports)
    devs = [DeviceSpec(f"stage {r.stage} {r.device.name}", r.device.free_bytes - r.device.reserve_bytes,
                       layer_ms, miss_ms) for r, (layer_ms, miss_ms) in zip(reports, speeds)]
    fixed, rule = fixed_blocks(engine.kv_blocks, engine.kv_fraction, sum(d.free_bytes for d in devs),
                               kv_block_bytes(cfg, L, base))
    min_blocks = fixed or blocks_for(context)

    def hint(n: int) -> str:
        return (f"the KV cache takes {kv_layer_bytes(cfg, n, base)} bytes per layer for {n} blocks ({n * BLOCK_SIZE} "
                f"tokens: {'as given' if fixed else f'one sequence at the {context}-token context'}, {base.label}): "
                "lower --max-len or --kv-blocks, store the KV smaller (--cache-type-k / -v q8_0), or add stages")

    def kv_plan(n: int, ranges, rule: str, tried=(), types_by_stage=None) -> KVPlan:
        types_by_stage = types_by_stage or [base] * len(ranges)
        layer = kv_by_layer(cfg, n, ranges, types_by_stage)
        stage_bytes = [sum(layer[a:b]) for a, b in ranges]
        return KVPlan(n, BLOCK_SIZE, context, rule, stage_bytes, list(tried), types=list(types_by_stage),
                      tokens_by_type=tokens_by_type(cfg, ranges, stage_bytes))

    if not cfg.is_moe:  # no experts to place: split by layer speed (or as given)
        ks = parse_split(opts.split, L, S) or proportional_split(L, devs)
        bounds = [0] + list(ks) + [L]
        kv_layer = kv_bytes_by_layer(cfg, min_blocks, base)
        for r, d, a, b in zip(reports, devs, bounds[:-1], bounds[1:]):
            if sum(kv_layer[a:b]) > d.free_bytes:
                raise PlacementError(f"stage {r.stage}: {r.device.name} cannot hold layers {a}-{b - 1}; {hint(min_blocks)}")
        ranges = list(zip(bounds[:-1], bounds[1:]))
        kv = kv_plan(min_blocks, ranges, rule or "one sequence at the full context (no experts to trade)")
        kv.type_rule = "as asked" if "auto" not in asked else "the default (no experts to trade against)"
        host_tier(reports, ranges, cfg, kv, engine)
        lines = [f"layer split (dense model, by measured layer speed): K={','.join(map(str, ks))}", kv.line(),
                 kv.types_line()] + ([kv.host_line()] if kv.host_rule else [])
        return None, ranges, speed_lines + lines, kv

    profile = Profile.load(opts.profile, L, cfg.n_experts) if opts.profile else None

    state = state_bytes_by_layer(cfg, engine.max_seqs)  # every sequence slot's DeltaNet state

    def plan_for(n: int, checkpoints: int = 0, ranges=None, types_by_stage=None):
        """The placement at n blocks (and checkpoints); with `ranges`, that split and each stage's types."""
        held = state if not checkpoints else state_bytes_by_layer(cfg, engine.max_seqs + checkpoints)
        layer_kv = kv_bytes_by_layer(cfg, n, base) if ranges is None else kv_by_layer(cfg, n, ranges, types_by_stage)
        kv = [k + s for k, s in zip(layer_kv, held)]
        spec = held_spec(header, kv, opts.stage.backend)
        if opts.draft:  # the draft model and its KV pool sit on the first stage, priced as its trunk
            spec.trunk_bytes.embedding += draft_bytes(opts.draft, n, itemsize)
        if uses_mtp(header, engine):  # the next-token-prediction layer: on the last stage, with the head
            spec.trunk_bytes.head += mtp_bytes(header, n, engine.max_seqs, itemsize, S == 1)
        split = opts.split if ranges is None else "K=" + ",".join(str(a) for a, _ in ranges[1:])
        got = plan_placement(spec, devs, profile, split=split, objective=opts.objective, trunk=opts.trunk,
                             handoff_ms=handoff_ms, cover_b=opts.cover_b)
        if ranges is not None and S > 1 and first_search is not None:  # the split the search chose, kept
            got.method, got.placements_scored = first_search
        return got

    first_search = None
    try:
        if fixed:
            blocks, plan, tried = fixed, plan_for(fixed), []
        else:
            blocks, plan, tried = trade_kv(plan_for, min_blocks, engine.max_seqs * min_blocks)
            rule = ("auto: from one sequence at the full context, doubled while the experts it displaces cost "
                    "under 2% of the predicted step")
    except PlacementError as exc:
        raise PlacementError(f"{exc}; {hint(min_blocks)}") from None
    first_search = (plan.method, plan.placements_scored)
    checkpoints, c_rule, c_tried = 0, "", []
    if any(state) and engine.prefix_reuse:  # recurrent state: checkpoints for prefix reuse, priced as KV is
        if engine.state_checkpoints is not None:
            checkpoints, c_rule = engine.state_checkpoints, "as given (--state-checkpoints)"
            if checkpoints:
                try:
                    plan = plan_for(blocks, checkpoints)
                except PlacementError as exc:
                    raise PlacementError(f"{exc}; {checkpoints} state checkpoints do not fit beside the KV: "
                                         "lower --state-checkpoints") from None
        else:
            checkpoints, better, c_tried = trade_checkpoints(lambda c: plan_for(blocks, c), plan.predicted_ms,
                                                             2 * engine.max_seqs)
            plan = better or plan
            c_rule = (f"auto: up to two per sequence slot (a prompt's end, its answer's last block), as many as "
                      f"cost under 2% of the predicted step")
    ranges = [tuple(x) for x in plan.split]
    types_by_stage, type_rule = [base] * S, "as asked (--cache-type-k / --cache-type-v)"
    if "auto" in asked:
        types_by_stage, type_rule = auto_kv_types(cfg, asked, kinds, ranges, base, min_blocks, context,
                                                  lambda n, ts: plan_for(n, checkpoints, ranges, ts))
        if types_by_stage != [base] * S:  # the same trade at these types (more blocks where their rows left room)
            if fixed:
                plan = plan_for(fixed, checkpoints, ranges, types_by_stage)
            else:
                blocks, plan, tried = trade_kv(lambda n: plan_for(n, checkpoints, ranges, types_by_stage), min_blocks,
                                               engine.max_seqs * min_blocks)
    plan.kv = kv_plan(blocks, ranges, rule, tried, types_by_stage)
    plan.kv.type_rule = type_rule
    plan.kv.checkpoints, plan.kv.checkpoint_rule = checkpoints, c_rule
    host_tier(reports, ranges, cfg, plan.kv, engine, state_bytes_by_layer(cfg, 1))
    plan.notes.append(plan.kv.types_line())
    if plan.kv.host_rule:
        plan.notes.append(plan.kv.host_line())
    if any(state):
        plan.notes.append(state_line(state_bytes_by_layer(cfg, 1), ranges, engine.max_seqs))
        if engine.prefix_reuse:
            plan.notes.append(checkpoint_line(state_bytes_by_layer(cfg, 1), ranges, checkpoints,
                                              sum(kv_bytes_by_layer(cfg, 1, base)), plan.kv.checkpoint_rule, c_tried))
    return plan, ranges, speed_lines + plan.lines(verbose=opts.verbose_plan), plan.kv


def auto_kv_types(config, asked, kinds, ranges, base: KVTypes, blocks: int, context: int, plan_with):
    """Cache types where --cache-type-k / -v are auto, per stage: of `base` (the default: float32 on
    the CPU), f16 and q8_0 for the auto ones, the types whose predicted step is the least, its
    reads included: smaller rows leave room for expert slots whose saved misses are weighed against
    what reading them costs (READ_NS_PER_VALUE), for one sequence at the full `context` (the
    decode step the KV trade starts from: planner/kv.py trade_kv), at `blocks` blocks. A stage on
    a card keeps `base` (float16): its attention (torch) would dequantise every quantised row each
    step. `plan_with(n, types_by_stage)`: the placement of the same split. Returns (types by
    stage, the rule's words)."""
    arch = arch_of(config)
    kv = [l for l in range(config.n_layers) if arch.kv_values(config, l)]
    latent = bool(kv) and arch.kv_layout(config, kv[0])[2] == 0
    candidates = []
    for t in ("f16", "q8_0"):
        alt = resolve_kv_types(*((t if x == "auto" else x) for x in asked), base, latent)
        try:
            check_kv_types(config, alt)
        except MoerayError:
            continue  # this model's rows cannot be kept in it
        if alt != base and alt not in candidates:
            candidates.append(alt)

    def step_ms(types) -> float:
        return plan_with(blocks, types).predicted_ms + sum(attention_ms(config, ranges, types, context))

    types, took, why = [base] * len(ranges), [], []
    best = step_ms(types)
    for i, kind in enumerate(kinds):
        if kind == "cuda":
            why.append(f"stage {i} keeps {base.label} on its card (its attention would dequantise other rows)")
            continue
        for alt in candidates:
            trial = types[:i] + [alt] + types[i + 1:]
            try:
                ms = step_ms(trial)
            except PlacementError:
                continue
            if ms < best:
                types, best, gain = trial, ms, best - ms
        if types[i] != base:
            took.append(f"stage {i} {types[i].label}")
    head = (f"auto: the types of least predicted step for one {context}-token sequence, the expert slots their "
            f"bytes buy against their reads")
    return types, "; ".join([head + (f" ({', '.join(took)})" if took else f" ({base.label} everywhere)")] + why)


def host_tier(reports: list[ProbeReport], ranges, config, kv: KVPlan, engine: EngineConfig,
              state_per_layer: list[int] | None = None) -> None:
    """What each node's host tier keeps (its room: ProbeReport.host_tier_bytes, `--kv-host`),
    split evenly among its stages: a hybrid model's state checkpoints beyond those its devices hold
    first (`moeray serve --local` does the same: local_kv_plan), then KV blocks its pools evict
    (cluster/kv_blocks.py). One count of each for all stages (a slot names the same prefix on every
    stage). Fills kv.host_checkpoints, kv.host_blocks and their words."""
    rooms = host_rooms(reports)
    if not any(rooms) or not engine.prefix_reuse:
        return
    state_per_layer = state_per_layer or [0] * config.n_layers
    per_state = [sum(state_per_layer[a:b]) for a, b in ranges]
    if any(per_state) and engine.state_checkpoints is None:
        host = host_checkpoints(reports, ranges, state_per_layer, 2 * engine.max_seqs - kv.checkpoints)
        if host:
            kv.host_checkpoints = host
            kv.checkpoint_rule += (f"; {host} more in host memory (the host tier: checkpoints first; copied when "
                                   "taken or restored)")
    left = [room - kv.host_checkpoints * p for room, p in zip(rooms, per_state)]
    per_block = [kv_block_bytes(config, range(a, b), t) for (a, b), t in zip(ranges, kv.types or [KVTypes()] * len(ranges))]
    kv.host_blocks = host_blocks_for(left, per_block)
    from moeray.units import format_bytes

    kv.host_rule = (f"each node's --kv-host room ({', '.join(format_bytes(r) for r in rooms)} per stage) less its "
                    f"checkpoints; a block the pool evicts is saved there and copied back on a prefix hit")


def host_rooms(reports: list[ProbeReport]) -> list[int]:
    """Each stage's host tier bytes: its node's room (ProbeReport.host_tier_bytes) split evenly
    among the stages on that node."""
    nodes = [r.device.node_ip or r.device.hostname for r in reports]
    on_node = Counter(nodes)
    return [r.host_tier_bytes // on_node[n] for r, n in zip(reports, nodes)]


def host_checkpoints(reports: list[ProbeReport], ranges, state_per_layer: list[int], wanted: int) -> int:
    """State checkpoints every stage can keep in its host tier, beyond those its device holds
    (`moeray serve --local` does the same: local_kv_plan): one count for all (host_rooms)."""
    if wanted < 1:
        return 0
    return host_checkpoints_for(host_rooms(reports), [sum(state_per_layer[a:b]) for a, b in ranges], wanted)


def shared_host_speeds(reports: list[ProbeReport]) -> tuple[list[tuple[float, float]], list[str]]:
    """(layer_ms, miss_ms) per stage for the planner, and a line for each adjustment.

    Simulated devices on one node are the same CPU cores: their timings differ only by noise
    (another stage loading, another process), and a planner that believes a 3x gap gives one card
    a single layer and wastes its room. They are planned with the median of their measurements.
    """
    speeds = [(r.layer_ms, r.miss_ms) for r in reports]
    lines = []
    by_node: dict[str, list[int]] = {}
    for i, r in enumerate(reports):
        if r.device.kind == "simulated" and r.device.node_ip:  # an unknown node is not known to be shared
            by_node.setdefault(r.device.node_ip, []).append(i)
    for node, idx in by_node.items():
        if len(idx) < 2:
            continue
        layer_ms = statistics.median(reports[i].layer_ms for i in idx)
        miss_ms = statistics.median(reports[i].miss_ms for i in idx)
        for i in idx:
            speeds[i] = (layer_ms, miss_ms)
        lines.append(f"simulated devices {', '.join(str(reports[i].stage) for i in idx)} share the CPU of {node}: "
                     f"planned with the median of their timings, {layer_ms:.3f} ms per layer, "
                     f"{miss_ms:.3f} ms per missed expert")
    return speeds, lines


def uses_mtp(header, engine: EngineConfig) -> bool:
    """The last stage loads the file's next-token-prediction layer: the file has one and speculation
    may use it (--speculative auto or mtp)."""
    return engine.speculative in ("auto", "mtp") and mtp_layers(header) > 0
