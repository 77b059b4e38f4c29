"""Planning a hybrid (Gated DeltaNet) model: its DeltaNet projections are trunk pieces offered per
layer with their bytes, its per-sequence state is charged to each layer's card like KV, and a
48-layer x 512-expert Qwen3-Next-shaped spec plans four cards in well under a second."""
import json
import re
import time

import pytest

from moeray.cluster.cli import main
from moeray.errors import PlacementError
from moeray.planner.shapes import SHAPES, hybrid_spec
from moeray.planner.spec import ModelSpec

SPLIT_LINE = re.compile(r"^layer split auto: K=\d+,\d+,\d+ - predicted \d+\.\d ms per decode step; the caches hold "
                        r"\d+ of 24576 profiled pairs \(~\d+\.\d% of the routed mass\), best of 16215 placements$")


@pytest.fixture
def spec_path(tmp_path):
    path = tmp_path / "qwen3next.json"
    path.write_text(json.dumps(hybrid_spec(SHAPES["qwen3next-80b-a3b"], "IQ3_S").to_dict()))
    return path


def test_qwen3next_shape_sizes():
    spec = hybrid_spec(SHAPES["qwen3next-80b-a3b"], "IQ3_S")
    assert (spec.n_layers, spec.n_experts, spec.n_experts_used) == (48, 512, 10)
    assert spec.expert_bytes[0] == 3 * 512 * 2048 * 110 // 256  # three IQ3_S matrices
    pieces = spec.trunk_bytes.pieces
    recurrent = [l for l in range(48) if "dnproj" in pieces[l]]
    assert recurrent == [l for l in range(48) if (l + 1) % 4]  # three of every four layers
    # dnproj: qkv (8192) ++ z (4096) ++ beta/alpha (64) rows of 2048, and the 2048 x 4096 output, Q8_0
    assert pieces[0]["dnproj"] == (2048 * (8192 + 4096 + 64) + 4096 * 2048) * 272 // 256
    # one sequence's state: conv 8192 x 3 + 32 heads of 128 x 128, float32, in DeltaNet layers only
    assert spec.state_bytes[0] == 4 * (8192 * 3 + 32 * 128 * 128) and spec.state_bytes[3] == 0
    again = ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again.trunk_bytes.pieces == pieces and again.state_bytes == spec.state_bytes
    with pytest.raises(PlacementError, match="pieces"):
        ModelSpec.from_dict({**spec.to_dict(), "trunk_bytes": {**spec.to_dict()["trunk_bytes"],
                                                               "layers": [1] * 48}})


def test_state_is_charged_per_sequence_like_kv():
    spec = hybrid_spec(SHAPES["qwen3next-80b-a3b"], "IQ3_S")
    four = spec.with_state_for(4)
    assert [b - a for a, b in zip(spec.trunk_bytes.layers, four.trunk_bytes.layers)] == [4 * s for s in spec.state_bytes]
    assert four.trunk_bytes.pieces[0]["state"] == 4 * spec.state_bytes[0] and "state" not in four.trunk_bytes.pieces[3]


def test_plan_four_cards_under_a_second(spec_path, capsys):
    """One placement search (no state checkpoints to trade: their trade runs two or three more)."""
    t0 = time.perf_counter()
    rc = main(["plan", "--spec", str(spec_path), "--devices", "10GiB,10GiB,6GiB,6GiB", "--max-seqs", "8",
               "--verbose", "--state-checkpoints", "0"])
    elapsed = time.perf_counter() - t0
    assert rc == 0 and elapsed < 1.0, elapsed
    lines = capsys.readouterr().out.splitlines()
    assert SPLIT_LINE.match(lines[0]), lines[0]
    assert any(re.search(r"\[place\] stage \d: layer 0 trunk \[dnproj 34\.13 MiB \+ .* state 16\.75 MiB\]", l)
               for l in lines)
    state = next(l for l in lines if l.startswith("[state]"))
    assert "36 recurrent layers hold 75.38 MiB of state per sequence; 8 sequence(s)" in state


def test_more_sequences_leave_less_room_for_experts(spec_path, capsys):
    held = []
    for n in (1, 64):
        main(["plan", "--spec", str(spec_path), "--devices", "10GiB,10GiB,6GiB,6GiB", "--max-seqs", str(n),
              "--json", "-"])
        held.append(json.loads(capsys.readouterr().out)["held_pairs"])
    assert held[1] < held[0]  # 64 sequences' state (4.7 GiB) pushes experts out


