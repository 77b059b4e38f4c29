"""A layer's trunk as one ggml graph (stages/runtime/trunk_graph.py) against the torch ops it replaces on
the ggml backend (stages/blocks/attention.py: the reference), on the default model and tiny random families.

Both sides quantise activations to 8 bits before each matmul, so a 1e-7 difference upstream (RoPE
in float32 vs float64, flash attention's online softmax vs SDPA) can move one rounding step and
grow through the layers: the bound is the ggml backend's own (1e-1 of the largest logit, as in
tests/stages/test_parity_transformers.py), checked where both sides routed every layer to the same
experts; measured here: 1e-2 to 3e-2 (the fused backend is as close to the exact backend as the torch
ggml backend: 3.0e-2 vs 3.3e-2 of the largest logit on the default model's 48-token prefill).
The default model's cases: tests/e2e/test_trunk_graph_default_model.py."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from moeray.stages.gguf.reader import GGUFFile
from moeray.stages.gguf.writer import write_gguf
from moeray.stages.blocks.kv_cache import BLOCK_SIZE
from moeray.stages.runtime.model import load_model
from moeray.stages.blocks.moe import HostExperts
from moeray.stages.kernels.backend import ggml_available
from tiny_models import tiny_deepseek2, tiny_deepseek3, tiny_glm4moe, tiny_qwen2moe, tiny_qwen3moe, token_ids

pytestmark = pytest.mark.skipif(not ggml_available(), reason="ggml-python is not installed")

RTOL = 1e-1  # of the largest |logit|: the ggml backend's tolerance


class Both:
    """One model run with its trunk graphs and without (the torch path), recording routing."""

    def __init__(self, path):
        self.routes = []
        host = HostExperts(GGUFFile(path), "ggml", on_route=lambda layer, ids, w: self.routes.append((layer, ids.sort(-1).values)))
        self.model = load_model(path, backend="ggml", experts=host)
        assert self.model.trunk is not None, "this model's layers should run as trunk graphs"
        self.graphs = self.model.trunk
        self.calls = 0
        for name in ("layer", "stage"):  # a layer's graph, or the stage's layers in one
            setattr(self.graphs, name, self._counted(getattr(self.graphs, name)))

    def _counted(self, call):
        def counted(*a, **kw):
            self.calls += 1
            return call(*a, **kw)
        return counted

    def run(self, fused: bool, fn):
        self.model.trunk = self.graphs if fused else None
        self.routes.clear()
        with torch.inference_mode():
            out = fn(self.model)
        by_layer: dict[int, list] = {}
        for layer, ids in self.routes:  # [layers, every position of every step, k]
            by_layer.setdefault(layer, []).append(ids)
        return out, torch.stack([torch.cat(v) for v in by_layer.values()]) if by_layer else None


def _close(both: Both, fn, what: str, routed_alike: bool = True, rtol: float = RTOL) -> None:
    """routed_alike: compare only positions both sides routed alike in every layer (random tiny
    routers: a flipped near-tie picks an unrelated expert). The default model's experts are
    upcycled near-copies, whose routing nearly ties everywhere (the torch ggml backend and the exact
    one route alike at ~1/3 of positions) while a flip barely moves the logits: all compared."""
    calls = both.calls
    got, r_got = both.run(True, fn)
    assert both.calls > calls  # the graphs really ran
    ref, r_ref = both.run(False, fn)
    same = torch.ones(got.shape[0], dtype=torch.bool)
    if routed_alike and r_ref is not None and r_ref.shape[1] == got.shape[0]:
        same = (r_got == r_ref).all(-1).all(0)
        assert same.float().mean() >= 0.75, f"{what}: routing differs at {int((~same).sum())} positions"
    err = (got - ref).abs().max(-1).values / ref.abs().max()
    assert err[same].max() <= rtol, f"{what}: {err[same].max():.2e} of max |logit|"


def _prefill_then_decode(ids, chunk: int):
    """Logits at every position: a prefill chunk, a second chunk, then one token per step."""
    def fn(model):
        kv = model.new_kv_cache(2, len(ids) + 8)
        cuts = [0, chunk, chunk + 5, *range(chunk + 6, len(ids) + 1)]
        out = []
        for a, b in zip(cuts, cuts[1:]):
            meta = model.batch_meta([b - a], [1], kv)
            out.append(model.head(model.run_layers(model.embed([ids[a:b]]), meta, kv)))
        return torch.cat(out)
    return fn


def test_gpt_oss_sixteen_sequences_past_the_window(tmp_path):
    """The same engine steps on gpt-oss: gathered keys, padded queries and the sliding-window
    masks (prompts of 19-23 tokens pass the window of 8) with sinks, in the graph as in torch."""
    from gpt_oss_model import write_gpt_oss

    _sixteen_sequences(Both(write_gpt_oss(tmp_path / "gpt-oss.gguf", "Q8_0")[0]))


def _sixteen_sequences(default: Both, rtol: float = RTOL) -> None:
    model = default.model
    prefix = token_ids(BLOCK_SIZE, seed=11)
    prompts = [token_ids(3 + i % 5, seed=20 + i) for i in range(16)]
    # 0..3 share block 0 (the prefix, written once) then own 3 blocks; 4..15 own 4 blocks each
    tables = [[0] + [1 + 3 * i + j for j in range(3)] if i < 4 else [100 + 4 * i + j for j in range(4)]
              for i in range(16)]

    def fn(m):
        kv = m.new_kv_pool(200)
        lens, out = [], []

        def run(n_new, starts, toks, idx):
            meta = m.table_meta(n_new, starts, [tables[i] for i in idx], kv)
            x = m.run_layers(m.embed(toks), meta, kv)
            return m.head(x[meta.last_index]), meta

        run([BLOCK_SIZE], [0], [prefix], [0])  # the shared block, written once
        for i in range(16):  # each prompt after the prefix (4..15 write their own prefix too)
            start = BLOCK_SIZE if i < 4 else 0
            toks = prompts[i] if i < 4 else prefix + prompts[i]
            logits, _ = run([len(toks)], [start], [toks], [i])
            out.append(logits)
            lens.append(start + len(toks))
        feed = token_ids(16 * 6, seed=9)  # the same inputs on both sides, not each side's own picks
        nxt = [[t] for t in feed[:16]]
        # a mixed step: sequence 0 adds two tokens while the others add one each
        mixed_new = [2] + [1] * 15
        if m.trunk is not None:  # its queries are padded to [16, 2] rows inside the graph
            assert m.trunk.step(m.table_meta(mixed_new, lens, tables, kv), kv).pad is not None
        for step in range(1, 5):
            logits, meta = run([1] * 16, lens, nxt, range(16))
            out.append(logits)
            lens = [n + 1 for n in lens]
            nxt = [[t] for t in feed[16 * step:16 * step + 16]]
        logits, _ = run(mixed_new, lens, [nxt[0] * 2] + nxt[1:], range(16))
        out.append(logits)
        lens = [n + k for n, k in zip(lens, mixed_new)]
        # the same padded shape [16, 2] with one more token: a graph of its own
        logits, _ = run([2, 2] + [1] * 14, lens, [nxt[0] * 2, nxt[1] * 2] + nxt[2:], range(16))
        out.append(logits)
        return torch.cat(out)

    _close(default, fn, "16 sequences", routed_alike=False, rtol=rtol)
    steps = [k[0] for k in list(default.graphs._graphs) + list(default.graphs._stages)]  # layer and stage graphs
    modes = {k[4] for k in steps}
    assert {"view", "gather"} <= modes, modes  # keys read as a view (one sequence) and gathered (16)
    assert any(k[3] for k in steps)  # and the mixed step ran padded


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("trunk")
    return {"qwen3moe": write_gguf(tiny_qwen3moe(), root / "qwen3moe.gguf", "Q8_0"),
            "qwen2moe": write_gguf(tiny_qwen2moe(), root / "qwen2moe.gguf", "Q8_0"),
            "glm4moe": write_gguf(tiny_glm4moe(), root / "glm4moe.gguf", "Q8_0"),
            "glm4moe-groups": write_gguf(tiny_glm4moe(groups=(4, 2)), root / "glm4moe-groups.gguf", "Q8_0"),
            # MLA: q through its LoRA, sigmoid + bias routing in 4 groups (V3); one attn_q, softmax (V2)
            "deepseek3": write_gguf(tiny_deepseek3(), root / "deepseek3.gguf", "Q8_0"),
            "deepseek2": write_gguf(tiny_deepseek2(), root / "deepseek2.gguf", "Q8_0"),
            **_float_heads(root)}


def _float_heads(root) -> dict:
    """DeepSeek files whose attn_k_b / attn_v_b stay float (the rest Q8_0): every other product is
    the same ggml op on both paths, so the graph and the torch path differ only where flash
    attention's and SDPA's last bits do (and a quantised product then rounds a step apart)."""
    from moeray.stages.gguf import writer as gguf_writer

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_writer, "_ALWAYS_F32", gguf_writer._ALWAYS_F32 + ("attn_k_b.weight", "attn_v_b.weight"))
        return {f"{n}-float-heads": write_gguf(make(), root / f"{n}-float-heads.gguf", "Q8_0")
                for n, make in (("deepseek3", tiny_deepseek3), ("deepseek2", tiny_deepseek2))}


# q/k norms, neox RoPE; qkv biases, a gated shared expert; a dense layer, sigmoid + bias routing, partial RoPE
@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe", "glm4moe"])
def test_tiny_families(tiny_files, name):
    both = Both(tiny_files[name])
    _close(both, lambda m: m.logits_all(token_ids(20)), f"{name} prefill")
    _close(both, _prefill_then_decode(token_ids(20), 9), f"{name} chunks + decode")


def test_gpt_oss_runs_in_the_stage_graph(tmp_path):
    """gpt-oss: attention sinks (flash_attn_ext's sinks), sliding windows of 8 on layers 0 and 2
    (their own mask; 20 tokens cross it), YaRN (ggml_rope_ext with the torch path's frequencies as
    freq_factors), top-k-then-softmax routing with the router's bias, swiglu_oai experts with
    biases (MXFP4): against torch's ops within the backend's bound (measured: 1e-5 of the residual
    stream, equal logits), one stage graph a step."""
    from gpt_oss_model import write_gpt_oss

    path, _ = write_gpt_oss(tmp_path / "gpt-oss.gguf", "Q8_0")
    both = Both(path)
    assert [l.attn.window for l in both.model.layers] == [8, 0, 8] and both.model.layers[0].attn.sinks is not None
    _close(both, lambda m: m.logits_all(token_ids(20)), "gpt-oss prefill")
    calls = both.calls
    _close(both, _prefill_then_decode(token_ids(20), 9), "gpt-oss chunks + decode")
    assert both.calls - calls == 2 + 20 - 9 - 5  # one stage graph a step


def test_repacked_q4k_weights(tmp_path):
    """Q4_K trunk matrices in ggml's repacked layout (the 30B shape's kind): the graph multiplies
    them through graphs.graph_mul_mat, as the torch path's matmuls do."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from shapes import Shape, write_shape

    s = Shape("qwen3moe", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=4, used=2,
              expert_ff=256, vocab=4096)
    both = Both(write_shape("tiny", shape=s, path=tmp_path / "tiny.gguf", pool_blocks=1024))
    from moeray.stages.kernels import repack

    layer = both.model.layers[0].attn
    assert both.model.repacked > 0 or not repack.wanted(layer.w_qkv[0].ggml_type, *layer.w_qkv[0].shape)
    ids = token_ids(20, seed=2)
    _close(both, lambda m: m.logits_all(ids), "Q4_K prefill")
    _close(both, _prefill_then_decode(ids, 7), "Q4_K chunks + decode")


