"""The shape of an architecture table, and the matcher every stage uses.

A table is data: rows of (module name pattern -> role, parallel style, block, flags). A
pattern is a dotted module path with placeholders ``{L}`` (layer index), ``{M}`` (MTP
layer index, for releases that store MTP layers apart, e.g. DeepSeek-V4's ``mtp.0``; it is
layer ``num_hidden_layers + M``) and ``{E}`` (routed expert id); the tensor name is
``<module>.<param>``, where param is one of `PARAMS` (``weight``, ``bias``,
``weight_scale_inv``, ``e_score_correction_bias``, and the quantized parts later stages
write) or one of the rule's own `Rule.params`. `ArchSpec.classify(name)` returns a `TensorInfo`, or
raises ArchError naming the tensor.

Parallel style -> TP split dim of a ``[out, in]`` weight (and of its block/group scales):

=========== ========== ============ ====================================
style       weight dim bias dim     examples
=========== ========== ============ ====================================
column      0          0            q_b_proj, gate_proj, up_proj
row         1          (replicated) o_proj, down_proj
vocab       0          -            embed_tokens (vocab-parallel)
replicated  -          -            norms, router, q_a_proj
=========== ========== ============ ====================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Mapping

from cvt.convert.arch.attention import AttentionKind, LayerAttention
from cvt.convert.arch.rotation import Rotation
from cvt.errors import ArchError


class Role(str, Enum):
    EMBEDDING = "embedding"
    HEAD = "head"
    NORM = "norm"
    LINEAR = "linear"  # attention projections and dense MLP
    EXPERT = "expert"  # routed expert linear (layer + expert id)
    SHARED_EXPERT = "shared_expert"
    ROUTER = "router"  # mlp.gate
    MTP_PROJ = "mtp_proj"  # eh_proj: concat(enorm(emb), hnorm(h)) -> hidden
    KV_CACHE = "kv_cache"  # int8 KV-cache scales (C8), see cvt.runtime.kv_cache
    CARRIED = "carried"  # a wrapper's other towers (Kimi-K2.5 vision): byte-identical through every stage


class Parallel(str, Enum):
    COLUMN = "column"
    ROW = "row"
    VOCAB = "vocab"
    REPLICATED = "replicated"


class Block(str, Enum):
    """Which part of the model a tensor belongs to: chooses its TP/EP group later."""

    ATTN = "attn"
    MLP = "mlp"  # dense MLP
    MOE = "moe"  # routed + shared experts, router
    EMBED = "embed"
    HEAD = "head"
    NORM = "norm"
    MTP = "mtp"  # MTP-only modules (enorm, hnorm, eh_proj)
    CARRIED = "carried"  # Role.CARRIED tensors: replicated, never run by cvt's text runtime


# Parameter names a module may carry. Weight-like params split like the weight.
WEIGHT_PARAMS = frozenset(
    {
        "weight",
        "weight_scale_inv",  # FP8 block scales
        "weight_scale",
        "weight_offset",
        "weight_packed",
        "weight_zero_point",
        "weight_global_scale",
        "weight_shape",
    }
)
OTHER_PARAMS = frozenset(
    {
        "bias",
        "e_score_correction_bias",
        "input_scale",
        "input_offset",
        "input_zero_point",
        "input_global_scale",
        "weight_scale_2",  # ModelOpt NVFP4's global weight scale: one float32, replicated (cvt.convert.ct_source)
        "deq_scale",
        "quant_bias",
        "scale_bias",  # Ascend W4A8_DYNAMIC: 8 * sum_k(w * scale), [n, 1] or [n, 16] (cvt.qtensor.layouts)
        "left_trans",  # Ascend W4A4_FLATQUANT_DYNAMIC: the online Kronecker transforms and the clip
        "right_trans",
        "clip_ratio",
        "kv_cache_scale",  # C8 (Ascend GQA naming, per cached channel)
        "kv_cache_offset",
        "scale",  # FAKQuant (Ascend MLA): self_attn.fa_{q,k,v}.scale / .offset
        "offset",
        "k_scale",  # C8 (compressed-tensors naming)
        "v_scale",
        "q_rot",  # DeepSeek-V3.2 indexer C8: self_attn.indexer.{q,k}_rot (cvt.qtensor.indexer_c8)
        "k_rot",
    }
)
PARAMS = WEIGHT_PARAMS | OTHER_PARAMS


@dataclass(frozen=True)
class Rule:
    """One row of a table.

    pattern:        module path with {L}/{E} placeholders ({B}: a carried tower's block, unchecked)
    role, parallel, block: see the enums
    quantizable:    a linear whose weight may be FP8 in a release / quantized by cvt
    float_default:  stays float under every quantization scheme unless a recipe says otherwise
    mtp_only:       exists only in MTP layers (index >= num_hidden_layers)
    params:         parameter names this module carries beyond `PARAMS` (DeepSeek-V4's
                    ``attn_sink``, ``hc_attn_fn``, its block ``scale``); they split like the weight
    parts:          config -> the sizes of the consecutive parts its split dim (0) holds, each split
                    over the degree on its own, so a rank holds its run of every part, in order
                    (Qwen3.5's in_proj_qkv and conv1d: q | k | v, as vLLM's MergedColumnParallelLinear
                    output_sizes and mamba_v2_sharded_weight_loader split them); None: one part
    """

    pattern: str
    role: Role
    parallel: Parallel = Parallel.REPLICATED
    block: Block = Block.NORM
    quantizable: bool = False
    float_default: bool = False
    mtp_only: bool = False
    params: frozenset[str] = frozenset()
    parts: Callable[[Mapping[str, Any]], tuple[int, ...]] | None = None


# The Hugging Face decoder skeleton every family shares (the runtime's model contract,
# `cvt.runtime.models.base`): embeddings, final norm, head, and each layer's two norms.
LAYER = "model.layers.{L}"
DECODER_RULES = (
    Rule("model.embed_tokens", Role.EMBEDDING, Parallel.VOCAB, Block.EMBED, float_default=True),
    Rule("model.norm", Role.NORM, Parallel.REPLICATED, Block.NORM, float_default=True),
    Rule("lm_head", Role.HEAD, Parallel.COLUMN, Block.HEAD, float_default=True),
    Rule(f"{LAYER}.input_layernorm", Role.NORM, Parallel.REPLICATED, Block.NORM, float_default=True),
    Rule(f"{LAYER}.post_attention_layernorm", Role.NORM, Parallel.REPLICATED, Block.NORM, float_default=True),
)


def swiglu_rules(prefix: str, role: Role, block: Block) -> tuple[Rule, Rule, Rule]:
    """The three linears of a SwiGLU MLP at `prefix` (a dense MLP, an expert, the shared experts):
    gate_proj and up_proj column-split, down_proj row-split, all quantizable."""
    return (Rule(f"{prefix}.gate_proj", role, Parallel.COLUMN, block, quantizable=True),
            Rule(f"{prefix}.up_proj", role, Parallel.COLUMN, block, quantizable=True),
            Rule(f"{prefix}.down_proj", role, Parallel.ROW, block, quantizable=True))


@dataclass(frozen=True)
class ArchTable:
    """A model family: which model_types it covers, how to read sizes from config, its rules."""

    name: str
    model_types: tuple[str, ...]
    rules: tuple[Rule, ...]
    # the families' names as people say them, e.g. "DeepSeek-V3 / R1 / V3.1": `cvt --help` lists them
    display: str
    # each decoder layer's attention kind, and so what its cache holds (`cvt.convert.arch.attention`):
    # the plan's KV bytes, the runtime cache, the KV-quantization sites and the ONNX cache I/O read it
    attention: LayerAttention
    # canonical count -> config key (absent keys mean 0)
    config_keys: Mapping[str, str] = field(default_factory=dict)
    # config -> {weight name: shape}, for planning from config.json alone (no weights)
    param_shapes: Callable[[Mapping[str, Any]], dict[str, tuple[int, ...]]] | None = None
    # keys whose default differs between the readers of the family's config.json (e.g. vLLM
    # falls back to softmax routing where transformers means sigmoid / noaux_tc): the value
    # an absent key means to cvt's runtime, written explicitly into every output config
    explicit_defaults: Mapping[str, Any] = field(default_factory=dict)
    # linears a serving stack fuses into one GEMM (vLLM 0.32: qkv_proj, gate_up_proj, MLA's
    # fused_qkv_a_proj, each expert's w13), as module patterns: a per-tensor quantization scale
    # (NVFP4's global scale) must be shared inside a group, or the fused layer uses one member's
    # scale for all and computes other weights than the file means
    fused_groups: tuple[tuple[str, ...], ...] = ()
    # config -> one line per value no model can have (`cvt.convert.arch.checks`)
    config_checks: Callable[[Mapping[str, Any]], list[str]] | None = None
    # a wrapper's prefix of the text model's tensor names (Kimi-K2.5: "language_model."), which the
    # runtime's module names lack
    text_prefix: str = ""
    # the linears calibration reads (`cvt.quant.methods.sites`), by their names under a parent module:
    # each group reads one input, measured once at its first linear present; the first group is the
    # attention's, read from input_layernorm (a smoothing fold's consumers, unless the runtime layer
    # lists its own folds: DeepSeek-V4's ``smooth_groups``)
    calib_shared_inputs: tuple[tuple[str, ...], ...] = ()
    # linears that read a norm of the same parent (measured as that norm's output): {linear: norm}
    calib_norm_inputs: Mapping[str, str] = field(default_factory=dict)
    # the parameter holding an FP8 weight's block scale in the release (DeepSeek-V4: ``scale``)
    scale_param: str = "weight_scale_inv"
    # config -> the memory plan's line on how the KV cache was counted, for families whose layers'
    # caches do not grow by a fixed size per token (DeepSeek-V4's windows and compressed entries)
    kv_note: Callable[[Mapping[str, Any]], str] | None = None
    # copies an Ascend output holds where SRC lacks them: {copy: the tensor it copies}, ``{M}`` for
    # each MTP layer (DeepSeek-V4: vllm-ascend's MTP draft reads only its own mtp.M.* embed / head)
    ascend_copies: Mapping[str, str] = field(default_factory=dict)
    # every MTP layer config.json counts must be stored (DeepSeek-V4: its release always holds
    # mtp.*, which vLLM's draft loads). Otherwise all or none: transformers' save_pretrained drops
    # DeepSeek-V3's MTP layer and keeps num_nextn_predict_layers, and cvt's runtime runs without it
    mtp_required: bool = False
    # integer tensors holding ids, by parameter -> the canonical count (`config_keys`) they index:
    # each entry must be in 0..count-1 (DeepSeek-V4's hash-routing ``tid2eid``: expert ids)
    id_params: Mapping[str, str] = field(default_factory=dict)
    # where a residual-stream rotation folds in exactly (`cvt.convert.arch.rotation`, `cvt quantize
    # --rotate`), or why the family refuses one
    rotation: Rotation | str = "no rotation is declared for this family"
    # transformers' save_pretrained names -> the release's, where they differ for the same weight:
    # (regex, replacement), the first whose regex matches a stored name renames it
    # (`cvt.convert.arch.release_names`); every stage then reads the release's names
    saved_renames: tuple[tuple[str, str], ...] = ()
    # fused routed experts stored as one tensor [E, n, k] (transformers' 3-D expert parameters, as
    # Qwen3.5-MoE's BF16 release stores them) -> the release's per-expert tensors: (regex of the
    # stored name, the replacement of each of the k equal row blocks of an expert's [n, k], in
    # order, "{E}" its expert id); every stage reads the per-expert tensors, each a contiguous byte
    # range of the stored one (`cvt.convert.arch.expert_splits`, `cvt.convert.reader`)
    saved_splits: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # its carried towers' linears are built with the quant config by the consumers (vLLM's Qwen3.5
    # vision tower and MTP draft; transformers' compressed-tensors quantizer takes every nn.Linear):
    # compressed-tensors lists their 2-D weights' modules in ``ignore``, so they load float
    carried_linears_ignored: bool = False
    # compressed-tensors ``ignore`` entries (``re:`` patterns) for carried towers a consumer builds
    # under other module names than the release's: transformers' Kimi_K25 renames the vision tower
    # and projector (conversion_mapping.py "kimi_k25") and its compressed-tensors quantizer matches
    # ``ignore`` against its own names, unmapped, taking every other nn.Linear
    carried_ignore: tuple[str, ...] = ()
    # the other module-name prefixes the consumers build a release module under: (release prefix,
    # (prefix, ...)), first match wins. compressed-tensors' ``ignore`` is matched against each
    # consumer's own module names with no mapping where the model class declares none (Kimi-K2.5:
    # vLLM's ``language_model.layers.L`` / ``lm_head``, transformers' ``model.language_model.layers.L``
    # / ``lm_head``), so `ignore_entries` writes a float module under one as a ``re:`` pattern
    # matching every spelling
    consumer_prefixes: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # fused linears a consumer matches ``ignore`` against by the fused module's own name, having no
    # packed_modules_mapping that names its members: (fused leaf, (member leaf, ...)); a module under
    # `consumer_prefixes` whose whole group is float has that name in its pattern too
    consumer_fused: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def input_site(self, name: str, has_norm: Callable[[str], bool],
                   has_linear: Callable[[str], bool]) -> tuple[str, str]:
        """Where linear `name` reads its input, by this table's `calib_norm_inputs` and
        `calib_shared_inputs`: ("out", norm) for a linear reading a norm of its parent, else
        ("in", the first linear of its shared-input group the model has), else ("in", name).
        `has_norm` / `has_linear` (a module's full name): whether the model has it -- the live
        model's modules in calibration (`cvt.quant.methods.sites`), SRC's in the quantize plan."""
        parent, _, leaf = name.rpartition(".")
        norm = self.calib_norm_inputs.get(leaf)
        if norm is not None and has_norm(f"{parent}.{norm}"):
            return ("out", f"{parent}.{norm}")
        for names in self.calib_shared_inputs:
            if leaf in names:
                for n in names:
                    if has_linear(f"{parent}.{n}"):
                        return ("in", f"{parent}.{n}")
        return ("in", name)


@dataclass(frozen=True)
class TensorInfo:
    """What a tensor name means under an architecture."""

    name: str
    module: str
    param: str
    rule: Rule
    layer: int | None
    expert: int | None
    is_mtp: bool

    @property
    def role(self) -> Role:
        return self.rule.role

    @property
    def block(self) -> Block:
        return self.rule.block

    @property
    def split_dim(self) -> int | None:
        """Tensor-parallel split dim of this tensor (None: replicated)."""
        par = self.rule.parallel
        if self.param == "weight_shape":
            return None
        if self.param in WEIGHT_PARAMS or self.param in self.rule.params:
            return {Parallel.COLUMN: 0, Parallel.ROW: 1, Parallel.VOCAB: 0}.get(par)
        if self.param == "bias" and par is Parallel.COLUMN:
            return 0
        return None


# Canonical counts that must be at least 1 when config.json gives them, and what no real model
# exceeds (a config over these is corrupt or hostile: planning it would allocate without bound).
POSITIVE_COUNTS = frozenset({"layers", "hidden", "heads", "kv_heads", "vocab"})
COUNT_LIMITS = {"layers": 4096, "mtp_layers": 64, "experts": 1 << 16, "shared_experts": 1 << 10,
                "experts_per_token": 1 << 10, "dense_layers": 4096, "heads": 1 << 14, "kv_heads": 1 << 14,
                "hidden": 1 << 20, "vocab": 1 << 24}


def _count(config: Mapping[str, Any], canonical: str, key: str) -> int:
    """config[key] as a count (absent or null: 0); ArchError naming the key when it is not a
    non-negative integer (positive for `POSITIVE_COUNTS`) within `COUNT_LIMITS`."""
    v = config.get(key)
    if v is None:
        return 0
    low = 1 if canonical in POSITIVE_COUNTS else 0
    top = COUNT_LIMITS.get(canonical)
    if isinstance(v, bool) or not isinstance(v, int) or v < low or (top is not None and v > top):
        rule = f"an integer >= {low}" + (f" and <= {top}" if top is not None else "")
        raise ArchError(f"config.json {key} = {v!r}: must be {rule}")
    return v


def _compile(pattern: str) -> re.Pattern:
    rx = re.escape(pattern).replace(r"\{L\}", r"(?P<layer>\d+)").replace(r"\{E\}", r"(?P<expert>\d+)")
    rx = rx.replace(r"\{B\}", r"\d+")
    rx = rx.replace(r"\{M\}", r"(?P<mtp>\d+)")
    return re.compile(rx)


def ignore_entries(table: ArchTable, modules: list[str]) -> list[str]:
    """compressed-tensors ``ignore`` entries that keep `modules` (float linears, release names) float
    for every consumer, then the table's `carried_ignore`: a module under one of the table's
    `consumer_prefixes` as one ``re:`` pattern matching its name under the release's prefix and each
    consumer's (with a `consumer_fused` module's name where the module leads a wholly float group),
    any other module as its name. E.g. ``language_model.model.layers.1.mlp.gate`` ->
    ``re:^(language_model\\.model\\.|language_model\\.|model\\.language_model\\.)layers\\.1\\.mlp\\.gate$``."""
    floats = set(modules)
    out: list[str] = []
    for module in modules:
        hit = next(((p, alts) for p, alts in table.consumer_prefixes if module.startswith(p)), None)
        if hit is None:
            out.append(module)
            continue
        prefix, alts = hit
        parent, dot, leaf = module.rpartition(".")
        leaves = [leaf]
        for fused, members in table.consumer_fused:
            if leaf == members[0] and all(f"{parent}{dot}{m}" in floats for m in members):
                leaves.append(fused)
        rest = module[len(prefix):]
        tail = re.escape(rest) if len(leaves) == 1 else (
            re.escape(rest[: len(rest) - len(leaf)]) + "(" + "|".join(map(re.escape, leaves)) + ")")
        out.append("re:^(" + "|".join(map(re.escape, (prefix, *alts))) + ")" + tail + "$")
    return [*out, *table.carried_ignore]


class ArchSpec:
    """A table bound to one config: classifies tensor names and knows the model's counts."""

    def __init__(self, table: ArchTable, config: Mapping[str, Any], model_type: str):
        self.table = table
        self.config = config
        self.model_type = model_type
        self._rules = [(_compile(r.pattern), r) for r in table.rules]
        self.counts = {k: _count(config, k, v) for k, v in table.config_keys.items()}
        self._shapes: dict[str, tuple[int, ...]] | None = None

    def fused_group(self, module: str) -> tuple[str, ...] | None:
        """The modules fused with `module` by the serving stacks (itself included, in the table's
        order), or None when it is fused with nothing."""
        for group in self.table.fused_groups:
            for pattern in group:
                m = _compile(pattern).fullmatch(module)
                if m is not None:
                    g = m.groupdict()
                    return tuple(p.replace("{L}", g.get("layer") or "").replace("{E}", g.get("expert") or "")
                                 .replace("{M}", g.get("mtp") or "") for p in group)
        return None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight the config describes with its shape (the table's `param_shapes`),
        ArchError when config.json cannot describe a model: a missing or non-integer size, or a
        dim that is not positive (named)."""
        if self._shapes is None:
            try:
                shapes = self.table.param_shapes(self.config)
            except KeyError as exc:
                raise ArchError(f"config.json has no {exc.args[0]!r}, which a {self.table.name} model needs") from None
            except (TypeError, ValueError, ZeroDivisionError) as exc:
                raise ArchError(f"config.json cannot describe a {self.table.name} model: {exc}") from None
            for name, shape in shapes.items():
                if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
                    raise ArchError(f"config.json gives {name} the shape {list(shape)}: every dim must be a "
                                    "positive integer (check the sizes it is computed from)")
            self._shapes = shapes
        return self._shapes

    def missing_copies(self, names) -> dict[str, str]:
        """``{copy: the tensor it copies}`` of the table's `ascend_copies` that `names` (SRC's
        tensor names) lack while holding the original, per MTP layer in order; {} for most models."""
        out = {}
        for m in range(self.num_mtp_layers if self.table.ascend_copies else 0):
            for pattern, name in self.table.ascend_copies.items():
                copy = pattern.replace("{M}", str(m))
                if copy not in names and name in names:
                    out[copy] = name
        return out

    def split_parts(self, info: "TensorInfo", size: int) -> tuple[int, ...] | None:
        """The sizes of `info`'s parts (`Rule.parts`) along its stored split dim of `size` (a scale
        or a packed part: the weight's parts scaled to it); None for a tensor of one part.
        ArchError when `size` does not hold the parts in whole rows."""
        if info.rule.parts is None or info.split_dim != 0:
            return None
        logical = info.rule.parts(self.config)
        total = sum(logical)
        if any(p * size % total for p in logical):
            raise ArchError(f"tensor {info.name}: its {size} rows do not hold the parts {list(logical)} of "
                            f"{info.rule.pattern} in whole rows")
        return tuple(p * size // total for p in logical)

    def attention(self) -> list[AttentionKind]:
        """Each decoder layer's attention kind (`ArchTable.attention`; MTP layers excluded)."""
        return self.table.attention.layers(self.config)

    @property
    def num_layers(self) -> int:
        return self.counts.get("layers", 0)

    @property
    def num_experts(self) -> int:
        return self.counts.get("experts", 0)

    @property
    def num_mtp_layers(self) -> int:
        return self.counts.get("mtp_layers", 0)

    def lacks_prefix(self, name: str) -> bool:
        """Whether `name` is a text-model tensor stored without the wrapper's `text_prefix`
        (Kimi-K2.5's ``language_model.``), which the table's names all carry."""
        prefix = self.table.text_prefix
        if not prefix or name.startswith(prefix):
            return False
        module, _, param = (prefix + name).rpartition(".")
        return any(rx.fullmatch(module) is not None and (param in PARAMS or param in r.params) for rx, r in self._rules)

    def prefix_problem(self, names) -> str | None:
        """One line when some of `names` lack the wrapper's `text_prefix` (`lacks_prefix`): how
        many, one of them, the prefix expected; None when every text tensor has it."""
        names = list(names)
        bare = [n for n in names if self.lacks_prefix(n)]
        if not bare:
            return None
        prefix = self.table.text_prefix
        mixed = ", while others have it" if any(n.startswith(prefix) for n in names) else ""
        return (f"{len(bare)} text-model tensors lack the {prefix!r} prefix (e.g. {bare[0]}{mixed}): a "
                f"{self.table.model_types[0]} checkpoint (config.json model_type) names every one under it")

    def classify(self, name: str) -> TensorInfo:
        """Map a tensor name to its role; ArchError when nothing in the table matches."""
        module, _, param = name.rpartition(".")
        if param not in PARAMS and not any(param in r.params for _, r in self._rules):
            raise ArchError(
                f"tensor {name}: parameter {param!r} is not one {self.table.name} checkpoints use "
                f"(known: {', '.join(sorted(PARAMS))})"
            )
        for rx, rule in self._rules:
            m = rx.fullmatch(module)
            if m is None or (param not in PARAMS and param not in rule.params):
                continue
            g = m.groupdict()
            layer = int(g["layer"]) if g.get("layer") is not None else None
            if g.get("mtp") is not None:
                layer = self.num_layers + int(g["mtp"])
            expert = int(g["expert"]) if g.get("expert") is not None else None
            is_mtp = layer is not None and layer >= self.num_layers
            if layer is not None and layer >= self.num_layers + self.num_mtp_layers:
                raise ArchError(
                    f"tensor {name}: layer {layer} is past the model's {self.num_layers} layers"
                    f" + {self.num_mtp_layers} MTP layers (config num_hidden_layers / num_nextn_predict_layers)"
                )
            if rule.mtp_only and not is_mtp:
                raise ArchError(f"tensor {name}: {rule.pattern} exists only in MTP layers, but layer {layer} is not one")
            if expert is not None and self.num_experts and expert >= self.num_experts:
                raise ArchError(f"tensor {name}: expert {expert} is past the config's {self.num_experts} routed experts")
            return TensorInfo(name, module, param, rule, layer, expert, is_mtp)
        if self.lacks_prefix(name):
            p = self.table.text_prefix
            raise ArchError(f"tensor {name}: lacks the {p!r} prefix (expected {p}{name}): a {self.table.model_types[0]} "
                            "checkpoint (config.json model_type) names every text-model tensor under it; one without "
                            "it, or mixing both, is refused")
        raise ArchError(f"tensor {name} does not match any {self.table.name} name pattern (model_type {self.model_type})")
