"""Ascend msModelSlim "AscendV1" (FORMATS.md 2.2): ``quant_model_weights-*.safetensors`` +
``quant_model_description.json`` (every tensor name -> type tag, plus global keys).

The tensors of each quantized linear are its layout's (`cvt.qtensor.layouts`: ascend-w8a8-dynamic,
ascend-w8a8-static, ascend-w4a16-int8-*, ascend-w4a16-int32, ascend-mxfp4, ascend-w4a8-dynamic[-row]), chosen per serving
target (``--target vllm-ascend|mindie``, default vllm-ascend) and module (some layouts are
loaded for MoE experts only). A float bias is tagged FLOAT; offsets are the documented form
``w = (q - offset) * scale``. `read` needs the tag (``meta``: the description dict, or a tag
string); the tag's layouts are told apart by the tensors present.

Description global keys (`description`), from msModelSlim 26.1 ``save/ascendv1.py``
(AscendV1Saver.post_run, update_quant_type, on_dynamic_cache, _save_activation_per_head) and
what the consumers read (vllm-ascend 0.23 ``modelslim_config.py``: ``kv_cache_type``,
``fa_quant_type``, ``group_size``, ``version``; MindIE reads its keys from config.json, see
`mindie_config`):

* ``model_quant_type``: msModelSlim's priority rule (`model_quant_type`): fewer bits win, and
  static W8A8 beats W8A8_DYNAMIC (a mixed static-attention model is "W8A8"); tags outside the
  list (W4A16, W4A16_MXFP4) count only when nothing in it is present;
* ``version`` "1.0.0"; ``group_size`` (0 when not grouped; the one group size of the grouped
  layouts, which the stacks read globally);
* GQA int8 KV cache: ``kv_cache_type`` and ``kv_quant_type`` "C8"; MLA (FAKQuant):
  ``fa_quant_type`` "FAKQuant".
"""

from __future__ import annotations

import json

from cvt.lazy import torch

from cvt.errors import FormatError, ShapeError
from cvt.qtensor import layouts as L
from cvt.qtensor.formats.base import lm_section, register, scheme_name
from cvt.qtensor.indexer_c8 import GLOBAL_KEY as INDEXER_KEY
from cvt.qtensor.schemes import FP4, W4A16, W8A8, W8A8C8
from cvt.qtensor.schemes.base import QuantizedTensor

FLOAT = "FLOAT"
VERSION = "1.0.0"
KV_TAGS = ("C8", "FAQuant")
# msModelSlim 26.1 save/ascendv1.py QUANT_TYPE_PRIORITY: a later entry wins
QUANT_TYPE_PRIORITY = ("FLOAT", "W16A16S", "W8A16", "W8A8_DYNAMIC", "W8A8_MIX", "W8A8", "WFP8AFP8_DYNAMIC",
                       "W8A8_MXFP8", "W4A8_MXFP", "W4A4_DYNAMIC", "W4A4_MXFP4", "W4A4_MXFP4_DUALSCALE",
                       "W4A4_MXFP4_SVD")
GLOBAL_KEYS = ("model_quant_type", "version", "group_size", "kv_cache_type", "kv_quant_type", "fa_quant_type")
# MindIE's config.json "quantize" value per model_quant_type (atb_llm utils/quantize/quant_type.py)
MINDIE_QUANTIZE = {"W8A8": "w8a8", "W8A8_DYNAMIC": "w8a8_dynamic", "W4A16": "w4a16", "W8A16": "w8a16",
                   "W8A8_MIX": "w8a8_mix"}


def model_quant_type(tags) -> str:
    """msModelSlim's rule over the linear weights' tags (FLOAT when none is quantized)."""
    present = {t for t in tags if t not in (FLOAT, *KV_TAGS)}
    ranked = [t for t in present if t in QUANT_TYPE_PRIORITY]
    if ranked:
        return max(ranked, key=QUANT_TYPE_PRIORITY.index)
    return sorted(present)[0] if present else FLOAT


