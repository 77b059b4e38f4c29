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
