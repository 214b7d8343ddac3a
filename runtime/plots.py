"""The verify report's plots and number formats: the per-layer cosine line and the per-token KL
histogram as inline SVG (the HTML report embeds them; no plotting library, no JavaScript).
`cvt.runtime.report` renders the rest."""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence

from cvt.schemas.report import LayerRow

COSINE_PLOT_TITLE = "Per-layer cosine similarity (candidate vs reference)"
KL_PLOT_TITLE = "Per-token KL divergence (reference || candidate), histogram"


def fmt(v, digits: int = 4) -> str:
    """A metric for display: ints as is, floats to `digits` significant digits, inf/nan by name."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.{digits}g}"


def fmt_col(attr: str, v: float) -> str:
    if attr == "cosine" and math.isfinite(v):
        return f"{v:.6f}"
    return fmt(v)



def esc(s) -> str:
    """HTML-escaped text (quotes too), for the report's markup."""
    return html.escape(str(s), quote=True)


def _svg_open(title: str, w: int, h: int) -> list[str]:
    return [f'<svg class="plot" role="img" aria-label="{esc(title)}" width="{w}" height="{h}" '
            f'viewBox="0 0 {w} {h}">', f"<title>{esc(title)}</title>",
            f'<text x="{w / 2:.1f}" y="18" text-anchor="middle" class="ptitle">{esc(title)}</text>']


def cosine_plot_svg(rows: Sequence[LayerRow], min_cosine: float | None, first_bad: str | None,
                    width: int = 900, height: int = 360) -> str:
    """Line plot of each layer's Cosine, threshold dashed, points below it red, first bad layer marked."""
    parts = _svg_open(COSINE_PLOT_TITLE, width, height)
    left, right, top, bottom = 70, 20, 34, 90
    pw, ph = width - left - right, height - top - bottom
    vals = [r.cosine for r in rows]
    finite = [v for v in vals if math.isfinite(v)]
    if not rows:
        parts.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle">no per-layer comparison</text>')
        return "\n".join(parts + ["</svg>"])
    lo = min(finite + ([min_cosine] if min_cosine is not None else []), default=0.0)
    lo = min(lo, 0.999)
    hi = 1.0
    lo = max(-1.0, lo - 0.1 * (hi - lo))
    span = hi - lo

    def x_of(i: int) -> float:
        return left + (pw * (i + 0.5) / len(rows))

    def y_of(v: float) -> float:
        if not math.isfinite(v):
            return top + ph
        return top + ph * (hi - min(max(v, lo), hi)) / span

    # Axes, grid and y ticks.
    parts.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="frame"/>')
    for k in range(6):
        v = lo + span * k / 5
        y = y_of(v)
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" class="grid"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">{esc(f"{v:.4f}")}</text>')
    parts.append(f'<text x="16" y="{top + ph / 2:.1f}" transform="rotate(-90 16 {top + ph / 2:.1f})" '
                 f'text-anchor="middle" class="axis">Cosine</text>')
    if min_cosine is not None:
        y = y_of(min_cosine)
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" class="limit"/>')
        parts.append(f'<text x="{left + pw - 4}" y="{y - 4:.1f}" text-anchor="end" class="tick limtext">'
                     f'min_cosine {esc(fmt(min_cosine))}</text>')
    # The line and the points.
    pts = " ".join(f"{x_of(i):.1f},{y_of(v):.1f}" for i, v in enumerate(vals))
    parts.append(f'<polyline points="{pts}" class="series"/>')
    step = max(1, math.ceil(len(rows) / 40))
    for i, row in enumerate(rows):
        v = row.cosine
        bad = math.isnan(v) or (min_cosine is not None and v < min_cosine)
        x, y = x_of(i), y_of(v)
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" class="{"pbad" if bad else "pok"}">'
                     f"<title>{esc(row.name)}: {esc(fmt_col('cosine', v))}</title></circle>")
        if row.name == first_bad:
            parts.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" class="firstbad"/>')
            parts.append(f'<text x="{x + 4:.1f}" y="{top + 12}" class="tick limtext">first divergent: '
                         f"{esc(row.name)}</text>")
        if i % step == 0 or row.name == first_bad:
            parts.append(f'<text x="{x:.1f}" y="{top + ph + 10}" transform="rotate(60 {x:.1f} {top + ph + 10})" '
                         f'class="tick">{esc(row.name)}</text>')
    return "\n".join(parts + ["</svg>"])


