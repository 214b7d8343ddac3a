"""The layout entries of the W8A8, W4A16, FP4 and W4A8_DYNAMIC kernel formats (Ascend and
compressed-tensors), registered on import; the Ascend 950 MX entries are `entries_mx`. Adding a
layout is one entry here (`cvt.qtensor.layouts` documents the table).
"""

from __future__ import annotations

import math

from cvt.lazy import torch

from cvt.errors import FormatError, ShapeError
from cvt.qtensor import primitives as P
from cvt.qtensor import kernel_formats as KF
from cvt.qtensor.layouts.base import (ASCEND, ASCEND_TARGETS, COMPRESSED_TENSORS, CT_TARGET, FLOATS, K16, MINDIE,
                                      SCALE_BIAS_RUNS, VLLM_ASCEND, DiskTensor, G, K, Layout, N, _expect, _take,
                                      register)
from cvt.qtensor.schemes import FP4, W4A8, W4A16, W8A8
from cvt.qtensor.schemes.base import QuantizedTensor


# ---- W8A8 ------------------------------------------------------------------------------------------
def _enc_w8a8_dynamic(q):
    n = q.shape[0]
    return {"weight": q.parts["weight"], "weight_scale": q.parts["weight_scale"].float().reshape(n, 1),
            "weight_offset": q.parts["weight_offset"].float().reshape(n, 1)}


def _dec_w8a8_dynamic(module, d):
    t = _take(module, d, ("weight", "weight_scale", "weight_offset"))
    n, k = _expect(f"{module}.weight", t["weight"], (torch.int8,)).shape
    sc = _expect(f"{module}.weight_scale", t["weight_scale"], FLOATS).float().reshape(n, 1)
    off = _expect(f"{module}.weight_offset", t["weight_offset"], FLOATS).float().reshape(n, 1)
    return QuantizedTensor(W8A8.name, KF.W8A8_DYNAMIC, (n, k), {"weight": t["weight"], "weight_scale": sc,
                                                            "weight_offset": off})


def _enc_w8a8_static(q):
    p, n = q.parts, q.shape[0]
    ws = q.extra.get("weight_scale")
    if ws is None:
        raise FormatError("static W8A8 needs its weight scale to write weight_scale (vllm-ascend's MLA fused "
                          "paths read it): quantize through cvt.qtensor.schemes.static_parts")
    ws = ws.float().reshape(n, 1)
    return {"weight": p["weight"], "input_scale": p["input_scale"].float().reshape(1),
            "input_offset": p["input_offset"].float().reshape(1), "deq_scale": p["deq_scale"],
            "quant_bias": p["quant_bias"], "weight_scale": ws, "weight_offset": torch.zeros_like(ws)}


def _dec_w8a8_static(module, d):
    t = _take(module, d, ("weight", "input_scale", "input_offset", "deq_scale", "quant_bias"))
    n, k = _expect(f"{module}.weight", t["weight"], (torch.int8,)).shape
    _expect(f"{module}.deq_scale", t["deq_scale"], (torch.float32, torch.int64), (n,))
    _expect(f"{module}.quant_bias", t["quant_bias"], (torch.int32,), (n,))
    parts = {"weight": t["weight"], "input_scale": t["input_scale"].float().reshape(1),
             "input_offset": t["input_offset"].float().reshape(1), "deq_scale": t["deq_scale"],
             "quant_bias": t["quant_bias"]}
    extra = {"weight_scale": d["weight_scale"].float().reshape(n, 1)} if "weight_scale" in d else {}
    return QuantizedTensor(W8A8.name, KF.W8A8_STATIC, (n, k), parts, 0, True, extra)


register(Layout("ascend-w8a8-dynamic", KF.W8A8_DYNAMIC, ASCEND, ASCEND_TARGETS, "W8A8_DYNAMIC",
                (DiskTensor("weight", "I8", (N, K)), DiskTensor("weight_scale", "F32", (N, 1)),
                 DiskTensor("weight_offset", "F32", (N, 1))), _enc_w8a8_dynamic, _dec_w8a8_dynamic,
                pack="i8"))
