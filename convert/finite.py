"""No NaN / Inf in a float tensor cvt writes: the count every writer checks, and its error.

Every verb that writes checkpoint weights (fp8-to-bf16, quantize, shard) hands each tensor to
`cvt.convert.fileset.FileSet.put`, which refuses a float one holding a NaN or an Inf before
its bytes reach the file: copied source tensors (norms, embeddings, a float-kept linear of a
BF16 source, an FP8 weight `cvt shard` splits), computed ones (scales, folded weights) alike;
`cvt export onnx` checks each weight it stores (`cvt.export.onnx_graph.Graph.weight`). Producers that count as they compute say so (`OutTensor.finite`) and are not
scanned again: the FP8 dequant kernel counts its NaN outputs (`cvt.convert.fp8`), and a
DeepSeek-V4 FP4 expert cannot hold one (every E2M1 code is finite, its scales are checked
finite and bounded first). No verb has an ``--allow-nonfinite``: no tensor of a supported
architecture holds NaN / Inf by design (masks and the like are not stored), so one that does
is a corrupt release.

The count is over the stored bits (`NONFINITE_MASKS`: the exponent field all ones, plus the
mantissa for e4m3fn, whose only NaN is S.1111.111), in C (`cvt_count_nonfinite`) when the
FP8 kernel is built, else numpy: one pass, no float conversion, torch never imported.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

from cvt.errors import TensorError

# safetensors dtype code -> the bits that are all ones in a NaN / Inf (and in nothing finite)
NONFINITE_MASKS: dict[str, int] = {
    "F64": 0x7FF0000000000000,
    "F32": 0x7F800000,
    "F16": 0x7C00,
    "BF16": 0x7F80,
    "F8_E4M3": 0x7F,  # e4m3fn: no Inf, NaN only as S.1111.111
    "F8_E5M2": 0x7C,
    "F8_E8M0": 0xFF,  # E8M0 scale: 0xFF is its NaN
}
_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
_UINT = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}


@lru_cache(maxsize=1)
def _c_count():
    from cvt.convert.fp8 import c_lib

    lib = c_lib()
    fn = getattr(lib, "cvt_count_nonfinite", None) if lib is not None else None  # (a kernel built before it: numpy)
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint64]
        fn.restype = ctypes.c_int64
    return fn


def is_float(dtype: str) -> bool:
    """Whether tensors of safetensors dtype `dtype` are checked (a float dtype)."""
    return dtype in NONFINITE_MASKS


def count_nonfinite(buf, dtype: str) -> int:
    """How many NaN / Inf elements the little-endian bytes `buf` (anything exposing the buffer
    protocol, whole elements) of float dtype `dtype` hold; 0 for a dtype that is not float."""
    mask = NONFINITE_MASKS.get(dtype)
    if mask is None:
        return 0
    import numpy as np

    size = _SIZES[dtype]
    raw = np.frombuffer(buf, dtype=np.uint8)
    n = raw.size // size
    if n == 0:
        return 0
    fn = _c_count()
    if fn is not None:
        return int(fn(raw.ctypes.data, n, size, mask))
    x = raw[: n * size].view(_UINT[size])
    return int(np.count_nonzero((x & x.dtype.type(mask)) == mask))


def nonfinite_error(what: str, bad: int, total: int | None, verb: str, piece: bool = False) -> TensorError:
    """The error of a float tensor described as `what` (its name, or `TensorRef.describe()`:
    name, dtype, shape, file) holding `bad` NaN / Inf values of `total` (None: not known, `bad`
    are those of a piece of it); `verb` refused it."""
    where = (f"{bad} of its {total} values are" if total is not None
             else f"{bad} values of {'a piece of it' if piece else 'it'} are")
    return TensorError(f"{what}: {where} NaN / Inf (in the source, or overflowed when computed from it); {verb} "
                       "refused (cvt writes no non-finite float tensor)")


__all__ = ["NONFINITE_MASKS", "count_nonfinite", "is_float", "nonfinite_error"]
