"""Released FP4 weights as a quantize source: carried over without loss when the target
scheme's weight grid is the release's, dequantized exactly (and requantized) otherwise.

Two grids are carried (`GRIDS`: the source's grid -> the kernel formats whose weights are it):

* **mxfp4** -- E2M1 codes ``sign << 3 | index`` into {0, .5, 1, 1.5, 2, 3, 4, 6}, element 2j in
  the low nibble of a byte ``[n, k/2]``, one E8M0 scale (``2**(byte - 127)``) per 32 inputs
  ``[n, k/32]``. DeepSeek-V4's FP4 routed experts (``expert_dtype: "fp4"``; `cvt.convert.fp4`:
  int8 pairs, DeepSeek's V4 ``inference/convert.py`` ``FP4_TABLE``, float8_e8m0fnu scales) and
  compressed-tensors ``mxfp4-pack-quantized`` linears (`cvt.convert.ct_source`: uint8 pairs by
  its ``pack_fp4_to_uint8``, uint8 E8M0 scales by ``mx_utils.compress_mx_scale``) are on it.
  So are the MX schemes' weights -- vllm-ascend main's ``quantization/methods/w4a4_mxfp4.py``
  and ``w4a8_mxfp4.py`` create ``weight`` uint8 ``[n, k // 2]`` and ``weight_scale`` uint8
  ``[n, k // 32]`` (``group_size`` 32) and hand them to ``npu_quant_matmul`` as
  ``float4_e2m1fn_x2`` / ``float8_e8m0fnu`` (msModelSlim's ``pack_fp4_to_uint8``, element 2j
  low) -- and ``fp4 --fp4-format mxfp4``'s (compressed-tensors ``mxfp4-pack-quantized``).
* **nvfp4** -- the same codes, one float8_e4m3fn scale per 16 inputs and a float32 global scale
  (``w = code * scale / global_scale``): compressed-tensors ``nvfp4-pack-quantized``
  (``nvfp4/base.py`` NVFP4PackedCompressor), read and written as ``fp4`` (nvfp4). NVIDIA
  ModelOpt's NVFP4 stores the same codes and block scales with ``weight_scale_2``, which
  multiplies (``w = code * scale * weight_scale_2``): carried as ``weight_global_scale = 1 /
  weight_scale_2`` in float32, the mapping compressed-tensors' own converter writes
  (``entrypoints/convert/converters/modelopt_nvfp4.py`` ``ModelOptNvfp4Converter``), where that
  is exact for every reader (`modelopt_global_scale`), requantized otherwise.

For those kernel formats the codes and scale bytes are copied as they are (method "source" in the
manifest, SQNR Infinity); every other scheme requantizes the exact dequantized weight, as it
would the BF16 output of ``cvt fp8-to-bf16``, and one note line says so. vLLM serves a fused
group (q/k/v, gate/up) with one nvfp4 global scale, the largest of its members'
(``compressed_tensors_w4a4_nvfp4.py`` ``weight_global_scale.max()``), so an nvfp4 group is
carried only when its members' global scales are the same number; otherwise it is requantized
with one shared scale (`cvt.quant.stage.assignment.Plan.shared`). DeepSeek reads code 8 as +0.0
and the MX decoders as -0.0: the same value, and the byte is kept.
"""

from __future__ import annotations

from typing import Mapping

from cvt.lazy import torch

from cvt.convert.fp4 import EXPERT_DTYPE_FP4, GROUP
from cvt.qtensor import kernel_formats as KF
from cvt.qtensor.layouts import kernel_fmt_of
from cvt.qtensor.schemes.base import QuantizedTensor

# a source grid -> the kernel formats whose weights are that grid (codes and scales copied)
GRIDS = {KF.MXFP4: (KF.W4A8_MXFP, KF.W4A4_MXFP4, KF.MXFP4), KF.NVFP4: (KF.NVFP4,)}
CARRY_KERNELS = GRIDS[KF.MXFP4]  # DeepSeek-V4's FP4 experts' grid
NVFP4_GROUP = 16
E8M0_BIAS = 127
# what the note names as carrying a ModelOpt NVFP4 linear over (`modelopt_global_scale`)
MODELOPT_CARRIED_BY = ("fp4 --fp4-format nvfp4 carries them over unchanged where 1 / weight_scale_2 gives every "
                       "element the same value in float32, a fused group only where its members share one global scale")
# what the note names as carrying a grid over (the schemes of `GRIDS`, as the CLI spells them)
_CARRIED_BY = {KF.MXFP4: "w4a8_mxfp, w4a4_mxfp4 and fp4 --fp4-format mxfp4 carry them over unchanged",
               KF.NVFP4: "fp4 --fp4-format nvfp4 carries them over unchanged, a fused group only where its "
                         "members share one global scale"}


def fp4_experts(config: Mapping) -> bool:
    """Whether config.json says the routed experts are FP4 (DeepSeek-V4's ``expert_dtype``)."""
    return config.get("expert_dtype") == EXPERT_DTYPE_FP4


