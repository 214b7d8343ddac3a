"""Helpers shared by the format kernels: part validation, module construction, exact int8 GEMM
and the dynamic per-token int8 reference.

Validation raises `cvt.errors.TensorError` with the format, the part name, its dtype and
shape, and what would have been valid, so one line is enough to act on.
"""

from __future__ import annotations

import torch
from torch import nn

from cvt.errors import TensorError
from cvt.qtensor.primitives import per_token_quant
from cvt.runtime.kernels import npu

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def desc(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"


def _dtypes(dtypes) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def take(fmt: str, names: tuple[str, ...], parts: dict, optional: tuple[str, ...] = ()) -> dict:
    """The parts of `fmt`, refusing missing ones, unknown ones and non-tensors."""
    if not isinstance(parts, dict):
        raise TensorError(f"{fmt}: parts must be a dict of tensors, got {type(parts).__name__}")
    missing = [n for n in names if n not in parts]
    unknown = sorted(set(parts) - set(names) - set(optional))
    if missing or unknown:
        raise TensorError(f"{fmt}: " + "; ".join(
            ([f"missing part(s) {missing}"] if missing else []) + ([f"unknown part(s) {unknown}"] if unknown else []))
            + f"; this format stores exactly {list(names)}" + (f" (optional {list(optional)})" if optional else ""))
    for n, t in parts.items():
        if not isinstance(t, torch.Tensor):
            raise TensorError(f"{fmt} part {n!r}: expected a torch.Tensor, got {type(t).__name__}")
    return parts


def check(fmt: str, name: str, t: torch.Tensor, dtypes, shape=None, why: str = "") -> torch.Tensor:
    """Check dtype (one of `dtypes`) and, when given, the exact `shape`."""
    if t.dtype not in tuple(dtypes):
        raise TensorError(f"{fmt} part {name!r} is {desc(t)}: expected dtype {_dtypes(dtypes)}"
                          + (f" ({why})" if why else ""))
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise TensorError(f"{fmt} part {name!r} is {desc(t)}: expected shape {list(shape)}"
                          + (f" ({why})" if why else ""))
    return t


def check_2d(fmt: str, name: str, t: torch.Tensor, dtypes) -> tuple[int, int]:
    check(fmt, name, t, dtypes)
    if t.dim() != 2 or t.shape[0] == 0 or t.shape[1] == 0:
        raise TensorError(f"{fmt} part {name!r} is {desc(t)}: expected a non-empty 2-D [out_features, in_features] tensor")
    return int(t.shape[0]), int(t.shape[1])


def check_per_channel(fmt: str, name: str, t: torch.Tensor, n: int) -> torch.Tensor:
    """A float part with one value per output channel: shape [n, 1] or [n]."""
    check(fmt, name, t, FLOATS)
    if tuple(t.shape) not in ((n, 1), (n,)):
        raise TensorError(f"{fmt} part {name!r} is {desc(t)}: expected shape [{n}, 1] (per output channel)")
    return t


def check_finite(fmt: str, name: str, t: torch.Tensor, positive: bool = False) -> None:
    f = t.float()
    bad = ~torch.isfinite(f)
    if positive:
        bad |= f <= 0
    if bool(bad.any()):
        what = "non-finite or non-positive" if positive else "non-finite"
        raise TensorError(f"{fmt} part {name!r} ({desc(t)}) holds {int(bad.sum())} {what} value(s)")


def new_module(cls, n: int, k: int, bias: torch.Tensor | None):
    """An instance of `cls` (a `Linear` subclass) with features and bias set, no weight yet."""
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dtype not in FLOATS or tuple(bias.shape) != (n,):
            got = desc(bias) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise TensorError(f"{cls.fmt} bias is {got}: expected a float tensor of shape [{n}]")
    mod = cls.__new__(cls)
    nn.Module.__init__(mod)
    mod.out_features, mod.in_features = n, k
    mod.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    return mod


def flat(x: torch.Tensor, k: int, fmt: str) -> torch.Tensor:
    if x.shape[-1] != k:
        raise TensorError(f"{fmt}: input {desc(x)} does not end in in_features={k}")
    return x.reshape(-1, k)


_INT_MM_MAX_K = 131071  # 128*128*k must stay below 2**31 for int32 accumulation


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact ``a @ b.T`` for int8 ``a [m, k]`` and ``b [n, k]``, as int32 (int64 when k is huge).

    torch._int_mm (int32 accumulation) where the device accepts the shapes (any shape on
    CPU; m > 16 and k, n multiples of 8 on CUDA), otherwise a float64 matmul, which is
    exact because every partial sum stays below 2**53 (on the host for devices other than
    CPU/CUDA; the Ascend int8 path normally runs npu_quant_matmul instead).
    """
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0:
        return torch.zeros(m, n, dtype=torch.int32, device=a.device)
    if k <= _INT_MM_MAX_K and (a.device.type == "cpu" or (m > 16 and k % 8 == 0 and n % 8 == 0)):
        try:
            return torch._int_mm(a.contiguous(), b.t())
        except (RuntimeError, NotImplementedError):
            pass
    dev = a.device
    if dev.type not in ("cpu", "cuda"):  # e.g. an NPU without float64 matmul: exactness first, on the host
        a, b = a.cpu(), b.cpu()
    out = a.to(torch.float64) @ b.to(torch.float64).t()
    return out.to(torch.int32 if k <= _INT_MM_MAX_K else torch.int64).to(dev)


def per_token_int8_linear(x2: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """The dynamic int8 reference (W8A8_DYNAMIC; W4A8_DYNAMIC with int4 values as int8): ``x2
    [m, k]`` quantized per token, ``y = float32(x_q @ weight^T) * weight_scale^T * x_scale (+
    bias)`` in float32 in that order, returned in x2's dtype; `weight` int8 [n, k], `weight_scale`
    [n, 1] per output channel."""
    xq, xs = per_token_quant(x2)
    acc = int8_matmul(xq, weight)
    y = acc.to(torch.float32) * weight_scale.to(torch.float32).reshape(1, -1) * xs[:, None]
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x2.dtype)


class FusedOrReference:
    """Mixin for quantized `Linear`s: the Ascend fused op when `npu.enabled` for the input's
    device (prepared once by `prepare_for_npu`), else the torch `reference` (default:
    dequantize-then-matmul in x's dtype)."""

    _npu_state = None

    def prepare_for_npu(self) -> None:
        """Lay the weights out for the Ascend ops once (no-op unless `npu.enabled` for their device)."""
        npu.prepare(self)

    def reference(self, x2: torch.Tensor) -> torch.Tensor:
        w = self.dense_weight().to(x2.dtype)
        return torch.nn.functional.linear(x2, w, None if self.bias is None else self.bias.to(x2.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = flat(x, self.in_features, self.fmt)
        y = npu.forward(self, x2) if npu.enabled(x.device) else None
        if y is None:
            y = self.reference(x2)
        return y.reshape(*x.shape[:-1], self.out_features)