register(Layout("ascend-w8a8-static", KF.W8A8_STATIC, ASCEND, ASCEND_TARGETS, "W8A8",
                (DiskTensor("weight", "I8", (N, K)), DiskTensor("input_scale", "F32", (1,)),
                 DiskTensor("input_offset", "F32", (1,)), DiskTensor("deq_scale", "F32", (N,)),
                 DiskTensor("quant_bias", "I32", (N,)),
                 # cvt writes these (vllm-ascend's MLA fused paths read weight_scale); msModelSlim 26.1's
                 # ascendv1_saver does not (static W8A8 linears: weight, input_scale, input_offset,
                 # deq_scale, quant_bias), and the static kernel needs neither: optional on reading
                 DiskTensor("weight_scale", "F32", (N, 1), optional=True),
                 DiskTensor("weight_offset", "F32", (N, 1), optional=True)), _enc_w8a8_static, _dec_w8a8_static))


def _enc_ct_int8(q):
    p, n = q.parts, q.shape[0]
    if bool((p["weight_offset"] != 0).any()):
        raise FormatError("int-quantized W8A8 is symmetric: non-zero weight offsets")
    return {"weight": p["weight"], "weight_scale": p["weight_scale"].float().reshape(n, 1)}


def _dec_ct_int8(module, d):
    t = _take(module, d, ("weight", "weight_scale"))
    n, k = _expect(f"{module}.weight", t["weight"], (torch.int8,)).shape
    sc = _expect(f"{module}.weight_scale", t["weight_scale"], FLOATS)
    if sc.numel() != n:
        raise FormatError(f"{module}.weight_scale {list(sc.shape)}: expected [{n}, 1] (channel)")
    if "weight_zero_point" in d:
        raise FormatError(f"{module} is asymmetric int8; cvt's W8A8 is symmetric")
    sc = sc.float().reshape(n, 1)
    return QuantizedTensor(W8A8.name, KF.W8A8_DYNAMIC, (n, k), {"weight": t["weight"], "weight_scale": sc,
                                                            "weight_offset": torch.zeros_like(sc)})


register(Layout("ct-int8", KF.W8A8_DYNAMIC, COMPRESSED_TENSORS, (CT_TARGET,), None,
                (DiskTensor("weight", "I8", (N, K)), DiskTensor("weight_scale", "F32", (N, 1))),
                _enc_ct_int8, _dec_ct_int8, pack="i8"))


# ---- W4A16 -----------------------------------------------------------------------------------------
def _w4a16(q_int4, sc, off, sym=None):
    n, k = q_int4.shape
    if sc.dim() != 2 or sc.shape[0] != n or k % sc.shape[1]:
        raise FormatError(f"weight_scale {list(sc.shape)} does not fit the weight [{n}, {k}] (expected [{n}, k/G])")
    g = 0 if sc.shape[1] == 1 else k // sc.shape[1]
    return QuantizedTensor(W4A16.name, KF.W4A16, (n, k), {"weight_int4": q_int4, "weight_scale": sc,
                                                      "weight_offset": off},
                           g, bool((off == 0).all()) if sym is None else sym)


def _ascend_int8_encoder(dim: int):
    def enc(q):
        if q.shape[dim] % 2:
            raise FormatError(f"cannot pack {list(q.shape)} along dim {dim} "
                              f"({'pairs of output channels' if dim == 0 else 'in_features'} must be even)")
        return {"weight": P.pack_int4_ascend(q.parts["weight_int4"], dim),
                "weight_scale": q.parts["weight_scale"].float(), "weight_offset": q.parts["weight_offset"].float()}
    return enc


