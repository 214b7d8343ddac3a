"""The process world a stage runs in: one process, or one rank of a torchrun job.

A `World` (rank, size, local rank) is a value: a verb's entry obtains it once (`from_env`:
torchrun's RANK, WORLD_SIZE, LOCAL_RANK, `SINGLE` (a world of one) without them; `expect`: the same,
checked against the `--procs` the verb was given) and passes it down to what splits work or meets
the other ranks; a library function called directly works in `SINGLE`. This module is the only
one that reads those variables. A world says how to split work (`owners`: items
to ranks by cost, the same answer on every rank) and meets its ranks through collectives, each
deterministic for a given world size: `barrier`, `all_gather` (Python objects, in rank order),
`broadcast` (an object from one rank), `gather_sum` (a tensor summed on one rank in rank order,
not in whatever order a reduction algorithm picks), `agree` (whether any rank failed). Its process
group is initialized by `World.start` (gloo on CPU; nccl / hccl for CUDA / NPU devices, with a gloo
group beside it for the Python objects and CPU tensors the stages exchange): torch.distributed
keeps one per process, and so does this module (`stop` leaves it).

`launch` is what ``cvt quantize | fp8-to-bf16 | shard --procs N`` does: run ``python -m
torch.distributed.run --standalone --nproc-per-node N`` with the same command on this node.
Across nodes a user runs torchrun itself; DST must then be a folder every node sees
(`World.check_shared`). A rank that dies takes the job down: torchrun's agent stops the others, and
each rank dies with its agent (`die_with_parent`).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Sequence

from cvt.errors import CvtError, OutputError

# set by `cvt ... --procs N` for the ranks it starts: the size the user asked for (a
# torchrun that started a different number of ranks is refused rather than silently used)
WORLD_ENV = "CVT_WORLD_SIZE"


@dataclass(frozen=True)
class World:
    """Where this process stands: rank `rank` of `size` (`local_rank` on its node)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def owners(self, costs: Sequence[float]) -> list[int]:
        """The rank that does each item: longest first, each to the least loaded rank (ties: the
        lower rank), as llm-compressor's GPTQ bin-packs modules onto ranks. A function of the
        costs and the world size only, so every rank computes the same assignment."""
        load = [0.0] * self.size
        owner = [0] * len(costs)
        for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
            r = min(range(self.size), key=lambda r: (load[r], r))
            owner[i] = r
            load[r] += costs[i]
        return owner

    def mine(self, costs: Sequence[float]) -> list[int]:
        """Indices of the items this rank does (`owners`), in their order."""
        return [i for i, r in enumerate(self.owners(costs)) if r == self.rank]

    def start(self, device_type: str = "cpu") -> "World":
        """Initialize the process group of this world (once; nothing for a world of one)."""
        if self.size == 1:
            return self
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group(backend_for(device_type), rank=self.rank, world_size=self.size)
        if "cpu_group" not in _started:
            _started["cpu_group"] = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return self

    def _group(self):
        if "cpu_group" not in _started:  # a stage that only moves files: gloo is all it needs
            self.start("cpu")
        return _started["cpu_group"]

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier(group=self._group())

    def all_gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self._group())
        return out

    def broadcast(self, obj, src: int = 0):
        """Rank `src`'s `obj` on every rank."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self._group())
        return box[0]

    def gather_sum(self, t, dst: int):
        """sum over ranks r = 0, 1, ... of each rank's `t` (same shape and dtype everywhere), added in
        rank order on rank `dst` (None elsewhere): the same bits for a given world size whatever
        the transport. Rank `dst` receives one rank's tensor at a time (memory: the sum and one
        buffer, whatever the world size). CPU tensors travel through gloo."""
        if self.size == 1:
            return t
        import torch
        import torch.distributed as dist

        dev = t.device
        src = t.detach().cpu().contiguous()
        if self.rank != dst:
            dist.send(src, dst=dst, group=self._group())
            return None
        total = buf = None
        for r in range(self.size):
            if r == dst:
                part = src
            else:
                buf = torch.empty_like(src) if buf is None else buf
                dist.recv(buf, src=r, group=self._group())
                part = buf
            total = part.clone() if total is None else total.add_(part)
        return total.to(dev)

    def agree(self, error: BaseException | None) -> BaseException | None:
        """Every rank says whether it failed. A rank that failed keeps its own error; the others get a
        `PeerFailed` naming the first rank that did (so that no rank waits for a peer that left)."""
        code = (130 if isinstance(error, KeyboardInterrupt) else error.exit_code if isinstance(error, CvtError)
                else 1 if isinstance(error, OSError) else 70)  # as the CLI's `main` exits for each
        mine = None if error is None else (str(error) if isinstance(error, CvtError) else
                                           f"{type(error).__name__}: {error}", code)
        said = self.all_gather(mine)
        bad = [(r, m) for r, m in enumerate(said) if m is not None]
        if error is not None or not bad:
            return error
        r, (message, code) = bad[0]
        return PeerFailed(r, message, code)

    def check_shared(self, folder: Path) -> None:
        """Every rank sees the same `folder` (DST): rank 0 writes a token there, each rank reads it
        back; one clear error when a rank does not see it (DST on a node-local disk)."""
        if self.size == 1:
            return
        import secrets

        token_path = Path(folder) / f".cvt-world-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}"
        token = self.broadcast(secrets.token_hex(16) if self.main else None)
        if self.main:
            token_path.write_text(token)
        self.barrier()
        try:
            seen = token_path.read_text()
        except OSError:
            seen = None
        views = self.all_gather(seen == token)
        self.barrier()
        if self.main:
            token_path.unlink(missing_ok=True)
        blind = [r for r, ok in enumerate(views) if not ok]
        if blind:  # rank 0 says it, once; the others stop quietly with its exit code
            err = OutputError(f"{folder}: not shared by every rank (rank {', '.join(map(str, blind))} cannot see the "
                              "file rank 0 wrote there); DST must be a folder every node mounts (a shared filesystem)")
            raise err if self.main else PeerFailed(0, str(err), err.exit_code)


SINGLE = World()  # one process: the default of every library function that takes a world
_started: dict[str, Any] = {}  # "cpu_group": the gloo group for objects and CPU tensors


def from_env(env=os.environ) -> World:
    """The world torchrun's environment describes (`SINGLE` when WORLD_SIZE is unset); CvtError for
    values that describe no rank, or a size other than ``--procs`` asked for."""
    try:
        size = int(env.get("WORLD_SIZE", "1") or 1)
        rank = int(env.get("RANK", "0") or 0)
        local = int(env.get("LOCAL_RANK", str(rank)) or 0)
    except ValueError:
        raise CvtError(f"WORLD_SIZE / RANK / LOCAL_RANK must be integers (got {env.get('WORLD_SIZE')!r}, "
                       f"{env.get('RANK')!r}, {env.get('LOCAL_RANK')!r})") from None
    if size < 1 or not 0 <= rank < size or local < 0:
        raise CvtError(f"RANK {rank} / WORLD_SIZE {size} / LOCAL_RANK {local} describe no rank of a world")
    asked = env.get(WORLD_ENV)
    if asked and asked != str(size):
        # cvt sets it from --procs for its own ranks; a user may have left it in the environment
        raise CvtError(f"{WORLD_ENV}={asked} in the environment (what --procs {asked} sets for its ranks) "
                       f"disagrees with torchrun's {size} rank(s); unset {WORLD_ENV} unless cvt --procs set it")
    return World(rank, size, local) if size > 1 else SINGLE


def launched(env=os.environ) -> bool:
    """Whether this process is a rank of a torchrun world (ours or the user's): WORLD_SIZE set and
    not 1, read as it is (before `from_env` checks it)."""
    return env.get("WORLD_SIZE", "1") != "1"


def first_rank(env=os.environ) -> bool:
    """Whether this process speaks for its world (one process, or rank 0: RANK unset or 0, read as
    it is): a warning every rank would give is said once."""
    return env.get("RANK", "0") == "0"


def rank_label(env=os.environ) -> str:
    """``"rank R: "`` in a torchrun world (R as RANK says, "?" without it), "" in one process: how
    a rank prefixes its one error line."""
    return f"rank {env.get('RANK', '?')}: " if launched(env) else ""


def for_rank_entry(env=os.environ) -> World:
    """The world of a rank entry point (`cvt.runtime.launch`): torch.distributed's when a caller
    already initialized its process group, else RANK / WORLD_SIZE as given (unchecked: the rank's
    preflight compares them with the manifest); LOCAL_RANK 0 when unset."""
    import torch.distributed as dist

    local = int(env.get("LOCAL_RANK", "0"))
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), local)
    return World(int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")), local)


def expect(procs: int | None, env=os.environ) -> World:
    """The world torchrun's environment describes (`from_env`), when it has `procs` ranks (None:
    any): a verb's `--procs N` under a torchrun the user started must say what WORLD_SIZE says."""
    w = from_env(env)
    if procs is not None and procs != w.size:
        if w.size == 1:  # the Python API, outside torchrun: it runs in this process, it launches none
            raise CvtError(f"procs {procs}: this process is not one of {procs} torchrun ranks (start it under "
                           f"torchrun --nproc-per-node {procs}, or run `cvt VERB ... --procs {procs}`)")
        raise CvtError(f"--procs {procs}, but torchrun started {w.size} ranks (WORLD_SIZE)")
    return w


