"""The Ascend W4A4_FLATQUANT_DYNAMIC layout entry of `cvt.qtensor.layouts` (registered on import,
after `entries_mx`).

On disk, pinned to vllm-ascend main (182b75ea84) ``quantization/methods/w4a4_flatquant.py``
(get_weight / get_pertensor_param / get_perchannel_param), for a linear ``[n, k]`` with ``(a, b)
= get_decompose_dim(k)``:

=============  =====  ========  ==========================================================
suffix         dtype  shape     note
=============  =====  ========  ==========================================================
weight         I8     [n, k]    int4 values -8..7, one per byte (packed to int32 on load)
weight_scale   F32    [n, 1]
weight_offset  F32    [n, 1]    zeros (declared by the method, never read: symmetric)
left_trans     BF16   [a, a]    the params dtype; transposed on load (kronecker_p1)
right_trans    BF16   [b, b]
clip_ratio     F32    [1]
=============  =====  ========  ==========================================================

The scheme is registered for ``"linear"`` only (``@register_scheme("W4A4_FLATQUANT_DYNAMIC",
"linear")``; no ``"moe"`` entry): a routed expert cannot be in it (`Layout.linears_only`). The
transform params are per-tensor params built from the partition's ``input_size``, and vLLM loads
a per-tensor param whole on every rank: a row-parallel linear split along k under TP would need
transforms of ``get_decompose_dim(k / tp)``, which a single checkpoint cannot hold for every TP
(`Layout.splits_k` False: `cvt shard` refuses the split). Column-parallel linears keep their k,
so any TP loads them. A fused linear (gate / up, q_a / kv_a) has one parameter for its shards, so
they must carry the same transforms (the scheme's come from k alone).
"""

from __future__ import annotations

from cvt.lazy import torch

from cvt.errors import FormatError
from cvt.qtensor import kernel_formats as KF
from cvt.qtensor import primitives as P
from cvt.qtensor.layouts.base import (ASCEND, DIAGONAL, FLOATS, KL, KR, RKL, RKR, VLLM_ASCEND, DiskTensor, K, Layout, N,
                                      _expect, _take, register)
from cvt.qtensor.schemes.base import QuantizedTensor
from cvt.qtensor.schemes.flatquant import W4A4FlatQuant, decompose_dim
from cvt.qtensor.schemes.flatquant_mx import MAX_TP

TAG = "W4A4_FLATQUANT_DYNAMIC"
SUFFIXES = ("weight", "weight_scale", "weight_offset", "left_trans", "right_trans", "clip_ratio")


def _transforms(module: str, t: dict, a: int, b: int) -> tuple:
    """(left_trans [a, a], right_trans [b, b], clip_ratio [1] float32) of both FLATQUANT layouts,
    checked: float, those shapes, finite; one clip in (0, 1]."""
    left = _expect(f"{module}.left_trans", t["left_trans"], FLOATS, (a, a))
    right = _expect(f"{module}.right_trans", t["right_trans"], FLOATS, (b, b))
    clip = _expect(f"{module}.clip_ratio", t["clip_ratio"], FLOATS).to(torch.float32).reshape(-1)
    if clip.numel() != 1 or not 0 < float(clip[0]) <= 1:
        raise FormatError(f"{module}.clip_ratio is {clip.tolist()}: expected one value in (0, 1]")
    P.check_finite(left, f"{module}.left_trans")
    P.check_finite(right, f"{module}.right_trans")
    return left, right, clip

def _encode(q: QuantizedTensor) -> dict[str, torch.Tensor]:
    p, n = q.parts, q.shape[0]
    sc = p["weight_scale"].to(torch.float32).reshape(n, 1)
    return {"weight": p["weight_int4"].to(torch.int8), "weight_scale": sc, "weight_offset": torch.zeros_like(sc),
            "left_trans": p["left_trans"].to(torch.bfloat16), "right_trans": p["right_trans"].to(torch.bfloat16),
            "clip_ratio": p["clip_ratio"].to(torch.float32).reshape(1)}


