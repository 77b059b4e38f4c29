"""`moeray plan` end to end: from a --spec JSON and from a (header-only) GGUF, torch never imported."""
import json
import subprocess
import sys

import numpy as np
import pytest

from moeray.cluster.cli import main
from moeray.planner.profile import Profile

GIB = 1 << 30


def write_spec(path, L=8, E=16, k=2, blob=1_000_000, trunk=500_000):
    spec = {"n_layers": L, "n_experts": E, "n_experts_used": k, "expert_bytes": [blob] * L,
            "trunk_bytes": {"embedding": 4 * trunk, "head": 4 * trunk, "layers": [trunk] * L}}
    path.write_text(json.dumps(spec))
    return spec


def test_plan_from_spec_writes_json(tmp_path, capsys):
    write_spec(tmp_path / "m.json")
    Profile.from_counts(np.random.default_rng(0).integers(0, 100, (8, 16))).save(tmp_path / "p.msgpack")
    rc = main(["plan", "--spec", str(tmp_path / "m.json"), "--devices", "60MB:0.5:0.2,30MB:1:0.2", "--verbose",
               "--profile", str(tmp_path / "p.msgpack"), "--json", str(tmp_path / "plan.json"), "--mass", "counts"])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.startswith("layer split auto: K=") and "best of 7 placements" in out.splitlines()[0]
    assert "[place] stage 0:" in out and "[slots] stage" in out
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["placements_scored"] == 7 and len(doc["split"]) == 2
    assert doc["split"][0][0] == 0 and doc["split"][-1][1] == 8 and doc["split"][0][1] == doc["split"][1][0]
    for s in doc["stages"]:
        assert {"held_pairs", "held_mass", "routed_mass", "trunk_decisions", "slots_per_layer"} <= set(s)
        assert s["trunk_bytes"] + s["held_bytes"] <= s["free_bytes"]
    assert doc["predicted_ms"] > 0 and doc["mass"] == "counts"


