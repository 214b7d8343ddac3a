"""The `cvt` command line: a thin layer over the library (`cvt.api`), one call per verb.

main     the `cvt` group, its verbs and the entry point (`main`: every failure as one line)
export   `cvt export onnx|om`
options  what every verb shares: exit codes, --quiet / --debug, number formatting
"""

import os

# numpy's bundled OpenBLAS starts its threads when numpy is imported and spins them for ~0.1 s
# (0.13 CPU-seconds of every run on 2 cores, measured); cvt calls no numpy BLAS, so they may
# sleep at once (the variable's minimum: 2**4 cycles of spinning). A BLAS that torch uses only
# wakes its threads a little later after a call; an explicit setting is kept.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from cvt.cli.main import cli, main  # noqa: E402

__all__ = ["cli", "main"]
