"""DeepSeek-V3.2(-Exp) (model_type deepseek_v32): DeepSeek-V3 plus DeepSeek Sparse Attention.

Every attention layer (MTP layers included) gains a lightning indexer under
``self_attn.indexer``; everything else is the DeepSeek-V3 table. Per layer, with
h = hidden_size, Hi / Di = index_n_heads / index_head_dim, q_lora = q_lora_rank:

    tensor                        shape            in the FP8 release   under TP
    indexer.wq_b.weight           [Hi*Di, q_lora]  FP8 + block scale    replicated
    indexer.wk.weight             [Di, h]          FP8 + block scale    replicated
    indexer.weights_proj.weight   [Hi, h]          BF16                 replicated
    indexer.k_norm.weight / bias  [Di]             float (LayerNorm)    replicated

Sources for the FP8 column: the official demo (deepseek-ai/DeepSeek-V3.2-Exp
inference/model.py, commit 3b99a53, class Indexer) builds wq_b and wk as plain `Linear`
(FP8 with a block `scale` when the checkpoint is FP8) and weights_proj with
``dtype=torch.get_default_dtype()`` (never FP8); its LayerNorm keeps weight and bias in
float32. vLLM (vllm/model_executor/models/deepseek_v2.py @ 002d607, `_try_load_fp8_indexer_wk`) says the
same from the loading side: "WK is stored in FP8 with a separate weight_scale_inv, while
weights_proj is stored in BF16".

Sources for the TP column: official inference/convert.py maps wq_b, wk, k_norm and
weights_proj with split dim None (every model-parallel rank gets the whole tensor); vLLM's
`Indexer` builds wq_b as ReplicatedLinear and fuses wk + weights_proj into one
MergedColumnParallelLinear with ``disable_tp=True, quant_config=None`` (FP8 wk is dequantized
to BF16 on load); vllm-ascend (vllm_ascend/models/layers/sfa.py @ 06ce70a, `Indexer`) builds all three as
ReplicatedLinear. So the indexer is replicated on every TP rank and computes the same top-k
everywhere (the official code asserts that with a broadcast).

Float by default: all four. weights_proj is never FP8 anywhere (not quantizable); wq_b and wk
are FP8 in the release but stay float under cvt's schemes: the top-k selection is discrete
(a small error flips which tokens are attended), vLLM serves wk unquantized (fused with
weights_proj under ``quant_config=None``), and vllm-ascend looks every indexer linear up in the
msModelSlim description (a missing entry fails its start-up), where cvt writes FLOAT.
"""

from __future__ import annotations

from cvt.convert.arch import checks, deepseek_v3, rotation
from cvt.convert.arch.attention import SPARSE_MLA, every_layer
from cvt.convert.arch.base import ArchTable, Block, Parallel, Role, Rule

REP = Parallel.REPLICATED
L = "model.layers.{L}"

# transformers' DeepseekV32Config defaults (what an absent key means): also written explicitly
# into every output config, next to the DeepSeek-V3 routing defaults
INDEX_DEFAULTS = {"index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64}
DEFAULTS = {**deepseek_v3.DEFAULTS, **INDEX_DEFAULTS}

IX = f"{L}.self_attn.indexer"
INDEXER_RULES = (
    Rule(f"{IX}.wq_b", Role.LINEAR, REP, Block.ATTN, quantizable=True, float_default=True),
    Rule(f"{IX}.wk", Role.LINEAR, REP, Block.ATTN, quantizable=True, float_default=True),
    Rule(f"{IX}.weights_proj", Role.LINEAR, REP, Block.ATTN, float_default=True),
    Rule(f"{IX}.k_norm", Role.NORM, REP, Block.ATTN, float_default=True),
    # the indexer C8's q_rot / k_rot of a w8a8c8 Ascend output (cvt.qtensor.indexer_c8)
    Rule(IX, Role.KV_CACHE, REP, Block.ATTN, float_default=True),
)


def indexer_shapes(cfg, layer: int) -> dict[str, tuple[int, ...]]:
    """The indexer tensors of one layer with their shapes."""
    h, q_lora = cfg["hidden_size"], cfg["q_lora_rank"]
    heads = cfg.get("index_n_heads") or INDEX_DEFAULTS["index_n_heads"]
    dim = cfg.get("index_head_dim") or INDEX_DEFAULTS["index_head_dim"]
    p = f"model.layers.{layer}.self_attn.indexer"
    return {f"{p}.wq_b.weight": (heads * dim, q_lora), f"{p}.wk.weight": (dim, h),
            f"{p}.k_norm.weight": (dim,), f"{p}.k_norm.bias": (dim,), f"{p}.weights_proj.weight": (heads, h)}


def param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3's weights plus each layer's indexer, right after its o_proj (MTP layers too:
    the release's layer 61 has one)."""
    if not cfg.get("q_lora_rank"):
        raise ValueError("q_lora_rank must be set: the indexer's query is read from q_a_layernorm's output")
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in deepseek_v3.param_shapes(cfg).items():
        out[name] = shape
        if name.endswith(".self_attn.o_proj.weight"):
            out.update(indexer_shapes(cfg, int(name.split(".")[2])))
    return out


TABLE = ArchTable(
    name="deepseek_v32",
    display="DeepSeek-V3.2",
    attention=every_layer(SPARSE_MLA),  # every layer runs (and caches the key of) its own indexer
    rotation=rotation.DEEPSEEK_V32,
    model_types=("deepseek_v32",),
    param_shapes=param_shapes,
    explicit_defaults=DEFAULTS,
    config_checks=checks.deepseek_v32,
    fused_groups=deepseek_v3.TABLE.fused_groups + (
        # vLLM's Indexer.wk_weights_proj (float: quant_config=None)
        (f"{IX}.wk", f"{IX}.weights_proj"),
    ),
    config_keys=deepseek_v3.TABLE.config_keys,
    calib_shared_inputs=deepseek_v3.TABLE.calib_shared_inputs,
    calib_norm_inputs=deepseek_v3.TABLE.calib_norm_inputs,
    rules=deepseek_v3.TABLE.rules + INDEXER_RULES,
)
