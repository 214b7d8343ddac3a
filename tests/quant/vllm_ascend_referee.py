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

Approximations are listed in ``APPROXIMATIONS``. Nothing here is imported by cvt.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.abc
import importlib.machinery
import json
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import torch

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


# ---------------------------------------------------------------------------------------------
# Stubs: vllm, torch_npu, transformers (when not really imported) and vllm-ascend's NPU modules.
# ---------------------------------------------------------------------------------------------

class _Anything:
    """Subclassable, callable, attribute-tolerant placeholder."""

    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        return _Anything()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __bool__(self):
        return False

    def __iter__(self):
        return iter(())


class _AnyMeta(type):
    """Class-level attribute access on stub classes (``CompilationMode.VLLM_COMPILE``)."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


class _AutoModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        obj = _AnyMeta(name, (_Anything,), {}) if name[:1].isupper() else _Anything()
        setattr(self, name, obj)
        return obj


# vllm_ascend modules that pull in NPU runtime code; the rest of vllm_ascend.quantization is real.
_VA_STUBBED = (
    "vllm_ascend.ascend_config", "vllm_ascend.ascend_forward_context", "vllm_ascend.distributed",
    "vllm_ascend.ops", "vllm_ascend.flash_common3_context", "vllm_ascend.device", "vllm_ascend.utils",
    "vllm_ascend.attention",
)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, tops: tuple[str, ...]):
        self.tops = tops

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.tops or fullname.startswith(_VA_STUBBED):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _AutoModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


class _PerTensorScaleParameter(torch.nn.Parameter):
    def __new__(cls, data=None, weight_loader=None, **kw):
        p = torch.nn.Parameter.__new__(cls, data, requires_grad=False)
        p.weight_loader = weight_loader
        return p


def _set_weight_attrs(weight, attrs):
    for k, v in (attrs or {}).items():
        setattr(weight, k, v)


class _QuantizationConfig(metaclass=_AnyMeta):
    def __init__(self):
        self.packed_modules_mapping: dict[str, list[str]] = {}


@dataclass
class _Env:
    mc: Any                    # vllm_ascend.quantization.modelslim_config
    adapters: Any              # vllm_ascend.quantization.method_adapters
    kv_c8: Any                 # vllm_ascend.quantization.methods.kv_c8
    LinearBase: type
    RowParallelLinear: type
    FusedMoE: type
    AttentionLayerBase: type
    VocabParallelEmbedding: type
    holder: Any                # the stub VllmConfig (quant_config set once the config exists)
    moe_bases: tuple = ()      # main: what _is_fused_moe_layer checks (MoERunner, RoutedExperts)


@contextlib.contextmanager
def _vllm_ascend(va_src: Path, hf_config: dict, dtype: torch.dtype):
    """Import vllm-ascend's quantization package from ``va_src`` on stubs; undo everything after."""
    # vllm and torch_npu are always stubs (a real or stand-in one already imported is set aside and put
    # back afterwards); transformers is used as is when the session already imported it.
    tops = ("vllm", "torch_npu") + (() if "transformers" in sys.modules else ("transformers",))

    def owned(name: str) -> bool:
        return name.split(".")[0] in tops or name.split(".")[0] == "vllm_ascend"

    saved = {k: v for k, v in sys.modules.items() if owned(k)}
    for k in saved:
        del sys.modules[k]
    finder = _StubFinder(tops)
    sys.meta_path.insert(0, finder)
    default_dtype = torch.get_default_dtype()
    try:
        pkg = types.ModuleType("vllm_ascend")
        pkg.__path__ = [str(Path(va_src) / "vllm_ascend")]
        sys.modules["vllm_ascend"] = pkg

        import vllm.config as vc
        import vllm.distributed as vd
        import vllm.model_executor.layers.fused_moe as vfm
        import vllm.model_executor.layers.quantization as vq
        import vllm.model_executor.layers.quantization.base_config as vqb
        import vllm.model_executor.parameter as vp
        import vllm.model_executor.utils as vmu
        import vllm.utils.math_utils as vmath
        import vllm_ascend.ascend_config as ac
        import vllm_ascend.distributed.parallel_state as ps
        import vllm_ascend.utils as vu

        holder = NS(
            quant_config=None,
            compilation_config=NS(mode=0),
            model_config=NS(enforce_eager=True, dtype=dtype, hf_config=NS(**hf_config),
                            use_mla="kv_lora_rank" in hf_config.get("text_config", hf_config)),
            parallel_config=NS(enable_expert_parallel=False, tensor_parallel_size=1, enable_eplb=False),
            kv_transfer_config=None,
            use_v2_model_runner=False,  # main's MoE schemes read it
        )
        vc.get_current_vllm_config = lambda: holder
        vc.get_current_vllm_config_or_none = lambda: holder
        vd.get_tensor_model_parallel_world_size = lambda: 1
        vd.get_tensor_model_parallel_rank = lambda: 0
        vq.register_quantization_config = lambda name: (lambda cls: cls)
        vqb.QuantizationConfig = _QuantizationConfig
        vp.PerTensorScaleParameter = _PerTensorScaleParameter
        vmu.set_weight_attrs = _set_weight_attrs
        vmath.cdiv = lambda a, b: -(-a // b)  # main's MX linear methods size scales with it
        vfm.FusedMoeWeightScaleSupported = enum.Enum(
            "FusedMoeWeightScaleSupported", {"TENSOR": "tensor", "CHANNEL": "channel", "GROUP": "group",
                                             "BLOCK": "block"})
        ac.get_ascend_config = lambda: NS(eplb_config=NS(dynamic_eplb=False), multistream_overlap_gate=False,
                                          enable_fused_mc2=0)
        vu.vllm_version_is = lambda v: v == "0.23.0"
        vu.COMPRESSED_TENSORS_METHOD = "compressed-tensors"
        vu.ASCEND_QUANTIZATION_METHOD = "ascend"

        def _no_mc2():  # the MoE schemes catch exactly this off-device
            raise AttributeError("no mc2 group off-device")

        ps.get_mc2_group = _no_mc2

        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
        from vllm.model_executor.layers.linear import LinearBase, RowParallelLinear
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            VocabParallelEmbedding,
        )
        from vllm_ascend.quantization import method_adapters, modelslim_config
        from vllm_ascend.quantization.methods import kv_c8

        torch.set_default_dtype(dtype)
        moe = getattr(modelslim_config, "_is_fused_moe_layer", None)  # main: isinstance of these
        bases = tuple(getattr(modelslim_config, n) for n in ("MoERunner", "RoutedExperts")
                      if moe is not None and isinstance(getattr(modelslim_config, n, None), type))
        yield _Env(modelslim_config, method_adapters, kv_c8, LinearBase, RowParallelLinear, vfm.FusedMoE,
                   AttentionLayerBase, VocabParallelEmbedding, holder, bases)
    finally:
        torch.set_default_dtype(default_dtype)
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)
        for k in [k for k in sys.modules if owned(k)]:
            del sys.modules[k]
        sys.modules.update(saved)


