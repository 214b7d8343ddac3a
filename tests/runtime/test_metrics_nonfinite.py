"""Metrics on NaN / Inf inputs: never a value that passes a gate, never an exception."""

from __future__ import annotations

import math

import pytest
import torch

from cvt.runtime import metrics as M

NAN, INF = math.nan, math.inf


def _with(value: float, i: int = 2, n: int = 6) -> torch.Tensor:
    t = torch.linspace(0.5, 3.0, n)
    t[i] = value
    return t


CLEAN = torch.linspace(0.5, 3.0, 6)


@pytest.mark.parametrize("value", [NAN, INF, -INF])
@pytest.mark.parametrize("where", ["candidate", "reference", "both"])
def test_cosine_is_nan_for_any_non_finite_input(value, where):
    a = _with(value) if where in ("candidate", "both") else CLEAN
    b = _with(value) if where in ("reference", "both") else CLEAN
    assert math.isnan(M.cosine(a, b))  # was max(-1, min(1, nan)) == 1.0
    cols = M.compare_tensors(a, b)
    assert math.isnan(cols["Cosine"])
    assert math.isnan(cols["One Thousandth Err Ratio"]) and math.isnan(cols["Five Thousandth Err Ratio"])
    assert math.isnan(M.thousandth_ratio(a, b)) and math.isnan(M.five_thousandth_ratio(a, b))
    # the standalone functions agree with compare_tensors, NaN for NaN
    for name, fn in (("MaxAbsErr", M.max_abs_err), ("MaxRelativeErr", M.max_rel_err), ("EucDist", M.euc_dist)):
        v, w = fn(a, b), cols[name]
        assert (math.isnan(v) and math.isnan(w)) or v == w, name


def test_error_columns_follow_the_rules():
    # NaN anywhere: NaN
    for a, b in ((_with(NAN), CLEAN), (CLEAN, _with(NAN))):
        assert math.isnan(M.max_abs_err(a, b))
        assert math.isnan(M.max_rel_err(a, b))
        assert math.isnan(M.euc_dist(a, b))
    # Inf only in the candidate: infinite error
    assert M.max_abs_err(_with(INF), CLEAN) == INF
    assert M.max_rel_err(_with(-INF), CLEAN) == INF
    assert M.euc_dist(_with(INF), CLEAN) == INF
    # a candidate Inf where the reference is zero is not left out of MaxRelativeErr
    assert M.max_rel_err(torch.tensor([1.0, INF]), torch.tensor([1.0, 0.0])) == INF
    # Inf in the reference: the relative measures are undefined, |a - b| is infinite
    assert M.max_abs_err(CLEAN, _with(INF)) == INF
    assert math.isnan(M.max_rel_err(CLEAN, _with(INF)))
    assert math.isnan(M.euc_dist(CLEAN, _with(INF)))
    # the same Inf on both sides: Inf - Inf
    assert math.isnan(M.max_abs_err(_with(INF), _with(INF)))
    # a NaN in the reference where it is (near) zero is not left out either
    assert math.isnan(M.max_rel_err(torch.ones(3), torch.tensor([1.0, NAN, 0.0])))


def test_rel_err_per_element():
    r = M.rel_err(torch.tensor([1.0, INF, 2.0, NAN]), torch.tensor([1.0, 1.0, INF, 1.0]))
    assert r[0] == 0.0 and r[1] == INF and math.isnan(r[2]) and math.isnan(r[3])


def test_finite_values_unchanged():
    b = torch.tensor([1.0, -2.0, 4.0, 0.0])
    a = torch.tensor([1.5, -2.0, 3.0, 0.25])
    assert M.compare_tensors(a, b) == {
        "Cosine": M.cosine(a, b), "MaxAbsErr": 1.0, "MaxRelativeErr": 0.5,
        "One Thousandth Err Ratio": 0.25, "Five Thousandth Err Ratio": 0.25,
        "EucDist": M.euc_dist(a, b)}
    # float64 values whose squares overflow: still a cosine, not NaN
    big = torch.tensor([1e200, -3e200, 2e200], dtype=torch.float64)
    assert M.cosine(big, big) == pytest.approx(1.0, abs=1e-12)
    assert M.cosine(big, -big) == pytest.approx(-1.0, abs=1e-12)
    assert M.cosine(big, torch.zeros(3, dtype=torch.float64)) == 0.0


