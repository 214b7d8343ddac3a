"""`w8a8`: symmetric per-channel int8 weights, int8 activations (Ascend W8A8_DYNAMIC / W8A8).

Parts (kernel ``w8a8_dynamic``, `cvt.runtime.kernels.int8`) for ``w [n, k]``::

    weight         int8    [n, k]   q = clamp(round(w / scale), -128, 127)
    weight_scale   float32 [n, 1]   bf16(amax_row / 127)  (0 -> 1.0)
    weight_offset  float32 [n, 1]   zeros (symmetric)

The scale is amax/127 (the Ascend converters' rule, FORMATS.md 2.2) rounded to the nearest
bfloat16, so it is the same number for every consumer: vllm-ascend keeps W8A8 scales in the
model dtype (bf16) and compressed-tensors checkpoints usually do too. ``dequantize`` is
``weight * weight_scale`` in float32, what the runtime's ``dense_weight`` computes.

Static activations (``static_activations=True``): the scheme only records that attention
projections use static W8A8 (msModelSlim's mixed recipe). After activation calibration the
stage turns that projection's dynamic `QuantizedTensor` into a ``w8a8_static`` one with
`static_parts` (parts ``weight``, ``input_scale``, ``input_offset``, ``deq_scale``,
``quant_bias``; the weight scale travels in ``extra["weight_scale"]`` because the static
kernel does not take it but the Ascend files carry it).
"""

from __future__ import annotations

from cvt.qtensor import kernel_formats as KF
from cvt.lazy import torch

from cvt.errors import CvtError, TensorError
from cvt.qtensor import primitives as P
from cvt.qtensor.schemes.base import QuantizedTensor, SchemeBase, register


def _refuse_options(scheme: str, group_size, symmetric, fp4_format) -> None:
    if group_size not in (None, 0):
        raise CvtError(f"scheme {scheme!r} is per output channel only: group_size={group_size} is not "
                       "supported (use w4a16 for grouped weights)")
    if symmetric not in (None, True):
        raise CvtError(f"scheme {scheme!r} is symmetric only (the Ascend W8A8 kernels ignore weight offsets)")
    if fp4_format is not None:
        raise CvtError(f"scheme {scheme!r} takes no fp4_format (got {fp4_format!r}; that option is for 'fp4')")


@register
class W8A8(SchemeBase):
    """Per-channel symmetric int8 weights; dynamic per-token int8 activations (or static, see above)."""

    name = "w8a8"
    summary = ("int8 weights per channel, int8 dynamic per-token activations (ascend --static-attention: "
               "static per-tensor on attention)")
    kv_cache: str | None = None
    options: tuple[str, ...] = ()
    static_attention = True  # attention may take calibrated static activations (--static-attention)
    kernel_formats = (KF.W8A8_DYNAMIC, KF.W8A8_STATIC)
    group_size = 0
    symmetric = True

    def __init__(self, group_size=None, symmetric=None, fp4_format=None, static_activations: bool = False):
        _refuse_options(self.name, group_size, symmetric, fp4_format)
        self.static_activations = bool(static_activations)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(static_activations={self.static_activations})"

    def kernel_fmt(self, static: bool = False) -> str:
        return KF.W8A8_STATIC if static else KF.W8A8_DYNAMIC

    def param_info(self, shape):
        n, k = shape
        return {"weight": ((n, k), torch.int8), "weight_scale": ((n, 1), torch.float32),
                "weight_offset": ((n, 1), torch.float32)}

    def quantize(self, w: torch.Tensor, name: str | None = None) -> QuantizedTensor:
        w = self.checked_weight(w, name)
        scale = P.symmetric_scale(w, 0, P.INT8_QDIV, P.round_to_bf16)
        q = P.quantize_int(w, scale, None, -128, 127)
        return QuantizedTensor(self.name, KF.W8A8_DYNAMIC, tuple(w.shape),
                               {"weight": q, "weight_scale": scale, "weight_offset": torch.zeros_like(scale)})

    def dequantize(self, q: QuantizedTensor) -> torch.Tensor:
        if q.kernel_fmt == KF.W8A8_STATIC:
            ws = q.extra.get("weight_scale")
            if ws is None:  # what the static kernel's dense_weight uses
                from cvt.qtensor.primitives import deq_scale_f32
                ws = (deq_scale_f32(q.parts["deq_scale"]) / q.parts["input_scale"].to(torch.float32))[:, None]
            return q.parts["weight"].to(torch.float32) * ws.to(torch.float32)
        return P.dequantize_int(q.parts["weight"], q.parts["weight_scale"])


def static_parts(qt: QuantizedTensor, input_scale, input_offset, bias: torch.Tensor | None = None,
                 fp16_model: bool = False) -> QuantizedTensor:
    """A ``w8a8_dynamic`` tensor + calibrated activation parameters -> ``w8a8_static`` (FORMATS.md 2.2).

    ``input_scale`` is rounded to bfloat16 and ``input_offset`` to an integer in -128..127
    (vllm-ascend holds them in the model dtype and int8), so every consumer computes with the
    same numbers. ``deq_scale = float32(input_scale * weight_scale)`` ``[n]`` (for fp16 models its float32 bits
    as int64, `fp16_model=True`); ``quant_bias = round(bias / deq_scale - sum_k(w_q) *
    input_offset)`` int32 ``[n]`` (`cvt.qtensor.primitives.quant_bias_from`). The bias is
    folded into quant_bias: build the runtime module with ``bias=None`` and do not also write
    a float bias for it.
    """
    from cvt.qtensor.primitives import deq_scale_int64, quant_bias_from

    if qt.kernel_fmt != KF.W8A8_DYNAMIC:
        raise CvtError(f"static_parts needs a w8a8_dynamic tensor, got kernel_fmt {qt.kernel_fmt!r}")
    s = P.round_to_bf16(torch.as_tensor(input_scale, dtype=torch.float32).reshape(1))
    off = torch.as_tensor(input_offset, dtype=torch.float32).reshape(1)
    if not bool(torch.isfinite(s).all()) or float(s) <= 0 or not bool(torch.isfinite(off).all()):
        raise TensorError(f"static W8A8 activation parameters must be finite with input_scale > 0: "
                          f"got input_scale={s.tolist()}, input_offset={off.tolist()}")
    off = torch.clamp(torch.round(off), -128, 127)
    n = qt.shape[0]
    if bias is not None and tuple(bias.shape) != (n,):
        raise TensorError(f"static W8A8 bias has shape {list(bias.shape)}: expected [{n}]")
    ws = qt.parts["weight_scale"].to(torch.float32).reshape(n)
    deq = (s * ws).to(torch.float32)
    qb = quant_bias_from(bias, qt.parts["weight"], off, deq)
    parts = {"weight": qt.parts["weight"], "input_scale": s, "input_offset": off,
             "deq_scale": deq_scale_int64(deq) if fp16_model else deq, "quant_bias": qb}
    return QuantizedTensor(qt.scheme, KF.W8A8_STATIC, qt.shape, parts, 0, True,
                           {**qt.extra, "weight_scale": ws.reshape(n, 1)})
