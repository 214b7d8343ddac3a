"""Architecture tables: roles, split dims, float defaults, MTP, and loud failures."""

from __future__ import annotations

import pytest

from cvt.convert.arch import TABLES, ArchTable, Block, Parallel, Role, arch_for, register
from cvt.convert.arch.attention import MLA, every_layer
from cvt.testing.checkpoints import tiny_deepseek_config
from cvt.errors import ArchError

DSV3 = tiny_deepseek_config()  # 3 layers (layer 0 dense), 4 experts, 1 MTP layer (index 3)


@pytest.mark.parametrize(
    "name,role,split,layer,expert,mtp,float_default",
    [
        ("model.embed_tokens.weight", Role.EMBEDDING, 0, None, None, False, True),
        ("lm_head.weight", Role.HEAD, 0, None, None, False, True),
        ("model.norm.weight", Role.NORM, None, None, None, False, True),
        ("model.layers.0.self_attn.q_a_proj.weight", Role.LINEAR, None, 0, None, False, False),
        ("model.layers.0.self_attn.q_b_proj.weight", Role.LINEAR, 0, 0, None, False, False),
        ("model.layers.0.self_attn.q_b_proj.weight_scale_inv", Role.LINEAR, 0, 0, None, False, False),
        ("model.layers.0.self_attn.kv_b_proj.weight", Role.LINEAR, 0, 0, None, False, True),
        ("model.layers.0.self_attn.o_proj.weight", Role.LINEAR, 1, 0, None, False, False),
        ("model.layers.0.mlp.down_proj.weight", Role.LINEAR, 1, 0, None, False, False),
        ("model.layers.2.mlp.gate.weight", Role.ROUTER, None, 2, None, False, True),
        ("model.layers.2.mlp.gate.e_score_correction_bias", Role.ROUTER, None, 2, None, False, True),
        ("model.layers.2.mlp.experts.3.up_proj.weight", Role.EXPERT, 0, 2, 3, False, False),
        ("model.layers.2.mlp.experts.0.down_proj.weight", Role.EXPERT, 1, 2, 0, False, False),
        ("model.layers.1.mlp.shared_experts.down_proj.weight", Role.SHARED_EXPERT, 1, 1, None, False, False),
        ("model.layers.3.eh_proj.weight", Role.MTP_PROJ, None, 3, None, True, True),
        ("model.layers.3.shared_head.head.weight", Role.HEAD, 0, 3, None, True, True),
        ("model.layers.3.mlp.experts.1.gate_proj.weight", Role.EXPERT, 0, 3, 1, True, False),
    ],
)
def test_deepseek_roles(name, role, split, layer, expert, mtp, float_default):
    info = arch_for(DSV3).classify(name)
    assert (info.role, info.split_dim, info.layer, info.expert, info.is_mtp, info.rule.float_default) == (
        role, split, layer, expert, mtp, float_default)


def test_every_param_of_the_config_classifies():
    for cfg in (DSV3, tiny_deepseek_config(model_type="kimi_k2", q_lora_rank=None)):
        arch = arch_for(cfg)
        for name in arch.table.param_shapes(arch.config):
            arch.classify(name)


@pytest.mark.parametrize(
    "name,error",
    [
        ("model.layers.0.self_attn.mystery.weight", "does not match any deepseek_v3 name pattern"),
        ("model.layers.0.self_attn.o_proj.gamma", "parameter 'gamma'"),
        ("model.layers.1.mlp.experts.4.up_proj.weight", "expert 4 is past the config's 4 routed experts"),
        ("model.layers.4.input_layernorm.weight", "layer 4 is past"),
        ("model.layers.1.eh_proj.weight", "exists only in MTP layers"),
    ],
    ids=["unknown-module", "unknown-param", "expert-out-of-range", "layer-out-of-range", "mtp-only-in-normal-layer"],
)
def test_unmappable_names_raise_naming_the_tensor(name, error):
    with pytest.raises(ArchError, match=error) as exc:
        arch_for(DSV3).classify(name)
    assert name in str(exc.value)


def test_unknown_model_type():
    with pytest.raises(ArchError, match=r"model_type 'mamba9' is not supported \(supported: .*deepseek_v3"):
        arch_for({"model_type": "mamba9"})


def test_text_config_wrapper():
    arch = arch_for({"model_type": "kimi_k25", "text_config": {**DSV3, "model_type": "kimi_k2"}})
    assert arch.table.name == "kimi_k25" and arch.model_type == "kimi_k2"       # DeepSeek-V3's, wrapped
    prefixed = arch.classify("language_model.model.layers.0.mlp.up_proj.weight")
    assert (prefixed.role, prefixed.layer, prefixed.split_dim) == (Role.LINEAR, 0, 0)
    # the release's names only: a text name without the prefix is refused, naming it (issue 37)
    with pytest.raises(ArchError, match="lacks the 'language_model.' prefix"):
        arch.classify("model.layers.0.mlp.up_proj.weight")


def test_duplicate_registration_fails_loudly():
    with pytest.raises(ArchError, match="already registered"):
        register(ArchTable(name="again", model_types=("deepseek_v3",), rules=(), display="Again",
                           attention=every_layer(MLA)))
    assert TABLES["deepseek_v3"].name == "deepseek_v3"


QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "vocab_size": 100, "num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "intermediate_size": 96, "mlp_only_layers": [0]}


