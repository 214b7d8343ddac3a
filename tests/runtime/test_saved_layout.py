"""cvt's runtime on checkpoints transformers' save_pretrained wrote (issue 41, item 4): loaded from
disk by `load_model`, the logits are transformers' own (`from_pretrained` of the same directory,
float32, eager) within 1e-5; training-only keys of transformers' config classes are ignored, an
unknown key is still refused. The checkpoints are `tests/convert/test_saved_layout.saved`'s."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cvt.runtime.loader import load_model  # noqa: E402
from cvt.runtime.models import family  # noqa: E402
from cvt.runtime.models.base import ConfigError  # noqa: E402
from cvt.tests.convert.test_saved_layout import saved  # noqa: E402
from cvt.tests.runtime.test_deepseek_v3 import assert_logits_close, tokens  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek_v4", "kimi_k25", "glm_moe_dsa"])
def test_saved_checkpoint_runs_like_transformers(tmp_path, arch):
    hf, _ = saved(tmp_path, arch)
    cls = getattr(transformers, json.loads((hf / "config.json").read_text())["architectures"][0])
    ref_model = cls.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager").eval()
    ours = load_model(hf, dtype=torch.float32).model
    t = tokens(2, 33, vocab=250)
    with torch.no_grad():
        ref = ref_model(input_ids=t).logits
    assert_logits_close(ours(t), ref)


def test_training_only_keys_ignored_unknown_refused():
    """DeepseekV4Config's router_jitter_noise (router noise while training only) is read past, as
    its nested rope_parameters are read; a key no config class defines is still refused."""
    cfg = transformers.DeepseekV4Config(vocab_size=64, hidden_size=64, num_hidden_layers=2, head_dim=32,
                                        num_attention_heads=2, q_lora_rank=32, o_groups=2, o_lora_rank=16,
                                        n_routed_experts=4, num_experts_per_tok=2).to_dict()
    assert "router_jitter_noise" in cfg and set(cfg["rope_parameters"]) == {"main", "compress"}
    mod, text = family(cfg)
    args = mod.Args.from_config(text)
    assert args.rope_theta == cfg["rope_parameters"]["main"]["rope_theta"]
    with pytest.raises(ConfigError, match="router_jitter_nois"):
        mod.Args.from_config({**text, "router_jitter_noise_v2": 0.0})
    bad = {**text, "rope_parameters": {**text["rope_parameters"],
                                       "compress": {**text["rope_parameters"]["compress"], "rope_theta": 1.0}}}
    with pytest.raises(ConfigError, match="compress_rope_theta"):
        mod.Args.from_config(bad)
