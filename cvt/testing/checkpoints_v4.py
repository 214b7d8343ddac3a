"""A tiny synthetic DeepSeek-V4 release in the release's own format, for tests and the demo.

`tiny_deepseek_v4_config()`: 4 decoder layers (sliding window, CSA at rate 4, HCA at rate
128, sliding window) + 1 MTP layer, the first 2 layers hash-routed, hidden 256 with a 200-row
``wq_a`` and a 320-row vocab (partial 128-blocks), 4 routed experts of width 128.
`write_v4_release(dst, config)` writes it as DeepSeek publishes V4 (`cvt.convert.arch.deepseek_v4`):
FP8 e4m3 linears with float8_e8m0fnu 128x128 block scales in ``X.scale``, FP4 routed experts
(int8 ``[n, k/2]``, element 2i in the low nibble, float8_e8m0fnu ``[n, k/32]`` scales) under
``expert_dtype: "fp4"``, float32 hyper-connection / sink / compressor tensors and router bias,
int64 ``tid2eid`` (I64 in the release's shards), BF16 for the rest, over several shards with an
index.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cvt.convert.arch import Role, arch_for
from cvt.convert.fp4 import EXPERT_DTYPE_FP4, FP4_MAX, FP4_TABLE, GROUP
from cvt.testing.checkpoints import quantize_fp8_block, write_release


def tiny_deepseek_v4_config(**overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": 320, "hidden_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 4,
        "num_hash_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
        "qk_rope_head_dim": 16, "q_lora_rank": 200, "o_groups": 2, "o_lora_rank": 64,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "sliding_window": 8,
        "compress_ratios": [0, 4, 128, 0, 4], "compress_rope_theta": 160000.0, "rope_theta": 10000.0,
        "index_n_heads": 8, "index_head_dim": 32, "index_topk": 4, "hc_mult": 2, "hc_sinkhorn_iters": 3,
        "hc_eps": 1e-6, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 1024,
        "bos_token_id": 256, "eos_token_id": 257, "torch_dtype": "bfloat16", "expert_dtype": EXPERT_DTYPE_FP4,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
    }
    cfg.update(overrides)
    return cfg


def quantize_fp4_groups(w):
    """float ``[n, k]`` -> (int8 ``[n, k/2]`` E2M1 pairs, float8_e8m0fnu ``[n, k/32]``) as the
    release stores an FP4 expert: a power-of-two scale per 32 inputs (amax / 6 rounded up),
    each value the nearest table entry."""
    import torch

    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    scale = torch.exp2(torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=1e-30) / FP4_MAX)))
    x = (g / scale[..., None]).reshape(n, k)
    table = torch.tensor(FP4_TABLE[:8])
    idx = (x.abs()[..., None] - table).abs().argmin(-1)
    codes = (idx | ((x < 0).long() << 3)).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)


# float tensors the release keeps in float32 (DeepSeek's V4 inference/model.py builds them under
# torch.float32: Block's hc_*, ParallelHead / MTPBlock hc_head_*, Attention.attn_sink,
# Compressor.ape / wkv / wgate, Gate.bias)
F32_PARAMS = ("attn_sink", "ape", "bias")


def v4_release_tensors(config: dict[str, Any], seed: int = 0) -> dict:
    """name -> tensor in the release's dtypes (module docstring)."""
    import torch

    from cvt.testing.checkpoints import random_weights

    arch = arch_for(config)
    block = tuple(config["quantization_config"]["weight_block_size"])
    fp4 = config.get("expert_dtype") == EXPERT_DTYPE_FP4
    g = torch.Generator().manual_seed(seed + 1)
    out = {}
    for name, w in random_weights(config, seed).items():
        info = arch.classify(name)
        param = info.param
        if param == "tid2eid":
            out[name] = torch.randint(0, arch.num_experts, tuple(w.shape), generator=g, dtype=torch.int64)
        elif param.startswith("hc_") or param in F32_PARAMS or ".compressor.w" in name:
            out[name] = w.float()
        elif param == "weight" and "scale" in info.rule.params:  # FP8 (FP4) in the release: rules with a scale
            if fp4 and info.role is Role.EXPERT:
                out[name], out[name[:-len("weight")] + "scale"] = quantize_fp4_groups(w)
            else:
                q, s = quantize_fp8_block(w, block, "F8_E8M0")
                out[name], out[name[:-len("weight")] + "scale"] = q, s
        else:
            out[name] = w.to(torch.bfloat16)
    return out


def write_v4_release(dst: Path, config: dict[str, Any] | None = None, seed: int = 0, n_shards: int = 3) -> Path:
    config = config or tiny_deepseek_v4_config()
    return write_release(dst, config, v4_release_tensors(config, seed), n_shards, move_scale=False,
                         readme="# tiny synthetic DeepSeek-V4-style release (random weights), written by cvt\n")


__all__ = ["tiny_deepseek_v4_config", "quantize_fp4_groups", "v4_release_tensors", "write_v4_release"]
