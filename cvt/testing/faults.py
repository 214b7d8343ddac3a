"""Test-only fault injection: kill this process with SIGKILL at an exact byte of output, or
after a calibrated decoder layer.

`CVT_TEST_KILL_AT_BYTE=N` makes the N-th byte written through `AtomicFile` (counting every
output file: shards, index, config, manifest) the point where the process SIGKILLs itself,
exactly as `kill -9` would, so the kill-and-resume tests can stop a run mid-tensor,
mid-file, between files or before the manifest, deterministically. `CVT_TEST_KILL_AFTER_LAYER=i`
SIGKILLs a calibrated quantize right after layer i's state is saved (`cvt.quant.methods.stream`);
`CVT_TEST_STOP_AFTER_LAYER=i` SIGSTOPs it there instead (mid-calibration, everything held; the
test resumes it with SIGCONT).
`CVT_TEST_PAUSE_AT_BYTE=N` makes the writer stop at that byte instead and wait (sleeping, so a
signal still arrives), having written its pid to `CVT_TEST_PAUSE_FILE`: the signal and kill tests
act on a run from outside at a known point, as a user would.
In a torchrun world, `CVT_TEST_KILL_RANK=r` limits the kills and the pause to rank r (the other
ranks run on until torchrun stops them, or wait for r at their next collective).

The library calls the seams of `cvt.hooks` (a plain write, a no-op); `install()` puts this
module's `write` and `after_layer` there. The CLI entry point (`cvt.cli.main`, which every rank
of a torchrun world it launches runs too) calls it when a ``CVT_TEST_*`` variable is set.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from cvt import hooks, signals

_rank = os.environ.get("CVT_TEST_KILL_RANK", "")
_here = not _rank or _rank == os.environ.get("RANK", "0")
_limit = int(os.environ.get("CVT_TEST_KILL_AT_BYTE", "0") or 0) if _here else 0
_pause = int(os.environ.get("CVT_TEST_PAUSE_AT_BYTE", "0") or 0) if _here else 0
_written = 0
_lock = threading.Lock()


def _wait_here(f) -> None:
    """Flush, say this pid in CVT_TEST_PAUSE_FILE (written whole, then renamed), and sleep until
    a signal ends the process (in the main thread: the signal's exception unwinds from here; in
    a writer thread: until the main thread has)."""
    global _pause
    _pause = 0
    f.flush()
    marker = os.environ["CVT_TEST_PAUSE_FILE"]
    with open(marker + ".tmp", "w") as m:
        m.write(str(os.getpid()))
    os.replace(marker + ".tmp", marker)
    # a writer thread waits until the main thread got a stop signal (whose cleanup may wait for this
    # thread, as it waits for a real write to end) or is gone
    while threading.main_thread().is_alive() and not signals.received(0):
        time.sleep(0.05)
    raise SystemExit(1)


def write(f, data: memoryview) -> None:
    """`f.write(data)`, unless the kill (or pause) byte falls inside `data`: then write the bytes
    before it, flush them to the OS, and SIGKILL (a half-written temp file, as a real kill
    leaves), or wait there (`_wait_here`)."""
    global _written
    if _limit or _pause:
        with _lock:
            if _pause and _written + len(data) >= _pause:  # the bytes before it, then no more (a signal ends it)
                f.write(data[: max(0, _pause - 1 - _written)])
                pause = True
            elif _limit and _written + len(data) >= _limit:
                f.write(data[: max(0, _limit - 1 - _written)])
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                pause = False
            _written += len(data)
        if pause:
            _wait_here(f)
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


def _sigint(signum, frame) -> None:
    """Python's SIGINT handler, which also records the signal (`signals.note`) for `_wait_here`."""
    signals.note(signum)
    raise KeyboardInterrupt


def install() -> None:
    """Route the library's seams (`cvt.hooks`) through this module's kill switches. Where the
    pause is armed, SIGINT is also recorded as it arrives: a writer thread paused in `_wait_here`
    sees SIGTERM / SIGHUP through `cvt.signals` but would not see a KeyboardInterrupt, and the
    main thread's cleanup waits for it, until torchrun SIGKILLs the rank 30 s later."""
    hooks.write = write
    hooks.after_layer = after_layer
    if (_pause and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):  # an ignored SIGINT stays so
        signal.signal(signal.SIGINT, _sigint)
