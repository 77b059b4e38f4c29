"""The house: imports run one way (cluster -> stages -> cache -> planner -> moeray's own base
modules), stages/ is rooms that import only rooms below them (DESIGN.md), the planner loads neither
torch nor Ray and reads no environment (it is the brain, testable and benchmarkable in
milliseconds), the step's contract (stages/runtime/step.py) loads neither, placement
(cluster/placement.py) and the one-process pipeline load no Ray, and no module of the package but
moeray/environment.py touches os.environ.

The rule for the environment: the package (moeray/, stages/, cache/, planner/, cluster/) reads
and sets variables only through moeray/environment.py, which lists every one. tests/ and bench/
are not the package: they may set variables for the processes they start and read the ones that
steer them (where a screenshot or a carried file goes)."""
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
            "import moeray.cluster.commands.plan\n"
            "import moeray.stages.arch as arch, moeray.stages.gguf.reader\n"
            "assert len(arch.supported()) >= 3  # every architecture module imported\n"
            "bad = [m for m in ('torch', 'ray') if m in sys.modules]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def _loads_none_of(modules: tuple[str, ...], imports: str) -> None:
    code = (f"import sys\n{imports}\n"
            f"bad = [m for m in {modules!r} if m in sys.modules]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_step_contract_loads_neither_torch_nor_ray():
    """StepBatch, StepOutput and the stage reports (stages/runtime/step.py) are plain dataclasses
    the engine, the scheduler and the driver read."""
    _loads_none_of(("torch", "ray"), "import moeray.stages.runtime.step")


def test_placement_and_the_one_process_pipeline_load_no_ray():
    """cluster/placement.py is the arithmetic the driver wires Ray around, and a one-process
    pipeline (cluster/local_pipeline.py: StageActor, StageRunner) runs without Ray."""
    _loads_none_of(("ray",), "import moeray.cluster.placement, moeray.cluster.local_pipeline")


# stages/ in rooms, each importing only the rooms below it (DESIGN.md, "Layout"): arch and gguf at
# the bottom, text and kernels above them, blocks, runtime on top.
ROOMS = {
    "arch": set(),
    "gguf": {"arch"},
    "text": {"arch", "gguf"},
    "kernels": {"arch", "gguf"},
    "blocks": {"arch", "gguf", "text", "kernels"},
    "runtime": {"arch", "gguf", "text", "kernels", "blocks"},
}


def _imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


def test_stages_is_rooms_and_each_imports_only_the_rooms_below():
    stages = ROOT / "stages"
    loose = sorted(p.name for p in stages.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules of stages/ outside a room: {loose}"
    rooms = sorted(p.name for p in stages.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    assert rooms == sorted(ROOMS), f"stages/ rooms {rooms}, DESIGN.md names {sorted(ROOMS)}"
    wrong = []
    for room, below in ROOMS.items():
        doc = ast.get_docstring(ast.parse((stages / room / "__init__.py").read_text())) or ""
        if not doc.strip():
            wrong.append(f"stages/{room}/__init__.py says nothing of what the room holds")
        for path in sorted((stages / room).rglob("*.py")):
            for name in _imported_modules(path):
                parts = name.split(".")
                if parts[:2] == ["moeray", "stages"] and len(parts) > 2:
                    if parts[2] != room and parts[2] not in below:
                        wrong.append(f"{path.relative_to(ROOT)} imports {name} (stages/{room} may import "
                                     f"{', '.join(sorted(below)) or 'no other room'})")
    assert not wrong, "\n".join(wrong)


def _environment_uses(path: Path) -> list[str]:
    """Where a module reads or sets the process environment: os.environ, os.getenv, os.putenv,
    os.unsetenv, or `environ` imported from os."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" \
                and node.attr in ("environ", "getenv", "putenv", "unsetenv", "environb"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} os.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv", "putenv", "unsetenv") for a in node.names):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} from os import ...")
    return found


ENVIRONMENT_MODULE = ROOT / "moeray" / "environment.py"


def test_only_moeray_environment_touches_the_environment():
    found = []
    for folder in ("moeray",) + PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != ENVIRONMENT_MODULE:
                found += _environment_uses(path)
    assert not found, ("the package reads or sets the environment only through moeray/environment.py "
                       "(a knob is a field of the config tree, cluster/config.py):\n" + "\n".join(found))
    assert _environment_uses(ENVIRONMENT_MODULE), "moeray/environment.py reads the environment"


def test_the_planner_reads_no_environment():
    wrong = []
    for path in sorted((ROOT / "planner").rglob("*.py")):
        wrong += _environment_uses(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            module = node.module if isinstance(node, ast.ImportFrom) else ""
            if "moeray.environment" in names or module == "moeray.environment" or (
                    module == "moeray" and "environment" in names):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} imports moeray.environment")
    assert not wrong, "planner/ takes every setting as a parameter:\n" + "\n".join(wrong)
