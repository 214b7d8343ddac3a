"""`w4a4_flatquant`: int4 weights per channel behind an online Kronecker transform of the
activations, int4 per-token activations (Ascend W4A4_FLATQUANT_DYNAMIC, A2 / A3).

Pinned to vllm-ascend main (182b75ea84) ``quantization/methods/w4a4_flatquant.py``
AscendW4A4FlatQuantDynamicLinearMethod: per linear ``[n, k]``, ``(a, b) = decompose_dim(k)``
(its ``get_decompose_dim``, a * b == k with a <= b closest)::

    weight_int4   int8     [n, k]   int4 values -8..7 of the *folded* weight W' (below)
    weight_scale  float32  [n, 1]   bf16(amax_row(W') / 7)  (the w4a8 rule: msModelSlim's minmax)
    left_trans    bfloat16 [a, a]   L as stored on disk
    right_trans   bfloat16 [b, b]   R as stored on disk
    clip_ratio    float32  [1]      in (0, 1]

At run time (``apply`` + ``process_weights_after_loading``: ``left_trans`` is transposed on
load and passed as kronecker_p1) each token x [k], viewed as X [a, b], becomes
``X~ = L^T X R`` (torch_npu.npu_kronecker_quant: ``x @ p2`` then ``p1 @ x``, in the model dtype),
quantized per token to int4 with ``scale = amax|X~| * clip_ratio / 7`` (CANN ops-nn
aclnnFlatQuant, "max(abs(x'')) / (7 / clipRatio)" -- the 8.5 / ops-nn master docs; older 8.2
pages print "/ (7 * clipRatio)", which would widen the range for a clip below 1; msModelSlim's
FlatQuant quantizer, processor/flat_quant/flat_quant_utils/fake_clip_quantizer.py get_scale_zero,
multiplies the max by the ratio, and that is what cvt follows), ``q = clamp(round(X~ / scale),
-8, 7)``, then ``y = (q @ W'^T) * scale * weight_scale`` (npu_quant_matmul, int4 x int4).

In row-major vec form ``vec(L^T X R) = (L^T (x) R^T) vec(X) = T x``, so the weight written is
``W' = W T^-1`` -- per row, reshaped [a, b]: ``L^-1 W_r R^-T`` (`fold`) -- and ``(T x) W'^T ==
x W^T`` in float. ``dequantize`` returns the weight in the original basis, ``deq(W') T`` (per
row ``L deq(W')_r R^T``, `unfold`): what the layer computes when the activations are not
rounded. The inverses are of the bf16 matrices the consumer multiplies by, in float64.

`quantize` writes FlatQuant's initialisation: randomised Hadamard matrices
(`cvt.qtensor.hadamard`, seed 0, one per size, so the shards of a fused linear -- gate / up,
q_a / kv_a -- share them, as vLLM's one parameter per fused layer needs) and ``clip_ratio`` 1.0.
`quantize_with` takes other transforms: ``--method flatquant`` fits L, R and the clip per input
site on calibration data (`cvt.quant.methods.flatquant`), the same for a fused linear's shards.
"""

from __future__ import annotations

import math

from cvt.lazy import torch

from cvt.errors import CvtError, ShapeError
from cvt.qtensor import kernel_formats as KF
from cvt.qtensor import primitives as P
from cvt.qtensor.schemes.base import QuantizedTensor, SchemeBase, refuse_fixed, register
from cvt.qtensor.schemes.w4a8 import QDIV, QMAX, QMIN, SCALE_FLOOR

MAX_DIM = 256   # CANN aclnnFlatQuant: M and N (the two factors) at most 256 (8.5 / ops-nn master)
RIGHT_UNIT = 8  # ... and N a multiple of 8 for the int32-packed int4 output vllm-ascend asks for
SEED = 0
PARTS = ("weight_int4", "weight_scale", "left_trans", "right_trans", "clip_ratio")


