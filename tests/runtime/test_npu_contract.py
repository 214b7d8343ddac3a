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
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from cvt.qtensor import primitives
from cvt.runtime import kernels as K
from cvt.runtime.kernels import int4, int8, npu

STANDIN = Path(__file__).parent / "npu_standin"


@pytest.fixture
def no_npu(monkeypatch):
    monkeypatch.delenv(npu.ENV_FORCE, raising=False)


@pytest.fixture
def standin(monkeypatch):
    """The stand-in torch_npu, with the documented rules of the ops cvt calls enforced on top
    (`strict_ops`): whatever the stand-in package itself checks, a call that the real torch_npu
    2.14 would refuse raises here, and the int64 / FP19 scale arithmetic is the hardware's."""
    monkeypatch.syspath_prepend(str(STANDIN))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    import torch_npu

    assert getattr(torch_npu, "__cvt_standin__", False) and Path(torch_npu.__file__).is_relative_to(STANDIN)
    for name, op in strict_ops(torch_npu).items():
        monkeypatch.setattr(torch_npu, name, op)
    torch_npu.CALLS.clear()
    yield torch_npu
    sys.modules.pop("torch_npu", None)


# ---- the documented rules ----------------------------------------------------------------------
# From the torch_npu 2.14.0 wheel: DOCS = torch_npu/_op_plugin_docs.py (the op's docstring, named
# by op), META = torch_npu/op_plugin/meta/_meta_registrations.py (the op's meta function), plus the
# CANN ops-nn kernels where the docstring leaves the arithmetic open (see cvt.runtime.kernels.npu).

FP19_LOW_BITS = 0x1FFF       # the float32 mantissa bits npu_trans_quant_param clears (round_mode 0)
FP19_KEEP = 0xFFFFE000       # sign, 8 exponent bits, 10 mantissa bits
FP19_FLAG = 1 << 46          # set in every npu_trans_quant_param output
HALF = (torch.float16, torch.bfloat16)


def _rule(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError("torch_npu 2.14 rule: " + msg)


def trans_quant_param(scale, offset=None, round_mode=0):
    """npu_trans_quant_param (DOCS npu_trans_quant_param: scale float32 (t,) or (1, n); "round_mode:
    ... 用于指定FP32填充到FP19的模式 ... 0表示截断填充"; META npu_trans_quant_param_meta: int64 out;
    ops-nn quant/trans_quant_param_v2: ``out = (scale & 0xFFFFE000) | (1 << 46)``, the offset
    ``clamp(rint(offset), -256, 255) & 0x1FF`` in bits 37-45). round_mode 1 (round half to even)
    is not used by cvt and not modelled."""
    _rule(scale.dtype == torch.float32, f"npu_trans_quant_param scale must be float32, got {scale.dtype}")
    _rule(scale.dim() == 1 or (scale.dim() == 2 and scale.shape[0] == 1),
          f"npu_trans_quant_param scale must be (t,) or (1, n), got {list(scale.shape)}")
    _rule(round_mode == 0, "round_mode 1 is not modelled here")
    q = (scale.contiguous().view(torch.int32).to(torch.int64) & FP19_KEEP) | FP19_FLAG
    if offset is not None:
        _rule(offset.dtype == torch.float32 and offset.dim() == scale.dim(), "offset must be float32 like scale")
        o = torch.round(offset.to(torch.float32)).clamp(-256, 255).to(torch.int64)
        q = (q & 0x4000FFFFFFFF) | ((o & 0x1FF) << 37)
    return q


def fp19_value(q):
    """The float32 the dequant hardware multiplies by for an int64 scale: bits 13-31 (FP19) of its
    low 32 bits -- whoever produced the int64 (cvt once passed its own full-float32 int64)."""
    low = q & FP19_KEEP
    return torch.where(low >= 2**31, low - 2**32, low).to(torch.int32).view(torch.float32)


def dynamic_quant(calls):
    def npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken",
                          dst_type_max=0.0):
        """npu_dynamic_quant as the kernel computes it (DOCS npu_dynamic_quant: fp16/bf16 x with
        more than one dim, scale = rowMax(|x|) / 127 float32 x.shape[:-1], smooth_scales multiplied
        in; ops-nn quant/dynamic_quant/op_kernel/dynamic_quant.h: factor = Div(127, rowmax) in
        float32, y = Cast(x * factor, CAST_RINT)). An all-zero row (127 / 0 = inf) has no
        documented codes: they are 127 here, so nothing may depend on them; its scale is 0."""
        calls.append("npu_dynamic_quant")
        _rule(x.dtype in HALF, f"npu_dynamic_quant x must be float16/bfloat16, got {x.dtype}")
        _rule(x.dim() > 1, "npu_dynamic_quant: 输入x的维度必须大于1")
        _rule(group_index is None and dst_type in (None, torch.int8) and quant_mode == "pertoken"
              and dst_type_max == 0.0, "only per-token int8 output without group_index is modelled")
        xf = x.to(torch.float32)
        if smooth_scales is not None:
            _rule(smooth_scales.dtype == x.dtype and tuple(smooth_scales.shape) == (x.shape[-1],),
                  "smooth_scales must be (H,) in x's dtype")
            xf = xf * smooth_scales.to(torch.float32)
        amax = xf.abs().amax(dim=-1, keepdim=True)
        factor = torch.full_like(amax, 127.0) / amax             # float32 division: Div(127, rowmax)
        y = torch.round(xf * factor).clamp(-128, 127)            # Muls, then round half to even
        y = torch.where(amax > 0, y, torch.full_like(y, 127.0))  # unspecified on a zero row
        return y.to(torch.int8), (amax / 127.0).squeeze(-1)
    return npu_dynamic_quant


