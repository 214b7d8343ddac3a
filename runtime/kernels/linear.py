"""The `Linear` base (dense float weight) and the format registry. See the package doc."""

from __future__ import annotations

import torch
from torch import nn

from cvt.errors import CvtError
from cvt.registry import Registry

FORMATS: Registry[type["Linear"]] = Registry("linear format")


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
    return FORMATS.add(cls.fmt, cls)


def get(name: str) -> type[Linear]:
    return FORMATS.get(name)


def for_parts(names: set[str]) -> type[Linear]:
    """The format whose parts are exactly `names` (bias aside)."""
    names = set(names) - {"bias"}
    for cls in FORMATS.values():
        if set(cls.parts) == names:
            return cls
    raise CvtError(f"no linear format stores exactly {sorted(names)} (known: "
                   + "; ".join(f"{c.fmt}: {'+'.join(c.parts)}" for c in FORMATS.values()) + ")")


register(Linear)
