"""`w4a4_mxfp4_flatquant` (Ascend 950 W4A4_MXFP4_FLATQUANT): the runtime kernel equals vllm-ascend's
own ``apply`` (stubbed NPU ops, `vllm_ascend_referee_mxflatquant`), layout round trip, the fold."""

import os
from pathlib import Path

import pytest
import torch

from cvt.qtensor import layouts as L
from cvt.qtensor.schemes import get_scheme
from cvt.qtensor.schemes.flatquant_mx import get_decompose_dim, trans_dims
from cvt.runtime import kernels as K


def _q(n=48, k=256, seed=0, name="m.q_proj", row=False):
    g = torch.Generator().manual_seed(seed)
    s = get_scheme("w4a4_mxfp4_flatquant").for_parallel(row)
    return s.quantize(torch.randn(n, k, generator=g) * 0.05, name)


def test_decompose_dim_is_vllm_ascends():
    # worked from w4a4_mxfp4_flatquant.get_decompose_dim by hand
    assert get_decompose_dim(256, 1) == (16, 16) and get_decompose_dim(7168, 1) == (64, 112)
    assert get_decompose_dim(128, 4) == (8, 16) and trans_dims(512, True) == (32, 16)
    assert get_decompose_dim(65536 * 2, 1) is None


def test_layout_round_trip_and_dense_weight():
    q = _q()
    lo = L.LAYOUTS.get("ascend-w4a4-mxfp4-flatquant")
    d = lo.encode(q)
    assert d["weight"].shape == (48, 128) and d["weight_scale"].shape == (48, 8) and lo.tag == "W4A4_MXFP4_FLATQUANT"
    q2 = lo.decode("m.q_proj", d)
    assert all(torch.equal(q.parts[p], q2.parts[p]) for p in q.parts)
    mod = K.get("w4a4_mxfp4_flatquant").from_parts(dict(q.parts))
    assert torch.equal(mod.dense_weight(), get_scheme("w4a4_mxfp4_flatquant").dequantize(q))


def test_row_layer_gets_vllm_ascends_row_sizes():
    """A RowParallelLinear (the plan's `for_parallel(True)`) is sized for max_supported_tp 4: k=512
    -> 32 x 16 (16 x 32 otherwise), written in the row layout entry, read back with its sizes."""
    s = get_scheme("w4a4_mxfp4_flatquant")
    r = s.for_parallel(True)
    assert r.row and not s.row and r.for_parallel(False) is s and s.for_parallel(True) is r
    assert r.dims(512) == (32, 16) and s.dims(512) == (16, 32) and r.shape_problem((8, 512)) is None
    q = _q(n=16, k=512, row=True)
    assert q.parts["left_trans"].shape == (32, 32) and q.parts["right_trans"].shape == (16, 16)
    assert q.extra == {"parallel": "row"} and _q(n=16, k=512).extra == {}
    lo = L.select("ascend", q.kernel_fmt, "vllm-ascend", expert=False, group_size=32, k=512, module="m.o_proj",
                  parallel="row")
    assert lo.name == "ascend-w4a4-mxfp4-flatquant-row" and lo.shapes(16, 512, 32)["left_trans"] == ((32, 32), "BF16")
    assert L.select("ascend", q.kernel_fmt, "vllm-ascend", expert=False, group_size=32, k=512,
                    module="m.q_a_proj").name == "ascend-w4a4-mxfp4-flatquant"
    q2 = lo.decode("m.o_proj", lo.encode(q))
    assert q2.extra == {"parallel": "row"} and all(torch.equal(q.parts[p], q2.parts[p]) for p in q.parts)
    with pytest.raises(Exception, match="do not fit"):  # a fit sized for the other role is refused
        r.quantize_with(torch.zeros(16, 512), *s.init_transforms(512), 1.0)


