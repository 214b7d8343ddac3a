"""GLM-5 (model_type glm_moe_dsa) through every stage: the table (DeepSeek-V3.2's rules, no indexer in
"shared" layers), config checks, `cvt fp8-to-bf16` bit-exact against an independent reference,
transformers' GlmMoeDsaForCausalLM loading the BF16 output, quantize -> run -> verify, shard, plan.

The tiny release (`tiny_glm_moe_dsa_config`, layer 1 a shared-indexer layer) is written as GLM's
FP8 releases are: every quantizable linear FP8 with 128x128 block scales, the indexer's
weights_proj BF16 and its LayerNorm F32, the router bias F32.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from cvt.convert.arch import Parallel, Role, arch_for, config_problems
from cvt.convert.arch import deepseek_v32, glm_moe_dsa
from cvt.convert.config import with_explicit_defaults
from cvt.convert.fp8_to_bf16 import fp8_to_bf16
from cvt.convert.placement import make_layout
from cvt.testing.checkpoints import release_tensors, tiny_glm_moe_dsa_config, write_release
from cvt.tests.conftest import run_cvt
from cvt.tests.convert.test_fp8_to_bf16 import read_all, reference_output

CFG = tiny_glm_moe_dsa_config(indexer_types=["full", "shared", "full"])   # + 1 MTP layer (index 3)
IX = "model.layers.{}.self_attn.indexer"
INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


def test_table_is_v32_without_shared_layers_indexers():
    glm, v32 = arch_for(CFG), arch_for({**CFG, "model_type": "deepseek_v32"})
    assert glm.table.name == "glm_moe_dsa" and glm.table.rules == v32.table.rules
    sg, s32 = glm.shapes(), v32.shapes()
    assert sorted(set(s32) - set(sg)) == sorted(f"{IX.format(1)}.{p}" for p in INDEXER)
    assert [n for n in s32 if n in sg] == list(sg) and all(sg[n] == s32[n] for n in sg)
    info = glm.classify(f"{IX.format(3)}.wk.weight_scale_inv")                 # the MTP layer's indexer
    assert info.is_mtp and info.rule.parallel is Parallel.REPLICATED and info.rule.float_default
    assert glm.classify("model.layers.2.mlp.experts.3.down_proj.weight").role is Role.EXPERT
    # GLM's default 32 indexer heads (GlmMoeDsaConfig), not V3.2's 64, when the key is absent
    bare = {k: v for k, v in CFG.items() if k != "index_n_heads"}
    assert arch_for(bare).shapes()[f"{IX.format(0)}.weights_proj.weight"] == (32, CFG["hidden_size"])


def test_explicit_defaults_are_glms():
    transformers = pytest.importorskip("transformers")
    ref = transformers.GlmMoeDsaConfig()
    keys = ("n_group", "topk_group", "index_topk", "index_head_dim", "index_n_heads", "routed_scaling_factor",
            "norm_topk_prob")
    bare = {k: v for k, v in CFG.items() if k not in keys and k != "indexer_rope_interleave"}
    out = with_explicit_defaults(bare)
    assert {k: out[k] for k in keys} == {k: getattr(ref, k) for k in keys}
    # vLLM's deepseek_v2.py reads indexer_rope_interleave (default False in some versions): stated
    assert out["indexer_rope_interleave"] is True and glm_moe_dsa.DEFAULTS["index_n_heads"] == 32
    assert deepseek_v32.INDEX_DEFAULTS["index_n_heads"] == 64


@pytest.mark.parametrize("change,words", [
    ({"indexer_types": ["shared", "full", "full"]}, "first 'full'"),
    ({"indexer_types": ["full", "sparse", "full"]}, "indexer_types"),
    ({"index_topk_pattern": "FQ"}, "index_topk_pattern"),
    ({"index_topk_freq": "2"}, "index_topk_freq"),
    ({"index_n_heads": 0}, "index_n_heads"),
])
def test_config_problems(change, words):
    problems = config_problems({**{k: v for k, v in CFG.items() if k != "indexer_types"}, **change})
    assert len(problems) == 1 and words in problems[0] and problems[0].startswith("config.json ")
    assert config_problems(CFG) == []


def write_glm_release(dst: Path, scale_dtype: str = "F32", seed: int = 1) -> Path:
    """The tiny FP8 release with every indexer scale moved to the last shard, after the weights."""
    tensors = release_tensors(CFG, seed, scale_dtype)
    last = [n for n in tensors if ".indexer." in n and n.endswith("_scale_inv")]
    ordered = {n: tensors[n] for n in tensors if n not in last} | {n: tensors[n] for n in last}
    return write_release(dst, CFG, ordered, n_shards=3)


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    return write_glm_release(tmp_path_factory.mktemp("glm5") / "fp8")


@pytest.mark.parametrize("scale_dtype", ["F32", "F8_E8M0"])
def test_fp8_to_bf16_is_bit_exact(tmp_path, scale_dtype):
    src = write_glm_release(tmp_path / "src", scale_dtype)
    fp8_to_bf16(src, tmp_path / "out", quiet=True)
    got, index = read_all(tmp_path / "out")
    want = reference_output(src)                      # numpy e4m3 decode x scale, one RNE to bf16
    assert set(got) == set(want) and not any(n.endswith("_scale_inv") for n in index["weight_map"])
    assert any(d == "F8_E4M3" for d, _, _ in read_all(src)[0].values())
    for name, (dtype, shape, raw) in want.items():
        assert got[name][:2] == (dtype, shape), name
        assert np.array_equal(got[name][2], raw), f"{name} differs from the reference"
    assert not any(n.startswith(IX.format(1)) for n in got)
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in out_cfg and out_cfg["indexer_types"] == CFG["indexer_types"]


def test_bf16_output_loads_in_transformers(release, tmp_path, monkeypatch):
    """GlmMoeDsaForCausalLM takes every non-MTP tensor of the output (none missing) and computes the
    logits of the reference dequantization (tests/convert/test_transformers.py reference_dequant)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from cvt.tests.convert.test_transformers import reference_dequant

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "bf16"
    fp8_to_bf16(release, out, quiet=True)
    ref = reference_dequant(release, tmp_path / "ref", (128, 128))

    def load(d):
        model, info = transformers.GlmMoeDsaForCausalLM.from_pretrained(
            str(d), dtype=torch.float32, output_loading_info=True, local_files_only=True)
        assert not info["missing_keys"] and not info.get("mismatched_keys"), info
        assert all(k.startswith("model.layers.3.") for k in info["unexpected_keys"])   # MTP only
        return model.eval()

    m_out, m_ref = load(out), load(tmp_path / "ref")
    assert m_out.model.layers[1].self_attn.indexer is None
    ids = torch.randint(0, CFG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(m_out(input_ids=ids).logits, m_ref(input_ids=ids).logits)
    assert ref  # the reference wrote tensors


@pytest.mark.slow
def test_inspect_run_and_plan(release):
    r = run_cvt("inspect", release)
    assert r.rc == 0, r.err
    assert re.search(r"model_type\s+glm_moe_dsa\s+\(table: glm_moe_dsa\)", r.out) and "problems        none" in r.out
    r = run_cvt("run", release, "--input-ids", ",".join(str(i) for i in range(20)), "--max-new-tokens", "3",
                "--dtype", "fp32", "--device", "cpu")
    assert r.rc == 0, r.err


def test_plan_counts_the_indexer_key_of_full_layers_only():
    from cvt.convert.memory_plan import memory_plan

    cfg = {k: v for k, v in CFG.items() if k != "quantization_config"}
    p = memory_plan(cfg, make_layout(world_size=1), kv_tokens=10)
    layers, full = cfg["num_hidden_layers"], 2                        # layer 1 is shared
    want = 10 * 2 * (layers * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) + full * cfg["index_head_dim"])
    assert p.ranks[0].kv_cache == want


