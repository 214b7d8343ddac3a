"""The `cvt` command line: a thin layer over the library (`cvt.api`), one call per verb.

main     the `cvt` group, its verbs and the entry point (`main`: every failure as one line)
export   `cvt export onnx|om`
options  what every verb shares: exit codes, --quiet / --debug, number formatting
"""

from cvt.cli.main import cli, main

__all__ = ["cli", "main"]
