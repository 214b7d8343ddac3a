"""`nvfp4` and `mxfp4`: E2M1 weights with per-group scales (compressed-tensors, FORMATS.md 2.3).

Canonical in-memory parts keep the 4-bit codes unpacked: ``weight_fp4`` uint8 ``[n, k]``, each
``sign << 3 | index`` into {0, 0.5, 1, 1.5, 2, 3, 4, 6}.

* `nvfp4` -- group 16; ``weight_scale`` float8_e4m3fn ``[n, k/16]``; ``weight_global_scale``
  float32 ``[1]`` (a divisor: ``448 * 6 / amax(w)``). ``w = fp4 * (float32(scale) /
  global_scale)``: the scale is divided first, as compressed-tensors' ``_dequantize`` does
  (``scale = scale / global_scale``), so the bits agree with its decompressor.
* `mxfp4` -- group 32; ``weight_scale`` uint8 E8M0 (or float8_e8m0fnu) ``[n, k/32]``;
  ``w = fp4 * 2**(e - 127)`` (exact; e = 255 is NaN).

On disk (``*-pack-quantized``) the codes are packed two per byte, ``weight_packed`` uint8
``[n, k/2]``, element 2j in the low nibble, 2j+1 in the high one (compressed-tensors
``pack_fp4_to_uint8`` / ``unpack_fp4_from_uint8``); `cvt.qtensor.layouts` unpacks.
Forward dequantizes in float32 with torch expressions (any device; there is no Ascend fused
FP4 op for these formats), casts to x.dtype and multiplies.
"""

from __future__ import annotations

import torch

from cvt.qtensor import kernel_formats as KF
from cvt.convert.fp8 import scale_to_f32
from cvt.errors import TensorError
# The E2M1 table and fp4 pack helpers live in cvt.qtensor.primitives; re-exported here.
from cvt.qtensor.primitives import E2M1_VALUES, decode_e2m1, pack_fp4, unpack_fp4  # noqa: F401
from cvt.runtime.kernels._common import FusedOrReference, check, check_2d, check_finite, desc, new_module, take
from cvt.runtime.kernels.linear import Linear, register


class _Fp4Linear(FusedOrReference, Linear):
    group = 0
    scale_dtypes: tuple = ()

    @classmethod
    def _check_codes(cls, codes: torch.Tensor) -> tuple[int, int]:
        n, k = check_2d(cls.fmt, "weight_fp4", codes, (torch.uint8,))
        if k % cls.group:
            raise TensorError(f"{cls.fmt} part 'weight_fp4' is {desc(codes)}: in_features must be a multiple "
                              f"of the group size {cls.group}")
        if bool((codes > 15).any()):
            raise TensorError(f"{cls.fmt} part 'weight_fp4' ({desc(codes)}) holds values above 15: pass unpacked "
                              "4-bit codes (cvt.qtensor.layouts reads packed ones)")
        return n, k

    def group_scales(self) -> torch.Tensor:  # float32 [n, k / group]
        raise NotImplementedError

    def dense_weight(self) -> torch.Tensor:
        n, k = self.weight_fp4.shape
        v = decode_e2m1(self.weight_fp4).reshape(n, k // self.group, self.group)
        return (v * self.group_scales()[:, :, None]).reshape(n, k)



@register
class NvFp4Linear(_Fp4Linear):
    fmt = KF.NVFP4
    parts = ("weight_fp4", "weight_scale", "weight_global_scale")
    group = 16

    @classmethod
    def from_parts(cls, parts, bias=None) -> "NvFp4Linear":
        p = take(cls.fmt, cls.parts, parts)
        n, k = cls._check_codes(p["weight_fp4"])
        check(cls.fmt, "weight_scale", p["weight_scale"], (torch.float8_e4m3fn,), (n, k // cls.group),
              f"one scale per {cls.group} elements of weight [{n}, {k}]")
        check_finite(cls.fmt, "weight_scale", p["weight_scale"])
        gs = p["weight_global_scale"]
        check(cls.fmt, "weight_global_scale", gs, (torch.float32,))
        if gs.numel() != 1 or gs.dim() > 1:
            raise TensorError(f"{cls.fmt} part 'weight_global_scale' is {desc(gs)}: expected shape [1]")
        check_finite(cls.fmt, "weight_global_scale", gs, positive=True)
        mod = new_module(cls, n, k, bias)
        mod.register_buffer("weight_fp4", p["weight_fp4"])
        mod.register_buffer("weight_scale", p["weight_scale"])
        mod.register_buffer("weight_global_scale", gs.reshape(1))
        return mod

    def group_scales(self) -> torch.Tensor:
        return self.weight_scale.to(torch.float32) / self.weight_global_scale


@register
class MxFp4Linear(_Fp4Linear):
    fmt = KF.MXFP4
    parts = ("weight_fp4", "weight_scale")
    group = 32

    @classmethod
    def from_parts(cls, parts, bias=None) -> "MxFp4Linear":
        p = take(cls.fmt, cls.parts, parts)
        n, k = cls._check_codes(p["weight_fp4"])
        s = check(cls.fmt, "weight_scale", p["weight_scale"], (torch.uint8, torch.float8_e8m0fnu),
                  (n, k // cls.group), f"E8M0 exponents, one per {cls.group} elements of weight [{n}, {k}]")
        if bool((s.view(torch.uint8) == 255).any()):
            raise TensorError(f"{cls.fmt} part 'weight_scale' ({desc(s)}) holds the E8M0 NaN code 255")
        mod = new_module(cls, n, k, bias)
        mod.register_buffer("weight_fp4", p["weight_fp4"])
        mod.register_buffer("weight_scale", s.view(torch.uint8))
        return mod

    def group_scales(self) -> torch.Tensor:
        return scale_to_f32(self.weight_scale.view(torch.float8_e8m0fnu))
