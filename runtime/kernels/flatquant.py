"""`w4a4_flatquant`: int4 weights per channel, an online Kronecker transform of the activations,
then int4 per-token activations (Ascend W4A4_FLATQUANT_DYNAMIC).

Canonical parts (`cvt.qtensor.schemes.flatquant` documents them; the layout reads the on-disk
``weight`` / ``weight_scale`` / ``weight_offset`` / ``left_trans`` / ``right_trans`` /
``clip_ratio`` into them): ``weight_int4`` int8 [n, k] in -8..7, ``weight_scale`` [n, 1],
``left_trans`` [a, a] and ``right_trans`` [b, b] as stored, ``clip_ratio`` [1].

What vllm-ascend main (182b75ea84) computes, ``quantization/methods/w4a4_flatquant.py``:

* process_weights_after_loading: ``layer.left_trans = left_trans.t()``, ``right_trans`` as is,
  ``aclnn_clip_ratio = clip_ratio.item()``; the int4 weight packed for the int4 GEMM;
* apply: ``left_trans.to(x.dtype)``, ``right_trans.to(x.dtype)``; ``x.view(-1, a, b)``;
  ``npu_kronecker_quant(x, left^T, right, clip_ratio, dst_dtype=int32)`` -- CANN aclnnFlatQuant:
  ``x' = x @ p2; x'' = p1 @ x'``; per token ``quantScale = amax|x''| / (7 / clipRatio)``; ``out =
  x'' / quantScale`` as int4 (`cvt.qtensor.schemes.flatquant.quantize_activations`: round half
  to even, clamped to -8..7, msModelSlim's FlatQuant quantizer); then ``npu_quant_matmul(x_q,
  weight^T, weight_scale, pertoken_scale=quantScale, output_dtype=x.dtype)`` -- int32
  accumulation times both scales, rounded once to x's dtype -- and the bias added after, in x's
  dtype.

That is the reference here, with the two small matmuls in float32 (the op's internal precision is
not documented) and the int GEMM exact (`_common.int8_matmul`: int4 values are int8 values).
There is no fused Ascend path in `cvt.runtime.kernels.npu` for this format: on an NPU the torch
reference runs.
"""

from __future__ import annotations

import torch

from cvt.errors import TensorError
from cvt.qtensor import kernel_formats as KF
from cvt.qtensor.schemes.flatquant import decompose_dim, quantize_activations, transform, unfold
from cvt.runtime.kernels._common import (FLOATS, FusedOrReference, check, check_2d, check_finite, check_per_channel,
                                         desc, int8_matmul, new_module, take)
from cvt.runtime.kernels.linear import Linear, register


def _finite_transforms_and_clip(fmt: str, left: torch.Tensor, right: torch.Tensor, clip: torch.Tensor) -> torch.Tensor:
    """Both FLATQUANT formats: the transforms finite, one clip_ratio in (0, 1] (float32 [1])."""
    check_finite(fmt, "left_trans", left)
    check_finite(fmt, "right_trans", right)
    clip = check(fmt, "clip_ratio", clip, FLOATS).float().reshape(-1)
    if clip.numel() != 1 or not 0 < float(clip[0]) <= 1:
        raise TensorError(f"{fmt} part 'clip_ratio' is {clip.tolist()}: expected one value in (0, 1]")
    return clip


