"""SIGTERM and SIGHUP stop a cvt command the way Ctrl-C does.

Python turns SIGINT into KeyboardInterrupt, so every ``finally`` runs (journals flushed, locks
released, the command's scratch folder removed) and a re-run resumes; SIGTERM (``kill``, a
batch scheduler's time limit, torchrun stopping its ranks) and SIGHUP (the terminal closed)
would end the process on the spot and leave all that behind. `install` makes them raise
`Interrupted`, a KeyboardInterrupt that remembers its signal, so that they take the same path;
the command then exits 128 + the signal's number, as a shell reports a process a signal ended.
`received` is the last stop signal this process got (SIGINT too: a launcher forwards it).
"""

from __future__ import annotations

import contextlib
import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_received: list[int] = []


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived (SIGTERM or SIGHUP; SIGINT stays Python's KeyboardInterrupt)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Stopped(BaseException):
    """An interruption (`Interrupted` or Ctrl-C's KeyboardInterrupt) carried out of a verb past
    click, which would print an empty line for a KeyboardInterrupt before the CLI's one line."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum, frame) -> None:
    _received.append(signum)
    raise Interrupted(signum)


def install() -> dict:
    """SIGTERM and SIGHUP raise `Interrupted` in this (main) thread from now on, unless the
    process was started with them ignored (``nohup`` ignores SIGHUP: that stays so); nothing
    outside the main thread. SIGINT is left as Python set it. Returns the handlers replaced."""
    saved = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            if signal.getsignal(sig) != signal.SIG_IGN:
                saved[sig] = signal.signal(sig, _raise)
        except ValueError:  # not the main thread
            break
    return saved


@contextlib.contextmanager
def installed():
    """`install` for the duration of a command (a caller's own handlers come back after it: the
    CLI's `main` also runs inside test processes)."""
    saved = install()
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def note(signum: int) -> None:
    """Record a stop signal that arrived some other way (KeyboardInterrupt: SIGINT)."""
    _received.append(signum)


def received(default: int = signal.SIGINT) -> int:
    """The stop signal this process last got (`default` when none was recorded)."""
    return _received[-1] if _received else default


def signum_of(exc: BaseException) -> int:
    """The signal behind an interruption: `Interrupted`'s own, SIGINT for a plain KeyboardInterrupt."""
    return exc.signum if isinstance(exc, (Interrupted, Stopped)) else received()


def exit_code(signum: int) -> int:
    """What a command a signal stopped exits with: 128 + the signal's number (130 for SIGINT)."""
    return 128 + int(signum)


def stopped_line(signum: int) -> str:
    """The one line a stopped command says: "interrupted" for Ctrl-C, the signal's name otherwise."""
    return "cvt: interrupted" if signum == signal.SIGINT else f"cvt: stopped by {signal.Signals(signum).name}"


def name_of(code: int) -> str | None:
    """The signal's name for a negative return code (a process it killed), else None."""
    try:
        return signal.Signals(-code).name if code < 0 else None
    except ValueError:
        return f"signal {-code}"


__all__ = ["Interrupted", "Stopped", "install", "installed", "note", "received", "signum_of", "exit_code", "stopped_line",
           "name_of", "STOP_SIGNALS"]
