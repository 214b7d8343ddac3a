"""Fused RTN kernels (`cvt.quant.qkernel`): what they refuse and where they fall back.

Non-finite weights and bad group sizes refused with the reference path's own message; the cases
`supports` declines; the kernel chosen by CVT_QUANT_KERNEL and the torch fallback without the
compiled module; `absmax` (the max |w| pass) against torch, reading only the blocks that can hold
the max; hand-built sources checked before the C kernel reads their pointers. The oracle helpers
and the `kernel` fixture are tests/quant/test_qkernel.py's.
"""

from __future__ import annotations

import pytest
import torch

from cvt.errors import TensorError
from cvt.quant import qkernel as QK
from cvt.qtensor.layouts import LAYOUTS
from cvt.qtensor.schemes import get_scheme
from cvt.tests.quant.test_qkernel import SIMD, as_raw, assert_same, bf16_weight, fp8_weight, reference, run
from cvt.tests.quant.test_qkernel import kernel  # noqa: F401 (a fixture)

# ---- refusals and fallbacks ------------------------------------------------------------------------

def reference_error(src, scheme) -> str:
    w = src.rows_float(0, src.shape[0])
    with pytest.raises(TensorError) as exc:
        scheme.quantize(w, name="m.weight")
    return str(exc.value)


@pytest.mark.parametrize("bad", ["nan", "inf", "fp8-nan-code", "fp8-overflow"])
@pytest.mark.parametrize("layout,scheme,opts", [("ct-int8", "w8a8", {}), ("ct-int4", "w4a16", {"group_size": 32}),
                                                ("ct-nvfp4", "fp4", {}), ("ct-mxfp4", "fp4", {"fp4_format": "mxfp4"})],
                         ids=["w8a8", "w4a16", "nvfp4", "mxfp4"])
def test_non_finite_refused_with_the_reference_message(kernel, bad, layout, scheme, opts):
    if bad.startswith("fp8"):
        src = fp8_weight((200, 256), seed=7)
        codes = src.w.view(torch.uint8).clone()
        scale = src.scale.clone()
        if bad == "fp8-nan-code":
            codes[150, 3] = 0x7F
            codes[7, 200] = 0xFF
        else:  # 448 * 1e36 overflows float32: Inf after dequantization
            codes[130, :5] = 0x7E
            scale[1, 0] = 1e36
        src = QK.WeightSource.fp8(codes.view(torch.float8_e4m3fn), scale, (128, 128))
    else:
        w = torch.randn(200, 256) * 0.1
        w[150, 3] = float(bad)
        w[7, 200] = -float(bad) if bad == "inf" else float(bad)
        src = QK.WeightSource(w.to(torch.bfloat16))
    sch, lo = get_scheme(scheme, **opts), LAYOUTS.get(layout)
    want = reference_error(src, sch)
    with pytest.raises(TensorError) as exc:
        run(kernel, src, sch, lo)
    assert str(exc.value) == want
    assert "m.weight" in want and "float32 [200, 256]" in want


def test_group_size_refused_with_the_reference_message(kernel):
    src = bf16_weight((8, 96))
    sch = get_scheme("w4a16", group_size=64)
    with pytest.raises(Exception) as want:
        sch.quantize(src.rows_float(0, 8), name="m.weight")
    with pytest.raises(type(want.value)) as got:
        run(kernel, src, sch, LAYOUTS.get("ct-int4"))
    assert str(got.value) == str(want.value)


