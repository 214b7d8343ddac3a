"""Referee for Qwen3.5 / Qwen3.5-MoE and Qwen3-Next: would vllm-ascend main load a cvt ``--format ascend``
output?

The hybrid-Qwen half of tests/quant/vllm_ascend_referee.py (same stubs, slot / dtype / shape checks and
``Report``): ``inspect_qwen3_5_output(dst, va_src)`` imports vllm-ascend's own quantization package from
``va_src`` and lets ``AscendModelSlimConfig`` choose every module's method and create its parameters:
its ``apply_vllm_mapper`` (vLLM's model loader hands it the model class's ``hf_to_vllm_mapper``:
model_loader/utils.py configure_quant_config), its ``packed_modules_model_mapping[model_type]``
(``qwen3_5`` / ``qwen3_5_moe``: in_proj_qkvz = in_proj_qkv + in_proj_z, in_proj_ba = in_proj_b +
in_proj_a, qkv_proj, gate_up_proj, experts; ``qwen3_next``: qkv_proj, gate_up_proj, experts and an
``in_proj`` = in_proj_qkvz + in_proj_ba no vLLM module is named, so each fused projection is looked up
as itself), ``is_layer_skipped_ascend`` and ``create_scheme_for_layer``.

The models are vLLM's (main, the ones vllm-ascend main patches: models/qwen3_5.py, qwen3_next.py,
layers/mamba/gdn/qwen_gdn_linear_attn.py), written out for tp=1; what differs between the two is one
`Model` entry each (`MODELS`):

* ``Qwen3_5(Moe)ForConditionalGeneration``: ``hf_to_vllm_mapper`` (Qwen3VLForConditionalGeneration's)
  maps ``model.language_model.`` -> ``language_model.model.``, ``model.visual.`` -> ``visual.``,
  ``lm_head.`` -> ``language_model.lm_head.``; ``load_weights`` skips ``mtp.`` (the draft's).
  ``Qwen3NextForCausalLM``: the release's names (``model.``, ``lm_head.``); its mapper drops ``mtp.``.
* ``visual`` (Qwen3.5) = Qwen3_VisionTransformer built *with* quant_config: every block's attn.qkv /
  attn.proj / mlp.linear_fc1 / linear_fc2 and the merger's linear_fc1 / linear_fc2 ask the description
  (must say FLOAT: cvt carries the tower); patch_embed / pos_embed / norms are checked to be float only.
* ``{lm}.layers.{i}``: a linear-attention layer's ``linear_attn`` (QwenGatedDeltaNetAttention):
  ``in_proj_qkvz`` MergedColumnParallelLinear with quant_config, [q, k, v, z] for Qwen3.5
  (gqa_interleaved_layout False: checkpoint in_proj_qkv loads as shards (0, 1, 2), in_proj_z as 3),
  one output shard for Qwen3-Next (True: the checkpoint's fused in_proj_qkvz, key-head interleaved,
  loads whole); ``in_proj_ba`` likewise ([b, a] or one shard) *with* quant_config (so the description
  decides); ``conv1d`` a ColumnParallelLinear without quant_config, weight [C, 1, k]; ``A_log``
  (float32) / ``dt_bias``, ``norm`` (RMSNormGated [Dv]), ``out_proj`` RowParallelLinear with
  quant_config.  A full-attention layer's ``self_attn`` (Qwen3NextAttention): QKVParallelLinear
  ``qkv_proj`` whose q shard carries the output gate (2 * heads * head_dim rows), ``o_proj``,
  q_norm / k_norm, the attention at ``attn``.  The MLP: Qwen2MoeMLP (dense; Qwen3-Next's
  ``mlp_only_layers`` / ``decoder_sparse_step`` layers too) or Qwen3NextSparseMoeBlock: ``gate`` and
  ``shared_expert_gate`` ReplicatedLinear built with quant_config=None, ``shared_expert`` MLP, FusedMoE
  ``experts``.
* ``Qwen3_5Model.load_weights`` / ``Qwen3NextModel.load_weights``: kv-scale remap for names ending in
  ``scale``, the stacked_params_mapping (a name no parameter takes is skipped with a warning: reported
  as dropped), per-expert names through FusedMoE's expert mapping.

Beyond vllm_ascend_referee.APPROXIMATIONS: the MTP draft (Qwen3_5MTP / Qwen3NextMTP) is not built;
its ``mtp.*`` tensors are checked to be float and described FLOAT (msModelSlim never quantizes it).
Tied embeddings (Qwen3.5): ``lm_head`` is ``embed_tokens`` and an ``lm_head.weight`` in the checkpoint
is not checked.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from cvt.tests.quant.vllm_ascend_referee import _CFG_DTYPES, _run_pass, open_output, read_headers, Report
from cvt.tests.quant.vllm_ascend_referee_layouts import _Attn, _Embed, _Lin, _mlp, _MoE, _Plain
from cvt.tests.quant.vllm_ascend_referee_routes import _ROTARY_UNUSED, _experts, _vllm_remap_kv_scale
from cvt.tests.quant.vllm_ascend_referee_stubs import _vllm_ascend
from cvt.tests.quant.vllm_ascend_referee_v4 import _WeightsMapper


@dataclass(frozen=True)
class Model:
    """One vLLM model class, as data: what differs between Qwen3.5 and Qwen3-Next (module docstring)."""

    hf_to_vllm: dict          # the class's hf_to_vllm_mapper prefixes (None: the name is dropped)
    packed: dict              # the class's packed_modules_mapping (configure_quant_config sets it)
    stacked: tuple            # the decoder model's load_weights stacked_params_mapping, in its order
    lm: str                   # the decoder model's vLLM prefix
    head: str                 # lm_head's vLLM prefix
    interleaved: bool         # gqa_interleaved_layout: in_proj_qkvz / in_proj_ba one checkpoint tensor each
    moe_layer: Callable       # (text config, layer index) -> whether the layer holds the sparse MoE block


_QKV_GATE_UP = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))
QWEN3_5 = Model(
    # Qwen3VLForConditionalGeneration.hf_to_vllm_mapper, which Qwen3_5ForConditionalGeneration inherits
    hf_to_vllm={"model.visual.": "visual.", "lm_head.": "language_model.lm_head.",
                "model.language_model.": "language_model.model."},
    packed={"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"],
            "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"], "in_proj_ba": ["in_proj_b", "in_proj_a"]},
    stacked=(*_QKV_GATE_UP, ("in_proj_ba", "in_proj_b", 0), ("in_proj_ba", "in_proj_a", 1),
             ("in_proj_qkvz", "in_proj_qkv", (0, 1, 2)), ("in_proj_qkvz", "in_proj_z", 3)),
    lm="language_model.model", head="language_model.lm_head", interleaved=False,
    moe_layer=lambda c, i: bool(c.get("num_experts")))
QWEN3_NEXT = Model(
    # Qwen3NextForCausalLM: hf_to_vllm_mapper drops mtp. (the draft's), packed_modules_mapping lists the
    # two fused Gated DeltaNet projections as themselves; Qwen3NextModel.load_weights stacks qkv / gate_up
    hf_to_vllm={"mtp.": None},
    packed={"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"],
            "in_proj_qkvz": ["in_proj_qkvz"], "in_proj_ba": ["in_proj_ba"]},
    stacked=_QKV_GATE_UP, lm="model", head="lm_head", interleaved=True,
    # Qwen3NextDecoderLayer: sparse unless in mlp_only_layers or off the decoder_sparse_step
    moe_layer=lambda c, i: (i not in (c.get("mlp_only_layers") or []) and (c.get("num_experts") or 0) > 0
                            and (i + 1) % (c.get("decoder_sparse_step") or 1) == 0))
MODELS = {"qwen3_5": QWEN3_5, "qwen3_5_moe": QWEN3_5, "qwen3_next": QWEN3_NEXT}
MODEL_TYPES = tuple(MODELS)


def model_of(config: dict) -> Model:
    return MODELS[config["model_type"]]


def text_of(config: dict) -> dict:
    """The language model's config: Qwen3.5's ``text_config``, Qwen3-Next's top level."""
    return config.get("text_config") or config