def test_qwen3_moe_and_dense():
    arch = arch_for(QWEN3_MOE)
    shapes = arch.table.param_shapes(arch.config)
    assert "model.layers.0.mlp.down_proj.weight" in shapes  # mlp_only layer
    assert shapes["model.layers.1.mlp.experts.3.down_proj.weight"] == (64, 32)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (32, 64)
    for name in shapes:
        arch.classify(name)
    info = arch.classify("model.layers.1.mlp.gate.weight")
    assert info.role is Role.ROUTER and info.rule.float_default
    assert arch.classify("model.layers.1.self_attn.k_norm.weight").role is Role.NORM
    for mt in ("qwen3", "llama"):
        dense = arch_for({**QWEN3_MOE, "model_type": mt, "num_experts": 0, "tie_word_embeddings": True})
        names = dense.table.param_shapes(dense.config)
        assert "lm_head.weight" not in names and all(".experts." not in n for n in names)
        with pytest.raises(ArchError):
            dense.classify("model.layers.1.mlp.experts.0.up_proj.weight")
    assert ("model.layers.0.self_attn.q_norm.weight" in
            arch_for({**QWEN3_MOE, "model_type": "qwen3"}).table.param_shapes({**QWEN3_MOE, "model_type": "qwen3"}))


def test_blocks_and_parallel_styles_cover_tp_groups():
    arch = arch_for(DSV3)
    assert arch.classify("model.layers.0.self_attn.o_proj.weight").block is Block.ATTN
    assert arch.classify("model.layers.0.mlp.up_proj.weight").block is Block.MLP
    assert arch.classify("model.layers.1.mlp.experts.0.up_proj.weight").block is Block.MOE
    assert arch.classify("model.embed_tokens.weight").rule.parallel is Parallel.VOCAB


def test_families_share_the_decoder_skeleton_and_swiglu_rows():
    """Every table starts with the Hugging Face decoder skeleton (`base.DECODER_RULES`), and each
    SwiGLU MLP it names (dense, experts, shared experts) is `base.swiglu_rules`: one definition
    of which linears are column / row split."""
    from cvt.convert.arch.base import DECODER_RULES, swiglu_rules

    assert [r.pattern for r in swiglu_rules("m", Role.EXPERT, Block.MOE)] == ["m.gate_proj", "m.up_proj", "m.down_proj"]
    assert [r.parallel for r in swiglu_rules("m", Role.EXPERT, Block.MOE)] == [Parallel.COLUMN, Parallel.COLUMN,
                                                                                Parallel.ROW]
    for name in ("deepseek_v3", "deepseek_v32", "qwen3", "qwen3_moe"):
        rules = TABLES.get(name).rules
        assert rules[:len(DECODER_RULES)] == DECODER_RULES, name
        for i, r in enumerate(rules):
            if r.pattern.endswith(".gate_proj"):
                prefix = r.pattern[:-len(".gate_proj")]
                assert rules[i:i + 3] == swiglu_rules(prefix, r.role, r.block), r.pattern


def test_what_a_family_adds_is_table_data():
    """DeepSeek-V4's MTP draft copies an Ascend output holds (`ArchTable.ascend_copies`: one pair
    per MTP layer, only those the source lacks) and the layers that cache an indexer key (their
    attention kind, `ArchTable.attention`) are read from the tables; other families have neither."""
    from cvt.testing.checkpoints import tiny_deepseek_v32_config, tiny_glm_moe_dsa_config
    from cvt.testing.checkpoints_v4 import tiny_deepseek_v4_config

    v4 = arch_for(tiny_deepseek_v4_config(num_nextn_predict_layers=2))
    names = {"embed.weight", "head.weight", "mtp.0.head.weight"}
    assert v4.missing_copies(names) == {"mtp.0.emb.tok_emb.weight": "embed.weight",
                                        "mtp.1.emb.tok_emb.weight": "embed.weight",
                                        "mtp.1.head.weight": "head.weight"}
    assert v4.missing_copies({"head.weight"}) == {"mtp.0.head.weight": "head.weight", "mtp.1.head.weight": "head.weight"}
    assert arch_for(DSV3).missing_copies(names) == {}
    v32 = tiny_deepseek_v32_config()
    def indexed(cfg):
        return sum(k.indexer_key for k in arch_for(cfg).attention())

    assert indexed(v32) == v32["num_hidden_layers"]
    assert indexed(tiny_glm_moe_dsa_config(indexer_types=["full", "shared", "full"])) == 2
    assert indexed(DSV3) == 0


def test_the_quantize_stage_and_the_memory_plan_name_no_model():
    """The quantize stage and the memory plan read per-model knowledge from the tables: no
    comparison of a model_type with a name there (the formats' `refused_models` is the formats' data)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    files = sorted((root / "quant" / "stage").glob("*.py")) + [root / "convert" / "memory_plan.py",
                                                               root / "convert" / "kv_bytes.py"]
    bad = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                text = ast.unparse(node)
                named = any((isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value != "model_type")
                            or (isinstance(n, ast.Name) and n.id.isupper()) for n in ast.walk(node))
                if "model_type" in text and named:  # against a name, or a module's MODEL_TYPE
                    bad.append(f"{path.relative_to(root)}:{node.lineno}: {text}")
    assert not bad, "\n".join(bad)
