"""Referee: would vllm-ascend 0.23 (+ vLLM 0.23) load a cvt ``--format ascend`` output?

``check_output(dst, va_src)`` imports vllm-ascend's own ``vllm_ascend.quantization`` package from a
local source tree (``va_src`` holds the ``vllm_ascend/`` directory, e.g. the unpacked 0.23.0.post1
sdist) with vllm / torch_npu / transformers and vllm-ascend's NPU runtime modules stubbed, and lets
its real code decide, for every module vLLM's model builds with ``quant_config``:

* ``AscendModelSlimConfig(description)`` (runs ``_apply_extra_quant_adaptations`` and
  ``_add_kvcache_quant_metadata``), then ``get_quant_method(layer, prefix)`` on stand-in layers of
  the right vLLM classes (LinearBase / RowParallelLinear, FusedMoE, AttentionLayerBase,
  VocabParallelEmbedding), so the FLOAT check (``is_layer_skipped_ascend``), the packed-modules
  mapping, ``create_scheme_for_layer`` and the FA / C8 attention dispatch are vllm-ascend's own;
* the scheme's parameters, registered by vllm-ascend's own ``AscendLinearMethod.create_weights`` /
  ``AscendFusedMoEMethod.create_weights`` (one expert) / attention ``create_weights``.

The model layout (which linears exist, fused or not, with or without quant_config) and the
loaders (``load_weights`` name routing, the linear / FusedMoE / FAKQuant / C8 weight loaders) are
vLLM 0.23's, written out here from its code for tp=1 (module docstrings name the functions). The
checkpoint side is only the safetensors headers (name, dtype, shape) of every ``*.safetensors`` in
``dst`` (what vLLM's default loader globs), plus the values of per-tensor params shared by a fused
linear (they must agree: vLLM keeps the last shard's).

Problems reported (an empty list = it loads):
* a vllm-ascend error while choosing or creating a layer's quant method (KeyError for a missing
  ``<prefix>.weight`` tag, ValueError for mixed shards, NotImplementedError for an unregistered
  (type, layer) pair, ZeroDivisionError / AssertionError for a bad group size), naming the module;
* a checkpoint tensor with no parameter (KeyError / ValueError in load_weights, or silently dropped
  by the loader: data the checkpoint meant to be used);
* a declared parameter no checkpoint tensor fills (it keeps ``torch.empty`` garbage; params a
  scheme initialises itself, e.g. W4A16's zero offsets, are not required);
* a shape the loader would reject (or silently broadcast / truncate);
* a dtype the loader would silently mangle: integer payloads (int8 / int32 / uint8 / int64) must
  have their exact dtype, floats must not land in integer params or the reverse, ``deq_scale``
  exactly float32 (bf16 models) / int64 (fp16); offsets (zero points) may be float or integer
  either way (integral values convert exactly).

DeepSeek MTP layers are skipped by the main model (as vLLM does) and checked as vLLM's
DeepSeekMTP draft model loads them; their problems start with ``[MTP draft]``.

Approximations are listed in ``APPROXIMATIONS``. Nothing here is imported by cvt. The parts live
beside this driver: ``vllm_ascend_referee_stubs`` (the stubs, ``_vllm_ascend``), ``_layouts`` (vLLM's
model layouts), ``_slots`` (parameters declared through vllm-ascend, the loaders' dtype / shape
rules), ``_routes`` (load_weights name routing).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cvt.tests.quant.vllm_ascend_referee_layouts import (_class_packed_mapping, _deepseek_layout, _deepseek_mtp_layout,
                                                         _kimi_k25_layout, _mtp_layers, _mtp_rewrite, _qwen3_layout)
from cvt.tests.quant.vllm_ascend_referee_routes import (_route_deepseek, _route_deepseek_mtp, _route_kimi_k25,
                                                        _route_qwen3, _route_qwen3_moe)
from cvt.tests.quant.vllm_ascend_referee_slots import (_declare, _dtype_problem, _module_prefixes, _shape_problems,
                                                       _Slot)
from cvt.tests.quant.vllm_ascend_referee_stubs import _Env, _vllm_ascend

APPROXIMATIONS = """
- tp=1, no expert / pipeline / data parallel, no EPLB, no mix_placement; one FusedMoE layer is
  created with one expert and its per-expert shapes are applied to every expert; FusedMoE's
  hidden size is not rounded up (no padding).
- Which modules exist and with what prefixes, and each load_weights' name routing (DeepseekV2/V3
  + DeepSeekMTP, Qwen3, Qwen3-MoE, with vllm-ascend's patch_deepseek_v2 / patch_deepseek_mtp /
  patch_weight_utils / patch_gqa_c8), are re-implemented from vLLM 0.23 / vllm-ascend source, not
  imported; the stand-in layers are bare nn.Modules of the right vLLM classes.
