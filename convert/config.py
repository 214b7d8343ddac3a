"""config.json: what a checkpoint is (source format) and how a stage rewrites it."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping

from cvt.convert.sources import SourceFormat, precision_of  # noqa: F401  (SourceFormat: the stages import it here)
from cvt.errors import FormatError

# a ModelOpt export's side file, what older exports (nvidia/DeepSeek-R1-FP4) carry instead of
# config.json's quantization_config; vLLM reads it (`ModelOptQuantConfigBase.get_config_filenames`)
HF_QUANT_CONFIG = "hf_quant_config.json"


def fold_hf_quant_config(config: dict, side: Mapping[str, Any] | None, where: str = HF_QUANT_CONFIG) -> dict:
    """`config` with a ModelOpt hf_quant_config.json (`side`, None: there is none) as its
    quantization_config, in the form ModelOpt writes into config.json itself (TensorRT-Model-Optimizer
    modelopt/torch/export/convert_hf_config.py: quant_method "modelopt", the ``quantization``
    section's keys at the top level, the producer kept): every stage then reads one form, and every
    output rewrites it (a BF16 output drops it). A config.json with its own quantization_config
    keeps it; a side file of another producer is not read."""
    if side is None or quantization_config(config) is not None:
        return config
    producer = side.get("producer")
    if not (isinstance(producer, Mapping) and str(producer.get("name", "")).lower() == "modelopt"):
        return config
    inner = side.get("quantization")
    if not isinstance(inner, Mapping):
        raise FormatError(f"{where}: \"quantization\" is {_short(inner)}; expected an object "
                          '(e.g. {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]})')
    return {**config, "quantization_config": {"quant_method": "modelopt", **inner, "producer": dict(producer)}}


def quantization_config(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """`quantization_config` at the top level or under `text_config` (K2.5-style wrappers).
    One without ``quant_method`` is not a Hugging Face quantization config but MindIE's
    settings next to an Ascend description (``group_size``, ``kv_quant_type``,
    ``fa_quant_type``): None, like a plain checkpoint (the description says what it holds)."""
    qc = config.get("quantization_config")
    where = "quantization_config"
    if qc is None and isinstance(config.get("text_config"), Mapping):
        qc, where = config["text_config"].get("quantization_config"), "text_config.quantization_config"
    if qc is not None and not isinstance(qc, Mapping):
        raise FormatError(f"config.json: {where} is {type(qc).__name__} {_short(qc)}; expected an object "
                          '(e.g. {"quant_method": "fp8", "weight_block_size": [128, 128]})')
    if isinstance(qc, Mapping) and "quant_method" not in qc:
        return None
    return qc


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class Fp8Config:
    block: tuple[int, int]
    scale_fmt: str | None  # V3.1: "ue8m0" (the stored scales are still read as float)


def describe_quant(qc: Mapping[str, Any] | None) -> str:
    if not qc:
        return "no quantization_config (a plain float checkpoint)"
    method = qc.get("quant_method", "?")
    extra = qc.get("format") or qc.get("fmt")
    algo = qc.get("quant_algo")  # ModelOpt's
    layers = qc.get("quantized_layers")  # ModelOpt's MIXED_PRECISION: layer -> {"quant_algo": ...}
    mix = ""
    if isinstance(layers, Mapping) and layers:
        counts: dict[str, int] = {}
        for info in layers.values():
            a = str(info.get("quant_algo") if isinstance(info, Mapping) else None).upper()
            counts[a] = counts.get(a, 0) + 1
        mix = ", quantized_layers " + ", ".join(f"{n} {a}" for a, n in sorted(counts.items()))
    return f"quantization_config.quant_method {method!r}" + (
        f" (format {extra!r})" if extra else f" (quant_algo {algo!r}{mix})" if algo else "")


def source_format(config: Mapping[str, Any], has_manifest: bool = False) -> SourceFormat:
    """What a checkpoint holds: cvt's own output, else the source-precision registry's entry
    for its quantization_config (`cvt.convert.sources.precision_of`)."""
    if has_manifest:
        return SourceFormat.CVT
    return precision_of(quantization_config(config))


def fp8_config(config: Mapping[str, Any], where: str) -> Fp8Config:
    """The FP8 block parameters, or FormatError saying what the checkpoint is instead."""
    qc = quantization_config(config)
    if not qc or qc.get("quant_method") != "fp8":
        raise FormatError(f"{where} is not an FP8 block checkpoint: {describe_quant(qc)}")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise FormatError(f"{where}: FP8 format {fmt!r} is not supported (only e4m3)")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise FormatError(
            f"{where}: quantization_config.weight_block_size is {block!r}; cvt needs [rows, cols] "
            "(per-tensor FP8 without blocks is not supported)"
        )
    return Fp8Config(block=(block[0], block[1]), scale_fmt=qc.get("scale_fmt"))


def fp8_block(config: Mapping[str, Any], where: str) -> tuple[int, int] | None:
    """The FP8 block of an FP8 block checkpoint (checked by `fp8_config`), None for any other."""
    qc = quantization_config(config)
    if not qc or qc.get("quant_method") != "fp8":
        return None
    return fp8_config(config, where).block


def with_explicit_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of config.json with the architecture's reader-dependent keys written out
    (`ArchTable.explicit_defaults`, e.g. DeepSeek's topk_method / scoring_func): every reader
    then means what cvt's runtime means. Unknown model types are copied as they are."""
    from cvt.convert.arch import TABLES, text_config

    out = copy.deepcopy(dict(config))
    lm = text_config(out)
    table = TABLES[lm["model_type"]] if lm.get("model_type") in TABLES else None
    for key, value in (table.explicit_defaults if table else {}).items():
        if lm.get(key) is None:
            lm[key] = value
    return out


def bf16_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json for a BF16 output: no quantization_config anywhere, dtype bfloat16, the
    reader-dependent defaults explicit (`with_explicit_defaults`)."""
    out = with_explicit_defaults(config)
    targets = [out]
    if isinstance(out.get("text_config"), dict):
        targets.append(out["text_config"])
    for cfg in targets:
        cfg.pop("quantization_config", None)
        cfg.pop("expert_dtype", None)  # DeepSeek-V4: the routed experts' release dtype, BF16 now
    keys = [k for k in ("torch_dtype", "dtype") if k in out] or ["torch_dtype"]
    for k in keys:
        out[k] = "bfloat16"
    return out
