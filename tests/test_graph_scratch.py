"""A graph's intermediates share scratch bytes once their last reader has run (qmatmul.place_scratch
with the graph's nodes), as ggml's own allocator does: a stage graph of 30 layers then needs about
one layer's intermediates. The results must not change: a long chain with branches, views and a
result read many nodes later gives what torch computes."""
from __future__ import annotations

import pytest
import torch

from moeray.stages.qmatmul import ggml_available, ggml_lib

pytestmark = pytest.mark.skipif(not ggml_available(), reason="ggml-python is not installed")


def test_a_long_graph_reuses_scratch_and_computes_the_same():
    from moeray.stages.trunk_graph import MultiGraph

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
