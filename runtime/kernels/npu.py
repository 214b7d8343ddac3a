"""Ascend fast path: the torch_npu fused ops behind the same `Linear` interface.

Selection: `enabled(device)` is True when ``torch_npu`` imports and the tensors are on an
``npu`` device. ``CVT_FORCE_NPU_KERNELS=1`` (or ``force=True``) selects the path for any
device -- only the contract test uses it, with a plain-torch stand-in for torch_npu.
`prepare(mod)` lays a module's weights out for the ops once (at load, after the module is on
its device; `forward` prepares lazily if the loader did not); `forward(mod, x2)` returns
``None`` when the fused op does not apply (float32 activations, int4 with out_features not a
multiple of 8), and the caller then runs its torch reference.

Ops and their documented semantics (torch_npu API reference, hiascend.com "ptaoplist" pages
for torch_npu.npu_*; CANN aclnn pages aclnnQuantMatmulV4 / aclnnWeightQuantBatchMatmulV2):

* ``npu_dynamic_quant(x, *, smooth_scales=None, ...) -> (y int8, scale float32 x.shape[:-1])``:
  per-token symmetric quant, ``scale = rowmax(|x|) / 127``, ``y = round(x / scale)``.
* ``npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
  output_dtype=None)``: x1 int8 ``(m, k)``, x2 int8 ``(k, n)``; ``(x1 @ x2 + bias_int32) * scale``
  or ``x1 @ x2 * scale * pertoken_scale + bias_float``; scale float32 ``(n,)`` (or int64 from
  npu_trans_quant_param, required for fp16 output without pertoken_scale).
* ``npu_trans_quant_param(scale, offset=None) -> int64``: the hardware form of a float32 scale.
* ``npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True)``: with
  ``div_mode=False``, ``round(input * scales + zero_points)``; scales/zero_points in the
  input's dtype (used as vllm-ascend does for W8A8: reciprocal input scale, ``torch.qint8``, axis -1).
* ``npu_convert_weight_to_int4pack(weight int32 (k, n)) -> int32 (k, n/8)``: 8 int4 per int32,
  packed along the last dim (the "N-packed" layout npu_weight_quant_batchmatmul takes).
* ``npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, ...,
  bias=None, antiquant_group_size=0)``: ``y = x @ ((weight + antiquant_offset) *
  antiquant_scale) + bias``, weight ``(k, n)``, scale/offset ``(n,)`` per channel or
  ``(ceil(k / group), n)`` per group, in x's dtype; bias float32. Note the PLUS: cvt stores the
  documented ``(w - offset)`` form, so the offset passed here is ``-weight_offset``.

Pages read (hiascend.com): torch_npu API list ptaoplist_000172 (npu_quant_matmul), _001228
(npu_dynamic_quant), _000179 (npu_weight_quant_batchmatmul), _000846
(npu_convert_weight_to_int4pack), _000861 (npu_trans_quant_param), torch_npu-npu_quantize.md;
CANN aclnnQuantMatmulV4.md, aclnnWeightQuantBatchMatmulV2.md, aclnnConvertWeightToINT4Pack.md.
Call patterns cross-checked in vllm-ascend (vllm_ascend/quantization/w8a8.py, w8a8_dynamic,
w8a16, kernels/mixed_precision/npu.py, w4a16.py ``pack_to_int32``).

Exactness against the references: W8A8_DYNAMIC and the int GEMMs reproduce them bit for bit.
W8A8 static uses npu_quantize only when ``1 / input_scale`` and ``input_offset`` are exact in
x's dtype (e.g. a power-of-two scale); otherwise x is quantized with torch ops on the device,
because the fused op would multiply by a rounded reciprocal. W4A16 passes scales in x's dtype
(the op requires it), so it matches the float32 reference exactly only for scales that x's
dtype represents (compressed-tensors stores bf16 scales anyway). fp8_block and the fp4
formats have no fused op here; their torch expressions run on the NPU as they are.
"""

from __future__ import annotations

import os

import torch

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
    return mod.weight_int4 if mod.fmt == "w4a16" else mod.weight


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
    if x2.dtype not in FUSED_DTYPES or mod.fmt not in _FORWARD:
        return None
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


# ---- W8A8_DYNAMIC -------------------------------------------------------------------------------

