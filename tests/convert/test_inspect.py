"""`cvt inspect`: architecture, format, counts, bytes, problems."""

from __future__ import annotations

import json


from cvt.convert.fp8_to_bf16 import fp8_to_bf16
from cvt.convert.inspect import inspect_checkpoint
from cvt.tests.conftest import run_cvt


def test_fp8_release(fp8_release_session):
    r = inspect_checkpoint(fp8_release_session)
    assert (r.model_type, r.architecture, r.source_format) == ("deepseek_v3", "deepseek_v3", "fp8-block")
    assert "[128, 128]" in r.format_detail
    assert r.layers["layers"] == "3 in config, 3 present"
    assert r.layers["moe layers"] == "2 (dense: 1)"
    assert r.layers["mtp layers"] == "1 in config, 1 present"
    assert set(r.bytes_by_dtype) == {"F8_E4M3", "BF16", "F32"}
    assert r.bytes_by_role["scale"] > 0 and r.bytes_by_role["expert"] > 0
    assert r.num_tensors == len(json.loads((fp8_release_session / "model.safetensors.index.json").read_text())["weight_map"])
    assert r.total_bytes == sum(r.bytes_by_dtype.values()) == sum(r.bytes_by_role.values())
    assert r.problems == []


def test_cvt_output(fp8_release_session, tmp_path):
    fp8_to_bf16(fp8_release_session, tmp_path / "out", quiet=True)
    r = inspect_checkpoint(tmp_path / "out")
    assert r.source_format == "cvt-artifact" and "hf-bf16" in r.format_detail and "fp8-to-bf16" in r.format_detail
    assert set(r.bytes_by_dtype) == {"BF16", "F32"}


def test_trained_fixture_bf16_single_file(trained_fixture):
    r = inspect_checkpoint(trained_fixture)
    assert r.source_format == "bf16" and r.layers["moe layers"] == "2 (dense: 1)"
    assert r.layers["mtp layers"] == "1 in config, 0 present"
    assert r.problems == []


def test_problems_are_listed_and_exit_code_3(tmp_path, tiny_config):
    from cvt.testing.checkpoints import release_tensors, write_release

    tensors = release_tensors(tiny_config)
    for n in [n for n in tensors if ".layers.2.mlp.experts.1." in n] + ["model.layers.0.mlp.up_proj.weight_scale_inv"]:
        del tensors[n]
    src = write_release(tmp_path / "src", tiny_config, tensors)
    res = run_cvt("inspect", src)
    assert res.rc == 3
    assert "FP8 weight model.layers.0.mlp.up_proj.weight" in res.out and "has no scale" in res.out
    assert "layer 2: 1 of 4 experts missing (e.g. expert 1)" in res.out
    report = json.loads(run_cvt("inspect", src, "--json").out)
    assert len(report["problems"]) == 2


def test_sharded_output_is_described_from_its_manifest(fp8_release_session, tmp_path):
    """inspect on a `cvt shard` output: layout, ranks and bytes per rank (it said "no .safetensors files")."""
    from cvt.convert.placement import make_layout
    from cvt.convert.shard import shard

    out = shard(fp8_release_session, tmp_path / "sh", make_layout(ep=2), quiet=True).dst
    m = json.loads((out / "cvt_manifest.json").read_text())
    res = run_cvt("inspect", out)
    assert res.rc == 0, res.err
    assert f"format          sharded-fp8-block: cvt shard output of {fp8_release_session} (fp8-block)" in res.out
    assert ("layout          world 2: attention tp 1 x dp 2; MoE moe_tp 1 x ep 2; dense_tp 1, embed_tp 1, "
            "lmhead_tp 1; shared experts moe_tp; placement contiguous") in res.out
    for r in m["shard"]["ranks"]:  # one line per rank, its bytes and experts as the manifest records them
        assert r["bytes"] > 0 and r["experts"]["1"] == [2 * r["rank"], 2 * r["rank"] + 1]
        assert (f"{r['rank']:>5}  {r['dir']:<12} {r['tensors']:>6} tensors ") in res.out
        assert "experts per MoE layer 2" in res.out
    doc = json.loads(run_cvt("inspect", out, "--json").out)
    assert [(r["rank"], r["dir"], r["tensors"], r["bytes"]) for r in doc["ranks"]] == [
        (r["rank"], r["dir"], r["tensors"], r["bytes"]) for r in m["shard"]["ranks"]]
    assert doc["layout"]["world_size"] == 2 and doc["total_bytes"] == m["total_size"]
    assert doc["num_tensors"] == len(m["shard"]["tensors"]) and doc["problems"] == []

    victim = out / m["shard"]["ranks"][1]["files"][0]  # a rank file cut short: listed, exit 3
    victim.write_bytes(victim.read_bytes()[:100])
    bad = run_cvt("inspect", out)
    assert bad.rc == 3 and f"{victim}: 100 bytes, the manifest says" in bad.out
