"""Reading a Dockerfile the way the tests need it: instructions, stages, ENV and CMD."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            pairs.append((word.upper(), rest.strip()))
    return pairs


def final_stage(dockerfile: Path) -> list[tuple[str, str]]:
    pairs = instructions(dockerfile)
    last_from = max(i for i, (word, _) in enumerate(pairs) if word == "FROM")
    return pairs[last_from:]


def build_args(dockerfile: Path) -> dict[str, str]:
    """ARG defaults."""
    return dict(a.split("=", 1) for w, a in instructions(dockerfile) if w == "ARG" and "=" in a)


def env(dockerfile: Path) -> dict[str, str]:
    """The ENV the final stage sets (KEY=VALUE form; $VAR and ${VAR} expanded like Docker,
    from earlier ENV values, else from this process's environment)."""
    values: dict[str, str] = {}

    def expand(match: re.Match[str]) -> str:
        return values.get(match.group(1), os.environ.get(match.group(1), ""))

    for word, args in final_stage(dockerfile):
        if word == "ENV":
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                values[key] = re.sub(r"\$\{?(\w+)\}?", expand, value)
    return values


def exec_form(dockerfile: Path, instruction: str) -> list[str]:
    """The last ENTRYPOINT or CMD of the final stage (exec form, a JSON array)."""
    return json.loads([a for w, a in final_stage(dockerfile) if w == instruction][-1])