class _Mapper(_WeightsMapper):
    """vLLM's WeightsMapper.apply_dict, what AscendModelSlimConfig.apply_vllm_mapper calls on the description."""

    def apply_dict(self, values: dict) -> dict:
        return {k: v for n, v in values.items() if (k := self._map_name(n)) is not None}


def _linear_attention(c: dict, dt: torch.dtype, g: str, interleaved: bool) -> list:
    """QwenGatedDeltaNetAttention: ``interleaved`` (Qwen3-Next) makes in_proj_qkvz / in_proj_ba one output
    shard each, loaded whole from the checkpoint's fused tensor (create_qkvz_proj / create_ba_proj)."""
    H, hk, hv = c["hidden_size"], c["linear_num_key_heads"], c["linear_num_value_heads"]
    kd, vd = hk * c["linear_key_head_dim"], hv * c["linear_value_head_dim"]
    conv = 2 * kd + vd
    qkvz = [(f"{g}.in_proj_qkvz", None, conv + vd)] if interleaved else [(f"{g}.in_proj_qkv", (0, 1, 2), conv),
                                                                         (f"{g}.in_proj_z", 3, vd)]
    ba = [(f"{g}.in_proj_ba", None, 2 * hv)] if interleaved else [(f"{g}.in_proj_b", 0, hv), (f"{g}.in_proj_a", 1, hv)]
    return [_Lin(f"{g}.in_proj_qkvz", "merged", H, qkvz), _Lin(f"{g}.in_proj_ba", "merged", H, ba),
            _Plain(f"{g}.conv1d.weight", (conv, 1, c["linear_conv_kernel_dim"]), dt),
            _Plain(f"{g}.A_log", (hv,), torch.float32), _Plain(f"{g}.dt_bias", (hv,), dt),
            _Plain(f"{g}.norm.weight", (c["linear_value_head_dim"],), dt),
            _Lin(f"{g}.out_proj", "row", vd, [(f"{g}.out_proj", None, H)])]


