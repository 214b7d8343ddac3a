"""The `cvt quantize` stage: a BF16, FP8 or compressed-tensors INT4 checkpoint -> quantized
weights in the Ascend (msModelSlim AscendV1) or compressed-tensors format.

Streaming like every stage: tensors are read one at a time (FP8 weights dequantized on the
fly, so no BF16 copy is ever written; a DeepSeek-V4 release's FP4 experts carried over or
requantized, `cvt.quant.stage.fp4_source`), each quantized linear is quantized once when its first
part is written, and the writer shards, hashes, resumes and writes the manifest. RTN goes
straight from the stored weight (BF16, or FP8 with its block scale, over the mmap) to the
on-disk tensors and the SQNR in one pass (`cvt.quant.qkernel`: the C kernel, or its blockwise
torch fallback), bit-identical to the unfused path ``layout.encode(scheme.quantize(float32
weight))``, which still serves calibrated, static-activation and packed-INT4-source modules,
layouts the kernels do not cover, and ``CVT_QUANT_KERNEL=reference``. Checked
before anything is written: names (architecture table), schemes against the format, group
sizes against every tensor, FP8 scales (present, shaped, finite). A NaN/Inf weight is refused
when its module is quantized (one pass over the weights, not two), and so is a float tensor
written with one (a float-kept FP8 weight's NaN codes, counted by the kernel as it dequantizes; a
copied norm's NaN: `cvt.convert.finite`); like any failure, it leaves no index, config or manifest behind. Which
linears are quantized, and how, is `cvt.quant.recipe.Policy`. Calibrated methods (gptq, awq,
smoothquant, flatquant) first run the runtime model layer by layer on calibration text
(`cvt.quant.methods`); their results replace RTN for the modules they cover, and every
fallback to RTN is recorded in the manifest. What the architecture table adds to an Ascend output
(`ArchTable.ascend_copies`: DeepSeek-V4's MTP draft copies of embed / head, which vllm-ascend's
draft reads) is written beside SRC's tensors; a format's consumers that load no model of the
family refuse it up front (`Format.refused_models`: compressed-tensors for DeepSeek-V4).

The modules, in the order a run goes through them: `run` (the `quantize` entry: request, SRC and
plan checks), `assignment` (scheme and method per module), `calibrate` (calibrated methods, static and
KV-cache scales), `outputs` (the output tensors and their tags), `quantizer` (each module
quantized when the writer asks), `write` (format metadata, manifest, the writer).
"""

from cvt.quant.stage.run import quantize

__all__ = ["quantize"]
