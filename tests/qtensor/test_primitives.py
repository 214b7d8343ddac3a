"""cvt.qtensor.primitives: rounding rules, scales, and bit layouts (worked examples + round trips)."""

from __future__ import annotations

import math

import pytest
import torch

from cvt.errors import CvtError, TensorError
from cvt.qtensor import primitives as P

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def nearest_e2m1_code(x: float) -> int:
    """Reference: the nearest E2M1 magnitude, ties to the even index; sign bit for negatives (and -0.0)."""
    a = min(abs(x), 6.0)
    d = [abs(a - v) for v in E2M1]
    best = min(d)
    idx = [i for i, v in enumerate(d) if v == best]
    i = idx[0] if len(idx) == 1 else next(j for j in idx if j % 2 == 0)
    return i | (8 if math.copysign(1.0, x) < 0 else 0)


# ---- E2M1 ---------------------------------------------------------------------------------------

def test_e2m1_worked_example_and_ties():
    x = torch.tensor([0.25, 0.3, -0.75, 2.5, 2.6, -7.0, -0.1])
    assert P.encode_e2m1(x).tolist() == [0, 1, 10, 4, 5, 15, 8]
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert P.decode_e2m1(P.encode_e2m1(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert P.encode_e2m1(torch.tensor([0.0, -0.0])).tolist() == [0, 8]


def test_e2m1_matches_nearest_reference_on_a_dense_grid():
    x = torch.cat([torch.arange(-7.0, 7.0, 1 / 64), torch.randn(2000, generator=gen(0)) * 3])
    ref = [nearest_e2m1_code(v) for v in x.tolist()]
    assert P.encode_e2m1(x).tolist() == ref


def test_e2m1_codes_round_trip():
    c = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(P.encode_e2m1(P.decode_e2m1(c)), c)
    assert P.decode_e2m1(c).tolist() == list(E2M1) + [-v for v in E2M1]


def test_e2m1_agrees_with_compressed_tensors_cast_to_fp4():
    ct = pytest.importorskip("compressed_tensors.quantization.utils.fp4_utils")
    x = torch.cat([torch.arange(-7.0, 7.0, 1 / 64), torch.randn(2000, generator=gen(1)) * 3])
    assert torch.equal(P.decode_e2m1(P.encode_e2m1(x)), ct.cast_to_fp4(x.clone()))


# ---- scales ---------------------------------------------------------------------------------------

def test_symmetric_and_asymmetric_scales_follow_the_documented_formulas():
    w = torch.randn(6, 64, generator=gen(2))
    w[1] = 0.0
    s = P.symmetric_scale(w, 16, 7.5)
    for r in range(6):
        for g in range(4):
            amax = float(w[r, 16 * g:16 * g + 16].abs().max())
            want = torch.tensor(amax, dtype=torch.float32) / 7.5 if amax else torch.tensor(1.0)
            assert s[r, g].item() == want.item()
    sc, off = P.asymmetric_scale_offset(w, 0, -8, 7)
    for r in range(6):
        lo, hi = min(float(w[r].min()), 0.0), max(float(w[r].max()), 0.0)
        want = (torch.tensor(hi, dtype=torch.float32) - lo) / 15.0 if hi > lo else torch.tensor(1.0)
        assert sc[r, 0].item() == want.item()
        assert off[r, 0].item() == max(-8, min(7, round(-8 - lo / want.item())))


def test_round_to_bf16():
    x = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-9, 3.0])
    assert P.round_to_bf16(x).tolist() == [1.0, 1.0 + 2**-7, 3.0]


def test_nvfp4_scales():
    w = torch.zeros(2, 32)
    assert P.nvfp4_global_scale(w).tolist() == [1.0]          # all-zero weight
    w[0, 0] = 3.0
    gs = P.nvfp4_global_scale(w)
    assert gs.dtype == torch.float32 and gs.tolist() == [896.0]  # 448 * 6 / 3
    s = P.nvfp4_block_scales(w, gs)
    assert s.dtype == torch.float8_e4m3fn and s.shape == (2, 2)
    # block 0: 3 / 6 * 896 = 448; the others are zero blocks -> e4m3 eps 0.125
    assert s.to(torch.float32).tolist() == [[448.0, 0.125], [0.125, 0.125]]


