"""Quantization, in two layers: `cvt.quant.tensor` (what a quantized weight is: schemes,
primitives, kernel formats, layouts, on-disk formats) sits below convert and the runtime; the
calibration methods (`methods/`: rtn, smoothquant, gptq, awq), recipes, the fused RTN kernels
(`qkernel`) and the `cvt quantize` stage (`stage/`, `cvt.quant.stage.quantize`) sit above the
runtime, whose models calibration drives."""
