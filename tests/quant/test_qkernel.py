"""Fused RTN kernels (`cvt.quant.qkernel`): the same bytes as the torch reference path.

The oracle is the reference itself: ``w = float32(source)`` (FP8 dequantized to BF16 first),
``layout.encode(scheme.quantize(w))`` and ``sqnr_db(w, scheme.dequantize(q))``. Every fused
layout, every source dtype (BF16; FP8 with float32 / bfloat16 / E8M0 block scales), awkward
shapes (edge blocks, odd rows, k not a multiple of 8), every group size of k, three
implementations (C with AVX2, C scalar, the blockwise torch fallback). The SQNR is a float sum
in another order: compared to 0.01 dB.
"""

from __future__ import annotations

import math

import pytest
import torch

from cvt.errors import TensorError
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


# ---- the stage uses the kernels, and writes the reference's bytes ----------------------------------

STAGE_CASES = [
    ("compressed-tensors", "w8a8", {}),
    ("compressed-tensors", "w4a16", {"asym": True, "group_size": 32}),
    ("compressed-tensors", "fp4", {}),  # nvfp4: fused groups share a global scale
    ("compressed-tensors", "fp4", {"fp4_format": "mxfp4"}),
    ("ascend", "w8a8", {}),
    ("ascend", "w4a16", {}),  # vllm-ascend int32 experts
    ("ascend", "w4a16", {"target": "mindie", "group_size": 64}),
    ("ascend", "w4a16", {"target": "mindie", "group_size": 0, "asym": True}),
]


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors"))}


@pytest.mark.parametrize("fmt,scheme,opts", STAGE_CASES,
                         ids=[f"{f}-{s}" + "".join(f"-{k}={v}" for k, v in o.items()) for f, s, o in STAGE_CASES])
@pytest.mark.parametrize("impl", ["c", pytest.param("torch", marks=pytest.mark.slow)])  # torch kernels: the tests above
def test_stage_writes_the_reference_bytes(fp8_release_session, tmp_path, monkeypatch, fmt, scheme, opts, impl):
    from cvt.convert.reader import read_manifest
    from cvt.quant.stage import quantize

    if impl == "c" and (QK._c_kernel.cache_clear() or QK._c_kernel() is None):
        pytest.skip("C quantize kernel not built")
    calls = []
    real, real_pieces = QK.quantize_to_layout, QK.quantize_in_pieces
    monkeypatch.setattr(QK, "quantize_to_layout", lambda *a, **k: calls.append(a[2].name) or real(*a, **k))
    monkeypatch.setattr(QK, "quantize_in_pieces", lambda *a, **k: calls.append(a[2].name) or real_pieces(*a, **k))
    try:
        monkeypatch.setenv("CVT_QUANT_KERNEL", "reference")
        QK._c_kernel.cache_clear()
        quantize(fp8_release_session, tmp_path / "ref", scheme=scheme, fmt=fmt, quiet=True, **opts)
        assert calls == []
        monkeypatch.setenv("CVT_QUANT_KERNEL", "" if impl == "c" else "torch")
        QK._c_kernel.cache_clear()
        quantize(fp8_release_session, tmp_path / "fused", scheme=scheme, fmt=fmt, quiet=True, **opts)
    finally:
        QK._c_kernel.cache_clear()
    ref, fused = read_manifest(tmp_path / "ref"), read_manifest(tmp_path / "fused")
    assert len(calls) == len(fused.quant.tensors) > 0  # every quantized module went through the fused path
    assert _files(tmp_path / "ref") == _files(tmp_path / "fused")
    for m, info in ref.quant.tensors.items():
        got = fused.quant.tensors[m]
        assert got.model_dump(exclude={"sqnr_db"}) == info.model_dump(exclude={"sqnr_db"})
        if isinstance(info.sqnr_db, float):
            assert abs(got.sqnr_db - info.sqnr_db) < SQNR_TOL_DB
        else:
            assert got.sqnr_db == info.sqnr_db


@pytest.mark.parametrize("scheme", ["w8a8", "fp4"])
def test_stage_refuses_non_finite_weight_like_the_reference(fp8_release, tmp_path, monkeypatch, scheme):
    """A NaN code in an FP8 weight: the same one-line error on both paths, nothing written (fp4:
    nvfp4, whose global-scale pass need not read the NaN code's block; the quantize pass refuses)."""
    import json

    from cvt.quant.stage import quantize

    index = json.loads((fp8_release / "model.safetensors.index.json").read_text())
    name = next(n for n in index["weight_map"] if n.endswith("mlp.experts.1.up_proj.weight"))
    path = fp8_release / index["weight_map"][name]
    data = bytearray(path.read_bytes())
    hlen = int.from_bytes(data[:8], "little")
    header = json.loads(data[8: 8 + hlen])
    start, (n, k) = header[name]["data_offsets"][0], header[name]["shape"]
    scale = torch.frombuffer(bytearray(data[8 + hlen + header[name + "_scale_inv"]["data_offsets"][0]:
                                             8 + hlen + header[name + "_scale_inv"]["data_offsets"][1]]),
                             dtype=torch.float32).reshape(header[name + "_scale_inv"]["shape"])
    r, c = divmod(int(scale.abs().argmin()), scale.shape[1])  # the block least able to hold the max
    data[8 + hlen + start + r * 128 * k + c * 128 + 5] = 0x7F
    path.write_bytes(bytes(data))
    if scheme == "fp4" and QK._c_kernel() is not None:  # the C global-scale pass does not read that block
        codes = torch.frombuffer(bytearray(data[8 + hlen + start: 8 + hlen + start + n * k]), dtype=torch.uint8)
        src = QK.WeightSource(codes.view(torch.float8_e4m3fn).reshape(n, k), scale, (128, 128))
        assert QK.absmax(src) is not None
    errors = []
    for mode in ("reference", ""):
        monkeypatch.setenv("CVT_QUANT_KERNEL", mode)
        QK._c_kernel.cache_clear()
        with pytest.raises(TensorError) as exc:
            quantize(fp8_release, tmp_path / f"out{mode}", scheme=scheme, quiet=True)
        errors.append(str(exc.value))
        assert not (tmp_path / f"out{mode}" / "cvt_manifest.json").exists()
    QK._c_kernel.cache_clear()
    assert errors[0] == errors[1] and name in errors[0] and "non-finite" in errors[0]