def decompose_dim(n: int) -> tuple[int, int]:
    """vllm-ascend ``w4a4_flatquant.get_decompose_dim``: (a - b, a + b) for the smallest a >=
    sqrt(n) with a*a - n a perfect square b*b, i.e. the factor pair of n closest to a square.
    n = 2 mod 4 is no difference of two squares: vllm-ascend's loop never ends there, this one
    raises ShapeError (odd n ends at (1, n), n = 0 mod 4 by (2, n / 2) at the latest)."""
    if n < 1 or n % 4 == 2:
        raise ShapeError(f"in_features {n} has no Kronecker factor pair (a - b, a + b) as vllm-ascend's "
                         "get_decompose_dim searches for one (n = 2 mod 4 is no difference of two squares)")
    a = math.isqrt(n)
    if a * a < n:
        a += 1
    while True:
        b = math.isqrt(a * a - n)
        if b * b == a * a - n:
            return a - b, a + b
        a += 1


def init_transforms(k: int, seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """(left_trans [a, a], right_trans [b, b]) in bfloat16: randomised Hadamard (orthogonal up to
    the bf16 rounding) for k's decomposition."""
    from cvt.qtensor.hadamard import Orthogonal

    a, b = decompose_dim(k)
    left = Orthogonal(a, seed, "flatquant-left").matrix()
    right = Orthogonal(b, seed, "flatquant-right").matrix()
    return left.to(torch.bfloat16), right.to(torch.bfloat16)


def fold(w: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """W' = W T^-1 (module docstring), float32 [n, k], computed in float64."""
    a, b = left.shape[0], right.shape[0]
    li = torch.linalg.inv(left.to(torch.float64))
    rit = torch.linalg.inv(right.to(torch.float64)).T
    wr = w.to(torch.float64).reshape(-1, a, b)
    return (li @ wr @ rit).reshape(w.shape).to(torch.float32)


def unfold(w: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """W' T: the weight in the original basis, float32 [n, k] (per row L W'_r R^T)."""
    a, b = left.shape[0], right.shape[0]
    wr = w.to(torch.float64).reshape(-1, a, b)
    return (left.to(torch.float64) @ wr @ right.to(torch.float64).T).reshape(w.shape).to(torch.float32)


def transform(x: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """T x for tokens x [m, k]: X [a, b] -> L^T X R (npu_kronecker_quant's ``p1 @ (x @ p2)``
    with p1 = left_trans^T), in float32."""
    a, b = left.shape[0], right.shape[0]
    xr = x.to(torch.float32).reshape(-1, a, b)
    return (left.to(torch.float32).T @ (xr @ right.to(torch.float32))).reshape(x.shape[0], a * b)


def quantize_activations(xt: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token int4 of transformed tokens xt [m, k]: (q int8 [m, k] in -8..7, scale float32 [m])
    with scale = amax * clip / 7 (a zero row gets scale 1 and zeros)."""
    amax = xt.abs().amax(dim=1)
    scale = amax * clip / QDIV
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(xt / scale[:, None]), QMIN, QMAX).to(torch.int8)
    return q, scale


@register
class W4A4FlatQuant(SchemeBase):
    """int4 weights per channel folded with an online Kronecker transform; int4 per-token activations."""

    name = "w4a4_flatquant"
    summary = ("int4 weights per channel behind Hadamard-initialised Kronecker transforms applied online, int4 "
               "per-token activations (Ascend W4A4_FLATQUANT_DYNAMIC, linears)")
    kv_cache = None
    static_activations = False
    options = ("group_size",)  # --group-size: 0 only (the scheme says why another is refused)
    kernel_formats = (KF.W4A4_FLATQUANT,)
    group_size = 0
    symmetric = True

    def __init__(self, group_size=None, symmetric=None, fp4_format=None, static_activations=None):
        refuse_fixed(self.name, group_size=group_size, groups=(0,),
                     group_why="is per output channel only (vllm-ascend's W4A4_FLATQUANT_DYNAMIC weight_scale [n, 1])",
                     symmetric=symmetric, sym_why="vllm-ascend's method ignores weight_offset", fp4_format=fp4_format,
                     static_activations=static_activations, act_why="per token")

    def __repr__(self) -> str:
        return "W4A4FlatQuant()"

    def kernel_fmt(self, static: bool = False) -> str:
        return KF.W4A4_FLATQUANT

    def check(self, name: str, shape: tuple[int, int]) -> None:
        P.check_group(name, tuple(shape), 0, self.name)
        why = self.shape_problem(shape)
        if why is not None:
            raise ShapeError(f"{name} {list(shape)}: {why}")

    def shape_problem(self, shape: tuple[int, int]) -> str | None:
        k = shape[1]
        if k % 8:
            return (f"{self.name} needs in_features a multiple of 8 (vllm-ascend packs the int4 weight eight per "
                    f"int32), got {k}")
        a, b = decompose_dim(k)
        if b > MAX_DIM or b % RIGHT_UNIT:
            return (f"in_features {k} = {a} x {b} (vllm-ascend's get_decompose_dim), and npu_kronecker_quant takes "
                    f"factors of at most {MAX_DIM} with the right one a multiple of {RIGHT_UNIT}")
        return None

    def param_info(self, shape):
        n, k = shape
        a, b = decompose_dim(k)
        return {"weight_int4": ((n, k), torch.int8), "weight_scale": ((n, 1), torch.float32),
                "left_trans": ((a, a), torch.bfloat16), "right_trans": ((b, b), torch.bfloat16),
                "clip_ratio": ((1,), torch.float32)}

    def quantize(self, w: torch.Tensor, name: str | None = None) -> QuantizedTensor:
        w = self.checked_weight(w, name)
        return self._quantize(w, *init_transforms(w.shape[1]), 1.0)

    def quantize_with(self, w: torch.Tensor, left: torch.Tensor, right: torch.Tensor, clip: float,
                      name: str | None = None, weight_clip: torch.Tensor | None = None) -> QuantizedTensor:
        """The parts of `w` behind the given transforms (bfloat16 [a, a] / [b, b], as stored) and
        clip ratio in (0, 1]: `quantize` with Hadamard's, `--method flatquant` with fitted ones.
        `weight_clip` [n, 1] in (0, 1]: each row's scale is ``amax * weight_clip / 7`` (FlatQuant's
        learnable weight clip, kept in ``weight_scale``; values past it clamp to -8..7)."""
        w = self.checked_weight(w, name)
        a, b = decompose_dim(w.shape[1])
        if tuple(left.shape) != (a, a) or tuple(right.shape) != (b, b) or not 0 < clip <= 1:
            raise CvtError(f"{name or self.name}: transforms {list(left.shape)} / {list(right.shape)} and clip {clip} "
                           f"do not fit in_features {w.shape[1]} = {a} x {b} with a clip in (0, 1]")
        if weight_clip is not None and (weight_clip.numel() != w.shape[0] or not bool(
                ((weight_clip > 0) & (weight_clip <= 1)).all())):
            raise CvtError(f"{name or self.name}: weight_clip {list(weight_clip.shape)} must be {w.shape[0]} values "
                           "in (0, 1]")
        return self._quantize(w, left, right, clip, weight_clip)

    def _quantize(self, w: torch.Tensor, left: torch.Tensor, right: torch.Tensor, clip: float,
                  weight_clip: torch.Tensor | None = None) -> QuantizedTensor:
        left, right = left.to(torch.bfloat16), right.to(torch.bfloat16)
        wf = fold(w, left, right)
        P.check_finite(wf, f"{self.name} folded weight (are the transforms invertible?)")
        amax = wf.abs().amax(dim=1, keepdim=True)
        if weight_clip is not None:
            amax = amax * weight_clip.to(torch.float32).reshape(-1, 1)
        scale = torch.clamp(P.round_to_bf16(amax / QDIV), min=SCALE_FLOOR)
        q = torch.clamp(torch.round(P.round_to_bf16(wf / scale)), QMIN, QMAX).to(torch.int8)
        parts = {"weight_int4": q, "weight_scale": scale, "left_trans": left, "right_trans": right,
                 "clip_ratio": torch.tensor([clip], dtype=torch.float32)}
        return QuantizedTensor(self.name, KF.W4A4_FLATQUANT, tuple(w.shape), parts)

    def dequantize(self, q: QuantizedTensor) -> torch.Tensor:
        p = q.parts
        wq = p["weight_int4"].to(torch.float32) * p["weight_scale"].to(torch.float32).reshape(-1, 1)
        return unfold(wq, p["left_trans"], p["right_trans"])
