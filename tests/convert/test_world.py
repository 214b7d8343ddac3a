"""The streaming stages on a torchrun world (issue 25): `cvt fp8-to-bf16 | quantize | shard --procs N`
launch torchrun (gloo, CPU ranks) and write the bytes one process
writes; a killed rank ends the job, and a re-run of any world size resumes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cvt import launcher, world
from cvt.convert.outdir import RANK_STATE, STATE_NAME, OutputDir
from cvt.errors import CvtError
from cvt.schemas.manifest import FileInfo
from tests.conftest import run_cvt


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def same_tree(a: Path, b: Path) -> None:
    ta, tb = tree(a), tree(b)
    assert sorted(ta) == sorted(tb)
    assert [k for k in ta if ta[k] != tb[k]] == []


def left_running(marker: str) -> list[str]:
    """Processes whose command line mentions `marker` (a run's DST)."""
    p = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True)
    return [ln for ln in p.stdout.splitlines() if "pgrep" not in ln]


@pytest.mark.slow
def test_streaming_stages_write_one_process_bytes(fp8_release, tmp_path):
    """fp8-to-bf16 on 2 ranks, RTN quantize on 3 (more ranks than its output files), shard on 2
    processes: every file of DST, manifest included, equals the one-process output's."""
    small = ("--max-shard-size", "200KB")
    assert run_cvt("fp8-to-bf16", fp8_release, tmp_path / "bf16-1", *small, "-q").rc == 0
    r = run_cvt("fp8-to-bf16", fp8_release, tmp_path / "bf16-2", *small, "--procs", "2", subprocess_=True)
    assert r.rc == 0, r.err
    assert r.out.count("dequantized") == 1  # one summary: rank 0's
    assert len(list((tmp_path / "bf16-1").glob("model-*.safetensors"))) > 4
    same_tree(tmp_path / "bf16-1", tmp_path / "bf16-2")

    bf16 = tmp_path / "bf16-1"
    q = ("--scheme", "w4a16", "--format", "ascend", "-q")
    assert run_cvt("quantize", bf16, tmp_path / "q-1", *q).rc == 0
    r = run_cvt("quantize", bf16, tmp_path / "q-3", *q, "--procs", "3", subprocess_=True)
    assert r.rc == 0, r.err
    assert len(list((tmp_path / "q-1").glob("*.safetensors"))) < 3  # idle ranks are fine
    same_tree(tmp_path / "q-1", tmp_path / "q-3")

    assert run_cvt("shard", tmp_path / "q-1", tmp_path / "s-1", "--ep", "4", *small, "-q").rc == 0
    r = run_cvt("shard", tmp_path / "q-1", tmp_path / "s-2", "--ep", "4", *small, "--procs", "2", "-q",
                subprocess_=True)
    assert r.rc == 0, r.err
    same_tree(tmp_path / "s-1", tmp_path / "s-2")


@pytest.mark.slow
def test_killed_rank_ends_the_job_and_any_world_size_resumes(fp8_release, tmp_path):
    """Rank 1 SIGKILLed mid-write: the job ends non-zero with no process left; a one-process
    re-run keeps the files the ranks finished (journaled per rank) and writes the same bytes."""
    small = ("--max-shard-size", "200KB")
    dst = tmp_path / "two"
    killed = run_cvt("fp8-to-bf16", fp8_release, dst, *small, "--procs", "2", subprocess_=True,
                     env={"CVT_TEST_KILL_RANK": "1", "CVT_TEST_KILL_AT_BYTE": "1500000"})
    assert killed.rc != 0
    assert left_running(str(dst)) == []
    assert not (dst / "cvt_manifest.json").exists()
    journals = list(dst.glob(RANK_STATE.format("*")))
    assert journals and json.loads(journals[0].read_text())["files"]  # rank 1 had finished some files
    resumed = run_cvt("fp8-to-bf16", fp8_release, dst, *small)
    assert resumed.rc == 0, resumed.err
    done = int(resumed.out.split("(")[1].split(" already done")[0])
    assert done > 0
    assert run_cvt("fp8-to-bf16", fp8_release, tmp_path / "one", *small, "-q").rc == 0
    same_tree(tmp_path / "one", dst)


