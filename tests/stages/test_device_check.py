"""The CUDA path: the CUDA-specific rules that the CPU can check (device-preserving dequantisation,
bounded scratch, card shares, link backends), and tests marked `cuda` that run on a GPU and skip,
saying why, everywhere else. bench/device_check.py end to end on the CPU (its dry run):
tests/e2e/test_device_check_script.py."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from moeray.errors import MoerayError, PlacementError
from quant_blocks import random_blocks

ROOT = Path(__file__).resolve().parents[2]
FAST_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4, T.IQ4_NL, T.IQ4_XS, T.IQ3_XXS, T.IQ3_S,
              T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_S, T.IQ1_M)
NO_CUDA = "no CUDA device here (torch.cuda.is_available() is False): run on a GPU machine with torch's CUDA build"


def _blocks(qtype: T, n_blocks: int, seed: int = 0) -> torch.Tensor:
    """Random blocks with sane float16 scales (random bytes there could be inf or NaN)."""
    return torch.from_numpy(random_blocks(qtype, n_blocks, np.random.default_rng(seed), scale=0.01).reshape(-1))


# ---------------------------------------------------------------- CUDA rules the CPU can check


@pytest.mark.parametrize("qtype", FAST_TYPES, ids=lambda t: t.name)
def test_dequantize_builds_on_the_input_device(qtype):
    """Every buffer of the fast paths is made on the input's device: run on `meta` (no data), any
    buffer made on the CPU by default would raise, as it would on CUDA."""
    from moeray.stages.gguf.quant import dequantize

    block, size = GGML_QUANT_SIZES[qtype]
    out = dequantize(torch.empty(3 * size, dtype=torch.uint8, device="meta"), qtype, (3, block))
    assert out.device.type == "meta" and out.shape == (3, block) and out.dtype == torch.float32


@pytest.mark.parametrize("qtype", (T.Q8_0, T.Q4_1, T.Q6_K), ids=lambda t: t.name)
def test_dequant_matmul_in_row_blocks_equals_the_whole(qtype):
    """A card expands a big weight a block of rows at a time (bounded scratch): same product."""
    from moeray.stages.kernels.qmatmul import QMatrix, _dequant_linear, row_bytes

    block, _ = GGML_QUANT_SIZES[qtype]
    N, K = 40, 2 * block
    raw = _blocks(qtype, N * row_bytes(qtype, K) // GGML_QUANT_SIZES[qtype][1])
    w = QMatrix(raw, qtype, (N, K), "dequant")
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(1))
    whole = _dequant_linear(w, x, None)
    rows7 = _dequant_linear(w, x, 7 * 4 * K)  # 7 rows at a time: the last block is short
    tol = 1e-5 * whole.abs().max()  # float32 sums in another order (BLAS blocks 7 rows otherwise)
    assert torch.allclose(rows7, whole, rtol=1e-5, atol=tol)
    assert torch.allclose(whole, x @ w.dequantize().T, rtol=1e-5, atol=tol)


def test_gpu_share_packs_stages_onto_cards():
    from moeray.cluster.placement import gpu_share

    assert gpu_share(2, 2) == 1.0 and gpu_share(1, 1) == 1.0  # a card each while they last
    assert gpu_share(2, 1) == 0.5 and gpu_share(4, 2) == 0.5 and gpu_share(8, 3) == 0.3333
    assert gpu_share(3, 1) * 3 <= 1.0  # Ray must fit k shares on one card
    assert gpu_share(4, 4, gpus_per_stage=0.25) == 0.25  # as given
    with pytest.raises(MoerayError, match="0 < x <= 1"):
        gpu_share(2, 1, gpus_per_stage=1.5)
    with pytest.raises(PlacementError, match="no GPUs"):
        gpu_share(2, 0)


def test_gpus_per_stage_is_checked_before_anything_starts():
    from moeray.cluster.config import LaunchOptions

    assert LaunchOptions(2, gpus_per_stage=0.5).gpus_per_stage == 0.5
    for bad in (0.0, -1.0, 2.0):
        with pytest.raises(MoerayError, match="--gpus-per-stage"):
            LaunchOptions(2, gpus_per_stage=bad)


def test_a_stage_sharing_a_card_is_planned_with_its_share():
    from moeray.stages.runtime.device import CUDA_RESERVE_BYTES, DeviceInfo, share_of_card

    GiB = 1 << 30
    card = DeviceInfo("cuda", "NVIDIA H200", 140 * GiB, 120 * GiB, "cuda:0", "00000000:65:00.0", "nvml",
                      CUDA_RESERVE_BYTES)
    assert share_of_card(card, 1.0) is card
    half = share_of_card(card, 0.5)
    assert (half.total_bytes, half.free_bytes, half.card_share) == (70 * GiB, 60 * GiB, 0.5)
    assert half.reserve_bytes == CUDA_RESERVE_BYTES  # every process keeps its own context's reserve
    assert half.pci_bus_id == card.pci_bus_id and card.free_bytes == 120 * GiB  # the card itself untouched
    # two halves never promise more than the card has free
    assert 2 * share_of_card(card, 0.5).free_bytes <= card.free_bytes
    tiny = share_of_card(card, 1e-4)
    assert tiny.reserve_bytes == tiny.free_bytes  # a share smaller than the reserve: no room, not negative


def test_cuda_stage_threads_split_the_node_cores():
    """Ray starts an actor that reserves no CPU on 1 thread; a CUDA stage's misses need more."""
    from moeray.stages.runtime.device import stage_threads

    assert stage_threads(16, 1, 1.0, 1) == 16  # one card, one stage: every core for its misses
    assert stage_threads(16, 1, 0.5, 2) == 8  # two stages share the card and the node
    assert stage_threads(64, 8, 1.0, 8) == 8 and stage_threads(64, 8, 1.0, 2) == 32
    assert stage_threads(16, 1, 0.004, 1) == 16  # a small share caps memory; it is still one stage
    assert stage_threads(4, 8, 0.25, 32) == 1  # never 0