@register
class W4A4FlatQuantLinear(FusedOrReference, Linear):
    fmt = KF.W4A4_FLATQUANT
    parts = ("weight_int4", "weight_scale", "left_trans", "right_trans", "clip_ratio")

    @classmethod
    def from_parts(cls, parts, bias=None) -> "W4A4FlatQuantLinear":
        p = take(cls.fmt, cls.parts, parts)
        q = p["weight_int4"]
        n, k = check_2d(cls.fmt, "weight_int4", q, (torch.int8,))
        if bool(((q < -8) | (q > 7)).any()):
            raise TensorError(f"{cls.fmt} part 'weight_int4' ({desc(q)}) holds values outside the int4 range -8..7")
        check_per_channel(cls.fmt, "weight_scale", p["weight_scale"], n)
        check_finite(cls.fmt, "weight_scale", p["weight_scale"])
        a, b = decompose_dim(k)
        why = f"vllm-ascend's get_decompose_dim({k}) = ({a}, {b})"
        left = check(cls.fmt, "left_trans", p["left_trans"], FLOATS, (a, a), why)
        right = check(cls.fmt, "right_trans", p["right_trans"], FLOATS, (b, b), why)
        clip = _finite_transforms_and_clip(cls.fmt, left, right, p["clip_ratio"])
        mod = new_module(cls, n, k, bias)
        mod.register_buffer("weight_int4", q)
        mod.register_buffer("weight_scale", p["weight_scale"].reshape(n, 1))
        mod.register_buffer("left_trans", left)
        mod.register_buffer("right_trans", right)
        mod.clip = float(clip[0])  # aclnn_clip_ratio: a host float
        return mod

    def prepare_for_npu(self) -> None:
        """Nothing to lay out: no fused Ascend path for this format yet (module docstring)."""

    def transformed(self, x2: torch.Tensor) -> torch.Tensor:
        """The tokens after the Kronecker transform, float32 [m, k] (transforms in x2's dtype first)."""
        dt = x2.dtype if x2.dtype in (torch.bfloat16, torch.float16) else torch.float32
        return transform(x2, self.left_trans.to(dt), self.right_trans.to(dt))

    def reference(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 [m, k]`` -> ``[m, n]`` in x2's dtype (module docstring)."""
        xq, xs = quantize_activations(self.transformed(x2), self.clip)
        acc = int8_matmul(xq, self.weight_int4)
        y = (acc.to(torch.float32) * self.weight_scale.to(torch.float32).reshape(1, -1) * xs[:, None]).to(x2.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x2.dtype)
        return y

    def dense_weight(self) -> torch.Tensor:
        """The weight in the activations' original basis (`cvt.qtensor.schemes.flatquant.unfold`)."""
        wq = self.weight_int4.to(torch.float32) * self.weight_scale.to(torch.float32)
        return unfold(wq, self.left_trans, self.right_trans)


@register
class W4A4MxFp4FlatQuantLinear(FusedOrReference, Linear):
    """Ascend 950 W4A4_MXFP4_FLATQUANT (vllm-ascend main 182b75ea84 ``quantization/methods/
    w4a4_mxfp4_flatquant.py``). process_weights_after_loading: ``left_trans`` transposed (kronecker_p1),
    the row-parallel diagonal block of this rank (the whole matrix at TP 1), ``aclnn_clip_ratio =
    clip_ratio.item()``. apply: ``x.view(-1, a, b)``; ``npu_kronecker_quant(x, left^T, right, clip,
    dst_dtype=float4_e2m1fn_x2)`` -- the transform ``p1 @ (x @ p2)`` of aclnnFlatQuant, here in
    float32 after the transforms are cast to x's dtype, then MXFP4 per block of 32 along the token
    with E8M0 scales (`cvt.qtensor.schemes.flatquant_mx.quantize_activations_mx`: msModelSlim's MXFP4
    rules with the block max times clip_ratio; CANN documents only the int4 mode's clip, so the MX
    mode's is cvt's reading); then ``npu_quant_matmul`` of the two MXFP4 operands with both E8M0
    scale sets, group_sizes [1, 1, 32], the bias inside, one cast to x's dtype (aclnnQuantMatmulV5,
    FLOAT4_E2M1 x FLOAT4_E2M1 with FLOAT8_E8M0 scales). The products of MX values are exact in
    float32; the sum order is torch's. No fused Ascend path."""

    fmt = KF.W4A4_MXFP4_FLATQUANT
    parts = ("weight_fp4", "weight_scale", "left_trans", "right_trans", "clip_ratio")

    @classmethod
    def from_parts(cls, parts, bias=None) -> "W4A4MxFp4FlatQuantLinear":
        from cvt.qtensor import mx as MX

        p = take(cls.fmt, cls.parts, parts)
        codes = p["weight_fp4"]
        n, k = check_2d(cls.fmt, "weight_fp4", codes, (torch.uint8,))
        if k % MX.BLOCK or bool((codes > 15).any()):
            raise TensorError(f"{cls.fmt} part 'weight_fp4' ({desc(codes)}) must be unpacked E2M1 codes 0..15 with "
                              f"in_features a multiple of {MX.BLOCK}")
        s = check(cls.fmt, "weight_scale", p["weight_scale"], (torch.uint8, torch.float8_e8m0fnu), (n, k // MX.BLOCK),
                  "E8M0 exponents, one per 32 elements")
        left, right = p["left_trans"], p["right_trans"]
        a, b = left.shape[0], right.shape[0]
        check(cls.fmt, "left_trans", left, FLOATS, (a, a), "square")
        check(cls.fmt, "right_trans", right, FLOATS, (b, b), f"square, {a} x its size = in_features {k}")
        if a * b != k:
            raise TensorError(f"{cls.fmt}: left_trans {a} x right_trans {b} != in_features {k} (the method's "
                              "dimension mismatch)")
        clip = _finite_transforms_and_clip(cls.fmt, left, right, p["clip_ratio"])
        mod = new_module(cls, n, k, bias)
        mod.register_buffer("weight_fp4", codes)
        mod.register_buffer("weight_scale", s.view(torch.uint8))
        mod.register_buffer("left_trans", left)
        mod.register_buffer("right_trans", right)
        mod.clip = float(clip[0])
        return mod

    def prepare_for_npu(self) -> None:
        """Nothing to lay out: no fused Ascend path for this format (class docstring)."""

    def transformed(self, x2: torch.Tensor) -> torch.Tensor:
        dt = x2.dtype if x2.dtype in (torch.bfloat16, torch.float16) else torch.float32
        return transform(x2, self.left_trans.to(dt), self.right_trans.to(dt))

    def folded_weight(self) -> torch.Tensor:
        """deq(W'), float32 [n, k] (exact): the weight the GEMM multiplies the transformed tokens by."""
        from cvt.qtensor import mx as MX
        from cvt.qtensor.primitives import decode_e2m1

        return MX.mx_dequantize(decode_e2m1(self.weight_fp4), MX.e8m0_exponents(self.weight_scale))

    def reference(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 [m, k]`` -> ``[m, n]`` in x2's dtype (class docstring)."""
        from cvt.qtensor.schemes.flatquant_mx import quantize_activations_mx

        y = quantize_activations_mx(self.transformed(x2), self.clip) @ self.folded_weight().t()
        if self.bias is not None:
            y = y + self.bias.to(torch.float32)
        return y.to(x2.dtype)

    def dense_weight(self) -> torch.Tensor:
        return unfold(self.folded_weight(), self.left_trans, self.right_trans)
