"""Metrics on hand-made tensors with known values, and KL / PPL against an independent computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cvt.runtime import metrics as M


def test_cosine_known_values():
    a = torch.tensor([1.0, 0.0, 0.0])
    b = torch.tensor([0.0, 2.0, 0.0])
    assert M.cosine(a, b) == 0.0
    assert M.cosine(a, a) == pytest.approx(1.0, abs=1e-15)
    assert M.cosine(a, -a) == pytest.approx(-1.0, abs=1e-15)
    assert M.cosine(torch.zeros(4), torch.zeros(4)) == 1.0
    assert M.cosine(torch.zeros(2), torch.ones(2)) == 0.0
    # 45 degrees, in bf16 inputs (computed in float64)
    assert M.cosine(torch.tensor([1.0, 1.0], dtype=torch.bfloat16), torch.tensor([1.0, 0.0])) == \
        pytest.approx(1 / math.sqrt(2), abs=1e-15)
    # huge values do not overflow
    big = torch.full((1000,), 3e38, dtype=torch.float32)
    assert M.cosine(big, big) == pytest.approx(1.0, abs=1e-12)


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(3, 2\)"):
        M.compare_tensors(torch.zeros(2, 3), torch.zeros(3, 2))


def test_abs_rel_euc():
    b = torch.tensor([1.0, -2.0, 4.0, 0.0])
    a = torch.tensor([1.5, -2.0, 3.0, 0.25])
    assert M.max_abs_err(a, b) == 1.0
    # |a/b - 1| over b != 0: 0.5, 0, 0.25; the b == 0 element is left out
    assert M.max_rel_err(a, b) == 0.5
    assert M.max_rel_err(torch.ones(3), torch.zeros(3)) == 0.0
    assert M.euc_dist(a, b) == pytest.approx(math.sqrt(0.25 + 1 + 0.0625) / math.sqrt(1 + 4 + 16), rel=1e-15)
    assert M.euc_dist(b, b) == 0.0
    assert M.euc_dist(torch.ones(2), torch.zeros(2)) == math.inf
    assert M.euc_dist(torch.zeros(2), torch.zeros(2)) == 0.0


def test_thousandth_ratios_on_crafted_errors():
    b = torch.ones(10, dtype=torch.float64) * 2.0
    # relative errors: 4 x 0, 2 x 0.0005, 2 x 0.003, 2 x 0.01
    rel = torch.tensor([0, 0, 0, 0, 5e-4, -5e-4, 3e-3, -3e-3, 1e-2, -1e-2], dtype=torch.float64)
    a = b * (1 + rel)
    assert M.thousandth_ratio(a, b) == pytest.approx(0.6)
    assert M.five_thousandth_ratio(a, b) == pytest.approx(0.8)
    assert M.max_rel_err(a, b) == pytest.approx(0.01)


def test_ratios_near_zero_reference():
    # reference zero: exact zero counts as exact, 1e-12 (< eps * 0.001) too, 1.0 is an error
    b = torch.zeros(4, dtype=torch.float64)
    a = torch.tensor([0.0, 1e-13, 1.0, 0.0], dtype=torch.float64)
    assert M.thousandth_ratio(a, b) == 0.75
    assert M.five_thousandth_ratio(a, b) == 0.75
    assert M.thousandth_ratio(torch.zeros(0), torch.zeros(0)) == 1.0


def test_sqnr_known_noise():
    torch.manual_seed(0)
    w = torch.randn(4096, dtype=torch.float64)
    noise = torch.randn(4096, dtype=torch.float64)
    noise = noise * (w.norm() / noise.norm()) * 0.01  # |noise| = |w| / 100 -> 40 dB
    assert M.sqnr_db(w, w + noise) == pytest.approx(40.0, abs=1e-9)
    assert M.sqnr_db(w, w * 0.9) == pytest.approx(20.0, abs=1e-9)  # |w - 0.9w| = |w| / 10
    assert M.sqnr_db(w, w.clone()) == math.inf
    assert M.sqnr_db(torch.zeros(3), torch.zeros(3)) == math.inf
    assert M.sqnr_db(torch.zeros(3), torch.ones(3)) == -math.inf


def test_compare_tensors_columns_exact_names():
    a = torch.randn(3, 5)
    d = M.compare_tensors(a, a)
    assert tuple(d) == M.COLUMNS == ("Cosine", "MaxAbsErr", "MaxRelativeErr", "One Thousandth Err Ratio",
                                     "Five Thousandth Err Ratio", "EucDist")
    assert d["Cosine"] == pytest.approx(1.0, abs=1e-15)
    assert d["MaxAbsErr"] == 0.0 and d["MaxRelativeErr"] == 0.0 and d["EucDist"] == 0.0
    assert d["One Thousandth Err Ratio"] == 1.0 and d["Five Thousandth Err Ratio"] == 1.0


def test_logit_stats_identical():
    torch.manual_seed(1)
    logits = torch.randn(50, 33)
    t = torch.randint(0, 33, (50,))
    s = M.logit_stats(logits, logits.clone(), t)
    assert s["kl_mean"] == 0.0 and s["kl_max"] == 0.0 and s["kl_p999"] == 0.0
    assert s["ppl_ratio"] == 1.0 and s["same_top1"] == 1.0 and s["rms_delta_p"] == 0.0
    assert s["tokens"] == 50
    assert s["kl_per_token"].shape == (50,) and s["kl_per_token"].dtype == torch.float64
    assert set(s) == set(M.LOGIT_STAT_KEYS) | {"kl_per_token"}


def _np_log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def test_logit_stats_against_numpy():
    rng = np.random.default_rng(7)
    n, v = 200, 57
    ref = rng.normal(size=(n, v)) * 3
    cand = ref + rng.normal(size=(n, v)) * 0.3
    t = rng.integers(0, v, size=n)
    s = M.logit_stats(torch.tensor(cand), torch.tensor(ref), torch.tensor(t), chunk_rows=7)

    lr, lc = _np_log_softmax(ref), _np_log_softmax(cand)
    kl = np.array([sum(math.exp(lr[i, j]) * (lr[i, j] - lc[i, j]) for j in range(v)) for i in range(n)])
    np.testing.assert_allclose(s["kl_per_token"].numpy(), kl, rtol=1e-10, atol=1e-14)
    assert s["kl_mean"] == pytest.approx(kl.mean(), rel=1e-10)
    assert s["kl_median"] == pytest.approx(np.median(kl), rel=1e-10)
    assert s["kl_p99"] == pytest.approx(np.percentile(kl, 99), rel=1e-10)
    assert s["kl_p999"] == pytest.approx(np.percentile(kl, 99.9), rel=1e-10)
    assert s["kl_max"] == pytest.approx(kl.max(), rel=1e-10)
    nll_c = -lc[np.arange(n), t]
    nll_r = -lr[np.arange(n), t]
    assert s["ppl_candidate"] == pytest.approx(math.exp(nll_c.mean()), rel=1e-10)
    assert s["ppl_reference"] == pytest.approx(math.exp(nll_r.mean()), rel=1e-10)
    assert s["ppl_ratio"] == pytest.approx(math.exp(nll_c.mean() - nll_r.mean()), rel=1e-10)
    assert s["same_top1"] == pytest.approx((cand.argmax(1) == ref.argmax(1)).mean())
    assert 0.5 < s["same_top1"] < 1.0
    dp = np.exp(-nll_c) - np.exp(-nll_r)
    assert s["rms_delta_p"] == pytest.approx(math.sqrt((dp ** 2).mean()), rel=1e-10)


def test_rms_delta_p_hand_made():
    # two tokens, vocab 2. ref: p(target) = 0.5 both; cand: p(target) = sigmoid(ln 3) = 0.75, then 0.25
    ref = torch.zeros(2, 2, dtype=torch.float64)
    cand = torch.tensor([[math.log(3.0), 0.0], [math.log(3.0), 0.0]], dtype=torch.float64)
    t = torch.tensor([0, 1])
    s = M.logit_stats(cand, ref, t)
    assert s["rms_delta_p"] == pytest.approx(0.25, abs=1e-15)  # dp = +0.25, -0.25
    # KL(ref || cand) = 0.5 ln(0.5/0.75) + 0.5 ln(0.5/0.25), both rows
    assert s["kl_mean"] == pytest.approx(0.5 * math.log(2 / 3) + 0.5 * math.log(2), abs=1e-15)
    assert s["ppl_reference"] == pytest.approx(2.0)
    assert s["ppl_candidate"] == pytest.approx(math.exp(-(math.log(0.75) + math.log(0.25)) / 2))
    assert s["same_top1"] == 1.0  # ref ties pick index 0, as does cand


def test_logit_stats_batched_shapes_and_bad_input():
    logits = torch.randn(2, 3, 11)
    t = torch.randint(0, 11, (2, 3))
    assert M.logit_stats(logits, logits, t)["tokens"] == 6
    with pytest.raises(ValueError, match="targets shape"):
        M.logit_stats(logits, logits, t.reshape(-1))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        M.logit_stats(logits, logits, torch.full((2, 3), 11))
    with pytest.raises(ValueError, match="same shape"):
        M.logit_stats(logits, logits[:, :2], t)
    with pytest.raises(ValueError, match="integer"):
        M.logit_stats(logits, logits, t.float())


def test_quantiles_match_numpy_and_allow_inf():
    x = torch.tensor([3.0, 1.0, 2.0, 10.0, 0.5])
    for q in (0.0, 0.5, 0.9, 0.99, 1.0):
        assert M.quantiles(x, [q])[0] == pytest.approx(np.quantile(x.numpy(), q))
    assert M.quantiles(torch.tensor([1.0, math.inf]), [0.0, 1.0]) == [1.0, math.inf]
