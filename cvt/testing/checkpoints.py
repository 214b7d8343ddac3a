"""Tiny synthetic checkpoints in the exact release formats, for `cvt demo`, tests and benches.

`tiny_deepseek_config()` is a DeepSeek-V3 config with awkward FP8 blocks (88-row
kv_a_proj_with_mqa like V3's 576x7168, 192-row q_b_proj, 72-column kv_b_proj, 300-row
vocab) while every quantized linear's input dim is a multiple of 128, so all group sizes
(16..128) apply; one dense and two MoE layers and an MTP layer. `write_fp8_release(dst, config)` writes it the way DeepSeek/Kimi publish:
FP8 e4m3 linears with `weight_scale_inv` block scales, BF16 norms/embeddings/router, F32
`e_score_correction_bias`, several shards with an index (one scale deliberately stored in
a different shard from its weight), config.json with `quantization_config`, a byte-level
tokenizer, generation_config.json and a remote-code .py file (copied, never run).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from cvt.convert.arch import arch_for
from cvt.dtypes import dtype_code
from cvt.convert.safetensors_io import TensorSpec, encode_header
from cvt.qtensor.layouts import COMPRESSED_TENSORS

FP8_MAX = 448.0


def tiny_deepseek_config(**overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "pad_token_id": 258,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 256,
        "initializer_range": 0.02,
        "intermediate_size": 384,
        "kv_lora_rank": 72,
        "max_position_embeddings": 1024,
        "moe_intermediate_size": 128,
        "n_group": 2,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "num_nextn_predict_layers": 1,
        "q_lora_rank": 128,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "rms_norm_eps": 1e-06,
        "rope_interleave": True,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "tie_word_embeddings": False,
        "topk_group": 1,
        "use_cache": True,
        "vocab_size": 300,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        },
    }
    cfg.update(overrides)
    return cfg


def tiny_deepseek_v32_config(**overrides: Any) -> dict[str, Any]:
    """`tiny_deepseek_config` as a DeepSeek-V3.2 (sparse attention): a lightning indexer of 8 heads x
    40 dims (wq_b [320, 128] and wk [40, 256]: partial FP8 blocks like q_b_proj's) keeping the top 8
    past tokens. No ``rope_interleave`` key: V3.2's MLA rope is always interleaved (transformers'
    DeepseekV32Config has no such attribute) and its release config.json has none."""
    cfg = tiny_deepseek_config(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
                               index_n_heads=8, index_head_dim=40, index_topk=8)
    cfg.pop("rope_interleave")
    cfg.update(overrides)
    return cfg


def tiny_glm_moe_dsa_config(**overrides: Any) -> dict[str, Any]:
    """`tiny_deepseek_v32_config` as a GLM-5 (model_type glm_moe_dsa): one routing group (GLM's), the
    indexer rope interleaved (stated, as GLM-5's config.json does), every layer's indexer "full"."""
    cfg = tiny_deepseek_v32_config(architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", n_group=1,
                                   indexer_rope_interleave=True)
    cfg.update(overrides)
    return cfg


# Kimi-K2.5's quantization_config (moonshotai/Kimi-K2.5 config.json, top level and text_config): routed
# experts INT4 pack-quantized, symmetric, group 32; attention, shared experts, dense MLP, lm_head BF16
KIMI_INT4_QC = {
    "config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                                  "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                                              "group_size": 32, "num_bits": 4, "observer": "minmax",
                                              "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                                              "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": COMPRESSED_TENSORS, "quantization_status": "compressed",
}


def tiny_kimi_k25_config(vision: dict[str, Any] | None = None, **text_overrides: Any) -> dict[str, Any]:
    """A tiny Kimi-K2.5: `tiny_deepseek_config`'s text model (no MTP layer, one routing group, as
    Kimi's) under ``text_config``, a 2-block vision tower of width 32 (vt_* keys, as the release's
    vision_config) with a 2x2 merge projector into the text width, and K2.5's INT4 quantization_config."""
    text = tiny_deepseek_config(**{"num_nextn_predict_layers": 0, "n_group": 1, **text_overrides})
    text["quantization_config"] = KIMI_INT4_QC
    vc = {"init_pos_emb_height": 4, "init_pos_emb_time": 4, "init_pos_emb_width": 4, "merge_kernel_size": [2, 2],
          "merge_type": "sd2_tpool", "mm_hidden_size": 32, "mm_projector_type": "patchmerger", "model_type": "",
          "patch_size": 2, "pos_emb_type": "divided_fixed", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05,
          "text_hidden_size": text["hidden_size"], "video_attn_type": "spatial_temporal", "vt_hidden_size": 32,
          "vt_intermediate_size": 48, "vt_num_attention_heads": 2, "vt_num_hidden_layers": 2, **(vision or {})}
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"],
            "pad_token_id": text["pad_token_id"], "dtype": "bfloat16", "quantization_config": KIMI_INT4_QC,
            "text_config": text, "tie_word_embeddings": False, "vision_config": vc}


