"""`report.json`: what `cvt verify` measured, candidate against reference, and whether it passed.

Typed with pydantic (`extra="forbid"`), versioned by `report_version`, exported as JSON Schema
to `schemas/report.schema.json` (`python -m cvt.schemas`). Metric names follow FORMATS.md
section 4: a per-layer row carries the six Ascend columns under their exact names
("Cosine", "MaxAbsErr", ...) as JSON keys, so `LayerRow(name=..., **compare_tensors(a, b))`
builds one. Python attribute names are snake_case (`row.cosine`).

Metrics can be infinite (SQNR of an exact weight, EucDist against a zero reference) or NaN;
the JSON stays strict: such values are written as the strings "Infinity", "-Infinity", "NaN"
(write with `model_dump_json(by_alias=True)`), and read back as floats. A NaN metric means a
candidate or reference tensor held NaN / Inf: it fails every threshold, and `nonfinite_layers`
/ `nonfinite_weights` / `first_nonfinite_layer` say where those values are.

`Thresholds` accepts finite limits only (each field states its rule); `Thresholds.from_options`
turns an invalid one into a one-line `CvtError` naming the CLI option.

report_version 2 added `first_nonfinite_layer`, `nonfinite_layers`, `nonfinite_weights` and a
NaN `same_top1`; report_version 3 added `status`, which tells a run without any threshold
("no_gates": nothing was checked) from one that passed its gates; report_version 4 added each
side's quantization `methods` and `fallbacks` (from its manifest); report_version 5 added each side's
`mixed_precision` (`cvt quantize --kl-budget`'s choice, from its manifest). Older reports still read
(their status is derived from `checks` and `passed`).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, model_validator

from cvt.errors import CvtError
from cvt.schemas.manifest import ToolInfo

REPORT_VERSION = 5

Status = Literal["passed", "failed", "no_gates"]
"""A report's verdict: every applied threshold held, one failed, or no threshold was given."""

Metric = Annotated[
    float,
    WithJsonSchema({"anyOf": [{"type": "number"}, {"enum": ["Infinity", "-Infinity", "NaN"]}]}),
]
"""A float that may be +-inf or NaN, written to JSON as a number or one of those three strings."""


def _share(v: float) -> float:
    if not (math.isnan(v) or 0.0 <= v <= 1.0):
        raise ValueError("must be a share in [0, 1], or NaN (non-finite logits)")
    return v


Share = Annotated[
    float,
    AfterValidator(_share),
    WithJsonSchema({"anyOf": [{"type": "number", "minimum": 0, "maximum": 1}, {"enum": ["NaN"]}]}),
]
"""A share in [0, 1], or NaN when it cannot be measured (NaN / Inf inputs)."""


def _limit(rule: str, ok, bounds: dict) -> Any:
    """A threshold: a finite float for which ok(v) holds, else ValueError("must be <rule>")."""

    def check(v: float) -> float:
        if not (math.isfinite(v) and ok(v)):
            raise ValueError(f"must be {rule}")
        return v

    return Annotated[float, AfterValidator(check), WithJsonSchema({"type": "number", **bounds})]


CosineLimit = _limit("a finite number in [-1, 1]", lambda v: -1.0 <= v <= 1.0, {"minimum": -1, "maximum": 1})
PplRatioLimit = _limit("a finite number > 0", lambda v: v > 0.0, {"exclusiveMinimum": 0})
KlLimit = _limit("a finite number >= 0", lambda v: v >= 0.0, {"minimum": 0})
Top1Limit = _limit("a finite number in [0, 1]", lambda v: 0.0 <= v <= 1.0, {"minimum": 0, "maximum": 1})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, ser_json_inf_nan="strings")


class ModelRef(_Strict):
    """One side of the comparison: a cvt output (with its manifest) or a plain HF directory."""

    path: str = Field(description="the directory (or hub id) that was loaded")
    format: str | None = Field(None, description="the manifest's format, e.g. w8a8-int8 (null: no manifest)")
    stages: list[str] = Field(default_factory=list, description="the manifest's stage names, in order")
    methods: dict[str, int] = Field(default_factory=dict, description="quantized linears per method applied "
                                                                      "(rtn-fallback: the method asked fell back to "
                                                                      "RTN); empty: not quantized")
    fallback_count: int = Field(0, ge=0, description="the manifest's quant.fallbacks entries")
    fallbacks: list[str] = Field(default_factory=list, description="the fallbacks grouped by reason, one line each "
                                                                   "(how many, what happened, where, why)")
    mixed_precision: list[str] = Field(default_factory=list, description="cvt quantize --kl-budget: the budget and "
                                                                         "what was measured, then each unit kept at "
                                                                         "the higher precision and why")


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
    same_top1: Share = Field(description="share of positions with the same argmax; NaN: a row held NaN / Inf")
    rms_delta_p: Metric = Field(description="RMS of p_cand(target) - p_ref(target), a fraction (not %)")


