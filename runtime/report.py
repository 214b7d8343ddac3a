"""Write a verify `Report` as report.json, report.md and a self-contained report.html.

`evaluate_thresholds(thresholds, layers, logits, nonfinite_layers)` turns the acceptance limits
into `ThresholdCheck`s, violation messages and a passed flag; a NaN measurement fails every
limit, and its message says it is NaN and where the non-finite values are (`nonfinite_layers`:
`NonFinite` rows, as `cvt verify` records them). `first_divergent_layer(rows, min_cosine)`
names the first layer below the cosine limit or NaN. `write_report(report, folder,
kl_values)` writes the three files. The HTML needs no network: inline CSS, two inline SVG
plots drawn here (per-layer cosine, histogram of per-token KL), no scripts, all text escaped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

from cvt.runtime.plots import cosine_plot_svg, esc, fmt, fmt_col, kl_histogram_svg
from cvt.schemas.report import (LayerRow, LogitStats, ModelRef, NonFinite, Report, ThresholdCheck, Thresholds,
                                WeightSqnrRow)
from cvt.units import plural


# (attribute, column name) of a LayerRow, in Ascend's order.
LAYER_COLUMNS = (
    ("cosine", "Cosine"),
    ("max_abs_err", "MaxAbsErr"),
    ("max_relative_err", "MaxRelativeErr"),
    ("one_thousandth_err_ratio", "One Thousandth Err Ratio"),
    ("five_thousandth_err_ratio", "Five Thousandth Err Ratio"),
    ("euc_dist", "EucDist"),
)

# (field, label) of LogitStats, in display order.
LOGIT_ROWS = (
    ("tokens", "Tokens scored"),
    ("ppl_candidate", "PPL(candidate)"),
    ("ppl_reference", "PPL(reference)"),
    ("ppl_ratio", "PPL(candidate) / PPL(reference)"),
    ("kl_mean", "Mean KL divergence"),
    ("kl_median", "Median KL divergence"),
    ("kl_p99", "KL divergence, 99%"),
    ("kl_p999", "KL divergence, 99.9%"),
    ("kl_max", "Maximum KL divergence"),
    ("same_top1", "Same top-1"),
    ("rms_delta_p", "RMS Δp"),
)

# Report.status -> (verdict text, HTML badge class): a run without thresholds checked nothing
# and must not read as a pass.
VERDICTS = {"passed": ("PASSED", "pass"), "failed": ("FAILED", "fail"), "no_gates": ("no gates applied", "nogates")}
NO_GATES_HINT = "no threshold given (--min-cosine, --max-ppl-ratio, --max-mean-kl, --min-top1): nothing was checked"


# ----------------------------------------------------------------------------- thresholds

def _cos_of(row) -> tuple[str, float]:
    if isinstance(row, LayerRow):
        return row.name, row.cosine
    return row["name"], float(row["Cosine"] if "Cosine" in row else row["cosine"])


def first_divergent_layer(rows: Iterable[LayerRow | dict], min_cosine: float | None) -> str | None:
    """Name of the first row (in order) whose cosine is below `min_cosine` or NaN; None if none.

    rows: `LayerRow`s, or dicts with "name" and "Cosine" (as `compare_tensors` + a name).
    A non-finite `min_cosine` is refused (ValueError): a NaN limit would pass every layer.
    """
    if min_cosine is None:
        return None
    if not math.isfinite(min_cosine):
        raise ValueError(f"min_cosine {min_cosine!r}: must be a finite number in [-1, 1]")
    for row in rows:
        name, c = _cos_of(row)
        if math.isnan(c) or c < min_cosine:
            return name
    return None


class ThresholdOutcome(NamedTuple):
    checks: list[ThresholdCheck]
    violations: list[str]
    passed: bool
    first_divergent_layer: str | None


def verdict_line(report: Report) -> str:
    """The one-line verdict `cvt verify` prints, e.g. "PASSED (4 gates)", "no gates applied: ..."."""
    text, n = VERDICTS[report.status][0], len(report.checks)
    if report.status == "no_gates":
        return f"{text}: {NO_GATES_HINT}"
    failed = sum(not c.passed for c in report.checks)
    return f"{text} ({failed} of {n} gates failed)" if failed else f"{text} ({n} gate{'s' * (n != 1)})"


def describe_nonfinite(row: NonFinite) -> str:
    """ "candidate layer.1: 96 NaN, 2 +Inf of 3072 values" """
    parts = [f"{n} {label}" for n, label in ((row.nan, "NaN"), (row.posinf, "+Inf"), (row.neginf, "-Inf")) if n]
    return f"{row.side} {row.name}: {', '.join(parts)} of {row.numel} values"


def _where(nonfinite: Sequence[NonFinite], name: str | None = None) -> str:
    """Where the NaN / Inf values are, in words: the rows of layer `name` (if any), and the first
    non-finite output when that is elsewhere."""
    if not nonfinite:
        return "the candidate or reference output holds NaN or Inf"
    here = [describe_nonfinite(r) for r in nonfinite if r.name == name]
    first = nonfinite[0]
    if first.name != name:
        here.append(f"first non-finite output: {describe_nonfinite(first)}")
    return "; ".join(here)


def evaluate_thresholds(thresholds: Thresholds, layers: Sequence[LayerRow],
                        logits: LogitStats | None, nonfinite_layers: Sequence[NonFinite] = ()) -> ThresholdOutcome:
    """Apply every set threshold; a threshold that cannot be measured (no layers / no logits) fails,
    and so does a NaN measurement, whatever the limit.

    nonfinite_layers: the layer outputs holding NaN / Inf (`Report.nonfinite_layers`, model
        order), named in the messages of the checks they fail.
    Returns the checks (one per set threshold), the failed checks' messages, `passed` (no
    violation) and the first layer below `min_cosine` (or NaN). Limits are re-validated
    (`Thresholds.coerce`): an invalid one raises `CvtError`.
    """
    thresholds = Thresholds.coerce(thresholds)
    checks: list[ThresholdCheck] = []
    first_bad = first_divergent_layer(layers, thresholds.min_cosine)

    if thresholds.min_cosine is not None:
        lim = thresholds.min_cosine
        if not layers:
            checks.append(ThresholdCheck(name="min_cosine", limit=lim, value=None, passed=False,
                                         message=f"min_cosine {lim:g}: no per-layer comparison to check"))
        else:
            worst = min(layers, key=lambda r: (not math.isnan(r.cosine), r.cosine))
            if first_bad is None:
                msg = f"every layer's Cosine >= {lim:g} (lowest {fmt(worst.cosine)} at {worst.name})"
            else:
                bad = next(r for r in layers if r.name == first_bad)
                n_bad = sum(1 for r in layers if math.isnan(r.cosine) or r.cosine < lim)
                n_nan = sum(1 for r in layers if math.isnan(r.cosine))
                if math.isnan(bad.cosine):
                    msg = (f"Cosine is NaN (non-finite values) from layer {first_bad}, fails >= {lim:g}: "
                           f"{_where(nonfinite_layers, first_bad)}; {n_bad} of {len(layers)} layers fail "
                           f"({n_nan} NaN)")
                else:
                    msg = (f"Cosine below {lim:g} from layer {first_bad} ({fmt(bad.cosine)}); {n_bad} of "
                           f"{len(layers)} layers below, lowest {fmt(worst.cosine)} at {worst.name}")
                    if n_nan:
                        msg += f" ({n_nan} NaN: {_where(nonfinite_layers)})"
            checks.append(ThresholdCheck(name="min_cosine", limit=lim, value=worst.cosine,
                                         passed=first_bad is None, message=msg))

    for name, field, label, upper in (
        ("max_ppl_ratio", "ppl_ratio", "PPL ratio", True),
        ("max_mean_kl", "kl_mean", "mean KL", True),
        ("min_top1", "same_top1", "same top-1 share", False),
    ):
        lim = getattr(thresholds, name)
        if lim is None:
            continue
        if logits is None:
            checks.append(ThresholdCheck(name=name, limit=lim, value=None, passed=False,
                                         message=f"{name} {lim:g}: no logits statistics to check"))
            continue
        v = getattr(logits, field)
        ok = (v <= lim) if upper else (v >= lim)  # False for NaN
        if math.isnan(v):
            msg = (f"{label} is NaN (non-finite logits), fails {'<=' if upper else '>='} {lim:g}: "
                   f"{_where(nonfinite_layers, 'logits')}")
        else:
            rel = ("<=" if ok else ">") if upper else (">=" if ok else "<")
            msg = f"{label} {fmt(v)} {rel} {lim:g}"
            if math.isinf(v) and nonfinite_layers:
                msg += f" ({_where(nonfinite_layers, 'logits')})"
        checks.append(ThresholdCheck(name=name, limit=lim, value=v, passed=bool(ok), message=msg))

    violations = [c.message for c in checks if not c.passed]
    return ThresholdOutcome(checks, violations, not violations, first_bad)


# ----------------------------------------------------------------------------- formatting

def _fmt_logit(field: str, v) -> str:
    if field == "same_top1" or field == "rms_delta_p":
        return "nan" if math.isnan(v) else f"{100 * v:.3f} %"
    return fmt(v, 6)


def quantization_line(m: ModelRef) -> str | None:
    """ "methods: gptq (45 linears), rtn-fallback (19 linears); 19 fallbacks" for a quantized side
    (its fallbacks by reason: `m.fallbacks`); None for one its manifest records no quantization of."""
    if not m.methods:
        return None
    methods = ", ".join(f"{k} ({plural(n, 'linear')})" for k, n in m.methods.items())
    return f"methods: {methods}; {plural(m.fallback_count, 'fallback')}"


def _worst_weights(weights: Sequence[WeightSqnrRow], k: int) -> list[WeightSqnrRow]:
    """The k lowest-SQNR rows (NaN first: a NaN is the worst)."""
    return sorted(weights, key=lambda w: (not math.isnan(w.sqnr_db), w.sqnr_db))[:k]


def nonfinite_note(report: Report) -> str | None:
    """One line on NaN / Inf values for the summary: where the first is, or "none found";
    None for a version 1 report (which did not record them)."""
    r = report
    if r.report_version < 2:
        return None
    if not r.nonfinite_layers and not r.nonfinite_weights:
        return "none found"
    parts = []
    if r.nonfinite_layers:
        first = [n for n in r.nonfinite_layers if n.name == r.first_nonfinite_layer]
        parts.append(f"first in layer {r.first_nonfinite_layer} ("
                     + "; ".join(describe_nonfinite(n) for n in first) + ")")
    if r.nonfinite_weights:
        w = r.nonfinite_weights
        parts.append(f"{len(w)} weight tensor{'s hold' if len(w) != 1 else ' holds'} NaN/Inf, first "
                     + describe_nonfinite(w[0]))
    return "; ".join(parts)


def _nonfinite_sides(report: Report) -> dict[str, str]:
    """layer name -> "candidate" / "reference" / "candidate, reference" for the non-finite outputs."""
    out: dict[str, list[str]] = {}
    for n in report.nonfinite_layers:
        out.setdefault(n.name, []).append(n.side)
    return {k: ", ".join(v) for k, v in out.items()}


def _md(s: str) -> str:
    """Text for a markdown table cell."""
    return str(s).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


# ----------------------------------------------------------------------------- markdown

def _md_side(label: str, m) -> list[str]:
    """One compared model's lines: path, format, stages; its quantization, fallbacks and
    --kl-budget choice (`ModelRef.mixed_precision`)."""
    out = [f"- {label}: `{_md(m.path)}` (format: {_md(m.format or 'none')}"
           + (f"; stages: {_md(' -> '.join(m.stages))}" if m.stages else "") + ")"]
    q = quantization_line(m)
    if q:
        out += [f"  - Quantization {_md(q)}"] + [f"    - {_md(line)}" for line in m.fallbacks]
        out += [f"  - Mixed precision: {_md(line)}" if i == 0 else f"    - {_md(line)}"
                for i, line in enumerate(m.mixed_precision)]
    return out


def render_markdown(report: Report, top_k_weights: int = 20) -> str:
    """report.md: summary, per-layer table (first divergent layer marked), logits, worst SQNR, thresholds."""
    r = report
    verdict = VERDICTS[r.status][0]
    out = [f"# cvt verify report: {verdict}", ""]
    for label, m in (("Candidate", r.candidate), ("Reference", r.reference)):
        out += _md_side(label, m)
    out += [
        f"- Data: {_md(r.data.source)}" + (f" `{_md(r.data.path)}`" if r.data.path else "")
        + f", {r.data.sequences} sequences, {r.data.tokens} tokens",
        f"- Tool: {r.tool.name} {_md(r.tool.version)}, report version {r.report_version}",
    ]
    note = nonfinite_note(r)
    if note:
        out.append(f"- Non-finite values: {_md(note)}")
    out.append("")

    if r.nonfinite_layers or r.nonfinite_weights:
        out += ["## Non-finite values (NaN / Inf)", "",
                "A NaN measurement fails every threshold. Where the values are:", "",
                "| Tensor | Kind | Side | NaN | +Inf | -Inf | Elements |", "|---|---|---|---:|---:|---:|---:|"]
        out += [f"| {_md(n.name)} | {kind} | {n.side} | {n.nan} | {n.posinf} | {n.neginf} | {n.numel} |"
                for kind, rows in (("layer output", r.nonfinite_layers), ("weight", r.nonfinite_weights))
                for n in rows]
        out.append("")

    out += ["## Per-layer comparison", ""]
    if r.layers:
        if r.first_divergent_layer:
            lim = r.thresholds.min_cosine
            out += [f"First divergent layer (Cosine < {fmt(lim)} or NaN): **{_md(r.first_divergent_layer)}**", ""]
        out.append("| # | Layer | " + " | ".join(c for _, c in LAYER_COLUMNS) + " |")
        out.append("|---:|---|" + "---:|" * len(LAYER_COLUMNS))
        sides = _nonfinite_sides(r)
        for i, row in enumerate(r.layers):
            bad = row.name == r.first_divergent_layer
            name = f"**{_md(row.name)}** (first divergent)" if bad else _md(row.name)
            if row.name in sides:
                name += f" (NaN/Inf: {sides[row.name]})"
            cells = [fmt_col(a, getattr(row, a)) for a, _ in LAYER_COLUMNS]
            if bad:
                cells = [f"**{c}**" for c in cells]
            out.append(f"| {i} | {name} | " + " | ".join(cells) + " |")
    else:
        out.append("No per-layer comparison.")
    out.append("")

    out += ["## Logits", ""]
    if r.logits is not None:
        out += ["| Metric | Value |", "|---|---:|"]
        out += [f"| {label} | {_fmt_logit(f, getattr(r.logits, f))} |" for f, label in LOGIT_ROWS]
    else:
        out.append("No logits comparison.")
    out.append("")

    worst = _worst_weights(r.weights, top_k_weights)
    out += [f"## Weight SQNR (worst {len(worst)} of {len(r.weights)})", ""]
    if worst:
        out += ["| Tensor | SQNR (dB) | Format |", "|---|---:|---|"]
        out += [f"| {_md(w.name)} | {fmt(w.sqnr_db)} | {_md(w.format)} |" for w in worst]
    else:
        out.append("No weight comparison.")
    out.append("")

    out += ["## Thresholds", ""]
    if r.checks:
        out += ["| Check | Limit | Value | Result | Detail |", "|---|---:|---:|---|---|"]
        out += [f"| {c.name} | {fmt(c.limit)} | {fmt(c.value)} | {'pass' if c.passed else '**FAIL**'} | "
                f"{_md(c.message)} |" for c in r.checks]
    else:
        out.append(f"No gates applied: {NO_GATES_HINT}.")
    out.append("")
    if r.violations:
        out += ["Violations:", ""] + [f"- {_md(v)}" for v in r.violations] + [""]
    out.append(f"Result: **{verdict}**")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- HTML

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 24px; color: #1d2330; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #d0d5dd; }
.verdict { display: inline-block; padding: 2px 10px; border-radius: 4px; color: #fff; }
.pass { background: #1a7f37; } .fail { background: #cf222e; } .nogates { background: #6e7781; }
table { border-collapse: collapse; font-size: 0.9em; margin: 8px 0; }
th, td { border: 1px solid #d0d5dd; padding: 3px 8px; } th { background: #f3f5f8; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.bad td { background: #ffebe9; font-weight: bold; }
td.failcell { color: #cf222e; font-weight: bold; } td.passcell { color: #1a7f37; }
code { background: #f3f5f8; padding: 0 3px; }
svg.plot { display: block; margin: 12px 0; background: #fff; border: 1px solid #d0d5dd; }
svg .ptitle { font-size: 14px; font-weight: bold; fill: #1d2330; }
svg .tick { font-size: 10px; fill: #4a5160; } svg .axis { font-size: 12px; fill: #1d2330; }
svg .frame { fill: none; stroke: #9aa3b2; } svg .grid { stroke: #e6e9ef; } svg .axisline { stroke: #9aa3b2; }
svg .series { fill: none; stroke: #2f6fde; stroke-width: 1.5; }
svg .pok { fill: #2f6fde; } svg .pbad { fill: #cf222e; }
svg .limit { stroke: #cf222e; stroke-dasharray: 5 4; } svg .limtext { fill: #cf222e; }
svg .firstbad { stroke: #cf222e; stroke-width: 1; opacity: 0.5; }
svg .bar { fill: #2f6fde; }
"""


