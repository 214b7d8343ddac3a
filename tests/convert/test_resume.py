"""Kill-and-resume byte identity, skipping finished files, and the DST lock."""

from __future__ import annotations

import fcntl
import os
import signal

import pytest

from cvt.tests.conftest import run_cvt

SHARD = "600000"  # several output files from the tiny release


def snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def golden(fp8_release_session, tmp_path_factory):
    """An uninterrupted run: the bytes every interrupted-then-resumed run must reproduce."""
    dst = tmp_path_factory.mktemp("golden") / "out"
    r = run_cvt("fp8-to-bf16", fp8_release_session, dst, "--max-shard-size", SHARD, "--quiet")
    assert r.rc == 0, r.err
    return snapshot(dst)


def total_written(golden) -> int:
    return sum(len(v) for v in golden.values())


@pytest.mark.parametrize(
    "workers,where",
    [*(pytest.param(w, at, marks=pytest.mark.slow) for w, at in [("1", 0.0001), ("1", 0.31), ("1", 0.77), ("1", 0.9995),
                                                                 ("2", 0.13)]), ("2", 0.5)],
    ids=lambda v: f"workers{v}" if isinstance(v, str) else f"kill-at-{v:.2%}",
)
def test_kill_9_anywhere_then_resume_is_byte_identical(fp8_release_session, tmp_path, golden, workers, where):
    dst = tmp_path / "out"
    at = max(1, int(total_written(golden) * where))
    killed = run_cvt("fp8-to-bf16", fp8_release_session, dst, "--max-shard-size", SHARD, "--quiet",
                     "--workers", workers, env={"CVT_TEST_KILL_AT_BYTE": str(at)})
    assert killed.rc == -signal.SIGKILL
    assert not (dst / "cvt_manifest.json").exists()
    resumed = run_cvt("fp8-to-bf16", fp8_release_session, dst, "--max-shard-size", SHARD, "--quiet", "--workers", workers)
    assert resumed.rc == 0, resumed.err
    assert snapshot(dst) == golden


@pytest.mark.slow
def test_kill_at_file_boundaries(fp8_release_session, tmp_path, golden):
    """Right after a complete weight file, right after the last one, and inside the manifest."""
    weights = sorted(k for k in golden if k.endswith(".safetensors"))
    offsets, acc = [], 0
    for k in weights:
        acc += len(golden[k])
        offsets.append(acc)
    for at in [offsets[0], offsets[-1] + 1, total_written(golden) - 5]:
        dst = tmp_path / f"out{at}"
        killed = run_cvt("fp8-to-bf16", fp8_release_session, dst, "--max-shard-size", SHARD, "--quiet",
                         "--workers", "1", env={"CVT_TEST_KILL_AT_BYTE": str(at)})
        assert killed.rc == -signal.SIGKILL
        assert run_cvt("fp8-to-bf16", fp8_release_session, dst, "--max-shard-size", SHARD, "--quiet").rc == 0
        assert snapshot(dst) == golden


@pytest.mark.slow
def test_resume_skips_finished_files_and_redoes_damaged_ones(fp8_release_session, tmp_path, golden):
    dst = tmp_path / "out"
    weights = sorted(k for k in golden if k.endswith(".safetensors"))
    # kill after the first two weight files are complete (the small state-file writes count too)
    at = len(golden[weights[0]]) + len(golden[weights[1]]) + 20_000
    run_cvt("fp8-to-bf16", fp8_release_session, dst, "--max-shard-size", SHARD, "--quiet", "--workers", "1",
            env={"CVT_TEST_KILL_AT_BYTE": str(at)})
    assert (dst / weights[0]).exists() and (dst / weights[1]).exists()
    # damage the second one without changing its size: its sha256 no longer matches
    data = bytearray((dst / weights[1]).read_bytes())
    data[-1] ^= 0xFF
    (dst / weights[1]).write_bytes(data)
    mtime0 = (dst / weights[0]).stat().st_mtime_ns
    r = run_cvt("fp8-to-bf16", fp8_release_session, dst, "--max-shard-size", SHARD)
    assert r.rc == 0, r.err
    assert f"wrote {len(weights) - 1} weight files (1 already done)" in r.out
    assert (dst / weights[0]).stat().st_mtime_ns == mtime0
    assert snapshot(dst) == golden
    # a complete DST re-run: everything verified, nothing rewritten
    again = run_cvt("fp8-to-bf16", fp8_release_session, dst, "--max-shard-size", SHARD)
    assert f"wrote 0 weight files ({len(weights)} already done)" in again.out
    assert snapshot(dst) == golden


