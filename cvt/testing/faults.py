"""Test-only fault injection: kill this process with SIGKILL at an exact byte of output, or
after a calibrated decoder layer.

`CVT_TEST_KILL_AT_BYTE=N` makes the N-th byte written through `AtomicFile` (counting every
output file: shards, index, config, manifest) the point where the process SIGKILLs itself,
exactly as `kill -9` would, so the kill-and-resume tests can stop a run mid-tensor,
mid-file, between files or before the manifest, deterministically. `CVT_TEST_KILL_AFTER_LAYER=i`
SIGKILLs a calibrated quantize right after layer i's state is saved (`cvt.quant.methods.stream`);
`CVT_TEST_STOP_AFTER_LAYER=i` SIGSTOPs it there instead (mid-calibration, everything held; the
test resumes it with SIGCONT).
In a torchrun world, `CVT_TEST_KILL_RANK=r` limits both kills to rank r (the other ranks run on
until torchrun stops them).

The library calls the seams of `cvt.hooks` (a plain write, a no-op); `install()` puts this
module's `write` and `after_layer` there. The CLI entry point (`cvt.cli.main`, which every rank
of a torchrun world it launches runs too) calls it when a ``CVT_TEST_*`` variable is set.
"""

from __future__ import annotations

import os
import signal
import threading

from cvt import hooks

_rank = os.environ.get("CVT_TEST_KILL_RANK", "")
_here = not _rank or _rank == os.environ.get("RANK", "0")
_limit = int(os.environ.get("CVT_TEST_KILL_AT_BYTE", "0") or 0) if _here else 0
_written = 0
_lock = threading.Lock()


def write(f, data: memoryview) -> None:
    """`f.write(data)`, unless the kill byte falls inside `data`: then write the bytes before
    it, flush them to the OS, and SIGKILL (a half-written temp file, as a real kill leaves)."""
    global _written
    if _limit:
        with _lock:
            if _written + len(data) >= _limit:
                f.write(data[: max(0, _limit - 1 - _written)])
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            _written += len(data)
    f.write(data)


_kill_layer = os.environ.get("CVT_TEST_KILL_AFTER_LAYER", "") if _here else ""
_stop_layer = os.environ.get("CVT_TEST_STOP_AFTER_LAYER", "")


def after_layer(i: int) -> None:
    """SIGKILL now when `CVT_TEST_KILL_AFTER_LAYER` names layer i; SIGSTOP when
    `CVT_TEST_STOP_AFTER_LAYER` does."""
    if _kill_layer and int(_kill_layer) == i:
        os.kill(os.getpid(), signal.SIGKILL)
    if _stop_layer and int(_stop_layer) == i:
        os.kill(os.getpid(), signal.SIGSTOP)


def install() -> None:
    """Route the library's seams (`cvt.hooks`) through this module's kill switches."""
    hooks.write = write
    hooks.after_layer = after_layer
