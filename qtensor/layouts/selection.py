"""Choosing a layout: the kernel format a scheme quantizes to, whether the fused RTN kernels write
a layout, the serving targets of an output format, and the one layout a target loads for a
module (`select`) or that a module's on-disk tensors are in (`read_layout`).
"""

from __future__ import annotations

from cvt.lazy import torch

from cvt.errors import FormatError
from cvt.qtensor.layouts.base import FORMAT_TARGETS, LAYOUTS, VLLM_ASCEND, Layout, scale_bias_role
from cvt.qtensor.schemes.base import SCHEMES


# ---- selection -------------------------------------------------------------------------------------
def kernel_fmt_of(scheme, static: bool = False) -> str:
    """The kernel format a scheme (instance, or a registered name) quantizes to (static: W8A8
    static activations); each scheme says (`Scheme.kernel_fmt`)."""
    return _instance(scheme).kernel_fmt(static)


def _instance(scheme):
    return SCHEMES.get(scheme)() if isinstance(scheme, str) else scheme


def fuses(layout: Layout, scheme, shape: tuple[int, int]) -> bool:
    """Whether the fused RTN kernels (`cvt.quant.qkernel`) write `layout` for a ``[n, k]`` weight
    of `scheme`, whatever its source dtype: the cases where the reference's encoder raises (and
    the stage then reports that) are not fused."""
    n, k = shape
    if layout.pack is None or n == 0 or k == 0 or layout.kernel_fmt != kernel_fmt_of(scheme):
        return False
    if not scheme.symmetric and not any(t.suffix in ("weight_offset", "weight_zero_point") for t in layout.tensors):
        return False  # no tensor holds zero points (vllm-ascend's int32 W4A16): the reference raises
    return not ((layout.pack == "nib_rows" and n % 2) or (layout.pack in ("nib_k", "e2m1") and k % 2))


def kernel_formats(scheme) -> set[str]:
    """Every kernel format a scheme can produce: a registered name's all, an instance's own
    (`Scheme.kernel_formats`: fp4 is one of nvfp4 / mxfp4 once built)."""
    return set(SCHEMES.get(scheme).kernel_formats) if isinstance(scheme, str) else set(scheme.produces())


def targets_for(fmt: str) -> tuple[str, ...]:
    if fmt not in FORMAT_TARGETS:
        raise FormatError(f"unknown output format {fmt!r} (known: {', '.join(sorted(FORMAT_TARGETS))})")
    return FORMAT_TARGETS[fmt]


def check_target(fmt: str, target: str | None) -> str:
    """The serving target of an output (default: vllm-ascend for ascend, vllm for c-t)."""
    valid = targets_for(fmt)
    if target is None:
        return valid[0]
    if target not in valid:
        raise FormatError(f"--target {target!r} does not apply to the {fmt} format (valid: {', '.join(valid)})")
    return target


def candidates(fmt: str, kernel_fmt: str, target: str) -> list[Layout]:
    return [lo for lo in LAYOUTS.values() if lo.format == fmt and lo.kernel_fmt == kernel_fmt and target in lo.targets]


def select(fmt: str, kernel_fmt: str, target: str, *, expert: bool, group_size: int, k: int,
           module: str = "", parallel: str | None = None) -> Layout:
    """The layout `target` loads for a linear of `kernel_fmt` (routed expert or not); FormatError
    saying why there is none (with what the stack does accept). `parallel`: the module's role where
    the quantized tensor carries it (``extra["parallel"]``; W4A4_MXFP4_FLATQUANT's row layers)."""
    where = f"{module}: " if module else ""
    found = candidates(fmt, kernel_fmt, target)
    if not found:
        other = sorted({t for lo in LAYOUTS.values() if lo.format == fmt and lo.kernel_fmt == kernel_fmt
                        for t in lo.targets})
        raise FormatError(f"{where}{fmt} for {target} has no layout for kernel format {kernel_fmt!r}"
                          + (f" (--target {' / '.join(other)} has one)" if other else ""))
    fit = [lo for lo in found if lo.holds(group_size, k)]
    if not fit:
        sizes = sorted({g for lo in found for g in lo.groups})
        raise FormatError(f"{where}{target} loads {kernel_fmt} only with "
                          + " or ".join(sorted({lo.grouping for lo in found})) + " scales"
                          + (f" (group sizes {', '.join(map(str, sizes))})" if sizes else "") + ", not "
                          + ("per channel" if group_size == 0 else f"group size {group_size}")
                          + (" (vllm-ascend divides by the description's group_size: 0 fails); use --group-size "
                             "32, 64 or 128" if target == VLLM_ASCEND else ""))
    lo = fit[0]
    if lo.experts_only and not expert:
        raise FormatError(f"{where}{target} loads {lo.tag or kernel_fmt} ({lo.name}) for MoE experts only (no "
                          "linear method loads it); keep this module float or give it another scheme in a recipe")
    if lo.linears_only and expert:
        raise FormatError(f"{where}{target} loads {lo.tag or kernel_fmt} ({lo.name}) for linears only (no MoE method "
                          "loads it); keep the routed experts float or give them another scheme in a recipe")
    if any(x.parallel != "any" for x in fit):  # e.g. W4A8_DYNAMIC: scale_bias by the module's role
        # the role the scheme was given (the architecture table's); else the "any" entry where there
        # is one (a W4A4_MXFP4_FLATQUANT linear that is not row-parallel), else msModelSlim's name rule
        role = parallel or ("any" if any(x.parallel == "any" for x in fit) else scale_bias_role(module))
        lo = next((x for x in fit if x.parallel == role), None) or next((x for x in fit if x.parallel == "any"), None)
        if lo is None:
            raise FormatError(f"{where}{target} has no {kernel_fmt} layout for {role}-parallel modules")
    return lo


def experts_only_reason(fmt: str, kernel_fmt: str, target: str) -> str | None:
    """Why a non-expert linear stays float by default under this target (None: it need not):
    every layout the target has for `kernel_fmt` is loaded for MoE experts only."""
    found = candidates(fmt, kernel_fmt, target)
    if found and all(lo.experts_only for lo in found):
        return (f"{target} loads {found[0].tag} ({kernel_fmt}) for MoE experts only (no linear method loads "
                "it): kept float; a recipe can give it another scheme")
    return None


def linears_only_reason(fmt: str, kernel_fmt: str, target: str) -> str | None:
    """Why a routed expert stays float by default under this target (None: it need not): every
    layout the target has for `kernel_fmt` is loaded for linears only (W4A4_FLATQUANT_DYNAMIC)."""
    found = candidates(fmt, kernel_fmt, target)
    if found and all(lo.linears_only for lo in found):
        return (f"{target} loads {found[0].tag} ({kernel_fmt}) for linears only (no MoE method loads it): kept "
                "float; a recipe can give the experts another scheme (w4a8)")
    return None


def read_layout(module: str, kernel_candidates, disk: dict[str, torch.Tensor]) -> Layout:
    """Among `kernel_candidates` (layouts of one tag), the one whose required tensors `disk`
    (suffix -> tensor) holds, preferring the most specific; int8 W4A16 by its scale shape."""
    fits = [lo for lo in kernel_candidates if all(t.suffix in disk for t in lo.tensors if not t.optional)]
    if not fits:
        need = sorted({t.suffix for lo in kernel_candidates for t in lo.tensors if not t.optional} - set(disk))
        raise FormatError(f"{module}: none of the layouts {[lo.name for lo in kernel_candidates]} matches its "
                          f"tensors {sorted(disk)} (missing {', '.join(need)})")
    return max(fits, key=lambda lo: len(lo.tensors))
