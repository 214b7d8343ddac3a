"""The attention kinds (`cvt.convert.arch.attention`): every architecture declares its layers' kinds
and what their caches hold, and the declaration gives the numbers the scattered tests gave before."""

from __future__ import annotations

import math

import pytest

from cvt.convert.arch import TABLES, WRAPPERS, arch_for
from cvt.convert.arch.attention import GQA, KINDS, MLA, SPARSE_MLA, SPARSE_MLA_SHARED, LayerAttention
from cvt.testing.checkpoints import (tiny_deepseek_config, tiny_deepseek_v32_config, tiny_glm_moe_dsa_config,
                                     tiny_kimi_k25_config, tiny_qwen3_config)
from cvt.testing.checkpoints_gpt_oss import tiny_gpt_oss_config
from cvt.testing.checkpoints_qwen3_5 import tiny_qwen3_5_config, tiny_qwen3_next_config
from cvt.testing.checkpoints_v4 import tiny_deepseek_v4_config

CONFIGS = {"deepseek_v3": tiny_deepseek_config, "deepseek_v32": tiny_deepseek_v32_config,
           "glm_moe_dsa": lambda: tiny_glm_moe_dsa_config(indexer_types=["full", "shared", "full"]),
           "kimi_k25": tiny_kimi_k25_config, "qwen3": lambda: tiny_qwen3_config(moe=False),
           "qwen3_moe": tiny_qwen3_config, "deepseek_v4": tiny_deepseek_v4_config,
           "qwen3_5_moe": tiny_qwen3_5_config, "qwen3_5_moe_text": tiny_qwen3_5_config,
           "qwen3_5": lambda: tiny_qwen3_5_config(moe=False), "qwen3_5_text": lambda: tiny_qwen3_5_config(moe=False),
           "gpt_oss": tiny_gpt_oss_config, "qwen3_next": tiny_qwen3_next_config}

# memory_plan(config, layout, scheme, kv_tokens=1001).ranks[0].kv_cache before the kinds existed
# (commit 6a18535: is_mla / kv_lora_rank tests, ArchTable.indexer_layers and ArchTable.kv_cache):
# (bf16 world 1, bf16 tp 2, w8a8c8 world 1)
BEFORE = {"deepseek_v3": (528528, 528528, 312312), "deepseek_v32": (768768, 768768, 552552),
          "glm_moe_dsa": (688688, 688688, 472472), "kimi_k25": (528528, 528528, 312312),
          "qwen3": (576576, 288288, 288288), "qwen3_moe": (576576, 288288, 288288),
          "deepseek_v4": (52992, 52992, 52992)}


def test_every_architecture_declares_its_attention_and_cache():
    """Every registered table (and wrapper) declares its layers' kinds; each kind says what its cache
    holds (entries, layout, runtime cache object, bytes); a table without it cannot be built."""
    names = {t.name for t in TABLES.values()} | set(WRAPPERS)
    assert names <= set(CONFIGS), f"a tiny config for {sorted(names - set(CONFIGS))}"
    for name in sorted(names):
        arch = arch_for(CONFIGS[name]())
        decl = arch.table.attention
        assert isinstance(decl, LayerAttention) and decl.kinds, name
        layers = arch.attention()
        assert len(layers) == arch.num_layers and set(layers) <= set(decl.kinds), name
        for kind in decl.kinds:
            assert KINDS[kind.name] is kind and kind.cache and kind.layout and kind.runtime_cache, kind.name
            assert all(e.name and e.dims[0] == "batch" for e in kind.cache), kind.name


def test_a_table_without_the_declaration_is_refused():
    from cvt.convert.arch import ArchTable

    with pytest.raises(TypeError, match="attention"):
        ArchTable(name="x", model_types=("x",), rules=(), display="X")


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_the_kinds_cache_bytes_are_the_numbers_before_them(name):
    from cvt.convert.memory_plan import memory_plan
    from cvt.convert.placement import make_layout

    cfg = CONFIGS[name]()
    got = tuple(memory_plan(cfg, lay, scheme, kv_tokens=1001).ranks[0].kv_cache
                for scheme, lay in (("bf16", make_layout(world_size=1)), ("bf16", make_layout(world_size=2, tp=2, ep=2)),
                                    ("w8a8c8", make_layout(world_size=1))))
    assert got == BEFORE[name]


