"""DeepSeek-V4 (Flash / Pro; model_type deepseek_v4), under the release's own tensor names.

The release keeps DeepSeek's names (``embed``, ``layers.N.attn.wq_a``, ``ffn.experts.E.w1``,
``mtp.M.*``, ``head``; transformers renames them on load, ``conversion_mapping.py``
"deepseek_v4"), which is what vLLM / vllm-ascend load, so cvt reads and writes these names.
Per layer, with d = hidden_size, H = num_attention_heads, D = head_dim (one shared KV head),
q = q_lora_rank, G / R = o_groups / o_lora_rank, hc = hc_mult, mix = (2 + hc) * hc,
r = the layer's compress ratio (0: sliding window only), c = 2 when r == 4 (overlapping
windows) else 1, Hi / Di = index_n_heads / index_head_dim, I = moe_intermediate_size:

    tensor (under layers.N. / mtp.M.)    shape            release        TP          float under cvt
    hc_{attn,ffn}_fn / _base / _scale    [mix, hc*d] / [mix] / [3]  f32    replicated  always
    attn_norm / ffn_norm .weight         [d]              bf16           replicated  always
    attn.attn_sink                       [H]              f32            dim 0       always
    attn.wq_a                            [q, d]           FP8            replicated  no
    attn.q_norm / kv_norm .weight        [q] / [D]        bf16           replicated  always
    attn.wq_b                            [H*D, q]         FP8            dim 0       no
    attn.wkv                             [D, d]           FP8            replicated  no
    attn.wo_a                            [G*R, H*D/G]     FP8            dim 0       yes (1)
    attn.wo_b                            [d, G*R]         FP8            dim 1       yes (1)
    attn.compressor.ape (r > 0)          [r, c*D]         f32            replicated  always
    attn.compressor.wkv / .wgate         [c*D, d]         f32            replicated  yes (1)
    attn.compressor.norm.weight          [D]              bf16           replicated  always
    attn.indexer.wq_b (r == 4)           [Hi*Di, q]       FP8            dim 0       yes (1)
    attn.indexer.weights_proj            [Hi, d]          bf16           dim 0       yes (1)
    attn.indexer.compressor.*            as above, D = Di, c = 2         replicated  yes (1)
    ffn.gate.weight                      [E, d]           bf16           replicated  always
    ffn.gate.bias (scored layers)        [E]              f32            replicated  always
    ffn.gate.tid2eid (hash layers)       [vocab, top-k]   int64          replicated  always
    ffn.experts.E.w1 / w3, w2            [I, d], [d, I]   FP4 (2)        EP; moe_tp  no
    ffn.shared_experts.w1 / w3, w2       [I, d], [d, I]   FP8            moe_tp      no
    mtp.M.e_proj / h_proj                [d, d]           FP8            replicated  yes
    mtp.M.enorm / hnorm / norm .weight   [d]              bf16           replicated  always
    mtp.M.hc_head_fn / _base / _scale    [hc, hc*d] / [hc] / [1]  f32    replicated  always
    mtp.M.emb.tok_emb / head .weight (3) [vocab, d]       bf16           vocab (dim 0) always (carried)

and at the top: ``embed.weight`` [vocab, d] (vocab-parallel), ``head.weight`` [vocab, d]
(column), ``norm.weight``, ``hc_head_fn`` / ``hc_head_base`` / ``hc_head_scale``. Layers below
``num_hash_layers`` route by ``tid2eid[token]`` (no bias); MTP layers always score.

Every FP8 linear ``X.weight`` (float8_e4m3fn) has its 128x128 block scale in ``X.scale``
(float8_e8m0fnu; `ArchTable.scale_param`); with ``expert_dtype: "fp4"`` each routed expert
``X.weight`` is int8 ``[n, k/2]`` (two E2M1 codes per byte, element 2i in the low nibble) with
``X.scale`` float8_e8m0fnu ``[n, k/32]`` (DeepSeek's V4 ``inference/convert.py``,
``cast_e2m1fn_to_e4m3fn``; ``inference/model.py``, ``Linear``); with ``"fp8"`` the experts
are FP8 blocks like the rest.

TP column: DeepSeek's ``inference/convert.py`` ``mapping`` (wq_b, wo_a, attn_sink,
weights_proj, embed, head: dim 0; wo_b: dim 1; every other name whole on each rank).
(1) msModelSlim's V4 recipes keep ``wo_a``, ``wo_b``, the compressors and the indexer float.
(2) int8-packed E2M1 with E8M0 group-32 scales under ``expert_dtype: "fp4"``; FP8 under "fp8".
(3) copies of ``embed`` / ``head`` for the MTP draft: in V4-Flash-Base, not in V4-Flash (so not in
    `param_shapes`); vLLM's and vllm-ascend's DeepSeekV4MTP.load_weights read only ``mtp.0.*``.
    ``Role.CARRIED``: copied byte for byte by every stage, never run (cvt's MTPBlock uses embed /
    head, as DeepSeek's inference/model.py ties them); ``cvt shard`` splits them by vocab with
    embed_tp / lmhead_tp, as vllm-ascend's draft holds them (VocabParallelEmbedding, ParallelLMHead
    in vllm_ascend/models/deepseek_v4/mtp.py).
    An Ascend output of a release without them gets them (BF16, FLOAT, equal to ``embed`` / ``head``;
    `ArchTable.ascend_copies`): vllm-ascend's ``DeepSeekV4MTP.load_weights`` (mtp.py @ 182b75e;
    v0.23.0 models/deepseek_v4_mtp.py) takes the draft's embedding from ``mtp.0.emb.tok_emb.weight``
    and its ParallelLMHead from ``mtp.0.head.weight``, and asks ``AscendModelSlimConfig.get_quant_method``
    for prefix ``mtp.0.head`` (a KeyError when the description has no ``mtp.0.head.weight``); it maps
    the top-level ``embed.weight`` / ``head.weight`` onto them only under the ``deepseek_v4_fp8`` config.
"""

