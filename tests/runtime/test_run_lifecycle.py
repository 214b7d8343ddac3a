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
    assert r.err == "cvt: interrupted\n"  # --quiet: no progress bars; one line (click's blank line is not printed)


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


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups: Linux")
@pytest.mark.parametrize("how", ["kill -9 rank 1", "SIGTERM to cvt"])
def test_a_procs_run_ends_in_one_line(how, qwen, tmp_path):
    """`cvt run --procs 2` with rank 1 killed: one line naming the rank and SIGKILL, exit 137 (was
    rank 0's "internal error: ... Connection reset by peer", exit 1); SIGTERM to the command: one
    line, exit 143; either way no process and no temp folder left."""
    dst = tmp_path / "ep2"
    assert run_cvt("shard", qwen, dst, "--ep", 2, "--quiet").rc == 0
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    ranks = rf"run_rank\('cvt\.runtime\.launch'\) {dst}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp)}
    env.pop("CVT_DEBUG", None)
    proc = subprocess.Popen([sys.executable, "-m", "cvt", "run", str(dst), "--procs", "2", "--input-ids", "1,2,3",
                             "--max-new-tokens", "4000", "--dtype", "fp32", "--device", "cpu"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(_pids(ranks)) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        time.sleep(3)  # loaded and generating
        if how == "SIGTERM to cvt":
            os.kill(proc.pid, signal.SIGTERM)
        else:
            os.kill(next(p for p in _pids(ranks) if b"\0RANK=1\0" in b"\0" + Path(f"/proc/{p}/environ").read_bytes()),
                    signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.startswith("cvt:") and " loaded " not in ln]
    if how == "SIGTERM to cvt":
        assert (proc.returncode, lines) == (143, ["cvt: stopped by SIGTERM"]), err
    else:
        assert (proc.returncode, lines) == (137, ["cvt: error: rank 1 was killed by SIGKILL; torchrun stopped the "
                                                  "other ranks"]), err
    assert "Traceback" not in err and "internal error" not in err
    assert _pids(ranks) == [] and os.listdir(tmp) == []
