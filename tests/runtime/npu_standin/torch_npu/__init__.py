"""A stand-in for ``torch_npu``, for the contract test only: no NPU exists here.

Each op below is the documented semantics of the real one, in plain torch on CPU, written
from the torch_npu / CANN API reference (hiascend.com) and NOT from cvt's kernels: argument
names and order (keyword-only where the reference has ``*``), dtypes and shapes the reference
allows (anything else raises, so a wrong call fails loudly), and the formulas. Arithmetic is
float32 with round-half-to-even; the real kernels' internal precision is not specified there.
Every call is appended to ``CALLS`` so a test can see which ops ran.

Sources (torch_npu API list "ptaoplist" pages, PyTorch 6.0 / 7.0 docs; aclnn pages):
  npu_dynamic_quant, npu_quant_matmul (+ aclnnQuantMatmulV4 formulas), npu_trans_quant_param,
  npu_quantize, npu_convert_weight_to_int4pack (+ aclnnConvertWeightToINT4Pack),
  npu_weight_quant_batchmatmul (+ aclnnWeightQuantBatchMatmulV2: ANTIQUANT(w) = (w + offset) * scale).
"""

from __future__ import annotations

import torch

__cvt_standin__ = True
CALLS: list[str] = []

_HALF = (torch.float16, torch.bfloat16)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError("torch_npu stand-in: " + msg)


def npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None):
    """Per-token symmetric dynamic quant, as the kernel computes it (torch_npu 2.14
    ``_op_plugin_docs.py`` npu_dynamic_quant; CANN ops-nn dynamic_quant: the per-row factor is
    127 / rowMax(|x|) and x is MULTIPLIED by it): y = round_half_even(x * (127 / rowMax(|x|))),
    and the returned scale = rowMax(|x|) / 127.

    Returns (y int8 shaped like x, scale float32 shaped x.shape[:-1]). smooth_scales (1-D, x's
    last dim, x's dtype) multiplies x first. An all-zero row is not covered by the reference
    (127 / 0); it gives scale 0 and y 0 here.
    """
    CALLS.append("npu_dynamic_quant")
    _need(x.dtype in _HALF, f"x must be float16/bfloat16, got {x.dtype}")
    _need(x.dim() > 1, "x must have more than one dimension")
    _need(group_index is None and dst_type in (None, torch.int8), "only int8 output without group_index is modelled")
    xf = x.to(torch.float32)
    if smooth_scales is not None:
        _need(smooth_scales.dtype == x.dtype and tuple(smooth_scales.shape) == (x.shape[-1],), "bad smooth_scales")
        xf = xf * smooth_scales.to(torch.float32)
    amax = xf.abs().amax(dim=-1)
    scale = amax / 127.0
    # one float32 division (torch's 127.0 / t would be t.reciprocal() * 127, rounded twice)
    factor = (torch.full_like(amax, 127.0) / torch.where(amax > 0, amax, torch.ones_like(amax))).unsqueeze(-1)
    y = torch.round(xf * factor).clamp(-128, 127)
    y = torch.where((scale > 0).unsqueeze(-1), y, torch.zeros_like(y))
    return y.to(torch.int8), scale


def _int64_scale_to_f32(scale):
    # the hardware scale: bits 0-31 of the int64 hold a float32 whose low 13 mantissa bits are
    # zero (FP19); bit 46 is a flag (and bits 37-45 an offset, not modelled)
    low = scale & 0xFFFFFFFF
    return torch.where(low >= 2**31, low - 2**32, low).to(torch.int32).view(torch.float32)


FP19_MASK = 0xFFFFE000  # sign, 8 exponent bits, 10 mantissa bits


