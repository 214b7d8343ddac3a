"""Referee for DeepSeek-V4: would vllm-ascend load a cvt ``--format ascend`` output of a V4 release?

The V4 half of tests/quant/vllm_ascend_referee.py (same stubs, same slot / dtype / shape checks,
same ``Report``): ``inspect_v4_output(dst, va_src)`` imports vllm-ascend's own quantization package
from ``va_src`` and lets ``AscendModelSlimConfig`` (its ``_apply_extra_quant_adaptations``, keyed on
``hc_head_fn``, the ``deepseek_v4`` packed-modules table, ``QUANT_MODEL_PREFIX_MAPPINGS`` /
``QUANT_MODEL_SUBSTR_MAPPINGS``, ``is_layer_skipped_ascend``, ``create_scheme_for_layer``) choose each
module's method and create its parameters, for every module vllm-ascend's V4 model builds.

The model layout and name routing are vllm-ascend's, written out here for tp=1 from
``vllm_ascend/models/deepseek_v4/{model,mtp,compressor,indexer}.py`` (main @ 182b75e; v0.23.0 has
the same modules in ``models/deepseek_v4.py`` / ``deepseek_v4_mtp.py``):

* ``AscendDeepseekV4ForCausalLM``: ``model.embed_tokens`` (with quant_config), per layer
  ``DeepseekV4Attention`` (wq_a, wq_b, wkv, wo_a, wo_b all with quant_config; attn_sink; the
  compressor at rate > 1 and, at rate 4, ``DeepseekV4Indexer`` with wq_b (quant_config),
  weights_proj (None) and its own compressor; compressor wkv / wgate take quant_config except on
  A5), the DSA attention layer at ``self_attn.attn``, ``DeepseekV4MoE`` (gate without
  quant_config, ``tid2eid`` int32 in hash layers else ``e_score_correction_bias``, shared experts
  MLP gate_up_proj / down_proj, FusedMoE ``mlp.experts``), the six hyper-connection tensors,
  then ``model.norm``, ``hc_head_*`` and ``lm_head`` (with quant_config);
  ``load_weights``: ``mtp.*`` skipped, the release names renamed in its order.
* ``DeepSeekV4MTP`` (the draft, when the output has ``mtp.0.*``): one predictor layer at vLLM
  prefix ``mtp.0`` (parameters under ``model.layers.0.``): e_proj / h_proj ReplicatedLinear with
  quant_config but no prefix (so the quant lookup is for ""), shared_head (norm + ParallelLMHead at
  ``mtp.0.head``), mtp_block (a decoder layer at ``mtp.0``, compress_ratios[num_hidden_layers],
  never hash-routed), hc_head_*; its own VocabParallelEmbedding without quant_config; under the
  ascend config ``load_weights`` reads only ``mtp.0.*`` names (``mtp.0.emb.tok_emb.weight`` and
  ``mtp.0.head.weight`` included: the FP8 release's top-level embed / head are aliased only for
  ``deepseek_v4_fp8``).  Problems start with ``[MTP draft]``.

Beyond vllm_ascend_referee.APPROXIMATIONS: the draft's quant lookups use the target's model_type
(deepseek_v4); ``tid2eid`` (int32 in vLLM) takes the release's int64 values through
default_weight_loader's copy_, which converts the expert ids exactly, so an int64 or int32
checkpoint tensor is accepted there; the stand-in device is not A5 (compressor wkv / wgate ask the
quant config; on A5 they are built without it: FLOAT resolves both ways to unquantized);
``process_weights_after_loading`` runs in `process_after_loading` only, with the NZ format casts
as the identity (W4A8_DYNAMIC's experts move tensors with ``.npu()`` and W4A16's pack with NPU
kernels: those cannot run here).

Seen in vllm-ascend itself: the draft's load_weights sends every name containing ``.norm.`` to
``shared_head.norm``, so an MTP layer that compresses (compress_ratios[num_hidden_layers] 4 or 128)
cannot load its ``attn.compressor.norm.weight``; the published V4 configs end compress_ratios with
0 for the MTP layer, as the referee's test release does.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cvt.tests.quant.vllm_ascend_referee import _CFG_DTYPES, _run_pass, open_output, read_headers, Report
from cvt.tests.quant.vllm_ascend_referee_layouts import _Attn, _Embed, _Lin, _mlp, _MoE, _Plain
from cvt.tests.quant.vllm_ascend_referee_routes import _ROTARY_UNUSED, _experts, _vllm_remap_kv_scale
from cvt.tests.quant.vllm_ascend_referee_slots import _fake
from cvt.tests.quant.vllm_ascend_referee_stubs import _vllm_ascend

F32 = torch.float32


def _ratio(c: dict, i: int) -> int:
    """vllm_ascend.utils.get_dsv4_compress_ratio (0 past the list)."""
    r = c.get("compress_ratios") or []
    return r[i] if i < len(r) else 0


def _compressor(c: dict, dt: torch.dtype, p: str, ratio: int, head_dim: int) -> list:
    """Compressor(prefix=p) (compressor.py): ape [ratio, coff*head_dim] f32, wkv / wgate [coff*head_dim, d]
    ReplicatedLinear with quant_config (off A5), norm RMSNorm(head_dim); coff = 2 at rate 4."""
    coff = 2 if ratio == 4 else 1
    H = c["hidden_size"]
    return [_Plain(f"{p}.ape", (ratio, coff * head_dim), F32),
            _Lin(f"{p}.wkv", "replicated", H, [(f"{p}.wkv", None, coff * head_dim)]),
            _Lin(f"{p}.wgate", "replicated", H, [(f"{p}.wgate", None, coff * head_dim)]),
            _Plain(f"{p}.norm.weight", (head_dim,), dt)]


def _decoder(c: dict, dt: torch.dtype, p: str, cfg_idx: int, hash_layer: bool) -> list:
    """DeepseekV2DecoderLayer(prefix=p) of models/deepseek_v4/model.py: attention at ``p.self_attn``, MoE at
    ``p.mlp``; ``cfg_idx`` indexes compress_ratios (extract_dsv4_layer_index)."""
    H, heads, hd = c["hidden_size"], c["num_attention_heads"], c["head_dim"]
    ql, G, R = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    hc = c["hc_mult"]
    mix = (2 + hc) * hc
    a, f = f"{p}.self_attn", f"{p}.mlp"
    mods: list = [_Plain(f"{p}.input_layernorm.weight", (H,), dt), _Plain(f"{p}.post_attention_layernorm.weight", (H,), dt)]
    for x in ("attn", "ffn"):
        mods += [_Plain(f"{p}.hc_{x}_fn", (mix, hc * H), F32), _Plain(f"{p}.hc_{x}_base", (mix,), F32),
                 _Plain(f"{p}.hc_{x}_scale", (3,), F32)]
    mods += [_Plain(f"{a}.attn_sink", (heads,), F32),
             _Lin(f"{a}.wq_a", "replicated", H, [(f"{a}.wq_a", None, ql)]),
             _Plain(f"{a}.q_norm.weight", (ql,), dt),
             _Lin(f"{a}.wq_b", "column", ql, [(f"{a}.wq_b", None, heads * hd)]),
             _Lin(f"{a}.wkv", "replicated", H, [(f"{a}.wkv", None, hd)]),
             _Plain(f"{a}.kv_norm.weight", (hd,), dt),
             _Lin(f"{a}.wo_a", "column", heads * hd // G, [(f"{a}.wo_a", None, G * R)]),
             _Lin(f"{a}.wo_b", "row", G * R, [(f"{a}.wo_b", None, H)]),
             # DSAAttention(prefix=f"{prefix}.attn") inside AscendDeepseekSparseAttention: vLLM's
             # _init_kv_cache_quant asks the quant config for it (FA / C8 descriptions only)
             _Attn(f"{a}.attn", f"{a}.dsa_attn.dsa_attn", a, heads, 1, hd)]
    r = _ratio(c, cfg_idx)
    if r > 1:
        mods += _compressor(c, dt, f"{a}.compressor", r, hd)
        if r == 4:
            ix, ihd, ih = f"{a}.indexer", c["index_head_dim"], c["index_n_heads"]
            mods += [_Lin(f"{ix}.wq_b", "replicated", ql, [(f"{ix}.wq_b", None, ih * ihd)]),
                     _Lin(f"{ix}.weights_proj", "replicated", H, [(f"{ix}.weights_proj", None, ih)], quant=False),
                     *_compressor(c, dt, f"{ix}.compressor", 4, ihd)]
    E = c["n_routed_experts"]
    mods.append(_Lin(f"{f}.gate", "replicated", H, [(f"{f}.gate", None, E)], quant=False))
    mods.append(_Plain(f"{f}.gate.tid2eid", (c["vocab_size"], c["num_experts_per_tok"]), torch.int32) if hash_layer
                else _Plain(f"{f}.gate.e_score_correction_bias", (E,), F32))
    if c.get("n_shared_experts"):
        mods += _mlp(f"{f}.shared_experts", H, c["moe_intermediate_size"] * c["n_shared_experts"])
    mods.append(_MoE(f"{f}.experts", E, H, c["moe_intermediate_size"]))
    return mods


def _v4_layout(c: dict, dt: torch.dtype) -> list:
    H, V, hc = c["hidden_size"], c["vocab_size"], c["hc_mult"]
    mods: list = [_Embed("model.embed_tokens", V, H), _Plain("model.norm.weight", (H,), dt),
                  _Plain("model.hc_head_fn", (hc, hc * H), F32), _Plain("model.hc_head_base", (hc,), F32),
                  _Plain("model.hc_head_scale", (1,), F32), _Embed("lm_head", V, H)]
    for i in range(c["num_hidden_layers"]):
        mods += _decoder(c, dt, f"model.layers.{i}", i, i < c.get("num_hash_layers", 0))
    return mods


def _mtp_layout(c: dict, dt: torch.dtype) -> list:
    """DeepSeekV4MTP (mtp.py) under vLLM prefixes (``mtp.0...``); ``_mtp_param`` names the parameters."""
    H, V, hc = c["hidden_size"], c["vocab_size"], c["hc_mult"]
    p = "mtp.0"
    return [_Plain("model.embed_tokens.weight", (V, H), dt, ckpt="mtp.0.emb.tok_emb.weight"),
            _Lin(f"{p}.e_proj", "replicated", H, [(f"{p}.e_proj", None, H)]),
            _Lin(f"{p}.h_proj", "replicated", H, [(f"{p}.h_proj", None, H)]),
            _Plain(f"{p}.enorm.weight", (H,), dt), _Plain(f"{p}.hnorm.weight", (H,), dt),
            _Plain(f"{p}.shared_head.norm.weight", (H,), dt), _Embed(f"{p}.head", V, H),
            _Plain(f"{p}.hc_head_fn", (hc, hc * H), F32), _Plain(f"{p}.hc_head_base", (hc,), F32),
            _Plain(f"{p}.hc_head_scale", (1,), F32),
            *_decoder(c, dt, p, c["num_hidden_layers"], False)]


_MTP_OUTER = ("e_proj.", "h_proj.", "enorm.", "hnorm.", "shared_head.", "hc_head_")


def _mtp_param(name: str) -> str:
    """vLLM prefix -> DeepSeekV4MTP parameter name: the predictor layer is ``model.layers.0``, its decoder
    block ``model.layers.0.mtp_block``, the shared head's ParallelLMHead ``shared_head.head``."""
    if not name.startswith("mtp.0."):
        return name
    rest = name[len("mtp.0."):]
    if rest.startswith("head."):
        return "model.layers.0.shared_head." + rest
    if rest.startswith(_MTP_OUTER):
        return "model.layers.0." + rest
    return "model.layers.0.mtp_block." + rest


