"""The fused kernel's fp4 codes without a division (quant/_qkernel.c fp4_kind; e2m1_idx16, fp48
and e2m1_idx4 in its _qkernel_avx512.h, _avx2.h and _neon.h parts): every SIMD level against the
reference (`scheme.quantize` + `layout.encode`, cvt.qtensor.schemes.fp4 `Fp4Scheme.quantize`,
whose E2M1 rounding is cvt.qtensor.primitives `encode_e2m1`) on quotients placed at and 1-2
bf16 ulps beside every E2M1 threshold, after scaling by nvfp4 multipliers that are not powers of
two (so that a quotient taken as w * (1 / mult) lands on the wrong side of a threshold unless the
kernel divides those vectors: the test shows such inputs are present), and on mxfp4's extreme
scales (E8M0 0, 1, 253). Group counts that leave groups to the scalar parameter loop after the
16-group SIMD one. And the SIMD packers (int4 / fp4 nibbles, compressed-tensors int32 words) with
their scalar tails."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cvt.quant import qkernel as QK
from cvt.qtensor import primitives as P
from cvt.qtensor.layouts import LAYOUTS
from cvt.qtensor.schemes import get_scheme
from cvt.tests.quant.test_qkernel import assert_same, reference

THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # encode_e2m1's
ULPS = (-2, -1, 0, 1, 2)
LEVELS = (0, 1, True)  # scalar, AVX2 (NEON on aarch64), the best (AVX-512 where the CPU has it)


@pytest.fixture(autouse=True)
def c_kernel():
    QK._c_kernel.cache_clear()
    if QK._c_kernel() is None:
        pytest.skip("C quantize kernel not built (no C compiler at install time)")


def near_thresholds(mult: torch.Tensor, group: int, seed: int) -> torch.Tensor:
    """float32 [n, ng, group]: element 0 left for the group's amax, the others +-T * mult moved
    by -2..2 bf16 ulps, cycling over every threshold T and offset."""
    n, ng = mult.shape
    g = torch.Generator().manual_seed(seed)
    combos = torch.tensor([(t, u) for t in THRESHOLDS for u in ULPS], dtype=torch.float64)
    pick = torch.arange(n * ng * (group - 1)) % len(combos)
    pick = pick[torch.randperm(len(pick), generator=g)]
    t, u = combos[pick, 0].float(), combos[pick, 1].to(torch.int16)
    v = (t.reshape(n, ng, group - 1) * mult[:, :, None]).to(torch.bfloat16)
    v = (v.view(torch.int16) + u.reshape(n, ng, group - 1)).view(torch.bfloat16).float()
    v[~torch.isfinite(v)] = 0.0  # beyond float32 (5 * 2**126), or a NaN pattern next to +-0 or Inf
    sign = torch.where(torch.rand(v.shape, generator=g) < 0.5, -1.0, 1.0)
    out = torch.zeros(n, ng, group)
    out[:, :, 1:] = v * sign
    return out


def fast_path_codes_differ(w: torch.Tensor, mult: torch.Tensor, group: int) -> int:
    """How many elements get another E2M1 code from the float32 w * (1 / mult) than from w / mult:
    the inputs on which a kernel multiplying without the fallback division would be wrong."""
    wg = w.float().reshape(*mult.shape, group).numpy()
    m = mult.numpy()[:, :, None]
    with np.errstate(all="ignore"):
        exact = np.clip(wg / m, -6, 6)
        fast = np.clip(wg * (np.float32(1.0) / m), -6, 6)
    return int((P.encode_e2m1(torch.from_numpy(exact)) != P.encode_e2m1(torch.from_numpy(fast))).sum())


def nvfp4_case(gs: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 weight [8, 19 * 16] and the reference's nvfp4 multipliers [8, 19] for global scale
    `gs`: group scales of every e4m3 mantissa (s = amax / 6 * gs over 2**-3..2**8), 19 groups a
    row (16 for the SIMD parameter loop, 3 left), the other elements near_thresholds; with a
    power-of-two gs (times 3), the multipliers have few bits, so T * mult is a bf16 value and
    w / mult is exactly T."""
    n, ng, group = 8, 19, 16
    g = torch.Generator().manual_seed(int(gs * 1000) % 9973)
    s = torch.exp2(torch.rand(n, ng, generator=g) * 11 - 3)
    amax = (s * 6 / gs).to(torch.bfloat16).float()
    w = torch.zeros(n, ng, group)
    w[:, :, 0] = amax
    gst = torch.tensor([gs], dtype=torch.float32)
    mult = P.nvfp4_block_scales(w.reshape(n, -1), gst).float() / gst  # the reference's multipliers
    w = near_thresholds(mult, group, seed=3)
    w[:, :, 0] = amax
    w[0, 1, 5], w[1, 2, 3] = -0.0, 2.0**-133  # -0.0, the smallest bf16 subnormal
    w = w.reshape(n, -1).to(torch.bfloat16)
    assert torch.isfinite(w.float()).all()
    return w, P.nvfp4_block_scales(w.float(), gst).float() / gst


