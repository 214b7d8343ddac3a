"""The `cvt` command line: a thin layer over the library (`cvt.api`), one call per verb.

main     the `cvt` group, its verbs and the entry point (`main`: every failure as one line)
export   `cvt export onnx|om`
options  what every verb shares: exit codes, --quiet / --debug, number formatting
"""

import os
import platform

# numpy's bundled OpenBLAS starts its threads when numpy is imported and spins them for ~0.1 s
# (0.13 CPU-seconds of every run on 2 cores, measured); cvt calls no numpy BLAS, so they may
# sleep at once (the variable's minimum: 2**4 cycles of spinning). Only on x86-64, where torch's
# BLAS is MKL and the variable reaches numpy's alone: torch's aarch64 wheels use OpenBLAS, whose
# threads between calibration's matmuls it would put to sleep (not measured). An explicit
# setting is kept.
if platform.machine().lower() in ("x86_64", "amd64"):
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from cvt.cli.main import cli, main  # noqa: E402

__all__ = ["cli", "main"]
