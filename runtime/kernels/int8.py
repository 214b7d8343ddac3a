"""Ascend int8 formats (msModelSlim "AscendV1", FORMATS.md 2.2): `w8a8_dynamic` and `w8a8_static`.

`w8a8_dynamic` (tag W8A8_DYNAMIC) -- parts ``weight`` int8 ``[n, k]``, ``weight_scale`` ``[n, 1]``,
``weight_offset`` ``[n, 1]`` (zeros: symmetric). Activations are quantized per token at run time
as both serving stacks do it (`per_token_quant`)::

    x_scale = amax(|x|, -1) / 127;  x_q = clamp(round(x * (127 / amax(|x|, -1))), -128, 127)
                                                  (float32, half to even; 0 for an all-zero row)
    y = float32(x_q @ w_q^T) * weight_scale^T * x_scale  (+ bias)  -> x.dtype

`w8a8_static` (tag W8A8) -- parts ``weight`` int8 ``[n, k]``, ``input_scale`` ``[1]``,
``input_offset`` ``[1]``, ``deq_scale`` ``[n]`` (= input_scale * weight_scale; float32 for bf16
models, or the float32 bits as int32 widened to int64 for fp16 models -- both read here) and
``quant_bias`` int32 ``[n]`` (= round(bias / deq_scale - sum_k(w_q) * input_offset), see
`quant_bias_from`)::

    x_q = clamp(round(x / input_scale + input_offset), -128, 127)
    y = x.dtype( float32(x_q @ w_q^T + quant_bias) * deq_scale )  (+ a separate float bias, if any)

The int GEMM is exact (int32 accumulation, `_common.int8_matmul`); the float steps are in
float32 in the order written above (the order of torch_npu.npu_quant_matmul's documented
formula, so the Ascend path reproduces these bits). `forward` takes the Ascend fused path
(`cvt.runtime.kernels.npu`) when `npu.enabled(x.device)`; `prepare_for_npu()` does its
weight layout work once, at load.
"""

from __future__ import annotations

import torch

from cvt.qtensor import kernel_formats as KF
from cvt.errors import TensorError
from cvt.qtensor.primitives import deq_scale_f32, static_quant
from cvt.runtime.kernels._common import (FLOATS, FusedOrReference, check, check_2d, check_finite, check_per_channel,
                                         desc, int8_matmul, new_module, per_token_int8_linear, take)
from cvt.runtime.kernels.linear import Linear, register


class _Int8Linear(FusedOrReference, Linear):
    pass


@register
class W8A8DynamicLinear(_Int8Linear):
    fmt = KF.W8A8_DYNAMIC
    parts = ("weight", "weight_scale", "weight_offset")

    @classmethod
    def from_parts(cls, parts, bias=None) -> "W8A8DynamicLinear":
        p = take(cls.fmt, cls.parts, parts)
        n, k = check_2d(cls.fmt, "weight", p["weight"], (torch.int8,))
        sc, off = p["weight_scale"], p["weight_offset"]
        for name, t in (("weight_scale", sc), ("weight_offset", off)):
            check_per_channel(cls.fmt, name, t, n)
        check_finite(cls.fmt, "weight_scale", sc)
        if bool((off != 0).any()):
            raise TensorError(f"{cls.fmt} part 'weight_offset' ({desc(off)}) is not all zeros: W8A8_DYNAMIC weights "
                              "are symmetric and the Ascend kernels ignore the offset")
        mod = new_module(cls, n, k, bias)
        mod.register_buffer("weight", p["weight"])
        mod.register_buffer("weight_scale", sc.reshape(n, 1))
        mod.register_buffer("weight_offset", off.reshape(n, 1))
        return mod

    def reference(self, x2: torch.Tensor) -> torch.Tensor:
        return per_token_int8_linear(x2, self.weight, self.weight_scale, self.bias)

    def dense_weight(self) -> torch.Tensor:
        return self.weight.to(torch.float32) * self.weight_scale.to(torch.float32)


@register
class W8A8StaticLinear(_Int8Linear):
    fmt = KF.W8A8_STATIC
    parts = ("weight", "input_scale", "input_offset", "deq_scale", "quant_bias")

    @classmethod
    def from_parts(cls, parts, bias=None) -> "W8A8StaticLinear":
        p = take(cls.fmt, cls.parts, parts)
        n, k = check_2d(cls.fmt, "weight", p["weight"], (torch.int8,))
        for name in ("input_scale", "input_offset"):
            t = p[name]
            check(cls.fmt, name, t, FLOATS + ((torch.int8, torch.int32) if name == "input_offset" else ()))
            if t.numel() != 1 or t.dim() > 1:
                raise TensorError(f"{cls.fmt} part {name!r} is {desc(t)}: expected shape [1] (per tensor)")
        check_finite(cls.fmt, "input_scale", p["input_scale"], positive=True)
        check(cls.fmt, "deq_scale", p["deq_scale"], (torch.float32, torch.int64), (n,),
              "float32, or float32 bits in int64 for fp16 models; one per output channel")
        check_finite(cls.fmt, "deq_scale", deq_scale_f32(p["deq_scale"]))
        check(cls.fmt, "quant_bias", p["quant_bias"], (torch.int32,), (n,))
        mod = new_module(cls, n, k, bias)
        mod.register_buffer("weight", p["weight"])
        mod.register_buffer("input_scale", p["input_scale"].reshape(1))
        mod.register_buffer("input_offset", p["input_offset"].reshape(1))
        mod.register_buffer("deq_scale", p["deq_scale"])
        mod.register_buffer("quant_bias", p["quant_bias"])
        return mod

    def reference(self, x2: torch.Tensor) -> torch.Tensor:
        xq = static_quant(x2, self.input_scale, self.input_offset)
        acc = int8_matmul(xq, self.weight) + self.quant_bias
        y = (acc.to(torch.float32) * deq_scale_f32(self.deq_scale)).to(x2.dtype)
        return y if self.bias is None else y + self.bias.to(x2.dtype)

    def dense_weight(self) -> torch.Tensor:
        """w_q * weight_scale with weight_scale = deq_scale / input_scale (float32; the offset lives in quant_bias)."""
        ws = deq_scale_f32(self.deq_scale) / self.input_scale.to(torch.float32)
        return self.weight.to(torch.float32) * ws[:, None]