def test_no_resume_rewrites_everything(fp8_release_session, tmp_path, golden):
    dst = tmp_path / "out"
    assert run_cvt("fp8-to-bf16", fp8_release_session, dst, "--max-shard-size", SHARD, "--quiet").rc == 0
    r = run_cvt("fp8-to-bf16", fp8_release_session, dst, "--max-shard-size", SHARD, "--no-resume")
    assert r.rc == 0 and "(0 already done)" in r.out
    assert snapshot(dst) == golden


def test_different_parameters_refuse_to_mix_into_one_dst(fp8_release_session, tmp_path):
    dst = tmp_path / "out"
    assert run_cvt("fp8-to-bf16", fp8_release_session, dst, "--max-shard-size", SHARD, "--quiet").rc == 0
    before = snapshot(dst)
    r = run_cvt("fp8-to-bf16", fp8_release_session, dst, "--max-shard-size", "1MB")
    assert r.rc != 0 and "different run" in r.err and len(r.err.strip().splitlines()) == 1
    assert snapshot(dst) == before
    ok = run_cvt("fp8-to-bf16", fp8_release_session, dst, "--max-shard-size", "1MB", "--overwrite", "--quiet")
    assert ok.rc == 0
    # the other run's files are gone: DST holds exactly what the new manifest lists
    import json

    listed = {f["path"] for f in json.loads((dst / "cvt_manifest.json").read_text())["files"]}
    assert set(os.listdir(dst)) == listed | {"cvt_manifest.json"}


