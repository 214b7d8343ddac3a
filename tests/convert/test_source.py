"""SRC as a local directory or a hub repo id, offline, against huggingface-hub's real cache logic.

A fake Hugging Face cache is built in tmp exactly as huggingface-hub lays it out
(`HF_HOME/hub/models--ORG--NAME/{refs/main, snapshots/<commit>/..., blobs/...}`) and the
CLI runs with `HF_HUB_OFFLINE=1`: nothing is mocked and nothing touches the network.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from cvt.convert.source import Source, resolve
from cvt.errors import CheckpointError
from cvt.tests.conftest import run_cvt

ORG, NAME = "cvt-test", "tiny-fp8"
REPO_ID = f"{ORG}/{NAME}"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def build_hub_cache(hf_home: Path, release: Path, *, repo_id: str = REPO_ID, commit: str = COMMIT,
                    symlinks: bool = True) -> Path:
    """Put `release` into a hub cache under `hf_home`; returns the snapshot folder.

    With `symlinks` the files are blobs linked from the snapshot (what huggingface-hub writes
    on Linux); without, they are plain copies in the snapshot (what it writes where symlinks
    are unavailable).
    """
    org, name = repo_id.split("/")
    repo = hf_home / "hub" / f"models--{org}--{name}"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(release.iterdir()):
        if symlinks:
            blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
            shutil.copyfile(f, blob)
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))
        else:
            shutil.copyfile(f, snap / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)  # huggingface-hub writes the hash without a newline
    return snap


def hub_env(hf_home: Path) -> dict:
    return {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hf_home / "hub"),
            "HUGGINGFACE_HUB_CACHE": str(hf_home / "hub")}


def assert_one_line_error(res, *names: str) -> str:
    assert res.rc != 0, f"expected failure\nstdout: {res.out}\nstderr: {res.err}"
    assert "Traceback" not in res.err, res.err
    lines = res.err.strip().splitlines()
    assert len(lines) == 1, f"stderr should be one line, got {len(lines)}:\n{res.err}"
    assert lines[0].startswith("cvt: error:"), lines[0]
    for name in names:
        assert name in lines[0], f"{name!r} not in: {lines[0]}"
    return lines[0]


def assert_nothing_complete(dst: Path) -> None:
    if dst.exists():
        for m in ("cvt_manifest.json", "model.safetensors.index.json", "config.json"):
            assert not (dst / m).exists(), m


def assert_converted(dst: Path) -> dict:
    manifest = json.loads((dst / "cvt_manifest.json").read_text())
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(dst / fname, framework="pt") as f:
            assert set(f.keys()) <= set(index["weight_map"])
    return manifest


@pytest.fixture
def hf_home(tmp_path, fp8_release_session) -> Path:
    home = tmp_path / "hf_home"
    build_hub_cache(home, fp8_release_session)
    return home


# ----------------------------------------------------------------------------------------
# hub ids through the CLI


@pytest.mark.parametrize("symlinks", [pytest.param(True, marks=pytest.mark.slow), False],
                         ids=["blob-symlinks", "plain-files"])
def test_hub_id_from_offline_cache(tmp_path, fp8_release_session, symlinks):
    home = tmp_path / "hf_home"
    build_hub_cache(home, fp8_release_session, symlinks=symlinks)
    dst = tmp_path / "out"
    res = run_cvt("fp8-to-bf16", REPO_ID, dst, "--quiet", env=hub_env(home))
    assert res.rc == 0, res.err
    src = assert_converted(dst)["source"]
    assert src["kind"] == "hub"
    assert src["repo_id"] == REPO_ID
    assert src["revision"] == COMMIT
    # side files came through the snapshot (symlinked blobs are copied as files, not links)
    assert (dst / "tokenizer.json").is_file() and not (dst / "tokenizer.json").is_symlink()
    assert (dst / "tokenizer.json").read_bytes() == (fp8_release_session / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("revision", [COMMIT, pytest.param("main", marks=pytest.mark.slow)], ids=["commit", "branch"])
def test_hub_revision(tmp_path, hf_home, revision):
    dst = tmp_path / "out"
    res = run_cvt("fp8-to-bf16", REPO_ID, dst, "--revision", revision, "--quiet", env=hub_env(hf_home))
    assert res.rc == 0, res.err
    src = assert_converted(dst)["source"]
    assert (src["kind"], src["repo_id"], src["revision"]) == ("hub", REPO_ID, COMMIT)


@pytest.mark.slow
def test_hub_id_not_in_cache(tmp_path, hf_home):
    dst = tmp_path / "out"
    res = run_cvt("fp8-to-bf16", "cvt-test/not-cached", dst, env=hub_env(hf_home))
    assert_one_line_error(res, "cvt-test/not-cached")
    assert_nothing_complete(dst)


@pytest.mark.slow
def test_hub_id_not_in_empty_cache(tmp_path):
    dst = tmp_path / "out"
    res = run_cvt("fp8-to-bf16", REPO_ID, dst, env=hub_env(tmp_path / "empty_hf_home"))
    assert_one_line_error(res, REPO_ID)
    assert_nothing_complete(dst)


@pytest.mark.parametrize("revision", [OTHER_COMMIT, pytest.param("no-such-branch", marks=pytest.mark.slow)],
                         ids=["commit", "branch"])
def test_hub_revision_not_in_cache(tmp_path, hf_home, revision):
    dst = tmp_path / "out"
    res = run_cvt("fp8-to-bf16", REPO_ID, dst, "--revision", revision, env=hub_env(hf_home))
    assert_one_line_error(res, REPO_ID, revision)  # which revision was not found
    assert_nothing_complete(dst)


@pytest.mark.slow
def test_hub_incomplete_snapshot(tmp_path, fp8_release_session):
    """A cached tree listing says the snapshot should hold a shard that is not there."""
    home = tmp_path / "hf_home"
    snap = build_hub_cache(home, fp8_release_session, symlinks=False)
    missing = "model-00002-of-00003.safetensors"
    files = {p.name: {"size": p.stat().st_size, "blob_id": hashlib.sha1(p.read_bytes()).hexdigest()}
             for p in sorted(snap.iterdir())}
    (snap / missing).unlink()
    trees = snap.parent.parent / "trees"
    trees.mkdir()
    (trees / f"{COMMIT}.json").write_text(json.dumps({"format_version": 1, "files": files}))
    dst = tmp_path / "out"
    res = run_cvt("fp8-to-bf16", REPO_ID, dst, env=hub_env(home))
    assert_one_line_error(res, missing)
    assert_nothing_complete(dst)


@pytest.mark.slow
def test_hub_errors_name_files_in_the_snapshot(tmp_path, hf_home):
    """A corrupt file in a cached snapshot is reported like a local one: one line, the file named."""
    snap = hf_home / "hub" / f"models--{ORG}--{NAME}" / "snapshots" / COMMIT
    shard = snap / "model-00001-of-00003.safetensors"
    data = shard.read_bytes()
    target = shard.resolve()
    shard.unlink()
    shard.write_bytes(data[: len(data) // 2])  # the blob is shared: replace the link, not the blob
    assert target.exists()
    dst = tmp_path / "out"
    res = run_cvt("fp8-to-bf16", REPO_ID, dst, env=hub_env(hf_home))
    assert_one_line_error(res, shard.name)
    assert_nothing_complete(dst)


# ----------------------------------------------------------------------------------------
# local paths through the CLI


@pytest.mark.parametrize("src", ["./nonexistent", "../nonexistent", "/nonexistent/dir", "nonexistent", "no/such/dir"],
                         ids=["dot", "dotdot", "absolute", "bare-word", "three-parts"])
def test_missing_local_dir(tmp_path, src):
    dst = tmp_path / "out"
    res = run_cvt("fp8-to-bf16", src, dst, env=hub_env(tmp_path / "hf_home"))
    assert_one_line_error(res, "no such directory", src)
    assert not dst.exists()


def test_src_is_a_file(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    res = run_cvt("fp8-to-bf16", f, tmp_path / "out")
    assert_one_line_error(res, "not a directory", f.name)


def test_revision_with_local_dir(tmp_path, fp8_release):
    res = run_cvt("fp8-to-bf16", fp8_release, tmp_path / "out", "--revision", COMMIT)
    assert_one_line_error(res, "--revision")


@pytest.mark.slow
def test_local_dir_wins_over_hub_id(tmp_path, fp8_release_session):
    """An existing directory spelled like owner/name is a local directory, not a hub id."""
    work = tmp_path / "cwd"
    shutil.copytree(fp8_release_session, work / ORG / NAME)
    dst = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "cvt", "fp8-to-bf16", REPO_ID, str(dst), "--quiet"], cwd=work,
                       capture_output=True, text=True, env={**os.environ, **hub_env(tmp_path / "empty")})
    assert p.returncode == 0, p.stderr
    src = json.loads((dst / "cvt_manifest.json").read_text())["source"]
    assert src["kind"] == "local" and src["repo_id"] is None


# ----------------------------------------------------------------------------------------
# cvt.convert.source.resolve directly


def test_resolve_local_dir(fp8_release):
    s = resolve(str(fp8_release))
    assert s == Source(fp8_release.resolve())
    assert s.kind == "local" and s.describe() == str(fp8_release.resolve())


def test_resolve_local_errors(tmp_path, fp8_release):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(CheckpointError, match="not a directory"):
        resolve(f)
    with pytest.raises(CheckpointError, match="--revision"):
        resolve(fp8_release, revision="main")
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve("./missing-dir")


@pytest.mark.slow
def test_resolve_hub_id_offline(tmp_path, hf_home):
    """resolve() in a fresh interpreter (huggingface-hub reads HF_HOME/HF_HUB_OFFLINE at import)."""
    code = (
        "import json, sys\n"
        "from cvt.convert.source import resolve\n"
        "s = resolve(sys.argv[1], sys.argv[2] or None)\n"
        "print(json.dumps({'path': str(s.path), 'kind': s.kind, 'repo_id': s.repo_id, 'revision': s.revision}))\n"
    )
    for rev in ("", "main", COMMIT):
        p = subprocess.run([sys.executable, "-c", code, REPO_ID, rev], capture_output=True, text=True,
                           env={**os.environ, **hub_env(hf_home)})
        assert p.returncode == 0, p.stderr
        got = json.loads(p.stdout)
        snap = hf_home / "hub" / f"models--{ORG}--{NAME}" / "snapshots" / COMMIT
        assert got == {"path": str(snap), "kind": "hub", "repo_id": REPO_ID, "revision": COMMIT}