def _decode(module: str, d: dict) -> QuantizedTensor:
    t = _take(module, d, SUFFIXES)
    w = _expect(f"{module}.weight", t["weight"], (torch.int8,))
    if w.dim() != 2:
        raise FormatError(f"{module}.weight is {list(w.shape)}: expected 2-D [n, k]")
    n, k = w.shape
    if bool(((w < -8) | (w > 7)).any()):
        raise FormatError(f"{module}.weight holds values outside the int4 range -8..7 (W4A4_FLATQUANT_DYNAMIC "
                          "stores one int4 value per int8)")
    a, b = decompose_dim(k)
    sc = _expect(f"{module}.weight_scale", t["weight_scale"], FLOATS)
    if sc.numel() != n:
        raise FormatError(f"{module}.weight_scale is {list(sc.shape)}: expected [{n}, 1]")
    left, right, clip = _transforms(module, t, a, b)
    parts = {"weight_int4": w, "weight_scale": sc.to(torch.float32).reshape(n, 1), "left_trans": left,
             "right_trans": right, "clip_ratio": clip}
    return QuantizedTensor(W4A4FlatQuant.name, KF.W4A4_FLATQUANT, (n, k), parts)


FLATQUANT_LAYOUT = register(Layout(
    "ascend-w4a4-flatquant", KF.W4A4_FLATQUANT, ASCEND, (VLLM_ASCEND,), TAG,
    (DiskTensor("weight", "I8", (N, K)), DiskTensor("weight_scale", "F32", (N, 1)),
     DiskTensor("weight_offset", "F32", (N, 1)), DiskTensor("left_trans", "BF16", (KL, KL)),
     DiskTensor("right_trans", "BF16", (KR, KR)), DiskTensor("clip_ratio", "F32", (1,))),
    _encode, _decode, grouping="channel", linears_only=True, splits_k=False))


# ---- W4A4_MXFP4_FLATQUANT (Ascend 950) ------------------------------------------------------------
# vllm-ascend main (182b75ea84) ``quantization/methods/w4a4_mxfp4_flatquant.py`` get_weight /
# get_pertensor_param / get_pergroup_param: weight U8 [n, k/2] (E2M1 two per byte, element 2j in the
# low nibble: the W4A4_MXFP4 packing), weight_scale U8 [n, k/32] (E8M0), left_trans / right_trans in
# the params dtype with the sizes of `cvt.qtensor.schemes.flatquant_mx.trans_dims` (a RowParallelLinear's
# differ from the others': its own entry, `parallel="row"`, picked by the tensor's extra["parallel"]),
# clip_ratio F32 [1]; no weight_offset. Registered for "linear" only; the description's group_size is
# 32 (the method's default). A row layer's transforms are sized for the whole k with max_supported_tp
# diagonal blocks, of which each vllm-ascend rank keeps its own (cvt writes L block-diagonal, so TP 1,
# 2 and 4 compute the same layer: `cvt.qtensor.schemes.flatquant_mx`). So `cvt shard` splits such a
# layer along k as the consumer's rank holds it after loading (process_weights_after_loading): its
# columns of weight / weight_scale, its diagonal block of left_trans (`DiskTensor.k_split`), right_trans
# and clip_ratio whole; a TP degree that does not divide max_supported_tp is refused (`Layout.max_tp`).
# Read back, either entry decodes either size pair, and a rank's shard its (a / tp, b) (the two entries
# hold the same tensors; the consumer declares the sizes by role).
MX_TAG = "W4A4_MXFP4_FLATQUANT"
MX_SUFFIXES = ("weight", "weight_scale", "left_trans", "right_trans", "clip_ratio")


def _encode_mx(q: QuantizedTensor) -> dict[str, torch.Tensor]:
    p = q.parts
    return {"weight": P.pack_fp4(p["weight_fp4"]), "weight_scale": p["weight_scale"].view(torch.uint8),
            "left_trans": p["left_trans"].to(torch.bfloat16), "right_trans": p["right_trans"].to(torch.bfloat16),
            "clip_ratio": p["clip_ratio"].to(torch.float32).reshape(1)}