def npu_trans_quant_param(scale, offset=None, round_mode=0):
    """float32 scale (t,) or (1, n) -> int64 of the same shape, the form npu_quant_matmul takes
    (torch_npu 2.14 ``_op_plugin_docs.py`` npu_trans_quant_param; op-plugin TransQuantParamV2):
    the float32 truncated to FP19 (round_mode 0: the low 13 mantissa bits cleared) in bits 0-31,
    bit 46 set."""
    CALLS.append("npu_trans_quant_param")
    _need(scale.dtype == torch.float32 and scale.dim() in (1, 2), f"scale must be float32 1-D/2-D, got {scale.dtype}")
    _need(offset is None, "offset is not modelled")
    _need(round_mode == 0, "only round_mode 0 (truncation) is modelled")
    bits = scale.contiguous().view(torch.int32).to(torch.int64) & FP19_MASK
    return bits | (1 << 46)


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None):
    """Quantized matmul (aclnnQuantMatmulV4 formulas), x1 int8 (m, k) @ x2 int8 (k, n):

    no pertoken: out = (x1 @ x2 + bias_int32) * scale + offset   (or x1 @ x2 * scale + bias_float)
    pertoken:    out = (x1 @ x2 + bias_int32) * scale * pertoken_scale
                 out =  x1 @ x2 * scale * pertoken_scale + bias_float
    scale: (t,), t = 1 or n, float32 / bfloat16, or int64 from npu_trans_quant_param (required
    for int8/float16 output without pertoken_scale). output_dtype: int8 (None), float16, bfloat16.
    """
    CALLS.append("npu_quant_matmul")
    _need(x1.dtype == torch.int8 and x2.dtype == torch.int8, f"x1/x2 must be int8, got {x1.dtype}/{x2.dtype}")
    _need(x1.dim() == 2 and x2.dim() == 2 and x1.shape[1] == x2.shape[0],
          f"x1 (m, k) and x2 (k, n) expected, got {list(x1.shape)} and {list(x2.shape)}")
    m, n = x1.shape[0], x2.shape[1]
    out_dtype = torch.int8 if output_dtype is None else output_dtype
    _need(out_dtype in (torch.int8, torch.float16, torch.bfloat16), f"bad output_dtype {output_dtype}")
    _need(scale.dim() == 1 and scale.shape[0] in (1, n), f"scale must be (1,) or ({n},), got {list(scale.shape)}")
    _need(scale.dtype in (torch.float32, torch.int64, torch.bfloat16), f"bad scale dtype {scale.dtype}")
    if pertoken_scale is None and out_dtype in (torch.int8, torch.float16):
        _need(scale.dtype == torch.int64, "int8/float16 output without pertoken_scale needs the int64 scale "
                                          "from npu_trans_quant_param")
    if scale.dtype == torch.int64:
        _need(pertoken_scale is None and out_dtype != torch.bfloat16, "int64 scale is for int8/float16 output only")
        s = _int64_scale_to_f32(scale)
    else:
        s = scale.to(torch.float32)
    acc = (x1.to(torch.float64) @ x2.to(torch.float64)).to(torch.int64)  # exact int32 accumulation
    _need(bool((acc.abs() < 2**31).all()), "int32 accumulator overflow")
    bias_int = bias is not None and bias.dtype == torch.int32
    if bias is not None:
        _need(bias.dim() == 1 and bias.shape[0] == n, f"bias must be ({n},), got {list(bias.shape)}")
        _need(bias.dtype in (torch.int32, torch.bfloat16, torch.float16, torch.float32), f"bad bias dtype {bias.dtype}")
        if bias_int:
            acc = acc + bias.to(torch.int64)
    y = acc.to(torch.int32).to(torch.float32) * s
    if pertoken_scale is not None:
        _need(pertoken_scale.dtype == torch.float32 and tuple(pertoken_scale.shape) == (m,),
              f"pertoken_scale must be float32 ({m},), got {pertoken_scale.dtype} {list(pertoken_scale.shape)}")
        _need(offset is None, "offset is not allowed with pertoken_scale")
        y = y * pertoken_scale[:, None]
    if bias is not None and not bias_int:
        _need(offset is None, "offset is not allowed with a float bias")
        y = y + bias.to(torch.float32)
    if offset is not None:
        y = y + offset.to(torch.float32)
    if out_dtype == torch.int8:
        return torch.round(y).clamp(-128, 127).to(torch.int8)
    return y.to(out_dtype)


_QRANGE = {torch.qint8: (-128, 127, torch.int8), torch.quint8: (0, 255, torch.uint8),
           torch.int32: (-2**31, 2**31 - 1, torch.int32)}


def npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True):
    """result = round(input / scales + zero_points) (div_mode=True) or round(input * scales + zero_points)
    (div_mode=False), saturated to dtype (torch.qint8 -> int8 values). With div_mode=False, scales and
    zero_points are 1-D of size 1 or input.shape[axis] and share input's dtype; axis > -2 means the
    last axis.
    """
    CALLS.append("npu_quantize")
    _need(dtype in _QRANGE, f"unsupported dtype {dtype}")
    lo, hi, out = _QRANGE[dtype]
    if div_mode:
        _need(scales.dtype in (torch.float32, torch.bfloat16), f"div_mode scales must be float32/bfloat16, got {scales.dtype}")
    else:
        _need(dtype == torch.qint8, "div_mode=False output is torch.qint8 here")
        _need(scales.dtype == input.dtype, f"scales dtype {scales.dtype} must equal input dtype {input.dtype}")
        _need(zero_points is None or (zero_points.dtype == scales.dtype and zero_points.shape == scales.shape),
              "zero_points must match scales in dtype and shape")
    ax = input.dim() - 2 if axis == -2 else input.dim() - 1
    _need(scales.dim() == 1 and scales.shape[0] in (1, input.shape[ax]), f"bad scales shape {list(scales.shape)}")
    shape = [1] * input.dim()
    shape[ax] = scales.shape[0]
    s = scales.to(torch.float32).reshape(shape)
    z = 0.0 if zero_points is None else zero_points.to(torch.float32).reshape(shape)
    x = input.to(torch.float32)
    y = (x / s if div_mode else x * s) + z
    return torch.round(y).clamp(lo, hi).to(out)


