"""FP8 e4m3 block-scaled weights -> BF16: the kernel and the `cvt fp8-to-bf16` stage.

Math (DeepSeek's `weight_dequant`, FORMATS.md 1.1), for w ``[n, k]`` and scale
``[ceil(n/bn), ceil(k/bk)]``::

    bf16[i, j] = round_to_nearest_even_bf16(float32(w[i, j]) * float32(s[i // bn, j // bk]))

Scales stored as bfloat16 or float8_e8m0fnu are upcast to float32 first (exactly); they
are never expanded to a full ``[n, k]`` tensor. Two kernels compute the same bits:

* `_fp8kernel.c` (built at install when a C compiler is present): one pass over memory, a
  256-entry decode table, pthreads over row ranges;
* a torch fallback: e4m3 bits are moved into float16 bits (``x << 7`` with the sign fixed
  up, which is ``w * 2**-8`` exactly, subnormals included), widened to float32 and
  multiplied by ``s * 2**8`` (an exact power-of-two rescale), one row-block at a time.
"""

from __future__ import annotations

import ctypes
import math
import os
from functools import lru_cache

from cvt.extras import c_kernel, simd_level
from cvt.errors import TensorError

NAN_CODES = (0x7F, 0xFF)


@lru_cache(maxsize=1)
def c_lib():
    """The built `_fp8kernel.c` (`ctypes.CDLL`), or None (no C compiler at install, or
    ``CVT_FP8_KERNEL=torch``)."""
    if os.environ.get("CVT_FP8_KERNEL", "").lower() == "torch":
        return None
    return c_kernel("cvt.convert._fp8kernel", "FP8 kernel", "dequantizing with the torch kernel, ~8x slower")


@lru_cache(maxsize=1)
def _c_kernel():
    lib = c_lib()
    if lib is None:
        return None
    fn = lib.cvt_dequant_fp8_block
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 7
    fn.restype = ctypes.c_int64  # the NaN / Inf outputs it made
    lib.cvt_fp8_simd_level.argtypes = [ctypes.c_int64]
    lib.cvt_fp8_simd_level.restype = ctypes.c_int
    fn.level = lib.cvt_fp8_simd_level
    return fn


def kernel_name() -> str:
    return "c" if _c_kernel() is not None else "torch"


def simd_in_use(simd: bool | int = True) -> str:
    """Which loops the C kernel runs on this CPU for `simd` (`cvt.extras.simd_level`, so
    ``CVT_KERNEL_SIMD`` counts): "avx512", "avx2", "neon" (aarch64) or "scalar" (block scales >=
    2**100 take the scalar loop whatever this says); "" without the C kernel."""
    from cvt.extras import simd_name

    fn = _c_kernel()
    return "" if fn is None else simd_name(fn.level(simd_level(simd)))


def scale_to_f32(scale):
    """float32 view of a block scale stored as float32, bfloat16, float16 or float8_e8m0fnu."""
    import torch

    if scale.dtype == torch.float32:
        return scale
    if scale.dtype == torch.float8_e8m0fnu:
        # E8M0: value 2**(e - 127); e = 0 is 2**-127 (a float32 subnormal), e = 255 is NaN.
        e = scale.view(torch.uint8).to(torch.int32)
        bits = torch.where(e == 0, torch.tensor(0x00400000, dtype=torch.int32), e << 23)
        bits = torch.where(e == 255, torch.tensor(0x7FC00000, dtype=torch.int32), bits)
        return bits.view(torch.float32)
    if scale.dtype in (torch.bfloat16, torch.float16):
        return scale.to(torch.float32)
    raise TensorError(f"scale dtype {scale.dtype} is not float32, bfloat16, float16 or float8_e8m0fnu")


def scale_to_f32_np(raw: memoryview, dtype: str, shape: tuple[int, ...]):
    """`scale_to_f32` on a stored scale's raw bytes (safetensors dtype code), in numpy: a
    float32 ``ndarray`` of `shape`, the same values. The torch-free path of fp8-to-bf16, whose
    process then never imports torch (about 0.8 s of its start)."""
    import numpy as np

    b = np.frombuffer(raw, dtype=np.uint8)
    if dtype == "F32":
        f = b.view("<f4")
    elif dtype == "BF16":
        f = (b.view("<u2").astype(np.uint32) << 16).view(np.float32)  # bf16 is the top half of float32
    elif dtype == "F16":
        f = b.view("<f2").astype(np.float32)
    elif dtype == "F8_E8M0":
        e = b.astype(np.uint32)
        f = np.where(e == 0, np.uint32(0x00400000), np.where(e == 255, np.uint32(0x7FC00000), e << 23)).astype(
            np.uint32).view(np.float32)
    else:
        raise TensorError(f"scale dtype {dtype} is not F32, BF16, F16 or F8_E8M0")
    return f.reshape(shape)


def dequant_fp8_block_np(w: memoryview, shape: tuple[int, int], scale_f32, block: tuple[int, int] = (128, 128),
                         threads: int | None = None, out=None):
    """`dequant_fp8_block` without torch, through the C kernel: e4m3 bytes `w` of a ``[n, k]``
    weight and its float32 scale (``ndarray`` of ``expected_scale_shape``) -> the BF16 bytes,
    a ``uint16`` ``ndarray [n, k]`` (written into `out`, a buffer of 2nk bytes, when given, else
    into a `cvt.convert.buffers.OUTPUTS` buffer);
    the same bits. Needs the C kernel (``kernel_name() == "c"``); without it callers take
    `dequant_fp8_block`, the torch path."""
    return dequant_fp8_counted_np(w, shape, scale_f32, block, threads, out)[0]


