"""An independent FP8 block dequantizer for the tests, in numpy (no torch float8, no cvt code).

e4m3fn is decoded from its bit fields by formula, the multiply is numpy's IEEE float32
multiply, and bfloat16 rounding is done on the float32 bit pattern (round half to even).
"""

from __future__ import annotations

import numpy as np


def decode_e4m3(codes: np.ndarray) -> np.ndarray:
    """uint8 e4m3fn codes -> float32 values (exact). 0x7f / 0xff are NaN."""
    c = codes.astype(np.int64)
    sign = np.where(c >> 7, -1.0, 1.0)
    e = (c >> 3) & 0xF
    m = c & 0x7
    val = np.where(e == 0, (m / 8.0) * 2.0**-6, (1.0 + m / 8.0) * np.exp2(e - 7.0))
    val = np.where((e == 15) & (m == 7), np.nan, val)
    return (sign * val).astype(np.float32)


def decode_scale(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Stored scale bytes -> float32, for F32 / BF16 / F8_E8M0."""
    if dtype == "F32":
        return raw.view(np.float32)
    if dtype == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype == "F8_E8M0":
        e = raw.view(np.uint8).astype(np.float64)
        return np.where(e == 255, np.nan, np.exp2(e - 127.0)).astype(np.float32)
    raise ValueError(dtype)


def bf16_bits_rne(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN -> a NaN pattern."""
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def dequant(codes: np.ndarray, scale_f32: np.ndarray, block=(128, 128)) -> np.ndarray:
    """[n, k] uint8 codes, [ceil(n/bn), ceil(k/bk)] float32 scale -> [n, k] uint16 bf16 bits."""
    n, k = codes.shape
    rows = np.arange(n) // block[0]
    cols = np.arange(k) // block[1]
    s = scale_f32[rows][:, cols]
    with np.errstate(over="ignore", invalid="ignore"):
        prod = decode_e4m3(codes) * s  # float32 x float32 -> float32, one IEEE rounding
    assert prod.dtype == np.float32
    return bf16_bits_rne(prod)


def same_bits_nan_aware(a_bits: np.ndarray, b_bits: np.ndarray) -> bool:
    """Equal bf16 bit patterns, where any NaN equals any NaN (NaN payloads differ between devices)."""
    a_nan = ((a_bits & 0x7F80) == 0x7F80) & ((a_bits & 0x7F) != 0)
    b_nan = ((b_bits & 0x7F80) == 0x7F80) & ((b_bits & 0x7F) != 0)
    return bool(np.array_equal(a_nan, b_nan) and np.array_equal(a_bits[~a_nan], b_bits[~b_nan]))
