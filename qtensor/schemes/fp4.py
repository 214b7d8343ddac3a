"""`fp4`: E2M1 weights with per-group scales, ``fp4_format`` "nvfp4" (group 16) or "mxfp4" (group 32).

Parts (kernels ``nvfp4`` / ``mxfp4``, `cvt.runtime.kernels.fp4`) for ``w [n, k]``::

    weight_fp4           uint8 [n, k]      codes sign << 3 | index into {0, .5, 1, 1.5, 2, 3, 4, 6}
    nvfp4: weight_scale  float8_e4m3fn [n, k/16]
           weight_global_scale float32 [1]   448 * 6 / amax(w)
           w = fp4 * (float32(scale) / global_scale)
    mxfp4: weight_scale  uint8 E8M0 [n, k/32]
           w = fp4 * 2**(e - 127)

The scale rules and the E2M1 rounding are compressed-tensors' (see `cvt.qtensor.primitives`):
its nvfp4 / mxfp4 quantizers and ours produce the same codes and scales for float32 weights.
Symmetric only (compressed-tensors refuses asymmetric fp4).
"""

from __future__ import annotations

from cvt.qtensor import kernel_formats as KF
from cvt.lazy import torch

from cvt.errors import CvtError
from cvt.qtensor import primitives as P
from cvt.qtensor.schemes.base import QuantizedTensor, SchemeBase, register

GROUPS = {KF.NVFP4: 16, KF.MXFP4: 32}  # the fp4 formats, defined here: each is its own kernel format


@register
class FP4(SchemeBase):
    name = "fp4"
    summary = "E2M1 weights with group scales: nvfp4 (group 16, E4M3 scales + a global scale) or mxfp4 (group 32, E8M0 scales)"
    kv_cache = None
    static_activations = False
    options = ("fp4_format",)
    kernel_formats = tuple(GROUPS)
    symmetric = True

    def __init__(self, fp4_format: str | None = None, group_size: int | None = None, symmetric=None,
                 static_activations=None):
        fmt = fp4_format or KF.NVFP4
        if fmt not in GROUPS:
            raise CvtError(f"scheme 'fp4': unknown fp4_format {fp4_format!r} (known: {', '.join(GROUPS)})")
        if group_size not in (None, GROUPS[fmt]):
            raise CvtError(f"scheme 'fp4' with fp4_format {fmt!r} has a fixed group size of {GROUPS[fmt]}; "
                           f"got group_size={group_size}")
        if symmetric not in (None, True):
            raise CvtError("scheme 'fp4' is symmetric only (compressed-tensors has no asymmetric fp4)")
        if static_activations:
            raise CvtError("scheme 'fp4' keeps activations in float: static_activations is not supported")
        self.fp4_format = fmt
        self.group_size = GROUPS[fmt]

    def __repr__(self) -> str:
        return f"FP4(fp4_format={self.fp4_format!r})"

    def kernel_fmt(self, static: bool = False) -> str:
        return self.fp4_format

    def produces(self) -> tuple[str, ...]:
        return (self.fp4_format,)

    def param_info(self, shape):
        n, k = shape
        g = (n, k // self.group_size)
        if self.fp4_format == KF.NVFP4:
            return {"weight_fp4": ((n, k), torch.uint8), "weight_scale": (g, torch.float8_e4m3fn),
                    "weight_global_scale": ((1,), torch.float32)}
        return {"weight_fp4": ((n, k), torch.uint8), "weight_scale": (g, torch.uint8)}

    def check(self, name, shape) -> None:
        P.check_group(name, tuple(shape), self.group_size, f"fp4 ({self.fp4_format})")

    def group_scales(self, q: QuantizedTensor) -> torch.Tensor:
        """The float32 multiplier of each group, ``[n, k/G]``."""
        if q.extra.get("fp4_format", self.fp4_format) == KF.NVFP4:
            return q.parts["weight_scale"].to(torch.float32) / q.parts["weight_global_scale"].to(torch.float32)
        return P.e8m0_to_f32(q.parts["weight_scale"])

    @property
    def per_tensor_scale(self) -> bool:
        """nvfp4's global scale is per tensor: fused linears must share it (`shared_scale`)."""
        return self.fp4_format == KF.NVFP4

    def shared_scale(self, ws: list[torch.Tensor]) -> torch.Tensor:
        """One global scale for weights a serving stack fuses into one GEMM: 448 * 6 / the
        largest amax among them (the smallest member scale), so no member's block scales
        overflow E4M3 -- what llm-compressor equalizes fused layers to."""
        amax = max(float(w.to(torch.float32).abs().amax()) for w in ws)
        return P.nvfp4_global_scale(torch.tensor([amax]))

    def shared_scale_of(self, amaxes: list[float]) -> float:
        """`shared_scale` from each member's max |w| (float32 values, e.g. the fused kernel's
        `cvt.quant.qkernel.absmax`): the same number, without torch."""
        return P.nvfp4_global_scale_of(max(amaxes))

    def quantize(self, w: torch.Tensor, name: str | None = None,
                 global_scale: torch.Tensor | None = None) -> QuantizedTensor:
        """RTN; nvfp4 with `global_scale` given (a fused group's `shared_scale`) uses it."""
        w = self.checked_weight(w, name)
        n, k = w.shape
        if self.fp4_format == KF.NVFP4:
            gs = P.nvfp4_global_scale(w) if global_scale is None else global_scale.to(torch.float32).reshape(1)
            scale = P.nvfp4_block_scales(w, gs, self.group_size)
            parts = {"weight_scale": scale, "weight_global_scale": gs}
            mult = scale.to(torch.float32) / gs
        else:
            scale = P.mxfp4_scale_codes(w, self.group_size)
            parts = {"weight_scale": scale}
            mult = P.e8m0_to_f32(scale)
        x = torch.clamp(P.groups(w, self.group_size) / mult[:, :, None], -P.E2M1_MAX, P.E2M1_MAX)
        codes = P.encode_e2m1(P.ungroup(x))
        return QuantizedTensor(self.name, self.fp4_format, (n, k), {"weight_fp4": codes, **parts},
                               self.group_size, True, {"fp4_format": self.fp4_format})

    def dequantize(self, q: QuantizedTensor) -> torch.Tensor:
        v = P.groups(P.decode_e2m1(q.parts["weight_fp4"]), q.group_size)
        return P.ungroup(v * self.group_scales(q)[:, :, None])
