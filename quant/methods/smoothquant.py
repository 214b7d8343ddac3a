"""SmoothQuant (Xiao et al., 2023) for W8A8: migrate activation outliers into the weights.

For the linears that consume one RMSNorm's output (all of them get the same factor, since the
factor is folded into the norm), per input channel j::

    s_j = max|x_j|^alpha / max_i |W_ij|^(1 - alpha)      (max over every quantized consumer)
    norm.weight /= s;   W_consumer[:, j] *= s_j             (float output unchanged)

so that ``x / s`` has flatter channels for per-token int8 activations and ``W * s`` stays easy
for per-channel int8 weights; alpha (default 0.5) trades one against the other. Groups
(`cvt.quant.methods.calib`): input_layernorm -> the attention input projections
(q_a_proj / q_proj, kv_a_proj_with_mqa, k_proj, v_proj), q_a_layernorm -> q_b_proj, and
post_attention_layernorm -> gate/up of the dense MLP, of the shared experts and of every routed
expert, plus the float router (scaled too, so routing is unchanged).

The fold helpers here are shared with AWQ.
"""

from __future__ import annotations

import torch
from torch import nn

from cvt.quant.recipe import METHOD_TABLE, SMOOTHQUANT

MIN_SCALE = 1e-5
# the kernel formats with quantized activations: a weight-only scheme (w4a16, fp4) has no
# activation outliers to migrate, and smoothing would only make its weights harder to quantize
SUPPORTED = METHOD_TABLE[SMOOTHQUANT].kernels


def smooth_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float = 0.5) -> torch.Tensor:
    """s [k] from the per-channel activation absmax [k] and the consumers' weights [n_i, k].

    Channels with no activation or no weight get s = 1."""
    a = act_absmax.detach().to(torch.float32)
    w = torch.stack([wi.detach().to(torch.float32).abs().amax(dim=0) for wi in weights]).amax(dim=0)
    s = a.clamp(min=MIN_SCALE).pow(alpha) / w.clamp(min=MIN_SCALE).pow(1 - alpha)
    s = s.clamp(min=MIN_SCALE)
    return torch.where((a > 0) & (w > 0), s, torch.ones_like(s))


@torch.no_grad()
def scale_columns(module: nn.Module, s: torch.Tensor) -> None:
    """module.weight[:, j] *= s_j (a consumer of the smoothed activation), in float32."""
    w = module.weight
    w.data = (w.data.to(torch.float32) * s.to(w.device)[None, :]).to(w.dtype)


@torch.no_grad()
def scale_rows(module: nn.Module, s: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Divide output rows (all, or `rows` in the order of s) of a norm weight [k] or a linear
    weight [n, k] (and its bias) by s: the producer side of a fold. A norm scaling by
    ``unit_offset + weight`` (Qwen3.5's zero-centred RMSNorm) has that sum divided."""
    for name in ("weight", "bias"):
        p = getattr(module, name, None)
        if p is None:
            continue
        off = getattr(module, "unit_offset", 0.0) if name == "weight" else 0.0
        v = p.data.to(torch.float32).clone()
        idx = torch.arange(v.shape[0], device=v.device) if rows is None else rows.to(v.device)
        shape = (-1,) + (1,) * (v.dim() - 1)
        v[idx] = (v[idx] + off) / s.to(v.device).reshape(shape) - off if off else v[idx] / s.to(v.device).reshape(shape)
        p.data = v.to(p.dtype)
