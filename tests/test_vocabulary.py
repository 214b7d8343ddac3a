"""One vocabulary: every scheme, format, target, method and fp4-format name is a string literal
in the one module that defines it; everything else refers to that definition (a registry, a
class's `name`, a constant). Adding a scheme is its scheme file, its layouts and tests.

The allow-list below is the whole set of exceptions, each with why.
"""

from __future__ import annotations

import ast
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("cvt", "convert", "qtensor", "quant", "export", "runtime", "schemas")

ALLOWED: dict[str, tuple[set[str], str]] = {
    "convert/sources.py": ({"compressed-tensors", "mxfp4"},
                           "source configs' quant_method values (the c-t library's word; gpt-oss's release's)"),
    "cvt/testing/checkpoints_gpt_oss.py": ({"mxfp4"}, "gpt-oss's release config: quant_method \"mxfp4\""),
    "convert/fp4.py": ({"fp4"}, "DeepSeek-V4's config.json expert_dtype value (the release's word)"),
    "convert/placement.py": ({"mindie"}, "the MindIE expert-placement JSON flavour, not the serving target"),
    "cvt/demo.py": ({"w8a8", "w4a16", "ascend", "compressed-tensors"},
                    "the demo's own pipeline: which schemes and formats it shows, as a user would type them"),
    "qtensor/formats/ascend.py": ({"w8a8", "w4a16"}, "MindIE's config.json `quantize` values (atb_llm's words)"),
    "qtensor/kernel_formats.py": ({"w4a16", "nvfp4", "mxfp4", "mxfp8", "w4a4_mxfp4", "w4a8_mxfp", "w4a4_flatquant",
                                   "w4a4_mxfp4_flatquant"},
                                  "kernel formats that share a word with a scheme or fp4 format"),
    "schemas/manifest.py": ({"ascend", "compressed-tensors"},
                            "the manifest schema's enum (schemas sit below the registries; held equal below)"),
}


def _owners() -> dict[str, str]:
    """name -> the module (path relative to the repo) that defines it."""
    from cvt.quant.recipe import METHODS
    from cvt.qtensor.formats import format_names
    from cvt.qtensor.layouts import ASCEND_TARGETS
    from cvt.qtensor.schemes import SCHEMES
    from cvt.qtensor.schemes.fp4 import GROUPS

    owners = {}
    for name in SCHEMES.names():
        owners[name] = str(Path(SCHEMES.get(name).__module__.replace("cvt.", "", 1).replace(".", "/") + ".py"))
    owners.update({n: "qtensor/layouts/base.py" for n in (*format_names(), *ASCEND_TARGETS)})
    owners.update({n: "quant/recipe.py" for n in METHODS})
    owners.update({n: "qtensor/kernel_formats.py" for n in GROUPS})
    return owners


def _literals(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def test_names_are_literals_only_where_they_are_defined():
    owners = _owners()
    assert len(owners) >= 15, owners  # 5 schemes, 2 formats, 2 targets, 4 methods, 2 fp4 formats
    stray = []
    for top in LIBRARY:
        for path in sorted((ROOT / top).rglob("*.py")):
            if top == "cvt" and path.relative_to(ROOT / "cvt").parts[0] in LIBRARY[1:]:
                continue  # cvt/convert -> ../convert: the same files, read once
            rel = str(path.relative_to(ROOT))
            allowed = ALLOWED.get(rel, (set(), ""))[0]
            for line, value in _literals(path):
                if value in owners and owners[value] != rel and value not in allowed:
                    stray.append(f"{rel}:{line}: {value!r} (defined in {owners[value]})")
    assert not stray, "\n".join(stray)


def test_the_allow_list_is_needed_and_explained():
    """Each exception still occurs (a stale entry would hide a new stray literal) and says why."""
    owners = _owners()
    for rel, (names, why) in ALLOWED.items():
        found = {v for _, v in _literals(ROOT / rel)} & set(owners)
        assert names <= found and len(why) > 20, (rel, names - found)


def test_the_manifest_enum_is_the_format_registry():
    from cvt.qtensor.formats import format_names
    from cvt.schemas.manifest import QuantInfo

    assert sorted(typing.get_args(QuantInfo.model_fields["format"].annotation)) == format_names()
