"""Accuracy metrics, in one place: used by the tests, `cvt verify` and the benchmarks alike.

Tensor level (names as Ascend's compare tools print them, see FORMATS.md section 4):

| column                        | function               | definition                                          |
|-------------------------------|------------------------|-----------------------------------------------------|
| `Cosine`                      | `cosine(a, b)`         | a.b / (|a| |b|); 1.0 when both are all zero          |
| `MaxAbsErr`                   | `max_abs_err(a, b)`    | max |a - b|                                         |
| `MaxRelativeErr`              | `max_rel_err(a, b)`    | max |a/b - 1| over the elements with |b| > eps       |
| `One Thousandth Err Ratio`    | `thousandth_ratio`     | share of elements with rel_err < 0.001              |
| `Five Thousandth Err Ratio`   | `five_thousandth_ratio`| share of elements with rel_err < 0.005              |
| `EucDist`                     | `euc_dist(a, b)`       | |a - b| / |b|                                       |

`a` is the candidate, `b` the reference. For the ratios the per-element relative error is
`rel_err = |a - b| / max(|b|, eps)`: where the reference is (near) zero, `|b| <= eps`, the
error is measured against `eps` instead, so `a == b == 0` counts as exact and a candidate that
is not (near) zero where the reference is counts as an error.

Weight level: `sqnr_db(w, w_hat) = 20 log10(|w| / |w - w_hat|)`.

Logits level (as llama.cpp's `--kl-divergence` report): `logit_stats(cand, ref, targets)` gives
both perplexities and their ratio, KL(ref || cand) per token with mean / median / p99 / p99.9 /
max, the "same top-1" share and RMS of Δp.

Everything is computed in float64 on the CPU, whatever the inputs' dtype and device.

Non-finite inputs (NaN, +-Inf) never give a value that looks good: `Cosine`, the two ratios and
the KL / PPL / top-1 statistics are NaN; `MaxAbsErr` follows IEEE arithmetic (NaN when a NaN is
involved, else inf); `MaxRelativeErr` and `EucDist` are NaN when either side holds a NaN or the
reference an Inf, inf when only the candidate holds an Inf; SQNR is NaN for a NaN on either side
or an Inf in `w`, -inf for an Inf only in `w_hat`. -inf logits are ordinary (probability 0).
No metric raises on them. `nonfinite_counts(t)` counts NaN / +Inf / -Inf elements of a tensor.
"""

from __future__ import annotations

import math

from cvt.lazy import torch

EPS = 1e-9
"""Default `eps`: a reference element with `|b| <= EPS` counts as zero for relative errors."""

COLUMNS = (
    "Cosine",
    "MaxAbsErr",
    "MaxRelativeErr",
    "One Thousandth Err Ratio",
    "Five Thousandth Err Ratio",
    "EucDist",
)
"""The per-tensor comparison columns, in Ascend's order; the keys of `compare_tensors`."""


