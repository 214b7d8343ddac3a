"""The scheme protocol and registry: one file per scheme, one small protocol.

A scheme turns one float weight ``w [n, k]`` (float32) into a `QuantizedTensor` whose
``parts`` are the *canonical in-memory* tensors the runtime's kernel of that format takes
(`cvt.runtime.kernels`, `kernel_fmt`), and back:

=========  ==============  =================================================================
scheme     kernel_fmt      parts (shapes for w [n, k], group size G)
=========  ==============  =================================================================
w8a8       w8a8_dynamic    weight int8 [n,k], weight_scale f32 [n,1], weight_offset f32 [n,1]
w8a8       w8a8_static     (static activations) + input_scale [1], input_offset [1],
                           deq_scale f32 [n], quant_bias int32 [n]   (activation calibration)
w4a16      w4a16           weight_int4 int8 [n,k] in -8..7, weight_scale f32 [n,k/G],
                           weight_offset f32 [n,k/G] (zeros when symmetric)
fp4        nvfp4 / mxfp4   weight_fp4 uint8 codes [n,k]; nvfp4: weight_scale f8e4m3 [n,k/16],
                           weight_global_scale f32 [1]; mxfp4: weight_scale uint8 E8M0 [n,k/32]
=========  ==============  =================================================================

Granularity is one notion, ``group_size``: 0 = per output channel, G = groups of G along k.
`quantize` is exact with respect to `dequantize` (what dequantize returns is what the kernel
multiplies by), and `fake_quant(w)` == `dequantize(quantize(w))` is what calibration methods
(GPTQ, AWQ) use to measure error. Formats (ascend, compressed-tensors) only rename and lay
out parts on disk; they hold no scheme logic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from cvt.lazy import torch

from cvt.errors import CvtError, OptionError
from cvt.qtensor import primitives as P
from cvt.registry import Registry


@dataclass
class QuantizedTensor:
    """A quantized linear weight: scheme name, logical shape [n, k], canonical parts."""

    scheme: str
    kernel_fmt: str
    shape: tuple[int, int]
    parts: dict[str, torch.Tensor]
    group_size: int = 0
    symmetric: bool = True
    extra: dict = field(default_factory=dict)  # e.g. {"fp4_format": "nvfp4"}


@runtime_checkable
class Scheme(Protocol):
    name: str
    group_size: int
    symmetric: bool

    def param_info(self, shape: tuple[int, int]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{part: (shape, dtype)} of `quantize` for a weight of `shape` (no data needed)."""

    def check(self, name: str, shape: tuple[int, int]) -> None:
        """Raise CvtError naming the tensor when the scheme cannot quantize this shape
        (e.g. a group size that does not divide k)."""

    def shape_problem(self, shape: tuple[int, int]) -> str | None:
        """Why the consumer cannot run the scheme on a linear of `shape` (None: it can)."""

    def quantize(self, w: torch.Tensor) -> QuantizedTensor:
        """w float [n, k] -> parts (RTN). Refuses non-finite weights."""

    def dequantize(self, q: QuantizedTensor) -> torch.Tensor:
        """parts -> float32 [n, k], exactly what the runtime kernel computes with."""

    def fake_quant(self, w: torch.Tensor) -> torch.Tensor:
        """dequantize(quantize(w)), the quantization error model used by calibration."""


class SchemeBase:
    """What the schemes share: the shape check, the checked float32 weight `quantize` starts from,
    the kernel formats they produce and `fake_quant`. A scheme class sets ``name``,
    ``group_size`` and ``kernel_formats`` and gives param_info / quantize / dequantize."""

    def produces(self) -> tuple[str, ...]:
        """The kernel formats this instance's tensors may have."""
        return self.kernel_formats

    def check(self, name: str, shape: tuple[int, int]) -> None:
        P.check_group(name, tuple(shape), self.group_size, self.name)

    def shape_problem(self, shape: tuple[int, int]) -> str | None:
        """Why the consumer cannot run this scheme on a linear of `shape` though the weight itself
        quantizes (None: it can); the plan keeps such a linear float unless a recipe asked for it."""
        return None

    def checked_weight(self, w: torch.Tensor, name: str | None = None) -> torch.Tensor:
        """`w` as float32 once `check` (its shape) and `check_finite` pass; both name `name`."""
        self.check(name or "weight", tuple(w.shape))
        P.check_finite(w, name)
        return w.to(torch.float32)

    def fake_quant(self, w: torch.Tensor) -> torch.Tensor:
        return self.dequantize(self.quantize(w))

    def grid(self, w: torch.Tensor, name: str | None = None) -> QuantizedTensor:
        """`quantize(w)`'s tensor for its per-group parts (scales, offsets) only: a scheme may leave
        the codes out (GPTQ's scale search reads grids of many candidates and no codes)."""
        return self.quantize(w, name)


def refuse_fixed(name: str, *, group_size, groups: tuple, group_why: str, symmetric, sym_why: str, fp4_format,
                 static_activations, act_why: str) -> None:
    """The one-line refusals of the options a scheme fixes: a group size not in `groups` (the
    `group_why` says what it has), asymmetric (`sym_why`), an fp4 format, static activations
    (`act_why`: how it quantizes them)."""
    if group_size not in (None, *groups):
        raise CvtError(f"scheme {name!r} {group_why}: group_size={group_size} is not supported")
    if symmetric not in (None, True):
        raise CvtError(f"scheme {name!r} is symmetric only ({sym_why})")
    if fp4_format is not None:
        raise CvtError(f"scheme {name!r} takes no fp4_format (got {fp4_format!r}; that option is for 'fp4')")
    if static_activations:
        raise CvtError(f"scheme {name!r} quantizes activations {act_why} at run time: static_activations is not "
                       "supported")


SCHEMES: Registry[type] = Registry("scheme", summarized=True)  # each class: name, summary (one line)
register = SCHEMES.register


def scheme_names() -> list[str]:
    return SCHEMES.names()


def get_scheme(name: str, **options) -> Scheme:
    """A scheme instance: options group_size, symmetric, fp4_format, static_activations."""
    return SCHEMES.get(name)(**options)


def scheme_from_options(name: str, *, group_size: int | None = None, symmetric: bool = True,
                        fp4_format: str | None = None) -> Scheme:
    """The scheme a command line asks for: each scheme takes the options its class lists in
    `options` and ignores the defaults of the others; a non-default option it does not take
    (``--asym`` for a symmetric-only scheme) is refused, naming the schemes that take it."""
    cls = SCHEMES.get(name)
    takes = getattr(cls, "options", ())
    if not symmetric and "symmetric" not in takes:
        which = [n for n in SCHEMES.names() if "symmetric" in getattr(SCHEMES.get(n), "options", ())]
        raise OptionError(f"--asym applies to {', '.join(which)} only, not {name}")
    given = {"group_size": group_size, "symmetric": symmetric, "fp4_format": fp4_format}
    return cls(**{k: v for k, v in given.items() if k in takes})
