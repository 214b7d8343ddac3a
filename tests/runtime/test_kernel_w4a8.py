"""`w4a8_dynamic` kernel: the torch reference is what vllm-ascend's W4A8_DYNAMIC MoE path computes.

vllm-ascend 0.23 ``quantization/methods/w4a8.py`` (AscendW4A8DynamicFusedMoEMethod, msModelSlim
version "1.0.0", group_size 0): ``npu_dynamic_quant`` on the tokens, then ``npu_grouped_matmul``
with the int4 weight, ``scale`` = float32 bits of weight_scale, ``per_token_scale`` and ``bias`` =
scale_bias summed over its runs (``update_bias``). The CANN A8W4 kernel (ops-transformer
``gmm/grouped_matmul/op_kernel/grouped_matmul_antiquant_a8w4_msd.h``) splits every int8 token into
two int4 rows, multiplies both with the dequantized weight, and combines ``high * 16 + low +
bias``, then ``* per_token_scale``. `msd` below runs that arithmetic (in float64) on the tensors cvt
writes and checks it equals the reference: the written scale_bias is exactly the term the split
leaves out.
"""

from __future__ import annotations

import pytest
import torch

from cvt.qtensor import primitives
from cvt.errors import CvtError, TensorError
from cvt.qtensor.formats import get_format
from cvt.qtensor.schemes import get_scheme
from cvt.runtime import kernels as K
from cvt.runtime.kernels import int8

N, KF = 48, 160  # 160 = 16 runs of 10


def gen(seed):
    return torch.Generator().manual_seed(seed)


def parts(n=N, k=KF, seed=0):
    q = torch.randint(-8, 8, (n, k), generator=gen(seed), dtype=torch.int8)
    s = (torch.rand(n, 1, generator=gen(seed + 1)) * 0.01 + 1e-3).to(torch.bfloat16).float()
    return {"weight_int4": q, "weight_scale": s}


def tokens(m=7, k=KF, seed=3, dtype=torch.float32):
    x = torch.randn(m, k, generator=gen(seed))
    x[2] = 0.0  # an all-zero token
    return x.to(dtype)


def msd(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, scale_bias: torch.Tensor) -> torch.Tensor:
    """The A8W4 MSD op's arithmetic (float64), from the tensors as vllm-ascend loads them."""
    xq, xs = primitives.per_token_quant(x)                 # npu_dynamic_quant
    xi = xq.to(torch.int64)
    high, low = xi >> 4, (xi & 15) - 8               # x = 16 * high + low + 8, both int4
    assert int(high.min()) >= -8 and int(high.max()) <= 7 and int(low.min()) >= -8 and int(low.max()) <= 7
    wd = q.double() * s.double()                     # [n, k]: int4 * scale (the op's dequant)
    bias = scale_bias.double().sum(1)                # update_bias: the runs summed, [n]
    y = 16 * (high.double() @ wd.T) + low.double() @ wd.T + bias
    return y * xs.double()[:, None]


