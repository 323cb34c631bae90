"""The import arrows of docs/ARCHITECTURE.md hold: no cycles between top-level packages, the two node kinds never
import each other, the engine imports nothing above it, the model never imports the parallel code."""

from __future__ import annotations

import ast
from pathlib import Path

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
