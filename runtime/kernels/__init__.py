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

Formats (canonical in-memory parts; `cvt.qtensor.layouts` reads every packed on-disk form into them):

  dense         weight
  fp8_block     weight f8e4m3 [n,k], weight_scale_inv [ceil(n/128), ceil(k/128)]     (fp8_block.py)
  w8a8_dynamic  weight i8 [n,k], weight_scale [n,1], weight_offset [n,1] = 0          (int8.py)
  w8a8_static   weight i8, input_scale [1], input_offset [1], deq_scale [n] f32|i64,
                quant_bias i32 [n]                                                   (int8.py)
  w4a16         weight_int4 i8 [n,k] (-8..7), weight_scale [n,k/G], weight_offset    (int4.py)
  w4a8_dynamic  weight_int4 i8 [n,k] (-8..7), weight_scale [n,1]; per-token int8
                activations                                                          (w4a8.py)
  nvfp4         weight_fp4 u8 codes [n,k], weight_scale f8e4m3 [n,k/16],
                weight_global_scale [1]                                              (fp4.py)
  mxfp4         weight_fp4 u8 codes [n,k], weight_scale u8 E8M0 [n,k/32]             (fp4.py)
  mxfp8         weight_fp8 f8e4m3 [n,k], weight_scale u8 E8M0 [n,k/32]; MXFP8 acts   (mx.py)
  w4a4_mxfp4    weight_fp4 u8 codes [n,k], weight_scale u8 E8M0 [n,k/32]; MXFP4 acts (mx.py)
  w4a8_mxfp     as w4a4_mxfp4; MXFP8 activations (for_parts finds mxfp4 for these
                parts: the loader picks by the manifest's kernel_fmt)                (mx.py)
  w4a4_flatquant  weight_int4 i8 [n,k], weight_scale [n,1], left_trans [a,a], right_trans
                [b,b], clip_ratio [1]; Kronecker transform, int4 per-token acts     (flatquant.py)
  w4a4_mxfp4_flatquant  weight_fp4 u8 codes [n,k], weight_scale u8 E8M0 [n,k/32], left_trans,
                right_trans, clip_ratio; Kronecker transform, MXFP4 acts             (flatquant.py)

The Ascend fast path (w8a8_dynamic, w8a8_static, w4a16) lives in npu.py: `prepare_for_npu()`
once at load, then `forward` uses torch_npu when `npu.enabled(x.device)`.
"""

from __future__ import annotations

from cvt.runtime.kernels.linear import FORMATS, Linear, for_parts, get, register

# Importing a format module registers its class (registration order = for_parts search order).
from cvt.runtime.kernels import fp8_block, int8, int4, w4a8, fp4, mx, flatquant, npu  # noqa: E402,F401  isort: skip
from cvt.runtime.kernels.flatquant import W4A4FlatQuantLinear, W4A4MxFp4FlatQuantLinear  # noqa: E402
from cvt.runtime.kernels.fp4 import MxFp4Linear, NvFp4Linear  # noqa: E402
from cvt.runtime.kernels.fp8_block import Fp8BlockLinear  # noqa: E402
from cvt.runtime.kernels.int4 import W4A16Linear  # noqa: E402
from cvt.runtime.kernels.mx import MxFp8Linear, W4A4MxFp4Linear, W4A8MxFpLinear  # noqa: E402
from cvt.runtime.kernels.int8 import W8A8DynamicLinear, W8A8StaticLinear  # noqa: E402
from cvt.runtime.kernels.w4a8 import W4A8DynamicLinear  # noqa: E402

__all__ = ["FORMATS", "Linear", "for_parts", "get", "register", "Fp8BlockLinear", "W8A8DynamicLinear",
           "W8A8StaticLinear", "W4A16Linear", "W4A8DynamicLinear", "NvFp4Linear", "MxFp4Linear",
           "MxFp8Linear", "W4A4MxFp4Linear", "W4A8MxFpLinear", "W4A4FlatQuantLinear",
           "W4A4MxFp4FlatQuantLinear"]
