"""The layers point only down (issue 13 §1), checked on the import graph so it stays true:
the configuration sits on leaf modules only, the engines import only the shared vocabulary
and their own options, the cache neither the configuration nor the protocols, the protocols
not the cache, and only the entry points import the servers. The roles stay apart: nothing a
front worker imports reaches what only an engine process runs (``app/engine_side/``, the
engine process, an engine's runtime), and a front reaches the engines' implementations only
through ``build_engine``, for the configured engine's identity.

The graph comes from ``ast`` (every ``import``, in functions too, or only those run when a
module is loaded); the configuration's rule is also checked in a fresh interpreter's
``sys.modules``."""

from __future__ import annotations

import ast
import os
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
SERVERS = {"app.web", "app.grpc_server", "app.grpc_kserve", "app.edge", "app.service"}
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


# The roles (app/__init__.py). A front worker's modules: what ``python -m app front`` and
# granian's CLI load (``front_server.load_worker``: ``web.create_front``, ``grpc_server``).
FRONT = {"app.front_server", "app.web", "app.grpc_server", "app.grpc_kserve"}
# What only an engine process (or the combined role) runs: a front never loads it.
ENGINE_ONLY = {"app.engine_process"}
ENGINE_ONLY_PACKAGES = ("app.engine_side",)
# Engine runtimes (third-party): imported only inside the implementations' ``prepare``/``load``,
# which a front's engine (the ``EngineProxy``) never runs.
ENGINE_RUNTIMES = {"paddle", "paddleocr", "paddlex"}
# The engines' interface, shared by both roles; the rest of ``app.engines`` is the
# implementations, which ``build_engine`` imports lazily (a front builds the configured one for
# its identity: fingerprint, description, parameters; it never loads it).
ENGINE_INTERFACE = {
    "app.engines",
    "app.engines.base",
    "app.engines.direct",
    "app.engines.lines",
    "app.engines.redacting",
    "app.engines.tasks",
}
# The one way from a front's modules to the engine side: ``assembly.build`` imports the feeders
# in a function, only where the process feeds (an engine process, the combined role).
FEEDING = {"app.cache.assembly": "app.engine_side"}


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
def imported(module: str, top_level: bool = False) -> frozenset[str]:
    """Every dotted name ``module`` imports (anywhere, or ``top_level``: when it is loaded):
    ``import a.b`` gives ``a.b``, ``from a import b`` gives ``a`` and ``a.b``."""
    tree = ast.parse(MODULES[module].read_text())
    skipped = _skipped(tree, top_level)
    names: set[str] = set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return frozenset(names)


@cache
def imports(module: str, top_level: bool = False) -> frozenset[str]:
    """The ``app`` modules ``module`` imports, with the packages Python loads on the way."""
    found = set()
    for name in imported(module, top_level):
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


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def engine_only(names: set[str] | frozenset[str]) -> set[str]:
    return {n for n in names if n in ENGINE_ONLY or any(_in(n, p) for p in ENGINE_ONLY_PACKAGES)}


def _feeding(module: str, name: str) -> bool:
    """``module`` imports ``name`` only where its process feeds (``FEEDING``: in a function)."""
    package = FEEDING.get(module)
    return package is not None and _in(name, package) and name not in imports(module, True)


@cache
def front() -> dict[str, str]:
    """Every module a front worker may load (its imports in functions too, but for the
    ``FEEDING`` one a front never takes), each with the module that first imports it."""
    importer = dict.fromkeys(FRONT, "")
    todo = sorted(FRONT)
    while todo:
        module = todo.pop()
        for name in sorted(imports(module)):
            if name not in importer and not _feeding(module, name):
                importer[name] = module
                todo.append(name)
    return importer


def _chain(name: str) -> str:
    """How a front reaches ``name``: its import chain from a front module."""
    chain = [name]
    while front()[chain[-1]]:
        chain.append(front()[chain[-1]])
    return " <- ".join(chain)


def third_party(module: str, top_level: bool = False) -> set[str]:
    """The top-level names of the modules outside ``app`` that ``module`` imports."""
    return {name.split(".")[0] for name in imported(module, top_level)} - {"app"}


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


# The cache's side: the cache, the engine call made in this process, the queue's shared part.
CACHE_SIDE = ("app.cache", "app.engine_calls", "app.queue")


def _forbidden(module: str, names: set[str] | frozenset[str]) -> set[str]:
    """What ``module`` (a cache-side or protocol module) must not reach: the configuration, the
    servers, and the other of the two (the cache does not know the protocols, nor they it)."""
    cache_side = any(_in(module, p) for p in CACHE_SIDE)
    other = ("app.protocols",) if cache_side else CACHE_SIDE
    reached = {n for n in names if n in SERVERS or n in CONFIG or any(_in(n, p) for p in other)}
    return reached - (CONFIG if module.startswith("app.protocols") else set())


