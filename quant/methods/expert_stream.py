"""Routed experts a chunk at a time: calibration of a MoE layer larger than memory.

DeepSeek-V3's MoE layer holds 256 experts, ~45 GB in float32: more than the hosts calibration
must run on. `calibrate_streaming` therefore leaves a layer's routed experts on the meta device
when they pass `max_expert_bytes` and hands the calibration of that layer an `ExpertStream`,
which owns the stage holding the experts (the MLP stage of the true-sequential order):

1. the stage's other linears (shared experts) are calibrated first, every routed expert stubbed
   out (zeros); that pass records the attention output per batch, which the later passes replay
   (attention is already quantized, so the MLP input is final);
2. for each chunk of experts (in expert order, each chunk within `max_expert_bytes` of float32
   weights and `max_hessian_bytes` of GPTQ Hessians): its weights are read from the source, one
   pass collects its linears' statistics (the other experts stubbed), they are quantized, one more
   pass adds the chunk's share of the layer's MoE output, and the weights are dropped.

Each expert sees exactly the tokens and inputs it sees when the layer is whole, so its
statistics and quantized tensors are the same bits. The layer's output (the next layer's input)
is the same bits too: each chunk's pass continues one routed-sum accumulator per batch
(`run_experts`' ``out``) in expert order, the shared experts' output is added after it and the
residual last, as `MoE.forward` and the decoder layer do in one pass.

Smoothing that spans the experts (AWQ / SmoothQuant on post_attention_layernorm, AWQ's
up -> down folds) needs every expert at once: such layers are calibrated whole (`chunkable`).

DeepSeek-V4's blocks stream the same way (their MoE is ``ffn``, attention ``attn``, experts'
linears w1 / w3 / w2): the routed sum continues over chunks as in the HF layout, and the block's
output comes from one more pass of the block itself with attention replayed and the MoE
returning that sum plus the shared expert's (the hyper-connection mixing around it is the
block's own arithmetic, not repeated here).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn

from cvt.quant.recipe import GPTQ
from cvt.quant.methods.sites import _Site
from cvt.runtime.models.base import shared_part


class ExpertStream:
    """See the module doc. `load(ids)` / `drop(ids)`: read / free those experts' weights;
    `chunks`: expert ids per chunk, in order; `save(c, {module: QuantizedTensor})`: store chunk
    c's quantized experts (returns their fields, collected in `saved`), so that a layer's experts
    are not all held in memory until the layer ends (None: they stay in the result)."""

    def __init__(self, layer: nn.Module, prefix: str, chunks: list[list[int]],
                 load: Callable[[list[int]], None], drop: Callable[[list[int]], None],
                 save: Callable[[int, dict], dict] | None = None, moe: str = "mlp", attn: str = "self_attn"):
        # moe / attn: the layer's MoE and attention attributes (HF layout: mlp, self_attn;
        # DeepSeek-V4's block: ffn, attn)
        self.layer, self.prefix, self.chunks, self.load, self.drop = layer, prefix, chunks, load, drop
        self.save, self.saved = save, {}
        # a hybrid layer names its token mixer (``mixer``: Qwen3.5's linear_attn or self_attn)
        self.moe, self.attn = getattr(layer, moe), getattr(layer, getattr(layer, "mixer", attn))
        self.hf = moe == "mlp"  # the HF decoder layer's residual arithmetic (`_chunks_then_output`)
        self.stage = f"{prefix}.{moe}"
        self.container = f"{prefix}.{moe}.experts"
        self.x_next: torch.Tensor | None = None   # the layer's output, once the MoE stage ran
        self._attn: list[torch.Tensor] | None = None
        self._shared: list[torch.Tensor] | None = None

    # -- planning -------------------------------------------------------------------------------
    @staticmethod
    def plan_chunks(layer: nn.Module, gptq_site_k: Callable[[int], list[int]], max_bytes: int,
                    max_hessian_bytes: int, hessian_itemsize: int = 4, moe: str = "mlp") -> list[list[int]]:
        """Consecutive experts per chunk within both budgets (float32 weights; Hessians of the
        GPTQ sites `gptq_site_k(e)` lists by width); at least one expert per chunk."""
        chunks: list[list[int]] = []
        cur: list[int] = []
        wb = hb = 0
        for e, ex in enumerate(getattr(layer, moe).experts):
            w = 4 * sum(p.numel() for p in ex.parameters())
            h = sum(hessian_itemsize * k * k for k in gptq_site_k(e))
            if cur and (wb + w > max_bytes or hb + h > max_hessian_bytes):
                chunks.append(cur)
                cur, wb, hb = [], 0, 0
            cur.append(e)
            wb, hb = wb + w, hb + h
        if cur:
            chunks.append(cur)
        return chunks

    def owns(self, stage: str) -> bool:
        """Whether this is the stage holding the routed experts (true-sequential: the MLP)."""
        return stage == self.stage

    def expert_of(self, name: str) -> int | None:
        head = self.container + "."
        return int(name[len(head):].split(".", 1)[0]) if name.startswith(head) else None

    # -- the stage ------------------------------------------------------------------------------
    @torch.no_grad()
    def run_stage(self, lc, stage: str, targets: list[str], x, args, kwargs) -> None:
        routed = [t for t in targets if self.expert_of(t) is not None]
        others = [t for t in targets if self.expert_of(t) is None]
        if others:  # their statistics pass records the attention output too
            with self._recording():
                lc._run_stage(stage, others, x, args, kwargs, stub_experts=set())
        else:
            self._record_attention(lc, x, args, kwargs)

        def calibrate(chunk: list[int]) -> None:
            mine = [t for t in routed if self.expert_of(t) in chunk]
            if mine:
                self._calibrate(lc, stage, mine, chunk, x, args, kwargs)

        self._chunks_then_output(lc, x, args, kwargs, calibrate)

    def _chunks_then_output(self, lc, x, args, kwargs, per_chunk: Callable[[list[int]], None]) -> None:
        """Each chunk: read, `per_chunk` (quantize its experts), add its share of the output,
        drop; then the layer's output (`x_next`)."""
        acc: list[torch.Tensor] = []
        phase = lc.res.phases
        for c, chunk in enumerate(self.chunks):
            with phase("io"):
                self.load(chunk)
            lc._refresh()
            try:
                per_chunk(chunk)
                with phase("forward"):
                    self._accumulate(lc, chunk, first=c == 0, acc=acc, x=x, args=args, kwargs=kwargs)
            finally:
                with phase("io"):
                    self.drop(chunk)
                lc._refresh()
            mods = [m for m in lc.res.quantized if self.expert_of(m) in chunk]
            if self.save is not None and mods:
                with phase("io"):
                    self.saved.update(self.save(c, {m: lc.res.quantized.pop(m) for m in mods}))
        bs = lc.o["batch_size"]
        starts = range(0, x.shape[0], bs)
        if not len(acc) == len(self._attn) == len(starts):
            raise RuntimeError(f"internal: {self.prefix}: {len(acc)} routed sums for {len(starts)} batches")
        shared = self._shared or [None] * len(acc)
        if self.hf:
            # the decoder layer's own arithmetic: h = x + attention, then h + (MoE.forward's y [+ shared
            # experts' output], viewed as the input)
            outs = []
            for b0, attn, a, s in zip(starts, self._attn, acc, shared):
                h = x[b0:b0 + bs] + attn
                outs.append(h + (a if s is None else a + s).view(h.shape))
            self.x_next = torch.cat(outs) if outs else x.clone()  # (no batch: a rank with no calibration sequence)
        else:
            with phase("forward"):
                self.x_next = self._output_pass(lc, acc, shared, x, args, kwargs)
        self._attn = self._shared = None

    def _output_pass(self, lc, acc: list, shared: list, x, args, kwargs) -> torch.Tensor:
        """The layer's output from one more pass of the layer itself (a block whose arithmetic
        around the MoE is its own: DeepSeek-V4's hyper-connection streams), attention replayed
        and the MoE returning, batch by batch, what its forward returns: the routed sum plus the
        shared experts' output, viewed as its input."""
        from cvt.quant.methods.calib import _run_layer, _unstub

        sums = iter(zip(acc, shared))

        def moe_output(h, *a, **k):
            y, s = next(sums)
            return (y if s is None else y + s).view(h.shape)

        self.moe.forward = moe_output
        try:
            with self._replay():
                return _run_layer(self.layer, x, args, kwargs, lc.o["batch_size"])
        finally:
            _unstub(self.moe)

    @torch.no_grad()
    def finish(self, lc, x, args, kwargs) -> None:
        """The layer's output when no stage ran the experts (its MLP is all float)."""
        if self.x_next is None:
            self._record_attention(lc, x, args, kwargs)
            self._chunks_then_output(lc, x, args, kwargs, lambda chunk: None)

    def _record_attention(self, lc, x, args, kwargs) -> None:
        """One pass, every routed expert stubbed, keeping the attention output per batch."""
        from cvt.quant.methods.calib import _run_layer

        with self._recording(), self._stubbed([e for c in self.chunks for e in c]), lc.res.phases("forward"):
            _run_layer(self.layer, x, args, kwargs, lc.o["batch_size"], out=False)

    @torch.no_grad()
    def run_rtn(self, lc, x, args, kwargs) -> None:
        """A layer with no data-driven method: RTN everywhere, as the whole layer gets it (no
        statistics passes, so a KV-cache observer sees only the quantized attention), the routed
        experts a chunk at a time, then the layer's output from the chunks' passes."""
        from cvt.quant.methods.calib import _quantize_rtn

        with lc.res.phases("solve"):
            for n in lc.schemes:
                if self.expert_of(n) is None:
                    _quantize_rtn(lc.linears[n], n, lc.schemes[n], lc.res)
        self._record_attention(lc, x, args, kwargs)

        def quantize(chunk: list[int]) -> None:
            with lc.res.phases("solve"):
                for n in lc.schemes:
                    if self.expert_of(n) in chunk:
                        _quantize_rtn(lc.linears[n], n, lc.schemes[n], lc.res)

        self._chunks_then_output(lc, x, args, kwargs, quantize)

    def _calibrate(self, lc, stage, mine: list[str], chunk: list[int], x, args, kwargs) -> None:
        """Statistics of the chunk's linears (the other experts stubbed), then quantize them."""
        import zlib

        o = lc.o
        sites: dict[tuple, _Site] = {}
        lc.h_users = {}
        for t in mine:
            key = lc.site_of[t]
            gptq = lc.method[t] == GPTQ
            if key not in sites:
                sites[key] = _Site(lc._k(key), hessian=gptq, hessian_dtype=o["hessian_dtype"],
                                   seed=zlib.crc32(key[1].encode()))
            elif gptq and sites[key].hess is None:
                sites[key] = _Site(lc._k(key), hessian=True, hessian_dtype=o["hessian_dtype"],
                                   seed=zlib.crc32(key[1].encode()))
            if gptq:
                lc.h_users[key] = lc.h_users.get(key, 0) + 1
        shared = shared_part(self.moe)
        with self._replay(), self._stubbed([], also=[shared] if shared is not None else []):  # not needed here
            lc._collect(stage, sites, x, args, kwargs, stub_experts={(self.container, e) for e in chunk})
        lc._quantize_all(mine, sites)

    def _accumulate(self, lc, chunk: list[int], *, first: bool, acc: list, x, args, kwargs) -> None:
        """One pass running only `chunk`'s experts: their contributions continue each batch's
        routed sum in `acc` (`run_experts`' accumulator, in expert order, as one pass over all
        experts adds them). The first pass also keeps the shared experts' output; no pass adds
        it into the sum (it is added last, as MoE.forward does). The model module's
        `run_experts` is swapped for the pass: only this thread runs forwards during calibration."""
        from cvt.quant.methods.calib import _run_layer, _stub, _unstub

        mlp = self.moe
        models = sys.modules[type(mlp).__module__]   # where MoE.forward looks run_experts up
        real = models.run_experts
        pos = [0]

        def continuing(xs, idx, weights, experts):
            b = pos[0]
            pos[0] += 1
            if b == len(acc):
                acc.append(real(xs, idx, weights, experts))
            else:
                real(xs, idx, weights, experts, out=acc[b])
            return acc[b]

        hooks = []
        shared = shared_part(mlp)
        if first and shared is not None:
            hooks.append(shared.register_forward_hook(lambda m, a, out: self._shared.append(out)))
        try:
            models.run_experts = continuing
            if shared is not None and not first:
                _stub(shared)
            with self._replay(), self._stubbed([e for c in self.chunks for e in c if e not in set(chunk)]):
                _run_layer(self.layer, x, args, kwargs, lc.o["batch_size"], out=False)
        finally:
            models.run_experts = real
            for h in hooks:
                h.remove()
            if shared is not None and not first:
                _unstub(shared)

    # -- helpers ----------------------------------------------------------------------------------
    @contextmanager
    def _recording(self):
        """Keep the attention output of each batch the passes inside run (for `_replay`)."""
        self._attn, self._shared = [], []
        hook = self.attn.register_forward_hook(lambda m, a, out: self._attn.append(out))
        try:
            yield
        finally:
            hook.remove()

    @contextmanager
    def _replay(self):
        """Attention returns the outputs recorded in the stage's first pass, batch by batch."""
        from cvt.quant.methods.calib import _unstub

        attn, recorded = self.attn, iter(self._attn)
        attn.forward = lambda *a, **k: next(recorded)
        try:
            yield
        finally:
            _unstub(attn)

    @contextmanager
    def _stubbed(self, ids: list[int], also: list[nn.Module] = ()):
        from cvt.quant.methods.calib import _stub, _unstub

        mods = [self.moe.experts[e] for e in ids] + list(also)
        for m in mods:
            _stub(m)
        try:
            yield
        finally:
            for m in mods:
                _unstub(m)


def expert_bytes(layer: nn.Module, moe: str = "mlp") -> int:
    """float32 bytes of a layer's routed experts (0 without, or fused into [E, ...] parameters as
    gpt-oss's, which no scheme quantizes: nothing to stream); `moe`: the layer's MoE attribute."""
    experts = getattr(getattr(layer, moe, None), "experts", None)
    if not isinstance(experts, nn.ModuleList) or not experts:
        return 0
    return 4 * sum(p.numel() for ex in experts for p in ex.parameters())


__all__ = ["ExpertStream", "expert_bytes"]
