"""What the layer-by-layer driver (`cvt.quant.methods.calib`) measures and folds: the statistics
of one activation (`_Site`: token count, min / max, GPTQ Hessian, AWQ mean |x| and a reservoir
sample), the smoothing groups of a decoder layer (`_Group`, `_smooth_groups`: producer norm or
linear -> consumer linears, for AWQ / SmoothQuant folds), and which linears share one input
(`_site_key`). Which linears read what is each architecture's declaration
(`ArchTable.calib_shared_inputs`, `ArchTable.calib_norm_inputs`), passed in as the table."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from cvt.convert.arch import ArchTable
from cvt.quant.methods.gptq import HessianAccumulator
from cvt.runtime.kernels import Linear


# ---- statistics at one input site --------------------------------------------------------------

class _Site:
    """Statistics of one activation: a linear's input ("in") or a module's output ("out").

    `div` holds the smoothing factors folded since capture: the current input is x / div."""

    def __init__(self, k: int, *, hessian: bool = False, samples: int = 0, hessian_dtype=torch.float32,
                 seed: int = 0):
        self.k, self.n = k, 0
        # per-channel max, min and sum |x|, accumulated where the forward runs (no host round trip
        # per linear and batch); read on the host (`cmax`, `cmin`, `abssum`), copied once per read
        self._stats: list[torch.Tensor] | None = None
        self._host: list[torch.Tensor] | None = None
        self.hess = HessianAccumulator(k, hessian_dtype) if hessian else None
        self.factor: dict = {}  # GPTQ's inverse-Hessian factor, shared by the linears of this site
        self.cap = samples
        self.buf: torch.Tensor | None = None
        self.gen = torch.Generator().manual_seed(seed)
        self.div: torch.Tensor | None = None
        self.hess_scaled = False             # the Hessian was captured after the folds

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, self.k).to(torch.float32)
        m = x.shape[0]
        if m == 0:
            return
        cmax, cmin, abssum = self._device_stats(x.device)
        torch.maximum(cmax, x.amax(dim=0), out=cmax)  # max / min / float64 sums: the same bits on any device
        torch.minimum(cmin, x.amin(dim=0), out=cmin)
        abssum += x.abs().sum(dim=0, dtype=torch.float64)
        self._host = None
        if self.hess is not None:
            self.hess.add(x)
        if self.cap:
            self._reservoir(x.cpu())
        self.n += m

    def _device_stats(self, device) -> list[torch.Tensor]:
        if self._stats is None:
            self._stats = [torch.full((self.k,), -math.inf, device=device),
                           torch.full((self.k,), math.inf, device=device),
                           torch.zeros(self.k, dtype=torch.float64, device=device)]
        elif self._stats[0].device != torch.device(device):  # set on the host by a reduction over ranks
            self._stats = [t.to(device) for t in self._stats]
        return self._stats

    def _host_stats(self) -> list[torch.Tensor]:
        if self._host is None:
            self._host = [t.cpu() for t in self._device_stats(self._stats[0].device if self._stats else "cpu")]
        return self._host

    def _set_stat(self, i: int, value: torch.Tensor) -> None:
        stats = self._host_stats()
        self._stats = [value if j == i else t for j, t in enumerate(stats)]
        self._host = None

    cmax = property(lambda self: self._host_stats()[0], lambda self, v: self._set_stat(0, v))
    cmin = property(lambda self: self._host_stats()[1], lambda self, v: self._set_stat(1, v))
    abssum = property(lambda self: self._host_stats()[2], lambda self, v: self._set_stat(2, v))

    def _reservoir(self, x: torch.Tensor) -> None:
        """Uniform sample of `cap` rows over everything seen (vectorized reservoir sampling)."""
        have = 0 if self.buf is None else self.buf.shape[0]
        take = min(self.cap - have, x.shape[0])
        if take > 0:
            self.buf = x[:take].clone() if self.buf is None else torch.cat((self.buf, x[:take]))
        rest = x[take:]
        if rest.shape[0] == 0:
            return
        t = self.n + take + torch.arange(rest.shape[0], dtype=torch.float64)   # global row index
        slot = (torch.rand(rest.shape[0], generator=self.gen, dtype=torch.float64) * (t + 1)).long()
        keep = slot < self.cap
        rows, slots = rest[keep], slot[keep]
        if slots.numel():
            # sequential semantics: a later row overwrites an earlier one in the same slot
            last = {}
            for i, sl in enumerate(slots.tolist()):
                last[sl] = i
            idx = torch.tensor(list(last.values()))
            self.buf[torch.tensor(list(last.keys()))] = rows[idx]

    def scale(self, s: torch.Tensor) -> None:
        """The activation is now x / s (a fold happened after capture)."""
        s = s.detach().to(torch.float32).cpu()
        self.div = s.clone() if self.div is None else self.div * s

    # current (post-fold) statistics
    def _d(self) -> torch.Tensor:
        return torch.ones(self.k) if self.div is None else self.div

    def absmax(self) -> torch.Tensor:
        return torch.maximum(self.cmax.abs(), self.cmin.abs()).nan_to_num(0.0, 0.0, 0.0) / self._d()

    def mean_abs(self) -> torch.Tensor:
        return (self.abssum / max(self.n, 1)).to(torch.float32) / self._d()

    def act_range(self) -> tuple[float, float]:
        if self.n == 0:
            return 0.0, 0.0
        d = self._d()
        return float((self.cmin / d).min()), float((self.cmax / d).max())

    def samples(self) -> torch.Tensor:
        x = self.buf if self.buf is not None else torch.zeros(0, self.k)
        return x / self._d()[None, :]

    def hessian(self) -> torch.Tensor:
        H = self.hess.H
        if self.div is not None and not self.hess_scaled:
            inv = (1.0 / self.div).to(H.dtype).to(H.device)
            H = H * inv[:, None] * inv[None, :]
        return H


# ---- smoothing groups --------------------------------------------------------------------------

@dataclass
class _Group:
    """Producer -> consumers of one activation: norm weight (or producer linear rows) /= s,
    consumer columns *= s."""

    producer: str                       # module name (norm or linear)
    consumers: list[str]                # linear names (quantized or float) taking the activation
    extras: list[str] = field(default_factory=list)   # other float consumers (router Gate)
    rows: torch.Tensor | None = None    # producer rows matching the consumers' input channels
    norm: bool = True                   # producer is a norm (its output is the activation)
    awq_only: bool = False              # linear-fed groups (and kv_a_layernorm): AWQ only


def _children(module: nn.Module, prefix: str) -> dict[str, nn.Module]:
    return {f"{prefix}.{n}": m for n, m in module.named_children()}


def _smooth_groups(layer: nn.Module, prefix: str, table: ArchTable) -> list[_Group]:
    """The smoothing groups of one decoder layer of `table`'s family (by module names: its
    attention inputs are the first of `ArchTable.calib_shared_inputs`); a layer that lists its own
    (``layer.smooth_groups(prefix)``: DeepSeek-V4's block) gives those."""
    own = getattr(layer, "smooth_groups", None)
    if own is not None:
        return [_Group(p, list(cons), extras=list(extras)) for p, cons, extras in own(prefix)]
    groups: list[_Group] = []
    attn = getattr(layer, "self_attn", None)
    ap = f"{prefix}.self_attn"
    lin = getattr(layer, "linear_attn", None)   # Qwen3.5's Gated DeltaNet: its input projections, b / a float
    if isinstance(lin, nn.Module) and hasattr(layer, "input_layernorm"):
        cons = [f"{prefix}.linear_attn.{n}" for n in _reads_input(lin, table)]
        if cons:
            groups.append(_Group(f"{prefix}.input_layernorm", cons))
    if attn is not None and hasattr(layer, "input_layernorm"):
        cons = [f"{ap}.{n}" for n in _reads_input(attn, table)]
        # DeepSeek-V3.2's lightning indexer reads the same two activations (wk, weights_proj: the
        # normed hidden state; wq_b: q_a_layernorm's output) and stays float: a fold into either norm
        # must scale its columns too, as the router's
        idx = getattr(attn, "indexer", None)
        ip = f"{ap}.indexer"
        if cons:
            groups.append(_Group(f"{prefix}.input_layernorm", cons,
                                 extras=[f"{ip}.{n}" for n in ("wk", "weights_proj")
                                         if isinstance(getattr(idx, n, None), Linear)]))
        if isinstance(getattr(attn, "q_a_layernorm", None), nn.Module) and isinstance(getattr(attn, "q_b_proj", None),
                                                                                     Linear):
            groups.append(_Group(f"{ap}.q_a_layernorm", [f"{ap}.q_b_proj"],
                                 extras=[f"{ip}.wq_b"] if isinstance(getattr(idx, "wq_b", None), Linear) else []))
        kv_b = getattr(attn, "kv_b_proj", None)
        if isinstance(kv_b, Linear) and hasattr(attn, "kv_a_layernorm"):
            groups.append(_Group(f"{ap}.kv_a_layernorm", [f"{ap}.kv_b_proj"], awq_only=True))
            o = getattr(attn, "o_proj", None)
            if isinstance(o, Linear):   # MLA: value rows of kv_b_proj -> o_proj input channels
                H, nope, dv = attn.n_heads, attn.nope, attn.v_dim
                rows = (torch.arange(H)[:, None] * (nope + dv) + nope + torch.arange(dv)[None, :]).reshape(-1)
                groups.append(_Group(f"{ap}.kv_b_proj", [f"{ap}.o_proj"], rows=rows, norm=False, awq_only=True))
        elif isinstance(getattr(attn, "v_proj", None), Linear) and isinstance(getattr(attn, "o_proj", None), Linear):
            mha = getattr(attn, "n_heads", None) == getattr(attn, "n_kv", None)
            if mha and attn.v_proj.weight.shape[0] == attn.o_proj.weight.shape[1]:
                groups.append(_Group(f"{ap}.v_proj", [f"{ap}.o_proj"], norm=False, awq_only=True))
    mlp = getattr(layer, "mlp", None)
    mp = f"{prefix}.mlp"
    if mlp is not None and hasattr(layer, "post_attention_layernorm"):
        mlps: list[tuple[str, nn.Module]] = []
        extras: list[str] = []
        if isinstance(getattr(mlp, "gate_proj", None), Linear):
            mlps.append((mp, mlp))
        else:
            shared_name = getattr(mlp, "shared_name", "shared_experts")   # Qwen3.5: shared_expert
            shared = getattr(mlp, shared_name, None)
            if shared is not None:
                mlps.append((f"{mp}.{shared_name}", shared))
            experts = getattr(mlp, "experts", None)  # fused [E, ...] parameters (gpt-oss): float, no linears
            for e, ex in enumerate(experts if isinstance(experts, nn.ModuleList) else ()):
                mlps.append((f"{mp}.experts.{e}", ex))
            # the float linears reading the same input: the router, Qwen3.5's shared-expert gate
            extras += [f"{mp}.{n}" for n in ("gate", "shared_expert_gate") if getattr(mlp, n, None) is not None]
        cons = [f"{p}.{n}" for p, m in mlps for n in ("gate_proj", "up_proj")
                if isinstance(getattr(m, n, None), Linear)]
        if cons:
            groups.append(_Group(f"{prefix}.post_attention_layernorm", cons, extras=extras))
        for p, m in mlps:
            if all(isinstance(getattr(m, n, None), Linear) for n in ("gate_proj", "up_proj", "down_proj")):
                groups.append(_Group(f"{p}.up_proj", [f"{p}.down_proj"], norm=False, awq_only=True))
    return groups



def _reads_input(attn: nn.Module, table: ArchTable) -> list[str]:
    """The linears of `attn` reading the attention input: the first of `table`'s shared-input
    groups naming one of its linears (the group's linears present, in the group's order)."""
    for names in table.calib_shared_inputs:
        present = [n for n in names if isinstance(getattr(attn, n, None), Linear)]
        if present:
            return present
    return []


def _site_key(name: str, module: nn.Module, parent: nn.Module, parent_name: str,
              table: ArchTable) -> tuple[str, str]:
    """Where a linear's input is measured (`ArchTable.input_site` on the live modules): ("out",
    norm) for a linear that reads a norm's output, else ("in", the first present linear of its
    shared-input group)."""
    def child(full: str):
        return getattr(parent, full.rsplit(".", 1)[-1], None)

    return table.input_site(name, lambda full: hasattr(parent, full.rsplit(".", 1)[-1]),
                            lambda full: isinstance(child(full), Linear))
