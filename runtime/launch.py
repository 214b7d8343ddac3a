"""One rank of a sharded checkpoint: ``torchrun --nproc-per-node W -m cvt.runtime.launch DST ...``.

``cvt run DST --procs W`` starts exactly this through torchrun. Each rank, before any
weight is read (`preflight`):

* reads DST/cvt_manifest.json (`cvt.convert.shard.read_shard_manifest`) and refuses a launch
  whose WORLD_SIZE differs from the manifest's world size;
* checks its own files -- its rank directory's weight files, index and Ascend description,
  and config.json -- exist with the manifest's size and checksum (``--no-verify-files`` checks
  sizes only);
* checks that the layout still validates against config.json (`cvt.convert.memory_plan.check`) and
  that its manifest coordinates follow the layout's rank rule;
* encodes the prompts (the tokenizer of `cvt run`) and checks the ids against the vocabulary.

Then the process group is initialized (gloo / nccl / hccl by device) and the ranks agree:
if any rank failed, each failing rank prints one line ``cvt: error: rank R: ...`` and every
rank exits non-zero. Otherwise each rank loads only its directory (`cvt.runtime.parallel`),
the ranks agree again, and they run greedy (or sampled, same seed everywhere) generation
together; rank 0 prints the text. Log records below WARNING are kept on rank 0 only.

``--dump-logits FILE`` writes a safetensors file with, per prompt i, ``tokens.{i}`` (prompt +
generated ids) and ``logits.{i}`` float32 ``[len(tokens) - 1, vocab]``: the logits of every
call `generate` made (prefill, then each decode step), i.e. what predicted tokens 1..end.
Rank 0 writes it; a FILE containing ``{rank}`` is written by every rank.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cvt.errors import CvtError, ManifestError

if TYPE_CHECKING:  # importing the launcher stays cheap: `cvt run` imports it
    from cvt.runtime.tokenizer import Tokenizer
    from cvt.schemas.manifest import Manifest, RankShard

log = logging.getLogger("cvt.runtime.launch")

EXIT_ERROR, EXIT_INTERNAL = 1, 70  # as the CLI exits for a refused input and for a bug


@dataclass
class Preflight:
    """What a rank checked before loading: manifest, its entry, config, encoded prompts."""

    root: Path
    manifest: "Manifest"
    entry: "RankShard"
    config: dict
    tokenizer: "Tokenizer"
    prompts: list[list[int]]


def _layout_words(layout) -> str:
    return (f"tp {layout.tp}, dp {layout.dp}, moe_tp {layout.moe_tp}, ep {layout.ep}, dense_tp {layout.dense_tp}, "
            f"embed_tp {layout.embed_tp}, lmhead_tp {layout.lmhead_tp}")


def preflight(root, rank: int, world_size: int, *, verify_files: bool = True, prompts=(), input_ids=()) -> Preflight:
    """Every check a rank makes before reading a weight (module docstring); CvtError on the first problem."""
    from cvt.convert.placement import coords
    from cvt.convert.memory_plan import check
    from cvt.convert.reader import file_problems
    from cvt.convert.safetensors_io import load_json
    from cvt.convert.shard import read_shard_manifest, weights_scheme
    from cvt.runtime.tokenizer import load_tokenizer, prompt_ids

    root = Path(root)
    manifest = read_shard_manifest(root)
    layout = manifest.shard.layout
    if world_size != layout.world_size:
        raise CvtError(f"{root} is sharded for a world of {layout.world_size} ranks ({_layout_words(layout)}), but "
                       f"{world_size} were launched (WORLD_SIZE={world_size}): launch with --nproc-per-node "
                       f"{layout.world_size} (cvt run --procs {layout.world_size})")
    entry = next((e for e in manifest.shard.ranks if e.rank == rank), None)
    if entry is None:
        raise ManifestError(f"{root}: the manifest has no entry for rank {rank}")
    want = {k: v for k, v in vars(coords(layout, rank)).items() if k != "rank"}
    if entry.coords != want:
        raise ManifestError(f"{root}: rank {rank} coordinates {entry.coords} do not follow the layout's rank rule "
                            f"({want})")
    files = {f.path: f for f in manifest.files}
    missing = [rel for rel in entry.files if rel not in files]
    if missing:
        raise ManifestError(f"{root}: rank {rank} file {missing[0]} is not in the manifest's file list")
    mine = [f for f in manifest.files if f.path.startswith(entry.dir + "/")]
    if "config.json" not in files:
        raise ManifestError(f"{root}: the manifest does not list config.json")
    bad = file_problems(root, [files["config.json"], *mine], verify_files)  # paths confined by the reader
    if bad:
        raise ManifestError(bad[0])
    config = load_json(root / "config.json")
    from cvt.convert.arch import arch_for, text_config

    arch_for(config).shapes()  # sizes that describe no model: one line naming the key
    # the scheme the shards were cut for, as the sharder saw it
    scheme, group = weights_scheme(config, manifest.quant.model_dump() if manifest.quant else None, str(root))
    check(layout, config, scheme, group)
    tok = load_tokenizer(root, config)
    ids = prompt_ids(tok, prompts, input_ids, int(text_config(config).get("vocab_size") or 0))
    return Preflight(root, manifest, entry, config, tok, ids)


class LogitsRecorder:
    """Stands in for a model in `generate`, keeping the logits of every call: (start_pos, logits)."""

    def __init__(self, model):
        self.model = model
        self.calls: list[tuple[int, object]] = []

    def __call__(self, tokens, start_pos: int = 0, cache=None):
        out = self.model(tokens, start_pos=start_pos, cache=cache)
        self.calls.append((start_pos, out))
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)

    def per_prompt(self, prompts: list[list[int]]) -> list:
        """logits float32 [len(prompt) + decode steps, vocab] per prompt (generate's grouping:
        prompts of one length form a batch, batches in order of first appearance)."""
        import torch

        groups: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault(len(p), []).append(i)
        runs: list[list] = []
        for start, out in self.calls:
            if start == 0:
                runs.append([])
            runs[-1].append(out)
        out: list = [None] * len(prompts)
        for run, idx in zip(runs, groups.values()):
            cat = torch.cat([t.float().cpu() for t in run], dim=1)
            for j, i in enumerate(idx):
                out[i] = cat[j]
        return out


def dump_logits(path, prompts: list[list[int]], outputs: list[list[int]], logits: list) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {}
    for i, (p, o, lg) in enumerate(zip(prompts, outputs, logits)):
        tensors[f"tokens.{i}"] = torch.tensor(p + o, dtype=torch.int64)
        tensors[f"logits.{i}"] = lg.contiguous()
    save_file(tensors, str(path))


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, like every cvt failure
        sys.stderr.write(f"cvt: error: {message} (see 'python -m cvt.runtime.launch --help')\n")
        sys.exit(2)


def parser() -> argparse.ArgumentParser:
    from cvt.runtime.device import CHOICES, DTYPES

    p = _Parser(prog="python -m cvt.runtime.launch",
                description="One rank of a cvt shard output; start with torchrun --nproc-per-node W.")
    p.add_argument("model", help="a cvt shard output directory")
    p.add_argument("--prompt", dest="prompts", action="append", default=[], help="prompt text (repeat for a batch)")
    p.add_argument("--input-ids", dest="input_ids", action="append", default=[],
                   help="comma-separated token ids instead of text (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=CHOICES, default="auto")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--no-verify-files", action="store_true", help="check file sizes only, not checksums")
    p.add_argument("--dump-logits", metavar="FILE", help="safetensors file of every call's logits (module doc)")
    p.add_argument("--quiet", "-q", action="store_true")
    p.add_argument("--debug", action="store_true")
    return p


class _RankZero(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or record.levelno >= logging.WARNING


def _logging(rank: int, debug: bool, quiet: bool) -> None:
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"cvt: rank {rank}: %(levelname)s %(name)s: %(message)s" if debug
                                               else "cvt: %(message)s"))
        root.addHandler(handler)
    for h in root.handlers:
        h.addFilter(_RankZero(rank))
    root.setLevel(logging.DEBUG if debug else (logging.WARNING if quiet else logging.INFO))


def report(rank: int, exc: BaseException, debug: bool) -> int:
    """One line on stderr for a rank's failure (a traceback with --debug); its exit code. A
    collective whose peer went away says nothing: that peer, or torchrun's report of it
    (`cvt.launcher`), says why."""
    from cvt.world import peer_left

    if debug:
        traceback.print_exception(exc)
    if peer_left(exc):
        return EXIT_ERROR
    if isinstance(exc, CvtError):
        sys.stderr.write(f"cvt: error: rank {rank}: {exc}\n")
        return exc.exit_code
    sys.stderr.write(f"cvt: internal error: rank {rank}: {type(exc).__name__}: {exc} "
                     "(re-run with --debug for the traceback)\n")  # a bug
    return EXIT_INTERNAL


def main(argv=None, *, setup_logging: bool = False) -> int:
    """Run one rank; returns the exit code (module docstring). `setup_logging`: configure the root
    logger (rank-0 filtering), as the ``python -m`` entry point does; off for library callers."""
    args = parser().parse_args(argv)
    from cvt.world import for_rank_entry

    w = for_rank_entry()  # this rank's world, read once (torch.distributed's, or torchrun's environment)
    rank, world, local = w.rank, w.size, w.local_rank
    if setup_logging:
        _logging(rank, args.debug, args.quiet)
    owned = clean = False  # clean: every rank got to the same point (a barrier is safe)
    try:
        import torch.distributed as dist

        from cvt.runtime.parallel import agree, backend_for, rank_device

        device = rank_device(args.device, local)
        try:
            pre, err = preflight(args.model, rank, world, verify_files=not args.no_verify_files,
                                 prompts=args.prompts, input_ids=args.input_ids), None
        except OSError as exc:
            pre, err = None, CvtError(f"{exc.filename + ': ' if exc.filename else ''}{exc.strerror or exc}")
        except Exception as exc:  # whatever it is, it must reach `agree`, or the peers wait
            pre, err = None, exc
        if world > 1 and not dist.is_initialized():
            from cvt.world import init_group

            init_group(backend_for(device), rank, world)
            owned = True
        failed = agree(err is not None, device)
        clean = True
        if err is not None:
            raise err
        if failed:
            log.debug("rank(s) %s failed the start-up checks; stopping", failed)
            return 1
        clean = False  # from here `_run` synchronizes the ranks itself (ParallelContext.close)
        rc = _run(args, pre, rank, device)
        # every rank that returns came through ParallelContext.close: one more barrier before the
        # world group goes, so no rank tears its gloo pairs down while a peer is still destroying
        # the sub-groups (seen once as a SIGABRT of rank 0 at exit, after its output was printed)
        clean = True
        return rc
    except KeyboardInterrupt as exc:  # SIGINT, or SIGTERM / SIGHUP (`cvt.signals`)
        from cvt import signals

        sig = signals.signum_of(exc)
        sys.stderr.write(f"{signals.stopped_line(sig).replace('cvt: ', f'cvt: rank {rank}: ', 1)}\n")
        return signals.exit_code(sig)
    except Exception as exc:
        return report(rank, exc, args.debug)
    finally:
        if owned:
            import torch.distributed as dist

            if clean:  # all ranks are here: none tears its pairs down under a peer still using them
                try:
                    dist.barrier()
                except RuntimeError as exc:  # a peer that failed late already left: nothing to wait for
                    log.debug("rank %d: final barrier: %s", rank, exc)
            dist.destroy_process_group()


def _run(args, pre: Preflight, rank: int, device) -> int:
    """Load the rank, agree, generate; rank 0 prints."""
    from cvt.runtime.device import DTYPES
    from cvt.runtime.generate import generate
    from cvt.runtime.parallel import ParallelContext, agree, load_rank

    layout = pre.manifest.shard.layout
    ctx = ParallelContext.create(layout, rank, device)
    dtype = DTYPES[args.dtype]
    try:
        rm, err = load_rank(pre.root, pre.manifest, pre.config, ctx, dtype=dtype), None
    except Exception as exc:  # any failure (out of memory too) must reach `agree`, or the peers wait
        rm, err = None, exc
    failed = agree(err is not None, device)
    if failed:
        ctx.close()  # every rank takes this path together: the barrier inside is safe
        if err is not None:
            return report(rank, err, args.debug)
        log.debug("rank(s) %s failed to load; stopping", failed)
        return 1
    log.info("rank %d of %d loaded %s (%s)", rank, layout.world_size, pre.entry.dir, _layout_words(layout))
    model = LogitsRecorder(rm.model) if args.dump_logits else rm.model
    tok = pre.tokenizer
    from cvt.convert.arch import carried_names, carried_what

    carried = carried_names(pre.config, pre.manifest.carried)
    if rank == 0 and carried:
        sys.stderr.write(f"cvt: note: {pre.config.get('model_type')}: running the text model only (the "
                         f"{len(carried)} {carried_what(carried)} tensors are not loaded)\n")
    res = generate(model, pre.prompts, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   seed=args.seed, eos_id=tok.eos_id, device=device)
    ctx.close()  # the last collective is done: what follows is local (a failure there strands nobody)
    if args.dump_logits and (rank == 0 or "{rank}" in args.dump_logits):
        dump_logits(args.dump_logits.replace("{rank}", str(rank)), pre.prompts, res.outputs,
                    model.per_prompt(pre.prompts))
    if rank == 0:
        for prompt, out in zip(pre.prompts, res.outputs):
            print(tok.decode(prompt) + tok.decode(out))
            if not args.quiet:
                print(f"  [{len(prompt)} prompt + {len(out)} new tokens: {out[:16]}{' ...' if len(out) > 16 else ''}]")
        if not args.quiet:
            print(f"prefill {res.prefill_tokens_per_s:.1f} tokens/s, decode {res.decode_tokens_per_s:.1f} tokens/s "
                  f"({device}, {args.dtype}, {tok.kind} tokenizer, {layout.world_size} ranks: {_layout_words(layout)})")
        sys.stdout.flush()
    return 0


# ------------------------------------------------------------------------------ cvt run --procs
def sharded_world(model) -> int | None:
    """The world size of a `cvt shard` output directory (None: MODEL is something else)."""
    from cvt.convert.reader import read_manifest

    if not Path(str(model)).is_dir():
        return None
    m = read_manifest(Path(str(model)))  # an invalid manifest is an error naming its fields
    return None if m is None or m.shard is None else m.shard.layout.world_size


def launch_args(*, prompts=(), input_ids=(), max_new_tokens=32, temperature=0.0, top_p=1.0, seed=0,
                device="auto", dtype="bf16", quiet=False, debug=False, dump_logits=None,
                verify_files=True) -> list[str]:
    """The launcher's command line for these `cvt run` options."""
    argv = [a for p in prompts for a in ("--prompt", p)] + [a for i in input_ids for a in ("--input-ids", i)]
    argv += ["--max-new-tokens", str(max_new_tokens), "--temperature", str(temperature), "--top-p", str(top_p),
             "--seed", str(seed), "--device", device, "--dtype", dtype]
    argv += (["--quiet"] if quiet else []) + (["--debug"] if debug else [])
    argv += ([] if verify_files else ["--no-verify-files"]) + (["--dump-logits", str(dump_logits)] if dump_logits else [])
    return argv