def test_fused_moe_layers_match_the_two_call_path_and_count_alike(tiny_files, monkeypatch):
    """qwen3moe (3 layers x 8 experts) with 12 slots filled so that layer 0 holds every expert
    (routing and experts inside its trunk graph, from the slots), layer 1 half of them (routing in
    the graph, the experts in two expert graphs after it) and layer 2 none (inside, from the
    mapping). Against MOERAY_FUSED_MOE=0 (torch routing, then the experts' graphs): the same logits
    within the backend's tolerance, the same experts, and the cache counts exactly what was routed.
    The split layer as on a card (split_from_host off; a CPU device runs it from the mapping inside
    its graph: test_glm4moe_through_an_expert_cache_counts_every_lookup)."""
    import numpy as np

    from moeray.planner.profile import Profile
    from moeray.stages.blocks import moe
    from moeray.stages.runtime.model import load_cached

    counts = np.zeros((3, 8), dtype=np.int64)
    counts[0], counts[1, :4] = 1000, 500
    model, cache = load_cached(tiny_files["qwen3moe"], backend="ggml", profile=Profile.from_counts(counts), n_slots=12, layout="global")
    resident = cache.core.slot_of >= 0
    assert resident.sum(1).tolist() == [8, 4, 0]
    cache.split_from_host = False
    routed, expert_graphs = [], []
    route, forward_stacks = cache.core.route, cache.host.forward_stacks
    monkeypatch.setattr(cache.core, "route", lambda l, ids: routed.append((l, np.array(ids))) or route(l, ids))
    monkeypatch.setattr(cache.host, "forward_stacks", lambda l, *a: expert_graphs.append(l) or forward_stacks(l, *a))
    fn = _prefill_then_decode(token_ids(20), 9)
    runs = {}
    for fused in (True, False):
        model.fuse_moe = fused
        routed.clear(), expert_graphs.clear(), cache.core.reset_counters()
        with torch.inference_mode():
            logits = fn(model)
        ids = [np.concatenate([i for l, i in routed if l == layer]) for layer in range(3)]  # [positions, k]
        c = cache.core
        for layer in range(3):  # every lookup counted: each pick once, a hit where resident
            picks = np.bincount(ids[layer].ravel(), minlength=8)
            assert c.routed[layer].tolist() == picks.tolist()
            assert (c.lookups[layer], c.hits[layer]) == (ids[layer].size, picks[resident[layer]].sum())
            assert c.misses[layer] == c.lookups[layer] - c.hits[layer]
        runs[fused] = logits, np.sort(np.stack(ids), -1), set(expert_graphs)
    (got, r_got, graphs_got), (ref, r_ref, graphs_ref) = runs[True], runs[False]
    assert graphs_got == {1} and graphs_ref == {0, 1, 2}  # the split layer alone calls the experts' graphs
    same = (r_got == r_ref).all(-1).all(0)
    assert same.mean() >= 0.75, f"routing differs at {int((~same).sum())} positions"
    err = (got - ref).abs().max(-1).values / ref.abs().max()
    assert err[torch.from_numpy(same)].max() <= RTOL