def quant_matmul(real):
    def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None, **kw):
        """npu_quant_matmul's rules (DOCS npu_quant_matmul, its A2/A3 dtype table; META
        npu_quant_matmul_meta, quant_matmul_bias_dtype_check), then the stand-in's arithmetic
        with the scale the hardware uses: an int64 scale is read as FP19, and a float32 scale
        without pertoken_scale for int8/float16 output is converted by npu_trans_quant_param
        inside the op (op-plugin QuantMatmulKernelNpuOpApi.cpp), so it is truncated too."""
        _rule(not kw, f"unmodelled arguments {sorted(kw)}")
        _rule(offset is None, "offset is not modelled here")
        out = torch.int8 if output_dtype is None else output_dtype
        _rule(out in (torch.int8, torch.float16, torch.bfloat16), f"unmodelled output_dtype {output_dtype}")
        n = x2.shape[-1]
        _rule(x1.shape[-1] <= 65535 and n <= 65535, "x1与x2最后一维的shape大小不能超过65535")
        _rule(scale.dim() == 1 and scale.shape[0] in (1, n), f"scale must be (1,) or ({n},), got {list(scale.shape)}")
        _rule(scale.dtype in (torch.float32, torch.int64, torch.bfloat16), f"bad scale dtype {scale.dtype}")
        if scale.dtype == torch.bfloat16:
            _rule(out == torch.bfloat16, "When scale's dtype is bfloat16, output_dtype must be bfloat16 or int32")
        if pertoken_scale is not None:  # table: pertoken goes with a float32/bf16 scale, bf16/fp16 output
            _rule(scale.dtype != torch.int64 and out in (torch.float16, torch.bfloat16),
                  "pertoken_scale needs a float32/bfloat16 scale and bfloat16/float16 output")
        if out == torch.bfloat16:       # table: bf16 output takes a float32 or bf16 scale
            _rule(scale.dtype != torch.int64, "bfloat16 output takes a float32/bfloat16 scale, not int64")
        if bias is not None:
            if bias.dtype == torch.bfloat16:
                _rule(out == torch.bfloat16, "When bias dtype is bfloat16, output_dtype must be bfloat16")
            if bias.dtype == torch.float16:
                _rule(pertoken_scale is not None, "Bias dtype cannot be float16 when pertoken not given.")
                _rule(out == torch.float16, "When bias dtype is float16 and pertoken is given, output_dtype "
                                            "must be float16")
        if scale.dtype == torch.float32 and pertoken_scale is None and out != torch.bfloat16:
            scale = trans_quant_param(scale)
        if scale.dtype == torch.int64:  # the stand-in reads bits 0-31: hand it the FP19 value
            scale = fp19_value(scale).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        return real(x1, x2, scale, pertoken_scale=pertoken_scale, bias=bias, output_dtype=output_dtype)
    return npu_quant_matmul


