"""Contract test: no NPU exists here.

`cvt.runtime.kernels.npu` is run against tests/runtime/npu_standin/torch_npu, a plain-torch
model of the documented semantics of every torch_npu op it calls (argument order and
keywords, dtypes and shapes accepted, N-packed int4 layout, the antiquant offset's plus sign,
per-token dynamic quant outputs), written from the torch_npu / CANN references and not from
cvt's kernels. The path is forced onto CPU tensors with CVT_FORCE_NPU_KERNELS=1, and each
format's fused output must equal its torch reference. What this proves: cvt calls the ops as
documented and composes them into the same math. What it cannot prove: that the real ops
behave as documented (the `npu` marker is for tests on a real device).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from cvt.runtime import kernels as K
from cvt.runtime.kernels import int4, int8, npu

STANDIN = Path(__file__).parent / "npu_standin"


@pytest.fixture
def no_npu(monkeypatch):
    monkeypatch.delenv(npu.ENV_FORCE, raising=False)


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.syspath_prepend(str(STANDIN))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    import torch_npu

    assert getattr(torch_npu, "__cvt_standin__", False) and Path(torch_npu.__file__).is_relative_to(STANDIN)
    torch_npu.CALLS.clear()
    yield torch_npu
    sys.modules.pop("torch_npu", None)


def both(mod, x, monkeypatch, standin):
    """(reference output, npu-path output, ops called by prepare + forward) for `mod` and `x`."""
    monkeypatch.delenv(npu.ENV_FORCE, raising=False)
    ref = mod(x)
    monkeypatch.setenv(npu.ENV_FORCE, "1")
    standin.CALLS.clear()
    mod.prepare_for_npu()  # what the loader does once; its ops are counted too
    got = mod(x)
    calls = list(standin.CALLS)
    monkeypatch.delenv(npu.ENV_FORCE, raising=False)
    assert torch.equal(mod(x), ref), "preparing for the NPU changed the reference result"
    return ref, got, calls


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_selection(monkeypatch, no_npu):
    assert not npu.enabled("cpu") and not npu.enabled(torch.device("cpu"))
    if npu.torch_npu_module() is None:  # the usual case here: no torch_npu installed
        assert not npu.enabled("npu:0") and not npu.enabled("cpu", force=True)
    monkeypatch.syspath_prepend(str(STANDIN))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    try:
        assert npu.enabled("npu:0") and npu.enabled("npu")
        assert not npu.enabled("cpu")
        assert npu.enabled("cpu", force=True)
        monkeypatch.setenv(npu.ENV_FORCE, "1")
        assert npu.enabled(torch.device("cpu")) and not npu.enabled("cpu", force=False)
    finally:
        sys.modules.pop("torch_npu", None)


def test_prepare_is_a_no_op_when_disabled(no_npu):
    q = torch.randint(-128, 128, (16, 32), dtype=torch.int8, generator=gen(0))
    mod = K.W8A8DynamicLinear.from_parts({"weight": q, "weight_scale": torch.ones(16, 1),
                                          "weight_offset": torch.zeros(16, 1)})
    mod.prepare_for_npu()
    assert mod._npu_state is None and mod.weight.is_contiguous()


def _dynamic(n, k, bias, seed=0):
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen(seed))
    s = torch.rand(n, 1, generator=gen(seed + 1)) * 0.01 + 1e-4
    b = torch.randn(n, generator=gen(seed + 2)) if bias else None
    return K.W8A8DynamicLinear.from_parts({"weight": q, "weight_scale": s, "weight_offset": torch.zeros(n, 1)}, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_dynamic(monkeypatch, standin, dtype, bias):
    mod = _dynamic(40, 96, bias)
    x = torch.randn(2, 7, 96, generator=gen(5)).to(dtype)
    x[1, 3] = 0
    ref, got, calls = both(mod, x, monkeypatch, standin)
    assert calls == ["npu_dynamic_quant", "npu_quant_matmul"]
    assert got.dtype == dtype and got.shape == (2, 7, 40)
    assert torch.equal(got, ref)
    assert mod._npu_state["w_kn"].shape == (96, 40) and mod._npu_state["w_kn"].is_contiguous()


def test_float32_input_takes_the_reference(monkeypatch, standin):
    mod = _dynamic(16, 32, True)
    x = torch.randn(3, 32, generator=gen(1))
    ref, got, calls = both(mod, x, monkeypatch, standin)
    assert calls == [] and torch.equal(got, ref)


def _static(n, k, in_scale, in_off, bias, deq_i64, seed=0):
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen(seed))
    ws = torch.rand(n, generator=gen(seed + 1)) * 0.01 + 1e-4
    deq = (torch.tensor(in_scale) * ws).float()
    b = torch.randn(n, generator=gen(seed + 2)) if bias else None
    qb = int8.quant_bias_from(b, q, torch.tensor([in_off]), deq)
    return K.W8A8StaticLinear.from_parts({
        "weight": q, "input_scale": torch.tensor([in_scale]), "input_offset": torch.tensor([in_off]),
        "deq_scale": int8.deq_scale_int64(deq) if deq_i64 else deq, "quant_bias": qb})


@pytest.mark.parametrize("dtype,deq_i64,expect_trans", [
    (torch.bfloat16, False, False), (torch.bfloat16, True, False),
    (torch.float16, True, False), (torch.float16, False, True)])
@pytest.mark.parametrize("in_scale,fused_quant", [(2.0 ** -5, True), (0.0317, False)])
def test_w8a8_static(monkeypatch, standin, dtype, deq_i64, expect_trans, in_scale, fused_quant):
    mod = _static(48, 64, in_scale, -3.0, True, deq_i64)
    x = (torch.randn(5, 64, generator=gen(7)) * 1.5).to(dtype)
    x[0, :4] = torch.tensor([0.75, -0.25, 20.0, -20.0]).to(dtype)  # a tie and saturation
    ref, got, calls = both(mod, x, monkeypatch, standin)
    expected = (["npu_trans_quant_param"] if expect_trans else []) + (["npu_quantize"] if fused_quant else [])
    assert calls == expected + ["npu_quant_matmul"]
    assert got.dtype == dtype and torch.equal(got, ref)


def test_w8a8_static_extra_float_bias(monkeypatch, standin):
    mod = _static(16, 32, 2.0 ** -4, 0.0, False, False)
    mod.bias = torch.nn.Parameter(torch.randn(16, generator=gen(3)), requires_grad=False)
    ref, got, _ = both(mod, torch.randn(4, 32, generator=gen(4)).bfloat16(), monkeypatch, standin)
    assert torch.equal(got, ref)


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


def test_whole_model_npu_path_matches_reference_kernels(trained_fixture, standin, monkeypatch):
    """The DeepSeek-V3 fixture with W8A8-dynamic attention and W4A16 experts (bf16 activations, as
    on an NPU): every quantized linear, fed the input it got in the reference forward, gives the
    reference kernel's output through the (stand-in) Ascend ops; the whole forward through them
    stays near the reference logits.

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
        if isinstance(quantized[name], int8.W8A8DynamicLinear):  # the same integers and float steps
            assert torch.equal(got, y), name
        else:  # the same dequantized weight, summed in another order: a bf16 unit of the output
            torch.testing.assert_close(got, y, rtol=2 ** -7, atol=2 ** -7 * y.abs().max().item(), msg=name)
        kinds.add(type(quantized[name]))
    assert len(kinds) == 2
    two_bf16_ulps = 2.0 ** (math.floor(math.log2(ref.abs().max().item())) - 6)
    off = ~((fused - ref).abs().amax(-1) <= two_bf16_ulps)                   # [1, positions]; NaN is off
    assert off.sum() <= off.numel() // 8, (fused - ref).abs().amax(-1)