def _table(header: Sequence[str], rows: Iterable[tuple[Sequence[tuple[str, str]], str]]) -> str:
    """rows: (cells as (text, css class), row css class); all text escaped here."""
    out = ["<table>", "<tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr>"]
    for cells, cls in rows:
        tr = f'<tr class="{cls}">' if cls else "<tr>"
        out.append(tr + "".join(f'<td class="{c}">{esc(t)}</td>' if c else f"<td>{esc(t)}</td>"
                                for t, c in cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def render_html(report: Report, kl_values=None, top_k_weights: int = 20) -> str:
    """report.html: self-contained (inline CSS and SVG, no scripts, no external resources)."""
    r = report
    verdict, badge = VERDICTS[r.status]
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
           f"<title>cvt verify report: {verdict}</title>", f"<style>{_CSS}</style>", "</head>", "<body>",
           f'<h1>cvt verify report <span class="verdict {badge}">{verdict}</span></h1>']
    out += _html_sides(r) + _html_nonfinite(r) + _html_layers(r) + _html_logits(r, kl_values)
    out += _html_weights(r, top_k_weights) + _html_thresholds(r)
    out += [f'<p>Result: <span class="verdict {badge}">{verdict}</span></p>',
            "</body>", "</html>"]
    return "\n".join(out) + "\n"


def _html_mixed(lines: list[str]) -> str:
    """--kl-budget's lines (`ModelRef.mixed_precision`): the first, then the kept units under it."""
    if not lines:
        return ""
    kept = "<ul>" + "".join(f"<li>{esc(line)}</li>" for line in lines[1:]) + "</ul>" if lines[1:] else ""
    return f"<li>Mixed precision: {esc(lines[0])}{kept}</li>"


def _html_sides(r: Report) -> list[str]:
    """The compared models, the data, the tool, and a note on non-finite values."""
    def side(label: str, m) -> str:
        extra = f"format {m.format or 'none'}" + (f"; stages: {' -> '.join(m.stages)}" if m.stages else "")
        q = quantization_line(m)
        quant = "" if q is None else (f"<ul><li>Quantization {esc(q)}" + (
            "<ul>" + "".join(f"<li>{esc(line)}</li>" for line in m.fallbacks) + "</ul>" if m.fallbacks else "")
            + "</li>" + _html_mixed(m.mixed_precision) + "</ul>")
        return f"<li>{esc(label)}: <code>{esc(m.path)}</code> ({esc(extra)}){quant}</li>"

    data = f"{r.data.source}" + (f" {r.data.path}" if r.data.path else "") + \
        f", {r.data.sequences} sequences, {r.data.tokens} tokens"
    out = ["<ul>", side("Candidate", r.candidate), side("Reference", r.reference),
           f"<li>Data: {esc(data)}</li>",
           f"<li>Tool: {esc(r.tool.name)} {esc(r.tool.version)}, report version {r.report_version}</li>"]
    note = nonfinite_note(r)
    if note:
        out.append(f'<li>Non-finite values: <strong>{esc(note)}</strong></li>' if r.nonfinite_layers or
                   r.nonfinite_weights else f"<li>Non-finite values: {esc(note)}</li>")
    out.append("</ul>")
    return out


def _html_nonfinite(r: Report) -> list[str]:
    """Where the NaN / Inf values are (nothing when there are none)."""
    if not (r.nonfinite_layers or r.nonfinite_weights):
        return []
    return ["<h2>Non-finite values (NaN / Inf)</h2>",
            "<p>A NaN measurement fails every threshold. Where the values are:</p>",
            _table(["Tensor", "Kind", "Side", "NaN", "+Inf", "-Inf", "Elements"],
                   [([(n.name, ""), (kind, ""), (n.side, ""), (str(n.nan), "num"), (str(n.posinf), "num"),
                      (str(n.neginf), "num"), (str(n.numel), "num")], "bad")
                    for kind, rows in (("layer output", r.nonfinite_layers), ("weight", r.nonfinite_weights))
                    for n in rows])]


def _html_layers(r: Report) -> list[str]:
    """The per-layer cosine plot and table, the first divergent layer marked."""
    out = ["<h2>Per-layer comparison</h2>", cosine_plot_svg(r.layers, r.thresholds.min_cosine, r.first_divergent_layer)]
    if not r.layers:
        return out + ["<p>No per-layer comparison.</p>"]
    if r.first_divergent_layer:
        out.append(f"<p>First divergent layer (Cosine &lt; {esc(fmt(r.thresholds.min_cosine))} or NaN): "
                   f"<strong>{esc(r.first_divergent_layer)}</strong></p>")
    rows = []
    sides = _nonfinite_sides(r)
    for i, row in enumerate(r.layers):
        bad = row.name == r.first_divergent_layer
        label = row.name + (" (first divergent)" if bad else "")
        if row.name in sides:
            label += f" (NaN/Inf: {sides[row.name]})"
        cells = [(str(i), "num"), (label, "")]
        cells += [(fmt_col(a, getattr(row, a)), "num") for a, _ in LAYER_COLUMNS]
        rows.append((cells, "bad" if bad else ""))
    out.append(_table(["#", "Layer"] + [c for _, c in LAYER_COLUMNS], rows))
    return out


def _html_logits(r: Report, kl_values) -> list[str]:
    """The KL histogram and the logits metrics."""
    out = ["<h2>Logits</h2>", kl_histogram_svg(kl_values)]
    if r.logits is not None:
        out.append(_table(["Metric", "Value"], [([(label, ""), (_fmt_logit(f, getattr(r.logits, f)), "num")], "")
                                                for f, label in LOGIT_ROWS]))
    else:
        out.append("<p>No logits comparison.</p>")
    return out


def _html_weights(r: Report, top_k_weights: int) -> list[str]:
    """The weights of worst SQNR."""
    worst = _worst_weights(r.weights, top_k_weights)
    out = [f"<h2>Weight SQNR (worst {len(worst)} of {len(r.weights)})</h2>"]
    if worst:
        out.append(_table(["Tensor", "SQNR (dB)", "Format"],
                          [([(w.name, ""), (fmt(w.sqnr_db), "num"), (w.format, "")], "") for w in worst]))
    else:
        out.append("<p>No weight comparison.</p>")
    return out


def _html_thresholds(r: Report) -> list[str]:
    """The gates applied, each with its limit, value and result, then the violations."""
    out = ["<h2>Thresholds</h2>"]
    if r.checks:
        out.append(_table(["Check", "Limit", "Value", "Result", "Detail"],
                          [([(c.name, ""), (fmt(c.limit), "num"), (fmt(c.value), "num"),
                             ("pass" if c.passed else "FAIL", "passcell" if c.passed else "failcell"),
                             (c.message, "")], "" if c.passed else "bad") for c in r.checks]))
    else:
        out.append(f"<p>No gates applied: {esc(NO_GATES_HINT)}.</p>")
    if r.violations:
        out.append("<p>Violations:</p><ul>" + "".join(f"<li>{esc(v)}</li>" for v in r.violations) + "</ul>")
    return out


# ----------------------------------------------------------------------------- files

def write_report(report: Report, folder: Path, kl_values=None, top_k_weights: int = 20) -> dict[str, Path]:
    """Write report.json, report.md and report.html into `folder` (created if missing).

    report: the validated `Report`; the cosine plot is drawn from `report.layers`.
    kl_values: per-token KL [N] (tensor, array or sequence; `logit_stats(...)["kl_per_token"]`)
        for the histogram, or None (the plot then says so).
    top_k_weights: how many lowest-SQNR weights the md/html tables list (json keeps all).
    Returns {"json": path, "md": path, "html": path}.
    """
    from cvt.convert.durable import write_bytes_atomic
    from cvt.errors import OutputError

    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{folder}: cannot create the report folder: {exc.strerror or exc}") from None
    paths = {"json": folder / "report.json", "md": folder / "report.md", "html": folder / "report.html"}
    data = {"html": render_html(report, kl_values, top_k_weights), "md": render_markdown(report, top_k_weights),
            "json": report.model_dump_json(indent=2, by_alias=True) + "\n"}
    # all three or none: each written atomically (temp + fsync + rename), report.json last as the
    # completion marker; an earlier report's files go first, so a failure (a full disk) leaves
    # no mix of old and new and nothing complete-looking
    for p in paths.values():
        p.unlink(missing_ok=True)
    try:
        for kind in ("html", "md", "json"):
            write_bytes_atomic(paths[kind], data[kind].encode("utf-8"))
    except BaseException:
        for p in paths.values():
            p.unlink(missing_ok=True)
        raise
    return paths
