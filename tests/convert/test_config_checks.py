"""One config.json check for writers and runtime (issue 24 item 7): every value that `cvt run`
refuses is refused by fp8-to-bf16 / quantize / shard before they write, and listed by inspect."""

from __future__ import annotations

import json

import pytest

from cvt.convert.arch import config_problems
from cvt.testing.checkpoints import (tiny_deepseek_config, tiny_deepseek_v32_config, tiny_qwen3_config,
                                     write_fp8_release)
from cvt.runtime.models import family
from cvt.runtime.models.base import ConfigError
from cvt.tests.conftest import run_cvt

YARN = {"type": "yarn", "factor": -4, "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}
BAD = [  # (config maker, change, the line's key part)
    *[(tiny_deepseek_v32_config, {"index_topk": v}, f"index_topk = {v!r}") for v in (0, -1, "abc", None, 8.5)],
    (tiny_deepseek_config, {"first_k_dense_replace": 5}, "first_k_dense_replace = 5: past the model's 3"),
    (tiny_deepseek_config, {"num_experts_per_tok": 9}, "num_experts_per_tok = 9: must be an integer in 1..4"),
    (tiny_deepseek_config, {"n_group": 3}, "n_group = 3: must divide n_routed_experts (4)"),
    (tiny_deepseek_config, {"topk_group": 3}, "topk_group = 3: must be an integer in 1..n_group (2)"),
    (tiny_deepseek_config, {"rms_norm_eps": -1e-6}, "rms_norm_eps = -1e-06"),
    (tiny_deepseek_config, {"rope_scaling": YARN}, "rope_scaling.factor = -4"),
    (lambda: tiny_qwen3_config(moe=True), {"num_experts_per_tok": 5}, "num_experts_per_tok = 5"),
    (lambda: tiny_qwen3_config(moe=True), {"rms_norm_eps": float("nan")}, "rms_norm_eps = nan"),
    (lambda: tiny_qwen3_config(moe=False), {"rope_scaling": {"rope_type": "linear", "factor": -4}},
     "rope_scaling.factor = -4"),
]


@pytest.mark.parametrize("make,change,line", BAD, ids=[b[2].split(":")[0] for b in BAD])
def test_bad_config_found_and_refused_by_runtime(make, change, line):
    cfg = {**make(), **change}
    assert any(line in p for p in config_problems(cfg)), config_problems(cfg)
    mod, text = family(cfg)
    with pytest.raises(ConfigError):
        mod.Args.from_config(text)


@pytest.mark.parametrize("cfg", [tiny_deepseek_config(), tiny_deepseek_v32_config(), tiny_qwen3_config(moe=True),
                                 tiny_qwen3_config(moe=False)])
def test_good_configs_have_no_problems(cfg):
    assert config_problems(cfg) == []


def test_real_configs_have_no_problems():
    from pathlib import Path

    for p in (Path(__file__).parents[1] / "data" / "configs").glob("*.json"):
        assert config_problems(json.loads(p.read_text())) == [], p


@pytest.fixture(scope="module")
def v32_topk0(tmp_path_factory):
    return write_fp8_release(tmp_path_factory.mktemp("v32") / "src", tiny_deepseek_v32_config(index_topk=0))


@pytest.mark.parametrize("verb", [["fp8-to-bf16"], ["quantize", "--scheme", "w8a8"], ["shard", "--ep", "2"]])
def test_writers_refuse_before_writing(v32_topk0, tmp_path, verb):
    dst = tmp_path / "out"
    r = run_cvt(verb[0], v32_topk0, dst, *verb[1:])
    assert r.rc == 1, r.err
    assert r.err.strip().splitlines() == [
        f"cvt: error: {v32_topk0}: config.json index_topk = 0: must be a positive integer; {verb[0]} refused"]
    assert not dst.exists()


def test_plan_refuses_it(v32_topk0):
    r = run_cvt("plan", v32_topk0, "--ep", "2")
    assert r.rc == 1, r.err
    assert r.err.strip().splitlines() == [
        "cvt: error: config.json index_topk = 0: must be a positive integer; plan refused"]


def test_inspect_lists_it(v32_topk0):
    r = run_cvt("inspect", v32_topk0)
    assert r.rc == 3, r.err
    assert "config.json index_topk = 0: must be a positive integer" in r.out


def test_dense_layer_holding_experts(tmp_path, fp8_release):
    cfg = json.loads((fp8_release / "config.json").read_text())
    (fp8_release / "config.json").write_text(json.dumps({**cfg, "first_k_dense_replace": 3}))
    r = run_cvt("shard", fp8_release, tmp_path / "out", "--ep", "2")
    assert r.rc == 1
    assert "layer 1 holds MoE tensors (model.layers.1." in r.err
    assert "first_k_dense_replace = 3 makes it a dense layer" in r.err
