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
from moeray.planner.kv import (HOST_CHECKPOINT_SHARE, KVPlan, checkpoints_within, context_tokens, fixed_blocks,
                               host_checkpoints_for, itemsize_for, local_plan, trade_checkpoints, trade_kv)
from moeray.planner.profile import Profile
from moeray.planner.report import checkpoint_line, state_line
from moeray.planner.search import parse_split, plan_placement, proportional_split
from moeray.planner.spec import ModelSpec, TrunkBytes
from moeray.stages.arch import arch_of
from moeray.stages.blocks.kv_cache import BLOCK_SIZE, blocks_for, kv_block_bytes, kv_bytes_by_layer, kv_layer_bytes
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


def local_kv_plan(config, engine: EngineConfig, free_bytes: int, itemsize: int = 4, trunk_bytes: int = 0,
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
    whole: 3.4 tok/s against llama-server's 5.1; with 8 checkpoints 5.0."""
    per_state = sum(state_bytes_by_layer(config, 1))
    room = max(0, free_bytes - trunk_bytes - engine.max_seqs * per_state)
    plan = local_plan(config.context_length, engine.max_len, engine.kv_blocks, engine.kv_fraction, room,
                      kv_block_bytes(config, config.n_layers, itemsize), BLOCK_SIZE)
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


def plan_from_reports(header, reports: list[ProbeReport], opts: LaunchOptions, engine: EngineConfig,
                      handoff_ms: float):
    """The planner over what the actors reported. Returns (plan or None, ranges, lines, kv).

    Each card offers its free bytes less its reserve; the trunk the stage holds (all of it:
    StageModel computes the trunk on its own device) and the KV pool of its layers are charged per
    candidate range inside the search, so a split is never chosen that its KV cannot fit. The KV
    budget (blocks, the same on every stage) is --kv-blocks, --kv-fraction, or traded against the
    expert slots (planner/kv.py).
    """
    cfg, S, L = header.config, len(reports), header.config.n_layers
    itemsize = itemsize_for(r.device.kind for r in reports)
    context = context_tokens(cfg.context_length, engine.max_len)
    speeds, speed_lines = shared_host_speeds(reports)
    devs = [DeviceSpec(f"stage {r.stage} {r.device.name}", r.device.free_bytes - r.device.reserve_bytes,
                       layer_ms, miss_ms) for r, (layer_ms, miss_ms) in zip(reports, speeds)]
    fixed, rule = fixed_blocks(engine.kv_blocks, engine.kv_fraction, sum(d.free_bytes for d in devs),
                               kv_block_bytes(cfg, L, itemsize))
    min_blocks = fixed or blocks_for(context)

    def hint(n: int) -> str:
        return (f"the KV cache takes {kv_layer_bytes(cfg, n, itemsize)} bytes per layer for {n} blocks ({n * BLOCK_SIZE} "
                f"tokens: {'as given' if fixed else f'one sequence at the {context}-token context'}): lower --max-len "
                "or --kv-blocks, or add stages")

    def kv_plan(n: int, ranges, rule: str, tried=()) -> KVPlan:
        layer = kv_bytes_by_layer(cfg, n, itemsize)
        return KVPlan(n, BLOCK_SIZE, context, rule, [sum(layer[a:b]) for a, b in ranges], list(tried))

    if not cfg.is_moe:  # no experts to place: split by layer speed (or as given)
        ks = parse_split(opts.split, L, S) or proportional_split(L, devs)
        bounds = [0] + list(ks) + [L]
        kv_layer = kv_bytes_by_layer(cfg, min_blocks, itemsize)
        for r, d, a, b in zip(reports, devs, bounds[:-1], bounds[1:]):
            if sum(kv_layer[a:b]) > d.free_bytes:
                raise PlacementError(f"stage {r.stage}: {r.device.name} cannot hold layers {a}-{b - 1}; {hint(min_blocks)}")
        ranges = list(zip(bounds[:-1], bounds[1:]))
        kv = kv_plan(min_blocks, ranges, rule or "one sequence at the full context (no experts to trade)")
        return None, ranges, speed_lines + [f"layer split (dense model, by measured layer speed): K={','.join(map(str, ks))}",
                              kv.line()], kv

    profile = Profile.load(opts.profile, L, cfg.n_experts) if opts.profile else None

    state = state_bytes_by_layer(cfg, engine.max_seqs)  # every sequence slot's DeltaNet state

    def plan_for(n: int, checkpoints: int = 0):
        held = state if not checkpoints else state_bytes_by_layer(cfg, engine.max_seqs + checkpoints)
        kv = [k + s for k, s in zip(kv_bytes_by_layer(cfg, n, itemsize), held)]
        spec = held_spec(header, kv, opts.stage.backend)
        if opts.draft:  # the draft model and its KV pool sit on the first stage, priced as its trunk
            spec.trunk_bytes.embedding += draft_bytes(opts.draft, n, itemsize)
        if uses_mtp(header, engine):  # the next-token-prediction layer: on the last stage, with the head
            spec.trunk_bytes.head += mtp_bytes(header, n, engine.max_seqs, itemsize, S == 1)
        return plan_placement(spec, devs, profile, split=opts.split,
                              objective=opts.objective, trunk=opts.trunk, handoff_ms=handoff_ms, cover_b=opts.cover_b)

    try:
        if fixed:
            blocks, plan, tried = fixed, plan_for(fixed), []
        else:
            blocks, plan, tried = trade_kv(plan_for, min_blocks, engine.max_seqs * min_blocks)
            rule = ("auto: from one sequence at the full context, doubled while the experts it displaces cost "
                    "under 2% of the predicted step")
    except PlacementError as exc:
        raise PlacementError(f"{exc}; {hint(min_blocks)}") from None
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
    host = 0
    if any(state) and engine.prefix_reuse and engine.state_checkpoints is None:
        host = host_checkpoints(reports, ranges, state_bytes_by_layer(cfg, 1), 2 * engine.max_seqs - checkpoints)
        if host:
            c_rule += (f"; {host} more in host memory (each node's share: MemAvailable less the model's files, "
                       f"/{HOST_CHECKPOINT_SHARE}, split among its stages; copied when taken or restored)")
    plan.kv = kv_plan(blocks, ranges, rule, tried)
    plan.kv.checkpoints, plan.kv.checkpoint_rule, plan.kv.host_checkpoints = checkpoints, c_rule, host
    if any(state):
        plan.notes.append(state_line(state_bytes_by_layer(cfg, 1), ranges, engine.max_seqs))
        if engine.prefix_reuse:
            plan.notes.append(checkpoint_line(state_bytes_by_layer(cfg, 1), ranges, checkpoints,
                                              sum(kv_bytes_by_layer(cfg, 1, itemsize)), c_rule, c_tried))
    return plan, ranges, speed_lines + plan.lines(verbose=opts.verbose_plan), plan.kv


def host_checkpoints(reports: list[ProbeReport], ranges, state_per_layer: list[int], wanted: int) -> int:
    """State checkpoints every stage can keep in its node's host memory, beyond those its device
    holds (`moeray serve --local` does the same: local_kv_plan): each node's room
    (ProbeReport.host_checkpoint_bytes) split evenly among the stages on it, one count for all."""
    if wanted < 1:
        return 0
    nodes = [r.device.node_ip or r.device.hostname for r in reports]
    on_node = Counter(nodes)
    rooms = [r.host_checkpoint_bytes // on_node[n] for r, n in zip(reports, nodes)]
    return host_checkpoints_for(rooms, [sum(state_per_layer[a:b]) for a, b in ranges], wanted)


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