def test_unfused_cases_are_declined():
    """What `supports` declines goes to the reference path (which raises its own errors)."""
    src = bf16_weight((7, 64))
    int32, grouped = LAYOUTS.get("ascend-w4a16-int32"), LAYOUTS.get("ascend-w4a16-int8-grouped")
    assert QK.supports(int32, get_scheme("w4a16", group_size=32), src)
    assert not QK.supports(int32, get_scheme("w4a16", group_size=32, symmetric=False), src)  # no zero points there
    assert not QK.supports(grouped, get_scheme("w4a16", group_size=32), src)  # odd rows: cannot pair
    assert not QK.supports(LAYOUTS.get("ascend-w8a8-static"), get_scheme("w8a8"), src)
    assert not QK.supports(LAYOUTS.get("ct-int8"), get_scheme("w8a8"), QK.WeightSource(src.w.to(torch.float16)))
    assert not QK.supports(LAYOUTS.get("ct-int8"), get_scheme("w4a16"), src)  # layout of another kernel format
    fused = {n for n in LAYOUTS.names() if LAYOUTS.get(n).pack is not None}
    assert fused == {"ascend-w8a8-dynamic", "ct-int8", "ascend-w4a16-int8-grouped", "ascend-w4a16-int8-channel",
                     "ascend-w4a16-int32", "ct-int4", "ct-nvfp4", "ct-mxfp4", "ascend-mxfp4",
                     "ascend-w8a8-mxfp8", "ascend-w4a4-mxfp4", "ascend-w4a8-mxfp"}  # Ascend 950 MX: issue 40


def test_kernel_name_follows_the_environment(monkeypatch):
    QK._c_kernel.cache_clear()
    try:
        monkeypatch.setenv("CVT_QUANT_KERNEL", "torch")
        assert QK.kernel_name() == "torch"
        monkeypatch.setenv("CVT_QUANT_KERNEL", "reference")
        assert QK.kernel_name() == "reference"
        monkeypatch.delenv("CVT_QUANT_KERNEL")
        QK._c_kernel.cache_clear()
        assert QK.kernel_name() in ("c", "torch")
    finally:
        QK._c_kernel.cache_clear()


def test_without_the_compiled_kernel(monkeypatch):
    """No C compiler at install time (the module cannot be imported): the torch fallback runs."""
    import sys

    import cvt.quant

    monkeypatch.setitem(sys.modules, "cvt.quant._qkernel", None)  # import raises ImportError
    monkeypatch.delattr(cvt.quant, "_qkernel", raising=False)
    monkeypatch.delenv("CVT_QUANT_KERNEL", raising=False)
    QK._c_kernel.cache_clear()
    try:
        assert QK.kernel_name() == "torch"
        src = fp8_weight((136, 352), seed=10)
        sch, lo = get_scheme("w4a16", group_size=32, symmetric=False), LAYOUTS.get("ct-int4")
        got = QK.quantize_to_layout(src, sch, lo, name="m.weight")
        assert got.kernel == "torch"
        assert_same(got, reference(src, sch, lo))
        got = QK.quantize_to_layout(as_raw(src), sch, lo, name="m.weight")  # a numpy source: numpy outputs
        assert got.kernel == "torch" and not isinstance(got.tensors["weight_packed"], torch.Tensor)
        assert_same(got, reference(src, sch, lo))
    finally:
        QK._c_kernel.cache_clear()


def test_absmax_matches_torch(kernel):
    src = fp8_weight((136, 352), seed=8)
    want = float(src.rows_float(0, 136).abs().amax())
    assert QK.absmax(as_raw(src) if kernel == "c-numpy" else src, simd=SIMD.get(kernel, True)) == want
    w = src.rows_float(0, 136)
    w[100, 3] = float("nan")
    assert QK.absmax(QK.WeightSource(w.to(torch.bfloat16))) is None


@pytest.mark.parametrize("case", ["bf16", "fp8", "fp8-negative-scales", "fp8-bf16-scales", "fp8-nan-code",
                                  "fp8-nan-code-early", "fp8-max-in-tail", "fp8-nan-code-in-tail", "fp8-overflow",
                                  "bf16-inf", "bf16-nan", "zeros"])
