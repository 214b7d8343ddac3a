"""`cvt quantize --method flatquant --procs N` (gloo, CPU ranks): the fit sees the same rows in
the same order on any world size (`cvt.quant.methods.ranks`). Its own file, apart from
tests/quant/test_calibrate_world.py, so that `make test`'s workers share the slow multi-rank runs."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cvt

pytestmark = pytest.mark.slow  # calibration on torchrun ranks


@pytest.mark.parametrize("scheme", ["w4a4_flatquant", "w4a4_mxfp4_flatquant"])
def test_flatquant_on_two_ranks_fits_what_one_process_fits(fp8_release, tmp_path, scheme):
    """--method flatquant on 2 ranks, 2 calibration sequences (one per rank): each site's rows are the
    ranks' samples in rank order (`ranks.reduce_sites`, all 512 under the cap: one process's rows in
    its order), one rank fits the site's transforms for all its linears (`ranks.exchange`) and shares
    the quantized parts, so every rank computes the next layer's inputs from the same weights. Both
    runs at one intra-op thread per process (what the launcher gives each of 2 ranks on 2 CPUs): the
    fit is not thread-count invariant (its float32 loss norm ``mean(ref^2)`` and the large sites' steps
    reduce in per-thread chunks; at 1 and 2 threads one process's summary loss moved 0.6%, 0.3% for
    MXFP4). Here the two runs agreed byte for byte, but a layer's forward on one sequence and on two
    may sum in another order on another CPU, so what is asserted is the fit: the same sites and
    settings, the same tensors written, the summary's start loss within 0.2% and fitted loss within
    1.5% (one process at 1 and 2 threads: 0.07% / 0.6%; each rank fitting on its own 256 rows
    instead of the 512 gathered: 0.55% / 1.9%, w4a4_flatquant)."""
    outs = {}
    for procs in ("1", "2"):
        dst = tmp_path / procs
        r = run_cvt("quantize", fp8_release, dst, "--scheme", scheme, "--format", "ascend", "--method", "flatquant",
                    "--calib-tokens", "512", "--flatquant-steps", "5", "--procs", procs, "-q",
                    env={"OMP_NUM_THREADS": "1"})
        assert r.rc == 0, r.err
        files = sorted(p.name for p in dst.glob("*.safetensors"))
        outs[procs] = (files, (dst / "quant_model_description.json").read_text(),
                       json.loads((dst / "cvt_manifest.json").read_text())["quant"]["calibration"])
    (w1, desc1, cal1), (w2, desc2, cal2) = outs["1"], outs["2"]
    assert cal2["ranks"] == 2 and "ranks" not in cal1
    fq, fq2 = cal1["flatquant"], cal2["flatquant"]
    assert fq["linears"] == 21 and fq["loss"] < fq["loss_start"], fq  # the fit ran and improved on the start
    same = ("steps", "lr", "seed", "linears")
    assert {k: fq2[k] for k in same} == {k: fq[k] for k in same}
    assert fq2["loss_start"] == pytest.approx(fq["loss_start"], rel=2e-3)
    assert fq2["loss"] == pytest.approx(fq["loss"], rel=1.5e-2)
    assert desc2 == desc1 and w2 == w1
