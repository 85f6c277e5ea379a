"""The layers point only down (issue 13 §1), checked on the import graph so it stays true:
the configuration sits on leaf modules only, the engines import only the shared vocabulary
and their own options, the cache neither the configuration nor the protocols, the protocols
not the cache, and only the entry points import the servers.

The graph comes from ``ast`` (every ``import``, in functions too, or only those run when a
module is loaded); the configuration's rule is also checked in a fresh interpreter's
``sys.modules``."""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "app"

# Modules that import nothing from app but the vocabulary: what the configuration may use.
LEAVES = {"app.vocabulary", "app.redis_url", "app.redaction"}
# How a setting is read (parsers, sections): on the leaves, under the configuration.
READING = {"app.env"}
# Servers and what only they use; entry points start them.
SERVERS = {"app.web", "app.grpc_server", "app.edge", "app.service"}
ENTRY_POINTS = {"app.__main__", "app.front_server", "app.supervisor", "app.engine_process"}
# What an engine may import besides other engine modules: the vocabulary, the image type of
# ``OcrRequest``, the redaction policy (``engines.redacting``), the wire formats a remote
# engine speaks as a client (pdserving's result string, the pipeline's gRPC stubs), and the
# malloc helpers (``app.memory``, which imports nothing of ours: the engine's freed memory).
ENGINE_MAY_IMPORT = {
    "app",
    "app.memory",
    "app.vocabulary",
    "app.imaging",
    "app.redaction",
    "app.protocols",
    "app.protocols.pdserving",
    "app.protocols.pipeline_stubs",
    "app.tracing",  # the engine's steps as spans (an interface: off, it does nothing)
}


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in APP.rglob("*.py")}
# The configuration's own modules (a package: a module per section).
CONFIG = {m for m in MODULES if m == "app.config" or m.startswith("app.config.")}


def _skipped(tree: ast.Module, top_level: bool) -> set[ast.AST]:
    """Nodes under ``if TYPE_CHECKING:`` (names for annotations, never imported at run time)
    and, for ``top_level``, in functions (imported when called, not when loaded)."""
    skipped: set[ast.AST] = set()
    for node in ast.walk(tree):
        lazy = top_level and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        if lazy or (
            isinstance(node, ast.If)
            and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        ):
            for child in node.body:
                skipped.update(ast.walk(child))
    return skipped


@cache
def imports(module: str, top_level: bool = False) -> frozenset[str]:
    """The ``app`` modules ``module`` imports (anywhere, or ``top_level``: when it is loaded),
    with the packages Python loads on the way."""
    tree = ast.parse(MODULES[module].read_text())
    skipped = _skipped(tree, top_level)
    found = set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return frozenset(name for name in found if name in MODULES and name != module)


def closure(module: str, top_level: bool = False) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for name in imports(todo.pop(), top_level):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def loaded_after_import(*modules: str) -> set[str]:
    """The ``app`` modules in ``sys.modules`` of a fresh interpreter after importing these."""
    code = (
        f"import sys, {', '.join(modules)}\n"
        "print('\\n'.join(m for m in sys.modules if m == 'app' or m.startswith('app.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return set(out.split())


def test_the_graph_sees_every_module():
    assert {"app.config", "app.web", "app.routes.rest", "app.cache.region"} <= MODULES.keys()
    assert "app.vocabulary" in closure("app.config")


def test_leaves_import_nothing_but_the_vocabulary():
    for leaf in LEAVES:
        assert imports(leaf) <= {"app", "app.vocabulary"}, leaf
    assert imports("app.vocabulary") == frozenset()


def test_config_sits_on_leaves_only():
    assert imports("app.env") <= {"app"} | LEAVES
    assert closure("app.config") <= {"app"} | CONFIG | LEAVES | READING


@pytest.mark.integration  # a fresh interpreter: a process (tests/conftest.py)
def test_config_loads_no_more_in_a_fresh_interpreter():
    """What importing the configuration really loads: the same modules as above."""
    assert loaded_after_import("app.config") <= {"app"} | CONFIG | LEAVES | READING


def test_engines_import_only_the_vocabulary_and_their_options():
    engines = sorted(m for m in MODULES if m.startswith("app.engines"))
    for engine in engines:
        outside = {m for m in imports(engine) if not m.startswith("app.engines")}
        assert outside <= ENGINE_MAY_IMPORT, (engine, outside - ENGINE_MAY_IMPORT)
        # What loading it brings along (``build_engine``'s lazy imports are the engines').
        loaded = {m for m in closure(engine, top_level=True) if not m.startswith("app.engines")}
        assert loaded <= ENGINE_MAY_IMPORT, (engine, loaded - ENGINE_MAY_IMPORT)


def _forbidden(module: str, names: set[str] | frozenset[str]) -> set[str]:
    """What ``module`` (a cache or protocol module) must not reach: the configuration, the
    servers, and the other of the two (the cache does not know the protocols, nor they it)."""
    other = "app.protocols" if module.startswith("app.cache") else "app.cache"
    return {
        n for n in names if n in SERVERS or n in CONFIG or n.split(".")[:2] == other.split(".")
    } - (CONFIG if module.startswith("app.protocols") else set())


def test_cache_and_protocols_stay_apart_and_below_the_servers():
    """Their own imports, and everything loading them brings along (the full closure would
    follow ``build_engine``'s lazy imports, which only the wiring calls)."""
    layer = sorted(m for m in MODULES if m.startswith(("app.cache", "app.protocols")))
    for module in layer:
        assert not _forbidden(module, imports(module)), module
        assert not _forbidden(module, closure(module, top_level=True)), module


def test_only_entry_points_import_the_servers():
    servers = SERVERS | {m for m in MODULES if m.startswith("app.routes")}
    for module in MODULES.keys() - ENTRY_POINTS - servers:
        assert not closure(module) & servers, (module, closure(module) & servers)


def test_routes_are_wired_by_create_app_only():
    importers = {m for m in MODULES if any(i.startswith("app.routes.") for i in imports(m))}
    assert importers - {m for m in MODULES if m.startswith("app.routes")} == {"app.web"}


def test_architecture_layout_lists_every_module():
    architecture = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    layout = architecture[architecture.index("## Layout") :]
    layout = layout[: layout.find("\n## ", 1)] if "\n## " in layout[1:] else layout
    paths = sorted(str(p.relative_to(ROOT)) for p in MODULES.values())
    missing = [path for path in paths if f"`{path}`" not in layout]
    assert not missing, f"docs/ARCHITECTURE.md Layout lacks {missing}"


def _declared() -> set[str]:
    """Distribution names pinned in requirements.txt, normalized (PEP 503)."""
    names = set()
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(_normal(line.split("==", 1)[0].split("[", 1)[0]))
    return names


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def test_every_third_party_module_app_imports_is_declared():
    """An import that only works because an unrelated package pulled it in breaks the day
    that package drops it (``cryptography`` once arrived that way): each is pinned itself."""
    from importlib.metadata import packages_distributions

    providers = packages_distributions()
    declared = _declared()
    undeclared = {}
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = {node.module.split(".")[0]}
            else:
                continue
            for top in tops - set(sys.stdlib_module_names) - {"app"}:
                dists = {_normal(d) for d in providers.get(top, [top])}
                if not dists & declared:
                    undeclared.setdefault(top, name)
    assert not undeclared, f"imported by app/ but not in requirements.txt: {undeclared}"