@dataclass
class _WeightsMapper:
    """vLLM's WeightsMapper (vllm/model_executor/models/utils.py): regex, then substr, prefix and suffix maps,
    each the first match replaced once, in that order. AscendModelSlimConfig.quant_prefix_mapper builds
    one from QUANT_MODEL_PREFIX_MAPPINGS / QUANT_MODEL_SUBSTR_MAPPINGS["deepseek_v4"] for every lookup."""

    orig_to_new_regex: dict = field(default_factory=dict)
    orig_to_new_substr: dict = field(default_factory=dict)
    orig_to_new_prefix: dict = field(default_factory=dict)
    orig_to_new_suffix: dict = field(default_factory=dict)

    def _map_name(self, key: str) -> str | None:
        for pattern, new in self.orig_to_new_regex.items():
            if pattern.search(key):
                if new is None:
                    return None
                key = pattern.sub(new, key)
        for table, hit in ((self.orig_to_new_substr, lambda k, s: s in k), (self.orig_to_new_prefix, str.startswith)):
            for old, new in table.items():
                if hit(key, old):
                    if new is None:
                        return None
                    key = key.replace(old, new, 1)
        for old, new in self.orig_to_new_suffix.items():
            if key.endswith(old):
                if new is None:
                    return None
                key = new.join(key.rsplit(old, 1))
        return key


