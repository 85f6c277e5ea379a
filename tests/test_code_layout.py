"""The shape of the code, checked by reading it: Lua lives in ``.lua`` files and is sent from
one module only (``app/cache/scripts/``)."""

from __future__ import annotations

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
