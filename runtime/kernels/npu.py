"""Ascend fast path: the torch_npu fused ops behind the same `Linear` interface.

Selection: `enabled(device)` is True when ``torch_npu`` imports and the tensors are on an
``npu`` device. ``CVT_FORCE_NPU_KERNELS=1`` (or ``force=True``) selects the path for any
device -- only the contract test uses it, with a plain-torch stand-in for torch_npu.
`prepare(mod)` lays a module's weights out for the ops once (at load, after the module is on
its device; `forward` prepares lazily if the loader did not); `forward(mod, x2)` returns
``None`` when the fused op does not apply (float32 activations, an empty input, a shape or
group size the op refuses -- see each format below), and the caller then runs its torch
reference.

Sources. The op docstrings and meta functions of the torch_npu 2.14.0 wheel,
``torch_npu/_op_plugin_docs.py`` (DOCS below) and ``torch_npu/op_plugin/meta/_meta_registrations.py``
(META), and the CANN ops-nn kernels / aclnn pages where the docstring leaves the arithmetic open.
Call patterns cross-checked in vllm-ascend (w8a8.py, w8a8_dynamic.py, w4a16.py).

* ``npu_dynamic_quant(x, *, smooth_scales=None, ...) -> (y int8, scale float32 x.shape[:-1])``
  (DOCS "npu_dynamic_quant"; META ``npu_dynamic_quant``): per-token symmetric quant. The
  docstring writes ``scale = rowMax(|x|) / 127, y = round(x / scale)``; the kernel (ops-nn
  ``quant/dynamic_quant/op_kernel/dynamic_quant.h``) computes the factor ``127 / rowMax(|x|)``
  in float32 and MULTIPLIES: ``y = round_half_even(x * (127 / rowmax))``, scale = rowmax / 127
  (to within the last bit: ``1 / (127 / rowmax)`` or ``rowmax * (1 / 127)`` depending on the
  tiling). cvt's reference (`cvt.qtensor.primitives.per_token_quant`) computes these codes too (so does vLLM's
  CUDA kernel). The docstring's ``round(x / scale)`` can differ by one int8 step where ``x *
  127 / rowmax`` is exactly a half-integer (a tie: ``x = +-rowmax / 2``, or other half-integer
  multiples of ``rowmax / 127`` when rowmax's significand has the factor 127); the two
  roundings of the reciprocal then push the tie opposite ways. On 96-wide standard-normal rows
  about 5% of bf16 rows and 1% of fp16 rows have such a tie. An all-zero row is not guarded
  (127 / 0 = inf, so its codes are unspecified) but its scale is 0 (``1 / inf`` or ``0 / 127``),
  so its output is exactly 0 (+ bias) whatever the codes: cvt does not rely on them.
* ``npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
  output_dtype=None)`` (DOCS "npu_quant_matmul"; META ``npu_quant_matmul_meta``,
  ``quant_matmul_bias_dtype_check``): x1 int8 ``(m, k)``, x2 int8 ``(k, n)``, k and n at most
  65535; ``(x1 @ x2 + bias_int32) * scale [* pertoken_scale]`` or ``x1 @ x2 * scale *
  pertoken_scale + bias_float``. The A2/A3 dtype table: bf16 output takes a float32 (or bf16)
  scale, optionally with a float32 pertoken_scale, and passes it through as float32; fp16
  output WITHOUT pertoken_scale takes an int64 scale from npu_trans_quant_param, and a float32
  one is converted by the op itself (the docstring's example: "Method 1" passes the float32
  scale, "Method 2" calls npu_trans_quant_param first; op-plugin QuantMatmulKernelNpuOpApi.cpp
  calls it for a float32 scale without pertoken_scale unless the output is bf16 or int32) --
  either way the scale is truncated to FP19. fp16 output WITH pertoken_scale takes a float32
  scale, not truncated. META ``quant_matmul_bias_dtype_check``: no float16 bias without
  pertoken_scale, a bf16 bias only with bf16 output.
* ``npu_trans_quant_param(scale, offset=None, round_mode=0) -> int64`` (DOCS
  "npu_trans_quant_param"; META ``npu_trans_quant_param_meta``; ops-nn
  ``quant/trans_quant_param_v2``): the "FP19" hardware form of a float32 scale. Bits 0-31 hold
  the float32 with its low 13 mantissa bits cleared (sign, exponent and 10 mantissa bits kept;
  round_mode 0 truncates, 1 rounds half to even), bit 46 is set, an offset goes to bits 37-45
  (int9). The effective scale can be up to 2**-10 (relative) below the float32 one.
* ``npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True)``: with
  ``div_mode=False``, ``round(input * scales + zero_points)``; scales/zero_points in the
  input's dtype (used as vllm-ascend does for W8A8: reciprocal input scale, ``torch.qint8``, axis -1).
* ``npu_convert_weight_to_int4pack(weight int32 (k, n)) -> int32 (k, n/8)``: 8 int4 per int32,
  packed along the last dim (the "N-packed" layout npu_weight_quant_batchmatmul takes).
* ``npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, ...,
  bias=None, antiquant_group_size=0)`` (DOCS "npu_weight_quant_batchmatmul"; META
  ``npu_weight_quant_batchmatmul_meta``; aclnnWeightQuantBatchMatmulV2): ``y = x @ ((weight +
  antiquant_offset) * antiquant_scale) + bias``, x ``(m, k)`` fp16/bf16, weight ``(k, n)``, K
  and N in [1, 65535], no empty input; antiquant_scale/offset in x's dtype, ``(n,)`` per
  channel (antiquant_group_size 0) or ``(ceil(k / group), n)`` per group, where the group size
  must be a multiple of 32 in [32, k - 1]; bias ``(n,)`` float16 when x is float16, float32
  when x is bfloat16. Note the PLUS: cvt stores the documented ``(w - offset)`` form, so the
  offset passed here is ``-weight_offset``.

Exactness against the references (`int8`, `int4`):
W8A8_DYNAMIC: the int GEMM, the float steps and the per-token codes are the reference's (both
multiply by the float32 ``127 / rowmax``); the pertoken scale may differ in its last bit by
tiling. Given the documented scale rowmax / 127, and a correctly rounded Div in the kernel (not
checked on hardware: no NPU here), the output is the reference's bit for bit.
W8A8 static: exact. x is quantized by npu_quantize only when ``1 / input_scale`` and
``input_offset`` are exact in x's dtype (e.g. a power-of-two scale); otherwise with torch ops on
the device, because the fused op would multiply by a rounded reciprocal. For fp16 output the
int64 (FP19) deq_scale is used only when truncating to FP19 loses nothing; otherwise the
float32 deq_scale goes in with a pertoken_scale of ones (the fp16 + pertoken row of the dtype
table), so the NPU multiplies by the same float32 scale as the reference. bf16 output takes the
float32 deq_scale directly.
W4A16 passes scales in x's dtype (the op requires it), so it matches the float32 reference
exactly only for scales that x's dtype represents (compressed-tensors stores bf16 scales
anyway); the matmul sums in another order. fp8_block and the fp4 formats have no fused op
here; their torch expressions run on the NPU as they are.
"""

