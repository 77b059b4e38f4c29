"""bench/device_check.py as it runs on the bare GPU image (docs/kernels.md: the one command): no Ray, no
pydantic, no FastAPI, no moeray install, gguf only from a wheel on sys.path. Here that image is
imitated on the CPU: a child Python whose import system refuses ray / pydantic / fastapi /
starlette / uvicorn (as absent packages do), drops the editable moeray install, and finds gguf
only inside a wheel-like zip; the quick dry run must pass every check in it. Also: the default
model's source in two parts (bench/carry.py) joins back, and refuses a wrong part by name."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("ray", "pydantic", "pydantic_core", "fastapi", "starlette", "uvicorn")

CHILD = r'''
import importlib.abc, importlib.machinery, runpy, sys
BLOCKED = set(sys.argv[1].split(","))
attempts = []

class BareImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in BLOCKED:
            attempts.append(name)
            raise ModuleNotFoundError(f"No module named {name!r} (the bare image has none)")
        if name == "gguf":  # only from a wheel on sys.path, as bench/carry.py puts it there
            wheels = [p for p in sys.path if p.endswith(".whl")]
            spec = importlib.machinery.PathFinder.find_spec(name, wheels) if wheels else None
            if spec is None:
                raise ModuleNotFoundError("No module named 'gguf' (not installed on the bare image)")
            return spec
        return None

# no moeray install: drop the editable finder, moeray comes from the checkout (bench/carry.bootstrap)
# (setuptools puts the finder class itself on sys.meta_path, not an instance)
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in str(getattr(f, "__module__", "")) + type(f).__module__]
sys.meta_path.insert(0, BareImage())
for m in [m for m in sys.modules if m.split(".")[0] in ("moeray", "gguf") or m.split(".")[0] in BLOCKED]:
    del sys.modules[m]
sys.argv = [sys.argv[2]] + sys.argv[3:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    import json
    print("BLOCKED-IMPORTS " + json.dumps(sorted(set(attempts))))
    print("GGUF-FROM " + str(getattr(sys.modules.get("gguf"), "__file__", None)))
'''


def _gguf_wheel(dst: Path) -> Path:
    """The installed gguf package zipped as a pure-Python wheel is (gguf/ at the zip's root)."""
    import gguf

    pkg = Path(gguf.__file__).parent
    whl = dst / "gguf-0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for f in pkg.rglob("*.py"):
            z.write(f, f.relative_to(pkg.parent))
    return whl


@pytest.mark.slow
def test_device_check_dry_run_on_an_imitated_bare_image(tmp_path):
    carry = tmp_path / "carry"
    (carry / "wheels").mkdir(parents=True)
    _gguf_wheel(carry / "wheels")
    out = tmp_path / "out"
    env = {**os.environ, "MOERAY_CARRY_DIR": str(carry), "RAY_DEDUP_LOGS": "0"}
    proc = subprocess.run([sys.executable, "-c", CHILD, ",".join(BLOCKED), str(ROOT / "bench" / "device_check.py"),
                           "--out", str(out), "--device", "cpu", "--quick", "--models", "synthetic"],
                          cwd=tmp_path, env=env, text=True, capture_output=True, timeout=900)
    log = proc.stdout[-4000:] + proc.stderr[-3000:]
    data = json.loads((out / "device_check.json").read_text())
    assert proc.returncode == 0, log
    assert data["finished"] and not data["errors"], data["errors"]
    assert all(c["pass"] for c in data["checks"]) and len(data["checks"]) >= 10, data["checks"]
    assert data["ray"].startswith("not used: ModuleNotFoundError"), data["ray"]
    assert any(b.startswith("moeray from ") for b in data["bootstrapped"]) and "gguf-0-py3-none-any.whl" in data["bootstrapped"]
    assert "GGUF-FROM " + str(carry / "wheels" / "gguf-0-py3-none-any.whl") in proc.stdout, log
    m = data["models"]["synthetic"]
    assert m["inproc_1"]["greedy"] == m["cpu_greedy"] == m["inproc_2"]["greedy"]
    assert data["link"]["rows1"]["intact"] and data["kernels"]["rows"]


def test_default_model_source_joins_from_two_parts(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    import carry

    monkeypatch.setattr(carry, "CARRY", tmp_path / "carry")
    monkeypatch.setattr(carry, "PARKED", tmp_path / "parked")
    monkeypatch.setattr(carry, "PART_BYTES", 1000)
    data = os.urandom(2500)
    carry.split_source(data)
    part0, part1 = carry.source_parts()
    assert part0.stat().st_size == 1000 and part1.stat().st_size == 1500
    # the first call parks part 0 outside the tree; the second carries only part 1
    carry.PARKED.mkdir()
    part0.rename(carry.PARKED / part0.name)
    path, why = carry.joined_source(tmp_path / "joined.gguf")
    assert why == "joined" and path.read_bytes() == data
    (carry.PARKED / part0.name).unlink()
    path, why = carry.joined_source(tmp_path / "joined.gguf")
    assert path is None and "smollm2-src.part0" in why and "first call" in why
    part0.write_bytes(os.urandom(1000))  # a wrong part: refused by the manifest's sha256
    path, why = carry.joined_source(tmp_path / "joined.gguf")
    assert path is None and "sha256" in why


def test_shape30b_is_qwen3_30b_a3b_shaped(tmp_path):
    """The slice's shapes are Qwen3-30B-A3B's (transformers' Qwen3MoeConfig defaults are that
    model's widths; its 48 layers and head_dim 128 are from the model's config.json, the defaults
    say 24 and hidden / heads), and the quick file it writes loads as a qwen3moe config."""
    from transformers import Qwen3MoeConfig

    sys.path.insert(0, str(ROOT / "bench"))
    import shape30b

    from moeray.stages.gguf.reader import GGUFFile

    c = Qwen3MoeConfig()
    assert shape30b.FULL == dict(hidden=c.hidden_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                                 head_dim=128, experts=c.num_experts, used=c.num_experts_per_tok,
                                 expert_ffn=c.moe_intermediate_size, vocab=c.vocab_size, layers=48)
    g = GGUFFile(str(shape30b.write(tmp_path / "s.gguf", 2, quick=True)))
    q = shape30b.QUICK
    assert (g.config.arch, g.config.n_layers, g.config.hidden, g.config.n_experts, g.config.n_experts_used,
            g.config.expert_ffn_dim, g.config.vocab_size, g.config.qk_norm) == (
        "qwen3moe", 2, q["hidden"], q["experts"], q["used"], q["expert_ffn"], q["vocab"], True)
    assert g.info("blk.0.ffn_gate_exps.weight").ggml_type.name == "Q4_K"
    assert g.info("blk.1.ffn_down_exps.weight").ggml_type.name == "Q6_K"
