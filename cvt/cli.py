"""The `cvt` command line: a thin layer over the library (one function call per verb).

Every verb takes `--quiet` (no progress bar or summary) and `--debug` (tracebacks and debug
logging). Failures print one line, `cvt: error: ...`, and exit non-zero; nothing is
imported before a verb runs, so `cvt --help` is instant.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import traceback

import click

from cvt import __version__

log = logging.getLogger("cvt")

EXIT_ERROR = 1
EXIT_PROBLEMS = 3
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130


def _common(fn):
    """--quiet and --debug on every verb."""

    @click.option("--quiet", "-q", is_flag=True, help="No progress bar and no summary.")
    @click.option("--debug", is_flag=True, envvar="CVT_DEBUG", help="Show tracebacks and debug logging.")
    @functools.wraps(fn)
    def wrapper(*args, quiet: bool, debug: bool, **kwargs):
        ctx = click.get_current_context()
        ctx.ensure_object(dict)["debug"] = debug
        logging.basicConfig(
            level=logging.DEBUG if debug else (logging.WARNING if quiet else logging.INFO),
            format="%(levelname)s %(name)s: %(message)s" if debug else "%(message)s",
        )
        return fn(*args, quiet=quiet, **kwargs)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="cvt")
def cli() -> None:
    """cvt: convert released LLM checkpoints (DeepSeek-V3/R1/V3.1, Kimi-K2, Qwen3, Qwen3-MoE)
    for Ascend NPUs and any torch machine.

    SRC may be a local directory or a Hugging Face hub repo id (owner/name; HF_HUB_OFFLINE=1
    uses only the local cache). Every output directory carries cvt_manifest.json.
    """


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


@cli.command("fp8-to-bf16")
@click.argument("src")
@click.argument("dst", type=click.Path())
@click.option("--revision", help="Hub revision (branch, tag or commit) when SRC is a repo id.")
@click.option("--workers", type=click.IntRange(1, 64), default=None,
              help="Output files written in parallel (default: 2, or 1 on a 1-core machine). Peak memory grows with it.")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest output file, e.g. 5GB, 500MB, 2GiB.")
@click.option("--resume/--no-resume", default=True, show_default=True,
              help="Keep output files an interrupted run of the same conversion finished (size and sha256 checked).")
@click.option("--overwrite", is_flag=True, help="Allow a DST that holds other files or another run's output.")
@_common
def fp8_to_bf16_cmd(src, dst, revision, workers, max_shard_size, resume, overwrite, quiet):
    """Dequantize an FP8 block-scaled release (DeepSeek-V3/R1, Kimi-K2, Qwen3-FP8) to BF16.

    Bit-exact with the official math: bf16 = RNE(float32(w) * float32(scale)) per 128x128
    block (partial edge blocks included). Non-FP8 tensors are copied byte for byte, scales
    are dropped, config.json loses quantization_config. Streams one tensor at a time;
    re-running after a crash resumes.
    """
    from cvt.convert.fp8_to_bf16 import fp8_to_bf16
    from cvt.convert.writer import parse_size

    r = fp8_to_bf16(src, dst, revision=revision, workers=workers, max_shard_size=parse_size(max_shard_size),
                    resume=resume, overwrite=overwrite, quiet=quiet)
    if not quiet:
        x = r.extra
        click.echo(
            f"dequantized {x['dequantized']} FP8 tensors, passed {x['passed_through']} through, dropped {x['scales_dropped']} scales\n"
            f"wrote {r.written_files} weight files ({r.skipped_files} already done) to {r.dst}\n"
            f"read {_human(r.bytes_in)}, wrote {_human(r.bytes_out)} in {r.seconds:.1f} s ({_human(r.throughput)}/s)"
        )


@cli.command("inspect")
@click.argument("path")
@click.option("--revision", help="Hub revision when PATH is a repo id.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_common
def inspect_cmd(path, revision, as_json, quiet):
    """Describe a checkpoint from its headers alone: architecture, format, layer and expert
    counts, bytes by dtype and by role, and any problems found (exit code 3 if some)."""
    from cvt.convert.inspect import inspect_checkpoint

    report = inspect_checkpoint(path, revision)
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.render())
    if report.problems:
        sys.exit(EXIT_PROBLEMS)


@cli.command("demo")
@click.argument("directory", required=False, default="cvt-demo", type=click.Path(file_okay=False))
@_common
def demo_cmd(directory, quiet):
    """Run every stage on a tiny built-in DeepSeek-V3-style FP8 checkpoint (in DIRECTORY,
    default ./cvt-demo) and print where the outputs are."""
    from cvt.demo import run_demo

    run_demo(directory, quiet=quiet, echo=click.echo)


def main(argv=None) -> None:
    """Entry point: run the CLI and turn every failure into one line and an exit code."""
    debug = bool(os.environ.get("CVT_DEBUG")) or "--debug" in (argv if argv is not None else sys.argv[1:])
    from cvt.errors import CvtError

    try:
        cli.main(args=argv, prog_name="cvt", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.UsageError as exc:  # bad arguments: one line, like every other failure
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        click.echo(f"cvt: error: {exc.format_message()}{hint}", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        click.echo(f"cvt: error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("cvt: aborted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except KeyboardInterrupt:
        click.echo("\ncvt: interrupted; re-run the same command to resume", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except CvtError as exc:
        if debug:
            traceback.print_exc()
        click.echo(f"cvt: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except OSError as exc:
        if debug:
            traceback.print_exc()
        where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
        click.echo(f"cvt: error: {where}{exc.strerror or exc}", err=True)
        sys.exit(EXIT_ERROR)
    except Exception as exc:  # a bug: say so, in one line unless --debug
        if debug:
            traceback.print_exc()
        click.echo(f"cvt: internal error: {type(exc).__name__}: {exc} (re-run with --debug for the traceback)", err=True)
        sys.exit(EXIT_INTERNAL)


if __name__ == "__main__":  # pragma: no cover
    main()