def _dec_ascend_int8(module, d):
    t = _take(module, d, ("weight", "weight_scale", "weight_offset"))
    _expect(f"{module}.weight", t["weight"], (torch.int8,))
    sc = t["weight_scale"].float()
    if sc.dim() != 2:
        raise FormatError(f"{module}.weight_scale is {list(sc.shape)}: expected 2-D [n, k/G]")
    off = _expect(f"{module}.weight_offset", t["weight_offset"].float(), (torch.float32,), tuple(sc.shape))
    # the pack dim by rows: TP shards may hold one group per row
    return _w4a16(P.unpack_int4_ascend(t["weight"], P.ascend_pack_dim(sc, t["weight"])), sc, off)


register(Layout("ascend-w4a16-int8-grouped", KF.W4A16, ASCEND, (MINDIE,), "W4A16",
                (DiskTensor("weight", "I8", (("n", 2), K)), DiskTensor("weight_scale", "F32", (N, G)),
                 DiskTensor("weight_offset", "F32", (N, G))), _ascend_int8_encoder(0), _dec_ascend_int8,
                grouping="grouped", groups=(64, 128, 256), pack="nib_rows"))  # MindIE models/base/config.py: group_size check
register(Layout("ascend-w4a16-int8-channel", KF.W4A16, ASCEND, (MINDIE,), "W4A16",
                (DiskTensor("weight", "I8", (N, ("k", 2))), DiskTensor("weight_scale", "F32", (N, 1)),
                 DiskTensor("weight_offset", "F32", (N, 1))), _ascend_int8_encoder(1), _dec_ascend_int8,
                grouping="channel", pack="nib_k"))


def _check_bf16(sc: torch.Tensor) -> torch.Tensor:
    if not torch.equal(P.round_to_bf16(sc), sc):
        raise FormatError("weight_scale is not bfloat16-representable; the int32 pack-quantized layout stores "
                          "bf16 scales (quantize with cvt's w4a16 scheme)")
    return sc.to(torch.bfloat16)


def _enc_int32(q, zero_point: bool):
    p, (n, k) = q.parts, q.shape
    out = {"weight_packed": P.pack_int4_ct(p["weight_int4"], 1), "weight_scale": _check_bf16(p["weight_scale"].float()),
           "weight_shape": torch.tensor([n, k], dtype=torch.int32)}
    if not q.symmetric:
        if not zero_point:
            raise FormatError("vllm-ascend's W4A16 MoE method loads no zero points (weight_offset is zeros): "
                              "quantize symmetric (drop --asym)")
        out["weight_zero_point"] = P.pack_int4_ct(p["weight_offset"].to(torch.int8), 0)
    elif bool((p["weight_offset"] != 0).any()):
        raise FormatError("marked symmetric but has non-zero offsets")
    return out


def _dec_int32(module, d):
    t = _take(module, d, ("weight_packed", "weight_scale", "weight_shape"))
    shape = t["weight_shape"].reshape(-1).tolist()
    if len(shape) != 2:
        raise FormatError(f"{module}.weight_shape is {shape}: expected [n, k]")
    n, k = (int(v) for v in shape)
    _expect(f"{module}.weight_packed", t["weight_packed"], (torch.int32,), (n, math.ceil(k / 8)))
    sc = t["weight_scale"].float()
    sym = "weight_zero_point" not in d
    off = torch.zeros_like(sc) if sym else P.unpack_int4_ct(d["weight_zero_point"], n, 0).float()
    if tuple(off.shape) != tuple(sc.shape):
        raise FormatError(f"{module}.weight_zero_point unpacks to {list(off.shape)}, expected {list(sc.shape)}")
    return _w4a16(P.unpack_int4_ct(t["weight_packed"], k, 1), sc, off, sym)


_INT32 = (DiskTensor("weight_packed", "I32", (N, ("k", 8))), DiskTensor("weight_scale", "BF16", (N, G)),
          DiskTensor("weight_shape", "I32", (2,)))
register(Layout("ascend-w4a16-int32", KF.W4A16, ASCEND, (VLLM_ASCEND,), "W4A16", _INT32,
                lambda q: _enc_int32(q, zero_point=False), _dec_int32, experts_only=True, grouping="grouped",
                pack="ct32"))
