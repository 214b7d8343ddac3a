"""Tiny Qwen3.5 / Qwen3.5-MoE configs in the release's config.json layout (model_type qwen3_5_moe /
qwen3_5 around a ``text_config``, a small ``vision_config``), for tests and benches.

Sizes are awkward on purpose: 3 linear-attention layers and 1 full one (the release's 3:1),
value heads twice the key heads (Qwen3.5's grouped value heads), partial rotary 0.25 as the
release, two routed experts per token over 6, and an MTP layer when asked for. Qwen3-Next's
(`tiny_qwen3_next_config`) is the same text model at the top level.
"""

from __future__ import annotations

from typing import Any

TEXT = {
    "vocab_size": 96, "hidden_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "max_position_embeddings": 128, "tie_word_embeddings": False, "attention_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
}
MOE = {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 20, "shared_expert_intermediate_size": 28}
VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 24, "num_heads": 2, "in_channels": 3, "patch_size": 4,
          "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 48, "num_position_embeddings": 16,
          "hidden_act": "gelu_pytorch_tanh"}


def tiny_qwen3_5_config(moe: bool = True, vision: bool = True, mtp: int = 0, **text_overrides: Any) -> dict[str, Any]:
    """A tiny Qwen3.5-MoE (or dense Qwen3.5) config.json, text model in ``text_config``."""
    mt = "qwen3_5_moe" if moe else "qwen3_5"
    text = {"model_type": f"{mt}_text", **TEXT, **(MOE if moe else {"intermediate_size": 40})}
    if mtp:
        text["mtp_num_hidden_layers"] = mtp
    text.update(text_overrides)
    cfg: dict[str, Any] = {"architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else
                                             "Qwen3_5ForConditionalGeneration"],
                           "model_type": mt, "tie_word_embeddings": False, "text_config": text}
    if vision:
        cfg["vision_config"] = {"model_type": f"{mt}_vision", **VISION}
    return cfg


def fused_experts(weights: dict) -> tuple[dict, dict]:
    """(fused, per_expert): `weights` (name -> tensor, a Qwen3.5-MoE's per-expert layout) with each
    layer's routed experts fused as the BF16 release stores them (``mlp.experts.gate_up_proj``
    [E, 2I, h], gate rows first; ``mlp.experts.down_proj`` [E, h, I]) where its first expert was,
    and the same weights per expert in the order a fused checkpoint is read (each layer's gate and
    up expert by expert, then its downs)."""
    import re

    import torch

    expert = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    layers: dict[str, dict[tuple[int, str], object]] = {}
    for name, t in weights.items():
        m = expert.match(name)
        if m:
            layers.setdefault(m[1], {})[(int(m[2]), m[3])] = t
    fused, per_expert = {}, {}
    for name, t in weights.items():
        m = expert.match(name)
        if m is None:
            fused[name] = per_expert[name] = t
        elif m[1] + ".gate_up_proj" not in fused:
            parts, n = layers[m[1]], 1 + max(e for e, _ in layers[m[1]])
            fused[m[1] + ".gate_up_proj"] = torch.stack([torch.cat([parts[e, "gate"], parts[e, "up"]]) for e in range(n)])
            fused[m[1] + ".down_proj"] = torch.stack([parts[e, "down"] for e in range(n)])
            per_expert.update({f"{m[1]}.{e}.{w}_proj.weight": parts[e, w] for e in range(n) for w in ("gate", "up")})
            per_expert.update({f"{m[1]}.{e}.down_proj.weight": parts[e, "down"] for e in range(n)})
    return fused, per_expert


def tiny_qwen3_next_config(**overrides: Any) -> dict[str, Any]:
    """A tiny Qwen3-Next config.json (top level, as its release): Qwen3.5-MoE's tiny text model,
    layer 1 a dense SwiGLU (``mlp_only_layers``), the rope keys as the release writes them."""
    text = {k: v for k, v in TEXT.items() if k != "rope_parameters"}
    cfg: dict[str, Any] = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", **text, **MOE,
                           "intermediate_size": 40, "mlp_only_layers": [1], "decoder_sparse_step": 1,
                           "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "norm_topk_prob": True}
    cfg.update(overrides)
    return cfg
