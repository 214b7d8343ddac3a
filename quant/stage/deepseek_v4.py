"""What the serving stacks load of a quantized DeepSeek-V4, beyond the release's own tensors.

`aliases`: vllm-ascend's ``DeepSeekV4MTP.load_weights`` (vllm_ascend/models/deepseek_v4/mtp.py @
182b75e; v0.23.0 models/deepseek_v4_mtp.py) reads only ``mtp.0.*`` tensors: the draft's embedding
from ``mtp.0.emb.tok_emb.weight`` and its ParallelLMHead from ``mtp.0.head.weight``, and asks
``AscendModelSlimConfig.get_quant_method`` for prefix ``mtp.0.head`` (a KeyError when the
description has no ``mtp.0.head.weight``). It maps the release's top-level ``embed.weight`` /
``head.weight`` onto them only under the ``deepseek_v4_fp8`` config. DeepSeek-V4-Flash-Base ships
both copies; V4-Flash does not, so an ascend output of it gets them (BF16, FLOAT), equal to
``embed`` / ``head``.
"""

from __future__ import annotations

from typing import Mapping

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
