"""Stages on different nodes: a three-node ray.cluster_utils.Cluster on this machine, where a
custom `moeray_device` resource on two worker nodes stands in for their GPUs."""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from moeray.cluster.config import EngineConfig, LaunchOptions  # noqa: E402
from moeray.cluster.driver import DEVICE_RESOURCE, launch  # noqa: E402
from moeray.cluster.engine import Engine  # noqa: E402
from moeray.stages.text.sampling import SamplingParams  # noqa: E402

MiB = 1 << 20
PROMPTS = [[504, 3575, 282, 4649, 314], [1, 9, 33]]
N_NEW = 4


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    workers = [c.add_node(num_cpus=1, resources={DEVICE_RESOURCE: 1}) for _ in range(2)]
    ray.init(address=c.address)
    yield c, workers
    ray.shutdown()
    c.shutdown()


def test_stages_on_distinct_nodes_give_the_one_process_tokens(cluster, default_model_path):
    import torch

    from moeray.stages.runtime.model import load_model

    _, workers = cluster
    opts = LaunchOptions(2, simulate=[320 * MiB, 320 * MiB], strategy="SPREAD", torch_threads=1, timeout_s=180)
    launched = launch(str(default_model_path), opts, EngineConfig(max_seqs=2, max_len=32), log=lambda line: None)
    try:
        nodes = [r.device.node_id for r in launched.reports]
        assert len(set(nodes)) == 2
        assert set(nodes) == {w.node_id for w in workers}  # the head node has no device resource
        eng = Engine(launched.pipeline(), EngineConfig(max_seqs=2, max_len=32, token_budget=8, prefill_chunk=4,
                                                       micro_batches=2, step_timeout_s=60))
        got = [r.output for r in eng.generate(PROMPTS, SamplingParams(max_tokens=N_NEW, ignore_eos=True),
                                              timeout_s=300)]
    finally:
        launched.shutdown()
    model = load_model(str(default_model_path))
    want = []
    for prompt in PROMPTS:
        kv, feed, toks = model.new_kv_cache(1, 32), prompt, []
        for _ in range(N_NEW):
            toks.append(int(torch.argmax(model.step([feed], [0], kv)[0])))
            feed = [toks[-1]]
        want.append(toks)
    assert got == want
