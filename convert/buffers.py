"""What bounds the memory of writing in parallel, and where produced bytes live: a byte budget
for produced buffers in flight, a countdown that releases a buffer (or a source tensor's pages)
after its last user (`cvt.convert.writer`, `cvt.convert.shard`), and the pool of page-aligned
output buffers the C kernels write into (`OutputPool`, `place`), placed so that O_DIRECT writes
them without a staging copy."""

from __future__ import annotations

import collections
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


# ---- page-aligned output buffers, placed for O_DIRECT -------------------------------------------

PAGE = 4096  # O_DIRECT's alignment of buffers and file offsets (`cvt.convert.durable`)
# smaller outputs come from malloc; from here on they are pooled: glibc's own reuse of freed
# blocks depends on its mmap threshold, arenas and trimming, and on the bench VM the OS zeroing
# fresh pages was still 14-45% of an fp8-to-bf16 / w8a8 run's CPU samples (perf) with it
POOLED_MIN = 1 << 20
PLACED_MIN = 64 << 10  # smaller outputs are not worth placing (the writer stages them anyway)
_place = threading.local()


def place(file_offset: int) -> None:
    """Tell this thread's next `OutputPool.array` where its bytes will sit in their output file
    (the writer calls this before each `OutTensor.produce`)."""
    _place.phase = file_offset % PAGE


def placed_phase() -> int:
    """The page offset of this thread's next output (0 when none was `place`d)."""
    return getattr(_place, "phase", 0)


def _size_class(nbytes: int) -> int:
    """Block size for `nbytes`: rounded up to 1/8 of its power of two (at most 12.5% spare), so
    that tensors of nearly the same size share blocks; a multiple of 64 KiB."""
    step = max(64 << 10, 1 << max(0, nbytes.bit_length() - 4))
    return -(-nbytes // step) * step


class OutputPool:
    """Kernel output buffers (numpy arrays) on page-aligned anonymous memory, recycled.

    Two costs of a fresh ``np.empty`` per output tensor go away: the page fault and zeroing of
    every page on first touch (fresh anonymous pages are zeroed by the kernel; w4a16's profile:
    ~12% of its CPU), and the staging copy into O_DIRECT's aligned buffers (~12%): an array is
    placed at the same offset within its page as its bytes will have in the output file
    (`place`), so `cvt.convert.durable.DirectFile` writes its whole pages straight from it.

    A block goes back to the pool when the last view of the array handed out is gone (a weak
    reference on the `_Held` object every view holds), so nothing has to give it back, and bytes
    the writer still holds are never handed out again. Idle blocks are capped at `max_idle` bytes
    (what the pool may add to peak RSS), the least recently used freed first."""

    def __init__(self, max_idle: int = IN_FLIGHT_BYTES):
        self.max_idle, self._idle = max_idle, 0
        self._free: list = []  # idle (mmap, address) blocks, least recently used first
        self._returned: collections.deque = collections.deque()  # given back, not yet in _free (`_give`)
        self._lock = threading.Lock()
        self.reused = 0  # blocks handed out again (tests, bench)

    def array(self, shape, dtype, phase: int | None = None):
        """An uninitialized C-contiguous ``ndarray`` of `shape` / `dtype`, whose first byte sits
        `phase` bytes into a page (default: `placed_phase`): a pooled block from `POOLED_MIN`
        bytes, a slice of a page-larger ``np.empty`` below it, a plain ``np.empty`` below
        `PLACED_MIN` (not placed)."""
        import math
        import mmap
        import weakref

        import numpy as np

        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < PLACED_MIN:
            return np.empty(shape, dtype=dtype)
        phase = placed_phase() if phase is None else phase % PAGE
        if nbytes < POOLED_MIN:  # from malloc, a page's slack to place it
            raw = np.empty(nbytes + PAGE, dtype=np.uint8)
            at = (phase - raw.ctypes.data) % PAGE
            return raw[at:at + nbytes].view(dtype).reshape(shape)
        size = _size_class(nbytes + phase)
        block = None
        with self._lock:
            self._take_returned()
            # best fit: the smallest idle block that holds it (its pages are faulted in already,
            # so a larger one costs nothing; DeepSeek's layers repeat the same few sizes), and not
            # one over 4x the size (a small output would keep a large block from the large ones)
            need = nbytes + phase
            fits = [(len(b[0]), i) for i, b in enumerate(self._free) if need <= len(b[0]) <= 4 * max(need, 1 << 20)]
            if fits:
                block = self._free.pop(min(fits)[1])
                self._idle -= len(block[0])
                self.reused += 1
        if block is None:
            import ctypes

            m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)  # page-aligned; private: huge pages may back it
            if hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
                m.madvise(mmap.MADV_HUGEPAGE)  # as numpy does for its large arrays: 2 MB faults, not 4 KB
            block = (m, ctypes.addressof(ctypes.c_char.from_buffer(m)))
        holder = _Held()
        holder.block = block
        holder.__array_interface__ = {"data": (block[1] + phase, False), "shape": (nbytes,), "typestr": "|u1",
                                      "version": 3}
        weakref.finalize(holder, self._give, block).atexit = False
        return np.asarray(holder).view(dtype).reshape(shape)

    @property
    def idle(self) -> int:
        """Bytes of idle blocks (those given back included)."""
        with self._lock:
            self._take_returned()
            return self._idle

    def clear(self) -> None:
        """Free every idle block (after a stage: a long-lived process keeps none of it)."""
        with self._lock:
            self._take_returned()
            self._free, self._idle = [], 0

    def _give(self, block) -> None:
        # a block's last view went away: possibly inside the garbage collector, on a thread that
        # holds self._lock already (any allocation can collect a cycle holding a view), so no lock
        # here: deque.append is atomic; `array` / `clear` take the returned blocks under the lock
        self._returned.append(block)

    def _take_returned(self) -> None:
        """(under self._lock) the returned blocks into the idle list, oldest dropped past max_idle."""
        while self._returned:
            block = self._returned.popleft()
            self._free.append(block)
            self._idle += len(block[0])
        while self._idle > self.max_idle:  # unmapped when dropped
            self._idle -= len(self._free.pop(0)[0])


class _Held:
    """What every view of a pooled array holds (numpy keeps the object that exposed the memory as
    the base of the array and of every view of it): the block; when it goes, the block returns."""

    __slots__ = ("__array_interface__", "block", "__weakref__")


OUTPUTS = OutputPool()  # the process's pool: the C kernels' outputs (fp8 dequant, fused quantize)
