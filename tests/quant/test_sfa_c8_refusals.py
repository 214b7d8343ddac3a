"""Outputs vllm-ascend would load and then not use are refused, in one line, before DST is touched:
an MLA C8 (FAKQuant) for a model vllm-ascend runs through its SFA backend (GLM-5: the lightning
indexer decides, `vllm_ascend/utils.py` `model_uses_sfa_sparse`; `attention/sfa_v1.py` never reads
``fa_k``), and an fp8 cache for DeepSeek-V3.2, whose C8 is the indexer's int8 one
(`methods/kv_c8.py` `AscendSFAQuantAttentionMethod`). And `cvt shard` reads the source's Ascend
description before it writes any rank file."""

from __future__ import annotations

from cvt.testing.checkpoints import tiny_deepseek_v32_config, tiny_glm_moe_dsa_config, write_fp8_release
from tests.conftest import run_cvt


def test_glm5_w8a8c8_ascend_is_refused(tmp_path):
    src = write_fp8_release(tmp_path / "glm", tiny_glm_moe_dsa_config())
    r = run_cvt("quantize", src, tmp_path / "out", "--scheme", "w8a8c8", "--format", "ascend")
    assert r.rc == 1 and r.err.count("\n") == 1, r.err
    assert "SFA backend" in r.err and "--scheme w8a8" in r.err
    assert not (tmp_path / "out").exists()


def test_v32_indexer_c8_with_an_fp8_cache_is_refused(tmp_path):
    src = write_fp8_release(tmp_path / "v32", tiny_deepseek_v32_config(index_head_dim=32))
    r = run_cvt("quantize", src, tmp_path / "out", "--scheme", "w8a8c8", "--format", "ascend", "--kv-dtype", "fp8")
    assert r.rc == 2 and r.err.count("\n") == 1, r.err
    assert "--kv-dtype fp8" in r.err and "indexer" in r.err
    assert not (tmp_path / "out").exists()


def test_shard_reads_a_broken_ascend_description_before_writing(tmp_path):
    src = write_fp8_release(tmp_path / "ds", tiny_deepseek_v32_config(index_head_dim=32))
    q = tmp_path / "w8a8"
    assert run_cvt("quantize", src, q, "--scheme", "w8a8", "--format", "ascend", "-q").rc == 0
    desc = q / "quant_model_description.json"
    desc.write_bytes(desc.read_bytes() + b"x")
    r = run_cvt("shard", q, tmp_path / "shards", "--tp", "2")
    assert r.rc == 1 and "not valid JSON" in r.err, r.err
    assert not list((tmp_path / "shards").glob("rank-*/*.safetensors"))
