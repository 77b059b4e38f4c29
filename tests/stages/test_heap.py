"""A loaded stage's heap is out of the garbage collector's walks (stages/runtime/heap.py): a full
collection after loading and serving walks few objects, not the hundreds of thousands a model
brings (~100 ms each on this machine, taken mid-step); a frozen graph is still freed when its
cache lets it go, and what a model left in reference cycles is collected when the next is loaded."""
from __future__ import annotations

import gc
import weakref

import pytest

from moeray.cluster.config import EngineConfig
from moeray.cluster.engine import Engine
from moeray.cluster.local_pipeline import LocalPipeline
from moeray.stages.kernels.backend import ggml_available
from moeray.stages.runtime.heap import freeze_heap
from moeray.stages.runtime.trunk_graph import MultiGraph
from moeray.stages.text.sampling import SamplingParams
from test_gguf_file import tiny_config, write_synthetic_gguf

pytestmark = pytest.mark.skipif(not ggml_available(), reason="stage graphs need ggml's kernels")


class _Cycle:
    def __init__(self):
        self.me = self


def _graphs(pipe) -> list[MultiGraph]:
    trunk = pipe.stage.model.trunk
    return [g for g in list(trunk._graphs.values()) + list(trunk._stages.values()) if isinstance(g, MultiGraph)]


def test_a_loaded_stage_leaves_little_for_a_collection_to_walk(tmp_path):
    path = write_synthetic_gguf(tmp_path / "moe.gguf", tiny_config("qwen3moe"), seed=3)
    pipe = LocalPipeline.from_file(str(path), 32, 1 << 30)
    eng = Engine(pipe, EngineConfig(max_seqs=2, max_len=128, kv_blocks=32))
    built = MultiGraph.built
    for n in (5, 9, 13):  # prompts of new lengths: a new graph each
        eng.generate([[1 + (3 * i) % 50 for i in range(n)]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert MultiGraph.built > built
    graphs = _graphs(pipe)
    assert graphs
    gc.collect()
    walked = {id(o) for o in gc.get_objects()}  # what a full collection walks: the objects not frozen
    assert gc.get_freeze_count() > 10 * len(walked)
    # The graphs built while serving are frozen too, the moment their step ended.
    assert not any(id(g) in walked for g in graphs)

    # A frozen graph the cache drops is freed by reference counting, as before.
    gone = [weakref.ref(g) for g in graphs]
    del graphs
    pipe.stage.model.trunk._graphs.clear()
    pipe.stage.model.trunk._stages.clear()
    assert all(r() is None for r in gone)


def test_garbage_frozen_in_a_cycle_is_collected_when_the_heap_is_frozen_again():
    held = _Cycle()
    ref = weakref.ref(held)
    freeze_heap(collect=False)
    del held
    gc.collect()
    assert ref() is not None  # frozen: no collection walks it
    freeze_heap()  # a load's freeze: everything back, one collection, then frozen
    assert ref() is None
