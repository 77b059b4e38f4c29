"""A graph's intermediates share scratch bytes once their last reader has run (graphs.place_scratch
with the graph's nodes), as ggml's own allocator does: a stage graph of 30 layers then needs about
one layer's intermediates. The results must not change: a long chain with branches, views and a
result read many nodes later gives what torch computes; and no result lands on bytes the node
before it read (ggml-cpu fuses RMS_NORM + MUL: the fused MUL reads the norm's source)."""
from __future__ import annotations

import ctypes

import pytest
import torch

from moeray.stages.kernels.backend import ggml_available, ggml_lib

pytestmark = pytest.mark.skipif(not ggml_available(), reason="ggml-python is not installed")


def test_a_long_graph_reuses_scratch_and_computes_the_same():
    from moeray.stages.runtime.trunk_graph import MultiGraph

    G = ggml_lib()
    H, N, depth = 256, 8, 40

    def build(ctx):
        x = G.ggml_new_tensor_2d(ctx, G.GGML_TYPE_F32, H, N)
        keep = G.ggml_scale(ctx, x, 0.5)  # read again only at the end: its bytes must survive
        y = x
        for i in range(depth):
            a = G.ggml_scale(ctx, y, 1.0 + 0.01 * i)
            b = G.ggml_sqr(ctx, G.ggml_scale(ctx, y, 0.1))
            half = G.ggml_view_2d(ctx, b, H // 2, N, b.contents.nb[1], 0)  # a view keeps its source alive
            y = G.ggml_add(ctx, a, G.ggml_concat(ctx, half, half, 0))
            y = G.ggml_scale(ctx, y, 0.5)
        return [x], [G.ggml_add(ctx, y, keep)], []

    g = MultiGraph(build, 8 * depth + 16)
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(0))
    out = torch.empty(N, H)
    g([x.data_ptr()], [out.data_ptr()])

    y = x.clone()
    for i in range(depth):
        b = (y * 0.1) ** 2
        half = b[:, : H // 2]
        y = (y * (1.0 + 0.01 * i) + torch.cat([half, half], 1)) * 0.5
    assert torch.allclose(out, y + 0.5 * x, rtol=1e-5, atol=1e-6)
    one = H * N * 4
    # ~5 intermediates of one [N, H] a layer, 40 layers: without reuse ~200 of them
    assert g.scratch.numel() <= 8 * one, g.scratch.numel() / one


def _overlaps(a, b) -> bool:
    G = ggml_lib()
    a0, b0 = a.contents.data, b.contents.data
    if a0 is None or b0 is None:  # an input or output: torch's bytes, given per call
        return False
    return a0 < b0 + G.ggml_nbytes(b) and b0 < a0 + G.ggml_nbytes(a)


def test_no_result_lands_on_what_the_node_before_read():
    """x -> scale -> rms_norm -> mul(w) chains: ggml computes a norm and the mul after it as one
    fused kernel that reads the norm's source while writing the mul's result, so that source must
    stay untouched one node longer than its last reader."""
    from moeray.stages.runtime.trunk_graph import MultiGraph

    G = ggml_lib()
    H, N, depth = 64, 6, 12

    def build(ctx):
        x = G.ggml_new_tensor_2d(ctx, G.GGML_TYPE_F32, H, N)
        w = G.ggml_new_tensor_1d(ctx, G.GGML_TYPE_F32, H)
        y = x
        for i in range(depth):
            small = G.ggml_sum_rows(ctx, y)  # a short-lived result: leaves a hole before the next ones
            a = G.ggml_add(ctx, G.ggml_scale(ctx, y, 1.0 + 0.1 * i), small)
            y = G.ggml_mul(ctx, G.ggml_rms_norm(ctx, a, 1e-5), w)
        return [x, w], [y], []

    g = MultiGraph(build, 8 * depth + 16)
    nodes = [G.ggml_graph_node(g.graph, i) for i in range(G.ggml_graph_n_nodes(g.graph))]
    for prev, node in zip(nodes, nodes[1:]):
        if node.contents.view_src:
            continue
        for src in prev.contents.src:
            if src and ctypes.addressof(src.contents) != ctypes.addressof(node.contents):
                assert not _overlaps(node, src), (G.ggml_op_desc(prev), G.ggml_op_desc(node))
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(1))
    w = torch.rand(H, generator=torch.Generator().manual_seed(2)) + 0.5
    out = torch.empty(N, H)
    g([x.data_ptr(), w.data_ptr()], [out.data_ptr()])
    y = x.clone()
    for i in range(depth):
        a = y * (1.0 + 0.1 * i) + y.sum(-1, keepdim=True)
        y = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    assert torch.allclose(out, y, rtol=1e-4, atol=1e-5)