def test_the_stage_graph_is_its_layer_graphs_bit_for_bit(tiny_files):
    """Decode steps run the stage's layers as one graph (every layer's routing and experts inside,
    host path): the same bits as one graph per layer, the same experts counted, one call a step."""
    routes = []
    host = HostExperts(GGUFFile(tiny_files["qwen3moe"]), "ggml", on_route=lambda l, ids, w: routes.append((l, ids, w)))
    model = load_model(tiny_files["qwen3moe"], backend="ggml", experts=host)
    calls = []
    for name in ("layer", "stage"):
        real = getattr(model.trunk, name)
        setattr(model.trunk, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw))
    fn = _prefill_then_decode(token_ids(20), 9)
    runs = []
    for stage in (True, False):
        model.stage_graph = stage
        routes.clear(), calls.clear()
        with torch.inference_mode():
            runs.append((fn(model), list(routes), list(calls), host.computed))
    (got, r_got, c_got, n_got), (ref, r_ref, c_ref, n_ref) = runs
    assert torch.equal(got, ref)
    assert n_got == n_ref - n_got > 0  # the host copy's count of experts computed, alike
    assert len(r_got) == len(r_ref) and all(a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
                                            for a, b in zip(r_got, r_ref))
    steps = 2 + 20 - 9 - 5  # two prefill chunks, then one token a step
    assert c_got == ["stage"] * steps and c_ref == ["layer"] * 3 * steps  # 3 layers


