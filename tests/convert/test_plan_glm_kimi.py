"""`cvt plan` from the real GLM-5 and Kimi-K2.5 configs: per-rank and model totals counted by hand.

Kimi-K2.5 is planned as the release stores it (and as `cvt quantize --scheme w4a16 --group-size 32
--format ascend --target vllm-ascend` re-emits it): routed experts INT4 g32 (int32-packed codes, bf16
scales [n, k/32], int32 weight_shape [2]), everything else BF16, the vision tower and projector
(335 tensors, 471,143,920 values) carried whole on every rank. Its model total is the release's
tensor bytes, 554.27 GiB (moonshotai/Kimi-K2.5 model.safetensors.index.json inventory).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cvt.convert.placement import make_layout
from cvt.convert.memory_plan import memory_plan
from cvt.tests.conftest import run_cvt
from cvt.tests.runtime.test_glm_moe_dsa import GLM5_CONFIG

CONFIGS = Path(__file__).resolve().parent.parent / "data" / "configs"
K25 = json.loads((CONFIGS / "kimi-k2.5.json").read_text())
BF = lambda n, k: 2 * n * k  # noqa: E731
W4G32 = lambda n, k: n * k // 2 + 2 * n * (k // 32) + 8  # noqa: E731  int32-packed int4, bf16 g32 scales, shape


def mla_layer(c: dict) -> int:
    """BF16 bytes of one MLA attention (q_a, q_b, kv_a, kv_b, o) + its four norms."""
    h, H, ql, kl, r, nope, v = (c[k] for k in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                                               "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
    attn = BF(ql, h) + BF(H * (nope + r), ql) + BF(kl + r, h) + BF(H * (nope + v), kl) + BF(h, H * v)
    return attn + 2 * (ql + kl) + 2 * 2 * h


@pytest.mark.slow
def test_kimi_k25_release_bytes_by_hand():
    t = K25["text_config"]
    h, V, E, mi, L, dense = (t[k] for k in ("hidden_size", "vocab_size", "n_routed_experts", "moe_intermediate_size",
                                            "num_hidden_layers", "first_k_dense_replace"))
    vc = K25["vision_config"]
    vh, vi, vb = vc["vt_hidden_size"], vc["vt_intermediate_size"], vc["vt_num_hidden_layers"]
    mk = vc["mm_hidden_size"] * 4
    carried = 2 * (vh * 3 * 14 * 14 + vh + 64 * 64 * vh
                   + vb * (4 * vh + 3 * vh * vh + 3 * vh + vh * vh + vh + 2 * vi * vh + vi + vh)
                   + 2 * vh + 2 * vc["mm_hidden_size"] + mk * mk + mk + h * mk + h)
    assert carried == 2 * 471_143_920

    def per_rank(experts: int) -> int:
        swiglu = lambda i, f: 2 * f(i, h) + f(h, i)  # noqa: E731
        moe = BF(E, h) + 4 * E + swiglu(mi, BF) + experts * swiglu(mi, W4G32)
        return 2 * BF(V, h) + 2 * h + L * mla_layer(t) + dense * swiglu(t["intermediate_size"], BF) + (L - dense) * moe \
            + carried

    plan = memory_plan(K25, make_layout(ep=64), "w4a16", group_size=32, fmt="ascend", target="vllm-ascend")
    assert plan.min == plan.max == per_rank(E // 64)
    assert plan.model_bytes["carried"] == carried and plan.ranks[0].weights["carried"] == carried
    total = sum(plan.model_bytes.values())
    assert total == per_rank(E)
    assert round(total / 2**30, 2) == 554.27                       # the release's tensor bytes
    r = run_cvt("plan", CONFIGS / "kimi-k2.5.json", "--ep", "64", "--scheme", "w4a16", "--group-size", "32",
                "--format", "ascend", "--target", "vllm-ascend")
    assert r.rc == 0, r.err


@pytest.mark.slow
def test_glm5_bytes_and_kv_cache_by_hand():
    c = GLM5_CONFIG
    h, V, E, mi, L, dense = (c[k] for k in ("hidden_size", "vocab_size", "n_routed_experts", "moe_intermediate_size",
                                            "num_hidden_layers", "first_k_dense_replace"))
    Hi, Di = c["index_n_heads"], c["index_head_dim"]
    indexer = BF(Hi * Di, c["q_lora_rank"]) + BF(Di, h) + 2 * 2 * Di + BF(Hi, h)   # wq_b, wk, k_norm w+b, weights_proj
    layer = mla_layer(c) + indexer
    swiglu = lambda i: 3 * BF(i, h)  # noqa: E731

    def per_rank(experts: int) -> int:
        moe = BF(E, h) + 4 * E + swiglu(mi) + experts * swiglu(mi)
        main = 2 * BF(V, h) + 2 * h + L * layer + dense * swiglu(c["intermediate_size"]) + (L - dense) * moe
        mtp = layer + moe + 2 * BF(V, h) + BF(h, 2 * h) + 3 * 2 * h                     # layer 78 (MTP)
        return main + mtp

    plan = memory_plan(GLM5_CONFIG, make_layout(ep=64), "bf16", kv_tokens=1000)
    assert {r.weight_bytes for r in plan.ranks} == {per_rank(E // 64)}
    total = sum(plan.model_bytes.values())
    assert total == per_rank(E)
    mtp_params = (layer + BF(E, h) + 4 * E + (E + 1) * swiglu(mi) + 2 * BF(V, h) + BF(h, 2 * h) + 3 * 2 * h) // 2
    assert abs((total // 2 - mtp_params) / 744e9 - 1) < 0.005       # GLM-5: 744B parameters
    # per token: every layer's MLA latent + rope key, and (all 78 layers "full") the indexer key, bf16
    assert plan.ranks[0].kv_cache == 16 * L * 2 * (c["kv_lora_rank"] + c["qk_rope_head_dim"] + Di)  # ceil(1000/64)
    shared = {**GLM5_CONFIG, "index_topk_freq": 4, "index_skip_topk_offset": 3}             # GLM-5.1-style sharing
    full = 3 + len(range(6, 78, 4))
    assert memory_plan(shared, make_layout(ep=64), "bf16", kv_tokens=1000).ranks[0].kv_cache == \
        16 * 2 * (L * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) + full * Di)
