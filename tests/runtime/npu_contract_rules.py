"""The NPU contract tests' shared parts (tests/runtime/test_npu_contract*.py): the `standin`
fixture (the stand-in torch_npu of tests/runtime/npu_standin with the torch_npu 2.14.0 documented
rules enforced on top, `strict_ops`) and `no_npu`, the rules themselves, the `spy` / `both`
harness, and the module builders (W8A8 dynamic and static) and the per-token quantization as
the serving kernel computes it, which both files use.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from cvt.qtensor import primitives
from cvt.runtime import kernels as K
from cvt.runtime.kernels import int8, npu

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


def _dynamic(n, k, bias, seed=0):
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen(seed))
    s = torch.rand(n, 1, generator=gen(seed + 1)) * 0.01 + 1e-4
    b = torch.randn(n, generator=gen(seed + 2)) if bias else None
    return K.W8A8DynamicLinear.from_parts({"weight": q, "weight_scale": s, "weight_offset": torch.zeros(n, 1)}, b)


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
