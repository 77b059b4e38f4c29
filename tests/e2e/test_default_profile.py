"""The embedded default model's routing profile: recorded from the bundled prompts beside the
model, deterministic, re-recorded when what it was made from changes, None for other models."""
from __future__ import annotations

import json

import numpy as np

from moeray.cache.trace import read_trace
from moeray.planner.profile import Profile
from moeray.stages.runtime import default_profile as dp
from moeray.stages.gguf.default_model import FILE_NAME, load_prompts


def test_profile_lies_beside_the_model_and_counts_its_trace(default_model_path):
    path = dp.default_profile_for(default_model_path, quiet=True)
    assert path == default_model_path.with_name(dp.PROFILE_NAME)
    assert json.loads(path.with_name(path.name + ".json").read_text()) == dp.profile_inputs(default_model_path)
    prof = Profile.load(path)
    trace = read_trace(path.with_name(dp.TRACE_NAME))
    assert np.array_equal(prof.count_table(), trace.counts())
    cfg = (trace.header.n_layers, trace.header.k)
    # every token of every prompt is routed through every layer to k experts
    assert sum(prof.counts) == trace.n_tokens * cfg[0] * cfg[1]
    assert trace.n_tokens >= sum(1 for _ in load_prompts()) * 10
    assert prof.counts == sorted(prof.counts, reverse=True)


def test_recording_is_deterministic(default_model_path, tmp_path):
    # Two short recordings (4 new tokens per prompt: prefill and decode both run), byte for byte.
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a = dp.record_profile(default_model_path, tmp_path / "a" / dp.PROFILE_NAME, max_tokens=4, quiet=True)
    b = dp.record_profile(default_model_path, tmp_path / "b" / dp.PROFILE_NAME, max_tokens=4, quiet=True)
    assert a.read_bytes() == b.read_bytes()
    assert a.with_name(dp.TRACE_NAME).read_bytes() == b.with_name(dp.TRACE_NAME).read_bytes()


def test_recorded_again_only_when_missing_or_stale(default_model_path, tmp_path, monkeypatch):
    model = tmp_path / FILE_NAME
    model.symlink_to(default_model_path)
    calls = []

    def fake_record(model_path, dst, max_tokens=dp.MAX_TOKENS, quiet=False):
        calls.append(dst)
        Profile.uniform(30, 8).save(dst)
        dst.with_name(dp.TRACE_NAME).write_bytes(b"")
        return dst

    monkeypatch.setattr(dp, "record_profile", fake_record)
    first = dp.default_profile_for(model)
    assert first == tmp_path / dp.PROFILE_NAME and len(calls) == 1
    assert dp.default_profile_for(model) == first and len(calls) == 1  # fresh: reused
    sidecar = first.with_name(first.name + ".json")
    sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), "prompts": "other prompts"}))
    dp.default_profile_for(model)
    assert len(calls) == 2  # made from other inputs: recorded again
    first.unlink()
    dp.default_profile_for(model)
    assert len(calls) == 3  # missing: recorded again
    assert dp.default_profile_for(tmp_path / "some-other-model.gguf") is None
