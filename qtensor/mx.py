"""Microscaling (MX) quantization as msModelSlim computes it for Ascend 950: MXFP8 (E4M3) and
MXFP4 (E2M1) blocks of 32 along k with one E8M0 shared exponent each.

Pure tensor functions (float32 math, no scheme or format knowledge); the MX schemes
(`cvt.qtensor.schemes.mx`) and the runtime's MX kernels (`cvt.runtime.kernels.mx`, which
quantize activations the same way) use them. Every rule is msModelSlim's (commit 1e4a534,
``msmodelslim/ir/api/impl/mx_quantization.py``, element parameters from ``ir/qal/qbase.py``
``_get_format_params``, weights through ``core/quantizer/impl/minmax.py`` MXWeightPerBlockMinmax),
written with the same torch operations. msModelSlim computes the shared exponent in the model's
dtype -- bfloat16 for the releases -- and the elements in float32; cvt does the same (for any
input dtype), so for a bf16 weight the numbers agree bit for bit:

* MXFP8 shared exponent (``calculate_mx_qparam``): ``se = floor(log2(amax + 2**-126 * (amax ==
  0))) - 8`` (emax of E4M3 = 2**(4-1)); above 127: NaN, below -127: -127.
  Elements (``mxfp_per_block_quantize`` / ``_quant`` / ``_clamp_out``): ``v = x / 2**se``;
  ``pe = max(floor(log2(|v| + (v == 0))), -6)``; ``v = sign(a) * floor(|a| + 0.5) / 8 * 2**pe``
  with ``a = v / 2**pe * 8`` (three mantissa bits, round half away from zero), clamped to +-448.
* MXFP4 shared exponent (``calculate_mxfp4_qparam``): ``se = floor(log2(amax / 0.875 + 9.6e-7))
  - 2``, clipped to -129..125. Elements (``mxfp4_quantize``): ``b = |x| / 2**se``; ``pe =
  clip(floor(log2(b + 9.6e-7)), 0, 2)``; ``m = floor(b / 2**pe * 2 + 0.5)``; ``v = m / 2 * 2**pe``
  clipped to 6, times ``sign(x)``: the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, round half away.
* Storage (``save/ascendv1.py`` on_w8a8_mx_dynamic_per_block / on_w4a4_mx_dynamic_per_block /
  on_w4a8_mx_dynamic_per_block): ``weight_scale = uint8(se + 127)`` (E8M0, bias 127), the
  elements as float8_e4m3fn or E2M1 codes packed two per byte (``pack_fp4_to_uint8``: element 2j
  in the low nibble, sign from ``signbit``); description ``group_size`` 32.
* Dequantization (``mxfp_per_block_dequantize``): ``x^ = v * 2**se`` -- exact in float32.

Shapes: ``x [..., k]`` with k a multiple of ``BLOCK``; scales ``[..., k / 32]``.
"""

from __future__ import annotations

import threading

from cvt.lazy import torch

from cvt.errors import TensorError

BLOCK = 32
E8M0_BIAS = 127
FP8_EMAX, FP8_MAX, FP8_MBITS, FP8_MIN_EXP = 8, 448.0, 5, -6      # mxfp8_e4m3: ebits 4, mbits 5
FP4_EMAX, FP4_MAX = 2, 6.0                                       # mxfp4: ebits 2, mbits 3
FP32_MIN_NORMAL = 2.0 ** -126
FP4_EPS = 9.6e-7                                                 # msModelSlim's log2 guard
FP8, FP4 = "e4m3", "e2m1"                                        # the element kinds


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % BLOCK:
        raise TensorError(f"MX quantization needs the last dimension a multiple of {BLOCK}, got "
                          f"{list(x.shape)}")
    return x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def shared_exponent(amax: torch.Tensor, elem: str) -> torch.Tensor:
    """float32 shared exponents (integer valued) of blocks with max |x| ``amax`` (module docstring),
    each step rounded to bfloat16 as msModelSlim's ops round it on a bf16 model (its observer keeps
    the weight's dtype: ``core/observer/minmax.py`` MsMinMaxBlockObserver.update): ``log2`` of a
    block max just under a power of two rounds up to it there, and so here."""
    amax = _bf16(amax)
    if elem == FP8:
        se = torch.floor(_bf16(torch.log2(_bf16(amax + FP32_MIN_NORMAL * (amax == 0).to(amax.dtype))))) - FP8_EMAX
        se[se > E8M0_BIAS] = float("nan")
        se[se < -E8M0_BIAS] = -E8M0_BIAS
        return se
    se = torch.floor(_bf16(torch.log2(_bf16(_bf16(amax / (1 - 0.5 ** 3)) + FP4_EPS)))) - FP4_EMAX
    return torch.clip(se, -E8M0_BIAS - FP4_EMAX, E8M0_BIAS - FP4_EMAX)


_TABLES: dict = {}
_TABLES_LOCK = threading.Lock()


def _bf16_np(x):
    """float32 numpy values rounded to bfloat16 (nearest even, NaN kept), as float32: `_bf16`."""
    import numpy as np

    b = x.view(np.uint32)
    r = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return np.where(np.isnan(x), (b | np.uint32(0x00400000)) & np.uint32(0xFFFF0000), r).astype(np.uint32).view(np.float32)