def pack_int4_ct(codes):
    """int codes [n, k] in -8..7 -> int32 [n, k/8]: compressed-tensors pack-quantized (code + 8,
    element i of each run of 8 along k at bits 4i; FORMATS.md 2.3)."""
    import numpy as np
    import torch

    u = (codes.to(torch.int64) + 8).numpy().astype(np.uint32).reshape(codes.shape[0], -1, 8)
    packed = np.zeros(u.shape[:2], dtype=np.uint32)
    for i in range(8):
        packed |= u[..., i] << np.uint32(4 * i)
    return torch.from_numpy(packed.view(np.int32))


def kimi_int4_tensors(config: dict[str, Any], seed: int = 0) -> dict:
    """name -> tensor of a Kimi-K2.5 release of `config`: routed experts as INT4 g32 (random codes,
    bf16 scales: weight_packed, weight_scale, weight_shape), the router bias F32, everything else
    (vision tower and projector included) BF16."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    out = {}
    for name, w in random_weights(config, seed).items():
        if ".mlp.experts." in name and name.endswith(".weight"):
            n, k = w.shape
            codes = torch.randint(-8, 8, (n, k), generator=g)
            base = name[: -len("weight")]
            out[base + "weight_packed"] = pack_int4_ct(codes)
            out[base + "weight_scale"] = (0.005 + 0.01 * torch.rand(n, k // 32, generator=g)).to(torch.bfloat16)
            out[base + "weight_shape"] = torch.tensor([n, k], dtype=torch.int32)
        elif name.endswith("e_score_correction_bias"):
            out[name] = w.float()
        else:
            out[name] = w.to(torch.bfloat16)
    return out


def quantize_fp8_block(w, block: tuple[int, int] = (128, 128), scale_dtype: str = "F32"):
    """float weight [n, k] -> (float8_e4m3fn [n, k], scale [ceil(n/bn), ceil(k/bk)]) as releases do:
    scale = amax(block) / 448, w_fp8 = w / scale. `scale_dtype` F8_E8M0 rounds scales up to powers of 2."""
    import torch

    n, k = w.shape
    bn, bk = block
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    pad = torch.zeros(gn * bn, gk * bk, dtype=torch.float32)
    pad[:n, :k] = w.float()
    amax = pad.view(gn, bn, gk, bk).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / FP8_MAX
    if scale_dtype == "F8_E8M0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    elif scale_dtype == "BF16":
        scale = scale.to(torch.bfloat16).float()
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    q = (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if scale_dtype == "F8_E8M0":
        stored = scale.to(torch.float8_e8m0fnu)
    elif scale_dtype == "BF16":
        stored = scale.to(torch.bfloat16)
    else:
        stored = scale
    return q, stored


def byte_tokenizer() -> dict[str, Any]:
    """A byte-level BPE tokenizer.json (no merges): token id = byte value, then <bos> <eos> <pad>."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    chars = dict(zip(bs, (chr(c) for c in cs)))
    vocab = {chars[b]: b for b in range(256)}
    specials = ["<bos>", "<eos>", "<pad>"]
    for i, tok in enumerate(specials):
        vocab[tok] = 256 + i
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": 256 + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, t in enumerate(specials)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }


def random_weights(config: dict[str, Any], seed: int = 0):
    """name -> float32 tensor for every weight of `config` (normal init, norms near 1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    arch = arch_for(config)
    shapes = arch.table.param_shapes(arch.config)
    out = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.05 * torch.randn(shape, generator=g)
        elif name.endswith("e_score_correction_bias"):
            t = 0.01 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) * (1.0 / math.sqrt(shape[-1]))
        out[name] = t
    return out


# Float tensors a release stores in F32 (the rest of the float tensors are BF16): the router's
# correction bias, and DeepSeek-V3.2's indexer LayerNorm (the official demo keeps its weight and
# bias float32, inference/model.py `LayerNorm`; loaders list them F32 in the HF release)
F32_IN_RELEASE = ("e_score_correction_bias", ".indexer.k_norm.weight", ".indexer.k_norm.bias")


def release_tensors(config: dict[str, Any], seed: int = 0, scale_dtype: str = "F32", weights: dict | None = None):
    """name -> tensor in release dtypes: FP8 + scales for quantizable linears (per the table),
    F32 for `F32_IN_RELEASE`, BF16 for everything else. `weights`: the float weights to write
    (default: `random_weights(config, seed)`)."""
    import torch

    arch = arch_for(config)
    block = tuple(config["quantization_config"]["weight_block_size"])
    out = {}
    for name, w in (random_weights(config, seed) if weights is None else weights).items():
        info = arch.classify(name)
        if info.rule.quantizable and info.param == "weight":
            q, s = quantize_fp8_block(w, block, scale_dtype)
            out[name] = q
            out[name + "_scale_inv"] = s
        elif name.endswith(F32_IN_RELEASE):
            out[name] = w.float()
        else:
            out[name] = w.to(torch.bfloat16)
    return out


def write_safetensors(path: Path, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """Plain (non-atomic) safetensors writer for fixtures: tensors in the given order."""
    import torch

    specs = [TensorSpec(n, dtype_code(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
    with open(path, "wb") as f:
        f.write(encode_header(specs, {"format": "pt"} if metadata is None else metadata))
        for t in tensors.values():
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def write_release(dst: Path, config: dict[str, Any], tensors: dict, n_shards: int = 3, move_scale: bool = True,
                  readme: str | None = None) -> Path:
    """Write `tensors` as a sharded HF checkpoint with index, config and side files (`readme`: the
    README.md text, default: one line saying the weights are random)."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    per = math.ceil(len(names) / n_shards)
    groups = [names[i : i + per] for i in range(0, len(names), per)]
    if move_scale and len(groups) > 1:
        # a weight's scale in a later shard than the weight, as real releases sometimes do
        for name in groups[0][::-1]:
            if name.endswith("_scale_inv"):
                groups[0].remove(name)
                groups[1].append(name)
                break
    n = len(groups)
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        write_safetensors(dst / fname, {k: tensors[k] for k in group})
        weight_map.update({k: fname for k in group})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    write_side_files(dst, config, readme)
    return dst


def write_side_files(dst: Path, config: dict[str, Any], readme: str | None = None) -> None:
    (dst / "tokenizer.json").write_text(json.dumps(byte_tokenizer(), ensure_ascii=False))
    (dst / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
         "model_max_length": config.get("max_position_embeddings", 1024)}))
    (dst / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id"), "do_sample": False}))
    (dst / "configuration_deepseek.py").write_text("# remote code shipped with the checkpoint; cvt copies it and never runs it\n")
    (dst / "README.md").write_text(readme or "# tiny synthetic DeepSeek-V3-style checkpoint (random weights), written by cvt\n")


def write_fp8_release(dst: Path, config: dict[str, Any] | None = None, seed: int = 0, n_shards: int = 3,
                      scale_dtype: str = "F32") -> Path:
    config = config or tiny_deepseek_config()
    return write_release(dst, config, release_tensors(config, seed, scale_dtype), n_shards)


def tiny_qwen3_config(moe: bool = True, **overrides: Any) -> dict[str, Any]:
    """A tiny Qwen3-MoE (or dense Qwen3) config with awkward sizes, byte-level vocab."""
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if moe else "qwen3",
        "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258,
        "hidden_size": 96, "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 24, "num_hidden_layers": 3, "vocab_size": 300, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 512, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
        "torch_dtype": "bfloat16",
    }
    if moe:
        cfg.update({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": True,
                    "decoder_sparse_step": 1, "mlp_only_layers": [0]})
    cfg.update(overrides)
    return cfg


def write_bf16_checkpoint(dst: Path, config: dict[str, Any], seed: int = 0, n_shards: int = 2,
                          weights: dict | None = None, readme: str | None = None) -> Path:
    """A plain BF16 Hugging Face checkpoint of `config` with random weights (router bias F32), or
    `weights` (name -> float tensor) when given."""
    import torch

    weights = random_weights(config, seed) if weights is None else weights
    tensors = {n: (t.float() if n.endswith("e_score_correction_bias") else t.to(torch.bfloat16))
               for n, t in weights.items()}
    return write_release(dst, config, tensors, n_shards, move_scale=False, readme=readme)