class _LookupAs:
    """The quant config, with some vLLM prefixes looked up as another (e_proj / h_proj: built without a
    prefix, so get_quant_method sees "")."""

    def __init__(self, cfg, table: dict[str, str]):
        self._cfg, self._table = cfg, table

    def get_quant_method(self, layer, prefix, *a, **k):
        return self._cfg.get_quant_method(layer, self._table.get(prefix, prefix), *a, **k)

    def __getattr__(self, name):
        return getattr(self._cfg, name)


def _body(name: str, params: set[str], c: dict):
    """The stacked / expert / default routing shared by the model's and the draft's load_weights."""
    if "rotary_emb.inv_freq" in name or any(s in name for s in _ROTARY_UNUSED):
        return "skip", None
    if ".gate.bias" in name:
        name = name.replace(".gate.bias", ".gate.e_score_correction_bias")
    if "sink" in name:
        return ("load", (name, None, None)) if name in params else ("keyerror", name)
    for pn, wn, sid in (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)):
        if wn not in name:
            continue
        if "mlp.experts." in name and name not in params:
            continue
        name = name.replace(wn, pn)
        if name.endswith(".bias") and name not in params:
            return "drop", name
        return ("load", (name, sid, None)) if name in params else ("keyerror", name)
    ex = _experts(name, params, c["n_routed_experts"])
    if ex is not None:
        mapped, sid, e = ex
        return ("load", (mapped, sid, e)) if mapped in params else ("keyerror", mapped)
    if name.endswith(".bias") and name not in params:
        return "drop", name
    r = _vllm_remap_kv_scale(name, params)
    if r is None:
        return "drop", name
    return ("load", (r, None, None)) if r in params else ("keyerror", r)


