"""Peak memory stays flat as the checkpoint grows: cvt streams, one tensor at a time."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cvt.testing.checkpoints import tiny_deepseek_config, write_fp8_release


def peak_rss_mb(*args) -> float:
    """Peak RSS of `python -m cvt ARGS` alone, measured by a wrapper process around it."""
    code = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")
    p = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "cvt", *map(str, args)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return int(p.stdout.strip().splitlines()[-1]) / 1024


@pytest.mark.slow
def test_peak_rss_flat_when_checkpoint_doubles(tmp_path):
    sizes = {}
    for layers in (3, 6):
        cfg = tiny_deepseek_config(hidden_size=1024, moe_intermediate_size=1024, intermediate_size=2048,
                                   n_routed_experts=16, num_hidden_layers=layers, num_nextn_predict_layers=0,
                                   vocab_size=2000)
        src = write_fp8_release(tmp_path / f"src{layers}", config=cfg, n_shards=2)
        in_mb = sum(p.stat().st_size for p in src.glob("*.safetensors")) / 2**20
        rss = peak_rss_mb("fp8-to-bf16", src, tmp_path / f"out{layers}", "--quiet")
        sizes[layers] = (in_mb, rss)
    (small_in, small_rss), (big_in, big_rss) = sizes[3], sizes[6]
    assert big_in > 2 * small_in > 150  # the input more than doubles (~100 MB -> ~250 MB of FP8, 2x that out)
    # whole-file or whole-model loading would add >= the extra input (~150 MB); streaming adds noise only
    assert big_rss - small_rss < 40, sizes