- DeepSeek MTP layers (index >= num_hidden_layers) are skipped by the main model, as vLLM does,
  and checked separately as the DeepSeekMTP draft model loads them (problems prefixed
  "[MTP draft]"), when the checkpoint has them: quant lookups under the target's model_type
  (the draft is built with the target's vllm_config), vllm-ascend's FA-name remap assumed to
  apply in deepseek_mtp too.
- Shapes must match exactly: vLLM would also accept a 0-d per-tensor scale on non-fused linears,
  broadcast a [1] scale into a [n,1] MoE parameter, narrow an oversized tensor or (MoE) load a
  smaller one into the front of a padded parameter; all reported.
- C8 (GQA) scales may have any shape that squeezes to a scalar or [num_kv_heads*head_dim] (what
  _c8_kv_scale_weight_loader takes and attention_v1._prepare_c8_scales can use).
- Only headers are read (except fused per-tensor values, compared across shards): packing,
  nibble order and scale values are not checked; a float tensor landing in an integer offset
  parameter is accepted as msModelSlim writes it (values assumed integral).
- DeepSeek-V3.2 / GLM-5: vLLM's Indexer as after vLLM PR #38870 (wq_b with quant_config, wk +
  weights_proj fused without it, k_norm LayerNorm); its k_cache (no quant_config) is not modelled.
- Kimi-K2.5: the text model as KimiK25ForConditionalGeneration builds it (vLLM models/kimi_k25.py at
  vllm-project/vllm 009dff45: no hf_to_vllm_mapper, no packed_modules_mapping); the vision tower and
  projector are only checked to be float (vLLM builds them without quant_config), their shapes
  and names are not.
- Embeddings / lm_head are checked as unquantized; a quantized VocabParallelEmbedding is reported
  as not modelled.
- Device gates are not modelled: FA quant (FAKQuant) params are created whenever the
  description asks for them (vllm-ascend does so on any device; whether the kernels use them is
  runtime), and MXFP schemes' hardware checks (A5-class) are stubbed.
"""

SCHEME_ERRORS = (KeyError, ValueError, NotImplementedError, ZeroDivisionError, AssertionError)

_ST_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_CFG_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
               "float32": torch.float32, "float": torch.float32}


def read_headers(dst: Path) -> tuple[dict[str, tuple[str, tuple[int, ...], Path]], list[str]]:
    """name -> (safetensors dtype, shape, file) for every ``*.safetensors`` in ``dst`` vLLM's default
    loader reads (all of them, unless a ``model.safetensors.index.json`` names a subset:
    filter_duplicate_safetensors_files)."""
    out: dict[str, tuple[str, tuple[int, ...], Path]] = {}
    problems: list[str] = []
    files = sorted(Path(dst).glob("*.safetensors"))
    index = Path(dst) / "model.safetensors.index.json"
    if index.is_file():
        named = set(json.loads(index.read_text()).get("weight_map", {}).values())
        files = [f for f in files if f.name in named]
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        for k, info in header.items():
            if k in out:
                problems.append(f"{k}: in both {out[k][2].name} and {f.name}")
            out[k] = (info["dtype"], tuple(info["shape"]), f)
    return out, problems


def check_output(dst: Path, va_src: Path) -> list[str]:
    """Problems vllm-ascend 0.23 + vLLM 0.23 would have loading the cvt ascend output ``dst``
    (empty: it loads and every declared parameter is filled with a well-typed tensor)."""
    return inspect_output(dst, va_src).problems


@dataclass
class Report:
    problems: list[str]
    slots: dict = field(default_factory=dict)       # (vLLM param, shard, expert) -> _Slot (main model)
    schemes: dict = field(default_factory=dict)     # vLLM module prefix -> method / scheme class name
    mtp_slots: dict = field(default_factory=dict)   # the same for the DeepSeek MTP draft model
    notes: list[str] = field(default_factory=list)  # what was checked beyond the main model / skipped


def open_output(dst: Path, model_types: tuple[str, ...], why_qc: str) -> tuple[dict, dict, list[str]] | Report:
    """(config.json, quant_model_description.json, problems so far) of the cvt ascend output `dst`
    of one of `model_types`, or the Report that ends the check there (another model type, no
    description); a quantization_config present is a problem: vLLM would pick that method
    (`why_qc` says which), not vllm-ascend's 'ascend'."""
    config = json.loads((Path(dst) / "config.json").read_text())
    if config.get("model_type") not in model_types:
        return Report([f"config.json: model_type {config.get('model_type')!r} is not one of {model_types}"])
    desc_path = Path(dst) / "quant_model_description.json"
    if not desc_path.exists():
        return Report([f"{dst}: no quant_model_description.json (vllm-ascend would not pick its 'ascend' method)"])
    problems = []
    if "quantization_config" in config:
        problems.append(f"config.json: quantization_config present: vLLM would pick {why_qc}, not vllm-ascend's "
                        "'ascend'")
    return config, json.loads(desc_path.read_text()), problems


