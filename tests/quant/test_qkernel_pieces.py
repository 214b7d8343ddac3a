"""`cvt.quant.qkernel.quantize_in_pieces`: the packed weight made row block by row block (what the
quantize stage streams to disk, `Quantizer.pieces`), against the unfused reference
(tests/quant/test_qkernel.py's `reference`: `scheme.quantize` + `layout.encode`), on every fused
layout, FP8 (partial blocks) and BF16 sources, pieces of one row block and of the whole weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cvt.errors import TensorError
from cvt.quant import qkernel as QK
from cvt.qtensor.layouts import LAYOUTS
from cvt.qtensor.schemes import get_scheme
from cvt.tests.quant.test_qkernel import as_raw, assert_same, bf16_weight, fp8_weight, reference
from cvt.tests.quant.test_qkernel_simd import CASES as SIMD_CASES
from cvt.tests.quant.test_qkernel_simd import c_kernel  # noqa: F401 (the autouse fixture: skip without the C kernel)

CASES = [*SIMD_CASES, ("ascend-w4a16-int8-channel", "w4a16", {"group_size": 0})]


def _run(gen):
    pieces = []
    while True:
        try:
            pieces.append(next(gen))
        except StopIteration as stop:
            return pieces, stop.value


@pytest.mark.parametrize("piece_bytes", [1, 1 << 30], ids=["row-blocks", "whole"])
@pytest.mark.parametrize("source", ["fp8", "bf16"])
@pytest.mark.parametrize("layout,scheme,opts", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_pieces_are_the_reference(layout, scheme, opts, source, piece_bytes):
    src = as_raw(fp8_weight((300, 256), seed=4) if source == "fp8" else bf16_weight((90, 256), seed=4))
    sch, lo = get_scheme(scheme, **opts), LAYOUTS.get(layout)
    pieces, res = _run(QK.quantize_in_pieces(src, sch, lo, name="m.weight", piece_bytes=piece_bytes))
    unit = 128 if source == "fp8" else 2
    assert len(pieces) == (-(-src.shape[0] // unit) if piece_bytes == 1 else 1)
    packed = [s for s, t in res.tensors.items() if t is None]
    assert packed == [lo.tensors[0].suffix]  # the first tensor on disk is the one made in pieces
    tensors = {s: (np.concatenate(pieces) if t is None else t) for s, t in res.tensors.items()}
    assert_same(QK.Fused(QK._as_torch(tensors, lo), res.sqnr_db, "c"), reference(src, sch, lo))


def test_non_finite_refused_with_the_whole_weights_count():
    """A NaN code in the last row block: the reference's message, counting the whole weight."""
    src = fp8_weight((300, 256), seed=4)
    w = src.w.view(torch.uint8).clone()
    w[260, 7] = w[290, 9] = 0x7F
    w[10, 3] = 0xFF
    src = as_raw(QK.WeightSource.fp8(w.view(torch.float8_e4m3fn), src.scale, src.block))
    gen = QK.quantize_in_pieces(src, get_scheme("w8a8"), LAYOUTS.get("ct-int8"), name="m.weight", piece_bytes=1)
    with pytest.raises(TensorError, match=r"holds 3 non-finite value\(s\)"):
        _run(gen)
