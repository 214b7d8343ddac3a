"""Contract test, continued (tests/runtime/test_npu_contract.py has the whole story): W4A16
through the stand-in torch_npu (npu_convert_weight_to_int4pack + npu_weight_quant_batchmatmul:
bias dtype, group sizes, the offset's sign, the N-packed layout), the calls each op refuses
falling back to the reference (k or n beyond 65535, empty inputs, unpackable widths), the
formats without a fused op, and a whole DeepSeek-V3 model on the fused path.
"""

from __future__ import annotations

import math

import pytest
import torch

from cvt.runtime import kernels as K
from cvt.runtime.kernels import int4, int8, npu
from cvt.tests.runtime.npu_contract_rules import _dynamic, _static, both, dynamic_as_documented, gen, spy
from cvt.tests.runtime.npu_contract_rules import standin  # noqa: F401 (a fixture)


def _w4a16(n, k, g, sym, bias, seed=0):
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen(seed))
    s = (torch.rand(n, k // g, generator=gen(seed + 1)) * 0.02 + 1e-3).bfloat16().float()
    off = torch.zeros_like(s) if sym else torch.randint(-3, 4, s.shape, generator=gen(seed + 2)).float()
    b = torch.randn(n, generator=gen(seed + 3)) if bias else None
    return K.W4A16Linear.from_parts({"weight_int4": q, "weight_scale": s, "weight_offset": off}, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("g,sym,bias", [(32, False, True), (32, True, False), (128, False, False), (128, True, True)])
def test_w4a16(monkeypatch, standin, dtype, g, sym, bias):
    n, k = 48, 128
    mod = _w4a16(n, k, g, sym, bias)
    x = torch.randn(3, 5, k, generator=gen(9)).to(dtype)
    ref, got, calls = both(mod, x, monkeypatch, standin)
    assert calls == ["npu_convert_weight_to_int4pack", "npu_weight_quant_batchmatmul"]
    st = mod._npu_state
    assert st["packed"].shape == (k, n // 8) and st["group_size"] == (g if g < k else 0)
    assert (st["offset"] is None) == sym
    assert got.dtype == dtype and got.shape == (3, 5, n)
    # same dequantized weight; only the matmul's accumulation order may differ
    torch.testing.assert_close(got, ref, rtol=2 ** -7, atol=1e-2)
    again = mod(x)  # prepared state is reused: no repacking
    assert torch.equal(again, ref) and standin.CALLS.count("npu_convert_weight_to_int4pack") == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_bias_dtype_follows_x(monkeypatch, standin, dtype):
    """DOCS npu_weight_quant_batchmatmul, bias: "当x数据类型为bfloat16, bias需为float32; 当x数据类型为
    float16, bias需为float16" (the stand-in refuses any other; cvt once passed float32 always)."""
    mod = _w4a16(16, 64, 32, False, True)
    seen = spy(monkeypatch, standin, "npu_weight_quant_batchmatmul")
    ref, got, calls = both(mod, torch.randn(4, 64, generator=gen(6)).to(dtype), monkeypatch, standin)
    assert calls[-1] == "npu_weight_quant_batchmatmul"
    (_, kw), = seen
    assert kw["bias"].dtype == (torch.float16 if dtype == torch.float16 else torch.float32)
    assert kw["antiquant_scale"].dtype == dtype
    torch.testing.assert_close(got, ref, rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("n,k,g,fused", [
    (16, 64, 16, False),    # group 16 (4 groups): below 32
    (16, 96, 48, False),    # group 48 (2 groups): not a multiple of 32
    (16, 192, 96, True),    # group 96: a multiple of 32 in [32, k - 1]
    (16, 64, 32, True),     # group 32: the smallest the op takes
    (16, 48, 48, True),     # one group over k=48: the per-channel mode (antiquant_group_size 0)
])
def test_w4a16_group_sizes_the_op_refuses_fall_back(monkeypatch, standin, n, k, g, fused):
    """DOCS npu_weight_quant_batchmatmul, antiquant_group_size: "per-group场景下要求传入值的范围为
    [32, K-1]且必须是32的倍数" (0 = per channel); other group sizes run the reference."""
    mod = _w4a16(n, k, g, False, True)
    x = torch.randn(3, k, generator=gen(4)).bfloat16()
    ref, got, calls = both(mod, x, monkeypatch, standin)
    if fused:
        assert calls == ["npu_convert_weight_to_int4pack", "npu_weight_quant_batchmatmul"]
        assert mod._npu_state["group_size"] == (0 if g == k else g)
        torch.testing.assert_close(got, ref, rtol=2 ** -7, atol=1e-2)
    else:
        assert calls == [] and torch.equal(got, ref)


@pytest.mark.parametrize("fmt", ["w8a8_dynamic", "w8a8_static", "w4a16"])
def test_k_or_n_beyond_65535_falls_back(monkeypatch, standin, fmt):
    """DOCS npu_quant_matmul: "x1与x2最后一维的shape大小不能超过65535"; DOCS
    npu_weight_quant_batchmatmul: "K、N的范围为[1, 65535]"."""
    if fmt == "w8a8_dynamic":
        mod, k = _dynamic(65536, 16, False), 16
    elif fmt == "w8a8_static":
        mod, k = _static(8, 65536, 2.0 ** -5, 0.0, False, False), 65536
    else:
        mod, k = _w4a16(8, 65600, 65600, True, False), 65600
    x = torch.randn(2, k, generator=gen(2)).bfloat16()
    ref, got, calls = both(mod, x, monkeypatch, standin)
    assert calls == [] and torch.equal(got, ref)


@pytest.mark.parametrize("fmt", ["w8a8_dynamic", "w8a8_static", "w4a16"])
def test_empty_input_falls_back(monkeypatch, standin, fmt):
    """DOCS npu_weight_quant_batchmatmul: "不支持空Tensor输入"; no op gets an empty input."""
    mod = {"w8a8_dynamic": lambda: _dynamic(16, 32, True),
           "w8a8_static": lambda: _static(16, 32, 2.0 ** -5, 0.0, True, False),
           "w4a16": lambda: _w4a16(16, 64, 32, False, True)}[fmt]()
    x = torch.randn(0, mod.in_features).bfloat16()
    ref, got, calls = both(mod, x, monkeypatch, standin)
    assert calls.count("npu_quant_matmul") == calls.count("npu_weight_quant_batchmatmul") == 0
    assert got.shape == ref.shape == (0, mod.out_features)


def test_w4a16_offset_sign_matters(monkeypatch, standin):
    """With a negated offset the fused path would be visibly wrong: the test above would catch it."""
    mod = _w4a16(16, 64, 32, False, False)
    x = torch.randn(4, 64, generator=gen(2)).bfloat16()
    ref, got, _ = both(mod, x, monkeypatch, standin)
    wrong = K.W4A16Linear.from_parts({"weight_int4": mod.weight_int4, "weight_scale": mod.weight_scale,
                                      "weight_offset": -mod.weight_offset})
    monkeypatch.delenv(npu.ENV_FORCE, raising=False)
    assert (wrong(x) - ref).abs().max() > 10 * (got - ref).abs().max() + 1e-2


def test_w4a16_unpackable_width_falls_back(monkeypatch, standin):
    mod = _w4a16(12, 64, 32, False, True)  # 12 output channels: int4pack needs a multiple of 8
    x = torch.randn(2, 64, generator=gen(1)).bfloat16()
    ref, got, calls = both(mod, x, monkeypatch, standin)
    assert calls == [] and torch.equal(got, ref)


def test_int4pack_layout_worked_example(standin):
    """The N-packed layout as the stand-in models it: element 8j+i in bits 4i (two's complement nibbles)."""
    w = torch.tensor([[1, -2, 3, -4, 5, -6, 7, -8]], dtype=torch.int32)
    assert standin.npu_convert_weight_to_int4pack(w).tolist() == [[0x87A5C3E1 - 2**32]]
    # ... which is the Ascend int8 two-per-byte form (even element low nibble) viewed as int32
    assert torch.equal(int4.pack_int4_ascend(w.to(torch.int8), 1).view(torch.int32),
                       standin.npu_convert_weight_to_int4pack(w))


@pytest.mark.parametrize("fmt", ["fp8_block", "nvfp4", "mxfp4"])
def test_formats_without_fused_op_run_their_torch_path(monkeypatch, standin, fmt):
    g = gen(0)
    if fmt == "fp8_block":
        mod = K.Fp8BlockLinear.from_parts({"weight": (torch.randn(40, 64, generator=g) * 10).to(torch.float8_e4m3fn),
                                           "weight_scale_inv": torch.rand(1, 1, generator=g)})
    elif fmt == "nvfp4":
        mod = K.NvFp4Linear.from_parts({"weight_fp4": torch.randint(0, 16, (8, 32), dtype=torch.uint8, generator=g),
                                        "weight_scale": torch.rand(8, 2, generator=g).to(torch.float8_e4m3fn),
                                        "weight_global_scale": torch.tensor([3.0])})
    else:
        mod = K.MxFp4Linear.from_parts({"weight_fp4": torch.randint(0, 16, (8, 64), dtype=torch.uint8, generator=g),
                                        "weight_scale": torch.randint(120, 130, (8, 2), dtype=torch.uint8, generator=g)})
    x = torch.randn(3, mod.in_features, generator=g).bfloat16()
    monkeypatch.setenv(npu.ENV_FORCE, "1")
    got = mod(x)
    monkeypatch.delenv(npu.ENV_FORCE)
    assert standin.CALLS == [] and torch.equal(got, mod(x))


def _rtn_modules(model):
    """Swap every attention/MoE linear of a loaded model for W8A8-dynamic or W4A16 (RTN, here in
    the test), so that a forward pass exercises both fused paths."""
    from cvt.runtime.kernels import Linear

    for name, mod in list(model.named_modules()):
        if not isinstance(mod, Linear) or type(mod) is not Linear or "kv_b_proj" in name or name == "lm_head":
            continue
        w = mod.weight.float()
        parent = model.get_submodule(name.rpartition(".")[0])
        if ".experts." in name:  # W4A16, group 32, symmetric
            g = w.view(w.shape[0], -1, 32)
            scale = (g.abs().amax(-1) / 7).clamp(min=1e-8)
            q = (g / scale[..., None]).round().clamp(-8, 7).to(torch.int8).view_as(w)
            new = int4.W4A16Linear.from_parts({"weight_int4": q, "weight_scale": scale, "weight_offset": torch.zeros_like(scale)})
        else:  # W8A8 dynamic, per output channel
            scale = (w.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-8)
            q = (w / scale).round().clamp(-128, 127).to(torch.int8)
            new = int8.W8A8DynamicLinear.from_parts({"weight": q, "weight_scale": scale, "weight_offset": torch.zeros_like(scale)})
        setattr(parent, name.rpartition(".")[2], new)


@pytest.mark.slow
def test_whole_model_npu_path_matches_reference_kernels(trained_fixture, standin, monkeypatch):
    """The DeepSeek-V3 fixture with W8A8-dynamic attention and W4A16 experts (bf16 activations, as
    on an NPU): every quantized linear, fed the input it got in the reference forward, gives the
    reference kernel's output through the (stand-in) Ascend ops; the whole forward through them
    stays near the reference logits. (The reference quantizes activations per token the way
    npu_dynamic_quant's kernel rounds; when it divided by the scale instead, the ties it rounded
    the other way, a few % of rows, moved this tiny model's logits far more than the
    accumulation order below, which is what this test measures.)

    Per linear, on identical inputs: a W4A16 matmul rounds to bf16 after summing in another
    order than the reference's bf16 GEMM (which one differs by a unit depends on the CPU), so
    the next layer's per-token int8 quantization can flip on it and a MoE router behind that
    pick another expert for a token. The whole forward is therefore held to two bf16 units on
    all but 1/8 of the positions, not on all of them."""
    from cvt.runtime.loader import load_model

    monkeypatch.delenv(npu.ENV_FORCE, raising=False)
    model = load_model(trained_fixture, dtype=torch.bfloat16).model
    _rtn_modules(model)
    quantized = {n: m for n, m in model.named_modules()
                 if isinstance(m, (int8.W8A8DynamicLinear, int4.W4A16Linear))}
    seen = {}

    def keep(name):
        def hook(_m, args, out):
            seen.setdefault(name, (args[0], out))
        return hook

    hooks = [m.register_forward_hook(keep(n)) for n, m in quantized.items()]
    tokens = torch.tensor([[256, 35, 105, 110, 99, 108, 117, 100, 101, 32, 60, 108]])
    ref = model(tokens)
    for h in hooks:
        h.remove()
    monkeypatch.setenv(npu.ENV_FORCE, "1")
    fused = model(tokens)
    assert standin.CALLS, "the fused path was not taken"
    called = {c[0] if isinstance(c, tuple) else c for c in standin.CALLS}
    assert {"npu_dynamic_quant", "npu_quant_matmul", "npu_weight_quant_batchmatmul"} <= called, called
    kinds = set()
    for name, (x, y) in seen.items():
        got = quantized[name](x)
        if isinstance(quantized[name], int8.W8A8DynamicLinear):  # the kernel's codes, the reference's steps
            assert torch.equal(got, y) and torch.equal(got, dynamic_as_documented(quantized[name], x)), name
        else:  # the same dequantized weight, summed in another order: a bf16 unit of the output
            torch.testing.assert_close(got, y, rtol=2 ** -7, atol=2 ** -7 * y.abs().max().item(), msg=name)
        kinds.add(type(quantized[name]))
    assert len(kinds) == 2
    two_bf16_ulps = 2.0 ** (math.floor(math.log2(ref.abs().max().item())) - 6)
    off = ~((fused - ref).abs().amax(-1) <= two_bf16_ulps)                   # [1, positions]; NaN is off
    assert off.sum() <= off.numel() // 8, (fused - ref).abs().amax(-1)
