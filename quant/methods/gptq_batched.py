"""Batched GPTQ: the algorithm of `gptq.gptq_quantize` for E linears of one shape at once.

A MoE layer has many linears of the same shape (the routed experts' gate / up / down
projections). `gptq_quantize` sweeps one linear's k columns, each column a handful of tiny
kernels: on a GPU that is launch-bound. `gptq_quantize_batched` sweeps the k columns once for
all E members, every step one set of tensor ops over ``[E, n, ...]``:

==========================  ============================================================
step                        batched form
==========================  ============================================================
dead columns                ``diag(H) == 0`` per member: masked fills, no host round trip
act_order                   a permutation per member ``perm [E, k]``, columns gathered
inverse Cholesky            ``cholesky_ex`` on ``[E, k, k]``; a member that fails at damp d
                            retries at 10 d, the others keep theirs (`used_damp` per member)
column quantization         `_BatchedGrid`: scales ``[E, n, n_groups]``, one column of every
                            member on its grid in one set of elementwise ops
rank-1 update in a block    ``err [E, n, 1] * U[:, i, None, i:]`` subtracted (as `gptq._sweep`)
lazy block update           ``bmm`` of ``E1 [E, n, B]`` with ``U [E, B, k - i2]``
dynamic groups              the scheme's RTN of the group's current columns of all members
                            stacked as ``[E * n, G]`` (rows are independent in every
                            scheme without a per-tensor part, the only ones with dynamic
                            groups); scale search weighs each row by its own member's diag(H)
==========================  ============================================================

The per-column step does not read a value back to the host (no ``.item()``, ``int(t)``,
``bool(t)``): act_order's group of a column comes from gathering the scales with the
permutation on the device, once per block. A dynamic group calls the scheme's RTN once when
the sweep enters it (k / G times for all members together), which may check its input on
the host.

Results equal `gptq_quantize` of each member alone up to float reduction order:
``used_damp`` and dead columns exactly, codes for all but a few elements whose value sat on a
rounding boundary (tests/quant/test_gptq_batched.py). On the CPU builds measured so far they
are the same bits (the batched GEMMs reduce in the same order as the per-member ones); a GPU's
batched GEMM need not.
"""

from __future__ import annotations

from typing import Callable

import torch

from cvt.errors import CvtError
from cvt.qtensor import mx as MX
from cvt.qtensor.primitives import encode_e2m1
from cvt.qtensor.schemes.base import QuantizedTensor, Scheme
from cvt.quant.methods.gptq import (E2M1, E2M1_MIDS, SHRINKS, GPTQResult, _dynamic_parts, _Grid, _packed, _settings,
                                    inverse_upper_factor, search_scales)