def test_cache_and_protocols_stay_apart_and_below_the_servers():
    """Their own imports, and everything loading them brings along (the full closure would
    follow ``build_engine``'s lazy imports, which only the wiring calls)."""
    layer = sorted(m for m in MODULES if any(_in(m, p) for p in (*CACHE_SIDE, "app.protocols")))
    for module in layer:
        assert not _forbidden(module, imports(module)), module
        assert not _forbidden(module, closure(module, top_level=True)), module


def test_only_entry_points_import_the_servers():
    servers = SERVERS | {m for m in MODULES if m.startswith("app.routes")}
    for module in MODULES.keys() - ENTRY_POINTS - servers:
        assert not closure(module) & servers, (module, closure(module) & servers)


def test_the_roles_are_declared_as_they_are():
    """The role rules below see real modules: a rename cannot make them vacuous."""
    assert ENGINE_ONLY <= MODULES.keys() and FRONT <= MODULES.keys()
    assert ENGINE_INTERFACE <= MODULES.keys()
    for package in ENGINE_ONLY_PACKAGES:
        assert package in MODULES and len(engine_only(set(MODULES))) > 5
    assert {"app.engines.paddle", "app.engines.serving"} <= MODULES.keys() - ENGINE_INTERFACE
    # The feeding edge is there, in a function: a front's closure leaves out a real edge only.
    for module, package in FEEDING.items():
        assert engine_only({n for n in imports(module) if _in(n, package)}), module
        assert not engine_only(imports(module, top_level=True)), module


def test_a_front_reaches_no_engine_only_module():
    """Nothing a front worker imports, in functions too, reaches what only an engine process
    runs: the feeders and their parts, the jobs' driver (``app/engine_side/``), the engine
    process. The feeders are imported where a process feeds only (``FEEDING``)."""
    reached = engine_only(set(front()))
    assert not reached, "a front reaches " + "; ".join(_chain(n) for n in sorted(reached))
    # And what a front's modules load, whatever their functions do: no way round FEEDING.
    loaded = set().union(*(closure(m, top_level=True) for m in FRONT))
    assert not engine_only(loaded), sorted(engine_only(loaded))


def test_a_front_builds_an_engine_only_through_build_engine():
    """A front imports the engines' implementations only through ``build_engine`` (lazily:
    the configured one, for its identity), never from its own modules."""
    implementations = {m for m in MODULES if _in(m, "app.engines")} - ENGINE_INTERFACE
    for module in sorted(front().keys() - implementations):
        direct = imports(module) & implementations
        if module == "app.engines":  # build_engine: in a function, never when loaded
            assert not imports(module, top_level=True) & implementations
        else:
            assert not direct, f"{_chain(module)} imports {sorted(direct)}"


def test_nothing_a_front_loads_imports_an_engine_runtime():
    """No module of a front imports Paddle or PaddleOCR when loaded; the implementations
    import them in the functions that load the engine (``prepare``, ``load``), which a
    front's ``EngineProxy`` never runs, and no other module of a front imports them at all."""
    implementations = {m for m in MODULES if _in(m, "app.engines")} - ENGINE_INTERFACE
    for module in sorted(front()):
        anywhere = third_party(module) & ENGINE_RUNTIMES
        when_loaded = third_party(module, top_level=True) & ENGINE_RUNTIMES
        assert not when_loaded, f"{_chain(module)} imports {sorted(when_loaded)} when loaded"
        assert module in implementations or not anywhere, f"{_chain(module)}: {anywhere}"


@pytest.mark.integration  # a fresh interpreter, and the configured engine's model files
def test_a_front_loads_no_engine_side_in_a_fresh_interpreter():
    """What a front worker's app really loads (``create_front``, the configured engine built
    for its identity): no engine-only module, no engine runtime."""
    code = (
        "import sys\n"
        "from app.config import Settings\n"
        "from app.web import create_front\n"
        "create_front(Settings.from_env())\n"
        "print('\\n'.join(sys.modules))"
    )
    env = {**os.environ, "REDIS_URL": "", "OTEL_TRACES_EXPORTER": "none"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        check=True, timeout=120,
    ).stdout.split()  # fmt: skip
    assert not engine_only(set(out)), sorted(engine_only(set(out)))
    assert not {m.split(".")[0] for m in out} & ENGINE_RUNTIMES


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
