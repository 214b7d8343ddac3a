"""Fused RTN quantization: one linear weight, as stored (BF16, or FP8 e4m3 with its block
scale_inv), straight to its on-disk layout (`cvt.qtensor.layouts`) and SQNR, in one pass.

The reference is the unfused path: ``w = float32(source)`` (FP8 dequantized to BF16 first,
`cvt.convert.fp8.dequant_fp8_block`), ``q = scheme.quantize(w)``, ``layout.encode(q)``, and
``sqnr_db(w, scheme.dequantize(q))``. `quantize_to_layout` returns the same tensors, bit for
bit, without the float32 copies (DeepSeek-V3's 18432 x 7168 dense MLP weights take ~0.5 GB as
float32 for w alone, and the reference makes several more). Two implementations:

* `_qkernel.c` (built at install when a C compiler is present; pthreads over row blocks, a
  few decoded rows per thread, AVX2 or AVX-512 on x86-64 checked at run time, `simd` /
  ``CVT_KERNEL_SIMD`` to cap it: `cvt.extras.simd_level`): the reference's float32
  operations in the same order (division, not a reciprocal multiply; torch.round's half-even;
  c10's e4m3 rounding), so the same bits;
* a torch fallback (no compiler, or ``CVT_QUANT_KERNEL=torch``): the reference functions
  themselves (`scheme.quantize` and the primitives' packers) applied to blocks of rows, so
  temporaries are a block, not the weight. Every scheme is row-local (groups run along k);
  nvfp4's per-tensor global scale comes from a first pass (max |w|), as the kernel does.

==========================  ====================================================================
layout                      fused output (w [n, k], group G)
==========================  ====================================================================
ascend-w8a8-dynamic         weight i8 [n,k], weight_scale f32 [n,1], weight_offset f32 zeros
ct-int8                     weight i8 [n,k], weight_scale f32 [n,1]
ascend-w4a16-int8-grouped   weight i8 [n/2,k] (row pairs), weight_scale / weight_offset f32 [n,k/G]
ascend-w4a16-int8-channel   weight i8 [n,k/2], weight_scale / weight_offset f32 [n,1]
ascend-w4a16-int32          weight_packed i32 [n,ceil(k/8)], weight_scale bf16, weight_shape (sym)
ct-int4                     ditto + weight_zero_point i32 [ceil(n/8),k/G] when asymmetric
ct-nvfp4                    weight_packed u8 [n,k/2], weight_scale e4m3 [n,k/16], weight_global_scale
ct-mxfp4, ascend-mxfp4      weight_packed / weight u8 [n,k/2], weight_scale u8 E8M0 [n,k/32]
ascend-w8a8-mxfp8           weight e4m3 [n,k], weight_scale u8 E8M0 [n,k/32] (msModelSlim MX rules;
ascend-w4a4-mxfp4 / -w4a8   weight u8 [n,k/2], ditto                         AVX2 or scalar C)
==========================  ====================================================================

API: ``WeightSource(bf16)`` / ``.fp8(codes, scale_inv, block)``; ``supports``; ``quantize_to_layout(src,
scheme, layout, name, global_scale=None, threads=None) -> Fused``; ``absmax(src)`` (nvfp4's global
scale); ``kernel_name()``. C: ``cvt_quantize(const cvt_qargs *)`` and ``cvt_pack_zero_points``.

Anything else (static W8A8, other source dtypes, an asymmetric int32 layout that refuses zero
points) is not fused: `supports` says so and the caller takes the reference path, which also
raises the reference's errors. NaN/Inf in the source is refused with the reference's message
(`cvt.qtensor.primitives.nonfinite_error`). The SQNR's sums (sum w^2, sum (w - w_hat)^2) are
float32 squares like the reference's, but added in another order (the kernel: float32 over
256-element spans of a row in its SIMD row loops, then float64 per thread; the reference:
float32 dot products of 1M-element chunks, added in float64), so the dB figure agrees to a
tolerance (the tests allow 0.01 dB), not bit for bit.
"""

from __future__ import annotations

import ctypes
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from cvt.qtensor import kernel_formats as KF
from cvt.extras import c_kernel, simd_level
from cvt.lazy import torch