def backend_for(device_type: str) -> str:
    """torch.distributed backend for a device type: gloo (cpu), nccl (cuda), hccl (npu)."""
    if device_type == "cpu":
        return "gloo"
    if device_type == "cuda":
        return "nccl"
    if device_type == "npu":
        import torch_npu  # noqa: F401  registers the hccl backend

        return "hccl"
    raise CvtError(f"no torch.distributed backend for device {device_type} (cpu: gloo, cuda: nccl, npu: hccl)")


def stop(clean: bool = True) -> None:
    """Leave the process group: after a last barrier when every rank got here (`clean`), so no
    rank tears down under a peer; after a failure at once (the peers may be anywhere: torchrun
    stops them when this rank exits)."""
    if not _started:
        return
    import torch.distributed as dist

    try:
        if clean and dist.is_initialized():
            dist.barrier(group=_started["cpu_group"])
    finally:
        _started.clear()
        if dist.is_initialized():
            dist.destroy_process_group()


class PeerFailed(CvtError):
    """Another rank failed (and said why itself): this rank stops too, with that rank's exit
    code, and says nothing more (the CLI prints no line for it)."""

    def __init__(self, rank: int, message: str, exit_code: int):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank, self.exit_code = rank, exit_code


# ------------------------------------------------------------------------------ starting ranks
# the lines torchrun's agent prints itself (its log records and its failure report), as opposed
# to what the ranks print
_AGENT = re.compile(
    r"^([WEI]\d{4} |\[rank\d+\]|\[\d+\]:|Traceback |  File |torch\.distributed\.|=+\s*$|-+\s*$|Failures:|Root Cause"
    r"|  <NO_OTHER_FAILURES>|\s+(time|host|rank|exitcode|error_file|traceback)\s*:|.* FAILED\s*$)")


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
            f"from cvt.world import run_rank; run_rank({module!r})")


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
    except KeyboardInterrupt:
        code = 130
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