def _prepare_dynamic(mod, tnpu) -> dict:
    return {"w_kn": _transpose_in_place(mod), "scale": mod.weight_scale.reshape(-1).to(torch.float32)}


def _forward_dynamic(mod, st, x2, tnpu):
    xq, xs = tnpu.npu_dynamic_quant(x2)
    bias = None if mod.bias is None else mod.bias.to(torch.float32)
    return tnpu.npu_quant_matmul(xq, st["w_kn"], st["scale"], pertoken_scale=xs, bias=bias, output_dtype=x2.dtype)


# ---- W8A8 static --------------------------------------------------------------------------------

def _prepare_static(mod, tnpu) -> dict:
    from cvt.runtime.kernels.int8 import deq_scale_f32

    return {"w_kn": _transpose_in_place(mod), "deq_f32": deq_scale_f32(mod.deq_scale).contiguous(),
            "deq_i64": mod.deq_scale if mod.deq_scale.dtype == torch.int64 else None,
            "s": mod.input_scale.reshape(()).to(torch.float32), "off": mod.input_offset.reshape(()).to(torch.float32)}


def _static_params(st, dt, k, tnpu) -> dict:
    p = st["per_dtype"].get(dt)
    if p is None:
        s, off = st["s"], st["off"]
        recip, off_dt = (1.0 / s).to(dt), off.to(dt)
        exact = float(recip.double() * s.double()) == 1.0 and float(off_dt) == float(off)
        if dt == torch.float16:  # fp16 output without pertoken scale takes the int64 (hardware) scale form
            scale = st["deq_i64"] if st["deq_i64"] is not None else tnpu.npu_trans_quant_param(st["deq_f32"])
        else:
            scale = st["deq_f32"]
        p = {"fused_quant": exact, "recip": recip.expand(k).contiguous(), "off": off_dt.expand(k).contiguous(),
             "scale": scale}
        st["per_dtype"][dt] = p
    return p


def _forward_static(mod, st, x2, tnpu):
    p = _static_params(st, x2.dtype, x2.shape[1], tnpu)
    if p["fused_quant"]:
        xq = tnpu.npu_quantize(x2, p["recip"], p["off"], torch.qint8, -1, False)
    else:
        from cvt.runtime.kernels.int8 import static_quant

        xq = static_quant(x2, st["s"], st["off"])
    y = tnpu.npu_quant_matmul(xq, st["w_kn"], p["scale"], bias=mod.quant_bias, output_dtype=x2.dtype)
    return y if mod.bias is None else y + mod.bias.to(x2.dtype)


# ---- W4A16 --------------------------------------------------------------------------------------

def _prepare_w4a16(mod, tnpu) -> dict:
    q, sc, off = mod.weight_int4, mod.weight_scale, mod.weight_offset
    n, k = q.shape
    if n % 8:  # npu_convert_weight_to_int4pack packs 8 along the last dim (n here)
        return {"unsupported": True}
    g = sc.shape[1]
    packed = tnpu.npu_convert_weight_to_int4pack(q.t().contiguous().to(torch.int32))  # (k, n/8)
    scale_kn = sc.to(torch.float32).t().contiguous()
    off_kn = None if not bool((off != 0).any()) else (-off.to(torch.float32)).t().contiguous()  # Ascend adds
    if g == 1:
        scale_kn = scale_kn.reshape(n)
        off_kn = None if off_kn is None else off_kn.reshape(n)
    return {"packed": packed, "scale": scale_kn, "offset": off_kn, "group_size": k // g if g > 1 else 0}


def _forward_w4a16(mod, st, x2, tnpu):
    dt = x2.dtype
    p = st["per_dtype"].get(dt)
    if p is None:
        p = {"scale": st["scale"].to(dt), "offset": None if st["offset"] is None else st["offset"].to(dt)}
        st["per_dtype"][dt] = p
    bias = None if mod.bias is None else mod.bias.to(torch.float32)
    return tnpu.npu_weight_quant_batchmatmul(x=x2, weight=st["packed"], antiquant_scale=p["scale"],
                                             antiquant_offset=p["offset"], bias=bias,
                                             antiquant_group_size=st["group_size"])


_PREPARE = {"w8a8_dynamic": _prepare_dynamic, "w8a8_static": _prepare_static, "w4a16": _prepare_w4a16}
_FORWARD = {"w8a8_dynamic": _forward_dynamic, "w8a8_static": _forward_static, "w4a16": _forward_w4a16}
