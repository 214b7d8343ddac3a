"""Durable writes: a file is complete or absent. `AtomicFile` (buffered, temp + fsync + rename,
hashed as written, writeback started as it goes), `DirectFile` (O_DIRECT through aligned
staging buffers, on local block filesystems), and small whole files (`write_bytes_atomic`,
`write_json_atomic`). The reading side is `cvt.convert.safetensors_io`."""

from __future__ import annotations

import errno
import json
import mmap
import os
import threading
from functools import lru_cache
from pathlib import Path

from cvt import hooks
from cvt.convert.checksum import hasher
from cvt.errors import OutputError

def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


WRITEBACK_EVERY = 64 << 20


@lru_cache(maxsize=1)
def _sync_file_range():
    """Linux's sync_file_range(2) through libc, or None elsewhere (Python's os lacks it)."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing [offset, offset + nbytes) of `fd` to disk, without
    waiting (SYNC_FILE_RANGE_WRITE). Purely a hint: `commit`'s fsync is what makes data
    durable. Errors are ignored (the fsync reports any real one)."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, offset, nbytes, 2)


DIRECT_STAGE = 2 << 20  # bytes per O_DIRECT write (a multiple of every block size); one per open weight file
_DIRECT_ALIGN = 4096
DIRECT_CHUNK = 8 << 20  # bytes per O_DIRECT write straight from a caller's placed buffer
DIRECT_QUEUED = 2  # such chunks queued to the disk thread at most
DIRECT_MIN = 64 << 10  # smaller buffers are staged (not worth two extra writes)


# local block filesystems, where an O_DIRECT write is one DMA from the staging buffer; on network
# and cluster filesystems (nfs, cifs, lustre, gpfs, fuse...) each one may be a synchronous round
# trip, so those keep buffered writes with write-behind
DIRECT_IO_FILESYSTEMS = frozenset({"ext4", "ext3", "xfs", "btrfs", "f2fs", "bcachefs"})


def direct_io_enabled(directory: Path | None = None) -> bool:
    """Whether weight files in `directory` are written with O_DIRECT (`DirectFile`): Linux, a
    local filesystem (`DIRECT_IO_FILESYSTEMS`, from /proc/self/mounts), and not
    ``CVT_DIRECT_IO=0``."""
    if not hasattr(os, "O_DIRECT") or os.environ.get("CVT_DIRECT_IO", "1") == "0":
        return False
    return directory is None or filesystem_type(directory) in DIRECT_IO_FILESYSTEMS


def filesystem_type(directory: Path) -> str | None:
    """The type of the filesystem holding `directory` (the longest mount point above its real
    path in /proc/self/mounts), or None where that is not readable."""
    return _fs_type(os.path.realpath(directory))


@lru_cache(maxsize=64)
def _fs_type(real: str) -> str | None:
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return None
    best, fs = -1, None
    for point, kind in mounts:
        point = point.replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > best:
            best, fs = len(point), kind
    return fs


class DirectFile:
    """A sequential file written with O_DIRECT through aligned staging buffers, hashing each
    staged chunk while it is still in cache.

    Why O_DIRECT: a buffered write copies every byte into a freshly allocated page-cache page,
    and on the machines measured that copy cost more CPU than the quantize kernel itself
    (perf: 21% of a w8a8 run in ``copy_folio_from_iter_atomic``; 0.36-3.1 CPU s for the same
    1.26 GB between runs, depending on what the kernel had to reclaim). With O_DIRECT the disk
    reads the staging buffer itself; the copy into it is a plain memcpy (numpy, outside the
    GIL). The bytes are not left in the page cache, which a TB-sized output would evict anyway.

    Why hash here (`sha`, a `cvt.convert.checksum.hasher`): a 2 MB chunk that was just copied
    sits in the core's L2, where hashing it ran 2-3x faster on the bench machine than over
    the same bytes read back from memory by a separate hasher; with one output file the hash
    is on a run's critical path.

    Layout: the caller's thread copies into a staging buffer and hashes it; for the first
    `DOUBLE_BUFFERED` files open at once, a disk thread writes each full buffer (aligned
    O_DIRECT writes) while a second one fills; further files (`cvt shard` feeds every rank's
    file at once) write full buffers in the caller's thread, so staging memory stays
    2 x DIRECT_STAGE x DOUBLE_BUFFERED + DIRECT_STAGE per other open file. `flush` waits for
    the disk thread, then writes the staged rest itself, its unaligned tail through a buffered
    write (the file is buffered from then on). A filesystem that refuses O_DIRECT at open or
    at the first write (EINVAL) gets buffered writes of the same bytes.

    No staging copy for a large buffer placed as its bytes sit in the file (its address and
    its file offset at the same offset within a page: `cvt.convert.buffers.OutputPool`, where
    the C kernels write): the bytes up to the next page boundary are staged, the staged pages
    written, then the buffer's whole pages go to the disk straight from it (`DIRECT_CHUNK` at
    a time, queued to the disk thread and hashed while it writes them; at most
    `DIRECT_QUEUED` chunks queued; `write` returns once they are written, so that the caller
    may reuse the buffer), and its last partial page is staged. `direct_bytes` counts the bytes
    written so.
        """

    DOUBLE_BUFFERED = 4
    _open_double = 0
    _count_lock = threading.Lock()

    def __init__(self, path: Path, sha=None):
        import numpy as np

        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        try:
            self._fd = os.open(path, flags | os.O_DIRECT, 0o666)
            self.direct = True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._fd = os.open(path, flags, 0o666)
            self.direct = False
        self.sha = sha
        with DirectFile._count_lock:
            self._double = self._counted = DirectFile._open_double < self.DOUBLE_BUFFERED
            DirectFile._open_double += self._double
        self._maps: list = []
        try:
            for _ in range(2 if self._double else 1):
                self._maps.append(mmap.mmap(-1, DIRECT_STAGE, flags=mmap.MAP_PRIVATE))  # page-aligned, as O_DIRECT needs
        except BaseException:
            self._release_maps()
            self._uncount()
            os.close(self._fd)
            self._fd = -1
            raise
        self._arrays = [np.frombuffer(m, dtype=np.uint8) for m in self._maps]
        self._free = list(range(len(self._maps)))  # stage indices the caller may fill
        self._cur = self._free.pop()
        self._fill = 0
        self._cond = threading.Condition()
        # (stage index or None, bytes) to write, in file order, for the disk thread: a filled stage,
        # or a chunk of a caller's placed buffer (`write`)
        self._todo: list[tuple[int | None, memoryview]] = []
        self._pos = 0  # bytes written to this file so far (staged, queued or on disk)
        self.direct_bytes = 0  # of which written straight from the caller's buffers
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None

    def fileno(self) -> int:
        return self._fd

    def write(self, data) -> None:
        import numpy as np

        src = np.frombuffer(data, dtype=np.uint8)
        n = len(src)
        if self.direct and n >= DIRECT_MIN:
            head = -self._pos % _DIRECT_ALIGN  # bytes up to the file's next page boundary
            body = max(0, n - head) // _DIRECT_ALIGN * _DIRECT_ALIGN
            if body > 0 and (src.ctypes.data + head) % _DIRECT_ALIGN == 0:  # placed: no staging copy
                self._stage(src[:head])
                self._straight(src[head:head + body])
                self._stage(src[head + body:])
                return
        self._stage(src)

    def _stage(self, src) -> None:
        """Copy `src` (uint8 ``ndarray``) into the staging buffers and hash it, writing each full one."""
        pos, n = 0, len(src)
        while pos < n:
            k = min(DIRECT_STAGE - self._fill, n - pos)
            stage = self._arrays[self._cur]
            stage[self._fill:self._fill + k] = src[pos:pos + k]  # numpy copies without the GIL
            if self.sha is not None:
                self.sha.update(stage[self._fill:self._fill + k])  # while it is in cache
            self._fill += k
            pos += k
            if self._fill == DIRECT_STAGE:
                self._submit()
        self._pos += n

    def _straight(self, body) -> None:
        """Write `body` (whole pages of a caller's buffer, at a page-aligned file offset) from
        where it is: the staged pages before it first, then chunk by chunk, each hashed while
        the disk thread writes it."""
        if self._fill % _DIRECT_ALIGN:
            raise RuntimeError(f"internal: O_DIRECT stage of {self._fill} bytes before a placed buffer")
        if self._fill:
            self._submit()  # a whole number of pages: the file offset is page-aligned here
        for i in range(0, len(body), DIRECT_CHUNK):
            chunk = body[i:i + DIRECT_CHUNK]
            if self._double:
                self._queue(None, memoryview(chunk))
                if self.sha is not None:
                    self.sha.update(chunk)
            else:
                if self.sha is not None:
                    self.sha.update(chunk)
                self._write(memoryview(chunk))
            self._pos += len(chunk)
            self.direct_bytes += len(chunk)
        if self._double:  # the caller may reuse the buffer once this returns (its writer's budget
            with self._cond:  # is released, a pooled block goes back): written by then
                while self._error is None and any(i is None for i, _ in self._todo):
                    self._cond.wait()
                self._raise()

    def _submit(self) -> None:
        """Hand the filled part of the current stage (all of it, or whole pages) to the disk
        thread; take a free one (waiting for it). Single-buffered: write it here."""
        view = memoryview(self._maps[self._cur])[:self._fill]
        if not self._double:
            self._write(view)
            self._fill = 0
            return
        self._queue(self._cur, view)
        with self._cond:
            while not self._free and self._error is None:
                self._cond.wait()
            self._raise()
            self._cur = self._free.pop()
        self._fill = 0

    def _queue(self, stage: int | None, view: memoryview) -> None:
        """Queue `view` for the disk thread (started on first use); a caller's chunk (`stage`
        None) waits while `DIRECT_QUEUED` are queued."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._disk, name="cvt-direct-write", daemon=True)
            self._thread.start()
        with self._cond:
            while (stage is None and self._error is None
                   and sum(i is None for i, _ in self._todo) >= DIRECT_QUEUED):
                self._cond.wait()
            self._raise()
            self._todo.append((stage, view))
            self._cond.notify_all()

    def _disk(self) -> None:
        while True:
            with self._cond:
                while not self._todo and not self._stop:
                    self._cond.wait()
                if not self._todo:
                    return
                i, view = self._todo[0]
            try:
                if self._error is None:
                    self._write(view)
            except BaseException as exc:  # raised in the caller's thread by the next call
                self._error = exc
            del view
            with self._cond:
                self._todo.pop(0)
                if i is not None:
                    self._free.append(i)
                self._cond.notify_all()

    def _drain(self) -> None:
        """Wait until the disk thread has written every full stage handed to it."""
        with self._cond:
            while self._todo:
                self._cond.wait()
            self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def flush(self) -> None:
        self._drain()
        whole = self._fill // _DIRECT_ALIGN * _DIRECT_ALIGN if self.direct else 0
        view = memoryview(self._maps[self._cur])
        if whole:
            self._write(view[:whole])
        if self._fill > whole:
            self._buffered()
            self._write(view[whole:self._fill])
        self._fill = 0

    def _buffered(self) -> None:
        if self.direct:
            import fcntl

            fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False

    def _write(self, view: memoryview) -> None:
        while len(view):
            try:
                n = os.write(self._fd, view)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                self._buffered()  # opened with O_DIRECT, but this filesystem refuses the writes
                continue
            view = view[n:]

    def close(self) -> None:
        """Close once: a second call must not close whatever file has reused the number."""
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        if self._thread is not None:
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            self._thread.join()
        try:
            os.close(fd)
        finally:
            self._arrays = []
            self._release_maps()
            self._uncount()

    def _uncount(self) -> None:
        with DirectFile._count_lock:
            if self._counted:
                self._counted = False
                DirectFile._open_double -= 1

    def _release_maps(self) -> None:
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a failed write's traceback still holds a view: unmapped when it goes
                pass
        self._maps = []