@contextlib.contextmanager
def _track_empty():
    """Tensors made by ``torch.empty`` while creating weights: parameters the checkpoint must fill
    (zeros / ones a scheme makes itself are defaults, not requirements)."""
    made: list[torch.Tensor] = []
    orig = torch.empty

    def empty(*a, **k):
        t = orig(*a, **k)
        made.append(t)
        return t

    torch.empty = empty
    try:
        yield made
    finally:
        torch.empty = orig


def _is_empty_made(t: torch.Tensor, made: list[torch.Tensor]) -> bool:
    return t.numel() > 0 and any(m.numel() > 0 and m.data_ptr() == t.data_ptr() for m in made)


# ---------------------------------------------------------------------------------------------
# vLLM 0.23 model layouts (tp=1)
# ---------------------------------------------------------------------------------------------

@dataclass
class _Lin:
    prefix: str                               # vLLM module prefix (quant lookup, parameter names)
    kind: str                                 # replicated | column | row | merged | qkv
    in_size: int
    shards: list[tuple[str, Any, int]]        # (checkpoint module, shard id or None, output rows)
    quant: bool = True                        # built with quant_config
    bias: bool = False


@dataclass
class _MoE:
    prefix: str
    num_experts: int
    hidden: int
    inter: int


@dataclass
class _Attn:
    layer_name: str                           # prefix vLLM passes to get_quant_method
    owner: str                                # where the attention layer's parameters live
    ckpt: str                                 # checkpoint prefix (…self_attn)
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass
class _Plain:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    ckpt: str | None = None                   # the checkpoint tensor, when its name differs


@dataclass
class _Embed:
    prefix: str
    vocab: int
    hidden: int
    required: bool = True                     # False: tied to embed_tokens, the checkpoint may omit it


def _mlp(prefix: str, hidden: int, inter: int) -> list:
    return [_Lin(f"{prefix}.gate_up_proj", "merged", hidden,
                 [(f"{prefix}.gate_proj", 0, inter), (f"{prefix}.up_proj", 1, inter)]),
            _Lin(f"{prefix}.down_proj", "row", inter, [(f"{prefix}.down_proj", None, hidden)])]


def _deepseek_decoder(c: dict, dt: torch.dtype, i: int, root: str = "model") -> list:
    """DeepseekV2DecoderLayer(prefix=f"model.layers.{i}") (vllm/model_executor/models/deepseek_v2.py, its
    MLA attention as vllm-ascend's patch_deepseek_v2 rebuilds it): MLA attention (fused_qkv_a_proj
    when q_lora_rank, else kv_a_proj_with_mqa + q_proj), dense MLP unless i >= first_k_dense_replace
    and i % moe_layer_freq == 0, else GateLinear router (no quant_config) + shared_experts MLP +
    FusedMoE.  ``root``: the DeepseekV2Model's prefix (``language_model`` under Kimi-K2.5)."""
    H, heads = c["hidden_size"], c["num_attention_heads"]
    nope, rope, vd = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    ql, kvl = c.get("q_lora_rank"), c["kv_lora_rank"]
    p = f"{root}.layers.{i}"
    a = f"{p}.self_attn"
    mods: list = [_Plain(f"{p}.input_layernorm.weight", (H,), dt),
                  _Plain(f"{p}.post_attention_layernorm.weight", (H,), dt)]
    if ql:
        mods += [_Lin(f"{a}.fused_qkv_a_proj", "merged", H,
                      [(f"{a}.q_a_proj", 0, ql), (f"{a}.kv_a_proj_with_mqa", 1, kvl + rope)]),
                 _Plain(f"{a}.q_a_layernorm.weight", (ql,), dt),
                 _Lin(f"{a}.q_b_proj", "column", ql, [(f"{a}.q_b_proj", None, heads * (nope + rope))])]
    else:
        mods += [_Lin(f"{a}.kv_a_proj_with_mqa", "replicated", H, [(f"{a}.kv_a_proj_with_mqa", None, kvl + rope)]),
                 _Lin(f"{a}.q_proj", "column", H, [(f"{a}.q_proj", None, heads * (nope + rope))])]
    mods += [_Plain(f"{a}.kv_a_layernorm.weight", (kvl,), dt),
             _Lin(f"{a}.kv_b_proj", "column", kvl, [(f"{a}.kv_b_proj", None, heads * (nope + vd))]),
             _Lin(f"{a}.o_proj", "row", heads * vd, [(f"{a}.o_proj", None, H)]),
             # AscendMultiHeadLatentAttention.mla_attn = MLAAttention(prefix=f"{prefix}.attn")
             _Attn(f"{a}.attn", f"{a}.mla_attn.mla_attn", a, heads, 1, kvl)]
    if _builds_indexer(c, i):
        mods += _indexer(c, dt, a)
    E = c.get("n_routed_experts")
    if E and i >= c.get("first_k_dense_replace", 0) and i % c.get("moe_layer_freq", 1) == 0:
        mods.append(_Plain(f"{p}.mlp.gate.weight", (E, H), dt))
        if c.get("topk_method") == "noaux_tc":
            mods.append(_Plain(f"{p}.mlp.gate.e_score_correction_bias", (E,), torch.float32))
        if c.get("n_shared_experts"):
            mods += _mlp(f"{p}.mlp.shared_experts", H, c["moe_intermediate_size"] * c["n_shared_experts"])
        mods.append(_MoE(f"{p}.mlp.experts", E, H, c["moe_intermediate_size"]))
    else:
        mods += _mlp(f"{p}.mlp", H, c["intermediate_size"])
    return mods


