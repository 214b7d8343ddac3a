"""`w4a16`: int4 weights in groups along k, float activations (Ascend W4A16, c-t pack-quantized).

Parts (kernel ``w4a16``, `cvt.runtime.kernels.int4`) for ``w [n, k]``, group size G
(0 = per output channel; a G equal to k has the same numbers - one scale per row - but stays
recorded as G: one group of k, which is how a stack reading one global group size (vllm-ascend,
MindIE) must get it)::

    weight_int4    int8    [n, k]     int4 values -8..7, unpacked
    weight_scale   float32 [n, k/G]   ([n, 1] per channel), bfloat16-representable
    weight_offset  float32 [n, k/G]   integer-valued in -8..7; zeros when symmetric

    dequant: w = (q - offset) * scale   (FORMATS.md 2.2's documented form)

Symmetric (default): ``scale = bf16(amax / 7.5)``, ``q = clamp(round(w / scale), -8, 7)``:
compressed-tensors' ``calculate_qparams`` (``max_val_pos / ((q_max - q_min) / 2)``), which is
also GPTQ's symmetric rule. Asymmetric (``symmetric=False``): ``scale = bf16((max(w,0) -
min(w,0)) / 15)``, ``offset = clamp(round(-8 - min / scale), -8, 7)`` (with the scale before
its bf16 rounding), ``q = clamp(round(w / scale + offset), -8, 7)`` (c-t's asymmetric branch).
Scales are rounded to bfloat16 because compressed-tensors stores them in bf16: every format
then holds exactly these numbers. Default group size: 128 (compressed-tensors' W4A16 preset).
"""

from __future__ import annotations

from cvt.qtensor import kernel_formats as KF
from cvt.lazy import torch

from cvt.errors import CvtError
from cvt.qtensor import primitives as P
from cvt.qtensor.schemes.base import QuantizedTensor, SchemeBase, register

QMIN, QMAX = -8, 7


@register
class W4A16(SchemeBase):
    name = "w4a16"
    summary = "int4 weights in groups along k (--group-size; 0: per channel), bf16 activations"
    kv_cache = None
    static_activations = False
    options = ("group_size", "symmetric")  # what `cvt quantize` passes on (--group-size, --asym)
    kernel_formats = (KF.W4A16,)

    def __init__(self, group_size: int | None = None, symmetric: bool | None = None, fp4_format=None,
                 static_activations=None):
        if fp4_format is not None:
            raise CvtError(f"scheme 'w4a16' takes no fp4_format (got {fp4_format!r}; that option is for 'fp4')")
        if static_activations:
            raise CvtError("scheme 'w4a16' keeps activations in float: static_activations is not supported")
        g = 128 if group_size is None else group_size
        if not isinstance(g, int) or isinstance(g, bool) or g < 0:
            raise CvtError(f"scheme 'w4a16': group_size must be 0 (per channel) or a positive int such as "
                           f"32, 64, 128; got {group_size!r}")
        self.group_size = g
        self.symmetric = True if symmetric is None else bool(symmetric)

    def __repr__(self) -> str:
        return f"W4A16(group_size={self.group_size}, symmetric={self.symmetric})"

    def kernel_fmt(self, static: bool = False) -> str:
        return KF.W4A16

    def _groups(self, k: int) -> int:
        return 1 if self.group_size in (0, k) else k // self.group_size

    def param_info(self, shape):
        n, k = shape
        s = (n, self._groups(k))
        return {"weight_int4": ((n, k), torch.int8), "weight_scale": (s, torch.float32),
                "weight_offset": (s, torch.float32)}

    def quantize(self, w: torch.Tensor, name: str | None = None) -> QuantizedTensor:
        qt = self.grid(w, name)
        scale, offset = qt.parts["weight_scale"], qt.parts["weight_offset"]
        q = P.quantize_int(w.to(torch.float32), scale, None if self.symmetric else offset, QMIN, QMAX)
        qt.parts = {"weight_int4": q, "weight_scale": scale, "weight_offset": offset}
        return qt

    def grid(self, w: torch.Tensor, name: str | None = None) -> QuantizedTensor:
        w = self.checked_weight(w, name)
        n, k = w.shape
        g = 0 if self.group_size in (0, k) else self.group_size
        if self.symmetric:
            scale = P.symmetric_scale(w, g, P.INT4_QDIV, P.round_to_bf16)
            offset = torch.zeros_like(scale)
        else:
            scale, offset = P.asymmetric_scale_offset(w, g, QMIN, QMAX, P.round_to_bf16)
        return QuantizedTensor(self.name, KF.W4A16, (n, k), {"weight_scale": scale, "weight_offset": offset},
                               self.group_size, self.symmetric)

    def dequantize(self, q: QuantizedTensor) -> torch.Tensor:
        p = q.parts
        return P.dequantize_int(p["weight_int4"], p["weight_scale"], p["weight_offset"])
