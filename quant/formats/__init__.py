"""On-disk formats for quantized weights: one protocol, a registry, one module per format.

A format only renames and lays out a `QuantizedTensor`'s canonical parts (`cvt.quant.schemes`);
it holds no quantization logic, and ``read(module, disk_tensors(module, q), meta) == q``
exactly (same parts, dtypes, shapes, scheme, group size, symmetry, extra).

==================  =====================  ==============================================
format              weights file prefix    metadata
==================  =====================  ==============================================
ascend              quant_model_weights    quant_model_description.json (`description`)
compressed-tensors  model                  config.json "quantization_config"
==================  =====================  ==============================================

Protocol (names are the full tensor names ``f"{module}.{part}"``; the writer shards):

* ``supports(scheme)`` -- None, or raise FormatError saying why and what is supported;
* ``check_shape(module, scheme, shape)`` -- raise naming the module when this format cannot
  store a weight of that shape (e.g. Ascend per-group W4A16 packs pairs of rows: n even);
* ``disk_tensors(module, q, bias=None) -> {name: tensor}`` -- exact names/dtypes/shapes;
* ``read(module, disk, meta) -> QuantizedTensor`` -- the inverse, for the runtime loader
  (``disk`` holds at least the module's tensors; a ``bias`` is the loader's business).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from cvt.registry import Registry
from cvt.errors import FormatError
from cvt.quant.schemes.base import QuantizedTensor


@runtime_checkable
class Format(Protocol):
    name: str
    weights_prefix: str

    def supports(self, scheme) -> None: ...

    def check_shape(self, module: str, scheme, shape: tuple[int, int]) -> None: ...

    def disk_tensors(self, module: str, q: QuantizedTensor,
                     bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]: ...

    def read(self, module: str, disk: dict[str, torch.Tensor], meta=None) -> QuantizedTensor: ...


FORMATS: Registry[type] = Registry("output format", FormatError)
register = FORMATS.register


def format_names() -> list[str]:
    return FORMATS.names()


def get_format(name: str) -> Format:
    return FORMATS.get(name)()


def scheme_name(scheme) -> str:
    """The registry name of a scheme instance (or a name passed as a string)."""
    return scheme if isinstance(scheme, str) else scheme.name


def take(fmt: str, module: str, disk: dict, parts: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """``{part: disk[f"{module}.{part}"]}``, refusing missing tensors with their full names."""
    missing = [f"{module}.{p}" for p in parts if f"{module}.{p}" not in disk]
    if missing:
        raise FormatError(f"{fmt}: module {module!r} lacks tensor(s) {missing}")
    return {p: disk[f"{module}.{p}"] for p in parts}


def expect(fmt: str, name: str, t: torch.Tensor, dtypes, shape=None) -> torch.Tensor:
    """Check a disk tensor's dtype (one of `dtypes`) and, when given, its exact shape."""
    if t.dtype not in tuple(dtypes) or (shape is not None and tuple(t.shape) != tuple(shape)):
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise FormatError(f"{fmt}: tensor {name!r} is {str(t.dtype).replace('torch.', '')} {list(t.shape)}: "
                          f"expected {want}" + (f" {list(shape)}" if shape is not None else ""))
    return t


from cvt.quant.formats import ascend, compressed_tensors  # noqa: E402,F401  isort: skip  (registers)

__all__ = ["FORMATS", "Format", "format_names", "get_format", "register"]