from cvt.qtensor import mx as MX
from cvt.qtensor import primitives as P
from cvt.qtensor.layouts import fuses
from cvt.runtime.metrics import sqnr_from_sums

SRC_BF16, SRC_FP8 = 0, 1
MODE_AMAX, MODE_SYM, MODE_ASYM, MODE_NVFP4, MODE_MXFP4, MODE_MX8, MODE_MX4 = range(7)
PACK_I8, PACK_CT32, PACK_NIB_K, PACK_NIB_ROWS, PACK_FP4, PACK_E4M3 = range(6)
# the C kernel's packing codes for the layout table's `Layout.pack` names
_PACK = dict(i8=PACK_I8, ct32=PACK_CT32, nib_k=PACK_NIB_K, nib_rows=PACK_NIB_ROWS, e2m1=PACK_FP4, e4m3=PACK_E4M3)
_MX_MODE = {KF.MXFP8: MODE_MX8, KF.W4A4_MXFP4: MODE_MX4, KF.W4A8_MXFP: MODE_MX4}  # msModelSlim MX blocks
ROWS_PER_BLOCK = 1 << 22  # torch fallback: about this many elements per block of rows


class _Args(ctypes.Structure):
    """`cvt_qargs` in _qkernel.c (same field order)."""

    _fields_ = ([(f, ctypes.c_void_p) for f in ("src", "fp8_scale", "q", "scale", "offset", "scale8", "sums",
                                                "nonfinite", "amax")]
                + [(f, ctypes.c_int64) for f in ("n", "k", "src_kind", "s_cols", "bn", "bk", "mode", "group",
                                                 "qmin", "qmax", "pack")]
                + [("qdiv", ctypes.c_float), ("global_scale", ctypes.c_float)]
                + [(f, ctypes.c_int64) for f in ("nthreads", "simd", "f64_squares")]
                + [("scale_bf16", ctypes.c_void_p), ("se_lut", ctypes.c_void_p)])


def _env() -> str:
    return os.environ.get("CVT_QUANT_KERNEL", "").lower()


@lru_cache(maxsize=1)
def _c_kernel():
    if _env() in ("torch", "reference"):
        return None
    lib = c_kernel("cvt.quant._qkernel", "quantize kernel", "RTN runs the blockwise torch fallback, ~20-40x slower")
    if lib is None:
        return None
    lib.cvt_quantize.argtypes = [ctypes.POINTER(_Args)]
    lib.cvt_quantize.restype = ctypes.c_int
    lib.cvt_pack_zero_points.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    lib.cvt_pack_zero_points.restype = None
    lib.cvt_simd_level.argtypes = [ctypes.c_int64]
    lib.cvt_simd_level.restype = ctypes.c_int
    return lib


def simd_in_use(simd: bool | int = True) -> str:
    """Which loops the C kernel runs on this CPU for `simd` (`cvt.extras.simd_level`, so
    ``CVT_KERNEL_SIMD`` counts): "avx512", "avx2", "neon" (aarch64: its FP8 / BF16 decode) or
    "scalar" (FP8 block scales >= 2**100 take the scalar loops whatever this says); "" without
    the C kernel."""
    from cvt.extras import simd_name

    lib = _c_kernel()
    if lib is None:
        return ""
    return simd_name(lib.cvt_simd_level(simd_level(simd)))


def kernel_name() -> str:
    """"c" (the fused C kernel), "torch" (the blockwise torch fallback: no compiled kernel, or
    ``CVT_QUANT_KERNEL=torch``) or "reference" (``CVT_QUANT_KERNEL=reference``: the stage does
    not fuse, it runs the reference path, whole-weight float32 copies included)."""
    if _env() == "reference":
        return "reference"
    return "c" if _c_kernel() is not None else "torch"


