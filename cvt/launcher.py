"""Starting the ranks of ``cvt VERB --procs N``: torchrun on this node, watched until it ends.

`launch` runs ``python -m torch.distributed.run --standalone --nproc-per-node N`` with each rank
running the same command (`boot_rank`), in a session of its own so that a stop signal reaches it
once, through this process: SIGINT, SIGTERM and SIGHUP are passed on to torchrun (which passes
them to its ranks and waits for them), a second one kills it. Meanwhile it relays what the
ranks print (their ``cvt:`` lines once each, rank 0's progress) and holds back torchrun's own
log and failure report, which it reads (`_Report`) to say in one line what ended a failed run:
the error a rank said, else the rank a signal killed or the rank that exited without a word.
The full report is printed under ``--debug`` only.

`check_procs` bounds N before anything starts: at most four ranks per CPU this process may use
(a rank beyond that only waits for a CPU: 65 ranks on 2 cores ran 145 s for nothing), and never
above `cvt.world.MAX_WORLD`. A rank never outlives the command (`die_with_parent`).
"""

from __future__ import annotations

import os
import re
import signal
import sys
from dataclasses import dataclass, field
from typing import NoReturn

from cvt import signals
from cvt.errors import OptionError
from cvt.world import MAX_WORLD

RANKS_PER_CPU = 4


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_procs(n: int, flag: str = "--procs") -> None:
    """Refuse (exit 2) a process count this node cannot run: above `RANKS_PER_CPU` per usable CPU
    or above `MAX_WORLD`."""
    cpus = usable_cpus()
    most = min(MAX_WORLD, RANKS_PER_CPU * cpus)
    if n > most:
        raise OptionError(f"{flag} {n}: this node gives cvt {cpus} CPU{'s' if cpus != 1 else ''}, and more than "
                          f"{RANKS_PER_CPU} ranks per CPU only wait for one (at most {flag} {most}; across nodes "
                          "start torchrun yourself)")


