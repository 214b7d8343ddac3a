"""RTN: round-to-nearest with the scheme's own scales; no data. The fallback of every
calibrated method (e.g. a MoE expert that received too few calibration tokens)."""

from __future__ import annotations

import torch

from cvt.qtensor.schemes.base import QuantizedTensor, Scheme


def rtn_quantize(w: torch.Tensor, scheme: Scheme) -> QuantizedTensor:
    """``scheme.quantize(w)`` of the float32 weight (the scheme refuses non-finite values)."""
    return scheme.quantize(w.detach().to(torch.float32))
