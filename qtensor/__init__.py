"""The quantized-tensor data: what a quantized weight is, independent of how it was computed.

primitives    scales, rounding, int4 / fp4 packing and unpacking (bit layouts documented there)
kernel_formats  the kernel formats' names (w8a8_dynamic, w4a16, nvfp4, ...), defined once
schemes/      one file per scheme (`param_info`, `quantize`, `dequantize`), registered by name
layouts/      the kernel layout table: each serving kernel's on-disk tensors, one owner each
disk_specs    a module's on-disk {name: (shape, dtype)} planned before anything is quantized
kv_tensors    the quantized KV cache's tensors per architecture and target
formats/      ascend and compressed-tensors: parts -> on-disk names, configs and descriptions

The lowest layer above the ground modules and `cvt.schemas`: it imports nothing of convert,
runtime, calibration, export or the CLI (the import-linter contract in pyproject.toml).
"""