def _pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both tensors flattened to float64 on the CPU; shapes must match."""
    a = torch.as_tensor(a)
    b = torch.as_tensor(b)
    if a.shape != b.shape:
        raise ValueError(f"cannot compare tensors of different shapes: candidate {tuple(a.shape)} "
                         f"vs reference {tuple(b.shape)}")
    return (a.detach().to(device="cpu", dtype=torch.float64).reshape(-1),
            b.detach().to(device="cpu", dtype=torch.float64).reshape(-1))


def _nonfinite(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """None when both (paired) tensors are all finite; else NaN when either holds a NaN or the
    reference `b` an Inf (a relative measure against it is undefined), inf when only the
    candidate `a` holds +-Inf."""
    if bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all()):
        return None
    if bool(torch.isnan(a).any()) or not bool(torch.isfinite(b).all()):
        return math.nan
    return math.inf


def nonfinite_counts(t: torch.Tensor, chunk: int = 1 << 24) -> tuple[int, int, int]:
    """(NaN, +Inf, -Inf) element counts of a tensor of any dtype and device (0s for integers).

    Chunked, so a large weight needs no full-size temporary; float8 chunks are widened first.
    """
    t = torch.as_tensor(t).detach()
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        return 0, 0, 0
    if t.dtype.is_complex:
        t = torch.view_as_real(t)
    flat = t.reshape(-1)
    nan = pinf = ninf = 0
    for i in range(0, flat.numel(), chunk):
        x = flat[i : i + chunk]
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            x = x.to(torch.float32)
        if bool(torch.isfinite(x).all()):
            continue
        nan += int(torch.isnan(x).sum())
        pinf += int(torch.isposinf(x).sum())
        ninf += int(torch.isneginf(x).sum())
    return nan, pinf, ninf


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two same-shape tensors (any shape, flattened).

    1.0 when both are all zero, 0.0 when exactly one is; NaN if either holds a NaN or an Inf.
    """
    a, b = _pair(a, b)
    return _cosine(a, b) if _nonfinite(a, b) is None else math.nan


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """`cosine` of paired, all-finite tensors."""
    aa, bb, ab = torch.dot(a, a).item(), torch.dot(b, b).item(), torch.dot(a, b).item()
    if aa == 0.0 and bb == 0.0:
        return 1.0
    if aa == 0.0 or bb == 0.0:
        return 0.0
    if math.isinf(aa) or math.isinf(bb) or math.isinf(ab):  # finite float64 inputs beyond ~1e154
        return _cosine(a / a.abs().max(), b / b.abs().max())
    # ab / sqrt(aa * bb) in float64: identical inputs give exactly 1 (sqrt(fl(x*x)) == x), where
    # normalizing first would leave rounding noise; float64 cannot overflow for activations.
    if math.isinf(aa * bb):
        return max(-1.0, min(1.0, ab / (math.sqrt(aa) * math.sqrt(bb))))
    return max(-1.0, min(1.0, ab / math.sqrt(aa * bb)))


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over all elements (0.0 for empty tensors).

    IEEE arithmetic for non-finite inputs: NaN when a NaN is involved (or Inf - Inf), else inf.
    """
    a, b = _pair(a, b)
    if a.numel() == 0:
        return 0.0
    return float((a - b).abs().max().item())


def max_rel_err(a: torch.Tensor, b: torch.Tensor, eps: float = EPS) -> float:
    """max |a/b - 1| over the elements where |b| > eps (0.0 when there are none).

    Elements where the reference is (near) zero are left out here; `max_abs_err` covers them.
    Non-finite inputs: NaN when either holds a NaN or the reference an Inf, inf when only the
    candidate holds +-Inf (wherever it is).
    """
    a, b = _pair(a, b)
    bad = _nonfinite(a, b)
    return _max_rel_err(a, b, eps) if bad is None else bad


def _max_rel_err(a: torch.Tensor, b: torch.Tensor, eps: float) -> float:
    keep = b.abs() > eps
    if not bool(keep.any()):
        return 0.0
    return float((a[keep] / b[keep] - 1.0).abs().max().item())


def rel_err(a: torch.Tensor, b: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Per-element relative error |a - b| / max(|b|, eps), float64, flattened [numel].

    NaN where the reference is non-finite or the candidate NaN; inf where only the candidate is +-Inf.
    """
    a, b = _pair(a, b)
    r = (a - b).abs() / b.abs().clamp_min(eps)
    return r if bool(torch.isfinite(b).all()) else torch.where(torch.isfinite(b), r, math.nan)


def _ratio_below(a: torch.Tensor, b: torch.Tensor, tol: float, eps: float) -> float:
    a, b = _pair(a, b)
    if _nonfinite(a, b) is not None:  # a share over NaN / Inf elements would look good: none given
        return math.nan
    return _shares(a, b, (tol,), eps)[0]


def _shares(a: torch.Tensor, b: torch.Tensor, tols: tuple[float, ...], eps: float) -> list[float]:
    """Share of elements with relative error below each tol, for paired all-finite tensors."""
    if a.numel() == 0:
        return [1.0] * len(tols)
    r = (a - b).abs() / b.abs().clamp_min(eps)
    return [float((r < tol).sum().item() / r.numel()) for tol in tols]


def thousandth_ratio(a: torch.Tensor, b: torch.Tensor, eps: float = EPS) -> float:
    """Share (0..1) of elements with relative error below 0.001 (see `rel_err`; 1.0 when empty;
    NaN when either input holds a NaN or an Inf)."""
    return _ratio_below(a, b, 0.001, eps)