@pytest.mark.skipif(not os.environ.get("CVT_VLLM_ASCEND_SRC"), reason="needs CVT_VLLM_ASCEND_SRC")
@pytest.mark.parametrize("clip,k,row", [(1.0, 256, False), (0.8, 256, False), (1.0, 512, True), (0.8, 512, True)])
def test_runtime_is_vllm_ascends_apply(clip, k, row):
    """Bit for bit, a row layer too (vllm-ascend declares its 32 x 16 transforms, process_weights_
    after_loading takes the TP-1 block); a transposed left_trans gives another output."""
    from cvt.tests.quant.vllm_ascend_referee_mxflatquant import run_mxflatquant

    q = _q(k=k, row=row)
    q.parts["clip_ratio"] = torch.tensor([clip])
    disk = L.LAYOUTS.get("ascend-w4a4-mxfp4-flatquant-row" if row else "ascend-w4a4-mxfp4-flatquant").encode(q)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    bias = torch.randn(48).to(torch.bfloat16)
    mine = K.get("w4a4_mxfp4_flatquant").from_parts(dict(q.parts), bias).reference(x)
    theirs = run_mxflatquant(Path(os.environ["CVT_VLLM_ASCEND_SRC"]), disk, x, bias, row=row)
    assert torch.equal(mine, theirs)
    flipped = run_mxflatquant(Path(os.environ["CVT_VLLM_ASCEND_SRC"]),
                              dict(disk, left_trans=disk["left_trans"].T.contiguous()), x, bias, row=row)
    assert not torch.equal(flipped, mine)
    if row:  # vllm-ascend declares the row sizes: the other role's would not load
        with pytest.raises(ValueError, match="vllm-ascend declares"):
            run_mxflatquant(Path(os.environ["CVT_VLLM_ASCEND_SRC"]), L.LAYOUTS.get("ascend-w4a4-mxfp4-flatquant")
                            .encode(_q(k=k)), x, bias, row=True)


def test_fit_uses_the_mxfp4_quantizer():
    """--method flatquant on this scheme: the fit's loss is measured with the MXFP4 kernel (the
    start's loss equals the kernel's error at the Hadamard pair) and never ends above it."""
    from cvt.quant.methods.flatquant import fit

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g) * torch.linspace(0.1, 3, 256)
    w = torch.randn(32, 256, generator=g) * 0.05
    s = get_scheme("w4a4_mxfp4_flatquant")
    r = fit(x, [w], steps=10, scheme=s, names=["m.q_proj"])
    y = K.get("w4a4_mxfp4_flatquant").from_parts(dict(s.quantize(w).parts)).reference(x)
    assert r.loss_init == pytest.approx(float((y - x @ w.T).pow(2).mean()), rel=1e-6)
    assert r.loss <= r.loss_init and r.clip == 1.0 and r.weight_clips is None


