"""What every CLI verb shares: exit codes, --quiet / --debug, number formatting. Below both
command modules (`cvt.cli.main`, `cvt.cli.export`); imports only click."""

from __future__ import annotations

import functools
import logging
import math

import click

from cvt.errors import CvtError
from cvt.units import binary_size, parse_size

EXIT_ERROR = 1
EXIT_PROBLEMS = 3
EXIT_THRESHOLD = 4
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130


def common(fn):
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
        try:
            return fn(*args, quiet=quiet, **kwargs)
        except KeyboardInterrupt as exc:  # past click as one exception (`signals.Stopped`): one line, no blank
            from cvt import signals

            raise signals.Stopped(signals.signum_of(exc)) from None

    return wrapper


def on_processes(result) -> str:
    """What a summary says after its timing when several ranks wrote the output together: ' on 2 processes'."""
    n = getattr(result, "processes", 1)
    return f" on {n} processes" if n > 1 else ""


def human(n: float) -> str:
    """Bytes in a summary line: '3.2 MiB'."""
    return binary_size(n, digits=1)


class NamesChoice(click.Choice):
    """`click.Choice` over names that live in a registry, read when click first needs them (to
    validate or to render `--help`): `cvt --help` and verbs that take no such option import no
    registry. `names` returns the names; `extra` come first (plan's stored forms, bf16 / fp8)."""

    def __init__(self, names, extra: tuple[str, ...] = ()):
        self._names, self._extra, self._cached = names, tuple(extra), None
        self.case_sensitive = True

    @property
    def choices(self) -> tuple[str, ...]:
        if self._cached is None:
            self._cached = (*self._extra, *self._names())
        return self._cached

    @choices.setter
    def choices(self, value) -> None:  # click.Choice.__init__ would set it; we never call it
        self._cached = tuple(value)


def scheme_names() -> list[str]:
    from cvt.qtensor.schemes import scheme_names as names

    return names()


def format_names() -> list[str]:
    from cvt.qtensor.formats import format_names as names

    return names()


def method_names() -> tuple[str, ...]:
    from cvt.quant.recipe import METHODS

    return METHODS


def ascend_targets() -> tuple[str, ...]:
    from cvt.qtensor.layouts import ASCEND_TARGETS

    return ASCEND_TARGETS


def fp4_formats() -> list[str]:
    from cvt.qtensor.schemes.fp4 import GROUPS

    return list(GROUPS)


SCHEMES = NamesChoice(scheme_names)
FORMATS = NamesChoice(format_names)
METHODS = NamesChoice(method_names)
TARGETS = NamesChoice(ascend_targets)
FP4_FORMATS = NamesChoice(fp4_formats)
PLAN_SCHEMES = NamesChoice(scheme_names, extra=("bf16", "fp8"))


# Numbers in options: every size option parses through SIZE, every float option through
# FiniteFloat; a bad value is a usage error (exit 2) naming the option, so no NaN, infinity or
# 0-byte size reaches the library.
class SizeType(click.ParamType):
    """A click option holding a size (`parse_size`): refused as a usage error naming the option."""

    name = "size"

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return parse_size(value)
        except CvtError as exc:
            self.fail(str(exc), param, ctx)


SIZE = SizeType()


class FiniteFloat(click.FloatRange):
    """click.FloatRange that also refuses NaN and infinities (a range check lets NaN through:
    every comparison with it is false)."""

    name = "finite float"

    def convert(self, value, param, ctx):
        rv = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(rv, param, ctx)


class Checked(click.ParamType):
    """A text option whose value a library function judges (``module:function``, returning None or
    the problem in words), imported only when the option is given so `--help` stays instant: a bad
    value is a usage error (exit 2) naming the option, not a failure deep in the verb."""

    def __init__(self, name: str, problem: str):
        self.name, self._problem = name, problem

    def convert(self, value, param, ctx):
        import importlib

        module, fn = self._problem.split(":")
        why = getattr(importlib.import_module(module), fn)(value)
        if why is not None:
            self.fail(why, param, ctx)
        return value


