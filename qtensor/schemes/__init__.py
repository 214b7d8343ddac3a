"""Quantization schemes, one module each, registered by name on import (see `base`).

==============  =========================================================================
w8a8            per-channel symmetric int8 weights; dynamic (or static) int8 activations
w8a8c8          w8a8 + int8 KV cache (Ascend C8)
w4a16           int4 weights, groups along k (0 = per channel), symmetric or asymmetric
w4a8            int4 weights per channel (symmetric); dynamic per-token int8 activations (Ascend W4A8_DYNAMIC)
fp4             E2M1 weights: nvfp4 (group 16, e4m3 scales + global scale) or mxfp4 (group 32, E8M0)
mxfp8           E4M3 weights, block 32, E8M0 scales; MXFP8 activations (Ascend 950 W8A8_MXFP8)
w4a4_mxfp4      E2M1 weights, block 32, E8M0 scales; MXFP4 activations (Ascend 950 W4A4_MXFP4)
w4a8_mxfp       E2M1 weights, block 32, E8M0 scales; MXFP8 activations (Ascend 950 W4A8_MXFP)
w4a4_flatquant  int4 weights per channel behind an online Kronecker transform; int4 activations
                (Ascend W4A4_FLATQUANT_DYNAMIC, linears)
w4a4_mxfp4_flatquant  E2M1 weights, block 32, behind an online Kronecker transform; MXFP4 activations
                (Ascend 950 W4A4_MXFP4_FLATQUANT, linears)
==============  =========================================================================

``get_scheme(name, **options)`` builds one; ``scheme_names()`` lists them.
"""

from cvt.qtensor.schemes.base import (SCHEMES, QuantizedTensor, Scheme, get_scheme, register, scheme_from_options,
                                      scheme_names)
from cvt.qtensor.schemes import w8a8, w8a8c8, w4a16, w4a8, fp4, mx, flatquant, flatquant_mx  # noqa: E402,F401  isort: skip  (registers)
from cvt.qtensor.schemes.flatquant import W4A4FlatQuant  # noqa: E402
from cvt.qtensor.schemes.flatquant_mx import W4A4MXFP4FlatQuant  # noqa: E402
from cvt.qtensor.schemes.fp4 import FP4  # noqa: E402
from cvt.qtensor.schemes.mx import MXFP8, W4A4MXFP4, W4A8MXFP  # noqa: E402
from cvt.qtensor.schemes.w4a8 import W4A8  # noqa: E402
from cvt.qtensor.schemes.w4a16 import W4A16  # noqa: E402
from cvt.qtensor.schemes.w8a8 import W8A8, static_parts  # noqa: E402
from cvt.qtensor.schemes.w8a8c8 import W8A8C8  # noqa: E402

__all__ = ["FP4", "W4A4FlatQuant", "W4A4MXFP4FlatQuant", "MXFP8", "W4A4MXFP4", "W4A8MXFP", "SCHEMES", "W4A8", "W4A16", "W8A8", "W8A8C8", "QuantizedTensor", "Scheme", "get_scheme", "register", "scheme_from_options", "scheme_names",
           "static_parts"]