def _route_v4(name: str, params: set[str], c: dict, cfg):
    """AscendDeepseekV4ForCausalLM.load_weights (models/deepseek_v4/model.py), in its order."""
    if name.startswith("mtp."):
        return "skip", None  # get_spec_layer_idx_from_weight_name: the draft's
    if not name.startswith("model"):
        name = f"model.{name}"
    for a, b in ((".w1.", ".gate_proj."), (".w2.", ".down_proj."), (".w3.", ".up_proj.")):
        if a in name:
            name = name.replace(a, b)
    if "model.head." in name and "model.lm_head." not in name:
        name = name.replace("model.head.", "lm_head.")
    if "model.lm_head." in name:
        name = name.replace("model.lm_head.", "lm_head.")
    if "embed." in name and "embed_token." not in name:
        name = name.replace("embed.", "embed_tokens.")
    if "attn" in name and "self_attn" not in name:
        name = name.replace(".attn.", ".self_attn.")
    for a, b in ((".ffn.", ".mlp."), (".ffn_norm.", ".post_attention_layernorm."), (".attn_norm.", ".input_layernorm.")):
        if a in name:
            name = name.replace(a, b)
    if name.endswith(".scale"):
        name = name.replace(".scale", ".weight_scale")
    return _body(name, params, c)