from __future__ import annotations

import os

import torch

from cvt.qtensor import kernel_formats as KF
from cvt.qtensor.primitives import deq_scale_f32, static_quant

ENV_FORCE = "CVT_FORCE_NPU_KERNELS"
FUSED_DTYPES = (torch.float16, torch.bfloat16)


def torch_npu_module():
    """The torch_npu module, or None when it does not import."""
    try:
        import torch_npu  # type: ignore[import-not-found]
    except ImportError:
        return None
    return torch_npu


def _device_type(device) -> str:
    if isinstance(device, torch.device):
        return device.type
    return str(device).split(":", 1)[0]


def forced() -> bool:
    return os.environ.get(ENV_FORCE, "").strip().lower() in ("1", "true", "yes", "on")


def enabled(device, force: bool | None = None) -> bool:
    """Whether the torch_npu path runs for tensors on `device`."""
    if _device_type(device) != "npu" and not (forced() if force is None else force):
        return False
    return torch_npu_module() is not None


def _weight(mod) -> torch.Tensor:
    return mod.weight_int4 if mod.fmt == KF.W4A16 else mod.weight


def prepare(mod) -> None:
    """Lay `mod`'s weights out for torch_npu once; no-op when the path is not enabled for them."""
    if enabled(_weight(mod).device):
        _state(mod, torch_npu_module())


def _state(mod, tnpu) -> dict:
    st = mod._npu_state
    dev = _weight(mod).device
    if st is None or st["device"] != dev:
        st = _PREPARE[mod.fmt](mod, tnpu)
        st["device"], st["per_dtype"] = dev, {}
        mod._npu_state = st
    return st