@register
class Ascend:
    name = L.ASCEND
    summary = "msModelSlim AscendV1, what vllm-ascend and MindIE load (quant_model_description.json)"
    weights_prefix = "quant_model_weights"
    description_file = "quant_model_description.json"
    kv_codec = "int8"          # a quantized KV cache is int8 (C8 / FAKQuant), what the Ascend stacks load
    static_attention = True    # static W8A8 attention (input_scale / deq_scale / quant_bias) exists here
    default_groups = {W4A16.name: 64}  # the group MindIE and vllm-ascend both load
    # vllm-ascend main (182b75ea84) has no quantized gpt-oss path: modelslim_config.py maps no gpt_oss
    # (packed_modules_model_mapping, QUANT_MODEL_PREFIX_MAPPINGS), it runs vLLM's own GptOssForCausalLM,
    # whose load_weights (gpt_oss.py, _load_weights_other) copies fused float experts only, and its
    # tests serve gpt-oss in BF16 (tests/e2e/pull_request/two_card/test_gpt_oss_distributed.py)
    refused_models: dict[str, str] = {
        "gpt_oss": "vllm-ascend serves gpt-oss in BF16 only (its modelslim_config.py maps no gpt_oss, and vLLM's "
                   "GptOssForCausalLM loads the fused experts as float); serve the fp8-to-bf16 output, or quantize "
                   "with --format compressed-tensors for vLLM"}

    # ---- what this format can hold ----------------------------------------------------------------

    def supports(self, scheme, target: str | None = None) -> None:
        name = scheme_name(scheme)
        target = L.check_target(self.name, target)
        kernels = {lo.kernel_fmt for lo in L.LAYOUTS.values() if lo.format == self.name and target in lo.targets}
        wanted = L.kernel_formats(scheme)
        if not (wanted & kernels):
            raise FormatError(f"the ascend format for {target} has no layout for scheme {name!r}"
                              + (f" ({', '.join(sorted(wanted))})" if wanted else "")
                              + f"; {target} loads: {', '.join(sorted(kernels))}"
                              + (" (fp4 on Ascend is MXFP4 for MoE experts, --fp4-format mxfp4 --target vllm-ascend)"
                                 if name == FP4.name else ""))

    def layout(self, module: str, scheme, shape, *, target: str | None = None, expert: bool = False,
               static: bool = False) -> L.Layout:
        target = L.check_target(self.name, target)
        return L.select(self.name, L.kernel_fmt_of(scheme, static), target, expert=expert,
                        group_size=getattr(scheme, "group_size", 0), k=shape[1], module=module)

    def check_shape(self, module: str, scheme, shape, *, target: str | None = None, expert: bool = False) -> None:
        self.supports(scheme, target)
        if not isinstance(scheme, str):
            scheme.check(f"{module}.weight", tuple(shape))
            lo = self.layout(module, scheme, shape, target=target, expert=expert)
            g = 0 if scheme.group_size in (0, shape[1]) else scheme.group_size
            if expert and lo.expert_k and shape[1] % lo.expert_k:
                raise ShapeError(f"ascend {lo.name}: {module}.weight {list(shape)}: {target or L.DEFAULT_TARGET}'s MoE "
                                 f"method views each expert's scale row in pairs: in_features must be a multiple of "
                                 f"{lo.expert_k}, got {shape[1]}")
            for t in lo.tensors:
                for axis, size in (("n", shape[0]), ("k", shape[1])):
                    m = t.multiple(axis, g, shape[1])
                    if m is not None and m[0] > 1 and size % m[0]:
                        raise ShapeError(f"ascend {lo.name}: {module}.weight {list(shape)}: {t.suffix} {m[1]}, "
                                          f"which must be a multiple of {m[0]} (got {size})")

    # ---- write -----------------------------------------------------------------------------------

    def disk_tensors(self, module: str, q: QuantizedTensor, bias: torch.Tensor | None = None, *,
                     target: str | None = None, expert: bool = False) -> dict[str, torch.Tensor]:
        lo = self.layout_for(module, q, target=target, expert=expert)
        try:
            encoded = lo.encode(q)
        except FormatError as exc:  # an encoder's rule, worded without the tensor: name it
            raise type(exc)(f"ascend {lo.name}: {module}.weight {list(q.shape)}: {exc}") from None
        out = {f"{module}.{s}": t for s, t in encoded.items()}
        if bias is not None:
            out[f"{module}.bias"] = bias
        return {k: v.contiguous() for k, v in out.items()}

    def layout_for(self, module: str, q: QuantizedTensor, *, target: str | None = None,
                   expert: bool = False) -> L.Layout:
        """The layout `disk_tensors` writes `q` in for this target and module."""
        target = L.check_target(self.name, target)
        return L.select(self.name, q.kernel_fmt, target, expert=expert, group_size=q.group_size, k=q.shape[1],
                        module=module, parallel=q.extra.get("parallel"))

    def tags(self, module: str, q: QuantizedTensor, bias: bool = False, *, target: str | None = None,
             expert: bool = False) -> dict[str, str]:
        """``{disk name: tag}`` for the tensors `disk_tensors` writes for this linear (bias: FLOAT)."""
        lo = self.layout_for(module, q, target=target, expert=expert)
        out = lo.tags(module, lo.encode(q))
        if bias:
            out[f"{module}.bias"] = FLOAT
        return out

    def description(self, tags: dict[str, str], kv_cache: str | None = None, group_size: int = 0,
                    extra_keys: dict[str, str] | None = None) -> dict:
        """quant_model_description.json: `tags` (every tensor in the weights, FLOAT for float ones)
        plus the global keys (module docstring). `kv_cache`: None, "C8" (GQA) or "FAKQuant" (MLA).
        `extra_keys`: further keys that name no tensor (DeepSeek-V3.2's indexer C8:
        `cvt.qtensor.indexer_c8.description_keys`)."""
        clash = sorted((set(GLOBAL_KEYS) | set(extra_keys or ())) & set(tags))
        if clash:
            raise FormatError(f"ascend description: tensor names {clash} collide with the description's global keys")
        desc = dict(tags)
        desc.update({"model_quant_type": model_quant_type(t for n, t in tags.items()
                                                          if n.endswith((".weight", ".weight_packed"))),
                     "version": VERSION, "group_size": int(group_size)})
        if kv_cache == "C8":
            desc["kv_cache_type"] = desc["kv_quant_type"] = "C8"
        elif kv_cache == "FAKQuant":
            desc["fa_quant_type"] = "FAKQuant"
        elif kv_cache is not None:
            raise FormatError(f"ascend description: kv_cache {kv_cache!r} is not supported (C8, FAKQuant or None)")
        desc.update(extra_keys or {})
        return desc

    def stored_metadata(self, root, quantization_config, load_json):
        """(read meta, description) of a checkpoint in this format (its description file), else None."""
        path = root / self.description_file
        if not path.is_file():
            return None
        desc = load_json(path)
        return desc, desc

    def kv_manifest(self, kv_tensors) -> dict:
        from cvt.qtensor.kv_tensors import KV_CONVENTION

        return {"convention": KV_CONVENTION, "tensors": sorted(kv_tensors)}

    def write_metadata(self, config: dict, tags: dict[str, str], schemes: dict, *, float_linears: list[str],
                       kv_cache: bool, mla: bool, target: str, extra_keys: dict[str, str] | None = None,
                       float_experts: list[str] = ()) -> list[tuple[str, bytes]]:
        """quant_model_description.json (returned as an extra file); a target that reads its keys
        from config.json (MindIE) gets them there too. `schemes`: module -> scheme; `extra_keys`:
        see `description`; `float_experts` (fused float experts): their tensors' own FLOAT tags say it."""
        groups = {s.group_size for s in schemes.values() if s.group_size}
        if len(groups) > 1:  # the stacks read one global group_size (vllm-ascend, MindIE)
            raise FormatError(f"the ascend description has one global group_size, but the recipe uses "
                              f"{sorted(groups)}: give every grouped module the same group size")
        from cvt.qtensor.kimi_k25_keys import vllm_prefix_keys

        extra_keys = {**(extra_keys or {}), **vllm_prefix_keys(config, tags)}  # Kimi-K2.5: vLLM's module names
        desc = self.description(tags, kv_cache=("FAKQuant" if mla else "C8") if kv_cache else None,
                                group_size=groups.pop() if groups else 0, extra_keys=extra_keys)
        if target in L.CONFIG_KEY_TARGETS:
            lm_section(config).update(mindie_config(desc, mla))
        return [(self.description_file, (json.dumps(desc, indent=2) + "\n").encode())]

    # ---- read ------------------------------------------------------------------------------------

    def read(self, module: str, disk: dict[str, torch.Tensor], meta=None) -> QuantizedTensor:
        """``meta``: the description dict (tag of ``{module}.weight``, or ``.weight_packed``; a KV-cache
        key makes a W8A8 scheme w8a8c8) or a tag string."""
        desc = meta if isinstance(meta, dict) else {}
        tag = meta if isinstance(meta, str) else (desc.get(f"{module}.weight") or desc.get(f"{module}.weight_packed"))
        if tag is None:
            raise FormatError(f"ascend: no type tag for {module}.weight (pass the quant_model_description.json "
                              "dict as meta)")
        found = [lo for lo in L.LAYOUTS.values() if lo.format == self.name and lo.tag == tag]
        if not found:
            known = sorted({lo.tag for lo in L.LAYOUTS.values() if lo.format == self.name})
            raise FormatError(f"ascend: {module}.weight has tag {tag!r}; cvt reads {', '.join(known)} linears "
                              "(FLOAT tensors are plain weights)")
        prefix = module + "."
        by_suffix = {n[len(prefix):]: t for n, t in disk.items() if n.startswith(prefix)}
        try:
            q = L.read_layout(module, found, by_suffix).decode(module, by_suffix)
        except FormatError as exc:
            raise FormatError(f"ascend: {exc}") from None
        if q.scheme == W8A8.name and (desc.get("kv_cache_type") == "C8" or desc.get("fa_quant_type")
                                      or desc.get(INDEXER_KEY)):
            q.scheme = W8A8C8.name
        return q


