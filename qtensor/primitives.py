"""Quantization primitives: scales, int rounding, E2M1 / E8M0 / nvfp4 scales, and bit packing.

Everything here is a pure function of tensors (float32 math, no scheme or format knowledge);
schemes (`cvt.qtensor.schemes`) compose them, formats (`cvt.qtensor.formats`) and the runtime
kernels (`cvt.runtime.kernels.int4` / `fp4`) use the pack helpers. This module imports only
torch and `cvt.errors` so the runtime can import it without a cycle.

Granularity is one ``group_size`` for a weight ``w [n, k]``: 0 = one scale per output channel
(``[n, 1]``), G = one scale per G consecutive elements along k (``[n, k/G]``).

Rules (and where they come from):

* Symmetric int: ``scale = amax / qdiv``, ``q = clamp(round(w / scale), qmin, qmax)``,
  round half to even (`torch.round`). int8 uses qdiv = 127 (Ascend: msModelSlim-format
  converters, e.g. omni-infer ``weight_quant``: ``abs_max / 127``); int4 uses qdiv = 7.5 over
  -8..7, compressed-tensors' ``calculate_qparams`` (``max_val_pos / ((q_max - q_min) / 2)``),
  which is also GPTQ's symmetric rule (``scale = 2 * amax / 15``, zero 8).
* Asymmetric int (documented form ``w = (q - offset) * scale``, FORMATS.md 2.2):
  ``lo = min(w, 0)``, ``hi = max(w, 0)``, ``scale = (hi - lo) / (qmax - qmin)``,
  ``offset = clamp(round(qmin - lo / scale), qmin, qmax)``, ``q = clamp(round(w / scale +
  offset), qmin, qmax)`` (compressed-tensors ``calculate_qparams``, asymmetric branch; when the
  scale is then rounded, e.g. to bf16, the offset keeps the unrounded scale's value, as there).
* A zero scale (an all-zero channel or group) is replaced by 1.0 so nothing divides by zero;
  its q are all 0, so it dequantizes to exact zeros.
* E2M1 (fp4) encode: round to the nearest of {0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to the even
  code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), |x| > 6
  saturates to 6; the sign bit is set for every negative input, including those that round to
  zero (-0.0): compressed-tensors ``cast_to_fp4`` + ``pack_fp4_to_uint8`` (``torch.signbit``).
* nvfp4: ``global_scale = 448 * 6 / amax(w)`` (float32; 1.0 when amax is 0 or the quotient
  overflows), block scale ``e4m3(clamp(amax_block / 6 * global_scale, +-448))`` (0 -> 0.125,
  the e4m3 eps), ``w ~= fp4 * (float(scale) / global_scale)``: compressed-tensors
  ``generate_gparam``, ``calculate_qparams`` (global_scale branch, ``_get_dtype_eps``) and
  ``_quantize`` / ``_dequantize`` (``scale = scale / global_scale`` first).
* mxfp4: E8M0 exponent ``e = 127 + floor(log2(p)) - 2`` where p is amax_block rounded to a
  power of two, up when its mantissa is >= 0.75 (compressed-tensors ``generate_mx_scales`` /
  ``round_to_power_2``, offset floor(log2(6)) = 2), clamped to 0..254; ``w ~= fp4 * 2**(e-127)``.
"""

from __future__ import annotations

import contextlib
import contextvars

from cvt.lazy import torch

from cvt.errors import CvtError, TensorError

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_EPS = 0.125  # torch.finfo(torch.float8_e4m3fn).eps: compressed-tensors' replacement for a zero scale
INT8_QDIV, INT4_QDIV = 127.0, 7.5


