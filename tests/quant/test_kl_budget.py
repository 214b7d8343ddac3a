"""`cvt quantize --kl-budget`: the units kept at a higher precision meet the budget on held-out
text (`cvt verify`'s built-in sample; the measurement reads the built-in calibration text) with the
fewest high bytes among the configurations measured; without the option nothing changes; bad
values are refused with one line, exit 2."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from cvt.quant.stage import quantize
from cvt.runtime.verify import verify
from cvt.tests.conftest import run_cvt

BUDGET = 0.005  # between the fixture's all-w4a16 RTN (~0.01) and all-w8a8 RTN (~0.001) mean KL
TOKENS = 2048   # 8 x 256 calibration tokens: a test's time budget


def held_out_kl(candidate: Path, reference: Path, tmp: Path) -> float:
    """`cvt verify` on its built-in sample (not the calibration text), as docs/quantize.md's table."""
    r = verify(candidate, reference, tmp / f"report-{candidate.name}", seq_len=128, max_sequences=8).report
    return r.logits.kl_mean


def manifest(dst: Path) -> dict:
    return json.loads((dst / "cvt_manifest.json").read_text())


def weight_files(dst: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(dst.glob("*.safetensors"))}


@pytest.mark.slow
def test_budget_met_on_held_out_text_with_the_fewest_high_bytes(trained_fixture, tmp_path):
    low, high, mixed = tmp_path / "w4a16", tmp_path / "w8a8", tmp_path / "mixed"
    quantize(trained_fixture, low, scheme="w4a16", quiet=True)
    quantize(trained_fixture, high, scheme="w8a8", quiet=True)
    kl_low, kl_high = held_out_kl(low, trained_fixture, tmp_path), held_out_kl(high, trained_fixture, tmp_path)
    assert kl_high < BUDGET < kl_low, (kl_high, kl_low)

    quantize(trained_fixture, mixed, scheme="w4a16", kl_budget=BUDGET, calib_tokens=TOKENS, quiet=True)
    kl_mixed = held_out_kl(mixed, trained_fixture, tmp_path)
    assert kl_mixed <= BUDGET, (kl_mixed, kl_low, kl_high)

    q = manifest(mixed)["quant"]
    mp = q["mixed_precision"]
    n = len(mp["units"])
    assert mp["kl_budget"] == BUDGET and mp["high"] == "w8a8" and mp["tokens"] == TOKENS
    kinds = sorted(u["unit"].split(".", 3)[3] for u in mp["units"])  # 3 layers: 1 dense, 2 MoE
    assert kinds == ["mlp", "mlp", "mlp", "mlp.experts", "mlp.experts", "self_attn", "self_attn", "self_attn"]
    # the trials: all high and all low measured; the choice is the fewest high bytes that held the budget
    by_k = {t["kept_units"]: t for t in mp["trials"]}
    assert {0, n} <= set(by_k) and by_k[0]["kl_mean"] > BUDGET >= by_k[n]["kl_mean"]
    met = [t for t in mp["trials"] if t["kl_mean"] <= BUDGET]
    assert mp["high_bytes"] == min(t["high_bytes"] for t in met) and mp["kl_mean"] <= BUDGET
    kept = [u for u in mp["units"] if u["kept_high"]]
    assert 0 < len(kept) < n and mp["high_bytes"] == sum(u["high_bytes"] for u in kept)
    assert sorted(u["rank"] for u in kept) == list(range(1, len(kept) + 1))  # a prefix of the greedy order
    # the output is what the record says: the kept units' linears w8a8, the other units' w4a16
    kept_units = {u["unit"] for u in kept}
    for name, t in q["tensors"].items():
        parts = name.split(".")
        unit = ".".join(parts[:3] + (["mlp", "experts"] if parts[3:5] == ["mlp", "experts"] else parts[3:4]))
        assert t["scheme"] == ("w8a8" if unit in kept_units else "w4a16"), name
    # the verify report says which were kept and why
    report = (tmp_path / "report-mixed" / "report.md").read_text()
    assert f"Mixed precision: --kl-budget {BUDGET:g}" in report
    assert all(f"{u['unit']} kept w8a8" in report for u in kept)
    doc = json.loads((tmp_path / "report-mixed" / "report.json").read_text())
    assert doc["report_version"] == 5 and len(doc["candidate"]["mixed_precision"]) == 1 + len(kept)


@pytest.mark.slow
def test_without_a_budget_nothing_changes(trained_fixture, tmp_path):
    """No --kl-budget: no mixed_precision key. A budget every configuration meets keeps nothing
    high: the same weight files and the same manifest but for its record."""
    plain, loose = tmp_path / "plain", tmp_path / "loose"
    quantize(trained_fixture, plain, scheme="w4a16", quiet=True)
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"kl_budget": 10.0}))
    from cvt.quant.recipe import load_recipe

    quantize(trained_fixture, loose, scheme="w4a16", recipe=load_recipe(recipe), calib_tokens=TOKENS, quiet=True)
    a, b = manifest(plain), manifest(loose)
    assert "mixed_precision" not in a["quant"]
    mp = b["quant"].pop("mixed_precision")
    assert mp["kl_budget"] == 10.0 and mp["high_bytes"] == 0 and not any(u["kept_high"] for u in mp["units"])
    assert [t["kept_units"] for t in mp["trials"]] == [0, len(mp["units"])]
    assert weight_files(plain) == weight_files(loose) and a == b


@pytest.mark.parametrize("args, says", [
    (["--kl-budget", "-0.1"], "--kl-budget -0.1: give a mean KL, a finite number >= 0"),
    (["--kl-budget", "nan"], "--kl-budget nan: give a mean KL, a finite number >= 0"),
    (["--kl-budget", "0.01", "--kl-high", "w4a16"], "--kl-high w4a16 is --scheme itself"),
    (["--kl-high", "float"], "--kl-high float applies with --kl-budget"),
], ids=["negative", "nan", "high-is-low", "high-alone"])
def test_bad_values_exit_2_with_one_line(trained_fixture, tmp_path, args, says):
    dst = tmp_path / "out"
    r = run_cvt("quantize", trained_fixture, dst, "--scheme", "w4a16", "--quiet", *args)
    lines = r.err.strip().splitlines()
    assert r.rc == 2 and len(lines) == 1 and lines[0].startswith("cvt: error: ") and says in lines[0], r.err
    assert not dst.exists()


@pytest.mark.slow
def test_a_budget_even_all_high_misses_is_refused_before_dst(trained_fixture, tmp_path):
    dst = tmp_path / "out"
    r = run_cvt("quantize", trained_fixture, dst, "--scheme", "w4a16", "--quiet", "--kl-budget", "0",
                "--calib-tokens", "512")
    line, = r.err.strip().splitlines()
    assert r.rc == 2, r.err
    assert "--kl-budget 0.0: even with all 8 units at w8a8 the output measures mean KL" in line, line
    assert not dst.exists()
