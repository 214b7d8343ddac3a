"""`cvt run` ends the way a user expects: Ctrl-C is exit 130, NaN logits are an error (never
argmax-of-NaN tokens and exit 0), and killing a `--procs` run ends torchrun and its ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cvt.testing.checkpoints import tiny_qwen3_config, write_bf16_checkpoint, write_safetensors
from cvt.tests.conftest import run_cvt


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    return write_bf16_checkpoint(tmp_path_factory.mktemp("qwen") / "bf16", tiny_qwen3_config(moe=True, max_position_embeddings=4096))


def test_ctrl_c_during_decode_exits_130(qwen, monkeypatch):
    import cvt.runtime.generate as gen

    calls = {"n": 0}
    real = gen.sample

    def interrupted(*a, **k):  # SIGINT arriving in the middle of decoding
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(gen, "sample", interrupted)
    r = run_cvt("run", qwen, "--input-ids", "1,2,3", "--max-new-tokens", "8", "--dtype", "fp32", "--quiet")
    assert r.rc == 130 and calls["n"] == 3
    assert "Traceback" not in r.err and r.err.strip().startswith("cvt:")  # --quiet: no progress bars


def test_nan_weights_fail_instead_of_printing_tokens(qwen, tmp_path):
    import shutil

    from safetensors.torch import load_file

    bad = tmp_path / "nan"
    shutil.copytree(qwen, bad)
    f = sorted(bad.glob("model-*.safetensors"))[0]
    tensors = {k: v.clone() for k, v in load_file(f).items()}  # not views of the file rewritten below
    name = next(n for n in tensors if n.endswith("self_attn.o_proj.weight"))
    tensors[name][0, 0] = float("nan")
    write_safetensors(f, tensors)
    r = run_cvt("run", bad, "--input-ids", "1,2,3", "--max-new-tokens", "4", "--dtype", "fp32", "--quiet")
    assert r.rc == 1, r.out
    assert r.err.count("\n") == 1 and "non-finite logits (NaN/Inf)" in r.err, r.err
    assert "new tokens" not in r.out


def _pids(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's (prctl)")
def test_killing_the_world_size_parent_ends_its_ranks(qwen, tmp_path):
    dst = tmp_path / "ep2"
    assert run_cvt("shard", qwen, dst, "--ep", 2, "--quiet").rc == 0
    pattern = rf"cvt\.runtime\.launch.* {dst}"  # torchrun's agent and the ranks: python -c <runs the launcher> DST
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CVT_DEBUG", None)
    parent = subprocess.Popen([sys.executable, "-m", "cvt", "run", str(dst), "--procs", "2", "--input-ids",
                               "1,2,3", "--max-new-tokens", "2000", "--dtype", "fp32", "--device", "cpu"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 120
        while len(_pids(pattern)) < 3 and time.monotonic() < deadline:  # torchrun + 2 ranks
            assert parent.poll() is None, "cvt run ended before its ranks started"
            time.sleep(0.2)
        assert len(_pids(pattern)) >= 3, "torchrun and its ranks never started"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 60
        while _pids(pattern) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _pids(pattern) == [], "torchrun / ranks outlived the killed `cvt run`"
    finally:
        for pid in _pids(pattern):
            os.kill(pid, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
