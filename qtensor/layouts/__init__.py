"""Quantized weight layouts as data: one entry per on-disk form of a kernel format.

A scheme (`cvt.qtensor.schemes`) produces a `QuantizedTensor` of canonical parts for a runtime
kernel format (``kernel_fmt``: w8a8_dynamic, w8a8_static, w4a16, w4a8_dynamic, nvfp4, mxfp4). A
`Layout` says how those parts sit on disk for one output format and the serving stacks that load it:
the tensors (suffix, dtype, and per dim which logical axis it follows and in what unit), the
Ascend type tag, which modules the stack accepts it for, and the encode / decode between
canonical parts and disk. The formats, the quantize stage, `cvt plan`, `cvt shard` and the
loader all read these entries; adding a layout is one entry in `entries` (or `entries_mx`).

base        DiskTensor, Layout, the LAYOUTS registry, the formats and targets, shared helpers
entries     the W8A8, W4A16, FP4 and W4A8_DYNAMIC entries (Ascend and compressed-tensors)
entries_mx  the Ascend 950 MX entries (W8A8_MXFP8, W4A4_MXFP4, W4A8_MXFP)
entries_flatquant  the Ascend W4A4_FLATQUANT_DYNAMIC and W4A4_MXFP4_FLATQUANT entries (linears; online Kronecker
                   transforms)
selection   kernel_fmt_of, fuses, targets, `select` and `read_layout` over the registry

This package imports the entry modules in that order (the registry's order, which `select`
prefers first) and re-exports the public names: ``from cvt.qtensor.layouts import LAYOUTS``.
No submodule imports the package.

The entries, their tensors and the consumers' code each follows are tabled in docs/formats.md
("Quantized layouts"); `tests/qtensor/test_layouts.py` holds that table to the registry.

Dims: per on-disk dim, ``("n", u)`` / ``("k", u)`` -- that dim runs along the weight's output /
input features, one on-disk element per ``u`` logical elements (``u`` may be ``"G"``, the
group size, per channel k; or ``"K/16"``, a sixteenth of k: W4A8's row ``scale_bias``) -- or
a fixed size (an int), or ``KL`` / ``KR``: a whole dim the size of k's left / right Kronecker
factor (FlatQuant's transforms). `cvt shard` splits a tensor along the dim that follows the module's TP
axis (a tensor without one is whole on every holder, unless its ``k_split`` says it splits in
diagonal blocks along k; ``Layout.max_tp`` / ``splits_k`` say which degrees along k load); `cvt plan` counts bytes and the units a
split must keep whole from the same data. A layout whose ``parallel`` is "column" / "row" holds
only the modules of that role (`scale_bias_role`, from the module name); `select` picks by it.
"""

from __future__ import annotations

from cvt.qtensor.layouts.base import (ASCEND, ASCEND_TARGETS, COMPRESSED_TENSORS, CONFIG_KEY_TARGETS, CT_TARGET, TARGET_SUMMARIES,
                                      DEFAULT_TARGET, FLOATS, FORMAT_TARGETS, K16, LAYOUTS, MINDIE, STACKS,
                                      SCALE_BIAS_COLUMN, SCALE_BIAS_ROW, SCALE_BIAS_RUNS, VLLM_ASCEND, DiskTensor,
                                      G, K, KL, KR, Layout, N, register, scale_bias_role)
from cvt.qtensor.layouts import entries, entries_mx, entries_flatquant  # noqa: F401  (register the entries, in this order)
from cvt.qtensor.layouts.selection import (candidates, check_target, experts_only_reason, fuses, kernel_fmt_of,
                                           linears_only_reason,
                                           kernel_formats, read_layout, select, targets_for)

__all__ = ["ASCEND", "COMPRESSED_TENSORS", "ASCEND_TARGETS", "CONFIG_KEY_TARGETS", "TARGET_SUMMARIES", "DEFAULT_TARGET", "CT_TARGET", "FORMAT_TARGETS", "MINDIE", "STACKS", "VLLM_ASCEND", "DiskTensor", "Layout", "LAYOUTS", "register",
           "select", "candidates", "check_target", "targets_for", "read_layout", "kernel_fmt_of", "kernel_formats", "experts_only_reason",
           "linears_only_reason", "KL", "KR",
           "scale_bias_role", "K16"]
