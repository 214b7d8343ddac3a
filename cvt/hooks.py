"""The library's two test seams, as replaceable callables: `write(f, data)`, through which every
byte of output passes (`cvt.convert.durable.AtomicFile`), and `after_layer(i)`, called once a
calibrated decoder layer is saved (`cvt.quant.methods.stream`). By default a plain write and a
no-op. The kill-and-resume tests' fault injection (`cvt.testing.faults`) replaces them; the
CLI entry point installs it only when a ``CVT_TEST_*`` variable is set, so the library never
imports test code.
"""

from __future__ import annotations


def plain_write(f, data) -> None:
    f.write(data)


def no_op(i: int) -> None:
    return None


write = plain_write
after_layer = no_op
