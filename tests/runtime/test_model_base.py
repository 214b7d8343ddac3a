"""The model contract every family shares through `cvt.runtime.models.base` (CausalLM, check_room):
the same refusals, naming the family's cache, for DeepSeek-V3, DeepSeek-V3.2 and Qwen3."""

from __future__ import annotations

import pytest
import torch

from cvt.testing.checkpoints import tiny_deepseek_config, tiny_deepseek_v32_config, tiny_qwen3_config
from cvt.errors import CvtError
from cvt.runtime.models import base, deepseek_v3, deepseek_v32, qwen3

FAMILIES = {  # module, config, how its errors name its cache
    "deepseek_v3": (deepseek_v3, tiny_deepseek_config(), "MLA cache"),
    "deepseek_v32": (deepseek_v32, tiny_deepseek_v32_config(), "MLA cache"),
    "qwen3": (qwen3, tiny_qwen3_config(), "KV cache"),
}


def _model(name: str, positions: int = 8):
    mod, cfg, _ = FAMILIES[name]
    return mod.Model(mod.Args.from_config({**cfg, "max_position_embeddings": positions}), dtype=torch.float32)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_refusals_are_shared(name):
    model, cache_name = _model(name), FAMILIES[name][2]
    assert isinstance(model, base.CausalLM) and model.max_positions == 8
    with pytest.raises(CvtError, match=f"^{cache_name} quantization 'int4' is not supported "
                                       r"\(supported: None, auto, int8, fp8\)$"):
        model.new_cache(1, 4, quant="int4")
    with pytest.raises(CvtError, match=f"^{cache_name} max_len 9 exceeds max_position_embeddings 8$"):
        model.new_cache(1, 9)
    with pytest.raises(CvtError, match="^an int8 KV cache needs calibrated int8 KV-cache scales and this "
                                       "model has none "):
        model.new_cache(1, 4, quant="int8")
    with pytest.raises(CvtError, match=r"^positions 6\.\.8 exceed max_position_embeddings 8$"):
        model(torch.zeros(1, 3, dtype=torch.int64), start_pos=6)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_cache_bounds(name):
    """A cache of batch 1, max_len 4 refuses batch 2, and positions past 3, naming itself."""
    model, cache_name = _model(name), FAMILIES[name][2]
    caches = model.new_cache(1, 4)
    assert len(caches) == model.args.num_hidden_layers
    cache = caches[0]
    a = model.args
    if name == "qwen3":
        def put(b, start, s):
            k = torch.zeros(b, a.kv_heads, s, a.dim_head)
            return cache.update(k, k, start)
    else:
        def put(b, start, s):
            return cache.write(start, torch.zeros(b, s, a.kv_lora_rank), torch.zeros(b, s, a.qk_rope_head_dim))
    put(1, 0, 4)
    with pytest.raises(CvtError, match=f"^{cache_name} of batch 1, max_len 4 cannot hold batch 2 at positions 0..0$"):
        put(2, 0, 1)
    with pytest.raises(CvtError, match=f"^{cache_name} of batch 1, max_len 4 cannot hold batch 1 at positions 3..4$"):
        put(1, 3, 2)
    if name == "deepseek_v32":
        cache.index_write(0, torch.zeros(1, 4, a.index_head_dim))
        with pytest.raises(CvtError, match="^indexer cache of batch 1, max_len 4 cannot hold batch 1 "
                                           "at positions 2..4$"):
            cache.index_write(2, torch.zeros(1, 3, a.index_head_dim))


def test_check_room():
    store = torch.zeros(2, 3, 5)                  # batch 2, positions on dim 2 (5), dim 1 is not positions
    base.check_room("X cache", store, 2, 2, 0, 5)
    with pytest.raises(CvtError, match=r"^X cache of batch 2, max_len 5 cannot hold batch 2 at positions 4\.\.5$"):
        base.check_room("X cache", store, 2, 2, 4, 6)
    with pytest.raises(CvtError, match=r"^X cache of batch 2, max_len 3 cannot hold batch 1 at positions 0\.\.3$"):
        base.check_room("X cache", store, 1, 1, 0, 4)