@dataclass
class WeightSource:
    """One linear weight as stored: BF16 ``[n, k]``, or FP8 e4m3fn ``[n, k]`` with its float32
    block scale_inv ``[ceil(n/bn), ceil(k/bk)]`` (`fp8`, which checks both). Either torch
    tensors, or (`raw`) numpy arrays over the stored bytes -- ``uint16`` for BF16, ``uint8`` for
    e4m3, numpy having neither dtype -- which the C kernel reads without torch ever being
    imported (the stage's RTN path, `cvt.lazy`). A numpy source needs the C kernel."""

    w: Any
    scale: Any = None
    block: tuple[int, int] | None = None
    dtype: str = ""  # safetensors code of w ("BF16" / "F8_E4M3"); set by `raw`, derived for torch

    def __post_init__(self):
        if not self.dtype:
            self.dtype = _torch_code(self.w)

    @classmethod
    def fp8(cls, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> "WeightSource":
        from cvt.convert.fp8 import checked_scale

        return cls(w, checked_scale(w, scale, tuple(block)), tuple(block))

    @classmethod
    def raw(cls, data, dtype: str, shape: tuple[int, int], scale=None,
            block: tuple[int, int] | None = None) -> "WeightSource":
        """A stored weight's bytes (`data`: a buffer, e.g. the mmap view) as a numpy source;
        FP8 (`dtype` "F8_E4M3") with its float32 ``ndarray`` scale, checked against `block`."""
        import numpy as np

        from cvt.convert.fp8 import expected_scale_shape
        from cvt.errors import TensorError

        if dtype not in ("BF16", "F8_E4M3") or len(shape) != 2:
            raise ValueError(f"internal: a raw weight source is a 2-D BF16 or F8_E4M3 weight, not {dtype} {list(shape)}")
        w = np.frombuffer(data, dtype=np.uint16 if dtype == "BF16" else np.uint8).reshape(shape)
        if dtype == "BF16":
            return cls(w, None, None, dtype)
        want = expected_scale_shape(tuple(shape), tuple(block))
        if scale is None or tuple(scale.shape) != want:
            raise TensorError(f"scale shape {None if scale is None else list(scale.shape)} does not match weight "
                              f"{list(shape)} with blocks {list(block)}: expected {list(want)}")
        return cls(w, np.require(scale, np.float32, ["C", "A"]), tuple(block), dtype)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.w.shape)

    @property
    def is_fp8(self) -> bool:
        return self.scale is not None

    @property
    def is_numpy(self) -> bool:
        return type(self.w).__module__ == "numpy"

    def rows_float(self, r0: int, r1: int) -> torch.Tensor:
        """float32 rows ``[r0, r1)``, exactly what the stage's reference quantizes (`r0` a
        multiple of the FP8 block's rows)."""
        w, scale = self.w, self.scale
        if self.is_numpy:  # the torch fallback on a numpy source: a zero-copy view as torch
            w = torch.from_numpy(w).view(torch.bfloat16 if self.dtype == "BF16" else torch.float8_e4m3fn)
            scale = None if scale is None else torch.from_numpy(scale)
        if not self.is_fp8:
            return w[r0:r1].float()
        from cvt.convert.fp8 import dequant_fp8_block

        bn = self.block[0]
        return dequant_fp8_block(w[r0:r1], scale[r0 // bn: -(-r1 // bn)], self.block).float()


def _torch_code(w) -> str:
    """The safetensors code of a torch tensor's dtype ("" for anything else, e.g. numpy)."""
    if type(w).__module__.split(".")[0] != "torch":
        return ""
    from cvt.dtypes import dtype_code

    try:
        return dtype_code(w.dtype)
    except Exception:  # a dtype safetensors has no code for: not a fused source
        return ""


def _ptr(a) -> int:
    return a.ctypes.data if type(a).__module__ == "numpy" else a.data_ptr()


def supports(layout, scheme, src: WeightSource) -> bool:
    """Whether `quantize_to_layout` produces this layout for this weight (else: the reference)."""
    if len(src.w.shape) != 2 or src.dtype not in ("BF16", "F8_E4M3") or (src.dtype == "F8_E4M3") != src.is_fp8:
        return False
    return fuses(layout, scheme, src.shape)


def _config(layout, scheme, k: int) -> dict:
    kf = layout.kernel_fmt
    if kf == KF.W8A8_DYNAMIC:
        return dict(mode=MODE_SYM, group=k, qdiv=P.INT8_QDIV, qmin=-128, qmax=127)
    if kf == KF.W4A16:
        g = 0 if scheme.group_size in (0, k) else scheme.group_size
        if scheme.symmetric:
            return dict(mode=MODE_SYM, group=g or k, qdiv=P.INT4_QDIV, qmin=-8, qmax=7)
        return dict(mode=MODE_ASYM, group=g or k, qdiv=15.0, qmin=-8, qmax=7)
    if kf == KF.NVFP4:
        return dict(mode=MODE_NVFP4, group=16, qdiv=0.0, qmin=0, qmax=0)
    return dict(mode=_MX_MODE.get(kf, MODE_MXFP4), group=32, qdiv=0.0, qmin=0, qmax=0)  # MX: Ascend 950's


def _mx_kw(cfg: dict) -> dict:
    """The MX modes' shared-exponent table (kept by `cvt.qtensor.mx`: the kernel gets its address)."""
    elem = {MODE_MX8: MX.FP8, MODE_MX4: MX.FP4}.get(cfg["mode"])
    return {} if elem is None else {"se_lut": MX.exponent_table(elem).ctypes.data}


@dataclass
class Fused:
    """`quantize_to_layout`'s result: the layout's tensors (suffix -> tensor, in the layout
    encoder's order; torch tensors for a torch source, numpy arrays for a numpy one, BF16 and
    e4m3 as ``uint16`` / ``uint8`` raw bits), the SQNR in dB against the float32 source, and
    which kernel ran."""

    tensors: dict[str, Any]
    sqnr_db: float
    kernel: str


def _desc(shape) -> str:
    return f"float32 {list(shape)}"


# ---- the C kernel ---------------------------------------------------------------------------------

def _cpus() -> int:
    """CPUs this process may run on (affinity / cgroup cpusets), not the host's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _check_source(src: WeightSource) -> None:
    """What the C kernel assumes of `src` (`WeightSource.fp8` and the stage guarantee it; a source
    built by hand might not): a 2-D BF16 weight, or a 2-D e4m3fn weight with its float32
    contiguous block scale of exactly ``expected_scale_shape``."""
    from cvt.convert.fp8 import expected_scale_shape

    w = src.w
    itemsize = w.dtype.itemsize if src.is_numpy else w.element_size()
    real = src.dtype if src.is_numpy else _torch_code(w)  # the field must not claim more bytes than w has
    if (len(w.shape) != 2 or src.dtype not in ("BF16", "F8_E4M3") or real != src.dtype
            or itemsize != (2 if src.dtype == "BF16" else 1)):
        raise ValueError(f"cvt quantize kernel: expected a 2-D bfloat16 or float8_e4m3fn weight, got {w.dtype} "
                         f"{list(w.shape)} as {src.dtype or '?'}")
    if (src.dtype == "F8_E4M3") != src.is_fp8:
        raise ValueError("cvt quantize kernel: an FP8 weight needs its block scale and a BF16 one has none "
                         "(build FP8 sources with WeightSource.fp8)")
    if src.is_fp8:
        sc = src.scale
        want = expected_scale_shape(tuple(w.shape), tuple(src.block))
        f32 = str(sc.dtype).replace("torch.", "") == "float32"
        contiguous = sc.flags["C_CONTIGUOUS"] if src.is_numpy else sc.is_contiguous()
        if not f32 or not contiguous or tuple(sc.shape) != want:
            raise ValueError(f"cvt quantize kernel: FP8 block scale must be float32 contiguous {list(want)}, got "
                             f"{sc.dtype} {list(sc.shape)} (build FP8 sources with WeightSource.fp8)")


def _call(fn, src: WeightSource, mode: int, threads: int | None, simd: bool | int,
          **kw) -> tuple[int, float, float, float]:
    """Run the kernel; returns (non-finite count, amax, sum w^2, sum err^2)."""
    _check_source(src)  # the C side reads raw pointers: shapes and dtypes must be what it assumes
    import numpy as np

    n, k = src.shape
    sums = np.zeros(2, dtype=np.float64)
    bad = np.zeros(1, dtype=np.int64)
    amax = np.zeros(1, dtype=np.float32)
    w = np.ascontiguousarray(src.w) if src.is_numpy else src.w.contiguous()
    a = _Args(src=_ptr(w), n=n, k=k, mode=mode, sums=sums.ctypes.data, nonfinite=bad.ctypes.data,
              amax=amax.ctypes.data, nthreads=max(1, threads or _cpus()), simd=simd_level(simd),
              group=kw.pop("group", k), **kw)
    if src.is_fp8:
        a.src_kind, a.fp8_scale, a.s_cols = SRC_FP8, _ptr(src.scale), src.scale.shape[1]
        a.bn, a.bk = src.block
    rc = fn(ctypes.byref(a))
    if rc == -2:
        raise MemoryError("cvt quantize kernel: out of memory for its row buffers")
    if rc != 0:
        raise RuntimeError(f"internal: cvt quantize kernel refused its arguments (rc {rc}) for {list(src.shape)}")
    return int(bad[0]), float(amax[0]), float(sums[0]), float(sums[1])


def absmax(src: WeightSource, threads: int | None = None, simd: bool | int = True) -> float | None:
    """max |w| over the float32 source (FP8: after its BF16 dequantization); None when the
    weight holds NaN/Inf (the caller then takes the reference path, which refuses it). The C
    kernel reads an FP8 weight's blocks in decreasing order of the most they can hold
    (bf16(448 |scale|)) and stops where no unread block can hold more, so a NaN code in a block
    not read gives the finite max instead: the quantize pass, which reads every element, then
    refuses the weight with the reference's error."""
    lib = _c_kernel()
    if lib is None:
        m = 0.0
        for r0, r1 in _row_blocks(src):
            w = src.rows_float(r0, r1)
            if not bool(torch.isfinite(w).all()):
                return None
            m = max(m, float(w.abs().amax())) if w.numel() else m
        return m
    bad, m, _, _ = _call(lib.cvt_quantize, src, MODE_AMAX, threads, simd)
    return None if bad else m


def _global_scale(src: WeightSource, cfg: dict, name: str | None, global_scale, threads, simd) -> float | None:
    """nvfp4's shared per-tensor scale: `global_scale` (a float or a one-element tensor: a fused
    group's) or the weight's own; None for the other modes."""
    if cfg["mode"] != MODE_NVFP4:
        return None
    if global_scale is not None:
        return float(global_scale if isinstance(global_scale, float) else global_scale.reshape(-1)[0])
    m = absmax(src, threads, simd)
    if m is None:
        raise P.nonfinite_error(name, _desc(src.shape), _count_nonfinite(src))
    return P.nvfp4_global_scale_of(m)


def quantize_to_layout(src: WeightSource, scheme, layout, name: str | None = None,
                       global_scale=None, threads: int | None = None, simd: bool | int = True) -> Fused:
    """`layout.encode(scheme.quantize(w))` and its SQNR for the weight `src` (see the module
    docstring); `global_scale`: nvfp4's shared per-tensor scale (a fused group's; a float or a
    one-element tensor), else computed from the weight. Raises the reference's errors (shape,
    group size, NaN/Inf)."""
    n, k = src.shape
    scheme.check(name or "weight", (n, k))
    if not supports(layout, scheme, src):
        raise ValueError(f"internal: layout {layout.name} of {scheme!r} is not fused for {src.dtype or src.w.dtype} "
                         f"{[n, k]}")
    cfg = _config(layout, scheme, k)
    gs = _global_scale(src, cfg, name, global_scale, threads, simd)
    lib = _c_kernel()
    if lib is None:
        raw, sig, err = _torch_blocks(src, scheme, layout, cfg, name, gs)
        kernel = "torch"
    else:
        raw, sig, err = _c_blocks(lib, src, layout, cfg, name, gs, threads, simd)
        kernel = "c"
    tensors = _assemble(layout, scheme, (n, k), raw, gs)
    return Fused(tensors if src.is_numpy else _as_torch(tensors, layout), sqnr_from_sums(sig, err), kernel)


def quantize_in_pieces(src: WeightSource, scheme, layout, name: str | None = None, global_scale=None,
                       threads: int | None = None, simd: bool | int = True, piece_bytes: int = 8 << 20):
    """`quantize_to_layout` with the C kernel on a numpy source (`WeightSource.raw`), the packed
    weight made in pieces of whole row blocks (about `piece_bytes` each; FP8 block rows, row
    pairs), each into its own `cvt.convert.buffers.OUTPUTS` buffer (placed for the writer): a
    generator yielding those pieces (numpy arrays, rows in order) whose return value
    (``StopIteration.value``) is the `Fused` of the layout's tensors with the packed weight's
    entry None. The same bytes as `quantize_to_layout` (rows are independent; the scales are
    written per row); the SQNR sums are added per piece (a piece whose float32 squares overflow
    is summed in float64, as the whole weight is there). A large weight is so never a fresh
    buffer to fault in and zero. Raises the reference's errors (NaN/Inf: before the first piece
    whose rows hold one, counting the whole weight's)."""
    import numpy as np

    from cvt.convert.buffers import OUTPUTS

    n, k = src.shape
    scheme.check(name or "weight", (n, k))
    lib = _c_kernel()
    if lib is None or not src.is_numpy or not supports(layout, scheme, src):
        raise ValueError(f"internal: {layout.name} of {scheme!r} is not made in pieces for this source")
    cfg = _config(layout, scheme, k)
    gs = _global_scale(src, cfg, name, global_scale, threads, simd)
    pack = _PACK[layout.pack]
    raw = _outputs(layout, (n, k), cfg, c=True, q=False)
    qshape, qcode = _packed_spec(layout, n, k)
    qdtype = np.dtype(_NP_BITS[qcode])
    qrows_per_row = 0.5 if pack == PACK_NIB_ROWS else 1
    unit = math.lcm(src.block[0] if src.is_fp8 else 1, 2)  # whole FP8 block rows, whole row pairs
    row_bytes = max(1, int(qshape[1] * qdtype.itemsize * qrows_per_row))
    rows = max(unit, piece_bytes // row_bytes // unit * unit)
    fn = lib.cvt_quantize
    sig = err = 0.0
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        sc = src.scale[r0 // src.block[0]:-(-r1 // src.block[0])] if src.is_fp8 else None
        part = WeightSource(src.w[r0:r1], sc, src.block, src.dtype)
        q = OUTPUTS.array((int((r1 - r0) * qrows_per_row), qshape[1]), qdtype)
        kw = dict(group=cfg["group"], qdiv=cfg["qdiv"], qmin=cfg["qmin"], qmax=cfg["qmax"], pack=pack,
                  q=q.ctypes.data, global_scale=gs if gs is not None else 0.0,
                  **{f: raw[f][r0:r1].ctypes.data for f in ("scale", "offset", "scale8", "scale_bf16") if f in raw},
                  **_mx_kw(cfg))
        bad, _, s1, e1 = _call(fn, part, cfg["mode"], threads, simd, **kw)
        if bad:
            raise P.nonfinite_error(name, _desc(src.shape), _count_nonfinite(src))
        if math.isinf(s1) or math.isinf(e1):
            _, _, s1, e1 = _call(fn, part, cfg["mode"], threads, simd, f64_squares=1, **kw)
        sig, err = sig + s1, err + e1
        yield q
    if cfg["mode"] == MODE_ASYM and pack == PACK_CT32:
        ng = raw["offset"].shape[1]
        raw["zero_point"] = np.empty((-(-n // 8), ng), dtype=np.int32)
        lib.cvt_pack_zero_points(raw["offset"].ctypes.data, raw["zero_point"].ctypes.data, n, ng)
    raw["q"] = None
    return Fused(_assemble(layout, scheme, (n, k), raw, gs), sqnr_from_sums(sig, err), "c")


# safetensors code -> the numpy dtype holding its bits (numpy has no bfloat16 / float8)
_NP_BITS = {"I8": "int8", "I32": "int32", "U8": "uint8", "F32": "float32", "BF16": "uint16", "F8_E4M3": "uint8"}


def _packed_spec(layout, n: int, k: int) -> tuple[tuple[int, int], str]:
    """(shape, dtype code) of the kernel's packed weight for a linear [n, k] in `layout`."""
    return {PACK_I8: ((n, k), "I8"), PACK_CT32: ((n, -(-k // 8)), "I32"), PACK_NIB_K: ((n, k // 2), "I8"),
            PACK_NIB_ROWS: ((n // 2, k), "I8"), PACK_FP4: ((n, k // 2), "U8"), PACK_E4M3: ((n, k), "F8_E4M3")
            }[_PACK[layout.pack]]


def _outputs(layout, shape, cfg, c: bool, q: bool = True) -> dict[str, Any]:
    """Uninitialized outputs: numpy arrays for the C kernel, torch tensors for the fallback.
    The kernel writes every element (torch fills would wake torch's OpenMP pool, whose
    spinning threads then compete with the kernel's). The C kernel's come from the recycled
    page-aligned pool (`cvt.convert.buffers.OUTPUTS`: no zeroing of fresh pages), the packed
    weight first, placed where the writer's O_DIRECT takes it without a staging copy (`place`:
    it is the first tensor of its module on disk); the others at the start of a page."""
    from cvt.convert.buffers import OUTPUTS
    from cvt.dtypes import torch_dtype

    def empty(shape_, code, zeros=False, phase=0):
        if c:
            return OUTPUTS.array(shape_, _NP_BITS[code], phase)
        return (torch.zeros if zeros else torch.empty)(shape_, dtype=torch_dtype(code))

    n, k = shape
    ng = k // cfg["group"]
    out = {"q": empty(*_packed_spec(layout, n, k), phase=None)} if q else {}  # None: this thread's `place`d phase
    if cfg["mode"] in (MODE_SYM, MODE_ASYM):
        out["scale"] = empty((n, ng), "F32")
        out["offset"] = empty((n, ng), "F32", zeros=cfg["mode"] != MODE_ASYM)  # the fallback writes no sym offset
        if c and _PACK[layout.pack] == PACK_CT32:
            out["scale_bf16"] = empty((n, ng), "BF16")
    else:
        out["scale8"] = empty((n, ng), "U8")
    return out


def _c_blocks(lib, src, layout, cfg, name, gs, threads, simd):
    import numpy as np

    raw = _outputs(layout, src.shape, cfg, c=True)
    ptr = {k_: v.ctypes.data for k_, v in raw.items()}
    kw = dict(group=cfg["group"], qdiv=cfg["qdiv"], qmin=cfg["qmin"], qmax=cfg["qmax"], pack=_PACK[layout.pack],
              q=ptr["q"], scale=ptr.get("scale"), offset=ptr.get("offset"), scale8=ptr.get("scale8"),
              scale_bf16=ptr.get("scale_bf16"), global_scale=gs if gs is not None else 0.0, **_mx_kw(cfg))
    fn = lib.cvt_quantize
    bad, _, sig, err = _call(fn, src, cfg["mode"], threads, simd, **kw)
    if bad:
        raise P.nonfinite_error(name, _desc(src.shape), bad)
    if math.isinf(sig) or math.isinf(err):  # a float32 square overflowed: the reference sums in float64 then
        _, _, sig, err = _call(fn, src, cfg["mode"], threads, simd, f64_squares=1, **kw)
    if cfg["mode"] == MODE_ASYM and _PACK[layout.pack] == PACK_CT32:
        n, ng = raw["offset"].shape
        raw["zero_point"] = np.empty((-(-n // 8), ng), dtype=np.int32)
        lib.cvt_pack_zero_points(raw["offset"].ctypes.data, raw["zero_point"].ctypes.data, n, ng)
    return raw, sig, err


# ---- the torch fallback: the reference, a block of rows at a time --------------------------------

def _row_blocks(src: WeightSource):
    n, k = src.shape
    unit = math.lcm(8, src.block[0] if src.is_fp8 else 1)  # whole FP8 block rows; 8 rows per zero-point word
    step = max(unit, ROWS_PER_BLOCK // max(k, 1) // unit * unit)
    for r0 in range(0, n, step):
        yield r0, min(n, r0 + step)


def _count_nonfinite(src: WeightSource) -> int:
    return sum(int((~torch.isfinite(src.rows_float(r0, r1))).sum()) for r0, r1 in _row_blocks(src))


def _sq_sums(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(x.x, (x - y).(x - y)) as `cvt.runtime.metrics.sqnr_db` sums them: float32 dot products,
    redone in float64 when one overflows."""
    d = x - y
    s, e = float(torch.dot(x, x)), float(torch.dot(d, d))
    if math.isinf(s) or math.isinf(e):
        x, d = x.double(), d.double()
        s, e = float(torch.dot(x, x)), float(torch.dot(d, d))
    return s, e


def _torch_blocks(src, scheme, layout, cfg, name, gs):
    raw = _outputs(layout, src.shape, cfg, c=False)
    pack = _PACK[layout.pack]
    sig = err = 0.0
    kw = {"global_scale": torch.tensor([gs], dtype=torch.float32)} if gs is not None else {}
    for r0, r1 in _row_blocks(src):
        w = src.rows_float(r0, r1)
        if not bool(torch.isfinite(w).all()):
            raise P.nonfinite_error(name, _desc(src.shape), _count_nonfinite(src))
        q = scheme.quantize(w, name=name, **kw)
        s, e = _sq_sums(w.reshape(-1), scheme.dequantize(q).reshape(-1))
        sig, err = sig + s, err + e
        p = q.parts
        if cfg["mode"] in (MODE_SYM, MODE_ASYM):
            qi = p["weight"] if "weight" in p else p["weight_int4"]
            raw["scale"][r0:r1] = p["weight_scale"]
            if cfg["mode"] == MODE_ASYM:
                raw["offset"][r0:r1] = p["weight_offset"]
            if pack == PACK_I8:
                raw["q"][r0:r1] = qi
            elif pack == PACK_CT32:
                raw["q"][r0:r1] = P.pack_int4_ct(qi, 1)
            elif pack == PACK_NIB_K:
                raw["q"][r0:r1] = P.pack_int4_ascend(qi, 1)
            else:
                raw["q"][r0 // 2: r1 // 2] = P.pack_int4_ascend(qi, 0)
        else:
            raw["q"][r0:r1] = p["weight_fp8"] if "weight_fp8" in p else P.pack_fp4(p["weight_fp4"])
            raw["scale8"][r0:r1] = p["weight_scale"].view(torch.uint8)
    if pack == PACK_CT32:  # what the C kernel writes beside: the bf16 scale, the packed zero points
        raw["scale_bf16"] = raw["scale"].to(torch.bfloat16)  # bf16 values already
        if cfg["mode"] == MODE_ASYM:
            raw["zero_point"] = P.pack_int4_ct(raw["offset"].to(torch.int8), 0)
    return {k_: _bits(v) for k_, v in raw.items()}, sig, err


def _bits(t):
    """A torch tensor as the numpy array of its bits (`_NP_BITS`; zero-copy)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view("uint16")
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy()
    return t.numpy()


# ---- the layout's tensors from the raw outputs (as `cvt.qtensor.layouts`' encoders write them) ------

def _assemble(layout, scheme, shape, raw, gs) -> dict[str, Any]:
    """numpy arrays (bits as `_NP_BITS`) of the layout's tensors, in its encoder's order."""
    import numpy as np

    n, k = shape
    name = layout.name
    if name in ("ascend-w8a8-dynamic", "ct-int8"):
        out = {"weight": raw["q"], "weight_scale": raw["scale"]}
        if name == "ascend-w8a8-dynamic":
            out["weight_offset"] = raw["offset"]
        return out
    if name.startswith("ascend-w4a16-int8"):
        return {"weight": raw["q"], "weight_scale": raw["scale"], "weight_offset": raw["offset"]}
    if name in ("ascend-w4a16-int32", "ct-int4"):
        out = {"weight_packed": raw["q"], "weight_scale": raw["scale_bf16"],
               "weight_shape": np.array([n, k], dtype=np.int32)}
        if not scheme.symmetric:
            out["weight_zero_point"] = raw["zero_point"]
        return out
    packed = layout.tensors[0].suffix  # the codes: "weight" (Ascend) or "weight_packed" (compressed-tensors)
    if name == "ct-nvfp4":
        return {packed: raw["q"], "weight_scale": raw["scale8"], "weight_global_scale": np.array([gs], dtype=np.float32)}
    return {packed: raw["q"], "weight_scale": raw["scale8"]}


def _as_torch(tensors: dict[str, Any], layout) -> dict[str, torch.Tensor]:
    """`_assemble`'s arrays as torch tensors of the layout's dtypes (zero-copy views)."""
    from cvt.dtypes import torch_dtype

    out = {}
    for suffix, a in tensors.items():
        t = torch.from_numpy(a.view("int16") if a.dtype.name == "uint16" else a)
        out[suffix] = t.view(torch_dtype(layout.tensor(suffix).dtype))
    return out