@pytest.mark.parametrize("fmt,target", [pytest.param("compressed-tensors", None, marks=pytest.mark.slow),
                                        ("ascend", "vllm-ascend"),
                                        pytest.param("ascend", "mindie", marks=pytest.mark.slow)])
def test_stage_layout_probe_scaled_from_a_few_rows(monkeypatch, fmt, target):
    """The writer plans each module's tensors from a probe of 16 rows scaled by the layout's dims:
    the same specs as a probe of the module's full size (which costs a full quantization)."""
    from cvt.errors import CvtError
    from cvt.qtensor.disk_specs import DiskLayouts
    from cvt.qtensor.formats import get_format
    from cvt.qtensor.layouts import check_target

    form, target = get_format(fmt), check_target(fmt, target)
    schemes = [get_scheme("w8a8"), get_scheme("w8a8c8"), get_scheme("fp4"), get_scheme("fp4", fp4_format="mxfp4")]
    schemes += [get_scheme("w4a16", group_size=g, symmetric=s) for g in (0, 32, 64, 128, 256) for s in (True, False)]
    checked = 0
    for sch in schemes:
        for shape in [(48, 256), (576, 1024), (1040, 512), (16 * 9, 256)]:
            for expert, static in [(False, False), (True, False), (False, True)]:
                if static and sch.name != "w8a8":
                    continue
                try:
                    big = DiskLayouts(form, target)
                    monkeypatch.setattr(DiskLayouts, "PROBE_ROWS", 1 << 30)
                    want = big.get("m", sch, shape, static, (shape[0],), torch.bfloat16, expert)
                except CvtError:
                    continue  # no layout for this scheme / module / shape on this target
                finally:
                    monkeypatch.setattr(DiskLayouts, "PROBE_ROWS", 16)
                got = DiskLayouts(form, target).get("m", sch, shape, static, (shape[0],), torch.bfloat16, expert)
                assert got == want, (sch, shape, expert, static)
                checked += 1
    assert checked > 20


@pytest.mark.parametrize("fmt,target", [("compressed-tensors", None), ("ascend", "vllm-ascend"), ("ascend", "mindie")])
def test_stage_plans_fused_layouts_from_the_table(monkeypatch, fmt, target):
    """The fused RTN layouts are planned from the layout table alone (no probe, no torch:
    `cvt.qtensor.disk_specs.data_planned`): the same names, order, shapes, dtypes and tags as a
    probe of the module's full size through the format's own encoder."""
    from cvt.errors import CvtError
    from cvt.qtensor.disk_specs import DiskLayouts
    from cvt.qtensor.formats import get_format
    from cvt.qtensor.layouts import check_target

    form, target = get_format(fmt), check_target(fmt, target)
    schemes = [get_scheme("w8a8"), get_scheme("w8a8c8"), get_scheme("fp4"), get_scheme("fp4", fp4_format="mxfp4")]
    schemes += [get_scheme("w4a16", group_size=g, symmetric=s) for g in (0, 32, 64, 128, 256) for s in (True, False)]
    probes = []
    real = DiskLayouts._probed
    monkeypatch.setattr(DiskLayouts, "_probed", lambda self, *a: probes.append(a) or real(self, *a))
    from_table = 0
    for sch in schemes:
        for shape in [(48, 256), (576, 1024), (1040, 512), (16 * 9, 256)]:
            for expert in (False, True):
                try:
                    got = DiskLayouts(form, target).get("m.gate_proj", sch, shape, False, None, None, expert)
                except CvtError:
                    continue  # no layout for this scheme / module / shape on this target
                if probes:
                    probes.clear()
                    continue  # planned on a probe (asymmetric ct-int4): the probe tests cover it
                from_table += 1
                want = real(DiskLayouts(form, target), "probe.gate_proj", sch, shape, False, None, None, expert)
                want = ({"m.gate_proj" + k: v for k, v in want[0].items()},
                        {"m.gate_proj" + k: v for k, v in want[1].items()})
                assert list(got[0].items()) == list(want[0].items()), (sch, shape, expert)
                assert got[1] == want[1], (sch, shape, expert)
    assert from_table > 20


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
