"""The trunk graphs on the embedded default model against the torch ops they replace (the
reference, the bound and the helpers are tests/stages/test_trunk_graph.py's): its prefill, its
prefill in chunks then decode, and the engine's sixteen sequences over shared prefix blocks."""
from __future__ import annotations

import pytest

from moeray.stages.kernels.backend import ggml_available
from test_trunk_graph import Both, _close, _prefill_then_decode, _sixteen_sequences
from tiny_models import token_ids

pytestmark = pytest.mark.skipif(not ggml_available(), reason="ggml-python is not installed")


@pytest.fixture(scope="module")
def default(default_model_path):
    return Both(default_model_path)


def test_default_model_prefill_logits(default):
    _close(default, lambda m: m.logits_all(token_ids(48, seed=3)), "prefill", routed_alike=False)


def test_default_model_prefill_chunks_then_decode(default):
    _close(default, _prefill_then_decode(token_ids(30, seed=5), 11), "chunks + decode", routed_alike=False)


def test_sixteen_sequences_with_shared_prefix_blocks(default):
    """The engine's case: block tables (sequences 0-3 share their first block, so keys are
    gathered by block), prompts continued past a shared prefix, decode of all 16 together, then a
    mixed steps (one, then two sequences add two tokens, the others one)."""
    _sixteen_sequences(default)