def test_top1_routing_decodes_several_sequences_in_the_stage_graph(tmp_path):
    """One expert a token (k = 1): the routed output [H, 1, N] becomes [H, N] before the stage graph
    adds it to the residual (before: ggml's add asserted and aborted the process at 2 tokens).
    Two sequences decode together: one stage graph a step, the layer graphs' bits."""
    path = write_gguf(tiny_qwen3moe(top_k=1), tmp_path / "top1.gguf", "Q8_0")
    model = load_model(path, backend="ggml")
    calls = []
    real = model.trunk.stage
    model.trunk.stage = lambda *a: calls.append(1) or real(*a)
    ids = token_ids(12)
    runs = []
    for stage in (True, False):
        model.stage_graph = stage
        kv = model.new_kv_cache(2, 32)
        with torch.inference_mode():
            out = [model.step([ids, ids[:5]], [0, 1], kv)]
            for t in range(4):
                out.append(model.step([[3 + t], [40 + t]], [0, 1], kv))
        runs.append(torch.stack(out))
    assert len(calls) == 5  # the 17-token first step as well
    assert torch.equal(runs[0], runs[1])


def _route_in_graph(rule, logits: torch.Tensor, cfg, bias: torch.Tensor | None):
    """A graph routing rule (stages/blocks/routing.py GRAPH_ROUTING) alone in a graph: logits [N, E]
    -> (ids [N, k] int32, weights [N, k])."""
    from moeray.stages.kernels.backend import ggml_lib
    from moeray.stages.runtime.trunk_graph import MultiGraph

    G = ggml_lib()
    N, E = logits.shape

    def build(ctx):
        inputs = [G.ggml_new_tensor_2d(ctx, G.GGML_TYPE_F32, E, N)]
        if bias is not None:
            inputs.append(G.ggml_new_tensor_1d(ctx, G.GGML_TYPE_F32, E))
        ids, weights = rule(ctx, inputs[0], cfg, inputs[1] if bias is not None else None)
        return inputs, [ids, weights], []

    ids, weights = torch.empty(N, cfg.n_experts_used, dtype=torch.int32), torch.empty(N, cfg.n_experts_used)
    MultiGraph(build)([logits.data_ptr()] + ([] if bias is None else [bias.data_ptr()]),
                      [ids.data_ptr(), weights.data_ptr()])
    return ids, weights


