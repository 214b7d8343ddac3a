"""The quantize stage's calibration: calibration text through the model one decoder layer at a
time (`cvt.quant.methods.stream`), and what the writer takes from it (`Calibrated`): the calibrated
modules (read from the state folder when written), changed float tensors, static attention inputs,
KV-cache scales, fallbacks and the per-module methods and SQNR, plus the manifest's summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cvt.lazy import torch

from cvt.convert.reader import Checkpoint
from cvt.errors import FormatError
from cvt.quant.recipe import FLATQUANT, RTN
from cvt.qtensor.schemes.base import QuantizedTensor
from cvt.schemas.manifest import Fallback
from cvt.quant.stage.assignment import Plan
from cvt.quant.stage import fp4_source
from cvt.quant.stage.outputs import int8_kv
from cvt.quant.stage.quantizer import Source
from cvt.world import SINGLE, World


@dataclass
class Calibrated:
    """What calibration gives the writer (empty for an RTN run)."""

    quantized: dict[str, QuantizedTensor] = field(default_factory=dict)
    float_overrides: dict[str, torch.Tensor] = field(default_factory=dict)  # e.g. norms after smoothing
    static_inputs: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    kv_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    fallbacks: list[Fallback] = field(default_factory=list)
    methods_applied: dict[str, str] = field(default_factory=dict)
    sqnr: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    tokens_sha256: str | None = None
    # calibrated results stay in the state folder: `quantized` / `float_overrides` list the names,
    # these read one when the writer asks for it
    loader: Any = None
    float_loader: Any = None
    summary: dict | None = None
    mixed: dict | None = None  # --kl-budget's record (`cvt.quant.stage.kl_budget.choose`)


def calib_data(ckpt: Checkpoint, calib, calib_tokens: int | None) -> torch.Tensor:
    """The calibration token ids [b, 256] (`cvt.quant.methods.data.calib_tokens`): `calib_tokens`
    as asked, all of them or a CvtError (None: the default, a bound)."""
    from cvt.corpus import CALIB_TOKENS
    from cvt.quant.methods.data import calib_tokens as calib_tokens_of
    from cvt.runtime.models import family
    from cvt.runtime.tokenizer import load_tokenizer

    mod, cfg = family(ckpt.config)
    args = mod.Args.from_config(cfg)
    tokens = calib_tokens_of(load_tokenizer(ckpt.root, ckpt.config), calib, seq_len=256,
                             max_sequences=max(1, (calib_tokens or CALIB_TOKENS) // 256),
                             max_len=args.max_position_embeddings, asked=calib_tokens)
    top = int(tokens.max()) if tokens.numel() else -1
    if top >= args.vocab_size:  # a tokenizer that does not fit the model (the embedding lookup would fail)
        raise FormatError(f"{ckpt.root}: its tokenizer gives token id {top}, beyond config.json's vocab_size "
                          f"{args.vocab_size}: calibration cannot run this tokenizer's ids through the model")
    return tokens


def calibrate(ckpt: Checkpoint, plan: Plan, tokens: torch.Tensor, static_attention: bool,
              kv_codec: str, state_dir: Path, device, quiet: bool, expert_memory: int | None = None,
              kv_static: bool = True, ascend_names: bool = False, source: Source | None = None,
              world: World = SINGLE, mixed: dict | None = None, fit: dict | None = None) -> Calibrated:
    """Calibration `tokens` (`calib_data`) through the model, one decoder layer from disk at a time
    (`cvt.quant.methods.stream`): the calibrated methods, static activation scales of the
    attention projections (--static-attention: amax / 127 of what they see, after smoothing and
    with the earlier layers quantized) and KV-cache scales (w8a8c8). Resumable per layer. `world`:
    the ranks that share the calibration sequences. `mixed`: --kl-budget's record, passed on. `fit`:
    --method flatquant's options (`cvt.quant.methods.flatquant`), recorded in the summary."""
    import hashlib

    from cvt.quant.methods.stream import calibrate_streaming, kv_scales, text_prefix
    from cvt.schemas.manifest import Fallback as ManifestFallback

    c8 = kv_static and int8_kv(plan)
    plan, frozen = fp4_source.calibration_plan(plan, source) if source is not None else (plan, frozenset())
    res = calibrate_streaming(ckpt, plan, tokens, state_dir, device=device, observe_kv=c8, quiet=quiet,
                              collect_stats=static_attention, frozen=frozen, world=world, **(fit or {}),
                              **({} if expert_memory is None else {"max_expert_bytes": expert_memory}))
    store = res.store
    out = Calibrated(mixed=mixed, tokens=int(tokens.numel()), tokens_sha256=hashlib.sha256(tokens.numpy().tobytes()).hexdigest())
    out.quantized = {m: None for m in store.modules()}            # read from the state folder when written
    out.loader = store.quantized
    out.float_overrides = {n: None for n in store.floats()}
    out.float_loader = store.float_tensor
    out.fallbacks = [ManifestFallback(module=f.name, method=plan.methods.get(f.name, RTN), reason=f.reason,
                                      tokens=f.tokens) for f in res.fallbacks]
    out.methods_applied = {m: ("rtn-fallback" if a == RTN and plan.methods.get(m, RTN) != RTN else a)
                           for m, a in res.methods.items()}
    out.sqnr = {m: st["sqnr_db"] for m, st in res.stats.items() if "sqnr_db" in st}
    if static_attention:
        targets = {m for m, s in plan.schemes.items() if getattr(s, "static_attention", False) and ".self_attn." in m}
        out.static_inputs = {m: (torch.tensor([max(abs(st["act_min"]), abs(st["act_max"]), 1e-8) / 127.0]),
                                 torch.zeros(1)) for m, st in res.stats.items() if m in targets and "act_min" in st}
    if c8:
        out.kv_scales = kv_scales(res, ckpt.config, kv_codec, ascend_names, text_prefix(ckpt))
    out.summary = {"tokens": int(tokens.numel()), "layers": len(res.seconds_per_layer), "device": str(device),
                   "seconds_per_layer": [round(x, 3) for x in res.seconds_per_layer],
                   # per layer: its forward passes, solve and reads (`cvt.quant.methods.phases`)
                   "phase_seconds": res.phase_table(),
                   "peak_rss_bytes": max(res.peak_rss_per_rank or [res.peak_rss]), "resumed_layers": res.resumed_layers}
    if FLATQUANT in plan.methods.values():
        out.summary[FLATQUANT] = flatquant_summary(res.stats, fit or {})
    if len(res.peak_rss_per_rank) > 1:  # a torchrun world: its size and each rank's peak
        out.summary.update(ranks=len(res.peak_rss_per_rank), peak_rss_per_rank=res.peak_rss_per_rank)
    return out


def flatquant_summary(stats: dict[str, dict], fit: dict) -> dict:
    """The manifest's record of --method flatquant: the fit's settings (its defaults where not
    given) and, over the fitted linears, the mean output MSE at the Hadamard start and after."""
    from cvt.quant.methods import flatquant as FQ

    fitted = [st for st in stats.values() if "flatquant_loss" in st]
    n = max(1, len(fitted))
    return {"steps": fit.get("flatquant_steps", FQ.STEPS), "lr": fit.get("flatquant_lr", FQ.LR),
            "seed": fit.get("flatquant_seed", FQ.SEED), "linears": len(fitted),
            "loss_start": sum(st["flatquant_loss_init"] for st in fitted) / n,
            "loss": sum(st["flatquant_loss"] for st in fitted) / n}