class AtomicFile:
    """Write to `<dir>/.<name>.tmp`, hashing as it goes (`cvt.convert.checksum.ALGORITHM`);
    `commit()` fsyncs, renames and returns (size, hex digest).

    Until commit nothing named `name` exists, so a killed or failed run never leaves a file
    that looks complete. Every byte goes through `write`, and from there through `cvt.hooks.write`
    (a plain write, unless the CLI installed the kill-and-resume tests' `cvt.testing.faults`).

    `direct` (the writer's weight files, when `direct_io_enabled`): written through
    `DirectFile` (O_DIRECT), so no byte is copied into the page cache. Otherwise buffered, and
    every `WRITEBACK_EVERY` bytes the kernel is asked to start writing the finished range to
    disk (`start_writeback`), so the disk works while cvt computes and `commit`'s fsync only
    waits for the tail: without it the whole file sat dirty in the page cache until the
    final fsync (measured: 0.5 s of a 3.3 s quantize run spent in that one fsync), and a
    1 TB run filled the page cache with dirty pages.
    """

    def __init__(self, path: Path, direct: bool = False):
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp")
        self.sha = hasher()
        self.size = 0
        self._synced = 0  # bytes handed to start_writeback
        try:
            self._f = (DirectFile(self.tmp, self.sha) if direct and direct_io_enabled(path.parent)
                       else open(self.tmp, "wb"))
        except OSError as exc:
            try:
                self.tmp.unlink()
            except OSError:
                pass
            raise OutputError(f"{self.tmp}: cannot create: {exc.strerror or exc}") from exc

    def write(self, data) -> None:
        """Write and hash `data`, each chunk of at most `DIRECT_STAGE` bytes hashed right after it
        was copied (into the staging buffer, or into the page cache by a buffered write), while
        it is still in cache (sha256, measured: 1.9 GB/s so, against 1.15 GB/s for a separate
        hasher reading the bytes back from memory; a buffered quantize: 1.9-2.0 s -> 1.8 s)."""
        mv = memoryview(data).cast("B")
        try:
            if isinstance(self._f, DirectFile):  # hashes each chunk as it stages it
                hooks.write(self._f, mv)
            else:
                for i in range(0, len(mv), DIRECT_STAGE):
                    chunk = mv[i:i + DIRECT_STAGE]
                    hooks.write(self._f, chunk)
                    self.sha.update(chunk)
        except OSError as exc:
            self.abort()
            raise OutputError(f"{self.path}: write failed after {self.size} bytes: {exc.strerror or exc} (disk full?)") from exc
        self.size += len(mv)
        if self.size - self._synced >= WRITEBACK_EVERY and not getattr(self._f, "direct", False):
            self._f.flush()
            start_writeback(self._f.fileno(), self._synced, self.size - self._synced)
            self._synced = self.size

    def commit(self) -> tuple[int, str]:
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self.tmp, self.path)
        except OSError as exc:
            self.abort()
            raise OutputError(f"{self.path}: cannot finish writing: {exc.strerror or exc} (disk full?)") from exc
        fsync_dir(self.path.parent)
        return self.size, self.sha.hexdigest()

    def abort(self) -> None:
        try:
            self._f.close()
        except OSError:
            pass
        try:
            self.tmp.unlink()
        except OSError:
            pass

    def __enter__(self) -> "AtomicFile":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def write_bytes_atomic(path: Path, data: bytes) -> tuple[int, str]:
    with AtomicFile(path) as f:
        f.write(data)
        return f.commit()


def write_json_atomic(path: Path, obj) -> tuple[int, str]:
    return write_bytes_atomic(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))


def write_safetensors_atomic(path: Path, tensors: dict) -> tuple[int, str]:
    """torch `tensors` as one safetensors file, in their order, atomically and hashed as
    written: (size, hex digest)."""
    import torch  # the tensors are torch's: it is imported already

    from cvt.convert.safetensors_io import TensorSpec, encode_header
    from cvt.dtypes import dtype_code

    specs = [TensorSpec(n, dtype_code(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
    with AtomicFile(path) as f:
        f.write(encode_header(specs, {"format": "pt"}))
        for t in tensors.values():
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy())
        return f.commit()
