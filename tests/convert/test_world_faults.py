"""Multi-rank faults run for real (issue 37): two CPU ranks of ``cvt fp8-to-bf16 --procs 2``
stopped from outside at a known point (a rank paused mid-write by ``CVT_TEST_PAUSE_AT_BYTE``,
its pid in a file), as a user or a scheduler would:

* ``kill -9`` of rank 0, then of rank 1 (and of rank 1 of an RTN quantize and of a shard): one
  ``cvt: error:`` line naming the rank and SIGKILL, exit 137, no traceback;
* SIGTERM, SIGINT and SIGHUP to the command's process group: one line, exit 128 + signal;
* one process under SIGTERM: the same;
* a rank started by hand whose peer never comes: one line naming MASTER_ADDR / MASTER_PORT
  within ``CVT_RENDEZVOUS_TIMEOUT``, no DST made;

and after each: no process of the run left, its temp folder (TMPDIR, where cvt's scratch folder
and torchrun's logs go) empty, and a one-process re-run resumes to the bytes of a clean run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_cvt
from tests.convert.test_world import left_running, same_tree

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and prctl: Linux")]

SMALL = ("--max-shard-size", "200KB")
PAUSE_AT = "1500000"  # a byte of the output: some files done, the run not


@pytest.fixture(scope="module")
def clean(fp8_release_session, tmp_path_factory) -> Path:
    """The one-process output every resumed run must equal."""
    out = tmp_path_factory.mktemp("clean") / "bf16"
    assert run_cvt("fp8-to-bf16", fp8_release_session, out, *SMALL, "-q").rc == 0
    return out


def _start(src: Path, dst: Path, tmp: Path, *extra: str, env: dict | None = None,
           verb: tuple = ("fp8-to-bf16",)) -> subprocess.Popen:
    """`cvt VERB SRC DST` (fp8-to-bf16) in a process group of its own, TMPDIR `tmp`."""
    full = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp), **(env or {})}
    full.pop("CVT_DEBUG", None)
    return subprocess.Popen([sys.executable, "-m", "cvt", verb[0], str(src), str(dst), *verb[1:], *SMALL, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full,
                            start_new_session=True)


def _paused(proc: subprocess.Popen, marker: Path) -> int:
    """The pid the paused writer wrote in `marker`, once it is there."""
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None, f"ended before the pause: {proc.communicate()}"
        assert time.monotonic() < deadline, "no rank reached the pause byte"
        time.sleep(0.1)
    return int(marker.read_text())


def _end(proc: subprocess.Popen, dst: Path, tmp: Path) -> tuple[int, list[str], str]:
    """Wait for the run; (exit code, its cvt: lines, all of stderr), checking nothing is left."""
    try:
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert left_running(str(dst)) == [], "a process of the run is still there"
    assert sorted(os.listdir(tmp)) == [], "the run's temp folders are left behind"
    return proc.returncode, [ln for ln in err.splitlines() if ln.startswith("cvt:")], err


def _resumes(src: Path, dst: Path, clean: Path, verb: tuple = ("fp8-to-bf16",)) -> None:
    assert not (dst / "cvt_manifest.json").exists()  # nothing that looks complete
    r = run_cvt(verb[0], src, dst, *verb[1:], *SMALL, "-q")
    assert r.rc == 0, r.err
    same_tree(clean, dst)


@pytest.mark.parametrize("rank", [0, 1])
def test_kill_9_of_one_rank_is_one_line_naming_it(rank, fp8_release_session, clean, tmp_path):
    tmp, dst, marker = tmp_path / "tmp", tmp_path / "out", tmp_path / "paused"
    tmp.mkdir()
    proc = _start(fp8_release_session, dst, tmp, "--procs", "2", env={
        "CVT_TEST_PAUSE_AT_BYTE": PAUSE_AT, "CVT_TEST_PAUSE_FILE": str(marker), "CVT_TEST_KILL_RANK": str(rank)})
    os.kill(_paused(proc, marker), signal.SIGKILL)
    rc, lines, err = _end(proc, dst, tmp)
    assert rc == 128 + signal.SIGKILL, err
    assert lines == [f"cvt: error: rank {rank} was killed by SIGKILL; torchrun stopped the other ranks; re-run the "
                     "same command to resume"], err
    assert "Traceback" not in err and "ChildFailedError" not in err
    _resumes(fp8_release_session, dst, clean)


@pytest.mark.parametrize("verb", [("quantize", "--scheme", "w8a8"), ("shard", "--ep", "2")], ids=lambda v: v[0])
def test_kill_9_of_a_rank_of_quantize_and_shard(verb, fp8_release_session, clean, tmp_path):
    """The same for the other streaming verbs (RTN quantize, shard), on the BF16 conversion."""
    tmp, dst, marker = tmp_path / "tmp", tmp_path / "out", tmp_path / "paused"
    tmp.mkdir()
    ref = tmp_path / "ref"
    assert run_cvt(verb[0], clean, ref, *verb[1:], *SMALL, "-q").rc == 0
    proc = _start(clean, dst, tmp, "--procs", "2", verb=verb, env={
        "CVT_TEST_PAUSE_AT_BYTE": "400000", "CVT_TEST_PAUSE_FILE": str(marker), "CVT_TEST_KILL_RANK": "1"})
    os.kill(_paused(proc, marker), signal.SIGKILL)
    rc, lines, err = _end(proc, dst, tmp)
    assert (rc, lines) == (137, ["cvt: error: rank 1 was killed by SIGKILL; torchrun stopped the other ranks; "
                                 "re-run the same command to resume"]), err
    assert "Traceback" not in err
    _resumes(clean, dst, ref, verb)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_stop_signal_to_the_group_stops_every_rank(sig, fp8_release_session, clean, tmp_path):
    tmp, dst, marker = tmp_path / "tmp", tmp_path / "out", tmp_path / "paused"
    tmp.mkdir()
    proc = _start(fp8_release_session, dst, tmp, "--procs", "2", env={
        "CVT_TEST_PAUSE_AT_BYTE": PAUSE_AT, "CVT_TEST_PAUSE_FILE": str(marker), "CVT_TEST_KILL_RANK": "1"})
    _paused(proc, marker)
    t0 = time.monotonic()
    os.killpg(proc.pid, sig)
    rc, lines, err = _end(proc, dst, tmp)
    assert rc == 128 + sig, err
    assert time.monotonic() - t0 < 25  # every rank left on the signal, none on torchrun's SIGKILL 30 s later
    said = "cvt: interrupted" if sig == signal.SIGINT else f"cvt: stopped by {sig.name}"
    assert lines == [f"{said}; re-run the same command to resume"], err
    assert "Traceback" not in err
    _resumes(fp8_release_session, dst, clean)


def test_sigterm_stops_one_process_like_ctrl_c(fp8_release_session, clean, tmp_path):
    tmp, dst, marker = tmp_path / "tmp", tmp_path / "out", tmp_path / "paused"
    tmp.mkdir()
    proc = _start(fp8_release_session, dst, tmp, "-q",
                  env={"CVT_TEST_PAUSE_AT_BYTE": PAUSE_AT, "CVT_TEST_PAUSE_FILE": str(marker)})
    os.kill(_paused(proc, marker), signal.SIGTERM)
    rc, lines, err = _end(proc, dst, tmp)
    assert (rc, err) == (143, "cvt: stopped by SIGTERM; re-run the same command to resume\n")  # one line, no blank
    _resumes(fp8_release_session, dst, clean)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_peer_that_never_comes_is_one_line_naming_the_address(fp8_release_session, tmp_path):
    tmp, dst = tmp_path / "tmp", tmp_path / "out"
    tmp.mkdir()
    port = _free_port()
    t0 = time.monotonic()
    proc = _start(fp8_release_session, dst, tmp, env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0",
                                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                              "CVT_RENDEZVOUS_TIMEOUT": "1"})
    rc, lines, err = _end(proc, dst, tmp)
    assert time.monotonic() - t0 < 90
    assert rc == 1 and len(lines) == 1, err
    assert lines[0].startswith("cvt: error: rank 0: the 2 ranks did not all meet at MASTER_ADDR:MASTER_PORT "
                               f"127.0.0.1:{port} within 1 s"), err
    assert "CVT_RENDEZVOUS_TIMEOUT" in lines[0]
    assert not dst.exists()  # the peers meet before DST is made


def test_sigint_ignored_at_start_stays_ignored_and_sigterm_still_stops(fp8_release_session, clean, tmp_path):
    """``nohup cvt ... &`` ignores SIGINT: a SIGINT to the group changes nothing (no rank is half
    stopped, no "interrupted" with exit 1); SIGTERM then stops the run as always."""
    tmp, dst, marker = tmp_path / "tmp", tmp_path / "out", tmp_path / "paused"
    tmp.mkdir()
    full = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp), "CVT_TEST_PAUSE_AT_BYTE": PAUSE_AT,
            "CVT_TEST_PAUSE_FILE": str(marker), "CVT_TEST_KILL_RANK": "1"}
    full.pop("CVT_DEBUG", None)
    proc = subprocess.Popen([sys.executable, "-m", "cvt", "fp8-to-bf16", str(fp8_release_session), str(dst), *SMALL,
                             "--procs", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    _paused(proc, marker)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(2)
    assert proc.poll() is None, proc.communicate()
    os.killpg(proc.pid, signal.SIGTERM)
    rc, lines, err = _end(proc, dst, tmp)
    assert (rc, lines) == (143, ["cvt: stopped by SIGTERM; re-run the same command to resume"]), err
    _resumes(fp8_release_session, dst, clean)
