"""What bounds the memory of writing in parallel: a byte budget for produced buffers in flight,
a pool of output buffers recycled by size, and a countdown that releases a buffer (or a source
tensor's pages) after its last user. Used by `cvt.convert.writer` and `cvt.convert.shard`."""

from __future__ import annotations

import threading
from typing import Callable

IN_FLIGHT_BYTES = 512 << 20


class ByteBudget:
    """A counting gate in bytes: `acquire(n)` waits while others hold bytes and n would pass
    the limit (a single buffer larger than the limit still goes through, alone)."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cond:
            while self.used and self.used + n > self.limit:
                self._cond.wait()
            self.used += n

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()


class BufferPool:
    """Output buffers (uint8 ``ndarray``) recycled by size, for a stage whose every tensor is a
    new buffer (fp8-to-bf16's BF16 weights). A fresh buffer costs a page fault and zeroing per
    page on first touch; reusing one does not (4.4 GB of 117 MB buffers: 0.95 s fresh, 0.19 s
    reused, on the bench machine). `give` after the writer has hashed the bytes (an
    `OutTensor.release`); idle buffers are capped at `max_idle` bytes, the rest freed, so the
    pool adds at most that to peak RSS."""

    def __init__(self, max_idle: int = IN_FLIGHT_BYTES // 2):
        self.max_idle, self.idle = max_idle, 0
        self._free: dict[int, list] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int):
        import numpy as np

        with self._lock:
            bufs = self._free.get(nbytes)
            if bufs:
                self.idle -= nbytes
                return bufs.pop()
        return np.empty(nbytes, dtype=np.uint8)

    def give(self, buf) -> None:
        with self._lock:
            if self.idle + buf.nbytes <= self.max_idle:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self.idle += buf.nbytes


class Countdown:
    """Runs `action` once, when `done` has been called `n` times (from any threads): a produced
    buffer's bytes (`FileSet.charge`) or a source tensor's pages (shard) held until their last user."""

    def __init__(self, n: int, action: Callable[[], None]):
        self.left, self.action, self._lock = n, action, threading.Lock()

    def done(self) -> None:
        with self._lock:
            self.left -= 1
            last = self.left == 0
        if last:
            self.action()
