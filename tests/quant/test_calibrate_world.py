"""Calibrated quantize on a torchrun world (issue 25): `cvt quantize --method gptq|awq --procs N`
(gloo, CPU ranks) splits the calibration sequences, combines the statistics in rank order and
quantizes each linear on one owner rank: the output depends on the world size only (two runs
agree byte for byte), is as good as one process's, and a killed rank's job resumes after the
last finished layer. FlatQuant's: tests/quant/test_calibrate_world_flatquant.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_cvt
from tests.quant.test_methods_e2e import kl_and_ppl, readme_row

pytestmark = pytest.mark.slow  # calibration on several torchrun ranks


def weights(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.glob("*.safetensors"))}


def test_gptq_on_three_ranks_resumes_after_a_killed_rank(fp8_release, tmp_path):
    """3 ranks, one calibration sequence of 256 tokens (ranks 0 and 1 compute none: `ranks.share`),
    the routed experts read a chunk at a time (--expert-memory): rank 2 SIGKILLed after layer 1 ends the job with no process left;
    the state holds two finished layers; a run with another world size is one line naming the
    right one; the same command resumes without recomputing them and writes what an
    uninterrupted 3-rank run writes."""
    argv = ("quantize", fp8_release, None, "--scheme", "w4a16", "--method", "gptq", "--calib-tokens", "256",
            "--expert-memory", "4KB", "--procs", "3", "-q")
    dst = tmp_path / "killed"
    a = [str(dst) if x is None else x for x in argv]
    killed = run_cvt(*a, subprocess_=True, env={"CVT_TEST_KILL_AFTER_LAYER": "1", "CVT_TEST_KILL_RANK": "2"})
    assert killed.rc == 137, killed.err  # one line naming the rank and its signal, no torchrun traceback
    assert [ln for ln in killed.err.splitlines() if ln.startswith("cvt:") and "per channel" not in ln] == [
        "cvt: error: rank 2 was killed by SIGKILL; torchrun stopped the other ranks; re-run the same command to resume"]
    assert "Traceback" not in killed.err
    assert subprocess.run(["pgrep", "-f", str(dst)], capture_output=True).stdout == b""
    state = json.loads((dst / ".cvt-calib" / "state.json").read_text())
    assert state["done"] == 2 and state["world"] == 3
    assert {"x-2.r0.bin", "x-2.r1.bin", "x-2.r2.bin"} <= set(state["files"])  # each rank's share of layer 2's input
    assert state["files"]["x-2.r0.bin"]["size"] == 0

    other = run_cvt(*a[:-3], "--procs", "2", "-q", subprocess_=True)
    assert other.rc == 1 and other.err.count("\n") == 1, other.err
    assert "computed by 3 ranks" in other.err and "--procs 3" in other.err

    resumed = run_cvt(*a, subprocess_=True)
    assert resumed.rc == 0, resumed.err
    cal = json.loads((dst / "cvt_manifest.json").read_text())["quant"]["calibration"]
    assert cal["resumed_layers"] == 2 and cal["ranks"] == 3 and len(cal["peak_rss_per_rank"]) == 3

    fresh = tmp_path / "fresh"
    r = run_cvt(*[str(fresh) if x is None else x for x in argv], subprocess_=True)
    assert r.rc == 0, r.err
    assert weights(fresh) == weights(dst)


def test_smoothquant_c8_static_on_more_ranks_than_sequences_is_deterministic(fp8_release, tmp_path):
    """3 ranks, 2 calibration sequences (one rank computes none): SmoothQuant's folds, the static
    attention scales and the C8 KV-cache scales come from statistics combined over the ranks;
    two runs write the same bytes."""
    outs = []
    for name in ("a", "b"):
        dst = tmp_path / name
        r = run_cvt("quantize", fp8_release, dst, "--scheme", "w8a8c8", "--format", "ascend", "--method",
                    "smoothquant", "--static-attention", "--calib-tokens", "512", "--procs", "3", "-q",
                    subprocess_=True)
        assert r.rc == 0, r.err
        outs.append(weights(dst))
    assert outs[0] == outs[1]
    q = json.loads((tmp_path / "a" / "cvt_manifest.json").read_text())["quant"]
    assert q["calibration"]["ranks"] == 3 and q["kv_cache"]


def test_two_ranks_match_one_process_quality(trained_fixture, tmp_path):
    """GPTQ and AWQ at w4a16 g128 on 2 ranks, 2048 calibration tokens, on the trained fixture:
    the KL to BF16 is the one-process run's (README's table rows, which
    tests/quant/test_methods_e2e.py checks against one process) or at most 25% above -- GPTQ's rounding is
    chaotic under a change of summation order: measured 0.0037 on 2 ranks and 0.0047 on 3 against
    0.0047 on one."""
    for method in ("gptq", "awq"):
        dst = tmp_path / method
        r = run_cvt("quantize", trained_fixture, dst, "--scheme", "w4a16", "--method", method, "--calib-tokens",
                    "2048", "--procs", "2", "-q", subprocess_=True)
        assert r.rc == 0, r.err
        kl, _ = kl_and_ppl(dst, trained_fixture, tmp_path)
        one, _ = readme_row(f"w4a16 g128, {method}")
        # one-sided: the rank order moves GPTQ's rounding either way (2 ranks measured 21% BETTER here), and
        # another CPU's summation order moves it again; what must hold is that ranks cost no quality
        assert kl <= 1.25 * one, (method, kl, one)
