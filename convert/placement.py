"""Parallel layouts: degrees and defaults, the rank -> group rule, expert placement and its files.

A `Layout` (typed in `cvt.schemas.parallel_layout`) factorizes one world of W ranks twice: attention
``tp x dp = W`` and MoE ``moe_tp x ep = W``, plus dense-MLP, embedding and lm_head TP
degrees that divide W. `make_layout` fills the defaults:

=========  ==========================================================================
degree     default
=========  ==========================================================================
world      ``world_size``, else ``ep x moe_tp``, else ``tp``  (``--ep 64`` alone: W = 64)
tp         1: attention data parallel, as DeepSeek-V3 / Kimi-K2 are deployed at EP 64+
moe_tp     1
ep         W / moe_tp
dense_tp   tp (the dense MLP follows attention)
embed_tp   tp
lmhead_tp  tp
=========  ==========================================================================

Rank rule (written into the layout, so a manifest carries it): ``coord = (rank // stride)
% size`` with tp, moe_tp, dense_tp, embed_tp, lmhead_tp at stride 1 (contiguous groups),
dp at stride tp and ep at stride moe_tp (strided groups). Example W = 8, moe_tp 2, ep 4:
MoE-TP groups {0,1} {2,3} {4,5} {6,7}; EP groups {0,2,4,6} {1,3,5,7}; rank 5 is ep_rank 2.

Placement: routed experts keep global ids; EP rank r holds ``placement.for_layer(L)[r]``.
Default: contiguous, expert e on EP rank ``e // (E / ep)``; ``redundant=R`` adds R physical
slots holding copies (physical list ``0..E-1, 0..R-1`` cut into ep equal runs). Files:

* MindIE / vllm-ascend JSON ``{"moe_layer_count": L, "layer_list": [{"layer_id", "device_count",
  "device_list": [{"device_id", "device_expert": [ids]}]}]}``. ``layer_id`` is read as the
  index among the model's MoE layers in order (MTP last) when the ids are 0..L-1, else as
  the decoder layer index; cvt writes the MoE-layer index. ``device_id`` is the EP rank.
* DeepSeek EPLB ``phy2log [L, R]``: physical slot r lives on EP rank ``r // (R / ep)``
  (JSON: a bare 2-D list or ``{"phy2log": ...}``); `eplb_maps` adds ``log2phy`` / ``logcnt``.
MoE layers a file does not list (e.g. the MTP layer) keep the contiguous default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from cvt.convert.arch import ArchSpec, Role, arch_for
from cvt.errors import CvtError, validation_summary
from cvt.schemas.parallel_layout import AXES, AxisRule, LayerPlacement, Layout, Placement

__all__ = ["Layout", "LayoutError", "Placement", "RankCoords", "make_layout", "coords", "group", "divisors",
           "contiguous_placement", "log2phy", "moe_layers", "placement_problems",
           "placement_from_mindie", "placement_to_mindie", "placement_from_phy2log",
           "placement_to_phy2log", "eplb_maps", "read_placement", "placement_json", "write_placement"]


MAX_WORLD = 1 << 16
"""Largest world cvt plans or shards for: far above any cluster, small enough that per-rank
work stays bounded (a mistyped --ep 1000000000 is refused before anything is allocated)."""


def divisors(n: int) -> list[int]:
    """Every divisor of n, ascending (O(sqrt n))."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