def test_absmax_without_decoding_every_element(kernel, case):
    """The C kernel takes max |w| from each block's largest magnitude code (e4m3 and bf16
    magnitudes order like their bits; bf16(x * s) is monotonic in x): the same float as the
    decoded weight's ``abs().amax()``. Where the decoded weight holds NaN/Inf: None, or (an FP8
    NaN code in a block whose scale cannot hold the max, so not read) the max of the finite
    values; the quantize pass then refuses the weight as the reference does."""
    g = torch.Generator().manual_seed(11)
    if case.startswith("bf16") or case == "zeros":
        w = (torch.randn(72, 200, generator=g) * 3).to(torch.bfloat16)
        w[5, 7] = -40.0  # the max is negative
        if case == "bf16-inf":
            w[70, 199] = float("-inf")
        elif case == "bf16-nan":
            w[0, 0] = float("nan")
        elif case == "zeros":
            w.zero_()
            w[3, :] = -0.0
        src = QK.WeightSource(w)
    else:
        # k 350: blocks of 128, 128 and 94 (the SIMD byte max's 128- and 32-byte steps and a scalar tail)
        k = 350 if case in ("fp8-max-in-tail", "fp8-nan-code-in-tail") else 352
        src = fp8_weight((136, k), seed=12, scale_dtype="BF16" if case == "fp8-bf16-scales" else "F32")
        codes, scale = src.w.view(torch.uint8).clone(), src.scale.clone()
        if case == "fp8-negative-scales":
            scale[0, 1] = -scale[0, 1] * 50
        elif case == "fp8-nan-code":
            codes[135, 351] = 0xFF
        elif case == "fp8-nan-code-early":
            codes[3, 77] = 0x7F  # inside a 128-byte step: the sign-cleared max is the NaN code
        elif case == "fp8-max-in-tail":
            codes[:, 256:] &= 0x3F  # small magnitudes ...
            codes[:, :256] &= 0x3F
            codes[64, 349] = 0xF5  # ... and the weight's max |w| (a negative code) in the last block's scalar tail
            scale[:] = 1.0
        elif case == "fp8-nan-code-in-tail":
            codes[10, 348] = 0xFF  # in the 94-wide last block's bytes past its 32-byte steps
        elif case == "fp8-overflow":
            codes[7, 300] = 0x7E  # 448
            scale[0, 2] = 3e38  # 448 x 3e38 is Inf in float32
        src = QK.WeightSource(codes.view(torch.float8_e4m3fn), scale, (128, 128))
    dec = src.rows_float(0, src.shape[0])
    want = None if not bool(torch.isfinite(dec).all()) else float(dec.abs().amax())
    got = QK.absmax(as_raw(src) if kernel == "c-numpy" else src, simd=SIMD.get(kernel, True))
    if want is None and got is not None:
        assert src.is_fp8 and case != "fp8-overflow"
        assert got == float(dec[torch.isfinite(dec)].abs().amax())
        sch, lo = (get_scheme("fp4"), "ct-nvfp4") if src.shape[1] % 16 == 0 else (get_scheme("w8a8"), "ct-int8")
        with pytest.raises(TensorError, match=r"holds 1 non-finite value\(s\)"):
            run(kernel, src, sch, LAYOUTS.get(lo))
    else:
        assert got == want
    assert (want is None) == (case in ("fp8-nan-code", "fp8-nan-code-early", "fp8-nan-code-in-tail", "fp8-overflow",
                                       "bf16-inf", "bf16-nan"))
    if case == "fp8-max-in-tail":
        assert want == abs(float(dec[64, 349]))