def _full_attention(c: dict, dt: torch.dtype, a: str) -> list:
    H, heads = c["hidden_size"], c["num_attention_heads"]
    kvh, hd = c.get("num_key_value_heads") or heads, c["head_dim"]
    return [_Lin(f"{a}.qkv_proj", "qkv", H, [(f"{a}.q_proj", "q", 2 * heads * hd), (f"{a}.k_proj", "k", kvh * hd),
                                             (f"{a}.v_proj", "v", kvh * hd)]),
            _Lin(f"{a}.o_proj", "row", heads * hd, [(f"{a}.o_proj", None, H)]),
            _Plain(f"{a}.q_norm.weight", (hd,), dt), _Plain(f"{a}.k_norm.weight", (hd,), dt),
            _Attn(f"{a}.attn", f"{a}.attn", a, heads, kvh, hd)]


def _moe(c: dict, p: str) -> list:
    H, E = c["hidden_size"], c["num_experts"]
    return [_Lin(f"{p}.gate", "replicated", H, [(f"{p}.gate", None, E)], quant=False),
            *_mlp(f"{p}.shared_expert", H, c["shared_expert_intermediate_size"]),
            _Lin(f"{p}.shared_expert_gate", "replicated", H, [(f"{p}.shared_expert_gate", None, 1)], quant=False),
            _MoE(f"{p}.experts", E, H, c["moe_intermediate_size"])]