def test_procs_flag_must_match_torchrun(fp8_release, tmp_path):
    r = run_cvt("fp8-to-bf16", fp8_release, tmp_path / "x", "--procs", "2", subprocess_=True,
                env={"WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert r.rc == 1 and r.err.count("\n") == 1
    assert "--procs 2" in r.err and "3 ranks" in r.err
    assert not (tmp_path / "x").exists()


def test_owners_balance_by_cost_and_agree_everywhere():
    w = world.World(rank=1, size=3)
    costs = [5, 1, 9, 3, 3, 7]
    owners = w.owners(costs)
    assert owners == world.World(rank=0, size=3).owners(costs)  # every rank computes the same
    # longest first to the least loaded rank: 9 -> 0, 7 -> 1, 5 -> 2, 3 -> 2 (8), 3 -> 1 (10), 1 -> 2 (9)
    assert owners == [2, 2, 0, 2, 1, 1]
    assert w.mine(costs) == [4, 5]
    assert world.World(size=4).owners([1.0]) == [0]  # more ranks than items


def test_procs_are_bounded_by_the_cpus_of_this_node():
    """Two ranks per CPU this process may use, never above MAX_WORLD: checked before torchrun starts."""
    from cvt.errors import OptionError

    most = min(world.MAX_WORLD, launcher.RANKS_PER_CPU * launcher.usable_cpus())
    launcher.check_procs(most)
    with pytest.raises(OptionError, match=rf"^--procs {most + 1}: this node gives cvt \d+ CPUs?, .*at most --procs {most};"):
        launcher.check_procs(most + 1)


@pytest.mark.parametrize("value, ok", [("", 300.0), ("2.5", 2.5), ("0", None), ("-1", None), ("nan", None),
                                       ("inf", None), ("x", None)])
def test_rendezvous_timeout_is_seconds_above_zero(value, ok):
    env = {world.RENDEZVOUS_ENV: value}
    if ok is not None:
        assert world.rendezvous_s(env) == ok
    else:
        with pytest.raises(CvtError, match=f"^{world.RENDEZVOUS_ENV}="):
            world.rendezvous_s(env)


@pytest.mark.parametrize("env, why", [({"WORLD_SIZE": "2", "RANK": "2"}, "describe no rank"),
                                      ({"WORLD_SIZE": "x"}, "must be integers"),
                                      ({"WORLD_SIZE": "2", "RANK": "0", world.WORLD_ENV: "4"}, "disagrees with torchrun.s 2 rank")])
def test_bad_torchrun_environment_is_one_line(env, why):
    with pytest.raises(CvtError, match=why):
        world.from_env(env)


def test_rank_journals_merge_into_the_next_run(tmp_path):
    """A rank > 0 journals its finished files in its own file; the next run's rank 0 (any world
    size) keeps them when they still match the disk, and the manifest removes every journal."""
    dst = tmp_path / "dst"
    with OutputDir(dst, "plan-a") as out:
        data = b"x" * 100
        (dst / "f1.bin").write_bytes(data)
        import hashlib

        info = FileInfo(path="f1.bin", size=100, sha256=hashlib.sha256(data).hexdigest(), tensors=1)
        out.rank = 1  # as a follower rank records
        out.record(info, {"m": {"k": 1}})
    assert json.loads((dst / RANK_STATE.format(1)).read_text())["files"]["f1.bin"]["size"] == 100
    assert "f1.bin" not in json.loads((dst / STATE_NAME).read_text())["files"]
    with OutputDir(dst, "plan-a") as out:
        found = out.finished("f1.bin", {"m"})
        assert found is not None and found[1] == {"m": {"k": 1}}
        assert not (dst / RANK_STATE.format(1)).exists()  # merged into the journal
    with OutputDir(dst, "plan-b", overwrite=True) as out:  # another plan: nothing of it is kept
        assert out.finished("f1.bin") is None
        assert not (dst / "f1.bin").exists()  # recorded by the earlier run: --overwrite removed it
    assert os.environ.get("WORLD_SIZE") is None


@pytest.mark.slow
def test_a_folder_some_rank_cannot_see_is_one_line(tmp_path):
    """Rank 1 looks at another folder than rank 0 (as a node-local DST would be): every rank
    stops with the line naming the rank that cannot see rank 0's token; in a shared folder all pass."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    root = str(Path(__file__).resolve().parents[2])
    env = {"PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    probe = subprocess.run([__import__("sys").executable, "-c", (
        "import sys; from cvt import launcher; "
        f"sys.exit(launcher.launch('tests.convert.world_probe', {[str(a), str(b)]!r}, 2, env_extra={env!r}))")],
        capture_output=True, text=True, timeout=300)
    assert probe.returncode == 1, probe.stderr
    lines = [ln for ln in probe.stderr.splitlines() if ln.startswith("cvt:")]
    assert len(lines) == 1 and "not shared by every rank (rank 1 cannot see" in lines[0], probe.stderr
    ok = subprocess.run([__import__("sys").executable, "-c", (
        "import sys; from cvt import launcher; "
        f"sys.exit(launcher.launch('tests.convert.world_probe', {[str(a), str(a)]!r}, 2, env_extra={env!r}))")],
        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert list(a.iterdir()) == []  # the token is gone


@pytest.mark.parametrize("body, rc, err", [
    ("import atexit, os, sys; atexit.register(os.abort); print('done')", 0, ""),  # a teardown that aborts
    ("import sys; print('done'); sys.exit(3)", 3, ""),
    ("print('done'); raise SystemExit('bad input')", 1, "bad input\n"),
    ("print('done'); raise ValueError('boom')", 1, "ValueError: boom"),
])
def test_a_rank_keeps_its_exit_code_whatever_the_teardown_does(tmp_path, body, rc, err):
    """`boot_rank` (what each rank of `launch` runs): MODULE's own exit code, its output flushed,
    and the interpreter's teardown skipped -- an abort there (gloo's 'terminate called without
    an active exception' at exit, now and then) no longer fails a rank that succeeded."""
    import sys

    (tmp_path / "rank_probe_mod.py").write_text(body + "\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, "-c", launcher.boot_rank("rank_probe_mod")], capture_output=True, text=True,
                       env=env, timeout=60, cwd=tmp_path)
    assert (p.returncode, p.stdout) == (rc, "done\n"), (p.returncode, p.stdout, p.stderr)
    assert (p.stderr == err) if not err.startswith("ValueError") else p.stderr.rstrip().endswith(err), p.stderr


def test_a_rank_keeps_what_c_code_printed_through_stdio(tmp_path):
    """C code's buffered stdio output (a pipe is fully buffered) is flushed before os._exit."""
    import sys

    (tmp_path / "rank_c_mod.py").write_text("import ctypes; ctypes.CDLL(None).printf(b'from C\\n')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, "-c", launcher.boot_rank("rank_c_mod")], capture_output=True, text=True,
                       env=env, timeout=60, cwd=tmp_path)
    assert (p.returncode, p.stdout) == (0, "from C\n"), (p.returncode, p.stdout, p.stderr)
