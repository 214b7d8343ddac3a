"""A DeepSeek-V4 release's FP4 routed experts as a quantize source: carried over without loss
when the target scheme's weight grid is the release's, dequantized exactly otherwise.

The release (``expert_dtype: "fp4"``; `cvt.convert.fp4`) stores an expert linear ``[n, k]`` as
int8 ``[n, k/2]``: E2M1 codes ``sign << 3 | index`` into {0, .5, 1, 1.5, 2, 3, 4, 6}, element
2i in the low nibble (DeepSeek's V4 ``inference/convert.py`` ``FP4_TABLE``), and ``X.scale``
float8_e8m0fnu ``[n, k/32]``: one power of two ``2**(byte - 127)`` per 32 inputs. The MX
schemes' weights are that grid byte for byte -- uint8 codes ``sign << 3 | index``, element 2j
in the low nibble, uint8 E8M0 scales with bias 127 (`cvt.qtensor.layouts.entries_mx`, pinned to
vllm-ascend main's ``w4a8_mxfp4.py``), as are ``fp4``'s mxfp4 ones (compressed-tensors
``pack_fp4_to_uint8``, E8M0 uint8 scales). So for `CARRY_KERNELS` the codes and scale bytes
are copied as they are (method "source" in the manifest, SQNR Infinity); every other scheme
requantizes the exact dequantized weight (`cvt.convert.fp4.dequant_fp4_experts`), as it would
the BF16 output of ``cvt fp8-to-bf16``. DeepSeek reads code 8 as +0.0 and the MX decoders as
-0.0: the same value, and the byte is kept.
"""

from __future__ import annotations

from typing import Mapping

from cvt.lazy import torch

from cvt.convert.fp4 import EXPERT_DTYPE_FP4, GROUP
from cvt.qtensor import kernel_formats as KF
from cvt.qtensor.layouts import kernel_fmt_of
from cvt.qtensor.schemes.base import QuantizedTensor

# kernel formats whose weight is E2M1 codes with one E8M0 scale per 32 inputs: the release's grid
CARRY_KERNELS = (KF.W4A8_MXFP, KF.W4A4_MXFP4, KF.MXFP4)
E8M0_BIAS = 127


def fp4_experts(config: Mapping) -> bool:
    """Whether config.json says the routed experts are FP4 (DeepSeek-V4's ``expert_dtype``)."""
    return config.get("expert_dtype") == EXPERT_DTYPE_FP4


def carries(scheme) -> bool:
    """Whether `scheme`'s weights are the release's FP4 grid (codes and scales copied as they are)."""
    return kernel_fmt_of(scheme) in CARRY_KERNELS


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor | None:
    """The release's scale ``[n, k/32]`` as uint8 E8M0 codes: float8_e8m0fnu as its bytes; a
    float32 / bfloat16 scale when every value is a power of two 2**-127..2**127 (None otherwise:
    that scale is not on the E8M0 grid, so the weight is requantized)."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    s = scale.to(torch.float32)
    if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
        return None
    mant, exp = torch.frexp(s)  # s = mant * 2**exp, mant in [0.5, 1): a power of two has mant 0.5
    e = exp.to(torch.int32) - 1
    if bool((mant != 0.5).any()) or bool((e < -E8M0_BIAS).any()) or bool((e > E8M0_BIAS).any()):
        return None
    return (e + E8M0_BIAS).to(torch.uint8)


def carried(packed: torch.Tensor, scale: torch.Tensor, scheme) -> QuantizedTensor | None:
    """The release's packed codes ``[n, k/2]`` (int8 / uint8) and scale ``[n, k/32]`` as `scheme`'s
    quantized tensor ``[n, k]``, bytes unchanged; None when the scheme's grid is another or the
    scale is not E8M0-representable."""
    from cvt.qtensor import primitives as P

    if not carries(scheme):
        return None
    codes_scale = e8m0_bytes(scale)
    if codes_scale is None:
        return None
    codes = P.unpack_fp4(packed.contiguous().view(torch.uint8))
    n, k = codes.shape
    extra = {"fp4_format": scheme.fp4_format} if getattr(scheme, "fp4_format", None) else {}
    return QuantizedTensor(scheme.name, kernel_fmt_of(scheme), (n, k),
                           {"weight_fp4": codes, "weight_scale": codes_scale.contiguous()}, GROUP, True, extra)


def requantized_note(schemes: Mapping[str, str]) -> str | None:
    """One line for the FP4 experts a run requantizes (`schemes`: module -> scheme name, the
    experts whose scheme does not carry them over), or None when there are none."""
    if not schemes:
        return None
    from cvt.qtensor.schemes.fp4 import FP4
    from cvt.qtensor.schemes.mx import W4A4MXFP4, W4A8MXFP

    names = sorted(set(schemes.values()))
    return (f"cvt: {len(schemes)} FP4 routed expert(s) of the release requantized to {', '.join(names)} from their "
            f"exact dequantized values ({W4A8MXFP.name}, {W4A4MXFP4.name} and {FP4.name} --fp4-format {KF.MXFP4} "
            "carry them over unchanged)")


__all__ = ["CARRY_KERNELS", "carried", "carries", "e8m0_bytes", "fp4_experts", "requantized_note"]


def calibration_plan(plan, source):
    """(the plan the calibration driver runs, the frozen linears): the FP4 experts this output
    carries as they are (method "source") are left out of the calibrated modules -- their
    weights in the calibration forward are the exact dequant, which is what the output holds --
    and named frozen, so that no smoothing fold changes them (`cvt.quant.methods.calib`)."""
    import dataclasses

    frozen = frozenset(m for m, s in plan.schemes.items()
                       if carries(s) and "weight" in plan.modules[m] and source.is_fp4(plan.modules[m]["weight"]))
    if not frozen:
        return plan, frozen
    return dataclasses.replace(plan, schemes={m: s for m, s in plan.schemes.items() if m not in frozen},
                               methods={m: v for m, v in plan.methods.items() if m not in frozen}), frozen
