"""Typed models for every file cvt writes, and their JSON Schema files.

`SCHEMAS` maps a schema file name to its pydantic model; `write_schema_files()`
regenerates the checked-in `*.schema.json` files; `load_schema(name)` reads one.
"""

from __future__ import annotations

import json
from pathlib import Path

from cvt.schemas.parallel_layout import Layout
from cvt.schemas.manifest import Manifest
from cvt.schemas.report import Report

HERE = Path(__file__).parent
SCHEMAS = {"layout.schema.json": Layout, "manifest.schema.json": Manifest, "report.schema.json": Report}


def schema_json(model) -> str:
    return json.dumps(model.model_json_schema(), indent=2, sort_keys=True) + "\n"


def load_schema(name: str) -> dict:
    return json.loads((HERE / name).read_text())


def write_schema_files(folder: Path = HERE) -> list[Path]:
    out = []
    for name, model in SCHEMAS.items():
        path = folder / name
        path.write_text(schema_json(model))
        out.append(path)
    return out
