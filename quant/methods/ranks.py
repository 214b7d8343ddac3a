"""Calibration across the ranks of a torchrun world (`cvt.world.World`, the layer driver's ``lc.world``):
statistics data parallel, each linear quantized by one owner rank, the results shared.

Every rank runs the decoder layer on its share of the calibration sequences (`share`). After
each statistics pass `reduce_sites` combines what the ranks saw, in rank order, so the result
depends on the world size only: token counts, per-channel min / max and sum |x| on every rank;
AWQ's samples are the ranks' samples in rank order, cut to the cap with a fixed seed; a GPTQ
Hessian ``H = 2/N sum x x^T`` is summed on its owner rank alone (``sum_r n_r H_r / N``), the
rank chosen by cost (`site_owners`: ``k^2 x rows + k^3`` per input site plus a per-column cost,
bin-packed) that then
runs GPTQ for every linear reading that site. `exchange` quantizes each rank's share of a
stage's linears (the other linears by cost, ``rows x k``; a FlatQuant site's linears on one rank,
which fits their transforms once: the AWQ samples' rows, so they fit the same) and shares the results -- quantized
parts, statistics, method, fallback -- so every rank sets the same dequantized weights before
it computes the next inputs. A smoothing fold is searched on one rank and broadcast
(`decided`): its float search must not differ between two machines' SIMD kernels.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Callable

import torch

from cvt.world import World
from cvt.quant.recipe import FLATQUANT, GPTQ


# GPTQ visits the columns one by one: a fixed cost per column (measured ~50 us on a CPU core,
# about this many flops), which dominates the k^3 + k^2 rows of a small linear
COLUMN_COST = 2_500_000


def share(w: World, n: int) -> slice:
    """Rank `w`'s contiguous share of `n` calibration sequences (empty when ranks outnumber them)."""
    lo, hi = n * w.rank // w.size, n * (w.rank + 1) // w.size
    return slice(lo, hi)


def site_owners(lc, sites: dict) -> dict[tuple, int]:
    """The rank that holds each GPTQ Hessian of `sites` and quantizes its linears."""
    keys = sorted(k for k, s in sites.items() if s.hess is not None)
    rows = {k: sum(lc.linears[t].weight.shape[0] for t in lc.schemes if lc.site_of[t] == k and lc.method[t] == GPTQ)
            for k in keys}
    costs = [sites[k].k ** 2 * max(rows[k], 1) + sites[k].k ** 3 + COLUMN_COST * sites[k].k for k in keys]
    return dict(zip(keys, lc.world.owners(costs)))


@torch.no_grad()
def reduce_sites(lc, sites: dict) -> None:
    """Combine every rank's statistics of `sites` (module doc); records the Hessians' owners in
    ``lc.site_owner``."""
    w = lc.world
    owners = site_owners(lc, sites)
    lc.site_owner.update(owners)
    for key in sorted(sites):
        s = sites[key]
        parts = w.all_gather((s.n, s.cmax, s.cmin, s.abssum, s.buf if s.cap else None))
        s.n = sum(p[0] for p in parts)
        s.cmax = torch.stack([p[1] for p in parts]).amax(dim=0)
        s.cmin = torch.stack([p[2] for p in parts]).amin(dim=0)
        total = parts[0][3].clone()
        for p in parts[1:]:
            total += p[3]
        s.abssum = total
        if s.cap:
            bufs = [p[4] for p in parts if p[4] is not None and p[4].shape[0]]
            buf = torch.cat(bufs) if bufs else None
            if buf is not None and buf.shape[0] > s.cap:  # the cap, chosen with a seed fixed per site
                g = torch.Generator().manual_seed(zlib.crc32(key[1].encode()) + 1)
                buf = buf[torch.randperm(buf.shape[0], generator=g)[:s.cap].sort().values]
            s.buf = buf
        if s.hess is not None:
            h = s.hess
            mine = h.H * h.n  # 2 sum x x^T over this rank's rows
            total = w.gather_sum(mine, owners[key])
            if w.rank == owners[key]:
                h._H, h.n = (total / s.n if s.n else total), s.n
            else:
                s.hess = None  # only the owner runs GPTQ on this site


def _portable(qt):
    """A QuantizedTensor whose tensors live on the CPU (what crosses to the other ranks)."""
    cpu = {k: v.detach().cpu() for k, v in qt.parts.items()}
    extra = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in qt.extra.items()}
    return dataclasses.replace(qt, parts=cpu, extra=extra)


def exchange(lc, names: list[str], sites: dict, quantize: Callable[[str], None],
             prepare: Callable[[list[str]], None] | None = None) -> None:
    """`quantize(name)` on the rank owning each of `names`, then every rank takes every result
    (in `names` order, as one process would have made them). `prepare(mine)`, when given, runs
    first on each rank with the names it quantizes (batched GPTQ of same-shaped linears)."""
    w = lc.world
    if w.size == 1:
        if prepare is not None:
            prepare(list(names))
        for t in names:
            quantize(t)
        return
    fixed = {t: lc.site_owner[lc.site_of[t]] for t in names
             if lc.method[t] == GPTQ and lc.site_of[t] in lc.site_owner}
    free = [t for t in names if t not in fixed]
    costs = [lc.linears[t].weight.shape[0] * lc.linears[t].weight.shape[1] for t in free]
    owner = {**fixed, **dict(zip(free, w.owners(costs)))}
    first: dict = {}  # a FlatQuant site's linears on one rank: it fits their one set of transforms
    for t in names:
        if lc.method[t] == FLATQUANT:
            owner[t] = owner[first.setdefault(lc.site_of[t], t)]
    res = lc.res
    n_fb = len(res.fallbacks)
    mine = [t for t in names if owner[t] == w.rank]
    if prepare is not None:
        prepare(mine)
    for t in mine:
        quantize(t)
    fb = {f.name: f for f in res.fallbacks[n_fb:]}
    del res.fallbacks[n_fb:]
    payload = {t: (_portable(res.quantized[t]), res.stats.get(t, {}), res.methods[t], fb.get(t)) for t in mine}
    results: dict[str, tuple] = {}
    for p in w.all_gather(payload):
        results.update(p)
    for t in names:
        qt, stats, method, fallback = results[t]
        if owner[t] != w.rank:
            res.quantized[t], res.stats[t], res.methods[t] = qt, stats, method
            mod = lc.linears[t]
            mod.weight.data = lc.schemes[t].dequantize(qt).to(device=mod.weight.device, dtype=mod.weight.dtype)
        if fallback is not None:
            res.fallbacks.append(fallback)


def decided(w: World, rank_for: str, compute: Callable[[], object]):
    """`compute()` on one rank of `w` (chosen by the name `rank_for`), its answer on every rank."""
    if w.size == 1:
        return compute()
    src = zlib.crc32(rank_for.encode()) % w.size
    return w.broadcast(compute() if w.rank == src else None, src=src)


def amax_max(w: World, amax: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each KV role's running amax, the maximum over the ranks of `w`."""
    if w.size == 1:
        return amax
    out: dict[str, torch.Tensor] = {}
    for part in w.all_gather(amax):
        for role, t in part.items():
            out[role] = t if role not in out else torch.maximum(out[role], t)
    return out
