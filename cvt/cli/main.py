"""The `cvt` group and its verbs: each builds its `cvt.api` options object, calls one function
and prints a summary. Every verb takes `--quiet` (no progress bar or summary) and `--debug`
(tracebacks and debug logging); `main` turns every failure into one line, `cvt: error: ...`, and
an exit code. Neither torch nor a registry is imported before a verb runs: `cvt --help` is instant.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from typing import get_args

import click

from cvt.cli.export import export as export_group
from cvt.cli import describe, options
from cvt.cli.describe import LazyHelp
from cvt.cli.options import (EXIT_ERROR, EXIT_INTERNAL, EXIT_PROBLEMS, EXIT_THRESHOLD, FORMATS,
                             FP4_FORMATS, METHODS, PLAN_SCHEMES, SCHEMES, SIZE, TARGETS, FiniteFloat, common,
                             human, on_processes, ranks)
from cvt import api
from cvt.corpus import CALIB_TOKENS
from cvt.version import __version__

log = logging.getLogger("cvt")

# what --procs says on the verbs whose ranks only deal out output files
STREAMING_RANKS = "the ranks exchange only file lists, over gloo (CPU); the bytes are those of one process."


@click.group(cls=describe.LazyHelpGroup, text=describe.group_help,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="cvt")
def cli() -> None:
    """The `cvt` group; its help is `describe.group_help` (the models: the architecture tables')."""


@cli.command("fp8-to-bf16", cls=describe.LazyHelpCommand, text=describe.fp8_to_bf16)
@click.argument("src")
@click.argument("dst", type=click.Path())
@click.option("--revision", help="Hub revision (branch, tag or commit) when SRC is a repo id.")
@click.option("--workers", type=click.IntRange(1, 64), default=None,
              help="Output files written in parallel (default: 2, or 1 on a 1-core machine). Peak memory grows with it.")
@click.option("--max-shard-size", type=SIZE, default="5GB", show_default=True,
              help="Largest output file, e.g. 5GB, 500MB, 2GiB. An output under 4 such files is cut into up to 4 "
                   "files of about equal shares (at least 256 MiB each; a large tensor keeps its own file), "
                   "so they are hashed in parallel.")
@click.option("--resume/--no-resume", default=True, show_default=True,
              help="Keep output files an interrupted run of the same conversion finished (size and checksum checked).")
@click.option("--overwrite", is_flag=True, help="Allow a DST that holds other files or another run's output.")
@common
@ranks("its output files", STREAMING_RANKS, old_spelling=True)
def fp8_to_bf16_cmd(src, dst, revision, workers, max_shard_size, resume, overwrite, quiet):
    """Its help is `describe.fp8_to_bf16` (the sources it reads: the source-precision registry's)."""
    r = api.fp8_to_bf16(api.Fp8ToBf16Options(src=src, dst=dst, revision=revision, workers=workers,
                                             max_shard_size=max_shard_size, resume=resume, overwrite=overwrite,
                                             quiet=quiet))
    if not quiet:
        from cvt.units import plural

        x = r.extra
        click.echo(
            f"dequantized {plural(x['dequantized'], x['precision'] + ' tensor')}, passed {x['passed_through']} through, dropped "
            f"{plural(x['scales_dropped'], 'scale')}\n"
            f"wrote {plural(r.written_files, 'weight file')} ({r.skipped_files} already done) to {r.dst}\n"
            f"read {human(r.bytes_in)}, wrote {human(r.bytes_out)} in {r.seconds:.1f} s ({human(r.throughput)}/s)"
            f"{on_processes(r)}")




@cli.command("quantize", cls=describe.LazyHelpCommand, text=describe.quantize)
@click.argument("src")
@click.argument("dst", type=click.Path())
@click.option("--scheme", type=SCHEMES, required=True, cls=LazyHelp, text=describe.schemes)
@click.option("--format", "fmt", type=FORMATS, default=None, cls=LazyHelp, text=describe.formats)
@click.option("--target", type=TARGETS, default=None, cls=LazyHelp, text=describe.targets)
@click.option("--target-version", default=None, metavar="LINE",
              help="vllm-ascend: the release line the output is for, 0.23 (default), 0.24, 0.25 or main; recorded "
                   "in the manifest. A module that line no longer loads is refused, saying why (main: no W4A8 "
                   "dense linear, no per-group W4A8).")
@click.option("--kv-dtype", default=None, metavar="int8|fp8",
              help="w8a8c8: the quantized KV cache's storage. ascend: int8 (default; C8 / FAKQuant) or fp8 "
                   "(FAKQuant's e4m3 cache on Ascend 950, MLA models, vllm-ascend; scales amax / 448); "
                   "compressed-tensors: fp8 only.")
@click.option("--method", type=METHODS, default=None, cls=LazyHelp, text=describe.methods)
@click.option("--group-size", type=click.IntRange(0), default=None,
              help="w4a16 group size along k (0: per channel). Default 128 for compressed-tensors, 64 for ascend.")
@click.option("--asym", is_flag=True, help="w4a16 with offsets (zero points) instead of symmetric.")
@click.option("--fp4-format", type=FP4_FORMATS, default=None,
              help="Default nvfp4. nvfp4: group 16, E4M3 scales + a global scale; mxfp4: group 32, E8M0 scales.")
@click.option("--calib", type=click.Path(dir_okay=False), help="Calibration text or .jsonl (\"text\" field); default: a built-in sample.")
@click.option("--calib-tokens", type=click.IntRange(16), default=CALIB_TOKENS, show_default=True,
              help="Calibration tokens to use, in sequences of 256 (the default: 128 x 256, the budget "
                   "llm-compressor's GPTQ examples use at that length; fewer leave MoE experts few rows). A count "
                   "above what the calibration text gives is refused; the default takes what a shorter --calib "
                   "file gives.")
@click.option("--device", type=click.Choice(get_args(api.Device)), default="cpu", show_default=True,
              help="Where calibration computes (gptq / awq / smoothquant, --static-attention, w8a8c8): each decoder "
                   "layer is read from SRC onto it, calibrated and dropped; RTN needs no device.")
@click.option("--expert-memory", type=SIZE, default="4GiB", show_default=True,
              help="Calibration reads at most this much of a MoE layer's routed experts at once (as float32): a layer "
                   "above it (DeepSeek-V3: ~45 GB) is calibrated a chunk of experts at a time, same output. Not "
                   "when AWQ / SmoothQuant smooth across the experts (they need them all).")
@click.option("--static-attention", is_flag=True,
              help="w8a8 (ascend): static per-tensor activation scales on attention projections, calibrated "
                   "(Ascend W8A8 with input_scale / deq_scale / quant_bias); MLPs and experts stay dynamic.")
@click.option("--ignore", multiple=True, help="Regex of module names to keep float (repeatable).")
@click.option("--recipe", type=click.Path(exists=True, dir_okay=False), help="JSON/YAML rules: pattern -> scheme/method/group size.")
@click.option("--rotate", default=None, metavar="hadamard[:SEED]",
              help="Fold a randomised Hadamard rotation into the weights first (QuaRot, offline): the residual "
                   "stream (norms folded into their readers), MLA's q / kv latents and the value heads turn, the "
                   "float model stays the same function, and activation outlier channels spread over all channels "
                   "(W4A8, W8A8, W4A4 gain). Same SEED, same bytes (default 0); recorded in the manifest. Refused "
                   "where it cannot be exact (DeepSeek-V4, Kimi-K2.5, tied embeddings). SRC: BF16 or FP8 block.")
@click.option("--kl-budget", type=float, default=None, metavar="KL",
              help="Keep the fewest decoder-layer units (attention, MLP, routed experts) at --kl-high until the "
                   "mean KL measured on the calibration text is at most KL; the choice and the measurements go into "
                   "the manifest (docs/quantize.md, Mixed precision by a KL budget).")
@click.option("--kl-high", default=None, metavar="SCHEME|float",
              help="The precision --kl-budget keeps units at (default w8a8).")
@click.option("--flatquant-steps", type=click.IntRange(1, 100000), default=None, metavar="N", cls=LazyHelp,
              text=lambda: describe.flatquant_fit("steps"))
@click.option("--flatquant-lr", type=FiniteFloat(min=0, min_open=True, max=1), default=None, metavar="LR",
              cls=LazyHelp, text=lambda: describe.flatquant_fit("lr"))
@click.option("--flatquant-seed", type=click.IntRange(0, 2**31 - 1), default=None, metavar="SEED", cls=LazyHelp,
              text=lambda: describe.flatquant_fit("seed"))
@click.option("--revision", help="Hub revision when SRC is a repo id.")
@click.option("--workers", type=click.IntRange(1, 64), default=None,
              help="Output files written in parallel (default: 2, or 1 on a 1-core machine).")
@click.option("--max-shard-size", type=SIZE, default="5GB", show_default=True,
              help="Largest output file. An output under 4 such files is cut into up to 4 files of about equal "
                   "shares (at least 256 MiB each; a large tensor keeps its own file), so they are hashed in parallel.")
@click.option("--resume/--no-resume", default=True, show_default=True, help="Keep files an interrupted run finished.")
@click.option("--overwrite", is_flag=True, help="Allow a DST that holds other files or another run's output.")
@common
@ranks("the calibration samples, the layers' linears and experts (by cost) and the output files",
       "they talk over gloo on CPU, nccl / hccl for --device cuda / npu. Without calibration the bytes are those "
       "of one process; calibrated (gptq, awq, smoothquant, flatquant, --static-attention, w8a8c8's KV ranges) they depend "
       "on N, not on timing: the same N writes the same bytes, one process other bytes (sums in another order, "
       "which GPTQ's rounding amplifies).", old_spelling=True)
def quantize_cmd(src, dst, scheme, fmt, target, target_version, kv_dtype, method, group_size, asym, fp4_format, calib,
                 calib_tokens, device,
                 expert_memory, static_attention, ignore, recipe, rotate, kl_budget, kl_high, flatquant_steps,
                 flatquant_lr, flatquant_seed, revision, workers,
                 max_shard_size, resume, overwrite, quiet):
    """Its help is `describe.quantize` (the sources it reads: the source-precision registry's)."""
    if click.get_current_context().get_parameter_source("calib_tokens") is click.core.ParameterSource.DEFAULT:
        calib_tokens = None  # the default is a bound (a shorter text is used whole), a given count a demand
    r = api.quantize(api.QuantizeOptions(
        src=src, dst=dst, scheme=scheme, fmt=fmt, target=target, target_version=target_version, kv_dtype=kv_dtype,
        method=method, group_size=group_size, asym=asym,
        fp4_format=fp4_format, calib=calib, calib_tokens=calib_tokens, device=device, expert_memory=expert_memory,
        static_attention=static_attention, ignore=tuple(ignore), recipe=recipe, rotate=rotate, revision=revision,
        workers=workers, max_shard_size=max_shard_size, resume=resume, overwrite=overwrite, quiet=quiet,
        kl_budget=kl_budget, kl_high=kl_high, flatquant_steps=flatquant_steps, flatquant_lr=flatquant_lr,
        flatquant_seed=flatquant_seed))
    if not quiet:
        from cvt.units import plural

        x = r.extra
        q = r.manifest.quant
        kinds = ", ".join(f"{n} {k}" for k, n in x["by_scheme"].items()) if len(x["by_scheme"]) > 1 else q.scheme
        methods = ", ".join(f"{n} {k}" for k, n in x["by_method"].items()) if len(x["by_method"]) > 1 else q.method
        click.echo(f"quantized {plural(x['quantized'], 'linear')} ({kinds}; {methods}; {q.format}), kept "
                   f"{x['float_modules']} float, {plural(x['fallbacks'], 'fallback')}; worst SQNR {x['min_sqnr_db']}\n"
                   + "".join(f"  {line}\n" for line in x["fallback_lines"] + x["mixed_lines"])
                   + (f"calibrated {c['layers']} layers on {c['tokens']} tokens ({c['device']}): "
                      f"{sum(c['seconds_per_layer']) / max(1, len(c['seconds_per_layer'])):.2f} s/layer, "
                      f"peak RSS {human(c['peak_rss_bytes'])}"
                      + (f", {c['resumed_layers']} layers resumed" if c['resumed_layers'] else "") + "\n"
                      if (c := r.manifest.quant.calibration) else "") +
                   f"wrote {plural(r.written_files, 'weight file')} ({r.skipped_files} already done) to {r.dst}: "
                   f"{human(r.bytes_out)} in {r.seconds:.1f} s{on_processes(r)}")


def _layout_options(fn):
    """The layout degrees shared by `cvt plan` and `cvt shard`."""
    opts = [
        click.option("--world-size", type=click.IntRange(1), help="Ranks in the world (default: ep x moe-tp, or tp)."),
        click.option("--tp", type=click.IntRange(1), help="Attention tensor parallel degree (default 1: attention DP)."),
        click.option("--ep", type=click.IntRange(1), help="Expert parallel degree (--ep 64 alone: 64 ranks, attention DP)."),
        click.option("--moe-tp", type=click.IntRange(1), help="TP inside each expert (default 1)."),
        click.option("--dense-tp", type=click.IntRange(1), help="TP of the dense MLP layers (default: --tp)."),
        click.option("--embed-tp", type=click.IntRange(1), help="Vocab-parallel degree of the embedding (default: --tp)."),
        click.option("--lmhead-tp", type=click.IntRange(1), help="Column-parallel degree of lm_head (default: --tp)."),
        click.option("--placement", type=click.Path(exists=True, dir_okay=False),
                     help="Expert placement: MindIE/vllm-ascend JSON or DeepSeek EPLB phy2log (default contiguous)."),
        click.option("--redundant", type=click.IntRange(0), default=0, show_default=True,
                     help="Without --placement: extra physical expert slots holding copies of experts 0..R-1."),
        click.option("--shared-experts", type=click.Choice(["moe_tp", "replicated"]), default="moe_tp",
                     show_default=True, help="Split shared experts moe-tp ways, or hold them whole on every rank."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _print_plan(options) -> None:
    from cvt.convert.placement import LayoutError
    from cvt.convert.memory_plan import layout_violations

    try:
        plan = api.plan(options)
    except LayoutError as exc:  # degrees that make no layout: the plan's problems, with nothing to plan
        click.echo(f"no memory plan: the degrees make no layout\n\n{layout_violations(exc.problems)}")
        sys.exit(EXIT_PROBLEMS)
    click.echo(plan.render())
    if plan.violations or plan.over_budget:
        sys.exit(EXIT_PROBLEMS)


@cli.command("plan")
@click.argument("model")
@_layout_options
@click.option("--scheme", type=PLAN_SCHEMES, default="bf16", show_default=True)
@click.option("--group-size", type=click.IntRange(0), default=None,
              help="Quantization group size (w4a16; default as cvt quantize's for --format).")
@click.option("--format", "fmt", type=FORMATS, default=None,
              help="The output format the weights are written in, as cvt quantize --format (default: "
                   "compressed-tensors, or ascend for a scheme only it has): each quantized linear counts the bytes "
                   "its on-disk tensors take.")
@click.option("--target", type=TARGETS, default=None,
              help="ascend: the serving stack, as cvt quantize --target (vllm-ascend keeps W4A16 and MXFP4 for MoE "
                   "experts only: the other linears count as bf16).")
@click.option("--fp4-format", type=FP4_FORMATS, default=None,
              help="fp4: nvfp4 (default) or mxfp4 (Ascend).")
@click.option("--hbm", type=SIZE, default=None, help="Device memory per rank, e.g. 64GB or 64GiB: ranks above it are flagged.")
@click.option("--kv-tokens", type=click.IntRange(0), default=0, show_default=True, help="Tokens of KV cache in flight (whole world).")
@click.option("--revision", help="Hub revision when MODEL is a repo id.")
@common
def plan_cmd(model, scheme, group_size, fmt, target, fp4_format, hbm, kv_tokens, revision, quiet, **degrees):
    """Per-rank memory plan of an EP/TP layout from config.json alone (MODEL: a checkpoint
    directory, a config.json, or a hub repo id, of which only config.json is fetched): weights by
    role plus KV cache, min/max/mean, the heaviest rank, ranks over --hbm, and every divisibility
    problem of the layout. Exit code 3 when the layout is invalid or a rank does not fit. `cvt
    shard SRC --dry-run` prints the same plan, with the same options (defaulting to SRC's own
    scheme, format and target)."""
    _print_plan(api.PlanOptions(model=model, revision=revision, layout=api.LayoutOptions(**degrees), scheme=scheme,
                                group_size=group_size, fmt=fmt, target=target, fp4_format=fp4_format, hbm=hbm,
                                kv_tokens=kv_tokens))


@cli.command("shard")
@click.argument("src")
@click.argument("dst", type=click.Path(), required=False)
@_layout_options
@click.option("--max-shard-size", type=SIZE, default="5GB", show_default=True, help="Largest file per rank.")
@click.option("--dry-run", is_flag=True, help="Print the per-rank memory plan from config.json alone; write nothing.")
@click.option("--scheme", type=PLAN_SCHEMES, default=None,
              help="--dry-run: weights' scheme (default: SRC's own - its cvt quantize scheme, fp8 or bf16).")
@click.option("--group-size", type=click.IntRange(0), default=None, help="--dry-run: quantization group size.")
@click.option("--format", "fmt", type=FORMATS, default=None,
              help="--dry-run: the format the weights are in, as cvt plan --format (default: SRC's own).")
@click.option("--target", type=TARGETS, default=None,
              help="--dry-run: ascend serving stack, as cvt plan --target (default: SRC's own).")
@click.option("--fp4-format", type=FP4_FORMATS, default=None,
              help="--dry-run: fp4 nvfp4 or mxfp4, as cvt plan --fp4-format (default: SRC's own).")
@click.option("--hbm", type=SIZE, default=None, help="--dry-run: device memory per rank, e.g. 64GB: ranks above it are flagged.")
@click.option("--kv-tokens", type=click.IntRange(0), default=0, show_default=True,
              help="--dry-run: tokens of KV cache in flight (whole world).")
@click.option("--revision", help="Hub revision when SRC is a repo id.")
@click.option("--resume/--no-resume", default=True, show_default=True, help="Keep rank files an interrupted run finished.")
@click.option("--overwrite", is_flag=True, help="Allow a DST that holds other files or another run's output.")
@common
@ranks("the rank files (--world-size is the layout's)", STREAMING_RANKS)
def shard_cmd(src, dst, max_shard_size, dry_run, scheme, group_size, fmt, target, fp4_format, hbm, kv_tokens, revision,
              resume, overwrite, quiet, **degrees):
    """Write SRC as per-rank directories DST/rank-XXXXX/ for an EP/TP layout (one world of
    W ranks: attention tp x dp = W, MoE moe-tp x ep = W), with DST/cvt_manifest.json giving
    every tensor's split and every rank's files (size, checksum) and expert slots. Works on BF16,
    FP8 releases and cvt quantize outputs; every tensor is read once, whatever W. The layout is
    validated before anything is written (heads, experts, vocab, FP8 blocks and quantization
    groups must divide). `torchrun --nproc-per-node W -m cvt.runtime.launch DST` (or
    `cvt run DST --procs W`) runs the result."""
    layout = api.LayoutOptions(**degrees)
    if dry_run:  # scheme, format, target and fp4 format default to SRC's own (`api.plan`)
        _print_plan(api.PlanOptions(model=src, revision=revision, layout=layout, scheme=scheme, group_size=group_size,
                                    fmt=fmt, target=target, fp4_format=fp4_format, hbm=hbm, kv_tokens=kv_tokens))
        return
    if dst is None:
        raise click.UsageError("DST is required (or pass --dry-run)")
    if scheme or group_size is not None or fmt or target or fp4_format or hbm or kv_tokens:
        raise click.UsageError("--scheme, --group-size, --format, --target, --fp4-format, --hbm and --kv-tokens "
                               "belong to --dry-run")
    r = api.shard(api.ShardOptions(src=src, dst=dst, layout=layout, revision=revision, max_shard_size=max_shard_size,
                                   resume=resume, overwrite=overwrite, quiet=quiet))
    if not quiet:
        from cvt.units import plural

        L = r.layout
        click.echo(f"sharded for world {L.world_size} (tp {L.tp} x dp {L.dp}; moe_tp {L.moe_tp} x ep {L.ep}; "
                   f"dense_tp {L.dense_tp}, embed_tp {L.embed_tp}, lmhead_tp {L.lmhead_tp})\n"
                   f"wrote {plural(r.written_files, 'rank file')} ({r.skipped_files} already done) to {r.dst}: read "
                   f"{human(r.bytes_in)}, wrote {human(r.bytes_out)} in {r.seconds:.1f} s "
                   f"({human(r.throughput)}/s){on_processes(r)}")


@cli.command("inspect")
@click.argument("path")
@click.option("--revision", help="Hub revision when PATH is a repo id.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@common
def inspect_cmd(path, revision, as_json, quiet):
    """Describe a checkpoint from its headers alone: architecture, format, layer and expert
    counts, bytes by dtype and by role, and any problems found (exit code 3 if some)."""
    report = api.inspect(path, revision)
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.render())
    if report.problems:
        sys.exit(EXIT_PROBLEMS)


@cli.command("run")
@click.argument("model")
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeat for a batch).")
@click.option("--input-ids", "input_ids", type=options.INPUT_IDS, multiple=True, metavar="IDS",
              help="Comma-separated token ids instead of text (repeatable).")
@click.option("--max-new-tokens", type=click.IntRange(0), default=32, show_default=True)
@click.option("--temperature", type=FiniteFloat(0), default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=FiniteFloat(0, 1, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=click.IntRange(0, 2**64 - 1), default=0, show_default=True, help="Sampling seed, 0 .. 2**64-1.")
@click.option("--device", type=click.Choice(get_args(api.Device)), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(get_args(api.DType)), default="bf16", show_default=True)
@click.option("--verify-files", is_flag=True, help="Check every file's checksum against the manifest before loading.")
@click.option("--revision", help="Hub revision when MODEL is a repo id.")
@click.option(options.PROCS, "procs", type=click.IntRange(1), default=None, metavar="N",
              help="Processes to launch: run a cvt shard output as its N ranks (N = the layout's world size) under "
                   "torchrun on this node (python -m cvt.runtime.launch; gloo on CPU, nccl / hccl for --device "
                   "cuda / npu), which always checks each rank's files' checksums.")
@options.old_procs_option
@click.option("--backend", type=click.Choice(get_args(api.Backend)), default="torch", show_default=True,
              help="onnxruntime: MODEL is a `cvt export onnx` output, run on the CPU (--dtype is the export's).")
@common
def run_cmd(model, prompts, input_ids, max_new_tokens, temperature, top_p, seed, device, dtype, verify_files, revision,
            procs, old_procs, backend, quiet):
    """Generate text with the bundled runtime from any cvt output or HF BF16/FP8 directory.

    Prints each continuation and the prefill / decode speed in tokens/s.
    """
    from cvt.errors import CvtError
    from cvt.runtime.launch import launch_args, sharded_world, torchrun

    world_size = options.deprecated_procs("run", old_procs, procs)
    if backend == "torch" and (world_size is not None and world_size > 1 or sharded_world(model) is not None):
        if revision:
            raise CvtError("--revision applies to hub repo ids; a sharded checkpoint is a local directory")
        argv = launch_args(prompts=prompts, input_ids=input_ids, max_new_tokens=max_new_tokens,
                           temperature=temperature, top_p=top_p, seed=seed, device=device, dtype=dtype, quiet=quiet,
                           debug=click.get_current_context().obj.get("debug", False))
        sys.exit(torchrun(model, world_size, argv))
    if backend == "onnxruntime" and world_size not in (None, 1):
        raise CvtError("--backend onnxruntime runs on one CPU process (--device auto or cpu, no --procs)")
    res = api.run(api.RunOptions(model=model, prompts=prompts, input_ids=input_ids, max_new_tokens=max_new_tokens,
                                 temperature=temperature, top_p=top_p, seed=seed, device=device, dtype=dtype,
                                 verify_files=verify_files, revision=revision, backend=backend, quiet=quiet))
    for note in res.notes:
        click.echo(f"cvt: note: {note}", err=True)
    for prompt, out, text in zip(res.prompt_ids, res.output_ids, res.texts):
        click.echo(text)
        if not quiet:
            click.echo(f"  [{len(prompt)} prompt + {len(out)} new tokens: {out[:16]}{' ...' if len(out) > 16 else ''}]")
    if not quiet:
        click.echo(f"prefill {res.prefill_tokens_per_s:.1f} tokens/s, decode {res.decode_tokens_per_s:.1f} tokens/s "
                   f"({res.device}, {res.dtype}, {res.tokenizer} tokenizer)")


@cli.command("verify")
@click.argument("candidate")
@click.option("--reference", required=True, help="The reference model (usually the BF16 checkpoint).")
@click.option("--data", type=click.Path(exists=True, dir_okay=False), help="Text or .jsonl (a \"text\" field per line); default: a built-in sample.")
@click.option("--report", "report_dir", required=True, type=click.Path(file_okay=False), help="Folder for report.json/.md/.html.")
@click.option("--seq-len", type=click.IntRange(2), default=128, show_default=True)
@click.option("--max-sequences", type=click.IntRange(1), default=8, show_default=True)
@click.option("--min-cosine", type=FiniteFloat(-1, 1), help="Fail when any layer's cosine is below this.")
@click.option("--max-ppl-ratio", type=FiniteFloat(0, min_open=True), help="Fail when PPL(candidate)/PPL(reference) is above this.")
@click.option("--max-mean-kl", type=FiniteFloat(0), help="Fail when the mean KL divergence is above this.")
@click.option("--min-top1", type=FiniteFloat(0, 1), help="Fail when the same-top-1 share is below this.")
@click.option("--device", type=click.Choice(get_args(api.Device)), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(get_args(api.DType)), default="fp32", show_default=True)
@common
def verify_cmd(candidate, reference, data, report_dir, seq_len, max_sequences, min_cosine, max_ppl_ratio, max_mean_kl,
               min_top1, device, dtype, quiet):
    """Compare CANDIDATE against --reference on the same tokens and write an accuracy report:
    per-layer cosine / max abs+rel error / thousandth ratios / EucDist, per-weight SQNR, PPL
    ratio, KL divergence, same top-1. Exits 4 when a threshold is violated."""
    from cvt.runtime.report import verdict_line

    res = api.verify(api.VerifyOptions(candidate=candidate, reference=reference, report_dir=report_dir, data=data,
                                       seq_len=seq_len, max_sequences=max_sequences, min_cosine=min_cosine,
                                       max_ppl_ratio=max_ppl_ratio, max_mean_kl=max_mean_kl, min_top1=min_top1,
                                       device=device, dtype=dtype, quiet=quiet))
    r = res.report
    if not quiet:
        import math

        worst = min(r.layers, key=lambda row: (not math.isnan(row.cosine), row.cosine))  # NaN is the worst
        lg = r.logits
        click.echo(f"layers: min cosine {worst.cosine:.6f} at {worst.name}; first divergent: {r.first_divergent_layer or '-'}")
        click.echo(f"logits: PPL ratio {lg.ppl_ratio:.4f}, mean KL {lg.kl_mean:.3g}, same top-1 {lg.same_top1:.2%}, "
                   f"RMS dp {lg.rms_delta_p:.3%}")
        if r.first_nonfinite_layer:
            side = next((n.side for n in r.nonfinite_layers if n.name == r.first_nonfinite_layer), "?")
            click.echo(f"non-finite values (NaN/Inf): {side} output of {r.first_nonfinite_layer} first")
        click.echo(f"result: {verdict_line(r)}\nreport: {res.paths['html']}")
    for v in r.violations:
        click.echo(f"cvt: threshold violated: {v}", err=True)
    if not r.passed:
        sys.exit(EXIT_THRESHOLD)


@cli.command("demo")
@click.argument("directory", required=False, default="cvt-demo", type=click.Path(file_okay=False))
@common
def demo_cmd(directory, quiet):
    """Run every stage on a tiny built-in DeepSeek-V3-style FP8 checkpoint (in DIRECTORY,
    default ./cvt-demo) and print where the outputs are."""
    from cvt.demo import run_demo

    run_demo(directory, quiet=quiet, echo=click.echo)


# `cvt export onnx|om` (cvt.cli.export imports only click at module level)
cli.add_command(export_group)


def _resumes(argv) -> bool:
    """Whether the verb `argv` names picks up where an interrupted run stopped (it has --resume)."""
    cmd: click.Command = cli
    for word in (argv if argv is not None else sys.argv[1:]):
        if word.startswith("-") or not isinstance(cmd, click.Group):
            break
        cmd = cmd.commands.get(word)
        if cmd is None:
            return False
    return any(p.name == "resume" for p in cmd.params)


def one_line(msg: str) -> str:
    """A message of several lines (a list of layout problems, click's choices) as one line."""
    out = ""
    for line in (ln.strip() for ln in str(msg).splitlines()):
        if line:
            out += ("" if not out else " " if out.endswith((":", ",")) else "; ") + line
    return out


def main(argv=None) -> None:
    """Entry point: run the CLI and turn every failure into one line and an exit code. SIGTERM and
    SIGHUP stop it as Ctrl-C does (`cvt.signals`): cleanup, one line, exit 128 + the signal."""
    from cvt import signals

    with signals.installed():
        _main(argv)


def _main(argv) -> None:
    debug = bool(os.environ.get("CVT_DEBUG")) or "--debug" in (argv if argv is not None else sys.argv[1:])
    from cvt.errors import CvtError

    from cvt.scratch import scratch_dir

    from cvt import signals, world

    if any(k.startswith("CVT_TEST_") for k in os.environ):  # the kill-and-resume tests' faults (cvt.hooks)
        from cvt.testing import faults

        faults.install()
    options.ARGV[:] = list(sys.argv[1:] if argv is None else argv)
    ranked, who = world.launched(), world.rank_label()  # a rank of torchrun: its errors say which
    try:
        with scratch_dir():  # torch's caches and torchrun's logs: removed when the command ends
            cli.main(args=argv, prog_name="cvt", standalone_mode=False)
            world.stop()  # a rank of torchrun leaves its process group (nothing in a world of one)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except getattr(click.exceptions, "NoArgsIsHelpError", ()) as exc:  # bare `cvt` (or `cvt export`): the help
        # (click >= 8.2 raises it; older click prints the help and exits 0 itself)
        click.echo(exc.ctx.get_help())
        sys.exit(0)
    except click.UsageError as exc:  # bad arguments: one line, like every other failure
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        click.echo(f"cvt: error: {one_line(exc.format_message())}{hint}", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        click.echo(f"cvt: error: {one_line(exc.format_message())}", err=True)
        sys.exit(exc.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt, signals.Stopped) as exc:  # Ctrl-C, SIGTERM, SIGHUP
        sig = signals.signum_of(exc.__cause__ if isinstance(exc, click.exceptions.Abort) and exc.__cause__ else exc)
        click.echo(signals.stopped_line(sig) + ("; re-run the same command to resume" if _resumes(argv) else ""),
                   err=True)
        sys.exit(signals.exit_code(sig))
    except world.PeerFailed as exc:  # another rank failed and said why: stop with its code, quietly
        if debug:
            traceback.print_exc()
        sys.exit(exc.exit_code)
    except CvtError as exc:
        if debug:
            traceback.print_exc()
        click.echo(f"cvt: error: {who}{one_line(exc)}", err=True)
        sys.exit(exc.exit_code)
    except OSError as exc:
        if debug:
            traceback.print_exc()
        where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
        click.echo(f"cvt: error: {who}{where}{exc.strerror or exc}", err=True)
        sys.exit(EXIT_ERROR)
    except Exception as exc:  # a bug: say so, in one line unless --debug
        from cvt.extras import extra_of, message

        if isinstance(exc, ModuleNotFoundError) and extra_of(exc.name):  # an optional dependency no `require` checked
            if debug:
                traceback.print_exc()
            click.echo(f"cvt: error: {message(exc.name)}", err=True)
            sys.exit(EXIT_ERROR)
        if type(exc).__name__ == "ValidationError":  # pydantic: input no reader turned into a CvtError
            from cvt.errors import validation_summary

            if debug:
                traceback.print_exc()
            click.echo(f"cvt: error: invalid input: {one_line(validation_summary(exc))}", err=True)
            sys.exit(EXIT_ERROR)
        if ranked and world.peer_left(exc):  # a collective whose peer died: that rank says why, this one stops
            if debug:
                traceback.print_exc()
            sys.exit(EXIT_ERROR)
        if debug:
            traceback.print_exc()
        click.echo(f"cvt: internal error: {who}{type(exc).__name__}: {one_line(exc)} (re-run with --debug for the "
                   "traceback)", err=True)
        sys.exit(EXIT_INTERNAL)


if __name__ == "__main__":  # pragma: no cover
    main()
