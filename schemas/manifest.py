"""`cvt_manifest.json`: what a cvt output directory is, and the contract later stages trust.

Typed with pydantic (`extra="forbid"` everywhere, so a misspelt or unknown key is an
error), versioned by `manifest_version`, and exported as JSON Schema to
`schemas/manifest.schema.json` (`python -m cvt.schemas` regenerates it; a test checks
that the file matches the models). Deterministic content (no timestamps), so a resumed
run writes the same bytes as an uninterrupted one.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from cvt.schemas.parallel_layout import Layout

MANIFEST_VERSION = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolInfo(_Strict):
    name: Literal["cvt"] = "cvt"
    version: str


class SourceInfo(_Strict):
    """The checkpoint a stage read: a local path or a hub id at a commit, plus content hashes."""

    kind: Literal["local", "hub"]
    path: str | None = Field(None, description="absolute path of a local source")
    repo_id: str | None = Field(None, description="hub repo id of a hub source")
    revision: str | None = Field(None, description="commit hash the hub id resolved to")
    config_sha256: str | None = Field(None, description="sha256 of the source config.json")
    index_sha256: str | None = Field(None, description="sha256 of the source safetensors index (null: single file)")
    format: str = Field(description="source format, e.g. fp8-block, bf16, compressed-tensors-int4, cvt-artifact")

    @model_validator(mode="after")
    def _identity(self):
        if self.kind == "local" and not self.path:
            raise ValueError("a local source needs its path")
        if self.kind == "hub" and not self.repo_id:
            raise ValueError("a hub source needs its repo_id")
        return self


class StageInfo(_Strict):
    """One stage applied to produce this directory, with the parameters that change its output."""

    name: str = Field(description="the verb, e.g. fp8-to-bf16")
    tool_version: str
    parameters: dict[str, Any] = Field(default_factory=dict)


_HEX256 = r"^[0-9a-f]{64}$"


class FileInfo(_Strict):
    """One file of the directory: its size and one checksum of its bytes, under the algorithm's
    name (`cvt.convert.checksum`): ``blake3`` (what cvt writes), ``sha256`` (older manifests, still
    verified). Exactly one is present; an absent one is not written."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "oneOf": [{"required": ["blake3"]}, {"required": ["sha256"]}]})

    path: str = Field(description="path relative to the manifest's directory")
    size: int = Field(ge=0)
    blake3: str | None = Field(None, pattern=_HEX256, description="BLAKE3 (256-bit) of the file's bytes")
    sha256: str | None = Field(None, pattern=_HEX256, description="sha256 of the file's bytes (older manifests)")
    tensors: int = Field(0, ge=0, description="tensors in the file (0 for non-weight files)")

    @model_validator(mode="after")
    def _one_checksum(self):
        if (self.blake3 is None) == (self.sha256 is None):
            raise ValueError("a file needs exactly one checksum: blake3 or sha256")
        return self

    @model_serializer(mode="wrap")
    def _drop_absent_checksum(self, handler):
        out = handler(self)
        for key in ("blake3", "sha256"):
            if out.get(key, "") is None:
                del out[key]
        return out


class Summary(_Strict):
    """Counts a stage reports, e.g. tensors dequantized / passed through / dropped."""

    counts: dict[str, int] = Field(default_factory=dict)


RTN_FALLBACK = "rtn-fallback"  # a tensor's `method` when the method asked for fell back to RTN (`Fallback`)


class QuantTensorInfo(_Strict):
    """One quantized linear: how it was quantized and how close it stayed to its source."""

    scheme: str
    kernel_fmt: str = Field(description="the runtime kernel format, e.g. w8a8_dynamic, w4a16, nvfp4")
    layout: str | None = Field(None, description="the on-disk layout (cvt.qtensor.layouts), e.g. ascend-w4a16-int32")
    method: str = Field(description="rtn, smoothquant, gptq, awq, flatquant, or rtn-fallback")
    group_size: int = Field(ge=0, description="0: per output channel")
    symmetric: bool = True
    sqnr_db: float | str = Field(description="20 log10(|w| / |w - dequant(q)|); 'Infinity' when exact")


class Fallback(_Strict):
    """A module that could not be quantized as asked: it could not use the requested method (e.g.
    an expert with too few calibration tokens) and was quantized with RTN instead, or its
    in_features are not a multiple of the group size and it was quantized per channel."""

    module: str
    method: str
    reason: str
    tokens: int | None = None


class MixedUnit(_Strict):
    """One unit of `cvt quantize --kl-budget` (a decoder layer's attention, MLP or routed experts)."""

    unit: str = Field(description="e.g. model.layers.1.mlp.experts")
    linears: int = Field(ge=0)
    low_bytes: int = Field(ge=0, description="its output bytes at --scheme")
    high_bytes: int = Field(ge=0, description="its output bytes at the high precision")
    error_low: float = Field(description="sum (y - y_float)^2 / sum y_float^2 of its decoder layer's output on the "
                                         "calibration tokens, float inputs, only this unit at --scheme (RTN)")
    error_high: float = Field(description="the same with this unit at the high precision")
    rank: int = Field(ge=1, description="its place in the greedy order: error removed per extra high byte, largest "
                                        "first")
    kept_high: bool


class MixedTrial(_Strict):
    """One measured configuration: the first `kept_units` units of the greedy order kept high."""

    kept_units: int = Field(ge=0)
    high_bytes: int = Field(ge=0)
    kl_mean: float = Field(description="mean KL(float || output) on the calibration tokens, runtime kernels (RTN)")


