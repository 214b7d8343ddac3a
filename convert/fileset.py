"""A checkpoint's safetensors files written as their tensors arrive: `FileSet`.

Each file is a hidden temp file (`cvt.convert.durable.AtomicFile`) that opens at its first
tensor, is hashed as it is written, and after its last is closed, fsynced, renamed into place and
journaled in DST's state (`cvt.convert.outdir.OutputDir`). Bytes produced but not yet hashed are
bounded by `cvt.convert.buffers.IN_FLIGHT_BYTES`. Every float tensor handed to it is checked
finite first (`cvt.convert.finite`): the one place every verb's weights pass. `cvt.convert.writer.write_shards` feeds it one
worker per file; `cvt shard` one thread visiting the source once for many files.
"""

from __future__ import annotations

import math
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from cvt.convert.buffers import IN_FLIGHT_BYTES, ByteBudget, Countdown
from cvt.convert.durable import AtomicFile
from cvt.convert.finite import count_nonfinite, is_float, nonfinite_error
from cvt.convert.outdir import OutputDir, file_info
from cvt.convert.safetensors_io import TensorSpec, encode_header
from cvt.dtypes import DTYPES, dtype_code
from cvt.schemas.manifest import FileInfo


def _as_buffer(data, spec: TensorSpec) -> memoryview:
    """The bytes of what a producer returned: raw bytes (a buffer), a torch tensor of the spec's
    dtype, or a numpy array -- of the spec's dtype, or an unsigned array of the same item size
    holding the bits of a dtype numpy lacks (BF16 as ``uint16``, F8 as ``uint8``)."""
    if type(data).__module__ == "numpy":
        want, size = DTYPES[spec.dtype]
        bits = spec.dtype == "BF16" or spec.dtype.startswith("F8_")  # dtypes numpy lacks: held in uint16 / uint8
        if (tuple(data.shape) != spec.shape or data.dtype.itemsize != size
                or not (data.dtype.name == want or (bits and data.dtype.kind == "u"))
                or data.dtype.byteorder == (">" if sys.byteorder == "little" else "<")):  # safetensors: little-endian
            raise RuntimeError(f"internal: {spec.name} produced numpy {data.dtype} {list(data.shape)}, planned "
                               f"{spec.dtype} {list(spec.shape)}")
        import numpy as np

        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    elif hasattr(data, "dtype") and hasattr(data, "shape") and not isinstance(data, memoryview):
        code = dtype_code(data.dtype)
        if code != spec.dtype or tuple(data.shape) != spec.shape:
            raise RuntimeError(f"internal: {spec.name} produced {code} {list(data.shape)}, planned {spec.dtype} {list(spec.shape)}")
        import torch

        data = data.contiguous().reshape(-1).view(torch.uint8).numpy()
    mv = memoryview(data).cast("B")
    if len(mv) != spec.nbytes:
        raise RuntimeError(f"internal: {spec.name} produced {len(mv)} bytes, planned {spec.nbytes}")
    return mv


class _Cancelled(Exception):
    pass


class _FilePipeline:
    """One output file's back half: a writer thread that writes (and so hashes, chunk by chunk
    while each is in cache: `AtomicFile.write`) the buffers the caller's thread hands it, while
    that thread produces the next tensor. Each buffer's charge (`FileSet.charge`) is settled once written.
    `depth` bounds the queue (a worker per file runs at most that far ahead); 0 leaves it
    unbounded, memory bounded by the byte budget alone (one thread feeding many files: a full
    queue would stall every other file)."""

    _END = object()

    def __init__(self, f: AtomicFile, update: Callable[[int], None], depth: int = 0):
        import queue

        self.f, self.update = f, update
        self.error: BaseException | None = None
        self.queue: "queue.Queue" = queue.Queue(maxsize=depth)
        self.thread = threading.Thread(target=self._writer, name="cvt-file-write", daemon=True)
        self.thread.start()

    def put(self, buf: memoryview, keep, nbytes: int, charge: Countdown) -> None:
        if self.error is not None:
            charge.done()
            raise self.error
        self.queue.put((buf, keep, nbytes, charge))

    def _writer(self) -> None:
        while (item := self.queue.get()) is not self._END:
            buf, keep, nbytes, charge = item
            del item
            if self.error is None:
                try:
                    self.f.write(buf)
                    self.update(nbytes)
                except BaseException as exc:  # reported by close(); keep draining so nobody blocks
                    self.error = exc
            del buf, keep
            try:
                charge.done()  # the budget is released first, whatever its `on_last` does
            except BaseException as exc:
                if self.error is None:
                    self.error = exc

    def close(self, abort: bool = False) -> None:
        if abort and self.error is None:
            self.error = _Cancelled()
        self.queue.put(self._END)
        self.thread.join()
        if self.error is not None and not abort:
            raise self.error


