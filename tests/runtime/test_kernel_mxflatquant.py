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


def _q(n=48, k=256, seed=0, name="m.q_proj"):
    g = torch.Generator().manual_seed(seed)
    return get_scheme("w4a4_mxfp4_flatquant").quantize(torch.randn(n, k, generator=g) * 0.05, name)


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


def test_row_layer_with_other_sizes_is_refused():
    s = get_scheme("w4a4_mxfp4_flatquant")
    assert s.shape_problem((8, 512), "m.o_proj") is not None and s.shape_problem((8, 512), "m.q_proj") is None


@pytest.mark.skipif(not os.environ.get("CVT_VLLM_ASCEND_SRC"), reason="needs CVT_VLLM_ASCEND_SRC")
@pytest.mark.parametrize("clip", [1.0, 0.8])
def test_runtime_is_vllm_ascends_apply(clip):
    from cvt.tests.quant.vllm_ascend_referee_mxflatquant import run_mxflatquant

    q = _q()
    q.parts["clip_ratio"] = torch.tensor([clip])
    disk = L.LAYOUTS.get("ascend-w4a4-mxfp4-flatquant").encode(q)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    bias = torch.randn(48).to(torch.bfloat16)
    mine = K.get("w4a4_mxfp4_flatquant").from_parts(dict(q.parts), bias).reference(x)
    theirs = run_mxflatquant(Path(os.environ["CVT_VLLM_ASCEND_SRC"]), disk, x, bias)
    assert torch.equal(mine, theirs)
    flipped = run_mxflatquant(Path(os.environ["CVT_VLLM_ASCEND_SRC"]),
                              dict(disk, left_trans=disk["left_trans"].T.contiguous()), x, bias)
    assert not torch.equal(flipped, mine)


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
