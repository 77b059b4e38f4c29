"""KV cache types on the default model: the trunk graph attends over f16, q8_0 and q4_0 rows as the
torch path does over the same rows dequantised, in the engine's steps; q8_0 changes what f16 predicts
as llama.cpp's own q8_0 cache does on this model (its llama-perplexity --kl-divergence against f16:
the same top token at 95.4% of positions, mean KL 0.0045): only near-ties flip."""
from __future__ import annotations

import pytest
import torch

from moeray.planner.kv import KVTypes
from moeray.stages.kernels import settings
from moeray.stages.kernels.backend import ggml_available
from moeray.stages.runtime.model import load_model

needs_ggml = pytest.mark.skipif(not ggml_available(), reason="ggml-python is not installed")


@needs_ggml
@pytest.mark.parametrize("cache_type,rtol", [("q8_0", 0.1), ("q4_0", 0.2), ("f16", 0.1)])
def test_the_graph_attends_over_quantised_rows_as_the_torch_path_does(default_model_path, cache_type, rtol):
    """The engine's steps (a shared prefix block gathered, 16 sequences decoding, mixed padded steps)
    over a pool of each type: the trunk graph (flash attention on the rows as stored) against the
    torch path (the same rows dequantised), within the ggml backend's tolerance (q4_0: twice it,
    measured 0.146 of the largest logit). Flash attention multiplies a quantised key by the query
    rounded to q8_0 (its dot products' type, as in llama.cpp): one layer's output moves ~1.4% of its
    largest value against the torch path's float query, over q8_0 and q4_0 rows alike; through 30
    layers the coarser q4_0 keys let it grow further."""
    from test_trunk_graph import Both, _sixteen_sequences

    settings.update(cache_type_k=cache_type, cache_type_v=cache_type)
    _sixteen_sequences(Both(default_model_path), rtol=rtol)


@pytest.fixture(scope="module")
def default_model(default_model_path):
    return load_model(default_model_path)


def test_q8_0_changes_what_f16_predicts_only_at_near_ties(default_model, default_model_path):
    """Teacher-forced over the default model's bundled prompts (through its chat template): q8_0
    against f16, both through the graph. Measured with the rows turned as llama.cpp turns them
    (stages/blocks/kv_rotation.py), these 12- to 44-token prompts taking ggml's query-by-query
    kernel (the tiled one from 64 rows: trunk_graph.FLOAT_READ_ROWS), which rounds the query to f16
    / q8_0: the same top token at 98.3% of 349 positions, mean KL 0.0052 (with the query in float32,
    MOERAY_FA_TILED_ROWS=16: 97.7%, every flip where f16's top two are within 0.10 of each other, KL
    0.0046, the largest logit moving 2.6; unturned 95.7%, KL 0.0065). This 135M-parameter model's top two logits are often near-ties: f32 against
    f16 agrees at 98.6% (KL 0.0045), the graph against the torch path, both f32, at 98.6%;
    llama.cpp's own q8_0 cache (llama-perplexity --kl-divergence against f16 on 7,168 tokens of
    prose) at 95.4 +/- 0.35% (docs/kv-cache.md)."""
    from moeray.stages.gguf import default_model as dm
    from moeray.stages.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_model_path)
    f16, q8 = [], []
    for ids in dm.prompt_token_ids(tok):
        f16.append(default_model.logits_all(ids, KVTypes.same("f16")))
        q8.append(default_model.logits_all(ids, KVTypes.same("q8_0")))
    a, b = torch.cat(f16), torch.cat(q8)
    top2 = a.topk(2, -1).values
    margin = top2[:, 0] - top2[:, 1]
    flipped = a.argmax(-1) != b.argmax(-1)
    assert 1 - flipped.float().mean() >= 0.97, f"the same top token at {1 - flipped.float().mean():.1%}"
    assert (margin[flipped] < 0.75).all(), margin[flipped]
    la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    kl = (la.exp() * (la - lb)).sum(-1)
    assert kl.mean() < 0.01 and (a - b).abs().max() < 3.0, (kl.mean(), (a - b).abs().max())
