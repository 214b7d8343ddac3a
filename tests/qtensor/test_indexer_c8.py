"""DeepSeek-V3.2's indexer C8 layout and math (`cvt.qtensor.indexer_c8`) pinned to vllm-ascend main.

Consumer code (vllm-project/vllm-ascend @ 182b75e, 2026-08-22):
* ``vllm_ascend/quantization/methods/kv_c8.py`` AscendSFAQuantAttentionMethod.create_weights:
  ``params_dict["indexer.q_rot"] = torch.empty((index_head_dim, index_head_dim), dtype=torch.float32)``
  (and ``indexer.k_rot``), registered under ``@register_scheme("INT8_DYNAMIC", "attention")``.
* ``vllm_ascend/quantization/modelslim_config.py`` get_cache_scale_mapper: checkpoint suffix
  ``.indexer.q_rot`` / ``.indexer.k_rot``; _add_kvcache_quant_metadata: global ``indexer_quant_type``
  switches it on, layer ids come from keys containing ``indexer.quant_type`` via
  ``"".join(re.findall(r"\\.(\\d+)\\.", key))``.
* ``vllm_ascend/ascend_config.py`` _parse_sparse_li_c8_layers_from_quant_config: suffix
  ``.indexer.quant_type`` with a value in ("INT8_DYNAMIC", "W8A8_MXFP8"); its unit test
  ``tests/ut/test_ascend_config.py`` uses ``"model.layers.1.self_attn.indexer.quant_type": "INT8_DYNAMIC"``.
* ``vllm_ascend/attention/sfa_v1.py`` process_weights_after_loading: the rotation it applies is
  ``scipy.linalg.hadamard(128) / 128**0.5`` (Sylvester: H[i, j] = (-1)^popcount(i & j));
  indexer_select_pre_process: ``npu_dynamic_quant(k_li.view(-1, head_dim), dst_type=int8)`` then
  ``k_li_scale.to(float16)`` (CANN DynamicQuant: scale = row max |x| / 127, y = round(x / scale)).
"""

from __future__ import annotations

import math
import re

import pytest

torch = pytest.importorskip("torch")

from cvt.qtensor import indexer_c8  # noqa: E402

CFG = {"model_type": "deepseek_v32", "num_hidden_layers": 2, "index_head_dim": 128}


def sylvester(n: int) -> torch.Tensor:
    """scipy.linalg.hadamard(n) / sqrt(n) by its closed form, float32."""
    h = [[(-1.0) ** bin(i & j).count("1") for j in range(n)] for i in range(n)]
    return (torch.tensor(h, dtype=torch.float64) / math.sqrt(n)).to(torch.float32)


def test_rotation_names_dtypes_shapes_and_values():
    rots = indexer_c8.rotation_tensors(CFG)
    assert list(rots) == [f"model.layers.{i}.self_attn.indexer.{r}_rot" for i in range(2) for r in "qk"]
    for t in rots.values():
        assert t.dtype == torch.float32 and tuple(t.shape) == (128, 128)
        assert torch.equal(t, sylvester(128))
    assert all(indexer_c8.ROT_RE.match(n) for n in rots)
    assert indexer_c8.ROT_RE.match("model.layers.0.self_attn.indexer.wk.weight") is None


def test_hadamard_agrees_with_scipy_when_present():
    scipy_linalg = pytest.importorskip("scipy.linalg")
    for n in (1, 2, 16, 128):
        want = torch.tensor(scipy_linalg.hadamard(n), dtype=torch.float64) / n ** 0.5
        assert torch.equal(indexer_c8.hadamard(n), want.to(torch.float32))


def test_description_keys_are_what_vllm_ascend_parses():
    keys = indexer_c8.description_keys(CFG)
    assert keys == {"model.layers.0.self_attn.indexer.quant_type": "INT8_DYNAMIC",
                    "model.layers.1.self_attn.indexer.quant_type": "INT8_DYNAMIC",
                    "indexer_quant_type": "INT8_DYNAMIC"}
    # modelslim_config._add_kvcache_quant_metadata's layer list
    layers = [int("".join(re.findall(r"\.(\d+)\.", k))) for k in keys if "indexer.quant_type" in k]
    assert layers == [0, 1]
    # ascend_config._parse_sparse_li_c8_layers_from_quant_config's layer names
    names = {k[:-len(".indexer.quant_type")] for k, v in keys.items()
             if k.endswith(".indexer.quant_type") and v in ("INT8_DYNAMIC", "W8A8_MXFP8")}
    assert names == {"model.layers.0.self_attn", "model.layers.1.self_attn"}


def test_dynamic_quant_is_npu_dynamic_quant():
    x = torch.tensor([[127.0, -63.5, 0.5, 1.5, -2.5],       # scale 1: halves round to even
                      [-254.0, 1.0, 3.0, 5.0, 0.0],          # scale 2
                      [0.0, 0.0, 0.0, 0.0, 0.0]])            # all zero: q 0, scale 0
    q, s = indexer_c8.dynamic_quant(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float16 and tuple(s.shape) == (3, 1)
    assert q.tolist() == [[127, -64, 0, 2, -2], [-127, 0, 2, 2, 0], [0, 0, 0, 0, 0]]
    assert s.flatten().tolist() == [1.0, 2.0, 0.0]
    # per row of the last dim: a [b, s, H, D] query gets one scale per (token, head)
    q4, s4 = indexer_c8.dynamic_quant(torch.randn(2, 3, 4, 8))
    assert tuple(q4.shape) == (2, 3, 4, 8) and tuple(s4.shape) == (2, 3, 4, 1)


def test_applies_and_problem():
    assert indexer_c8.applies(CFG, "ascend") and not indexer_c8.applies(CFG, "compressed-tensors")
    assert not indexer_c8.applies({"model_type": "deepseek_v3"}, "ascend")
    assert indexer_c8.problem(CFG) is None
    assert indexer_c8.problem({"model_type": "deepseek_v32", "num_hidden_layers": 2}) is None   # absent: 128
    why = indexer_c8.problem({**CFG, "index_head_dim": 40})
    assert "power-of-two index_head_dim" in why and "40" in why
    with pytest.raises(ValueError, match="power-of-two"):
        indexer_c8.hadamard(40)
