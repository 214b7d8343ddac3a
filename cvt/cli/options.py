"""What every CLI verb shares: exit codes, --quiet / --debug, number formatting. Below both
command modules (`cvt.cli.main`, `cvt.cli.export`); imports only click."""

from __future__ import annotations

import functools
import logging
import math

import click

from cvt.errors import CvtError
from cvt.units import parse_size

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
        return fn(*args, quiet=quiet, **kwargs)

    return wrapper


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


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


# the command line `main` was given: what `ranks` re-runs on each rank
ARGV: list[str] = []


def ranks(flag: str = "--world-size", what: str = "its output files"):
    """`flag N` on a streaming or calibrating verb: run the same command as N ranks of torchrun
    on this node (`cvt.world.launch`), which split `what`; under a torchrun the user started
    (several nodes) the flag may be left out, and must match WORLD_SIZE if given. Ranks other
    than 0 print no summary."""

    def deco(fn):
        @click.option(flag, "ranks", type=click.IntRange(1), default=None,
                      help=f"Run as N processes (torchrun on this node, gloo / nccl / hccl by --device) that split "
                           f"{what}; same bytes as one process. Under your own torchrun (several nodes: DST on a "
                           f"shared filesystem) leave it out.")
        @functools.wraps(fn)
        def wrapper(*args, ranks: int | None, quiet: bool, **kwargs):
            import os
            import sys

            from cvt import world

            if os.environ.get("WORLD_SIZE", "1") != "1":  # a rank of torchrun (ours or the user's)
                if os.environ.get(world.WORLD_ENV):  # started by `ranks` below: never outlive its torchrun
                    world.die_with_parent()()
                w = world.current()
                if ranks is not None and ranks != w.size:
                    raise CvtError(f"{flag} {ranks}, but torchrun started {w.size} ranks (WORLD_SIZE)")
                return fn(*args, quiet=quiet or not w.main, **kwargs)
            if ranks is None or ranks == 1:
                return fn(*args, quiet=quiet, **kwargs)
            argv, skip = [], False
            for a in ARGV:
                if skip:
                    skip = False
                elif a == flag:
                    skip = True
                elif not a.startswith(flag + "="):
                    argv.append(a)
            debug = click.get_current_context().obj.get("debug", False)
            sys.exit(world.launch("cvt", argv, ranks, debug=debug, env_extra={world.WORLD_ENV: str(ranks)}))

        return wrapper

    return deco
