"""The kernel registry (engine/kernels.py): `resolve` answers every (request, parallelism, device, interpreter) cell
as expected, refuses with the reason, and names code that exists; docs/ARCHITECTURE.md holds exactly its rendered
table; README's `--kernels` row and the node flag's help say what it says; the engine and the SPMD wrappers ask it."""

from __future__ import annotations

import argparse
import ast
import importlib
import itertools

import pytest

from engine import kernels
from engine.kernels import KernelRefusal, cell, resolve
from tests.conftest import REPO_ROOT

# (request, parallelism) -> set on (cpu, cpu + interpreter, cuda, cuda + interpreter); "refused" for a refusal
EXPECTED = {
    ("auto", "single"): ("reference", "reference", "fast", "fast"),
    ("auto", "tp"): ("reference",) * 4,
    ("auto", "dcp"): ("reference",) * 4,
    ("reference", "single"): ("reference",) * 4,
    ("reference", "tp"): ("reference",) * 4,
    ("reference", "dcp"): ("reference",) * 4,
    ("fast", "single"): ("refused", "fast", "fast", "fast"),
    ("fast", "tp"): ("refused", "fast", "fast", "fast"),
    ("fast", "dcp"): ("refused", "fast", "fast", "fast"),
}
PLACES = (("cpu", False), ("cpu", True), ("cuda", False), ("cuda", True))
CASES = [(req, par, dev, interp, want[i]) for (req, par), want in EXPECTED.items()
         for i, (dev, interp) in enumerate(PLACES)]


@pytest.mark.parametrize("requested,parallelism,device,interpreter,expected", CASES,
                         ids=[f"{r}-{p}-{d}{'-interp' if i else ''}" for r, p, d, i, _ in CASES])
def test_resolve_answers_each_cell(requested: str, parallelism: str, device: str, interpreter: bool,
                                   expected: str) -> None:
    if expected == "refused":
        with pytest.raises(KernelRefusal, match="kernels='fast' needs a CUDA device") as refused:
            resolve(requested, parallelism, device, interpreter)
        assert "TRITON_INTERPRET=1" in refused.value.reason
        return
    choice = resolve(requested, parallelism, device, interpreter)
    assert (choice.kernels, choice.parallelism, choice.device) == (expected, parallelism, device)
    assert choice.prefill == cell(expected, parallelism, "prefill", device)
    assert choice.decode == cell(expected, parallelism, "decode", device)


