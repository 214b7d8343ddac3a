"""Streaming calibration: the quantize stage's data-driven work, one decoder layer in memory.

`calibrate_streaming` runs the calibration driver (`cvt.quant.methods.calib`: GPTQ, AWQ,
SmoothQuant, RTN in place, the true-sequential stages) over a runtime model built on the meta
device, so that a 0.7-2 TB checkpoint calibrates on a host with less RAM than the model:

1. The calibration tokens are embedded by reading only their rows of ``embed_tokens`` (the
   model's embedding, `cvt.quant.methods.decoder_layers`: DeepSeek-V4's ``embed``) from the checkpoint (mmap), and
   the model's own forward gives the arguments of decoder layer 0 (rope, mask; V4: the token
   ids, positions, ropes) through the driver's capture hook; no other weight is loaded.
2. For each decoder layer i: its tensors are read from the source and assigned in the compute
   dtype on `device` (FP8 blocks dequantized, compressed-tensors INT4 unpacked to float, BF16
   as is); the layer is calibrated; its quantized parts, changed float tensors, statistics and
   observed KV-cache ranges are written to the state folder (``DST/.cvt-calib``), with the
   layer's output (the next layer's input, float32); the layer's weights are dropped (back to
   meta) before the next is read. Layer inputs larger than `spill_bytes` are used from the
   state folder through mmap instead of RAM.
3. A killed run restarts after its last finished layer (`state.json` names the plan: SRC's
   content identity (`cvt.convert.identity`), schemes and methods, tokens, options, device;
   and records the size and checksum of every state file, hashed as it was written); the
   persisted inputs and results are the exact float32 bytes an uninterrupted run has, so the
   output is byte-identical. Before a resumed run uses the state, every recorded file is
   checked against its record: a changed file (a tensor scaled at the same size), one not
   recorded, or a state computed from another SRC is refused with one line, never consumed.

Peak memory: one decoder layer in float32, except a MoE layer whose routed experts pass
`max_expert_bytes` (DeepSeek-V3: ~45 GB per layer): those are read, calibrated and dropped a chunk
of experts at a time (`cvt.quant.methods.expert_stream`; not when AWQ / SmoothQuant smooth across
the experts, which needs them all; each chunk's quantized experts go to the state folder as it
finishes, and the layer keeps a few activation-sized lists: attention output, routed sums);
plus the layer's input and output activations (or mmap pages of them), the driver's statistics
(GPTQ Hessians bounded by `max_hessian_bytes`), and a constant. Everything else of the stage
streams as RTN does: the writer reads each calibrated module's parts from the state folder
(`cvt.quant.methods.layer_store`). In a torchrun world each rank runs its share of the
sequences and the ranks combine what the methods measure (`cvt.quant.methods.ranks`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import resource
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from cvt.world import SINGLE, World
from cvt.errors import CvtError
from cvt.quant.methods import ranks
from cvt.quant.methods import flatquant as FQ
from cvt.quant.recipe import AWQ, FLATQUANT, GPTQ, RTN, SMOOTHQUANT
from cvt.quant.methods.layer_store import LayerStore, _unreadable, check_resumed

log = logging.getLogger(__name__)

SPILL_BYTES = 1 << 30  # layer activations above this are used through mmap from the state folder
MAX_EXPERT_BYTES = 4 << 30  # a MoE layer's routed experts above this (float32) are read a chunk at a time


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class StreamResult:
    """What the stage needs from calibration; tensors stay on disk until the writer asks."""

    store: "LayerStore"
    methods: dict[str, str] = field(default_factory=dict)
    fallbacks: list = field(default_factory=list)              # calib.Fallback
    stats: dict[str, dict] = field(default_factory=dict)
    kv_amax: list[dict[str, torch.Tensor]] = field(default_factory=list)
    seconds_per_layer: list[float] = field(default_factory=list)
    phase_seconds: list[dict[str, float]] = field(default_factory=list)  # per layer (`phases.Phases`)
    peak_rss: int = 0
    peak_rss_per_rank: list[int] = field(default_factory=list)
    resumed_layers: int = 0

    def phase_table(self) -> dict[str, list[float]]:
        """phase -> its seconds in each layer (0 for a layer saved before phases were recorded)."""
        from cvt.quant.methods.phases import PHASES

        return {k: [ph.get(k, 0.0) for ph in self.phase_seconds] for k in PHASES}


def _trim() -> None:
    """Hand freed heap memory back to the OS (glibc keeps a dropped layer's many mid-sized
    buffers in its arenas otherwise, and RSS would creep up layer by layer)."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def stream_plan_id(ckpt, plan, tokens: torch.Tensor, device, opts: dict, source: dict | None = None,
                   frozen=frozenset()) -> str:
    """The calibration's identity: a resumed run continues only the same one. `source`: SRC's
    content identity (`Checkpoint.content_identity` when not given); `frozen`: modules kept as
    the source has them (a fold may not change them: it changes what is calibrated)."""
    # the FlatQuant fit's options only where a module is fitted: every other run's identity is unchanged
    fits = FLATQUANT in plan.methods.values()
    ident = {
        "source": source if source is not None else ckpt.content_identity,
        "modules": sorted((m, s.name, s.group_size, s.symmetric, getattr(s, "fp4_format", None),
                           plan.methods.get(m, RTN)) for m, s in plan.schemes.items()),
        "tokens": hashlib.sha256(tokens.numpy().tobytes()).hexdigest(), "shape": list(tokens.shape),
        # max_expert_bytes changes how much is read at once, not a byte of the result: a run killed
        # for memory may resume with a smaller --expert-memory
        # the device kind, not its index: rank r of a torchrun world computes on cuda:r
        "device": torch.device(device).type, "opts": {k: str(v) for k, v in sorted(opts.items()) if k != "max_expert_bytes"
                                                      and (fits or not k.startswith("flatquant_"))},
    }
    if frozen:  # (absent otherwise: the identity of every run without carried experts is unchanged)
        ident["frozen"] = sorted(frozen)
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _streams_experts(layer: nn.Module, prefix: str, plan, o: dict, moe: str = "mlp") -> bool:
    """Whether this layer's routed experts are calibrated a chunk at a time (module doc): its MoE
    (``moe``: the HF layout's ``mlp``, DeepSeek-V4's ``ffn``) holds more than ``max_expert_bytes``
    of routed experts, and no smoothing spans them."""
    from cvt.quant.methods.expert_stream import expert_bytes

    if not isinstance(getattr(layer, moe, None), nn.Module):
        return False
    if not o["true_sequential"] or expert_bytes(layer, moe) <= o["max_expert_bytes"]:
        return False
    smoothed = sorted(m for m, meth in plan.methods.items()
                      if m.startswith(f"{prefix}{moe}.") and meth in (AWQ, SMOOTHQUANT))
    if smoothed:
        log.info("%s%s.experts: calibrated whole (%s smooths across them: %s)", prefix, moe,
                 plan.methods[smoothed[0]], smoothed[0])
        return False
    return True


