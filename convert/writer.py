"""Writing a checkpoint directory: bounded shards, atomic files, resume, lock, manifest.

Every stage describes its output as an ordered list of `OutTensor` (name, dtype, shape and
a function producing the bytes). `write_checkpoint` then

1. plans shards up front (in order, each at most `max_shard_size` unless one tensor is
   larger; a small output cut into up to `BALANCED_FILES` balanced files, see `plan_shards`):
   the plan depends only on the tensor list and the arguments, so a resumed run writes the
   same file names with the same contents;
2. enters DST (`cvt.convert.outdir.OutputDir`: refuses a DST overlapping SRC, locks it, and
   finds what an earlier run of the same plan finished: recorded in `.cvt-state.json` after
   each file, trusted only when size and checksum on disk still match);
3. writes the other files through a `FileSet` (`cvt.convert.fileset`), `workers` files at a
   time, each to a hidden temp file that is fsynced and renamed into place, hashed as it is
   written (`cvt shard` feeds its per-rank files through a `FileSet` too);
4. writes the index, config.json and copied files, then `cvt_manifest.json` last, and
   removes the state file (`finish_output`). Until the manifest exists nothing in DST claims to be complete.

In a world of several ranks (torchrun, `cvt.world`) each rank writes its share of the planned
files (`ranked`: by bytes), the ranks agree that all went well (`together`), and rank 0 writes
step 4 once every file is in: the bytes are those of one process, whatever the world size.

Peak memory is about `workers` x (largest output tensor + its input), whatever the model size.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from cvt.world import SINGLE, World
from cvt.version import __version__
from cvt.convert.arch import carried_names
from cvt.convert.outdir import OutputDir
from cvt.convert.reader import Checkpoint
from cvt.convert.safetensors_io import TensorSpec
from cvt.convert.buffers import OUTPUTS, place
from cvt.convert.fileset import FileSet, _Cancelled
from cvt.progress import make_progress
from cvt.schemas.manifest import FileInfo, Manifest, SourceInfo, StageInfo, Summary, ToolInfo

DEFAULT_MAX_SHARD = 5 * 10**9
DEFAULT_WORKERS = 2  # output files written at once (1 on a 1-core machine)
# a small output is cut into this many balanced files (`plan_shards`), so that workers hash in
# parallel (the checksum is sequential within a file); a constant, not the worker count: the same
# command must write the same files whatever the machine or --workers
BALANCED_FILES = 4
# ... unless they would be smaller than this (below it a further file saves little)
MIN_BALANCED_SHARD = 256 << 20


def default_workers(workers: int | None) -> int:
    return max(1, workers or min(DEFAULT_WORKERS, os.cpu_count() or 1))


@dataclass(frozen=True)
class OutTensor:
    """One output tensor: its spec, a producer of its bytes, and what reading it costs.

    `produce()` returns a torch tensor of exactly `spec`'s dtype and shape, or a buffer of
    `spec.nbytes` bytes; `release()` (optional) is called once the bytes are written. With
    `pieces`, it returns an iterator of numpy arrays that are the tensor's bytes in order, each
    made when the writer asks for it (placed and charged one by one), so that a large tensor is
    never whole in memory; or of one whole tensor (any of the above).

    A float tensor is refused when it holds NaN / Inf (`cvt.convert.finite`, by `FileSet.put`),
    unless `finite`: its producer counts them itself as it computes (the FP8 kernel) or cannot
    make one. `source`: the source tensor it is read from (`TensorRef.describe()`: name, dtype,
    shape, file), which that error names.
    """

    spec: TensorSpec
    produce: Callable[[], Any]
    release: Callable[[], None] | None = None
    read_bytes: int = 0
    # stage metadata about this tensor (e.g. a quantized module's SQNR), journaled per file so
    # that a resumed run can rebuild the manifest without recomputing finished files
    meta: Callable[[], tuple[str, dict]] | None = None
    meta_key: str | None = None
    pieces: bool = False
    finite: bool = False
    source: str | None = None


@dataclass
class WriteResult:
    dst: Path
    files: list[FileInfo]
    written_files: int
    skipped_files: int
    bytes_in: int
    bytes_out: int
    seconds: float
    manifest: Manifest | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, dict] = field(default_factory=dict)
    processes: int = 1  # the ranks that wrote DST together (torchrun's world; `cvt.world`)

    @property
    def throughput(self) -> float:
        return self.bytes_out / self.seconds if self.seconds > 0 else 0.0


def plan_shards(tensors: list, max_shard_size: int, prefix: str = "model", balanced: int = 1) -> list[tuple[str, list]]:
    """File plan: consecutive runs of `tensors` (anything with a ``.spec``) of at most
    `max_shard_size` bytes each (a larger tensor alone), greedy in order, named
    ``{prefix}-00001-of-0000N.safetensors``. When that gives fewer than m = min(`balanced`,
    total bytes // `MIN_BALANCED_SHARD`) files, the tensors are instead cut into m runs of about
    equal bytes (each tensor goes to the run its middle byte falls in), unless one would pass
    `max_shard_size` with more than one tensor. Depends only on the arguments."""
    groups: list[list[OutTensor]] = []
    size = 0
    for t in tensors:
        if not groups or (size + t.spec.nbytes > max_shard_size and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.spec.nbytes
    total = sum(t.spec.nbytes for t in tensors)
    m = min(balanced, total // MIN_BALANCED_SHARD)
    if len(groups) < m:
        runs: list[list[OutTensor]] = [[] for _ in range(m)]
        start = 0
        for t in tensors:
            runs[min(m - 1, (2 * start + t.spec.nbytes) * m // (2 * total))].append(t)
            start += t.spec.nbytes
        runs = [g for g in runs if g]
        if len(runs) > len(groups) and all(len(g) == 1 or sum(t.spec.nbytes for t in g) <= max_shard_size
                                           for g in runs):
            groups = runs
    n = len(groups)
    return [(f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


def plan_id(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def source_info(ckpt: Checkpoint, fmt: str) -> SourceInfo:
    src = ckpt.source
    return SourceInfo(
        kind=src.kind,
        path=str(src.path) if src.kind == "local" else None,
        repo_id=src.repo_id,
        revision=src.revision,
        config_sha256=ckpt.config_sha256,
        index_sha256=ckpt.index_sha256,
        format=fmt,
    )


def write_shards(
    out: OutputDir,
    shards: list[tuple[str, list[OutTensor]]],
    *,
    workers: int = 1,
    progress=None,
    metadata: dict[str, str] | None = None,
    meta: dict[str, dict] | None = None,
) -> tuple[list[FileInfo], int, int]:
    """Write every planned shard not already finished, `workers` files at a time (each producing
    its tensors in order). Returns (file infos, written, skipped); the tensors' stage metadata
    is collected into `meta` (finished files' from the journal). A float tensor holding NaN /
    Inf is a TensorError naming it, before its bytes are written (`FileSet.put`)."""
    fs = FileSet(out, shards, progress=progress, metadata=metadata, closers=0, depth=2)
    files = _ShardFiles(fs)
    try:
        if fs.pending:
            _in_parallel(files.write, fs.pending, workers, files.stop)
        infos = fs.close()
    except BaseException:
        fs.abort()
        raise
    finally:
        OUTPUTS.clear()  # the recycled output blocks: not kept past the stage
    if meta is not None:
        meta.update(fs.meta)
    return infos, len(fs.pending), len(shards) - len(fs.pending)


def _in_parallel(write: Callable[[str, list], None], pending: list, workers: int, stop: threading.Event) -> None:
    """`write(rel, tensors)` for each pending file, `workers` at a time; the first failure sets
    `stop` (the other files stop at their next tensor) and is raised."""
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="cvt-write") as pool:
        futures = [pool.submit(write, rel, ts) for rel, ts in pending]
        try:
            # in slices: a signal the kernel hands another thread only trips Python's flag, and the
            # main thread runs its handler (SIGTERM's `cvt.signals`, Ctrl-C) when it next runs Python
            # code -- an unbounded wait would sleep through it
            while True:
                done, left = wait(futures, timeout=0.2, return_when=FIRST_EXCEPTION)
                if not left or any(fut.exception() is not None for fut in done):
                    break
            for fut in done:
                if fut.exception() is not None:
                    raise fut.exception()
            for fut in futures:
                fut.result()
        except BaseException:
            stop.set()
            for fut in futures:
                fut.cancel()
            raise


class _ShardFiles:
    """Writes one planned file's tensors in order into a `FileSet`: each produced whole, or in
    pieces (`OutTensor.pieces`), placed at its offset and charged against the set's memory budget."""

    def __init__(self, fs: FileSet):
        self.fs = fs
        self.stop = threading.Event()

    def write(self, rel: str, tensors: list[OutTensor]) -> None:
        fs = self.fs
        offset = len(fs.header(rel))  # of the next tensor's bytes in the file
        for t in tensors:
            if self.stop.is_set():
                raise _Cancelled
            if t.pieces:
                offset = self._pieces(rel, t, offset)
                continue
            charge = fs.charge(t.spec.nbytes, 1, t.release)
            try:
                place(offset)  # a kernel's output buffer lands as O_DIRECT writes it, with no staging copy
                offset += t.spec.nbytes
                data = t.produce()
            except BaseException:
                charge.done()
                raise
            fs.put(rel, t.spec, data, charge, t.meta() if t.meta is not None else None, check=not t.finite,
                   what=t.source)
            del data

    def _pieces(self, rel: str, t: OutTensor, offset: int) -> int:
        """`t`'s pieces into file `rel` from `offset`, each placed and charged as it is made, then
        an empty last piece that closes the item. Returns the offset after it."""
        end, it = offset + t.spec.nbytes, iter(t.produce())
        try:
            return self._pieces_into(rel, t, it, offset, end)
        finally:
            # a producer left mid-way (another worker failed, the disk is full) may hold a lock
            # the next file's parts wait on (a fused module's) or source pages: let it unwind now
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def _pieces_into(self, rel: str, t: OutTensor, it, offset: int, end: int) -> int:
        import numpy as np

        fs = self.fs
        while True:
            if self.stop.is_set():
                raise _Cancelled
            place(offset)
            data = next(it, None)
            if data is None:
                break
            n = data.nbytes
            if offset + n > end:
                raise RuntimeError(f"internal: {t.spec.name} produced more than its {t.spec.nbytes} planned bytes")
            fs.put(rel, t.spec, data, fs.charge(n, 1), piece=True, last=False, check=not t.finite, what=t.source)
            offset += n
            del data
        if offset != end:
            raise RuntimeError(f"internal: {t.spec.name} produced {t.spec.nbytes - (end - offset)} bytes, planned "
                               f"{t.spec.nbytes}")
        fs.put(rel, t.spec, np.empty(0, np.uint8), fs.charge(0, 1, t.release), t.meta() if t.meta else None,
               piece=True)
        return end


def run_plan_id(ckpt: Checkpoint, src: SourceInfo, stage: StageInfo, **parts: Any) -> str:
    """The plan id of a stage run (resume continues only the same plan): tool version, source
    identity and files, the stage and its parameters, plus the stage's own `parts`."""
    return plan_id({
        "tool": __version__,
        "source": src.model_dump(),
        # fine-tunes share config, index, names and sizes with their base, and a copy keeps
        # mtimes: the weight files' content (headers and sampled blocks, `Checkpoint.content_identity`) tells
        # one source from another, and a mere touch of SRC does not
        "source_files": ckpt.content_identity,
        "stage": stage.model_dump(),
        **parts,
    })


def _carried(ckpt: Checkpoint, names: Iterable[str] | None) -> list[str]:
    """The source's carried tensors, then those only the output has (DeepSeek-V4's MTP copies)."""
    out = carried_names(ckpt.config, ckpt.tensors)
    if names is not None:
        out += [n for n in carried_names(ckpt.config, names) if n not in ckpt.tensors]
    return out


def finish_output(out: OutputDir, ckpt: Checkpoint, files: list[FileInfo], *, src: SourceInfo, stage: StageInfo,
                  pid: str, out_format: str, tensor_count: int, total_size: int, summary: dict[str, int],
                  quant=None, shard=None, skip_aux: Iterable[str] = (), names: Iterable[str] | None = None) -> Manifest:
    """Copy the source's side files (tokenizer, generation config, remote code, ...; not
    `skip_aux`) into DST, then write the manifest: the last file, which makes DST complete.
    `names`: the tensors written, when not the source's (the manifest lists their carried ones)."""
    skip = set(skip_aux)
    for path in ckpt.aux_files():
        if path.name not in skip:
            files.append(out.copy_file(path, path.name))
    prior = list(ckpt.manifest.stages) if ckpt.manifest is not None else []  # a later stage extends the history
    manifest = Manifest(tool=ToolInfo(version=__version__), source=src, stages=[*prior, stage], format=out_format,
                        plan_id=pid, tensor_count=tensor_count, total_size=total_size, files=files,
                        summary=Summary(counts=summary), carried=_carried(ckpt, names), quant=quant, shard=shard)
    out.finish(manifest)
    return manifest


def ranked(w: World, files: list[tuple[str, Any]], cost: Callable[[Any], int]) -> list[tuple[str, Any]]:
    """The planned files rank `w` writes (`cvt.world.World.mine`, by bytes): all of them in a
    world of one. Which rank writes a file changes nothing in it: the plan fixes every byte."""
    return files if w.size == 1 else [files[i] for i in w.mine([cost(x) for _, x in files])]


def together(w: World, step: Callable[[], Any]) -> Any:
    """Run this rank's `step`, then agree with the others (`cvt.world.World.agree`): when any rank
    failed every rank raises (the failing one its own error), so that none waits for a peer
    that left. In a world of one: just `step()`."""
    if w.size == 1:
        return step()
    err = out = None
    try:
        out = step()
    except BaseException as exc:  # KeyboardInterrupt too: the peers must hear of it
        err = exc
    err = w.agree(err)
    if err is not None:
        raise err
    return out


def gathered(w: World, plan: list[tuple[str, Any]], files: list[FileInfo], written: int, skipped: int,
             meta: dict | None = None) -> tuple[list[FileInfo], int, int]:
    """Every rank's file infos in `plan` order, and the counts summed (meta merged into `meta`)."""
    if w.size == 1:
        return files, written, skipped
    parts = w.all_gather((files, written, skipped, meta or {}))
    order = {rel: i for i, (rel, _) in enumerate(plan)}
    files = sorted((f for p in parts for f in p[0]), key=lambda f: order[f.path])
    if meta is not None:
        for p in parts:
            meta.update(p[3])
    return files, sum(p[1] for p in parts), sum(p[2] for p in parts)


def write_checkpoint(
    ckpt: Checkpoint,
    dst: Path,
    tensors: list[OutTensor],
    *,
    stage: StageInfo,
    source_format: str,
    out_format: str,
    config: dict,
    summary: dict[str, int],
    max_shard_size: int = DEFAULT_MAX_SHARD,
    workers: int = 1,
    balanced: int = BALANCED_FILES,
    resume: bool = True,
    overwrite: bool = False,
    quiet: bool = False,
    prefix: str = "model",
    extra_files: Iterable[tuple[str, bytes]] = (),
    quant=None,
    on_meta: Callable[[dict[str, dict]], None] | None = None,
    world: World = SINGLE,
) -> WriteResult:
    """Plan, write and finalize a Hugging Face style checkpoint directory (see module doc);
    `balanced`: see `plan_shards`; `world`: the ranks that write it (`cvt.world`)."""
    t0 = time.perf_counter()
    extra_files = list(extra_files)
    shards = plan_shards(tensors, max_shard_size, prefix, balanced)
    src = source_info(ckpt, source_format)
    pid = run_plan_id(
        ckpt, src, stage, max_shard_size=max_shard_size, prefix=prefix, files=[(rel, len(ts)) for rel, ts in shards],
        tensors=[(t.spec.name, t.spec.dtype, t.spec.shape) for t in tensors],
        quant=quant.model_dump(exclude={"tensors", "fallbacks", "float_modules", "calibration", "mixed_precision"})
        if quant is not None else None)
    total_out = sum(t.spec.nbytes for t in tensors)
    manifest = None
    with OutputDir(Path(dst), pid, resume=resume, overwrite=overwrite, source=ckpt.source.confine_root,
                   verb=stage.name, world=world) as out:
        together(world, lambda: out.claim([*(rel for rel, _ in shards), f"{prefix}.safetensors.index.json", "config.json",
                                    *(rel for rel, _ in extra_files), *(p.name for p in ckpt.aux_files())]))
        meta: dict[str, dict] = {}
        mine = ranked(world, shards, lambda ts: sum(t.spec.nbytes for t in ts))  # this rank's files (all, for one)
        with make_progress(sum(t.spec.nbytes for _, ts in mine for t in ts), stage.name, quiet or not world.main) as bar:
            files, written, skipped = together(world, lambda: write_shards(
                out, mine, workers=workers, progress=bar, meta=meta))
        files, written, skipped = gathered(world, shards, files, written, skipped, meta)
        if on_meta is not None:
            on_meta(meta)
        if world.main:  # the files that make DST complete: one writer, after every rank's files are in
            weight_map = {t.spec.name: rel for rel, ts in shards for t in ts}
            files.append(out.write_json(f"{prefix}.safetensors.index.json",
                                        {"metadata": {"total_size": total_out}, "weight_map": weight_map}))
            files.append(out.write_json("config.json", config))
            for rel, data in extra_files:
                files.append(out.write_small(rel, data))
            manifest = finish_output(out, ckpt, files, src=src, stage=stage, pid=pid, out_format=out_format,
                                     tensor_count=len(tensors), total_size=total_out, summary=summary, quant=quant,
                                     names=[t.spec.name for t in tensors])
        world.barrier()
    return WriteResult(
        dst=Path(dst),
        files=files,
        written_files=written,
        skipped_files=skipped,
        bytes_in=sum(t.read_bytes for t in tensors),
        bytes_out=total_out,
        seconds=time.perf_counter() - t0,
        manifest=manifest,
        meta=meta,
        processes=world.size,
    )