def _transposed(t) -> bool:  # META is_transpose_last_two_dims
    return t.dim() >= 2 and t.stride(-2) == 1 and t.stride(-1) == t.shape[-2] and t.shape[-1] > 1


def weight_quant_batchmatmul(real):
    def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                                     quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0,
                                     weight_dtype=None):
        """npu_weight_quant_batchmatmul's rules (DOCS npu_weight_quant_batchmatmul; META
        npu_weight_quant_batchmatmul_meta; the op-plugin's group-size check), then the
        stand-in's arithmetic."""
        _rule(x.dtype in HALF and x.dim() == 2, f"x must be (M, K) float16/bfloat16, got {x.dtype} {list(x.shape)}")
        _rule(x.numel() > 0, "不支持空Tensor输入")
        _rule(weight.dim() == 2 and weight.dtype in (torch.int8, torch.int32), f"bad weight {weight.dtype}")
        _rule(not _transposed(weight), "transposed weights are not modelled here")
        k = weight.shape[0]
        n = weight.shape[1] * (8 if weight.dtype == torch.int32 else 1)  # int32 carries 8 int4 along n
        _rule(x.shape[1] == k, f"x {list(x.shape)} does not match weight (k={k})")
        _rule(1 <= k <= 65535 and 1 <= n <= 65535, "K、N的范围为[1, 65535]")
        _rule(quant_scale is None and quant_offset is None and weight_dtype is None, "not modelled here")
        _rule(inner_precise in (0, 1), "inner_precise is 0 or 1")
        # "若输入为float16、bfloat16, 其数据类型需与x保持一致" (int64 antiquant_scale: not modelled)
        _rule(antiquant_scale.dtype == x.dtype,
              f"antiquant_scale dtype {antiquant_scale.dtype} must be x's {x.dtype}")
        g = antiquant_group_size
        _rule(g == 0 or (g % 32 == 0 and 32 <= g <= k - 1),
              "antiquant_group_size can be either 0 or a multiple of 32 within the range 32 to weight_k_dim - 1 "
              f"(got {g}, k={k})")
        shape = tuple(antiquant_scale.shape)
        if g:  # "per_group模式: 输入shape为(ceil(K, antiquant_group_size), N)"
            _rule(shape == (-(-k // g), n), f"per-group antiquant_scale must be ({-(-k // g)}, {n}), got {list(shape)}")
        else:  # "per_tensor模式: (1,)或(1, 1)"; "per_channel模式: (1, N)或(N,)"
            _rule(shape in ((1,), (1, 1), (1, n), (n,)), f"per-tensor/per-channel antiquant_scale, got {list(shape)}")
        if antiquant_offset is not None:  # "其数据类型需与antiquant_scale保持一致"; "shape要保持一致"
            _rule(antiquant_offset.dtype == antiquant_scale.dtype and tuple(antiquant_offset.shape) == shape,
                  "antiquant_offset must match antiquant_scale in dtype and shape")
        if bias is not None:
            want = torch.float16 if x.dtype == torch.float16 else torch.float32
            _rule(bias.dtype == want, f"当x数据类型为bfloat16, bias需为float32; 当x数据类型为float16, bias需为float16 "
                                      f"(x {x.dtype}, bias {bias.dtype})")
            _rule(tuple(bias.shape) in ((n,), (1, n)), f"bias must be (N,) or (1, N), got {list(bias.shape)}")
            _rule(bias.is_contiguous(), "bias: 不支持非连续的Tensor")
        return real(x, weight, antiquant_scale, antiquant_offset, bias=bias, antiquant_group_size=g)
    return npu_weight_quant_batchmatmul


def strict_ops(tnpu) -> dict:
    """The ops of stand-in `tnpu` that cvt calls, with the rules above enforced."""
    calls = tnpu.CALLS

    def npu_trans_quant_param(scale, offset=None, round_mode=0):
        calls.append("npu_trans_quant_param")
        return trans_quant_param(scale, offset, round_mode)

    return {"npu_trans_quant_param": npu_trans_quant_param, "npu_dynamic_quant": dynamic_quant(calls),
            "npu_quant_matmul": quant_matmul(tnpu.npu_quant_matmul),
            "npu_weight_quant_batchmatmul": weight_quant_batchmatmul(tnpu.npu_weight_quant_batchmatmul)}


def spy(monkeypatch, standin, op):
    """Record the arguments of every call to stand-in `op` (a list of (args, kwargs))."""
    seen, real = [], getattr(standin, op)

    def wrapped(*args, **kwargs):
        seen.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(standin, op, wrapped)
    return seen


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


TIES = {  # rows whose second element is -+rowmax / 2, where the two roundings part
    # bf16: x * fl(127 / rowmax) is exactly -63.5 (-> -64, half to even), x / fl(rowmax / 127) -63.499996 (-> -63)
    torch.bfloat16: [2.796875, -1.3984375, 0.5],
    # fp16: x * fl(127 / rowmax) is exactly 63.5 (-> 64, half to even), x / fl(rowmax / 127) 63.499996 (-> 63)
    torch.float16: [2.001953125, 1.0009765625, -0.25],
}


def kernel_per_token_quant(x2):
    """npu_dynamic_quant as the kernel computes it (cvt.runtime.kernels.npu's docstring; ops-nn
    quant/dynamic_quant/op_kernel/dynamic_quant.h: Div(127, rowmax), Muls, Cast CAST_RINT):
    codes round_half_even(x * (127 / rowmax)), scale rowmax / 127 (0 and codes 0 for a zero row)."""
    xf = x2.to(torch.float32)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    q = torch.round(xf * (torch.full_like(amax, 127.0) / amax)).clamp(-128, 127)  # one division, not 1/t * 127
    q = torch.where(amax > 0, q, torch.zeros_like(q))
    return q.to(torch.int8), (amax / 127.0).squeeze(-1)


def dynamic_as_documented(mod, x):
    """What npu.py's docstring says the W8A8_DYNAMIC path computes: the kernel's codes, then the
    reference's int GEMM and float steps."""
    x2 = x.reshape(-1, mod.in_features)
    xq, xs = kernel_per_token_quant(x2)
    acc = int8.int8_matmul(xq, mod.weight)
    y = acc.to(torch.float32) * mod.weight_scale.to(torch.float32).reshape(1, -1) * xs[:, None]
    if mod.bias is not None:
        y = y + mod.bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], mod.out_features)


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


def _fp19(t):
    """float32 `t` truncated to FP19 (npu_trans_quant_param, round_mode 0)."""
    return (t.to(torch.float32).contiguous().view(torch.int32) & ~FP19_LOW_BITS).view(torch.float32)


def _static(n, k, in_scale, in_off, bias, deq_i64, seed=0, fp19=False):
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen(seed))
    ws = torch.rand(n, generator=gen(seed + 1)) * 0.01 + 1e-4
    deq = (torch.tensor(in_scale) * ws).float()
    if fp19:
        deq = _fp19(deq)
    else:  # every value carries mantissa bits below FP19
        assert bool((deq.view(torch.int32) & FP19_LOW_BITS).ne(0).all())
    b = torch.randn(n, generator=gen(seed + 2)) if bias else None
    qb = primitives.quant_bias_from(b, q, torch.tensor([in_off]), deq)
    return K.W8A8StaticLinear.from_parts({
        "weight": q, "input_scale": torch.tensor([in_scale]), "input_offset": torch.tensor([in_off]),
        "deq_scale": primitives.deq_scale_int64(deq) if deq_i64 else deq, "quant_bias": qb})


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
