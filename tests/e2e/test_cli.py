"""`moeray generate` and `moeray logits` as a user runs them: subprocesses, real models."""
from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest


def moeray(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "moeray.cluster.cli", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


def test_generate_streams_text_then_speed_and_memory(smollm2_dense_path):
    r = moeray("generate", smollm2_dense_path, "--prompt", "The capital of France is", "--max-tokens", "6")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout  # the float32 model's margin here is 2.5 logits: no rounding flips it
    assert "prefill:" in r.stderr and "tok/s" in r.stderr and "decode:" in r.stderr
    assert "memory:" in r.stderr
    # The chat question's first word is a near-tie for this model ("The" 25.33 vs "L" 25.24 in
    # float32), which 8-bit activations can flip; --exact answers as the float32 model does.
    r = moeray("generate", smollm2_dense_path, "--chat", "--exact", "--prompt", "What is the capital of France?",
               "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_generate_stop_string_and_seeded_sampling(smollm2_dense_path):
    args = ["generate", smollm2_dense_path, "--prompt", "def fibonacci(n):", "--max-tokens", "16",
            "--temperature", "0.9", "--top-k", "40", "--top-p", "0.95", "--seed", "3", "--stop", "return"]
    a = moeray(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout.strip() and "return" not in a.stdout


def test_generate_penalties_and_logit_bias(smollm2_dense_path):
    """The sampling flags reach the sampler (what each computes: tests/stages/test_sampling.py)."""
    args = ["generate", smollm2_dense_path, "--prompt", "a b a b a b a b a b", "--max-tokens", "8"]
    plain = moeray(*args)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.split() == ["a", "b"] * 4
    for flag in ("--presence-penalty", "--frequency-penalty"):
        r = moeray(*args, flag, "2")
        assert r.returncode == 0, r.stderr
        assert r.stdout.split()[2:] != ["a", "b"] * 3, (flag, r.stdout)
    r = moeray(*args, "--logit-bias", "253=100", "--max-tokens", "3")  # 253 is " a" in SmolLM2's vocabulary
    assert r.returncode == 0 and r.stdout.split() == ["a"] * 3, r.stdout
    r = moeray(*args, "--logit-bias", "49152=1")
    assert r.returncode == 2 and "not in this model's vocabulary (ids 0 to 49151)" in r.stderr


def test_logits_writes_float32_for_every_position(smollm2_dense_path, tmp_path):
    out = tmp_path / "out.npy"
    r = moeray("logits", smollm2_dense_path, "--tokens", "1 4093 198 19556", "-o", out)
    assert r.returncode == 0, r.stderr
    logits = np.load(out)
    assert logits.dtype == np.float32 and logits.shape == (4, 49152)
    assert np.isfinite(logits).all()


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "no/such/model.gguf", "--prompt", "hi"], "no such file"),
        (["logits", "no/such/model.gguf", "--tokens", "1 2", "-o", "x.npy"], "no such file"),
        (["generate", "{bad}", "--prompt", "hi"], "not a GGUF"),
        (["generate", "{bad}", "--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "{bad}", "--prompt", "hi", "--presence-penalty", "3"], "--presence-penalty: presence_penalty must"),
        (["generate", "{bad}", "--prompt", "hi", "--logit-bias", "42"], "--logit-bias 42: give ID=BIAS"),
        (["run", "--prompt", "hi", "--min-p", "2"], "--min-p: min_p must be in [0, 1]"),
        (["logits", "{bad}", "--tokens", "1 x", "-o", "x.npy"], "--tokens"),
        (["run", "--stages", "0", "--prompt", "hi"], "--stages must be >= 1"),
        (["serve", "--threads", "2"], "--threads N (N >= 1) is for --local"),
        (["serve", "--local", "--threads", "0"], "--threads N (N >= 1) is for --local"),
        (["serve", "--no-metrics"], "--no-metrics is for --local on its own"),
        (["serve", "--local", "--no-metrics", "--dashboard"], "--no-metrics is for --local on its own"),
        (["serve", "--local", "no/such/model.gguf"], "no such file"),  # said before Ray starts
    ],
)
def test_errors_are_one_clean_line(tmp_path, args, message):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file" * 10)
    r = moeray(*[a.replace("{bad}", str(bad)) for a in args], timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.stderr


def test_default_model_is_used_when_no_model_given(default_model_path, smollm2_dense_path, tmp_path):
    tokens = "1 4093 198 19556 905"
    r = moeray("logits", "--exact", "--tokens", tokens, "-o", tmp_path / "moe.npy")
    assert r.returncode == 0, r.stderr
    assert str(default_model_path) in r.stderr  # it says which file, with its sha256
    assert moeray("logits", "--exact", smollm2_dense_path, "--tokens", tokens, "-o", tmp_path / "dense.npy").returncode == 0
    moe, dense = np.load(tmp_path / "moe.npy"), np.load(tmp_path / "dense.npy")
    # The upcycled MoE computes the dense FFN (identical experts, renormalised top-2 weights that
    # sum to 1 up to float32 rounding), so its logits are the dense model's up to rounding.
    assert np.abs(moe - dense).max() <= 1e-4 * np.abs(dense).max()


def test_generate_cache_flags_same_text_and_recorded_routing_makes_a_profile(default_model_path, tmp_path):
    """A run from the host copy only (--cache-budget 0) records its routing; the profile made from
    it fills a small adaptive cache that then hits, and the greedy text is the same either way."""
    trace, profile = tmp_path / "run.trace", tmp_path / "profile.msgpack"
    common = ["generate", default_model_path, "--prompt", "The capital of France is", "--max-tokens", "8"]
    cold = moeray(*common, "--cache-budget", "0", "--record-routing", trace)
    assert cold.returncode == 0, cold.stderr
    assert "expert cache:" not in cold.stderr and trace.stat().st_size > 0
    made = moeray("profile", "make", trace, "-o", profile)
    assert made.returncode == 0, made.stderr
    warm = moeray(*common, "--cache-budget", "300MiB", "--profile", profile, "--cache-policy", "adaptive")
    assert warm.returncode == 0, warm.stderr
    assert warm.stdout == cold.stdout and "Paris" in warm.stdout
    hits, lookups = map(int, re.search(r"expert cache: .*; (\d+) hits / (\d+) lookups", warm.stderr).groups())
    assert 0 < hits <= lookups
