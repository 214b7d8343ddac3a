"""What the serving stacks load of a quantized DeepSeek-V4, beyond the release's own tensors.

`aliases`: vllm-ascend's ``DeepSeekV4MTP.load_weights`` (vllm_ascend/models/deepseek_v4/mtp.py @
182b75e; v0.23.0 models/deepseek_v4_mtp.py) reads only ``mtp.0.*`` tensors: the draft's embedding
from ``mtp.0.emb.tok_emb.weight`` and its ParallelLMHead from ``mtp.0.head.weight``, and asks
``AscendModelSlimConfig.get_quant_method`` for prefix ``mtp.0.head`` (a KeyError when the
description has no ``mtp.0.head.weight``). It maps the release's top-level ``embed.weight`` /
``head.weight`` onto them only under the ``deepseek_v4_fp8`` config. DeepSeek-V4-Flash-Base ships
both copies; V4-Flash does not, so an ascend output of it gets them (BF16, FLOAT), equal to
``embed`` / ``head``.

`check_format`: vLLM's DeepseekV4ForCausalLM (vllm/models/deepseek_v4/nvidia/model.py) is built for
the release's FP8 layout (``deepseek_v4_fp8``): DeepseekV4Model.load_weights fuses ``attn.wq_a`` +
``attn.wkv`` (``attn.fused_wqa_wkv``), the compressors' wkv + wgate and the shared experts' w1 + w3,
and the class declares no ``packed_modules_mapping``; vLLM's compressed-tensors MoE lookup
(compressed_tensors_moe.py, get_compressed_tensors_moe_method) takes the experts' scheme from a
``Linear`` target or from targets matching gate_proj / up_proj / down_proj, names V4's w1 / w2 / w3
experts do not have. No compressed-tensors output cvt writes for V4 is known to load there, so the
format is refused for V4 before anything is written.
"""

from __future__ import annotations

from typing import Mapping

from cvt.errors import FormatError
from cvt.quant.tensor.layouts import COMPRESSED_TENSORS

MODEL_TYPE = "deepseek_v4"


def aliases(config: Mapping, names) -> dict[str, str]:
    """``{missing MTP copy: the top-level tensor it copies}`` for a DeepSeek-V4 checkpoint with MTP
    layers (`names`: its tensor names); empty for any other model or when the copies are present."""
    if config.get("model_type") != MODEL_TYPE:
        return {}
    out = {}
    for j in range(config.get("num_nextn_predict_layers") or 0):
        for alias, name in ((f"mtp.{j}.emb.tok_emb.weight", "embed.weight"), (f"mtp.{j}.head.weight", "head.weight")):
            if alias not in names and name in names:
                out[alias] = name
    return out


def check_format(config: Mapping, fmt: str) -> None:
    """FormatError (one line) for an output format no stack loads for DeepSeek-V4 (module docstring)."""
    if config.get("model_type") == MODEL_TYPE and fmt == COMPRESSED_TENSORS:
        raise FormatError(f"{MODEL_TYPE}: --format {fmt} is refused: no compressed-tensors output of V4 is known to load "
                          "in vLLM's DeepseekV4ForCausalLM (its MoE scheme lookup matches experts by a Linear target or "
                          "gate_proj / up_proj / down_proj names, not V4's w1 / w2 / w3, and it fuses wq_a + wkv with no "
                          "packed_modules_mapping); serve the release (or its fp8-to-bf16 output) with vLLM, or quantize "
                          "with --format ascend for vllm-ascend")