def _expert_stream(model, ckpt, device, block, layer: nn.Module, i: int, plan, o: dict, store: LayerStore,
                   layout) -> "ExpertStream":
    from cvt.quant.methods.expert_stream import ExpertStream
    from cvt.runtime.loader import assign_tensors

    prefix, moe = f"{text_prefix(ckpt)}{layout.layers}.{i}", layout.moe
    experts = getattr(layer, moe).experts

    def gptq_sites(e: int) -> list[int]:
        """The widths of expert e's GPTQ Hessians: one for the linears reading the MoE input
        (gate / up, V4's w1 / w3), one per other linear (down, w2)."""
        ex, name = experts[e], f"{prefix}.{moe}.experts.{e}."
        shared = next((names for names in model.args.arch_table().calib_shared_inputs
                       if any(hasattr(ex, n) for n in names)), ())  # the family's table: which read one input
        gptq = [n for n, mod in ex.named_children()
                if hasattr(mod, "weight") and plan.methods.get(name + n) == GPTQ and name + n in plan.schemes]
        ks = [getattr(ex, n).weight.shape[1] for n in gptq if n not in shared]
        reads_input = [n for n in gptq if n in shared]
        return ([getattr(ex, reads_input[0]).weight.shape[1]] if reads_input else []) + ks

    def save(c: int, quantized: dict) -> dict:
        return store.save_part(i, c, quantized)

    def load(ids: list[int]) -> None:
        heads = tuple(f"{prefix}.{moe}.experts.{e}." for e in ids)
        assign_tensors(model, ckpt, device, block, skip=lambda name: not name.startswith(heads))
        _dense_linears(layer)

    def drop(ids: list[int]) -> None:
        for e in ids:
            experts[e].to("meta")
        _trim()

    chunks = ExpertStream.plan_chunks(layer, gptq_sites, o["max_expert_bytes"], o["max_hessian_bytes"],
                                      torch.finfo(o["hessian_dtype"]).bits // 8, moe=moe)
    log.info("%s: %d routed experts in %d chunks", prefix, len(experts), len(chunks))
    return ExpertStream(layer, prefix, chunks, load, drop, save, moe=moe, attn=layout.attn)


def _dense_linears(layer: nn.Module) -> None:
    """Quantized source modules (compressed-tensors INT4) become float Linears to calibrate."""
    from cvt.runtime.kernels import Linear

    for name, mod in list(layer.named_modules()):
        if isinstance(mod, Linear) and mod.fmt != "dense":
            parent, _, attr = name.rpartition(".")
            w = mod.dense_weight()
            setattr(layer.get_submodule(parent) if parent else layer, attr,
                    Linear.from_parts({"weight": w}, None if mod.bias is None else mod.bias.float()))


def calibrate_streaming(ckpt, plan, tokens: torch.Tensor, state_dir: Path, *, device="cpu",
                        observe_kv: bool = False, spill_bytes: int | None = None, quiet: bool = True,
                        on_layer: Callable[[int], None] | None = None, frozen: frozenset[str] = frozenset(),
                        world: World = SINGLE, **opts) -> StreamResult:
    """Calibrate `plan` (``plan.schemes``, ``plan.methods``) on `tokens` [b, s], one decoder layer
    at a time (module doc). `opts` go to the driver (`cvt.quant.methods.calib.calibrate`'s
    options). `on_layer(i)` is called after layer i is saved (tests kill runs there). `frozen`:
    linears the output carries from SRC as they are (not in ``plan.schemes``; no fold changes them).
    The layer input stored between layers is whatever the model's layers take (`calib.Layout`):
    hidden states [b, s, h], DeepSeek-V4's hc streams [b, s, hc, h], float32. `world`: the ranks
    that share the sequences (`cvt.quant.methods.ranks`; one process by default)."""
    from cvt import hooks
    from cvt.quant.methods import calib as C
    from cvt.runtime import kv_cache
    from cvt.runtime.loader import fp8_block
    from cvt.runtime.models import build_model
    from cvt.convert.config import source_format
    from cvt.progress import make_progress

    device = torch.device(device)
    o = _options(opts)
    source = ckpt.content_identity
    store = LayerStore(state_dir, stream_plan_id(ckpt, plan, tokens, device, o, source, frozen), source, world)
    with torch.device("meta"):
        model = build_model(ckpt.config, dtype=torch.float32)
    n_layers = model.args.num_hidden_layers
    layout = C.Layout.of(model)
    if observe_kv and kv_cache.attention(model).kv_quant is None:  # (its table's attention kind)
        raise CvtError(f"{ckpt.config.get('model_type')}: KV-cache scales are not calibrated for this model family")
    block = fp8_block(ckpt, source_format(ckpt.config))
    tp = text_prefix(ckpt)                                 # Kimi-K2.5: the checkpoint's language_model.
    mine = tokens[ranks.share(world, tokens.shape[0])]     # this rank's sequences (all of them for one)
    x, args, kwargs = _first_input(model, layout, ckpt, mine, tokens, device, tp)
    shape = tuple(x.shape)
    spill = x.numel() * 4 > (SPILL_BYTES if spill_bytes is None else spill_bytes)
    res, start = _resume(store, plan, n_layers)
    if start:
        x = store.x(start, shape, spill).to(device)
        log.info("calibration resumes after %d finished layers", start)
    observer = kv_cache.KVObserver(model) if observe_kv else None
    layers = _Layers(model, layout, ckpt, plan, o, store, device, block, tp, frozen, observer, world)
    bar = make_progress(n_layers, "calibrate", quiet, unit="layer", initial=start)
    try:
        for i in range(start, n_layers):
            with _layer_progress(layers.layers[i], f"layer {i + 1}/{n_layers}", mine.numel(), quiet):
                x, seconds = layers.calibrate(i, x, args, kwargs, res)
            if spill:  # the next input from the state file, not RAM
                x = store.x(i + 1, shape, True).to(device)
            layers.drop(i)
            _merge(res, store.load_layer(i))
            bar.update(1)
            bar.set_postfix_str(f"{seconds:.1f} s/layer, peak RSS {peak_rss_bytes() / 2**30:.2f} GiB")
            log.info("calibrated layer %d/%d in %.1f s", i + 1, n_layers, seconds)
            hooks.after_layer(i)  # the kill-and-resume tests stop a run here
            if on_layer is not None:
                on_layer(i)
    finally:
        bar.close()
        ckpt.release(f"{tp}{layout.embed}.weight")
    res.peak_rss = peak_rss_bytes()
    res.peak_rss_per_rank = world.all_gather(res.peak_rss)
    return res


def _options(opts: dict) -> dict:
    """The driver's options, `opts` over the defaults; CvtError naming an unknown one."""
    o = dict(min_tokens=32, batch_size=8, damp=0.01, act_order=True, scale_search="hdiag", block_size=128,
             static_groups=None,
             true_sequential=True, alpha=0.5, n_grid=20, duo_scaling=True, awq_clip_search=True, max_samples=512,
             max_hessian_bytes=4 << 30, hessian_dtype=torch.float32, collect_stats=False,
             max_expert_bytes=MAX_EXPERT_BYTES, flatquant_steps=FQ.STEPS, flatquant_lr=FQ.LR, flatquant_seed=FQ.SEED)
    unknown = set(opts) - set(o)
    if unknown:
        raise CvtError(f"unknown calibration option(s) {sorted(unknown)}")
    o.update(opts)
    return o


def _first_input(model, layout, ckpt, mine: torch.Tensor, tokens: torch.Tensor, device, tp: str):
    """(hidden states, args, kwargs) of decoder layer 0 for this rank's share `mine` of `tokens`:
    the tokens' rows of the embedding read from the checkpoint (mmap, never the whole table), and
    the model's own forward for the layer arguments (rope, mask; `calib._layer_args`)."""
    from cvt.quant.methods import calib as C

    embed = model.get_submodule(layout.embed)
    emb = ckpt.read(f"{tp}{layout.embed}.weight")         # rows read through mmap, never the whole table
    embed.forward = lambda t: emb[t.cpu()].to(device=device, dtype=torch.float32)
    x, args, kwargs = C._layer_args(model, (mine if mine.shape[0] else tokens[:1]).to(device))
    x = x[:mine.shape[0]]                                  # a rank with none still needs the layer arguments
    del embed.forward
    return x, args, kwargs


def _resume(store: LayerStore, plan, n_layers: int) -> tuple[StreamResult, int]:
    """The result so far and the first layer to calibrate: the layers an earlier run of the same
    plan finished, each checked against the plan (`check_resumed`)."""
    start = store.done()
    if start > n_layers:
        raise _unreadable(store.root / "state.json", f"{start} layers done, the model has {n_layers}")
    res = StreamResult(store, resumed_layers=start)
    for i in range(start):
        meta = store.load_layer(i)
        check_resumed(meta, plan, i, store.root / f"layer-{i}.json")
        _merge(res, meta)
        res.kv_amax.append(store.kv_amax(i))
    return res, start


@dataclass
class _Layers:
    """Calibrates the model's decoder layers one at a time: read from the checkpoint, run through
    the driver, saved to the state folder, dropped."""

    model: nn.Module
    layout: object  # `calib.Layout`
    ckpt: object
    plan: object
    o: dict
    store: LayerStore
    device: torch.device
    block: object
    tp: str
    frozen: frozenset
    observer: object
    world: World

    def __post_init__(self):
        self.layers = self.layout.decoder_layers(self.model)

    def calibrate(self, i: int, x: torch.Tensor, args, kwargs, res: StreamResult) -> tuple[torch.Tensor, float]:
        """Layer i read, calibrated and saved with the KV ranges it saw; returns its output and the
        seconds it took."""
        from cvt.quant.methods import calib as C
        from cvt.runtime.loader import assign_tensors

        t0 = time.perf_counter()
        layout, plan, o, observer = self.layout, self.plan, self.o, self.observer
        layer = self.layers[i]
        prefix = f"{self.tp}{layout.layers}.{i}."
        streamed = _streams_experts(layer, prefix, plan, o, layout.moe)
        experts_at = f"{prefix}{layout.moe}.experts."
        lres = C.CalibResult()
        with lres.phases("io"):
            assign_tensors(self.model, self.ckpt, self.device, self.block,
                           skip=lambda name: not name.startswith(prefix) or (streamed and name.startswith(experts_at)))
            _dense_linears(layer)
        es = (_expert_stream(self.model, self.ckpt, self.device, self.block, layer, i, plan, o, self.store, layout)
              if streamed else None)
        if observer is not None:
            layer.self_attn.kv_observer = observer._observer(i)
        C._LayerCalib(layer, f"{self.tp}{layout.layers}.{i}", plan.schemes.get, lambda n: plan.methods.get(n, RTN),
                      lres, o, self.model.args.arch_table(), experts=es, frozen=self.frozen,
                      world=self.world).run(x, args, kwargs)
        if es is not None:
            x = es.x_next
        else:
            with lres.phases("forward"):
                x = C._run_layer(layer, x, args, kwargs, o["batch_size"])
        if observer is not None:
            layer.self_attn.kv_observer = None
        lres.seconds_per_layer.append(time.perf_counter() - t0)  # (saving its state, below, is not counted)
        amax = ranks.amax_max(self.world, observer.amax[i]) if observer is not None else {}
        self.store.save_layer(i, lres, amax, x, es.saved if es is not None else None)
        res.kv_amax.append(amax)
        return x, lres.seconds_per_layer[0]

    def drop(self, i: int) -> None:
        """Layer i's weights dropped (back to the meta device), the freed heap handed back."""
        self.layers[i].to("meta")
        _trim()


@contextmanager
def _layer_progress(layer: nn.Module, desc: str, tokens: int, quiet: bool):
    """A bar of the calibration tokens through `layer` (this rank's `tokens` per pass), under the
    layers' bar: the driver runs a layer several times (statistics per stage, GPTQ Hessian chunks,
    expert chunks, its output), each pass counted afresh, so that a layer taking minutes visibly
    moves. Counted by a forward hook on the decoder layer: every pass calls it batch by batch."""
    from cvt.progress import make_progress

    bar = make_progress(tokens, desc, quiet, unit="token", leave=False, position=1)
    passes = [1]

    def tick(module, args, out) -> None:
        if not args or not hasattr(args[0], "shape") or args[0].dim() < 2:
            return
        if bar.n >= tokens:  # the next pass over the calibration tokens
            passes[0] += 1
            bar.reset(tokens)
            bar.set_description(f"{desc}, pass {passes[0]}", refresh=False)
        bar.update(int(args[0].shape[0] * args[0].shape[1]))

    hook = layer.register_forward_hook(tick)
    try:
        yield bar
    finally:
        hook.remove()
        bar.close()


def _merge(res: StreamResult, meta: dict) -> None:
    from cvt.quant.methods.calib import Fallback

    res.methods.update(meta["methods"])
    res.stats.update(meta["stats"])
    res.fallbacks += [Fallback(*f) for f in meta["fallbacks"]]
    res.seconds_per_layer += meta["seconds"]
    res.phase_seconds.append(meta.get("phases", {}))  # (a state saved before phases were recorded: none)


def text_prefix(ckpt) -> str:
    """The checkpoint's prefix of the text model's names ("language_model." for Kimi-K2.5, else "");
    the runtime model, calibrated here layer by layer, names its modules without it."""
    from cvt.convert.arch import arch_for

    return arch_for(ckpt.config).table.text_prefix


def kv_scales(res: StreamResult, model_or_config, codec: str, ascend_names: bool = False,
              prefix: str = "") -> dict[str, torch.Tensor]:
    """The KV-cache scales from the per-layer ranges observed while calibrating (the runtime's
    `KVObserver` rules: int8 Ascend C8 / FAKQuant, fp8 compressed-tensors, or with `ascend_names`
    fp8 FAKQuant, Ascend 950's cache: the Ascend names with amax / 448), named as the checkpoint
    names the text model (`prefix`: `text_prefix`)."""
    from cvt.runtime import kv_cache

    class _Obs(kv_cache.KVObserver):
        def __init__(self):  # noqa: D401 - the observer's scale rules over stored ranges
            self.model = model_or_config
            self.mla = kv_cache.latent_cache(model_or_config)
            self.amax = res.kv_amax

    obs = _Obs()
    out = obs.fp8_scales() if codec == "fp8" and not ascend_names else obs.scales(codec)
    return {prefix + n: t for n, t in out.items()}
