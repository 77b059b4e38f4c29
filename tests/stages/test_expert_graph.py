"""The routed experts of a layer as one ggml graph (mul_mat_id over the stacked experts): the
torch backend's math, one call per layer whatever the batch, hits read from the slot buffer by
index, and the same bits whichever stack served a pick."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from moeray.stages.blocks import expert_graph
from moeray.stages.kernels import graphs
from moeray.stages.blocks.expert_graph import Part, Stack
from moeray.stages.kernels.qmatmul import GLU
from moeray.stages.gguf.reader import GGUFFile
from moeray.stages.runtime.model import load_cached
from moeray.stages.blocks.moe import HostExperts
from moeray.stages.kernels.backend import ggml_available

pytestmark = pytest.mark.skipif(not ggml_available(), reason="ggml-python is not installed")


@pytest.fixture(scope="module")
def gguf(default_model_path):
    return GGUFFile(default_model_path)


def routed(n: int, n_experts: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=g)
    return ids, w / w.sum(1, keepdim=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("n", [1, 7])
def test_the_graph_computes_the_torch_routes_experts(gguf, n):
    """ggml (8-bit activations, as llama.cpp) against the dequantised float32 math of the torch backend."""
    cfg = gguf.config
    x = torch.randn(n, cfg.hidden, generator=torch.Generator().manual_seed(n))
    ids, w = routed(n, cfg.n_experts, cfg.n_experts_used, seed=n)
    fused = HostExperts(gguf, "ggml")
    assert fused.stack(3) is not None
    ref = HostExperts(gguf, "dequant").forward(3, x, ids, w)
    out = fused.forward(3, x, ids, w)
    assert rel_err(out, ref) < 1.5e-2
    assert fused.computed == len(torch.unique(ids))  # every expert the step used, once


def test_one_graph_call_per_layer_whatever_the_batch(gguf, monkeypatch):
    calls = []
    real = graphs._Graph.__call__

    def counting(self, pointers, out_ptr):
        calls.append(self)
        return real(self, pointers, out_ptr)

    monkeypatch.setattr(graphs._Graph, "__call__", counting)
    host = HostExperts(gguf, "ggml")
    for n in (1, 16):
        calls.clear()
        x = torch.randn(n, gguf.config.hidden)
        ids, w = routed(n, gguf.config.n_experts, 2, seed=0)
        host.forward(0, x, ids, w)
        assert len(calls) == 1, n  # the old path made one per used expert (up to 8 here)


def test_hits_come_from_the_slot_buffer_and_a_split_step_gives_the_same_bits(gguf, monkeypatch):
    """Some of a step's picks in slots, the rest from the mapping: two graph calls, and every
    token's output equal, bit for bit, to the all-mapping call (the sum runs in one order)."""
    cfg = gguf.config
    model, cache = load_cached(gguf, (0, 2), n_slots=5, layout="global")
    assert cache.slot_store is not None and cache.slot_store.buffer.shape[0] == 5
    for pair in cache.core.resident_pairs():  # the default profile's fill: replaced by known pairs
        cache.core.evict(*pair)
    for e in (0, 3, 5):
        cache.core.admit(1, e)
    # The slot row holds exactly the expert's GGUF bytes.
    slot = cache.core.lookup(1, 3)
    raw = np.concatenate([gguf.expert_raw(1, kind, 3) for kind in ("gate", "up", "down")])
    assert torch.equal(cache.slot_store.buffer[slot, :len(raw)], torch.from_numpy(raw))
    assert cache.resident_bytes() == 3 * gguf.expert_bytes(1) == cache.budget.used

    n = 12
    x = torch.randn(n, cfg.hidden, generator=torch.Generator().manual_seed(5))
    ids, w = routed(n, cfg.n_experts, 2, seed=5)
    ref = HostExperts(gguf, "ggml").forward(1, x, ids, w)
    calls = []
    real = expert_graph.run
    monkeypatch.setattr("moeray.stages.blocks.moe.run", lambda stack, *a: calls.append(stack) or real(stack, *a))
    out = cache.forward(1, x, ids, w)
    assert torch.equal(out, ref)
    assert [s.owner is cache.slot_store.buffer for s in calls] == [True, False]
    hits = int(np.isin(ids.numpy(), [0, 3, 5]).sum())
    assert cache.core.hits[1] == hits and cache.core.misses[1] == 2 * n - hits
    # Every pick a hit: one call, on the slots.
    calls.clear()
    ids_hit = torch.tensor([[0, 3], [5, 0]])
    out = cache.forward(1, x[:2], ids_hit, w[:2])
    assert len(calls) == 1 and calls[0].owner is cache.slot_store.buffer
    assert torch.equal(out, HostExperts(gguf, "ggml").forward(1, x[:2], ids_hit, w[:2]))


