"""Referee for W4A4_MXFP4_FLATQUANT: vllm-ascend's own method (``quantization/methods/
w4a4_mxfp4_flatquant.py`` AscendW4A4MXFP4FlatQuantDynamicLinearMethod), run on a cvt output's tensors
as vLLM would for one linear (a RowParallelLinear with ``row``: ``layer_type="row"`` sizes the
transforms for max_supported_tp, process_weights_after_loading takes the rank's diagonal block of
the whole left_trans; at TP > 1 each rank on its columns), with its NPU ops replaced by torch
stand-ins:

* ``npu_kronecker_quant(x [K, M, N], p1, p2, clip_ratio, dst_dtype=float4_e2m1fn_x2)``: ``p1 @ (x @
  p2)`` (aclnnFlatQuant), then MXFP4 per 32 along the token, written here from msModelSlim's rules
  (``ir/api/impl/mx_quantization.py``: exponent ``floor(log2(amax * clip / 0.875)) - 2``, E2M1
  round half away, clamp 6), returning the element values and the exponents (the op's fp4 and E8M0);
* ``npu_quant_matmul(x1, x2, scale, pertoken_scale=..., group_sizes=[1, 1, 32], bias=...)``:
  ``sum_k x1 2**ps * x2 2**s (+ bias)`` in float32, cast once to ``output_dtype``; x2 is the method's
  ``weight`` after process_weights_after_loading (packed [k/2, n]) and scale its ``[k/64, n, 2]`` view.

What this checks is the method's wiring: which matrix is transposed, the views, the packing order
and the scale reshapes, the bias.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from cvt.tests.quant.vllm_ascend_referee_stubs import _vllm_ascend
from cvt.tests.quant.vllm_ascend_referee_flatquant import _npu_tensor_method

METHOD = "vllm_ascend.quantization.methods.w4a4_mxfp4_flatquant"
GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _e2m1(v):
    b = v.abs()
    pe = torch.clip(torch.floor(torch.log2(b + 9.6e-7)), 0, 2)
    return torch.sign(v) * torch.clip(torch.floor(b / 2 ** pe * 2 + 0.5) / 2 * 2 ** pe, -6, 6)


def _kronecker_quant(x, p1, p2, clip_ratio=1.0, dst_dtype=None):
    xf = p1.to(torch.float32) @ (x.to(torch.float32) @ p2.to(torch.float32))
    g = xf.reshape(xf.shape[0], -1, 32)
    amax = (g.abs().amax(-1) * clip_ratio).to(torch.bfloat16).float()
    se = torch.floor(torch.log2(((amax / 0.875).to(torch.bfloat16).float() + 9.6e-7).to(torch.bfloat16).float())
                     .to(torch.bfloat16).float()) - 2
    return _e2m1(g / 2 ** se[..., None]).reshape(xf.shape[0], -1), se


def _quant_matmul(x1, x2, scale, *, pertoken_scale=None, bias=None, output_dtype=None, group_sizes=None, **_):
    lo, hi = (x2 & 0xF).long(), (x2 >> 4).long()          # [k/2, n]: element 2j low nibble
    codes = torch.stack([lo, hi], dim=1).reshape(-1, x2.shape[1])  # [k, n]
    w = torch.where(codes >= 8, -GRID[codes - 8], GRID[codes & 7])
    ws = 2.0 ** (scale.permute(1, 0, 2).reshape(x2.shape[1], -1).float() - 127)  # [n, k/32]
    w = w * ws.t().repeat_interleave(32, 0)
    xs = x1 * (2.0 ** pertoken_scale).repeat_interleave(32, 1)
    y = xs @ w
    if bias is not None:
        y = y + bias.float()
    return y.to(output_dtype)


def run_mxflatquant(va_src: Path, disk: dict[str, torch.Tensor], x: torch.Tensor,
                    bias: torch.Tensor | None = None, row: bool = False, tp: int = 1) -> torch.Tensor:
    """vllm-ascend's W4A4_MXFP4_FLATQUANT ``apply`` on one linear's on-disk tensors for ``x``
    (``row``: the linear is a RowParallelLinear). ``tp`` > 1 (a row layer): the sum in float32 of
    the ranks' outputs, each rank with its columns of ``weight`` / ``weight_scale`` (vLLM's
    row-parallel loader), the per-tensor params whole (process_weights_after_loading takes its
    diagonal block of left_trans) and its columns of ``x``; the bias on rank 0 (RowParallelLinear
    adds it once, after the reduce)."""
    if tp == 1:
        return _run_rank(va_src, disk, x, bias, row, 0, 1)

    def cols(t: torch.Tensor, r: int) -> torch.Tensor:
        return t[:, r * t.shape[1] // tp:(r + 1) * t.shape[1] // tp]

    outs = [_run_rank(va_src, dict(disk, weight=cols(disk["weight"], r), weight_scale=cols(disk["weight_scale"], r)),
                      cols(x, r), bias if r == 0 else None, row, r, tp) for r in range(tp)]
    return sum(o.to(torch.float32) for o in outs)


def _run_rank(va_src: Path, disk: dict, x: torch.Tensor, bias, row: bool, rank: int, tp: int) -> torch.Tensor:
    with _vllm_ascend(Path(va_src), {"model_type": "qwen3"}, x.dtype), _npu_tensor_method(), torch.no_grad():
        import importlib

        mod = importlib.import_module(METHOD)
        npu = sys.modules["torch_npu"]
        npu.npu_kronecker_quant = _kronecker_quant
        npu.npu_quant_matmul = _quant_matmul
        for name in ("float4_e2m1fn_x2", "float8_e8m0fnu"):
            if not hasattr(npu, name):
                setattr(npu, name, name)
        mod.get_current_vllm_config = lambda: type("C", (), {"quant_config": type("Q", (), {
            "quant_description": {}})()})()
        mod.get_tensor_model_parallel_world_size = lambda: tp
        meth = mod.AscendW4A4MXFP4FlatQuantDynamicLinearMethod()
        n, k2 = disk["weight"].shape
        k = 2 * k2
        cls = type("Layer", (torch.nn.Module, mod.RowParallelLinear) if row else (torch.nn.Module,), {})
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.tp_size, layer.tp_rank = tp, rank
        kind = "row" if row else "others"
        params = {**meth.get_weight(k, n, x.dtype), **meth.get_pertensor_param(x.dtype, layer_type=kind),
                  **meth.get_pergroup_param(k, n, x.dtype)}
        for name, p in params.items():
            t = disk[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{name}: checkpoint {list(t.shape)}, vllm-ascend declares {list(p.shape)}")
            p.copy_(t)
            layer.register_parameter(name, torch.nn.Parameter(p, requires_grad=False))
        meth.process_weights_after_loading(layer)
        return meth.apply(layer, x, bias=bias)