def test_sqnr_non_finite_never_raises():
    w = torch.randn(64, 32)
    nan_w, inf_w = w.clone(), w.clone()
    nan_w[3, 4], inf_w[3, 4] = NAN, INF
    assert math.isnan(M.sqnr_db(w, nan_w))  # NaN in the candidate
    assert math.isnan(M.sqnr_db(nan_w, w))  # NaN in the reference
    assert M.sqnr_db(w, inf_w) == -INF  # was ValueError: math domain error (log10 of 0)
    assert math.isnan(M.sqnr_db(inf_w, w))  # Inf in the reference: undefined
    assert math.isnan(M.sqnr_db(inf_w, inf_w))  # Inf - Inf
    assert math.isnan(M.sqnr_db(w.bfloat16(), nan_w.bfloat16()))
    # finite values whose float32 squares overflow: computed in float64, no NaN / crash
    big = torch.full((8,), 3e38)
    assert M.sqnr_db(big, big * 0.9) == pytest.approx(20.0, abs=1e-4)  # 0.9 rounded to float32
    # float64 squares that overflow: infinite noise, not a crash
    assert M.sqnr_db(torch.full((4,), 1.0, dtype=torch.float64), torch.full((4,), 1e300, dtype=torch.float64)) == -INF


def _logits(n=40, v=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g, dtype=torch.float64) * 2, torch.randint(0, v, (n,), generator=g)


STAT_KEYS = ("ppl_ratio", "kl_mean", "kl_median", "kl_p99", "kl_p999", "kl_max", "same_top1", "rms_delta_p")


@pytest.mark.parametrize("value", [NAN, INF])
@pytest.mark.parametrize("side", ["candidate", "reference"])
def test_logit_stats_nan_or_inf_logits(side, value):
    ref, t = _logits()
    cand = ref + 0.1 * _logits(seed=1)[0]
    bad = (cand if side == "candidate" else ref).clone()
    bad[5, 7] = value
    c, r = (bad, ref) if side == "candidate" else (cand, bad)
    s = M.logit_stats(c, r, t, chunk_rows=8)
    for k in STAT_KEYS:
        assert math.isnan(s[k]), (k, s[k])  # a NaN reference row no longer gives KL 0
    assert math.isnan(s["ppl_candidate" if side == "candidate" else "ppl_reference"])
    kl = s["kl_per_token"]
    assert math.isnan(kl[5]) and bool(torch.isfinite(kl[torch.arange(40) != 5]).all())


def test_logit_stats_all_nan_rows_are_not_the_same_top1():
    ref, t = _logits()
    nan = torch.full_like(ref, NAN)
    s = M.logit_stats(nan, nan, t)
    assert math.isnan(s["same_top1"]) and math.isnan(s["kl_mean"]) and math.isnan(s["ppl_ratio"])


def test_logit_stats_minus_inf_logits_are_probability_zero():
    ref, t = _logits()
    t[:] = 0
    # the reference rules out token 29 everywhere: KL unaffected by it, still finite
    r = ref.clone()
    r[:, 29] = -INF
    s = M.logit_stats(ref, r, t)
    assert math.isfinite(s["kl_mean"]) and s["kl_mean"] > 0 and s["same_top1"] >= 0
    # the candidate rules out the target token: infinite PPL, KL and ratio; no exception
    c = ref.clone()
    c[:, 0] = -INF
    s = M.logit_stats(c, ref, t)
    assert s["ppl_candidate"] == INF and s["ppl_ratio"] == INF and s["kl_mean"] == INF
    # the reference rules it out: its PPL is infinite, the ratio undefined (NaN), not 0
    s = M.logit_stats(ref, c, t)
    assert s["ppl_reference"] == INF and math.isnan(s["ppl_ratio"])


def test_ppl_beyond_float_range_does_not_raise():
    v = 4
    ref = torch.zeros(3, v, dtype=torch.float64)
    ref[:, 1] = 1000.0  # the target 0 gets log p = -1000: PPL e^1000
    s = M.logit_stats(ref, ref.clone(), torch.zeros(3, dtype=torch.long))
    assert s["ppl_candidate"] == INF and s["ppl_reference"] == INF
    assert s["ppl_ratio"] == 1.0 and s["kl_mean"] == 0.0


def test_quantiles_with_nan_are_nan():
    assert all(math.isnan(q) for q in M.quantiles(torch.tensor([0.1, NAN, 0.3]), [0.5, 0.99]))
    assert M.quantiles(torch.tensor([0.0, 1.0, INF]), [0.0, 0.5, 1.0]) == [0.0, 1.0, INF]


def test_nonfinite_counts():
    t = torch.tensor([1.0, NAN, INF, -INF, -INF, 0.0])
    assert M.nonfinite_counts(t) == (1, 1, 2)
    assert M.nonfinite_counts(t.bfloat16()) == (1, 1, 2)
    assert M.nonfinite_counts(t, chunk=2) == (1, 1, 2)
    assert M.nonfinite_counts(torch.ones(5)) == (0, 0, 0)
    assert M.nonfinite_counts(torch.arange(5)) == (0, 0, 0)
    f8 = torch.tensor([1.0, NAN, 2.0]).to(torch.float8_e4m3fn)  # no Inf in e4m3fn
    assert M.nonfinite_counts(f8) == (1, 0, 0)