def test_refusals_carry_their_reason() -> None:
    with pytest.raises(KernelRefusal, match="kernels='triton' is unknown; choose one of: auto, reference, fast"):
        resolve("triton", "single", "cuda", False)
    with pytest.raises(KernelRefusal, match="needs the triton package") as refused:
        resolve("fast", "single", "cuda", False, has_triton=False)
    assert refused.value.requested == "fast" and isinstance(refused.value, ValueError)
    assert resolve("auto", "single", "cuda", False, has_triton=False).kernels == "reference"  # auto never refuses
    with pytest.raises(KernelRefusal, match="cannot run here: no switch"):
        resolve("fast", "tp", "cuda", False, unfit="no switch")
    assert resolve("auto", "single", "cuda", False, unfit="no switch").kernels == "reference"
    assert resolve(None, "single", "cuda:1", False).device == "cuda"
    with pytest.raises(ValueError, match="unknown parallelism 'pp'"):
        resolve("auto", "pp", "cpu", False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no kernels for device 'mps'"):
        resolve("auto", "single", "mps", False)


def test_the_table_has_one_cell_each_naming_code_that_exists() -> None:
    keys = [(c.kernels, c.parallelism, c.phase, c.device) for c in kernels.TABLE]
    assert sorted(keys) == sorted(itertools.product(kernels.KERNEL_SETS, kernels.PARALLELISMS, kernels.PHASES,
                                                    kernels.DEVICES))
    for c in kernels.TABLE:
        module, _, qualname = c.runs.partition(":")
        target: object = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
        assert callable(target), c.runs
        assert c.needs_interpreter == (c.kernels == "fast" and c.device == "cpu")
        # the fast set's DCP prefill is the reference one (the fast prefill writes whole rows); every other cell
        # runs its own set's kernels
        assert c.runs_set == ("reference" if (c.kernels, c.parallelism, c.phase) == ("fast", "dcp", "prefill")
                              else c.kernels), c


def test_the_registry_imports_no_torch() -> None:
    tree = ast.parse((REPO_ROOT / "engine/kernels.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "importlib.util", "os", "collections.abc", "dataclasses", "typing"}, imported


def test_architecture_holds_exactly_the_rendered_table() -> None:
    text = (REPO_ROOT / "docs/ARCHITECTURE.md").read_text()
    assert text.count(kernels.TABLE_BEGIN) == 1 and text.count(kernels.TABLE_END) == 1
    between = text.split(kernels.TABLE_BEGIN)[1].split(kernels.TABLE_END)[0]
    assert between.strip("\n") == kernels.render_markdown(), (
        "docs/ARCHITECTURE.md's kernel table is stale: paste engine.kernels.render_markdown() between its markers")


def test_readme_and_the_flag_say_what_the_registry_says() -> None:
    rows = [line for line in (REPO_ROOT / "README.md").read_text().splitlines() if "`--kernels" in line]
    assert len(rows) == 1, rows
    assert kernels.auto_summary() in rows[0] and "docs/ARCHITECTURE.md" in rows[0]
    assert kernels.auto_summary() == "auto (the default) is fast for a single rank on cuda, reference elsewhere"
    from node.cli import add_common_flags
    from node.settings import NodeSettings

    parser = argparse.ArgumentParser()
    add_common_flags(parser)
    flag = next(a for a in parser._actions if "--kernels" in a.option_strings)
    assert flag.help == kernels.cli_help() and tuple(flag.choices) == kernels.REQUESTS
    assert [NodeSettings(kernels=request).engine.kernels for request in kernels.REQUESTS] == list(kernels.REQUESTS)
    with pytest.raises(ValueError, match="kernels must be one of auto, reference, fast"):
        NodeSettings(kernels="triton")


def test_engine_and_wrappers_ask_the_registry(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from engine.engine import Engine, EngineConfig
    from engine.parallel.spmd import DCPModel, TimedModel, TPModel

    assert (TimedModel.parallelism, TPModel.parallelism, DCPModel.parallelism) == ("single", "tp", "dcp")
    engine = Engine(EngineConfig(num_rows=8, kernels="reference"))
    assert engine.kernel_choice == resolve("reference", "single", "cpu", False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(KernelRefusal, match=r"runs single, the engine tp \(tp_size=2"):
        Engine(EngineConfig(num_rows=8, tp_size=2, kernels="fast"))  # the plain model over a TP layout
    assert Engine(EngineConfig(num_rows=8, tp_size=2)).kernels == "reference"


def test_every_multi_rank_cell_runs_on_the_rank_shard() -> None:
    """A TP or DCP rank holds its shard with either kernel set (the fast steps copy it: engine/parallel/fast_*.py),
    one rank the whole model; the wrappers refuse a rank's model that is not its shard."""
    import torch

    from engine.model.config import get_preset
    from engine.model.model import KimiModel
    from engine.model.shards import ShardSpec
    from engine.parallel.groups import ParallelContext
    from engine.parallel.spmd import TPModel

    for c in kernels.TABLE:
        assert c.weights == ("whole" if c.parallelism == "single" else "shard"), c
    ctx = ParallelContext(rank=1, world_size=2, group=None, device=torch.device("cpu"), backend="gloo")
    for spec in (ShardSpec(), ShardSpec(2, 0)):  # the whole model, another rank's shard
        with torch.device("meta"):
            model = KimiModel(get_preset("kimi-k3.1-mini"), spec)
        with pytest.raises(ValueError, match=r"build it with ShardSpec\(2, 1\)"):
            TPModel(model, ctx, 1)
