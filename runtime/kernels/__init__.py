"""Linear kernels: one `Linear` interface, one implementation per weight format.

Every linear layer of every runtime model is a `Linear` (dense float weight). The loader
replaces a module by the format class that matches the parts a checkpoint stores for it
(e.g. `weight` + `weight_scale_inv` -> `fp8_block`), so model code never branches on
formats. Each format class:

* declares `fmt` (registry name) and `parts` (the canonical tensor names it needs);
* is built with `from_parts(parts: dict[str, Tensor], bias: Tensor | None)`;
* implements `forward(x [..., in_features]) -> [..., out_features]` in x's dtype, with a
  torch reference implementation (CPU/CUDA) and, where `cvt.runtime.kernels.npu` applies,
  the Ascend fused op behind the same interface;
* implements `dense_weight() -> float32 [out, in]` (MLA absorption and verify's SQNR use it).

Registry: `register(cls)` fails on a duplicate name; `get(name)` lists the known names
when the name is unknown; `for_parts(names)` picks the format whose parts match exactly.
"""

from __future__ import annotations

from cvt.runtime.kernels.linear import FORMATS, Linear, for_parts, get, register

# Importing a format module registers its class (registration order = for_parts search order).
from cvt.runtime.kernels import fp8_block, int8, int4, fp4, npu  # noqa: E402,F401  isort: skip
from cvt.runtime.kernels.fp4 import MxFp4Linear, NvFp4Linear  # noqa: E402
from cvt.runtime.kernels.fp8_block import Fp8BlockLinear  # noqa: E402
from cvt.runtime.kernels.int4 import W4A16Linear  # noqa: E402
from cvt.runtime.kernels.int8 import W8A8DynamicLinear, W8A8StaticLinear  # noqa: E402

__all__ = ["FORMATS", "Linear", "for_parts", "get", "register", "Fp8BlockLinear", "W8A8DynamicLinear",
           "W8A8StaticLinear", "W4A16Linear", "NvFp4Linear", "MxFp4Linear"]