def launch(module: str, argv: list[str], world_size: int, *, debug: bool = False,
           env_extra: dict[str, str] | None = None) -> int:
    """Run ``python -m torch.distributed.run --standalone --nproc-per-node W`` with each rank
    running MODULE ARGV (started by `boot`), and return the exit code: the first failing rank's
    own code when torchrun reports it, else torchrun's. Unless `debug`, stderr keeps the ranks'
    ``cvt:`` lines (an error said by several ranks once) and drops torchrun's own report,
    which is shown only when the run fails without any ``cvt:`` line."""
    import collections
    import subprocess

    cmd = [sys.executable, "-c", boot("torch.distributed.run"), "--standalone", "--nproc-per-node", str(world_size),
           "--no-python", sys.executable, "-u", "-c", boot_rank(module), *argv]
    from cvt.scratch import child_env

    env = child_env(dict(os.environ))  # torchrun's log folders go to the command's private temp folder
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpus // world_size)))  # the CPUs this process may use, shared
    env.update(env_extra or {})
    # torchrun gets SIGTERM if this process dies (and stops its ranks, which also die with it)
    arm = die_with_parent(os.getpid())
    if debug:
        return subprocess.call(cmd, env=env, preexec_fn=arm)
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, preexec_fn=arm)
    said: set[str] = set()
    other: collections.deque[str] = collections.deque(maxlen=40)
    codes: list[int] = []
    root_cause = report = False

    def line_out(line: str) -> None:
        nonlocal root_cause, report
        if line.startswith("cvt:"):
            key = re.sub(r"^cvt: (error: |internal error: )?rank \d+: ", r"cvt: \1", line)
            if key not in said:
                said.add(key)
                sys.stderr.write(line)
        elif report or _AGENT.match(line):  # torchrun's own log and report: shown only when no rank said why
            other.append(line)
            report = report or line.startswith("Traceback ")  # the agent's failure: all that follows is its
            root_cause = root_cause or line.startswith("Root Cause")
            m = re.match(r"\s*exitcode\s*:\s*(-?\d+)", line)
            if m and root_cause:
                codes.append(int(m.group(1)))
        else:  # rank 0's progress bar and log lines (the other ranks run quiet)
            sys.stderr.write(line)
        sys.stderr.flush()

    pending = ""
    while chunk := os.read(proc.stderr.fileno(), 1 << 16):
        pending += chunk.decode(errors="replace")
        *lines, pending = pending.split("\n")
        for line in lines:
            line_out(line + "\n")
        cut = pending.rfind("\r")  # a progress bar's redraws, passed on as they come
        if cut >= 0 and not report and not pending.startswith("cvt:"):
            sys.stderr.write(pending[:cut + 1])
            sys.stderr.flush()
            pending = pending[cut + 1:]
    if pending:
        line_out(pending)
    rc = proc.wait()
    if rc != 0 and not said:
        sys.stderr.write("".join(other))
    if rc != 0 and codes and codes[0] > 0:
        return codes[0]  # the failing rank's own exit code (1 refused input, 70 a bug, ...), not torchrun's 1
    return rc
