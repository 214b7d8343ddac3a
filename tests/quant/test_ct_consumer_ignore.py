"""A compressed-tensors output's ``ignore`` as each consumer matches it against its own module names:
every linear cvt keeps float is ignored there, every linear cvt quantized is not.

- transformers 5.24: its compressed-tensors quantizer hands ``ignore`` unmapped to compressed-tensors'
  ``apply_quantization_config`` (quantizer_compressed_tensors.py), which matches it against
  ``model.named_modules()`` (compressed_tensors/utils/match.py ``match_named_modules``, used here).
  Kimi_K25 names the text model ``model.language_model.layers.L`` and the head ``lm_head``
  (conversion_mapping.py "kimi_k25"); DeepseekV3ForCausalLM (Kimi-K2) the release's names.
- vLLM (not installed here): ``should_ignore_layer`` below is vLLM's rule as written in
  vllm/model_executor/layers/quantization/compressed_tensors/utils.py (exact name or ``re:`` +
  ``re.match``; a layer in ``fused_mapping`` decided by its shards, which must agree), called with each
  layer's prefix (compressed_tensors.py ``get_scheme_dict``); a FusedMoE by expert 0's three linears
  (compressed_tensors_moe.py ``get_moe_method``). The layouts and packed mappings are
  tests/quant/vllm_ascend_referee.py's: KimiK25ForConditionalGeneration (models/kimi_k25.py, vLLM
  009dff45 / dd4ad005) builds DeepseekV2Model(prefix "language_model") with no hf_to_vllm_mapper and
  no packed_modules_mapping, its load_weights renaming ``language_model.model`` -> ``language_model``;
  DeepseekV3ForCausalLM keeps the release's names and maps fused_qkv_a_proj / gate_up_proj to shards.
Qwen3.5 (release names are transformers' own; vLLM maps the ignore list with its mapper) is covered by
test_compressed_tensors_qwen3_5.py.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from cvt.quant.stage import quantize
from cvt.testing.checkpoints import (kimi_int4_tensors, tiny_deepseek_config, tiny_kimi_k25_config, write_bf16_checkpoint,
                                     write_release)
from cvt.tests.quant.vllm_ascend_referee import read_headers
from cvt.tests.quant.vllm_ascend_referee_layouts import _class_packed_mapping, _deepseek_layout, _kimi_k25_layout, _Lin, _MoE

pytest.importorskip("compressed_tensors")

# float by --ignore: layer 1's whole attention (vLLM's fused_qkv_a_proj among it) and half of layer 0's
# dense MLP (gate_up_proj float, down_proj quantized)
MIXED = (r"layers\.1\.self_attn\.", r"layers\.0\.mlp\.(gate|up)_proj$")


def should_ignore_layer(layer_name: str, ignore, fused_mapping) -> bool:
    """vLLM compressed_tensors/utils.py ``should_ignore_layer`` + ``_is_equal_or_regex_match``."""
    def hit(name: str) -> bool:
        return any(re.match(t[3:], name) if t.startswith("re:") else t == name for t in ignore)

    proj = layer_name.split(".")[-1]
    if proj in fused_mapping and layer_name not in ignore:
        shards = {hit(layer_name.replace(proj, s)) for s in fused_mapping[proj]}
        if len(shards) > 1:
            raise ValueError(f"different schemes for the shards of {layer_name}")
        return shards.pop()
    return hit(layer_name)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct-ignore")
    k25 = tiny_kimi_k25_config()
    k2 = tiny_deepseek_config(num_nextn_predict_layers=0)
    srcs = {"kimi_k25": write_release(root / "k25", k25, kimi_int4_tensors(k25, seed=2), n_shards=1, move_scale=False),
            "kimi_k2": write_bf16_checkpoint(root / "k2", k2)}
    out = {}
    for arch, src in srcs.items():
        for case, ignore in (("default", ()), ("mixed", MIXED)):
            dst = root / f"{arch}-{case}"
            quantize(src, dst, scheme="w4a16", fmt="compressed-tensors", group_size=32, ignore=ignore, quiet=True)
            out[arch, case] = dst
    return out


def _stored(dst):
    """(the ignore list, targets, float linears, quantized linears) of an output, by release name."""
    config = json.loads((dst / "config.json").read_text())
    qc = config["quantization_config"]
    targets = [t for g in qc["config_groups"].values() for t in g["targets"]]
    tensors, _ = read_headers(dst)
    quantized = {n.rpartition(".")[0] for n in tensors if n.endswith(".weight_packed")}
    floats = {n.rpartition(".")[0] for n, (dt, shape, _) in tensors.items()
              if n.endswith(".weight") and len(shape) == 2 and dt in ("BF16", "F32")}
    return config, qc["ignore"], targets, floats, quantized


def _release_name(arch: str, consumer_name: str) -> str:
    """A text module's release name from transformers' / vLLM's name for it (Kimi-K2: the same)."""
    if arch == "kimi_k2":
        return consumer_name
    if consumer_name == "lm_head":
        return "language_model.lm_head"
    for theirs in ("model.language_model.", "language_model."):  # transformers', vLLM's
        if consumer_name.startswith(theirs):
            return "language_model.model." + consumer_name[len(theirs):]
    raise AssertionError(consumer_name)


