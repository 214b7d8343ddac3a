"""Config against weights: what a stage checks before writing anything, and `cvt inspect` lists.

`survey(ckpt, arch, block)` walks the headers once (no weight is read) and collects, by role
and layer, what the checkpoint holds and every problem a later stage or the runtime would
trip over:

* a tensor no architecture pattern maps (or one past the config's layers / experts);
* an FP8 weight without its ``weight_scale_inv`` (DeepSeek-V4: ``scale``), a scale without a
  weight, a misshaped scale (a V4 FP4 expert's: ``[n, k/32]``);
* a float or FP8 weight whose shape differs from what config.json describes
  (`ArchSpec.shapes`; packed quantized parts are checked by their formats' readers);
* a decoder layer without tensors, a MoE layer missing some of the config's routed experts, a
  layer holding MoE tensors that ``first_k_dense_replace`` makes dense;
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
    """An E4M3 ``X.weight`` with a uint8 / E8M0 ``X.weight_scale`` is an MXFP8 weight (Ascend
    W8A8_MXFP8: one E8M0 exponent per 32 along k), not an FP8 block release's weight."""
    s = tensors.get(name + "_scale")
    return s is not None and s.dtype in ("U8", "F8_E8M0")


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
    if arch is not None:  # what is missing explains the misshapes it causes: listed first
        structural: list[str] = []
        n = arch.num_layers
        for layer, seen in sorted(out.experts_seen.items()):
            missing = sorted(set(range(arch.num_experts)) - seen)
            if missing:
                key = arch.table.config_keys.get("experts", "experts")
                structural.append(f"layer {layer}: {len(missing)} of {arch.num_experts} experts missing "
                                f"(e.g. expert {missing[0]}); config.json {key} = {arch.num_experts}")
        missing_layers = sorted(set(range(n)) - out.layers_seen)
        if missing_layers:
            structural.append(f"{len(missing_layers)} decoder layers have no tensors (e.g. layer {missing_layers[0]}); "
                            f"config.json {arch.table.config_keys.get('layers', 'layers')} = {n}")
        problems[:0] = out.config + structural
    return out


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
