"""`mxfp8`, `w4a4_mxfp4`, `w4a8_mxfp`: the Ascend 950 microscaling linears (W8A8_MXFP8,
W4A4_MXFP4, W4A8_MXFP), weights and activations in blocks of 32 along k with E8M0 scales.

Canonical in-memory parts (`cvt.qtensor.schemes.mx`; `cvt.qtensor.layouts.entries_mx` reads
the packed on-disk forms into them):

* ``mxfp8``: ``weight_fp8`` float8_e4m3fn ``[n, k]``, ``weight_scale`` uint8 E8M0 ``[n, k/32]``;
* ``w4a4_mxfp4`` / ``w4a8_mxfp``: ``weight_fp4`` uint8 E2M1 codes ``[n, k]`` (unpacked),
  ``weight_scale`` uint8 E8M0 ``[n, k/32]``.

The weight is ``element * 2**(e - 127)`` per block (`dense_weight`, exactly the scheme's
dequantize). vllm-ascend quantizes the activations per token block with ``npu_dynamic_mx_quant``
(MXFP8 for W8A8_MXFP8 and W4A8_MXFP, MXFP4 for W4A4_MXFP4) and runs ``npu_quant_matmul`` with
both E8M0 scale sets; the reference here is msModelSlim's MX fake-quant linear
(``ir/w8a8_mx_dynamic.py`` W8A8MXDynamicPerBlockFakeQuantLinear.forward and its w4a4 / w4a8
siblings): ``x`` quantize-dequantized per block of 32 by the same rules as the weights
(`cvt.qtensor.mx`), then ``y = x^ @ w^T (+ bias)`` in float32, returned in x's dtype. The
products of MX values are exact in float32; the sum order is torch's. No fused Ascend path.
"""

from __future__ import annotations

import torch

from cvt.errors import TensorError
from cvt.qtensor import kernel_formats as KF
from cvt.qtensor import mx as MX
from cvt.qtensor.primitives import decode_e2m1
from cvt.runtime.kernels._common import FusedOrReference, check, check_2d, desc, new_module, take
from cvt.runtime.kernels.linear import Linear, register


class _MxLinear(FusedOrReference, Linear):
    code_part = "weight_fp4"
    code_dtype = torch.uint8
    act = MX.FP8

    @classmethod
    def from_parts(cls, parts, bias=None):
        p = take(cls.fmt, cls.parts, parts)
        codes = p[cls.code_part]
        n, k = check_2d(cls.fmt, cls.code_part, codes, (cls.code_dtype,))
        if k % MX.BLOCK:
            raise TensorError(f"{cls.fmt} part {cls.code_part!r} is {desc(codes)}: in_features must be a multiple "
                              f"of the block {MX.BLOCK}")
        if cls.code_dtype == torch.uint8 and bool((codes > 15).any()):
            raise TensorError(f"{cls.fmt} part {cls.code_part!r} ({desc(codes)}) holds values above 15: pass "
                              "unpacked 4-bit codes (cvt.qtensor.layouts reads packed ones)")
        if cls.code_dtype != torch.uint8 and not bool(torch.isfinite(codes.float()).all()):
            raise TensorError(f"{cls.fmt} part {cls.code_part!r} ({desc(codes)}) holds NaN")
        s = check(cls.fmt, "weight_scale", p["weight_scale"], (torch.uint8, torch.float8_e8m0fnu),
                  (n, k // MX.BLOCK), f"E8M0 exponents, one per {MX.BLOCK} elements of weight [{n}, {k}]")
        if bool((s.view(torch.uint8) == 255).any()):
            raise TensorError(f"{cls.fmt} part 'weight_scale' ({desc(s)}) holds the E8M0 NaN code 255")
        mod = new_module(cls, n, k, bias)
        mod.register_buffer(cls.code_part, codes)
        mod.register_buffer("weight_scale", s.view(torch.uint8))
        return mod

    def prepare_for_npu(self) -> None:
        """Nothing to lay out: no fused Ascend path for these formats (module docstring)."""

    def elements(self) -> torch.Tensor:
        c = getattr(self, self.code_part)
        return c.to(torch.float32) if self.code_dtype != torch.uint8 else decode_e2m1(c)

    def dense_weight(self) -> torch.Tensor:
        return MX.mx_dequantize(self.elements(), MX.e8m0_exponents(self.weight_scale))

    def reference(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 [m, k]`` -> ``[m, n]`` in x2's dtype (module docstring)."""
        xq = MX.mx_fake_quant(x2.to(torch.float32), self.act)
        y = xq @ self.dense_weight().t()
        if self.bias is not None:
            y = y + self.bias.to(torch.float32)
        return y.to(x2.dtype)


@register
class MxFp8Linear(_MxLinear):
    fmt = KF.MXFP8
    parts = ("weight_fp8", "weight_scale")
    code_part = "weight_fp8"
    code_dtype = torch.float8_e4m3fn
    act = MX.FP8


@register
class W4A4MxFp4Linear(_MxLinear):
    fmt = KF.W4A4_MXFP4
    parts = ("weight_fp4", "weight_scale")
    act = MX.FP4


@register
class W4A8MxFpLinear(_MxLinear):
    fmt = KF.W4A8_MXFP
    parts = ("weight_fp4", "weight_scale")
    act = MX.FP8
