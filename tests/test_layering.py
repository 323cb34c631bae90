"""The import arrows of docs/ARCHITECTURE.md hold: no cycles between top-level packages, the two node kinds never
import each other, the engine imports nothing above it, the model never imports the parallel code, no product package imports
transformers (the tests' oracle); inside node/ and
the hand-off's packages the modules form a DAG, and node/ knows the KV transport only as its Protocol and holds
neither half of a hand-off (prefill_node/ exports, decode_node/ imports)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

ALLOWED = {
    "serving": set(),
    "engine": set(),
    "kv_transfer": {"engine", "serving"},
    "node": {"engine", "kv_transfer", "serving"},
    "prefill_node": {"node", "kv_transfer", "engine", "serving"},
    "decode_node": {"node", "kv_transfer", "engine", "serving"},
    "router": {"kv_transfer", "serving"},
    "loadgen": {"serving"},
    "sim": {"cluster", "router", "loadgen", "engine", "kv_transfer", "serving"},
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _package_imports(package: str) -> dict[str, set[str]]:
    """Imported module name -> the files of `package` that import it."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO_ROOT / package).rglob("*.py")):
        for name in _imports(path):
            found.setdefault(name, set()).add(str(path.relative_to(REPO_ROOT)))
    return found


def test_packages_import_only_what_the_architecture_allows() -> None:
    ours = {p.name for p in REPO_ROOT.iterdir() if (p / "__init__.py").exists() and p.name != "tests"}
    breaks = []
    for package, allowed in ALLOWED.items():
        for module, files in _package_imports(package).items():
            top = module.split(".")[0]
            if top in ours and top != package and top not in allowed:
                breaks.append(f"{package} imports {module} ({', '.join(sorted(files))})")
    assert not breaks, "\n".join(breaks)


PRODUCT = ("serving", "engine", "kv_transfer", "node", "prefill_node", "decode_node", "router", "cluster", "loadgen",
           "pdcluster")
"""Product packages: what ships and runs in a server (tests and benchmarks are not)."""


def test_product_code_never_imports_transformers() -> None:
    """transformers is the tests' oracle (tests/checkpoints.py), never a dependency of what serves a checkpoint."""
    bad = sorted(f for package in PRODUCT if (REPO_ROOT / package).is_dir()
                 for module, files in _package_imports(package).items() if module.split(".")[0] == "transformers"
                 for f in files)
    assert not bad, f"product code imports transformers: {bad}"


def test_model_never_imports_parallel_code() -> None:
    bad = {m: f for m, f in _package_imports("engine/model").items() if m.startswith("engine.parallel")}
    assert not bad, bad


def _module_file(module: str) -> Path | None:
    """The file of one of our modules (None: not ours)."""
    base = REPO_ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    return None


def _imports_torch(module: str, seen: set[str]) -> list[str]:
    """The chain of our modules through which `module` imports torch (empty: it does not), package __init__s
    included, every import counted (lazy ones too)."""
    parts = module.split(".")
    for name in [".".join(parts[:i]) for i in range(1, len(parts))] + [module]:
        if name in seen:
            continue
        seen.add(name)
        path = _module_file(name)
        if path is None:
            continue
        for imported in sorted(_imports(path)):
            if imported.split(".")[0] in ("torch", "triton"):
                return [name, imported]
            chain = _imports_torch(imported, seen)
            if chain:
                return [name, *chain]
    return []


def test_engine_api_imports_no_torch() -> None:
    """engine/api.py (sampling params, engine config, the rank protocol) is what torch-free code (the node's HTTP
    layer) uses of the engine: neither it nor anything it imports may import torch."""
    chain = _imports_torch("engine.api", set())
    assert not chain, " -> ".join(chain)


def _intra_package_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (lazy imports too), for `package`'s own modules."""
    graph: dict[str, set[str]] = {}
    for path in sorted((REPO_ROOT / package).rglob("*.py")):
        module = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
        graph[module] = {name for name in _imports(path) if name.startswith(f"{package}.") and _module_file(name)}
    return graph