def boot(module: str) -> str:
    """Python code for `python -c` that runs MODULE as `python -m MODULE` would, except that the
    current directory is not put on sys.path.

    `python -m` (and `-c`) put the current directory first on sys.path, so a folder named `cvt`
    there -- the clone's own folder, when cvt starts from its parent -- shadows the installed
    package and every rank dies on import (a folder named `torch` would break the agent the
    same way). `-P` / PYTHONSAFEPATH would drop it but exist only from Python 3.11 (cvt
    supports 3.10); `-I` would also drop PYTHONPATH and the user's site-packages, where cvt may
    be installed. So the child removes the one entry `-c` added (''; none under -P /
    PYTHONSAFEPATH), keeping every other path as the parent's interpreter would have it. One
    line, so that a process list shows MODULE and its arguments on one line (`pgrep -f`)."""
    return (f"import runpy, sys; sys.path.pop(0) if sys.path[:1] == [''] else None; "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")


def boot_rank(module: str) -> str:
    """`boot` for a rank: MODULE runs through `run_rank`, which ends the process without the
    interpreter's teardown."""
    return (f"import sys; sys.path.pop(0) if sys.path[:1] == [''] else None; "
            f"from cvt.launcher import run_rank; run_rank({module!r})")


def run_rank(module: str) -> NoReturn:
    """Run MODULE as ``__main__`` (as `boot` does), then flush and leave with ``os._exit``.

    A rank's work is over when MODULE returns (its process group destroyed, its files closed,
    its output printed); what is left is the interpreter's teardown, where C++ static destructors
    run while gloo's or the store's threads may still be joinable: now and then that aborted a
    rank that had succeeded ("terminate called without an active exception", SIGABRT, and
    torchrun reports the run failed). Skipping the teardown keeps the exit code MODULE chose."""
    import logging
    import runpy
    import traceback

    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:  # sys.exit(None | int | message), as the interpreter maps it
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            sys.stderr.write(f"{exc.code}\n")
            code = 1
    except KeyboardInterrupt as exc:  # SIGINT, or SIGTERM / SIGHUP when MODULE installed `cvt.signals`
        code = signals.exit_code(signals.signum_of(exc))
    except BaseException:  # an uncaught error: the traceback the interpreter would print
        traceback.print_exc()
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said there
            pass
    try:  # what C / C++ code (torch, gloo) printed through stdio's buffers: os._exit skips exit()'s flush
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
    os._exit(code)


def die_with_parent(parent: int | None = None, sig: int = 15):
    """On Linux, make the calling process receive `sig` (SIGTERM) when its parent exits, kill -9
    included, so that no rank or torchrun outlives the command that started it. `parent`: the
    pid expected as parent (when it already died, exit now). Elsewhere a no-op.

    Returns the function that does it, resolved here: `launch` passes it as a Popen
    `preexec_fn`, where (between fork and exec) nothing may be imported."""
    import ctypes
    import signal

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return lambda: None

    def arm() -> None:
        prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG
        if parent is not None and os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


# the lines torchrun's agent prints itself (its log records and its failure report), as opposed
# to what the ranks print
_AGENT = re.compile(
    r"^([WEI]\d{4} |\[rank\d+\]|\[\d+\]:|Traceback |  File |torch\.distributed\.|=+\s*$|-+\s*$|Failures:|Root Cause"
    r"|  <NO_OTHER_FAILURES>|\s+(time|host|rank|exitcode|error_file|traceback)\s*:|.* FAILED\s*$)")
# a rank's line that it was stopped (by the signal torchrun passed on): the launcher says that once
_STOPPED = re.compile(r"^cvt: (rank \d+: )?(interrupted|stopped by (SIG[A-Z]+))")
_SAID_BY = re.compile(r"^cvt: (?:error: |internal error: )?rank (\d+): ")


@dataclass
class _Report:
    """What the ranks and torchrun said, read line by line: the ``cvt:`` lines shown (once each),
    the ranks that said an error (None: a line without its rank), the stop signal a rank or
    torchrun reported, and torchrun's failures (rank -> exit code, negative: killed by that
    signal) with its root cause."""

    said: set = field(default_factory=set)
    speakers: list = field(default_factory=list)
    stopped: int | None = None
    failures: dict = field(default_factory=dict)
    root: int | None = None
    _block: list = field(default_factory=list)  # [rank, in the root-cause section]
    _in_report: bool = False
    _root_section: bool = False

    def line(self, line: str) -> None:
        """Show `line` on stderr or hold it back."""
        if line.startswith("cvt:"):
            m = _STOPPED.match(line)
            if m:  # said once, by the launcher
                self.stopped = self.stopped or (getattr(signal, m.group(3)) if m.group(3) else signal.SIGINT)
                return
            key = re.sub(r"^cvt: (error: |internal error: )?rank \d+: ", r"cvt: \1", line)
            if key not in self.said:
                self.said.add(key)
                sys.stderr.write(line)
            if line.startswith(("cvt: error:", "cvt: internal error:")):  # why a rank failed (not a log line)
                by = _SAID_BY.match(line)
                self.speakers.append(int(by.group(1)) if by else None)
        elif self._in_report or _AGENT.match(line):  # torchrun's own log and report: read, not shown
            self._agent(line)
        else:  # rank 0's progress bar and log lines (the other ranks run quiet)
            sys.stderr.write(line)
        sys.stderr.flush()

    def _agent(self, line: str) -> None:
        self._in_report = self._in_report or line.startswith("Traceback ")  # all that follows is its report
        self._root_section = self._root_section or line.startswith("Root Cause")
        if m := re.search(r"got signal: (?:Signals\.)?(\w+)", line):  # torchrun itself was signalled
            self.stopped = self.stopped or _signum(m.group(1))
        if m := re.match(r"\s+rank\s*:\s*(\d+)", line):
            self._block = [int(m.group(1)), self._root_section]
        elif (m := re.match(r"\s+exitcode\s*:\s*(-?\d+)", line)) and self._block:
            rank, root = self._block
            self.failures[rank] = int(m.group(1))
            if root:
                self.root = rank

    def culprit(self) -> tuple[int, int] | None:
        """(rank, exit code) of the failure that explains the run's end: a rank a signal killed
        (negative code; the root cause first), else the root cause."""
        order = sorted(self.failures, key=lambda r: (r != self.root, r))
        killed = [r for r in order if self.failures[r] < 0]
        pick = killed[0] if killed else (self.root if self.root is not None else (order[0] if order else None))
        return None if pick is None else (pick, self.failures[pick])


def _signum(word: str) -> int:
    try:
        return int(word)
    except ValueError:
        return int(getattr(signal, word, signal.SIGTERM))


class _Forward:
    """While torchrun runs: SIGINT (unless this process ignores it), SIGTERM and SIGHUP are
    recorded and passed on to it; a second one kills it. The old handlers come back on exit."""

    def __init__(self, proc):
        self.proc, self.signum, self.saved = proc, None, {}

    def __enter__(self):
        for sig in signals.STOP_SIGNALS:
            try:
                if signal.getsignal(sig) != signal.SIG_IGN:
                    self.saved[sig] = signal.signal(sig, self._on)
            except ValueError:  # not the main thread: signals stay as they are
                break
        return self

    def _on(self, signum, frame) -> None:
        again, self.signum = self.signum is not None, self.signum or signum
        signals.note(self.signum)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if again else signum)

    def __exit__(self, *exc) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)


