"""`moeray serve --local`'s KV budget: one sequence at the model's context when it fits, else as
much context as half the device holds (a 40,960-token model failed to start with 7.5 GiB of KV
asked of a 4 GiB device), and an explicit --max-len is kept as given."""
from __future__ import annotations

import dataclasses

from moeray.cluster.config import EngineConfig
from moeray.cluster.driver import local_kv_plan
from moeray.stages.blocks.kv_cache import kv_bytes_by_layer
from moeray.stages.gguf.reader import read_gguf_header
from moeray.stages.blocks.kv_cache import BLOCK_SIZE


def test_a_long_context_gets_half_the_device_and_says_so(default_model_path):
    cfg = read_gguf_header(str(default_model_path)).config
    small = local_kv_plan(cfg, EngineConfig(), 4 << 30)
    assert small.context == cfg.context_length and "full context" in small.rule
    long = dataclasses.replace(cfg, context_length=1 << 20)
    budget = 1 << 30
    plan = local_kv_plan(long, EngineConfig(), budget)
    used = sum(kv_bytes_by_layer(long, plan.blocks))
    assert budget // 2 - sum(kv_bytes_by_layer(long, 1)) < used <= budget // 2
    assert plan.context == plan.blocks * BLOCK_SIZE < long.context_length
    assert f"one sequence of {plan.context} tokens" in plan.rule and "--max-len" in plan.rule
    given = local_kv_plan(long, EngineConfig(max_len=4096), budget)
    assert given.context == 4096


def test_the_kv_is_planned_within_what_the_trunk_leaves(default_model_path):
    # The stage charges KV, recurrent states and trunk to one device budget: a KV plan of half the
    # device beside a trunk of 60% of it would not load (Qwen3.6 on serve --local's 4 GiB did not start).
    cfg = dataclasses.replace(read_gguf_header(str(default_model_path)).config, context_length=1 << 20)
    budget, trunk = 1 << 30, (6 << 30) // 10
    alone = local_kv_plan(cfg, EngineConfig(), budget)
    beside = local_kv_plan(cfg, EngineConfig(), budget, trunk_bytes=trunk)
    used = sum(kv_bytes_by_layer(cfg, beside.blocks))
    assert trunk + used <= budget and used <= (budget - trunk) // 2
    assert beside.blocks < alone.blocks and beside.context == beside.blocks * BLOCK_SIZE
