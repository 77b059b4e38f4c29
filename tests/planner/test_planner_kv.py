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


def test_q8_0_on_the_default_cards_holds_more_than_1_8x_float32s_tokens(default_model_path):
    """The same cards with the KV stored as q8_0 (-ctk q8_0 -ctv q8_0, 1.0625 bytes a value against
    float32's 4): the trade keeps more blocks within 2% of its smallest step, and the bytes float32
    spent on KV hold experts instead (a shorter predicted step). The plan's line names the types and
    the tokens the same bytes would hold at each; f16 lies between."""
    from moeray.cluster.config import DEFAULT_SIMULATED, EngineConfig, LaunchOptions
    from moeray.cluster.placement import plan_from_reports
    from moeray.planner.kv import KVTypes
    from moeray.stages.gguf.reader import read_gguf_header
    from moeray.stages.kernels.settings import StageOptions
    from moeray.units import parse_sizes
    from test_ray_units import _reports

    header = read_gguf_header(default_model_path)

    def plan(t: str):
        opts = LaunchOptions(4, stage=StageOptions(cache_type_k=t, cache_type_v=t))
        return plan_from_reports(header, _reports(parse_sizes(DEFAULT_SIMULATED)), opts, EngineConfig(), 0.2)

    p32, _, _, f32 = plan("f32")
    p8, _, lines, q8 = plan("q8_0")
    assert f32.tokens == 8192 and q8.tokens >= 1.8 * f32.tokens
    assert q8.types == [KVTypes.same("q8_0")] * 4 and p8.predicted_ms < p32.predicted_ms
    assert sum(q8.stage_bytes) == q8.blocks * 16 * 30 * 3 * 64 * 2 // 32 * 34  # k and v rows of 30 layers in q8_0
    line = next(l for l in lines if l.startswith("[kv] cache types q8_0 on every stage"))
    assert f"q8_0 {q8.tokens}" in line and "as asked" in line
    assert f32.tokens < plan("f16")[3].tokens < q8.tokens
    # auto: the plan's choice per stage, one line saying which and why
    _, _, lines, auto = plan("auto")
    assert len(auto.types) == 4 and any(l.startswith("[kv] cache types") and "auto:" in l for l in lines)


def test_a_cache_type_the_model_cannot_keep_is_refused_before_anything_loads(tmp_path):
    from moeray.cluster.config import EngineConfig, LaunchOptions
    from moeray.cluster.placement import plan_from_reports
    from moeray.errors import MoerayError
    from moeray.stages.gguf.reader import read_gguf_header
    from moeray.stages.kernels.settings import StageOptions
    from test_gguf_file import tiny_config, write_synthetic_gguf
    from test_ray_units import _reports

    MiB = 1 << 20

    header = read_gguf_header(write_synthetic_gguf(tmp_path / "m.gguf", tiny_config("qwen3moe"), seed=1))  # heads of 24
    opts = LaunchOptions(2, stage=StageOptions(cache_type_k="q4_0", cache_type_v="f16"))
    with pytest.raises(MoerayError) as exc:
        plan_from_reports(header, _reports([64 * MiB] * 2), opts, EngineConfig(max_len=64), 0.2)
    assert str(exc.value).startswith("--cache-type-k q4_0 --cache-type-v f16: q4_0 stores a row in blocks of 32 "
                                     "values and this model's K rows are 24 values wide; choose f16 or f32 for K")
    auto = LaunchOptions(2, stage=StageOptions())  # auto never picks what the model cannot keep
    _, _, _, kv = plan_from_reports(header, _reports([64 * MiB] * 2), auto, EngineConfig(max_len=64), 0.2)
    assert all(t.k in ("f32", "f16") for t in kv.types)