def _builds_indexer(c: dict, i: int) -> bool:
    """DeepSeek-V3.2 / GLM-5 (``index_topk`` in the config): does layer ``i`` get an Indexer?  vllm-ascend
    patch/worker/patch_deepseek_v2.py (_deepseek_v2_mla_attention_init + _should_skip_indexer_init): not
    when top-k is skipped there (``index_topk_pattern`` letter "S", else the ``index_topk_freq`` /
    ``index_skip_topk_offset`` schedule) *and* ``indexer_types`` calls the decoder layer "shared" (as
    transformers' GlmMoeDsaConfig.__post_init__ derives it from the pattern when absent)."""
    if "index_topk" not in c:
        return False
    pattern, freq, off = c.get("index_topk_pattern"), c.get("index_topk_freq", 1), c.get("index_skip_topk_offset", 2)
    if pattern is None:
        skip = max(i - off + 1, 0) % freq != 0
    else:
        skip = 0 <= i < len(pattern) and pattern[i] == "S"
    if not skip or i >= c["num_hidden_layers"]:
        return True
    types = c.get("indexer_types")
    if types is None and isinstance(pattern, str):
        types = ["shared" if x == "S" else "full" for x in pattern]
    kind = types[i] if types is not None and i < len(types) else None
    return not (isinstance(kind, str) and kind.lower() == "shared")


def _indexer(c: dict, dt: torch.dtype, a: str) -> list:
    """vLLM deepseek_v2.py Indexer(prefix=f"{a}.indexer") (after vLLM PR #38870): wq_b a ReplicatedLinear
    *with* quant_config, wk + weights_proj fused into a MergedColumnParallelLinear built without it
    (always float), k_norm a LayerNorm (weight + bias)."""
    ix = f"{a}.indexer"
    hd = c.get("index_head_dim", 128)
    n = c.get("index_n_heads") or (32 if c.get("model_type") == "glm_moe_dsa" else 64)
    return [_Lin(f"{ix}.wq_b", "replicated", c["q_lora_rank"], [(f"{ix}.wq_b", None, n * hd)]),
            _Lin(f"{ix}.wk_weights_proj", "merged", c["hidden_size"],
                 [(f"{ix}.wk", 0, hd), (f"{ix}.weights_proj", 1, n)], quant=False),
            _Plain(f"{ix}.k_norm.weight", (hd,), dt), _Plain(f"{ix}.k_norm.bias", (hd,), dt)]


def _deepseek_layout(c: dict, dt: torch.dtype) -> list:
    """DeepseekV2ForCausalLM / DeepseekV3ForCausalLM: embed_tokens, num_hidden_layers decoder layers,
    norm, lm_head (ParallelLMHead with quant_config)."""
    H, V = c["hidden_size"], c["vocab_size"]
    mods: list = [_Embed("model.embed_tokens", V, H), _Plain("model.norm.weight", (H,), dt), _Embed("lm_head", V, H)]
    for i in range(c["num_hidden_layers"]):
        mods += _deepseek_decoder(c, dt, i)
    return mods


def _kimi_k25_layout(c: dict, dt: torch.dtype) -> list:
    """vLLM models/kimi_k25.py KimiK25ForConditionalGeneration: ``language_model`` = DeepseekV2Model(prefix
    "language_model") on text_config (module prefixes ``language_model.layers.{i}``), ``lm_head`` at the
    top; the vision tower / projector are checked by _route_kimi_k25 only (float, carried)."""
    t = c["text_config"]
    H, V = t["hidden_size"], t["vocab_size"]
    mods: list = [_Embed("language_model.embed_tokens", V, H), _Plain("language_model.norm.weight", (H,), dt),
                  _Embed("lm_head", V, H)]
    for i in range(t["num_hidden_layers"]):
        mods += _deepseek_decoder(t, dt, i, root="language_model")
    return mods


def _mtp_layers(c: dict) -> range:
    L = c["num_hidden_layers"]
    return range(L, L + (c.get("num_nextn_predict_layers") or 0))


def _mtp_rewrite(c: dict, name: str) -> str:
    """DeepSeekMTP._rewrite_spec_layer_name (vllm/model_executor/models/deepseek_mtp.py) for a name
    in a spec layer: decoder-block weights move under ``.mtp_block.``, the shared embed_tokens to the
    top level, enorm / hnorm / eh_proj / shared_head stay."""
    for spec in _mtp_layers(c):
        p = f"model.layers.{spec}."
        if not name.startswith(p):
            continue
        for w in ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head"):
            if w in name:
                return name.replace(p, "model.") if w == "embed_tokens" else name
        return name.replace(p, f"{p}mtp_block.")
    return name