@pytest.mark.parametrize("rule,fields", [
    ("softmax_topk", dict(norm_topk_prob=True)),
    ("softmax_topk", dict(norm_topk_prob=False)),
    # DeepSeek-V3 / Kimi-K2: sigmoid, bias, 8 groups of 8 (3 used), renormalised, scaled
    ("grouped_topk", dict(expert_gating="sigmoid", score_bias=True, expert_groups=8, expert_groups_used=3,
                          expert_weights_scale=2.5)),
    ("grouped_topk", dict(expert_gating="sigmoid", score_bias=True, expert_weights_scale=2.5)),  # GLM-4.5
    ("grouped_topk", dict(expert_gating="softmax", expert_groups=4, expert_groups_used=2, norm_topk_prob=False)),  # V2
    ("topk_softmax", dict(router_bias=True)),  # gpt-oss
])
def test_graph_routing_rules_choose_and_weigh_as_the_torch_rules(rule, fields):
    """Each rule's graph form against its torch form (stages/blocks/routing.py) on random logits: the same
    experts in the same rank order, the same weights within float32 rounding."""
    from dataclasses import replace

    from moeray.stages.arch.config import ModelConfig
    from moeray.stages.blocks.routing import GRAPH_ROUTING, ROUTING

    cfg = replace(ModelConfig(arch="t", n_layers=1, hidden=8, n_heads=1, n_kv_heads=1, head_dim=8, vocab_size=8,
                              context_length=8, rope_theta=1e4, rms_eps=1e-6, rope_style="neox", ffn_dim=0,
                              n_experts=64, n_experts_used=6, expert_ffn_dim=8, shared_expert_ffn_dim=0,
                              norm_topk_prob=True, qk_norm=False, tie_embeddings=True), **fields)
    gen = torch.Generator().manual_seed(7)
    for n in (1, 7, 32):
        logits = torch.randn(n, 64, generator=gen)
        bias = 0.3 * torch.randn(64, generator=gen) if cfg.score_bias or cfg.router_bias else None
        want_ids, want_w = ROUTING[rule](logits, cfg, bias)
        ids, weights = _route_in_graph(GRAPH_ROUTING[rule], logits, cfg, bias)
        assert torch.equal(ids.long(), want_ids), f"{rule} {fields}: other experts at {n} tokens"
        assert (weights - want_w).abs().max() <= 1e-6 * want_w.abs().max()


