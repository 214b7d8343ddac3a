"""safetensors dtype codes: the one table from a code ('BF16') to its torch dtype and element
size, read by the reader, the writers and the planners alike."""

from __future__ import annotations

from cvt.errors import CheckpointError

# safetensors dtype code -> (torch dtype name, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "U16": ("uint16", 2),
    "I16": ("int16", 2),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "U32": ("uint32", 4),
    "I32": ("int32", 4),
    "F32": ("float32", 4),
    "U64": ("uint64", 8),
    "I64": ("int64", 8),
    "F64": ("float64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
}


def dtype_code(torch_dtype) -> str:
    """torch.dtype -> safetensors code, e.g. torch.bfloat16 -> 'BF16'."""
    name = str(torch_dtype).removeprefix("torch.")
    for code, (tname, _) in DTYPES.items():
        if tname == name:
            return code
    raise CheckpointError(f"dtype {torch_dtype} has no safetensors code")


def torch_dtype(code: str):
    import torch

    return getattr(torch, DTYPES[code][0])