class Thresholds(_Strict):
    """Acceptance limits, each a finite number; null: not checked. A NaN measurement fails every one."""

    min_cosine: CosineLimit | None = Field(
        None, description="every layer's Cosine must be >= this; a finite number in [-1, 1]")
    max_ppl_ratio: PplRatioLimit | None = Field(
        None, description="PPL(candidate) / PPL(reference) must be <= this; a finite number > 0")
    max_mean_kl: KlLimit | None = Field(None, description="mean KL must be <= this; a finite number >= 0")
    min_top1: Top1Limit | None = Field(
        None, description="same top-1 share must be >= this; a finite number in [0, 1]")

    @classmethod
    def from_options(cls, **limits: float | None) -> Thresholds:
        """Thresholds from the CLI's options (min_cosine=..., max_ppl_ratio=..., max_mean_kl=...,
        min_top1=...; None: not set). An invalid limit raises `CvtError` in one line naming the
        option and its rule, e.g. "--min-cosine nan: must be a finite number in [-1, 1]"."""
        try:
            return cls(**limits)
        except ValidationError as exc:
            raise CvtError(_limits_error(exc, limits)) from None

    @classmethod
    def coerce(cls, value: Thresholds | dict | None) -> Thresholds:
        """`value` as validated Thresholds (None: none set): a dict goes through `from_options`,
        an instance is re-validated (a `model_construct`ed one may hold anything)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            value = value.model_dump()
        if not isinstance(value, dict):
            raise CvtError(f"thresholds: expected Thresholds or a dict of limits, got {type(value).__name__}")
        return cls.from_options(**value)


def _limits_error(exc: ValidationError, limits: dict) -> str:
    parts = []
    for e in exc.errors(include_url=False):
        loc = e.get("loc") or ()
        field = str(loc[0]) if loc else ""
        opt = "--" + field.replace("_", "-") if field else "thresholds"
        value = limits.get(field, e.get("input"))
        shown = repr(value) if isinstance(value, float) else str(value)
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{opt} {shown}: {msg}")
    return "; ".join(parts)


class NonFinite(_Strict):
    """NaN / Inf elements of one tensor on one side of the comparison."""

    name: str = Field(description='a layer of `layers` ("layer.3", "logits") or a weight tensor name')
    side: Literal["candidate", "reference"]
    nan: int = Field(ge=0, description="NaN elements")
    posinf: int = Field(ge=0, description="+Inf elements")
    neginf: int = Field(ge=0, description="-Inf elements")
    numel: int = Field(ge=1, description="elements in the tensor")

    @model_validator(mode="after")
    def _counts(self):
        bad = self.nan + self.posinf + self.neginf
        if not 1 <= bad <= self.numel:
            raise ValueError(f"{self.name}: {bad} non-finite elements must be between 1 and numel {self.numel}")
        return self


class ThresholdCheck(_Strict):
    """One applied threshold and its outcome."""

    name: Literal["min_cosine", "max_ppl_ratio", "max_mean_kl", "min_top1"]
    limit: float
    value: Metric | None = Field(description="the measured value compared (null: nothing to measure)")
    passed: bool
    message: str = Field(description="what was compared, in words")


class Report(_Strict):
    report_version: Literal[1, 2, 3, 4, 5] = REPORT_VERSION
    tool: ToolInfo
    candidate: ModelRef
    reference: ModelRef
    data: DataInfo
    layers: list[LayerRow] = Field(default_factory=list, description="per-layer comparison, in model order")
    first_divergent_layer: str | None = Field(
        None, description="first layer with Cosine below min_cosine, or NaN (non-finite values)")
    first_nonfinite_layer: str | None = Field(
        None, description="first layer (model order) whose candidate or reference output holds NaN or Inf; "
                          "null: all finite")
    nonfinite_layers: list[NonFinite] = Field(
        default_factory=list, description="every layer output holding NaN or Inf: model order, candidate first")
    nonfinite_weights: list[NonFinite] = Field(
        default_factory=list, description="every candidate or reference weight holding NaN or Inf")
    weights: list[WeightSqnrRow] = Field(default_factory=list, description="per-weight SQNR rows")
    logits: LogitStats | None = None
    thresholds: Thresholds = Field(default_factory=Thresholds)
    checks: list[ThresholdCheck] = Field(default_factory=list)
    violations: list[str] = Field(default_factory=list, description="the failed checks' messages")
    passed: bool = Field(description="no applied threshold failed (true also when none was applied: see status)")
    status: Annotated[Status | None, WithJsonSchema({
        "enum": ["passed", "failed", "no_gates"],
        "description": "passed: every applied threshold held; failed: one did not; no_gates: no threshold was "
                       "given, nothing was checked (derived from checks and passed when absent)"})] = None

    @model_validator(mode="after")
    def _consistent(self):
        failed = [c.message for c in self.checks if not c.passed]
        if self.passed and (failed or self.violations):
            raise ValueError(f"passed is true but there are violations: {failed or self.violations}")
        if not self.passed and not failed and not self.violations:
            raise ValueError("passed is false but no check failed and no violation is listed")
        status = "failed" if not self.passed else "passed" if self.checks else "no_gates"
        if self.status is None:
            self.status = status
        elif self.status != status:
            raise ValueError(f"status {self.status!r} does not match the checks (they say {status!r})")
        first = self.nonfinite_layers[0].name if self.nonfinite_layers else None
        if self.first_nonfinite_layer != first:
            raise ValueError(f"first_nonfinite_layer {self.first_nonfinite_layer!r} does not match "
                             f"nonfinite_layers (first: {first!r})")
        return self
