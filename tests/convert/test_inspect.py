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
    from cvt.convert.synthetic import release_tensors, write_release

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
