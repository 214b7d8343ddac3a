"""Runtime model families, by config.json model_type.

Each family module defines `Args` (a `ModelArgs` dataclass read strictly from config.json)
and `Model(args, dtype=None, device=None)` following the contract in `base.py`.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from cvt.convert.arch import text_config
from cvt.runtime.models.base import ConfigError

FAMILIES = {
    "deepseek_v3": "cvt.runtime.models.deepseek_v3",
    "kimi_k2": "cvt.runtime.models.deepseek_v3",
    "deepseek_v32": "cvt.runtime.models.deepseek_v32",
    "glm_moe_dsa": "cvt.runtime.models.glm_moe_dsa",
    "deepseek_v4": "cvt.runtime.models.deepseek_v4",
    "qwen3_moe": "cvt.runtime.models.qwen3",
    "qwen3": "cvt.runtime.models.qwen3",
    "qwen2": "cvt.runtime.models.qwen3",
    "llama": "cvt.runtime.models.qwen3",
}


def family(config: Mapping[str, Any]):
    """(module, text config) for a config.json; ConfigError for an unsupported model_type."""
    cfg = text_config(config)
    mt = cfg.get("model_type")
    if mt not in FAMILIES:
        raise ConfigError(f"config.json model_type {mt!r} has no runtime model (supported: {', '.join(sorted(FAMILIES))})")
    return importlib.import_module(FAMILIES[mt]), cfg


def build_model(config: Mapping[str, Any], dtype=None, device=None):
    mod, cfg = family(config)
    return mod.Model(mod.Args.from_config(cfg), dtype=dtype, device=device)
