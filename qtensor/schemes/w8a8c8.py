"""`w8a8c8`: `w8a8` weights (per-channel symmetric int8) plus an int8 KV cache (Ascend C8).

The linear parts, `quantize` and `dequantize` are exactly `w8a8`'s. The scheme only marks
``kv_cache = "int8"``: the KV-cache scales (``kv_cache_scale`` / ``kv_cache_offset`` on
Ascend, ``k_scale`` / ``v_scale`` in compressed-tensors) are calibrated and written elsewhere;
the formats read the flag to add ``"kv_cache_type": "C8"`` (Ascend description) or a
``kv_cache_scheme`` (compressed-tensors).
"""

from __future__ import annotations

from cvt.qtensor.schemes.base import register
from cvt.qtensor.schemes.w8a8 import W8A8


@register
class W8A8C8(W8A8):
    name = "w8a8c8"
    summary = ("w8a8 plus a quantized KV cache with calibrated scales (ascend: int8 C8 / FAKQuant; "
               "compressed-tensors: FP8, the kind vLLM loads)")
    kv_cache = "int8"
