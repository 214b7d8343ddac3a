"""torch, imported on first use.

`import torch` costs ~0.8 s of a process's start on a 2-core machine: as much as the IO floor
of a small conversion (docs/performance.md). The streaming verbs' fast paths (fp8-to-bf16, shard,
RTN quantize with the C kernels) never touch a tensor library beyond numpy, but the modules they
plan with (schemes, formats, layouts) also hold the torch reference code. Those modules bind
``torch`` to `torch` below instead of importing it: the real module is imported on the first
attribute access (``torch.int8``, ``torch.empty``...), under the import system's own lock, so
threads may race to it. Module-level code in them must therefore not touch ``torch.<attr>``
(`tests/convert/test_startup.py` fails if an RTN quantize process imports torch).
"""

from __future__ import annotations

import importlib
from types import ModuleType


class LazyModule:
    """A stand-in for a module that imports it on first attribute access, then forwards."""

    def __init__(self, name: str):
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str):
        d = self.__dict__
        if attr.startswith("__") or "_name" not in d:  # copy / pickle probes, a half-built instance
            raise AttributeError(attr)
        mod = d.get("_module")
        if mod is None:  # importlib serializes concurrent first imports (per-module import lock)
            mod = d["_module"] = importlib.import_module(d["_name"])
        return getattr(mod, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}{'' if self._module is None else ' (imported)'}>"


torch = LazyModule("torch")

__all__ = ["LazyModule", "torch"]
