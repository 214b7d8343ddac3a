"""Contract test: no NPU exists here.

`cvt.runtime.kernels.npu` is run against tests/runtime/npu_standin/torch_npu, a plain-torch
model of the documented semantics of every torch_npu op it calls (argument order and
keywords, dtypes and shapes accepted, N-packed int4 layout, the antiquant offset's plus sign,
per-token dynamic quant outputs), written from the torch_npu / CANN references and not from
cvt's kernels. The path is forced onto CPU tensors with CVT_FORCE_NPU_KERNELS=1, and each
format's fused output must equal its torch reference. What this proves: cvt calls the ops as
documented and composes them into the same math. What it cannot prove: that the real ops
behave as documented (the `npu` marker is for tests on a real device).

The documented rules are those of the torch_npu 2.14.0 wheel: ``torch_npu/_op_plugin_docs.py``
(DOCS) and ``torch_npu/op_plugin/meta/_meta_registrations.py`` (META), with the CANN ops-nn
kernels where the docstrings leave the arithmetic open. The `standin` fixture enforces them on
top of the stand-in package (`strict_ops`: each op cvt calls raises where the real one refuses
the call, npu_dynamic_quant rounds ``x * (127 / rowmax)``, and int64 scales are read as FP19),
so these tests fail where a real NPU would. Each rule cvt once broke has a test here that fails
on that behaviour: the bias dtype (float16 for float16 x) and group-size (0, or a multiple of
32 in [32, k - 1]) rules of npu_weight_quant_batchmatmul, the FP19 truncation of the float16
static W8A8 deq_scale, and the module docstring's claims (npu_dynamic_quant's multiply by
``127 / rowmax``, npu_trans_quant_param's FP19 layout).

The stand-in's rules, the fixtures and the shared module builders are in npu_contract_rules.py;
this file holds the op selection, W8A8 (dynamic and static) and the stand-in's own rules;
test_npu_contract_w4a16.py holds W4A16, the fallbacks, the formats without a fused op and the
whole model.
"""

from __future__ import annotations

import sys

import pytest
import torch

from cvt.qtensor import primitives
from cvt.runtime import kernels as K
from cvt.runtime.kernels import int8, npu
from cvt.tests.runtime.npu_contract_rules import (STANDIN, _dynamic, _fp19, _static, both, dynamic_as_documented, gen,
                                                  kernel_per_token_quant, spy)
from cvt.tests.runtime.npu_contract_rules import no_npu, standin  # noqa: F401 (fixtures)


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