def inspect_output(dst: Path, va_src: Path) -> Report:
    """``check_output`` with what the referee saw: every parameter slot and each module's scheme."""
    dst, va_src = Path(dst), Path(va_src)
    problems: list[str] = []
    report = Report(problems)
    config = json.loads((dst / "config.json").read_text())
    desc_path = dst / "quant_model_description.json"
    if not desc_path.exists():
        return Report([f"{dst}: no quant_model_description.json (vllm-ascend would not pick its 'ascend' method)"])
    desc = json.loads(desc_path.read_text())
    dt_name = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").replace("torch.", "")
    dtype = _CFG_DTYPES.get(dt_name)
    if dtype is None:
        return Report([f"config.json: model dtype {dt_name!r} not understood"])
    if dtype == torch.float32:  # vLLM's dtype="auto" serves a float32 config in 16 bits (bf16 where supported)
        dtype = torch.bfloat16
    qc = config.get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") and str(qc["quant_method"]).lower() != "ascend":
        problems.append(f"config.json: quantization_config.quant_method {qc['quant_method']!r}: vLLM would "
                        "quantize with that method, not vllm-ascend's 'ascend' (msModelSlim strips "
                        "quantization_config)")
    mt = config.get("model_type")
    if mt in ("deepseek_v3", "deepseek_v2", "kimi_k2", "deepseek_v32", "glm_moe_dsa") and config.get("kv_lora_rank"):
        if ("index_topk" in config) != (mt in ("deepseek_v32", "glm_moe_dsa")):
            return Report([f"config.json: model_type {mt} with{'' if 'index_topk' in config else 'out'} an indexer "
                           "is not modelled by the referee"])
        layout, arch = _deepseek_layout(config, dtype), "deepseek"  # GlmMoeDsaForCausalLM is a DeepseekV2ForCausalLM
    elif mt == "kimi_k25" and config.get("text_config", {}).get("kv_lora_rank"):
        layout, arch = _kimi_k25_layout(config, dtype), "kimi_k25"
    elif mt == "qwen3":
        layout, arch = _qwen3_layout(config, dtype, moe=False), "qwen3"
    elif mt == "qwen3_moe":
        layout, arch = _qwen3_layout(config, dtype, moe=True), "qwen3_moe"
    else:
        return Report([f"config.json: model_type {mt!r} is not modelled by the referee"])

    tensors, hp = read_headers(dst)
    problems += hp
    route = {"deepseek": _route_deepseek, "qwen3": _route_qwen3, "qwen3_moe": _route_qwen3_moe,
             "kimi_k25": _route_kimi_k25}[arch]
    with _vllm_ascend(va_src, config, dtype) as env:
        cfg = env.mc.AscendModelSlimConfig(json.loads(json.dumps(desc)))
        cfg.packed_modules_mapping = _class_packed_mapping(config)
        env.holder.quant_config = cfg
        report.slots = _run_pass(env, cfg, layout, route, tensors, config, dtype, problems, report.schemes,
                                 arch, label="")
        if arch == "deepseek":
            spec = [f"model.layers.{i}." for i in _mtp_layers(config)]
            if any(n.startswith(tuple(spec)) for n in tensors):
                # vLLM builds the draft under the target's vllm_config (model_type deepseek_v3 for the quant
                # lookups) and the same AscendModelSlimConfig; DeepSeekMTP.load_weights reads every tensor.
                report.mtp_slots = _run_pass(env, cfg, _deepseek_mtp_layout(config, dtype), _route_deepseek_mtp,
                                             tensors, config, dtype, problems, report.schemes, "deepseek MTP",
                                             label="[MTP draft] ", rename=lambda n: _mtp_rewrite(config, n))
                report.notes.append(f"MTP layers {list(_mtp_layers(config))} checked as vLLM's DeepSeekMTP draft "
                                    "model loads them")
            elif spec:
                report.notes.append(f"no tensors for MTP layers {list(_mtp_layers(config))}: the main model loads; "
                                    "MTP speculative decoding would refuse this checkpoint")
    return report


