"""compressed-tensors (FORMATS.md 2.3): ``model-*.safetensors`` + config.json "quantization_config".

==============  =====================  ===================================================================
scheme          c-t format             tensors of linear X (w [n, k], group G)
==============  =====================  ===================================================================
w8a8, w8a8c8    int-quantized          X.weight int8 [n,k]; X.weight_scale f32 [n,1]
w4a16           pack-quantized         X.weight_packed int32 [n, ceil(k/8)] (value + 8, element i of 8
                                       at bits 4i); X.weight_scale bf16 [n,k/G] ([n,1] per channel);
                                       X.weight_shape int32 [2] = [n, k]; asymmetric adds
                                       X.weight_zero_point int32 [ceil(n/8), k/G] (packed along dim 0)
fp4 nvfp4       nvfp4-pack-quantized   X.weight_packed uint8 [n,k/2] (element 2j low nibble);
                                       X.weight_scale float8_e4m3fn [n,k/16]; X.weight_global_scale f32 [1]
fp4 mxfp4       mxfp4-pack-quantized   X.weight_packed uint8 [n,k/2]; X.weight_scale uint8 E8M0 [n,k/32]
==============  =====================  ===================================================================

The tensors are the layouts' (`cvt.qtensor.layouts`: ct-int8, ct-int4, ct-nvfp4, ct-mxfp4); this
module adds config.json's ``quantization_config``.

The compressed-tensors package's own decompressors reproduce cvt's dequantized weights
(tests/qtensor/test_formats.py). Static W8A8 activations are Ascend-only in cvt and refused here.
`read` infers the scheme from the tensors; ``meta`` (the quantization_config dict) is
optional and supplies the int8 KV-cache flag (w8a8 -> w8a8c8).
"""

from __future__ import annotations

import re

from cvt.qtensor import kernel_formats as KF
from cvt.lazy import torch

from cvt.errors import FormatError
from cvt.qtensor import layouts as L
from cvt.qtensor.formats.base import lm_section, register, scheme_name
from cvt.qtensor.schemes import FP4, W4A16, W8A8, W8A8C8
from cvt.qtensor.schemes.base import QuantizedTensor

_F = L.COMPRESSED_TENSORS
SUPPORTED = (W8A8.name, W8A8C8.name, W4A16.name, FP4.name)
_FP4_FORMAT = {KF.NVFP4: "nvfp4-pack-quantized", KF.MXFP4: "mxfp4-pack-quantized"}


def kv_cache_fp8() -> dict:
    """The ``kv_cache_scheme`` cvt writes for w8a8c8: vLLM's FP8 (e4m3) KV cache, per-tensor
    static scales ``self_attn.k_scale`` / ``v_scale`` [1]. vLLM accepts only ``type: float`` KV
    schemes (``compressed_tensors.py`` get_cache_scale / ``CompressedTensorsKVCacheMethod``:
    "int" fails at load for GQA models and is ignored for MLA)."""
    return {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "tensor",
            "dynamic": False}


def kv_cache_int8(strategy: str = "tensor") -> dict:
    """A ``kv_cache_scheme`` for an int8 KV cache (scales ``self_attn.k_scale`` / ``v_scale``)."""
    if strategy not in ("tensor", "attn_head"):
        raise FormatError(f"kv cache strategy {strategy!r}: expected 'tensor' or 'attn_head'")
    return {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": strategy,
            "dynamic": False}


def scheme_config(scheme) -> tuple[str, dict, dict | None]:
    """(c-t format, weights args, input_activations args) of a scheme instance, as c-t serializes them."""
    name = scheme_name(scheme)
    if name in (W8A8.name, W8A8C8.name):
        return ("int-quantized",
                {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": "channel",
                 "dynamic": False},
                {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": "token",
                 "dynamic": True})
    if name == W4A16.name:
        g = scheme.group_size
        return ("pack-quantized",
                {"num_bits": 4, "type": "int", "symmetric": bool(scheme.symmetric), "group_size": g or None,
                 "strategy": "group" if g else "channel", "dynamic": False}, None)
    if name == FP4.name:
        nv = scheme.fp4_format == KF.NVFP4
        return (_FP4_FORMAT[scheme.fp4_format],
                {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16 if nv else 32,
                 "strategy": "tensor_group" if nv else "group", "dynamic": False,
                 "scale_dtype": "torch.float8_e4m3fn" if nv else "torch.uint8"}, None)
    raise FormatError(f"compressed-tensors: no configuration for scheme {name!r} (supported: {', '.join(SUPPORTED)})")


def fused_experts_ignore(module: str) -> str:
    """The ignore entry that keeps float the routed experts of MoE `module` stored fused over
    [E, ...] (gpt-oss's ``mlp.experts.gate_up_proj`` / ``down_proj``). vLLM's FusedMoE takes the
    experts' scheme from the names of their unfused linears, ``<module>.0.gate_proj`` / ``up_proj``
    / ``down_proj`` (compressed_tensors_moe.py, ``CompressedTensorsMoEMethod.get_moe_method``:
    ignored there -> ``UnquantizedFusedMoEMethod``), after ``apply_vllm_mapper`` renamed the ignore
    list with the model's ``hf_to_vllm_mapper`` (gpt_oss.py maps the *suffix* ``.down_proj`` to
    ``.w2_weight``, so an exact name would be renamed away): a regex, which no suffix rule touches,
    matching every expert's three linears."""
    return "re:" + re.escape(module) + r"\.\d+\.(gate_proj|up_proj|down_proj)$"