@pytest.mark.parametrize("name", ["qwen2moe", "glm4moe", "glm4moe-groups", "deepseek3", "deepseek2"])
def test_shared_expert_dense_layers_and_sigmoid_routing_run_in_the_stage_graph(tiny_files, name):
    """qwen2moe (a sigmoid-gated shared expert) and glm4moe (a dense first layer, sigmoid scores +
    correction bias, renormalised and scaled, an ungated shared expert; with 4 groups of which 2
    are chosen from), DeepSeek-V3 / V2 (the same with MLA attention; V2's softmax scores, not
    renormalised): every layer's FFN inside its graph, a decode step as ONE stage graph. Against
    MOERAY_FUSED_MOE=0 (torch routing, experts, shared expert and dense FFN after each layer's
    graph): the same experts, logits within 1e-4 of the largest (measured: equal), the same
    experts computed; and the stage graph gives the layer graphs' bits."""
    routes = []
    host = HostExperts(GGUFFile(tiny_files[name]), "ggml", on_route=lambda l, ids, w: routes.append((l, ids, w)))
    model = load_model(tiny_files[name], backend="ggml", experts=host)
    calls = []
    for call in ("layer", "stage"):
        real = getattr(model.trunk, call)
        setattr(model.trunk, call, lambda *a, real=real, call=call, **kw: calls.append(call) or real(*a, **kw))
    fn = _prefill_then_decode(token_ids(20, seed=4), 9)
    runs = {}
    for fused, stage in ((True, True), (True, False), (False, False)):
        model.fuse_moe, model.stage_graph = fused, stage
        routes.clear(), calls.clear()
        computed = host.computed
        with torch.inference_mode():
            runs[fused, stage] = fn(model), list(routes), list(calls), host.computed - computed
    steps, layers = 2 + 20 - 9 - 5, 3  # two prefill chunks, then one token a step
    (got, r_got, c_got, n_got), (per_layer, r_layer, c_layer, n_layer), (ref, r_ref, c_ref, n_ref) = (
        runs[True, True], runs[True, False], runs[False, False])
    assert c_got == ["stage"] * steps  # one graph a step (prefill chunks of <= 32 tokens too)
    assert c_layer == c_ref == ["layer"] * layers * steps
    assert torch.equal(got, per_layer)
    assert n_got == n_layer == n_ref > 0
    for a, b, c in zip(r_got, r_layer, r_ref):
        assert a[0] == b[0] == c[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
        assert torch.equal(a[1], c[1]), f"layer {a[0]}: other experts than the torch rule"
        assert (a[2] - c[2]).abs().max() <= 1e-6
    assert len(r_got) == len(r_ref) == (layers - (name != "qwen2moe")) * steps  # glm: layer 0 is dense
    err = (got - ref).abs().max() / ref.abs().max()
    assert err <= 1e-4, f"{name}: {err:.2e} of max |logit|"


@pytest.mark.parametrize("n_slots,split_from_host", [(12, False), (12, True), (16, True)])
def test_glm4moe_through_an_expert_cache_counts_every_lookup(tiny_files, n_slots, split_from_host, monkeypatch):
    """glm4moe (layer 0 dense, no slots) behind an expert cache. 16 slots: both MoE layers hold
    every expert, so each layer's routing, routed experts (from the slots, through the slot
    table) and shared expert run inside its graph and a decode step is one stage graph. 12 slots:
    layer 2 holds half; as on a card (split_from_host off) its routed experts run after its graph
    (its shared expert inside); on a CPU device, where the slots are host memory, every pick of it
    runs from the mapping inside its graph and a decode step is one stage graph again. Against
    MOERAY_FUSED_MOE=0: logits within 1e-4 of the largest (measured: equal), and the cache counts
    exactly what was routed, hits where resident, whichever stack computed them."""
    import numpy as np

    from moeray.planner.profile import Profile
    from moeray.stages.runtime.model import load_cached

    counts = np.zeros((3, 8), dtype=np.int64)
    counts[1], counts[2, :4] = 1000, 500
    counts[2, 4:] = 100 if n_slots == 16 else 0
    model, cache = load_cached(tiny_files["glm4moe"], backend="ggml", profile=Profile.from_counts(counts), n_slots=n_slots, layout="global")
    resident = cache.core.slot_of >= 0
    assert resident.sum(1).tolist() == [0, 8, 8 if n_slots == 16 else 4]
    assert cache.split_from_host  # a CPU device's default
    cache.split_from_host = split_from_host
    routed, calls, shared = [], [], []
    route, route_layers = cache.core.route, cache.core.route_layers
    monkeypatch.setattr(cache.core, "route", lambda l, ids: routed.append((l, np.array(ids))) or route(l, ids))
    # a stage graph's step is counted for all its layers in one call (static policy: never through route)
    monkeypatch.setattr(cache.core, "route_layers", lambda ls, ids: routed.extend(
        (l, np.array(i)) for l, i in zip(ls, ids)) or route_layers(ls, ids))
    for layer in model.layers[1:]:  # the shared expert's torch form (qmatmul.swiglu's one graph)
        real = layer.ffn.shared.forward
        monkeypatch.setattr(layer.ffn.shared, "forward", lambda h, real=real: shared.append(1) or real(h))
    for call in ("layer", "stage"):
        real = getattr(model.trunk, call)
        monkeypatch.setattr(model.trunk, call, lambda *a, real=real, call=call, **kw: calls.append(call) or real(*a, **kw))
    fn = _prefill_then_decode(token_ids(20, seed=6), 9)
    runs = {}
    for fused in (True, False):
        model.fuse_moe = fused
        routed.clear(), calls.clear(), shared.clear(), cache.core.reset_counters()
        with torch.inference_mode():
            logits = fn(model)
        assert len(shared) == (0 if fused else 2 * (2 + 20 - 9 - 5))  # inside every layer's graph, split or not
        ids = {layer: np.concatenate([i for l, i in routed if l == layer]) for layer in (1, 2)}
        c = cache.core
        for layer, got in ids.items():
            picks = np.bincount(got.ravel(), minlength=8)
            assert c.routed[layer].tolist() == picks.tolist()
            assert (c.lookups[layer], c.hits[layer]) == (got.size, picks[resident[layer]].sum())
        assert c.lookups[0] == 0
        runs[fused] = logits, ids, list(calls)
    (got, r_got, c_got), (ref, r_ref, c_ref) = runs[True], runs[False]
    steps = 2 + 20 - 9 - 5
    assert c_got == (["stage"] * steps if split_from_host else ["layer"] * 3 * steps)
    assert all(np.array_equal(r_got[l], r_ref[l]) for l in (1, 2))
    err = (got - ref).abs().max() / ref.abs().max()
    assert err <= 1e-4, f"{err:.2e} of max |logit|"


def test_gpt_oss_with_every_expert_resident_is_the_host_path_bit_for_bit(tmp_path):
    """gpt-oss's experts from the slots inside the stage graph (their biases as slot rows, picked
    through the slot table): the host path's logits bit for bit, one stage graph a step, every
    lookup a hit."""
    from gpt_oss_model import write_gpt_oss

    _resident_is_the_host_path_bit_for_bit(write_gpt_oss(tmp_path / "gpt-oss.gguf", "Q8_0")[0])


def test_deepseek_with_every_expert_resident_is_the_host_path_bit_for_bit(tiny_files):
    """DeepSeek-V3 (a dense first layer, no slots; MLA) with every MoE layer's experts in the
    slots: the same, through the slot table inside the stage graph."""
    _resident_is_the_host_path_bit_for_bit(tiny_files["deepseek3"])


def _resident_is_the_host_path_bit_for_bit(path) -> None:
    from moeray.stages.runtime.model import load_cached

    host = load_model(path, backend="ggml")
    cfg = host.config
    moe = len(cfg.moe_layers)
    cached, cache = load_cached(path, backend="ggml", n_slots=moe * cfg.n_experts, layout="global")
    assert (cache.core.slot_of[cfg.moe_layers] >= 0).all()
    calls = []
    real = cached.trunk.stage
    cached.trunk.stage = lambda *a: calls.append(1) or real(*a)
    fn = _prefill_then_decode(token_ids(20), 9)
    with torch.inference_mode():
        want, got = fn(host), fn(cached)
    assert torch.equal(got, want)
    c = cache.core
    assert len(calls) == 2 + 20 - 9 - 5 and c.hits.sum() == c.lookups.sum() == 20 * moe * cfg.n_experts_used


@pytest.mark.parametrize("name,attn_factor", [("deepseek3", None), ("deepseek2", None), ("deepseek3", 1.25)])
def test_mla_layer_graph_against_the_torch_attention(tiny_files, name, attn_factor):
    """One MLA layer (DeepSeek's dense first layer: q LoRA or one attn_q, the latent and its norm,
    YaRN RoPE on the decoupled dims, the latent cache written in the graph, absorbed attention,
    v_b, the output) as its stage graph against stages/blocks/mla.py's torch form, over a prefill and
    decode steps, with k_b / v_b in Q8_0 as llama.cpp quantises them: the residual stream within
    3e-2 of each row's largest value (measured: 1.3e-2, from the 8-bit activations ggml's
    quantised products take where torch multiplies float32; without YaRN's frequencies 0.17, the
    value read from the wrong columns 1.1, without the latent norm 0.37, without DeepSeek's
    mscale^2 in the softmax scale 0.1). attn_factor: a YaRN attention factor on cos / sin (a file's
    rope.scaling.yarn_attn_factor; DeepSeek's own configs give 1), in rope_ext as in stages/blocks/rope.py
    (without it in the graph: 0.43)."""
    from dataclasses import replace

    from moeray.stages.runtime.model import StageModel

    g = GGUFFile(tiny_files[name])
    if attn_factor is not None:
        g.config = replace(g.config, yarn_attn_factor=attn_factor)
    stage = StageModel(g, 0, 1, backend="ggml")
    assert stage.trunk is not None and type(stage.layers[0].attn).__name__ == "MLAttention"
    assert stage.layers[0].attn.w_k_b.backend == "ggml"
    ids = token_ids(20)
    calls = []
    real = stage.trunk.stage
    stage.trunk.stage = lambda *a: calls.append(1) or real(*a)
    runs = []
    for graphs in (stage.trunk, None):
        stage.trunk = graphs
        kv = stage.new_kv_cache(1, 32)
        with torch.inference_mode():
            out = [stage.run_layers(stage.embed([ids[:9]]), stage.batch_meta([9], [0], kv), kv)]
            for t in ids[9:]:
                out.append(stage.run_layers(stage.embed([[t]]), stage.batch_meta([1], [0], kv), kv))
        runs.append(torch.cat(out))
    assert len(calls) == 1 + 11  # one stage graph a step
    got, ref = runs
    err = (got - ref).abs().max(-1).values / ref.abs().max(-1).values
    assert err.max() <= 3e-2, f"{name}: {err.max():.2e} of the largest |x|"


@pytest.mark.parametrize("name", ["deepseek3", "deepseek2"])
def test_mla_families_decode_in_the_stage_graph(tiny_files, name):
    """DeepSeek-V3 / V2 whole (MLA, a dense first layer, grouped sigmoid or softmax routing, shared
    experts), k_b / v_b float: the graph's logits within 3e-2 of the torch path's largest
    (measured: equal bit for bit; RoPE's YaRN frequencies and scale, the latent cache, attention
    and routing alike), over a prefill, a second chunk and one stage graph per decode step."""
    both = Both(tiny_files[f"{name}-float-heads"])
    assert both.model.layers[0].attn.w_k_b.backend == "exact"
    _close(both, lambda m: m.logits_all(token_ids(20)), f"{name} prefill", rtol=3e-2)
    calls = both.calls
    _close(both, _prefill_then_decode(token_ids(20), 9), f"{name} chunks + decode", rtol=3e-2)
    assert both.calls - calls == 2 + 20 - 9 - 5  # one stage graph a step


def test_deepseek_sixteen_sequences_with_shared_prefix_blocks(tiny_files):
    """The engine's steps on MLA's one latent pool (DeepSeek-V3, float k_b / v_b): shared blocks
    gathered, a single sequence's keys as a view, 16 decoding together, mixed prefill + decode
    steps padded; the torch path's logits within 3e-2 of the largest (measured: 104 of 112 rows
    equal bit for bit, the others up to 1.4e-2)."""
    _sixteen_sequences(Both(tiny_files["deepseek3-float-heads"]), rtol=3e-2)


def test_a_residency_change_between_decode_steps_reaches_the_stage_graph(tiny_files):
    """A stage keeps each layer's stack, graph spec and the stage graph's input pointers from step
    to step while its slots stay as they are. A change between two decode steps must reach the
    next one: layer 2's experts emptied and loaded back into each other's slots (a kept slot table
    would now read the wrong expert's bytes), then layer 1's emptied (served from the mapping):
    the logits stay the host path's bit for bit, one stage graph a step, every lookup counted."""
    from moeray.stages.runtime.model import load_cached

    path = tiny_files["qwen3moe"]
    host = load_model(path, backend="ggml")
    cfg = host.config
    E, k = cfg.n_experts, cfg.n_experts_used
    cached, cache = load_cached(path, backend="ggml", n_slots=cfg.n_layers * E, layout="global")
    core = cache.core
    calls = []
    real = cached.trunk.stage
    cached.trunk.stage = lambda *a: calls.append(1) or real(*a)
    ids = token_ids(12, seed=4)
    before = core.slot_of[2].copy()
    with torch.inference_mode():
        kvs = [m.new_kv_cache(1, 40) for m in (host, cached)]
        logits = [m.step([ids], [0], kv) for m, kv in zip((host, cached), kvs)]
        for step in range(9):
            if step == 3:  # a free list is a stack: expert 0 now takes the slot expert 7 had, ...
                for e in range(E):
                    core.evict(2, e)
                for e in range(E):
                    core.admit(2, e)
                assert (core.slot_of[2] != before).all()
            if step == 6:
                for e in range(E):
                    core.evict(1, e)
                core.reset_counters()
            tok = int(logits[0][0].argmax())
            logits = [m.step([[tok]], [0], kv) for m, kv in zip((host, cached), kvs)]
            assert torch.equal(logits[1], logits[0]), f"decode step {step}"
    assert len(calls) == 10  # the prefill and every decode step one stage graph
    assert core.lookups.tolist() == [3 * k] * 3
    assert core.hits.tolist() == [3 * k, 0, 3 * k] and core.misses[1] == 3 * k