def forward(mod, x2: torch.Tensor) -> torch.Tensor | None:
    """``[m, out_features]`` from the fused ops for 2-D ``x2``, or None when they do not apply."""
    if x2.dtype not in FUSED_DTYPES or mod.fmt not in _FORWARD or x2.shape[0] == 0:
        return None  # float32 activations; no fused op; empty input ("不支持空Tensor输入")
    tnpu = torch_npu_module()
    st = _state(mod, tnpu)
    if st.get("unsupported"):
        return None
    return _FORWARD[mod.fmt](mod, st, x2, tnpu)


def _transpose_in_place(mod) -> torch.Tensor:
    """``weight [n, k]`` -> contiguous ``[k, n]``; the module keeps a ``[n, k]`` view of it (no copy kept)."""
    w_kn = mod.weight.t().contiguous()
    mod.weight = w_kn.t()
    return w_kn


# ---- shared gates --------------------------------------------------------------------------------

# DOCS npu_quant_matmul: "x1与x2最后一维的shape大小不能超过65535"; DOCS npu_weight_quant_batchmatmul:
# "K、N的范围为[1, 65535]".
MAX_KN = 65535
# The float32 mantissa bits npu_trans_quant_param clears (DOCS npu_trans_quant_param: "用于指定FP32填充到
# FP19的模式 ... 0表示截断填充"; ops-nn quant/trans_quant_param_v2: out = (scale & 0xFFFFE000) | (1 << 46)).
FP19_LOW_BITS = 0x1FFF


def _kn_ok(n: int, k: int) -> bool:
    return 1 <= k <= MAX_KN and 1 <= n <= MAX_KN


def fp19_exact(scale_f32: torch.Tensor) -> bool:
    """Whether npu_trans_quant_param's truncation to FP19 leaves every value of `scale_f32` unchanged."""
    return not bool((scale_f32.contiguous().view(torch.int32) & FP19_LOW_BITS).any())


def group_size_ok(group_size: int, k: int) -> bool:
    """npu_weight_quant_batchmatmul's antiquant_group_size rule: 0 (per channel / per tensor) or a
    multiple of 32 in [32, k - 1] (DOCS npu_weight_quant_batchmatmul: "per-group场景下要求传入值的范围为
    [32, K-1]且必须是32的倍数"; the op-plugin check "antiquant_group_size can be either 0 or a multiple
    of 32 within the range 32 to weight_k_dim - 1")."""
    return group_size == 0 or (group_size % 32 == 0 and 32 <= group_size <= k - 1)


# ---- W8A8_DYNAMIC -------------------------------------------------------------------------------

def _prepare_dynamic(mod, tnpu) -> dict:
    n, k = mod.weight.shape
    if not _kn_ok(n, k):
        return {"unsupported": True}
    return {"w_kn": _transpose_in_place(mod), "scale": mod.weight_scale.reshape(-1).to(torch.float32)}


def _forward_dynamic(mod, st, x2, tnpu):
    # codes = round_half_even(x * (127 / rowmax)), scale = rowmax / 127 (module docstring); an
    # all-zero row gets scale 0, so its output is 0 (+ bias) whatever codes the kernel gives it.
    xq, xs = tnpu.npu_dynamic_quant(x2)
    bias = None if mod.bias is None else mod.bias.to(torch.float32)  # fp32 bias: bf16 / fp16 + pertoken rows
    return tnpu.npu_quant_matmul(xq, st["w_kn"], st["scale"], pertoken_scale=xs, bias=bias, output_dtype=x2.dtype)


# ---- W8A8 static --------------------------------------------------------------------------------

def _prepare_static(mod, tnpu) -> dict:

    n, k = mod.weight.shape
    if not _kn_ok(n, k):
        return {"unsupported": True}
    return {"w_kn": _transpose_in_place(mod), "deq_f32": deq_scale_f32(mod.deq_scale).contiguous(),
            "s": mod.input_scale.reshape(()).to(torch.float32), "off": mod.input_offset.reshape(()).to(torch.float32)}


