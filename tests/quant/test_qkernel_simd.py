"""The fused C quantize kernel at every SIMD level (scalar, AVX2, AVX-512 where the CPU has it) on
hand-built FP8 edge cases, against the unfused reference (`scheme.quantize` + `layout.encode`,
cvt.qtensor's schemes and layouts): NaN codes refused with the reference's message, all-zero
groups and blocks, subnormal float32 block scales, -0.0, and group sizes that fill 16 lanes, 8
lanes or neither. (tests/quant/test_qkernel.py sweeps shapes, group sizes and layouts.)"""

from __future__ import annotations

import math

import pytest
import torch

from cvt.extras import simd_level
from cvt.errors import CvtError, TensorError
from cvt.quant import qkernel as QK
from cvt.qtensor.layouts import LAYOUTS
from cvt.qtensor.schemes import get_scheme
from cvt.tests.quant.test_qkernel import assert_same, reference

NAN_MSG = r"weight 'm\.weight' \(float32 \[256, 512\]\) holds 1 non-finite value\(s\) \(NaN/Inf\)"
LEVELS = {"scalar": 0, "avx2": 1, "best": True}
CASES = [("ascend-w8a8-dynamic", "w8a8", {}), ("ct-int8", "w8a8", {}),
         ("ascend-w4a16-int8-grouped", "w4a16", {"group_size": 128}),
         ("ascend-w4a16-int8-grouped", "w4a16", {"group_size": 32, "symmetric": False}),
         ("ascend-w4a16-int32", "w4a16", {"group_size": 128}), ("ct-int4", "w4a16", {"group_size": 64}),
         ("ct-int4", "w4a16", {"group_size": 8, "symmetric": False}), ("ct-nvfp4", "fp4", {}),
         ("ct-mxfp4", "fp4", {"fp4_format": "mxfp4"}), ("ascend-mxfp4", "fp4", {"fp4_format": "mxfp4"})]


@pytest.fixture(autouse=True)
def c_kernel():
    QK._c_kernel.cache_clear()
    if QK._c_kernel() is None:
        pytest.skip("C quantize kernel not built (no C compiler at install time)")