def test_shard_fp8_ep_and_bf16_tp(release, tmp_path):
    """FP8: EP 2 keeps each indexer scale with its weight. BF16: TP 2 replicates the full layers'
    indexers (vLLM / vllm-ascend build them replicated) and splits q_b_proj; concatenating the shards
    gives the input back (`assert_reproduces`)."""
    from cvt.convert.shard import shard
    from cvt.testing.checkpoints import write_bf16_checkpoint
    from cvt.tests.convert.test_shard import assert_reproduces

    r = run_cvt("shard", release, tmp_path / "ep", "--ep", "2", "--quiet")
    assert r.rc == 0, r.err
    m = assert_reproduces(release, tmp_path / "ep")
    for rank in m["shard"]["ranks"]:
        index = json.loads((tmp_path / "ep" / rank["dir"] / "model.safetensors.index.json").read_text())
        assert {f"{IX.format(2)}.wk.weight", f"{IX.format(2)}.wk.weight_scale_inv"} <= set(index["weight_map"])
    src = write_bf16_checkpoint(tmp_path / "bf16", {k: v for k, v in CFG.items() if k != "quantization_config"})
    m = assert_reproduces(src, shard(src, tmp_path / "tp", make_layout(world_size=2, tp=2, ep=2), quiet=True).dst)
    t = m["shard"]["tensors"]
    assert all(t[f"{IX.format(i)}.{p}"]["dim"] is None for i in (0, 2) for p in INDEXER)
    assert not any(n.startswith(IX.format(1)) for n in t)
    assert t["model.layers.0.self_attn.q_b_proj.weight"]["dim"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("case", ["w8a8-ascend", "w4a16-compressed-tensors"])
def test_quantize_run_verify(release, tmp_path, case):
    """FP8 release -> quantized output (the indexer float: FLOAT in the Ascend description, `ignore`d in
    compressed-tensors; the shared layer has none) -> cvt run -> cvt verify against the BF16 output."""
    from cvt.quant.stage import quantize
    from cvt.tests.convert.test_shard import read_all as read_tensors

    scheme, fmt = case.split("-", 1)
    out = tmp_path / case
    quantize(release, out, scheme=scheme, fmt=fmt, quiet=True, calib_tokens=64,
             **({"group_size": 32} if scheme == "w4a16" else {}))
    bf16 = fp8_to_bf16(release, tmp_path / "bf16", quiet=True).dst
    got, ref = read_tensors(out), read_tensors(bf16)
    for i in (0, 2, 3):
        for p in INDEXER:
            name = f"{IX.format(i)}.{p}"
            assert got[name].dtype == ref[name].dtype and bool((got[name] == ref[name]).all()), name
    assert not any(n.startswith(IX.format(1)) for n in got)
    assert any(n.startswith("model.layers.2.mlp.experts.0.down_proj.weight_") for n in got)      # quantized
    if fmt == "ascend":
        desc = json.loads((out / "quant_model_description.json").read_text())
        assert all(desc[f"{IX.format(i)}.{p}"] == "FLOAT" for i in (0, 2, 3) for p in INDEXER)
    else:
        ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
        assert {f"{IX.format(2)}.{m}" for m in ("wq_b", "wk", "weights_proj")} <= set(ignore)
    r = run_cvt("run", out, "--input-ids", ",".join(map(str, range(40, 60))), "--max-new-tokens", "3",
                "--device", "cpu", "--quiet")
    assert r.rc == 0, r.err
    r = run_cvt("verify", out, "--reference", bf16, "--report", tmp_path / "rep", "--device", "cpu",
                "--max-sequences", "1", "--seq-len", "32")                        # 32 > index_topk 8
    assert r.rc == 0, r.err
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    sqnr = {w["name"]: w["sqnr_db"] for w in report["weights"]}
    assert sqnr[f"{IX.format(2)}.wk.weight"] == "Infinity"
    assert isinstance(sqnr["model.layers.2.self_attn.o_proj.weight"], float)
