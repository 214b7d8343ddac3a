"""`w4a8`: int4 weights per output channel, dynamic per-token int8 activations (Ascend W4A8_DYNAMIC).

Parts (kernel ``w4a8_dynamic``, `cvt.runtime.kernels.w4a8`) for ``w [n, k]``::

    weight_int4   int8    [n, k]   int4 values -8..7, unpacked
    weight_scale  float32 [n, 1]   bf16(amax_row / 7), at least 2**-23

    dequant: w = weight_int4 * weight_scale;  y = x_scale * (x_q @ weight_int4^T) * weight_scale^T

The math is msModelSlim 26.1's, the only W4A8_DYNAMIC weight quantizer its current (modelslim_v1)
flow has -- ``ir/w4a8_dynamic.py`` registers W4A8DynamicFakeQuantLinear for
``(int8_per_token_sym, int4_per_channel_sym)`` only, and every W4A8 recipe in ``lab_practice/``
(``deepseek_v3/deepseek_w4a8_per_channel.yaml`` for DeepSeek-R1, Kimi-K2, GLM-5, Qwen3-MoE)
quantizes the routed experts per channel, symmetric:

* ``core/quantizer/impl/minmax.py`` WeightPerChannelMinmax (method "minmax", i.e. RTN): min / max
  per output channel, then ``ir/api/impl/int_quantization.py`` calculate_int_qparam, symmetric
  INT4 branch: ``max_bound = 2**3 - 1 = 7``, ``scale = max(-min(w, 0), max(w, 0)) / 7`` floored
  at float32 eps (2**-23), offset 0; int_quantize: ``q = clamp(round(w / scale), -8, 7)`` (round
  half to even). msModelSlim computes in the model's dtype; the releases it quantizes are loaded
  in bfloat16 (``model/deepseek_v3/model_adapter.py`` builds under ``default_dtype(torch.bfloat16)``),
  so the scale is a bfloat16 number and so is the quotient ``w / scale`` before it is
  rounded -- cvt does the same: for a bf16 weight, bit for bit what msModelSlim writes (its code
  written out in ``tests/qtensor/test_scheme_w4a8.py``; msModelSlim itself, run on a bf16 weight
  outside the suite, gave the same scales, values and packed bytes). The lab recipes pick method
  "ssz" (``core/quantizer/impl/ssz.py``: a per-channel least-squares refinement of this scale,
  data-free), which cvt does not implement: cvt's w4a8 is msModelSlim's "minmax".

There is no group size: msModelSlim's older llm_ptq flow also wrote a per-group two-level form
(``weight_scale_second`` / ``weight_offset_second``: int8 per channel, then int4 per group of
the int8 codes, from a compiled kernel) which this scheme does not produce.
"""

from __future__ import annotations

from cvt.qtensor import kernel_formats as KF
from cvt.lazy import torch

from cvt.errors import CvtError
from cvt.qtensor import primitives as P
from cvt.qtensor.schemes.base import QuantizedTensor, SchemeBase, register

QMIN, QMAX = -8, 7
QDIV = 7.0            # msModelSlim's symmetric INT4 max_bound, 2**(4-1) - 1
SCALE_FLOOR = 2.0 ** -23  # torch.finfo(torch.float32).eps: calculate_int_qparam's floor (exact in bf16 too)


@register
class W4A8(SchemeBase):
    """Per-channel symmetric int4 weights; dynamic per-token int8 activations."""

    name = "w4a8"
    summary = "int4 weights per channel, int8 dynamic per-token activations (Ascend W4A8_DYNAMIC, MoE experts)"
    kv_cache = None
    static_activations = False
    options = ("group_size",)  # --group-size (0 only: the scheme says why another is refused)
    kernel_formats = (KF.W4A8_DYNAMIC,)
    group_size = 0
    symmetric = True

    def __init__(self, group_size=None, symmetric=None, fp4_format=None, static_activations=None):
        if group_size not in (None, 0):
            raise CvtError(f"scheme 'w4a8' is per output channel only (msModelSlim's W4A8_DYNAMIC, int4 per "
                           f"channel): group_size={group_size} is not supported (use w4a16 for grouped int4)")
        if symmetric not in (None, True):
            raise CvtError("scheme 'w4a8' is symmetric only (msModelSlim's int4_per_channel_sym; the Ascend W4A8 "
                           "kernels take no weight offset)")
        if fp4_format is not None:
            raise CvtError(f"scheme 'w4a8' takes no fp4_format (got {fp4_format!r}; that option is for 'fp4')")
        if static_activations:
            raise CvtError("scheme 'w4a8' quantizes activations per token at run time: static_activations is not "
                           "supported")

    def __repr__(self) -> str:
        return "W4A8()"

    def kernel_fmt(self, static: bool = False) -> str:
        return KF.W4A8_DYNAMIC

    def param_info(self, shape):
        n, k = shape
        return {"weight_int4": ((n, k), torch.int8), "weight_scale": ((n, 1), torch.float32)}

    def quantize(self, w: torch.Tensor, name: str | None = None) -> QuantizedTensor:
        w = self.checked_weight(w, name)
        amax = w.abs().amax(dim=1, keepdim=True)  # = max(-min(w, 0), max(w, 0)) per channel
        scale = torch.clamp(P.round_to_bf16(amax / QDIV), min=SCALE_FLOOR)
        q = torch.clamp(torch.round(P.round_to_bf16(w / scale)), QMIN, QMAX).to(torch.int8)
        return QuantizedTensor(self.name, KF.W4A8_DYNAMIC, tuple(w.shape), {"weight_int4": q, "weight_scale": scale})

    def dequantize(self, q: QuantizedTensor) -> torch.Tensor:
        return q.parts["weight_int4"].to(torch.float32) * q.parts["weight_scale"].to(torch.float32).reshape(-1, 1)