@pytest.mark.parametrize("tracks", [True, False], ids=["scales-track-codes", "scales-do-not"])
def test_absmax_reads_only_the_blocks_that_can_hold_the_max(kernel, tracks):
    """FP8 block scales chosen as each block's amax / 448 (DeepSeek's): the C kernel reads the
    blocks in decreasing order of their bound bf16(448 |s|) and stops where no unread block can
    hold more -- here after block (0, 0), so a NaN code in any other block is not seen (the
    quantize pass refuses it). When the scales do not track the codes it reads on (all of it,
    past 16 blocks), and finds the NaN code. The max is exact either way."""
    g = torch.Generator().manual_seed(21)
    codes = (torch.randint(0, 0x7E, (5 * 128, 5 * 128), generator=g, dtype=torch.uint8) & 0x6F)
    for r in range(5):
        for c in range(5):  # every block's largest magnitude code: 448 (0x7E), as amax / 448 scales make it
            codes[r * 128 + (r + c) % 128, c * 128 + 3] = 0x7E | (0x80 if (r + c) % 2 else 0)
    scale = torch.rand(5, 5, generator=g) * 0.5 + 0.25
    scale[0, 0] = 1.0  # the largest bound: its block holds the max
    if not tracks:  # small codes, the max in the block of the smallest scale: no bound prunes the rest
        scale = torch.rand(5, 5, generator=g) * 0.1 + 0.9
        scale[4, 4] = 0.8
        codes[:, :] &= 0x3F
        codes[4 * 128 + 5, 4 * 128 + 5] = 0x7E
    codes[300, 400] = 0xFF  # a NaN code in block (2, 3)
    src = QK.WeightSource(codes.view(torch.float8_e4m3fn), scale, (128, 128))
    dec = src.rows_float(0, src.shape[0])
    finite = float(dec[torch.isfinite(dec)].abs().amax())
    got = QK.absmax(src if kernel != "c-numpy" else as_raw(src), simd=SIMD.get(kernel, True))
    if kernel == "torch":  # the fallback decodes every row
        assert got is None
    elif tracks:
        assert got == finite == 448.0
    else:
        assert got is None
    with pytest.raises(TensorError, match=r"holds 1 non-finite value\(s\)"):
        run(kernel, src, get_scheme("fp4"), LAYOUTS.get("ct-nvfp4"))
    codes[300, 400] = 0x01  # without the NaN code: the decoded weight's max
    src = QK.WeightSource(codes.view(torch.float8_e4m3fn), scale, (128, 128))
    got = QK.absmax(src if kernel != "c-numpy" else as_raw(src), simd=SIMD.get(kernel, True))
    assert got == finite == float(src.rows_float(0, src.shape[0]).abs().amax())


def test_torch_fallback_works_in_row_blocks(monkeypatch):
    """Small blocks of rows (several per FP8 block row would be wrong: blocks are whole FP8 rows)."""
    QK._c_kernel.cache_clear()
    monkeypatch.setenv("CVT_QUANT_KERNEL", "torch")
    monkeypatch.setattr(QK, "ROWS_PER_BLOCK", 1)
    try:
        for src in (bf16_weight((37, 64), seed=9), fp8_weight((300, 64), seed=9, block=(64, 32))):
            assert [b for b in QK._row_blocks(src)][0] == (0, 8 if not src.is_fp8 else 64)
            for layout, scheme, opts in [("ct-int4", "w4a16", {"group_size": 16, "symmetric": False}),
                                         ("ascend-w4a16-int8-channel", "w4a16", {"group_size": 0}),
                                         ("ct-nvfp4", "fp4", {})]:
                sch, lo = get_scheme(scheme, **opts), LAYOUTS.get(layout)
                got = QK.quantize_to_layout(src, sch, lo, name="m.weight")
                assert got.kernel == "torch"
                assert_same(got, reference(src, sch, lo))
    finally:
        QK._c_kernel.cache_clear()


@pytest.mark.skipif(QK.kernel_name() != "c", reason="the C kernel is not built here")
def test_hand_built_sources_are_checked_before_the_c_kernel_reads_them():
    """The kernel reads raw pointers: a source not built by `WeightSource.fp8` / `raw` (a FP8 weight
    without its scale, a bf16 or short scale, a float32 weight, a dtype field claiming wider
    elements than the array holds) is refused instead of read out of bounds."""
    import numpy as np

    w = torch.randn(256, 256).to(torch.float8_e4m3fn)
    good = torch.ones(2, 2)
    bytes_ = np.zeros((64, 64), dtype=np.uint8)
    for src in (QK.WeightSource(w), QK.WeightSource(w, good.bfloat16(), (128, 128)),
                QK.WeightSource(w, torch.ones(1, 2), (128, 128)), QK.WeightSource(torch.randn(8, 8)),
                QK.WeightSource(bytes_, dtype="BF16"), QK.WeightSource(w.view(torch.uint8), dtype="BF16"),
                QK.WeightSource(bytes_.view(np.uint16)[:, :32].copy(), good.numpy(), (128, 128), "F8_E4M3")):
        with pytest.raises(ValueError, match="cvt quantize kernel"):
            QK.absmax(src)
    assert QK.absmax(QK.WeightSource(w, good, (128, 128))) is not None
    assert QK.absmax(QK.WeightSource.raw(bytes_, "F8_E4M3", (64, 64), np.ones((1, 1), np.float32), (128, 128))) == 0
