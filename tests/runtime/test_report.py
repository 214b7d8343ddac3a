"""report.{json,md,html}: schema-valid JSON, markdown tables, a self-contained HTML with two SVG plots."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser

import jsonschema
import pytest
import torch
from pydantic import ValidationError

from cvt.runtime.metrics import compare_tensors, logit_stats
from cvt.runtime.plots import COSINE_PLOT_TITLE, KL_PLOT_TITLE
from cvt.runtime.report import (evaluate_thresholds, first_divergent_layer,
                                write_report)
from cvt.schemas import load_schema
from cvt.schemas.manifest import ToolInfo
from cvt.schemas.report import DataInfo, LayerRow, LogitStats, ModelRef, Report, Thresholds, WeightSqnrRow

N_LAYERS = 8


def _layers() -> list[LayerRow]:
    torch.manual_seed(0)
    names = ["embed"] + [f"layer.{i}" for i in range(N_LAYERS)] + ["final_norm", "logits"]
    rows = []
    for k, name in enumerate(names):
        ref = torch.randn(4, 64)
        noise = 1e-3 * (10 ** (k / 3))  # grows through the model: cosine < 0.99 from layer.6
        rows.append(LayerRow(name=name, **compare_tensors(ref + noise * torch.randn(4, 64), ref)))
    return rows


def _report(thresholds: Thresholds, with_logits: bool = True):
    layers = _layers()
    torch.manual_seed(1)
    ref = torch.randn(300, 50) * 2
    stats = logit_stats(ref + 0.2 * torch.randn(300, 50), ref, torch.randint(0, 50, (300,)))
    kl = stats.pop("kl_per_token")
    logits = LogitStats(**stats) if with_logits else None
    weights = [WeightSqnrRow(name=f"model.layers.{i}.mlp.down_proj.weight", sqnr_db=40.0 - i, format="int8-channel")
               for i in range(30)]
    weights.append(WeightSqnrRow(name="model.layers.0.self_attn.o_proj.weight", sqnr_db=math.inf, format="bf16"))
    outcome = evaluate_thresholds(thresholds, layers, logits)
    report = Report(
        tool=ToolInfo(version="0.1.0"),
        candidate=ModelRef(path="/tmp/cand <w8a8>", format="w8a8-int8", stages=["fp8-to-bf16", "quantize"]),
        reference=ModelRef(path="/tmp/ref"),
        data=DataInfo(source="builtin-sample", sequences=3, tokens=300),
        layers=layers, first_divergent_layer=outcome.first_divergent_layer, weights=weights, logits=logits,
        thresholds=thresholds, checks=outcome.checks, violations=outcome.violations, passed=outcome.passed,
    )
    return report, kl


STRICT = Thresholds(min_cosine=0.99, max_ppl_ratio=1.5, max_mean_kl=0.1, min_top1=0.5)


def test_first_divergent_layer():
    rows = [{"name": "a", "Cosine": 0.999}, {"name": "b", "Cosine": 0.98}, {"name": "c", "Cosine": 0.5}]
    assert first_divergent_layer(rows, 0.99) == "b"
    assert first_divergent_layer(rows, 0.9) == "c"
    assert first_divergent_layer(rows, 0.1) is None
    assert first_divergent_layer(rows, None) is None
    assert first_divergent_layer([{"name": "n", "Cosine": float("nan")}], 0.99) == "n"


def test_thresholds_outcome():
    report, _ = _report(STRICT)
    assert report.first_divergent_layer == "layer.6"
    assert not report.passed
    by = {c.name: c for c in report.checks}
    assert set(by) == {"min_cosine", "max_ppl_ratio", "max_mean_kl", "min_top1"}
    assert not by["min_cosine"].passed and report.first_divergent_layer in by["min_cosine"].message
    assert by["max_ppl_ratio"].passed and by["min_top1"].passed
    assert report.violations == [c.message for c in report.checks if not c.passed]

    loose, _ = _report(Thresholds(min_cosine=-1.0, max_ppl_ratio=10.0))
    assert loose.passed and loose.violations == [] and loose.first_divergent_layer is None

    none, _ = _report(Thresholds())
    assert none.passed and none.checks == []

    # a threshold that cannot be measured fails rather than passing silently
    nologits, _ = _report(Thresholds(min_top1=0.5), with_logits=False)
    assert not nologits.passed and "no logits" in nologits.violations[0]


def test_report_model_rejects_inconsistent_verdict():
    report, _ = _report(STRICT)
    bad = report.model_dump(by_alias=True)
    bad["passed"] = True
    with pytest.raises(ValidationError, match="passed is true"):
        Report.model_validate(bad)
    with pytest.raises(ValidationError, match="needs its path"):
        DataInfo(source="file", sequences=1, tokens=1)


def test_json_valid_and_roundtrips(tmp_path):
    report, kl = _report(STRICT)
    paths = write_report(report, tmp_path / "out", kl)
    assert set(paths) == {"json", "md", "html"} and all(p.exists() for p in paths.values())
    text = paths["json"].read_text()
    doc = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    jsonschema.validate(doc, load_schema("report.schema.json"))
    assert doc["layers"][0]["name"] == "embed"
    assert set(doc["layers"][0]) == {"name", "Cosine", "MaxAbsErr", "MaxRelativeErr", "One Thousandth Err Ratio",
                                     "Five Thousandth Err Ratio", "EucDist"}
    assert doc["weights"][-1]["sqnr_db"] == "Infinity"
    assert Report.model_validate(doc) == report
    assert Report.model_validate_json(text) == report

    bad = json.loads(text)
    bad["layers"][0]["cosine"] = bad["layers"][0].pop("Cosine")
    bad["surprise"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, load_schema("report.schema.json"))


def test_markdown_tables(tmp_path):
    report, kl = _report(STRICT)
    md = write_report(report, tmp_path, kl)["md"].read_text()
    assert md.startswith("# cvt verify report: FAILED")
    for section in ("## Per-layer comparison", "## Logits", "## Weight SQNR (worst 20 of 31)", "## Thresholds"):
        assert section in md
    assert ("| # | Layer | Cosine | MaxAbsErr | MaxRelativeErr | One Thousandth Err Ratio | "
            "Five Thousandth Err Ratio | EucDist |") in md
    assert f"**{report.first_divergent_layer}** (first divergent)" in md
    assert "| Mean KL divergence |" in md and "| Same top-1 |" in md and "| RMS Δp |" in md
    # worst weight first, the exact (inf) one not among the worst 20
    sq = md.split("## Weight SQNR")[1].split("##")[0]
    assert sq.index("layers.29.") < sq.index("layers.28.") and "o_proj" not in sq
    assert "| min_cosine | 0.99 |" in md and "**FAIL**" in md
    assert md.rstrip().endswith("Result: **FAILED**")


class _Scan(HTMLParser):
    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.svgs = 0
        self.svg_titles: list[str] = []
        self.urls: list[str] = []
        self.scripts = 0
        self.bad_rows = 0

    def handle_starttag(self, tag, attrs):
        self.stack.append(tag)
        a = dict(attrs)
        self.svgs += tag == "svg"
        self.scripts += tag in ("script", "iframe", "object", "embed", "link")
        self.bad_rows += tag == "tr" and a.get("class") == "bad"
        for k in ("src", "href", "xlink:href"):
            if k in a:
                self.urls.append(a[k])

    def handle_endtag(self, tag):
        while self.stack and self.stack.pop() != tag:
            pass

    def handle_data(self, data):
        if self.stack[-2:] == ["svg", "title"]:
            self.svg_titles.append(data)


def test_html_self_contained_with_two_plots(tmp_path):
    report, kl = _report(STRICT)
    report = report.model_copy(update={"candidate": ModelRef(path='/tmp/<script>alert("x")</script>')})
    html_text = write_report(report, tmp_path, kl)["html"].read_text()
    scan = _Scan()
    scan.feed(html_text)
    assert scan.svgs == 2
    assert scan.svg_titles == [COSINE_PLOT_TITLE, KL_PLOT_TITLE]
    assert scan.urls == [] and scan.scripts == 0
    assert "http://" not in html_text and "https://" not in html_text
    assert "<script>" not in html_text and "&lt;script&gt;" in html_text  # text is escaped
    assert scan.bad_rows >= 2  # first divergent layer row + failed threshold rows
    assert "One Thousandth Err Ratio" in html_text and "RMS Δp" in html_text


def test_html_without_logits_or_layers(tmp_path):
    report = Report(tool=ToolInfo(version="0.1.0"), candidate=ModelRef(path="c"), reference=ModelRef(path="r"),
                    data=DataInfo(source="file", path="d.jsonl", sequences=0, tokens=0), passed=True)
    paths = write_report(report, tmp_path)
    scan = _Scan()
    scan.feed(paths["html"].read_text())
    assert scan.svgs == 2
    assert "No per-layer comparison." in paths["md"].read_text()


def _chromium() -> str | None:
    if os.path.exists("/usr/bin/chromium"):
        return "/usr/bin/chromium"
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def _png_distinct_bytes(data: bytes) -> int:
    """Distinct byte values in the decompressed image data (1-2 for a blank page)."""
    pos, idat = 8, b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        if kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + length]
        pos += 12 + length
    return len(set(zlib.decompress(idat)))


@pytest.mark.slow
@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed: headless render of report.html skipped")
def test_html_renders_in_headless_chromium(tmp_path):
    report, kl = _report(STRICT)
    html_path = write_report(report, tmp_path / "rep", kl)["html"]
    png = tmp_path / "shot.png"
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
           "--window-size=1200,1600", f"--screenshot={png}", html_path.resolve().as_uri()]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert png.exists(), f"chromium wrote no screenshot (rc {p.returncode}): {p.stderr[-2000:]}"
    data = png.read_bytes()
    w, h = _png_size(data)
    assert w >= 400 and h >= 400
    assert len(data) > 10_000, f"screenshot is only {len(data)} bytes: a blank page?"
    assert _png_distinct_bytes(data) > 16


def test_no_thresholds_say_no_gates_applied_not_passed(tmp_path):
    """Without a threshold nothing was checked: json status no_gates, md / html 'no gates applied'
    with a neutral badge, never PASSED (a w4a16 at cosine 0.76 read as a green PASSED)."""
    report, kl = _report(Thresholds())
    assert report.status == "no_gates" and report.checks == [] and report.passed
    paths = write_report(report, tmp_path, kl)
    doc = json.loads(paths["json"].read_text())
    jsonschema.validate(doc, load_schema("report.schema.json"))
    assert doc["status"] == "no_gates" and doc["report_version"] == 5
    md = paths["md"].read_text()
    assert md.startswith("# cvt verify report: no gates applied\n")
    assert md.rstrip().endswith("Result: **no gates applied**") and "PASSED" not in md
    html_text = paths["html"].read_text()
    assert '<h1>cvt verify report <span class="verdict nogates">no gates applied</span></h1>' in html_text
    assert "PASSED" not in html_text and 'class="verdict pass"' not in html_text
    assert ".nogates { background: #6e7781; }" in html_text  # grey: neither the pass green nor the fail red

    for th, status, title in ((STRICT, "failed", "FAILED"), (Thresholds(min_cosine=-1.0), "passed", "PASSED")):
        r, _ = _report(th)
        assert r.status == status
        assert write_report(r, tmp_path / status, kl)["md"].read_text().startswith(f"# cvt verify report: {title}\n")

    # an older report (no status) reads with its status derived; a status the checks contradict is refused
    old = {k: v for k, v in report.model_dump(by_alias=True).items() if k != "status"}
    assert Report.model_validate({**old, "report_version": 2}).status == "no_gates"
    with pytest.raises(ValidationError, match="status 'passed' does not match"):
        Report.model_validate({**old, "status": "passed"})