def _ranks(q, tp: int) -> list:
    """Rank r's parts of row layer `q` at TP `tp`: its columns of the codes and exponents, its
    diagonal block of left_trans (vllm-ascend's process_weights_after_loading), right and clip."""
    p, (n, k) = q.parts, q.shape
    a = p["left_trans"].shape[0]
    out = []
    for r in range(tp):
        c, ca, cs = slice(r * k // tp, (r + 1) * k // tp), slice(r * a // tp, (r + 1) * a // tp), k // tp // 32
        out.append(dict(p, weight_fp4=p["weight_fp4"][:, c], weight_scale=p["weight_scale"][:, r * cs:(r + 1) * cs],
                        left_trans=p["left_trans"][ca, ca]))
    return out


def _tp_output(q, x: torch.Tensor, tp: int) -> torch.Tensor:
    k = q.shape[1]
    lin = K.get("w4a4_mxfp4_flatquant")
    return sum(lin.from_parts(parts).reference(x[:, r * k // tp:(r + 1) * k // tp])
               for r, parts in enumerate(_ranks(q, tp)))


def test_a_ranks_part_of_a_row_layer_reads_back():
    """`cvt shard`'s rank of a row layer (its columns, its (a / tp, b) transforms: a x b = the
    rank's k) decodes through the row layout entry, and the decoded ranks add up to the TP-1 layer.
    k = 384: (32, 12); a rank's (16, 12) at TP 2 is neither size pair of a whole layer of k 192."""
    q = _q(n=16, k=384, row=True)
    lo = L.LAYOUTS.get("ascend-w4a4-mxfp4-flatquant-row")
    lin = K.get("w4a4_mxfp4_flatquant")
    x = torch.randn(3, 384, generator=torch.Generator().manual_seed(1))
    full = lin.from_parts(dict(q.parts)).reference(x)
    for tp in (2, 4):
        k, out = 384 // tp, 0
        for r, parts in enumerate(_ranks(q, tp)):
            disk = lo.encode(type(q)(q.scheme, q.kernel_fmt, (16, k), parts, 32, True, q.extra))
            part = lo.decode("m.o_proj", disk)
            assert part.shape == (16, k) and part.parts["left_trans"].shape == (32 // tp, 32 // tp)
            assert all(torch.equal(part.parts[p], parts[p]) for p in parts)
            out = out + lin.from_parts(dict(part.parts)).reference(x[:, r * k:(r + 1) * k])
        torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fitted", [False, True])
def test_a_row_layer_at_tp_2_and_4_is_the_tp_1_layer(fitted):
    """A RowParallelLinear's left_trans is block-diagonal in max_supported_tp (4) blocks, so the
    ranks' diagonal blocks on their columns add up to the TP-1 layer at TP 2 and 4 (the MX blocks
    of the transformed tokens are the same; only the sum order differs). A dense left (cvt's
    earlier row start) is refused, and would have been wrong at TP 2."""
    from cvt.qtensor.schemes.flatquant_mx import MAX_TP, off_block
    from cvt.quant.methods.flatquant import fit

    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 512, generator=g) * torch.linspace(0.2, 3, 512)
    w = torch.randn(40, 512, generator=g) * 0.05
    r = get_scheme("w4a4_mxfp4_flatquant").for_parallel(True)
    left, right = r.init_transforms(512)
    if fitted:
        f = fit(x, [w], steps=15, scheme=r, names=["m.o_proj"])
        assert f.fitted and not torch.equal(f.left, left)  # the blocks moved ...
        left, right = f.left, f.right
    assert left.shape == (32, 32) and not off_block(left, MAX_TP)  # ... and nothing outside them
    assert off_block(torch.ones(32, 32), MAX_TP) and not off_block(torch.ones(32, 32), 1)
    q = r.quantize_with(w, left, right, 1.0)
    full = K.get("w4a4_mxfp4_flatquant").from_parts(dict(q.parts)).reference(x)
    for tp in (2, 4):
        torch.testing.assert_close(_tp_output(q, x, tp), full, rtol=1e-5, atol=1e-5)
    dense = torch.linalg.qr(torch.randn(32, 32, generator=g))[0].to(torch.bfloat16)
    with pytest.raises(Exception, match="block-diagonal in 4 blocks"):
        r.quantize_with(w, dense, right, 1.0)
    qd = r._quantize(w, dense, right, 1.0)  # what a dense left would have written
    ref = K.get("w4a4_mxfp4_flatquant").from_parts(dict(qd.parts)).reference(x)
    assert (_tp_output(qd, x, 2) - ref).abs().max() > 0.1 * ref.abs().max()


@pytest.mark.skipif(not os.environ.get("CVT_VLLM_ASCEND_SRC"), reason="needs CVT_VLLM_ASCEND_SRC")
def test_vllm_ascend_at_tp_2_and_4_computes_cvts_row_layer():
    """vllm-ascend's own loader and apply on each rank (its columns, its diagonal block), summed:
    cvt's TP-1 output of the same row layer, at TP 2 and 4."""
    from cvt.tests.quant.vllm_ascend_referee_mxflatquant import run_mxflatquant

    q = _q(n=40, k=512, row=True)
    disk = L.LAYOUTS.get("ascend-w4a4-mxfp4-flatquant-row").encode(q)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(40)
    mine = K.get("w4a4_mxfp4_flatquant").from_parts(dict(q.parts), bias).reference(x)
    src = Path(os.environ["CVT_VLLM_ASCEND_SRC"])
    assert torch.equal(run_mxflatquant(src, disk, x, bias, row=True), mine)
    for tp in (2, 4):
        torch.testing.assert_close(run_mxflatquant(src, disk, x, bias, row=True, tp=tp), mine, rtol=1e-5, atol=1e-5)