_NO_MTP_BLOCK = (".hc_head_fn", ".hc_head_base", ".hc_head_scale", ".e_proj.", ".h_proj.", ".enorm.", ".hnorm.",
                 ".norm.", ".head.", ".emb.tok_emb.")


def _route_v4_mtp(name: str, params: set[str], c: dict, cfg):
    """DeepSeekV4MTP.load_weights (models/deepseek_v4/mtp.py) under the ascend quant config."""
    if "rotary_emb.inv_freq" in name:
        return "skip", None
    if not name.startswith("mtp."):
        return "skip", None  # the target model's (no deepseek_v4_fp8 aliasing of embed / head here)
    if not name.startswith("mtp.0."):
        return "keyerror", name  # `assert "mtp.0." in name`: one MTP layer
    if ".emb.tok_emb." in name:
        name = name.replace("mtp.0.", "model.")
    elif any(s in name for s in _NO_MTP_BLOCK):
        name = name.replace("mtp.0.", "model.layers.0.")
    else:
        name = name.replace("mtp.0.", "model.layers.0.mtp_block.")
    for a, b in ((".w1.", ".gate_proj."), (".w2.", ".down_proj."), (".w3.", ".up_proj.")):
        if a in name:
            name = name.replace(a, b)
    if name.endswith(".scale"):
        name = name.replace(".scale", ".weight_scale")
    for a, b in ((".head.", ".shared_head.head."), (".norm.", ".shared_head.norm."), (".emb.tok_emb.", ".embed_tokens.")):
        if a in name:
            name = name.replace(a, b)
    if "attn" in name and "self_attn" not in name:
        name = name.replace(".attn.", ".self_attn.")
    for a, b in ((".ffn.", ".mlp."), (".ffn_norm.", ".post_attention_layernorm."), (".attn_norm.", ".input_layernorm.")):
        if a in name:
            name = name.replace(a, b)
    return _body(name, params, c)


# the renames `_route_v4` / `_route_v4_mtp` (with `_body`) apply, in their order: copied from
# vllm-ascend's load_weights of models/deepseek_v4/model.py (AscendDeepseekV4ForCausalLM) and
# mtp.py (DeepSeekV4MTP; v0.23.0: deepseek_v4.py, deepseek_v4_mtp.py). `name_renames` reads the
# tree's own, and the pin test compares: a rename vllm-ascend adds or changes fails it.
MODEL_RENAMES = [(".w1.", ".gate_proj."), (".w2.", ".down_proj."), (".w3.", ".up_proj."), ("model.head.", "lm_head."),
                 ("model.lm_head.", "lm_head."), ("embed.", "embed_tokens."), (".attn.", ".self_attn."),
                 (".ffn.", ".mlp."), (".ffn_norm.", ".post_attention_layernorm."),
                 (".attn_norm.", ".input_layernorm."), (".scale", ".weight_scale"),
                 (".gate.bias", ".gate.e_score_correction_bias")]
MTP_RENAMES = [("mtp.0.", "model."), ("mtp.0.", "model.layers.0."), ("mtp.0.", "model.layers.0.mtp_block."),
               (".w1.", ".gate_proj."), (".w2.", ".down_proj."), (".w3.", ".up_proj."), (".scale", ".weight_scale"),
               (".head.", ".shared_head.head."), (".norm.", ".shared_head.norm."),
               (".emb.tok_emb.", ".embed_tokens."), (".attn.", ".self_attn."), (".ffn.", ".mlp."),
               (".ffn_norm.", ".post_attention_layernorm."), (".attn_norm.", ".input_layernorm."),
               (".gate.bias", ".gate.e_score_correction_bias")]


def name_renames(path: Path, function: str = "load_weights") -> list[tuple[str, str]]:
    """The ``name = name.replace("A", "B")`` calls of `function` in the Python file `path`, in
    source order (vllm-ascend's renames of the release's tensor names)."""
    import ast

    out = []
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            for n in ast.walk(node):
                if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "replace"
                        and isinstance(n.func.value, ast.Name) and n.func.value.id == "name" and len(n.args) == 2
                        and all(isinstance(a, ast.Constant) for a in n.args)):
                    out.append((n.lineno, n.col_offset, n.args[0].value, n.args[1].value))
    return [(a, b) for *_, a, b in sorted(out)]


