"""docs/ARCHITECTURE.md stays readable: its miss path is a section of at most 90 lines around
one diagram of a miss from the front to an engine and back that names each part's module, and
every link to one of its sections (from the docs, the README, the settings' help) lands on a
heading."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
MISS_PATH_MAX_LINES = 90
# The parts of a miss, front to engine and back: the diagram names each one's module.
MISS_PATH_MODULES = (
    "app/cache/region.py",
    "app/cache/misses.py",
    "app/cache/singleflight.py",
    "app/cache/quotas.py",
    "app/queue/requester.py",
    "app/cache/notify.py",
    "app/engines/direct.py",
    "app/engine_process.py",
    "app/engine_side/feeders.py",
    "app/engine_side/heartbeat.py",
    "app/engine_side/claims.py",
    "app/engine_side/scheduler.py",
    "app/queue/ticket.py",
    "app/engine_calls/compute.py",
    "app/engine_calls/engine_runner.py",
    "app/engine_side/interjection.py",
)


def _section(text: str, heading: str) -> list[str]:
    """The lines from ``heading`` up to the next heading of its level (or the end)."""
    lines = text.splitlines()
    start = lines.index(heading)
    level = heading.split(" ", 1)[0] + " "
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(level)), len(lines))
    return lines[start:end]


def _fenced(lines: list[str]) -> list[list[str]]:
    """The fenced blocks among ``lines``, each without its fences."""
    blocks: list[list[str]] = []
    block: list[str] | None = None
    for line in lines:
        if line.startswith("```"):
            if block is None:
                block = []
            else:
                blocks.append(block)
                block = None
        elif block is not None:
            block.append(line)
    return blocks


def _anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings, as GitHub makes them (outside fences)."""
    anchors, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            heading = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", heading).replace(" ", "-"))
    return anchors


def test_the_miss_path_fits_in_90_lines_around_its_diagram() -> None:
    section = _section(ARCHITECTURE.read_text(encoding="utf-8"), "## The miss path")
    assert len(section) <= MISS_PATH_MAX_LINES, (
        f"docs/ARCHITECTURE.md's miss path has {len(section)} lines (at most "
        f"{MISS_PATH_MAX_LINES}): move the details into the modules' docstrings"
    )
    blocks = _fenced(section)
    assert blocks, "the miss path lost its diagram (a fenced block)"
    diagram = "\n".join(line for block in blocks for line in block)
    missing = [module for module in MISS_PATH_MODULES if module not in diagram]
    assert not missing, f"the miss path's diagram does not name {missing}"
    gone = [module for module in MISS_PATH_MODULES if not (ROOT / module).is_file()]
    assert not gone, f"the diagram names modules that no longer exist: {gone}"


def test_the_miss_path_cites_no_issue_numbers() -> None:
    """A reader cannot open the project's issue numbers: the text says what they said."""
    section = "\n".join(_section(ARCHITECTURE.read_text(encoding="utf-8"), "## The miss path"))
    assert not re.search(r"\bissues? \d+", section, re.IGNORECASE)


def test_every_link_into_architecture_lands_on_a_heading() -> None:
    anchors = _anchors(ARCHITECTURE)
    sources = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    sources += sorted((ROOT / "app").rglob("*.py"))
    broken = []
    for source in sources:
        text = source.read_text(encoding="utf-8")
        links = re.findall(r"ARCHITECTURE\.md#([\w-]+)", text)
        if source == ARCHITECTURE:
            links += re.findall(r"\]\(#([\w-]+)\)", text)
        broken += [
            f"{source.relative_to(ROOT)}: #{anchor}" for anchor in links if anchor not in anchors
        ]
    assert not broken, f"links to no heading of docs/ARCHITECTURE.md: {broken}"


def test_architecture_links_to_other_docs_land_on_headings() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    broken = []
    for name, anchor in re.findall(r"\]\(([A-Z][A-Z_]*\.md)#([\w-]+)\)", text):
        target = ARCHITECTURE.parent / name
        if not target.is_file() or anchor not in _anchors(target):
            broken.append(f"{name}#{anchor}")
    assert not broken, f"docs/ARCHITECTURE.md links to no heading: {broken}"
