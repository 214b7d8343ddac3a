"""Quantization methods: how the weights handed to a scheme are chosen.

=============  ====================================================================  ==========
method         what it does                                                          data
=============  ====================================================================  ==========
rtn            `scheme.quantize(w)` (round to nearest with the scheme's scales)       none
smoothquant    per-channel factors folded from the RMSNorm into its consumers, then   act max
               RTN (W8A8: flatter per-token activations)
gptq           column-wise quantization with inverse-Hessian error feedback           H = X^T X
awq            activation-aware scales folded into the producer, clipping search,     mean|x|,
               then RTN (W4A16 / FP4)                                                 samples
flatquant      w4a4_flatquant's online Kronecker transforms and activation clip       samples
               fitted per input site (Adam on the output MSE), then RTN behind them
=============  ====================================================================  ==========

`calibrate` (calib.py) drives the data-driven ones layer by layer through a runtime model;
`gptq_quantize`, `awq_search` / `awq_clip`, `smooth_scales` and `flatquant.fit` are the per-linear
(per-site) algorithms.
"""

from cvt.quant.methods.awq import AwqScale, awq_clip, awq_search
from cvt.quant.methods.calib import DATA_METHODS, METHODS, CalibResult, Fallback, calib_tokens, calibrate
from cvt.quant.methods.plan_run import MethodsResult, run_methods
from cvt.quant.methods.gptq import GPTQResult, HessianAccumulator, gptq_quantize
from cvt.quant.methods.rtn import rtn_quantize
from cvt.quant.methods.smoothquant import scale_columns, scale_rows, smooth_scales

__all__ = ["METHODS", "DATA_METHODS", "CalibResult", "Fallback", "MethodsResult", "calib_tokens", "calibrate",
           "run_methods", "gptq_quantize",
           "GPTQResult", "HessianAccumulator", "awq_search", "awq_clip", "AwqScale", "smooth_scales",
           "scale_columns", "scale_rows", "rtn_quantize"]