def exponent_table(elem: str):
    """`shared_exponent` of every bfloat16 value as a block max, by its bits: numpy int16 [65536],
    0x7fff where E8M0 cannot hold the exponent (NaN, negative, outside -127..127). The fused RTN
    kernel (`cvt.quant.qkernel`, MX modes) looks exponents up here. The same float32 operations as
    `shared_exponent`, in numpy (so an RTN run does not import torch); tests/quant/test_qkernel.py
    holds the two equal on all 65536 values. Made once under a lock and kept for the process: the
    kernel holds only its address (the writer's threads may ask at the same time)."""
    import numpy as np

    with _TABLES_LOCK:
        if elem not in _TABLES:
            amax = (np.arange(65536, dtype=np.uint32) << np.uint32(16)).view(np.float32)
            with np.errstate(all="ignore"):
                if elem == FP8:
                    t = _bf16_np(amax + np.float32(FP32_MIN_NORMAL) * (amax == 0).astype(np.float32))
                    se = np.floor(_bf16_np(np.log2(t))) - np.float32(FP8_EMAX)
                    se = np.where(se > E8M0_BIAS, np.nan, np.maximum(se, -E8M0_BIAS))
                else:
                    t = _bf16_np(_bf16_np(amax / np.float32(1 - 0.5 ** 3)) + np.float32(FP4_EPS))
                    se = np.floor(_bf16_np(np.log2(t))) - np.float32(FP4_EMAX)
                    se = np.clip(se, -E8M0_BIAS - FP4_EMAX, E8M0_BIAS - FP4_EMAX)
                ok = np.isfinite(se) & (se >= -E8M0_BIAS) & (se <= E8M0_BIAS) & (amax >= 0)
            _TABLES[elem] = np.where(ok, se, 0x7FFF).astype(np.int16)
        return _TABLES[elem]


def quantize_elements(v: torch.Tensor, elem: str) -> torch.Tensor:
    """Values already divided by 2**se -> float32 values on the element grid (module docstring)."""
    if elem == FP8:
        pe = torch.floor(torch.log2(torch.abs(v) + (v == 0).to(v.dtype))).clip(min=FP8_MIN_EXP)
        a = v / (2 ** pe) * (2 ** (FP8_MBITS - 2))
        a = torch.sign(a) * torch.floor(torch.abs(a) + 0.5)
        out = torch.clamp(a / (2 ** (FP8_MBITS - 2)) * (2 ** pe), -FP8_MAX, FP8_MAX)
        # +-inf stay +-inf; a where, not a masked assignment, so that GPTQ's batched column loop
        # (`gptq_batched`) runs without a device-to-host sync
        return torch.where(torch.isinf(v), v, out)
    b = torch.abs(v)
    pe = torch.clip(torch.floor(torch.log2(b + FP4_EPS)), 0, FP4_EMAX)
    m = torch.floor(b / (2 ** pe) * 2 + 0.5)
    return torch.sign(v) * torch.clip(m / 2 * (2 ** pe), -FP4_MAX, FP4_MAX)


def mx_quantize(x: torch.Tensor, elem: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., k]`` -> (element values float32 ``[..., k]`` on the E4M3 / E2M1 grid, shared
    exponents float32 ``[..., k/32]``); ``x ~= values * 2**se`` per block."""
    g = _blocks(x)
    se = shared_exponent(g.abs().amax(dim=-1), elem)
    vals = quantize_elements(g / (2 ** se)[..., None], elem)
    return vals.reshape(x.shape), se


def mx_dequantize(vals: torch.Tensor, se: torch.Tensor) -> torch.Tensor:
    """``vals [..., k]`` times ``2**se`` per block of 32, float32 ``[..., k]`` (exact)."""
    g = _blocks(vals)
    return (g * (2 ** se.to(torch.float32))[..., None]).reshape(vals.shape)


def mx_fake_quant(x: torch.Tensor, elem: str) -> torch.Tensor:
    """`mx_dequantize(*mx_quantize(x))`: what msModelSlim's MX fake-quant linears compute with
    for activations and weights (float32)."""
    return mx_dequantize(*mx_quantize(x, elem))


def e8m0_codes(se: torch.Tensor) -> torch.Tensor:
    """Shared exponents -> uint8 E8M0 codes ``se + 127`` (msModelSlim's ``+ 127``); an exponent
    outside -127..127 (NaN: a block whose max is beyond float32's E8M0 range) is a TensorError."""
    bad = ~torch.isfinite(se) | (se < -E8M0_BIAS) | (se > E8M0_BIAS)
    if bool(bad.any()):
        raise TensorError(f"{int(bad.sum())} MX block(s) have a shared exponent outside E8M0's -127..127")
    return (se + E8M0_BIAS).to(torch.uint8)


def e8m0_exponents(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 codes -> float32 shared exponents ``code - 127``."""
    return codes.view(torch.uint8).to(torch.float32) - E8M0_BIAS
