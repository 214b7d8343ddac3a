"""The int8 KV cache's on-disk layout: which tensors, names, shapes and dtypes (one owner).

The math, runtime behaviour and calibration are `cvt.runtime.kv_cache`'s (its docstring
describes the convention in full); cvt.qtensor owns the layout, so that the quantize stage, the
formats, `cvt plan` and the runtime read one definition:

* MLA (DeepSeek-V3 family): FAKQuant, ``self_attn.fa_{q,k,v}.{scale,offset}``; scales float32
  ``[num_attention_heads, 1]`` (q) and ``[1, 1]`` (k, v), offsets int8 zeros (vllm-ascend 0.23
  ``quantization/methods/kv_c8.py`` AscendFAQuantAttentionMethod; msModelSlim 26.1
  ``model/deepseek_v3/model_adapter.py`` + ``save/ascendv1.py`` _save_activation_per_head);
  Ascend tag ``FAQuant``, description ``fa_quant_type: FAKQuant``.
* GQA: C8, ``self_attn.{k,v}_proj.kv_cache_{scale,offset}`` float32 ``[kv_heads * head_dim]``
  (vllm-ascend ``modelslim_config.py`` get_cache_scale; msModelSlim on_dynamic_cache); tag
  ``C8``, description ``kv_cache_type: C8`` and ``kv_quant_type: C8``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

import torch

from cvt.qtensor.layouts import VLLM_ASCEND

QMIN, QMAX = -128, 127
SCALE_DIVISOR = 127.0
SCALE_MIN = 2.0 ** -14

KV_CONVENTION: dict[str, Any] = {
    "name": "cvt-kv-int8",
    "version": 2,
    "dtype": "int8",
    "symmetric": True,
    "dynamic": False,
    "scale_dtype": "float32",
    "qmin": QMIN,
    "qmax": QMAX,
    "scale": f"max(amax / {SCALE_DIVISOR:g}, 2**-14)",
    "quantize": "q = clamp(round_half_to_even(x / scale), -128, 127)",
    "dequantize": "x = (q - offset) * scale, offset = 0",
    "mla": {
        "name": "FAKQuant",
        "cached_int8": "latent kv_a_layernorm(kv_a_proj_with_mqa(x)[..., :kv_lora_rank]), one scale per layer",
        "cached_float": "k_pe (rope key), compute dtype",
        "tensors": {
            "q": "model.layers.{i}.self_attn.fa_q.{scale,offset} [num_attention_heads, 1] (absorbed query, "
                 "per head; written for the serving stacks, not applied by cvt's runtime)",
            "k": "model.layers.{i}.self_attn.fa_k.{scale,offset} [1, 1] (the cached latent)",
            "v": "model.layers.{i}.self_attn.fa_v.{scale,offset} [1, 1] (the latent read as value)",
        },
        "offset_dtype": "int8",
    },
    "gqa": {
        "name": "C8",
        "cached_int8": {"k": "rope(k_norm(k_proj(x))) per head", "v": "v_proj(x)"},
        "tensors": {
            "k": "model.layers.{i}.self_attn.k_proj.kv_cache_{scale,offset} [kv_heads*head_dim]",
            "v": "model.layers.{i}.self_attn.v_proj.kv_cache_{scale,offset} [kv_heads*head_dim]",
        },
        "channel": "head * head_dim + d",
        "offset_dtype": "float32",
    },
    "layers": "decoder layers 0 .. num_hidden_layers-1 (no MTP layers)",
}

NAME_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\."
                      r"(?:(k_proj|v_proj)\.kv_cache_(scale|offset)|(fa_q|fa_k|fa_v)\.(scale|offset))$")
CT_NAME_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_(scale|zero_point)$")


@dataclasses.dataclass(frozen=True)
class KVTensorSpec:
    """One stored KV-cache tensor: on-disk name, layer, role, scale or offset, shape, dtype."""

    name: str
    layer: int
    role: str          # "q" | "k" | "v" (MLA: fa_q / fa_k / fa_v; GQA: k_proj / v_proj)
    kind: str          # "scale" | "offset"
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32


def kv_tensor_specs(layers: int, mla: bool, heads: int, kv_channels: int) -> list[KVTensorSpec]:
    """Every KV-cache tensor for `layers` decoder layers, in layer order: per layer, per role
    (MLA q, k, v; GQA k, v), scale then offset. `kv_channels`: GQA kv_heads * head_dim."""
    out = []
    for i in range(layers):
        p = f"model.layers.{i}.self_attn."
        if mla:
            out += [KVTensorSpec(f"{p}fa_{r}.{kind}", i, r, kind, (heads if r == "q" else 1, 1),
                                 torch.float32 if kind == "scale" else torch.int8)
                    for r in ("q", "k", "v") for kind in ("scale", "offset")]
        else:
            out += [KVTensorSpec(f"{p}{r}_proj.kv_cache_{kind}", i, r, kind, (kv_channels,))
                    for r in ("k", "v") for kind in ("scale", "offset")]
    return out


def kv_target_problem(cfg: Mapping[str, Any], fmt: str, target: str) -> str | None:
    """Why `target` would load an int8 KV cache of this model wrong (None: it loads it); `cfg`
    the language model's config (a wrapper config.json's `text_config`)."""
    mt = cfg.get("model_type")
    if target == VLLM_ASCEND and mt == "qwen3_moe":  # vllm-ascend reads the ascend format only
        return ("w8a8c8 for qwen3_moe on vllm-ascend: vllm-ascend 0.23 loads C8 KV-cache scales only for Qwen3 "
                "dense, GLM4-MoE and MiniMax-M2 (patch/worker/patch_gqa_c8.py); for Qwen3-MoE it drops them and "
                "runs the int8 cache with scale 1 (wrong results, no error). Use --scheme w8a8, or --target mindie")
    return None


# ---- the cache's storage dtype (--kv-dtype) ---------------------------------------------------------
KV_DTYPES = ("int8", "fp8")
# Ascend 950 (A5) FAKQuant: the same tensors and tags; vllm-ascend stores the latent as float8_e4m3fn
# on A5 (attention/mla_v1.py: ``self.dtype = torch.float8_e4m3fn if A5 else torch.int8``), quantized
# by npu_kv_rmsnorm_rope_cache with ``c_kv_scale = 1 / fa_k.scale`` and read back times fa_k.scale
# (``fak_descale_float``; quantization/methods/kv_c8.py AscendFAQuantAttentionMethod); k_pe stays bf16.
FP8_FAKQUANT: dict[str, Any] = {
    "dtype": "float8_e4m3fn",
    "scale": "max(amax / 448, 2**-14)",
    "quantize": "q = e4m3(clamp(x / scale, -448, 448)) (round to nearest even, saturating)",
    "dequantize": "x = q * scale",
    "device": "Ascend 950 (A5) only: A2 / A3 cache int8 with the same scale, which clips at 127 / 448 of the range",
}


def kv_storage(fmt: str, fmt_codec: str, target: str | None, kv_dtype: str | None, mla: bool,
               has_cache: bool) -> str:
    """The codec a run calibrates its quantized KV cache for: `kv_dtype` (int8 | fp8) when given,
    else the format's own (`fmt_codec`). fp8 in the ascend format is FAKQuant (MLA) for vllm-ascend
    on Ascend 950; anything else a stack would not load is an OptionError saying why."""
    from cvt.errors import OptionError

    if kv_dtype is None:
        return fmt_codec
    if kv_dtype not in KV_DTYPES:
        raise OptionError(f"--kv-dtype {kv_dtype!r} is not supported (supported: {', '.join(KV_DTYPES)})")
    if not has_cache:
        raise OptionError("--kv-dtype applies to a scheme with a quantized KV cache (w8a8c8)")
    if kv_dtype == fmt_codec:
        return kv_dtype
    if fmt_codec == "fp8":  # compressed-tensors
        raise OptionError(f"--kv-dtype {kv_dtype}: the {fmt} format's KV cache is fp8 (kv_cache_scheme type float, "
                          "the only kind vLLM loads)")
    if not mla:
        raise OptionError("--kv-dtype fp8: vllm-ascend's GQA C8 cache is int8 (methods/kv_c8.py "
                          "AscendC8KVCacheAttentionMethod sets kv_cache_torch_dtype int8); fp8 is FAKQuant (MLA) "
                          "on Ascend 950")
    if target != VLLM_ASCEND:
        raise OptionError(f"--kv-dtype fp8: {target} caches FAKQuant in int8; the fp8 (e4m3) FAKQuant cache is "
                          f"vllm-ascend's on Ascend 950 (--target {VLLM_ASCEND})")
    return kv_dtype
