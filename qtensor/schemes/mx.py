"""The Ascend 950 (A5) microscaling schemes: MXFP8 / MXFP4 weights in blocks of 32 along k with
E8M0 scales, activations quantized per block at run time (msModelSlim's W8A8_MXFP8, W4A4_MXFP4,
W4A8_MXFP; vllm-ascend main ``quantization/methods/w8a8_mxfp8.py``, ``w4a4_mxfp4.py``,
``w4a8_mxfp4.py``).

==========  ============  =============================================================
scheme      kernel_fmt    weights / activations (one E8M0 scale per 32 along k)
==========  ============  =============================================================
mxfp8       mxfp8         E4M3 / MXFP8 (Ascend W8A8_MXFP8)
w4a4_mxfp4  w4a4_mxfp4    E2M1 / MXFP4 (Ascend W4A4_MXFP4)
w4a8_mxfp   w4a8_mxfp     E2M1 / MXFP8 (Ascend W4A8_MXFP; DeepSeek-V4's FP4 experts)
==========  ============  =============================================================

Names: ``mxfp8`` as issue 28 asks; the fp4 ones carry their activation width, since weight-only
MXFP4 is already ``fp4 --fp4-format mxfp4`` (W4A16_MXFP4) and ``w4a8`` is the int4 W4A8_DYNAMIC.

Parts for ``w [n, k]`` (k a multiple of 32)::

    mxfp8:       weight_fp8  float8_e4m3fn [n, k]   the E4M3 elements
    fp4 ones:    weight_fp4  uint8 [n, k]           E2M1 codes sign << 3 | index (unpacked)
    all:         weight_scale uint8 [n, k/32]       E8M0: w = element * 2**(e - 127)

The quantizer is msModelSlim's round-to-nearest (method "minmax"; `cvt.qtensor.mx` has the
rules). Its E2M1 rounding (half away from zero, block exponent from ``amax * 8/7``) is not
compressed-tensors' (`fp4`'s mxfp4: ties to even, ``round_to_power_2``), so the two MXFP4 forms
are different numbers for the same weight. Symmetric only; no group-size option (fixed 32).
"""

from __future__ import annotations

from cvt.lazy import torch

from cvt.qtensor import kernel_formats as KF
from cvt.qtensor import mx as MX
from cvt.qtensor import primitives as P
from cvt.qtensor.schemes.base import QuantizedTensor, SchemeBase, refuse_fixed, register


class _MX(SchemeBase):
    """A block-32 MX scheme: `elem` is the weight element kind, `act` the activations'."""

    kv_cache = None
    static_activations = False
    options = ("group_size",)  # --group-size: 32 only (the scheme says why another is refused)
    group_size = MX.BLOCK
    symmetric = True
    elem = act = ""
    code_part = ""

    def __init__(self, group_size=None, symmetric=None, fp4_format=None, static_activations=None):
        refuse_fixed(self.name, group_size=group_size, groups=(MX.BLOCK,),
                     group_why=f"has a fixed block of {MX.BLOCK} along in_features (E8M0 scales, msModelSlim's "
                     "AscendV1 group_size 32)", symmetric=symmetric, sym_why="E8M0 scales, no offsets",
                     fp4_format=fp4_format, static_activations=static_activations, act_why="per block")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def kernel_fmt(self, static: bool = False) -> str:
        return self.kernel_formats[0]

    def check(self, name, shape) -> None:
        P.check_group(name, tuple(shape), MX.BLOCK, self.name)

    def param_info(self, shape):
        n, k = shape
        code = torch.float8_e4m3fn if self.elem == MX.FP8 else torch.uint8
        return {self.code_part: ((n, k), code), "weight_scale": ((n, k // MX.BLOCK), torch.uint8)}

    def quantize(self, w: torch.Tensor, name: str | None = None) -> QuantizedTensor:
        w = self.checked_weight(w, name)
        vals, se = MX.mx_quantize(w, self.elem)
        codes = vals.to(torch.float8_e4m3fn) if self.elem == MX.FP8 else P.encode_e2m1(vals)
        return QuantizedTensor(self.name, self.kernel_fmt(), tuple(w.shape),
                               {self.code_part: codes, "weight_scale": MX.e8m0_codes(se)}, MX.BLOCK, True)

    def elements(self, q: QuantizedTensor) -> torch.Tensor:
        """The weight's element values, float32 [n, k] (exact)."""
        c = q.parts[self.code_part]
        return c.to(torch.float32) if self.elem == MX.FP8 else P.decode_e2m1(c)

    def dequantize(self, q: QuantizedTensor) -> torch.Tensor:
        return MX.mx_dequantize(self.elements(q), MX.e8m0_exponents(q.parts["weight_scale"]))


@register
class MXFP8(_MX):
    name = "mxfp8"
    summary = "E4M3 weights in blocks of 32 with E8M0 scales, MXFP8 activations (Ascend 950 W8A8_MXFP8)"
    kernel_formats = (KF.MXFP8,)
    elem = act = MX.FP8
    code_part = "weight_fp8"


@register
class W4A4MXFP4(_MX):
    name = "w4a4_mxfp4"
    summary = "E2M1 weights in blocks of 32 with E8M0 scales, MXFP4 activations (Ascend 950 W4A4_MXFP4)"
    kernel_formats = (KF.W4A4_MXFP4,)
    elem = act = MX.FP4
    code_part = "weight_fp4"


@register
class W4A8MXFP(_MX):
    name = "w4a8_mxfp"
    summary = "E2M1 weights in blocks of 32 with E8M0 scales, MXFP8 activations (Ascend 950 W4A8_MXFP)"
    kernel_formats = (KF.W4A8_MXFP,)
    elem, act = MX.FP4, MX.FP8
    code_part = "weight_fp4"


MX_SCHEMES = (MXFP8, W4A4MXFP4, W4A8MXFP)