def _vision(v: dict) -> list:
    """Qwen3_VisionTransformer's linears (built with quant_config, prefix ``visual``), with their biases."""
    d, i = v["hidden_size"], v["intermediate_size"]
    m, o = d * v["spatial_merge_size"] ** 2, v["out_hidden_size"]
    mods = []
    for b in range(v["depth"]):
        q = f"visual.blocks.{b}"
        mods += [_Lin(f"{q}.attn.qkv", "column", d, [(f"{q}.attn.qkv", None, 3 * d)], bias=True),
                 _Lin(f"{q}.attn.proj", "row", d, [(f"{q}.attn.proj", None, d)], bias=True),
                 _Lin(f"{q}.mlp.linear_fc1", "column", d, [(f"{q}.mlp.linear_fc1", None, i)], bias=True),
                 _Lin(f"{q}.mlp.linear_fc2", "row", i, [(f"{q}.mlp.linear_fc2", None, d)], bias=True)]
    return mods + [_Lin("visual.merger.linear_fc1", "column", m, [("visual.merger.linear_fc1", None, m)], bias=True),
                   _Lin("visual.merger.linear_fc2", "row", m, [("visual.merger.linear_fc2", None, o)], bias=True)]


def _layer_types(c: dict) -> list[str]:
    """``layer_types``, else every ``full_attention_interval``-th layer full (Qwen3NextConfig's rule)."""
    every = c.get("full_attention_interval") or 4
    return c.get("layer_types") or ["linear_attention" if (i + 1) % every else "full_attention"
                                    for i in range(c["num_hidden_layers"])]


