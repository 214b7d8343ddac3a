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
keeps one per process, and so does this module (`stop` leaves it). `init_group` meets the other
ranks within a rendezvous timeout (`RENDEZVOUS_ENV`, default `RENDEZVOUS_S`) and then gives the
collectives torch's long default: a peer that never comes is one line naming MASTER_ADDR /
MASTER_PORT, not a wait of half an hour.

`cvt.launcher` starts the ranks of ``cvt VERB --procs N`` on this node. Across nodes a user runs
torchrun itself; DST must then be a folder every node sees (`World.check_shared`).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from cvt import signals
from cvt.errors import CvtError, OutputError

# set by `cvt ... --procs N` for the ranks it starts: the size the user asked for (a
# torchrun that started a different number of ranks is refused rather than silently used)
WORLD_ENV = "CVT_WORLD_SIZE"
# the most ranks cvt takes, from torchrun's WORLD_SIZE or --procs: far above any conversion job
# (DeepSeek-V3 at EP 320 is 320 ranks), and a bound before any list or tensor is sized by it
MAX_WORLD = 4096
# how long a rank waits for the others to arrive (seconds): a rank started by hand whose peers
# never come stops with one line instead of torch's 30-minute wait
RENDEZVOUS_ENV = "CVT_RENDEZVOUS_TIMEOUT"
RENDEZVOUS_S = 300


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
            init_group(backend_for(device_type), self.rank, self.size)
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
        code = (signals.exit_code(signals.signum_of(error)) if isinstance(error, KeyboardInterrupt)
                else error.exit_code if isinstance(error, CvtError)
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
    if size > MAX_WORLD:
        raise CvtError(f"WORLD_SIZE {size}: above the {MAX_WORLD} ranks cvt runs on")
    if size < 1 or not 0 <= rank < size or local < 0:
        raise CvtError(f"RANK {rank} / WORLD_SIZE {size} / LOCAL_RANK {local} describe no rank of a world")
    asked = env.get(WORLD_ENV)
    if asked and asked != str(size):
        # cvt sets it from --procs for its own ranks; a user may have left it in the environment
        raise CvtError(f"{WORLD_ENV}={asked} in the environment (what --procs {asked} sets for its ranks) "
                       f"disagrees with torchrun's {size} rank(s); unset {WORLD_ENV} unless cvt --procs set it")
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if size > 1 and not env.get(k)]
    if missing:  # torch.distributed would fail on it later, with an error taken for a peer leaving
        raise CvtError(f"WORLD_SIZE {size} without {' / '.join(missing)}: the ranks meet at MASTER_ADDR:MASTER_PORT "
                       "(torchrun sets both; ranks started by hand need rank 0's address and a free port)")
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


def rendezvous_s(env=os.environ) -> float:
    """The rendezvous timeout in seconds (`RENDEZVOUS_ENV`, default `RENDEZVOUS_S`)."""
    text = env.get(RENDEZVOUS_ENV, "")
    try:
        value = float(text) if text else RENDEZVOUS_S
    except ValueError:
        value = -1.0
    if not 0 < value < 1e7:
        raise CvtError(f"{RENDEZVOUS_ENV}={text!r}: give the seconds a rank waits for the others "
                       f"(default {RENDEZVOUS_S})")
    return value


def init_group(backend: str, rank: int, size: int, env=os.environ) -> None:
    """`dist.init_process_group` for rank `rank` of `size`, meeting the others within the rendezvous
    timeout (one line naming MASTER_ADDR / MASTER_PORT when they do not all come); the
    collectives then get torch's default timeout back."""
    from datetime import timedelta

    import torch.distributed as dist

    wait = rendezvous_s(env)
    try:
        dist.init_process_group(backend, rank=rank, world_size=size, timeout=timedelta(seconds=wait))
    except (RuntimeError, ValueError) as exc:  # torch's DistStoreError / DistNetworkError derive from RuntimeError
        where = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise CvtError(f"the {size} ranks did not all meet at MASTER_ADDR:MASTER_PORT {where} within {wait:g} s "
                       f"({type(exc).__name__}: {first}); start every rank with the same MASTER_ADDR / MASTER_PORT / "
                       f"WORLD_SIZE, or raise {RENDEZVOUS_ENV}") from None
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)  # torch >= 2.4
    if set_timeout is not None and backend in ("gloo", "nccl"):
        which = "default_pg_nccl_timeout" if backend == "nccl" else "default_pg_timeout"
        default = getattr(dist.constants, which, None)
        if default is not None:
            set_timeout(default)


def peer_left(exc: BaseException) -> bool:
    """Whether `exc` is torch.distributed's report that a peer rank went away mid-collective (that
    rank, or torchrun, says why; this one stops quietly)."""
    text = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    return "torch.distributed" in text or "Connection closed by peer" in text or "Connection reset by peer" in text \
        or type(exc).__name__ in ("DistBackendError", "DistNetworkError", "DistError")