def five_thousandth_ratio(a: torch.Tensor, b: torch.Tensor, eps: float = EPS) -> float:
    """Share (0..1) of elements with relative error below 0.005 (see `rel_err`; 1.0 when empty;
    NaN when either input holds a NaN or an Inf)."""
    return _ratio_below(a, b, 0.005, eps)


def euc_dist(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Euclidean distance |a - b| / |b|: 0.0 when a == b, inf when only b is zero.

    Non-finite inputs: NaN when either holds a NaN or the reference an Inf, inf when only the
    candidate holds +-Inf.
    """
    a, b = _pair(a, b)
    bad = _nonfinite(a, b)
    return _euc_dist(a, b) if bad is None else bad


def _euc_dist(a: torch.Tensor, b: torch.Tensor) -> float:
    d = torch.linalg.vector_norm(a - b).item()
    nb = torch.linalg.vector_norm(b).item()
    if d == 0.0:
        return 0.0
    return d / nb if nb > 0.0 else math.inf


def sqnr_db(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(|w| / |w - w_hat|).

    w: the original (high precision) tensor, w_hat: its dequantized approximation, same shape.
    inf when w_hat == w exactly (including both zero), -inf when w is zero and w_hat is not.
    Non-finite inputs: NaN when either holds a NaN or `w` an Inf (or Inf - Inf), -inf when only
    `w_hat` holds +-Inf (infinite noise).
    """
    if w.shape != w_hat.shape:
        raise ValueError(f"shape mismatch: {list(w.shape)} vs {list(w_hat.shape)}")
    # dot products (float32, or float64 for float64 inputs) over chunks of 1M elements, summed in
    # float64: ample for a dB figure,
    # fast, and memory stays bounded for the largest weights (whole-tensor float64 copies of a
    # 7168x16384 weight would be ~1 GB each)
    a, b = w.detach().reshape(-1), w_hat.detach().reshape(-1).to(w.device)
    dt = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)  # float64 stays float64
    sig = err = 0.0
    step = 1 << 20
    for i in range(0, a.numel(), step):
        x, y = a[i : i + step].to(dt), b[i : i + step].to(dt)
        s, e = _sq_sums(x, y)
        if dt != torch.float64 and (math.isinf(s) or math.isinf(e)):  # float32 overflow, or a real Inf
            s, e = _sq_sums(x.double(), y.double())
        sig += s
        err += e
    return sqnr_from_sums(sig, err)


def sqnr_from_sums(sig: float, err: float) -> float:
    """`sqnr_db` from its two sums, sum w^2 and sum (w - w_hat)^2 (also what the fused quantize
    kernels accumulate, `cvt.quant.qkernel`)."""
    if math.isnan(sig) or math.isnan(err) or math.isinf(sig):
        return math.nan  # a NaN on either side, Inf - Inf, or an Inf in w: undefined
    if math.isinf(err):
        return -math.inf  # w finite, w_hat holds +-Inf: infinite noise
    noise, signal = math.sqrt(err), math.sqrt(sig)
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    r = signal / noise
    if r == 0.0 or math.isinf(r):  # the quotient under/overflows: take the logs apart
        return 20.0 * (math.log10(signal) - math.log10(noise))
    return 20.0 * math.log10(r)