def test_a_torch_route_cache_keeps_one_object_per_slot(gguf):
    _, cache = load_cached(gguf, (0, 1), backend="dequant", n_slots=2, layout="global")
    assert cache.slot_store is None and len(cache._weights) == cache.core.n_resident == 2


def _q8_stack(rng, E: int, F: int, H: int, with_bias: bool):
    """A stack over Q8_0 blocks quantised from random float weights (and their float values)."""
    owner, parts, floats = [], [], []
    for rows, cols in ((F, H), (F, H), (H, F)):
        wf = (rng.standard_normal((E, rows, cols)) / np.sqrt(cols)).astype(np.float32)
        q = torch.from_numpy(quants.quantize(wf.reshape(E * rows, cols), T.Q8_0).reshape(-1).copy())
        owner.append(q)
        floats.append(torch.from_numpy(quants.dequantize(q.numpy(), T.Q8_0).reshape(E, rows, cols)))
        parts.append(Part(q.data_ptr(), T.Q8_0, rows, cols, q.numel() // E))
    biases = (None, None, None)
    if with_bias:
        biases = tuple(torch.from_numpy(rng.standard_normal((E, r)).astype(np.float32) * 0.5) for r in (F, F, H))
    return Stack(tuple(parts), E, owner, biases), floats, biases


@pytest.mark.parametrize("act", ["silu", "swiglu_oai"])
def test_activations_and_expert_biases_match_their_formulas(act):
    """COORD item 2: silu(g)*u, or gpt-oss's clamped (u+1)*g*sigmoid(alpha*g), with per-expert biases
    on gate, up and down (ggml's add_id), against the formulas in float32."""
    rng = np.random.default_rng(0)
    E, F, H, n, k = 4, 64, 96, 5, 2
    stack, (wg, wu, wd), (bg, bu, bd) = _q8_stack(rng, E, F, H, with_bias=act == "swiglu_oai")
    math = GLU(act, alpha=1.702, limit=0.5)  # a small limit, so the clamps really bite
    x = torch.from_numpy(rng.standard_normal((n, H)).astype(np.float32)) * 3
    ids, w = routed(n, E, k, seed=1)
    ref = torch.zeros(n, H)
    for t in range(n):
        for r in range(k):
            e = int(ids[t, r])
            g, u = wg[e] @ x[t], wu[e] @ x[t]
            if bg is not None:
                g, u = g + bg[e], u + bu[e]
            if act == "silu":
                h = torch.nn.functional.silu(g) * u
            else:
                g, u = g.clamp(max=math.limit), u.clamp(-math.limit, math.limit)
                h = (u + 1) * g * torch.sigmoid(math.alpha * g)
            y = wd[e] @ h + (bd[e] if bd is not None else 0)
            ref[t] += w[t, r] * y
    out = expert_graph.run(stack, math, x, ids, w)
    assert rel_err(out, ref) < 2e-2


def test_a_tokens_experts_do_not_depend_on_its_batch(gguf):
    """Built without llamafile's sgemm, mul_mat_id runs the same dot products at every batch:
    a token's expert output is the same bits alone or among others."""
    cfg = gguf.config
    host = HostExperts(gguf, "ggml")
    x = torch.randn(9, cfg.hidden, generator=torch.Generator().manual_seed(2))
    ids, w = routed(9, cfg.n_experts, cfg.n_experts_used, seed=2)
    batch = host.forward(4, x, ids, w)
    assert torch.equal(batch, torch.cat([host.forward(4, x[i:i + 1], ids[i:i + 1], w[i:i + 1]) for i in range(9)]))


def test_a_layer_without_experts_has_no_stack_and_no_slots(smollm2_dense_path):
    """COORD item 3: a dense FFN layer (here every layer of the dense SmolLM2) gets no stacked
    experts and a slot store covers only layers that have experts."""
    from moeray.cache.slot_store import SlotStore

    host = HostExperts(GGUFFile(smollm2_dense_path), "ggml")
    assert host.stack(0) is None
    assert SlotStore.for_host(host, 0, 2, 4, [1, 1], torch.device("cpu")) is None
