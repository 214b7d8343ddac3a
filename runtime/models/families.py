"""The runtime model families by config.json model_type: which module builds a config's model
(`family`, `build_model`), and `ConfigError`. Imports no model module (each is imported when
its family is asked for), so `cvt.runtime.kv_cache`, which `base` imports, can look a config's
family up here without an import cycle.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from cvt.convert.arch import text_config
from cvt.errors import CvtError


class ConfigError(CvtError):
    """config.json asks for something the runtime does not implement."""


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
    "qwen3_5_moe_text": "cvt.runtime.models.qwen3_5",
    "qwen3_5_text": "cvt.runtime.models.qwen3_5",
    "qwen3_next": "cvt.runtime.models.qwen3_next",
    "gpt_oss": "cvt.runtime.models.gpt_oss",
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
