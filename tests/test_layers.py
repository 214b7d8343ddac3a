"""The layer contract (DESIGN.md "Layers point down") is in pyproject.toml, complete, and kept.

import-linter is the referee: it builds the import graph of the whole package, imports inside
functions included, and checks each contract. This test fails when the code breaks a contract
and when a contract (or a layer of one) is removed from the configuration, and (through grimp,
import-linter's own graph library) when any modules import each other in a cycle.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]

LAYERS = [  # top to bottom; ":" siblings may import each other, nothing points up
    "cvt.cli",
    "cvt.demo : cvt.demo_model",
    "cvt.testing",
    "cvt.api : cvt.support",
    "cvt.export",
    "cvt.quant.stage",
    "cvt.quant.methods : cvt.quant.recipe : cvt.quant.qkernel",
    "cvt.runtime",
    "cvt.convert",
    "cvt.qtensor",
    "cvt.schemas",
    "cvt.launcher",
    "cvt.units : cvt.registry : cvt.lazy : cvt.dtypes : cvt.version : cvt.extras : cvt.progress : cvt.scratch : cvt.corpus : cvt.world : cvt.hooks",
    "cvt.signals",
    "cvt.errors",
]
INDEPENDENT = [
    {"cvt.qtensor.formats.ascend", "cvt.qtensor.formats.compressed_tensors"},
    {"cvt.quant.methods.rtn", "cvt.quant.methods.smoothquant", "cvt.quant.methods.gptq", "cvt.quant.methods.awq"},
    {"cvt.runtime.kernels.int8", "cvt.runtime.kernels.int4", "cvt.runtime.kernels.w4a8", "cvt.runtime.kernels.fp4",
     "cvt.runtime.kernels.fp8_block", "cvt.runtime.kernels.mx"},
    {"cvt.runtime.models.qwen3", "cvt.runtime.models.deepseek_v3", "cvt.runtime.models.deepseek_v4"},
]


LIBRARY = ["cvt.convert", "cvt.qtensor", "cvt.quant", "cvt.runtime", "cvt.export", "cvt.schemas", "cvt.api", "cvt.support"]


def _contracts() -> list[dict]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert cfg["root_package"] == "cvt"
    return cfg["contracts"]


def test_the_layers_contract_lists_every_layer_in_order():
    layers = [c for c in _contracts() if c["type"] == "layers"]
    assert len(layers) == 1
    assert layers[0]["layers"] == LAYERS
    assert not layers[0].get("ignore_imports") and not layers[0].get("unmatched_ignore_imports_alerting")


def test_the_independence_contracts_are_all_there():
    got = [set(c["modules"]) for c in _contracts() if c["type"] == "independence"]
    assert sorted(map(sorted, got)) == sorted(map(sorted, INDEPENDENT))
    assert not any(c.get("ignore_imports") for c in _contracts())


def test_the_library_may_not_import_the_test_support():
    forbidden = [c for c in _contracts() if c["type"] == "forbidden"]
    assert len(forbidden) == 1
    assert sorted(forbidden[0]["source_modules"]) == sorted(LIBRARY)
    assert forbidden[0]["forbidden_modules"] == ["cvt.testing"]


def test_every_top_level_module_is_in_a_layer():
    """A new module of cvt (or a new top-level folder) gets a place in the layer order."""
    grimp = pytest.importorskip("grimp")
    layered = {m.strip() for layer in LAYERS for m in layer.split(":")}
    graph = grimp.build_graph("cvt", cache_dir=None)
    loose = sorted(m for m in graph.find_children("cvt") if m != "cvt.__main__" and m not in layered
                   and not any(x.startswith(m + ".") for x in layered))
    assert not loose, f"not in the layers contract: {loose}"


def cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without
    recursion): each is a set of modules that import each other, directly or through the others."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def test_cycles_finds_every_cycle_and_nothing_else():
    grimp = pytest.importorskip("grimp")
    g = grimp.ImportGraph()
    for a, b in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.d", "p.a"), ("p.e", "p.f"), ("p.f", "p.e"),
                 ("p.g", "p.d")]:
        g.add_import(importer=a, imported=b)
    assert cycles(g) == [["p.a", "p.b", "p.c"], ["p.e", "p.f"]]


def test_no_module_level_import_cycles():
    """Modules (a package's __init__ counts as one) never import each other in a cycle, imports
    inside functions included: the graph import-linter checks, built by grimp from the installed
    layout (cvt/ with its links to the subpackage folders)."""
    grimp = pytest.importorskip("grimp")
    found = cycles(grimp.build_graph("cvt", cache_dir=None))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_every_subpackage_folder_is_linked_where_import_linter_looks():
    """cvt/convert -> ../convert, ...: an installed cvt's layout, so the graph holds every module."""
    for name in ("convert", "qtensor", "quant", "export", "runtime", "schemas"):
        link = ROOT / "cvt" / name
        assert link.is_symlink() and os.readlink(link) == f"../{name}", link


def test_lint_imports_keeps_every_contract():
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    r = subprocess.run([str(exe), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    n = len(_contracts())
    assert r.returncode == 0 and f"Contracts: {n} kept, 0 broken." in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
