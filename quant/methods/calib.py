"""Calibration data and the layer-by-layer calibration driver of the data-driven methods.

Data: `calib_tokens` reads ``--calib FILE`` (plain text, or .jsonl with a "text" field per
line) or the built-in sample, tokenizes it with the model's tokenizer and cuts it into
sequences ``[b, s]``.

Driver: `calibrate(model, tokens, scheme_for, method)` runs a runtime model (any family that
follows `cvt.runtime.models.base`'s contract: ``model.model.layers[i]``, or where the model
says (`cvt.quant.methods.decoder_layers`: DeepSeek-V4's ``layers[i]``); linears are
`cvt.runtime.kernels.Linear`) one decoder layer at a time, so that memory is about one decoder
layer plus the calibration activations:

1. The arguments the model passes to its decoder layers (hidden states, rope cos/sin, mask,
   ...) are captured by a forward pre-hook on layer 0 that stops the model's own forward:
   every family's own argument computation is used, and each layer is later called with
   exactly those arguments (mini-batches of `batch_size` sequences).
2. For decoder layer i, in stages (the layer's children in order: ``self_attn`` then
   ``mlp``, so MLP statistics see the already-quantized attention, as GPTQ's
   "true-sequential"):
   * forward hooks on every input site accumulate what the methods need: the token count
     and per-channel min / max (always), H = 2/N sum x x^T (gptq), mean |x| and a reservoir
     sample of `max_samples` rows (awq, flatquant); RMSNorm outputs give the statistics of the smoothing
     groups (awq, smoothquant). Linears with identical inputs (q/k/v, gate/up) share one
     site; MLA's ``kv_b_proj``, which the absorbed attention never calls, reads
     ``kv_a_layernorm``'s output. Later stages' modules are stubbed out during these passes.
   * smoothing groups (awq, smoothquant) are searched and folded (`smoothquant.scale_rows` /
     `scale_columns`); the statistics already captured are rescaled to the new inputs;
   * each target linear is quantized: gptq -> `gptq.gptq_quantize(w, H)` (routed experts of
     one shape: one `gptq_batched` call for many), awq -> optional clipping search then RTN,
     flatquant -> the site's fitted transforms (`flatquant.flatquant_site`, once per input site),
     smoothquant / rtn -> RTN (`scheme.quantize`), and its weight in the model is replaced by
     the dequantized weight, so later layers see quantized outputs.
   * MoE experts: hooks see only the tokens routed to each expert. An expert linear with fewer
     than `min_tokens` rows is quantized with RTN and reported in `CalibResult.fallbacks`.
     GPTQ Hessians of routed experts are collected in chunks of experts so that their memory
     stays under `max_hessian_bytes` (one extra pass per chunk, other experts stubbed out).
3. The layer is run once more (quantized, no hooks) to give the next layer its inputs.

Linears that `scheme_for` selects outside the decoder layers the forward runs (MTP layers,
lm_head when a recipe asks) are quantized with RTN and reported as fallbacks.

`on_layer_start(i, layer)` / `on_layer_end(i, layer, result)` let a caller load a layer's
weights just before it is needed and write / free it right after (a model built on the meta
device with only the embedding loaded is enough to start).
"""

from __future__ import annotations

from cvt.runtime.metrics import sqnr_db  # noqa: E402

import logging
import re
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from cvt.convert.arch import ArchTable
from cvt.world import SINGLE, World
from cvt.errors import CvtError
from cvt.quant.methods import ranks
from cvt.quant.methods.awq import awq_clip, awq_search
from cvt.quant.methods.data import calib_tokens  # noqa: F401  (re-exported)
from cvt.quant.recipe import AWQ, DATA_METHODS, FLATQUANT, GPTQ, METHODS, RTN, SMOOTHQUANT  # noqa: F401  (METHODS re-exported)
from cvt.quant.methods import flatquant as FQ
from cvt.quant.methods.gptq import gptq_quantize
from cvt.quant.methods.gptq_batched import solve_together
from cvt.quant.methods.phases import Phases
from cvt.quant.methods.decoder_layers import Layout, _PerSequence  # noqa: F401  (Layout re-exported)
from cvt.quant.methods.sites import _children, _Group, _Site, _site_key, _smooth_groups
from cvt.quant.methods.smoothquant import scale_columns, scale_rows, smooth_scales
from cvt.qtensor.schemes.base import QuantizedTensor, Scheme
from cvt.runtime.kernels import Linear