def test_link_backend_nccl_only_between_distinct_cards():
    from moeray.stages.runtime.transport import link_backend

    a, b = ("cuda", "node1", "00000000:65:00.0"), ("cuda", "node1", "00000000:66:00.0")
    assert link_backend([a, b]) == "nccl"
    assert link_backend([a, ("cuda", "node2", a[2])]) == "nccl"  # same bus id on another node: another card
    assert link_backend([a, a]) == "gloo"  # NCCL refuses two ranks on one device
    assert link_backend([("simulated", "node1", ""), ("simulated", "node1", "")]) == "gloo"
    assert link_backend([]) == "gloo"


# ---------------------------------------------------------------- on a GPU


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("qtype", FAST_TYPES, ids=lambda t: t.name)
def test_cuda_dequantize_equals_cpu(qtype):
    from moeray.stages.gguf.quant import dequantize

    block, _ = GGML_QUANT_SIZES[qtype]
    raw = _blocks(qtype, 64)
    want = dequantize(raw, qtype, (64, block))
    got = dequantize(raw.cuda(), qtype, (64, block))
    assert got.device.type == "cuda" and torch.equal(got.cpu(), want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_probe_reads_nvml_by_bus_id():
    from moeray.stages.runtime.device import cuda_views, probe_cuda

    info, views = probe_cuda(0), cuda_views(0)
    assert info.memory_source == "nvml", info.memory_source
    assert views["nvml"]["total_bytes"] == info.total_bytes  # the stage planned with NVML's count
    # NVML counts the whole frame buffer, CUDA what it can hand out: the same card within a few percent
    assert abs(views["nvml"]["total_bytes"] - views["torch"]["total_bytes"]) <= 0.05 * info.total_bytes
    assert views["nvml"]["name"] == views["torch"]["name"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_stage_logits_equal_cpu_with_half_the_experts_on_the_card(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    from device_check import device_logits, write_synthetic

    from moeray.stages.gguf.reader import GGUFFile
    from moeray.stages.kernels.backend import current_backend, set_backend

    path = str(write_synthetic(tmp_path / "moe.gguf", quick=True))
    tokens = list(range(2, 26))
    g = GGUFFile(path)
    every = sum(g.expert_bytes(l) for l in range(g.config.n_layers)) * g.config.n_experts
    backend = current_backend()
    try:  # device_logits sets this process's backend: the tests after this one keep theirs
        cpu = device_logits(path, tokens, "cpu", every, "dequant")
        gpu = device_logits(path, tokens, "cuda:0", every // 2, "dequant")
    finally:
        set_backend(backend)
    assert 0 < gpu["resident"] < gpu["n_experts_total"]
    scale = abs(cpu["logits"]).max()
    assert abs(gpu["logits"] - cpu["logits"]).max() <= 1e-3 * scale
    assert gpu["torch_peak_run_bytes"] <= 1.05 * (gpu["trunk_bytes"] + gpu["slots_bytes"]) + (64 << 20)