def _deepseek_mtp_layout(c: dict, dt: torch.dtype) -> list:
    """DeepSeekMTP (deepseek_mtp.py, as vllm-ascend's patch_deepseek_mtp subclasses it): per spec
    layer L+i a DeepSeekMultiTokenPredictorLayer with enorm, hnorm, eh_proj (a plain nn.Linear: no
    quant_config), shared_head (norm + ParallelLMHead with quant_config, prefix
    ``model.layers.{L+i}.shared_head.head``) and mtp_block = DeepseekV2DecoderLayer built with
    prefix ``model.layers.{L+i}`` (so quant lookups use the checkpoint names) whose parameters live
    under ``model.layers.{L+i}.mtp_block.``; one shared VocabParallelEmbedding without quant_config.
    Module prefixes here are the vLLM prefixes (quant lookups); _run_pass renames the parameters."""
    H, V = c["hidden_size"], c["vocab_size"]
    first = _mtp_layers(c)[0]
    mods: list = [_Plain("model.embed_tokens.weight", (V, H), dt, ckpt=f"model.layers.{first}.embed_tokens.weight")]
    for i in _mtp_layers(c):
        p = f"model.layers.{i}"
        mods += [_Plain(f"{p}.enorm.weight", (H,), dt), _Plain(f"{p}.hnorm.weight", (H,), dt),
                 _Plain(f"{p}.eh_proj.weight", (H, 2 * H), dt), _Plain(f"{p}.shared_head.norm.weight", (H,), dt),
                 _Embed(f"{p}.shared_head.head", V, H)]
        mods += _deepseek_decoder(c, dt, i)
    return mods


def _qwen3_layout(c: dict, dt: torch.dtype, moe: bool) -> list:
    """Qwen3ForCausalLM (models/qwen3.py + qwen2.py's MLP) / Qwen3MoeForCausalLM (models/qwen3_moe.py):
    QKVParallelLinear qkv_proj, o_proj, q_norm/k_norm, Attention at …self_attn.attn; MoE layers have
    a ReplicatedLinear router ``mlp.gate`` built *with* quant_config, then FusedMoE."""
    H, V, heads = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    hd = c.get("head_dim") or H // heads
    kvh = c.get("num_key_value_heads", heads)
    mods: list = [_Embed("model.embed_tokens", V, H), _Plain("model.norm.weight", (H,), dt)]
    if moe:  # Qwen3MoeForCausalLM always builds lm_head (tied: sharing embed_tokens' weight) and loads it
        mods.append(_Embed("lm_head", V, H, required=not c.get("tie_word_embeddings", False)))
    elif not c.get("tie_word_embeddings", False):  # Qwen3ForCausalLM: tied lm_head is embed_tokens, skipped
        mods.append(_Embed("lm_head", V, H))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        mods += [_Plain(f"{p}.input_layernorm.weight", (H,), dt),
                 _Plain(f"{p}.post_attention_layernorm.weight", (H,), dt),
                 _Lin(f"{a}.qkv_proj", "qkv", H, [(f"{a}.q_proj", "q", heads * hd), (f"{a}.k_proj", "k", kvh * hd),
                                                 (f"{a}.v_proj", "v", kvh * hd)], bias=bool(c.get("attention_bias"))),
                 _Lin(f"{a}.o_proj", "row", heads * hd, [(f"{a}.o_proj", None, H)]),
                 _Plain(f"{a}.q_norm.weight", (hd,), dt), _Plain(f"{a}.k_norm.weight", (hd,), dt),
                 _Attn(f"{a}.attn", f"{a}.attn", a, heads, kvh, hd)]
        E = c.get("num_experts", 0) if moe else 0
        if E and i not in c.get("mlp_only_layers", []) and (i + 1) % c.get("decoder_sparse_step", 1) == 0:
            mods.append(_Lin(f"{p}.mlp.gate", "replicated", H, [(f"{p}.mlp.gate", None, E)]))
            if c.get("shared_expert_intermediate_size", 0) > 0:
                mods += _mlp(f"{p}.mlp.shared_expert", H, c["shared_expert_intermediate_size"])
                mods.append(_Lin(f"{p}.mlp.shared_expert_gate", "replicated", H,
                                 [(f"{p}.mlp.shared_expert_gate", None, 1)], quant=False))
            mods.append(_MoE(f"{p}.mlp.experts", E, H, c["moe_intermediate_size"]))
        else:
            mods += _mlp(f"{p}.mlp", H, c["intermediate_size"])
    return mods


