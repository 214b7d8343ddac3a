"""NaN / Inf in the report: every threshold fails with a line saying where, limits are validated,
the report model and schema carry the non-finite locations."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
import torch
from pydantic import ValidationError

from cvt.errors import CvtError
from cvt.runtime.metrics import compare_tensors, logit_stats
from cvt.runtime.report import evaluate_thresholds, first_divergent_layer, render_html, write_report
from cvt.schemas import load_schema
from cvt.schemas.manifest import ToolInfo
from cvt.schemas.report import (DataInfo, LayerRow, LogitStats, ModelRef, NonFinite, Report, Thresholds,
                                WeightSqnrRow)

ALL = Thresholds(min_cosine=0.5, max_ppl_ratio=100.0, max_mean_kl=10.0, min_top1=0.0)
"""Loose limits every finite comparison below passes: only the NaN can fail them."""


def _case(side: str, value: float):
    """Layer rows, logits stats and NonFinite rows for a comparison whose `side` turns non-finite
    from layer.1 on (a tensor holding `value`)."""
    torch.manual_seed(0)
    names = ["embed", "layer.0", "layer.1", "layer.2", "logits"]
    layers, nonfinite = [], []
    for k, name in enumerate(names):
        ref = torch.randn(4, 16)
        cand = ref + 1e-3 * torch.randn(4, 16)
        if k >= 2:
            (cand if side == "candidate" else ref)[0, 3] = value
            nonfinite.append(NonFinite(name=name, side=side, nan=int(math.isnan(value)),
                                       posinf=int(value == math.inf), neginf=0, numel=64))
        layers.append(LayerRow(name=name, **compare_tensors(cand, ref)))
    ref = torch.randn(20, 10)
    cand = ref + 0.01 * torch.randn(20, 10)
    (cand if side == "candidate" else ref)[4, 2] = value
    stats = logit_stats(cand, ref, torch.randint(0, 10, (20,)))
    kl = stats.pop("kl_per_token")
    return layers, LogitStats(**stats), nonfinite, kl


def _report(thresholds, layers, logits, nonfinite, weights_nf=()):
    out = evaluate_thresholds(thresholds, layers, logits, nonfinite)
    return Report(tool=ToolInfo(version="0.1.0"), candidate=ModelRef(path="/c"), reference=ModelRef(path="/r"),
                  data=DataInfo(source="builtin-sample", sequences=1, tokens=20), layers=layers,
                  first_divergent_layer=out.first_divergent_layer,
                  first_nonfinite_layer=nonfinite[0].name if nonfinite else None,
                  nonfinite_layers=list(nonfinite), nonfinite_weights=list(weights_nf),
                  weights=[WeightSqnrRow(name="model.layers.1.mlp.down_proj.weight", sqnr_db=math.nan, format="dense")],
                  logits=logits, thresholds=thresholds, checks=out.checks, violations=out.violations,
                  passed=out.passed)


def test_loose_limits_pass_when_finite():
    torch.manual_seed(0)
    ref = torch.randn(4, 16)
    layers = [LayerRow(name="embed", **compare_tensors(ref, ref))]
    lr = torch.randn(20, 10)
    stats = logit_stats(lr, lr, torch.randint(0, 10, (20,)))
    stats.pop("kl_per_token")
    assert evaluate_thresholds(ALL, layers, LogitStats(**stats)).passed


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("side", ["candidate", "reference"])
def test_non_finite_fails_every_gate_and_says_where(side, value):
    layers, logits, nonfinite, _ = _case(side, value)
    out = evaluate_thresholds(ALL, layers, logits, nonfinite)
    assert not out.passed
    assert {c.name for c in out.checks if not c.passed} == {"min_cosine", "max_ppl_ratio", "max_mean_kl", "min_top1"}
    assert out.first_divergent_layer == "layer.1"
    by = {c.name: c.message for c in out.checks}
    assert by["min_cosine"].startswith("Cosine is NaN (non-finite values) from layer layer.1")
    assert f"{side} layer.1:" in by["min_cosine"]
    for name in ("max_ppl_ratio", "max_mean_kl", "min_top1"):
        assert "is NaN (non-finite logits)" in by[name], by[name]
        assert f"{side} logits:" in by[name] and f"first non-finite output: {side} layer.1" in by[name]
    assert out.violations == [by[n] for n in ("min_cosine", "max_ppl_ratio", "max_mean_kl", "min_top1")]


def test_nan_without_location_still_fails():
    layers, logits, _, _ = _case("candidate", math.nan)
    out = evaluate_thresholds(ALL, layers, logits)
    assert not out.passed and len(out.violations) == 4
    assert all("NaN" in v and "holds NaN or Inf" in v for v in out.violations)


def test_infinite_ppl_ratio_fails():
    layers, logits, _, _ = _case("candidate", math.nan)
    inf_logits = logits.model_copy(update={"ppl_ratio": math.inf, "kl_mean": math.inf})
    out = evaluate_thresholds(Thresholds(max_ppl_ratio=1e9, max_mean_kl=1e9), layers[:2], inf_logits)
    assert not out.passed and out.violations == ["PPL ratio inf > 1e+09", "mean KL inf > 1e+09"]


def test_first_divergent_layer_nan():
    rows = [{"name": "a", "Cosine": 1.0}, {"name": "b", "Cosine": math.nan}, {"name": "c", "Cosine": 0.1}]
    assert first_divergent_layer(rows, -1.0) == "b"
    with pytest.raises(ValueError, match="finite"):
        first_divergent_layer(rows, math.nan)


@pytest.mark.parametrize(("field", "value", "rule"), [
    ("min_cosine", math.nan, "a finite number in [-1, 1]"),
    ("min_cosine", 1.5, "a finite number in [-1, 1]"),
    ("min_cosine", -math.inf, "a finite number in [-1, 1]"),
    ("max_ppl_ratio", math.nan, "a finite number > 0"),
    ("max_ppl_ratio", 0.0, "a finite number > 0"),
    ("max_ppl_ratio", math.inf, "a finite number > 0"),
    ("max_mean_kl", -0.1, "a finite number >= 0"),
    ("max_mean_kl", math.nan, "a finite number >= 0"),
    ("min_top1", math.nan, "a finite number in [0, 1]"),
    ("min_top1", 1.01, "a finite number in [0, 1]"),
])
def test_thresholds_validated_in_words(field, value, rule):
    with pytest.raises(ValidationError, match=f"must be {rule}".replace("[", r"\[").replace("]", r"\]")):
        Thresholds(**{field: value})
    with pytest.raises(CvtError) as exc:
        Thresholds.from_options(**{field: value})
    assert str(exc.value) == f"--{field.replace('_', '-')} {value!r}: must be {rule}"
    # the JSON schema says the same
    schema = load_schema("report.schema.json")["$defs"]["Thresholds"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({field: value if math.isfinite(value) else "NaN"}, schema)


def test_thresholds_from_options_and_coerce():
    th = Thresholds.from_options(min_cosine=-1.0, max_ppl_ratio=1.01, max_mean_kl=0.0, min_top1=1.0)
    assert th == Thresholds(min_cosine=-1.0, max_ppl_ratio=1.01, max_mean_kl=0.0, min_top1=1.0)
    assert Thresholds.from_options(min_cosine=None, max_ppl_ratio=None, max_mean_kl=None, min_top1=None) == Thresholds()
    with pytest.raises(CvtError, match=r"^--min-cosine nan: .*; --max-mean-kl -1: must be a finite number >= 0$"):
        Thresholds.from_options(min_cosine=math.nan, max_mean_kl=-1)
    assert Thresholds.coerce(None) == Thresholds() and Thresholds.coerce({"min_top1": 0.5}).min_top1 == 0.5
    sneaky = Thresholds.model_construct(min_cosine=math.nan, max_ppl_ratio=None, max_mean_kl=None, min_top1=None)
    with pytest.raises(CvtError, match=r"--min-cosine nan: must be a finite number in \[-1, 1\]"):
        Thresholds.coerce(sneaky)
    with pytest.raises(CvtError, match="--min-cosine nan"):  # evaluate_thresholds re-validates
        evaluate_thresholds(sneaky, [], None)


def test_logit_stats_same_top1_nan_or_share():
    _, logits, _, _ = _case("reference", math.nan)
    assert math.isnan(logits.same_top1)
    with pytest.raises(ValidationError, match=r"share in \[0, 1\]"):
        logits.model_validate({**logits.model_dump(), "same_top1": 1.5})


@pytest.mark.parametrize("side", ["candidate", "reference"])
def test_report_files_name_the_first_non_finite_layer(tmp_path, side):
    layers, logits, nonfinite, kl = _case(side, math.nan)
    weights_nf = [NonFinite(name="model.layers.1.mlp.down_proj.weight", side=side, nan=1, posinf=0, neginf=0,
                            numel=9216)]
    report = _report(ALL, layers, logits, nonfinite, weights_nf)
    paths = write_report(report, tmp_path, kl)
    text = paths["json"].read_text()
    doc = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    jsonschema.validate(doc, load_schema("report.schema.json"))
    assert doc["report_version"] == 5 and doc["first_nonfinite_layer"] == "layer.1"
    assert doc["nonfinite_layers"][0] == {"name": "layer.1", "side": side, "nan": 1, "posinf": 0, "neginf": 0,
                                          "numel": 64}
    assert doc["logits"]["same_top1"] == "NaN" and doc["layers"][2]["Cosine"] == "NaN"
    assert Report.model_validate_json(text).model_dump_json() == report.model_dump_json()
    md = paths["md"].read_text()
    assert f"- Non-finite values: first in layer layer.1 ({side} layer.1: 1 NaN of 64 values)" in md
    assert "## Non-finite values (NaN / Inf)" in md
    assert f"| model.layers.1.mlp.down_proj.weight | weight | {side} | 1 | 0 | 0 | 9216 |" in md
    assert f"layer.1** (first divergent) (NaN/Inf: {side})" in md
    html = paths["html"].read_text()
    assert "<h2>Non-finite values (NaN / Inf)</h2>" in html and f"{side} layer.1: 1 NaN of 64 values" in html


def test_report_consistency_and_older_versions():
    layers, logits, nonfinite, _ = _case("candidate", math.inf)
    report = _report(ALL, layers, logits, nonfinite)
    doc = report.model_dump(by_alias=True)
    with pytest.raises(ValidationError, match="first_nonfinite_layer"):
        Report.model_validate({**doc, "first_nonfinite_layer": "layer.2"})
    with pytest.raises(ValidationError, match="first_nonfinite_layer"):
        Report.model_validate({**doc, "nonfinite_layers": []})
    with pytest.raises(ValidationError, match="between 1 and numel"):
        NonFinite(name="x", side="candidate", nan=0, posinf=0, neginf=0, numel=3)
    # a version 1 report (no non-finite fields) still reads, and renders without the note
    finite_layers = layers[:2]
    v1 = {k: v for k, v in doc.items()
          if k not in ("first_nonfinite_layer", "nonfinite_layers", "nonfinite_weights", "status")}
    v1.update(report_version=1, layers=[r.model_dump(by_alias=True) for r in finite_layers], logits=None,
              checks=[], violations=[], passed=True, first_divergent_layer=None, thresholds={})
    old = Report.model_validate(v1)
    jsonschema.validate(json.loads(old.model_dump_json(by_alias=True)), load_schema("report.schema.json"))
    assert "Non-finite" not in render_html(old)
