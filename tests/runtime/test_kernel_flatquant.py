"""`w4a4_flatquant` kernel: the torch reference is vllm-ascend's W4A4_FLATQUANT_DYNAMIC apply
(``quantization/methods/w4a4_flatquant.py``: npu_kronecker_quant, then npu_quant_matmul, then the
bias), and a quantized checkpoint runs end to end (`cvt quantize` -> `cvt verify`; `cvt shard`
refuses the k split its transforms cannot follow)."""

from __future__ import annotations

import json

import pytest
import torch

from cvt.errors import TensorError
from cvt.qtensor.schemes import get_scheme
from cvt.runtime import kernels as K
from cvt.testing.checkpoints import tiny_qwen3_config, write_bf16_checkpoint
from cvt.tests.conftest import run_cvt


def gen(seed):
    return torch.Generator().manual_seed(seed)


def quantized(n=40, k=768, seed=0, clip=1.0):
    q = get_scheme("w4a4_flatquant").quantize(torch.randn(n, k, generator=gen(seed)) * 0.05)
    q.parts["clip_ratio"] = torch.tensor([clip])
    return q


@pytest.mark.parametrize("clip", [1.0, 0.6])
def test_reference_is_the_vllm_ascend_pipeline(clip):
    """Written out from the op documentation: p1 = left_trans^T, p2 = right_trans (in x's dtype),
    x'' = p1 @ (x @ p2), scale = max|x''| * clip / 7 per token, int4 = clamp(round(x'' / scale)),
    y = bf16(int4 @ w^T * weight_scale * scale) + bias (bf16)."""
    q = quantized(clip=clip)
    bias = (torch.randn(40, generator=gen(1)) * 0.1).to(torch.bfloat16)
    mod = K.get("w4a4_flatquant").from_parts(dict(q.parts), bias)
    x = torch.randn(5, 768, generator=gen(2)).to(torch.bfloat16)
    p1 = q.parts["left_trans"].to(torch.bfloat16).t().float()
    p2 = q.parts["right_trans"].to(torch.bfloat16).float()
    xt = (p1 @ (x.float().reshape(5, 24, 32) @ p2)).reshape(5, 768)
    s = xt.abs().amax(dim=1) / (7 / clip)
    xq = torch.clamp(torch.round(xt / s[:, None]), -8, 7)
    acc = xq.double() @ q.parts["weight_int4"].double().T
    want = (acc.float() * q.parts["weight_scale"].reshape(1, -1) * s[:, None]).to(torch.bfloat16) + bias
    got = mod(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    if clip < 1:  # the clip saturates: some codes sit at the int4 ends
        assert bool((xq.abs() >= 7).sum() > 5 * 2)


def test_float_transform_equals_the_original_linear():
    """The kernel's transform and the weight it dequantizes (in its own basis) give x W'^T; in the
    original basis (`dense_weight`) the same product without the transform, within 1e-5."""
    q = quantized()
    mod = K.get("w4a4_flatquant").from_parts(dict(q.parts))
    x = torch.randn(6, 768, generator=gen(3))
    wq = q.parts["weight_int4"].float() * q.parts["weight_scale"]
    got = mod.transformed(x) @ wq.T
    want = x @ mod.dense_weight().T
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    assert torch.equal(mod.dense_weight(), get_scheme("w4a4_flatquant").dequantize(q))


def test_parts_refused_with_the_rule():
    q = quantized()
    with pytest.raises(TensorError, match=r"left_trans.*get_decompose_dim\(768\) = \(24, 32\)"):
        K.get("w4a4_flatquant").from_parts(dict(q.parts, left_trans=torch.eye(32)))
    with pytest.raises(TensorError, match="clip_ratio"):
        K.get("w4a4_flatquant").from_parts(dict(q.parts, clip_ratio=torch.tensor([0.0])))


@pytest.mark.slow
def test_quantize_verify_and_shard(tmp_path):
    """A Qwen3-MoE output: the linears in W4A4_FLATQUANT_DYNAMIC, the routed experts float (the
    reason in the manifest), `cvt verify` runs it, `cvt shard --tp 2` refuses the row-parallel split."""
    src = write_bf16_checkpoint(tmp_path / "src", tiny_qwen3_config(
        moe=True, hidden_size=128, head_dim=32, intermediate_size=256, moe_intermediate_size=64))
    dst = tmp_path / "fq"
    r = run_cvt("quantize", src, dst, "--scheme", "w4a4_flatquant", "--format", "ascend", "-q")
    assert r.rc == 0, r.err
    m = json.loads((dst / "cvt_manifest.json").read_text())["quant"]
    assert m["tensors"]["model.layers.0.self_attn.o_proj"]["layout"] == "ascend-w4a4-flatquant"
    assert "linears only" in m["float_modules"]["model.layers.1.mlp.experts.0.down_proj"]
    r = run_cvt("verify", dst, "--reference", src, "--report", tmp_path / "rep", "--seq-len", "16",
                "--max-sequences", "2", "--device", "cpu", "-q")
    assert r.rc == 0, r.err
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert 0 < rep["logits"]["kl_mean"] < 0.5
    r = run_cvt("shard", dst, tmp_path / "tp2", "--world-size", "2", "--tp", "2")
    assert r.rc == 1
    assert "o_proj" in r.err and "cannot be split along in_features" in r.err
