"""The per-file checksum (`cvt.convert.checksum`): BLAKE3 recorded under its name, any flipped
byte of any output file caught by verification and by resume, and manifests / resume journals
written before BLAKE3 (sha256) still verifying and still resuming."""

from __future__ import annotations

import hashlib
import json
import shutil

import blake3
import pytest

from cvt.convert import checksum
from cvt.convert.reader import file_problems, read_manifest
from cvt.schemas.manifest import FileInfo
from cvt.tests.conftest import run_cvt

SHARD = "600000"  # several weight files from the tiny release


@pytest.fixture(scope="module")
def out(fp8_release_session, tmp_path_factory):
    dst = tmp_path_factory.mktemp("ck") / "out"
    r = run_cvt("fp8-to-bf16", fp8_release_session, dst, "--max-shard-size", SHARD, "--quiet")
    assert r.rc == 0, r.err
    return dst


def _as_sha256(records: list[dict], root) -> list[dict]:
    """Records as a cvt before BLAKE3 wrote them: sha256 (hashlib's) in place of blake3."""
    return [{"path": f["path"], "size": f["size"],
             "sha256": hashlib.sha256((root / f["path"]).read_bytes()).hexdigest(), "tensors": f["tensors"]}
            for f in records]


def _inodes(root) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in root.iterdir() if not p.name.startswith(".")}


def test_manifest_records_blake3_of_every_file(out):
    m = json.loads((out / "cvt_manifest.json").read_text())
    assert len(m["files"]) > 3
    for f in m["files"]:
        assert "sha256" not in f  # one checksum per file, under its algorithm's name
        assert f["blake3"] == blake3.blake3((out / f["path"]).read_bytes()).hexdigest()  # the package's own


@pytest.mark.slow
def test_a_flipped_byte_in_any_file_is_detected(out, tmp_path):
    """Every file the manifest lists, a byte flipped at its start, middle and end (same size):
    verification names the file; the untouched copy verifies clean."""
    dst = tmp_path / "out"
    shutil.copytree(out, dst)
    files = read_manifest(dst).files
    assert file_problems(dst, files, verify_files=True) == []
    for f in files:
        p = dst / f.path
        clean = p.read_bytes()
        for at in (0, len(clean) // 2, len(clean) - 1):
            data = bytearray(clean)
            data[at] ^= 0x01
            p.write_bytes(data)
            assert file_problems(dst, files, verify_files=True) == [f"{p}: blake3 differs from the manifest: "
                                                                     "the file was modified"], (f.path, at)
        p.write_bytes(clean)


def test_old_sha256_manifest_verifies_and_detects_a_flip(out, tmp_path):
    dst = tmp_path / "out"
    shutil.copytree(out, dst)
    m = json.loads((dst / "cvt_manifest.json").read_text())
    m["files"] = _as_sha256(m["files"], dst)
    (dst / "cvt_manifest.json").write_text(json.dumps(m))
    files = read_manifest(dst).files
    assert all(checksum.recorded(f)[0] == checksum.SHA256 for f in files)
    assert file_problems(dst, files, verify_files=True) == []
    victim = dst / files[0].path
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x80
    victim.write_bytes(data)
    assert file_problems(dst, files, verify_files=True) == [f"{victim}: sha256 differs from the manifest: "
                                                             "the file was modified"]


def test_old_sha256_journal_resumes(fp8_release_session, out, tmp_path):
    """A run killed under a cvt that journalled sha256: its finished files are checked with
    sha256 and kept (same inode), a damaged one is rewritten, a missing one written, and the
    final manifest is byte-identical to an uninterrupted run's (BLAKE3 throughout)."""
    dst = tmp_path / "out"
    shutil.copytree(out, dst)
    m = json.loads((dst / "cvt_manifest.json").read_text())
    weights = sorted(f["path"] for f in m["files"] if f["path"].endswith(".safetensors"))
    journal = {f["path"]: {k: v for k, v in f.items() if k != "path"} for f in _as_sha256(m["files"], dst)}
    (dst / ".cvt-state.json").write_text(json.dumps({"plan_id": m["plan_id"], "files": journal}))
    (dst / "cvt_manifest.json").unlink()
    (dst / weights[-1]).unlink()
    damaged = bytearray((dst / weights[1]).read_bytes())
    damaged[100] ^= 0x01
    (dst / weights[1]).write_bytes(damaged)
    before = _inodes(dst)
    r = run_cvt("fp8-to-bf16", fp8_release_session, dst, "--max-shard-size", SHARD)
    assert r.rc == 0, r.err
    assert f"wrote 2 weight files ({len(weights) - 2} already done)" in r.out
    after = _inodes(dst)
    assert [w for w in weights[:-1] if after[w] == before[w]] == [w for w in weights[:-1] if w != weights[1]]
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == {p.name: p.read_bytes() for p in out.iterdir()}


def test_old_sha256_manifest_resumes_without_rewriting(fp8_release_session, out, tmp_path):
    dst = tmp_path / "out"
    shutil.copytree(out, dst)
    m = json.loads((dst / "cvt_manifest.json").read_text())
    m["files"] = _as_sha256(m["files"], dst)
    (dst / "cvt_manifest.json").write_text(json.dumps(m))
    weights = sorted(f["path"] for f in m["files"] if f["path"].endswith(".safetensors"))
    before = _inodes(dst)
    r = run_cvt("fp8-to-bf16", fp8_release_session, dst, "--max-shard-size", SHARD)
    assert r.rc == 0, r.err
    assert f"wrote 0 weight files ({len(weights)} already done)" in r.out
    assert all(_inodes(dst)[w] == before[w] for w in weights)
    assert (dst / "cvt_manifest.json").read_bytes() == (out / "cvt_manifest.json").read_bytes()


def test_file_digests_one_read_matches_each_reference(tmp_path):
    data = bytes(range(256)) * 40_000 + b"tail"
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    got = checksum.file_digests(p, (checksum.SHA256, checksum.BLAKE3), chunk=1 << 16)
    assert got == {"sha256": hashlib.sha256(data).hexdigest(), "blake3": blake3.blake3(data).hexdigest()}
    assert checksum.verify(p, {"sha256": got["sha256"]}) == got
    assert checksum.verify(p, {"sha256": "0" * 64}) is None and checksum.verify(p, {"size": 3}) is None
    with pytest.raises(ValueError, match="unknown checksum algorithm 'xxh3'"):
        checksum.hasher("xxh3")


@pytest.mark.parametrize("fields", [{}, {"blake3": "a" * 64, "sha256": "b" * 64}])
def test_file_record_needs_exactly_one_checksum(fields):
    with pytest.raises(ValueError, match="exactly one checksum"):
        FileInfo(path="x", size=1, **fields)
