"""Plug an ExpertCache (and optionally a routing-trace writer) into a StageModel.

This is the one call the CLI and the stage actor make:

    cache = attach_cache(model, budget_bytes, profile, policy, record_routing="run.trace")
    ... model.step(...) ...
    print(cache.stats()); cache.close()
"""
from __future__ import annotations

import os

from moeray.cache.budget import device_budget
from moeray.cache.expert_cache import ExpertCache, slot_bytes
from moeray.cache.trace import TraceWriter
from moeray.stages.moe import HostExperts


def load_profile(profile, n_layers: int, n_experts: int):
    """A planner Profile from a Profile, a path (moeray, Strata STRP or colibri heat), or None (uniform)."""
    from moeray.planner.profile import Profile

    if profile is None:
        return Profile.uniform(n_layers, n_experts)
    if isinstance(profile, (str, os.PathLike)):
        return Profile.load(profile, n_layers, n_experts)
    profile.check_model(n_layers, n_experts)
    return profile


def attach_cache(model, budget_bytes: int | None, profile=None, policy: str = "static",
                 record_routing: str | os.PathLike | None = None, *, layout: str = "global",
                 n_slots: int | None = None, copies_per_step: int | None = 1) -> ExpertCache:
    """Give `model` (a StageModel) an expert cache of `budget_bytes` on its device, filled from
    `profile`, and make it the model's ExpertSource and routing hook.

    budget_bytes: bytes the cache may hold; on CPU a simulated budget (required unless n_slots is
    given), on CUDA a cap on what the device has free (None = all of it, less a reserve).
    n_slots: alternatively `--expert-cache N`: N slots of the largest blob.
    record_routing: append every routing decision of the stage to this trace file.
    A routing hook already set on the model keeps being called.
    """
    cfg = model.config
    host = model.expert_source if isinstance(model.expert_source, HostExperts) else HostExperts(model.gguf)
    if n_slots is not None:
        wanted = int(n_slots) * max(slot_bytes(host, l) for l in range(model.first, model.end))
        budget_bytes = wanted if budget_bytes is None else min(int(budget_bytes), wanted)
    budget = device_budget(str(model.device), budget_bytes)
    cache = ExpertCache(host, model.first, model.end, budget, layout=layout, policy=policy,
                        device=model.device, copies_per_step=copies_per_step)
    cache.fill(load_profile(profile, cfg.n_layers, cfg.n_experts))
    if record_routing is not None:
        cache.trace_writer = TraceWriter(record_routing, n_layers=cfg.n_layers, n_experts=cfg.n_experts,
                                         k=cfg.n_experts_used, first=model.first, end=model.end)
    previous = cache.previous_hook = model.routing_hook
    if previous is None:
        model.routing_hook = cache.on_route
    else:
        def hook(layer, ids, weights):
            previous(layer, ids, weights)
            cache.on_route(layer, ids, weights)
        model.routing_hook = hook
    model.expert_source = cache
    return cache


def attach_trace(model, path: str | os.PathLike, **writer_kwargs) -> TraceWriter:
    """Record the routing of `model` to `path` without a cache (the writer is the routing hook)."""
    cfg = model.config
    writer = TraceWriter(path, n_layers=cfg.n_layers, n_experts=cfg.n_experts, k=cfg.n_experts_used,
                         first=model.first, end=model.end, **writer_kwargs)
    previous = model.routing_hook
    if previous is None:
        model.routing_hook = writer
    else:
        def hook(layer, ids, weights):
            previous(layer, ids, weights)
            writer(layer, ids, weights)
        model.routing_hook = hook
    return writer


def detach_cache(model) -> None:
    """Undo attach_cache: the model gets its host experts and its earlier routing hook back."""
    cache = model.expert_source
    if not isinstance(cache, ExpertCache):
        return
    cache.close()
    model.expert_source = cache.host
    model.routing_hook = cache.previous_hook
