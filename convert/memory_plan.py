"""Before writing shards: divisibility checks and a per-rank memory plan, from config.json alone.

Every tensor of ``param_shapes(config)`` (MTP layers included) is split along its arch-table
split dim by the degree of its part of the model:

===================  ======================================================================
tensor               held by
===================  ======================================================================
attention linears    tp (column: heads; row: o_proj's input); q_a / kv_a projections whole
dense MLP            dense_tp
routed experts       whole experts on their EP rank(s) (placement), split moe_tp ways inside
shared experts       moe_tp (``layout.shared_experts == "replicated"``: whole on every rank)
embed_tokens         embed_tp (vocab-parallel), MTP's copy too
lm_head              lmhead_tp (column-parallel), MTP's shared_head.head too
norms, router, bias  replicated (eh_proj too)
===================  ======================================================================

Bytes per tensor shard under a scheme:

* ``bf16``: 2 bytes per element; ``e_score_correction_bias`` stays float32 everywhere.
* ``fp8``: the linears an FP8 release stores in FP8 (attention, dense MLP, experts; FORMATS.md
  1.1: not embeddings, heads, norms, router, nor MTP's eh_proj, a plain nn.Linear in vLLM /
  SGLang) take 1 byte per element + float32 block scales ``ceil(n/128) x ceil(k/128)`` of the
  shard; everything else as bf16.
* ``w8a8`` / ``w8a8c8`` / ``w4a16`` / ``w4a8`` / ``fp4``: quantizable linears that are not float by default
  (arch table) take the bytes `cvt quantize --format F --target T` writes for their shard: the
  on-disk tensors of the layout the layout table picks (`DiskBytes`, the table quantize and
  shard read; F defaults to compressed-tensors, or ascend for a scheme only it has), or bf16
  where T loads that kernel format for MoE experts only; the rest stays bf16. w4a16's group
  size defaults as quantize's does per format. w8a8c8 adds the replicated KV-cache scales and
  offsets of `cvt.runtime.kv_cache` (MLA FAKQuant: fa_q [heads, 1], fa_k / fa_v [1, 1] per
  layer; GQA: per channel). A test holds each rank's bytes equal to what `cvt shard` writes.

KV cache for ``kv_tokens``: the tokens in flight over the whole world; attention DP splits
sequences evenly over the dp ranks (``ceil(kv_tokens / dp)`` per rank), TP ranks of a group
hold the same tokens. Each decoder layer caches what its attention kind holds (the table's
`ArchTable.attention`, `cvt.convert.arch.attention`; MTP layers excluded): MLA
``kv_lora_rank + qk_rope_head_dim`` values per token (whole on every TP rank: the latent has no
heads), sparse MLA plus its lightning indexer's key (``index_head_dim``, bf16) where the layer runs
its own indexer (DeepSeek-V3.2: every one; GLM-5: its "full" indexer layers), GQA
``2 x kv_heads / tp x head_dim``. bf16, or int8 under w8a8c8 (MLA: the latent only; the rope key
stays bf16). `cvt.convert.kv_bytes` counts it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from cvt.convert.arch import Block, Parallel, Role, TensorInfo, arch_for, config_problems
from cvt.convert.config import fp8_block
from cvt.convert.placement import Layout, Placement, contiguous_placement, divisors, moe_layers, placement_problems
from cvt.convert.disk_bytes import DiskBytes, format_group, plan_scheme, plan_schemes
from cvt.convert.kv_bytes import kv_cache_bytes
from cvt.convert.safetensors_io import load_json
from cvt.units import binary_size, parse_size
from cvt.errors import CvtError, FormatError, ShapeError

CATEGORIES = ("attention", "dense_mlp", "experts", "shared_experts", "router", "embedding", "head", "norm",
              "mtp_proj", "kv_scales", "carried")
_ROLE_CATEGORY = {Role.EMBEDDING: "embedding", Role.HEAD: "head", Role.NORM: "norm", Role.ROUTER: "router",
                  Role.EXPERT: "experts", Role.SHARED_EXPERT: "shared_experts", Role.MTP_PROJ: "mtp_proj",
                  Role.KV_CACHE: "kv_scales", Role.CARRIED: "carried"}  # carried: Kimi-K2.5's vision tower
_PACKED_4BIT = ("weight_int4", "weight_fp4")
_NUM = re.compile(r"(?<=\.)(\d+)(?=\.)")


@dataclass(frozen=True)
class Kind:
    """What a tensor name pattern means for sharding (one per pattern, cached)."""

    info: TensorInfo
    category: str
    axis: str | None  # layout degree that splits it (None: replicated)
    fp8: bool  # stored as FP8 in an FP8 block release
    quantized: bool  # quantized by cvt's schemes unless a recipe says otherwise


def axis_of(info: TensorInfo, shared: str = "moe_tp") -> str | None:
    """The layout degree that splits this tensor's module (None: the module is replicated). A
    carried copy of the embedding / head (DeepSeek-V4's MTP draft's: a vocab / column rule) splits
    as they do; other carried tensors (Kimi-K2.5's vision tower) are replicated."""
    role = info.role
    if role is Role.CARRIED:
        return {Parallel.VOCAB: "embed_tp", Parallel.COLUMN: "lmhead_tp"}.get(info.rule.parallel)
    return {Role.EMBEDDING: "embed_tp", Role.HEAD: "lmhead_tp", Role.EXPERT: "moe_tp",
            Role.SHARED_EXPERT: "moe_tp" if shared == "moe_tp" else None,
            Role.LINEAR: "tp" if info.block is Block.ATTN else "dense_tp"}.get(role)


def _kind(info: TensorInfo, shared: str) -> Kind:
    role = info.role
    cat = _ROLE_CATEGORY.get(role) or ("attention" if info.block is Block.ATTN else "dense_mlp")
    axis = axis_of(info, shared) if info.split_dim is not None else None
    weight = info.param == "weight" and info.rule.quantizable
    fp8 = weight and role in (Role.LINEAR, Role.EXPERT, Role.SHARED_EXPERT)
    return Kind(info, cat, axis, fp8, weight and not info.rule.float_default)


def tensors(config: Mapping[str, Any], shared: str = "moe_tp") -> Iterator[tuple[str, tuple, Kind, tuple]]:
    """(name, shape, kind, numbers in the name) for every weight of the config."""
    arch = arch_for(config)
    cache: dict[str, Kind] = {}
    for name, shape in arch.shapes().items():
        key = _NUM.sub("#", name)
        kind = cache.get(key)
        if kind is None:
            kind = cache[key] = _kind(arch.classify(name), shared)
        yield name, shape, kind, tuple(map(int, _NUM.findall(name)))


# ------------------------------------------------------------------------------ validation
@dataclass(frozen=True)
class Violation:
    """A degree that does not divide something: the tensor or config key, dim, sizes, valid degrees."""

    subject: str
    axis: str
    degree: int
    size: int
    dim: int | None = None
    unit: int = 1
    unit_name: str = "element"
    valid: tuple[int, ...] = ()
    more: int = 0
    reason: str = ""

    def __str__(self) -> str:
        if self.reason:
            return self.reason
        where = self.subject + (f" dim {self.dim}" if self.dim is not None else "")
        units = f" = {self.size // self.unit} {self.unit_name}s" if self.unit > 1 and self.size % self.unit == 0 else ""
        msg = (f"{where} (size {self.size}{units}): {self.axis} {self.degree} does not split it into whole "
               f"{self.unit_name}s; valid {self.axis}: {', '.join(map(str, self.valid)) or 'none'}")
        return msg + (f" (and {self.more} more tensors like it)" if self.more else "")


def _holds_fp8(config: Mapping[str, Any], scheme: str | None) -> tuple[int, int] | None:
    """The FP8 block when the shards hold FP8 weights (scheme 'fp8', or None on an FP8 source)."""
    src_block = fp8_block(config, "config.json")  # the source's own, checked: [rows, cols] > 0
    if scheme == "fp8" or (scheme is None and src_block):
        return src_block or (128, 128)
    return None


def _unit(kind: Kind, dim: int, block, sch, k: int) -> tuple[int, str]:
    """The granularity a shard along `dim` must keep whole: an FP8 block, and for a quantized
    module what every on-disk layout of its kernel format packs along that axis (groups, int4
    pairs and int32 runs, fp4 pairs; `cvt.qtensor.layouts`), whichever format the shards are in."""
    unit, names = 1, []
    if block and kind.fp8:
        unit, names = block[dim], [f"FP8 {block[dim]}-block"]
    if sch is not None and kind.quantized:
        from cvt.qtensor.layouts import LAYOUTS, kernel_fmt_of

        axis = "n" if dim == 0 else "k"
        g = getattr(sch, "group_size", 0) or 0
        expert = kind.info.role is Role.EXPERT
        q = 1
        for lo in LAYOUTS.values():
            if lo.kernel_fmt == kernel_fmt_of(sch) and lo.holds(g, k):
                q = math.lcm(q, lo.split_units(axis, g, k, expert=expert))
        if q > 1:
            unit = math.lcm(unit, q)
            what = ("expert in_features unit" if expert and axis == "k" and q > g
                    else "group" if g and q % g == 0 else "packing unit")
            names.append(f"{sch.name} {what} of {q}")
    return unit, " and ".join(names) if names else ("row" if dim == 0 else "column")


def _some(values, n: int = 12) -> str:
    values = list(values)
    return ", ".join(map(str, values[:n])) + (f", ... {values[-1]}" if len(values) > n else "")


def _config_violation(subject, axis, degree, size, world, unit_name, extra="") -> Violation | None:
    if size % degree == 0:
        return None
    valid = tuple(d for d in divisors(world) if size % d == 0)
    return Violation(subject, axis, degree, size, unit_name=unit_name, valid=valid,
                     reason=f"{subject} = {size} {unit_name}s: {axis} {degree} does not divide it; valid {axis}: "
                            f"{', '.join(map(str, valid))} (the divisors of {size} that also divide the world size "
                            f"{world}; {size}'s divisors: {_some(divisors(size))}){extra}")


def _fused_violations(arch, layout: Layout, layers: list[int], items: list) -> list[Violation]:
    """Experts fused over dim 0 (gpt-oss's ``[E, ...]``) split only as contiguous id ranges over ep,
    whole along their width (`cvt.convert.shard.split_of`): moe_tp > 1 and any other placement
    (EPLB, redundant copies) are violations. `items`: `tensors`'s, each pattern classified once."""
    name = next((n for n, _, kind, _ in items if kind.info.role is Role.EXPERT and kind.info.expert is None), None)
    if name is None:
        return []
    out, E = [], arch.num_experts
    if layout.moe_tp > 1:
        out.append(Violation(name, "moe_tp", layout.moe_tp, E, reason=f"{name} (experts fused over dim 0): moe_tp "
                             f"{layout.moe_tp} would split each expert's width, which cvt does not do for fused "
                             "experts; valid moe_tp: 1 (split them over ep)"))
    if layout.placement is not None and E % layout.ep == 0 and any(
            layout.placement.for_layer(L) != contiguous_placement(E, layout.ep).default for L in layers):
        out.append(Violation(name, "ep", layout.ep, E, reason=f"{name} (experts fused over dim 0): the placement "
                             f"({layout.placement.source}) is not contiguous expert id ranges over ep, the only "
                             "split of fused experts; shard without --placement or --redundant"))
    return out


def validate(layout: Layout, config: Mapping[str, Any], scheme: str | None = None,
             group_size: int | None = None, _items: list | None = None) -> list[Violation]:
    """Every divisibility problem of `layout` for this model (empty: the layout can be written).
    `scheme`: None = the source as stored (FP8 blocks when it is an FP8 release), or a plan scheme."""
    arch = arch_for(config)
    cfg, W = arch.config, layout.world_size
    sch = plan_scheme(scheme, group_size)
    block = _holds_fp8(config, scheme)
    out: list[Violation] = []
    heads = cfg.get("num_attention_heads") or 0
    out.append(_config_violation("config.num_attention_heads", "tp", layout.tp, heads, W, "head"))
    if any(k.heads_split for k in arch.attention()):  # GQA's KV heads; MLA's latent, V4's one K=V head: whole
        kv = cfg.get("num_key_value_heads") or heads
        out.append(_config_violation("config.num_key_value_heads", "tp", layout.tp, kv, W, "KV head"))
    for kind in {k.name: k for k in arch.attention()}.values():  # e.g. the Gated DeltaNet's key / value heads
        out += [_config_violation(f"config.{key}", "tp", layout.tp, cfg[key], W, unit)
                for key, unit in kind.tp_heads if cfg.get(key) is not None]
    E, layers = arch.num_experts, moe_layers(config)
    if layers and layout.placement is None:
        key = arch.table.config_keys.get("experts", "experts")
        out.append(_config_violation(f"config.{key}", "ep", layout.ep, E, W, "routed expert",
                                     " (or give an expert placement with redundant experts, the physical "
                                     "count a multiple of ep)"))
    elif layers:
        if layout.placement.num_experts != E:
            out.append(Violation("placement", "ep", layout.ep, layout.placement.num_experts,
                                 reason=f"the placement is for {layout.placement.num_experts} experts, the "
                                        f"config has {E}"))
        out += [Violation("placement", "ep", layout.ep, E, reason=p)
                for p in placement_problems(layout.placement, layers)]
    items = _items if _items is not None else list(tensors(config, layout.shared_experts))
    out = [v for v in out if v is not None] + _fused_violations(arch, layout, layers, items)
    seen: dict[tuple, list] = {}
    for name, shape, kind, _ in items:
        if kind.axis is None or getattr(layout, kind.axis) == 1:
            continue
        d, dim = getattr(layout, kind.axis), kind.info.split_dim
        unit, unit_name = _unit(kind, dim, block, sch, shape[1] if len(shape) == 2 else 0)
        size = shape[dim]
        if size % (d * unit):
            key = (kind.info.rule.pattern, kind.info.param, dim, kind.axis)
            if key in seen:
                seen[key][1] += 1
                continue
            valid = tuple(x for x in divisors(W) if size % (x * unit) == 0)
            seen[key] = [Violation(name, kind.axis, d, size, dim, unit, unit_name, valid), 0]
    out += [dataclasses.replace(v, more=more) for v, more in seen.values()]
    return out


def check(layout: Layout, config: Mapping[str, Any], scheme: str | None = None,
          group_size: int | None = None) -> None:
    """CvtError listing every violation (call before writing anything)."""
    bad = validate(layout, config, scheme, group_size)
    if bad:
        raise CvtError(f"the layout (world {layout.world_size}: tp {layout.tp}, ep {layout.ep}, moe_tp "
                       f"{layout.moe_tp}, dense_tp {layout.dense_tp}, embed_tp {layout.embed_tp}, lmhead_tp "
                       f"{layout.lmhead_tp}) cannot shard this model:\n  " + "\n  ".join(map(str, bad)))


# ------------------------------------------------------------------------------ memory plan
def _tensor_bytes(kind: Kind, shape: tuple, dim: int | None, deg: int, sch, block, disk: DiskBytes | None = None,
                  module: str = "", per_channel: bool = False) -> int:
    """Bytes of one shard (dim split `deg` ways, the largest shard when it does not divide);
    a quantized linear's as `disk` says (`DiskBytes`; `per_channel`: its group fallback), else
    from the scheme's parts."""
    shape = list(shape)
    if dim is not None and deg > 1:
        shape[dim] = -(-shape[dim] // deg)
    numel = math.prod(shape)
    if kind.info.param == "e_score_correction_bias":
        return 4 * numel
    if block and kind.fp8 and len(shape) == 2:
        n, k = shape
        return n * k + -(-n // block[0]) * -(-k // block[1]) * 4
    if disk is not None and kind.quantized and len(shape) == 2:
        b = disk(module, shape, kind.info.role is Role.EXPERT, per_channel, kind.info.rule.parallel is Parallel.ROW,
                 deg if dim == 1 else 1, kind.axis or "tp")
        return 2 * numel if b is None else b
    if sch is not None and kind.quantized and len(shape) == 2:
        total = 0
        for part, (pshape, dtype) in sch.param_info(tuple(shape)).items():
            rows, cols = (pshape[0], math.prod(pshape[1:])) if len(pshape) > 1 else (1, math.prod(pshape))
            total += rows * -(-cols // 2) if part in _PACKED_4BIT else rows * cols * dtype.itemsize
        return total
    return 2 * numel


parse_bytes = parse_size  # one size syntax for every option (cvt.units)


def size(n: float) -> str:
    """A cell of the plan: its own binary unit, so that a tiny model's bytes read as bytes, not 0.00 GiB."""
    return binary_size(n)


@dataclass
class RankUsage:
    rank: int
    ep_rank: int
    weights: dict[str, int]  # category -> bytes
    kv_cache: int = 0

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_cache


def _ranges(ranks: list[int]) -> str:
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)


@dataclass
class Plan:
    """Per-rank bytes of a layout (weights by category + KV cache), and what it assumed."""

    model_type: str
    scheme: str
    layout: Layout
    ranks: list[RankUsage]
    model_bytes: dict[str, int]  # unsharded: every tensor once, every logical expert once
    kv_tokens: int = 0
    hbm_bytes: int | None = None
    violations: list[Violation] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)

    @property
    def totals(self) -> list[int]:
        return [r.total for r in self.ranks]

    @property
    def min(self) -> int:
        return min(self.totals)

    @property
    def max(self) -> int:
        return max(self.totals)

    @property
    def mean(self) -> float:
        return sum(self.totals) / len(self.ranks)

    @property
    def heaviest(self) -> RankUsage:
        return max(self.ranks, key=lambda r: (r.total, -r.rank))

    @property
    def over_budget(self) -> list[int]:
        return [] if self.hbm_bytes is None else [r.rank for r in self.ranks if r.total > self.hbm_bytes]

    def render(self) -> str:
        L = self.layout
        lines = [f"memory plan: {self.model_type}, scheme {self.scheme}, KV cache {self.kv_tokens} tokens",
                 f"layout: world {L.world_size} = tp {L.tp} x dp {L.dp} = moe_tp {L.moe_tp} x ep {L.ep}; "
                 f"dense_tp {L.dense_tp}, embed_tp {L.embed_tp}, lmhead_tp {L.lmhead_tp}, "
                 f"shared experts {L.shared_experts}",
                 f"model (every tensor and expert once): {size(sum(self.model_bytes.values()))}", "",
                 f"{'per rank':<16}{'min':>12}{'max':>12}{'mean':>12}"]
        rows = [(c, [r.weights.get(c, 0) for r in self.ranks]) for c in CATEGORIES]
        rows = [(c, v) for c, v in rows if max(v)] + [("weights", [r.weight_bytes for r in self.ranks]),
                                                     ("kv_cache", [r.kv_cache for r in self.ranks]),
                                                     ("total", self.totals)]
        for name, v in rows:
            lines.append(f"{name:<16}{size(min(v)):>12}{size(max(v)):>12}{size(sum(v) / len(v)):>12}")
        h = self.heaviest
        heavy = [r.rank for r in self.ranks if r.total == h.total]
        lines += ["", f"heaviest rank: {h.rank} (ep_rank {h.ep_rank}): {size(h.total)}"
                  + (f"; {len(heavy)} ranks at that size: {_ranges(heavy)}" if len(heavy) > 1 else "")]
        if self.hbm_bytes is not None:
            over = self.over_budget
            lines.append(f"HBM budget {size(self.hbm_bytes)}: " + (
                f"{len(over)} of {len(self.ranks)} ranks exceed it: {_ranges(over)}" if over else
                f"every rank fits (least headroom {size(self.hbm_bytes - self.max)})"))
        lines += ["", "assumptions:"] + [f"  - {a}" for a in self.assumptions]
        layout_bad = [v for v in self.violations if v.axis != "group"]
        group_bad = [v for v in self.violations if v.axis == "group"]
        if layout_bad:
            lines += ["", layout_violations(layout_bad)]
        if group_bad:
            lines += ["", "quantization violations (cvt quantize refuses this group size):"] + [
                f"  - {v}" for v in group_bad]
        return "\n".join(lines)


def layout_violations(problems) -> str:
    """The plan's list of what makes `cvt shard` refuse a layout (also printed alone for degrees
    that make no layout at all: `cvt.convert.placement.LayoutError`)."""
    return "\n".join(["layout violations (cvt shard refuses this layout):"] + [f"  - {p}" for p in problems])


def _scheme_assumption(scheme: str, sch, disk: DiskBytes | None) -> str:
    if disk is None:
        return {"bf16": "bf16: 2 bytes per element (e_score_correction_bias float32)",
                "fp8": "fp8: attention, dense MLP and expert linears 1 byte/element + float32 128x128 block scales; "
                       "embeddings, heads, norms, router, eh_proj bf16"}[scheme]
    return (f"{scheme}" + (f" group {sch.group_size}" if getattr(sch, "group_size", 0) else "")
            + (f" ({sch.fp4_format})" if getattr(sch, "fp4_format", None) else "")
            + f": linears not float by default as cvt quantize --format {disk.fmt} --target {disk.target} writes "
            "them (its layout table)"
            + (f"; {disk.target} loads this kernel format for MoE experts only, so the other linears stay bf16"
               if disk.float_reason else "") + "; the rest bf16")


def read_config(model: str | Path, revision: str | None = None) -> tuple[Path, dict]:
    """(where MODEL is, its config.json): MODEL is a checkpoint directory, the config.json file
    itself, or a hub repo id, of which only config.json and a cvt manifest are fetched (`resolve`:
    HF_HUB_OFFLINE=1 reads the local cache alone; `revision`: a branch, tag or commit)."""
    from cvt.convert.source import CONFIG_PATTERNS, resolve

    path = Path(model).expanduser()
    if path.is_file():
        if revision:
            raise CvtError(f"{model}: --revision applies to hub repo ids, not local files")
        return path, load_json(path)
    where = resolve(model, revision, patterns=CONFIG_PATTERNS).path
    if not (where / "config.json").is_file():
        raise CvtError(f"{model}: no config.json (give a checkpoint directory, a config.json file or a hub repo id)")
    return where, load_json(where / "config.json")


def memory_plan(config: Mapping[str, Any], layout: Layout, scheme: str = "bf16", group_size: int | None = None,
                kv_tokens: int = 0, hbm_bytes: int | str | None = None, fmt: str | None = None,
                target: str | None = None, fp4_format: str | None = None) -> Plan:
    """Per-rank bytes of `layout` for this config under `scheme` (module docstring), no weights
    read; a quantized scheme's linears as `cvt quantize --format fmt --target target` writes
    them (`DiskBytes`)."""
    if scheme not in plan_schemes():
        raise CvtError(f"unknown scheme {scheme!r} for the memory plan (known: {', '.join(plan_schemes())})")
    if not isinstance(kv_tokens, int) or kv_tokens < 0:
        raise CvtError(f"kv_tokens must be a non-negative integer, got {kv_tokens!r}")
    if scheme in ("bf16", "fp8") and (fmt or target or fp4_format):
        raise CvtError(f"--format, --target and --fp4-format describe quantized weights, not {scheme}")
    arch = arch_for(config)
    problems = config_problems(config)  # what the writers and the runtime refuse, the plan refuses
    if problems:
        raise CvtError(f"{problems[0]}; plan refused")
    sch, disk = _weights_format(arch.config, scheme, group_size, fmt, target, fp4_format)
    block = (fp8_block(config, "config.json") or (128, 128)) if scheme == "fp8" else None
    items = list(tensors(config, layout.shared_experts))
    w = _weight_bytes(items, layout, sch, block, disk)
    kv = kv_cache_bytes(arch, layout, sch, disk, kv_tokens)
    if kv.scale_bytes is not None:  # an int8 cache's scale tensors, replicated
        w.per_rank["kv_scales"] = w.model["kv_scales"] = kv.scale_bytes
    layers = moe_layers(config)
    ep_bytes, assumptions = _expert_bytes(arch, layers, layout, w.experts)
    ranks = []
    for rank in range(layout.world_size):
        ep_rank = (rank // layout.moe_tp) % layout.ep
        usage = {c: b for c, b in w.per_rank.items() if b}
        if layers:
            usage["experts"] = ep_bytes[ep_rank]
        ranks.append(RankUsage(rank, ep_rank, usage, kv.per_rank))
    assumptions += [
        "bytes are weights + KV cache only (no activations, workspace, communication buffers or allocator slack)",
        f"shared experts: {'split moe_tp ways' if layout.shared_experts == 'moe_tp' else 'whole on every rank'}; "
        "norms, router, q_a/kv_a projections and eh_proj replicated",
        _scheme_assumption(scheme, sch, disk), kv.assumption]
    group_bad = _group_problems(w.fits, sch, assumptions)
    return Plan(arch.model_type, scheme, layout, ranks, w.model, kv_tokens,
                None if hbm_bytes is None else parse_bytes(hbm_bytes),
                validate(layout, config, scheme, sch.group_size if format_group(disk, scheme) else group_size,
                         items) + group_bad + list(w.unwritable.values()), assumptions)


def _weights_format(cfg: Mapping[str, Any], scheme: str, group_size: int | None, fmt: str | None,
                    target: str | None, fp4_format: str | None):
    """(scheme object, `DiskBytes`) of a quantized plan scheme, (None, None) for bf16 / fp8; what
    cvt quantize refuses of an int8 KV cache for this model and format, the plan refuses."""
    if scheme in ("bf16", "fp8"):
        return None, None
    sch, disk = DiskBytes.resolve(scheme, group_size, fmt, target, fp4_format)
    if getattr(sch, "kv_cache", None) == "int8":
        from cvt.qtensor import indexer_c8
        from cvt.qtensor.kv_tensors import kv_target_problem

        why = (indexer_c8.problem(cfg) if indexer_c8.applies(cfg, disk.fmt)
               else kv_target_problem(cfg, disk.fmt, disk.target))
        if why is not None:
            raise FormatError(why)
    return sch, disk


@dataclass
class _Weights:
    """What the weights take: per rank by category (routed experts apart, per layer and expert id),
    every tensor once, the group rule's answers (`_group_fit`) and the tensors the scheme's layout
    cannot hold (counted as bf16)."""

    per_rank: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    model: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    experts: dict[int, dict[int, int]] = field(default_factory=dict)
    fits: dict[tuple, list] = field(default_factory=dict)  # (pattern, shape) -> [answer, first module, count]
    unwritable: dict[str, Violation] = field(default_factory=dict)


def _weight_bytes(items: list, layout: Layout, sch, block, disk: DiskBytes | None) -> _Weights:
    """Every tensor's bytes, whole and as the layout splits it (one computation per pattern, param,
    shape and degree)."""
    w = _Weights()
    memo: dict[tuple, int] = {}
    for name, shape, kind, nums in items:
        deg = getattr(layout, kind.axis) if kind.axis else 1
        key = (kind.info.rule.pattern, kind.info.param, shape, deg)
        fit = _group_fit(w.fits, disk, name, shape, kind)
        if key not in memo:
            module = name.rsplit(".", 1)[0]
            channel = isinstance(fit, str)
            try:
                memo[key[:3] + (0,)] = _tensor_bytes(kind, shape, None, 1, sch, block, disk, module, channel)
                memo[key] = _tensor_bytes(kind, shape, kind.info.split_dim, deg, sch, block, disk, module, channel)
            except ShapeError as exc:  # quantize would refuse this tensor (or its shard): a problem of the plan
                w.unwritable.setdefault(str(exc), Violation(name, kind.axis or "-", deg, shape[0], reason=str(exc)))
                memo[key] = memo[key[:3] + (0,)] = _tensor_bytes(kind, shape, kind.info.split_dim, deg, None, block)
        w.model[kind.category] += memo[key[:3] + (0,)]
        if kind.info.role is Role.EXPERT:
            layer = w.experts.setdefault(nums[0], {})
            # a layer's experts fused along dim 0 (gpt-oss) count as shape[0] experts of equal share
            for e, share in ([(nums[1], memo[key])] if len(nums) > 1 else
                             ((e, memo[key] // shape[0]) for e in range(shape[0]))):
                layer[e] = layer.get(e, 0) + share
        else:
            w.per_rank[kind.category] += memo[key]
    return w


def _group_fit(fits: dict[tuple, list], disk: DiskBytes | None, name: str, shape: tuple, kind: Kind):
    """quantize's group rule for a whole quantized linear (`DiskBytes.group_fit`), asked once per
    pattern and shape and counted in `fits`: None (the groups fit), the reason of a per-channel
    fallback, or the FormatError refusing it; None for any other tensor."""
    if disk is None or not kind.quantized or len(shape) != 2:
        return None
    fkey = (kind.info.rule.pattern, shape)
    if fkey not in fits:
        module = name.rsplit(".", 1)[0]
        try:
            answer = disk.group_fit(module, shape, kind.info.role is Role.EXPERT)
        except FormatError as exc:
            answer = exc
        fits[fkey] = [answer, module, 0]
    fits[fkey][2] += 1
    return fits[fkey][0]


def _group_problems(fits: dict[tuple, list], sch, assumptions: list[str]) -> list[Violation]:
    """The group rule's refusals as violations; its fallbacks added to `assumptions`."""
    group_bad = []
    for (answer, module, count) in fits.values():
        more = f" (and {count - 1} more linears like it)" if count > 1 else ""
        if isinstance(answer, FormatError):
            group_bad.append(Violation(module, "group", sch.group_size, 0, reason=f"{answer}{more}"))
        elif answer is not None:
            assumptions.append(f"{module}: {answer}, as cvt quantize writes it{more}")
    return group_bad


def _expert_bytes(arch, layers: list[int], layout: Layout, experts: dict[int, dict[int, int]]):
    """(bytes of routed experts per EP rank, assumptions): each MoE layer's experts as the placement
    puts them (contiguous by default; a count ep does not divide: ceil per rank, fewer on the last)."""
    E = arch.num_experts
    ep_bytes = [0] * layout.ep
    assumptions = []
    placement = layout.placement
    if layers and placement is None:
        if E % layout.ep == 0:
            placement = contiguous_placement(E, layout.ep)
        else:
            s = -(-E // layout.ep)
            fallback = [list(range(E))[r * s:(r + 1) * s] for r in range(layout.ep)]
            placement = Placement.model_construct(num_experts=E, ep=layout.ep, source="fallback", layers=[],
                                                  default=fallback)
            assumptions.append(f"{E} experts do not divide over ep {layout.ep}: counted {s} per rank, fewer on "
                               "the last")
    for layer in layers:
        per_e = experts.get(layer, {})
        sizes = set(per_e.values())
        for r, ids in enumerate(placement.for_layer(layer)):
            ep_bytes[r] += len(ids) * next(iter(sizes)) if len(sizes) == 1 else sum(per_e.get(e, 0) for e in ids)
    return ep_bytes, assumptions
