"""Quantization above the runtime: the calibration methods (`methods/`: rtn, smoothquant, gptq,
awq), recipes, the fused RTN kernels (`qkernel`) and the `cvt quantize` stage (`stage/`,
`cvt.quant.stage.quantize`), which drive the runtime's models. What a quantized weight is
(schemes, primitives, kernel formats, layouts, on-disk formats) is `cvt.qtensor`, below convert."""
