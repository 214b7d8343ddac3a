"""Tiny gpt-oss configs and MXFP4 releases (the openai/gpt-oss-20b layout), for tests and benches.

Sizes are awkward where the format allows: 4 layers alternating sliding (window 5) and full
attention as the release, 2 KV heads for 4 query heads, 6 experts with 2 per token, YaRN rope as
the release's (factor 4 over 32 original positions here). hidden and intermediate sizes are
multiples of 32 (the MXFP4 group). `mxfp4_release_tensors` packs the experts as the release
stores them: ``X_blocks`` u8 [E, N, K/32, 16] (element 2j of a 32-group in the low nibble),
``X_scales`` u8 [E, N, K/32] (E8M0), N / K the rows / inputs of transformers' dequantized
``X`` transposed ([E, K, N] -> [E, N, K]); the codes and scales random (no quantizer: the
release's own, triton_kernels', needs a GPU).
"""

from __future__ import annotations

from typing import Any

CONFIG = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 96, "hidden_size": 64,
    "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "num_local_experts": 6, "num_experts_per_tok": 2, "sliding_window": 5,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "hidden_act": "silu", "attention_bias": True,
    "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32},
}
# the release's config.json quantization_config (openai/gpt-oss-20b)
MXFP4_QC = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                               "model.embed_tokens", "lm_head"]}


def tiny_gpt_oss_config(mxfp4: bool = False, **overrides: Any) -> dict[str, Any]:
    """A tiny gpt-oss config.json (`mxfp4`: with the release's quantization_config)."""
    cfg = {**CONFIG, "rope_parameters": dict(CONFIG["rope_parameters"]), **overrides}
    if mxfp4:
        cfg["quantization_config"] = dict(MXFP4_QC)
    return {k: v for k, v in cfg.items() if v is not None}


def pack_mxfp4(codes, scales):
    """uint8 codes [..., N, K] (0..15) + uint8 scales [..., N, K/32] -> (blocks [..., N, K/32, 16],
    scales): two codes a byte, the even element in the low nibble."""
    *pre, n, k = codes.shape
    c = codes.reshape(*pre, n, k // 32, 16, 2)
    return (c[..., 0] | (c[..., 1] << 4)).contiguous(), scales.contiguous()


def mxfp4_release_tensors(float_tensors: dict, seed: int = 0, low: int = 118, high: int = 130) -> dict:
    """`float_tensors` (BF16 layout, `cvt.convert.arch.gpt_oss.param_shapes`) with the experts'
    gate_up_proj / down_proj replaced by random MXFP4 blocks + scales (E8M0 in low..high-1), the
    rest as BF16; in the release's order (blocks, scales, then the bias)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in float_tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, k, n = t.shape                                   # transformers' [E, in, out]
            codes = torch.randint(0, 16, (e, n, k), generator=g, dtype=torch.uint8)
            scales = torch.randint(low, high, (e, n, k // 32), generator=g, dtype=torch.uint8)
            out[name + "_blocks"], out[name + "_scales"] = pack_mxfp4(codes, scales)
        else:
            out[name] = t.to(torch.bfloat16)
    return out