def test_plan_of_a_hybrid_gguf_offers_dnproj_and_charges_state(tmp_path, capsys):
    """From a GGUF header: the DeltaNet layers' projections as their own piece, the state line."""
    from moeray.stages.gguf.writer import write_gguf
    from tiny_hybrid import tiny_qwen3next

    path = write_gguf(tiny_qwen3next(), tmp_path / "q3n.gguf", "Q8_0")
    assert main(["plan", str(path), "--devices", "2MB,2MB", "--max-seqs", "4", "--verbose"]) == 0
    out = capsys.readouterr().out
    layer0 = next(l for l in out.splitlines() if "layer 0 trunk" in l)
    assert "dnproj" in layer0 and "state" in layer0 and "attn " not in layer0
    layer3 = next(l for l in out.splitlines() if "layer 3 trunk" in l)
    assert "attn" in layer3 and "dnproj" not in layer3 and "state" not in layer3
    # conv 256 x 3 + 4 heads of 32 x 32, float32, in each of layers 0-2
    assert "[state] 3 recurrent layers hold 57.00 KiB of state per sequence; 4 sequence(s)" in out


CHECKPOINTS = re.compile(r"^\[state\] (\d+) checkpoint\(s\) of the recurrent state, 75\.38 MiB each")


def _plan(spec_path, capsys, devices, *extra):
    assert main(["plan", "--spec", str(spec_path), "--devices", devices, "--max-seqs", "8", *extra]) == 0
    lines = capsys.readouterr().out.splitlines()
    line = next(l for l in lines if CHECKPOINTS.match(l))
    ms = float(re.search(r"predicted (\d+\.\d) ms", lines[0]).group(1))
    return int(CHECKPOINTS.match(line).group(1)), ms, line


def test_state_checkpoints_are_priced_against_the_experts(spec_path, capsys):
    """Checkpoints of the recurrent state (prefix reuse on hybrid models) take the room of experts:
    roomy cards hold two per sequence (16 for --max-seqs 8) at the first try; the 10+10+6+6 GiB
    rig holds as many as keep the predicted step within 2% of none, found in at most three
    searches; a count given is charged as given, and costs experts."""
    n, _, line = _plan(spec_path, capsys, "40GiB,40GiB,40GiB,40GiB")
    assert n == 16 and "host memory" not in line and line.endswith("tried 16: " + line.split("tried 16: ")[1]) and line.count(" ms") == 1
    none_n, none_ms, _ = _plan(spec_path, capsys, "10GiB,10GiB,6GiB,6GiB", "--state-checkpoints", "0")
    n, ms, line = _plan(spec_path, capsys, "10GiB,10GiB,6GiB,6GiB")
    assert none_n == 0 and 1 <= n < 16 and none_ms <= ms <= 1.02 * none_ms + 0.1
    assert 2 <= line.split("tried ")[1].count(" ms") <= 3, line
    assert "at launch the rest in the nodes' host memory" in line  # only the stages can measure it
    given, ms5, _ = _plan(spec_path, capsys, "10GiB,10GiB,6GiB,6GiB", "--state-checkpoints", "12")
    assert given == 12 and ms5 > ms


def test_trade_checkpoints_rule():
    """The rule alone: all wanted when they cost little; else what their cost per checkpoint affords,
    stepped down until it fits; none when not even one fits or keeps within the tolerance."""
    from moeray.planner.kv import trade_checkpoints

    class Plan:
        def __init__(self, ms):
            self.predicted_ms = ms

    def costs(per, fits=10**9):
        def plan_for(n):
            if n > fits:
                raise PlacementError("no room")
            return Plan(100.0 + per * n)
        return plan_for

    assert trade_checkpoints(costs(0.01), 100.0, 16)[0] == 16
    n, plan, tried = trade_checkpoints(costs(0.5), 100.0, 16)
    assert n == 4 and plan.predicted_ms == 102.0 and len(tried) == 2
    assert trade_checkpoints(costs(0.01, fits=5), 100.0, 16)[0] == 5
    assert trade_checkpoints(costs(3.0), 100.0, 16)[0] == 0