def mindie_config(desc: dict, mla: bool) -> dict:
    """The keys MindIE's atb_llm reads from config.json for a quantized model
    (``models/base/config.py`` QuantizationConfig, ``models/deepseekv2/flash_causal_deepseekv2.py``):
    ``quantize`` (from model_quant_type; a DeepSeek model with static W8A8 attention and dynamic
    MLP runs attention with ``mla_quantize: "w8a8"`` and everything else ``w8a8_dynamic``) and
    ``quantization_config`` with ``group_size``, ``kv_quant_type`` / ``fa_quant_type``."""
    mqt = desc["model_quant_type"]
    tags = {t for n, t in desc.items() if n.endswith((".weight", ".weight_packed"))}
    out: dict = {}
    if mla and mqt == "W8A8" and "W8A8_DYNAMIC" in tags:
        out["quantize"], out["mla_quantize"] = "w8a8_dynamic", "w8a8"
    else:
        out["quantize"] = MINDIE_QUANTIZE.get(mqt, mqt.lower())
    qc: dict = {"group_size": desc.get("group_size", 0)}
    if desc.get("kv_quant_type"):
        qc["kv_quant_type"] = desc["kv_quant_type"]
    if desc.get("fa_quant_type"):
        qc["fa_quant_type"] = desc["fa_quant_type"]
    out["quantization_config"] = qc
    return out