@pytest.mark.parametrize("gs", [2.0**10, 3 * 2.0**9, 5 * 2.0**12, 1234.5678, 0.37, 7 * 2.0**-20, 1e-30, 3e38])
def test_nvfp4_quotients_at_and_beside_every_threshold(gs):
    w, mult = nvfp4_case(gs)
    src = QK.WeightSource(w)
    sch, lo = get_scheme("fp4"), LAYOUTS.get("ct-nvfp4")
    want = reference(src, sch, lo, global_scale=torch.tensor([gs], dtype=torch.float32))
    for level in LEVELS:
        assert_same(QK.quantize_to_layout(src, sch, lo, name="m.weight", global_scale=gs, simd=level, threads=2),
                    want)
    if gs in (2.0**10, 3 * 2.0**9):
        assert fast_path_codes_differ(w, mult, 16) > 0  # the fallback division is what gets these right


def mxfp4_case() -> torch.Tensor:
    """A bf16 weight [6, 19 * 32]: E8M0 scales 0 (the multiplier 2**-127, itself subnormal), 1, 2,
    127, 252 and 253 (the largest a finite weight gets; 1 / mult = 2**-126) among others, 16 + 3
    groups a row, quotients at and beside every threshold, bf16 subnormal inputs, -0.0 and
    all-zero groups."""
    n, group = 6, 32
    es = torch.tensor([0, 1, 2, 127, 252, 253, 0, 1, 60, 200, 3, 250, 126, 128, 0, 253, 90, 30, 5])
    mult = P.e8m0_to_f32(es.to(torch.uint8)).repeat(n, 1)
    w = near_thresholds(mult, group, seed=5)
    w[:, :, 0] = torch.where(es == 253, torch.tensor(1.75 * 2.0**127), 6 * mult[0])  # scale e: mxfp4_scale_codes
    w[0, 2] = 0.0                 # an all-zero group (scale 0)
    w[1, 3, 1:] = -0.0
    w[2, 0, 1:8] = torch.tensor([2.0**-133, -(2.0**-133), 2.0**-130, 3 * 2.0**-132, -(2.0**-127), 2.0**-128, 0.0])
    return w.reshape(n, -1).to(torch.bfloat16)


@pytest.mark.parametrize("layout", ["ct-mxfp4", "ascend-mxfp4"])
def test_mxfp4_extreme_scales(layout):
    src = QK.WeightSource(mxfp4_case())
    sch, lo = get_scheme("fp4", fp4_format="mxfp4"), LAYOUTS.get(layout)
    want = reference(src, sch, lo)
    codes = want[0][next(x for x in want[0] if "scale" in x)].view(torch.uint8)
    assert {0, 1, 253} <= set(codes.reshape(-1).tolist())  # the extremes are the scales used
    for level in LEVELS:
        assert_same(QK.quantize_to_layout(src, sch, lo, name="m.weight", simd=level, threads=2), want)


PACKED = [("ct-int4", "w4a16", {"group_size": 0}), ("ct-int4", "w4a16", {"group_size": 0, "symmetric": False}),
          ("ascend-w4a16-int8-channel", "w4a16", {"group_size": 0}),
          ("ascend-w4a16-int8-grouped", "w4a16", {"group_size": 2}), ("ct-mxfp4", "fp4", {"fp4_format": "mxfp4"})]


@pytest.mark.parametrize("k", [32, 67, 130, 202, 352, 416])
@pytest.mark.parametrize("layout,scheme,opts", PACKED, ids=[f"{c[0]}-{len(c[2])}" for c in PACKED])
def test_packers_at_every_level_and_tail(layout, scheme, opts, k):
    """The SIMD packers (quant/_qkernel_avx2.h / _neon.h pack_nib_*: 32 / 16 bytes a step;
    pack_rows_*) and their scalar tails: compressed-tensors int32 words with k not a multiple of 8 (odd k: a half-filled
    byte and zero nibbles), nibbles along k and in row pairs with k not a multiple of 64, against
    the reference's packers (cvt.qtensor.primitives via `layout.encode`)."""
    if (layout != "ct-int4" and k % 2) or (scheme == "fp4" and k % 32):
        pytest.skip("k this layout does not take")
    w = torch.randn(6, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    src = QK.WeightSource(w)
    sch, lo = get_scheme(scheme, **opts), LAYOUTS.get(layout)
    want = reference(src, sch, lo)
    for level in LEVELS:
        assert_same(QK.quantize_to_layout(src, sch, lo, name="m.weight", simd=level, threads=2), want)