def test_mxfp4_scale_worked_example():
    w = torch.zeros(1, 128)
    w[0, 0], w[0, 32], w[0, 64] = 6.0, 7.0, -0.75  # block 3 all zero
    # 6 = 1.5 * 2**2 -> 2**2 -> 127; 7 = 1.75 * 2**2 -> 2**3 -> 128; 0.75 = 1.5 * 2**-1 -> 124; 0 -> 0
    assert P.mxfp4_scale_codes(w).tolist() == [[127, 128, 124, 0]]


def test_mxfp4_scale_codes_match_a_frexp_reference():
    w = torch.randn(8, 256, generator=gen(3)) * torch.logspace(-30, 30, 8)[:, None]
    codes = P.mxfp4_scale_codes(w)
    for r in range(8):
        for g in range(8):
            amax = float(w[r, 32 * g:32 * g + 32].abs().max())
            m, e = math.frexp(amax)  # amax = m * 2**e, m in [0.5, 1)
            p = e if 2 * m - 1 >= 0.75 else e - 1
            assert codes[r, g].item() == max(0, min(254, 127 + p - 2))


def test_e8m0_to_f32_is_exact_and_agrees_with_the_runtime():
    from cvt.convert.fp8 import scale_to_f32

    e = torch.arange(255, dtype=torch.uint8)
    got = P.e8m0_to_f32(e)
    assert got.tolist() == [2.0 ** (int(v) - 127) for v in range(255)]
    assert torch.equal(got, scale_to_f32(e.view(torch.float8_e8m0fnu)))


# ---- integer rounding -----------------------------------------------------------------------------

def test_quantize_int_rounds_half_to_even_and_clamps():
    w = torch.tensor([[0.5, 1.5, 2.5, -0.5, -2.5, 100.0, -100.0, 0.0]])
    q = P.quantize_int(w, torch.ones(1, 1), None, -8, 7)
    assert q.tolist() == [[0, 2, 2, 0, -2, 7, -8, 0]]
    q2 = P.quantize_int(w, torch.ones(1, 1), torch.full((1, 1), 3.0), -8, 7)
    assert q2.tolist() == [[4, 4, 6, 2, 0, 7, -8, 3]]
    assert P.dequantize_int(q2, torch.full((1, 1), 0.5), torch.full((1, 1), 3.0)).tolist() == \
        [[0.5, 0.5, 1.5, -0.5, -1.5, 2.0, -5.5, 0.0]]


def test_checks_name_the_tensor():
    with pytest.raises(CvtError, match=r"'layers.0.mlp.down_proj.weight'.*group size 48 does not divide in_features=64"):
        P.check_group("layers.0.mlp.down_proj.weight", (8, 64), 48, "w4a16")
    P.check_group("x", (8, 64), 32)
    w = torch.ones(2, 4)
    w[1, 2] = float("nan")
    with pytest.raises(TensorError, match=r"weight 'a.b' \(float32 \[2, 4\]\) holds 1 non-finite"):
        P.check_finite(w, "a.b")


# ---- packing --------------------------------------------------------------------------------------

def test_int4_ascend_worked_example():
    q = torch.tensor([[1, -2], [3, -4]], dtype=torch.int8)
    assert P.pack_int4_ascend(q, 0).tolist() == [[0x31, 0xCE - 256]]          # pairs of output channels
    assert P.pack_int4_ascend(q, 1).tolist() == [[0xE1 - 256], [0xC3 - 256]]  # along k
    assert P.ascend_pack_dim(torch.ones(4, 1)) == 1 and P.ascend_pack_dim(torch.ones(4, 2)) == 0