def kl_histogram_svg(kl_values: Iterable[float] | None, width: int = 900, height: int = 340) -> str:
    """Histogram of per-token KL on log-spaced bins (~40, >= 5 per decade); zeros, inf and NaN counted apart."""
    parts = _svg_open(KL_PLOT_TITLE, width, height)
    vals = [] if kl_values is None else [float(v) for v in _flat(kl_values)]
    if not vals:
        parts.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle">no per-token KL values</text>')
        return "\n".join(parts + ["</svg>"])
    left, right, top, bottom = 70, 20, 34, 60
    pw, ph = width - left - right, height - top - bottom
    n_nan = sum(1 for v in vals if math.isnan(v))
    n_inf = sum(1 for v in vals if math.isinf(v))
    pos = [v for v in vals if math.isfinite(v) and v > 0]
    n_zero = sum(1 for v in vals if v == 0 or (math.isfinite(v) and v < 0))
    if pos:
        d_lo = math.floor(math.log10(min(pos)))
        d_hi = max(d_lo + 1, math.ceil(math.log10(max(pos))))
        d_lo = max(d_lo, d_hi - 12)  # at most 12 decades; smaller values go to the first bin
    else:
        d_lo, d_hi = -6, 0
    per_decade = max(5, min(20, 40 // (d_hi - d_lo)))  # about 40 bins
    nb = (d_hi - d_lo) * per_decade
    counts = [0] * nb
    for v in pos:
        b = int((math.log10(v) - d_lo) * per_decade)
        counts[min(max(b, 0), nb - 1)] += 1
    peak = max(counts + [n_zero, 1])

    def x_of(logv: float) -> float:
        return left + pw * (logv - d_lo) / (d_hi - d_lo)

    def y_of(c: float) -> float:
        return top + ph * (1 - c / peak)

    parts.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="frame"/>')
    for k in range(5):
        c = peak * k / 4
        y = y_of(c)
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" class="grid"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">{c:.0f}</text>')
    parts.append(f'<text x="16" y="{top + ph / 2:.1f}" transform="rotate(-90 16 {top + ph / 2:.1f})" '
                 f'text-anchor="middle" class="axis">tokens</text>')
    for d in range(d_lo, d_hi + 1):
        x = x_of(d)
        parts.append(f'<line x1="{x:.1f}" y1="{top + ph}" x2="{x:.1f}" y2="{top + ph + 5}" class="axisline"/>')
        parts.append(f'<text x="{x:.1f}" y="{top + ph + 18}" text-anchor="middle" class="tick">1e{d}</text>')
    parts.append(f'<text x="{left + pw / 2:.1f}" y="{height - 8}" text-anchor="middle" class="axis">'
                 f"KL divergence per token (nats, log scale)</text>")
    bw = pw / nb
    for b, c in enumerate(counts):
        if c == 0:
            continue
        x, y = left + b * bw, y_of(c)
        lo_edge, hi_edge = 10 ** (d_lo + b / per_decade), 10 ** (d_lo + (b + 1) / per_decade)
        parts.append(f'<rect x="{x + 0.5:.1f}" y="{y:.1f}" width="{max(bw - 1, 0.5):.1f}" height="{top + ph - y:.1f}" '
                     f'class="bar"><title>{esc(f"{lo_edge:.3g} .. {hi_edge:.3g}")}: {c} tokens</title></rect>')
    notes = [f"{len(vals)} tokens"]
    if n_zero:
        notes.append(f"{n_zero} with KL = 0 (not drawn)")
    if n_inf:
        notes.append(f"{n_inf} with KL = inf")
    if n_nan:
        notes.append(f"{n_nan} NaN")
    finite = [v for v in vals if math.isfinite(v)]
    if finite:
        mean = sum(finite) / len(finite)
        if mean > 0:
            x = x_of(min(max(math.log10(mean), d_lo), d_hi))
            parts.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" class="limit"/>')
            parts.append(f'<text x="{x + 4:.1f}" y="{top + 12}" class="tick limtext">mean {esc(fmt(mean))}</text>')
    parts.append(f'<text x="{left + pw - 4}" y="{top + 12}" text-anchor="end" class="tick">{esc("; ".join(notes))}</text>')
    return "\n".join(parts + ["</svg>"])


def _flat(values) -> list:
    if hasattr(values, "detach"):  # torch tensor
        return values.detach().to("cpu").double().reshape(-1).tolist()
    if hasattr(values, "ravel"):  # numpy array
        return values.ravel().tolist()
    return list(values)
