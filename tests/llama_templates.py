"""The published chat templates of the families, as llama.cpp keeps them (models/templates/), taken
from the llama-cpp-python sdist on PyPI (which vendors llama.cpp) once per machine and cached
beside the default model ($MOERAY_CACHE_DIR or ~/.cache/moeray). They are not committed: llama.cpp
collects them from the model repositories, under those models' own licences.

MOERAY_LLAMA_CPP_PYTHON_SDIST names a local copy of the sdist (no download). Without PyPI or the
copy, the tests that need a template skip and say why.
"""
from __future__ import annotations

import hashlib
import json
import os
import tarfile
import tempfile
import urllib.request
from pathlib import Path

import pytest

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
INDEX = "https://pypi.org/simple/llama-cpp-python/"
INSIDE = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/models/templates/"

# The families' templates (file names in llama.cpp's models/templates/).
FAMILIES = {
    "qwen3": "Qwen-Qwen3-0.6B.jinja",
    "qwen2.5": "Qwen-Qwen2.5-7B-Instruct.jinja",
    "qwen3-coder": "Qwen3-Coder.jinja",
    "qwen3.5": "Qwen3.5-4B.jinja",
    "deepseek-v3.1": "deepseek-ai-DeepSeek-V3.1.jinja",
    "deepseek-r1": "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
    "glm-4.6": "GLM-4.6.jinja",
    "kimi-k2": "Kimi-K2-Instruct.jinja",
    "kimi-k2-thinking": "Kimi-K2-Thinking.jinja",
    "gpt-oss": "openai-gpt-oss-120b.jinja",
}
# Templates without a tool format (the generic format's): not families, looked up by template().
OTHERS = {"gemma-2": "google-gemma-2-2b-it.jinja", "phi-3.5": "microsoft-Phi-3.5-mini-instruct.jinja"}


def _cache() -> Path:
    return Path(os.environ.get("MOERAY_CACHE_DIR") or Path.home() / ".cache" / "moeray") / f"llama-templates-{VERSION}"


def _extract(sdist: Path, into: Path) -> None:
    tmp = Path(tempfile.mkdtemp(dir=into.parent))
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            if m.isfile() and m.name.startswith(INSIDE) and m.name.endswith(".jinja"):
                (tmp / Path(m.name).name).write_bytes(tar.extractfile(m).read())
    tmp.rename(into)  # whole or not at all: a reader never sees half a folder


def _download(to: Path) -> None:
    req = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        files = json.load(r)["files"]
    (entry,) = [f for f in files if f["filename"] == SDIST]
    digest = hashlib.sha256()
    with urllib.request.urlopen(entry["url"], timeout=300) as r, open(to, "wb") as out:
        while chunk := r.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != SHA256:
        raise OSError(f"{SDIST} from PyPI has sha256 {digest.hexdigest()}, not {SHA256}")


def template_dir() -> Path:
    cache = _cache()
    if cache.is_dir():
        return cache
    cache.parent.mkdir(parents=True, exist_ok=True)
    local = os.environ.get("MOERAY_LLAMA_CPP_PYTHON_SDIST")
    try:
        if local:
            _extract(Path(local), cache)
        else:
            with tempfile.TemporaryDirectory(dir=cache.parent) as tmp:
                _download(Path(tmp) / SDIST)
                _extract(Path(tmp) / SDIST, cache)
    except (OSError, ValueError, tarfile.TarError) as exc:
        if cache.is_dir():  # another process got there first
            return cache
        pytest.skip(f"llama.cpp's chat templates are not available (the llama-cpp-python {VERSION} sdist from "
                    f"PyPI, or MOERAY_LLAMA_CPP_PYTHON_SDIST): {exc}")
    return cache


def template(family: str) -> str:
    return (template_dir() / {**FAMILIES, **OTHERS}[family]).read_text()
