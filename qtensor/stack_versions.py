"""vllm-ascend release lines (``--target-version``): which line an Ascend output is written for,
and what a line no longer loads.

The lines are vllm-ascend's releases as tagged in its repository (v0.23.0, v0.24.0rc1,
v0.25.1rc1) and ``main``. cvt's layouts are pinned to 0.23, the default; every line loads the
layouts cvt writes (the Ascend 950 MX methods ``W8A8_MXFP8`` / ``W4A4_MXFP4`` / ``W4A8_MXFP``
and FAKQuant with an fp8 cache on A5 are registered from v0.23.0 on), except a ``W4A4_MXFP4``
dense linear whose in_features / 32 is odd on 0.23 / 0.24 (their linear method reshapes
weight_scale to [n, k/64, 2] without the padding PR #12201 brought in v0.25.1rc1:
`shape_problem`; such a linear stays float unless a recipe asks for it) and what ``REMOVED`` lists: main dropped the W4A8_DYNAMIC linear method and per-group W4A8 MoE weights (PR #13713,
commit efda044, "Remove deprecated W4A8Linear/W8A8PDMixMoE schemes": ``methods/w4a8.py``
registers ("W4A8_DYNAMIC", "moe") only, and its __init__ raises "The current weights use
Per-Group quantization, which is no longer supported" for a description ``group_size`` > 0); no
tagged release contains that commit. The quantize stage refuses such a module with the reason
(`line_problem`) and records the line in the manifest (``quant.target_version``).
"""

from __future__ import annotations

from cvt.errors import OptionError
from cvt.qtensor import kernel_formats as KF
from cvt.qtensor.layouts import ASCEND, VLLM_ASCEND

LINES = ("0.23", "0.24", "0.25", "main")
DEFAULT_LINE = "0.23"
PR_13713 = ("vllm-ascend main removed it (PR #13713, \"Remove deprecated W4A8Linear/W8A8PDMixMoE schemes\"; "
            "methods/w4a8.py registers W4A8_DYNAMIC for MoE only)")
# (kernel format, what) -> {line: why that line does not load it}
REMOVED: dict[tuple[str, str], dict[str, str]] = {
    (KF.W4A8_DYNAMIC, "linear"): {"main": f"W4A8_DYNAMIC for a dense linear: {PR_13713}"},
    (KF.W4A8_DYNAMIC, "per-group"): {"main": "per-group W4A8_DYNAMIC: vllm-ascend main refuses a description "
                                             "group_size > 0 ('Per-Group quantization ... is no longer "
                                             "supported', PR #13713); use per-channel w4a8 (group size 0)"},
}


def check_line(fmt: str, target: str | None, line: str | None) -> str | None:
    """The release line an output is for: `line` (default `DEFAULT_LINE`) for ascend + vllm-ascend,
    None for other targets; OptionError for an unknown line or one given for another target."""
    if fmt != ASCEND or target != VLLM_ASCEND:
        if line is not None:
            raise OptionError(f"--target-version applies to --format {ASCEND} --target {VLLM_ASCEND} only, "
                              f"not {fmt}{' --target ' + target if target else ''}")
        return None
    if line is None:
        return DEFAULT_LINE
    if line not in LINES:
        raise OptionError(f"--target-version {line!r}: unknown vllm-ascend release line (known: {', '.join(LINES)})")
    return line


def line_problem(line: str | None, kernel_fmt: str, *, expert: bool, group_size: int | None) -> str | None:
    """Why vllm-ascend `line` would not load a module of `kernel_fmt` (routed expert or not, with
    this group size), or None."""
    if line is None:
        return None
    whats = ([] if expert else ["linear"]) + (["per-group"] if group_size else [])
    for what in whats:
        why = REMOVED.get((kernel_fmt, what), {}).get(line)
        if why is not None:
            return f"--target-version {line}: {why}"
    return None


# lines whose W4A4_MXFP4 linear method views weight_scale [n, k/32] as [n, k/64, 2] with no padding
# (vllm-ascend v0.23.0 / v0.24.0rc1 quantization/methods/w4a4_mxfp4.py, the linear method's
# process_weights_after_loading: weight_scale.reshape(n_dim, k_dim // 2, 2);
# v0.25.1rc1 pads the scale columns to even first, PR #12201)
_PAIRED_SCALES = ("0.23", "0.24")


def shape_problem(line: str | None, kernel_fmt: str, *, expert: bool, k: int) -> str | None:
    """Why vllm-ascend `line` cannot load a module of `kernel_fmt` with `k` in_features, or None."""
    if line in _PAIRED_SCALES and kernel_fmt == KF.W4A4_MXFP4 and not expert and (k // 32) % 2:
        return (f"--target-version {line}: vllm-ascend {line}'s W4A4_MXFP4 linear method views weight_scale "
                f"[n, k/32] in pairs without padding, so in_features / 32 must be even (got {k} / 32 = {k // 32}; "
                "0.25.1rc1 and main pad it)")
    return None
