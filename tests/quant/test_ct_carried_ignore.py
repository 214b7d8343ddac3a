"""A compressed-tensors output keeps a carried tower's linears float for transformers too (issue 40):
transformers' compressed-tensors quantizer takes every nn.Linear its ``targets`` match minus ``ignore``,
matched against its own module names, unmapped. Kimi-K2.5's vision tower and projector are carried
float (`cvt.convert.arch.kimi_k25`), and transformers 5 builds them as nn.Linear under other names
(model.vision_tower.layers.B.attn.q_proj, model.mm_projector.in_proj): ``ignore`` must cover them.
(Qwen3.5 / Qwen3-Next: test_compressed_tensors_qwen3_5.py loads the output with from_pretrained.)"""

from __future__ import annotations

import json

import pytest
import torch

from cvt.quant.stage import quantize
from cvt.testing.checkpoints import kimi_int4_tensors, tiny_kimi_k25_config, write_release

pytest.importorskip("compressed_tensors")


@pytest.mark.slow  # a K2.5 release, a w4a16 quantize and transformers' model: ~5 s
def test_kimi_k25_carried_linears_are_not_quantized_by_transformers(tmp_path):
    from compressed_tensors.utils.match import match_named_modules

    from cvt.tests.runtime.test_kimi_k25 import hf_kimi

    cfg = tiny_kimi_k25_config()
    src = write_release(tmp_path / "int4", cfg, kimi_int4_tensors(cfg, seed=2), n_shards=2, move_scale=False)
    quantize(src, tmp_path / "ct", scheme="w4a16", fmt="compressed-tensors", group_size=32, quiet=True)
    out = json.loads((tmp_path / "ct" / "config.json").read_text())
    qc = out.get("quantization_config") or out["text_config"]["quantization_config"]
    targets = [t for g in qc["config_groups"].values() for t in g["targets"]]
    model = hf_kimi(cfg)
    towers = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
              and n.startswith(("model.vision_tower.", "model.mm_projector."))}
    assert len(towers) == 14  # 2 blocks x (q, k, v, proj, fc1, fc2) + in_proj, out_proj: all nn.Linear
    quantized = {n for n, _ in match_named_modules(model, targets, qc["ignore"])}
    assert quantized and not quantized & towers, sorted(quantized & towers)
    # under the release's names too (what the output stores: float wqkv / wo / fc0 / fc1 / proj.N)
    from cvt.qtensor.formats.compressed_tensors import match_name

    carried = {n.rpartition(".")[0] for n, t in kimi_int4_tensors(cfg, seed=2).items()
               if n.startswith(("vision_tower.", "mm_projector.")) and n.endswith(".weight") and t.dim() == 2}
    assert carried and all(any(match_name(m, i) for i in qc["ignore"]) for m in carried)
