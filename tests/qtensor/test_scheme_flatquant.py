"""`w4a4_flatquant` (Ascend W4A4_FLATQUANT_DYNAMIC): the decomposition, the folded weight, the
layout on disk, and the plan's choices (linears only, shapes the op cannot take kept float)."""

from __future__ import annotations

import pytest
import torch

from cvt.errors import CvtError, FormatError, ShapeError
from cvt.qtensor import layouts as L
from cvt.qtensor.schemes import get_scheme
from cvt.qtensor.schemes.flatquant import decompose_dim, fold, init_transforms, transform, unfold


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_decompose_dim_is_vllm_ascends():
    # the expected pairs are vllm-ascend's own unit test (tests/ut/quantization/methods/a2/
    # test_w4a4_flatquant.py test_get_decompose_dim) and DeepSeek-V3's widths worked by hand
    assert [decompose_dim(n) for n in (1024, 768, 100, 99)] == [(32, 32), (24, 32), (10, 10), (9, 11)]
    assert decompose_dim(7168) == (64, 112)    # 88^2 - 7168 = 24^2
    assert decompose_dim(18432) == (128, 144)  # 136^2 - 18432 = 8^2


def test_decompose_dim_refuses_what_has_no_pair():
    """n = 2 mod 4 is no difference of two squares: vllm-ascend's search never ends there, cvt's
    refuses in one line (the layout reader meets such a k in a lying header) and the MX variant
    says None (where vllm-ascend raises)."""
    from cvt.qtensor.schemes.flatquant_mx import get_decompose_dim

    for n in (2, 6, 18, 4098):
        with pytest.raises(ShapeError, match=f"in_features {n} has no Kronecker factor pair"):
            decompose_dim(n)
        assert get_decompose_dim(n, 1) is None
    assert decompose_dim(4100) == (50, 82) and get_decompose_dim(4100, 1) == (50, 82)  # 66^2 - 4100 = 16^2


@pytest.mark.parametrize("k", [256, 768, 7168])
def test_the_transformed_linear_is_the_linear_in_float(k):
    """(L^T X R) . W'^T == x . W^T with W' the folded weight, in float32 within 1e-5."""
    w = torch.randn(24, k, generator=gen(1))
    x = torch.randn(9, k, generator=gen(2))
    left, right = init_transforms(k)
    got = transform(x, left, right) @ fold(w, left, right).T
    want = x @ w.T
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    assert float((unfold(fold(w, left, right), left, right) - w).abs().max()) < 1e-5


def test_transform_follows_the_kronecker_op():
    """npu_kronecker_quant's x'' = p1 @ (x @ p2) with p1 = left_trans^T (the method transposes it on
    load), written out here element by element for one token."""
    left, right = torch.randn(3, 3, generator=gen(3)), torch.randn(4, 4, generator=gen(4))
    x = torch.randn(1, 12, generator=gen(5))
    X = x.reshape(3, 4)
    want = torch.zeros(3, 4)
    for i in range(3):
        for j in range(4):
            want[i, j] = sum(left[p, i] * X[p, q] * right[q, j] for p in range(3) for q in range(4))
    assert torch.allclose(transform(x, left, right).reshape(3, 4), want, atol=1e-5)


def test_quantize_parts_and_determinism():
    s = get_scheme("w4a4_flatquant")
    w = torch.randn(16, 768, generator=gen(6)) * 0.02
    q = s.quantize(w)
    assert {k: (tuple(v.shape), v.dtype) for k, v in q.parts.items()} == {
        k: v for k, v in s.param_info((16, 768)).items()}
    assert q.parts["left_trans"].shape == (24, 24) and q.parts["right_trans"].shape == (32, 32)
    assert float(q.parts["clip_ratio"]) == 1.0
    assert int(q.parts["weight_int4"].min()) >= -8 and int(q.parts["weight_int4"].max()) <= 7
    # the transforms depend on k alone: the shards of a fused linear (gate / up) share them
    q2 = s.quantize(torch.randn(8, 768, generator=gen(7)))
    assert torch.equal(q.parts["left_trans"], q2.parts["left_trans"])
    assert torch.equal(q.parts["right_trans"], q2.parts["right_trans"])
    # Hadamard: orthogonal up to the bf16 rounding of its entries
    lf = q.parts["left_trans"].float()
    assert float((lf @ lf.T - torch.eye(24)).abs().max()) < 1e-2
    # dequantize is the weight in the original basis: int4 error only (~12% for Gaussian rows)
    err = float((s.dequantize(q) - w).norm() / w.norm())
    assert 0.02 < err < 0.2


def test_options_and_shapes_refused():
    with pytest.raises(CvtError, match="per output channel only"):
        get_scheme("w4a4_flatquant", group_size=32)
    with pytest.raises(CvtError, match="symmetric only"):
        get_scheme("w4a4_flatquant", symmetric=False)
    s = get_scheme("w4a4_flatquant")
    with pytest.raises(ShapeError, match="multiple of 8"):
        s.check("m.weight", (8, 100))
    # 96 = 8 x 12: the right factor must be a multiple of 8 for the int32-packed output
    assert "8 x 12" in s.shape_problem((8, 96))
    with pytest.raises(ShapeError, match="8 x 12"):
        s.check("m.weight", (8, 96))
    assert s.shape_problem((8, 256)) is None


def test_layout_on_disk_round_trips():
    lo = L.select("ascend", "w4a4_flatquant", "vllm-ascend", expert=False, group_size=0, k=768, module="m.o_proj")
    assert lo.name == "ascend-w4a4-flatquant" and lo.tag == "W4A4_FLATQUANT_DYNAMIC"
    assert lo.shapes(16, 768, 0) == {"weight": ((16, 768), "I8"), "weight_scale": ((16, 1), "F32"),
                                     "weight_offset": ((16, 1), "F32"), "left_trans": ((24, 24), "BF16"),
                                     "right_trans": ((32, 32), "BF16"), "clip_ratio": ((1,), "F32")}
    q = get_scheme("w4a4_flatquant").quantize(torch.randn(16, 768, generator=gen(8)))
    disk = lo.encode(q)
    assert {k: v.dtype for k, v in disk.items()} == {
        "weight": torch.int8, "weight_scale": torch.float32, "weight_offset": torch.float32,
        "left_trans": torch.bfloat16, "right_trans": torch.bfloat16, "clip_ratio": torch.float32}
    assert not bool(disk["weight_offset"].any())
    back = lo.decode("m", disk)
    assert all(torch.equal(back.parts[k], q.parts[k]) for k in q.parts)
    bad = dict(disk, left_trans=disk["left_trans"][:8, :8])
    with pytest.raises(FormatError, match="left_trans"):
        lo.decode("m", bad)
    with pytest.raises(FormatError, match="clip_ratio"):
        lo.decode("m", dict(disk, clip_ratio=torch.tensor([1.5])))


def test_linears_only():
    """vllm-ascend registers W4A4_FLATQUANT_DYNAMIC for "linear" only: a routed expert is refused
    when asked for, and stays float (with the reason) by default."""
    with pytest.raises(FormatError, match="linears only"):
        L.select("ascend", "w4a4_flatquant", "vllm-ascend", expert=True, group_size=0, k=256, module="e")
    assert "linears only" in L.linears_only_reason("ascend", "w4a4_flatquant", "vllm-ascend")
    assert L.linears_only_reason("ascend", "w8a8_dynamic", "vllm-ascend") is None
    assert L.experts_only_reason("ascend", "w4a4_flatquant", "vllm-ascend") is None
