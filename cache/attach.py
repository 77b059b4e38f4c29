"""Build the expert path of one stage: an ExpertCache in front of the host copy, filled from a
profile, optionally recording every routing decision.

    host = HostExperts(gguf)                                   # moeray.stages.blocks.moe
    cache = build_cache(host, first, end, "cpu", budget_bytes, profile, "adaptive")
    model = StageModel(gguf, first, end, "cpu", experts=cache)  # the MoE blocks are built with it
    ... model.step(...) ...
    print(cache.stats()); cache.close()

The host object is passed in, so this package never imports moeray.stages.
"""
from __future__ import annotations

import os

from moeray.cache.budget import device_budget
from moeray.cache.expert_cache import ExpertCache
from moeray.cache.trace import TraceWriter


def load_profile(profile, n_layers: int, n_experts: int):
    """A planner Profile from a Profile, a path (moeray, Strata STRP or colibri heat), or None (uniform)."""
    from moeray.planner.profile import Profile

    if profile is None:
        return Profile.uniform(n_layers, n_experts)
    if isinstance(profile, (str, os.PathLike)):
        return Profile.load(profile, n_layers, n_experts)
    profile.check_model(n_layers, n_experts)
    return profile


def routing_trace(path: str | os.PathLike, config, first: int, end: int, **writer_kwargs) -> TraceWriter:
    """A writer that records every routing decision of layers [first, end) to `path`; give it to
    HostExperts as `on_route` to record without a cache."""
    return TraceWriter(path, n_layers=config.n_layers, n_experts=config.n_experts, k=config.n_experts_used,
                       first=first, end=end, **writer_kwargs)


def build_cache(host, first: int, end: int, device, budget_bytes: int | None, profile=None,
                policy: str = "static", record_routing: str | os.PathLike | None = None, *,
                layout: str = "global", n_slots: int | None = None,
                copies_per_step: int | None = 1) -> ExpertCache:
    """An expert cache of `budget_bytes` on `device` for layers [first, end), filled from `profile`.

    budget_bytes: bytes the cache may hold; on CPU a simulated budget (required unless n_slots is
    given), on CUDA a cap on what the device has free (None = all of it, less a reserve).
    n_slots: alternatively `--expert-cache N`: N slots of the largest blob.
    record_routing: append every routing decision of the stage to this trace file.
    """
    cfg = host.config
    if n_slots is not None:
        wanted = int(n_slots) * max(host.slot_bytes(l) for l in range(first, end))
        budget_bytes = wanted if budget_bytes is None else min(int(budget_bytes), wanted)
    budget = device_budget(str(device), budget_bytes)
    cache = ExpertCache(host, first, end, budget, layout=layout, policy=policy, device=device,
                        copies_per_step=copies_per_step)
    cache.fill(load_profile(profile, cfg.n_layers, cfg.n_experts))
    if record_routing is not None:
        cache.trace_writer = routing_trace(record_routing, cfg, first, end)
    return cache