from __future__ import annotations

from typing import Any, Mapping

from cvt.convert.arch import checks
from cvt.convert.arch.attention import V4, V4_CACHE_DEFAULTS, LayerAttention, v4_kind
from cvt.convert.arch.base import ArchTable, Block, Parallel, Role, Rule

C, R, V, REP = Parallel.COLUMN, Parallel.ROW, Parallel.VOCAB, Parallel.REPLICATED
SCALE = frozenset({"scale"})  # the release's FP8 block / FP4 group scale, split like its weight
HC_LAYER = frozenset({f"hc_{part}_{p}" for part in ("attn", "ffn") for p in ("fn", "base", "scale")})
HC_HEAD = frozenset({"hc_head_fn", "hc_head_base", "hc_head_scale"})
LAYER_TYPES = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
DEFAULT_HASH_LAYERS = 3  # transformers' DeepseekV4Config.default_num_hash_layers

# What an absent key means to transformers' DeepseekV4Config (and cvt's runtime)
# (sliding_window and index_head_dim: the attention kinds' own, `cvt.convert.arch.attention`)
_W, _DI = V4_CACHE_DEFAULTS["sliding_window"], V4_CACHE_DEFAULTS["index_head_dim"]
DEFAULTS = {"scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
            "swiglu_limit": 10.0, "sliding_window": _W, "hc_mult": 4, "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-6, "index_n_heads": 64, "index_head_dim": _DI, "index_topk": 512,
            "rope_theta": 10000.0, "compress_rope_theta": 160000.0}