def carries(scheme, grid: str = KF.MXFP4) -> bool:
    """Whether `scheme`'s weights are the source `grid` (codes and scales copied as they are)."""
    return kernel_fmt_of(scheme) in GRIDS[grid]


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor | None:
    """The release's scale ``[n, k/32]`` as uint8 E8M0 codes: float8_e8m0fnu and uint8 (compressed-
    tensors' E8M0 bytes) as their bytes; a float32 / bfloat16 scale when every value is a power of
    two 2**-127..2**127 (None otherwise: that scale is not on the E8M0 grid, so the weight is
    requantized)."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
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
    """The release's mxfp4 packed codes ``[n, k/2]`` (int8 / uint8) and scale ``[n, k/32]`` as
    `scheme`'s quantized tensor ``[n, k]``, bytes unchanged; None when the scheme's grid is another
    or the scale is not E8M0-representable."""
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


def carried_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                  scheme) -> QuantizedTensor | None:
    """A compressed-tensors nvfp4 linear (uint8 ``[n, k/2]``, float8_e4m3fn ``[n, k/16]``, global
    scale ``[1]``) as `scheme`'s (fp4 nvfp4) quantized tensor, codes and scale bytes unchanged, the
    global scale as float32 (exact from any float dtype); None when the scheme's grid is another."""
    from cvt.qtensor import primitives as P

    if not carries(scheme, KF.NVFP4) or scale.dtype != torch.float8_e4m3fn:
        return None
    codes = P.unpack_fp4(packed.contiguous().view(torch.uint8))
    parts = {"weight_fp4": codes, "weight_scale": scale.contiguous(),
             "weight_global_scale": global_scale.to(torch.float32).reshape(1).clone()}
    return QuantizedTensor(scheme.name, KF.NVFP4, tuple(codes.shape), parts, NVFP4_GROUP, True,
                           {"fp4_format": KF.NVFP4})


def modelopt_global_scale(scale_2: torch.Tensor) -> torch.Tensor | None:
    """compressed-tensors' ``weight_global_scale`` float32 ``[1]`` for a ModelOpt NVFP4 linear's
    ``weight_scale_2`` `scale_2`: ``1 / scale_2`` in float32, as compressed-tensors' own
    ``ModelOptNvfp4Converter.process`` writes it; None unless every reader of the output gets
    ModelOpt's value ``code * (float32(s) * scale_2)`` exactly:

    * vLLM takes the reciprocal back (``compressed_tensors_w4a16_nvfp4.py`` /
      ``compressed_tensors_w4a4_nvfp4.py`` ``process_weights_after_loading``: ``1.0 /
      weight_global_scale``) and multiplies the block scale by it as for ModelOpt
      (``nvfp4_emulation_utils.py`` ``dequantize_to_dtype``), so ``1 / (1 / scale_2)`` must be
      ``scale_2`` again, bit for bit;
    * compressed-tensors' decompression and cvt's runtime divide the block scale by it, so
      ``float32(s) / global_scale == float32(s) * scale_2`` for each of the 254 finite E4M3
      values ``s`` (then each code times that factor is the same float32 product too).

    Both hold for a power-of-two ``scale_2``; for others they are checked, not assumed."""
    s2 = scale_2.to(torch.float32).reshape(1)
    gs = 1.0 / s2
    if not (bool(torch.isfinite(gs).all()) and torch.equal(1.0 / gs, s2)):
        return None
    e4m3 = _e4m3_values()
    return gs.clone() if torch.equal(e4m3 / gs, e4m3 * s2) else None


def _e4m3_values() -> torch.Tensor:
    """float32 of every finite float8_e4m3fn byte (254: 0x7F and 0xFF are NaN)."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    return v[torch.isfinite(v)]


def carried_modules(plan, source) -> frozenset[str]:
    """The quantized modules of `plan` whose stored weight is carried over (`source.carry_grid`,
    the scheme's grid the same); an nvfp4 linear only when it has a global scale that converts
    exactly (`source.global_scale`: None for a ModelOpt one that does not), and a fused group
    (`plan.shared`) only when every member carries and all their global scales are equal, else
    none of it."""
    out = {m for m, s in plan.schemes.items() if (g := source.carry_grid(plan.modules[m])) is not None
           and carries(s, g)}
    scales = {m: source.global_scale(plan.modules[m]) for m in out
              if source.carry_grid(plan.modules[m]) == KF.NVFP4}
    base = frozenset(m for m in out if scales.get(m, b"") is not None)
    out = set(base)
    for m in base:
        group = plan.shared.get(m)
        if group is not None and not (all(x in base for x in group) and len({scales[x] for x in group}) == 1):
            out.discard(m)
    return frozenset(out)


def requantized_note(schemes: Mapping[str, str], what: str = "FP4 routed expert(s)",
                     grid: str = KF.MXFP4, carried_by: str | None = None) -> str | None:
    """One line for the FP4 weights a run requantizes (`schemes`: module -> scheme name, those
    not carried over; `what`: what they are in the release; `grid`: theirs; `carried_by`: what
    would carry them, default the grid's words), or None when there are none."""
    if not schemes:
        return None
    names = sorted(set(schemes.values()))
    return (f"cvt: {len(schemes)} {what} of the release requantized to {', '.join(names)} from their "
            f"exact dequantized values ({carried_by or _CARRIED_BY[grid]})")


__all__ = ["CARRY_KERNELS", "GRIDS", "MODELOPT_CARRIED_BY", "carried", "carried_modules", "carried_nvfp4", "carries",
           "e8m0_bytes", "fp4_experts", "modelopt_global_scale", "requantized_note"]


def calibration_plan(plan, source):
    """(the plan the calibration driver runs, the frozen linears): the FP4 weights this output
    carries as they are (method "source") are left out of the calibrated modules -- their
    weights in the calibration forward are the exact dequant, which is what the output holds --
    and named frozen, so that no smoothing fold changes them (`cvt.quant.methods.calib`)."""
    import dataclasses

    frozen = carried_modules(plan, source)
    if not frozen:
        return plan, frozen
    return dataclasses.replace(plan, schemes={m: s for m, s in plan.schemes.items() if m not in frozen},
                               methods={m: v for m, v in plan.methods.items() if m not in frozen}), frozen
