"""The `Linear` base (dense float weight) and the format registry. See the package doc."""

from __future__ import annotations

import torch
from torch import nn

from cvt.errors import CvtError

FORMATS: dict[str, type["Linear"]] = {}


class Linear(nn.Module):
    """y = x @ W^T (+ b) with W float ``[out_features, in_features]`` (Hugging Face layout)."""

    fmt = "dense"
    parts: tuple[str, ...] = ("weight",)

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return nn.functional.linear(x, w, b)

    def dense_weight(self) -> torch.Tensor:
        return self.weight.float()

    @classmethod
    def from_parts(cls, parts: dict[str, torch.Tensor], bias: torch.Tensor | None = None) -> "Linear":
        w = parts["weight"]
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        mod.out_features, mod.in_features = w.shape
        mod.weight = nn.Parameter(w, requires_grad=False)
        mod.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        return mod

    def extra_repr(self) -> str:
        return f"{self.fmt}, in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


def register(cls: type[Linear]) -> type[Linear]:
    if cls.fmt in FORMATS:
        raise CvtError(f"linear format {cls.fmt!r} is registered twice ({FORMATS[cls.fmt].__name__}, {cls.__name__})")
    FORMATS[cls.fmt] = cls
    return cls


def get(name: str) -> type[Linear]:
    try:
        return FORMATS[name]
    except KeyError:
        raise CvtError(f"unknown linear format {name!r} (known: {', '.join(sorted(FORMATS))})") from None


def for_parts(names: set[str]) -> type[Linear]:
    """The format whose parts are exactly `names` (bias aside)."""
    names = set(names) - {"bias"}
    for cls in FORMATS.values():
        if set(cls.parts) == names:
            return cls
    raise CvtError(f"no linear format stores exactly {sorted(names)} (known: "
                   + "; ".join(f"{c.fmt}: {'+'.join(c.parts)}" for c in FORMATS.values()) + ")")


register(Linear)