class LayoutError(CvtError):
    """Degrees that make no layout: each broken rule one line of `problems` (a degree that does not
    divide the world size, moe_tp x ep != W). `cvt plan` and `shard --dry-run` list them as the
    layout's violations (exit 3); a verb that would write refuses the layout (exit 1)."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = list(problems)


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CvtError(f"{name} must be a positive integer, got {value!r}")
    return value


def _degree(name: str, value: Any, world: int, problems: list[str]) -> int | None:
    """`value` when it divides `world`; else None, with the problem said in `problems`."""
    if world % _positive(name, value):
        problems.append(f"{name} {value} does not divide the world size {world} "
                        f"(valid {name}: {', '.join(map(str, divisors(world)))})")
        return None
    return value


def _rank_rule(deg: Mapping[str, int]) -> list[AxisRule]:
    strides = {"tp": 1, "dp": deg["tp"], "moe_tp": 1, "ep": deg["moe_tp"], "dense_tp": 1, "embed_tp": 1,
               "lmhead_tp": 1}
    return [AxisRule(axis=a, size=deg[a], stride=strides[a], formula=f"(rank // {strides[a]}) % {deg[a]}")
            for a in AXES]


def make_layout(world_size: int | None = None, tp: int | None = None, ep: int | None = None,
                moe_tp: int | None = None, dense_tp: int | None = None, embed_tp: int | None = None,
                lmhead_tp: int | None = None, shared_experts: str = "moe_tp",
                placement: Placement | None = None) -> Layout:
    """A layout from the CLI's degrees (None = default, see the module table); `LayoutError`
    naming every degree that breaks the factorization, with its valid values (CvtError for a
    degree that is no positive integer, or a world too large)."""
    m = 1 if moe_tp is None else _positive("moe_tp", moe_tp)
    if world_size is None:
        world_size = _positive("ep", ep) * m if ep is not None else (tp or 1)
    if isinstance(world_size, int) and world_size > MAX_WORLD:
        raise CvtError(f"a world of {world_size} ranks (--world-size, or ep x moe-tp) is more than cvt plans for "
                       f"({MAX_WORLD}); check the degrees")
    w, problems = _positive("world size", world_size), []
    m = _degree("moe_tp", m, w, problems)
    t = _degree("tp", 1 if tp is None else tp, w, problems)
    e = _degree("ep", ep if ep is not None else (w // m if m else None), w, problems) if ep is not None or m else None
    if m and e and e * m != w:
        problems.append(f"moe_tp {m} x ep {e} = {m * e} must equal the world size {w} "
                        f"(with moe_tp {m}, ep must be {w // m})")
    # the TP degrees that default to tp: checked when given (tp's own problem is said once)
    rest = {n: _degree(n, t if v is None else v, w, problems) if v is not None or t else None
            for n, v in (("dense_tp", dense_tp), ("embed_tp", embed_tp), ("lmhead_tp", lmhead_tp))}
    if problems:
        raise LayoutError(problems)
    deg = {"tp": t, "dp": w // t, "moe_tp": m, "ep": e, **rest}
    if shared_experts not in ("moe_tp", "replicated"):
        raise CvtError(f"shared_experts must be 'moe_tp' or 'replicated', got {shared_experts!r}")
    if placement is not None and placement.ep != e:
        raise CvtError(f"the expert placement has {placement.ep} EP ranks, but ep is {e}")
    return Layout(world_size=w, shared_experts=shared_experts, rank_rule=_rank_rule(deg), placement=placement,
                  **deg)


@dataclass(frozen=True)
class RankCoords:
    rank: int
    tp_rank: int
    dp_rank: int
    moe_tp_rank: int
    ep_rank: int
    dense_tp_rank: int
    embed_tp_rank: int
    lmhead_tp_rank: int


def coords(layout: Layout, rank: int) -> RankCoords:
    """Every coordinate of `rank`, computed from the layout's rank rule alone."""
    if not 0 <= rank < layout.world_size:
        raise CvtError(f"rank {rank} is outside the world 0..{layout.world_size - 1}")
    c = {f"{r.axis}_rank": (rank // r.stride) % r.size for r in layout.rank_rule}
    return RankCoords(rank=rank, **c)


def group(layout: Layout, axis: str, rank: int) -> list[int]:
    """The ranks of `rank`'s group along `axis` (e.g. its TP group), in coordinate order."""
    rule = {r.axis: r for r in layout.rank_rule}.get(axis)
    if rule is None:
        raise CvtError(f"unknown parallel axis {axis!r} (known: {', '.join(AXES)})")
    base = rank - ((rank // rule.stride) % rule.size) * rule.stride
    return [base + i * rule.stride for i in range(rule.size)]


# ------------------------------------------------------------------------------ placement
def contiguous_placement(num_experts: int, ep: int, redundant: int = 0) -> Placement:
    """Experts 0..E-1 in order over ep ranks; `redundant` extra slots hold copies of 0..R-1."""
    phys = list(range(num_experts)) + [i % num_experts for i in range(redundant)]
    if redundant < 0 or len(phys) % ep:
        raise CvtError(f"{num_experts} experts + {redundant} redundant = {len(phys)} physical experts do not "
                       f"divide over ep {ep} ranks (ep must divide the physical count; valid ep: "
                       f"{', '.join(map(str, divisors(len(phys))))}; or add redundant experts)")
    s = len(phys) // ep
    ranks = [phys[r * s:(r + 1) * s] for r in range(ep)]
    for r, ids in enumerate(ranks):
        if len(set(ids)) != len(ids):
            raise CvtError(f"redundant={redundant}: EP rank {r} would hold a copy of an expert it already has "
                           f"({ids}); use fewer redundant experts or a placement file")
    return Placement(num_experts=num_experts, ep=ep, source="redundant" if redundant else "contiguous",
                     default=ranks)


def log2phy(ranks: list[list[int]]) -> dict[int, list[tuple[int, int]]]:
    """Logical expert -> [(ep_rank, slot), ...] for one layer's placement."""
    out: dict[int, list[tuple[int, int]]] = {}
    for r, ids in enumerate(ranks):
        for s, e in enumerate(ids):
            out.setdefault(e, []).append((r, s))
    return dict(sorted(out.items()))


def moe_layers(config: Mapping[str, Any]) -> list[int]:
    """Decoder layers holding routed experts (MTP layers included, last), from config alone."""
    arch = arch_for(config)
    key = arch.table.config_keys.get("experts")
    if not key or not arch.config.get(key):
        return []
    cfg = dict(arch.config)
    cfg[key] = 1  # one expert per layer is enough to see which layers have them
    one = ArchSpec(arch.table, cfg, arch.model_type)
    infos = (one.classify(n) for n in one.shapes())
    return sorted({i.layer for i in infos if i.role is Role.EXPERT and i.layer is not None})


def placement_problems(placement: Placement, layers: list[int]) -> list[str]:
    """What is wrong with a placement for these MoE layers (empty: usable)."""
    out = []
    extra = sorted({p.layer for p in placement.layers} - set(layers))
    if extra:
        out.append(f"placement lists layer {extra[0]}, which has no routed experts (MoE layers: "
                   f"{layers[0] if layers else '-'}..{layers[-1] if layers else '-'})")
    for layer in layers:
        ranks = placement.for_layer(layer)
        missing = sorted(set(range(placement.num_experts)) - {e for ids in ranks for e in ids})
        if missing:
            out.append(f"placement of layer {layer}: expert {missing[0]} is on no rank "
                       f"({len(missing)} of {placement.num_experts} experts missing)")
        for r, ids in enumerate(ranks):
            if len(set(ids)) != len(ids):
                out.append(f"placement of layer {layer}: EP rank {r} holds an expert twice ({ids})")
        counts = sorted({len(ids) for ids in ranks})
        if len(counts) > 1:
            phys = sum(len(ids) for ids in ranks)
            out.append(f"placement of layer {layer}: {phys} physical experts (with redundancy) are not "
                       f"a multiple of ep {placement.ep}: EP ranks hold {counts[0]}..{counts[-1]} experts")
    return out


def _layer_map(ids: list[int], layers: list[int], where: str) -> list[int]:
    if len(ids) > len(layers):
        raise CvtError(f"{where}: {len(ids)} MoE layers listed, but the model has {len(layers)}")
    if sorted(ids) == list(range(len(ids))):
        return [layers[i] for i in ids]
    bad = [i for i in ids if i not in layers]
    if bad:
        raise CvtError(f"{where}: layer_id {bad[0]} is neither a MoE-layer index 0..{len(layers) - 1} "
                       f"nor a MoE decoder layer ({layers[0]}..{layers[-1]})")
    return list(ids)


def _base(num_experts: int, ep: int) -> list[list[int]]:
    if num_experts % ep == 0:
        return contiguous_placement(num_experts, ep).default
    s = -(-num_experts // ep)  # files cover every layer they name; the default only needs to be shaped
    return [list(range(num_experts))[r * s:(r + 1) * s] for r in range(ep)]


def placement_from_mindie(obj: Mapping[str, Any], layers: list[int], num_experts: int,
                          where: str = "placement") -> Placement:
    try:
        entries = list(obj["layer_list"])
        count = int(obj.get("moe_layer_count", len(entries)))
        ids = [int(e["layer_id"]) for e in entries]
        ranks_per_layer = []
        for e in entries:
            devs = list(e["device_list"])
            if devs and all("device_id" in d for d in devs):
                devs.sort(key=lambda d: int(d["device_id"]))
                if [int(d["device_id"]) for d in devs] != list(range(len(devs))):
                    raise CvtError(f"{where}: layer_id {e['layer_id']}: device_id values must be the EP ranks "
                                   f"0..{len(devs) - 1}")
            if int(e.get("device_count", len(devs))) != len(devs):
                raise CvtError(f"{where}: layer_id {e['layer_id']} says device_count {e['device_count']} "
                               f"but lists {len(devs)} devices")
            ranks_per_layer.append([[int(x) for x in d["device_expert"]] for d in devs])
    except (KeyError, TypeError, ValueError) as exc:
        raise CvtError(f"{where}: not a MindIE/vllm-ascend expert map (needs moe_layer_count, layer_list[]."
                       f"layer_id/device_list[].device_expert): {exc!r}") from exc
    if count != len(entries):
        raise CvtError(f"{where}: moe_layer_count is {count} but layer_list has {len(entries)} entries")
    if not ranks_per_layer:
        raise CvtError(f"{where}: layer_list is empty")
    ep = len(ranks_per_layer[0])
    return _build(ranks_per_layer, _layer_map(ids, layers, where), num_experts, ep, "mindie-json", where)


def _build(ranks_per_layer, layer_ids, num_experts, ep, source, where) -> Placement:
    try:
        return Placement(num_experts=num_experts, ep=ep, source=source, default=_base(num_experts, ep),
                         layers=[LayerPlacement(layer=L, ranks=r) for L, r in zip(layer_ids, ranks_per_layer)])
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise CvtError(f"{where}: {validation_summary(exc)}") from None


def placement_to_mindie(placement: Placement, layers: list[int]) -> dict[str, Any]:
    return {"moe_layer_count": len(layers), "layer_list": [
        {"layer_id": i, "device_count": placement.ep,
         "device_list": [{"device_id": r, "device_expert": list(ids)}
                         for r, ids in enumerate(placement.for_layer(L))]}
        for i, L in enumerate(layers)]}


def placement_from_phy2log(phy2log: list[list[int]], layers: list[int], num_experts: int, ep: int,
                           where: str = "phy2log") -> Placement:
    if not (isinstance(phy2log, list) and phy2log and all(isinstance(row, list) for row in phy2log)):
        raise CvtError(f"{where}: phy2log must be a non-empty 2-D list [moe layers, physical experts]")
    width = {len(row) for row in phy2log}
    if len(width) != 1:
        raise CvtError(f"{where}: phy2log rows have different lengths {sorted(width)}")
    R = width.pop()
    if R % ep:
        raise CvtError(f"{where}: {R} physical experts per layer do not divide over ep {ep} ranks "
                       f"(slot r lives on rank r // (R / ep))")
    s = R // ep
    per_layer = [[[int(x) for x in row[r * s:(r + 1) * s]] for r in range(ep)] for row in phy2log]
    return _build(per_layer, _layer_map(list(range(len(phy2log))), layers, where), num_experts, ep,
                  "eplb-phy2log", where)


def placement_to_phy2log(placement: Placement, layers: list[int]) -> list[list[int]]:
    out = []
    for L in layers:
        ranks = placement.for_layer(L)
        if len({len(ids) for ids in ranks}) != 1:
            raise CvtError(f"layer {L}: EP ranks hold different numbers of experts; phy2log needs equal "
                           "slots per rank")
        out.append([e for ids in ranks for e in ids])
    return out


def eplb_maps(placement: Placement, layers: list[int]) -> dict[str, list]:
    """DeepSeek EPLB's three maps: phy2log [L, R], log2phy [L, E, maxcnt] (-1 padded), logcnt [L, E]."""
    phy = placement_to_phy2log(placement, layers)
    E = placement.num_experts
    l2p = [[[i for i, x in enumerate(row) if x == e] for e in range(E)] for row in phy]
    width = max((len(s) for layer in l2p for s in layer), default=1)
    return {"phy2log": phy, "log2phy": [[s + [-1] * (width - len(s)) for s in layer] for layer in l2p],
            "logcnt": [[len(s) for s in layer] for layer in l2p]}


def layout_for(config: Mapping[str, Any], world_size: int | None = None, tp: int | None = None,
               ep: int | None = None, moe_tp: int | None = None, dense_tp: int | None = None,
               embed_tp: int | None = None, lmhead_tp: int | None = None, *, placement: Path | str | None = None,
               redundant: int = 0, shared_experts: str = "moe_tp") -> Layout:
    """`make_layout`'s degrees for this model, with its expert placement: read from `placement`
    (MindIE / vllm-ascend JSON or an EPLB phy2log), or contiguous with `redundant` extra slots
    holding copies of experts 0..R-1, or contiguous."""
    degrees = (world_size, tp, ep, moe_tp, dense_tp, embed_tp, lmhead_tp)
    layout = make_layout(*degrees, shared_experts=shared_experts)
    if placement and redundant:
        raise CvtError("give either --placement or --redundant, not both")
    if placement:
        return make_layout(*degrees, shared_experts=shared_experts,
                           placement=read_placement(placement, config, layout.ep))
    if redundant:
        if not moe_layers(config):
            raise CvtError("--redundant: the model has no routed experts")
        return make_layout(*degrees, shared_experts=shared_experts,
                           placement=contiguous_placement(arch_for(config).num_experts, layout.ep, redundant))
    return layout


def read_placement(path: Path | str, config: Mapping[str, Any], ep: int) -> Placement:
    """A placement file (MindIE/vllm-ascend JSON or EPLB phy2log JSON), checked against the model."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CvtError(f"{path}: cannot read the placement file: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise CvtError(f"{path}: not JSON: {exc}") from exc
    arch = arch_for(config)
    E, layers = arch.num_experts, moe_layers(config)
    if not layers:
        raise CvtError(f"{path}: the model has no routed experts to place")
    if isinstance(obj, dict) and "layer_list" in obj:
        p = placement_from_mindie(obj, layers, E, str(path))
    elif isinstance(obj, dict) and "phy2log" in obj:
        p = placement_from_phy2log(obj["phy2log"], layers, E, ep, str(path))
        if "logcnt" in obj and obj["logcnt"] != eplb_maps(p, layers[:len(obj["phy2log"])])["logcnt"]:
            raise CvtError(f"{path}: logcnt disagrees with phy2log")
    elif isinstance(obj, list):
        p = placement_from_phy2log(obj, layers, E, ep, str(path))
    else:
        raise CvtError(f"{path}: unknown placement format (expected a MindIE/vllm-ascend map with "
                       "'layer_list', or DeepSeek EPLB 'phy2log')")
    if p.ep != ep:
        raise CvtError(f"{path}: the placement spreads experts over {p.ep} ranks, but ep is {ep}")
    problems = placement_problems(p, layers)
    if problems:
        raise CvtError(f"{path}: " + "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)"
                                                                  if len(problems) > 3 else ""))
    # every decoder MoE layer placed by the file (MTP layers may be left out, as EPLB maps do);
    # a layer left out would silently fall back to the contiguous default
    unplaced = sorted(set(L for L in layers if L < arch.num_layers) - {lp.layer for lp in p.layers})
    if unplaced:
        n = len([L for L in layers if L < arch.num_layers])
        raise CvtError(f"{path}: places {n - len(unplaced)} of the model's {n} MoE layers; layer {unplaced[0]} "
                       f"is missing (a placement file must place every MoE layer)")
    return p


# The expert-placement JSON flavours cvt writes, with the file `cvt shard` gives each: MindIE's /
# vllm-ascend's (named after the MindIE file format, not the serving target) and DeepSeek's EPLB maps.
PLACEMENT_FILES = {"mindie": ("expert_placement.json", placement_to_mindie),
                   "eplb": ("expert_placement_eplb.json", eplb_maps)}


def placement_json(placement: Placement, config: Mapping[str, Any], fmt: str = next(iter(PLACEMENT_FILES))) -> bytes:
    """`placement` as MindIE/vllm-ascend JSON (fmt 'mindie') or EPLB maps (fmt 'eplb'), UTF-8."""
    if fmt not in PLACEMENT_FILES:
        raise CvtError(f"unknown placement format {fmt!r} (known: {', '.join(PLACEMENT_FILES)})")
    obj: Any = PLACEMENT_FILES[fmt][1](placement, moe_layers(config))
    return (json.dumps(obj) + "\n").encode("utf-8")


def write_placement(placement: Placement, path: Path | str, config: Mapping[str, Any],
                    fmt: str = next(iter(PLACEMENT_FILES))) -> Path:
    """Write `placement` as MindIE/vllm-ascend JSON (fmt 'mindie') or EPLB maps (fmt 'eplb')."""
    path = Path(path)
    path.write_bytes(placement_json(placement, config, fmt))
    return path
