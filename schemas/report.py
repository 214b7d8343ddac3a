"""`report.json`: what `cvt verify` measured, candidate against reference, and whether it passed.

Typed with pydantic (`extra="forbid"`), versioned by `report_version`, exported as JSON Schema
to `schemas/report.schema.json` (`python -m cvt.schemas`). Metric names follow FORMATS.md
section 4: a per-layer row carries the six Ascend columns under their exact names
("Cosine", "MaxAbsErr", ...) as JSON keys, so `LayerRow(name=..., **compare_tensors(a, b))`
builds one. Python attribute names are snake_case (`row.cosine`).

Metrics can be infinite (SQNR of an exact weight, EucDist against a zero reference) or NaN;
the JSON stays strict: such values are written as the strings "Infinity", "-Infinity", "NaN"
(write with `model_dump_json(by_alias=True)`), and read back as floats.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator

from cvt.schemas.manifest import ToolInfo

REPORT_VERSION = 1

Metric = Annotated[
    float,
    WithJsonSchema({"anyOf": [{"type": "number"}, {"enum": ["Infinity", "-Infinity", "NaN"]}]}),
]
"""A float that may be +-inf or NaN, written to JSON as a number or one of those three strings."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, ser_json_inf_nan="strings")


class ModelRef(_Strict):
    """One side of the comparison: a cvt output (with its manifest) or a plain HF directory."""

    path: str = Field(description="the directory (or hub id) that was loaded")
    format: str | None = Field(None, description="the manifest's format, e.g. w8a8-int8 (null: no manifest)")
    stages: list[str] = Field(default_factory=list, description="the manifest's stage names, in order")


class DataInfo(_Strict):
    """The token sequences both models were run on."""

    source: Literal["builtin-sample", "file"]
    path: str | None = Field(None, description="the data file (source = file)")
    sequences: int = Field(ge=0)
    tokens: int = Field(ge=0, description="token positions scored (logits compared)")

    @model_validator(mode="after")
    def _path(self):
        if self.source == "file" and not self.path:
            raise ValueError("data source 'file' needs its path")
        if self.source == "builtin-sample" and self.path:
            raise ValueError("data source 'builtin-sample' takes no path")
        return self


class LayerRow(_Strict):
    """Candidate vs reference output of one layer, with Ascend's compare columns."""

    name: str = Field(description='e.g. "embed", "layer.0", ..., "final_norm", "logits"')
    cosine: Metric = Field(alias="Cosine")
    max_abs_err: Metric = Field(alias="MaxAbsErr")
    max_relative_err: Metric = Field(alias="MaxRelativeErr")
    one_thousandth_err_ratio: Metric = Field(alias="One Thousandth Err Ratio")
    five_thousandth_err_ratio: Metric = Field(alias="Five Thousandth Err Ratio")
    euc_dist: Metric = Field(alias="EucDist")


class WeightSqnrRow(_Strict):
    """SQNR of one dequantized candidate weight against the reference weight."""

    name: str = Field(description="tensor name")
    sqnr_db: Metric = Field(description="20 log10(|w| / |w - w_hat|); Infinity when exact")
    format: str = Field(description="the candidate's storage format of this tensor, e.g. int8-channel")


class LogitStats(_Strict):
    """Next-token distributions, as llama.cpp's KL-divergence report."""

    tokens: int = Field(ge=1)
    ppl_candidate: Metric
    ppl_reference: Metric
    ppl_ratio: Metric = Field(description="PPL(candidate) / PPL(reference)")
    kl_mean: Metric = Field(description="mean KL(reference || candidate) per token, nats")
    kl_median: Metric
    kl_p99: Metric
    kl_p999: Metric
    kl_max: Metric
    same_top1: float = Field(ge=0, le=1, description="share of positions with the same argmax")
    rms_delta_p: Metric = Field(description="RMS of p_cand(target) - p_ref(target), a fraction (not %)")


class Thresholds(_Strict):
    """Acceptance limits; null: not checked."""

    min_cosine: float | None = Field(None, description="every layer's Cosine must be >= this")
    max_ppl_ratio: float | None = Field(None, description="PPL(candidate) / PPL(reference) must be <= this")
    max_mean_kl: float | None = Field(None, description="mean KL must be <= this")
    min_top1: float | None = Field(None, ge=0, le=1, description="same top-1 share must be >= this")


class ThresholdCheck(_Strict):
    """One applied threshold and its outcome."""

    name: Literal["min_cosine", "max_ppl_ratio", "max_mean_kl", "min_top1"]
    limit: float
    value: Metric | None = Field(description="the measured value compared (null: nothing to measure)")
    passed: bool
    message: str = Field(description="what was compared, in words")


class Report(_Strict):
    report_version: Literal[1] = REPORT_VERSION
    tool: ToolInfo
    candidate: ModelRef
    reference: ModelRef
    data: DataInfo
    layers: list[LayerRow] = Field(default_factory=list, description="per-layer comparison, in model order")
    first_divergent_layer: str | None = Field(None, description="first layer with Cosine below min_cosine")
    weights: list[WeightSqnrRow] = Field(default_factory=list, description="per-weight SQNR rows")
    logits: LogitStats | None = None
    thresholds: Thresholds = Field(default_factory=Thresholds)
    checks: list[ThresholdCheck] = Field(default_factory=list)
    violations: list[str] = Field(default_factory=list, description="the failed checks' messages")
    passed: bool

    @model_validator(mode="after")
    def _consistent(self):
        failed = [c.message for c in self.checks if not c.passed]
        if self.passed and (failed or self.violations):
            raise ValueError(f"passed is true but there are violations: {failed or self.violations}")
        if not self.passed and not failed and not self.violations:
            raise ValueError("passed is false but no check failed and no violation is listed")
        return self