def edge_fp8(n=256, k=512, block=(128, 128)) -> QK.WeightSource:
    """FP8 codes with: an all-zero 128x128 block, an all-(-0.0) row, a row of the largest finite
    codes, a row of the smallest subnormal codes; float32 block scales that are subnormal
    (1e-39, the smallest 1.4e-45), zero, and ordinary."""
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x41  # no NaN codes here
    codes[:128, 128:256] = 0x00       # an all-zero block
    codes[3] = 0x80                    # -0.0 everywhere in a row
    codes[5, ::2], codes[5, 1::2] = 0x7E, 0xFE  # +-448
    codes[6] = 0x01                    # the smallest e4m3 subnormal
    s = torch.rand(n // block[0], k // block[1], generator=g) * 0.01 + 1e-4
    s[0, 2] = 1e-39                    # float32 subnormal block scales
    s[1, 0] = 1.4e-45
    s[1, 3] = 0.0
    return QK.WeightSource.fp8(codes.view(torch.float8_e4m3fn), s, block)


@pytest.mark.parametrize("level", list(LEVELS))
@pytest.mark.parametrize("layout,scheme,opts", CASES, ids=[f"{c[0]}-{c[2].get('group_size', '')}" for c in CASES])
def test_fp8_edge_cases_match_the_reference(level, layout, scheme, opts):
    src = edge_fp8()
    sch, lo = get_scheme(scheme, **opts), LAYOUTS.get(layout)
    assert_same(QK.quantize_to_layout(src, sch, lo, name="m.weight", simd=LEVELS[level], threads=2),
                reference(src, sch, lo))


@pytest.mark.parametrize("level", list(LEVELS))
@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_nan_code_refused_at_every_level(level, code):
    """One NaN code (either sign) in the middle of a SIMD-sized run: the reference's refusal."""
    src = edge_fp8()
    w = src.w.view(torch.uint8).clone()
    w[200, 301] = code
    src = QK.WeightSource.fp8(w.view(torch.float8_e4m3fn), src.scale, src.block)
    sch = get_scheme("w4a16", group_size=128)
    with pytest.raises(TensorError, match=NAN_MSG):
        QK.quantize_to_layout(src, sch, LAYOUTS.get("ascend-w4a16-int8-grouped"), name="m.weight",
                              simd=LEVELS[level])
    with pytest.raises(TensorError, match=NAN_MSG):  # what the reference itself says
        sch.quantize(src.rows_float(0, src.shape[0]), name="m.weight")


@pytest.mark.parametrize("level", list(LEVELS))
@pytest.mark.parametrize("where", [[(1, 10)], [(0, 2), (1, 10)], [(0, 2), (1, 10), (3, 11)]],
                         ids=["tail", "vector-and-tail", "vector-and-two-tails"])
def test_nan_codes_in_block_tails_are_counted_at_every_level(level, where):
    """k = 12: each row is 8 SIMD lanes and a 4-element scalar tail. Every NaN code counts once,
    wherever it sits (the AVX2 tail once subtracted its +1, so a NaN in one row's lanes and one in
    another row's tail cancelled and the weight was quantized)."""
    codes = torch.full((4, 12), 0x38, dtype=torch.uint8)  # 1.0
    for r, c in where:
        codes[r, c] = 0x7F
    src = QK.WeightSource.fp8(codes.view(torch.float8_e4m3fn), torch.ones(1, 1), (128, 128))
    msg = rf"weight 'm\.weight' \(float32 \[4, 12\]\) holds {len(where)} non-finite value\(s\) \(NaN/Inf\)"
    for layout, scheme, opts in (("ct-int8", "w8a8", {}), ("ct-int4", "w4a16", {"group_size": 4})):
        with pytest.raises(TensorError, match=msg):
            QK.quantize_to_layout(src, get_scheme(scheme, **opts), LAYOUTS.get(layout), name="m.weight",
                                  simd=LEVELS[level], threads=1)


def test_the_levels_are_what_they_say(monkeypatch):
    """`simd` and CVT_KERNEL_SIMD choose the loops: AVX-512 is used where the CPU has it."""
    import os

    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    best = "avx512" if "avx512f" in flags and "avx2" in flags else ("avx2" if "avx2" in flags else None)
    if best is not None:
        assert QK.simd_in_use() == best
    assert QK.simd_in_use(False) == "scalar"
    monkeypatch.setenv("CVT_KERNEL_SIMD", "scalar")
    assert QK.simd_in_use() == "scalar" and simd_level() == 0
    monkeypatch.setenv("CVT_KERNEL_SIMD", "avx3")
    with pytest.raises(CvtError, match="CVT_KERNEL_SIMD=avx3: expected one of scalar, avx2, avx512"):
        simd_level()


def test_sqnr_sums_agree_across_levels():
    """Only the SQNR's sums change between levels: their order, and the SIMD row loops' float32
    spans (SQ_SPAN in _qkernel.c: at most ~2e-6 relative on each sum, ~2e-5 dB; 5e-8 dB here):
    within 1e-4 dB."""
    src = edge_fp8(k=1024)
    sch, lo = get_scheme("fp4"), LAYOUTS.get("ct-nvfp4")
    got = [QK.quantize_to_layout(src, sch, lo, simd=v, threads=1).sqnr_db for v in LEVELS.values()]
    assert all(math.isfinite(x) and abs(x - got[0]) < 1e-4 for x in got), got


@pytest.mark.parametrize("level", list(LEVELS))
@pytest.mark.parametrize("layout,scheme,opts", [("ct-int8", "w8a8", {}),
                                                ("ct-int4", "w4a16", {"group_size": 32, "symmetric": False})],
                         ids=["w8a8", "w4a16-asym"])
def test_quotients_on_and_beside_every_rounding_boundary(level, layout, scheme, opts):
    """BF16 values at (j + 0.5) x the row's scale and the bf16 neighbours either side, for every j
    of the range, in rows of several scales: every level's quotient must give the reference's
    rint(w / scale) on each (a multiply-first shortcut, as the AVX-512 loop once had, would not)."""
    rows = []
    for r, amax in enumerate([127.0, 1.0, 3.0e-3, 7.7e4, 0.37, 1e-20, 5.5, 2.0**-120]):
        sc = float(torch.tensor(amax / 127.0).to(torch.bfloat16).float())
        mids = torch.tensor([(j + 0.5) * sc for j in range(-128, 128)]).to(torch.bfloat16)
        bits = mids.view(torch.int16)
        row = torch.cat([mids, (bits + 1).view(torch.bfloat16), (bits - 1).view(torch.bfloat16)])[:512].float()
        row[0] = amax  # the row's scale: amax / 127 as above
        rows.append(row)
    src = QK.WeightSource(torch.stack(rows).to(torch.bfloat16))
    sch, lo = get_scheme(scheme, **opts), LAYOUTS.get(layout)
    assert_same(QK.quantize_to_layout(src, sch, lo, name="m.weight", simd=LEVELS[level], threads=2),
                reference(src, sch, lo))