def match_name(name: str, target: str) -> bool:
    """compressed-tensors' rule: ``re:<regex>`` is `re.match`ed, anything else is compared exactly."""
    return re.match(target[3:], name) is not None if target.startswith("re:") else name == target


@register
class CompressedTensors:
    name = L.COMPRESSED_TENSORS
    summary = "what vLLM and transformers load (quantization_config in config.json)"
    weights_prefix = "model"
    kv_codec = "fp8"           # a quantized KV cache is FP8 (e4m3, per tensor): the only kind vLLM loads
    static_attention = False
    default_groups = {W4A16.name: 128}  # llm-compressor's and vLLM's usual group
    per_channel_fallback = True  # each config group has its own strategy (`group_fallback`)
    # vLLM's DeepseekV4ForCausalLM (vllm/models/deepseek_v4/nvidia/model.py) is built for the
    # release's FP8 layout: its load_weights fuses attn.wq_a + attn.wkv, the compressors' wkv + wgate
    # and the shared experts' w1 + w3, with no packed_modules_mapping, and the compressed-tensors MoE
    # lookup (compressed_tensors_moe.py, get_compressed_tensors_moe_method) takes the experts'
    # scheme from a Linear target or gate_proj / up_proj / down_proj targets, names V4's w1 / w2 /
    # w3 experts lack: no compressed-tensors output of V4 is known to load there
    refused_models = {
        "deepseek_v4": "no compressed-tensors output of V4 is known to load in vLLM's DeepseekV4ForCausalLM (its MoE "
                       "scheme lookup matches experts by a Linear target or gate_proj / up_proj / down_proj names, not "
                       "V4's w1 / w2 / w3, and it fuses wq_a + wkv with no packed_modules_mapping); serve the release "
                       "(or its fp8-to-bf16 output) with vLLM, or quantize with --format ascend for vllm-ascend",
    }

    def supports(self, scheme, target: str | None = None) -> None:
        L.check_target(self.name, target)
        name = scheme_name(scheme)
        if name not in SUPPORTED:
            raise FormatError(f"compressed-tensors: scheme {name!r} is not supported (supported: "
                              f"{', '.join(SUPPORTED)})")
        if getattr(scheme, "static_activations", False):
            raise FormatError(f"compressed-tensors: scheme {name!r} with static activations is Ascend-only in cvt "
                              "(write it as ascend, or use dynamic per-token W8A8)")

    def check_shape(self, module: str, scheme, shape, *, target: str | None = None, expert: bool = False) -> None:
        self.supports(scheme)
        if not isinstance(scheme, str):
            scheme.check(f"{module}.weight", tuple(shape))

    # ---- write -----------------------------------------------------------------------------------

    def layout_for(self, module: str, q: QuantizedTensor, *, target: str | None = None,
                   expert: bool = False) -> L.Layout:
        """The layout `disk_tensors` writes `q` in."""
        self.supports(q.scheme, target)
        if q.kernel_fmt == KF.W8A8_STATIC:
            raise FormatError(f"compressed-tensors: no layout for static W8A8 ({module!r}); it is Ascend-only in cvt")
        return L.select(self.name, q.kernel_fmt, L.CT_TARGET, expert=expert, group_size=q.group_size, k=q.shape[1],
                        module=module)

    def disk_tensors(self, module: str, q: QuantizedTensor, bias: torch.Tensor | None = None, *,
                     target: str | None = None, expert: bool = False) -> dict[str, torch.Tensor]:
        lo = self.layout_for(module, q, target=target, expert=expert)
        try:
            out = {f"{module}.{s}": t for s, t in lo.encode(q).items()}
        except FormatError as exc:
            raise FormatError(f"compressed-tensors: {module}: {exc}") from None
        if bias is not None:
            out[f"{module}.bias"] = bias
        return {k_: v.contiguous() for k_, v in out.items()}

    def quantization_config(self, schemes_used, ignore_list=(), kv_cache_scheme: dict | None = None) -> dict:
        """config.json's ``quantization_config``.

        `schemes_used`: scheme instances, or ``(scheme, targets)`` pairs. One scheme alone
        targets ``["Linear"]``; several need their own targets (exact module names or
        ``re:`` regexes) and make the top-level format ``mixed-precision``. `ignore_list`:
        modules kept float (exact names / ``re:`` regexes, c-t's `match_name` rule; the
        model-free dequantizer matches by name only, so list embeddings and heads too).
        `kv_cache_scheme`: `kv_cache_fp8()` (what cvt writes: vLLM loads only FP8 caches) or
        `kv_cache_int8()` (readable by cvt); required when a scheme has a quantized KV cache.
        """
        pairs = [(s, None) if not isinstance(s, tuple) else (s[0], s[1]) for s in schemes_used]
        if not pairs:
            raise FormatError("compressed-tensors: quantization_config needs at least one scheme")
        groups: list[tuple[str, dict, dict | None, list[str] | None]] = []
        for scheme, targets in pairs:
            self.supports(scheme)
            fmt, w, a = scheme_config(scheme)
            same = next((g for g in groups if (g[0], g[1], g[2]) == (fmt, w, a)), None)
            if same is None:
                groups.append((fmt, w, a, None if targets is None else list(targets)))
            elif targets is not None and same[3] is not None:
                same[3].extend(t for t in targets if t not in same[3])
        if len(groups) > 1 and any(g[3] is None for g in groups):
            raise FormatError("compressed-tensors: several schemes are used, so each needs explicit targets "
                              f"(module names or 're:' regexes); got formats {[g[0] for g in groups]}")
        if any(getattr(s, "kv_cache", None) == "int8" for s, _ in pairs) and kv_cache_scheme is None:
            raise FormatError("compressed-tensors: a scheme with a quantized KV cache needs kv_cache_scheme "
                              "(kv_cache_fp8(): vLLM loads only FP8 KV caches)")
        ignore: list[str] = []
        for i in ignore_list:
            if not isinstance(i, str) or not i:
                raise FormatError(f"compressed-tensors: ignore entries must be module names or 're:' regexes, "
                                  f"got {i!r}")
            if i.startswith("re:"):
                try:
                    re.compile(i[3:])
                except re.error as e:
                    raise FormatError(f"compressed-tensors: ignore regex {i!r} does not compile: {e}") from None
            if i not in ignore:
                ignore.append(i)
        config_groups = {
            f"group_{j}": {"targets": targets or ["Linear"], "weights": w, "input_activations": a,
                           "output_activations": None, "format": fmt}
            for j, (fmt, w, a, targets) in enumerate(groups)}
        formats = {g[0] for g in groups}
        return {"quant_method": self.name,  # the c-t library's own name for its format
                "format": formats.pop() if len(formats) == 1 else "mixed-precision",
                "quantization_status": "compressed", "config_groups": config_groups, "ignore": ignore,
                "kv_cache_scheme": kv_cache_scheme}

    def stored_metadata(self, root, quantization_config, load_json):
        """(read meta, None) of a checkpoint in this format (config.json's quantization_config), else None."""
        qc = quantization_config
        return (dict(qc), None) if qc and qc.get("quant_method") == self.name else None

    def kv_manifest(self, kv_tensors) -> dict:
        return {"convention": {"name": "vllm-fp8-kv", "dtype": "float8_e4m3fn", "granularity": "tensor",
                               "scale": "amax / 448 (MLA: one scale for [latent | rope key])",
                               "quantize": "e4m3(clamp(x / scale, -448, 448))", "dequantize": "x = q * scale"},
                "tensors": sorted(kv_tensors)}

    def write_metadata(self, config: dict, tags: dict[str, str], schemes: dict, *, float_linears: list[str],
                       kv_cache: bool, mla: bool, target: str, float_experts: list[str] = ()) -> list[tuple[str, bytes]]:
        """config.json's quantization_config (one scheme: targets Linear; several: each its
        modules); no extra files. `schemes`: module -> scheme; `float_experts`: MoE modules whose
        routed experts are float tensors fused over [E, ...] (`fused_experts_ignore`)."""
        used = list({id(s): s for s in schemes.values()}.values())
        if len(used) > 1:
            used = [(s, [m for m, x in schemes.items() if x is s]) for s in used]
        lm_section(config)["quantization_config"] = self.quantization_config(
            used, ignore_list=[*float_linears, *map(fused_experts_ignore, float_experts)],
            kv_cache_scheme=kv_cache_fp8() if kv_cache else None)
        return []

    # ---- read ------------------------------------------------------------------------------------

    def read(self, module: str, disk: dict[str, torch.Tensor], meta: dict | None = None) -> QuantizedTensor:
        x = module + "."
        if meta is not None and any(match_name(module, i) for i in meta.get("ignore") or ()):
            raise FormatError(f"compressed-tensors: {module!r} is in the ignore list: it is a float module")
        kv = (meta or {}).get("kv_cache_scheme") or {}
        by_suffix = {n[len(x):]: t for n, t in disk.items() if n.startswith(x)}
        packed = by_suffix.get("weight_packed")
        name = ("ct-int4" if packed is not None and packed.dtype == torch.int32 else
                ("ct-nvfp4" if "weight_global_scale" in by_suffix else "ct-mxfp4") if packed is not None else "ct-int8")
        try:
            q = L.LAYOUTS.get(name).decode(module, by_suffix)
        except FormatError as exc:
            raise FormatError(f"compressed-tensors: {exc}") from None
        if q.scheme == W8A8.name and kv.get("type") in ("int", "float") and kv.get("num_bits") == 8:
            q.scheme = W8A8C8.name
        return q
