"""Referee for W4A4_FLATQUANT_DYNAMIC: vllm-ascend's own method, run on a cvt output's tensors.

``run_flatquant(va_src, disk, x)`` imports vllm-ascend's quantization package on the stubs of
`vllm_ascend_referee` and runs ``AscendW4A4FlatQuantDynamicLinearMethod`` (``quantization/methods/
w4a4_flatquant.py``) as vLLM would for one linear: ``get_weight`` / ``get_pertensor_param`` /
``get_perchannel_param`` declare the parameters (the disk tensors must have their shapes; floats
are copied in with the parameter's dtype, as vLLM's loaders do), ``process_weights_after_loading``
lays them out, ``apply(layer, x)`` computes. Its three NPU ops are replaced by torch stand-ins
written from their documentation, not from cvt:

* ``npu_kronecker_quant(x [K, M, N], p1, p2, clip_ratio, dst_dtype=int32)`` -- CANN ops-nn
  aclnnFlatQuant: ``x' = x @ p2``, ``x'' = p1 @ x'``; per token ``quantScale = max|x''| / (7 /
  clipRatio)``; ``out = x'' / quantScale`` to int4, eight per int32 along N;
* ``npu_convert_weight_to_int4pack(w int32 [n, k])``: eight int4 per int32 along k;
* ``npu_quant_matmul(x1, x2, scale, pertoken_scale=..., output_dtype=...)`` (int32 inputs = int4
  x int4): ``(x1 @ x2) * scale * pertoken_scale`` in float32, cast once to ``output_dtype``.

The small matmuls run in float32 and the int4 rounding is half to even, clamped to -8..7
(msModelSlim's FlatQuant quantizer); the packing nibble order is the stand-ins' own (pack and
unpack agree; the NPU's is not checked). What this checks is vllm-ascend's wiring around the ops:
which matrix is transposed on load, which is p1 / p2, the views, the scales' order, the bias.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

from cvt.tests.quant.vllm_ascend_referee_stubs import _vllm_ascend

METHOD = "vllm_ascend.quantization.methods.w4a4_flatquant"


def _pack8(v: torch.Tensor) -> torch.Tensor:
    """int4 values [..., 8j] -> int32 [..., j], value 8j + i in bits 4i..4i+3."""
    u = (v.to(torch.int64) & 0xF).reshape(*v.shape[:-1], -1, 8)
    word = sum(u[..., i] << (4 * i) for i in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _unpack8(w: torch.Tensor) -> torch.Tensor:
    u = w.to(torch.int64) & 0xFFFFFFFF
    nib = torch.stack([(u >> (4 * i)) & 0xF for i in range(8)], dim=-1)
    return torch.where(nib >= 8, nib - 16, nib).reshape(*w.shape[:-1], -1)


def _kronecker_quant(x, p1, p2, clip_ratio=1.0, dst_dtype=None):
    xf = p1.to(torch.float32) @ (x.to(torch.float32) @ p2.to(torch.float32))
    scale = xf.abs().amax(dim=(1, 2)) / (7.0 / clip_ratio)
    q = torch.clamp(torch.round(xf / scale[:, None, None]), -8, 7)
    return _pack8(q), scale


def _quant_matmul(x1, x2, scale, *, pertoken_scale=None, bias=None, output_dtype=None, **_):
    a = _unpack8(x1).to(torch.float64)
    b = _unpack8(x2.t()).to(torch.float64).t()  # the method passes weight_packed.t()
    acc = (a @ b).to(torch.float32)  # exact: int4 products summed stay far below 2**24 here
    return (acc * scale.reshape(1, -1) * pertoken_scale.reshape(-1, 1)).to(output_dtype)


@contextlib.contextmanager
def _npu_tensor_method():
    had = hasattr(torch.Tensor, "npu")
    old = getattr(torch.Tensor, "npu", None)
    torch.Tensor.npu = lambda self: self
    try:
        yield
    finally:
        if had:
            torch.Tensor.npu = old
        else:
            del torch.Tensor.npu


def _layer(meth, disk: dict, dtype: torch.dtype) -> torch.nn.Module:
    n, k = disk["weight"].shape
    layer = torch.nn.Module()
    params = {**meth.get_weight(k, n, dtype), **meth.get_pertensor_param(dtype, layer_type="others"),
              **meth.get_perchannel_param(n, dtype)}
    for name, p in params.items():
        t = disk[name]
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"{name}: checkpoint {list(t.shape)}, vllm-ascend declares {list(p.shape)}")
        p.copy_(t)  # vLLM's default weight loaders: param.data.copy_(loaded), converting the dtype
        layer.register_parameter(name, torch.nn.Parameter(p, requires_grad=False))
    return layer


def run_flatquant(va_src: Path, disk: dict[str, torch.Tensor], x: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """vllm-ascend's W4A4_FLATQUANT_DYNAMIC ``apply`` on one linear's on-disk tensors (suffix ->
    tensor: weight, weight_scale, weight_offset, left_trans, right_trans, clip_ratio) for ``x``."""
    # vLLM runs the model under inference mode (the method's new Parameters would track gradients)
    with _vllm_ascend(Path(va_src), {"model_type": "qwen3"}, x.dtype), _npu_tensor_method(), torch.no_grad():
        import importlib

        mod = importlib.import_module(METHOD)
        npu = sys.modules["torch_npu"]
        npu.npu_kronecker_quant = _kronecker_quant
        npu.npu_convert_weight_to_int4pack = lambda w, inner_k_tiles=1: _pack8(w)
        npu.npu_quant_matmul = _quant_matmul
        meth = mod.AscendW4A4FlatQuantDynamicLinearMethod()
        layer = _layer(meth, disk, x.dtype)
        meth.process_weights_after_loading(layer)
        return meth.apply(layer, x, bias=bias)
