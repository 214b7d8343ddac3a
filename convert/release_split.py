"""`cvt shard` of a quantized release as stored: the units a split must keep whole.

A shard carries what the source stores, split per rank, whatever the source: an FP8 block
release gives FP8 shards, a cvt quantize output quantized ones, and a compressed-tensors or
ModelOpt release (`SHARDED_RELEASES`) its own codes, scales and global scales. The arch table's
split dims apply to every part of a quantized linear alike (dim 0 follows out_features n, dim 1
in_features k; `cvt.convert.shard.split_of`), so the parts split consistently exactly when each
rank's run of the weight holds whole units of every part along the split axis:

==================  ===========================================================================
part                logical elements per stored one (n, k)
==================  ===========================================================================
packed int4         X.weight_packed int32 [n, ceil(k/8)]: (1, 8)    (c-t pack-quantized)
packed FP4          X.weight_packed / ModelOpt X.weight u8 [n, k/2]: (1, 2)
FP8 / INT8 codes    X.weight [n, k]: (1, 1)
scale, zero point   group [n, k/G]: (1, G); channel [n, 1] / [n]: (1, whole k); tensor [1] / []:
                    whole; block [ceil(n/bn), ceil(k/bk)]: (bn, bk) (ModelOpt FP8_PB_WO's
                    [ceil(n/bn), 1, ceil(k/bk), 1]: (bn, -, bk, -)); int4's packed zero point
                    [ceil(n/8), k/G]: (8, G)
global scales       weight_global_scale, weight_scale_2, input_*: whole on every holder
weight_shape        the global [n, k], whole (the multi-rank loader makes it the rank's)
==================  ===========================================================================

A split along an axis of length L over degree d keeps them whole when L is a multiple of
d x unit; a part whole along that axis (one scale covers all of it) is copied to every holder.
`unit_problem` names the first part a layout would cut (a group straddling ranks, an int32 of
packed codes straddling them), in one line, before anything is written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from cvt.convert.sources import CT_STREAMED, SourceFormat

# the releases `cvt shard` carries as stored (FP8 block and cvt's outputs are its own paths)
SHARDED_RELEASES = (SourceFormat.CT_INT4, *CT_STREAMED, SourceFormat.GPT_OSS_MXFP4)
_INT4_PARTS = ("weight_packed", "weight_scale", "weight_zero_point")


@dataclass(frozen=True)
class Units:
    """One stored part of a quantized linear: the linear's logical (n, k), and per stored dim the
    logical elements one stored element covers (None: the part is whole along that axis)."""

    logical: tuple[int, int]
    units: tuple[int | None, ...]
    what: str  # the docs' words for the part ("packed int4, 8 per int32")


def release_units(ckpt, fmt: SourceFormat, qc: Mapping[str, Any] | None) -> dict[str, Units]:
    """Stored tensor name -> its `Units`, for every split-sensitive part of the release's
    quantized linears (headers only, but the int4 ``weight_shape`` [2] each linear stores);
    TensorError as the stage readers raise it for a part that is missing or misshapen."""
    if fmt is SourceFormat.CT_INT4:
        return _int4_units(ckpt, qc)
    if fmt is SourceFormat.GPT_OSS_MXFP4:
        return {}  # fused experts [E, ...]: split over ep along E only (moe_tp > 1 is refused for them)
    from cvt.convert.ct_source import ct_linears, scale_granularity

    out: dict[str, Units] = {}
    for lin in ct_linears(ckpt.tensors, fmt, qc).values():
        lay = lin.layout
        n, k = lin.shape
        out[lin.anchor] = Units(lin.shape, (1, 2) if lay.packed else (1, 1),
                                "packed FP4, 2 per byte" if lay.packed else f"{lay.dtype} codes")
        for part in ("weight_scale", "weight_zero_point"):
            name = lin.parts.get(part)
            if name is None:
                continue
            shape = tuple(ckpt.tensors[name].shape)
            rows, cols = (1, lay.group) if lay.group is not None else scale_granularity(lin, shape)
            out[name] = Units(lin.shape, _scale_units(shape, rows, cols, n, k), _scale_words(part, rows, cols, n, k))
    return out


def _scale_units(shape: tuple[int, ...], rows: int, cols: int, n: int, k: int) -> tuple[int | None, ...]:
    if len(shape) == 1:  # ModelOpt's per-channel [n] (or a tensor scale [1])
        return (None,) if math.prod(shape) == 1 else (rows,)
    if len(shape) == 4:  # ModelOpt FP8_PB_WO's [ceil(n/bn), 1, ceil(k/bk), 1]: k's blocks on dim 2
        return (None if rows >= n else rows, None, None if cols >= k else cols, None)
    return (None if rows >= n else rows, None if cols >= k else cols)


def _scale_words(part: str, rows: int, cols: int, n: int, k: int) -> str:
    what = "zero point" if part == "weight_zero_point" else "scale"
    if rows >= n and cols >= k:
        return f"per-tensor {what}"
    if cols >= k and rows <= 1:
        return f"per-channel {what}"
    return f"{what} per {rows}x{cols} block" if rows > 1 else f"{what} per group of {cols}"


def _int4_units(ckpt, qc: Mapping[str, Any] | None) -> dict[str, Units]:
    """compressed-tensors pack-quantized: int32 words of 8 codes along k, a scale (and packed
    zero point, 8 rows per int32) per group of G along k (G: the config group's group_size when
    it fits the scale, else k / cols), the logical [n, k] from each linear's ``weight_shape``."""
    import numpy as np

    from cvt.errors import TensorError

    group = _config_group(qc)
    out: dict[str, Units] = {}
    for name, ref in ckpt.tensors.items():
        module, _, param = name.rpartition(".")
        if param != "weight_shape" or f"{module}.weight_packed" not in ckpt.tensors:
            continue
        stored = np.frombuffer(ckpt.view(name), dtype="<i4" if ref.dtype == "I32" else "<i8")
        if stored.size != 2 or ckpt.tensors[f"{module}.weight_packed"].shape[0] != int(stored[0]):
            raise TensorError(f"{ref.describe()}: holds {stored.tolist()}, expected [n, k] of "
                              f"{ckpt.tensors[f'{module}.weight_packed'].describe()}")
        n, k = int(stored[0]), int(stored[1])
        out[f"{module}.weight_packed"] = Units((n, k), (1, 8), "packed int4, 8 per int32")
        scale = ckpt.tensors.get(f"{module}.weight_scale")
        cols = scale.shape[-1] if scale is not None and len(scale.shape) == 2 else 1
        g = group if group and -(-k // group) == cols else -(-k // cols)
        for part, rows in (("weight_scale", 1), ("weight_zero_point", 8)):
            if f"{module}.{part}" in ckpt.tensors:
                what = "zero point (8 rows per int32)" if rows == 8 else "scale"
                out[f"{module}.{part}"] = Units((n, k), (rows, None if g >= k else g),
                                                f"{what} per group of {g}" if g < k else f"per-channel {what}")
    return out


def _config_group(qc: Mapping[str, Any] | None) -> int | None:
    """The group size of the release's one group strategy (None: none, or several that differ)."""
    sizes = {int(w["group_size"]) for g in ((qc or {}).get("config_groups") or {}).values()
             if isinstance(w := (g or {}).get("weights"), Mapping) and w.get("group_size")}
    return sizes.pop() if len(sizes) == 1 else None


def unit_problem(ckpt, units: Mapping[str, Units], splits: Mapping[str, Any], world: int) -> str | None:
    """One line naming the first split tensor whose run per rank would cut one of its units (and
    how many more), or None; `splits`: name -> `cvt.convert.shard.Split`."""
    from cvt.convert.placement import divisors

    bad: list[str] = []
    for name, sp in splits.items():
        u = units.get(name)
        if sp.dim is None or u is None or sp.dim >= len(u.units) or u.units[sp.dim] is None:
            continue
        size, unit = u.logical[min(sp.dim, 1)], u.units[sp.dim]  # a 4-D block scale's dim 2: k
        if size % (sp.degree * unit) == 0:
            continue
        axis = "out_features" if sp.dim == 0 else "in_features"
        valid = [d for d in divisors(world) if d == 1 or size % (d * unit) == 0]  # 1: the part whole
        bad.append(f"{ckpt.tensors[name].describe()} ({u.what}): {sp.axis} {sp.degree} gives each rank "
                   f"{size / sp.degree:g} of its {size} {axis}, not whole units of {unit}: one would straddle two "
                   f"ranks; valid {sp.axis}: {', '.join(map(str, valid))}")
    if not bad:
        return None
    return bad[0] + (f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else "")


__all__ = ["SHARDED_RELEASES", "Units", "release_units", "unit_problem"]