def _hf_model(arch: str, config: dict):
    transformers = pytest.importorskip("transformers")
    if arch == "kimi_k25":
        from cvt.tests.runtime.test_kimi_k25 import hf_kimi

        return hf_kimi(config)
    text = {k: v for k, v in config.items() if k != "quantization_config"}
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**text))


@pytest.mark.slow  # four tiny w4a16 quantizes (a K2.5 INT4 release, a Kimi-K2-named BF16 one): ~10 s
@pytest.mark.parametrize("case", ["default", "mixed"])
@pytest.mark.parametrize("arch", ["kimi_k25", "kimi_k2"])
def test_transformers_quantizes_exactly_the_linears_cvt_quantized(outputs, arch, case):
    from compressed_tensors.utils.match import match_named_modules

    config, ignore, targets, floats, quantized = _stored(outputs[arch, case])
    model = _hf_model(arch, config)
    text = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
            and not n.startswith(("model.vision_tower.", "model.mm_projector."))}  # test_ct_carried_ignore.py
    theirs = {n for n, _ in match_named_modules(model, targets, ignore)}
    assert text and theirs <= text
    for n in sorted(text):
        r = _release_name(arch, n)
        assert r in floats | quantized, (n, r)
        assert (n in theirs) == (r in quantized), (n, r, "quantized by transformers" if n in theirs else "left float")
    if case == "mixed":  # what --ignore kept float reaches transformers' names
        assert any(".layers.1.self_attn.q_a_proj" in n and n not in theirs for n in text)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["default", "mixed"])
@pytest.mark.parametrize("arch", ["kimi_k25", "kimi_k2"])
def test_vllm_quantizes_exactly_the_linears_cvt_quantized(outputs, arch, case):
    config, ignore, _, floats, quantized = _stored(outputs[arch, case])
    if arch == "kimi_k25":
        mods = _kimi_k25_layout(config, torch.bfloat16)
        fused = _class_packed_mapping(config)
        assert fused == {}  # KimiK25ForConditionalGeneration declares none: fused layers go by their own name
    else:
        config = config | {"model_type": "deepseek_v3"}
        mods, fused = _deepseek_layout(config, torch.bfloat16), _class_packed_mapping(config)
    seen = 0
    for m in mods:
        if isinstance(m, _Lin) and m.quant:
            shards = [_release_name(arch, ck) for ck, _, _ in m.shards]
            assert all(s in floats | quantized for s in shards), (m.prefix, shards)
            assert len({s in floats for s in shards}) == 1, (m.prefix, shards)  # vLLM: one scheme per fused layer
            assert should_ignore_layer(m.prefix, ignore, fused) == (shards[0] in floats), m.prefix
            seen += 1
        elif isinstance(m, _MoE):  # expert 0's linears decide the FusedMoE's method
            for w in ("gate", "up", "down"):
                r = _release_name(arch, f"{m.prefix}.0.{w}_proj")
                assert r in quantized, r
                assert not should_ignore_layer(f"{m.prefix}.0.{w}_proj", ignore, fused), m.prefix
    assert seen
    if case == "mixed":
        root = "language_model" if arch == "kimi_k25" else "model"
        assert should_ignore_layer(f"{root}.layers.1.self_attn.fused_qkv_a_proj", ignore, fused)
        assert should_ignore_layer(f"{root}.layers.0.mlp.gate_up_proj", ignore, fused)
        assert not should_ignore_layer(f"{root}.layers.0.mlp.down_proj", ignore, fused)