def test_what_each_family_declares():
    assert arch_for(tiny_deepseek_config()).table.attention.kinds == (MLA,)
    assert arch_for(tiny_kimi_k25_config()).table.attention.kinds == (MLA,)
    assert arch_for(tiny_deepseek_v32_config()).table.attention.kinds == (SPARSE_MLA,)
    glm = arch_for(tiny_glm_moe_dsa_config(indexer_types=["full", "shared", "full"]))
    assert glm.attention() == [SPARSE_MLA, SPARSE_MLA_SHARED, SPARSE_MLA]
    for moe in (True, False):
        assert arch_for(tiny_qwen3_config(moe=moe)).table.attention.kinds == (GQA,)
    v4 = arch_for(tiny_deepseek_v4_config(compress_ratios=[0, 4, 128, 4]))
    assert [k.name for k in v4.attention()] == ["v4_sliding", "v4_csa", "v4_hca", "v4_csa"]
    assert [k.name for k in arch_for(tiny_gpt_oss_config()).attention()] == ["gqa_sliding", "gqa"] * 2
    # what the KV-cache quantization reads: FAKQuant's latent for every MLA kind, GQA's C8, none for V4
    assert [TABLES[mt].attention.latent for mt in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "qwen3", "deepseek_v4")] \
        == [True, True, True, False, False]
    assert TABLES["deepseek_v4"].attention.kv_quant is None and TABLES["qwen3_moe"].attention.kv_quant.tag == "C8"


def test_the_linear_kind_counts_a_fixed_state():
    """Gated DeltaNet (Qwen3.5's linear layers): conv state + recurrent state, whatever the tokens."""
    cfg = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
           "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}
    state = 3 * (2 * 2 * 8 + 4 * 16) + 4 * 8 * 16
    assert KINDS["linear"].cache_bytes(cfg, 10) == KINDS["linear"].cache_bytes(cfg, 10_000) == state * 2


@pytest.mark.parametrize("make", [tiny_qwen3_5_config, tiny_qwen3_next_config], ids=["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("tp", [1, 2])
def test_the_linear_cache_entries_are_the_runtime_state_and_the_plan(make, tp):
    """The linear kind's cache entries, read off the runtime's args as the ONNX cache I/O reads them,
    are the shapes of the runtime's `LinearState` (the conv's last kernel - 1 inputs, as vLLM's
    gated_delta_net_state_shape) and hold what the plan counts, on a rank of tp (heads / tp)."""
    import torch

    from cvt.convert.placement import make_layout
    from cvt.runtime.models import family
    from cvt.runtime.parallel import local_args

    mod, cfg = family(make())
    args = local_args(mod.Args.from_config(cfg), make_layout(tp, tp=tp), mod.Model.parallel)
    with torch.device("meta"):
        state = mod.Model(args).new_cache(3, 8)[0]
    conv, rec = ([3 if d == "batch" else getattr(args, d) for d in e.dims] for e in KINDS["linear"].cache)
    assert (list(state.conv.shape), list(state.recurrent.shape)) == (conv, rec)
    assert conv[2] == cfg["linear_conv_kernel_dim"] - 1 and rec[1] == cfg["linear_num_value_heads"] // tp
    numel = (math.prod(conv) + math.prod(rec)) // 3
    assert KINDS["linear"].cache_bytes(cfg, 5, tp=tp) == numel * 2          # bf16 elements


def test_every_architecture_declares_what_calibration_reads():
    """Each table names the linears that read one input (`ArchTable.calib_shared_inputs`, the first
    group the attention's), which the calibration driver measures once (`cvt.quant.methods.sites`)."""
    for mt in TABLES.names():
        groups = TABLES[mt].calib_shared_inputs
        assert groups and all(groups) and len({n for g in groups for n in g}) == sum(map(len, groups)), mt
    assert TABLES["deepseek_v3"].calib_norm_inputs == {"kv_b_proj": "kv_a_layernorm"}
    assert arch_for(tiny_kimi_k25_config()).table.calib_shared_inputs == TABLES["deepseek_v3"].calib_shared_inputs
