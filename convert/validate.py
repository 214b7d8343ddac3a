"""Config against weights: what a stage checks before writing anything, and `cvt inspect` lists.

`survey(ckpt, arch, block)` walks the headers once (no weight is read) and collects, by role
and layer, what the checkpoint holds and every problem a later stage or the runtime would
trip over:

* a tensor no architecture pattern maps (or one past the config's layers / experts); a
  wrapper's text tensors without its prefix (Kimi-K2.5's ``language_model.``), in one line;
* an FP8 weight without its ``weight_scale_inv`` (DeepSeek-V4: ``scale``), a scale without a
  weight, a misshaped scale (a V4 FP4 expert's: ``[n, k/32]``);
* a float or FP8 weight whose shape differs from what config.json describes
  (`ArchSpec.shapes`; packed quantized parts are checked by their formats' readers);
* a decoder layer without tensors, a MoE layer missing some of the config's routed experts (a
  fused experts tensor, gpt-oss's, holds as many as its first dim), a
  layer holding MoE tensors that ``first_k_dense_replace`` makes dense;
* MTP layers config.json counts (``num_nextn_predict_layers``) but the files lack: any of them
  where the table requires them (`ArchTable.mtp_required`: DeepSeek-V4's release; not in a layout
  transformers' save_pretrained wrote, which has none), else some but not all;
* an id tensor with an entry outside the ids it indexes (`ArchTable.id_params`: DeepSeek-V4's
  hash-routing ``tid2eid``, expert ids; the only values read, a few MB);
* a config.json value no model can have (`cvt.convert.arch.config_problems`: ``index_topk`` 0,
  ``n_group`` not dividing the experts, a negative ``rms_norm_eps``, ...), which the runtime
  refuses with the same check.

`check_weights(ckpt, verb)` raises CheckpointError listing the first problems: fp8-to-bf16,
quantize and shard call it before their output directory is touched, so a config that lies
about the weights (``n_routed_experts: 8`` with 4 experts stored, a ``q_a_proj`` of another
shape) fails with one line instead of producing an artifact the runtime refuses later.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from cvt.convert.arch import ArchSpec, Role, config_problems
from cvt.convert.fp4 import FP4_DTYPES, fp4_scale_shape
from cvt.convert.fp8 import expected_scale_shape
from cvt.errors import ArchError, CheckpointError

SCALE_SUFFIX = "_scale_inv"
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


@dataclass
class Survey:
    problems: list[str] = field(default_factory=list)
    config: list[str] = field(default_factory=list)  # config.json values alone (also in problems)
    by_role: Counter = field(default_factory=Counter)
    layers_seen: set[int] = field(default_factory=set)
    experts_seen: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))


def _mx_scaled(tensors, name: str) -> bool:
    """An E4M3 ``X.weight`` with its own ``X.weight_scale`` is not an FP8 block release's weight:
    uint8 / E8M0, an MXFP8 weight (Ascend W8A8_MXFP8: one E8M0 exponent per 32 along k); float,
    a compressed-tensors float-quantized one (`cvt.convert.ct_source` checks its scale)."""
    return name + "_scale" in tensors


def survey(ckpt, arch: ArchSpec | None, block: tuple[int, int] = (128, 128)) -> Survey:
    """Problems and bytes by role of `ckpt` under `arch` (None: the FP8 scale checks only)."""
    out = Survey()
    problems = out.problems
    expected: dict[str, tuple[int, ...]] = {}
    if arch is not None:
        out.config = config_problems(arch.config)
        try:
            expected = arch.shapes()
        except ArchError as exc:
            problems.append(str(exc))
    dense = arch.counts.get("dense_layers", 0) if arch is not None else 0
    dense_moe: set[int] = set()
    # the release's block-scale parameter: X.weight_scale_inv, or DeepSeek-V4's X.scale
    sp = arch.table.scale_param if arch is not None else "weight" + SCALE_SUFFIX
    for name, ref in ckpt.tensors.items():
        module, _, param = name.rpartition(".")
        is_scale = param == sp
        base = f"{module}.weight" if is_scale else name
        if is_scale:
            w = ckpt.tensors.get(base)
            want = None if w is None or len(w.shape) != 2 else (
                fp4_scale_shape(w.shape) if w.dtype in FP4_DTYPES else expected_scale_shape(w.shape, block))
            if w is None:
                problems.append(f"scale {name} has no weight {base}")
            elif want is not None and ref.shape != want:
                problems.append(f"scale {name}: shape {list(ref.shape)}, expected {list(want)} for weight "
                                f"{list(w.shape)}")
        elif (ref.dtype.startswith("F8_") and ref.dtype != "F8_E8M0" and name.endswith(".weight")
              and f"{name[:-len('.weight')]}.{sp}" not in ckpt.tensors  # (NVFP4's E4M3 weight_scale is not a weight)
              and not _mx_scaled(ckpt.tensors, name)):
            problems.append(f"FP8 weight {name} ({ref.path.name}) has no scale {name[:-len('.weight')]}.{sp}")
        elif ref.dtype in _FLOAT_DTYPES and name in expected and tuple(ref.shape) != tuple(expected[name]):
            problems.append(f"{name} ({ref.path.name}): shape {list(ref.shape)}, config.json describes "
                            f"{list(expected[name])}")
        if arch is None:
            continue
        if arch.lacks_prefix(base):  # one line below for all of them, not one per tensor
            out.by_role["unmapped"] += ref.nbytes
            continue
        try:
            info = arch.classify(base)
        except ArchError as exc:
            problems.append(str(exc))
            out.by_role["unmapped"] += ref.nbytes
            continue
        role = info.role.value + (" (mtp)" if info.is_mtp else "")
        out.by_role["scale" if is_scale else role] += ref.nbytes
        if (info.layer is not None and not info.is_mtp and info.layer < dense
                and info.role in (Role.EXPERT, Role.SHARED_EXPERT, Role.ROUTER) and info.layer not in dense_moe):
            dense_moe.add(info.layer)
            problems.append(f"layer {info.layer} holds MoE tensors ({name}), but config.json "
                            f"first_k_dense_replace = {dense} makes it a dense layer")
        if info.layer is not None:
            out.layers_seen.add(info.layer)
            if info.expert is not None:
                out.experts_seen[info.layer].add(info.expert)
            elif info.role is Role.EXPERT and ref.shape:  # a layer's experts fused along dim 0 (gpt-oss)
                out.experts_seen[info.layer].update(range(ref.shape[0]))
                if ref.shape[0] != arch.num_experts and name not in expected:  # (a float one: its shape's line)
                    key = arch.table.config_keys.get("experts", "experts")
                    problems.append(f"{name} ({ref.path.name}): holds {ref.shape[0]} experts (dim 0 of "
                                    f"{list(ref.shape)}), config.json {key} = {arch.num_experts}")
        if info.param in arch.table.id_params:
            problems += _id_problems(ckpt, ref, arch, arch.table.id_params[info.param])
    if arch is not None:  # what is missing explains the misshapes it causes: listed first
        prefix = arch.prefix_problem(ckpt.tensors)  # (then the layers look empty: that line alone)
        problems[:0] = out.config + ([prefix] if prefix else _missing(arch, out, bool(getattr(ckpt, "renamed", None))))
    return out


def _missing(arch: ArchSpec, out: Survey, saved: bool = False) -> list[str]:
    """Experts, decoder layers and MTP layers config.json counts that hold no tensor (`saved`: a
    layout transformers' save_pretrained wrote, which never holds MTP layers)."""
    structural: list[str] = []
    for layer, seen in sorted(out.experts_seen.items()):
        missing = sorted(set(range(arch.num_experts)) - seen)
        if missing:
            key = arch.table.config_keys.get("experts", "experts")
            structural.append(f"layer {layer}: {len(missing)} of {arch.num_experts} experts missing "
                              f"(e.g. expert {missing[0]}); config.json {key} = {arch.num_experts}")
    missing_layers = sorted(set(range(arch.num_layers)) - out.layers_seen)
    if missing_layers:
        structural.append(f"{len(missing_layers)} decoder layers have no tensors (e.g. layer {missing_layers[0]}); "
                          f"config.json {arch.table.config_keys.get('layers', 'layers')} = {arch.num_layers}")
    return structural + _mtp_problems(arch, out.layers_seen, arch.table.mtp_required and not saved)


def _mtp_problems(arch: ArchSpec, seen: set[int], required: bool) -> list[str]:
    """The MTP layers config.json counts that hold no tensor, when every one is `required`
    (`ArchTable.mtp_required`, in a release layout) or some are stored (all or none otherwise)."""
    n, m = arch.num_layers, arch.num_mtp_layers
    missing = [j for j in range(m) if n + j not in seen]
    if not missing or (len(missing) == m and not required):
        return []
    key = arch.table.config_keys.get("mtp_layers", "mtp_layers")
    what = (f"MTP layer {missing[0]} (layer index {n + missing[0]}) has" if len(missing) == 1 else
            f"{len(missing)} of the {m} MTP layers have (e.g. MTP layer {missing[0]}, layer index {n + missing[0]})")
    hint = " (set it to 0 for a checkpoint without MTP layers)" if len(missing) == m else ""
    return [f"{what} no tensors, but config.json {key} = {m}{hint}"]


def _id_problems(ckpt, ref, arch: ArchSpec, count: str) -> list[str]:
    """An id tensor (`ArchTable.id_params`): integer, every entry in 0..count-1."""
    import numpy as np

    key, top = arch.table.config_keys.get(count, count), arch.counts.get(count, 0)
    if ref.dtype not in ("I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64"):
        return [f"{ref.describe()}: holds {count} ids, so must be an integer tensor"]
    try:
        ids = np.frombuffer(ckpt.view(ref.name), dtype=f"<{ref.dtype[0].lower()}{int(ref.dtype[1:]) // 8}")
        bad = np.flatnonzero((ids < 0) | (ids >= top))
        if not bad.size:
            return []
        at = [int(i) for i in np.unravel_index(int(bad[0]), ref.shape)]
        more = f" ({bad.size - 1} more entries out of range)" if bad.size > 1 else ""
        return [f"{ref.describe()}: entry {int(ids[bad[0]])} at {at} is not one of the {top} {count} (ids 0..{top - 1}; "
                f"config.json {key} = {top}){more}"]
    finally:
        ckpt.release(ref.name)


def check_weights(ckpt, arch: ArchSpec, verb: str, block: tuple[int, int] = (128, 128)) -> None:
    """CheckpointError naming the first problems `survey` finds (call before writing)."""
    found = survey(ckpt, arch, block)
    if found.config:  # the config alone is invalid: say so, not that the weights disagree with it
        more = f" (and {len(found.config) - 1} more; `cvt inspect` lists them all)" if len(found.config) > 1 else ""
        raise CheckpointError(f"{ckpt.root}: {found.config[0]}{more}; {verb} refused")
    problems = found.problems
    if problems:
        more = f" (and {len(problems) - 3} more; `cvt inspect` lists them all)" if len(problems) > 3 else ""
        raise CheckpointError(f"{ckpt.root}: config.json and the weights disagree, {verb} refused: "
                              + "; ".join(problems[:3]) + more)


__all__ = ["Survey", "survey", "check_weights"]
