"""`calibrate` for a quantize-stage plan, answered in the stage's terms: the in-memory driver
(every layer held), as tests and small models use it; the stage itself streams
(`cvt.quant.methods.stream`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cvt.qtensor.schemes.base import QuantizedTensor
from cvt.quant.methods.calib import CalibResult, calibrate
from cvt.quant.recipe import RTN


@dataclass
class MethodsResult:
    """`run_methods`' answer in the stage's terms.

    quantized:       module -> QuantizedTensor (every module of plan.schemes in the decoder layers)
    float_overrides: tensor name -> float tensor to write instead of the source's (norm weights,
                     router, float kv_b_proj, biases changed by smoothing folds)
    fallbacks:       cvt.schemas.manifest.Fallback per module quantized with RTN instead of its method
    act_absmax:      module -> max |input| seen during calibration, AFTER smoothing and with the
                     earlier layers quantized (use it for static activation scales of smoothed linears)
    calib:           the full CalibResult (per-module stats, smoothing factors, seconds per layer)
    """

    quantized: dict[str, QuantizedTensor]
    float_overrides: dict[str, torch.Tensor]
    fallbacks: list
    act_absmax: dict[str, float]
    calib: CalibResult


def run_methods(model: nn.Module, tokens: torch.Tensor, plan, **opts) -> MethodsResult:
    """`calibrate` for a stage plan (``plan.schemes``: module -> Scheme, ``plan.methods``:
    module -> method). Modules whose method is "rtn" are quantized with RTN too, so that later
    layers see them quantized. `opts` go to `calibrate`."""
    from cvt.schemas.manifest import Fallback as ManifestFallback

    schemes, methods = plan.schemes, plan.methods
    res = calibrate(model, tokens, schemes.get, lambda n: methods.get(n, RTN), **opts)
    fallbacks = [ManifestFallback(module=f.name, method=methods.get(f.name, RTN), reason=f.reason, tokens=f.tokens)
                 for f in res.fallbacks]
    absmax = {n: max(abs(s["act_min"]), abs(s["act_max"])) for n, s in res.stats.items() if "act_min" in s}
    return MethodsResult(res.quantized, res.float_weights, fallbacks, absmax, res)
