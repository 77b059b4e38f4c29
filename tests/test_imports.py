"""Imports run one way: cluster -> stages -> cache -> planner -> moeray.errors, and the planner
loads neither torch nor Ray (it is the brain, testable and benchmarkable in milliseconds)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("stages", "cache", "planner", "cluster")
# What each package may import of the others (moeray.errors is everyone's).
ALLOWED = {
    "planner": set(),
    "cache": {"planner"},
    "stages": {"cache", "planner"},
    "cluster": {"stages", "cache", "planner"},
}


def imported_packages(path: Path) -> set[str]:
    """moeray subpackages a module imports anywhere in it (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "moeray" and len(parts) > 1 and parts[1] in PACKAGES:
                found.add(parts[1])
            if parts[0] in PACKAGES:  # the old top-level names must not come back
                found.add(f"top-level {parts[0]}")
    return found


def test_packages_import_one_way():
    wrong = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for target in imported_packages(path) - ALLOWED[package] - {package}:
                wrong.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not wrong, "imports against the one-way order cluster -> stages -> cache -> planner:\n" + "\n".join(wrong)


def test_no_module_imports_a_module_that_imports_it():
    """Module-level cycles inside a package too (e.g. engine <-> driver), function-level imports included."""
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT / package).with_suffix("")
            mod = ".".join(("moeray", package, *rel.parts)).removesuffix(".__init__")
            deps = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moeray."):
                    deps.add(node.module)
                    deps.update(f"{node.module}.{a.name}" for a in node.names)
                elif isinstance(node, ast.Import):
                    deps.update(a.name for a in node.names if a.name.startswith("moeray."))
            graph[mod] = deps
    cycles = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if b in graph and a in graph[b] and a < b)
    assert not cycles, "modules that import each other: " + ", ".join(cycles)


def test_the_planner_loads_neither_torch_nor_ray():
    """Nor do the header reader and the architecture modules it builds configs with."""
    code = ("import sys, importlib, pkgutil, moeray.planner as p\n"
            "for m in pkgutil.iter_modules(p.__path__):\n"
            "    importlib.import_module('moeray.planner.' + m.name)\n"
            "import moeray.cluster.plan_cmd\n"
            "import moeray.stages.arch as arch, moeray.stages.gguf.reader\n"
            "assert len(arch.supported()) >= 3  # every architecture module imported\n"
            "bad = [m for m in ('torch', 'ray') if m in sys.modules]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