def torchrun(model, world_size: int | None, argv: list[str]) -> int:
    """Run `python -m torch.distributed.run --standalone --nproc-per-node W -m cvt.runtime.launch MODEL
    ARGV` (`cvt.world.launch`) and return its exit code."""
    world = sharded_world(model)
    if world is None:
        raise CvtError(f"{model}: not a cvt shard output (no cvt_manifest.json with a 'shard' section); "
                       "--procs runs sharded checkpoints (cvt shard SRC DST --world-size W)")
    if world_size is None:
        raise CvtError(f"{model} is sharded for {world} ranks: run it with `cvt run {model} --procs {world}` "
                       f"(or torchrun --nproc-per-node {world} -m cvt.runtime.launch {model})")
    if world_size != world:
        raise CvtError(f"{model} is sharded for a world of {world} ranks, not {world_size}: use --procs {world}")
    from cvt.launcher import launch

    return launch("cvt.runtime.launch", [str(model), *argv], world_size, debug="--debug" in argv)


__all__ = ["main", "preflight", "Preflight", "LogitsRecorder", "dump_logits", "parser", "torchrun", "launch_args",
           "sharded_world"]


if __name__ == "__main__":
    from cvt import signals
    from cvt.launcher import die_with_parent

    signals.install()
    die_with_parent()()  # a rank never outlives torchrun's agent (nor, through it, `cvt run`)
    sys.exit(main(setup_logging=True))
