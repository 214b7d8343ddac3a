"""cvt's own header parser and streaming writer, refereed by the safetensors library."""

from __future__ import annotations

from pathlib import Path

import blake3
import pytest
import torch
from safetensors.torch import load_file, save_file

from cvt.dtypes import dtype_code

from cvt.convert.durable import write_safetensors_atomic
from cvt.convert.safetensors_io import read_header

from cvt.convert.durable import AtomicFile
from cvt.errors import CheckpointError

TENSORS = {
    "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "b": torch.randn(5, 7).to(torch.bfloat16),
    "c": torch.randint(-128, 127, (9,), dtype=torch.int8),
    "d": torch.randn(4, 3).to(torch.float8_e4m3fn),
    "e": torch.tensor(3.5, dtype=torch.float64),
    "f": torch.empty(0, 4, dtype=torch.float16),
    "g": torch.randint(0, 255, (2, 2), dtype=torch.uint8).view(torch.float8_e8m0fnu),
}


write_with_cvt = write_safetensors_atomic  # the writer cvt uses for its own safetensors (calibration state)


def test_cvt_writes_what_safetensors_reads(tmp_path):
    size, sha = write_with_cvt(tmp_path / "x.safetensors", TENSORS)
    back = load_file(tmp_path / "x.safetensors")
    assert set(back) == set(TENSORS)
    for n, t in TENSORS.items():
        assert back[n].dtype == t.dtype and torch.equal(back[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), n
    assert size == (tmp_path / "x.safetensors").stat().st_size
    assert (8 + int.from_bytes((tmp_path / "x.safetensors").read_bytes()[:8], "little")) % 8 == 0  # aligned data
    assert not list(tmp_path.glob(".*.tmp"))


def test_cvt_reads_what_safetensors_writes(tmp_path):
    save_file({k: v for k, v in TENSORS.items()}, tmp_path / "y.safetensors", metadata={"format": "pt"})
    refs, meta = read_header(tmp_path / "y.safetensors")
    assert meta == {"format": "pt"} and set(refs) == set(TENSORS)
    raw = (tmp_path / "y.safetensors").read_bytes()
    for n, t in TENSORS.items():
        assert refs[n].shape == tuple(t.shape) and refs[n].dtype == dtype_code(t.dtype)
        assert raw[refs[n].start:refs[n].end] == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_abort_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with AtomicFile(tmp_path / "z.safetensors") as f:
            f.write(b"12345678")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "mangle,message",
    [
        (lambda raw: raw[:5], "truncated safetensors file"),
        (lambda raw: (10**9).to_bytes(8, "little") + raw[8:], "header length 1000000000 exceeds the file"),
        (lambda raw: raw[:-3], "past the end of the file"),
        (lambda raw: raw + b"junk", "bytes after the last tensor"),
        (lambda raw: raw[:8] + b"x" + raw[9:], "not valid JSON"),
    ],
    ids=["shorter-than-8", "header-too-long", "truncated-data", "trailing-bytes", "bad-json"],
)
def test_malformed_files_name_the_file(tmp_path, mangle, message):
    save_file({"w": torch.ones(4, 4)}, tmp_path / "ok.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(mangle((tmp_path / "ok.safetensors").read_bytes()))
    with pytest.raises(CheckpointError, match=message) as exc:
        read_header(bad)
    assert str(bad) in str(exc.value)


def test_lying_sizes_and_overlaps(tmp_path):
    import json

    def craft(header: dict, data: bytes):
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        p = tmp_path / "c.safetensors"
        p.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
        return p

    p = craft({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}, b"\0" * 12)
    with pytest.raises(CheckpointError, match=r"tensor w: 12 bytes on disk but F32 \[2, 2\] needs 16"):
        read_header(p)
    p = craft({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
               "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, b"\0" * 6)
    with pytest.raises(CheckpointError, match="overlaps"):
        read_header(p)
    p = craft({"a": {"dtype": "Q7", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4)
    with pytest.raises(CheckpointError, match="unknown dtype 'Q7'"):
        read_header(p)


def test_writeback_starts_on_each_finished_range(tmp_path, monkeypatch):
    """AtomicFile asks the kernel to write every WRITEBACK_EVERY bytes out as they are written
    (sync_file_range, so the final fsync waits only for the tail and dirty pages stay bounded):
    the ranges handed over are contiguous from offset 0, never past what was written, and the
    file's bytes and checksum are unchanged by it."""
    import os
    import sys

    from cvt.convert import durable as S

    calls = []
    real = S.start_writeback
    monkeypatch.setattr(S, "WRITEBACK_EVERY", 1 << 20)
    monkeypatch.setattr(S, "start_writeback", lambda fd, off, n: (calls.append((off, n)), real(fd, off, n)))
    data = os.urandom((5 << 20) + 12345)
    with AtomicFile(tmp_path / "w.bin") as f:
        for i in range(0, len(data), 300_000):
            f.write(data[i:i + 300_000])
        size, sha = f.commit()
    assert (tmp_path / "w.bin").read_bytes() == data and size == len(data)
    assert sha == blake3.blake3(data).hexdigest()  # the blake3 package's own digest
    assert calls and calls[0][0] == 0 and all(n >= 1 << 20 for _, n in calls)
    assert all(a + n == b for (a, n), (b, _) in zip(calls, calls[1:]))  # contiguous, no gap, no overlap
    assert len(data) - (1 << 20) - 300_000 < calls[-1][0] + calls[-1][1] <= len(data)  # only the tail left
    if sys.platform.startswith("linux"):  # the real syscall is found and accepts the calls above
        assert S._sync_file_range() is not None


def _write_direct(path, data: bytes, piece: int):
    with AtomicFile(path, direct=True) as f:
        for i in range(0, len(data), piece):
            f.write(data[i:i + piece])
        return f.commit()


@pytest.mark.parametrize("size", [0, 100, 4096, (2 << 20) - 1, 2 << 20, (5 << 20) + 12345])
def test_direct_file_writes_the_same_bytes(tmp_path, monkeypatch, size):
    """Weight files go out through O_DIRECT (`DirectFile`: whole staging buffers as aligned
    writes, the unaligned tail buffered at commit): the same bytes and checksum as the data, for
    empty, sub-page, page-sized, stage-sized and multi-stage files written in odd pieces."""
    import os

    from cvt.convert import durable as S

    if not S.direct_io_enabled():
        pytest.skip("no O_DIRECT here (or CVT_DIRECT_IO=0)")
    opened = []
    real = S.DirectFile.__init__
    monkeypatch.setattr(S.DirectFile, "__init__", lambda self, *a: (real(self, *a), opened.append(self.direct))[0])
    data = os.urandom(size)
    assert _write_direct(tmp_path / "w.bin", data, 300_001) == (size, blake3.blake3(data).hexdigest())
    assert (tmp_path / "w.bin").read_bytes() == data
    assert len(opened) == 1  # O_DIRECT itself, or a buffered file where the filesystem refuses it: same bytes


def test_direct_file_falls_back_where_the_filesystem_refuses(tmp_path, monkeypatch):
    """tmpfs refuses O_DIRECT at open, some FUSE filesystems only at the first write (EINVAL):
    both become ordinary buffered files with the same bytes; other errors still fail."""
    import errno
    import os

    from cvt.convert import durable as S
    from cvt.errors import OutputError

    data = os.urandom((3 << 20) + 77)
    real_open, real_write = os.open, os.write

    def refuse_open(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(S, "direct_io_enabled", lambda *a: True)
    monkeypatch.setattr(os, "O_DIRECT", getattr(os, "O_DIRECT", 0o40000), raising=False)
    monkeypatch.setattr(os, "open", refuse_open)
    _write_direct(tmp_path / "a.bin", data, 1 << 20)
    assert (tmp_path / "a.bin").read_bytes() == data
    monkeypatch.setattr(os, "open", real_open)

    refused = []

    def refuse_direct_write(fd, view):
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(len(view))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, view)

    try:  # does this filesystem take O_DIRECT at open? then the writes are what it refuses below
        os.close(real_open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o666))
        opens_direct = True
    except OSError:
        opens_direct = False
    monkeypatch.setattr(os, "write", refuse_direct_write)
    _write_direct(tmp_path / "b.bin", data, 1 << 20)
    assert (tmp_path / "b.bin").read_bytes() == data
    assert bool(refused) == opens_direct  # refused once, then buffered
    assert len(refused) <= 1

    def full(fd, view):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OutputError, match=r"c\.bin: .*No space left on device"):
        _write_direct(tmp_path / "c.bin", data, 1 << 20)
    assert not list(tmp_path.glob(".c.bin*"))  # nothing half-written left behind


def test_direct_io_only_on_local_filesystems(tmp_path, monkeypatch):
    """O_DIRECT is for local block filesystems (a network or cluster filesystem may make every
    2 MB write a synchronous round trip): the filesystem is read from /proc/self/mounts by the
    longest mount point above the directory; CVT_DIRECT_IO=0 turns it off everywhere."""
    import os

    from cvt.convert import durable as S

    if not os.path.exists("/proc/self/mounts") or not hasattr(os, "O_DIRECT"):
        pytest.skip("Linux only")
    kind = S.filesystem_type(tmp_path)
    assert kind is not None
    assert S.direct_io_enabled(tmp_path) == (kind in S.DIRECT_IO_FILESYSTEMS)
    if os.path.isdir("/proc/self"):
        assert S.filesystem_type(Path("/proc/self")) == "proc" and not S.direct_io_enabled(Path("/proc/self"))
    monkeypatch.setenv("CVT_DIRECT_IO", "0")
    assert not S.direct_io_enabled(tmp_path)


def test_direct_file_closes_once(tmp_path):
    """A failed write aborts the file, and its caller may abort again: the second close must not
    close whatever file has reused the descriptor number since."""
    import os

    from cvt.convert.durable import DirectFile

    f = DirectFile(tmp_path / "a.bin")
    f.write(b"x" * 5000)
    f.flush()
    f.close()
    other = os.open(tmp_path / "b.bin", os.O_WRONLY | os.O_CREAT)  # likely the number f had
    try:
        f.close()
        os.write(other, b"still open")
    finally:
        os.close(other)
    assert (tmp_path / "b.bin").read_bytes() == b"still open"
    assert (tmp_path / "a.bin").read_bytes() == b"x" * 5000


def test_direct_files_beyond_the_double_buffered_ones_write_in_place(tmp_path, monkeypatch):
    """`cvt shard` feeds every rank's file at once: only the first DOUBLE_BUFFERED open files get a
    second staging buffer and a disk thread (memory), the rest write each full buffer in the
    caller's thread; the same bytes either way, and closing gives the slots back."""
    import os

    from cvt.convert import durable as S

    if not S.direct_io_enabled(tmp_path):
        pytest.skip("no O_DIRECT on this filesystem")
    monkeypatch.setattr(S.DirectFile, "DOUBLE_BUFFERED", 2)
    before = S.DirectFile._open_double
    data = [os.urandom((3 << 20) + 17 * i) for i in range(4)]
    files = [AtomicFile(tmp_path / f"f{i}.bin", direct=True) for i in range(4)]
    assert [f._f._double for f in files] == [True, True, False, False]
    for piece in range(0, max(map(len, data)), 700_000):  # interleaved, as the shard writer does
        for f, d in zip(files, data):
            f.write(d[piece:piece + 700_000])
    for i, (f, d) in enumerate(zip(files, data)):
        assert f.commit() == (len(d), blake3.blake3(d).hexdigest())
        assert (tmp_path / f"f{i}.bin").read_bytes() == d
    assert S.DirectFile._open_double == before