def npu_convert_weight_to_int4pack(weight, inner_k_tiles=0):
    """int32 (d0, d1) with values in [-8, 7], d1 a multiple of 8, contiguous -> int32 (d0, d1 / 8):
    8 int4 per int32 along the last dimension, element 8j + i in bits [4i, 4i + 4) (two's complement
    nibbles, lowest element in the lowest nibble, as the int8 two-per-byte form viewed as int32).
    """
    CALLS.append("npu_convert_weight_to_int4pack")
    _need(weight.dtype == torch.int32 and weight.dim() == 2, f"weight must be 2-D int32, got {weight.dtype}")
    _need(weight.is_contiguous(), "weight must be contiguous")
    _need(weight.shape[1] % 8 == 0, f"last dimension {weight.shape[1]} is not a multiple of 8")
    _need(bool(((weight >= -8) & (weight <= 7)).all()), "values outside the int4 range [-8, 7]")
    u = (weight.to(torch.int64) & 0xF).reshape(weight.shape[0], -1, 8)
    word = torch.zeros(u.shape[:2], dtype=torch.int64)
    for i in range(8):
        word |= u[:, :, i] << (4 * i)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _unpack_int4pack(w):
    v = torch.stack([(w >> (4 * i)) & 0xF for i in range(8)], dim=-1).reshape(w.shape[0], -1)
    return torch.where(v >= 8, v - 16, v)


def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                                 quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0):
    """y = x @ ANTIQUANT(weight) + bias, ANTIQUANT(weight) = (weight + antiquant_offset) * antiquant_scale.

    x (m, k) float16/bfloat16; weight int8 (k, n) or int32 (k, n / 8) carrying int4 (from
    npu_convert_weight_to_int4pack); antiquant_scale in x's dtype, (n,) / (1, n) per channel,
    (1,) per tensor, (ceil(k / antiquant_group_size), n) per group; antiquant_offset same shape
    and dtype. torch_npu 2.14 ``_op_plugin_docs.py`` npu_weight_quant_batchmatmul:
    antiquant_group_size is 0 or a multiple of 32 in [32, k - 1] (the binary's check:
    "antiquant_group_size can be either 0 or a multiple of 32 within the range 32 to
    weight_k_dim - 1"); bias (n,) is float16 when x is float16 and float32 when x is bfloat16.
    Output in x's dtype.
    """
    CALLS.append("npu_weight_quant_batchmatmul")
    _need(quant_scale is None and quant_offset is None, "output quantization is not modelled")
    _need(x.dtype in _HALF and x.dim() == 2, f"x must be 2-D float16/bfloat16, got {x.dtype} {list(x.shape)}")
    if weight.dtype == torch.int32:
        w = _unpack_int4pack(weight)
    else:
        _need(weight.dtype == torch.int8, f"weight must be int8 or int32 (int4 pack), got {weight.dtype}")
        w = weight.to(torch.int64)
    k, n = w.shape
    _need(x.shape[1] == k, f"x {list(x.shape)} does not match weight (k={k}, n={n})")
    _need(antiquant_scale.dtype == x.dtype, f"antiquant_scale dtype {antiquant_scale.dtype} must equal x's {x.dtype}")
    g = antiquant_group_size
    _need(g == 0 or (g % 32 == 0 and 32 <= g <= k - 1),
          f"antiquant_group_size can be either 0 or a multiple of 32 within the range 32 to weight_k_dim - 1 "
          f"(got {g}, k {k})")
    if antiquant_group_size:
        groups = -(-k // antiquant_group_size)
        _need(tuple(antiquant_scale.shape) == (groups, n), f"per-group scale must be ({groups}, {n})")
        expand = lambda t: t.to(torch.float32).repeat_interleave(antiquant_group_size, dim=0)[:k]  # noqa: E731
    else:
        _need(tuple(antiquant_scale.shape) in ((n,), (1, n), (1,)), f"bad antiquant_scale shape {list(antiquant_scale.shape)}")
        expand = lambda t: t.to(torch.float32).reshape(1, -1)  # noqa: E731
    wf = w.to(torch.float32)
    if antiquant_offset is not None:
        _need(antiquant_offset.dtype == antiquant_scale.dtype and antiquant_offset.shape == antiquant_scale.shape,
              "antiquant_offset must match antiquant_scale in dtype and shape")
        wf = wf + expand(antiquant_offset)
    wd = (wf * expand(antiquant_scale)).to(x.dtype)
    y = x.to(torch.float32) @ wd.to(torch.float32)
    if bias is not None:
        want = torch.float16 if x.dtype == torch.float16 else torch.float32
        _need(bias.dtype == want and bias.numel() == n,
              f"bias must be {want} ({n},) when x is {x.dtype}, got {bias.dtype} {list(bias.shape)}")
        y = y + bias.to(torch.float32).reshape(1, n)
    return y.to(x.dtype)