def _tid2eid_ok(problem: str) -> bool:
    """tid2eid: default_weight_loader's copy_ turns int64 / int32 expert ids into the int32 parameter exactly."""
    head = problem.split(": ", 1)[0].removeprefix("[MTP draft] ")
    return head.endswith(".ffn.gate.tid2eid") and ("integer payload is torch.int64 but" in problem)


def inspect_v4_output(dst: Path, va_src: Path) -> Report:
    """vllm-ascend's view of the cvt ascend output ``dst`` of a DeepSeek-V4 release (module docstring)."""
    dst, va_src = Path(dst), Path(va_src)
    opened = open_output(dst, ("deepseek_v4",), "its method (deepseek_v4_fp8 for the release's fp8)")
    if isinstance(opened, Report):
        return opened
    config, desc, problems = opened
    report = Report(problems)
    if "hc_head_fn" not in desc:
        problems.append("quant_model_description.json: no 'hc_head_fn' key, so AscendModelSlimConfig does not "
                        "normalise the release's names (_apply_extra_quant_adaptations) and no module is found")
    dt_name = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").replace("torch.", "")
    dtype = _CFG_DTYPES.get(dt_name, torch.bfloat16)
    if dtype == torch.float32:
        dtype = torch.bfloat16
    tensors, hp = read_headers(dst)
    problems += hp
    raw: list[str] = []
    with _vllm_ascend(va_src, config, dtype) as env:
        env.mc.WeightsMapper = _WeightsMapper  # vllm is a stub: its mapper, written out
        cfg = env.mc.AscendModelSlimConfig(json.loads(json.dumps(desc)))
        # the class's own packed_modules_mapping; get_quant_method swaps in packed_modules_model_mapping["deepseek_v4"]
        cfg.packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}
        env.holder.quant_config = cfg
        report.slots = _run_pass(env, cfg, _v4_layout(config, dtype), _route_v4, tensors, config, dtype, raw,
                                 report.schemes, "deepseek_v4", label="")
        if any(n.startswith("mtp.") for n in tensors):
            report.mtp_slots = _run_pass(env, _LookupAs(cfg, {"mtp.0.e_proj": "", "mtp.0.h_proj": ""}),
                                         _mtp_layout(config, dtype), _route_v4_mtp, tensors, config, dtype, raw,
                                         report.schemes, "deepseek_v4 MTP", label="[MTP draft] ", rename=_mtp_param)
            report.notes.append("MTP layer mtp.0 checked as vllm-ascend's DeepSeekV4MTP draft loads it")
    problems += [p for p in raw if not _tid2eid_ok(p)]
    return report


def check_v4_output(dst: Path, va_src: Path) -> list[str]:
    return inspect_v4_output(dst, va_src).problems


# ---------------------------------------------------------------------------------------------
# process_weights_after_loading on the loaded values (NZ format casts as identity)
# ---------------------------------------------------------------------------------------------

def _identity(t, *a, **k):
    return t


def _read_tensor(dst: Path, name: str, files: dict) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(files[name][2], framework="pt") as h:
        return h.get_tensor(name)


def _fill(p: torch.nn.Parameter, local: str, m, slots: dict, tensors: dict, dst: Path) -> list[str]:
    """Copy the checkpoint tensors the referee routed into `p` (module `m`'s parameter `local`) as
    vLLM's weight loaders place them (fused shards along output_dim, experts along dim 0 then their
    w1 / w3 half); names of the tensors copied."""
    full = f"{m.prefix}.{local}"
    used = []
    if isinstance(m, _MoE):
        for (param, sid, e), s in slots.items():
            if param != full or not s.filled_by:
                continue
            v = _read_tensor(dst, s.filled_by[0], tensors)
            region = p.data[e]
            if sid in ("w1", "w3") and tuple(s.shape) != tuple(region.shape):
                half = region.shape[0] // 2
                region = region.narrow(0, 0 if sid == "w1" else half, half)
            region.copy_(v.reshape(region.shape))
            used.append(s.filled_by[0])
        return used
    out_dim, offset = getattr(p, "output_dim", None), 0
    for ck, sid, _ in m.shards:
        s = slots.get((full, sid if len(m.shards) > 1 else None, None))
        if s is None or not s.filled_by:
            continue
        v = _read_tensor(dst, s.filled_by[0], tensors)
        if len(m.shards) > 1 and out_dim is not None:
            n = s.shape[out_dim]
            p.data.narrow(out_dim, offset, n).copy_(v)
            offset += n
        else:
            p.data.copy_(v.reshape(p.shape))
        used.append(s.filled_by[0])
    return used


