"""Fused RTN kernels (`cvt.quant.qkernel`): the same bytes as the torch reference path.

The oracle is the reference itself: ``w = float32(source)`` (FP8 dequantized to BF16 first),
``layout.encode(scheme.quantize(w))`` and ``sqnr_db(w, scheme.dequantize(q))``. Every fused
layout, every source dtype (BF16; FP8 with float32 / bfloat16 / E8M0 block scales), awkward
shapes (edge blocks, odd rows, k not a multiple of 8), every group size of k, three
implementations (C with AVX2, C scalar, the blockwise torch fallback). The SQNR is a float sum
in another order: compared to 0.01 dB.

This file holds the oracle helpers (`reference`, `assert_same`, the `kernel` fixture, imported by
the other test_qkernel_* files) and the bit-identical sweeps; refusals and fallbacks are in
test_qkernel_refusals.py, the quantize stage on the kernels in test_qkernel_stage.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from cvt.quant import qkernel as QK
from cvt.qtensor.layouts import LAYOUTS
from cvt.qtensor.schemes import get_scheme
from cvt.runtime.metrics import sqnr_db

SQNR_TOL_DB = 0.01


# ---- helpers ---------------------------------------------------------------------------------------

@pytest.fixture(params=["c-simd", "c-avx2", "c-scalar", "c-numpy", "torch"])
def kernel(request, monkeypatch):
    """Which implementation runs: the C kernel (its best SIMD: AVX-512 where the CPU has it;
    AVX2 at most; scalar loops; "c-numpy": on a numpy source, as the stage gives it, with numpy
    outputs) or the torch fallback."""
    QK._c_kernel.cache_clear()
    if request.param == "torch":
        monkeypatch.setenv("CVT_QUANT_KERNEL", "torch")
    elif QK._c_kernel() is None:
        pytest.skip("C quantize kernel not built (no C compiler at install time)")
    yield request.param
    QK._c_kernel.cache_clear()


SIMD = {"c-scalar": 0, "c-avx2": 1}  # the kernel fixture's `simd` argument (else True: the best)


def run(kind: str, src, scheme, layout, **kw) -> QK.Fused:
    if kind == "c-numpy":
        src = as_raw(src)
    return QK.quantize_to_layout(src, scheme, layout, name="m.weight", simd=SIMD.get(kind, True), threads=3, **kw)


def as_raw(src: QK.WeightSource) -> QK.WeightSource:
    """The same weight as a numpy source over its bytes (`WeightSource.raw`, the stage's form)."""
    if src.is_fp8:
        return QK.WeightSource.raw(src.w.view(torch.uint8).numpy(), "F8_E4M3", src.shape, src.scale.numpy(),
                                   src.block)
    return QK.WeightSource.raw(src.w.view(torch.int16).numpy(), "BF16", src.shape)


def reference(src: QK.WeightSource, scheme, layout, global_scale=None):
    w = src.rows_float(0, src.shape[0])
    q = scheme.quantize(w, name="m.weight", **({"global_scale": global_scale} if global_scale is not None else {}))
    return layout.encode(q), sqnr_db(w, scheme.dequantize(q))


def same_bytes(a, b: torch.Tensor) -> bool:
    if not isinstance(a, torch.Tensor):  # numpy: the bits in an array of the same item size
        assert a.dtype.itemsize == b.element_size() and (a.dtype.kind == "u" or a.dtype.name == str(b.dtype)[6:])
        a = torch.from_numpy(a.view("int16") if a.dtype.name == "uint16" else a).view(b.dtype)
    return (a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def assert_same(got: QK.Fused, want: tuple[dict, float]) -> None:
    tensors, sq = want
    assert list(got.tensors) == list(tensors)
    for suffix, t in tensors.items():
        assert same_bytes(got.tensors[suffix], t), suffix
    if math.isinf(sq):
        assert got.sqnr_db == sq
    else:
        assert abs(got.sqnr_db - sq) < SQNR_TOL_DB, (got.sqnr_db, sq)


def bf16_weight(shape, seed=0, scale=0.05) -> QK.WeightSource:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * scale
    w[0, : min(16, shape[1])] = 0.0  # an all-zero group
    if shape[0] > 1:
        w[1, 0] = -0.0
        w[1, 1 : min(40, shape[1])] *= 1e-30  # tiny values: bf16 subnormal scales
    return QK.WeightSource(w.to(torch.bfloat16))


def fp8_weight(shape, seed=0, scale_dtype="F32", block=(128, 128)) -> QK.WeightSource:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    codes[0, : min(32, shape[1])] = 0x80  # -0.0: an all-(-0) group
    sshape = (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    s = torch.rand(sshape, generator=g) * 0.02 + 1e-4
    if scale_dtype == "BF16":
        s = s.to(torch.bfloat16)
    elif scale_dtype == "F8_E8M0":
        s = torch.randint(110, 125, sshape, generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return QK.WeightSource.fp8(codes.view(torch.float8_e4m3fn), s, block)


SOURCES = {"bf16": bf16_weight, "fp8": fp8_weight}

# (layout, scheme, options); w4a16 group sizes come from the shape (every divisor of k below)
INT8 = [("ascend-w8a8-dynamic", "w8a8", {}), ("ct-int8", "w8a8", {})]
INT4 = [("ascend-w4a16-int8-grouped", True), ("ascend-w4a16-int8-grouped", False),
        ("ascend-w4a16-int32", True), ("ct-int4", True), ("ct-int4", False)]
INT4_CHANNEL = [("ascend-w4a16-int8-channel", True), ("ascend-w4a16-int8-channel", False),
                ("ct-int4", True), ("ct-int4", False)]
FP4 = [("ct-nvfp4", {}), ("ct-mxfp4", {"fp4_format": "mxfp4"}), ("ascend-mxfp4", {"fp4_format": "mxfp4"})]
# Ascend 950's MX schemes (msModelSlim's rules, `cvt.qtensor.mx`): E4M3 / E2M1 elements, E8M0 per 32
MX = [("ascend-w8a8-mxfp8", "mxfp8"), ("ascend-w4a4-mxfp4", "w4a4_mxfp4"), ("ascend-w4a8-mxfp", "w4a8_mxfp")]
# 80x256; 136x352: partial FP8 blocks along both dims (like V3's 576x7168 kv_a_proj), groups such
# as 11, 22, 44 and 88 that do not fill SIMD registers
SHAPES = [(80, 256), (136, 352)]


def divisors(k: int) -> list[int]:
    return [d for d in range(1, k + 1) if k % d == 0]


# ---- bit-identical to the reference ----------------------------------------------------------------

@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("layout,scheme,opts", INT8, ids=[c[0] for c in INT8])
def test_int8_per_channel(kernel, source, shape, layout, scheme, opts):
    src = SOURCES[source](shape)
    sch, lo = get_scheme(scheme, **opts), LAYOUTS.get(layout)
    assert_same(run(kernel, src, sch, lo), reference(src, sch, lo))


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("shape", [SHAPES[0], pytest.param(SHAPES[1], marks=pytest.mark.slow)],  # 352: 11 groups
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("layout,sym", INT4, ids=[f"{a}-{'sym' if s else 'asym'}" for a, s in INT4])
def test_int4_every_group_size(kernel, source, shape, layout, sym):
    """Every group size cvt accepts for this k (any divisor; k itself is per channel)."""
    src = SOURCES[source](shape)
    lo = LAYOUTS.get(layout)
    for g in divisors(shape[1]):
        if g == shape[1]:
            continue  # per channel: the channel layouts' test
        sch = get_scheme("w4a16", group_size=g, symmetric=sym)
        got = run(kernel, src, sch, lo)
        try:
            assert_same(got, reference(src, sch, lo))
        except AssertionError as exc:
            raise AssertionError(f"group size {g}: {exc}") from None


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("shape", SHAPES + [(7, 100), (6, 200)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("layout,sym", INT4_CHANNEL, ids=[f"{a}-{'sym' if s else 'asym'}" for a, s in INT4_CHANNEL])
def test_int4_per_channel(kernel, source, shape, layout, sym):
    """Group 0 and group k (the same thing); k = 100 / 200: c-t int32 words padded with zero nibbles."""
    src = SOURCES[source](shape)
    lo = LAYOUTS.get(layout)
    for g in (0, shape[1]):
        sch = get_scheme("w4a16", group_size=g, symmetric=sym)
        assert_same(run(kernel, src, sch, lo), reference(src, sch, lo))


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("shape", SHAPES + [(3, 32)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("layout,opts", FP4, ids=[c[0] for c in FP4])
def test_fp4(kernel, source, shape, layout, opts):
    src = SOURCES[source](shape)
    sch, lo = get_scheme("fp4", **opts), LAYOUTS.get(layout)
    assert_same(run(kernel, src, sch, lo), reference(src, sch, lo))


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("shape", SHAPES + [(3, 32)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("layout,scheme", MX, ids=[c[0] for c in MX])
def test_mx(kernel, source, shape, layout, scheme):
    src = SOURCES[source](shape)
    sch, lo = get_scheme(scheme), LAYOUTS.get(layout)
    assert_same(run(kernel, src, sch, lo), reference(src, sch, lo))


def test_mx_elements_near_powers_of_two(kernel):
    """Where torch's floor(log2(x)) and the exponent bits can differ (x just under a power of two)
    and at the rounding ties of both grids, across block scales from 2**-60 to 2**60."""
    g = torch.Generator().manual_seed(5)
    base = torch.tensor([1.0, 1.9999, 2.0, 3.9999, 4.0, 5.0, 5.9999, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 0.0,
                         -0.0, 448.0, 15.9999, 0.015625, 0.0078, 240.0, 239.9999, 1.0625, 1.1875])
    w = base.repeat(4, 64)[:, :1024].clone() * torch.sign(torch.randn(4, 1024, generator=g))
    w = torch.cat([w * 2.0 ** e for e in (-60, -20, -3, 0, 3, 20, 60)])
    src = QK.WeightSource(w.to(torch.bfloat16))
    for layout, scheme in MX:
        sch, lo = get_scheme(scheme), LAYOUTS.get(layout)
        assert_same(run(kernel, src, sch, lo), reference(src, sch, lo))


def test_mx_every_bf16_value(kernel):
    """Every finite bfloat16 value as an MX element, bit for bit with the reference: sorted by
    magnitude (blocks of like values: every shared exponent down to E8M0's -127, whose multiplier
    and its reciprocal are subnormal) and shuffled (blocks spanning the whole range: elements that
    underflow once divided, subnormal and zero elements under a large block max). The AVX2 MX rows
    take the element clamp on |v| first and build codes from the exponent field (_qkernel_avx2.h),
    so blocks whose elements lie between the largest element and the next power of two (448..512
    for E4M3, 6..7 for E2M1 under its rounded-up shared exponent) come last."""
    b = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    v = b.view(torch.bfloat16).float()
    v = v[torch.isfinite(v)]
    v = v[torch.argsort(v.abs(), stable=True)]
    g = torch.Generator().manual_seed(9)
    top = torch.tensor([448.0, 460.0, 480.0, 496.0, 504.0, 6.0, 6.5, 6.75, 6.9, 7.0]).repeat_interleave(32)
    top = top * torch.where(torch.rand(top.shape, generator=g) < 0.5, -1.0, 1.0)
    rows = torch.cat([v, v[torch.randperm(v.numel(), generator=g)], top])
    rows = rows[: rows.numel() // 256 * 256].view(-1, 256)
    src = QK.WeightSource(rows.to(torch.bfloat16))
    for layout, scheme in MX:
        sch, lo = get_scheme(scheme), LAYOUTS.get(layout)
        assert_same(run(kernel, src, sch, lo), reference(src, sch, lo))


@pytest.mark.parametrize("se", [-128, -127, -119, -118, -117, -116, -108, -107, -106, -105, 15, 16, 17, 18, 60],
                         ids=lambda s: f"se{s}")
def test_mx_shared_exponents_at_the_fast_paths_edges(kernel, se):
    """The AVX2 MX rows skip v = w / 2**se where that is exact and every power of two they use is a
    normal float (shared exponents -117..16 for E4M3, -106..16 for E2M1; _qkernel_avx2.h mx8x_el),
    else they divide as the scalar does. One weight per shared exponent (its error sums are then
    not drowned by larger blocks'): blocks whose max sets se for E4M3 (2**(se + 8)) or for E2M1
    (2**(se + 2)), the rest of each block small (the subnormal grid of the elements, where w_hat
    uses the smallest power of two) and the smallest bfloat16 values (+-2**-133: once divided by
    2**17 and more, v rounds to zero and loses w's sign). At the low edges the error squares
    underflow in float32 whatever w_hat is, so there only the codes and scales tell."""
    g = torch.Generator().manual_seed(11 + se)
    tiny = torch.tensor([2.0 ** -133, -(2.0 ** -133), 2.0 ** -132, -(2.0 ** -132)]).repeat(16, 1)
    for top, schemes in ((se + 8, MX[:1]), (se + 2, MX[1:])):
        small = torch.rand(16, 27, generator=g) * 2.0 ** (se - 6) * torch.where(torch.rand(16, 27, generator=g) < 0.5, -1.0, 1.0)
        w = torch.cat([torch.full((16, 1), 2.0 ** min(top, 127)), small, tiny], 1).reshape(2, 256)
        src = QK.WeightSource(w.to(torch.bfloat16))
        for layout, scheme in schemes:
            sch, lo = get_scheme(scheme), LAYOUTS.get(layout)
            assert_same(run(kernel, src, sch, lo), reference(src, sch, lo))


def test_nvfp4_shared_global_scale(kernel):
    """A fused group's scale (`FP4.shared_scale`), given from outside, is used as given."""
    src = bf16_weight((80, 256), seed=4)
    sch, lo = get_scheme("fp4"), LAYOUTS.get("ct-nvfp4")
    gs = sch.shared_scale([src.rows_float(0, 80), torch.full((2, 2), 3.0)])
    assert_same(run(kernel, src, sch, lo, global_scale=gs), reference(src, sch, lo, gs))


@pytest.mark.parametrize("scale_dtype", ["BF16", "F8_E8M0"])
@pytest.mark.parametrize("layout,scheme,opts", [("ct-int8", "w8a8", {}), ("ct-int4", "w4a16", {"symmetric": False}),
                                                ("ct-nvfp4", "fp4", {})], ids=["w8a8", "w4a16-asym", "nvfp4"])
def test_fp8_scale_dtypes_and_blocks(kernel, scale_dtype, layout, scheme, opts):
    sch, lo = get_scheme(scheme, **opts), LAYOUTS.get(layout)
    for block in ((128, 128), (64, 32), (1, 128)):
        src = fp8_weight((150, 256), seed=2, scale_dtype=scale_dtype, block=block)
        assert_same(run(kernel, src, sch, lo), reference(src, sch, lo))


@pytest.mark.slow
@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("layout,scheme,opts", [
    ("ascend-w8a8-dynamic", "w8a8", {}), ("ct-int4", "w4a16", {"group_size": 128}),
    ("ct-int4", "w4a16", {"group_size": 128, "symmetric": False}), ("ascend-w4a16-int8-grouped", "w4a16", {"group_size": 64}),
    ("ct-nvfp4", "fp4", {}), ("ct-mxfp4", "fp4", {"fp4_format": "mxfp4"})],
    ids=["w8a8", "w4a16-g128", "w4a16-g128-asym", "ascend-w4a16-g64", "nvfp4", "mxfp4"])
def test_v3_kv_a_proj_shape(kernel, source, layout, scheme, opts):
    """576 x 7168, DeepSeek-V3's kv_a_proj_with_mqa: 4.5 FP8 blocks of rows."""
    if kernel in ("c-scalar", "c-numpy"):
        pytest.skip("the SIMD and torch runs cover this shape")
    src = SOURCES[source]((576, 7168), seed=5)
    sch, lo = get_scheme(scheme, **opts), LAYOUTS.get(layout)
    assert_same(run(kernel, src, sch, lo), reference(src, sch, lo))


@pytest.mark.parametrize("layout,scheme,opts", [("ct-int8", "w8a8", {}), ("ct-int4", "w4a16", {"symmetric": False}),
                                                ("ct-nvfp4", "fp4", {}), ("ct-mxfp4", "fp4", {"fp4_format": "mxfp4"}),
                                                ("ascend-w8a8-mxfp8", "mxfp8", {}),
                                                ("ascend-w4a4-mxfp4", "w4a4_mxfp4", {})],
                         ids=["w8a8", "w4a16-asym", "nvfp4", "mxfp4", "mx-mxfp8", "mx-w4a4"])
def test_extreme_values(kernel, layout, scheme, opts):
    """bf16's largest and smallest magnitudes: saturating scales, subnormal scales and results,
    float32 squares that overflow (the SQNR is then summed in float64, as the reference does)."""
    w = torch.zeros(16, 128)
    w[0] = 3.0e38
    w[1, ::2] = -3.3e38
    w[2] = torch.linspace(-1e-38, 1e-38, 128)
    w[3] = 9.2e-41  # bf16 subnormal
    w[4, 7] = 1.0
    w[5] = torch.linspace(-7.0, 7.0, 128)
    w[6:] = torch.randn(10, 128, generator=torch.Generator().manual_seed(3)) * 1e19
    src = QK.WeightSource(w.to(torch.bfloat16))
    sch, lo = get_scheme(scheme, **opts), LAYOUTS.get(layout)
    assert_same(run(kernel, src, sch, lo), reference(src, sch, lo))


@pytest.mark.parametrize("layout,scheme,opts", [("ct-int8", "w8a8", {}), ("ct-int4", "w4a16", {"group_size": 32}),
                                                ("ct-nvfp4", "fp4", {})], ids=["w8a8", "w4a16", "nvfp4"])
def test_float32_sums_that_overflow(kernel, layout, scheme, opts):
    """Squares that are finite in float32 (|w| ~1.5e19, w^2 ~2e38) but whose float32 sums are not:
    the SIMD row loops add squares in float32 over 256-element spans, so a span's sum overflows
    and the weight's sums are redone in float64, as the reference's float32 dot product
    overflows and is redone. The SQNR stays finite and agrees with the reference."""
    w = torch.linspace(1.2e19, 1.8e19, 8 * 512).reshape(8, 512)
    w[1::2] *= -1.0
    w[:, 1::3] *= 0.75
    src = QK.WeightSource(w.to(torch.bfloat16))
    sch, lo = get_scheme(scheme, **opts), LAYOUTS.get(layout)
    got, want = run(kernel, src, sch, lo), reference(src, sch, lo)
    assert math.isfinite(want[1]) and math.isfinite(got.sqnr_db)
    assert_same(got, want)


def test_fp8_scales_beyond_the_simd_rescale(kernel):
    """Block scales >= 2**100 (finite results up to ~6e35): the C kernel's exact power-of-two
    FP8 rescale would overflow, so it runs its scalar loops; float32 squares overflow too."""
    src = fp8_weight((130, 256), seed=11)
    scale = src.scale.clone()
    scale[1, 1] = 2.0**110
    src = QK.WeightSource.fp8(src.w, scale, (128, 128))
    for layout, scheme, opts in [("ct-int8", "w8a8", {}), ("ct-int4", "w4a16", {"group_size": 32, "symmetric": False}),
                                 ("ct-nvfp4", "fp4", {})]:
        sch, lo = get_scheme(scheme, **opts), LAYOUTS.get(layout)
        assert_same(run(kernel, src, sch, lo), reference(src, sch, lo))


def test_e2m1_and_e4m3_rounding_ties(kernel):
    """Values on every E2M1 threshold (ties to the even code), both signs, and -0.0."""
    ties = torch.tensor([0.0, -0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 0.5, 1.0, 1.5, 3.0, 4.0])
    w = torch.cat([ties, -ties, ties * 2, ties / 2]).reshape(2, 32)
    src = QK.WeightSource(w.to(torch.bfloat16))
    for layout, opts in FP4:
        sch, lo = get_scheme("fp4", **opts), LAYOUTS.get(layout)
        assert_same(run(kernel, src, sch, lo), reference(src, sch, lo))


def test_int_rounding_half_even(kernel):
    """w / scale landing exactly on .5: torch.round's half-to-even, not half away from zero."""
    w = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5]]).repeat(2, 1)
    src = QK.WeightSource(w.to(torch.bfloat16))
    sch, lo = get_scheme("w8a8"), LAYOUTS.get("ct-int8")
    got = run(kernel, src, sch, lo)
    assert got.tensors["weight"][0].tolist() == [127, 0, 2, 2, 0, -2, -2, 126]
    assert_same(got, reference(src, sch, lo))


def test_thread_counts_give_identical_bits():
    if QK._c_kernel() is None:
        pytest.skip("C quantize kernel not built")
    src = fp8_weight((300, 256), seed=6)
    for layout, scheme, opts in [("ascend-w4a16-int8-grouped", "w4a16", {"group_size": 32}),
                                 ("ct-int8", "w8a8", {}), ("ct-nvfp4", "fp4", {})]:
        sch, lo = get_scheme(scheme, **opts), LAYOUTS.get(layout)
        outs = [QK.quantize_to_layout(src, sch, lo, threads=t) for t in (1, 2, 3, 7, 64)]
        for o in outs[1:]:
            assert all(same_bytes(o.tensors[x], outs[0].tensors[x]) for x in o.tensors)
            assert abs(o.sqnr_db - outs[0].sqnr_db) < 1e-9


@pytest.mark.parametrize("elem", ["e4m3", "e2m1"])
def test_mx_exponent_table_is_the_reference(elem):
    """The MX modes' shared-exponent table (numpy, so RTN imports no torch) equals the reference's
    `shared_exponent` on every bfloat16 value a block max can take."""
    from cvt.qtensor import mx as MX

    amax = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    se = MX.shared_exponent(amax, elem)
    ok = torch.isfinite(se) & (se >= -127) & (se <= 127) & (amax >= 0)
    want = torch.where(ok, se, 0x7FFF).to(torch.int16)
    assert torch.equal(torch.from_numpy(MX.exponent_table(elem)), want)
