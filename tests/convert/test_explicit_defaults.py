"""Two readers of one config.json must not disagree silently: DeepSeek outputs state their routing.

vLLM's ``model_executor/models/deepseek_v2.py`` reads ``topk_method`` / ``scoring_func`` with
defaults of its own (no topk_method: softmax routing without the correction bias), while
transformers' DeepseekV3Config -- and cvt's runtime, which takes the arch table's defaults --
mean ``noaux_tc`` / ``sigmoid``. The shared trained fixture omits both keys; every cvt output
of it must carry them, with the values the runtime used.
"""

from __future__ import annotations

import json

import pytest

from cvt.convert.arch.deepseek_v3 import DEFAULTS
from cvt.convert.placement import make_layout
from cvt.convert.shard import shard
from cvt.quant.stage import quantize
from cvt.runtime.models.deepseek_v3 import Args

ROUTING = ("topk_method", "scoring_func", "norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group")


def test_runtime_defaults_are_the_tables():
    import dataclasses

    fields = {f.name: f.default for f in dataclasses.fields(Args)}
    assert {k: fields[k] for k in DEFAULTS} == DEFAULTS
    assert (DEFAULTS["topk_method"], DEFAULTS["scoring_func"]) == ("noaux_tc", "sigmoid")


@pytest.mark.parametrize("fmt", ["compressed-tensors", "ascend"])
def test_outputs_of_a_config_without_routing_keys_state_them(trained_fixture, tmp_path, fmt):
    src = json.loads((trained_fixture / "config.json").read_text())
    assert not {"topk_method", "scoring_func"} & set(src)  # the fixture omits them
    q = tmp_path / "q"
    quantize(trained_fixture, q, scheme="w8a8", fmt=fmt, quiet=True)
    out = json.loads((q / "config.json").read_text())
    for k in ROUTING:  # kept where the source has them, the runtime's meaning where it does not
        assert out[k] == src.get(k, DEFAULTS[k]), k
    s = tmp_path / "s"
    shard(trained_fixture, s, make_layout(ep=2), quiet=True)
    sh = json.loads((s / "config.json").read_text())
    assert all(sh[k] == src.get(k, DEFAULTS[k]) for k in ROUTING)
