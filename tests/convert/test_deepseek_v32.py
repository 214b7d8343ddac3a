"""DeepSeek-V3.2 (sparse attention, lightning indexer) through the convert verbs: the table's roles,
`cvt inspect`, `cvt fp8-to-bf16` bit-exact against an independent reference (indexer FP8 scales in
other shards than their weights), `cvt plan`, `cvt shard` (indexer replicated on every TP rank),
and transformers' DeepseekV32ForCausalLM loading the BF16 output.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from cvt.convert.arch import Block, Parallel, Role, arch_for
from cvt.convert.arch import deepseek_v3, deepseek_v32
from cvt.convert.config import with_explicit_defaults
from cvt.convert.fp8_to_bf16 import fp8_to_bf16
from cvt.convert.placement import make_layout
from cvt.convert.shard import shard
from cvt.testing.checkpoints import release_tensors, tiny_deepseek_v32_config, write_bf16_checkpoint, write_release
from cvt.errors import ArchError
from cvt.tests.conftest import run_cvt
from cvt.tests.convert.test_fp8_to_bf16 import read_all, reference_output

CFG = tiny_deepseek_v32_config()  # 3 layers (layer 0 dense), 1 MTP layer (index 3), indexer 8 x 40
IX = "model.layers.{}.self_attn.indexer"
INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


# ---------------------------------------------------------------------------------------------
# the architecture table
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,role,quantizable", [
    ("model.layers.0.self_attn.indexer.wq_b.weight", Role.LINEAR, True),
    ("model.layers.1.self_attn.indexer.wq_b.weight_scale_inv", Role.LINEAR, True),
    ("model.layers.2.self_attn.indexer.wk.weight", Role.LINEAR, True),
    ("model.layers.2.self_attn.indexer.weights_proj.weight", Role.LINEAR, False),
    ("model.layers.0.self_attn.indexer.k_norm.weight", Role.NORM, False),
    ("model.layers.0.self_attn.indexer.k_norm.bias", Role.NORM, False),
    ("model.layers.3.self_attn.indexer.wk.weight_scale_inv", Role.LINEAR, True),    # the MTP layer's
])
def test_indexer_roles_replicated_and_float_by_default(name, role, quantizable):
    info = arch_for(CFG).classify(name)
    assert (info.role, info.block, info.rule.parallel) == (role, Block.ATTN, Parallel.REPLICATED)
    assert info.split_dim is None and info.rule.float_default and info.rule.quantizable is quantizable
    assert info.is_mtp is (info.layer == 3)


def test_the_rest_is_deepseek_v3():
    v32, v3 = arch_for(CFG), arch_for({**CFG, "model_type": "deepseek_v3"})
    assert v32.table.name == "deepseek_v32" and v32.table.rules[:len(v3.table.rules)] == v3.table.rules
    s32, s3 = v32.table.param_shapes(v32.config), v3.table.param_shapes(v3.config)
    extra = [n for n in s32 if n not in s3]
    assert [n for n in s32 if n in s3] == list(s3)                       # same order otherwise
    layers = CFG["num_hidden_layers"] + CFG["num_nextn_predict_layers"]
    assert sorted(extra) == sorted(f"{IX.format(i)}.{p}" for i in range(layers) for p in INDEXER)
    h, q_lora, heads, dim = CFG["hidden_size"], CFG["q_lora_rank"], CFG["index_n_heads"], CFG["index_head_dim"]
    assert s32[f"{IX.format(1)}.wq_b.weight"] == (heads * dim, q_lora)
    assert s32[f"{IX.format(1)}.wk.weight"] == (dim, h)
    assert s32[f"{IX.format(1)}.weights_proj.weight"] == (heads, h)
    assert s32[f"{IX.format(1)}.k_norm.bias"] == (dim,)
    for name in s32:
        v32.classify(name)
    with pytest.raises(ArchError, match="does not match any deepseek_v3 name"):   # V3 has no indexer
        v3.classify(f"{IX.format(0)}.wk.weight")
    with pytest.raises(ArchError, match="q_lora_rank"):
        arch_for({**CFG, "q_lora_rank": None}).shapes()


def test_fused_group_and_explicit_defaults():
    arch = arch_for(CFG)
    assert arch.fused_group(f"{IX.format(2)}.wk") == (f"{IX.format(2)}.wk", f"{IX.format(2)}.weights_proj")
    assert arch.fused_group(f"{IX.format(2)}.wq_b") is None
    bare = {k: v for k, v in CFG.items() if not k.startswith("index_") and k not in ("topk_method", "scoring_func")}
    out = with_explicit_defaults(bare)
    assert {k: out[k] for k in deepseek_v32.INDEX_DEFAULTS} == deepseek_v32.INDEX_DEFAULTS == {
        "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64}           # DeepseekV32Config's
    assert (out["topk_method"], out["scoring_func"]) == (deepseek_v3.DEFAULTS["topk_method"], "sigmoid")


# ---------------------------------------------------------------------------------------------
# an FP8 release with the indexer's scales in other shards
# ---------------------------------------------------------------------------------------------

def write_v32_release(dst: Path, scale_dtype: str = "F32", seed: int = 1) -> Path:
    """The release layout (FP8 wq_b / wk + block scales, BF16 weights_proj, F32 k_norm), with every
    indexer weight_scale_inv moved to the last of 3 shards, after all the weights."""
    tensors = release_tensors(CFG, seed, scale_dtype)
    last = [n for n in tensors if ".indexer." in n and n.endswith("_scale_inv")]
    ordered = {n: tensors[n] for n in tensors if n not in last} | {n: tensors[n] for n in last}
    return write_release(dst, CFG, ordered, n_shards=3)


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    return write_v32_release(tmp_path_factory.mktemp("v32") / "fp8")


def test_release_layout(release):
    tensors, index = read_all(release)
    wm = index["weight_map"]
    for i in range(4):
        p = IX.format(i)
        assert tensors[f"{p}.wq_b.weight"][0] == tensors[f"{p}.wk.weight"][0] == "F8_E4M3"
        assert tensors[f"{p}.wq_b.weight_scale_inv"][1] == (3, 1)          # 320 rows: 2.5 blocks
        assert tensors[f"{p}.weights_proj.weight"][0] == "BF16" and f"{p}.weights_proj.weight_scale_inv" not in wm
        assert tensors[f"{p}.k_norm.weight"][0] == tensors[f"{p}.k_norm.bias"][0] == "F32"
    apart = [n for n in wm if ".indexer." in n and n + "_scale_inv" in wm and wm[n] != wm[n + "_scale_inv"]]
    assert len(apart) >= 4


@pytest.mark.parametrize("scale_dtype", ["F32", "F8_E8M0"])
def test_fp8_to_bf16_is_bit_exact_with_the_indexer(tmp_path, scale_dtype):
    src = write_v32_release(tmp_path / "src", scale_dtype)
    fp8_to_bf16(src, tmp_path / "out", quiet=True)
    got, index = read_all(tmp_path / "out")
    want = reference_output(src)                      # numpy e4m3 decode x scale, one RNE to bf16
    assert set(got) == set(want) and not any(n.endswith("_scale_inv") for n in index["weight_map"])
    for name, (dtype, shape, raw) in want.items():
        assert got[name][:2] == (dtype, shape), name
        assert np.array_equal(got[name][2], raw), f"{name} differs from the reference"
    p = IX.format(3)
    assert [got[f"{p}.{t}"][0] for t in INDEXER] == ["BF16", "BF16", "F32", "F32", "BF16"]


@pytest.mark.slow
def test_bf16_output_loads_in_transformers(release, tmp_path, monkeypatch):
    """transformers' DeepseekV32ForCausalLM takes every non-MTP tensor of the output (none missing),
    and computes the logits of the reference dequantization."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from cvt.tests.convert.test_transformers import expected_state, read_dir, reference_dequant

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "bf16"
    fp8_to_bf16(release, out, quiet=True)
    ref = reference_dequant(release, tmp_path / "ref", (128, 128))
    got = read_dir(out)
    assert sorted(got) == sorted(ref) and all(torch.equal(got[n], ref[n]) for n in ref)

    def load(d):
        model, info = transformers.DeepseekV32ForCausalLM.from_pretrained(
            str(d), dtype=torch.float32, output_loading_info=True, local_files_only=True)
        assert not info["missing_keys"] and not info.get("mismatched_keys"), info
        assert all(k.startswith("model.layers.3.") for k in info["unexpected_keys"])   # MTP only
        return model.eval()

    m_out, m_ref = load(out), load(tmp_path / "ref")
    sd = m_out.state_dict()
    for k, t in expected_state(ref, sd, CFG["num_hidden_layers"]).items():
        assert torch.equal(sd[k], t.float()), k
    ids = torch.randint(0, CFG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(m_out(input_ids=ids).logits, m_ref(input_ids=ids).logits)


# ---------------------------------------------------------------------------------------------
# the CLI verbs
# ---------------------------------------------------------------------------------------------

def test_inspect_and_plan(release):
    r = run_cvt("inspect", release)
    assert r.rc == 0, r.err
    assert re.search(r"model_type\s+deepseek_v32\s+\(table: deepseek_v32\)", r.out) and "problems        none" in r.out
    r = run_cvt("plan", release, "--ep", "2")
    assert r.rc == 0, r.err
    assert "deepseek_v32" in r.out


def test_shard_replicates_the_indexer_on_every_tp_rank(tmp_path):
    from cvt.tests.convert.test_shard import assert_reproduces, read_all as read_rank

    cfg = {k: v for k, v in CFG.items() if k != "quantization_config"}
    src = write_bf16_checkpoint(tmp_path / "src", cfg)
    m = assert_reproduces(src, shard(src, tmp_path / "out", make_layout(world_size=2, tp=2, ep=2), quiet=True).dst)
    t = m["shard"]["tensors"]
    for i in range(CFG["num_hidden_layers"]):              # MTP layers are left to each rank the same way
        for p in INDEXER:
            assert t[f"{IX.format(i)}.{p}"]["dim"] is None, p
    assert t["model.layers.0.self_attn.q_b_proj.weight"]["dim"] == 0
    source = read_rank(src)
    for r in m["shard"]["ranks"]:
        held = read_rank(tmp_path / "out" / r["dir"])
        for p in INDEXER:
            name = f"{IX.format(1)}.{p}"
            assert held[name].shape == source[name].shape and bool((held[name] == source[name]).all()), name


def test_fp8_shard_keeps_indexer_scales_with_their_weights(release, tmp_path):
    from cvt.tests.convert.test_shard import assert_reproduces

    r = run_cvt("shard", release, tmp_path / "out", "--ep", "2", "--quiet")
    assert r.rc == 0, r.err
    m = assert_reproduces(release, tmp_path / "out")
    for rank in m["shard"]["ranks"]:
        index = json.loads((tmp_path / "out" / rank["dir"] / "model.safetensors.index.json").read_text())
        assert {f"{IX.format(2)}.wk.weight", f"{IX.format(2)}.wk.weight_scale_inv"} <= set(index["weight_map"])


@pytest.mark.slow
def test_run_an_fp8_release(release):
    """The loader dequantizes the indexer's FP8 linears and takes its F32 LayerNorm."""
    r = run_cvt("run", release, "--input-ids", ",".join(str(i) for i in range(20)), "--max-new-tokens", "3",
                "--dtype", "fp32", "--device", "cpu")
    assert r.rc == 0, r.err


def test_plan_counts_the_indexer_key_cache():
    """Per token and layer the V3.2 cache holds the MLA latent + rope key and the indexer's own
    key (index_head_dim, bf16): (kv_lora_rank + qk_rope_head_dim + index_head_dim) * 2 bytes."""
    from cvt.convert.placement import make_layout
    from cvt.convert.memory_plan import memory_plan

    cfg = {k: v for k, v in CFG.items() if k != "quantization_config"}
    p = memory_plan(cfg, make_layout(world_size=1), kv_tokens=10)
    want = 10 * cfg["num_hidden_layers"] * 2 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] + cfg["index_head_dim"])
    assert p.ranks[0].kv_cache == want