@dataclass
class _Open:
    f: AtomicFile
    pipe: _FilePipeline
    left: int
    count: int
    meta: dict[str, dict] = field(default_factory=dict)


class FileSet:
    """The safetensors files of a plan, fed tensor by tensor in any interleaving: by one worker
    per file (`write_shards`) or by one thread visiting a source once and handing each slice to
    every file that holds it (`cvt shard`).

    `files`: ``[(relative path, items)]``, items with a ``.spec`` (`TensorSpec`) and optionally a
    ``.meta_key`` (stage metadata recorded per file). Files an earlier run of the same plan
    finished (`OutputDir.finished`: size, checksum and metadata match) are skipped: `pending`
    lists the others. A file opens at its first `put` and, after its last, is closed, fsynced,
    renamed and journaled on a closer thread while the caller goes on. Bytes produced but not
    yet hashed are bounded by `IN_FLIGHT_BYTES` (`charge` before producing a buffer)."""

    def __init__(self, out: OutputDir, files: list[tuple[str, list]], *, progress=None,
                 metadata: dict[str, str] | None = None, closers: int = 4, depth: int = 0):
        # closers 0: a file is closed by the thread that put its last item; depth: see _FilePipeline
        # (a worker per file: closers=0, depth=2; one feeder for many files: the defaults)
        self.depth = depth
        self.out = out
        self.header_meta = {"format": "pt"} if metadata is None else metadata
        self.update = progress.update if progress is not None else (lambda n: None)
        self.specs = {rel: [t.spec for t in items] for rel, items in files}
        self.results: dict[str, FileInfo] = {}
        self.done_meta: dict[str, dict] = {}
        self.pending: list[tuple[str, list]] = []
        for rel, items in files:
            size = len(self.header(rel)) + sum(t.spec.nbytes for t in items)
            keys = {k for t in items if (k := getattr(t, "meta_key", None))}
            done = out.finished(rel, keys)
            if done is not None and done[0].size == size:
                self.results[rel] = done[0]
                self.done_meta.update(done[1])
                self.update(sum(t.spec.nbytes for t in items))
            else:
                self.pending.append((rel, items))
        self.budget = ByteBudget(IN_FLIGHT_BYTES)
        self._open: dict[str, _Open] = {}
        self._closing: dict[str, tuple[_Open, Future]] = {}
        self._lock = threading.Lock()
        self._closer = ThreadPoolExecutor(max_workers=closers, thread_name_prefix="cvt-file-close") if closers else None
        self.meta: dict[str, dict] = dict(self.done_meta)

    def header(self, rel: str) -> bytes:
        """File `rel`'s safetensors header (its tensors' bytes start right after it)."""
        return encode_header(self.specs[rel], self.header_meta)

    def offsets(self, rel: str) -> dict[str, int]:
        """Each tensor's byte offset in file `rel`, by name (where O_DIRECT will have it)."""
        out, at = {}, len(self.header(rel))
        for spec in self.specs[rel]:
            out[spec.name] = at
            at += spec.nbytes
        return out

    def charge(self, nbytes: int, holders: int = 1, on_last: Callable[[], None] | None = None) -> Countdown:
        """Wait for room in the budget, then hold one buffer's `nbytes` until its `holders` files (a
        replicated slice is charged once) hashed it; then release them and run `on_last`."""
        self.budget.acquire(nbytes)

        def release() -> None:
            self.budget.release(nbytes)
            if on_last is not None:
                on_last()
        return Countdown(holders, release)

    def put(self, rel: str, spec: TensorSpec, data, charge: Countdown, meta: tuple[str, dict] | None = None,
            piece: bool = False, last: bool = True, check: bool = True, what: str | None = None) -> None:
        """Hand `data` (a tensor or buffer of exactly `spec`) to file `rel`, the next of its items;
        `piece`: `data` (a numpy array) is a piece of that item, any length, and unless `last`
        more of it follows. A float `spec` holding NaN / Inf is a TensorError naming `what` (the
        source tensor, `TensorRef.describe()`; default the tensor's name) and the verb, unless not
        `check` (its producer counted them already)."""
        try:
            whole = not (piece and type(data).__module__ == "numpy")
            if not whole:
                import numpy as np

                buf = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
            else:  # a whole tensor (a piece that is not numpy is the whole item: `OutTensor.pieces`)
                buf = _as_buffer(data, spec)
            bad = count_nonfinite(buf, spec.dtype) if check and is_float(spec.dtype) else 0
            if bad:
                raise nonfinite_error(what or spec.name, bad, math.prod(spec.shape) if whole else None,
                                      self.out.verb, piece)
        except BaseException:
            charge.done()
            raise
        with self._lock:
            f = self._open.get(rel)
            if f is None:
                af = None
                try:
                    af = AtomicFile(self.out.path(rel), direct=True)  # weight files: O_DIRECT (`DirectFile`)
                    af.write(self.header(rel))
                except BaseException:  # (a full disk, no file handles left): the bytes are not held
                    charge.done()
                    if af is not None:
                        af.abort()
                    raise
                n = len(self.specs[rel])
                f = self._open[rel] = _Open(af, _FilePipeline(af, self.update, self.depth), n, n)
        f.pipe.put(buf, data, len(buf), charge)
        if not last:
            return
        if meta is not None:
            f.meta[meta[0]] = meta[1]
        f.left -= 1
        if f.left == 0 and self._closer is None:
            with self._lock:
                del self._open[rel]
            try:
                info = self._finish(rel, f)
            except BaseException:
                f.f.abort()
                raise
            with self._lock:
                self.results[rel] = info
                self.meta.update(f.meta)
        elif f.left == 0:
            with self._lock:
                self._closing[rel] = (f, self._closer.submit(self._finish, rel, self._open.pop(rel)))
            self._collect(wait_all=False)

    def _finish(self, rel: str, f: _Open) -> FileInfo:
        f.pipe.close()
        size, digest = f.f.commit()
        info = file_info(rel, size, digest, f.count)
        self.out.record(info, f.meta)
        return info

    def _collect(self, wait_all: bool) -> None:
        with self._lock:
            ready = [r for r, (_, fut) in self._closing.items() if wait_all or fut.done()]
        for rel in ready:
            f, fut = self._closing[rel]
            self.results[rel] = fut.result()
            with self._lock:
                del self._closing[rel]
                self.meta.update(f.meta)

    def close(self) -> list[FileInfo]:
        """Wait for every file; their infos in plan order."""
        try:
            self._collect(wait_all=True)
            if self._open:  # every file closes after its last item; anything left is a planning bug
                raise RuntimeError(f"internal: files left open: {sorted(self._open)[:3]}")
        finally:
            if self._closer is not None:
                self._closer.shutdown(wait=True)
        return [self.results[rel] for rel in self.specs]

    def abort(self) -> None:
        """After a failure: stop every open file and remove its temp file; files whose close
        already finished stay recorded (a rerun keeps them)."""
        with self._lock:
            open_files, closing = list(self._open.values()), list(self._closing.values())
            self._open.clear()
        for f in open_files:
            f.pipe.close(abort=True)
            f.f.abort()
        for f, fut in closing:
            if not fut.cancel():
                try:
                    fut.result()
                    continue  # finished and recorded
                except BaseException:
                    pass
            f.f.abort()
        if self._closer is not None:
            self._closer.shutdown(wait=True)


__all__ = ["FileSet"]