def _static_params(st, dt, k, tnpu) -> dict:
    p = st["per_dtype"].get(dt)
    if p is None:
        s, off = st["s"], st["off"]
        recip, off_dt = (1.0 / s).to(dt), off.to(dt)
        exact = float(recip.double() * s.double()) == 1.0 and float(off_dt) == float(off)
        ones = False
        if dt == torch.float16:
            # fp16 output without pertoken_scale multiplies by the FP19 (npu_trans_quant_param) scale,
            # also when given a float32 one; the reference multiplies by the float32 deq_scale. Use
            # the int64 form only when FP19 is exact; else the float32 scale with a pertoken_scale of
            # ones ("x1 int8, scale float32, pertoken float32, output float16" in DOCS npu_quant_matmul's
            # A2/A3 table), which is not truncated. A stored int64 deq_scale is re-encoded through
            # npu_trans_quant_param (the documented producer) rather than passed as it is.
            if fp19_exact(st["deq_f32"]):
                scale = tnpu.npu_trans_quant_param(st["deq_f32"])
            else:
                scale, ones = st["deq_f32"], True
        else:  # bf16 output: float32 scale, passed through (no trans_quant_param on bf16 output)
            scale = st["deq_f32"]
        p = {"fused_quant": exact, "recip": recip.expand(k).contiguous(), "off": off_dt.expand(k).contiguous(),
             "scale": scale, "ones": ones}
        st["per_dtype"][dt] = p
    return p


def _forward_static(mod, st, x2, tnpu):
    p = _static_params(st, x2.dtype, x2.shape[1], tnpu)
    if p["fused_quant"]:
        xq = tnpu.npu_quantize(x2, p["recip"], p["off"], torch.qint8, -1, False)
    else:

        xq = static_quant(x2, st["s"], st["off"])
    pertoken = torch.ones(x2.shape[0], dtype=torch.float32, device=x2.device) if p["ones"] else None
    y = tnpu.npu_quant_matmul(xq, st["w_kn"], p["scale"], pertoken_scale=pertoken, bias=mod.quant_bias,
                              output_dtype=x2.dtype)
    return y if mod.bias is None else y + mod.bias.to(x2.dtype)


# ---- W4A16 --------------------------------------------------------------------------------------

def _prepare_w4a16(mod, tnpu) -> dict:
    q, sc, off = mod.weight_int4, mod.weight_scale, mod.weight_offset
    n, k = q.shape
    g = sc.shape[1]
    # one scale column is the per-channel mode (antiquant_group_size 0, scale (n,)), also when
    # the checkpoint calls it "group k"; otherwise the group size must pass the op's rule
    group_size = k // g if g > 1 else 0
    if n % 8 or not _kn_ok(n, k) or not group_size_ok(group_size, k):
        # n % 8: npu_convert_weight_to_int4pack packs 8 along the last dim (n here)
        return {"unsupported": True}
    packed = tnpu.npu_convert_weight_to_int4pack(q.t().contiguous().to(torch.int32))  # (k, n/8)
    scale_kn = sc.to(torch.float32).t().contiguous()
    off_kn = None if not bool((off != 0).any()) else (-off.to(torch.float32)).t().contiguous()  # Ascend adds
    if g == 1:
        scale_kn = scale_kn.reshape(n)
        off_kn = None if off_kn is None else off_kn.reshape(n)
    return {"packed": packed, "scale": scale_kn, "offset": off_kn, "group_size": group_size}


def _forward_w4a16(mod, st, x2, tnpu):
    dt = x2.dtype
    p = st["per_dtype"].get(dt)
    if p is None:
        p = {"scale": st["scale"].to(dt), "offset": None if st["offset"] is None else st["offset"].to(dt)}
        st["per_dtype"][dt] = p
    # bias: "当x数据类型为bfloat16, bias需为float32; 当x数据类型为float16, bias需为float16" (DOCS
    # npu_weight_quant_batchmatmul); contiguous ("不支持非连续的Tensor"). An fp16 bias is what the
    # reference adds too (bias.to(x.dtype)).
    bias = None
    if mod.bias is not None:
        bias = mod.bias.to(torch.float16 if dt == torch.float16 else torch.float32).contiguous()
    return tnpu.npu_weight_quant_batchmatmul(x=x2, weight=st["packed"], antiquant_scale=p["scale"],
                                             antiquant_offset=p["offset"], bias=bias,
                                             antiquant_group_size=st["group_size"])


_PREPARE = {KF.W8A8_DYNAMIC: _prepare_dynamic, KF.W8A8_STATIC: _prepare_static, KF.W4A16: _prepare_w4a16}
_FORWARD = {KF.W8A8_DYNAMIC: _forward_dynamic, KF.W8A8_STATIC: _forward_static, KF.W4A16: _forward_w4a16}