def test_int4_ct_worked_example():
    q = torch.tensor([[1, -2, 3, -4, 5, -6, 7, -8, 2, 0]], dtype=torch.int8)
    assert P.pack_int4_ct(q).tolist() == [[0x0F2D4B69, 0x8A]]
    zp = q.t().contiguous()  # the zero point packs along dim 0 the same way
    assert P.pack_int4_ct(zp, 0).tolist() == [[0x0F2D4B69], [0x8A]]


def test_fp4_pack_worked_example():
    codes = torch.tensor([[1, 2, 9, 15]], dtype=torch.uint8)
    assert P.pack_fp4(codes).tolist() == [[0x21, 0xF9]]


@pytest.mark.parametrize("shape", [(6, 10), (8, 64), (3, 7), (1, 1), (16, 33)])
def test_pack_round_trips_bit_for_bit(shape):
    q = torch.randint(-8, 8, shape, dtype=torch.int8, generator=gen(shape[0] * 100 + shape[1]))
    for dim in (0, 1):
        assert torch.equal(P.unpack_int4_ct(P.pack_int4_ct(q, dim), shape[dim], dim), q)
        if shape[dim] % 2 == 0:
            assert torch.equal(P.unpack_int4_ascend(P.pack_int4_ascend(q, dim), dim), q)
        else:
            with pytest.raises(TensorError, match="needs an even size"):
                P.pack_int4_ascend(q, dim)
    c = torch.randint(0, 16, (shape[0], 2 * shape[1]), dtype=torch.uint8, generator=gen(7))
    assert torch.equal(P.unpack_fp4(P.pack_fp4(c)), c)
    packed = torch.randint(-2**31, 2**31 - 1, (shape[0], 4), dtype=torch.int32, generator=gen(8))
    assert torch.equal(P.pack_int4_ct(P.unpack_int4_ct(packed, 32), 1), packed)


def test_pack_helpers_agree_with_compressed_tensors():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    nv = pytest.importorskip("compressed_tensors.compressors.nvfp4.helpers")
    q = torch.randint(-8, 8, (12, 20), dtype=torch.int8, generator=gen(9))
    for dim in (0, 1):
        assert torch.equal(P.pack_int4_ct(q, dim), helpers.pack_to_int32(q, 4, packed_dim=dim))
    c = torch.randint(0, 16, (5, 8), dtype=torch.uint8, generator=gen(10))
    assert torch.equal(nv.unpack_fp4_from_uint8(P.pack_fp4(c), 5, 8, dtype=torch.float32), P.decode_e2m1(c))


def test_runtime_kernels_reexport_the_primitives():
    from cvt.runtime.kernels import fp4, int4

    for name in ("ascend_pack_dim", "pack_int4_ascend", "unpack_int4_ascend", "pack_int4_ct", "unpack_int4_ct"):
        assert getattr(int4, name) is getattr(P, name)
    for name in ("decode_e2m1", "pack_fp4", "unpack_fp4", "E2M1_VALUES"):
        assert getattr(fp4, name) is getattr(P, name)


def test_nvfp4_global_scale_of_a_float_is_the_torch_value():
    """The torch-free form the fused path uses (`cvt.quant.qkernel`'s numpy path) gives the same
    float32 as `nvfp4_global_scale` on a weight of that amax, bit for bit: zero, subnormal and
    tiny amax (quotient overflows -> 1.0), every binade, float32 max."""
    import numpy as np

    rng = np.random.default_rng(0)
    bits = rng.integers(0, 0x7F800000, 4000, dtype=np.uint32)  # every finite non-negative float32
    amax = np.concatenate([np.array([0.0, 1e-45, 1.1754944e-38, 1e-38, 1.0, 448.0, 2688.0, 3.4028235e38],
                                    dtype=np.float32), bits.view(np.float32), rng.random(2000, dtype=np.float32) * 8])
    for a in amax.tolist():
        w = torch.tensor([[a, -a / 2]], dtype=torch.float32)
        want = float(P.nvfp4_global_scale(w))
        got = P.nvfp4_global_scale_of(a)
        assert got == want, (a, got, want)
