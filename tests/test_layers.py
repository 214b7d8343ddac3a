"""The layer contract (DESIGN.md "Layers point down") is in pyproject.toml, complete, and kept.

import-linter is the referee: it builds the import graph of the whole package, imports inside
functions included, and checks each contract. This test fails when the code breaks a contract
and when a contract (or a layer of one) is removed from the configuration.
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
    "cvt.api",
    "cvt.export",
    "cvt.quant.stage",
    "cvt.quant.methods : cvt.quant.recipe : cvt.quant.qkernel",
    "cvt.runtime",
    "cvt.convert",
    "cvt.qtensor",
    "cvt.schemas",
    "cvt.units : cvt.registry : cvt.lazy : cvt.dtypes : cvt.version : cvt.extras : cvt.progress : cvt.scratch : cvt.corpus : cvt.world : cvt.hooks",
    "cvt.errors",
]
INDEPENDENT = [
    {"cvt.qtensor.formats.ascend", "cvt.qtensor.formats.compressed_tensors"},
    {"cvt.quant.methods.rtn", "cvt.quant.methods.smoothquant", "cvt.quant.methods.gptq", "cvt.quant.methods.awq"},
    {"cvt.runtime.kernels.int8", "cvt.runtime.kernels.int4", "cvt.runtime.kernels.w4a8", "cvt.runtime.kernels.fp4",
     "cvt.runtime.kernels.fp8_block", "cvt.runtime.kernels.mx"},
    {"cvt.runtime.models.qwen3", "cvt.runtime.models.deepseek_v3", "cvt.runtime.models.deepseek_v4"},
]


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