def _rank_pairs(k: int) -> list[tuple[int, int]]:
    """The (a / tp, b) of a `cvt shard` rank's part of a row layer holding k of its in_features:
    (a, b) = the row sizes of the whole layer's tp k, tp > 1 dividing max_supported_tp."""
    from cvt.qtensor.schemes.flatquant_mx import trans_dims

    out = []
    for tp in range(2, MAX_TP + 1):
        d = trans_dims(k * tp, True) if MAX_TP % tp == 0 else None
        if d is not None and d[0] % tp == 0:
            out.append((d[0] // tp, d[1]))
    return out


def _decode_mx(module: str, d: dict) -> QuantizedTensor:
    from cvt.qtensor import mx as MX
    from cvt.qtensor.schemes.flatquant_mx import ROW, W4A4MXFP4FlatQuant, trans_dims

    t = _take(module, d, MX_SUFFIXES)
    codes = P.unpack_fp4(_expect(f"{module}.weight", t["weight"], (torch.uint8,)))
    if codes.dim() != 2 or codes.shape[1] % MX.BLOCK:
        raise FormatError(f"{module}.weight unpacks to {list(codes.shape)}: expected 2-D [n, k], k a multiple of 32")
    n, k = codes.shape
    pairs = [d for d in (trans_dims(k, False), trans_dims(k, True), *_rank_pairs(k)) if d is not None]
    have = (t["left_trans"].shape[0], t["right_trans"].shape[0]) if t["left_trans"].dim() == 2 else None
    if not pairs:
        raise FormatError(f"{module}: in_features {k} has no W4A4_MXFP4_FLATQUANT Kronecker factors")
    a, b = have if have in pairs else pairs[0]  # a row layer's (trans_dims(k, True)) or another's
    sc = _expect(f"{module}.weight_scale", t["weight_scale"], (torch.uint8, torch.float8_e8m0fnu), (n, k // MX.BLOCK))
    left, right, clip = _transforms(module, t, a, b)
    parts = {"weight_fp4": codes, "weight_scale": sc.view(torch.uint8), "left_trans": left, "right_trans": right,
             "clip_ratio": clip}
    row = (a, b) != trans_dims(k, False)
    return QuantizedTensor(W4A4MXFP4FlatQuant.name, KF.W4A4_MXFP4_FLATQUANT, (n, k), parts, 32, True,
                           {"parallel": ROW} if row else {})


MXFP4_FLATQUANT_LAYOUT = register(Layout(
    "ascend-w4a4-mxfp4-flatquant", KF.W4A4_MXFP4_FLATQUANT, ASCEND, (VLLM_ASCEND,), MX_TAG,
    (DiskTensor("weight", "U8", (N, ("k", 2))), DiskTensor("weight_scale", "U8", (N, ("k", 32))),
     DiskTensor("left_trans", "BF16", (KL, KL)), DiskTensor("right_trans", "BF16", (KR, KR)),
     DiskTensor("clip_ratio", "F32", (1,))),
    _encode_mx, _decode_mx, linears_only=True, splits_k=False, device="Ascend 950"))
MXFP4_FLATQUANT_ROW_LAYOUT = register(Layout(
    "ascend-w4a4-mxfp4-flatquant-row", KF.W4A4_MXFP4_FLATQUANT, ASCEND, (VLLM_ASCEND,), MX_TAG,
    (DiskTensor("weight", "U8", (N, ("k", 2))), DiskTensor("weight_scale", "U8", (N, ("k", 32))),
     DiskTensor("left_trans", "BF16", (RKL, RKL), k_split=DIAGONAL), DiskTensor("right_trans", "BF16", (RKR, RKR)),
     DiskTensor("clip_ratio", "F32", (1,))),
    _encode_mx, _decode_mx, linears_only=True, device="Ascend 950", parallel="row", max_tp=MAX_TP))
