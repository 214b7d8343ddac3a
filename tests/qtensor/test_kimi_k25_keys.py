"""Kimi-K2.5's Ascend description also names each tag under vLLM's module prefixes.

vLLM models/kimi_k25.py (KimiK25ForConditionalGeneration.__init__) builds the text model as
DeepseekV2Model(prefix="language_model") and defines no packed_modules_mapping; vllm-ascend
quantization/modelslim_config.py (AscendModelSlimConfig.get_quant_method ->
is_layer_skipped_ascend / get_linear_quant_type) then reads ``{prefix}.weight`` for every module,
fused ones under their fused name. The keys below are those lookups, written out by hand.
The referee (tests/quant/test_vllm_ascend_referee.py, CVT_VLLM_ASCEND_SRC) runs vllm-ascend's
own code on a whole output.
"""

from __future__ import annotations

import json

from cvt.qtensor.formats.ascend import Ascend
from cvt.qtensor.kimi_k25_keys import vllm_prefix_keys
from cvt.qtensor.layouts import VLLM_ASCEND

L = "language_model.model.layers.{}."
TAGS = {
    "language_model.model.embed_tokens.weight": "FLOAT",
    "language_model.lm_head.weight": "FLOAT",
    "vision_tower.encoder.blocks.0.wo.weight": "FLOAT",
    L.format(0) + "self_attn.q_a_proj.weight": "FLOAT",
    L.format(0) + "self_attn.kv_a_proj_with_mqa.weight": "FLOAT",
    L.format(0) + "self_attn.o_proj.weight": "FLOAT",
    L.format(0) + "mlp.gate_proj.weight": "FLOAT",
    L.format(0) + "mlp.up_proj.weight": "FLOAT",
    L.format(1) + "mlp.shared_experts.gate_proj.weight": "FLOAT",
    L.format(1) + "mlp.experts.0.gate_proj.weight": "W4A8_DYNAMIC",
    L.format(1) + "mlp.experts.0.gate_proj.weight_scale": "W4A8_DYNAMIC",
    L.format(1) + "mlp.experts.7.down_proj.weight": "W4A8_DYNAMIC",
    L.format(2) + "mlp.experts.0.gate_proj.weight_packed": "W4A16",
}


def test_keys_are_vllm_ascends_lookups():
    got = vllm_prefix_keys({"model_type": "kimi_k25"}, TAGS)
    v = "language_model.layers.{}."
    want = {
        "language_model.embed_tokens.weight": "FLOAT",
        v.format(0) + "self_attn.q_a_proj.weight": "FLOAT",
        v.format(0) + "self_attn.fused_qkv_a_proj.weight": "FLOAT",          # get_quant_method(fused_qkv_a_proj)
        v.format(0) + "self_attn.kv_a_proj_with_mqa.weight": "FLOAT",
        v.format(0) + "self_attn.o_proj.weight": "FLOAT",
        v.format(0) + "mlp.gate_proj.weight": "FLOAT",
        v.format(0) + "mlp.gate_up_proj.weight": "FLOAT",                    # dense MLP
        v.format(0) + "mlp.up_proj.weight": "FLOAT",
        v.format(1) + "mlp.shared_experts.gate_proj.weight": "FLOAT",
        v.format(1) + "mlp.shared_experts.gate_up_proj.weight": "FLOAT",
        v.format(1) + "mlp.experts.0.gate_proj.weight": "W4A8_DYNAMIC",
        v.format(1) + "mlp.experts.weight": "W4A8_DYNAMIC",                  # FusedMoE prefix ...mlp.experts
        v.format(1) + "mlp.experts.7.down_proj.weight": "W4A8_DYNAMIC",
        v.format(2) + "mlp.experts.0.gate_proj.weight_packed": "W4A16",
        v.format(2) + "mlp.experts.weight_packed": "W4A16",
    }
    assert got == want
    assert vllm_prefix_keys({"model_type": "deepseek_v3"}, TAGS) == {}


def test_the_written_description_has_them_beside_the_checkpoint_names():
    files = Ascend().write_metadata({"model_type": "kimi_k25"}, TAGS, {}, float_linears=[], kv_cache=False,
                                    mla=True, target=VLLM_ASCEND)
    desc = json.loads(files[0][1])
    assert desc["language_model.layers.1.mlp.experts.weight"] == "W4A8_DYNAMIC"
    assert all(desc[k] == t for k, t in TAGS.items())
    plain = json.loads(Ascend().write_metadata({"model_type": "deepseek_v3"}, TAGS, {}, float_linears=[],
                                               kv_cache=False, mla=True, target=VLLM_ASCEND)[0][1])
    assert not any(k.startswith("language_model.layers.") for k in plain)
