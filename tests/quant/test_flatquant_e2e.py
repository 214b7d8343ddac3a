"""Acceptance (issue 39 item 2): `--scheme w4a4_flatquant` through `cvt quantize` and `cvt verify`
on the trained DeepSeek-V3 fixture: the online Hadamard transforms beat the same layout with
identity transforms (plain per-token int4 W4A4), and the quantize page's rows are this run's."""

from __future__ import annotations

import json

import pytest
import torch

from cvt.quant.recipe import Recipe
from cvt.quant.stage import quantize
from cvt.qtensor.schemes import flatquant
from cvt.tests.quant.test_methods_e2e import assert_readme_row, kl_and_ppl, with_activation_outliers

pytestmark = pytest.mark.slow  # seven quantize + verify runs on the trained fixture

EXPERTS_FLOAT = Recipe.model_validate({"rules": [{"pattern": r"mlp\.experts\.", "scheme": "float"}]})


def _identity(k: int, seed: int = flatquant.SEED):
    a, b = flatquant.decompose_dim(k)
    return torch.eye(a, dtype=torch.bfloat16), torch.eye(b, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def fixture_hadamard(trained_fixture, tmp_path_factory) -> tuple:
    """(the output, its (KL, PPL ratio)) of `--scheme w4a4_flatquant` (RTN, the Hadamard start) on
    the trained fixture: the row both tests below compare with, quantized and verified once."""
    tmp = tmp_path_factory.mktemp("flatquant")
    dst = tmp / "fixture-fq-hadamard"
    quantize(trained_fixture, dst, scheme="w4a4_flatquant", fmt="ascend", quiet=True)
    return dst, kl_and_ppl(dst, trained_fixture, tmp)


def _rows(src, tmp_path, monkeypatch, tag: str, hadamard: tuple | None = None) -> dict[str, tuple[float, float]]:
    """KL rows of the Hadamard start (`hadamard` when already measured), identity transforms and MXFP4."""
    kl = {} if hadamard is None else {"hadamard": hadamard}
    for name, transforms in (("hadamard", None), ("identity", _identity))[hadamard is not None:]:
        with monkeypatch.context() as m:
            if transforms is not None:
                m.setattr(flatquant, "init_transforms", transforms)
            dst = tmp_path / f"{tag}-fq-{name}"
            quantize(src, dst, scheme="w4a4_flatquant", fmt="ascend", quiet=True)
        kl[name] = kl_and_ppl(dst, src, tmp_path)
    dst = tmp_path / f"{tag}-mx"
    quantize(src, dst, scheme="w4a4_mxfp4", fmt="ascend", quiet=True, recipe=EXPERTS_FLOAT)
    kl["mx"] = kl_and_ppl(dst, src, tmp_path)
    return kl


def test_online_hadamard_beats_plain_int4_w4a4(trained_fixture, fixture_hadamard, tmp_path, monkeypatch):
    kl = _rows(trained_fixture, tmp_path, monkeypatch, "fixture", hadamard=fixture_hadamard[1])
    floats = json.loads((fixture_hadamard[0] / "cvt_manifest.json").read_text())["quant"]["float_modules"]
    assert "96 = 8 x 12" in floats["model.layers.0.self_attn.q_b_proj"]  # the op cannot take it: float
    assert "linears only" in floats["model.layers.1.mlp.experts.0.up_proj"]
    assert kl["hadamard"][0] <= 0.6 * kl["identity"][0], kl
    assert_readme_row("w4a4_flatquant, Hadamard transforms", kl["hadamard"])
    assert_readme_row("w4a4_flatquant, identity transforms", kl["identity"])
    assert_readme_row("w4a4_mxfp4, experts float", kl["mx"])
    dst = tmp_path / "fixture-fq-awq"
    quantize(trained_fixture, dst, scheme="w4a4_flatquant", fmt="ascend", quiet=True, method="awq", calib_tokens=2048)
    awq = kl_and_ppl(dst, trained_fixture, tmp_path)
    assert awq[0] < kl["hadamard"][0], (awq, kl)
    assert_readme_row("w4a4_flatquant, Hadamard transforms, awq (--calib-tokens 2048)", awq, rel=0.15, ppl_abs=5e-3)
    src = with_activation_outliers(trained_fixture, tmp_path / "outliers")
    kl = _rows(src, tmp_path, monkeypatch, "outliers")
    assert kl["hadamard"][0] <= 0.2 * kl["identity"][0], kl
    assert_readme_row("w4a4_flatquant with injected activation outliers, Hadamard transforms", kl["hadamard"])
    assert_readme_row("w4a4_flatquant with injected activation outliers, identity transforms", kl["identity"],
                      ppl_abs=0.02)
    assert_readme_row("w4a4_mxfp4 with injected activation outliers, experts float", kl["mx"])


def test_fitted_transforms_beat_the_hadamard_start(trained_fixture, fixture_hadamard, tmp_path):
    """`--method flatquant` (the transforms and clip fitted per input site, default steps and lr) on
    the quantize page's 2048 calibration tokens: mean KL below the Hadamard-initialised output's
    (`--method rtn`, the default: `fixture_hadamard`), and the page's row is this run's."""
    kl = {"rtn": fixture_hadamard[1]}
    dst = tmp_path / "fq-flatquant"
    quantize(trained_fixture, dst, scheme="w4a4_flatquant", fmt="ascend", quiet=True, method="flatquant",
             calib_tokens=2048)
    kl["flatquant"] = kl_and_ppl(dst, trained_fixture, tmp_path)
    assert kl["flatquant"][0] <= 0.85 * kl["rtn"][0], kl
    assert_readme_row("w4a4_flatquant, Hadamard transforms", kl["rtn"])
    assert_readme_row("w4a4_flatquant, fitted transforms (--method flatquant, --calib-tokens 2048)", kl["flatquant"],
                      rel=0.15, ppl_abs=0.02)  # an Adam fit on calibration sums: the CPU's summation order shows
