"""What the benches share: `--dir` checked before any work, a progress bar per row, the two IO
floors (buffered, and O_DIRECT: the disk itself) and cvt's run in a child with its wall time,
peak RSS and CPU seconds.

Imported by the bench scripts as `common` (they run as `python bench/NAME.py`, so bench/ is on
sys.path). cvt is imported only when a bar is made: the peers' inner processes run this file's
siblings in other virtual environments.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

ALIGN = 4096  # O_DIRECT wants buffer address, offset and length aligned to the logical block
CHUNK = 16 << 20


def load_fp8_bench():
    """bench/fp8_to_bf16.py as a module (its synthetic release writer, buffered floor and
    `run_cvt`): the benches run as scripts, so their sibling is loaded from its path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_fp8_to_bf16", Path(__file__).resolve().parent / "fp8_to_bf16.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def scratch_dir(value: str) -> str:
    """argparse type of --dir: an existing, writable directory (argparse prints the one-line
    error and exits 2, before anything is built)."""
    p = Path(value)
    if not p.is_dir():
        raise argparse.ArgumentTypeError(f"{value}: no such directory (create it first)")
    if not os.access(p, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{value}: not writable")
    return value


def row_progress(total: int, desc: str, quiet: bool = False):
    """A progress bar on stderr for `total` rows of a bench (cvt's one progress bar)."""
    from cvt.progress import make_progress

    return make_progress(total, desc, quiet, unit="row")


# A child's ru_maxrss starts from its parent's peak (Linux keeps the pre-exec memory's high-water
# mark through fork/vfork + exec), and a benchmark's process grows while it builds fixtures:
# so cvt runs under a tiny wrapper, whose own peak is small, and reports its one child's rusage
# (RUSAGE_CHILDREN of the wrapper is cvt's process alone: user + sys CPU seconds, peak RSS).
_WRAP = ("import os, resource, subprocess, sys, time; t = time.perf_counter(); rc = subprocess.call(sys.argv[1:]); "
         "dt = time.perf_counter() - t; u = resource.getrusage(resource.RUSAGE_CHILDREN); "
         "print(rc, dt, u.ru_maxrss, u.ru_utime + u.ru_stime)")


def run_logged(cmd: list[str], log: Path, env: dict | None = None) -> tuple[float, int]:
    """Run `cmd` with its stdout and stderr into `log`: (wall seconds, exit code). The peers'
    child runs (llm-compressor, msModelSlim, cvt) are kept as logs to show on failure."""
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
    return time.perf_counter() - t0, rc


def run_cvt_cpu(cmd: list[str], cwd: str | Path | None = None) -> tuple[float, int, float]:
    """(wall seconds, peak RSS bytes, user + sys CPU seconds) of this one child, run in `cwd`
    (``python -m`` puts its working directory first on sys.path, before PYTHONPATH)."""
    out = subprocess.run([sys.executable, "-c", _WRAP, *cmd], capture_output=True, text=True, check=True, cwd=cwd)
    rc, dt, maxrss, cpu = out.stdout.split()[-4:]
    if int(rc) != 0:
        raise SystemExit(f"cvt failed (exit {rc}): {shlex.join(cmd)}")
    return float(dt), int(maxrss) * 1024, float(cpu)


def read_input(src_files: list[Path]) -> float:
    """Seconds to read every input byte once (readinto one buffer; page-cache warm as cvt reads it)."""
    buf = bytearray(CHUNK)
    t0 = time.perf_counter()
    for p in src_files:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0


def io_floor(src_files: list[Path], out: Path, sizes: list[int]) -> tuple[float, float]:
    """Buffered floor, (read seconds, write+fsync seconds): read the input, then write `sizes`
    bytes file after file through the page cache, fsync per file. No compute, no hashing."""
    t_rd = read_input(src_files)
    view = memoryview(bytearray(CHUNK))
    t1 = time.perf_counter()
    for i, size in enumerate(sizes):
        with open(out / f"floor-{i:05d}.bin", "wb", buffering=0) as f:
            while size:
                size -= f.write(view[: min(size, CHUNK)])
            os.fsync(f.fileno())
    return t_rd, time.perf_counter() - t1


def direct_refused(out: Path) -> str | None:
    """Why O_DIRECT cannot be used in `out` (tmpfs and some others refuse it), or None."""
    if not hasattr(os, "O_DIRECT"):
        return "no O_DIRECT on this platform"
    probe = out / ".odirect-probe"
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"O_DIRECT refused in {out}: {exc.strerror}"
    finally:
        buf.close()
        probe.unlink(missing_ok=True)
    return None


def _write_direct(path: Path, size: int, buf: mmap.mmap, errors: list) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            view, left = memoryview(buf), size - size % ALIGN
            while left:
                left -= os.write(fd, view[: min(left, CHUNK)])
            if size % ALIGN:  # the unaligned tail: drop O_DIRECT for the last partial block
                import fcntl

                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                os.write(fd, view[: size % ALIGN])
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        errors.append(f"{path}: {exc}")


def direct_floor(src_files: list[Path], out: Path, sizes: list[int]) -> tuple[float, float] | str:
    """O_DIRECT floor, (read seconds, write+fsync seconds), or the reason it was skipped: read
    the input once (page cache, as cvt reads it), then write `sizes` bytes with O_DIRECT from
    page-aligned (mmap) buffers, one thread per output file, fsync each. No compute, no hashing."""
    why = direct_refused(out)
    if why is not None:
        return why
    t_rd = read_input(src_files)
    buf = mmap.mmap(-1, CHUNK)  # page-aligned; the threads only read it
    buf.write(b"\x5a" * CHUNK)  # fault the pages in before the clock starts
    errors: list[str] = []
    threads = [threading.Thread(target=_write_direct, args=(out / f"direct-{i:05d}.bin", size, buf, errors))
               for i, size in enumerate(sizes)]
    t1 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t_wr = time.perf_counter() - t1
    buf.close()
    if errors:
        return "O_DIRECT write failed: " + errors[0]
    return t_rd, t_wr


def floor_cells(t_cvt: float, buffered: float, direct: float | str) -> str:
    """'buffered s (cvt/floor x), O_DIRECT s (x)' for a report line; ratio = floor s / cvt s."""
    d = f"{direct:.2f} s ({direct / t_cvt:.2f}x)" if isinstance(direct, float) else f"skipped ({direct})"
    return f"buffered floor {buffered:.2f} s ({buffered / t_cvt:.2f}x), O_DIRECT floor {d}"
