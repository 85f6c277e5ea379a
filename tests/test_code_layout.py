"""The shape of the code, checked by reading it: Lua lives in ``.lua`` files and is sent from
one module only (``app/cache/scripts/``, whichever process sends it); the miss path's modules
and classes stay small enough to read (``app/cache/``, ``app/queue/``, ``app/engine_calls/``,
``app/engine_side/``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

APP = Path(__file__).resolve().parent.parent / "app"
REGISTRY = APP / "cache" / "scripts" / "__init__.py"

# A script sent or loaded: redis-py's methods, or the raw commands.
_SENDS = re.compile(
    r"\.(eval|evalsha|eval_ro|evalsha_ro|register_script|script_load|fcall|fcall_ro)\("
    r"|execute_command\(\s*[\"'](EVAL|EVALSHA|EVAL_RO|EVALSHA_RO|SCRIPT|FCALL|FUNCTION)\b",
    re.I,
)


def _sources() -> list[Path]:
    return sorted(APP.rglob("*.py"))


def test_no_lua_in_python_strings() -> None:
    found = [str(p.relative_to(APP)) for p in _sources() if "redis.call(" in p.read_text()]
    assert not found, f"Lua inside Python (move it to app/cache/scripts/*.lua): {found}"


def test_scripts_are_sent_from_the_registry_only() -> None:
    found = [
        f"{p.relative_to(APP)}:{n}"
        for p in _sources()
        if p != REGISTRY
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if _SENDS.search(line)
    ]
    assert not found, f"scripts sent outside app/cache/scripts/__init__.py: {found}"
    assert _SENDS.search(REGISTRY.read_text())  # the check would see one


# The miss path reads as named parts: no module or class a reader cannot take in at once.
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 250
BOUNDED = (APP / "cache", APP / "queue", APP / "engine_calls", APP / "engine_side")


def _bounded_sources() -> list[Path]:
    return sorted(p for folder in BOUNDED for p in folder.rglob("*.py"))


def test_no_module_over_its_bound() -> None:
    sizes = {p: len(p.read_text().splitlines()) for p in _bounded_sources()}
    over = {str(p.relative_to(APP)): n for p, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_no_class_over_its_bound() -> None:
    over = {}
    for path in _bounded_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    over[f"{path.relative_to(APP)}:{node.name}"] = lines
    assert not over, f"classes over {MAX_CLASS_LINES} lines: {over}"
