"""gpt-oss across 4 Ray pipeline stages (one layer each): the tiny gpt-oss model's greedy tokens
equal the one-process model's, prompts batched at different lengths past the sliding window,
its experts (MXFP4, with biases) half in the stages' caches and half on the host."""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from moeray.cluster.config import EngineConfig, LaunchOptions  # noqa: E402
from moeray.cluster.driver import launch  # noqa: E402
from moeray.stages.blocks.kv_cache import kv_layer_bytes  # noqa: E402
from moeray.stages.kernels.settings import StageOptions  # noqa: E402
from moeray.stages.blocks.kv_cache import blocks_for  # noqa: E402
from moeray.cluster.engine import Engine  # noqa: E402
from moeray.stages.text.sampling import SamplingParams  # noqa: E402

MAX_SEQS, MAX_LEN, N_NEW = 3, 48, 6
PROMPTS = [list(range(5, 17)), [7, 3, 250, 9], list(range(100, 121))]  # 12, 4 and 21 tokens; window 8


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from gpt_oss_model import write_gpt_oss

    path, _ = write_gpt_oss(tmp_path_factory.mktemp("ray-gpt-oss") / "gpt-oss.gguf", "Q8_0", n_layers=4)
    return str(path)


@pytest.fixture(scope="module")
def reference(model_path):
    """Greedy tokens of the whole model in this process, one prompt at a time."""
    from greedy import one_process_greedy
    from moeray.stages.runtime.model import load_model

    return one_process_greedy(load_model(model_path, backend="exact"), PROMPTS, N_NEW, MAX_LEN)


def test_four_stages_give_the_one_process_greedy_tokens(model_path, reference):
    from moeray.stages.gguf.reader import expert_bytes, read_gguf_header, trunk_bytes

    h = read_gguf_header(model_path)
    trunk = trunk_bytes(h.tensors, h.config, "exact")  # the exact backend: float32 copies, no ties broken by rounding
    per_layer = max(trunk["layers"])
    expert = expert_bytes(h.tensors, 0, "exact")
    kv = kv_layer_bytes(h.config, MAX_SEQS * blocks_for(MAX_LEN))  # one layer's KV pool: a stage's
    # each card: its layer's trunk and KV, the embedding (first) or head (last), room for 1 or 2 of its 6 experts
    room = per_layer + kv + 1.5 * expert
    budgets = [int(room + trunk["embedding"]), int(room), int(room), int(room + trunk["head"])]
    opts = LaunchOptions(4, simulate=budgets, torch_threads=1, timeout_s=180, stage=StageOptions(backend="exact"))
    launched = launch(model_path, opts, EngineConfig(max_seqs=MAX_SEQS, max_len=MAX_LEN), log=lambda _: None)
    try:
        assert launched.ranges == [(0, 1), (1, 2), (2, 3), (3, 4)]
        eng = Engine(launched.pipeline(), EngineConfig(max_seqs=MAX_SEQS, max_len=MAX_LEN, token_budget=10,
                                                       prefill_chunk=6, micro_batches=2, step_timeout_s=60))
        reqs = eng.generate(PROMPTS, SamplingParams(max_tokens=N_NEW, ignore_eos=True), timeout_s=300)
        assert [r.output for r in reqs] == reference
        assert eng.stats.failures == 0
        for st in launched.stage_stats():  # some experts in each stage's cache, the rest from the host
            assert 0 < st.cache["resident"] < 6 and st.cache["hits"] > 0 and st.cache["misses"] > 0, st.cache
            assert st.cache["held_bytes_per_slot"] == [expert]  # weights and bias rows, as priced
    finally:
        launched.shutdown()
        ray.shutdown()