def test_second_concurrent_run_is_refused(fp8_release_session, tmp_path):
    """While one run holds DST (its flock), a second run refuses and touches nothing."""
    dst = tmp_path / "out"
    dst.mkdir()
    fd = os.open(dst, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a running cvt holds
        r = run_cvt("fp8-to-bf16", fp8_release_session, dst)
        assert r.rc != 0 and "another cvt run" in r.err and "Traceback" not in r.err
        assert list(dst.iterdir()) == []
    finally:
        os.close(fd)
    assert run_cvt("fp8-to-bf16", fp8_release_session, dst, "--quiet").rc == 0


@pytest.mark.slow
def test_two_real_runs_at_once(fp8_release_session, tmp_path, golden):
    """Two real processes on one DST: one wins, the other refuses or finds the work done; the result is intact."""
    import subprocess
    import sys

    dst = tmp_path / "out"
    cmd = [sys.executable, "-m", "cvt", "fp8-to-bf16", str(fp8_release_session), str(dst), "--max-shard-size", SHARD, "--quiet"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    rcs = [p.returncode for p in procs]
    assert 0 in rcs
    for rc, (_, err) in zip(rcs, outs):
        assert rc == 0 or "another cvt run" in err
    assert snapshot(dst) == golden


@pytest.mark.slow
def test_resume_refuses_another_source_with_the_same_config_and_index(tmp_path):
    """A fine-tune ships the same config.json and index as its base: a killed run of one and a
    re-run with the other must not mix their shards."""
    from cvt.testing.checkpoints import write_fp8_release

    a = write_fp8_release(tmp_path / "a", seed=1)
    b = write_fp8_release(tmp_path / "b", seed=2)
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    assert (a / "model.safetensors.index.json").read_bytes() == (b / "model.safetensors.index.json").read_bytes()
    dst = tmp_path / "out"
    killed = run_cvt("fp8-to-bf16", a, dst, "--max-shard-size", SHARD, "--quiet", "--workers", "1",
                     env={"CVT_TEST_KILL_AT_BYTE": "1500000"})
    assert killed.rc == -signal.SIGKILL
    r = run_cvt("fp8-to-bf16", b, dst, "--max-shard-size", SHARD, "--quiet")
    assert r.rc != 0 and "different run" in r.err


@pytest.mark.slow
def test_resume_refuses_a_source_replaced_in_place_with_the_same_mtimes(tmp_path):
    """SRC's weight files replaced at the same path by another checkpoint's with the same names
    and sizes, their mtimes set back (``touch -r``): the plan is keyed on the files' content
    (`cvt.convert.identity`), so the killed run's shards are not mixed into the new one's."""
    import shutil

    from cvt.testing.checkpoints import write_fp8_release

    src = write_fp8_release(tmp_path / "src", seed=1)
    other = write_fp8_release(tmp_path / "other", seed=2)
    dst = tmp_path / "out"
    killed = run_cvt("fp8-to-bf16", src, dst, "--max-shard-size", SHARD, "--quiet", "--workers", "1",
                     env={"CVT_TEST_KILL_AT_BYTE": "1500000"})
    assert killed.rc == -signal.SIGKILL
    for p in sorted(src.glob("*.safetensors")):
        st = p.stat()
        shutil.copyfile(other / p.name, p)
        assert p.stat().st_size == st.st_size and p.read_bytes() != b""
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = run_cvt("fp8-to-bf16", src, dst, "--max-shard-size", SHARD, "--quiet")
    assert r.rc == 1 and "holds the output of a different run" in r.err, r.err


def test_a_failure_in_the_writer_thread_is_reported_not_hung(fp8_release_session, tmp_path):
    import threading

    from cvt.convert.reader import open_checkpoint
    from cvt.convert.safetensors_io import TensorSpec
    from cvt.convert.writer import OutTensor, write_checkpoint
    from cvt.schemas.manifest import StageInfo

    ckpt = open_checkpoint(fp8_release_session)

    def boom():
        raise RuntimeError("release failed")

    outs = [OutTensor(TensorSpec(f"t{i}", "U8", (1000,)), produce=lambda: bytes(1000), release=boom) for i in range(5)]
    errors = []

    def run():
        try:
            write_checkpoint(ckpt, tmp_path / "out", outs, stage=StageInfo(name="test", tool_version="0"),
                             source_format="bf16", out_format="test", config={}, summary={}, quiet=True)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the writer hung"
    assert errors and "release failed" in str(errors[0])
    assert not (tmp_path / "out" / "cvt_manifest.json").exists()


def test_a_producer_left_mid_tensor_is_closed(fp8_release_session, tmp_path):
    """A tensor made in pieces whose writing fails mid-way (here: more bytes than planned) has its
    producer closed: its `finally` runs (a fused module's lock, source pages), so a worker of
    another file waiting on that lock is not left hanging."""
    import numpy as np

    from cvt.convert.reader import open_checkpoint
    from cvt.convert.safetensors_io import TensorSpec
    from cvt.convert.writer import OutTensor, write_checkpoint
    from cvt.schemas.manifest import StageInfo

    closed = []

    def pieces():
        try:
            for _ in range(3):
                yield np.zeros(600, np.uint8)  # 1800 bytes of a 1000-byte tensor
        finally:
            closed.append(True)

    outs = [OutTensor(TensorSpec("t", "U8", (1000,)), produce=pieces, pieces=True)]
    with pytest.raises(RuntimeError, match="more than its 1000 planned bytes"):
        write_checkpoint(open_checkpoint(fp8_release_session), tmp_path / "out", outs,
                         stage=StageInfo(name="test", tool_version="0"), source_format="bf16", out_format="test",
                         config={}, summary={}, quiet=True)
    assert closed == [True]
    assert not (tmp_path / "out" / "cvt_manifest.json").exists()