# vLLM model classes' own packed_modules_mapping (configure_quant_config hands it to the quant
# config; vllm-ascend replaces it by its table for model types it lists, e.g. deepseek_v3, qwen3_moe).
def _class_packed_mapping(c: dict) -> dict[str, list[str]]:
    mt = c.get("model_type")
    if mt == "kimi_k25":  # KimiK25ForConditionalGeneration defines none: QuantizationConfig's empty default
        return {}
    if mt == "qwen3":
        return {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    if mt == "qwen3_moe":
        m = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
        if c.get("mlp_only_layers"):
            m["gate_up_proj"] = ["gate_proj", "up_proj"]
        return m
    m = {"gate_up_proj": ["gate_proj", "up_proj"]}
    if c.get("q_lora_rank") is not None:
        m["fused_qkv_a_proj"] = ["q_a_proj", "kv_a_proj_with_mqa"]
    return m


# ---------------------------------------------------------------------------------------------
# Slots: one per (vLLM parameter, fused shard, expert) a checkpoint tensor loads into
# ---------------------------------------------------------------------------------------------

@dataclass
class _Slot:
    param: str                 # vLLM parameter name
    ckpt: str                  # the checkpoint tensor expected to fill it
    shape: tuple[int, ...]
    dtype: torch.dtype
    loader: str                # plain | linear | fused | moe | fa | c8
    required: bool = True
    what: str = ""             # scheme / module, for messages
    numel_one_fill: bool = False   # FAKQuant: numel-1 param takes any numel-1 tensor
    c8_numels: tuple[int, ...] = ()
    filled_by: list[str] = field(default_factory=list)


def _is_int(dt: torch.dtype) -> bool:
    return not (dt.is_floating_point or dt.is_complex or dt == torch.bool)


def _dtype_problem(name: str, got: torch.dtype, s: _Slot) -> str | None:
    want = s.dtype
    local = s.param.rsplit(".", 1)[-1]
    offset_like = local.endswith("offset")
    if s.loader == "c8":
        return None if (got.is_floating_point or _is_int(got)) else f"{name}: dtype {got} cannot be a C8 scale/offset"
    if local == "deq_scale" and got != want:
        return (f"{name}: deq_scale is {got} but {s.what} declares {want} (float32 for bf16 models, int64 for "
                "fp16: npu_quant_matmul's scale; copy_ would convert the values)")
    if _is_int(want):
        if got == want or offset_like:
            return None
        if _is_int(got):
            return (f"{name}: integer payload is {got} but {s.param} is {want} ({s.what}); "
                    "copy_ would convert values, not reinterpret bits")
        return (f"{name}: float tensor ({got}) for integer parameter {s.param} ({want}, {s.what}); "
                "copy_ would truncate it")
    if not got.is_floating_point and not (offset_like and _is_int(got)):  # integer zero points convert exactly
        return (f"{name}: integer tensor ({got}) for float parameter {s.param} ({want}, {s.what}); "
                "copy_ would cast the raw integers")
    return None


# ---------------------------------------------------------------------------------------------
# The referee
# ---------------------------------------------------------------------------------------------

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


def _shape_problems(name: str, shape: tuple[int, ...], s: _Slot) -> list[str]:
    if s.loader == "c8":
        sq = tuple(d for d in shape if d != 1)
        numel = 1
        for d in shape:
            numel *= d
        if len(sq) > 1 or numel not in s.c8_numels:
            return [(f"{name}: shape {list(shape)}: the C8 scale must squeeze to a scalar or "
                     f"[num_kv_heads*head_dim] = {list(s.c8_numels)[-1:]} (vllm-ascend _prepare_c8_scales)")]
        return []
    if s.numel_one_fill:
        numel = 1
        for d in shape:
            numel *= d
        if numel == 1:
            return []
    if tuple(shape) != tuple(s.shape):
        extra = ""
        if shape == () and s.shape == (1,):
            extra = " (a 0-d per-tensor value; fused linears assert [1], write [1] everywhere)"
        return [f"{name}: shape {list(shape)} but {s.param} ({s.what}) takes {list(s.shape)}{extra}"]
    return []


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


# ---------------------------------------------------------------------------------------------
# Declared parameters, from vllm-ascend's own methods
# ---------------------------------------------------------------------------------------------

def _module_prefixes(m) -> list[str]:
    """Name prefixes (vLLM parameters and checkpoint tensors) that belong to module ``m``."""
    if isinstance(m, _Lin):
        return [m.prefix + "."] + [ck + "." for ck, _, _ in m.shards]
    if isinstance(m, _MoE):
        return [m.prefix + "."]
    if isinstance(m, _Attn):
        return [m.owner + ".", f"{m.ckpt}.fa_", f"{m.ckpt}.k_proj.kv_cache_", f"{m.ckpt}.v_proj.kv_cache_"]
    return [m.prefix + "."] if isinstance(m, _Embed) else [m.name]


def _fake(env: _Env, *bases: type):
    cls = type("Layer", (torch.nn.Module, *bases), {})
    layer = cls.__new__(cls)
    torch.nn.Module.__init__(layer)
    return layer


def _declare(env: _Env, cfg, m, dtype: torch.dtype, slots: dict, fused_pertensor: dict, schemes: dict) -> None:
    mt = env.holder.model_config.hf_config.model_type
    if isinstance(m, _Plain):
        slots[(m.name, None, None)] = _Slot(m.name, m.ckpt or m.name, m.shape, m.dtype, "plain",
                                            what="unquantized parameter")
        return
    if isinstance(m, _Embed):
        layer = _fake(env, env.VocabParallelEmbedding)
        meth = cfg.get_quant_method(layer, m.prefix)
        if isinstance(meth, env.adapters.AscendEmbeddingMethod):
            raise NotImplementedError(f"quantized VocabParallelEmbedding {m.prefix} is not modelled by the referee")
        slots[(f"{m.prefix}.weight", None, None)] = _Slot(f"{m.prefix}.weight", f"{m.prefix}.weight",
                                                          (m.vocab, m.hidden), dtype, "plain", m.required,
                                                          what="embedding")
        return
    if isinstance(m, _Lin):
        schemes[m.prefix] = _declare_linear(env, cfg, m, dtype, slots, fused_pertensor)
        return
    if isinstance(m, _MoE):
        schemes[m.prefix] = _declare_moe(env, cfg, m, dtype, slots)
        return
    if isinstance(m, _Attn):
        schemes[m.layer_name] = _declare_attention(env, cfg, m, slots, mt)
        return
    raise TypeError(m)


def _declare_linear(env: _Env, cfg, m: _Lin, dtype: torch.dtype, slots: dict, fused_pertensor: dict) -> str:
    sizes = [n for _, _, n in m.shards]
    bases = (env.RowParallelLinear, env.LinearBase) if m.kind == "row" else (env.LinearBase,)
    layer = _fake(env, *bases)
    meth = cfg.get_quant_method(layer, m.prefix) if m.quant else None
    params: list[tuple[str, torch.nn.Parameter, bool]] = []
    if isinstance(meth, env.adapters.AscendLinearMethod):
        what = f"{type(meth.quant_method).__name__} ({m.prefix})"
        with _track_empty() as made:
            meth.create_weights(layer, m.in_size, sizes, m.in_size, sum(sizes), dtype, weight_loader=None)
            params = [(n, p, _is_empty_made(p, made)) for n, p in layer.named_parameters(recurse=False)]
    else:  # AscendUnquantizedLinearMethod / no quant_config: a float weight [n, k]
        what = f"unquantized linear ({m.prefix})"
        w = torch.nn.Parameter(torch.empty(sum(sizes), m.in_size, dtype=dtype), requires_grad=False)
        _set_weight_attrs(w, {"input_dim": 1, "output_dim": 0})
        params = [("weight", w, True)]
    if m.bias:
        b = torch.nn.Parameter(torch.empty(sum(sizes), dtype=dtype), requires_grad=False)
        _set_weight_attrs(b, {"output_dim": 0})
        params.append(("bias", b, True))
    fused = m.kind in ("merged", "qkv")
    for local, p, required in params:
        full = f"{m.prefix}.{local}"
        out_dim = getattr(p, "output_dim", None)
        packed_dim, factor = getattr(p, "packed_dim", None), getattr(p, "packed_factor", None)
        if not fused:
            ck, _, _ = m.shards[0]
            slots[(full, None, None)] = _Slot(full, f"{ck}.{local}", tuple(p.shape), p.dtype, "linear", required, what)
            continue
        for ck, sid, n in m.shards:
            shape = list(p.shape)
            if out_dim is not None:  # MergedColumn/QKV weight_loader: narrow the param along output_dim
                size = n // factor if (packed_dim is not None and packed_dim == out_dim) else n
                shape[out_dim] = size
            else:  # "the same for all partitions": the whole param, each shard
                fused_pertensor.setdefault(full, []).append((full, sid, None))
            slots[(full, sid, None)] = _Slot(full, f"{ck}.{local}", tuple(shape), p.dtype, "fused", required,
                                             what + f" shard {sid}")
    return what.split(" (")[0]


def _declare_moe(env: _Env, cfg, m: _MoE, dtype: torch.dtype, slots: dict) -> str:
    layer = _fake(env, env.FusedMoE, *env.moe_bases)
    layer.moe_config = None
    layer.weight_loader = None  # main wraps it (_make_modelslim_moe_weight_loader)
    meth = cfg.get_quant_method(layer, m.prefix)
    if isinstance(meth, env.adapters.AscendFusedMoEMethod):
        what = f"{type(meth.quant_method).__name__} ({m.prefix})"
        with _track_empty() as made:
            meth.create_weights(layer, num_experts=1, hidden_size=m.hidden, intermediate_size_per_partition=m.inter,
                                params_dtype=dtype, weight_loader=None, intermediate_size_full=m.inter)
            params = [(n, p, _is_empty_made(p, made)) for n, p in layer.named_parameters(recurse=False)]
    else:  # AscendUnquantizedFusedMoEMethod (vLLM UnquantizedFusedMoEMethod.create_weights)
        what = f"unquantized FusedMoE ({m.prefix})"
        params = [("w13_weight", torch.nn.Parameter(torch.empty(1, 2 * m.inter, m.hidden, dtype=dtype)), True),
                  ("w2_weight", torch.nn.Parameter(torch.empty(1, m.hidden, m.inter, dtype=dtype)), True)]
    chan = {"channel", "group"}
    for local, p, required in params:
        full = f"{m.prefix}.{local}"
        if local.startswith("w13_"):
            suffix, shards = local[4:], (("w1", "gate_proj"), ("w3", "up_proj"))
        elif local.startswith("w2_"):
            suffix, shards = local[3:], (("w2", "down_proj"),)
        else:
            raise NotImplementedError(f"{full}: MoE parameter not named w13_/w2_ is not modelled by the referee")
        per_expert = tuple(p.shape[1:])
        qm = getattr(p, "quant_method", None)
        qm = getattr(qm, "value", qm)
        if "input_scale" in local or "weight_shape" in local:
            kind = "single"           # _load_single_value: param[expert] = loaded
        elif "scale" in local or "zero" in local or "offset" in local:
            if qm not in chan:        # FusedMoE.weight_loader: "quant method must be one of ..."
                raise ValueError(f"{full}: scale/offset parameter loaded with quant_method {qm!r}")
            kind = "split"
        else:
            kind = "split"            # weights: _load_w13 / _load_w2
        for sid, proj in shards:
            shape = per_expert
            if kind == "split" and sid in ("w1", "w3"):  # w13 halves along the intermediate dim
                shape = (per_expert[0] // 2, *per_expert[1:])
            for e in range(m.num_experts):
                ck = f"{m.prefix}.{e}.{proj}.{suffix}"
                slots[(full, sid, e)] = _Slot(full, ck, shape, p.dtype, "moe", required, what + f" {sid}")
    return what.split(" (")[0]


def _declare_attention(env: _Env, cfg, m: _Attn, slots: dict, mt: str) -> str:
    layer = _fake(env, env.AttentionLayerBase)
    layer.num_heads, layer.num_kv_heads, layer.head_size = m.num_heads, m.num_kv_heads, m.head_dim
    meth = cfg.get_quant_method(layer, m.layer_name)
    if not isinstance(meth, env.adapters.AscendKVCacheMethod):
        return "unquantized attention"
    scheme = meth.quant_method
    with _track_empty() as made:
        meth.create_weights(layer)
        params = [(n, p, _is_empty_made(p, made)) for n, p in layer.named_parameters()]
    name = type(scheme).__name__
    for local, p, required in params:
        full = f"{m.owner}.{local}"
        if isinstance(scheme, env.kv_c8.AscendC8KVCacheAttentionMethod):
            # checkpoint …self_attn.{k,v}_proj.kv_cache_{scale,offset} -> attn.{k,v}_cache_{scale,offset}
            kv, what_ = local.split("_", 1)[0], local.split("_")[-1]
            ck = f"{m.ckpt}.{kv}_proj.kv_cache_{what_}"
            slots[(full, None, None)] = _Slot(full, ck, tuple(p.shape), p.dtype, "c8", True, f"{name} ({m.layer_name})",
                                              c8_numels=(1, m.num_kv_heads * m.head_dim))
        elif isinstance(scheme, env.kv_c8.AscendFAQuantAttentionMethod):
            ck = f"{m.ckpt}.{local}"
            slots[(full, None, None)] = _Slot(full, ck, tuple(p.shape), p.dtype, "fa", required,
                                              f"{name} ({m.layer_name})",
                                              numel_one_fill=p.numel() == 1)
        else:
            ck = f"{m.ckpt}.{local}"
            slots[(full, None, None)] = _Slot(full, ck, tuple(p.shape), p.dtype, "plain", required,
                                              f"{name} ({m.layer_name})")
    return name


# ---------------------------------------------------------------------------------------------
# load_weights name routing (vLLM 0.23, plus vllm-ascend's patches)
# ---------------------------------------------------------------------------------------------

_ROTARY_UNUSED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

_KV_SCALE_PATTERNS = [
    (r"\.self_attn\.([kv])_proj\.([kv])_scale$", r".self_attn.{attn}.\2_scale"),
    (r"\.self_attn\.qkv_proj\.([kv])_scale$", r".self_attn.attn.\1_scale"),
    (r"\.self_attn\.qkqkv_proj\.([kv])_scale$", r".self_attn.attn.\1_scale"),
    (r"\.mixer\.[kv]_proj\.([kv])_scale$", r".mixer.attn.\1_scale"),
    (r"\.self_attn\.q\.scale$", r".self_attn.attn.q_scale"),
    (r"\.self_attn\.([kv])_cache\.scale$", r".self_attn.attn.\1_scale"),
    (r"\.([qkv])_scale$", r".attn.\1_scale"),
    (r"\.([qkv])_zero_point$", r".attn.\1_zero_point"),
]
_KV_SCALE_ENDINGS = (".k_scale", ".v_scale", ".q_scale", ".k_zero_point", ".v_zero_point", ".q_zero_point",
                     ".q.scale", ".k_cache.scale", ".v_cache.scale")


def _vllm_remap_kv_scale(name: str, params: set[str]) -> str | None:
    """vllm.model_executor.model_loader.weight_utils.maybe_remap_kv_scale_name."""
    if name in params:
        return name
    if name.endswith(".kv_scale"):
        r = name.replace(".kv_scale", ".attn.k_scale")
        return r if r in params else None
    attn = "mla_attn.mla_attn" if any("mla_attn" in k for k in params) else "attn"
    if name.endswith(_KV_SCALE_ENDINGS):
        for pat, rep in _KV_SCALE_PATTERNS:
            if re.search(pat, name):
                r = re.sub(pat, rep.replace("{attn}", attn), name)
                return r if r in params else None
    return name


_FA_NAMES = ("fa_q.scale", "fa_k.scale", "fa_v.scale", "fa_q.offset", "fa_k.offset", "fa_v.offset",
             "indexer.q_rot", "indexer.k_rot")


def _va_remap_deepseek(name: str, params: set[str]) -> str | None:
    """vllm-ascend patch/worker/patch_weight_utils.py: deepseek_v2's remap, FA names to mla_attn."""
    name = _vllm_remap_kv_scale(name, params)
    if name is None:
        return None
    for s in _FA_NAMES:
        if name.endswith(s):
            r = name.replace(s, f"mla_attn.mla_attn.{s}")
            return r if r in params else r.replace(".mla_attn", "")
    return name


def _top_level(name: str, params: set[str], tied: bool):
    """AutoWeightsLoader at the CausalLM: ``model.`` goes to the model's load_weights, ``lm_head.`` to
    the head's parameters, anything else is a ValueError."""
    if any(s in name for s in _ROTARY_UNUSED):
        return "skip", None
    if name.startswith("model."):
        return None
    if name.startswith("lm_head."):
        if tied:
            return "skip", None
        return ("load", (name, None, None)) if name in params else ("valueerror", name)
    return "valueerror", name


_EXPERT_RE = re.compile(r"experts\.(\d+)\.(gate_proj|down_proj|up_proj)\.")
_EXPERT_SHARDS = {"gate_proj": ("experts.w13_", "w1"), "down_proj": ("experts.w2_", "w2"),
                  "up_proj": ("experts.w13_", "w3")}


def _experts(name: str, params: set[str], num_experts: int):
    """FusedMoE.make_expert_params_mapping(gate_proj, down_proj, up_proj) lookup: the checkpoint's
    ``experts.{e}.{gate,up,down}_proj.`` (e < num_experts) becomes ``experts.w13_`` / ``experts.w2_``."""
    for mo in _EXPERT_RE.finditer(name):
        e = int(mo.group(1))
        if e < num_experts and mo.group(1) == str(e):
            pn, sid = _EXPERT_SHARDS[mo.group(2)]
            return name.replace(mo.group(0), pn, 1), sid, e
    return None


def _route_deepseek(name: str, params: set[str], c: dict, cfg):
    """DeepseekV2ForCausalLM: AutoWeightsLoader, then DeepseekV2Model.load_weights (deepseek_v2.py; MLA,
    no ROCm shared-expert fusion), which skips the spec-decode (MTP) layers."""
    top = _top_level(name, params, False)
    if top is not None:
        return top
    if any(name.startswith(f"model.layers.{i}.") for i in _mtp_layers(c)):
        return "skip", None  # get_spec_layer_idx_from_weight_name: the main model skips it
    return _deepseek_body(name, params, c)


_KIMI_CARRIED = ("vision_tower.", "mm_projector.")


def _route_kimi_k25(name: str, params: set[str], c: dict, cfg):
    """KimiK25ForConditionalGeneration.load_weights (vLLM models/kimi_k25.py): spec layers skipped,
    ``language_model.lm_head`` -> ``lm_head``, ``language_model.model`` -> ``language_model``, then the
    DeepseekV2 stacked / expert / default routing.  The vision tower and projector (default loading
    into MoonViT / KimiK25MultiModalProjector, not modelled here) must be the float tensors cvt
    carries: an integer one is reported, a float one accepted."""
    t = c["text_config"]
    if "rotary_emb.inv_freq" in name:
        return "skip", None
    if name.startswith(_KIMI_CARRIED):
        return "carried", name
    if any(f"model.layers.{i}." in name for i in _mtp_layers(t)):
        return "skip", None
    name = name.replace("language_model.lm_head", "lm_head").replace("language_model.model", "language_model")
    if name.startswith("lm_head."):
        return ("load", (name, None, None)) if name in params else ("keyerror", name)
    if not name.startswith("language_model."):
        return "keyerror", name  # params_dict[name]
    return _deepseek_body(name, params, t)


def _route_deepseek_mtp(name: str, params: set[str], c: dict, cfg):
    """DeepSeekMTP.load_weights (deepseek_mtp.py; vllm-ascend's AscendDeepSeekMTP only adds a rot.weight
    case): only spec-layer names, rewritten by _rewrite_spec_layer_name, then the same stacked /
    expert / remap routing as the main model; a spec layer after the first skips its shared
    top-level weights (embed_tokens)."""
    if "rotary_emb.inv_freq" in name:
        return "skip", None
    spec = next((i for i in _mtp_layers(c) if name.startswith(f"model.layers.{i}.")), None)
    if spec is None:
        return "skip", None  # the main model's
    name = _mtp_rewrite(c, name)
    r = _deepseek_body(name, params, c)
    if r[0] in ("keyerror", "load") and spec != _mtp_layers(c)[0] and ".layers" not in (
            r[1][0] if isinstance(r[1], tuple) else r[1]):
        return "skip", None
    return r


def _deepseek_body(name: str, params: set[str], c: dict):
    stacked = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
               ("wk_weights_proj", "wk", 0), ("wk_weights_proj", "weights_proj", 1),
               ("fused_qkv_a_proj", "q_a_proj", 0), ("fused_qkv_a_proj", "kv_a_proj_with_mqa", 1)]
    for pn, wn, sid in stacked:
        if wn not in name:
            continue
        if "mlp.experts." in name and name not in params:
            continue
        mapped = name.replace(wn, pn)
        if pn == "fused_qkv_a_proj" and mapped not in params:
            continue
        name = mapped
        if name.endswith(".bias") and name not in params:
            return "drop", name
        if name not in params:
            return "keyerror", name
        return "load", (name, sid, None)
    ex = _experts(name, params, c.get("n_routed_experts") or 0)
    if ex is not None:
        mapped, sid, e = ex
        if mapped not in params:
            return "keyerror", mapped
        return "load", (mapped, sid, e)
    if name.endswith(".bias") and name not in params:
        return "drop", name
    remapped = _va_remap_deepseek(name, params)
    if remapped is None:
        return "drop", name
    if remapped not in params:
        return "keyerror", remapped
    return "load", (remapped, None, None)


# (fused param, checkpoint name, shard id): the stacked_params_mapping of qwen3.py and qwen3_moe.py
_QWEN3_STACKED = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                  ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


_C8_SUFFIXES = ((".k_proj.kv_cache_scale", ".attn.k_cache_scale"), (".k_proj.kv_cache_offset", ".attn.k_cache_offset"),
                (".v_proj.kv_cache_scale", ".attn.v_cache_scale"), (".v_proj.kv_cache_offset", ".attn.v_cache_offset"))


def _c8_cache_name(cfg, name: str) -> str | None:
    """The vLLM name of a C8 scale / offset: 0.23's AscendModelSlimConfig.get_cache_scale; on main (no
    get_cache_scale) the C8 part of get_cache_scale_mapper's suffix map, which vLLM applies to every
    weight name before load_weights."""
    if hasattr(cfg, "get_cache_scale"):
        return cfg.get_cache_scale(name)
    if getattr(cfg, "enable_c8_quant", False):
        for src, dst in _C8_SUFFIXES:
            if name.endswith(src):
                return name[: -len(src)] + dst
    return None


def _route_qwen3(name: str, params: set[str], c: dict, cfg):
    """Qwen3ForCausalLM.load_weights as patched by vllm-ascend (patch_gqa_c8: C8 scales through
    get_cache_scale first), then Qwen2Model.load_weights (qwen2.py)."""
    top = _top_level(name, params, bool(c.get("tie_word_embeddings", False)))
    if top is not None:
        return top
    scale_name = _c8_cache_name(cfg, name)
    if scale_name is not None:
        return ("load", (scale_name, None, None)) if scale_name in params else ("drop", scale_name)
    for pn, wn, sid in _QWEN3_STACKED:
        if wn not in name:
            continue
        name = name.replace(wn, pn)
        if name.endswith(".bias") and name not in params:
            return "drop", name
        if name.endswith("scale"):
            r = _vllm_remap_kv_scale(name, params)
            if r is None:
                return "drop", name
            name = r
        if name not in params:
            return "keyerror", name
        return "load", (name, sid, None)
    if name.endswith(".bias") and name not in params:
        return "drop", name
    r = _vllm_remap_kv_scale(name, params)
    if r is None or r not in params:
        return "drop", r or name
    return "load", (r, None, None)


_QWEN3_MOE_IGNORE = (".bias", "_bias", ".weight_scale", "_weight_scale", ".input_scale", "_input_scale")


def _route_qwen3_moe(name: str, params: set[str], c: dict, cfg):
    """Qwen3MoeModel.load_weights (qwen3_moe.py); vllm-ascend has no C8 patch for it."""
    top = _top_level(name, params, False)  # AutoWeightsLoader(self): no skip_prefixes
    if top is not None:
        return top
    if "scale" in name or "zero_point" in name:
        r = _vllm_remap_kv_scale(name, params)
        if r is None:
            return "drop", name
        name = r
    for pn, wn, sid in _QWEN3_STACKED:
        if wn not in name:
            continue
        if "mlp.experts" in name:
            continue
        name = name.replace(wn, pn)
        if name.endswith(_QWEN3_MOE_IGNORE) and name not in params:
            return "drop", name
        if name.endswith("scale"):
            r = _vllm_remap_kv_scale(name, params)
            if r is None:
                return "drop", name
            name = r
        if name not in params:
            continue  # vLLM: `continue` with the renamed name (it ends up dropped below)
        return "load", (name, sid, None)
    ex = _experts(name, params, c.get("num_experts") or 0)
    if ex is not None:
        mapped, sid, e = ex
        if mapped.endswith(_QWEN3_MOE_IGNORE) and mapped not in params:
            return "drop", mapped
        if mapped not in params:
            return "keyerror", mapped
        return "load", (mapped, sid, e)
    if name.endswith(_QWEN3_MOE_IGNORE) and name not in params:
        return "drop", name
    if name not in params:
        return "drop", name
    return "load", (name, None, None)
