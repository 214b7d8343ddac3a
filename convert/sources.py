"""Source precisions as data: what cvt reads in a released checkpoint, how it recognises it from
the checkpoint's own config.json (``quantization_config``; a ModelOpt export's
hf_quant_config.json is read as one, `cvt.convert.config.fold_hf_quant_config`), which tensors make up one of its
linears, and its exact dequantization. `source_format` takes the first entry whose rule matches;
`cvt inspect` shows the entry, and the help and docs list `readable()` from here.

The FP8 block, plain float and DeepSeek-V4 FP4 entries are read by their own stage code
(`cvt.convert.fp8`, `cvt.convert.fp4`); the compressed-tensors and ModelOpt ones by
`cvt.convert.ct_source` (one linear at a time, the same code for both producers);
gpt-oss's MXFP4 by `cvt.convert.mxfp4_source` (fp8-to-bf16, quantize and the runtime).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Mapping

from cvt.errors import FormatError
from cvt.registry import Registry


class SourceFormat(str, Enum):
    FP8_BLOCK = "fp8-block"
    BF16 = "bf16"  # or any plain float checkpoint
    CT_INT4 = "compressed-tensors-int4"  # Kimi-K2-Thinking / K2.5 pack-quantized
    CT_MXFP4 = "compressed-tensors-mxfp4"
    CT_NVFP4 = "compressed-tensors-nvfp4"
    CT_FP8 = "compressed-tensors-fp8"
    CT_INT8 = "compressed-tensors-int8"
    CT_OTHER = "compressed-tensors"
    GPT_OSS_MXFP4 = "gpt-oss-mxfp4"  # openai/gpt-oss-20b / -120b experts
    MODELOPT_NVFP4 = "modelopt-nvfp4"  # NVIDIA's ModelOpt exports (nvidia/*-FP4 releases)
    MODELOPT_FP8 = "modelopt-fp8"
    MODELOPT_MXFP8 = "modelopt-mxfp8"
    MODELOPT_FP8_PB_WO = "modelopt-fp8-pb-wo"
    MODELOPT_MIXED = "modelopt-mixed"
    CVT = "cvt-artifact"
    OTHER_QUANT = "other-quantized"


# both stages that turn a quantized release into float weights
DEQUANT_VERBS = ("fp8-to-bf16", "quantize")


@dataclass(frozen=True)
class SourcePrecision:
    """One precision a release may be stored in."""

    name: str                  # the `SourceFormat` value (what manifests record), or a part's own name
    summary: str               # one line: what it is and who writes it
    recognised: str            # how config.json says so (the docs' words for `matches`)
    matches: Callable[[Mapping[str, Any] | None], bool] | None  # on quantization_config; None: not a whole checkpoint
    parts: tuple[str, ...]     # per linear X: the tensors X.<part> that make up its weight
    dequant: str               # the exact math to float32 / BF16
    word: str                  # what a summary calls its stored weights ("dequantized 3 MXFP4 tensors")
    verbs: tuple[str, ...] = DEQUANT_VERBS  # the stages that read it


SOURCES: Registry[SourcePrecision] = Registry("source precision", FormatError, summarized=True)


def _add(p: SourcePrecision) -> None:
    SOURCES.add(p.name, p)


def _ct(fmt: str) -> Callable[[Mapping[str, Any] | None], bool]:
    """compressed-tensors' top-level ``format`` (one format for every config group; mixed
    precision is another format and not read)."""
    return lambda qc: bool(qc) and qc.get("quant_method") == "compressed-tensors" and qc.get("format") == fmt


_add(SourcePrecision(
    SourceFormat.BF16.value, "plain float weights (BF16, F16, F32): copied, or quantized as they are",
    "no quantization_config", lambda qc: not qc, ("weight",), "none (the stored value)", "float", ("quantize",)))
_add(SourcePrecision(
    SourceFormat.FP8_BLOCK.value, "FP8 e4m3 weights with block scales (DeepSeek-V3/V3.2/V4, Kimi-K2, GLM-5 releases)",
    'quant_method "fp8" with weight_block_size [bn, bk]', lambda qc: bool(qc) and qc.get("quant_method") == "fp8",
    ("weight", "weight_scale_inv"), "rne_bf16(float32(w) * float32(s[i // bn, j // bk]))", "FP8"))
_add(SourcePrecision(
    "deepseek-v4-fp4-experts", "DeepSeek-V4's FP4 routed experts (E2M1 pairs in int8, E8M0 scale per 32)",
    'within an FP8 block release whose config.json has expert_dtype "fp4"', None, ("weight", "scale"),
    "rne_bf16(e2m1(code) * float32(s[i, j // 32]))", "FP4"))
_add(SourcePrecision(
    SourceFormat.CT_INT4.value, "compressed-tensors pack-quantized INT4 (Kimi-K2-Thinking / K2.5, llm-compressor W4A16)",
    'quant_method "compressed-tensors", format "pack-quantized"', _ct("pack-quantized"),
    ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point"),
    "float32(int4 - zero_point) * float32(s[i, j // G]), to BF16 once", "INT4", ("quantize",)))
_add(SourcePrecision(
    SourceFormat.CT_MXFP4.value, "compressed-tensors mxfp4-pack-quantized (E2M1 pairs, E8M0 scale per 32)",
    'quant_method "compressed-tensors", format "mxfp4-pack-quantized"', _ct("mxfp4-pack-quantized"),
    ("weight_packed", "weight_scale"), "rne_bf16(e2m1(code) * 2**(s[i, j // 32] - 127))", "MXFP4"))
_add(SourcePrecision(
    SourceFormat.CT_NVFP4.value, "compressed-tensors nvfp4-pack-quantized (E2M1 pairs, E4M3 scale per 16, global scale)",
    'quant_method "compressed-tensors", format "nvfp4-pack-quantized"', _ct("nvfp4-pack-quantized"),
    ("weight_packed", "weight_scale", "weight_global_scale"),
    "rne_bf16(e2m1(code) * (float32(s[i, j // 16]) / global_scale))", "NVFP4"))
_add(SourcePrecision(
    SourceFormat.CT_FP8.value, "compressed-tensors float-quantized FP8 e4m3, per-tensor / per-channel / group scales "
    "(llm-compressor's FP8 and FP8_DYNAMIC)", 'quant_method "compressed-tensors", format "float-quantized"',
    _ct("float-quantized"), ("weight", "weight_scale"), "rne_bf16(float32(w) * float32(s))", "FP8"))
_add(SourcePrecision(
    SourceFormat.CT_INT8.value, "compressed-tensors int-quantized INT8, per-tensor / per-channel / group scales "
    "(llm-compressor's W8A8)", 'quant_method "compressed-tensors", format "int-quantized"', _ct("int-quantized"),
    ("weight", "weight_scale", "weight_zero_point"), "rne_bf16(float32(w - zero_point) * float32(s))", "INT8"))

_add(SourcePrecision(
    SourceFormat.GPT_OSS_MXFP4.value, "gpt-oss's MXFP4 routed experts (X_blocks: E2M1 pairs, X_scales: E8M0 per 32; "
    "openai/gpt-oss releases)", 'quant_method "mxfp4"', lambda qc: bool(qc) and qc.get("quant_method") == "mxfp4",
    ("_blocks", "_scales"), "rne_bf16(e2m1(code) * 2**(s[e, n, k // 32] - 127)), as transformers' "
    "convert_moe_packed_tensors, transposed to [E, K, N]", "MXFP4"))


def modelopt_algo(qc: Mapping[str, Any] | None) -> str | None:
    """A ModelOpt config's ``quant_algo``, upper-cased (None: not ModelOpt's): flat, as ModelOpt
    writes config.json's quantization_config, or under ``quantization``, as in hf_quant_config.json
    (vLLM's `ModelOptQuantConfigBase._extract_modelopt_quant_algo` reads both the same way)."""
    if not qc or not str(qc.get("quant_method", "")).lower().startswith("modelopt"):
        return None
    inner = qc.get("quantization")
    algo = (inner if isinstance(inner, Mapping) else qc).get("quant_algo")
    return str(algo).upper() if algo else None


def _modelopt(*algos: str) -> Callable[[Mapping[str, Any] | None], bool]:
    return lambda qc: modelopt_algo(qc) in algos


# ModelOpt's exports (TensorRT-Model-Optimizer modelopt/torch/export/unified_export_hf.py, quant_utils.py),
# as vLLM loads them (vllm/model_executor/layers/quantization/modelopt.py: ModelOptNvFp4LinearMethod,
# ModelOptFp8LinearMethod, ModelOptFp8PcPtLinearMethod, ModelOptMxFp8LinearMethod,
# ModelOptFp8PbWoLinearMethod, ModelOptMixedPrecisionConfig; read at vLLM commit 00155cdecca7)
_MODELOPT = 'quant_method "modelopt" (config.json) or producer "modelopt" (hf_quant_config.json), quant_algo'
_add(SourcePrecision(
    SourceFormat.MODELOPT_NVFP4.value, "NVIDIA ModelOpt NVFP4 (E2M1 pairs, E4M3 scale per 16, weight_scale_2 global; "
    "nvidia/*-FP4 releases)", f'{_MODELOPT} "NVFP4"', _modelopt("NVFP4"),
    ("weight", "weight_scale", "weight_scale_2"), "rne_bf16(e2m1(code) * (float32(s[i, j // 16]) * weight_scale_2))", "NVFP4"))
_add(SourcePrecision(
    SourceFormat.MODELOPT_FP8.value, "NVIDIA ModelOpt FP8 e4m3, per-tensor or per-channel scale",
    f'{_MODELOPT} "FP8" or "FP8_PER_CHANNEL_PER_TOKEN"', _modelopt("FP8", "FP8_PER_CHANNEL_PER_TOKEN"),
    ("weight", "weight_scale"), "rne_bf16(float32(w) * float32(s))", "FP8"))
_add(SourcePrecision(
    SourceFormat.MODELOPT_MXFP8.value, "NVIDIA ModelOpt MXFP8 (E4M3, E8M0 scale per 32; vllm-ascend main serves it)",
    f'{_MODELOPT} "MXFP8"', _modelopt("MXFP8"),
    ("weight", "weight_scale"), "rne_bf16(float32(w) * 2**(s[i, j // 32] - 127))", "MXFP8"))

_add(SourcePrecision(
    SourceFormat.MODELOPT_FP8_PB_WO.value, "NVIDIA ModelOpt FP8_PB_WO: FP8 e4m3 weight-only, a float32 scale per "
    "128x128 block (nvidia/Kimi-K3-NVFP4's attention projections)", f'{_MODELOPT} "FP8_PB_WO"', _modelopt("FP8_PB_WO"),
    ("weight", "weight_scale"), "rne_bf16(float32(w) * s[i // 128, 0, j // 128, 0])", "FP8"))
_add(SourcePrecision(
    SourceFormat.MODELOPT_MIXED.value, "NVIDIA ModelOpt MIXED_PRECISION: each layer its own quant_algo (FP8, NVFP4 "
    "or W4A16_NVFP4) in quantized_layers, a layer not listed float", f'{_MODELOPT} "MIXED_PRECISION"',
    _modelopt("MIXED_PRECISION"), ("weight", "weight_scale", "weight_scale_2"),
    "per layer, its quantized_layers entry's: modelopt-fp8's or modelopt-nvfp4's", "FP8 / NVFP4"))

# the per-linear entries cvt.convert.ct_source reads (fp8-to-bf16 and quantize, on the fly)
CT_STREAMED = (SourceFormat.CT_MXFP4, SourceFormat.CT_NVFP4, SourceFormat.CT_FP8, SourceFormat.CT_INT8,
               SourceFormat.MODELOPT_NVFP4, SourceFormat.MODELOPT_FP8, SourceFormat.MODELOPT_MXFP8,
               SourceFormat.MODELOPT_FP8_PB_WO, SourceFormat.MODELOPT_MIXED)


def precision_of(qc: Mapping[str, Any] | None) -> SourceFormat:
    """The format of a checkpoint with this quantization_config: the first entry that matches; a
    compressed-tensors format no entry reads is `CT_OTHER`, any other quantization `OTHER_QUANT`."""
    for p in SOURCES.values():
        if p.matches is not None and p.matches(qc):
            return SourceFormat(p.name)
    if qc and qc.get("quant_method") == "compressed-tensors":
        return SourceFormat.CT_OTHER
    return SourceFormat.OTHER_QUANT


def summary_of(fmt: SourceFormat) -> str | None:
    """The entry's one line for a format (None: cvt's own output, or one it does not read)."""
    return SOURCES.get(fmt.value).summary if fmt.value in SOURCES else None


def word_of(fmt: SourceFormat) -> str:
    """What a summary calls the format's stored weights (FP8, MXFP4, NVFP4, INT8, ...)."""
    return SOURCES.get(fmt.value).word


def readable(verb: str) -> list[str]:
    """Names of the precisions `verb` reads, in registry order (the help and docs list them)."""
    return [p.name for p in SOURCES.values() if verb in p.verbs]
