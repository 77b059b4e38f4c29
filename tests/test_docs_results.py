"""The docs' figure tables against the results files they are rendered from (bench/render_docs.py).

A figure changed by hand, in a page or in a results file, fails here naming the page and the
results file; every results file carries the command, commit and date of the run that wrote it;
a row whose results file is missing is left out and its command listed; no page, bench or results
file names one machine's paths."""
from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import render_docs  # noqa: E402
from results import command, portable_values, read_results  # noqa: E402

PLAN = ROOT / "docs" / "results" / "plan.json"  # the results file these tests change in a copy


def copy_of_the_docs(tmp_path: Path) -> Path:
    """The pages render_docs.py renders and docs/results/, under a root of their own."""
    for page in render_docs.pages():
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / page, tmp_path / page)
    shutil.copytree(ROOT / "docs" / "results", tmp_path / "docs" / "results")
    return tmp_path


def test_every_page_shows_what_its_results_files_render():
    problems = render_docs.check()
    assert not problems, "run `.venv/bin/python bench/render_docs.py`:\n" + "\n".join(problems)


def test_a_figure_changed_in_a_results_file_fails_naming_the_pages_and_the_file(tmp_path):
    assert PLAN.is_file(), f"{PLAN} is missing: run `{render_docs.BY_NAME['plan'].command}`"
    root = copy_of_the_docs(tmp_path)
    path = root / "docs" / "results" / "plan.json"
    text = path.read_text()
    median = read_results(path)["rows"][0]["median_ms"]
    path.write_text(text.replace(repr(median), repr(median * 2 + 1), 1))
    problems = render_docs.check(root)
    assert any("docs/performance.md" in p and "docs/results/plan.json" in p and "'plan'" in p for p in problems), \
        problems
    assert any(p.startswith("README.md") and "docs/results/plan.json" in p for p in problems), problems


def test_a_figure_changed_in_a_page_fails_naming_the_page_and_its_results_file(tmp_path):
    assert PLAN.is_file(), f"{PLAN} is missing: run `{render_docs.BY_NAME['plan'].command}`"
    root = copy_of_the_docs(tmp_path)
    page = root / "docs" / "performance.md"
    text = page.read_text()
    block = re.search(r"<!-- results: plan -->\n(.*?)<!-- /results: plan -->", text, re.S)
    row = next(line for line in block.group(1).splitlines() if line.startswith("| 4 stages"))
    cells = row.split(" | ")
    cells[3] = "0.01"  # the median ms, typed over
    page.write_text(text.replace(row, " | ".join(cells), 1))
    problems = render_docs.check(root)
    assert len(problems) == 1, problems
    assert problems[0].startswith("docs/performance.md: table 'plan'") and "docs/results/plan.json" in problems[0]
    assert "0.01" in problems[0]


def test_a_row_without_its_results_file_is_left_out_and_its_command_listed(tmp_path):
    root = copy_of_the_docs(tmp_path)
    (root / "docs" / "results" / "plan.json").unlink(missing_ok=True)
    results = render_docs.load_all(root)
    readme = render_docs.render_page((root / "README.md").read_text(), "README.md", results)
    table = re.search(r"<!-- results: readme -->\n(.*?)<!-- /results: readme -->", readme, re.S).group(1)
    assert "placement search" not in table and "bench/plan.py" not in table
    perf = render_docs.render_page((root / "docs" / "performance.md").read_text(), "docs/performance.md", results)
    block = re.search(r"<!-- results: plan -->\n(.*?)<!-- /results: plan -->", perf, re.S).group(1)
    assert "|" not in block and f"`{render_docs.BY_NAME['plan'].command}`: not measured yet" in block
    missing = re.search(r"<!-- results: missing -->\n(.*?)<!-- /results: missing -->", perf, re.S).group(1)
    assert render_docs.BY_NAME["plan"].command in missing


def test_rendering_twice_changes_nothing():
    results = render_docs.load_all()
    for page in render_docs.pages():
        once = render_docs.render_page((ROOT / page).read_text(), page, results)
        assert render_docs.render_page(once, page, results) == once, page


def test_every_table_a_page_marks_is_one_the_renderer_knows():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        rel = str(page.relative_to(ROOT))
        for name in re.findall(r"^<!-- results: ([\w.-]+) -->$", page.read_text(), re.M):
            table = render_docs.BY_TABLE.get(name)
            assert table is not None and table.page == rel, f"{rel}: <!-- results: {name} --> is rendered by no table"


def test_every_results_file_holds_its_command_commit_and_date():
    files = sorted((ROOT / "docs" / "results").glob("*.json"))
    assert files, "docs/results/ holds no results file"
    for path in files:
        run = read_results(path)["run"]
        source = render_docs.BY_NAME[path.stem]
        assert run["command"].startswith(f".venv/bin/python {source.bench} "), (path.name, run["command"])
        assert re.fullmatch(r"[0-9a-f]{7,40}", run["commit"] or ""), (path.name, run["commit"])
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", run["date"]), (path.name, run["date"])


def test_a_file_without_a_run_record_is_refused(tmp_path):
    path = tmp_path / "typed.json"
    path.write_text('{"rows": [{"median_ms": 1.0}]}')
    with pytest.raises(ValueError, match="never by hand"):
        read_results(path)


def test_the_recorded_command_is_portable():
    home = Path.home()
    got = command([str(ROOT / "bench" / "decode.py"), "--model", str(home / ".cache" / "moeray" / "m.gguf"),
                   f"--json={ROOT / 'docs' / 'results' / 'x.json'}", "--variant", "a b="])
    assert got == (".venv/bin/python bench/decode.py --model ~/.cache/moeray/m.gguf --json=docs/results/x.json "
                   "--variant 'a b='")


def test_a_path_inside_a_kept_line_of_text_is_made_portable_too():
    """A bench that keeps its server's log lines (serve_hits' plan) writes no one machine's folders."""
    home = Path.home()
    got = portable_values({"plan": [f"profile: {home / '.cache' / 'm.msgpack'} (recorded)", "stage 0: 176 MiB"],
                           "model": str(ROOT / "docs" / "x.gguf")})
    assert got == {"plan": ["profile: ~/.cache/m.msgpack (recorded)", "stage 0: 176 MiB"], "model": "docs/x.gguf"}


MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|home|Users|scratch|mnt|root)/")


def test_no_page_bench_test_or_results_file_names_a_machine_path():
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "NOTICE", ROOT / "Makefile", ROOT / "pyproject.toml",
             *(ROOT / "docs").rglob("*.md"), *(ROOT / "docs" / "results").glob("*.json"), *(ROOT / "bench").glob("*.py"),
             *(ROOT / "tests").rglob("*.py"), *(ROOT / "ray_configs").glob("*")]
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:120]}" for p in files if p.is_file()
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if MACHINE_PATH.search(line)]
    assert not found, "a path of one machine (take it from an argument, PATH or an environment variable):\n" + \
        "\n".join(found)
