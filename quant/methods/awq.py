"""AWQ (Lin et al., 2024): activation-aware scales for weight-only quantization.

For a group of linears that consume the same activation ``x`` (the output of one RMSNorm, or
of one producing linear), search per input channel scales ``s`` minimizing the output error
of the fake-quantized scaled weights on calibration samples::

    loss(s) = sum_i || X_i W_i^T - (X_i / s) Q_i(W_i * s)^T ||^2 / sum_i numel
    s(alpha) = mean|x|^alpha / (w_mean^(1 - alpha) + 1e-4)      (duo_scaling, AutoAWQ's default)
             = mean|x|^alpha                                    (duo_scaling=False, the paper)
    normalized by sqrt(max s * min s); alpha = 0, 1/n_grid, .., (n_grid-1)/n_grid as the reference

where w_mean[j] is the mean over all consumer rows of |w| / max|w| of its group. s = 1 (plain
RTN) is always a candidate, so the search never does worse than RTN on its samples
(`AwqScale.alpha` is None when nothing beat it). The loss is per consumer linear (not the
output of the enclosing block, as AutoAWQ measures for attention / MLP groups).
The best s is folded exactly: the producer (norm weight, or the producer linear's rows) is
divided by s and every consumer's columns are multiplied by s, so the checkpoint stays plain.

Groups (`cvt.quant.methods.calib`): input_layernorm -> attention input projections;
q_a_layernorm -> q_b_proj; kv_a_layernorm -> kv_b_proj (only when kv_b_proj is quantized);
post_attention_layernorm -> gate/up of the dense MLP, shared experts and every routed expert
(one s for all: the norm is shared; the float router is scaled too); up_proj -> down_proj of
every MLP / expert; the value rows of kv_b_proj (float) -> o_proj (MLA), v_proj -> o_proj
(only without GQA).

Then the optional clipping search (AWQ's ``auto_clip``): per output row and group, shrink the
clamp range ``|w| <= r * max|w|`` for r in 1, 0.95, .. 0.55 and keep the r with the least
output error ``mean_t (sum_{j in group} x_tj (w_j - Q(clamp(w))_j))^2``; skipped for the q/k
producing projections as in the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cvt.qtensor.schemes.base import Scheme


@dataclass
class AwqScale:
    scales: torch.Tensor        # float32 [k]
    alpha: float | None         # None: no alpha beat s = 1 (scales are all ones)
    loss: float                 # at the chosen scales
    loss_rtn: float             # at s = 1 (plain RTN)


def _scales(x_mean_abs: torch.Tensor, alpha: float, w_mean: torch.Tensor | None = None) -> torch.Tensor:
    s = x_mean_abs.to(torch.float32).pow(alpha)
    if w_mean is not None:
        s = s / (w_mean.pow(1 - alpha) + 1e-4)
    s = s.clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def _w_mean(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """Mean over all consumer rows of |w| / max|w| of its group ([k]), AutoAWQ's duo-scaling statistic."""
    total, rows = None, 0
    for w in weights:
        n, k = w.shape
        g = group_size if group_size and k % group_size == 0 else k
        a = w.abs().reshape(n, k // g, g)
        a = (a / (a.amax(dim=-1, keepdim=True) + 1e-6)).reshape(n, k).sum(dim=0)
        total = a if total is None else total + a
        rows += n
    return total / rows


def _row_separable(scheme: Scheme, k: int) -> bool:
    try:
        return all(shape[0] == 2 for shape, _ in scheme.param_info((2, k)).values())
    except Exception:   # a scheme that cannot describe itself: evaluate its consumers one by one
        return False


@torch.no_grad()
def awq_search(x_mean_abs: torch.Tensor, inputs: list[torch.Tensor], weights: list[torch.Tensor],
               schemes: list[Scheme], *, n_grid: int = 20, duo_scaling: bool = True) -> AwqScale:
    """Best s [k] for the consumers (inputs X_i [N_i, k], weights W_i [n_i, k], schemes) of one
    activation whose per-channel mean |x| is `x_mean_abs` [k]."""
    ws = [w.detach().to(torch.float32) for w in weights]
    w_mean = _w_mean(ws, getattr(schemes[0], "group_size", 0)) if duo_scaling else None
    # consumers given the same input tensor and scheme object are evaluated as one stacked weight
    # when the scheme quantizes rows independently (every part has a row dim): same numbers, fewer calls
    batches: dict[tuple, list[int]] = {}
    for i, (x, sch) in enumerate(zip(inputs, schemes)):
        key = (id(x), id(sch)) if _row_separable(sch, ws[i].shape[1]) else (i,)
        batches.setdefault(key, []).append(i)
    xs, bws, bsch = [], [], []
    for idx in batches.values():
        x = inputs[idx[0]]
        xs.append(x.detach().to(torch.float32).reshape(-1, x.shape[-1]))
        bws.append(torch.cat([ws[i] for i in idx]) if len(idx) > 1 else ws[idx[0]])
        bsch.append(schemes[idx[0]])
    refs = [x @ w.t() for x, w in zip(xs, bws)]
    total = sum(r.numel() for r in refs) or 1

    def loss_of(s: torch.Tensor) -> float:
        loss = 0.0
        for x, w, ref, sch in zip(xs, bws, refs, bsch):
            w_eff = sch.fake_quant(w * s[None, :]).to(torch.float32) / s[None, :]
            loss += float(((x @ w_eff.t()) - ref).pow(2).sum())
        return loss / total

    ones = torch.ones(x_mean_abs.shape[0], dtype=torch.float32)
    loss_rtn = loss_of(ones)
    best = (None, loss_rtn, ones)
    for i in range(n_grid):
        alpha = i / n_grid
        s = _scales(x_mean_abs, alpha, w_mean)
        loss = loss_of(s)
        if loss < best[1]:
            best = (alpha, loss, s)
    alpha, loss, s = best
    return AwqScale(s, alpha, loss, loss_rtn)


@torch.no_grad()
def awq_clip(x: torch.Tensor, w: torch.Tensor, scheme: Scheme, *, n_grid: int = 20, max_shrink: float = 0.5,
             group_size: int | None = None, rows_per_chunk: int = 256) -> torch.Tensor:
    """The weight with each (row, group) clamped to ``r * max|w|`` for the best r (see module doc).

    x [N, k] calibration inputs, w [n, k]; the returned float32 weight is what the caller then
    quantizes with the scheme (RTN)."""
    x = x.detach().to(torch.float32).reshape(-1, x.shape[-1])
    w = w.detach().to(torch.float32)
    n, k = w.shape
    G = group_size or getattr(scheme, "group_size", 0) or k
    if k % G:
        G = k
    ng = k // G
    xg = x.reshape(-1, ng, G)                                               # [N, g, G]
    amax = w.abs().reshape(n, ng, G).amax(dim=-1)                          # [n, g]
    ratios = [1 - i / n_grid for i in range(int(max_shrink * n_grid))]
    ref = torch.empty(x.shape[0], n, ng)
    for r0 in range(0, n, rows_per_chunk):
        r1 = min(n, r0 + rows_per_chunk)
        ref[:, r0:r1] = torch.einsum("tgj,ngj->tng", xg, w[r0:r1].reshape(-1, ng, G))
    best_err = torch.full((n, ng), float("inf"))
    best_r = torch.ones(n, ng)
    for r in ratios:
        lim = (amax * r)[:, :, None]
        wc = torch.maximum(torch.minimum(w.reshape(n, ng, G), lim), -lim).reshape(n, k)
        q = scheme.fake_quant(wc).to(torch.float32)
        err = torch.empty(n, ng)
        for r0 in range(0, n, rows_per_chunk):
            r1 = min(n, r0 + rows_per_chunk)
            out = torch.einsum("tgj,ngj->tng", xg, q[r0:r1].reshape(-1, ng, G))
            err[r0:r1] = (out - ref[:, r0:r1]).pow(2).mean(dim=0)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_r = torch.where(better, torch.full_like(best_r, r), best_r)
    lim = (amax * best_r)[:, :, None]
    return torch.maximum(torch.minimum(w.reshape(n, ng, G), lim), -lim).reshape(n, k)
