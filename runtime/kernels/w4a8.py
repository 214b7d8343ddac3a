"""`w4a8_dynamic`: int4 weights per output channel, dynamic per-token int8 activations (Ascend W4A8_DYNAMIC).

Canonical in-memory parts (what `from_parts` takes; `cvt.qtensor.layouts` reads the packed
``weight`` [n/2, k] + ``weight_scale`` + ``weight_offset`` + ``scale_bias`` into them):

* ``weight_int4`` int8 ``[n, k]``, one int4 value per element, -8..7 (unpacked);
* ``weight_scale`` float ``[n, 1]`` (or ``[n]``), finite.

No offset part: the format is symmetric (msModelSlim writes zeros, vllm-ascend never reads
them), and two parts keep `for_parts` from mistaking it for a per-channel ``w4a16``.

What vllm-ascend 0.23 computes with these tensors (``methods/w4a8.py``
AscendW4A8DynamicFusedMoEMethod, per-channel path; ``ops/fused_moe/moe_mlp.py``
quant_apply_mlp): the tokens are quantized by ``npu_dynamic_quant`` (per-token symmetric int8,
as `cvt.qtensor.primitives.per_token_quant`), then ``npu_grouped_matmul`` runs int8 x int4 with ``scale`` = the
float32 bits of ``weight_scale``, ``per_token_scale`` = the tokens' scales and ``bias`` = the
summed ``scale_bias``. That bias is not an output bias: the op splits each int8 activation into
two int4 halves (CANN ops-transformer ``grouped_matmul_antiquant_a8w4_msd.h``: ``high * 16 +
low``, then ``+ bias``, then ``* per_token_scale``), and ``8 * sum_k(w * scale)`` (aclnn
GroupedMatmulWeightNz: "Bias ... 8 x weight x scale, summed over k") restores the offset the
signed low half leaves out. So the op's result is::

    x_scale = amax(|x|, -1) / 127;  x_q = clamp(round(x * (127 / amax(|x|, -1))), -128, 127)
    y = float32(x_q @ weight_int4^T) * weight_scale^T * x_scale  (+ bias)  -> x.dtype

which is the reference here: the int GEMM is exact (`_common.int8_matmul`: int4 values are int8
values), the float steps are float32 in that order -- the W8A8_DYNAMIC reference with int4
weights. The NPU op accumulates the two halves' dequantized partial sums in float16 and rounds
the output once; cvt's reference is the exact value it approximates. There is no fused Ascend
path in `cvt.runtime.kernels.npu` for this format yet: on an NPU the torch reference runs.
"""

from __future__ import annotations

import torch

from cvt.qtensor import kernel_formats as KF
from cvt.errors import TensorError
from cvt.runtime.kernels._common import (FusedOrReference, check_2d, check_finite, check_per_channel, desc, new_module,
                                         per_token_int8_linear, take)
from cvt.runtime.kernels.linear import Linear, register


@register
class W4A8DynamicLinear(FusedOrReference, Linear):
    fmt = KF.W4A8_DYNAMIC
    parts = ("weight_int4", "weight_scale")

    @classmethod
    def from_parts(cls, parts, bias=None) -> "W4A8DynamicLinear":
        p = take(cls.fmt, cls.parts, parts)
        q, sc = p["weight_int4"], p["weight_scale"]
        n, k = check_2d(cls.fmt, "weight_int4", q, (torch.int8,))
        if bool(((q < -8) | (q > 7)).any()):
            raise TensorError(f"{cls.fmt} part 'weight_int4' ({desc(q)}) holds values outside the int4 range -8..7 "
                              "(pass unpacked values; cvt.qtensor.layouts reads packed ones)")
        check_per_channel(cls.fmt, "weight_scale", sc, n)
        check_finite(cls.fmt, "weight_scale", sc)
        mod = new_module(cls, n, k, bias)
        mod.register_buffer("weight_int4", q)
        mod.register_buffer("weight_scale", sc.reshape(n, 1))
        return mod

    def prepare_for_npu(self) -> None:
        """Nothing to lay out: no fused Ascend path for this format yet (module docstring)."""

    def reference(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 [m, k]`` -> ``[m, n]`` in x2's dtype (module docstring)."""
        return per_token_int8_linear(x2, self.weight_int4, self.weight_scale, self.bias)

    def dense_weight(self) -> torch.Tensor:
        return self.weight_int4.to(torch.float32) * self.weight_scale.to(torch.float32)