def _run_pass(env: _Env, cfg, layout: list, route, tensors: dict, config: dict, dtype: torch.dtype,
              problems: list[str], schemes: dict, arch: str, label: str, rename=None) -> dict:
    """One vLLM model: declare every module's parameters through vllm-ascend, route every checkpoint
    tensor as that model's load_weights does, compare.  ``rename`` maps vLLM module-prefix based
    names to the model's parameter names (the MTP draft's ``.mtp_block.``)."""
    slots: dict[tuple, _Slot] = {}
    fused_pertensor: dict[str, list[tuple]] = {}
    failed: list[str] = []  # module prefixes (vLLM and checkpoint) whose quant method failed
    for m in layout:
        try:
            _declare(env, cfg, m, dtype, slots, fused_pertensor, schemes)
        except SCHEME_ERRORS as exc:
            where = getattr(m, "prefix", None) or getattr(m, "layer_name", None) or m.name
            problems.append(f"{label}{where}: {type(exc).__name__} in vllm-ascend while choosing / creating its "
                            f"quant method: {exc}")
            schemes[where] = f"error: {type(exc).__name__}"
            failed += _module_prefixes(m)
    if rename is not None:
        slots = {(rename(k[0]), *k[1:]): _renamed(s, rename) for k, s in slots.items()}
        fused_pertensor = {rename(k): [(rename(x[0]), *x[1:]) for x in v] for k, v in fused_pertensor.items()}
        failed += [rename(f) for f in failed]
    params = {s.param for s in slots.values()}
    for name in sorted(tensors):
        st_dtype, shape, _ = tensors[name]
        verdict, target = route(name, params, config, cfg)
        if verdict == "skip":
            continue
        tgt = target[0] if isinstance(target, tuple) else target
        if any(x.startswith(f) for f in failed for x in (name, tgt or "")):
            continue  # vLLM stopped at that module already (reported above)
        if verdict == "keyerror":
            problems.append(f"{label}{name}: checkpoint tensor with no parameter in vLLM (KeyError in load_weights; "
                            f"looked up as {target})")
            continue
        if verdict == "valueerror":
            problems.append(f"{label}{name}: checkpoint tensor with no module or parameter in vLLM "
                            "(ValueError in AutoWeightsLoader)")
            continue
        if verdict == "carried":
            if not _ST_DTYPES.get(st_dtype, torch.int8).is_floating_point:
                problems.append(f"{label}{name}: {st_dtype} tensor in the vision tower / projector, which vLLM "
                                "builds without quant_config (float)")
            continue
        if verdict == "drop":
            problems.append(f"{label}{name}: checkpoint tensor dropped silently by vLLM's {arch} load_weights "
                            f"(no parameter {target})")
            continue
        s = slots.get(target)
        if s is None:
            problems.append(f"{label}{name}: vLLM routes it to {target[0]}"
                            + (f" (shard {target[1]})" if target[1] is not None else "")
                            + (f" (expert {target[2]})" if target[2] is not None else "")
                            + ", which that module does not load")
            continue
        s.filled_by.append(name)
        if len(s.filled_by) > 1:
            problems.append(f"{label}{name}: loads into {s.param} already filled by {s.filled_by[0]}")
        got = _ST_DTYPES.get(st_dtype)
        if got is None:
            problems.append(f"{label}{name}: safetensors dtype {st_dtype} not understood")
            continue
        problems += [label + x for x in _shape_problems(name, shape, s)]
        dp = _dtype_problem(name, got, s)
        if dp:
            problems.append(label + dp)
    for s in slots.values():
        if s.required and not s.filled_by:
            fate = ("it would keep its default (scale 1 / offset 0)" if s.loader == "c8"
                    else "it would stay torch.empty")
            problems.append(f"{label}{s.param}: declared by {s.what} but no checkpoint tensor fills it "
                            f"(expected {s.ckpt}, {tuple(s.shape)} {s.dtype}); {fate}")
    problems += [label + x for x in _fused_pertensor_values(fused_pertensor, slots, tensors)]
    return slots


def _renamed(s: _Slot, rename) -> _Slot:
    s.param = rename(s.param)
    return s


def _fused_pertensor_values(groups: dict[str, list[tuple]], slots: dict, tensors: dict) -> list[str]:
    """Per-tensor params of fused linears have no output_dim: every shard loads the whole [1] param and
    the last wins, so the shards must carry equal values."""
    from safetensors import safe_open

    out = []
    for param, keys in groups.items():
        vals = []
        for key in keys:
            s = slots[key]
            if not s.filled_by or s.filled_by[0] not in tensors:
                continue
            name = s.filled_by[0]
            with safe_open(tensors[name][2], framework="pt") as h:
                t = h.get_tensor(name)
            if t.numel() == 1:
                vals.append((name, t.double().item()))
        if len({v for _, v in vals}) > 1:
            out.append(f"{param}: the fused shards carry different per-tensor values "
                       f"({', '.join(f'{n}={v:g}' for n, v in vals)}); vLLM keeps only the last one loaded")
    return out