class MixedPrecision(_Strict):
    """`cvt quantize --kl-budget`: the budget, what was measured and what was kept high
    (`cvt.quant.stage.kl_budget`)."""

    kl_budget: float = Field(ge=0)
    high: str = Field(description="the precision kept units get: a scheme name, or float")
    tokens: int = Field(ge=0, description="calibration tokens measured on")
    kl_mean: float = Field(description="the chosen configuration's measured mean KL")
    high_bytes: int = Field(ge=0, description="bytes of the units kept high")
    quantized_bytes: int = Field(ge=0, description="bytes of all the units in the chosen configuration")
    units: list[MixedUnit] = Field(default_factory=list)
    trials: list[MixedTrial] = Field(default_factory=list)


class QuantInfo(_Strict):
    scheme: str = Field(description="the stage's --scheme")
    format: Literal["ascend", "compressed-tensors"]
    target: str | None = Field(None, description="serving stack the layouts are for: vllm-ascend or mindie "
                                                 "(ascend), vllm (compressed-tensors)")
    target_version: str | None = Field(None, description="vllm-ascend release line the output is for "
                                                         "(0.23, 0.24, 0.25, main; ascend + vllm-ascend only)")
    method: str
    group_size: int | None = None
    symmetric: bool = True
    fp4_format: str | None = None
    kv_cache: dict[str, Any] | None = Field(None, description="int8 KV cache convention and scale tensor names (w8a8c8)")
    tensors: dict[str, QuantTensorInfo] = Field(default_factory=dict, description="by module name")
    float_modules: dict[str, str] = Field(default_factory=dict, description="module -> why it stayed float")
    fallbacks: list[Fallback] = Field(default_factory=list)
    calibration: dict[str, Any] | None = Field(None, description="calibrated runs: tokens, layers, device, mean "
                                                                  "seconds per layer, peak RSS, layers resumed; --method flatquant: "
                                                                  "its fit's settings and mean site loss")
    mixed_precision: MixedPrecision | None = Field(None, description="--kl-budget: the units kept at a higher "
                                                                      "precision and why (absent without it)")

    @model_serializer(mode="wrap")
    def _drop_absent_mixed(self, handler):
        out = handler(self)
        if out.get("mixed_precision", "") is None:  # a run without --kl-budget writes the bytes it always did
            del out["mixed_precision"]
        return out


class TensorShard(_Strict):
    """How one source tensor is spread over the ranks of a sharded checkpoint.

    ``dim`` None: every holder has the whole tensor. Otherwise holder with coordinate ``i``
    along ``axis`` has ``narrow(dim, i * shape[dim] / degree, shape[dim] / degree)``; where
    ``parts`` is set (consecutive parts along ``dim``, e.g. a Gated DeltaNet's q | k | v rows),
    that run of each part, concatenated in order; where ``diagonal`` is set (a square tensor: a
    W4A4_MXFP4_FLATQUANT row layer's ``left_trans``), that run along dims 0 and 1, its diagonal
    block (the source is block-diagonal: the blocks put back on the diagonal give it exactly).
    Holders: every rank, except routed-expert tensors (``expert`` set), held only by the
    ranks whose EP rank places that expert (see the rank entries' ``experts``)."""

    shape: list[int]
    dtype: str
    axis: str | None = Field(None, description="layout axis the tensor is split along (null: whole on holders)")
    dim: int | None = Field(None, description="split dim (null: not split)")
    degree: int = Field(1, ge=1)
    expert: list[int] | None = Field(None, description="[layer, global expert id] of a routed-expert tensor")
    parts: list[int] | None = Field(None, description="sizes of the consecutive parts along dim, each split "
                                                      "over degree on its own (absent: one part)")
    diagonal: bool = Field(False, description="holder i has diagonal block i (the run along dims 0 and 1) of a "
                                              "block-diagonal square tensor (absent: false)")

    @model_serializer(mode="wrap")
    def _drop_one_part(self, handler):
        out = handler(self)
        if out.get("parts", "") is None:  # a tensor of one part writes the bytes it always did
            del out["parts"]
        if out.get("diagonal") is False:  # likewise a tensor split in runs of one dim
            del out["diagonal"]
        return out


class RankShard(_Strict):
    rank: int = Field(ge=0)
    dir: str = Field(description="the rank's directory, relative to the manifest")
    coords: dict[str, int] = Field(description="coordinate along every layout axis")
    files: list[str] = Field(description="the rank's weight files (paths relative to the manifest)")
    tensors: int = Field(ge=0)
    bytes: int = Field(ge=0, description="tensor bytes the rank holds")
    experts: dict[str, list[int]] = Field(
        default_factory=dict, description="MoE layer -> global expert id held in each local slot")


class ShardInfo(_Strict):
    layout: Layout
    tensors: dict[str, TensorShard] = Field(description="every source tensor, by name")
    ranks: list[RankShard]


class Manifest(_Strict):
    manifest_version: Literal[1] = MANIFEST_VERSION
    tool: ToolInfo
    source: SourceInfo
    stages: list[StageInfo] = Field(description="every stage from the original release to this directory, in order")
    format: str = Field(description="what this directory holds, e.g. hf-bf16")
    plan_id: str = Field(description="hash of source identity + stage parameters; resume only continues the same plan")
    tensor_count: int = Field(ge=0)
    total_size: int = Field(ge=0, description="bytes of tensor data (the index's metadata.total_size)")
    files: list[FileInfo] = Field(description="weight files, then index, config and copied files")
    summary: Summary = Field(default_factory=Summary)
    carried: list[str] = Field(default_factory=list, description=(
        "tensors of a wrapper's other towers (Kimi-K2.5's vision tower and projector): float, copied byte for "
        "byte by every stage, replicated on every rank, not run by cvt's text-only runtime"))
    quant: QuantInfo | None = Field(None, description="present when the directory holds quantized weights")
    shard: ShardInfo | None = Field(None, description="present in a per-rank sharded directory (cvt shard)")