def dequant_fp8_counted_np(w: memoryview, shape: tuple[int, int], scale_f32, block: tuple[int, int] = (128, 128),
                           threads: int | None = None, out=None):
    """`dequant_fp8_block_np`, and how many of its outputs are NaN / Inf: (bits, count). The
    kernel counts them as it goes (its NaN codes), so that a writer refuses the weight without
    another pass over it (`cvt.convert.finite`)."""
    import numpy as np

    fn = _c_kernel()
    if fn is None:
        raise RuntimeError("internal: dequant_fp8_block_np needs the C kernel (kernel_name() == 'c')")
    n, k = shape
    if tuple(scale_f32.shape) != expected_scale_shape(shape, block) or len(w) != n * k:
        raise TensorError(f"FP8 weight of {len(w)} bytes as {list(shape)}, scale {list(scale_f32.shape)}: "
                          f"expected {n * k} bytes and a {list(expected_scale_shape(shape, block))} scale")
    s = np.require(scale_f32, np.float32, ["C", "A"])  # a view of the mmap may sit at an unaligned offset
    if out is None:  # page-aligned, recycled, placed for the writer's O_DIRECT (`OutputPool`)
        from cvt.convert.buffers import OUTPUTS

        out = OUTPUTS.array((n, k), np.uint16)
    else:
        out = np.frombuffer(out, dtype=np.uint16).reshape(n, k)
    bad = 0
    if n and k:
        wa = np.frombuffer(w, dtype=np.uint8)
        bad = fn(wa.ctypes.data, s.ctypes.data, out.ctypes.data, n, k, s.shape[1], block[0], block[1],
                 max(1, threads or os.cpu_count() or 1), simd_level())
    return out, int(bad)


def expected_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    n, k = shape
    return (math.ceil(n / block[0]), math.ceil(k / block[1]))


def checked_scale(w, scale, block: tuple[int, int]):
    """The float32 contiguous block scale of FP8 weight `w`, after checking both (TensorError
    naming the shapes and dtypes): what `dequant_fp8_block` and the fused quantize kernels
    (`cvt.quant.qkernel`) read."""
    import torch

    if w.dtype != torch.float8_e4m3fn or w.dim() != 2:
        raise TensorError(f"expected a 2-D float8_e4m3fn weight, got {w.dtype} {list(w.shape)}")
    s = scale_to_f32(scale).contiguous()
    if tuple(s.shape) != expected_scale_shape(tuple(w.shape), block):
        raise TensorError(
            f"scale shape {list(s.shape)} does not match weight {list(w.shape)} with blocks {list(block)}: "
            f"expected {list(expected_scale_shape(tuple(w.shape), block))}"
        )
    return s


def dequant_fp8_block(w, scale, block: tuple[int, int] = (128, 128), threads: int | None = None, simd: bool = True):
    """FP8 e4m3fn ``[n, k]`` + scale ``[ceil(n/bn), ceil(k/bk)]`` -> bfloat16 ``[n, k]``.

    Bit-identical to ``(w.float() * s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]).bfloat16()``
    for every finite input; NaN codes give NaN. `simd=False` keeps the C kernel on its scalar
    loop (the tests compare both).
    """
    import torch

    s = checked_scale(w, scale, block)
    w = w.contiguous()
    n, k = w.shape
    out = torch.empty((n, k), dtype=torch.bfloat16)
    if n == 0 or k == 0:
        return out
    fn = _c_kernel()
    if fn is not None:
        threads = threads or os.cpu_count() or 1
        fn(w.data_ptr(), s.data_ptr(), out.data_ptr(), n, k, s.shape[1], block[0], block[1], max(1, threads),
           simd_level(simd))
        return out
    return _dequant_torch(w, s, block, out)


def _dequant_torch(w, s, block, out):
    import torch

    bn, bk = block
    n, k = w.shape
    s2 = s * 256.0
    if not torch.isfinite(s2[torch.isfinite(s)]).all():  # scales >= 2**120: the rescale would overflow
        return _dequant_reference(w, s, block, out)
    v = w.view(torch.int8)
    for r0 in range(0, n, bn):
        r1 = min(r0 + bn, n)
        x = v[r0:r1].to(torch.int16)
        # sign-extended int8 << 7 puts the sign in bits 14 and 15: clear bit 14 -> fp16 bits of w * 2**-8
        x.bitwise_left_shift_(7).bitwise_and_(-16385)
        f = x.view(torch.float16).to(torch.float32)
        f.mul_(s2[r0 // bn].repeat_interleave(bk)[:k])  # one row of k scales, broadcast over the block's rows
        out[r0:r1].copy_(f)
    u = w.view(torch.uint8)
    nan = (u & 0x7F) == 0x7F
    if nan.any():
        out[nan] = _dequant_reference(w, s, block, None)[nan]
    return out


def _dequant_reference(w, s, block, out):
    """The straightforward algorithm (full-size scale expansion); used only for odd inputs."""
    import torch

    bn, bk = block
    n, k = w.shape
    full = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    res = (w.to(torch.float32) * full).to(torch.bfloat16)
    if out is None:
        return res
    out.copy_(res)
    return out