class _BatchedGrid:
    """The `_Grid`s of E members stacked: ``scale / offset [E, n, n_groups]`` and, per group,
    what `quant` needs (safe divisor, zero-scale mask, the code of a zero scale).

    `column(g)` (group g of every member, views) or `block(gidx)` (``gidx [E, B]``: the group
    of each member's column, gathered) give the per-column parameters ``[E, n]`` / ``[E, n, B]``
    that `quant` takes: the same expressions as `_Grid.quant`, so the dequantized column is the
    kernel formula's value bit for bit."""

    def __init__(self, grids: list[_Grid]):
        g0 = grids[0]
        self.grids, self.elem, self.code, self.code_dtype = grids, g0.elem, g0.code, g0.code_dtype
        self.qmin, self.qmax = getattr(g0, "qmin", None), getattr(g0, "qmax", None)
        self.scale = torch.stack([g.scale for g in grids])
        self.offset = None if g0.offset is None else torch.stack([g.offset for g in grids])
        self._mids, self._e2m1 = E2M1_MIDS.to(self.scale.device), E2M1.to(self.scale.device)
        self._derive()

    def _derive(self) -> None:
        s = self.scale
        self.zero = s == 0
        self.safe = torch.where(self.zero, torch.ones_like(s), s)
        self.q0 = None if self.offset is None else torch.round(self.offset).clamp(self.qmin, self.qmax)

    def set_group(self, g: int, qt: QuantizedTensor) -> None:
        """Group g's scales of every member from `qt`, the scheme's RTN of ``[E * n, G]``."""
        E, n, _ = self.scale.shape
        other = _Grid(qt, 1)
        self.scale[:, :, g] = other.scale[:, 0].reshape(E, n)
        s = self.scale[:, :, g]
        self.zero[:, :, g] = s == 0
        self.safe[:, :, g] = torch.where(s == 0, torch.ones_like(s), s)
        if self.offset is not None:
            self.offset[:, :, g] = other.offset[:, 0].reshape(E, n)
            self.q0[:, :, g] = torch.round(self.offset[:, :, g]).clamp(self.qmin, self.qmax)

    def _params(self):
        return (self.scale, self.safe, self.zero, self.offset, self.q0)

    def column(self, g: int) -> tuple:
        return tuple(None if t is None else t[:, :, g] for t in self._params())

    def block(self, gidx: torch.Tensor) -> tuple:
        E, n, _ = self.scale.shape
        idx = gidx[:, None, :].expand(E, n, gidx.shape[1])
        return tuple(None if t is None else t.gather(2, idx) for t in self._params())

    def quant(self, col: torch.Tensor, p: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes as float32, dequantized values) of ``col [E, n]`` with the parameters `p`
        (`column` / one column of `block`)."""
        s, safe, zero, off, q0 = p
        if self.elem is not None:
            vals = MX.quantize_elements(col / s, self.elem)
            return (vals if self.elem == MX.FP8 else encode_e2m1(vals).to(torch.float32)), vals * s
        if off is not None:
            q = torch.round(col / safe + off).clamp_(self.qmin, self.qmax)
            q = torch.where(zero, q0, q)
            return q, (q - off) * s
        v = torch.where(zero, torch.zeros_like(col), col / safe)
        idx = (v.abs()[..., None] > self._mids).sum(dim=-1)            # nearest E2M1 index (ties down)
        mag = self._e2m1[idx]
        neg = (v < 0) & (idx > 0)
        code = idx + 8 * neg.to(idx.dtype)
        return code.to(torch.float32), torch.where(neg, -mag, mag) * s


@torch.no_grad()
def gptq_quantize_batched(W: torch.Tensor, H: torch.Tensor, scheme: Scheme, *, damp: float = 0.01,
                          act_order: bool = False, block_size: int = 128, static_groups: bool | None = None,
                          names: list[str] | None = None, scale_search: str | None = None,
                          shrinks: tuple[float, ...] = SHRINKS, same: list[int] | None = None) -> list[GPTQResult]:
    """GPTQ of E linear weights ``W [E, n, k]`` with their input Hessians ``H [E, k, k]``: the
    `GPTQResult` of each member, as `gptq.gptq_quantize` (same options) gives it for that member
    alone up to float reduction order. `names` (E of them) are used in messages. `same[e]`: the
    first member whose Hessian is member e's (gate and up of one expert): its inverse-Hessian
    factor is computed once and shared, as `gptq_quantize(factor=)` does."""
    if W.dim() != 3 or H.shape != (W.shape[0], W.shape[2], W.shape[2]):
        raise CvtError(f"batched GPTQ: weights {list(W.shape)} and Hessians {list(H.shape)} are not [E, n, k] and "
                       "[E, k, k]")
    E, n, k = W.shape
    names = list(names) if names is not None else [f"weight[{e}]" for e in range(E)]
    if len(names) != E:
        raise CvtError(f"batched GPTQ: {len(names)} names for {E} weights {list(W.shape)}")
    W = W.detach().to(torch.float32).clone()
    bad = (~torch.isfinite(W)).flatten(1).any(dim=1).tolist()
    if any(bad):
        raise CvtError(f"GPTQ {names[bad.index(True)]}: weight {[n, k]} holds non-finite values")
    H = H.detach().to(device=W.device, dtype=torch.float32).clone()
    dead = torch.diagonal(H, dim1=1, dim2=2) == 0                         # [E, k]
    torch.diagonal(H, dim1=1, dim2=2).masked_fill_(dead, 1)
    W.masked_fill_(dead[:, None, :], 0)
    rtn = [scheme.quantize(W[e]) for e in range(E)]      # static scales: after dead columns are zeroed
    G, n_groups, static_groups, block_size, search = _settings(rtn[0], n, k, names[0], act_order, block_size,
                                                               static_groups, scale_search)
    if search and static_groups:
        rtn = [search_scales(W[e], H[e], scheme, G, shrinks, scale_search) for e in range(E)]
    grid = _BatchedGrid([_Grid(r, n_groups) for r in rtn])
    dyn_parts = None
    if not static_groups:
        per = [_dynamic_parts(r.kernel_fmt, r.parts, n, n_groups) for r in rtn]
        dyn_parts = {key: torch.stack([p[key] for p in per]) for key in per[0]}

    perm = None
    if act_order:
        perm = torch.argsort(torch.diagonal(H, dim1=1, dim2=2), dim=1, descending=True)     # [E, k]
        W = W.gather(2, perm[:, None, :].expand(E, n, k))
        H = _permuted(H, perm)
    first = sorted(set(same)) if same is not None else list(range(E))
    U, used_damp = _inverse_cholesky_batched(H[first] if len(first) < E else H, damp, [names[e] for e in first])
    if len(first) < E:  # each member takes the factor of the first member with its Hessian
        at = [first.index(same[e]) for e in range(E)]
        U, used_damp = U[at], [used_damp[i] for i in at]
    hdiag = torch.diagonal(H, dim1=1, dim2=2)

    def regroup(cur: torch.Tensor, j: int) -> QuantizedTensor:  # every member's group from its current columns
        flat = cur.reshape(E * n, G)
        if not search:
            return scheme.quantize(flat)
        hd = hdiag[:, None, j:j + G].expand(E, n, G).reshape(E * n, G)
        return search_scales(flat, None, scheme, G, shrinks, scale_search, hd=hd)

    Q, codes, loss = _sweep_batched(W, U, grid, G, perm, block_size, dyn_parts, regroup)
    if perm is not None:
        inv = torch.argsort(perm, dim=1)[:, None, :].expand(E, n, k)
        Q, codes = Q.gather(2, inv), codes.gather(2, inv)
    out = []
    n_dead, losses = dead.sum(dim=1).tolist(), loss.sum(dim=1).tolist()
    for e in range(E):
        dyn = None if dyn_parts is None else {key: v[e] for key, v in dyn_parts.items()}
        qt, w_e, exact = _packed(rtn[e], grid.grids[e], codes[e], dyn, Q[e], scheme, names[e])
        out.append(GPTQResult(qt, w_e, losses[e], used_damp[e], static_groups, n_dead[e], exact))
    return out


def _permuted(H: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``H[e][perm[e]][:, perm[e]]`` for every member: rows then columns picked with index_select
    (whole-row copies, then one gather per row), half the CPU of two `gather`s reading an
    index per element."""
    out = torch.empty_like(H)
    for e in range(H.shape[0]):
        torch.index_select(H[e].index_select(0, perm[e]), 1, perm[e], out=out[e])
    return out