def test_plan_devices_json_split_and_throughput(tmp_path, capsys):
    write_spec(tmp_path / "m.json")
    (tmp_path / "d.json").write_text(json.dumps([
        {"name": "a", "free_bytes": 50_000_000, "layer_ms": 0.5, "miss_ms": 0.3},
        {"name": "b", "free_bytes": 20_000_000, "layer_ms": 0.9, "miss_ms": 0.3},
        {"name": "c", "free_bytes": 20_000_000, "layer_ms": 0.9, "miss_ms": 0.3}]))
    assert main(["plan", "--spec", str(tmp_path / "m.json"), "--devices-json", str(tmp_path / "d.json"),
                 "--split", "K=3,6", "--json", "-"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["split"] == [[0, 3], [3, 6], [6, 8]]
    assert cap.err.startswith("layer split as given: K=3,6")
    assert main(["plan", "--spec", str(tmp_path / "m.json"), "--devices-json", str(tmp_path / "d.json"),
                 "--stages-objective", "throughput", "--trunk", "off", "--plot", str(tmp_path / "p.png")]) == 0
    assert "(throughput)" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_plan_errors_are_one_clean_line(tmp_path, capsys):
    write_spec(tmp_path / "m.json")
    (tmp_path / "bad.prof").write_bytes(b"STRP\x01")
    assert main(["plan", "--spec", str(tmp_path / "m.json"), "--devices", "1GiB",
                 "--profile", str(tmp_path / "bad.prof")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moeray plan: error:") and "bad.prof" in err and "\n" not in err
    assert main(["plan", "--spec", str(tmp_path / "m.json"), "--devices", "12 parsecs"]) == 2
    assert "size" in capsys.readouterr().err
    Profile.uniform(9, 16).save(tmp_path / "other.msgpack")
    assert main(["plan", "--spec", str(tmp_path / "m.json"), "--devices", "1GiB",
                 "--profile", str(tmp_path / "other.msgpack")]) == 2
    assert "9 layers but the model has 8" in capsys.readouterr().err


def tiny_moe_gguf(path, L=3, E=4, k=2, H=64, F=32, V=128):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(L)
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_context_length(256)
    w.add_expert_count(E)
    w.add_expert_used_count(k)
    w.add_layer_norm_rms_eps(1e-5)
    f32 = np.float32
    w.add_tensor("token_embd.weight", np.zeros((V, H), f32))
    w.add_tensor("output_norm.weight", np.ones(H, f32))
    w.add_tensor("output.weight", np.zeros((V, H), f32))
    for i in range(L):
        for n in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{n}.weight", np.zeros((H, H), f32))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(H, f32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(H, f32))
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", np.zeros((E, H), f32))
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.zeros((E, F, H), f32))
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.zeros((E, F, H), f32))
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", np.zeros((E, H, F), f32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_plan_from_a_header_only_gguf_without_torch(tmp_path):
    from moeray.stages.gguf.reader import write_header_only

    tiny_moe_gguf(tmp_path / "m.gguf")
    write_header_only(tmp_path / "m.gguf", tmp_path / "head.gguf")
    assert (tmp_path / "head.gguf").stat().st_size < (tmp_path / "m.gguf").stat().st_size
    code = ("import sys, json; from moeray.cluster.cli import main; "
            f"rc = main(['plan', {str(tmp_path / 'head.gguf')!r}, '--devices', '60KiB,40KiB', '--json', "
            f"{str(tmp_path / 'plan.json')!r}]); "
            "assert 'torch' not in sys.modules and 'ray' not in sys.modules, 'heavy import'; sys.exit(rc)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert len(doc["split"]) == 2 and doc["n_pairs"] == 12
    one_expert = 3 * 32 * 64 * 4  # gate + up + down rows of one expert, F32
    held = sum(s["held_bytes"] for s in doc["stages"])
    assert held % one_expert == 0 and held // one_expert == doc["held_pairs"]


def test_plan_of_the_default_model_uses_its_recorded_profile_without_torch(default_model_path):
    """`moeray plan` on the embedded model prices with its recorded profile (counts, fitted b) and
    stays torch-free once the profile exists; any other model without --profile gets the uniform share."""
    from moeray.stages.runtime.default_profile import default_profile_for

    profile = default_profile_for(default_model_path, quiet=True)  # recorded here if it is missing
    code = ("import sys; from moeray.cluster.cli import main; "
            f"rc = main(['plan', {str(default_model_path)!r}, '--devices', '60MiB,60MiB,60MiB,60MiB']); "
            "assert 'torch' not in sys.modules, 'heavy import'; sys.exit(rc)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    picks = sum(Profile.load(profile).counts)
    assert str(profile) in res.stderr
    assert res.stdout.splitlines()[-1].startswith(f"mass: the profile's measured counts ({picks} routed picks); "
                                                  "mass curve: b=")
    assert res.stdout.splitlines()[-1].endswith(f"fitted from {picks} routed picks")
    assert "predicted hit rate" in res.stdout


def test_plan_without_a_profile_predicts_the_uniform_share(tmp_path, capsys):
    write_spec(tmp_path / "m.json")
    assert main(["plan", "--spec", str(tmp_path / "m.json"), "--devices", "60MB,30MB", "--json", "-"]) == 0
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert doc["mass_b_source"] == "uniform" and "b=1 (no profile" in out.err
    for s in doc["stages"]:
        n_pairs = (s["layers"][1] - s["layers"][0]) * 16
        assert s["held_mass"] / s["routed_mass"] == pytest.approx(s["held_pairs"] / n_pairs)
        assert s["predicted_hit_rate"] == pytest.approx(s["slot_pairs"] / n_pairs)


def test_cover_b_is_a_flag_and_its_override_is_named(tmp_path, capsys, monkeypatch):
    """b of the mass curve reaches the planner as a parameter (--cover-b); MOERAY_SPLIT_COVER_B, the
    debugging override, is folded in by the command, which names it, and wins over the flag."""
    write_spec(tmp_path / "m.json")
    args = ["plan", "--spec", str(tmp_path / "m.json"), "--devices", "60MB,30MB", "--json", "-"]
    monkeypatch.delenv("MOERAY_SPLIT_COVER_B", raising=False)
    assert main(args + ["--cover-b", "2.5"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["mass_b_source"] == "given" and "mass curve: b=2.5 as given" in out.err
    monkeypatch.setenv("MOERAY_SPLIT_COVER_B", "4")
    assert main(args + ["--cover-b", "2.5"]) == 0
    out = capsys.readouterr()
    assert "mass curve: b=4 as given" in out.err
    assert "debugging override MOERAY_SPLIT_COVER_B=4 -> launch.cover_b = 4.0 (default 2.5)" in out.err


def test_the_plan_reads_at_a_glance_and_verbose_keeps_every_decision(tmp_path, capsys):
    """One line per stage and one per departure from the default (runs of layers merged);
    --verbose prints every trunk decision and slot layout as before."""
    L = 12
    (tmp_path / "m.json").write_text(json.dumps({
        "n_layers": L, "n_experts": 3, "n_experts_used": 2, "expert_bytes": [1_000_000] * L,
        "trunk_bytes": {"embedding": 2_000_000, "head": 2_000_000, "layers": [500_000] * L}}))
    args = ["plan", "--spec", str(tmp_path / "m.json"), "--devices", "12MB,12MB,8MB", "--cpu-factor", "2",
            "--split", "K=4,8"]
    assert main(args) == 0
    short = capsys.readouterr().out.splitlines()
    stage_lines = [ln for ln in short if ln.startswith("stage ")]
    assert [ln.split()[:5] for ln in stage_lines] == [["stage", "0", "dev0", "layers", "0-3"],
                                                     ["stage", "1", "dev1", "layers", "4-7"],
                                                     ["stage", "2", "dev2", "layers", "8-11"]]
    for ln in stage_lines:  # device, layers, trunk, slots, predicted hit rate, predicted ms
        assert "trunk " in ln and " slots (" in ln and "predicted hit rate" in ln and ln.endswith(" ms")
    # every layer trunk is worth less than the experts it would push out (2*p = 1.33 >= 1): off the
    # card, one line per stage's run of layers, plus the head and the embedding
    place = [ln for ln in short if ln.startswith("[place]")]
    assert len(place) == 5
    assert "[place] stage 1: layers 4-7 trunks (1.91 MiB) -> cpu: layer 4: the experts it would push out" in place[2]
    assert any(ln.startswith("[place] stage 2: lm_head (1.91 MiB) -> cpu:") for ln in place)
    assert len(short) == 1 + 3 + 5 + 1  # the split, the stages, the departures, the mass line
    assert main(args + ["--verbose"]) == 0
    verbose = capsys.readouterr().out.splitlines()
    assert sum(ln.startswith("[place] stage 1: layer ") for ln in verbose) == 4
    assert sum(ln.startswith("[slots] stage") for ln in verbose) == 3
    assert verbose[0] == short[0] and verbose[-1] == short[-1]


def test_plan_with_no_model_plans_the_default_model(default_model_path):
    """`moeray plan --devices ...` with no MODEL is the embedded default model, as for every other
    command: the same plan as naming its file, short (a stage a line), and still torch-free."""
    from moeray.stages.runtime.default_profile import default_profile_for

    default_profile_for(default_model_path, quiet=True)  # recorded here if it is missing
    devices = ["--devices", "60MiB,60MiB,60MiB,60MiB"]
    code = ("import sys; from moeray.cluster.cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'heavy import'; sys.exit(rc)")
    bare = subprocess.run([sys.executable, "-c", code, "plan", *devices], capture_output=True, text=True, timeout=120)
    assert bare.returncode == 0, bare.stderr
    named = subprocess.run([sys.executable, "-c", code, "plan", str(default_model_path), *devices],
                           capture_output=True, text=True, timeout=120)
    assert named.returncode == 0, named.stderr
    assert bare.stdout == named.stdout
    lines = bare.stdout.splitlines()
    assert lines[0].startswith("layer split auto: K=")
    assert sum(ln.startswith("stage ") for ln in lines) == 4
    assert len(lines) <= 10  # 30 layers, 4 stages: no per-layer lines
    assert str(default_model_path) in bare.stderr  # it says which model it planned
