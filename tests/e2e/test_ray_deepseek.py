"""A tiny DeepSeek-V3 (MLA, a dense first layer, grouped sigmoid routing) on four simulated
stages as Ray actors: probe, plan, load, wire, and the one-process greedy tokens."""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from moeray.cluster.config import EngineConfig, LaunchOptions  # noqa: E402
from moeray.cluster.driver import launch  # noqa: E402
from moeray.cluster.engine import Engine  # noqa: E402
from moeray.stages.text.sampling import SamplingParams  # noqa: E402

MiB = 1 << 20
MAX_SEQS, MAX_LEN = 3, 48
PROMPTS = [[5, 17, 99, 3, 150], list(range(20, 39)), [1, 9]]
N_NEW = 6


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory):
    from moeray.stages.gguf.writer import write_gguf
    from tiny_models import tiny_deepseek3

    return write_gguf(tiny_deepseek3(n_layers=4), tmp_path_factory.mktemp("ds") / "ds4.gguf", "Q8_0")


@pytest.fixture(scope="module")
def launched(ds_path):
    # about half of the 24 experts fit beside each stage's trunk and KV: each stage chooses
    opts = LaunchOptions(4, simulate=[3 * MiB // 2] * 4, torch_threads=1, timeout_s=180)
    out = launch(str(ds_path), opts, EngineConfig(max_seqs=MAX_SEQS, max_len=MAX_LEN), log=lambda line: None)
    yield out
    out.shutdown()
    ray.shutdown()


def test_four_stages_give_the_one_process_greedy_tokens(launched, ds_path):
    import torch

    from moeray.stages.runtime.model import load_model

    model = load_model(str(ds_path))
    want = []
    for prompt in PROMPTS:
        kv, toks, feed = model.new_kv_cache(1, MAX_LEN), [], prompt
        for _ in range(N_NEW):
            toks.append(int(torch.argmax(model.step([feed], [0], kv)[0])))
            feed = [toks[-1]]
        want.append(toks)
    assert launched.ranges == [(0, 1), (1, 2), (2, 3), (3, 4)]  # the dense layer 0 is a stage of its own
    eng = Engine(launched.pipeline(), EngineConfig(max_seqs=MAX_SEQS, max_len=MAX_LEN, token_budget=12,
                                                   prefill_chunk=8, micro_batches=2, step_timeout_s=60))
    reqs = eng.generate(PROMPTS, SamplingParams(max_tokens=N_NEW, ignore_eos=True), timeout_s=300)
    assert [r.output for r in reqs] == want
    assert eng.stats.failures == 0
    stats = launched.stage_stats()
    assert stats[0].cache is None  # the dense stage builds no expert cache
    assert all(s.cache and s.cache["lookups"] > 0 for s in stats[1:])
