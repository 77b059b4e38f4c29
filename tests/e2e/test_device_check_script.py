"""bench/device_check.py run as a script (the one command of the CUDA path): end to end on the CPU
(its dry run: the synthetic MoE in one process and on 1 and 2 Ray stages), its one-line refusal
where CUDA is absent, and its quick run on a GPU (marked `cuda`: skips, saying why, everywhere
else). The CUDA rules the CPU can check, in process: tests/stages/test_device_check.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_device_check import NO_CUDA, ROOT

SCRIPT = ROOT / "bench" / "device_check.py"


def _run_script(out: Path, *extra: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *extra], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout, env={**os.environ, "RAY_DEDUP_LOGS": "0"})


# ---------------------------------------------------------------- the dry run


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    """The whole script on the CPU, small: the synthetic MoE in 1 and 2 simulated stages."""
    out = tmp_path_factory.mktemp("device_check")
    proc = _run_script(out, "--device", "cpu", "--quick", "--models", "synthetic")
    report = out / "device_check.json"
    assert report.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(report.read_text())


@pytest.mark.slow
def test_dry_run_passes_every_check(dry_run):
    proc, data = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert data["finished"] and not data["errors"]
    failed = [c for c in data["checks"] if not c["pass"]]
    assert not failed and len(data["checks"]) >= 7, data["checks"]
    assert "checks passed" in proc.stdout and "synthetic" in proc.stdout  # the summary table


@pytest.mark.slow
def test_dry_run_measures_what_the_gpu_run_reports(dry_run):
    _, data = dry_run
    assert "NVML" in json.dumps(data["probe"]["views"])  # NVML's answer here: why it has no card to show
    m = data["models"]["synthetic"]
    assert m["experts_bytes"] > 0 and m["size_bytes"] > m["experts_bytes"]
    lg = m["logits"]
    assert lg["rel_diff"] == 0.0 and lg["argmax_agreement"] == 1.0  # the same kernels on the same CPU
    assert 0 < lg["resident"] < lg["n_experts_total"]  # the capped cache: hits from slots, misses from the host
    for n in (1, 2):
        run = m[f"stages_{n}"]
        assert run["greedy"] == m["cpu_greedy"] and len(run["greedy"]) == 8
        assert [d["batch"] for d in run["decode"]] == [1, 4] and all(d["decode_tok_s"] > 0 for d in run["decode"])
        assert len(run["stages"]) == n
        for s in run["stages"]:
            # "about half" of the experts are resident and hit; the rest are misses on the host
            assert 0.25 <= s["hit_rate"] <= 0.75 and s["lookups"] > 0
            mem = s["memory"]
            assert 0 < mem["held_bytes"] <= mem["charged_bytes"]
            assert {"KV pool", "expert cache"} <= {k.split(" (")[0] for k in mem["charged"]}
    hop = m["stages_2"]["hop"]
    assert hop["rows1"]["intact"] and hop["rows16"]["intact"] and hop["rows1"]["backend"] == "gloo"
    assert hop["rows1"]["ms_per_hop"] > 0


def test_cuda_requested_without_cuda_is_one_clear_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal cannot happen")
    proc = _run_script(tmp_path, "--device", "cuda", timeout=120)
    assert proc.returncode == 2
    assert "sees no CUDA device" in proc.stderr and "--device cpu" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------- on a GPU


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_device_check_quick(tmp_path):
    proc = _run_script(tmp_path, "--device", "cuda", "--quick", "--models", "synthetic")
    data = json.loads((tmp_path / "device_check.json").read_text())
    assert proc.returncode == 0, [c for c in data["checks"] if not c["pass"]] or data["errors"]