def _sq_sums(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(x.x, (x - y).(x - y)) as Python floats."""
    d = x - y
    return float(torch.dot(x, x)), float(torch.dot(d, d))


def compare_tensors(a: torch.Tensor, b: torch.Tensor, eps: float = EPS) -> dict[str, float]:
    """All six Ascend columns for candidate `a` against reference `b` (same shape, any shape).

    Returns {"Cosine", "MaxAbsErr", "MaxRelativeErr", "One Thousandth Err Ratio",
    "Five Thousandth Err Ratio", "EucDist"} -> float, in that order (`COLUMNS`).
    """
    a, b = _pair(a, b)
    bad = _nonfinite(a, b)
    if bad is not None:  # checked once here rather than by every column
        return {
            "Cosine": math.nan,
            "MaxAbsErr": max_abs_err(a, b),
            "MaxRelativeErr": bad,
            "One Thousandth Err Ratio": math.nan,
            "Five Thousandth Err Ratio": math.nan,
            "EucDist": bad,
        }
    r1, r5 = _shares(a, b, (0.001, 0.005), eps)
    return {
        "Cosine": _cosine(a, b),
        "MaxAbsErr": max_abs_err(a, b),
        "MaxRelativeErr": _max_rel_err(a, b, eps),
        "One Thousandth Err Ratio": r1,
        "Five Thousandth Err Ratio": r5,
        "EucDist": _euc_dist(a, b),
    }


LOGIT_STAT_KEYS = (
    "tokens",
    "ppl_candidate",
    "ppl_reference",
    "ppl_ratio",
    "kl_mean",
    "kl_median",
    "kl_p99",
    "kl_p999",
    "kl_max",
    "same_top1",
    "rms_delta_p",
)
"""The scalar keys of `logit_stats` (also the fields of `cvt.schemas.report.LogitStats`)."""


def logit_stats(cand_logits: torch.Tensor, ref_logits: torch.Tensor, targets: torch.Tensor,
                chunk_rows: int = 64) -> dict:
    """Compare candidate and reference next-token distributions on the same tokens.

    cand_logits, ref_logits: [N, V] (or [..., V], flattened to [N, V]) raw logits of the
        candidate and the reference at N positions.
    targets: [N] (or [...] matching the leading dims) int, the true next token at each position.
    chunk_rows: rows processed at a time (bounds the float64 working memory to ~chunk_rows * V).

    Returns a dict:
      tokens         N
      ppl_candidate  exp(mean_i -log p_cand(targets_i))
      ppl_reference  exp(mean_i -log p_ref(targets_i))
      ppl_ratio      ppl_candidate / ppl_reference
      kl_mean, kl_median, kl_p99, kl_p999, kl_max
                     statistics of KL_i = sum_v p_ref,i(v) (log p_ref,i(v) - log p_cand,i(v))
                     (percentiles by linear interpolation, as numpy's default)
      same_top1      share (0..1) of positions where argmax cand == argmax ref
      rms_delta_p    sqrt(mean_i dp_i^2), dp_i = p_cand(targets_i) - p_ref(targets_i), as a
                     fraction (llama.cpp prints it in percent)
      kl_per_token   float64 tensor [N] of KL_i, for the histogram
    KL_i is clamped at 0 (float64 rounding can give -1e-17 for identical rows).

    Non-finite logits: a row holding a NaN or a +Inf (its log-softmax is NaN) makes that
    position's KL, NLL and dp NaN, so every mean, percentile, PPL and their ratio, and
    same_top1 are NaN (never a passing value). -inf logits are probability 0: KL_i is +inf where
    the reference gives a token the candidate rules out, PPL inf where a side rules out the
    target; the ratio is NaN when the reference PPL is infinite (undefined).
    """
    cand_logits, ref_logits, targets = _flat_inputs(cand_logits, ref_logits, targets)
    kl, nll_cand, nll_ref, dp, same, nan_rows = _per_position(cand_logits, ref_logits, targets, chunk_rows)
    mean_c, mean_r = nll_cand.mean().item(), nll_ref.mean().item()
    ppl_c, ppl_r = _exp(mean_c), _exp(mean_r)
    if math.isnan(mean_c) or math.isnan(mean_r) or math.isinf(mean_r):
        ratio = math.nan  # a NaN, or an infinite reference PPL: undefined
    elif math.isfinite(ppl_c) and math.isfinite(ppl_r):
        ratio = ppl_c / ppl_r  # ppl_r >= 1 (NLL >= 0)
    else:  # PPL beyond float range (mean NLL > ~709): the ratio may still be finite
        ratio = _exp(mean_c - mean_r)
    q = quantiles(kl, [0.5, 0.99, 0.999])
    return {
        "tokens": targets.numel(),
        "ppl_candidate": ppl_c,
        "ppl_reference": ppl_r,
        "ppl_ratio": ratio,
        "kl_mean": kl.mean().item(),
        "kl_median": q[0],
        "kl_p99": q[1],
        "kl_p999": q[2],
        "kl_max": kl.max().item(),
        "same_top1": math.nan if nan_rows else same.double().mean().item(),
        "rms_delta_p": dp.square().mean().sqrt().item(),
        "kl_per_token": kl,
    }


def _flat_inputs(cand_logits, ref_logits, targets) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits as [N, V] and the targets as CPU int64 [N]; ValueError for shapes that do not
    match, non-integer targets, N = 0 or a target outside the vocabulary."""
    cand_logits = torch.as_tensor(cand_logits)
    ref_logits = torch.as_tensor(ref_logits)
    targets = torch.as_tensor(targets)
    if cand_logits.shape != ref_logits.shape or cand_logits.dim() < 2:
        raise ValueError(f"logits must have the same shape [N, V]: candidate {tuple(cand_logits.shape)} "
                         f"vs reference {tuple(ref_logits.shape)}")
    if tuple(targets.shape) != tuple(cand_logits.shape[:-1]):
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match logits shape "
                         f"{tuple(cand_logits.shape)} (expected {tuple(cand_logits.shape[:-1])})")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer token ids, got dtype {targets.dtype}")
    vocab = cand_logits.shape[-1]
    cand_logits = cand_logits.reshape(-1, vocab)
    ref_logits = ref_logits.reshape(-1, vocab)
    targets = targets.reshape(-1).to(device="cpu", dtype=torch.long)
    if targets.numel() == 0:
        raise ValueError("logit_stats needs at least one position (got N = 0)")
    bad = (targets < 0) | (targets >= vocab)
    if bool(bad.any()):
        i = int(bad.nonzero()[0].item())
        raise ValueError(f"target token id {int(targets[i])} at position {i} is outside the vocabulary [0, {vocab})")
    return cand_logits, ref_logits, targets


def _per_position(cand_logits: torch.Tensor, ref_logits: torch.Tensor, targets: torch.Tensor, chunk_rows: int):
    """Per position, in float64, `chunk_rows` rows at a time: (KL, candidate NLL, reference NLL,
    dp, same top-1, and how many rows hold a NaN)."""
    n = targets.numel()
    kl = torch.empty(n, dtype=torch.float64)
    nll_cand = torch.empty(n, dtype=torch.float64)
    nll_ref = torch.empty(n, dtype=torch.float64)
    dp = torch.empty(n, dtype=torch.float64)
    same = torch.empty(n, dtype=torch.bool)
    nan_rows = 0
    for s in range(0, n, chunk_rows):
        e = min(n, s + chunk_rows)
        lc = torch.log_softmax(cand_logits[s:e].detach().to(device="cpu", dtype=torch.float64), dim=-1)
        lr = torch.log_softmax(ref_logits[s:e].detach().to(device="cpu", dtype=torch.float64), dim=-1)
        pr = lr.exp()
        # p_ref = 0 contributes 0 (avoids 0 * (-inf - x) = nan); a NaN p_ref stays NaN (`pr > 0`
        # would zero it and report KL 0 for a NaN reference row).
        kl[s:e] = torch.where(pr == 0, torch.zeros_like(pr), pr * (lr - lc)).sum(-1).clamp_min(0.0)
        t = targets[s:e, None]
        lct, lrt = lc.gather(-1, t)[:, 0], lr.gather(-1, t)[:, 0]
        nll_cand[s:e], nll_ref[s:e] = -lct, -lrt
        dp[s:e] = lct.exp() - lrt.exp()
        same[s:e] = lc.argmax(-1) == lr.argmax(-1)  # argmax of a NaN row means nothing: see nan_rows
        nan_rows += int((torch.isnan(lc).any(-1) | torch.isnan(lr).any(-1)).sum())
    return kl, nll_cand, nll_ref, dp, same, nan_rows


def _exp(x: float) -> float:
    """math.exp without OverflowError: inf past the float range, NaN stays NaN."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def quantiles(x: torch.Tensor, qs: list[float]) -> list[float]:
    """Quantiles (q in 0..1) of a non-empty vector, linear interpolation as numpy's default.

    Sorted by hand rather than `torch.quantile`, so +inf values (and any length) are fine; any
    NaN makes every quantile NaN (as numpy's), rather than the sort's NaN-last order.
    """
    s = torch.sort(torch.as_tensor(x).detach().to(device="cpu", dtype=torch.float64).reshape(-1)).values
    if bool(torch.isnan(s).any()):
        return [math.nan] * len(qs)
    out = []
    for q in qs:
        pos = q * (s.numel() - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        a, b = s[lo].item(), s[hi].item()
        out.append(a if lo == hi or a == b else a + (b - a) * (pos - lo))
    return out
