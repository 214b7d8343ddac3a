"""A quantized output's manifest said for people: the methods its linears got, and its fallbacks
grouped by reason, each with where in the model they are (the architecture table: "the MTP
layer (layer 3)"). `cvt quantize`'s summary and `cvt verify`'s report print these lines; the
record itself is the manifest's ``quant.fallbacks`` (module, method asked, reason, tokens).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Mapping

from cvt.convert.arch import arch_for
from cvt.errors import CvtError
from cvt.schemas.manifest import RTN_FALLBACK
from cvt.units import plural


def method_counts(quant) -> dict[str, int]:
    """{method applied: linears}, most first (``rtn-fallback``: its method fell back to RTN)."""
    counts = Counter(t.method for t in quant.tensors.values())
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _reason_key(f) -> tuple[str, bool]:
    """The reason a fallback is grouped by: its text, with a leading count of the module's own
    calibration tokens (``"3 calibration tokens < min_tokens 16"``) left out, so the experts
    that saw too few tokens make one group whatever each saw."""
    lead = f"{f.tokens} "
    if f.tokens is not None and f.reason.startswith(lead):
        return f.reason[len(lead):], True
    return f.reason, False


def _ranges(ids: list[int]) -> str:
    """[1, 2, 3, 5] -> "1-3, 5"."""
    out, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def where(modules: list[str], config: Mapping[str, Any] | None) -> str:
    """Where `modules` are: "layers 1-2", "the MTP layer (layer 3)", "lm_head", or several of these."""
    layers, mtp, other = set(), set(), []
    try:
        arch = arch_for(config) if config is not None else None
    except CvtError:
        arch = None
    for m in modules:
        try:
            info = arch.classify(m + ".weight") if arch is not None else None
        except CvtError:
            info = None
        if info is None or info.layer is None:
            other.append(m)
        else:
            (mtp if info.is_mtp else layers).add(info.layer)
    parts = []
    if layers:
        parts.append(f"layer{'s' if len(layers) > 1 else ''} {_ranges(sorted(layers))}")
    if mtp:
        parts.append(f"the MTP layer{'s' if len(mtp) > 1 else ''} (layer{'s' if len(mtp) > 1 else ''} "
                     f"{_ranges(sorted(mtp))})")
    if other:
        parts.append(", ".join(other[:3]) + (f" and {len(other) - 3} more" if len(other) > 3 else ""))
    return " and ".join(parts)


def fallback_lines(quant, config: Mapping[str, Any] | None) -> list[str]:
    """One line per reason, most linears first: ``"19 linears fell back from gptq to RTN in the MTP
    layer (layer 3): not covered by calibration"``; a reason that starts with each module's own
    token count gives their range (``"0-12 calibration tokens < min_tokens 16"``)."""
    groups: dict[tuple, list] = {}
    for f in quant.fallbacks:
        reason, counted = _reason_key(f)
        rtn = getattr(quant.tensors.get(f.module), "method", None) == RTN_FALLBACK
        groups.setdefault((rtn, f.method if rtn else None, reason, counted), []).append(f)
    lines = []
    for (rtn, method, reason, counted), fs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0][2])):
        if counted:
            lo, hi = min(f.tokens for f in fs), max(f.tokens for f in fs)
            reason = f"{lo if lo == hi else f'{lo}-{hi}'} {reason}"
        what = f"fell back from {method} to RTN" if rtn else "fell back"
        lines.append(f"{plural(len(fs), 'linear')} {what} in {where([f.module for f in fs], config)}: {reason}")
    return lines


def mixed_lines(quant) -> list[str]:
    """`cvt quantize --kl-budget`'s choice for people (the manifest's ``quant.mixed_precision``):
    the budget and what was measured, then each unit kept high and why; [] without one."""
    mp = getattr(quant, "mixed_precision", None)
    if mp is None:
        return []
    by_k = {t.kept_units: t.kl_mean for t in mp.trials}
    kept = sorted((u for u in mp.units if u.kept_high), key=lambda u: u.rank)
    share = mp.high_bytes / mp.quantized_bytes if mp.quantized_bytes else 0.0
    out = [f"--kl-budget {mp.kl_budget:g}: mean KL {mp.kl_mean:.5f} measured on {mp.tokens} calibration tokens "
           f"(all {quant.scheme}: {by_k.get(0, float('nan')):.5f}, all {mp.high}: "
           f"{by_k.get(len(mp.units), float('nan')):.5f}); {len(kept)} of {plural(len(mp.units), 'unit')} kept "
           f"{mp.high}, {100 * share:.1f}% of the quantized bytes"]
    out += [f"{u.unit} kept {mp.high}: its layer's output error {u.error_low:.2e} at {quant.scheme}, "
            f"{u.error_high:.2e} at {mp.high} (rank {u.rank} by error removed per extra byte)" for u in kept]
    return out