def _sweep_batched(W: torch.Tensor, U: torch.Tensor, grid: _BatchedGrid, G: int, perm: torch.Tensor | None,
                   block_size: int, dyn_parts: dict | None, regroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gptq._sweep` for ``W [E, n, k]`` (permuted per member under act_order, ``perm [E, k]``)
    and ``U [E, k, k]``. Dynamic groups (`dyn_parts` ``{part: [E, n, n_groups]}``) take their
    scales from ``regroup(current columns [E, n, G], first column)`` when the sweep enters them.
    Returns (dequantized Q, codes, loss ``[E, n]`` float64). No host sync per column."""
    E, n, k = W.shape
    Q = torch.zeros_like(W)
    codes = torch.zeros_like(W)
    loss = torch.zeros(E, n, dtype=torch.float64, device=W.device)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, :, i1:i2].clone()
        Q1, C1, E1 = torch.zeros_like(W1), torch.zeros_like(W1), torch.zeros_like(W1)
        U1 = U[:, i1:i2, i1:i2]
        blk = grid.block(perm[:, i1:i2] // G) if perm is not None else None
        for i in range(i2 - i1):
            j = i1 + i
            if dyn_parts is not None and j % G == 0:   # no perm with dynamic groups: column j is in group j // G
                cur = torch.cat((W1[:, :, i:], W[:, :, i2:]), dim=2)[:, :, :G]
                gq = regroup(cur.contiguous(), j)
                grid.set_group(j // G, gq)
                for key in dyn_parts:
                    dyn_parts[key][:, :, j // G] = gq.parts[key].reshape(E, n, -1)[:, :, 0]
            p = grid.column(j // G) if blk is None else tuple(None if t is None else t[:, :, i] for t in blk)
            wcol = W1[:, :, i]
            c, q = grid.quant(wcol, p)
            Q1[:, :, i], C1[:, :, i] = q, c
            err = (wcol - q) / U1[:, i, i, None]
            # w - e u, product and difference each rounded: as `gptq._sweep`, element for element
            W1[:, :, i:] -= err[:, :, None] * U1[:, i, None, i:]
            E1[:, :, i] = err
        Q[:, :, i1:i2], codes[:, :, i1:i2] = Q1, C1
        loss += E1.double().pow(2).sum(dim=2) / 2
        W[:, :, i2:] -= torch.bmm(E1, U[:, i1:i2, i2:])     # as `gptq._sweep`'s mm then subtract
    return Q, codes, loss


def _inverse_cholesky_batched(H: torch.Tensor, damp: float, names: list[str]) -> tuple[torch.Tensor, list[float]]:
    """`gptq._inverse_cholesky` of every member of ``H [E, k, k]``: the members that fail at
    dampening d retry at 10 d, the others keep their factor. Returns (U [E, k, k], damp per member)."""
    E, k, _ = H.shape
    # per member, as `_inverse_cholesky` takes it (a batched mean over the strided diagonals may sum in
    # another order, and the shift with it)
    mean_diag = [torch.diag(h).mean().item() for h in H]
    U = torch.empty_like(H)
    used: list[float] = [0.0] * E
    todo = list(range(E))
    for attempt in range(4):
        d = damp * 10 ** attempt
        idx = torch.tensor(todo, device=H.device)
        Hd = H[idx]
        # the shift rounded to float32 from the float64 product, as `Hd[eye, eye] += d * mean_diag`
        shift = torch.tensor([d * mean_diag[e] for e in todo], dtype=torch.float64, device=H.device)
        torch.diagonal(Hd, dim1=1, dim2=2).add_(shift.to(H.dtype)[:, None])
        Ui, info = inverse_upper_factor(Hd)
        ok = (info == 0).tolist()
        done = [i for i, good in enumerate(ok) if good]
        if done:
            U[idx[done]] = Ui[done]
            for i in done:
                used[todo[i]] = d
        todo = [e for e, good in zip(todo, ok) if not good]
        if not todo:
            return U, used
    raise CvtError(f"GPTQ {names[todo[0]]}: the input Hessian [{k}, {k}] is not positive definite even with "
                   f"dampening {damp * 1000:g} x mean(diag H); the calibration inputs may hold non-finite values")


# ---- the calibration driver's use: same-shaped linears of one quantization call ------------------

# members per batched call: enough to fill a GPU's launches, few enough that the stacked copies
# (weights, and a few [E, k, k] Hessian-sized buffers: damped H, its inverse, U) stay small
MAX_MEMBERS = 16
# [E, k, k] float32 buffers alive at once in a call (the stacked Hessians, their working copy, the
# damped copy, its factor, the inverse, U): what a call's members are counted against the budget
HESSIAN_COPIES = 6


def solve_together(items: list[tuple[str, torch.Tensor, Callable[[], torch.Tensor], Scheme]], max_bytes: int,
                   **opts) -> dict[str, GPTQResult]:
    """`gptq_quantize_batched` over `items` ``(name, weight [n, k], hessian(), scheme)``: those
    with the same weight shape, dtype, device and scheme object are solved together, in `items`
    order, at most `MAX_MEMBERS` per call and `max_bytes` for its `HESSIAN_COPIES` Hessian-sized
    float32 buffers. A linear with no partner is left out (the caller solves it alone, as
    before). `opts` go to each call."""
    groups: dict[tuple, list] = {}
    for it in items:
        w = it[1]
        groups.setdefault((tuple(w.shape), w.dtype, w.device, id(it[3])), []).append(it)
    out: dict[str, GPTQResult] = {}
    for members in groups.values():
        k = members[0][1].shape[1]
        per_call = max(1, min(MAX_MEMBERS, max_bytes // (HESSIAN_COPIES * 4 * k * k)))
        for b0 in range(0, len(members), per_call):
            batch = members[b0:b0 + per_call]
            if len(batch) < 2:
                continue
            W = torch.stack([m[1].detach().to(torch.float32) for m in batch])
            # linears of one site (gate and up of an expert) hand in the same hessian(): built once,
            # its factor computed once
            same = [next(j for j in range(i + 1) if batch[j][2] == batch[i][2]) for i in range(len(batch))]
            built = {j: batch[j][2]().to(torch.float32) for j in sorted(set(same))}
            H = torch.stack([built[j] for j in same])
            names = [m[0] for m in batch]
            out.update(zip(names, gptq_quantize_batched(W, H, batch[0][3], names=names, same=same, **opts)))
            del W, H
    return out
