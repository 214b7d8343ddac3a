"""FP4 (E2M1) routed experts of a DeepSeek-V4 release -> BF16.

With ``expert_dtype: "fp4"`` each routed expert linear ``X.weight`` ``[n, k]`` is stored as
int8 ``[n, k/2]``: two E2M1 codes per byte, element ``2i`` in the low nibble, ``2i + 1`` in
the high one; ``X.scale`` is float8_e8m0fnu ``[n, k/32]`` (one power-of-two scale per 32
inputs of a row). The official dequant (DeepSeek's V4 ``inference/convert.py``, ``FP4_TABLE``
and ``cast_e2m1fn_to_e4m3fn``) reads a code through the table

    code  0..7:  0, 0.5, 1, 1.5, 2, 3, 4, 6      code 8..15: 0, -0.5, ..., -6

(code 8 is +0.0 there, not -0.0) and multiplies by the float32 scale; BF16 is that float32
product rounded once to nearest even::

    bf16[i, j] = rne_bf16(FP4_TABLE[code(i, j)] * float32(s[i, j // 32]))

The product is exact in float32 (3 significant bits times a power of two), so the one
rounding only matters at the ends of the range. Scales stored as float32 / bfloat16 are
accepted too (upcast exactly, `cvt.convert.fp8.scale_to_f32`).
"""

from __future__ import annotations

from cvt.errors import TensorError

GROUP = 32
# config.json ``expert_dtype`` of a DeepSeek-V4 release (the release's words)
EXPERT_DTYPE_FP4 = "fp4"
EXPERT_DTYPES = (EXPERT_DTYPE_FP4, "fp8")
FP4_DTYPES = ("I8", "U8")  # how a release stores the packed codes (safetensors dtype codes)
FP4_TABLE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_MAX = 6.0


def fp4_scale_shape(packed_shape: tuple[int, ...]) -> tuple[int, int]:
    """The scale shape of a packed ``[n, k/2]`` FP4 weight: ``[n, k/32]``."""
    n, half = packed_shape
    return (n, 2 * half // GROUP)


def dequant_fp4_experts(w, scale):
    """Packed E2M1 int8/uint8 ``[n, k/2]`` + scale ``[n, k/32]`` (float8_e8m0fnu, float32 or
    bfloat16) -> bfloat16 ``[n, k]`` (module docstring); TensorError naming the shapes when
    they do not fit."""
    import torch

    from cvt.convert.fp8 import scale_to_f32

    if w.dtype not in (torch.int8, torch.uint8) or w.dim() != 2:
        raise TensorError(f"expected a 2-D int8 FP4 weight (two E2M1 codes per byte), got {w.dtype} {list(w.shape)}")
    n, half = w.shape
    k = 2 * half
    if k % GROUP or tuple(scale.shape) != (n, k // GROUP):
        raise TensorError(f"FP4 weight {list(w.shape)} (logical [{n}, {k}]) needs a [{n}, {k // GROUP}] scale "
                          f"(one per {GROUP} inputs) and k a multiple of {GROUP}; got scale {list(scale.shape)}")
    s = scale_to_f32(scale).contiguous()
    u = w.contiguous().view(torch.uint8)
    table = torch.tensor(FP4_TABLE, dtype=torch.float32)
    out = torch.empty((n, k), dtype=torch.bfloat16)
    rows = max(1, (1 << 20) // max(k, 1))  # a few MB of codes and float32 at a time
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        b = u[r0:r1]
        codes = torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(r1 - r0, k).long()
        v = table[codes].view(r1 - r0, k // GROUP, GROUP) * s[r0:r1, :, None]
        out[r0:r1] = v.view(r1 - r0, k).to(torch.bfloat16)
    return out
