"""Quantization: schemes (one file each, one protocol), primitives (scales, packing),
calibration methods (rtn, smoothquant, gptq, awq) and on-disk formats (ascend,
compressed-tensors). The `cvt quantize` stage is `cvt.quant.stage.quantize`."""