def _desc(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"


# ---- checks and grouping --------------------------------------------------------------------------

# set by `finite_known`: the weights quantized in that block derive from one already checked
_FINITE_KNOWN = contextvars.ContextVar("cvt_finite_known", default=False)


@contextlib.contextmanager
def finite_known():
    """Within the block `check_finite` passes without reading its tensor: for a caller that checked
    a weight once and quantizes many finite variants of it (GPTQ's scale search: clipped copies)."""
    token = _FINITE_KNOWN.set(True)
    try:
        yield
    finally:
        _FINITE_KNOWN.reset(token)


def check_finite(w: torch.Tensor, name: str | None = None) -> None:
    """Raise TensorError on NaN/Inf in a weight (naming it when `name` is given)."""
    if _FINITE_KNOWN.get():
        return
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        raise nonfinite_error(name, _desc(w), int(bad.sum()))


def nonfinite_error(name: str | None, desc: str, count: int) -> TensorError:
    """`check_finite`'s error for a weight described as `desc` (e.g. ``"float32 [n, k]"``) holding
    `count` NaN/Inf values (also raised by the fused kernels, `cvt.quant.qkernel`)."""
    who = f"weight {name!r}" if name else "weight"
    return TensorError(f"{who} ({desc}) holds {count} non-finite value(s) (NaN/Inf): cannot quantize it")


def check_group(name: str, shape: tuple[int, int], group_size: int, scheme: str = "") -> None:
    """Raise CvtError naming the tensor when `group_size` does not divide k (shape [n, k])."""
    if len(shape) != 2 or shape[0] <= 0 or shape[1] <= 0:
        raise CvtError(f"{scheme or 'scheme'}: tensor {name!r} has shape {list(shape)}: expected a non-empty "
                       "2-D [out_features, in_features] weight")
    if group_size < 0 or (group_size and shape[1] % group_size):
        raise CvtError(f"{scheme or 'scheme'}: tensor {name!r} with shape {list(shape)}: group size {group_size} "
                       f"does not divide in_features={shape[1]} (use a divisor of {shape[1]}, or 0 = per channel)")


def groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """``w [n, k]`` -> ``[n, k/G, G]`` (``[n, 1, k]`` for group_size 0)."""
    n, k = w.shape
    g = group_size or k
    if k % g:
        raise CvtError(f"group size {g} does not divide in_features={k} of a {_desc(w)} weight")
    return w.reshape(n, k // g, g)


def ungroup(x: torch.Tensor) -> torch.Tensor:
    """Inverse of `groups`: ``[n, k/G, G]`` -> ``[n, k]``."""
    return x.reshape(x.shape[0], -1)


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 values rounded (nearest even) to the nearest bfloat16, returned as float32."""
    return x.to(torch.float32).to(torch.bfloat16).to(torch.float32)


# ---- integer quantization -------------------------------------------------------------------------

def _safe(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def symmetric_scale(w: torch.Tensor, group_size: int, qdiv: float, scale_round=None) -> torch.Tensor:
    """``amax / qdiv`` per group, float32 ``[n, k/G]`` (``[n, 1]`` per channel), then `scale_round`
    (e.g. `round_to_bf16`) when given; a zero scale becomes 1.0."""
    amax = groups(w.to(torch.float32), group_size).abs().amax(dim=-1)
    scale = amax / qdiv
    return _safe(scale if scale_round is None else scale_round(scale))


def asymmetric_scale_offset(w: torch.Tensor, group_size: int, qmin: int, qmax: int,
                            scale_round=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Min/max scale and integer-valued offset per group (both float32 ``[n, k/G]``).

    The offset is derived from the unrounded scale, then `scale_round` (e.g. `round_to_bf16`)
    is applied to the scale: compressed-tensors' order (its observer computes the zero point,
    the checkpoint stores the scale in bf16). An all-zero group gets scale 1.0, offset qmin.
    """
    g = groups(w.to(torch.float32), group_size)
    lo = torch.clamp(g.amin(dim=-1), max=0.0)
    hi = torch.clamp(g.amax(dim=-1), min=0.0)
    scale = _safe((hi - lo) / float(qmax - qmin))
    offset = torch.clamp(torch.round(qmin - lo / scale), qmin, qmax) + 0.0  # + 0.0: no -0.0 offsets
    if scale_round is not None:
        scale = _safe(scale_round(scale))
    return scale, offset


def quantize_int(w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                 qmin: int, qmax: int) -> torch.Tensor:
    """``clamp(round(w / scale + offset), qmin, qmax)`` per group, as int8 ``[n, k]``.

    `scale` / `offset` are ``[n, k/G]``; the group size is k divided by their last dim.
    """
    n, k = w.shape
    ng = scale.shape[-1]
    x = w.to(torch.float32).reshape(n, ng, k // ng) / scale.to(torch.float32)[:, :, None]
    if offset is not None:
        x = x + offset.to(torch.float32)[:, :, None]
    return torch.clamp(torch.round(x), qmin, qmax).reshape(n, k).to(torch.int8)


def dequantize_int(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """``(q - offset) * scale`` per group in float32 ``[n, k]`` (what the w4a16 / w8a8 kernels use)."""
    n, k = q.shape
    ng = scale.shape[-1]
    x = q.to(torch.float32).reshape(n, ng, k // ng)
    if offset is not None:
        x = x - offset.to(torch.float32)[:, :, None]
    return (x * scale.to(torch.float32)[:, :, None]).reshape(n, k)


# ---- E2M1 (fp4) -------------------------------------------------------------------------------------

def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float values (already divided by their scale) -> uint8 codes ``sign << 3 | index``.

    Thresholds (|x|): <= 0.25 -> 0, < 0.75 -> 0.5, <= 1.25 -> 1, < 1.75 -> 1.5, <= 2.5 -> 2,
    < 3.5 -> 3, <= 5 -> 4, else 6 (ties to the even code; saturating). Worked example:
    ``[0.25, 0.3, -0.75, 2.5, 2.6, -7.0, -0.1] -> [0, 1, 10, 4, 5, 15, 8]``.
    """
    a = x.to(torch.float32).abs()
    idx = ((a > 0.25).to(torch.uint8) + (a >= 0.75).to(torch.uint8) + (a > 1.25).to(torch.uint8)
           + (a >= 1.75).to(torch.uint8) + (a > 2.5).to(torch.uint8) + (a >= 3.5).to(torch.uint8)
           + (a > 5.0).to(torch.uint8))
    return idx | (torch.signbit(x).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes (low 4 bits: sign << 3 | index) -> float32 values (code 8 is -0.0)."""
    c = codes.to(torch.int64)
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def nvfp4_global_scale(w: torch.Tensor) -> torch.Tensor:
    """``448 * 6 / amax(w)`` as float32 ``[1]`` (1.0 for an all-zero weight)."""
    amax = w.to(torch.float32).abs().amax()
    amax = torch.clamp(amax, min=torch.finfo(torch.float32).tiny)
    gs = torch.nan_to_num((E4M3_MAX * E2M1_MAX) / amax, nan=1.0, posinf=1.0, neginf=1.0)
    return gs.reshape(1).to(torch.float32)


def nvfp4_global_scale_of(amax: float) -> float:
    """`nvfp4_global_scale` from a float32 ``amax`` (max |w|, e.g. the fused kernel's), in
    numpy float32: the same value, without torch (`cvt.quant.qkernel`'s numpy path)."""
    import numpy as np

    a = max(np.float32(amax), np.finfo(np.float32).tiny)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        # torch's `number / tensor` is `tensor.reciprocal() * number` (Tensor.__rtruediv__): two
        # float32 roundings, which a single division would not match bit for bit
        gs = (np.float32(1.0) / a) * np.float32(E4M3_MAX * E2M1_MAX)
    return float(gs) if np.isfinite(gs) else 1.0


def nvfp4_block_scales(w: torch.Tensor, global_scale: torch.Tensor, group: int = 16) -> torch.Tensor:
    """float8_e4m3fn ``[n, k/16]``: ``e4m3(clamp(amax_block / 6 * global_scale, +-448))``, 0 -> 0.125."""
    amax = groups(w.to(torch.float32), group).abs().amax(dim=-1)
    s = (amax / E2M1_MAX) * global_scale.to(torch.float32).reshape(())
    s = torch.clamp(s, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return torch.where(s == 0, torch.full_like(s, E4M3_EPS), s).to(torch.float8_e4m3fn)


def e8m0_to_f32(e: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 exponents -> float32 ``2**(e - 127)``, built from bits (exact; 0 -> 2**-127, 255 -> NaN)."""
    e = e.view(torch.uint8).to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23)
    bits = torch.where(e == 255, torch.full_like(e, 0x7FC00000), bits)
    return bits.view(torch.float32)


def mxfp4_scale_codes(w: torch.Tensor, group: int = 32) -> torch.Tensor:
    """uint8 E8M0 ``[n, k/32]``: ``127 + floor(log2(pow2_round(amax))) - 2`` clamped to 0..254.

    ``pow2_round`` keeps amax's exponent and rounds up when the top two mantissa bits are 11
    (mantissa >= 0.75): in float32 bits, ``(bits + 2**21) & 0x7F800000``. Worked example:
    amax 6.0 = 1.5 * 2**2 -> 2**2 -> e = 127 (scale 1: 6 -> code 7); amax 7.0 = 1.75 * 2**2 ->
    2**3 -> e = 128 (scale 2: 7/2 = 3.5 -> 4, dequant 8).
    """
    amax = groups(w.to(torch.float32), group).abs().amax(dim=-1).contiguous()
    exp_field = ((amax.view(torch.int32).to(torch.int64) + (1 << 21)) >> 23) & 0xFF
    return torch.clamp(exp_field - 2, 0, 254).to(torch.uint8)


# ---- Ascend int4 packing: two per int8, even element in the low nibble ------------------------------

def ascend_pack_dim(scale: torch.Tensor, packed: torch.Tensor | None = None) -> int:
    """0 (pairs of output channels) for per-group scales, 1 (along k) when the scale's last dim is 1.

    Given the packed weight, its rows decide instead: ``[n/2, k]`` (half the scale's rows) is
    packed in row pairs, ``[n, k/2]`` along k. That also reads a TP shard of a grouped weight
    whose rank holds one group per row (scale ``[n, 1]``, still packed in row pairs)."""
    if packed is not None and packed.dim() == 2 and scale.dim() == 2:
        return 0 if scale.shape[0] == 2 * packed.shape[0] else 1
    return 1 if scale.shape[-1] == 1 else 0


def pack_int4_ascend(q: torch.Tensor, dim: int) -> torch.Tensor:
    """int4 values ``q`` int8 ``[n, k]`` (-8..7) -> int8 packed along `dim` (0: ``[n/2, k]``, 1: ``[n, k/2]``).

    Two's-complement nibbles; element 2j of `dim` in the low nibble, 2j+1 in the high one.
    Worked example, ``q = [[1, -2], [3, -4]]``: dim 0 (per-group W4A16, pairs of output
    channels) -> ``[[0x31, 0xCE]]`` (column 0: 1 low, 3 high; column 1: -2 = 0xE low, -4 = 0xC
    high); dim 1 (per-channel, along k) -> ``[[0xE1], [0xC3]]`` (as int8: -31, -61).
    """
    if q.dim() != 2 or q.shape[dim] % 2:
        raise TensorError(f"cannot pack int4 {_desc(q)} along dim {dim}: needs an even size there")
    u = q.to(torch.int16) & 0xF
    lo, hi = (u[0::2], u[1::2]) if dim == 0 else (u[:, 0::2], u[:, 1::2])
    v = lo | (hi << 4)
    return torch.where(v >= 128, v - 256, v).to(torch.int8)


def unpack_int4_ascend(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of `pack_int4_ascend`: int8 packed -> int8 ``[n, k]`` values -8..7."""
    u = packed.to(torch.int16) & 0xFF
    lo, hi = u & 0xF, u >> 4
    lo, hi = torch.where(lo >= 8, lo - 16, lo), torch.where(hi >= 8, hi - 16, hi)
    out = torch.stack((lo, hi), dim=dim + 1)  # [.., 2, ..] interleaved along `dim`
    shape = list(packed.shape)
    shape[dim] *= 2
    return out.reshape(shape).to(torch.int8)


# ---- compressed-tensors pack-quantized: int32, value + 8, element i of 8 at bits 4i -----------------

def pack_int4_ct(q: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """int4 values int8 -8..7 -> int32 packed 8 per word along `dim` (zero nibbles pad to a multiple of 8).

    Worked example, one row ``[1, -2, 3, -4, 5, -6, 7, -8, 2, 0]``: +8 -> 9 6 11 4 13 2 15 0 | 10 8,
    element i at bits 4i -> words ``[0x0F2D4B69, 0x0000008A]`` (compressed-tensors
    ``pack_to_int32(num_bits=4)``; the zero point uses dim 0: ``[n, k/G] -> [ceil(n/8), k/G]``).
    """
    u = q.to(torch.int64) + 8
    if dim == 0:
        u = u.t()
    pad = (-u.shape[1]) % 8
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    u = u.reshape(u.shape[0], -1, 8)
    word = torch.zeros(u.shape[:2], dtype=torch.int64, device=q.device)
    for i in range(8):
        word |= u[:, :, i] << (4 * i)
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return word.t().contiguous() if dim == 0 else word


def unpack_int4_ct(packed: torch.Tensor, size: int, dim: int = 1) -> torch.Tensor:
    """Inverse of `pack_int4_ct`: int32 words -> int8 values -8..7, `size` elements along `dim`."""
    p = packed.t() if dim == 0 else packed
    v = torch.stack([(p >> (4 * i)) & 0xF for i in range(8)], dim=-1).reshape(p.shape[0], -1)[:, :size]
    v = (v - 8).to(torch.int8)
    return v.t().contiguous() if dim == 0 else v


# ---- fp4 packing (nvfp4 / mxfp4 pack-quantized) ----------------------------------------------------

def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[n, k]`` (k even) -> uint8 ``[n, k/2]``, element 2j low nibble, 2j+1 high.

    Worked example: codes ``[[1, 2, 9, 15]]`` (0.5, 1.0, -0.5, -6.0) -> ``[[0x21, 0xF9]]``
    (compressed-tensors ``pack_fp4_to_uint8``).
    """
    if codes.dim() != 2 or codes.shape[1] % 2:
        raise TensorError(f"cannot pack fp4 codes {_desc(codes)}: expected 2-D with an even last dimension")
    c = codes.to(torch.uint8) & 0xF
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, k/2]`` -> uint8 codes ``[n, k]`` (inverse of `pack_fp4`)."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(packed.shape[0], -1)


# --- int8 activations and the static W8A8 constants (the serving kernels' arithmetic) ---

def per_token_quant(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantization of ``x2 [m, k]``: (x_q int8, x_scale float32 [m]).

    The codes multiply by the float32 factor ``127 / amax`` and round half to even, the scale
    is ``amax / 127``: what vLLM's CUDA kernel (csrc/quantization/w8a8/int8/scaled_quant.cu,
    ``dynamic_scaled_int8_quant_kernel``: ``inv_s = 127.f / absmax``, 0 for a zero row, then
    ``cvt.rni.sat.s8.f32(x * inv_s)``) and torch_npu's ``npu_dynamic_quant`` (ops-nn
    dynamic_quant.h, see `cvt.runtime.kernels.npu`) compute. ``round(x / x_scale)`` is one code
    off wherever ``x * 127 / amax`` is a half-integer (a few % of bf16 rows).

    The factor is one correctly rounded float32 division: torch's ``127.0 / t`` is
    ``t.reciprocal() * 127`` (two roundings, a last-bit difference for ~27% of bf16 amax values).
    An amax below ~3.7e-37 makes the factor inf: the row saturates (+-127 / -128, zeros stay 0),
    as ``cvt.rni.sat`` does."""
    xf = x2.to(torch.float32)
    amax = xf.abs().amax(dim=-1)
    factor = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xf * factor[:, None]).nan_to_num_(nan=0.0).clamp_(-128, 127)  # 0 * inf: 0
    return q.to(torch.int8), amax / 127.0


def static_quant(x2: torch.Tensor, input_scale: torch.Tensor, input_offset: torch.Tensor) -> torch.Tensor:
    """``clamp(round(x / input_scale + input_offset), -128, 127)`` as int8, computed in float32."""
    s = input_scale.reshape(()).to(torch.float32)
    off = input_offset.reshape(()).to(torch.float32)
    return torch.round(x2.to(torch.float32) / s + off).clamp_(-128, 127).to(torch.int8)


def deq_scale_f32(deq_scale: torch.Tensor) -> torch.Tensor:
    """float32 view of a deq_scale stored as float32 or as int64 holding float32 bits (low 32 bits)."""
    if deq_scale.dtype == torch.float32:
        return deq_scale
    if deq_scale.dtype == torch.int64:
        low = deq_scale & 0xFFFFFFFF
        low = torch.where(low >= 2**31, low - 2**32, low)
        return low.to(torch.int32).view(torch.float32)
    raise TensorError(f"deq_scale is {_desc(deq_scale)}: expected float32 or int64 (float32 bits)")


def deq_scale_int64(deq_scale: torch.Tensor) -> torch.Tensor:
    """The fp16-model storage of a float32 deq_scale: its bits as int32, widened to int64."""
    return deq_scale.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)


def quant_bias_from(bias: torch.Tensor | None, w_q: torch.Tensor, input_offset: torch.Tensor,
                    deq_scale: torch.Tensor) -> torch.Tensor:
    """``round(bias / deq_scale - sum_k(w_q) * input_offset)`` as int32 ``[n]`` (FORMATS.md 2.2), in float64."""
    d = deq_scale_f32(deq_scale).to(torch.float64)
    b = torch.zeros_like(d) if bias is None else bias.to(torch.float64) / d
    v = torch.round(b - w_q.to(torch.float64).sum(dim=1) * input_offset.reshape(()).to(torch.float64))
    if bool((v.abs() >= 2**31).any()):
        raise TensorError("quant_bias does not fit int32 (bias / deq_scale too large)")
    return v.to(torch.int32)
