"""`fp8_block`: FP8 e4m3 weights with 2-D block scales (DeepSeek-V3 / Kimi-K2 / Qwen3-FP8 releases).

Parts (FORMATS.md 1.1): ``weight`` float8_e4m3fn ``[n, k]`` and ``weight_scale_inv``
``[ceil(n/bn), ceil(k/bk)]`` (float32, bfloat16, float16 or float8_e8m0fnu; a multiplier
despite the name). The dequantized weight is the official BF16 one, bit for bit:
``bf16(float32(w) * float32(s[i // bn, j // bk]))`` -- `cvt.convert.fp8.dequant_fp8_block` on
CPU, the same torch expression on other devices (no Ascend fused op exists for it: on an NPU
this torch expression runs on the device). Forward dequantizes, then multiplies in x.dtype.
Nothing is cached: the full-size weight lives only during the call.
"""

from __future__ import annotations

import torch

from cvt.qtensor import kernel_formats as KF
from cvt.convert.fp8 import dequant_fp8_block, expected_scale_shape, scale_to_f32
from cvt.runtime.kernels._common import FusedOrReference, check, check_2d, check_finite, new_module, take
from cvt.runtime.kernels.linear import Linear, register

SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu)


def dequant_expr(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The same bits as `dequant_fp8_block`, as one torch expression (runs on any device)."""
    bn, bk = block
    n, k = w.shape
    full = scale_to_f32(s).repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    return (w.to(torch.float32) * full).to(torch.bfloat16)


@register
class Fp8BlockLinear(FusedOrReference, Linear):
    fmt = KF.FP8_BLOCK
    parts = ("weight", "weight_scale_inv")
    block_size: tuple[int, int] = (128, 128)

    @classmethod
    def from_parts(cls, parts, bias=None, *, block_size: tuple[int, int] = (128, 128)) -> "Fp8BlockLinear":
        p = take(cls.fmt, cls.parts, parts)
        w, s = p["weight"], p["weight_scale_inv"]
        n, k = check_2d(cls.fmt, "weight", w, (torch.float8_e4m3fn,))
        bs = tuple(int(b) for b in block_size)
        if len(bs) != 2 or min(bs) <= 0:
            raise ValueError(f"block_size must be two positive ints, got {block_size!r}")
        check(cls.fmt, "weight_scale_inv", s, SCALE_DTYPES, expected_scale_shape((n, k), bs),
              f"ceil({n}/{bs[0]}) x ceil({k}/{bs[1]}) blocks of weight [{n}, {k}]")
        check_finite(cls.fmt, "weight_scale_inv", scale_to_f32(s))
        mod = new_module(cls, n, k, bias)
        mod.register_buffer("weight", w)
        mod.register_buffer("weight_scale_inv", s)
        mod.block_size = bs
        return mod

    def dequant_bf16(self) -> torch.Tensor:
        """The official BF16 weight ``[n, k]`` (bit-exact on every device)."""
        if self.weight.device.type == "cpu":
            return dequant_fp8_block(self.weight, self.weight_scale_inv, self.block_size)
        return dequant_expr(self.weight, self.weight_scale_inv, self.block_size)

    def dense_weight(self) -> torch.Tensor:
        return self.dequant_bf16().float()

    def extra_repr(self) -> str:
        return super().extra_repr() + f", block={list(self.block_size)}"
