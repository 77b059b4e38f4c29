"""`moeray serve --local`'s experts: cached on its simulated device only when it holds every one of
them, else all computed from host memory. The device is host memory itself, so a part of them
there reads no fewer bytes, and it splits each layer's picks between two stacks (the layer then
runs outside the stage graph: slower; docs/architecture.md, "The expert cache"). The tokens are the same either way."""
from __future__ import annotations

from moeray.cluster.config import EngineConfig
from moeray.cluster.engine import Engine
from moeray.cluster.local_pipeline import LocalPipeline
from moeray.cluster.service import _experts_line
from moeray.stages.gguf.reader import GGUFFile
from moeray.stages.blocks.kv_cache import kv_block_bytes, kv_dtype
from moeray.stages.runtime.model import stage_trunk_bytes
from moeray.stages.blocks.moe import HostExperts
from moeray.stages.text.sampling import SamplingParams

KV_BLOCKS = 16


def _pipeline(path, budget):
    return LocalPipeline.from_file(str(path), KV_BLOCKS, budget, max_seqs=2)


def _tokens(pipe):
    engine = Engine(pipe, EngineConfig(max_seqs=2, max_len=KV_BLOCKS * 8, kv_blocks=KV_BLOCKS))
    reqs = engine.generate([[1, 504, 3458, 314], [1, 1070, 314, 253, 2]], SamplingParams(max_tokens=12, ignore_eos=True))
    return [r.output for r in reqs]


def test_a_device_short_of_every_expert_caches_none_and_says_so(default_model_path):
    gguf = GGUFFile(str(default_model_path))
    cfg = gguf.config
    kv = KV_BLOCKS * kv_block_bytes(cfg, range(cfg.n_layers), kv_dtype("cpu").itemsize)
    trunk = stage_trunk_bytes(gguf, 0, cfg.n_layers)
    host = HostExperts(gguf)
    every = cfg.n_experts * sum(host.slot_bytes(l) for l in range(cfg.n_layers))

    whole = _pipeline(default_model_path, kv + trunk + every + (1 << 20))
    assert whole.load_report.cache_resident == cfg.n_layers * cfg.n_experts
    assert whole.stage.stats().cache["hit_rate"] == 0.0  # a cache, before any step
    assert "resident" in _experts_line(cfg, whole.load_report)

    short = _pipeline(default_model_path, kv + trunk + every // 2)
    report = short.load_report
    assert report.cache_slots == 0 and short.stage.stats().cache is None
    assert not any("expert cache" in what for what in report.placed)
    assert "every routed expert computed from host memory" in _experts_line(cfg, report)

    assert _tokens(short) == _tokens(whole)
    assert whole.stage.stats().cache["hit_rate"] == 1.0