def _a_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` as a path that ends where it starts (empty: the graph is a DAG)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str]:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == 1:
                return path[path.index(imported):] + [imported]
            if imported not in state:
                cycle = visit(imported)
                if cycle:
                    return cycle
        path.pop()
        state[module] = 2
        return []

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return []


@pytest.mark.parametrize("package", ["node", "prefill_node", "decode_node", "kv_transfer"])
def test_modules_inside_a_node_package_import_without_cycles(package: str) -> None:
    """node/ (and the hand-off's other packages) form a DAG of modules: runtime -> worker -> rank, app -> runtime,
    never back (worker <-> runtime was one cycle)."""
    cycle = _a_cycle(_intra_package_graph(package))
    assert not cycle, " -> ".join(cycle)


def _transport_implementations() -> set[str]:
    """kv_transfer modules that define a concrete KV transport (a class with `post_read` that is not a Protocol)."""
    found = set()
    for path in sorted((REPO_ROOT / "kv_transfer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef) or any(getattr(b, "id", None) == "Protocol" for b in node.bases):
                continue
            if any(isinstance(f, ast.FunctionDef) and f.name == "post_read" for f in node.body):
                found.add(".".join(path.relative_to(REPO_ROOT).with_suffix("").parts))
    return found


def test_node_knows_the_transport_only_by_its_protocol() -> None:
    """node/ (shared by both node kinds) never imports a concrete transport: its rank worker sees
    `kv_transfer.transport.KVTransport`, and the node packages' rank roles build NIXL and pass it in."""
    implementations = _transport_implementations()
    assert "kv_transfer.nixl_agent" in implementations
    bad = {m: f for m, f in _package_imports("node").items() if m in implementations}
    assert not bad, bad


HANDOFF_HALVES = {"kv_transfer.lease", "kv_transfer.reads", "kv_transfer.importer", "kv_transfer.remap",
                  "kv_transfer.side_channel", "kv_transfer.exporter", "kv_transfer.rank_exporter"}
"""The export half (leases, side channel) and the import half (plan, READs) of a hand-off: prefill_node's and
decode_node's, never node/'s."""


def test_node_holds_neither_half_of_a_handoff() -> None:
    bad = {m: f for m, f in _package_imports("node").items() if m in HANDOFF_HALVES}
    assert not bad, bad


ENGINE_BUILDERS = {"engine.engine", "engine.rank_engine", "engine.parallel.spmd", "engine.model.weights",
                   "engine.runner", "engine.scheduler", "engine.cache"}
"""Engine modules that build or drive an engine: the rank's engine is engine/rank_engine.py's, built in the rank
process from the factory's name, and node/ holds no mirror of it."""


def test_node_builds_no_engine_and_names_the_engines_factory() -> None:
    """node/ imports nothing that builds or drives an engine (the backend mirror that wrapped `Engine` is gone): its
    rank worker loads the factory by name and hands every command to the engine's own `apply`."""
    bad = {m: f for m, f in _package_imports("node").items() if m in ENGINE_BUILDERS}
    assert not bad, bad
    from engine.rank_engine import build_rank_engine
    from node.worker import REFERENCE_ENGINE, load

    assert load(REFERENCE_ENGINE) is build_rank_engine


def _class_methods(path: Path, names: set[str] | None = None) -> set[str]:
    """Public method and property names of the classes of `path` (of those named in `names`, when given)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and (names is None or node.name in names):
            found |= {f.name for f in node.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")}
            found |= {f.target.id for f in node.body if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)}
    return found


def test_node_drives_the_engine_only_through_its_rank_surface() -> None:
    """No node/ code calls an `Engine` method outside engine/api.py's `RankEngine` (`apply`, `import_kv`,
    `step_events`, `rank_stats`), so no node class can translate commands into engine calls one to one. Names that
    node/'s own classes define (a hand-off's `abort`, a role's `step`) are theirs, not the engine's."""
    engine_only = (_class_methods(REPO_ROOT / "engine" / "engine.py", {"Engine"})
                   - _class_methods(REPO_ROOT / "engine" / "api.py", {"RankEngine"})
                   - {m for path in (REPO_ROOT / "node").rglob("*.py") for m in _class_methods(path)})
    assert {"add_request", "start_decode", "allocate_for_import", "prefill_and_keep"} <= engine_only
    calls = sorted(f"{path.relative_to(REPO_ROOT)}:{node.lineno} .{node.func.attr}()"
                   for path in sorted((REPO_ROOT / "node").rglob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in engine_only)
    assert not calls, calls
