"""The parallel layout of a sharded checkpoint: degrees, the rank rule, expert placement.

One world of W ranks is factorized twice (DESIGN.md "Parallel layout"): attention
``tp x dp = W`` and MoE ``moe_tp x ep = W``; dense MLP, embedding (vocab-parallel) and
lm_head (column-parallel) have their own TP degrees, each dividing W. The rank -> group
coordinates rule is data (`rank_rule`): for every axis, ``coord = (rank // stride) % size``.
cvt writes TP-like axes with stride 1 (contiguous groups: ranks 0..tp-1 form TP group 0)
and the complementary axes (dp, ep) with stride tp / moe_tp (strided groups: an EP group
holds one rank of every MoE-TP group). A reader computes coordinates from the rule alone.

Expert placement is per MoE layer: ``ranks[ep_rank]`` lists the global expert ids held by
that EP rank, in slot order; a logical expert on several ranks is a redundant expert.
``default`` applies to every MoE layer not listed in ``layers``.

`cvt.convert.placement` builds, checks, reads and writes these; this module only declares them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LAYOUT_VERSION = 1
AXES = ("tp", "dp", "moe_tp", "ep", "dense_tp", "embed_tp", "lmhead_tp")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AxisRule(_Strict):
    """One axis of the rank rule: ``coord = (rank // stride) % size``."""

    axis: Literal["tp", "dp", "moe_tp", "ep", "dense_tp", "embed_tp", "lmhead_tp"]
    size: int = Field(ge=1, description="the axis' degree")
    stride: int = Field(ge=1, description="rank distance between neighbours along this axis")
    formula: str = Field(description="the rule in words, e.g. '(rank // 8) % 16'")


class LayerPlacement(_Strict):
    layer: int = Field(ge=0, description="decoder layer index (model.layers.{layer})")
    ranks: list[list[int]] = Field(description="per EP rank: global expert ids in slot order")


class Placement(_Strict):
    """Routed-expert placement over the EP ranks (EP rank = world rank when moe_tp is 1)."""

    num_experts: int = Field(ge=1, description="logical (routed) experts per MoE layer")
    ep: int = Field(ge=1)
    source: str = Field("contiguous", description="contiguous, redundant, mindie-json, eplb-phy2log")
    default: list[list[int]] = Field(description="per EP rank: expert ids, for MoE layers not in `layers`")
    layers: list[LayerPlacement] = Field(default_factory=list, description="per-layer placements")

    @model_validator(mode="after")
    def _shape(self):
        for where, ranks in [("default", self.default)] + [(f"layer {p.layer}", p.ranks) for p in self.layers]:
            if len(ranks) != self.ep:
                raise ValueError(f"placement {where} lists {len(ranks)} EP ranks, but ep is {self.ep}")
            for r, ids in enumerate(ranks):
                bad = [e for e in ids if not 0 <= e < self.num_experts]
                if bad:
                    raise ValueError(f"placement {where}, EP rank {r}: expert id {bad[0]} is outside "
                                     f"0..{self.num_experts - 1}")
        seen = [p.layer for p in self.layers]
        if len(seen) != len(set(seen)):
            raise ValueError("placement lists a layer twice")
        return self

    def for_layer(self, layer: int) -> list[list[int]]:
        for p in self.layers:
            if p.layer == layer:
                return p.ranks
        return self.default


class Layout(_Strict):
    """Degrees of every parallel axis, the rank rule, and the routed-expert placement."""

    layout_version: Literal[1] = LAYOUT_VERSION
    world_size: int = Field(ge=1)
    tp: int = Field(ge=1, description="attention tensor parallel (heads split); tp x dp = world_size")
    dp: int = Field(ge=1, description="attention data parallel (sequences split)")
    moe_tp: int = Field(ge=1, description="tensor parallel inside an expert; moe_tp x ep = world_size")
    ep: int = Field(ge=1, description="expert parallel: routed experts are spread over ep ranks")
    dense_tp: int = Field(ge=1, description="TP of the dense MLP layers (first_k_dense_replace)")
    embed_tp: int = Field(ge=1, description="vocab-parallel embedding degree")
    lmhead_tp: int = Field(ge=1, description="column-parallel lm_head degree")
    shared_experts: Literal["moe_tp", "replicated"] = Field(
        "moe_tp", description="shared experts split like a routed expert (moe_tp) or held whole on every rank")
    rank_rule: list[AxisRule] = Field(description="rank -> coordinate per axis")
    placement: Placement | None = Field(None, description="null: contiguous (expert e on EP rank e // (E / ep))")

    @model_validator(mode="after")
    def _factorization(self):
        w = self.world_size
        if self.tp * self.dp != w:
            raise ValueError(f"tp {self.tp} x dp {self.dp} must equal world_size {w}")
        if self.moe_tp * self.ep != w:
            raise ValueError(f"moe_tp {self.moe_tp} x ep {self.ep} must equal world_size {w}")
        for axis in ("dense_tp", "embed_tp", "lmhead_tp"):
            if w % getattr(self, axis):
                raise ValueError(f"{axis} {getattr(self, axis)} must divide world_size {w}")
        axes = {r.axis: r for r in self.rank_rule}
        if sorted(axes) != sorted(AXES) or len(self.rank_rule) != len(AXES):
            raise ValueError(f"rank_rule must give each axis once: {', '.join(AXES)}")
        for name, r in axes.items():
            if r.size != getattr(self, name):
                raise ValueError(f"rank_rule axis {name} has size {r.size}, but {name} is {getattr(self, name)}")
        if self.placement is not None and self.placement.ep != self.ep:
            raise ValueError(f"placement is for ep {self.placement.ep}, but ep is {self.ep}")
        return self