# an Ascend SoC name atc knows ('Ascend' + npu-smi's Name, of a known chip series): a typo names valid ones
SOC_VERSION = Checked("soc", "cvt.export.atc:soc_problem")
# `cvt run --input-ids 1,2,3`: comma-separated token ids, at least one, none negative; kept as the
# text the ranks are given
INPUT_IDS = Checked("ids", "cvt.runtime.tokenizer:input_ids_problem")


# the command line `main` was given: what `ranks` re-runs on each rank
ARGV: list[str] = []

PROCS = "--procs"        # processes to launch: one word in every verb that launches them
OLD_PROCS = "--world-size"  # its old spelling in quantize / fp8-to-bf16 / run (deprecated for one release)


def deprecated_procs(verb: str, old: int | None, procs: int | None) -> int | None:
    """The process count of a verb whose `--world-size` once meant processes: `--procs`, or the
    old spelling with one warning line on stderr (said once: by the launching process, or by rank
    0 under the user's own torchrun)."""
    from cvt import world

    if old is None:
        return procs
    if procs is not None and procs != old:
        raise click.UsageError(f"{PROCS} {procs} and {OLD_PROCS} {old} disagree (give {PROCS} alone)")
    if world.first_rank():
        click.echo(f"cvt: warning: {OLD_PROCS} is deprecated for {verb}; use {PROCS}", err=True)
    return old


def old_procs_option(fn):
    """The hidden deprecated `--world-size` of a verb that now says `--procs` (`deprecated_procs`)."""
    return click.option(OLD_PROCS, "old_procs", type=click.IntRange(1), default=None, hidden=True,
                        help=f"Deprecated spelling of {PROCS} (removed in the next release).")(fn)


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """`argv` less each of `flags` and its value (``--flag N`` or ``--flag=N``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in flags)):
            out.append(a)
    return out


def ranks(what: str, note: str, old_spelling: bool = False):
    """`--procs N` on a streaming or calibrating verb: run the same command as N ranks of torchrun
    on this node (`cvt.launcher.launch`), which split `what` (`note`: how they talk, and what the
    bytes are); under a torchrun the user started (several nodes) the flag may be left out, and
    must match WORLD_SIZE if given. Ranks other than 0 print no summary. `old_spelling`: the verb
    also takes the deprecated `--world-size N` for it (`deprecated_procs`)."""

    def deco(fn):
        @click.option(PROCS, "procs", type=click.IntRange(1), default=None, metavar="N",
                      help=f"Processes to launch: run as N ranks of torchrun on this node that split {what}; "
                           f"{note} Under your own torchrun (several nodes: DST on a shared filesystem) leave it out.")
        @functools.wraps(fn)
        def wrapper(*args, procs: int | None, quiet: bool, old_procs: int | None = None, **kwargs):
            import os
            import sys

            from cvt import launcher, world

            ctx = click.get_current_context()
            procs = deprecated_procs(ctx.info_name, old_procs, procs)
            if world.launched():  # a rank of torchrun (ours or the user's)
                if os.environ.get(world.WORLD_ENV):  # started by `ranks` below: never outlive its torchrun
                    launcher.die_with_parent()()
                w = world.expect(procs)
                return fn(*args, quiet=quiet or not w.main, **kwargs)
            if procs is None or procs == 1:
                return fn(*args, quiet=quiet, **kwargs)
            argv = _without(ARGV, (PROCS, OLD_PROCS) if old_spelling else (PROCS,))
            debug = ctx.obj.get("debug", False)
            sys.exit(launcher.launch("cvt", argv, procs, debug=debug, env_extra={world.WORLD_ENV: str(procs)},
                                     hint="; re-run the same command to resume"))

        return old_procs_option(wrapper) if old_spelling else wrapper

    return deco