TIES = {  # rows whose second element is -+rowmax / 2, where the two roundings part
    # bf16: x * fl(127 / rowmax) is exactly -63.5 (-> -64, half to even), x / fl(rowmax / 127) -63.499996 (-> -63)
    torch.bfloat16: [2.796875, -1.3984375, 0.5],
    # fp16: x * fl(127 / rowmax) is exactly 63.5 (-> 64, half to even), x / fl(rowmax / 127) 63.499996 (-> 63)
    torch.float16: [2.001953125, 1.0009765625, -0.25],
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_dynamic(monkeypatch, standin, dtype, bias):
    mod = _dynamic(40, 96, bias)
    x = torch.randn(2, 7, 96, generator=gen(5)).to(dtype)
    x[1, 3] = 0  # an all-zero row
    # a row with a tie (x = +-rowmax / 2) that x / scale rounds the other way (next test)
    x[0, 2] = x[0, 2].clamp(-2, 2)
    x[0, 2, :2] = torch.tensor(TIES[dtype][:2])
    ref, got, calls = both(mod, x, monkeypatch, standin)
    assert calls == ["npu_dynamic_quant", "npu_quant_matmul"]
    assert got.dtype == dtype and got.shape == (2, 7, 40)
    assert torch.equal(got, dynamic_as_documented(mod, x))
    # the reference quantizes tokens as the kernel does (ties included), so it is the same output
    x2 = x.reshape(-1, 96)
    assert torch.equal(kernel_per_token_quant(x2)[0], primitives.per_token_quant(x2)[0])
    assert torch.equal(got, ref)
    assert mod._npu_state["w_kn"].shape == (96, 40) and mod._npu_state["w_kn"].is_contiguous()


@pytest.mark.parametrize("dtype,row,col,kernel_code,division_code", [
    (torch.bfloat16, TIES[torch.bfloat16], 1, -64, -63), (torch.float16, TIES[torch.float16], 1, 64, 63)])
def test_dynamic_quant_multiplies_by_127_over_rowmax(standin, dtype, row, col, kernel_code, division_code):
    """npu_dynamic_quant's codes are round(x * (127 / rowmax)), not the docstring's round(x / scale)
    (ops-nn dynamic_quant.h; DOCS npu_dynamic_quant for the scale = rowMax(|x|) / 127 it returns)."""
    x = torch.tensor([row], dtype=torch.float32).to(dtype)
    y, scale = standin.npu_dynamic_quant(x)
    assert y.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (1,)
    xf = x.float()
    by_division = torch.round(xf / (xf.abs().amax() / 127.0))  # the docstring's round(x / scale)
    assert int(y[0, col]) == kernel_code and int(by_division[0, col]) == division_code
    assert float(scale[0]) == float(torch.tensor(row[0]) / 127.0)
    assert torch.equal(y, kernel_per_token_quant(x)[0])


@pytest.mark.parametrize("dtype,row,col,kernel_code", [
    (torch.bfloat16, TIES[torch.bfloat16], 1, -64), (torch.float16, TIES[torch.float16], 1, 64),
    # the factor must be ONE float32 division: fl(127 / 2.96875) gives 63.499996 (-> 63), where
    # torch's 127.0 / t (t.reciprocal() * 127) gives 63.500004 (-> 64), as does x / scale (63.5)
    (torch.bfloat16, [2.96875, 1.484375, 0.0], 1, 63)])
def test_reference_per_token_quant_rounds_as_the_serving_kernels(dtype, row, col, kernel_code):
    """cvt's reference per-token quantization (`primitives.per_token_quant`, the CPU/GPU path of every
    W8A8_DYNAMIC and W4A8 linear) multiplies by the float32 factor 127 / rowmax, as vLLM's CUDA
    kernel (csrc/quantization/w8a8/int8/scaled_quant.cu, dynamic_scaled_int8_quant_kernel:
    inv_s = 127.f / absmax, cvt.rni.sat.s8.f32) and npu_dynamic_quant (ops-nn dynamic_quant.h)
    do: on these tie rows x / scale would round the other way (the codes are worked by hand in
    TIES and below). A zero row gets codes 0 and scale 0 (vLLM: inv_s = 0)."""
    x = torch.tensor([row, [0.0] * len(row)], dtype=torch.float32).to(dtype)
    q, scale = primitives.per_token_quant(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (2,)
    assert int(q[0, col]) == kernel_code
    assert float(scale[0]) == float(torch.tensor(abs(row[0])) / 127.0)
    assert q[1].tolist() == [0] * len(row) and float(scale[1]) == 0.0


def test_reference_per_token_quant_saturates_a_tiny_row():
    """amax below 127 / FLT_MAX: the float32 factor is inf, so the row saturates as vLLM's
    cvt.rni.sat.s8.f32 does (+-inf -> 127 / -128), and its zeros (0 * inf = NaN) stay 0."""
    x = torch.tensor([[1e-37, -5e-38, 0.0, 2e-38], [3.0, -1.5, 0.0, 0.75]])
    q, scale = primitives.per_token_quant(x)
    assert q.tolist() == [[127, -128, 0, 127], [127, -64, 0, 32]]  # 0.75 * 127 / 3 = 31.75 -> 32
    assert float(scale[0]) == float(torch.tensor(1e-37) / 127.0) and float(scale[1]) == float(torch.tensor(3.0) / 127)


def test_w8a8_dynamic_zero_row_codes_are_not_used(monkeypatch, standin):
    """An all-zero row: the docstring has no guard (127 / 0) and the kernel's codes for it are
    unspecified; its scale is 0, so cvt's output for it is the bias whatever the codes are."""
    real = standin.npu_dynamic_quant

    def garbage_on_zero_rows(x, **kw):
        y, s = real(x, **kw)
        return torch.where((s == 0).unsqueeze(-1), torch.full_like(y, 127), y), s

    monkeypatch.setattr(standin, "npu_dynamic_quant", garbage_on_zero_rows)
    mod = _dynamic(24, 64, True)
    x = torch.randn(3, 64, generator=gen(8)).bfloat16()
    x[1] = 0
    ref, got, _ = both(mod, x, monkeypatch, standin)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[1], mod.bias.bfloat16())


def test_float32_input_takes_the_reference(monkeypatch, standin):
    mod = _dynamic(16, 32, True)
    x = torch.randn(3, 32, generator=gen(1))
    ref, got, calls = both(mod, x, monkeypatch, standin)
    assert calls == [] and torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("deq_i64", [False, True])
@pytest.mark.parametrize("fp19", [False, True])
@pytest.mark.parametrize("in_scale,fused_quant", [(2.0 ** -5, True), (0.0317, False)])
def test_w8a8_static(monkeypatch, standin, dtype, deq_i64, fp19, in_scale, fused_quant):
    mod = _static(48, 64, in_scale, -3.0, True, deq_i64, fp19=fp19)
    x = (torch.randn(5, 64, generator=gen(7)) * 1.5).to(dtype)
    x[0, :4] = torch.tensor([0.75, -0.25, 20.0, -20.0]).to(dtype)  # a tie and saturation
    ref, got, calls = both(mod, x, monkeypatch, standin)
    assert got.dtype == dtype and torch.equal(got, ref)  # integer sums: exact on any CPU
    # fp16 output takes the int64 (FP19) scale form only when it is exact (see the next test)
    expect_trans = dtype == torch.float16 and fp19
    expected = (["npu_trans_quant_param"] if expect_trans else []) + (["npu_quantize"] if fused_quant else [])
    assert calls == expected + ["npu_quant_matmul"]


@pytest.mark.parametrize("deq_i64", [False, True])
def test_w8a8_static_fp16_deq_scale_is_not_truncated_to_fp19(monkeypatch, standin, deq_i64):
    """fp16 output without pertoken_scale multiplies by the FP19 form of the scale (an int64 from
    npu_trans_quant_param, or a float32 one the op converts itself -- DOCS npu_quant_matmul's
    example, "Method 1" / "Method 2"; op-plugin QuantMatmulKernelNpuOpApi.cpp), up to 2**-10
    below the float32 deq_scale the reference uses. cvt once passed its stored int64 or
    npu_trans_quant_param's, and its fp16 output was off by that truncation. It passes the
    float32 deq_scale with a pertoken_scale of ones instead (DOCS npu_quant_matmul table: int8 x1,
    float32 scale, float32 pertoken_scale, float16 output), which is not truncated."""
    mod = _static(48, 64, 0.0317, -3.0, True, deq_i64)
    x = (torch.randn(6, 64, generator=gen(3)) * 1.5).half()
    qmm = spy(monkeypatch, standin, "npu_quant_matmul")
    ref, got, calls = both(mod, x, monkeypatch, standin)
    assert torch.equal(got, ref)
    assert calls == ["npu_quant_matmul"]
    (args, kw), = qmm
    assert args[2].dtype == torch.float32 and torch.equal(kw["pertoken_scale"], torch.ones(6))
    # ... and the int64 form would have been visibly off: the truncation matters on these inputs
    xq = primitives.static_quant(x, mod.input_scale, mod.input_offset)
    deq = primitives.deq_scale_f32(mod.deq_scale)
    via_fp19 = standin.npu_quant_matmul(xq, mod._npu_state["w_kn"], standin.npu_trans_quant_param(deq),
                                        bias=mod.quant_bias, output_dtype=torch.float16)
    assert not torch.equal(via_fp19, ref)
    assert torch.equal(via_fp19, ((int8.int8_matmul(xq, mod.weight) + mod.quant_bias).float() * _fp19(deq)).half())


def test_trans_quant_param_fp19_worked_example(standin):
    """FP19 bit layout (DOCS npu_trans_quant_param round_mode 0 = truncation; ops-nn
    trans_quant_param_v2: out = (scale & 0xFFFFE000) | (1 << 46)): sign, exponent and 10 mantissa
    bits of the float32 in bits 0-31, the low 13 cleared, bit 46 set."""
    s = torch.tensor([1.0, 1.0 + 2.0 ** -10 + 2.0 ** -11, -(2.0 ** -20) * (1 + 2.0 ** -23)], dtype=torch.float32)
    got = standin.npu_trans_quant_param(s)
    assert got.dtype == torch.int64 and got.shape == (3,)
    assert got.tolist() == [0x3F800000 | 1 << 46, 0x3F802000 | 1 << 46, 0xB5800000 | 1 << 46]
    low = (got & 0xFFFFFFFF).to(torch.int64)
    f = torch.where(low >= 2**31, low - 2**32, low).to(torch.int32).view(torch.float32)
    assert f.tolist() == [1.0, 1.0 + 2.0 ** -10, -(2.0 ** -20)]  # truncated toward zero


def test_quant_matmul_reads_scales_as_the_hardware_does(standin):
    """The stand-in's npu_quant_matmul multiplies by the scale the hardware uses: an int64 scale
    read as FP19 whoever produced it (npu_trans_quant_param, or cvt's own full-float32 int64
    `primitives.deq_scale_int64`), and a float32 scale for float16 output without pertoken_scale
    truncated the same way inside the op (op-plugin QuantMatmulKernelNpuOpApi.cpp calls
    npu_trans_quant_param); with a pertoken_scale the float32 scale is used as it is (DOCS
    npu_quant_matmul A2/A3 table: int8 x1, float32 scale, float32 pertoken_scale, float16 out)."""
    x1, x2 = torch.ones(1, 1, dtype=torch.int8), torch.ones(1, 1, dtype=torch.int8)
    s = torch.tensor([1.0 + 2.0 ** -11 + 2.0 ** -12])  # float16(1 * s) = 1 + 2**-10; FP19(s) = 1
    fp16 = {"output_dtype": torch.float16}
    truncated = [standin.npu_quant_matmul(x1, x2, s, **fp16),
                 standin.npu_quant_matmul(x1, x2, standin.npu_trans_quant_param(s), **fp16),
                 standin.npu_quant_matmul(x1, x2, primitives.deq_scale_int64(s), **fp16)]
    assert [float(t) for t in truncated] == [1.0, 1.0, 1.0]
    kept = standin.npu_quant_matmul(x1, x2, s, pertoken_scale=torch.ones(1), **fp16)
    assert float(kept) == 1.0 + 2.0 ** -10


def _wqbmm_args(standin, x_dtype=torch.float16, k=64, n=16):
    x = torch.zeros(2, k, dtype=x_dtype)
    w = standin.npu_convert_weight_to_int4pack(torch.zeros(k, n, dtype=torch.int32))  # (k, n / 8)
    return x, w, torch.ones(n, dtype=x_dtype)


REFUSED = {  # calls the real torch_npu 2.14 refuses (the rule each breaks is in the message)
    "wqbmm float32 bias, float16 x": lambda t: t.npu_weight_quant_batchmatmul(
        *_wqbmm_args(t), bias=torch.zeros(16, dtype=torch.float32)),
    "wqbmm float16 bias, bfloat16 x": lambda t: t.npu_weight_quant_batchmatmul(
        *_wqbmm_args(t, torch.bfloat16), bias=torch.zeros(16, dtype=torch.float16)),
    "wqbmm antiquant_scale not in x's dtype": lambda t: t.npu_weight_quant_batchmatmul(
        *_wqbmm_args(t)[:2], torch.ones(16, dtype=torch.bfloat16)),
    "wqbmm group 16": lambda t: t.npu_weight_quant_batchmatmul(
        *_wqbmm_args(t)[:2], torch.ones(4, 16, dtype=torch.float16), antiquant_group_size=16),
    "wqbmm group 48": lambda t: t.npu_weight_quant_batchmatmul(
        *_wqbmm_args(t, k=96)[:2], torch.ones(2, 16, dtype=torch.float16), antiquant_group_size=48),
    "wqbmm group k": lambda t: t.npu_weight_quant_batchmatmul(
        *_wqbmm_args(t)[:2], torch.ones(1, 16, dtype=torch.float16), antiquant_group_size=64),
    "wqbmm per-group scale shape": lambda t: t.npu_weight_quant_batchmatmul(
        *_wqbmm_args(t), antiquant_group_size=32),
    "wqbmm per-channel scale shape": lambda t: t.npu_weight_quant_batchmatmul(
        *_wqbmm_args(t)[:2], torch.ones(2, 16, dtype=torch.float16)),
    "wqbmm offset shape": lambda t: t.npu_weight_quant_batchmatmul(
        *_wqbmm_args(t), antiquant_offset=torch.ones(1, 16, dtype=torch.float16)),
    "quant_matmul float16 bias without pertoken": lambda t: t.npu_quant_matmul(
        torch.ones(1, 4, dtype=torch.int8), torch.ones(4, 2, dtype=torch.int8), torch.ones(2),
        bias=torch.zeros(2, dtype=torch.float16), output_dtype=torch.float16),
    "quant_matmul bfloat16 bias, float16 output": lambda t: t.npu_quant_matmul(
        torch.ones(1, 4, dtype=torch.int8), torch.ones(4, 2, dtype=torch.int8), torch.ones(2),
        pertoken_scale=torch.ones(1), bias=torch.zeros(2, dtype=torch.bfloat16), output_dtype=torch.float16),
    "quant_matmul int64 scale, bfloat16 output": lambda t: t.npu_quant_matmul(
        torch.ones(1, 4, dtype=torch.int8), torch.ones(4, 2, dtype=torch.int8),
        t.npu_trans_quant_param(torch.ones(2)), output_dtype=torch.bfloat16),
    "dynamic_quant 1-D x": lambda t: t.npu_dynamic_quant(torch.ones(8, dtype=torch.float16)),
    "dynamic_quant float32 x": lambda t: t.npu_dynamic_quant(torch.ones(2, 8)),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_standin_refuses_what_torch_npu_refuses(standin, case):
    """The stand-in raises where the real op does (DOCS npu_weight_quant_batchmatmul: bias "当x数据类型为
    bfloat16, bias需为float32; 当x数据类型为float16, bias需为float16", antiquant_scale dtype "需与x保持一致",
    antiquant_group_size "范围为[32, K-1]且必须是32的倍数", scale shape per mode; META
    quant_matmul_bias_dtype_check; DOCS npu_quant_matmul table; DOCS npu_dynamic_quant "输入x的维度必须大于1"),
    so a contract test fails where a real NPU would."""
    with pytest.raises(RuntimeError, match="torch_npu 2.14 rule"):
        REFUSED[case](standin)


def test_standin_accepts_the_documented_calls(standin):
    """... and takes the calls the rules allow (so the refusals above are the rules, not typos)."""
    x, w, s = _wqbmm_args(standin)
    assert standin.npu_weight_quant_batchmatmul(x, w, s, bias=torch.zeros(16, dtype=torch.float16)).shape == (2, 16)
    xb, wb, sb = _wqbmm_args(standin, torch.bfloat16)
    assert standin.npu_weight_quant_batchmatmul(xb, wb, sb, bias=torch.zeros(16)).dtype == torch.bfloat16
    assert standin.npu_weight_quant_batchmatmul(x, w, torch.ones(2, 16, dtype=torch.float16),
                                                antiquant_group_size=32).shape == (2, 16)
    x96, w96, _ = _wqbmm_args(standin, k=96)
    assert standin.npu_weight_quant_batchmatmul(x96, w96, torch.ones(3, 16, dtype=torch.float16),
                                                antiquant_group_size=32).shape == (2, 16)
    _, scale = standin.npu_dynamic_quant(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert scale.tolist() == [0.0, 0.0]  # an all-zero row: scale 0 (its codes are unspecified)


def test_module_docstring_states_what_the_ops_compute():
    """The issue's "docstring claims must match the hardware": cvt.runtime.kernels.npu's op notes
    once said npu_dynamic_quant computes round(x / scale), called the int64 scale of
    npu_trans_quant_param "the hardware form of a float32 scale" without its FP19 truncation, and
    gave npu_weight_quant_batchmatmul a float32 bias. Each claim now matches DOCS / ops-nn."""
    doc = " ".join(npu.__doc__.split())

    def section(op, next_op):
        return doc[doc.index(f"``{op}("):doc.index(f"``{next_op}(")]

    dq = section("npu_dynamic_quant", "npu_quant_matmul")
    assert "MULTIPLIES: ``y = round_half_even(x * (127 / rowmax))``, scale = rowmax / 127" in dq
    assert "all-zero row" in dq and "its scale is 0" in dq
    tq = section("npu_trans_quant_param", "npu_quantize")
    assert "low 13 mantissa bits cleared" in tq and "10 mantissa bits kept" in tq
    assert "round_mode 0 truncates" in tq and "bit 46 is set" in tq
    wq = doc[doc.index("``npu_weight_quant_batchmatmul("):]
    assert "bias ``(n,)`` float16 when x is float16, float32 when x is bfloat16" in wq
    assert "multiple of 32 in [32, k - 1]" in wq


def test_w8a8_static_extra_float_bias(monkeypatch, standin):
    mod = _static(16, 32, 2.0 ** -4, 0.0, False, False)
    mod.bias = torch.nn.Parameter(torch.randn(16, generator=gen(3)), requires_grad=False)
    ref, got, _ = both(mod, torch.randn(4, 32, generator=gen(4)).bfloat16(), monkeypatch, standin)
    assert torch.equal(got, ref)