log = logging.getLogger(__name__)

EXPERT_RE = re.compile(r"^(?P<container>.*\.experts)\.(?P<expert>\d+)\.")
# AWQ reference skips its clipping search for projections that produce attention queries / keys
NO_CLIP = ("q_proj", "k_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


# ---- results -----------------------------------------------------------------------------------

@dataclass
class Fallback:
    """A linear quantized with RTN instead of its method's data-driven step."""

    name: str
    tokens: int
    reason: str


@dataclass
class CalibResult:
    """What `calibrate` produced.

    quantized:      linear module name -> QuantizedTensor (every linear scheme_for selected)
    float_weights:  parameter name -> new float tensor (model dtype) for float parameters the
                    smoothing folds changed: norm weights, the router, float linears such as
                    kv_b_proj, biases of producer linears. Write these instead of the source's.
    methods:        linear module name -> method actually applied ("rtn" for fallbacks)
    fallbacks:      the RTN fallbacks, with the token count each linear saw
    stats:          linear module name -> {"tokens", "act_min", "act_max" (of its input, after
                    smoothing), "gptq_loss", "gptq_damp", "awq_clip"}, for static activation
                    scales and the manifest
    smoothing:      producer name (norm or linear) -> {"method", "alpha", "consumers"} per fold
    seconds_per_layer: wall time of each decoder layer
    phases:         wall seconds of this layer's forward passes, solve and IO (`phases.Phases`)
    """

    quantized: dict[str, QuantizedTensor] = field(default_factory=dict)
    float_weights: dict[str, torch.Tensor] = field(default_factory=dict)
    methods: dict[str, str] = field(default_factory=dict)
    fallbacks: list[Fallback] = field(default_factory=list)
    stats: dict[str, dict] = field(default_factory=dict)
    smoothing: dict[str, dict] = field(default_factory=dict)
    seconds_per_layer: list[float] = field(default_factory=list)
    phases: Phases = field(default_factory=Phases)


# ---- the driver ----------------------------------------------------------------------------------

class _Stop(Exception):
    pass


def _layer_args(model: nn.Module, tokens: torch.Tensor):
    """(layer input [b, s, ...] -- hidden states [b, s, h], DeepSeek-V4's hc streams
    [b, s, hc, h] --, the other positional args, kwargs) the model passes to layer 0; the
    arguments `Layout.per_sequence` names come wrapped as `_PerSequence`."""
    captured = {}
    layout = Layout.of(model)

    def hook(module, args, kwargs):
        captured["args"], captured["kwargs"] = args, kwargs
        raise _Stop

    h = layout.decoder_layers(model)[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(tokens)
    except _Stop:
        pass
    finally:
        h.remove()
    if "args" not in captured:
        raise CvtError("calibration: the model's forward did not call its first decoder layer")
    args = tuple(_PerSequence(a) if j in layout.per_sequence else a for j, a in enumerate(captured["args"][1:]))
    return captured["args"][0], args, dict(captured["kwargs"])


def _stub(module: nn.Module):
    """Make `module` return zeros shaped like its first input (its output is not needed)."""
    module.forward = lambda x, *a, **k: torch.zeros_like(x)


def _unstub(module: nn.Module):
    module.__dict__.pop("forward", None)


@torch.no_grad()
def _run_layer(layer, x, args, kwargs, batch_size, out=True):
    if x.shape[0] == 0:  # a rank with no calibration sequence (more ranks than sequences)
        return x.clone() if out else None
    outs = []
    for b0 in range(0, x.shape[0], batch_size):
        a = tuple(v.t[b0:b0 + batch_size] if isinstance(v, _PerSequence) else v for v in args)
        y = layer(x[b0:b0 + batch_size], *a, **kwargs)
        if out:
            outs.append(y)
    return torch.cat(outs) if out else None


def calibrate(model: nn.Module, tokens: torch.Tensor, scheme_for: Callable[[str], Scheme | None],
              method: str | Callable[[str], str] = GPTQ, *, min_tokens: int = 32, batch_size: int = 8,
              damp: float = 0.01, act_order: bool = True, scale_search: str | None = "hdiag", block_size: int = 128,
              static_groups: bool | None = None, true_sequential: bool = True, alpha: float = 0.5,
              n_grid: int = 20, duo_scaling: bool = True, awq_clip_search: bool = True, max_samples: int = 512,
              max_hessian_bytes: int = 4 << 30, hessian_dtype: torch.dtype = torch.float32,
              flatquant_steps: int = FQ.STEPS, flatquant_lr: float = FQ.LR, flatquant_seed: int = FQ.SEED,
              quantize_rest: bool = True, keep_tensors: bool = True,
              on_layer_start: Callable[[int, nn.Module], None] | None = None,
              on_layer_end: Callable[[int, nn.Module, CalibResult], None] | None = None) -> CalibResult:
    """Quantize every linear `scheme_for(name)` selects, layer by layer (see the module doc).

    model: a runtime model (weights in float32 recommended), modified in place: folded scales and quantized
        (dequantized) weights. tokens: [b, s] int64 calibration batch. scheme_for(linear module name) ->
        Scheme, or None to keep the linear float.
    method: one of METHODS, or a function of the linear name giving one (recipes).
    min_tokens: linears (MoE experts) that saw fewer rows fall back to RTN.
    gptq: damp, act_order, scale_search, block_size, static_groups (see `gptq.gptq_quantize`; the defaults
        act_order + static groups + the "hdiag" clip search measured best on the trained fixture, README),
        hessian_dtype, max_hessian_bytes (budget for the Hessians of routed experts collected in one pass).
    smoothquant: alpha. awq: n_grid, awq_clip_search, max_samples (rows kept per input site). flatquant:
        flatquant_steps, flatquant_lr, flatquant_seed (`cvt.quant.methods.flatquant.fit`), max_samples.
    quantize_rest: RTN for selected linears outside the decoder layers (reported as fallbacks).
    on_layer_start / on_layer_end: see the module doc; `on_layer_end` gets a CalibResult holding only that layer's
        tensors. keep_tensors=False: the returned result keeps no tensors (quantized / float_weights stay empty;
        methods, fallbacks, stats, smoothing are kept), for callers that write each layer from `on_layer_end`.
    """
    method_for = method if callable(method) else (lambda _n, m=method: m)
    if not callable(method) and method not in METHODS:
        raise CvtError(f"unknown calibration method {method!r} (known: {', '.join(METHODS)})")
    if tokens.dim() != 2 or tokens.numel() == 0:
        raise CvtError(f"calibration tokens must be a non-empty [batch, seq] tensor, got {list(tokens.shape)}")
    opts = dict(min_tokens=min_tokens, batch_size=batch_size, damp=damp, act_order=act_order, scale_search=scale_search,
                block_size=block_size, static_groups=static_groups, true_sequential=true_sequential, alpha=alpha,
                n_grid=n_grid, duo_scaling=duo_scaling, awq_clip_search=awq_clip_search, max_samples=max_samples,
                max_hessian_bytes=max_hessian_bytes, hessian_dtype=hessian_dtype, flatquant_steps=flatquant_steps,
                flatquant_lr=flatquant_lr, flatquant_seed=flatquant_seed)
    result = CalibResult()
    for name, mod in model.named_modules():   # refuse impossible shapes / methods before any work
        if isinstance(mod, Linear):
            sch = scheme_for(name)
            if sch is not None:
                sch.check(name, tuple(mod.weight.shape))
                if method_for(name) not in METHODS:
                    raise CvtError(f"{name}: unknown calibration method {method_for(name)!r} "
                                   f"(known: {', '.join(METHODS)})")
    layout = Layout.of(model)
    layers = layout.decoder_layers(model)
    n_layers = model.args.num_hidden_layers
    table = model.args.arch_table()  # which linears read what (`ArchTable.calib_shared_inputs`)
    dev = next((p.device for p in model.get_submodule(layout.embed).parameters()), torch.device("cpu"))
    if on_layer_start is not None:
        on_layer_start(0, layers[0])
    x, args, kwargs = _layer_args(model, tokens.to(dev))
    done: set[str] = set()
    for i in range(n_layers):
        t0 = time.perf_counter()
        layer = layers[i]
        if on_layer_start is not None and i > 0:
            on_layer_start(i, layer)
        lres = CalibResult()
        _LayerCalib(layer, f"{layout.layers}.{i}", scheme_for, method_for, lres, opts, table).run(x, args, kwargs)
        x = _run_layer(layer, x, args, kwargs, batch_size)
        lres.seconds_per_layer.append(time.perf_counter() - t0)
        _merge(result, lres, keep_tensors)
        done |= {n for n, _ in layer.named_modules(prefix=f"{layout.layers}.{i}")}
        log.info("calibrated layer %d/%d in %.1f s (%d linears, %d fallbacks)", i + 1, n_layers,
                 lres.seconds_per_layer[0], len(lres.quantized), len(lres.fallbacks))
        if on_layer_end is not None:
            on_layer_end(i, layer, lres)
    if quantize_rest:
        for name, mod in model.named_modules():
            if not isinstance(mod, Linear) or name in done or name in result.quantized:
                continue
            sch = scheme_for(name)
            if sch is None or mod.weight.device.type == "meta":
                continue
            _quantize_rtn(mod, name, sch, result)
            result.fallbacks.append(Fallback(name, 0, "outside the decoder layers the calibration forward runs"))
    return result


def _merge(into: CalibResult, part: CalibResult, keep_tensors: bool = True) -> None:
    if keep_tensors:
        into.quantized.update(part.quantized)
        into.float_weights.update(part.float_weights)
    into.methods.update(part.methods)
    into.fallbacks += part.fallbacks
    into.stats.update(part.stats)
    into.smoothing.update(part.smoothing)
    into.seconds_per_layer += part.seconds_per_layer


def _set_weight(mod: nn.Module, w: torch.Tensor) -> None:
    mod.weight.data = w.to(device=mod.weight.device, dtype=mod.weight.dtype)


def _quantize_rtn(mod, name, scheme, res: CalibResult, w: torch.Tensor | None = None) -> None:
    try:
        qt = scheme.quantize((mod.weight if w is None else w).detach().to(torch.float32))
    except CvtError as exc:
        raise type(exc)(f"{name}: {exc}") from exc
    res.quantized[name] = qt
    res.methods[name] = RTN
    deq = scheme.dequantize(qt)
    # SQNR against the float weight this linear has now (after any smoothing fold)
    res.stats.setdefault(name, {})["sqnr_db"] = sqnr_db(mod.weight.detach().float(), deq)
    _set_weight(mod, deq)


class _LayerCalib:
    """Calibrate the linears of one decoder layer (see the module doc)."""

    def __init__(self, layer, prefix, scheme_for, method_for, res: CalibResult, opts: dict, table: ArchTable,
                 experts=None, frozen: frozenset[str] = frozenset(), world: World = SINGLE):
        # experts: a `expert_stream.ExpertStream` loading the routed experts a chunk at a time
        # (the streaming driver, when a layer's experts pass its memory budget), or None
        # frozen: linears the output takes from the source as they are (DeepSeek-V4's FP4 experts
        # carried into an MX scheme): not calibrated, and no smoothing fold may change them
        # world: the ranks that share the calibration sequences (`cvt.quant.methods.ranks`)
        # table: the family's architecture table, whose declaration says which linears read what
        self.layer, self.prefix, self.res, self.o, self.experts = layer, prefix, res, opts, experts
        self.frozen, self.world = frozen, world
        self.no_clip = NO_CLIP + tuple(getattr(layer, "no_clip", ()))
        self._refresh()
        self.schemes = {n: s for n in self.linears if (s := scheme_for(n)) is not None}
        self.h_users: dict[tuple, int] = {}
        self.method = {n: method_for(n) for n in self.schemes}
        for n, m in self.method.items():
            if m not in METHODS:
                raise CvtError(f"{n}: unknown calibration method {m!r} (known: {', '.join(METHODS)})")
        self.site_of = {}
        for n in self.linears:
            parent_name = n.rsplit(".", 1)[0]
            self.site_of[n] = _site_key(n, self.linears[n], self.mods[parent_name], parent_name, table)
        self.groups = _smooth_groups(layer, prefix, table)
        self.changed: set[str] = set()      # float params changed by folds
        self.site_owner: dict[tuple, int] = {}  # GPTQ site -> the rank holding its Hessian (`ranks`)
        self.solved: dict = {}                  # linear -> GPTQResult of a batched call (`_solve_experts`)
        self.flat_fits: dict = {}               # input site -> its FlatQuant transforms (`flatquant_site`)

    def _refresh(self) -> None:
        """Module maps (again after an expert chunk is loaded: a quantized source's linears are
        replaced by dense ones then)."""
        self.mods = dict(self.layer.named_modules(prefix=self.prefix))
        self.linears = {n: m for n, m in self.mods.items() if isinstance(m, Linear)}

    # -- planning -------------------------------------------------------------------------------
    def _stages(self) -> list[tuple[str, list[str]]]:
        children = list(_children(self.layer, self.prefix))
        targets = list(self.schemes)
        if not self.o["true_sequential"]:
            return [("", targets)]
        stages = []
        for c in children:
            ts = [t for t in targets if t.startswith(c + ".")]
            if ts:
                stages.append((c, ts))
        rest = [t for t in targets if not any(t.startswith(c + ".") for c in children)]
        if rest:
            stages.append(("", rest))
        return stages

    def _group_method(self, g: _Group) -> str | None:
        ms = {self.method.get(c) for c in g.consumers}
        if AWQ in ms:
            return AWQ
        if SMOOTHQUANT in ms and not g.awq_only:
            return SMOOTHQUANT
        return None

    def run(self, x, args, kwargs) -> None:
        if not any(m in DATA_METHODS for m in self.method.values()) and not self.o.get("collect_stats"):
            if self.experts is not None:  # routed experts read a chunk at a time
                return self.experts.run_rtn(self, x, args, kwargs)
            with self.res.phases("solve"):
                for n in self.schemes:
                    _quantize_rtn(self.linears[n], n, self.schemes[n], self.res)
            return
        for stage, targets in self._stages():
            self._run_stage(stage, targets, x, args, kwargs)
        if self.experts is not None:  # the layer's output, also when no stage ran the experts
            self.experts.finish(self, x, args, kwargs)
        for p in sorted(self.changed):
            owner, attr = p.rsplit(".", 1)
            if owner in self.res.quantized:
                if attr == "weight":
                    continue
            self.res.float_weights[p] = getattr(self.mods[owner], attr).detach().clone()

    def _later_children(self, stage: str) -> list[nn.Module]:
        names = list(_children(self.layer, self.prefix))
        if not stage or stage not in names:
            return []
        return [self.mods[n] for n in names[names.index(stage) + 1:]]

    def _run_stage(self, stage, targets, x, args, kwargs, stub_experts=None) -> None:
        """Statistics, smoothing folds and quantization of `targets`; `stub_experts`: the routed
        experts the passes run (the others return zeros), None: all of them."""
        if self.experts is not None and stub_experts is None and self.experts.owns(stage):
            return self.experts.run_stage(self, stage, targets, x, args, kwargs)
        o = self.o
        tset = set(targets)
        groups = [g for g in self.groups if set(g.consumers) & tset and self._group_method(g)]
        # sites: every target's input site; samples for awq consumers; hessians for gptq
        need_h: dict[tuple, bool] = {}
        need_s: dict[tuple, bool] = {}
        for t in targets:
            key = self.site_of[t]
            need_h[key] = need_h.get(key, False) or self.method[t] == GPTQ
            need_s[key] = need_s.get(key, False) or self.method[t] in (AWQ, FLATQUANT)
        for g in groups:
            if self._group_method(g) == AWQ:
                for c in g.consumers:
                    if c in self.schemes:
                        need_s[self.site_of[c]] = True
        norm_sites = {("out", g.producer) for g in groups if g.norm}
        # GPTQ hessians of routed experts: chunks of experts within the memory budget
        expert_of = {}
        for key in need_h:
            m = EXPERT_RE.match(key[1] + ".")
            if m and need_h[key]:
                expert_of[key] = (m["container"], int(m["expert"]))
        per_expert: dict[tuple, list[tuple]] = {}
        for key, ex in expert_of.items():
            per_expert.setdefault(ex, []).append(key)
        esize = torch.finfo(o["hessian_dtype"]).bits // 8
        chunks: list[list[tuple]] = []
        cur, cur_bytes = [], 0
        for ex, keys in sorted(per_expert.items()):
            b = sum(self._k(k) ** 2 * esize for k in keys)
            if cur and cur_bytes + b > o["max_hessian_bytes"]:
                chunks.append(cur)
                cur, cur_bytes = [], 0
            cur += keys
            cur_bytes += b
        if cur:
            chunks.append(cur)
        first_chunk = set(chunks[0]) if chunks else set()
        later_chunks = chunks[1:]

        sites: dict[tuple, _Site] = {}
        for key in set(need_h) | set(need_s) | norm_sites:
            h = need_h.get(key, False) and (key not in expert_of or key in first_chunk)
            sites[key] = _Site(self._k(key), hessian=h, samples=o["max_samples"] if need_s.get(key) else 0,
                               hessian_dtype=o["hessian_dtype"], seed=zlib.crc32(key[1].encode()))
        self._collect(stage, sites, x, args, kwargs, stub_experts=stub_experts)

        # smoothing folds
        with self.res.phases("solve"):
            for g in groups:
                self._smooth(g, sites)
        # quantize everything whose statistics are complete
        pending = {t for ch in later_chunks for k in ch for t in self._target_of_site(k, targets)}
        self.h_users = {}
        for t in targets:
            if self.method[t] == GPTQ:
                self.h_users[self.site_of[t]] = self.h_users.get(self.site_of[t], 0) + 1
        self._quantize_all([t for t in targets if t not in pending], sites)
        # remaining expert hessian chunks: one pass each, other experts stubbed out
        for ch in later_chunks:
            chunk_sites = {k: _Site(self._k(k), hessian=True, hessian_dtype=o["hessian_dtype"]) for k in ch}
            keep = {expert_of[k] for k in ch}
            self._collect(stage, chunk_sites, x, args, kwargs, stub_experts=keep)
            for k in ch:
                sites[k].hess, sites[k].hess_scaled = chunk_sites[k].hess, True   # captured after the folds
            self._quantize_all(sorted({t for k in ch for t in self._target_of_site(k, targets)}), sites)  # fixed order

    def _target_of_site(self, key, targets) -> list[str]:
        return [t for t in targets if self.site_of[t] == key]

    def _k(self, key) -> int:
        mode, name = key
        mod = self.mods[name]
        return mod.weight.shape[1] if mode == "in" else mod.weight.shape[0]

    def _collect(self, stage, sites, x, args, kwargs, stub_experts) -> None:
        with self.res.phases("forward"):
            self._collect_here(stage, sites, x, args, kwargs, stub_experts)

    def _collect_here(self, stage, sites, x, args, kwargs, stub_experts) -> None:
        hooks = []
        for (mode, name), site in sites.items():
            mod = self.mods[name]
            if mode == "in":
                hooks.append(mod.register_forward_pre_hook(lambda m, a, s=site: s.add(a[0])))
            else:
                hooks.append(mod.register_forward_hook(lambda m, a, out, s=site: s.add(out)))
        stubbed = list(self._later_children(stage))
        if stub_experts is not None:
            for name, mod in self.mods.items():
                m = EXPERT_RE.match(name + ".")
                is_expert = m is not None and name == f"{m['container']}.{m['expert']}"
                if is_expert and (m["container"], int(m["expert"])) not in stub_experts:
                    stubbed.append(mod)
        try:
            for mod in stubbed:
                _stub(mod)
            _run_layer(self.layer, x, args, kwargs, self.o["batch_size"], out=False)
        finally:
            for mod in stubbed:
                _unstub(mod)
            for h in hooks:
                h.remove()
        if self.world.size > 1:  # what every rank saw, combined (`ranks.reduce_sites`)
            ranks.reduce_sites(self, sites)

    def _quantize_all(self, names: list[str], sites) -> None:
        """`_quantize` each of `names` (on its owner rank in a world of several: `ranks.exchange`)."""
        with self.res.phases("solve"):
            ranks.exchange(self, names, sites, lambda t: self._quantize(t, sites),
                           lambda mine: self._solve_experts(mine, sites))

    def _solve_experts(self, names: list[str], sites) -> None:
        """GPTQ of the routed experts' linears among `names` that share a shape and scheme, in
        batched calls (`gptq_batched.solve_together`: one column sweep for many experts); `_quantize`
        takes their results from ``self.solved`` in `names` order, so the bookkeeping is unchanged."""
        o = self.o
        items = []
        for t in names:
            site = sites.get(self.site_of[t])
            if (self.method[t] == GPTQ and EXPERT_RE.match(t + ".") and site is not None and site.hess is not None
                    and site.n >= o["min_tokens"]):
                items.append((t, self.linears[t].weight, site.hessian, self.schemes[t]))
        self.solved = solve_together(items, o["max_hessian_bytes"], **self._gptq_opts()) if len(items) > 1 else {}

    def _gptq_opts(self) -> dict:
        o = self.o
        # an explicit static_groups=False asks for the reference's dynamic groups: no act_order then
        return dict(damp=o["damp"], act_order=o["act_order"] and o["static_groups"] is not False,
                    block_size=o["block_size"], static_groups=o["static_groups"], scale_search=o["scale_search"])

    def _smooth(self, g: _Group, sites) -> None:
        meth = self._group_method(g)
        o = self.o
        quant_cons = [c for c in g.consumers if c in self.schemes]
        if not quant_cons:
            return
        if self.frozen.intersection(g.consumers + g.extras):  # a fold would change a carried weight
            log.info("%s: not smoothed (%s is carried from the source as it is)", g.producer,
                     sorted(self.frozen.intersection(g.consumers + g.extras))[0])
            return
        if g.norm:
            src = sites[("out", g.producer)]
        else:
            src = sites[self.site_of[g.consumers[0]]]
        if src.n == 0:
            return
        if meth == SMOOTHQUANT:
            s = ranks.decided(self.world, g.producer, lambda: smooth_scales(
                src.absmax(), [self.linears[c].weight for c in quant_cons], o["alpha"]))
            info = {"method": SMOOTHQUANT, "alpha": o["alpha"]}
        else:
            use = [c for c in quant_cons if sites[self.site_of[c]].n >= o["min_tokens"]]
            if not use:
                return

            def search():
                samples = {key: sites[key].samples() for key in {self.site_of[c] for c in use}}   # one tensor per site
                return awq_search(src.mean_abs(), [samples[self.site_of[c]] for c in use],
                                  [self.linears[c].weight for c in use], [self.schemes[c] for c in use],
                                  n_grid=o["n_grid"], duo_scaling=o["duo_scaling"])
            found = ranks.decided(self.world, g.producer, search)  # one rank searches: the ranks fold the same s
            if found.alpha is None:
                return
            s = found.scales
            info = {"method": AWQ, "alpha": found.alpha, "loss": found.loss, "loss_rtn": found.loss_rtn}
        # fold: producer rows / s, consumers' columns * s, extras' columns * s
        prod = self.mods[g.producer]
        scale_rows(prod, s, g.rows)
        self.changed.add(f"{g.producer}.weight")
        if getattr(prod, "bias", None) is not None:
            self.changed.add(f"{g.producer}.bias")
        for c in g.consumers + g.extras:
            scale_columns(self.mods[c], s)
            self.changed.add(f"{c}.weight")
        seen = set()
        # the statistics already collected at the consumers' inputs, and at a quantized extra's
        # (a recipe may quantize one: its samples / Hessian must be those of the folded input)
        for c in list(g.consumers) + [e for e in g.extras if e in self.schemes and e in self.site_of]:
            key = self.site_of[c]
            if key in sites and key not in seen:
                sites[key].scale(s)
                seen.add(key)
        if g.norm and ("out", g.producer) in sites and ("out", g.producer) not in seen:
            sites[("out", g.producer)].scale(s)
        self.res.smoothing[g.producer] = {**info, "consumers": list(g.consumers) + list(g.extras)}

    def _quantize(self, name, sites) -> None:
        o = self.o
        mod, scheme, meth = self.linears[name], self.schemes[name], self.method[name]
        site = sites.get(self.site_of[name])
        n = site.n if site is not None else 0
        stats = {"tokens": n}
        if site is not None and site.n:
            stats["act_min"], stats["act_max"] = site.act_range()
        self.res.stats[name] = stats
        if meth in (GPTQ, AWQ, FLATQUANT) and n < o["min_tokens"]:
            self.res.fallbacks.append(Fallback(name, n, f"{n} calibration tokens < min_tokens {o['min_tokens']}"))
            _quantize_rtn(mod, name, scheme, self.res)
            return
        if meth == GPTQ:
            r = self.solved.pop(name, None) or gptq_quantize(mod.weight, site.hessian(), scheme, name=name,
                                                             factor=site.factor, **self._gptq_opts())
            self.res.quantized[name] = r.qtensor
            self.res.methods[name] = GPTQ
            stats.update(gptq_loss=r.loss, gptq_damp=r.damp,
                         sqnr_db=sqnr_db(mod.weight.detach().float(), scheme.dequantize(r.qtensor)))
            _set_weight(mod, r.weight)
            key = self.site_of[name]
            self.h_users[key] -= 1
            if self.h_users[key] == 0:
                site.hess, site.factor = None, {}  # every linear of this site is done: free the Hessian
            return
        if meth == FLATQUANT:
            return FQ.flatquant_site(self, name, site, stats)
        w = None
        if meth == AWQ and o["awq_clip_search"] and name.rsplit(".", 1)[-1] not in self.no_clip:
            w = awq_clip(site.samples(), mod.weight, scheme, n_grid=o["n_grid"])
            stats["awq_clip"] = True
        _quantize_rtn(mod, name, scheme, self.res, w)
        self.res.methods[name] = meth