def process_after_loading(dst: Path, va_src: Path, prefixes: list[str]) -> dict[str, str]:
    """``{vLLM module prefix: "ok" | "unquantized" | the error}``: each quantized module's vllm-ascend
    method creates its weights (all experts),
    takes the checkpoint values the referee routes to them, and runs its own
    ``process_weights_after_loading`` (``torch_npu.npu_format_cast`` and ``maybe_trans_nz`` -- NZ
    layout casts on the NPU -- are the identity here; any other NPU kernel it calls fails the module)."""
    dst, va_src = Path(dst), Path(va_src)
    report = inspect_v4_output(dst, va_src)
    if report.problems:  # the loading the parameters would come from already fails
        return {"(load)": "; ".join(report.problems)}
    config = json.loads((dst / "config.json").read_text())
    desc = json.loads((dst / "quant_model_description.json").read_text())
    dtype = torch.bfloat16
    tensors, _ = read_headers(dst)
    mods = {getattr(m, "prefix", None): m for m in _v4_layout(config, dtype)}
    out: dict[str, str] = {}
    with _vllm_ascend(va_src, config, dtype) as env:
        env.mc.WeightsMapper = _WeightsMapper
        sys.modules["torch_npu"].npu_format_cast = _identity
        for name, mod in list(sys.modules.items()):
            if name.startswith("vllm_ascend.quantization") and hasattr(mod, "maybe_trans_nz"):
                mod.maybe_trans_nz = _identity
        cfg = env.mc.AscendModelSlimConfig(json.loads(json.dumps(desc)))
        cfg.packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}
        env.holder.quant_config = cfg
        for prefix in prefixes:
            m = mods[prefix]
            try:
                if isinstance(m, _MoE):
                    layer = _fake(env, env.FusedMoE, *env.moe_bases)
                    layer.moe_config, layer.weight_loader = None, None
                    meth = cfg.get_quant_method(layer, prefix)
                    if not isinstance(meth, env.adapters.AscendFusedMoEMethod):
                        out[prefix] = "unquantized"
                        continue
                    meth.create_weights(layer, num_experts=m.num_experts, hidden_size=m.hidden,
                                        intermediate_size_per_partition=m.inter, params_dtype=dtype, weight_loader=None,
                                        intermediate_size_full=m.inter)
                else:
                    sizes = [n for _, _, n in m.shards]
                    layer = _fake(env, *((env.RowParallelLinear, env.LinearBase) if m.kind == "row" else (env.LinearBase,)))
                    meth = cfg.get_quant_method(layer, prefix)
                    if not isinstance(meth, env.adapters.AscendLinearMethod):
                        out[prefix] = "unquantized"
                        continue
                    meth.create_weights(layer, m.in_size, sizes, m.in_size, sum(sizes), dtype, weight_loader=None)
                layer.prefix = prefix
                # vLLM's loader refuses a model with a parameter no checkpoint tensor initialized
                unfilled = [local for local, p in list(layer.named_parameters(recurse=False))
                            if not _fill(p, local, m, report.slots, tensors, dst)]
                if unfilled:
                    out[prefix] = f"parameters no checkpoint tensor fills: {unfilled}"
                    continue
                meth.process_weights_after_loading(layer)
                out[prefix] = "ok"
            except Exception as exc:  # the module's processing failed: say how
                out[prefix] = f"{type(exc).__name__}: {exc}"
    return out
