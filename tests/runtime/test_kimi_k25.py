"""Kimi-K2.5 runtime (text only): parity with transformers' Kimi-K2.5 language model, the release's
names loaded (``language_model.`` prefix, INT4 experts), the vision tower left unread and said so.

Referee: transformers 5's Kimi_K25ForConditionalGeneration (models/kimi_k25/modeling_kimi_k25.py:
Kimi_K25Model builds ``language_model = AutoModel.from_config(text_config)`` and Kimi_K25ForConditionalGeneration
its ``lm_head``), text-only input ids, eager attention, random weights copied in by name.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from cvt.testing.checkpoints import kimi_int4_tensors, tiny_kimi_k25_config, write_release  # noqa: E402
from cvt.runtime.loader import load_model  # noqa: E402
from cvt.runtime.models import build_model  # noqa: E402
from cvt.tests.conftest import run_cvt  # noqa: E402
from cvt.tests.runtime.test_deepseek_v3 import YARN, assert_logits_close, tokens, unfuse  # noqa: E402

PARITY = {
    "tiny": tiny_kimi_k25_config(),
    # K2.5's own rope: yarn over a longer max_position_embeddings; 8 experts in 2 groups, no dense layer
    "yarn_groups": tiny_kimi_k25_config(rope_scaling=YARN, max_position_embeddings=128, n_routed_experts=8,
                                        n_group=2, topk_group=1, num_experts_per_tok=3, first_k_dense_replace=0),
}


def hf_kimi(cfg: dict, seed: int = 0):
    """transformers' Kimi_K25ForConditionalGeneration of `cfg` (its vision_config in transformers' own
    key names), every tensor redrawn (norms near 1, non-zero router bias)."""
    transformers = pytest.importorskip("transformers")
    text = {k: v for k, v in cfg["text_config"].items() if k != "quantization_config"} | {"torch_dtype": "float32"}
    vc = cfg["vision_config"]
    vision = {"hidden_size": vc["vt_hidden_size"], "intermediate_size": vc["vt_intermediate_size"],
              "num_hidden_layers": vc["vt_num_hidden_layers"], "num_attention_heads": vc["vt_num_attention_heads"],
              "patch_size": vc["patch_size"], "pos_emb_height": vc["init_pos_emb_height"],
              "pos_emb_width": vc["init_pos_emb_width"]}
    hc = transformers.Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=vc["mm_hidden_size"],
                                     tie_word_embeddings=False, attn_implementation="eager")
    model = transformers.Kimi_K25ForConditionalGeneration(hc).eval()
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, t in model.state_dict().items():
        if name.endswith("norm.weight"):
            sd[name] = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
        elif name.endswith("e_score_correction_bias"):
            sd[name] = 0.2 * torch.randn(t.shape, generator=g)
        else:
            sd[name] = torch.randn(t.shape, generator=g) / math.sqrt(t.shape[-1])
    model.load_state_dict(sd, strict=True)
    return model


def text_state(hf) -> dict:
    """The language model's tensors under cvt's runtime names (experts unfused)."""
    sd = {n.replace("model.language_model.", "model.", 1): t for n, t in hf.state_dict().items()
          if n.startswith("model.language_model.") or n == "lm_head.weight"}
    return unfuse(sd)


@pytest.mark.parametrize("name", sorted(PARITY))
def test_text_logits_match_transformers_kimi_k25(name):
    cfg = PARITY[name]
    hf = hf_kimi(cfg)
    ours = build_model(cfg, dtype=torch.float32)                  # the wrapper's text_config picks DeepSeek-V3
    ours.load_state_dict(text_state(hf), strict=True)
    t = tokens(2, 12)
    with torch.no_grad():
        ref = hf(input_ids=t).logits
    assert_logits_close(ours(t), ref)
    cache = ours.new_cache(batch=2, max_len=12)
    steps = [ours(t[:, :5], 0, cache)] + [ours(t[:, p:p + 1], p, cache) for p in range(5, 12)]
    assert_logits_close(torch.cat(steps, dim=1), ref)


def unpack_ct_int4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Independent of cvt: nibble i of each int32 is (v >> 4i) & 0xF, minus 8 (FORMATS.md 1.2)."""
    v = packed.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(v >> (4 * i)) & 0xF for i in range(8)], dim=-1).reshape(n, k) - 8


def test_release_loads_by_its_names_and_runs_text_only(tmp_path):
    cfg = tiny_kimi_k25_config()
    tensors = kimi_int4_tensors(cfg, seed=3)
    src = write_release(tmp_path / "k25", cfg, tensors, n_shards=3, move_scale=False)
    loaded = load_model(src, dtype=torch.float32)
    vision = sorted(n for n in tensors if n.startswith(("vision_tower.", "mm_projector.")))
    assert sorted(loaded.skipped) == vision and len(vision) == 2 + 1 + 2 * 12 + 2 + 6
    model = loaded.model
    assert not any("vision" in n for n, _ in model.named_parameters())
    e = "language_model.model.layers.2.mlp.experts.3.up_proj"
    n, k = tensors[e + ".weight_shape"].tolist()
    want = (unpack_ct_int4(tensors[e + ".weight_packed"], n, k).float()
            * tensors[e + ".weight_scale"].float().repeat_interleave(32, dim=1))
    assert torch.equal(model.get_submodule(e.removeprefix("language_model.")).dense_weight(), want)
    assert torch.equal(model.model.layers[1].self_attn.q_b_proj.weight,
                       tensors["language_model.model.layers.1.self_attn.q_b_proj.weight"].float())
    r = run_cvt("run", src, "--input-ids", "5,6,7,8", "--max-new-tokens", "2", "--device", "cpu", "--quiet")
    assert r.rc == 0, r.err
    assert r.err.strip() == (f"cvt: note: kimi_k25: running the text model only (the {len(vision)} vision tower / "
                             "projector tensors are not loaded)")
