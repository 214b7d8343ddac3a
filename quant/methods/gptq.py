"""GPTQ (Frantar et al., 2022): quantize one linear column by column, pushing each column's
quantization error onto the not-yet-quantized columns through the inverse Hessian of the
layer's inputs.

For ``w [n, k]`` and calibration inputs ``x [N, k]`` (the rows the linear saw)::

    H    = 2/N sum_t x_t x_t^T                                    [k, k]   (`HessianAccumulator`)
    dead = diag(H) == 0  ->  H[dead, dead] = 1, w[:, dead] = 0
    act_order: permute columns by descending diag(H)
    H   += damp * mean(diag H) * I            (damp 0.01; x10 retried if H is not positive definite)
    U    = cholesky(H^-1, upper)              the rows of U drive the updates
    for each block of B columns (lazy batch updates), for each column j of the block:
        q_j  = quant(w_j)                     with the scales of j's group (see below)
        e_j  = (w_j - q_j) / U[j, j]
        w[:, j+1:block_end] -= e_j U[j, j+1:block_end]
    after the block:  w[:, block_end:] -= E U[block, block_end:]

Quantization grid. The `Scheme` protocol has no "scales of one group" / "quantize with fixed
scales" hooks, so the grid comes from the scheme's own RTN: `scheme.quantize` of a float
matrix yields the canonical parts (`base.py`), and the per-group scale / offset are read from
those parts with the dequant formula of the runtime kernel of that `kernel_fmt`
(`_Grid`). GPTQ then only picks the integer / E2M1 code of every element on that grid, and
the result is built from the RTN parts with the code part replaced, so the scale convention
(absmax/7 or /7.5, E4M3 rounding, E8M0 exponent) is always the scheme's:

* dynamic groups (the reference): when a group starts, its scales come from
  `scheme.quantize(w_current[:, group])` -- the group's columns as GPTQ has updated them so far;
* static groups: all scales come up front from `scheme.quantize(w_original)`. Used with
  ``act_order`` (a permuted column order visits a group's columns at different times, so the
  group keeps the scales of the ORIGINAL column grouping, as AutoGPTQ's ``static_groups``: no
  g_idx is needed on disk) and for schemes with a per-tensor part (nvfp4's global scale: a
  slice would get its own), and on request.

Scale search (``scale_search``, on by default in the calibration drivers): instead of the
absmax grid, each group takes the grid of its weight clipped to ``r * [min, max]`` for the
``r`` in 1.0 .. 0.8 that quantizes it with the least error weighted by diag(H) ("hdiag"; "mse"
unweighted). With ``act_order`` (static groups) the search runs once on the original weight,
otherwise on each group's current columns when the group starts. On the trained fixture
(W4A16 g128, 32768 calibration tokens, held-out text) act_order + the hdiag search lowered the
mean KL from 0.00375 to 0.00304 (README).

Supported kernel formats: w4a16 (int4 sym/asym, any group size), w8a8_dynamic (int8 per
channel: one group = the row), nvfp4, mxfp4, and the Ascend 950 MX ones (mxfp8, w4a4_mxfp4,
w4a8_mxfp: block 32, E8M0 scales from the scheme, elements on msModelSlim's grid). w8a8_static (static activation scales) is
refused: its parts fold the weight scale into deq_scale / quant_bias.

The returned `GPTQResult.weight` is ``scheme.dequantize(qtensor)``; it is checked to equal
the GPTQ columns computed here with the kernel formula (so the stored tensor is what GPTQ
chose, exactly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cvt.qtensor import kernel_formats as KF
from cvt.qtensor import mx as MX
from cvt.qtensor.primitives import encode_e2m1, finite_known
from cvt.errors import CvtError
from cvt.quant.recipe import GPTQ, METHOD_TABLE
from cvt.qtensor.schemes.base import QuantizedTensor, Scheme

E2M1 = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0), dtype=torch.float32)
# midpoints between consecutive E2M1 magnitudes: #(MIDS < v) = index of the nearest magnitude
E2M1_MIDS = (E2M1[1:] + E2M1[:-1]) / 2
INT_RANGES = {KF.W4A16: ("weight_int4", -8, 7), KF.W8A8_DYNAMIC: ("weight", -128, 127)}
# the Ascend 950 MX formats: (element kind, code part); the grid is msModelSlim's (`cvt.qtensor.mx`)
MX_ELEM = {KF.MXFP8: (MX.FP8, "weight_fp8"), KF.W4A4_MXFP4: (MX.FP4, "weight_fp4"), KF.W4A8_MXFP: (MX.FP4, "weight_fp4")}
FP4_GROUP = {KF.NVFP4: 16, KF.MXFP4: 32, **{f: MX.BLOCK for f in MX_ELEM}}
SUPPORTED = METHOD_TABLE[GPTQ].kernels  # the kernel formats below handle: int4, int8 per channel, fp4, MX
METRICS = ("mse", "hdiag")
# clipping ratios tried by the scale search: 1.0 (absmax) down to 0.8 in steps of 0.01, as
# llm-compressor's MSE observer (maxshrink 0.2) and AutoAWQ's clip search cover
SHRINKS = tuple(1 - i / 100 for i in range(21))


class HessianAccumulator:
    """Running ``H = 2/N sum x x^T`` over batches of inputs ``x [..., k]`` (float32 by default,
    the reference's choice; float64 on request). ``n`` counts the rows seen."""

    def __init__(self, k: int, dtype: torch.dtype = torch.float32, device=None):
        self.k, self.dtype = k, dtype
        self._H = None if device is None else torch.zeros(k, k, dtype=dtype, device=device)
        self.n = 0

    @property
    def H(self) -> torch.Tensor:
        """[k, k]; allocated on the device of the first batch (CPU when none came)."""
        if self._H is None:
            self._H = torch.zeros(self.k, self.k, dtype=self.dtype)
        return self._H

    def add(self, x: torch.Tensor) -> None:
        if self._H is None:
            self._H = torch.zeros(self.k, self.k, dtype=self.dtype, device=x.device)
        x = x.reshape(-1, x.shape[-1]).to(self._H.dtype)
        m = x.shape[0]
        if m == 0:
            return
        self._H *= self.n / (self.n + m)
        self.n += m
        x = x * math.sqrt(2.0 / self.n)
        self._H.addmm_(x.t(), x)


@dataclass
class GPTQResult:
    qtensor: QuantizedTensor
    weight: torch.Tensor        # float32 [n, k] == scheme.dequantize(qtensor)
    loss: float                 # GPTQ's proxy loss sum_j |w_j - q_j|^2 / U_jj^2 / 2
    damp: float                 # the relative dampening that was used
    static_groups: bool
    dead_columns: int
    exact: bool                 # scheme.dequantize(qtensor) equals the kernel-formula columns bit for bit


# ---- the quantization grid read from a scheme's RTN parts -----------------------------------------

class _Grid:
    """Per-group grids of one weight, read from canonical parts of `kernel_fmt`.

    ``scale[:, g]`` / ``offset[:, g]`` (int) or ``scale[:, g]`` (fp4, the float32 multiplier
    the kernel applies) for group g; `quant(col, g)` returns (codes, dequantized column)
    computed with the kernel's expressions, so the dequantized column is bit-exact."""

    def __init__(self, qt: QuantizedTensor, n_groups: int):
        fmt = qt.kernel_fmt
        self.fmt = fmt
        self.n_groups = n_groups
        self.elem = None
        if fmt in MX_ELEM:  # E8M0 block scales: the multiplier 2**(e - 127), elements on msModelSlim's grid
            self.elem, self.code = MX_ELEM[fmt]
            self.scale = (2 ** MX.e8m0_exponents(qt.parts["weight_scale"])).reshape(qt.shape[0], -1).clone()
            self.offset = None
        elif fmt in INT_RANGES:
            self.code, self.qmin, self.qmax = INT_RANGES[fmt]
            self.scale = qt.parts["weight_scale"].to(torch.float32).reshape(qt.shape[0], -1).clone()
            self.offset = qt.parts["weight_offset"].to(torch.float32).reshape(qt.shape[0], -1).clone()
        else:
            self.code = "weight_fp4"
            self.scale = _fp4_scales(qt).clone()
            self.offset = None
        if self.scale.shape[1] != n_groups:
            raise CvtError(f"GPTQ: scheme {qt.scheme!r} returned {self.scale.shape[1]} scale groups for a weight "
                           f"{list(qt.shape)}, expected {n_groups}")
        self.code_dtype = qt.parts[self.code].dtype if self.code in qt.parts else None  # a `Scheme.grid`: none
        self._cache: dict[int, tuple] = {}
        self._mids, self._e2m1 = E2M1_MIDS.to(self.scale.device), E2M1.to(self.scale.device)

    def set_group(self, g: int, qt: QuantizedTensor) -> None:
        """Take group g's scales from `qt`, the scheme's RTN of that group's columns alone."""
        other = _Grid(qt, 1)
        self.scale[:, g] = other.scale[:, 0]
        if self.offset is not None:
            self.offset[:, g] = other.offset[:, 0]
        self._cache.pop(g, None)

    def _group(self, g: int):
        c = self._cache.get(g)
        if c is None:
            s = self.scale[:, g].contiguous()
            zero = s == 0
            safe = torch.where(zero, torch.ones_like(s), s)
            off = None if self.offset is None else self.offset[:, g].contiguous()
            q0 = None if off is None else torch.round(off).clamp(self.qmin, self.qmax)
            c = self._cache[g] = (s, safe, zero if bool(zero.any()) else None, off, q0)
        return c

    def quant(self, col: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes as float32, dequantized column) of column `col` [n] on group g's grid."""
        s, safe, zero, off, q0 = self._group(g)
        if self.elem is not None:
            vals = MX.quantize_elements(col / s, self.elem)
            return (vals if self.elem == MX.FP8 else encode_e2m1(vals).to(torch.float32)), vals * s
        if off is not None:
            q = torch.round(col / safe + off).clamp_(self.qmin, self.qmax)
            if zero is not None:
                q = torch.where(zero, q0, q)
            return q, (q - off) * s
        v = col / safe
        if zero is not None:
            v = torch.where(zero, torch.zeros_like(v), v)
        idx = (v.abs()[:, None] > self._mids[None, :]).sum(dim=1)   # nearest E2M1 index (ties down)
        mag = self._e2m1[idx]
        neg = (v < 0) & (idx > 0)
        code = idx + 8 * neg.to(idx.dtype)
        return code.to(torch.float32), torch.where(neg, -mag, mag) * s

    def fake(self, W: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every column of ``W [n, n_groups * G]`` on its group's grid (column j in group j // G),
        dequantized: the values `quant` gives column by column, computed at once (the group's
        scale broadcast over its G columns: the same elementwise arithmetic, no expanded copies).
        `out` (like W): the integer grids compute in it, in place (a search calls this once per
        candidate: a fresh [n, k] buffer per step costs its page faults)."""
        n, k = W.shape
        w = W.reshape(n, self.n_groups, k // self.n_groups)
        s = self.scale[:, :, None]
        if self.elem is not None:
            return (MX.quantize_elements(w / s, self.elem) * s).reshape(n, k)
        zero = self.scale == 0
        fix = bool(zero.any())          # an all-zero group's scale (the schemes store 1.0 there: rare)
        safe = torch.where(zero, torch.ones_like(self.scale), self.scale)[:, :, None] if fix else s
        if self.offset is not None:
            off = self.offset[:, :, None]
            buf = None if out is None else out.view(w.shape)
            if not fix and not bool(self.offset.any()):
                # symmetric grids: + 0 and - 0 change no value but the sign of a zero, which the
                # loss squares away
                return torch.div(w, safe, out=buf).round_().clamp_(self.qmin, self.qmax).mul_(s).reshape(n, k)
            q = torch.div(w, safe, out=buf).add_(off).round_().clamp_(self.qmin, self.qmax)
            if fix:
                q = torch.where(zero[:, :, None], torch.round(off).clamp(self.qmin, self.qmax), q)
            return q.sub_(off).mul_(s).reshape(n, k)
        v = w / safe
        if fix:
            v = torch.where(zero[:, :, None], torch.zeros_like(v), v)
        idx = torch.bucketize(v.abs(), self._mids)          # #(MIDS < |v|), as `quant`
        mag = self._e2m1[idx]
        return (torch.where((v < 0) & (idx > 0), -mag, mag) * s).reshape(n, k)

    def parts(self, rtn: QuantizedTensor, codes: torch.Tensor) -> dict[str, torch.Tensor]:
        """`rtn`'s parts with the codes replaced and, for dynamic groups, the group scales."""
        out = dict(rtn.parts)
        out[self.code] = codes.to(self.code_dtype)
        return out


def _fp4_scales(qt: QuantizedTensor) -> torch.Tensor:
    """float32 [n, k/G] group multipliers as the fp4 kernels compute them."""
    from cvt.convert.fp8 import scale_to_f32

    s = qt.parts["weight_scale"]
    if qt.kernel_fmt == KF.NVFP4:
        return s.to(torch.float32) / qt.parts["weight_global_scale"].to(torch.float32).reshape(())
    return scale_to_f32(s.view(torch.float8_e8m0fnu) if s.dtype == torch.uint8 else s)


def _group_size(qt: QuantizedTensor, k: int) -> int:
    if qt.kernel_fmt in FP4_GROUP:
        return FP4_GROUP[qt.kernel_fmt]
    return qt.group_size or k


def _dynamic_parts(fmt: str, parts: dict, n: int, n_groups: int) -> dict[str, torch.Tensor]:
    """The parts that are per group ([n, n_groups]) and must follow dynamic group scales."""
    return {k: v for k, v in parts.items() if v.dim() == 2 and tuple(v.shape) == (n, n_groups)
            and k not in ("weight", "weight_int4", "weight_fp4")}


def _bounds(W: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``W [n, k]`` as groups ``[n, k/G, G]`` with each row and group's min(w, 0) and max(w, 0)."""
    n, k = W.shape
    g = W.reshape(n, k // G, G)
    return g, g.amin(dim=-1, keepdim=True).clamp(max=0.0), g.amax(dim=-1, keepdim=True).clamp(min=0.0)


def _clip(W: torch.Tensor, G: int, r: float, bounds=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """W with every group's range shrunk by r: clamp to [r * min(w, 0), r * max(w, 0)] per row and
    group (`bounds`: `_bounds(W, G)`, when the caller clips W by several r; `out`: a buffer like W
    to write it in)."""
    g, lo, hi = bounds or _bounds(W, G)
    c = torch.minimum(g, hi * r, out=None if out is None else out.view(g.shape))
    return torch.maximum(c, lo * r, out=c).reshape(W.shape)


def _group_loss(err: torch.Tensor, H: torch.Tensor | None, G: int, metric: str,
                hd: torch.Tensor | None = None, inplace: bool = False) -> torch.Tensor:
    """[n, k/G] loss of the error ``err [n, k]`` per row and group: "mse" sum e^2; "hdiag" sum
    e^2 diag(H) (each column's error weighted by its input's energy: the output error a column
    causes when the inputs are uncorrelated). `hd` ``[n, k]``, when given, replaces diag(H) per
    row (the rows of several linears stacked, each with its own Hessian: `gptq_batched`).
    `inplace`: err is the caller's scratch, overwritten (the same values, no new [n, k] buffers)."""
    n, k = err.shape
    e = err.reshape(n, k // G, G)
    e2 = e.square_() if inplace else e.pow(2)
    if metric == "mse":
        return e2.sum(-1)
    # diag(H) contiguous: a strided view (stride k + 1) as the broadcast operand is ~20x slower
    w = torch.diagonal(H).contiguous().reshape(1, k // G, G) if hd is None else hd.reshape(n, k // G, G)
    return (e2.mul_(w) if inplace else e2 * w).sum(-1)


def search_scales(W: torch.Tensor, H: torch.Tensor | None, scheme: Scheme, G: int, shrinks, metric: str,
                  hd: torch.Tensor | None = None) -> QuantizedTensor:
    """The scheme's quantization of ``W [n, k]`` whose per-group parts (scales, offsets) are, per
    row and group, those of the clipped weight `_clip(W, G, r)` for the r in `shrinks` whose grid
    quantizes W (unclipped) with the least `_group_loss`. shrinks[0] should be 1.0 (plain absmax):
    ties keep the earlier candidate, so the chosen grid is never worse than it on the metric.
    The loss is that of W on each grid (`_Grid.fake`: codes of the unclipped weight, as GPTQ picks
    them); the returned per-element parts (codes) are the absmax RTN's, which GPTQ replaces.
    The candidates after the first are the scheme's grids only (`Scheme.grid`: no codes) of a W
    already checked finite. One candidate is alive at a time: memory is one quantization of W
    plus the per-group best. `hd` ``[n, k]`` replaces diag(H) per row (`_group_loss`)."""
    n, k = W.shape
    ng = k // G
    base = best_loss = None
    best: dict[str, torch.Tensor] = {}
    bounds = _bounds(W, G)
    clipped, scratch = torch.empty_like(W), torch.empty_like(W)     # reused by every candidate
    for r in shrinks:
        if base is None:
            qt = scheme.quantize(_clip(W, G, r, bounds) if r != 1.0 else W)
        else:
            with finite_known():                                    # W was checked by the first candidate
                qt = scheme.grid(_clip(W, G, r, bounds, clipped) if r != 1.0 else W)
        # fake - W rather than W - fake: the loss squares it, in place in the scratch buffer
        loss = _group_loss(_Grid(qt, ng).fake(W, scratch).sub_(W), H, G, metric, hd, inplace=True)
        per_group = {key: v.reshape(n, -1) for key, v in qt.parts.items() if v.numel() == n * ng}
        if base is None:
            base, best_loss, best = qt, loss, {key: v.clone() for key, v in per_group.items()}
            for key, v in qt.parts.items():
                if v.numel() not in (n * ng, n * k):
                    raise CvtError(f"GPTQ scale search: part {key!r} {list(v.shape)} is neither per group nor per "
                                   "element")
            continue
        better = loss < best_loss                                   # ties keep the earlier (larger) ratio
        best_loss = torch.where(better, loss, best_loss)
        for key, v in per_group.items():
            best[key] = torch.where(better, v, best[key])
    parts = {key: (best[key].reshape(v.shape) if key in best else v) for key, v in base.parts.items()}
    return QuantizedTensor(base.scheme, base.kernel_fmt, tuple(base.shape), parts, base.group_size, base.symmetric,
                           dict(base.extra))


@torch.no_grad()
def gptq_quantize(w: torch.Tensor, H: torch.Tensor, scheme: Scheme, *, damp: float = 0.01,
                  act_order: bool = False, block_size: int = 128, static_groups: bool | None = None,
                  name: str = "weight", scale_search: str | None = None,
                  shrinks: tuple[float, ...] = SHRINKS, factor: dict | None = None) -> GPTQResult:
    """GPTQ of one linear weight ``w [n, k]`` given its input Hessian ``H [k, k]`` (2/N sum x x^T).

    damp: relative dampening (times mean diag H). act_order: quantize columns in order of
    descending diag(H) (implies static groups). static_groups: None = the reference (dynamic
    group scales) unless act_order or the scheme has a per-tensor part. block_size: lazy-batch
    width (raised to the group size when they do not nest). `name` is used in messages.
    scale_search: None (the reference: each group's scales from the scheme's RTN, absmax) or a
    `_group_loss` metric ("mse", "hdiag"): each group's scales are those of the clipped weight
    `_clip(w, G, r)` for the r in `shrinks` whose grid quantizes the group with the least loss
    (`search_scales`; plain absmax r = 1 included, so never worse on that metric). Not for
    schemes with a per-tensor part (nvfp4's global scale): ignored there. `factor`: a dict kept
    by the caller for the linears that read one input (one Hessian: gate and up, q_a and kv_a):
    the inverse-Hessian factor the first computes, the others reuse -- it depends on H, act_order
    and damp only, so the bits are those of computing it again, at a fraction of the O(k^3) cost."""
    w0 = w.detach().to(torch.float32)
    n, k = w0.shape
    if H.shape != (k, k):
        raise CvtError(f"GPTQ {name}: Hessian {list(H.shape)} does not match weight {list(w0.shape)}")
    if not torch.isfinite(w0).all():
        raise CvtError(f"GPTQ {name}: weight {list(w0.shape)} holds non-finite values")
    W = w0.clone()
    H = H.detach().to(device=W.device, dtype=torch.float32).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    rtn = scheme.quantize(W)  # static scales: after dead columns are zeroed, as the reference
    G, n_groups, static_groups, block_size, search = _settings(rtn, n, k, name, act_order, block_size,
                                                               static_groups, scale_search)
    grid = _Grid(rtn, n_groups)
    per_group = _dynamic_parts(rtn.kernel_fmt, rtn.parts, n, n_groups)
    if search and static_groups:
        rtn = search_scales(W, H, scheme, G, shrinks, scale_search)
        grid = _Grid(rtn, n_groups)

    perm = None
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H.index_select(0, perm).index_select(1, perm)
    if factor is not None and factor.get("key") == (act_order, damp):
        U, used_damp = factor["U"], factor["damp"]
    else:
        U, used_damp = _inverse_cholesky(H, damp, name)
        if factor is not None:
            factor.update(key=(act_order, damp), U=U, damp=used_damp)

    dyn_parts = {key: v.clone() for key, v in per_group.items()} if not static_groups else None

    def regroup(cur: torch.Tensor, j: int) -> QuantizedTensor:  # a dynamic group's scales, from its current columns
        return (search_scales(cur, H[j:j + G, j:j + G], scheme, G, shrinks, scale_search)
                if search else scheme.quantize(cur))

    Q, codes, loss = _sweep(W, U, grid, G, perm, block_size, dyn_parts, regroup)
    if perm is not None:
        inv = torch.argsort(perm)
        Q, codes = Q[:, inv], codes[:, inv]
    qt, out, exact = _packed(rtn, grid, codes, dyn_parts, Q, scheme, name)
    return GPTQResult(qt, out, float(loss.sum()), used_damp, bool(static_groups), int(dead.sum()), exact)


def _settings(rtn: QuantizedTensor, n: int, k: int, name: str, act_order: bool, block_size: int,
              static_groups: bool | None, scale_search: str | None) -> tuple[int, int, bool, int, bool]:
    """The checks and settings `gptq_quantize` and `gptq_batched.gptq_quantize_batched` share,
    from the scheme's RTN of the weight: (group size G, groups, static_groups, block_size, search)."""
    if rtn.kernel_fmt not in SUPPORTED:
        raise CvtError(f"GPTQ {name}: scheme {rtn.scheme!r} with kernel format {rtn.kernel_fmt!r} is not supported "
                       f"(supported kernel formats: {', '.join(SUPPORTED)}; static activation scales: use rtn or "
                       "smoothquant, or dynamic activations)")
    G = _group_size(rtn, k)
    if k % G:
        raise CvtError(f"GPTQ {name}: group size {G} does not divide in_features {k}")
    n_groups = k // G
    has_global = any(v.dim() < 2 or tuple(v.shape) not in ((n, n_groups), (n, k)) for v in rtn.parts.values())
    if static_groups is None:
        static_groups = act_order or has_global
    if not static_groups and has_global:
        raise CvtError(f"GPTQ {name}: scheme {rtn.scheme!r} ({rtn.kernel_fmt}) has a per-tensor part; "
                       "only static groups are possible")
    if block_size % G and G % block_size:
        block_size = G
    if scale_search is not None and scale_search not in METRICS:
        raise CvtError(f"GPTQ {name}: unknown scale_search {scale_search!r} (known: {', '.join(METRICS)})")
    if act_order and not static_groups:
        raise CvtError(f"GPTQ {name}: act_order needs static groups (dynamic ones would need a g_idx on disk)")
    return G, n_groups, bool(static_groups), block_size, scale_search is not None and not has_global


def _sweep(W: torch.Tensor, U: torch.Tensor, grid: "_Grid", G: int, perm: torch.Tensor | None, block_size: int,
           dyn_parts: dict | None, regroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's column sweep over ``W [n, k]`` (permuted under act_order) with the upper Cholesky
    factor `U` of the inverse Hessian, `block_size` columns at a time (lazy batch updates): each
    column quantized on `grid`, its error pushed onto the columns after it. Dynamic groups
    (`dyn_parts` not None) take their scales from `regroup(current columns, first column)` when
    the sweep enters them, recorded in `dyn_parts`. Returns (dequantized Q, codes, loss per row)."""
    n, k = W.shape
    Q = torch.zeros_like(W)
    codes = torch.zeros_like(W)
    loss = torch.zeros(n, dtype=torch.float64, device=W.device)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        # the block transposed: a column of W is a contiguous row, so the rank-1 update of the
        # columns after it is one contiguous pass (an addr_ on the strided [n, B - i] view was
        # ~100x slower on CPU builds and most of a layer's solve)
        W1 = W[:, i1:i2].T.contiguous()
        Q1, C1, E1 = torch.zeros_like(W1), torch.zeros_like(W1), torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = i1 + i
            g = (int(perm[j]) if perm is not None else j) // G
            if dyn_parts is not None and j % G == 0:
                # the group's current columns: in this block (W1, up to date) and beyond it (W, lazily
                # updated by every previous block; this block has not pushed errors yet when i == 0)
                cur = torch.cat((W1[i:].T, W[:, i2:]), dim=1)[:, :G]
                gq = regroup(cur.contiguous(), j)
                grid.set_group(g, gq)
                for key in dyn_parts:
                    dyn_parts[key][:, g] = gq.parts[key].reshape(n, -1)[:, 0]
            wcol = W1[i]
            c, q = grid.quant(wcol, g)
            Q1[i], C1[i] = q, c
            err = (wcol - q) / U1[i, i]
            W1[i:] -= U1[i, i:, None] * err[None, :]   # w - u e, product and difference each rounded
            E1[i] = err
        Q[:, i1:i2], codes[:, i1:i2] = Q1.T, C1.T
        E1 = E1.T.contiguous()
        loss += E1.double().pow(2).sum(dim=1) / 2
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    return Q, codes, loss


def _packed(rtn: QuantizedTensor, grid: "_Grid", codes: torch.Tensor, dyn_parts: dict | None, Q: torch.Tensor,
            scheme: Scheme, name: str) -> tuple[QuantizedTensor, torch.Tensor, bool]:
    """The codes and scales as the scheme's tensor, its dequantized weight, and whether that is
    exactly the sweep's Q (CvtError when it differs beyond float rounding: a scheme whose
    dequantize disagrees with its kernel formula)."""
    parts = grid.parts(rtn, codes)
    if dyn_parts:
        parts.update({key: v.reshape(rtn.parts[key].shape) for key, v in dyn_parts.items()})
    qt = QuantizedTensor(rtn.scheme, rtn.kernel_fmt, tuple(rtn.shape), parts, rtn.group_size, rtn.symmetric,
                         dict(rtn.extra))
    out = scheme.dequantize(qt).to(torch.float32)
    exact = torch.equal(out, Q)
    if not exact:
        diff = (out - Q).abs().max().item()
        scale = max(Q.abs().max().item(), 1e-30)
        if diff > 1e-6 * scale:
            raise CvtError(f"GPTQ {name}: internal error: scheme {rtn.scheme!r} dequantizes the GPTQ codes to other "
                           f"values than the {rtn.kernel_fmt} kernel formula (max diff {diff:.3g})")
    return qt, out, exact


def inverse_upper_factor(Hd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, info) for ``Hd [..., k, k]`` positive definite: U upper triangular with
    ``Hd^-1 = U^T U``, the factor GPTQ's sweep reads (info != 0 where Hd is not positive definite).

    With J the reversal, ``J Hd J = L L^T`` (Cholesky) gives ``Hd = R R^T``, R = J L J upper, so
    ``Hd^-1 = (R^-1)^T R^-1`` and U = R^-1 = J L^-1 J: one Cholesky and one triangular inverse,
    half the work of the reference's Cholesky, inverse from it, then Cholesky of the inverse
    (the same factor up to float rounding; both sweeps, per linear and batched, use this one)."""
    L, info = torch.linalg.cholesky_ex(Hd.flip(-2, -1))
    return lower_inverse(L).flip(-2, -1), info


# below this width a triangular solve against the identity; above, two halves and two GEMMs
_TRI_LEAF = 256


def lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """``L^-1`` of lower triangular ``L [..., k, k]``, by halves: with ``L = [[A, 0], [B, C]]``,
    ``L^-1 = [[A^-1, 0], [-C^-1 B A^-1, C^-1]]``. A triangular solve against the identity
    (`solve_triangular`) spends k^3 / 2 multiply-adds on a dense right-hand side; the halves
    spend k^3 / 3, most of it in GEMMs, which run faster per flop: 2.5x less CPU at k = 2048
    (one thread), the same accuracy (max error relative to a float64 inverse ~6e-8 either way)."""
    k = L.shape[-1]
    if k <= _TRI_LEAF:
        eye = torch.eye(k, dtype=L.dtype, device=L.device)
        return torch.linalg.solve_triangular(L, eye.expand_as(L), upper=False)
    m = k // 2
    Ai, Ci = lower_inverse(L[..., :m, :m]), lower_inverse(L[..., m:, m:])
    X = torch.zeros_like(L)
    X[..., :m, :m], X[..., m:, m:] = Ai, Ci
    X[..., m:, :m] = -(Ci @ (L[..., m:, :m] @ Ai))
    return X


def _inverse_cholesky(H: torch.Tensor, damp: float, name: str) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of (H + damp*mean(diag H)*I)^-1; retries with 10x dampening."""
    mean_diag = torch.diag(H).mean().item()
    k = H.shape[0]
    eye = torch.arange(k, device=H.device)
    for attempt in range(4):
        d = damp * 10 ** attempt
        Hd = H.clone()
        Hd[eye, eye] += d * mean_diag
        U, info = inverse_upper_factor(Hd)
        if info == 0:
            return U, d
    raise CvtError(f"GPTQ {name}: the input Hessian [{k}, {k}] is not positive definite even with dampening "
                   f"{damp * 1000:g} x mean(diag H); the calibration inputs may hold non-finite values")
