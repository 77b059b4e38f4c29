"""`moeray serve --local`'s KV budget: one sequence at the model's context when it fits, else as
much context as half the device holds (a 40,960-token model failed to start with 7.5 GiB of KV
asked of a 4 GiB device), and an explicit --max-len is kept as given."""
from __future__ import annotations

import dataclasses

from moeray.cluster.config import EngineConfig
from moeray.cluster.placement import local_kv_plan
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


def test_a_hybrid_models_checkpoints_take_what_the_kv_leaves_then_host_memory(tmp_path):
    # Qwen3.6 on serve --local's 4 GiB device: its experts cannot all be cached there (they stay in
    # host memory), yet the checkpoints got a quarter of what the KV left: 1, and 4 clients cycling
    # 8 prompts prefilled every prompt whole (3.4 tok/s against llama-server's 5.1).
    from moeray.cluster.placement import state_bytes_by_layer
    from moeray.stages.gguf.writer import write_gguf
    from tiny_hybrid import tiny_qwen3next

    cfg = read_gguf_header(str(write_gguf(tiny_qwen3next(max_pos=4096), tmp_path / "h.gguf", "F32"))).config
    per = sum(state_bytes_by_layer(cfg, 1))
    eng = EngineConfig(max_seqs=4, max_len=1024)
    trunk = 10 * per
    kv = local_kv_plan(cfg, eng, 1 << 40, trunk_bytes=trunk).stage_bytes[0]
    budget = trunk + 4 * per + kv + 5 * per + per // 2  # the KV (of --max-len) leaves 5.5 states' room
    free = budget - trunk - 4 * per - kv

    beside = local_kv_plan(cfg, eng, budget, trunk_bytes=trunk, expert_bytes=free)  # every expert fits
    assert beside.checkpoints == 1 and beside.host_checkpoints == 0
    assert "a quarter" in beside.checkpoint_rule

    host_only = local_kv_plan(cfg, eng, budget, trunk_bytes=trunk, expert_bytes=free + 1)
    assert host_only.checkpoints == 5
    assert "experts stay in host memory" in host_only.checkpoint_rule

    more = local_kv_plan(cfg, eng, budget, trunk_bytes=trunk, expert_bytes=free + 1, host_bytes=2 * per + 1)
    assert (more.checkpoints, more.host_checkpoints) == (host_only.checkpoints, 2)
    assert "2 more in host memory" in more.checkpoint_rule
    capped = local_kv_plan(cfg, eng, budget, trunk_bytes=trunk, expert_bytes=free + 1, host_bytes=100 * per)
    assert capped.checkpoints + capped.host_checkpoints == 2 * eng.max_seqs  # two per sequence slot at most

    given = local_kv_plan(cfg, dataclasses.replace(eng, state_checkpoints=3), budget, trunk_bytes=trunk,
                          expert_bytes=free + 1, host_bytes=100 * per)
    assert (given.checkpoints, given.host_checkpoints) == (3, 0)