def launch(module: str, argv: list[str], world_size: int, *, debug: bool = False,
           env_extra: dict[str, str] | None = None, hint: str = "") -> int:
    """Run MODULE ARGV as `world_size` ranks of torchrun on this node (module docstring) and
    return the exit code: the code of the rank whose error was said, 128 + the signal of a
    rank a signal killed, else the failing rank's or torchrun's. A stop signal this process
    got and passed on raises `signals.Interrupted` once torchrun has ended. `hint` ends the line
    said for a rank that died without a word (how to resume)."""
    import subprocess

    check_procs(world_size)
    cmd = [sys.executable, "-c", boot("torch.distributed.run"), "--standalone", "--nproc-per-node", str(world_size),
           "--no-python", sys.executable, "-u", "-c", boot_rank(module), *argv]
    from cvt.scratch import child_env

    env = child_env(dict(os.environ))  # torchrun's log folders go to the command's private temp folder
    env.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // world_size)))  # the CPUs this process may use, shared
    env.update(env_extra or {})
    # torchrun gets SIGTERM if this process dies (and stops its ranks, which also die with it)
    proc = subprocess.Popen(cmd, env=env, stderr=None if debug else subprocess.PIPE,
                            preexec_fn=die_with_parent(os.getpid()), start_new_session=True)
    report = _Report()
    with _Forward(proc) as fwd:
        if not debug:
            _relay(proc, report)
        rc = proc.wait()
    if fwd.signum is not None:
        raise signals.Interrupted(fwd.signum)
    return rc if rc == 0 or debug else _outcome(rc, report, hint)


def _relay(proc, report: _Report) -> None:
    """Pass torchrun's stderr through `report` line by line (a progress bar's redraws as they come)."""
    pending = ""
    while chunk := os.read(proc.stderr.fileno(), 1 << 16):
        pending += chunk.decode(errors="replace")
        *lines, pending = pending.split("\n")
        for line in lines:
            report.line(line + "\n")
        cut = pending.rfind("\r")
        if cut >= 0 and not report._in_report and not pending.startswith("cvt:"):
            sys.stderr.write(pending[:cut + 1])
            sys.stderr.flush()
            pending = pending[cut + 1:]
    if pending:
        report.line(pending)


def _outcome(rc: int, report: _Report, hint: str) -> int:
    """The exit code of a failed run, saying in one line what ended it when no rank said why."""
    culprit = report.culprit()
    if report.speakers:  # a rank said why: its exit code (the speaker's, else the failure that explains it)
        spoke = next((r for r in report.speakers if r is not None and r in report.failures), None)
        code = report.failures[spoke] if spoke is not None else (culprit[1] if culprit else rc)
        return code if code > 0 else rc
    if culprit is not None and culprit[1] < 0:
        rank, code = culprit
        sys.stderr.write(f"cvt: error: rank {rank} was killed by {signals.name_of(code)}; torchrun stopped the "
                         f"other ranks{hint}\n")
        return signals.exit_code(-code)
    if report.stopped is not None:  # torchrun or a rank got a stop signal (not through this process)
        who = f"rank {culprit[0]}" if culprit and culprit[1] == signals.exit_code(report.stopped) else "torchrun"
        sys.stderr.write(f"cvt: error: {who} was stopped by {signal.Signals(report.stopped).name}{hint}\n")
        return signals.exit_code(report.stopped)
    if culprit is not None:
        rank, code = culprit
        sys.stderr.write(f"cvt: error: rank {rank} exited with code {code} without saying why (re-run with --debug "
                         f"for torchrun's report){hint}\n")
        return code if code > 0 else rc
    sys.stderr.write(f"cvt: error: torchrun failed (exit {rc}) before any rank said why (re-run with --debug for "
                     "its report)\n")
    return rc


__all__ = ["launch", "check_procs", "usable_cpus", "boot", "boot_rank", "run_rank", "die_with_parent",
           "RANKS_PER_CPU"]