def compress_ratios(cfg: Mapping[str, Any]) -> list[int]:
    """Each decoder layer's compress ratio, then each MTP layer's: the release's
    ``compress_ratios`` (one per layer, MTP layers after; a missing MTP entry is 0), or
    transformers' ``layer_types`` + ``compress_rates``."""
    n, n_mtp = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers") or 0
    if cfg.get("compress_ratios") is not None:
        out = list(cfg["compress_ratios"])
    elif cfg.get("layer_types") is not None:
        rates = {**{"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
                 **(cfg.get("compress_rates") or {})}
        out = [0 if t == "sliding_attention" else rates[t] for t in cfg["layer_types"]]
    else:  # transformers' default schedule: 2 x HCA, then CSA / HCA interleaved
        out = [128] * min(n, 2) + [4 if i % 2 else 128 for i in range(max(n - 2, 0))]
    out = out[:n + n_mtp]
    return out + [0] * (n + n_mtp - len(out))


def num_hash_layers(cfg: Mapping[str, Any]) -> int:
    """Decoder layers routed by ``tid2eid`` (``num_hash_layers``, or transformers' ``mlp_layer_types``)."""
    if cfg.get("mlp_layer_types") is not None:
        return sum(t == "hash_moe" for t in cfg["mlp_layer_types"])
    v = cfg.get("num_hash_layers")
    return DEFAULT_HASH_LAYERS if v is None else v


def _compressor(p: str, ratio: int, dim: int, d: int) -> dict[str, tuple[int, ...]]:
    c = 2 if ratio == 4 else 1
    return {f"{p}.ape": (ratio, c * dim), f"{p}.wkv.weight": (c * dim, d), f"{p}.wgate.weight": (c * dim, d),
            f"{p}.norm.weight": (dim,)}


def param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor of a DeepSeek-V4 release with its logical shape, from config alone (MTP
    layers included; scales not; FP4 experts as their unpacked [n, k])."""
    d, heads, dim = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    q, groups, o_rank = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    n, n_mtp, vocab = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers") or 0, cfg["vocab_size"]
    experts, inter, topk = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    hc = cfg.get("hc_mult", DEFAULTS["hc_mult"])
    ih = cfg.get("index_n_heads", DEFAULTS["index_n_heads"])
    idim = cfg.get("index_head_dim", DEFAULTS["index_head_dim"])
    if heads * dim % groups:
        raise ValueError(f"num_attention_heads * head_dim ({heads * dim}) is not a multiple of o_groups ({groups})")
    ratios, n_hash = compress_ratios(cfg), num_hash_layers(cfg)
    mix = (2 + hc) * hc
    out: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, d)}
    for i in range(n + n_mtp):
        p = f"layers.{i}" if i < n else f"mtp.{i - n}"
        if i >= n:
            out.update({f"{p}.e_proj.weight": (d, d), f"{p}.h_proj.weight": (d, d), f"{p}.enorm.weight": (d,),
                        f"{p}.hnorm.weight": (d,)})
        for part in ("attn", "ffn"):
            out.update({f"{p}.hc_{part}_fn": (mix, hc * d), f"{p}.hc_{part}_base": (mix,), f"{p}.hc_{part}_scale": (3,)})
        out[f"{p}.attn_norm.weight"] = (d,)
        a = f"{p}.attn"
        out.update({f"{a}.attn_sink": (heads,), f"{a}.wq_a.weight": (q, d), f"{a}.q_norm.weight": (q,),
                    f"{a}.wq_b.weight": (heads * dim, q), f"{a}.wkv.weight": (dim, d), f"{a}.kv_norm.weight": (dim,),
                    f"{a}.wo_a.weight": (groups * o_rank, heads * dim // groups),
                    f"{a}.wo_b.weight": (d, groups * o_rank)})
        r = ratios[i]
        if r:
            out.update(_compressor(f"{a}.compressor", r, dim, d))
        if r == 4:
            out.update({f"{a}.indexer.wq_b.weight": (ih * idim, q), f"{a}.indexer.weights_proj.weight": (ih, d)})
            out.update(_compressor(f"{a}.indexer.compressor", r, idim, d))
        out[f"{p}.ffn_norm.weight"] = (d,)
        f = f"{p}.ffn"
        out[f"{f}.gate.weight"] = (experts, d)
        if i < n_hash:
            out[f"{f}.gate.tid2eid"] = (vocab, topk)
        else:
            out[f"{f}.gate.bias"] = (experts,)
        for e in range(experts):
            out.update({f"{f}.experts.{e}.w1.weight": (inter, d), f"{f}.experts.{e}.w2.weight": (d, inter),
                        f"{f}.experts.{e}.w3.weight": (inter, d)})
        out.update({f"{f}.shared_experts.w1.weight": (inter, d), f"{f}.shared_experts.w2.weight": (d, inter),
                    f"{f}.shared_experts.w3.weight": (inter, d)})
        if i >= n:
            out[f"{p}.norm.weight"] = (d,)
            out.update({f"{p}.hc_head_fn": (hc, hc * d), f"{p}.hc_head_base": (hc,), f"{p}.hc_head_scale": (1,)})
    out.update({"norm.weight": (d,), "head.weight": (vocab, d), "hc_head_fn": (hc, hc * d), "hc_head_base": (hc,),
                "hc_head_scale": (1,)})
    return out


def attention_kinds(cfg: Mapping[str, Any]) -> list:
    """Each decoder layer's attention kind, by its compress ratio (`cvt.convert.arch.attention.V4`:
    sliding window only, CSA at 4, HCA at 128)."""
    return [v4_kind(r) for r in compress_ratios(cfg)[:cfg["num_hidden_layers"]]]


def kv_note(cfg: Mapping[str, Any]) -> str:
    """How the memory plan counts the cache (the kinds' own bytes, as DeepSeek's V4
    inference/model.py `Attention` sizes it): every layer keeps the last sliding_window K=V
    entries of head_dim; a layer at ratio r > 0 adds one head_dim entry per r positions, and at
    r == 4 the indexer one index_head_dim key per 4 positions."""
    n, dim = cfg["num_hidden_layers"], cfg["head_dim"]
    window = cfg.get("sliding_window", DEFAULTS["sliding_window"])
    idim = cfg.get("index_head_dim", DEFAULTS["index_head_dim"])
    ratios = compress_ratios(cfg)[:n]
    kinds = {r: ratios.count(r) for r in sorted(set(ratios))}
    what = ", ".join(f"{c} x {'sliding window' if r == 0 else f'rate {r}'}" for r, c in kinds.items())
    return (f"DeepSeek-V4 layers ({what}): last {window} K=V entries of {dim} per layer, plus "
            f"{dim} per r positions at rate r and the indexer's {idim} per 4 at rate 4")


def _layer_rules(L: str) -> tuple[Rule, ...]:
    """The rules of one decoder layer at prefix `L` (``layers.{L}`` or ``mtp.{M}``)."""
    a, f = f"{L}.attn", f"{L}.ffn"

    def lin(mod, par, block, role=Role.LINEAR, float_default=False):
        return Rule(mod, role, par, block, quantizable=True, float_default=float_default, params=SCALE)

    def compressor(p):
        return (Rule(p, Role.NORM, REP, Block.ATTN, float_default=True, params=frozenset({"ape"})),
                Rule(f"{p}.wkv", Role.LINEAR, REP, Block.ATTN, quantizable=True, float_default=True),
                Rule(f"{p}.wgate", Role.LINEAR, REP, Block.ATTN, quantizable=True, float_default=True),
                Rule(f"{p}.norm", Role.NORM, REP, Block.ATTN, float_default=True))

    return (
        Rule(L, Role.NORM, REP, Block.NORM, float_default=True, params=HC_LAYER),
        Rule(f"{L}.attn_norm", Role.NORM, REP, Block.NORM, float_default=True),
        Rule(f"{L}.ffn_norm", Role.NORM, REP, Block.NORM, float_default=True),
        # the per-head sinks split with the heads (role LINEAR: the attention's tp axis; never quantized)
        Rule(a, Role.LINEAR, C, Block.ATTN, float_default=True, params=frozenset({"attn_sink"})),
        lin(f"{a}.wq_a", REP, Block.ATTN),
        Rule(f"{a}.q_norm", Role.NORM, REP, Block.ATTN, float_default=True),
        lin(f"{a}.wq_b", C, Block.ATTN),
        lin(f"{a}.wkv", REP, Block.ATTN),
        Rule(f"{a}.kv_norm", Role.NORM, REP, Block.ATTN, float_default=True),
        lin(f"{a}.wo_a", C, Block.ATTN, float_default=True),
        lin(f"{a}.wo_b", R, Block.ATTN, float_default=True),
        *compressor(f"{a}.compressor"),
        lin(f"{a}.indexer.wq_b", C, Block.ATTN, float_default=True),
        Rule(f"{a}.indexer.weights_proj", Role.LINEAR, C, Block.ATTN, float_default=True),
        *compressor(f"{a}.indexer.compressor"),
        Rule(f"{f}.gate", Role.ROUTER, REP, Block.MOE, float_default=True, params=frozenset({"tid2eid"})),
        lin(f"{f}.experts.{{E}}.w1", C, Block.MOE, Role.EXPERT),
        lin(f"{f}.experts.{{E}}.w3", C, Block.MOE, Role.EXPERT),
        lin(f"{f}.experts.{{E}}.w2", R, Block.MOE, Role.EXPERT),
        lin(f"{f}.shared_experts.w1", C, Block.MOE, Role.SHARED_EXPERT),
        lin(f"{f}.shared_experts.w3", C, Block.MOE, Role.SHARED_EXPERT),
        lin(f"{f}.shared_experts.w2", R, Block.MOE, Role.SHARED_EXPERT),
    )


# transformers 5.24's save_pretrained (DeepseekV4ForCausalLM: conversion_mapping.py "deepseek_v4"
# undone) -> the release: names under ``model.`` but for ``head``; embed / norm / hc_head keep the
# names of transformers' modules; an attention's ``kv_norm`` comes back as ``norm`` (the load-time
# rename ``.norm.`` -> ``.kv_norm.``, meant for the compressors, reversed for both). No MTP layer
# (transformers builds none), so `mtp_required` does not hold for this layout (`cvt.convert.validate`).
SAVED_RENAMES = (
    (r"^model\.embed_tokens\.weight$", "embed.weight"),
    (r"^model\.norm\.weight$", "norm.weight"),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^model\.layers\.(\d+)\.attn\.norm\.", r"layers.\1.attn.kv_norm."),
    (r"^model\.layers\.", "layers."),
)

M = "mtp.{M}"
TABLE = ArchTable(
    name="deepseek_v4",
    display="DeepSeek-V4",
    attention=LayerAttention(tuple(V4.values()), attention_kinds),
    model_types=("deepseek_v4",),
    # hc_pre / hc_post mix the hc_mult residual copies with weights computed from all of them, and
    # the compressor / indexer read them too: not yet worked through, so refused rather than guessed
    rotation="its hyper-connections (hc_attn_fn / hc_ffn_fn over every residual copy) are not mapped for rotation",
    param_shapes=param_shapes,
    explicit_defaults=DEFAULTS,
    config_checks=checks.deepseek_v4,
    scale_param="scale",
    kv_note=kv_note,
    # attn_norm's output -> wq_a, wkv; the MoE input -> each expert's w1, w3 (its folds: the runtime
    # block's smooth_groups)
    calib_shared_inputs=(("wq_a", "wkv"), ("w1", "w3")),
    ascend_copies={"mtp.{M}.emb.tok_emb.weight": "embed.weight", "mtp.{M}.head.weight": "head.weight"},  # (3)
    mtp_required=True,
    saved_renames=SAVED_RENAMES,
    id_params={"tid2eid": "experts"},  # token id -> the experts a hash layer routes it to
    fused_groups=tuple(  # each expert's w1 / w3 (vLLM's w13), the shared experts' gate_up
        grp for L in ("layers.{L}", M) for grp in (
            (f"{L}.ffn.experts.{{E}}.w1", f"{L}.ffn.experts.{{E}}.w3"),
            (f"{L}.ffn.shared_experts.w1", f"{L}.ffn.shared_experts.w3"))),
    config_keys={
        "layers": "num_hidden_layers",
        "experts": "n_routed_experts",
        "shared_experts": "n_shared_experts",
        "experts_per_token": "num_experts_per_tok",
        "mtp_layers": "num_nextn_predict_layers",
        "vocab": "vocab_size",
        "hidden": "hidden_size",
        "heads": "num_attention_heads",
    },
    rules=(
        Rule("embed", Role.EMBEDDING, V, Block.EMBED, float_default=True),
        Rule("head", Role.HEAD, C, Block.HEAD, float_default=True),
        Rule("norm", Role.NORM, REP, Block.NORM, float_default=True),
        Rule("", Role.NORM, REP, Block.HEAD, float_default=True, params=HC_HEAD),
        *_layer_rules("layers.{L}"),
        *_layer_rules(M),
        Rule(f"{M}.e_proj", Role.MTP_PROJ, REP, Block.MTP, quantizable=True, float_default=True, mtp_only=True,
             params=SCALE),
        Rule(f"{M}.h_proj", Role.MTP_PROJ, REP, Block.MTP, quantizable=True, float_default=True, mtp_only=True,
             params=SCALE),
        Rule(f"{M}.enorm", Role.NORM, REP, Block.MTP, float_default=True, mtp_only=True),
        Rule(f"{M}.hnorm", Role.NORM, REP, Block.MTP, float_default=True, mtp_only=True),
        Rule(f"{M}.norm", Role.NORM, REP, Block.MTP, float_default=True, mtp_only=True),
        Rule(M, Role.NORM, REP, Block.MTP, float_default=True, mtp_only=True, params=HC_HEAD),
        # the MTP layer's own copies of embed / head (3): carried, cvt's MTPBlock runs embed / head
        # carried, but split by vocab as embed / head are (vllm-ascend's DeepSeekV4MTP holds them in
        # a VocabParallelEmbedding and a ParallelLMHead): `cvt.convert.memory_plan.axis_of`
        Rule(f"{M}.emb.tok_emb", Role.CARRIED, V, Block.CARRIED, float_default=True, mtp_only=True),
        Rule(f"{M}.head", Role.CARRIED, C, Block.CARRIED, float_default=True, mtp_only=True),
    ),
)
