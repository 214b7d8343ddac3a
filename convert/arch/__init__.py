"""Architecture tables: tensor name pattern -> role, TP split, float-by-default.

`arch_for(config)` picks the table by `model_type` (top level, or under `text_config` for
wrappers such as Kimi-K2.5) and binds it to the config. Quantize, shard, runtime and
export all read these tables; nothing else in cvt knows a tensor name.
"""

from __future__ import annotations

from typing import Any, Mapping

from cvt.convert.arch import deepseek_v3, deepseek_v32, deepseek_v4, qwen3
from cvt.convert.arch.base import ArchSpec, ArchTable, Block, Parallel, Role, Rule, TensorInfo
from cvt.errors import ArchError
from cvt.registry import Registry

__all__ = ["ArchSpec", "ArchTable", "Block", "Parallel", "Role", "Rule", "TensorInfo", "arch_for", "config_problems",
           "register", "TABLES"]

TABLES: Registry[ArchTable] = Registry("model_type", ArchError)


def register(table: ArchTable) -> None:
    """Add a table under each of its model_types; a model_type claimed twice is an error."""
    for mt in table.model_types:
        if mt in TABLES:
            raise ArchError(f"model_type {mt!r} is already registered by table {TABLES[mt].name!r}")
    for mt in table.model_types:
        TABLES.add(mt, table)


for _t in (deepseek_v3.TABLE, deepseek_v32.TABLE, deepseek_v4.TABLE, qwen3.DENSE, qwen3.MOE):
    register(_t)


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config: `text_config` when the top level is a wrapper."""
    inner = config.get("text_config")
    if isinstance(inner, Mapping) and config.get("model_type") not in TABLES:
        return inner
    return config


def arch_for(config: Mapping[str, Any]) -> ArchSpec:
    cfg = text_config(config)
    mt = cfg.get("model_type")
    if mt not in TABLES:
        raise ArchError(f"config.json model_type {mt!r} is not supported (supported: {', '.join(TABLES.names())})")
    return ArchSpec(TABLES[mt], cfg, mt)


def config_problems(config: Mapping[str, Any]) -> list[str]:
    """One line per config.json value no model of its family can have (`cvt.convert.arch.checks`);
    an unknown model_type has none here (`arch_for` refuses it)."""
    cfg = text_config(config)
    mt = cfg.get("model_type")
    table = TABLES[mt] if mt in TABLES else None
    return table.config_checks(cfg) if table is not None and table.config_checks else []
