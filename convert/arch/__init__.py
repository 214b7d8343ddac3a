"""Architecture tables: tensor name pattern -> role, TP split, float-by-default.

`arch_for(config)` picks the table by `model_type` (top level, or under `text_config` for
wrappers such as Kimi-K2.5, whose `WRAPPERS` entry prefixes the text names and adds the
tensors every stage carries through: `cvt.convert.arch.kimi_k25`) and binds it to the config. Quantize, shard, runtime and
export all read these tables; nothing else in cvt knows a tensor name.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, NamedTuple

from cvt.convert.arch import (deepseek_v3, deepseek_v32, deepseek_v4, glm_moe_dsa, gpt_oss, kimi_k25, qwen3, qwen3_5,
                              qwen3_5_wrapper, qwen3_next)
from cvt.convert.arch.base import ArchSpec, ArchTable, Block, Parallel, Role, Rule, TensorInfo
from cvt.errors import ArchError
from cvt.registry import Registry

__all__ = ["ArchSpec", "ArchTable", "Block", "Parallel", "Role", "Rule", "TensorInfo", "arch_for", "carried_names",
           "carried_what", "config_problems", "expert_splits", "families", "register", "release_names", "TABLES"]

TABLES: Registry[ArchTable] = Registry("model_type", ArchError)


class Wrapper(NamedTuple):
    """A wrapper model_type: its display name, (text table, whole config.json) -> the table
    of its checkpoints' names, and the text model_type it wraps."""

    display: str
    wrap: Callable[[ArchTable, Mapping[str, Any]], ArchTable]
    text: str


WRAPPERS = {"kimi_k25": Wrapper(kimi_k25.DISPLAY, kimi_k25.wrap, kimi_k25.TEXT_MODEL_TYPE),
            **{mt: Wrapper(qwen3_5_wrapper.DISPLAY[mt], qwen3_5_wrapper.wrap, text)
               for mt, text in qwen3_5_wrapper.TEXT.items()}}


def register(table: ArchTable) -> None:
    """Add a table under each of its model_types; a model_type claimed twice is an error."""
    for mt in table.model_types:
        if mt in TABLES:
            raise ArchError(f"model_type {mt!r} is already registered by table {TABLES[mt].name!r}")
    for mt in table.model_types:
        TABLES.add(mt, table)


for _t in (deepseek_v3.TABLE, deepseek_v32.TABLE, deepseek_v4.TABLE, glm_moe_dsa.TABLE, qwen3.DENSE, qwen3.MOE,
           qwen3_5.DENSE, qwen3_5.MOE, gpt_oss.TABLE, qwen3_next.TABLE):
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
    table = TABLES[mt]
    wrapper = WRAPPERS.get(config.get("model_type")) if cfg is not config else None
    return ArchSpec(table if wrapper is None else wrapper.wrap(table, config), cfg, mt)


def families() -> list[str]:
    """Every supported family as people name it: each table's display name, in registration
    order, then the wrappers'."""
    tables = list({id(t): t for t in TABLES.values()}.values())  # a table under several model_types: once
    return [t.display for t in tables] + [w.display for w in WRAPPERS.values()]


def carried_names(config: Mapping[str, Any], names) -> list[str]:
    """Of `names`, those a table maps to `Role.CARRIED` (Kimi-K2.5's vision tower and projector,
    DeepSeek-V4's MTP copies of embed / head: copied byte for byte by every stage, replicated, never
    run), in order; [] for a model without them or a config no table reads."""
    try:
        arch = arch_for(config)
    except ArchError:
        return []
    if not any(r.role is Role.CARRIED for r in arch.table.rules):  # (DeepSeek-V4: the MTP embed / head copies)
        return []
    out = []
    for name in names:
        try:
            if arch.classify(name).role is Role.CARRIED:
                out.append(name)
        except ArchError:
            pass  # the stages' survey names it
    return out


def carried_what(names) -> str:
    """What carried tensors `names` are, in a note's words: a vision tower / projector (Kimi-K2.5,
    Qwen3.5), an MTP draft (``mtp.*``: Qwen3.5, Qwen3-Next), or both."""
    mtp = [n.startswith("mtp.") for n in names]
    return "MTP draft" if all(mtp) else "vision tower / projector / MTP draft" if any(mtp) else \
        "vision tower / projector"


def config_problems(config: Mapping[str, Any]) -> list[str]:
    """One line per config.json value no model of its family can have (`cvt.convert.arch.checks`);
    an unknown model_type has none here (`arch_for` refuses it)."""
    cfg = text_config(config)
    mt = cfg.get("model_type")
    table = TABLES[mt] if mt in TABLES else None
    return table.config_checks(cfg) if table is not None and table.config_checks else []


def expert_splits(config: Mapping[str, Any], names) -> dict[str, tuple[str, ...]]:
    """``{stored name: per-expert release names, row block by row block}`` for each of `names` that
    holds fused routed experts (the table's `ArchTable.saved_splits`; "{E}" stays in each name, the
    caller knows the expert count from the stored shape); {} for a per-expert layout or a config
    no table reads. ArchError when a fused tensor's experts are also stored one by one."""
    try:
        splits = [(re.compile(rx), tos) for rx, tos in arch_for(config).table.saved_splits]
    except (ArchError, TypeError):  # a config no table reads: the stages' own checks name its fault
        return {}
    out: dict[str, tuple[str, ...]] = {}
    for name in names:
        for rx, tos in splits:
            if rx.match(name):
                out[name] = tuple(rx.sub(to, name, count=1) for to in tos)
                break
    one_by_one = {k: re.compile("(?:" + "|".join(re.escape(to).replace(re.escape("{E}"), r"\d+") for to in tos) + ")$")
                  for k, tos in out.items()}
    for n in names:
        fused = next((k for k, rx in one_by_one.items() if n not in out and rx.match(n)), None)
        if fused is not None:
            raise ArchError(f"tensor {n} is stored twice: one by one and inside {fused} (the routed experts "
                            "fused); a checkpoint holds one layout or the other")
    return out


def release_names(config: Mapping[str, Any], names) -> dict[str, str]:
    """``{stored name: release name}`` for each of `names` (a checkpoint's) that transformers'
    save_pretrained wrote under another name than the publisher's release (the table's
    `ArchTable.saved_renames`); {} for a release layout or a config no table reads. ArchError when
    a renamed tensor is also stored under its release name (a layout mixing both)."""
    try:
        renames = [(re.compile(rx), to) for rx, to in arch_for(config).table.saved_renames]
    except (ArchError, TypeError):  # a config no table reads (an unhashable model_type too): the
        return {}                   # stages' own checks name its fault
    out: dict[str, str] = {}
    for name in names:
        for rx, to in renames:
            if rx.match(name):
                out[name] = rx.sub(to, name, count=1)
                break
    clash = sorted(set(out.values()) & (set(names) - set(out)))
    if clash or len(set(out.values())) < len(out):
        both = clash[0] if clash else next(v for v in out.values() if list(out.values()).count(v) > 1)
        stored = [k for k, v in out.items() if v == both]
        raise ArchError(f"tensor {both} is stored twice: under the release's name and as {stored[0]} (transformers' "
                        "save_pretrained name); a checkpoint holds one layout or the other")
    return out
