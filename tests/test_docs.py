"""The README and docs/ as a reader meets them: every relative link reaches a file (and a heading,
when it names one), the README stays a short front door, and no page keeps a session log."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # a '#' in a code block is no heading
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_every_relative_link_reaches_a_file_and_its_heading():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no file {file}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/ (at most 250)"
    assert "make demo" in "\n".join(lines) and "make test" in "\n".join(lines)


# What a lab notebook leaves behind: wall-clock sittings, dates, machine load, the value a figure
# "was", session and issue numbers.
SESSION_LOG = re.compile(r"\b\d{1,2}:\d{2}(?:–\d{1,2}:\d{2})? UTC\b|\bload average\b|\bsession \d+\b|"
                         r"\bissue \d+\b|\bthe issue's\b|\bsitting\b|\b20\d\d-[01]\d-[0-3]\d\b|"
                         r"\b(?:1-minute |one-minute )?load \d+(?:\.\d+)?\b|\(was \d|[,;] was \d", re.I)


def test_no_page_keeps_a_session_log():
    found = [f"{page.relative_to(ROOT)}:{n}: {m.group(0)!r}"
             for page in PAGES for n, line in enumerate(page.read_text().splitlines(), 1)
             for m in [SESSION_LOG.search(line)] if m]
    assert not found, "history belongs to git, not the docs:\n" + "\n".join(found)
