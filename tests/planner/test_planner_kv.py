"""The planner's KV budget (planner/kv.py, torch-free): auto trades KV blocks against expert
slots, --kv-blocks / --kv-fraction fix it, and the plan line says the tokens a stage holds and
the concurrency at the model's context."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from moeray.errors import PlacementError
from moeray.planner.kv import KVPlan, blocks_for_fraction, trade_kv


@dataclass
class FakePlan:
    predicted_ms: float


def plans(ms_of_blocks, fits_up_to: int):
    seen = []

    def plan_for(n: int) -> FakePlan:
        seen.append(n)
        if n > fits_up_to:
            raise PlacementError(f"{n} blocks do not fit")
        return FakePlan(ms_of_blocks(n))
    return plan_for, seen


def test_auto_doubles_kv_while_the_step_stays_within_2_percent():
    # Each block beyond 100 pushes out experts worth 0.01 ms of a 100 ms step: 2% is 200 blocks more.
    plan_for, _ = plans(lambda n: 100.0 + 0.01 * max(0, n - 100), fits_up_to=10_000)
    blocks, plan, tried = trade_kv(plan_for, 32, 32 * 16)
    assert 256 < blocks <= 300 and plan.predicted_ms <= 102.0  # bisected to within 1/16
    assert tried[0] == (32, 100.0) and [b for b, _ in tried[:5]] == [32, 64, 128, 256, 512]
    # KV costs nothing (every expert fits anyway): as much as max_seqs full-context sequences can use.
    free, _ = plans(lambda n: 50.0, fits_up_to=10_000)
    assert trade_kv(free, 32, 512)[0] == 512
    # Bounded by what fits on the cards.
    tight, _ = plans(lambda n: 50.0, fits_up_to=200)
    blocks, _, tried = trade_kv(tight, 32, 512)
    assert 180 <= blocks <= 200 and (256, None) in tried
    # Not even one sequence at the full context: the caller's error, unchanged.
    with pytest.raises(PlacementError, match="do not fit"):
        trade_kv(plans(lambda n: 1.0, fits_up_to=10)[0], 32, 512)


def test_fraction_and_the_plan_line():
    assert blocks_for_fraction(0.25, 1000 * 1024, 1024) == 250
    kv = KVPlan(512, 16, 8192, "auto", [96 << 20, 84 << 20], [(512, 100.0), (1024, None)])
    assert (kv.tokens, kv.concurrency) == (8192, 1.0)
    assert kv.line().startswith("[kv] 512 blocks of 16 tokens on every stage: 8192 tokens of KV per stage "
                                "(96 MiB, 84 MiB), 1.00 sequences at the 8192-token context; auto; tried 512: "
                                "100.0 ms, 1024: no fit")
    assert kv.to_json()["concurrency"] == 1.0


def test_the_default_model_on_the_default_cards_serves_its_whole_context(default_model_path):
    """The default simulated cards hold one 8,192-token sequence of float32 KV (what 16 x 512
    reserved before) and the planner says so; a bigger KV budget is refused with the fix named."""
    from moeray.cluster.config import DEFAULT_SIMULATED, EngineConfig, LaunchOptions
    from moeray.cluster.placement import plan_from_reports
    from moeray.stages.gguf.reader import read_gguf_header
    from moeray.units import parse_sizes
    from test_ray_units import _reports

    header = read_gguf_header(default_model_path)
    opts = LaunchOptions(4)
    _, ranges, lines, kv = plan_from_reports(header, _reports(parse_sizes(DEFAULT_SIMULATED)), opts, EngineConfig(),
                                             0.2)
    assert (kv.context, kv.blocks, kv.tokens) == (8192, 512, 8192)
    assert any(line.startswith("[kv] 512 blocks of 16 tokens on every stage: 8192 tokens of KV per stage") for line in lines)
    assert sum(kv.stage_bytes) == 512 * 16 * 2 * 30 * 3 * 64 * 4  # float32 k and v, 30 layers
    with pytest.raises(PlacementError, match="--kv-blocks"):
        plan_from_reports(header, _reports(parse_sizes(DEFAULT_SIMULATED)), opts, EngineConfig(kv_blocks=4096), 0.2)
    _, _, _, frac = plan_from_reports(header, _reports(parse_sizes(DEFAULT_SIMULATED)), opts,
                                      EngineConfig(kv_fraction=0.1, max_len=1024), 0.2)
    assert frac.rule == "--kv-fraction 0.1" and frac.context == 1024 and frac.concurrency > 1
