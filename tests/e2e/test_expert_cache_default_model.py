"""ExpertCache on the embedded default model: the same greedy tokens with no, some and all of its
experts cached, and every layer's lookups counted (the tiny models' cases:
tests/cache/test_expert_cache.py)."""
from __future__ import annotations

import pytest

from moeray.stages.runtime.model import load_cached
from test_expert_cache import greedy, one_torch_thread  # noqa: F401  (autouse: one torch thread here too)


def _default_model(request):
    try:
        return request.getfixturevalue("default_model_path")
    except pytest.FixtureLookupError:
        from moeray.stages.gguf.default_model import default_model_path

        return default_model_path(quiet=True)


@pytest.mark.slow
def test_default_model_same_tokens_with_no_some_and_all_experts_cached(request):
    path = _default_model(request)
    prompt = [1, 504, 3458, 282, 4649, 314, 253, 1789, 30]     # fixed token ids
    n_new = 4
    outputs = {}
    for n_slots in (0, 40, 240):                               # 30 layers x 8 experts = 240
        model, cache = load_cached(path, n_slots=n_slots, layout="global")
        outputs[n_slots] = greedy(model, prompt, n_new)
        tokens = len(prompt) + n_new  # every layer's FFN every row, but the last layer's: the prompt's last
        assert all(s.lookups == 2 * (tokens if s.layer < 29 else 1 + n_new) for s in cache.layer_stats())
        assert cache.core.n_resident == n_slots
        if n_slots == 240:
            assert cache.hit_rate() == 1.0
        del cache, model
    assert outputs[0] == outputs[40] == outputs[240]
