"""Runtime model families, by config.json model_type.

Each family module defines `Args` (a `ModelArgs` dataclass read strictly from config.json)
and `Model(args, dtype=None, device=None)` following the contract in `base.py`; `families.py`
maps a config to its family.
"""

from __future__ import annotations

from cvt.runtime.models.families import FAMILIES, ConfigError, build_model, family

__all__ = ["FAMILIES", "ConfigError", "build_model", "family"]