def layout(config: dict, dt: torch.dtype) -> list:
    """Every module vLLM's Qwen3_5(Moe)ForConditionalGeneration / Qwen3NextForCausalLM builds (module
    docstring), vLLM prefixes."""
    m, c = model_of(config), text_of(config)
    H, V = c["hidden_size"], c["vocab_size"]
    tied = m is QWEN3_5 and bool(c.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    mods: list = [_Embed(f"{m.lm}.embed_tokens", V, H), _Plain(f"{m.lm}.norm.weight", (H,), dt)]
    if not tied:  # Qwen3NextForCausalLM builds its lm_head whatever the config says
        mods.append(_Embed(m.head, V, H))
    types = _layer_types(c)
    for i in range(c["num_hidden_layers"]):
        p = f"{m.lm}.layers.{i}"
        mods += [_Plain(f"{p}.input_layernorm.weight", (H,), dt), _Plain(f"{p}.post_attention_layernorm.weight", (H,), dt)]
        mods += (_linear_attention(c, dt, f"{p}.linear_attn", m.interleaved) if types[i] == "linear_attention"
                 else _full_attention(c, dt, f"{p}.self_attn"))
        mods += _moe(c, f"{p}.mlp") if m.moe_layer(c, i) else _mlp(f"{p}.mlp", H, c["intermediate_size"])
    if config.get("vision_config"):
        mods += _vision(config["vision_config"])
    return mods


def draft_layout(config: dict, dt: torch.dtype) -> list:
    """The MTP draft's modules as vLLM's Qwen3_5MTP / Qwen3NextMTP build them, prefix ``mtp``, with the
    quant config (qwen3_5_mtp.py / qwen3_next_mtp.py: ``fc`` and one full-attention decoder layer per
    ``mtp_num_hidden_layers``, numbered from 0).  Not run by the Ascend referee (the draft is not
    built there); the compressed-tensors test checks their ``ignore`` entries with it."""
    m, c = model_of(config), text_of(config)
    H = c["hidden_size"]
    mods: list = [_Lin("mtp.fc", "column", 2 * H, [("mtp.fc", None, H)])]
    for j in range(c.get("mtp_num_hidden_layers") or c.get("num_nextn_predict_layers") or 0):
        p = f"mtp.layers.{j}"
        mods += _full_attention(c, dt, f"{p}.self_attn")
        mods += _moe(c, f"{p}.mlp") if m.moe_layer(c, j) else _mlp(f"{p}.mlp", H, c["intermediate_size"])
    return mods


def _map(name: str, m: Model = QWEN3_5) -> str | None:
    for old, new in m.hf_to_vllm.items():
        if name.startswith(old):
            return None if new is None else new + name[len(old):]
    return name


def route(name: str, params: set[str], c: dict, cfg):
    """Qwen3_5ForConditionalGeneration.load_weights (AutoWeightsLoader(skip_prefixes=["mtp."]) with the
    mapper, then Qwen3_5Model.load_weights for the language model or the vision tower's parameters), or
    Qwen3NextForCausalLM.load_weights (its mapper drops mtp., then Qwen3NextModel.load_weights)."""
    m = model_of(c)
    if any(s in name for s in _ROTARY_UNUSED) or name.startswith("mtp."):
        return ("carried", name) if name.startswith("mtp.") else ("skip", None)
    name = _map(name, m)
    if name.startswith("visual."):
        return ("load", (name, None, None)) if name in params else ("carried", name)
    if name.startswith(f"{m.head}."):
        return ("load", (name, None, None)) if name in params else ("valueerror", name)
    if not name.startswith(f"{m.lm}."):
        return "valueerror", name
    if name.endswith("scale"):
        r = _vllm_remap_kv_scale(name, params)
        if r is None:
            return "drop", name
        name = r
    for pn, wn, sid in m.stacked:
        if wn not in name or "mlp.experts" in name:
            continue
        name = name.replace(wn, pn)
        if name.endswith(".bias") and name not in params:
            return "drop", name
        if name not in params:
            continue  # vLLM: `continue` with the renamed name, which the default branch then drops
        return "load", (name, sid, None)
    ex = _experts(name, params, text_of(c).get("num_experts") or 0)
    if ex is not None:
        mapped, sid, e = ex
        if mapped.endswith((".bias", "_bias")) and mapped not in params:
            return "drop", mapped
        return ("load", (mapped, sid, e)) if mapped in params else ("keyerror", mapped)
    if name not in params:
        return "drop", name  # "Parameter ... not found in params_dict, skip loading"
    return "load", (name, None, None)


_DRAFT_FLOAT = re.compile(r"^mtp\.")


def _draft_problems(desc: dict, tensors: dict) -> list[str]:
    """The MTP draft is not built here: its tensors must be float and described FLOAT."""
    # msModelSlim never quantizes the draft: its Qwen3.5 recipes exclude mtp*, its Qwen3-Next adapter
    # (msmodelslim/model/qwen3_next) loads transformers' Qwen3NextForCausalLM, which has no mtp.* modules
    out = [f"[MTP draft] {k}: described {v!r}, not FLOAT (msModelSlim does not quantize mtp*; the draft is "
           "not modelled by the referee)" for k, v in desc.items() if _DRAFT_FLOAT.match(k) and v != "FLOAT"]
    return out + [f"[MTP draft] {k}: described FLOAT but the tensor is missing" for k, v in desc.items()
                  if _DRAFT_FLOAT.match(k) and v == "FLOAT" and k not in tensors]


def inspect_qwen3_5_output(dst: Path, va_src: Path) -> Report:
    """vllm-ascend main's view of the cvt ascend output ``dst`` of a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next
    (module docstring)."""
    dst, va_src = Path(dst), Path(va_src)
    opened = open_output(dst, MODEL_TYPES, "that method (msModelSlim strips it)")
    if isinstance(opened, Report):
        return opened
    config, desc, problems = opened
    report = Report(problems)
    dt_name = str(text_of(config).get("dtype") or config.get("torch_dtype") or config.get("dtype")
                  or "bfloat16").replace("torch.", "")
    dtype = _CFG_DTYPES.get(dt_name, torch.bfloat16)
    dtype = torch.bfloat16 if dtype == torch.float32 else dtype
    tensors, hp = read_headers(dst)
    problems += hp
    with _vllm_ascend(va_src, config, dtype) as env:
        cfg = env.mc.AscendModelSlimConfig(json.loads(json.dumps(desc)))
        cfg.packed_modules_mapping = dict(model_of(config).packed)
        cfg.apply_vllm_mapper(_Mapper(orig_to_new_prefix=dict(model_of(config).hf_to_vllm)))
        env.holder.quant_config = cfg
        report.slots = _run_pass(env, cfg, layout(config, dtype), route, tensors, config, dtype, problems,
                                 report.schemes, config["model_type"], label="")
    problems += _draft_problems(desc, tensors)
    report.notes.append("MTP draft (mtp.*) checked float only; the draft model is not built")
    return report


def check_qwen3_5_output(dst: Path, va_src: Path) -> list[str]:
    return inspect_qwen3_5_output(dst, va_src).problems