register(Layout("ct-int4", KF.W4A16, COMPRESSED_TENSORS, (CT_TARGET,), None,
                _INT32 + (DiskTensor("weight_zero_point", "I32", (("n", 8), G), optional=True),),
                lambda q: _enc_int32(q, zero_point=True), _dec_int32, pack="ct32"))


# ---- FP4 ---------------------------------------------------------------------------------------------
def _enc_fp4(packed_name: str):
    def enc(q):
        out = {packed_name: P.pack_fp4(q.parts["weight_fp4"])}
        if q.kernel_fmt == KF.NVFP4:
            out["weight_scale"] = q.parts["weight_scale"]
            out["weight_global_scale"] = q.parts["weight_global_scale"].float().reshape(1)
        else:
            out["weight_scale"] = q.parts["weight_scale"].view(torch.uint8)
        return out
    return enc


def _dec_fp4(packed_name: str):
    def dec(module, d):
        packed = _expect(f"{module}.{packed_name}", _take(module, d, (packed_name,))[packed_name], (torch.uint8,))
        codes = P.unpack_fp4(packed)
        n, k = codes.shape
        if "weight_global_scale" in d:
            t = _take(module, d, ("weight_scale", "weight_global_scale"))
            sc = _expect(f"{module}.weight_scale", t["weight_scale"], (torch.float8_e4m3fn,), (n, k // 16))
            parts = {"weight_fp4": codes, "weight_scale": sc,
                     "weight_global_scale": t["weight_global_scale"].float().reshape(1)}
            return QuantizedTensor(FP4.name, KF.NVFP4, (n, k), parts, 16, True, {"fp4_format": KF.NVFP4})
        sc = _expect(f"{module}.weight_scale", _take(module, d, ("weight_scale",))["weight_scale"],
                     (torch.uint8, torch.float8_e8m0fnu), (n, k // 32))
        return QuantizedTensor(FP4.name, KF.MXFP4, (n, k), {"weight_fp4": codes, "weight_scale": sc.view(torch.uint8)},
                               32, True, {"fp4_format": KF.MXFP4})
    return dec


register(Layout("ct-nvfp4", KF.NVFP4, COMPRESSED_TENSORS, (CT_TARGET,), None,
                (DiskTensor("weight_packed", "U8", (N, ("k", 2))), DiskTensor("weight_scale", "F8_E4M3", (N, ("k", 16))),
                 DiskTensor("weight_global_scale", "F32", (1,))), _enc_fp4("weight_packed"), _dec_fp4("weight_packed"),
                pack="e2m1"))
register(Layout("ct-mxfp4", KF.MXFP4, COMPRESSED_TENSORS, (CT_TARGET,), None,
                (DiskTensor("weight_packed", "U8", (N, ("k", 2))), DiskTensor("weight_scale", "U8", (N, ("k", 32)))),
                _enc_fp4("weight_packed"), _dec_fp4("weight_packed"), pack="e2m1"))
register(Layout("ascend-mxfp4", KF.MXFP4, ASCEND, (VLLM_ASCEND,), "W4A16_MXFP4",
                (DiskTensor("weight", "U8", (N, ("k", 2))), DiskTensor("weight_scale", "U8", (N, ("k", 32)))),
                _enc_fp4("weight"), _dec_fp4("weight"), experts_only=True, pack="e2m1"))


def _w4a8_encoder(runs: int):
    def enc(q):
        p, (n, k) = q.parts, q.shape
        if n % 8:
            raise ShapeError(f"W4A8_DYNAMIC packs two int4 per byte along out_features and vllm-ascend views the "
                              f"[k, n/2] bytes as int32 (methods/w4a8.py pack_to_int32): out_features must be a "
                              f"multiple of 8, got {n}")
        if k % runs:
            raise ShapeError(f"W4A8_DYNAMIC row-parallel scale_bias sums in_features in {runs} runs: in_features "
                              f"must be a multiple of {runs}, got {k}")
        qi, sc = p["weight_int4"], p["weight_scale"].to(torch.float32).reshape(n, 1)
        # ascendv1.py on_w4a8_dynamic: deq_weight = weight.float().T * weight_scale; process_scale(name,
        # deq_weight.T, 16) -- summed, then times 8 (the order and views are msModelSlim's)
        deq = (qi.to(torch.float32).T * sc.reshape(n)).T
        if runs == 1:
            sb = 8 * deq.sum(dim=1, keepdim=True)
        else:
            sb = (8 * deq.reshape(-1, k // runs).sum(dim=1, keepdim=True)).reshape(n, -1)
        return {"weight": P.pack_int4_ascend(qi, 0), "weight_scale": sc, "weight_offset": torch.zeros_like(sc),
                "scale_bias": sb.to(torch.float32)}
    return enc


def _dec_w4a8(module, d):
    if "weight_scale_second" in d or "weight_offset_second" in d:
        raise FormatError(f"{module}: per-group W4A8_DYNAMIC (weight_scale_second / weight_offset_second, "
                          "msModelSlim's older two-level form) is not supported; cvt reads the per-channel form")
    t = _take(module, d, ("weight", "weight_scale", "weight_offset", "scale_bias"))
    packed = _expect(f"{module}.weight", t["weight"], (torch.int8,))
    if packed.dim() != 2:
        raise FormatError(f"{module}.weight is {list(packed.shape)}: expected 2-D [n/2, k]")
    n, k = 2 * packed.shape[0], packed.shape[1]
    sc = _expect(f"{module}.weight_scale", t["weight_scale"], FLOATS)
    if sc.numel() != n or sc.dim() > 2:
        raise FormatError(f"{module}.weight_scale is {list(sc.shape)}: expected [{n}, 1] (per channel; the weight "
                          f"[{n // 2}, {k}] packs two output channels per byte)")
    off = _expect(f"{module}.weight_offset", t["weight_offset"], FLOATS)
    if off.numel() != n or bool((off != 0).any()):
        raise FormatError(f"{module}.weight_offset must be {n} zeros (W4A8_DYNAMIC is symmetric)")
    sb = _expect(f"{module}.scale_bias", t["scale_bias"], (torch.float32,))
    if sb.dim() != 2 or sb.shape[0] != n or SCALE_BIAS_RUNS % sb.shape[1]:
        raise FormatError(f"{module}.scale_bias is {list(sb.shape)}: expected [{n}, 1] or [{n}, "
                          f"{SCALE_BIAS_RUNS} / tp]")
    parts = {"weight_int4": P.unpack_int4_ascend(packed, 0), "weight_scale": sc.to(torch.float32).reshape(n, 1)}
    return QuantizedTensor(W4A8.name, KF.W4A8_DYNAMIC, (n, k), parts)


def _w4a8_tensors(scale_bias: tuple) -> tuple[DiskTensor, ...]:
    return (DiskTensor("weight", "I8", (("n", 2), K)), DiskTensor("weight_scale", "F32", (N, 1)),
            DiskTensor("weight_offset", "F32", (N, 1)), DiskTensor("scale_bias", "F32", scale_bias))


# vllm-ascend's linear method for W4A8_DYNAMIC divides by the description's group_size (0 here:
# ZeroDivisionError) and runs it as weight-only W4A16 anyway: loaded for MoE experts only
register(Layout("ascend-w4a8-dynamic", KF.W4A8_DYNAMIC, ASCEND, (VLLM_ASCEND,), "W4A8_DYNAMIC",
                _w4a8_tensors((N, 1)), _w4a8_encoder(1), _dec_w4a8, experts_only=True, grouping="channel",
                parallel="column"))
register(Layout("ascend-w4a8-dynamic-row", KF.W4A8_DYNAMIC, ASCEND, (VLLM_ASCEND,), "W4A8_DYNAMIC",
                _w4a8_tensors((N, ("k", K16))), _w4a8_encoder(SCALE_BIAS_RUNS), _dec_w4a8, experts_only=True,
                grouping="channel", parallel="row"))