@pytest.mark.parametrize("bias", [False, True])
def test_reference_is_per_token_int8_times_int4(bias):
    p = parts()
    b = torch.randn(N, generator=gen(9)) if bias else None
    mod = K.get("w4a8_dynamic").from_parts(dict(p), b)
    assert isinstance(mod, K.W4A8DynamicLinear) and (mod.out_features, mod.in_features) == (N, KF)
    assert torch.equal(mod.dense_weight(), p["weight_int4"].float() * p["weight_scale"])
    x = tokens().reshape(7, 1, KF)
    xq, xs = primitives.per_token_quant(x.reshape(-1, KF))
    acc = (xq.double() @ p["weight_int4"].double().T).float()  # exact: small integers
    want = acc * p["weight_scale"].reshape(1, -1) * xs[:, None]  # the reference's float32 steps, in order
    if b is not None:
        want = want + b
    y = mod(x)
    assert y.shape == (7, 1, N) and y.dtype == torch.float32
    assert torch.equal(y.reshape(7, N), want)
    assert not y[2].any() or bias  # a zero token gives zero (+ bias)
    assert mod(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("module", ["m.experts.0.gate_proj", "m.experts.0.down_proj"])
def test_ascend_op_arithmetic_on_written_tensors_equals_reference(module):
    """What the NPU computes from cvt's files (scale_bias included) is the reference's value."""
    g = gen(4)
    w = (torch.randn(N, KF, generator=g) * 0.02).to(torch.bfloat16).float()
    q = get_scheme("w4a8").quantize(w)
    fmt = get_format("ascend")
    disk = fmt.disk_tensors(module, q, expert=True)
    back = fmt.read(module, disk, "W4A8_DYNAMIC")
    mod = K.get(back.kernel_fmt).from_parts(back.parts)
    x = tokens()
    want = mod(x).double()
    got = msd(x, back.parts["weight_int4"], back.parts["weight_scale"], disk[f"{module}.scale_bias"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # without the bias the split is off by the whole 8 * sum_k(w) term
    off = msd(x, back.parts["weight_int4"], back.parts["weight_scale"], torch.zeros(N, 1))
    assert (off - want).abs().max() > 1e-3


def test_bad_parts_and_registry():
    p = parts()
    cls = K.get("w4a8_dynamic")
    cls.from_parts(dict(p))
    cls.from_parts({**p, "weight_scale": p["weight_scale"].reshape(N)})  # [n] too
    for bad, msg in [({"weight_int4": p["weight_int4"] * 2}, "outside the int4 range"),
                     ({"weight_int4": p["weight_int4"].int()}, "expected dtype int8"),
                     ({"weight_scale": p["weight_scale"][:5]}, r"expected shape \[48, 1\]"),
                     ({"weight_scale": torch.full((N, 1), float("inf"))}, "non-finite"),
                     ({"weight_scale": torch.ones(N, 1, dtype=torch.int32)}, "expected dtype float32")]:
        with pytest.raises(TensorError, match=msg):
            cls.from_parts({**p, **bad})
    with pytest.raises(TensorError, match="unknown part.*weight_offset"):
        cls.from_parts({**p, "weight_offset": torch.zeros(N, 1)})
    with pytest.raises(TensorError, match=r"missing part.*weight_scale"):
        cls.from_parts({"weight_int4": p["weight_int4"]})
    # two parts: for_parts tells it from a per-channel w4a16 (three parts)
    assert K.for_parts({"weight_int4", "weight_scale"}) is cls
    assert K.for_parts({"weight_int4", "weight_scale", "weight_offset"}) is K.get("w4a16")
    with pytest.raises(CvtError, match="unknown linear format"):
        K.get("w4a8")


@pytest.mark.parametrize("bias", [False, True])
def test_same_reference_and_scale_check_as_w8a8_dynamic(bias):
    """W4A8_DYNAMIC is the W8A8_DYNAMIC reference with int4 values as int8 (`_common.per_token_int8_linear`):
    the same values, scales and bias give the same bits, and a bad scale the same words."""
    p = parts()
    b = torch.randn(N, generator=gen(9)) if bias else None
    w4 = K.get("w4a8_dynamic").from_parts(dict(p), b)
    w8 = int8.W8A8DynamicLinear.from_parts({"weight": p["weight_int4"], "weight_scale": p["weight_scale"],
                                            "weight_offset": torch.zeros(N, 1)}, b)
    for dtype in (torch.float32, torch.bfloat16):
        x = tokens(dtype=dtype)
        assert torch.equal(w4(x), w8(x))
    bad = p["weight_scale"][:5]
    with pytest.raises(TensorError) as e4:
        K.get("w4a8_dynamic").from_parts({**p, "weight_scale": bad})
    with pytest.raises(TensorError) as e8:
        int8.W8A8DynamicLinear.from_parts({"weight": p["weight_int4"], "weight_scale": bad,
                                           "weight_offset": torch.zeros(N, 1)})
    assert str(e4.value) == "w4a8_dynamic part 'weight_scale' is float32 [5, 1]: expected shape [48, 1] (per output channel)"
    assert str(e8.value) == str(e4.value).replace("w4a8_dynamic", "w8a8_dynamic")


def test_prepare_for_npu_is_a_no_op():
    mod = K.get("w4a8_dynamic").from_parts(parts())
    mod.prepare_for_npu()
    assert mod._npu_state is None


def test_forced_npu_path_falls_back_to_the_reference(monkeypatch):
    """With the Ascend path selected (torch_npu importable, CVT_FORCE_NPU_KERNELS), this format has no
    fused op in `npu.py` and runs the reference -- never a W8A8 / W4A16 op on its tensors."""
    from cvt.runtime.kernels import npu

    monkeypatch.setattr(npu, "torch_npu_module", lambda: object())  # any use of a torch_npu op would raise
    monkeypatch.setenv(npu.ENV_FORCE, "1")
    mod = K.get("w4a8_dynamic").from_parts(parts())
    x = tokens(dtype=torch.bfloat16)
    assert npu.enabled(x.device)
    assert torch.equal(mod(x), mod.reference(x))
