"""Tiny compressed-tensors releases written by the compressed-tensors library itself (its
presets, its qparams and its compressors, as llm-compressor drives them), and that library's
own decompression of them, for the source-precision tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cvt.testing.checkpoints import random_weights, tiny_qwen3_config, write_release

# preset -> the c-t format it is stored in
PRESETS = {"MXFP4": "mxfp4-pack-quantized", "NVFP4": "nvfp4-pack-quantized", "FP8": "float-quantized",
           "FP8_DYNAMIC": "float-quantized", "FP8_BLOCK": "float-quantized", "W8A8": "int-quantized",
           "W4A16": "pack-quantized"}


def _minmax(w: torch.Tensor, args):
    """c-t's observed min / max for the strategy (what llm-compressor's memoryless observer takes)."""
    from compressed_tensors.quantization import QuantizationStrategy as S

    n, k = w.shape
    if args.strategy == S.TENSOR:
        return w.amin().reshape(1), w.amax().reshape(1)
    if args.strategy == S.CHANNEL:
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if args.strategy == S.BLOCK:
        bn, bk = args.block_structure
        b = w.reshape(n // bn, bn, k // bk, bk)
        return b.amin((1, 3)), b.amax((1, 3))
    g = w.reshape(n, k // args.group_size, args.group_size)
    return g.amin(-1), g.amax(-1)


def scheme_of(preset: str, group_size: int | None = None):
    """c-t's scheme for `preset` (targets Linear); `group_size`: another group than the preset's
    (0: per channel), for tiny layers narrower than its 128."""
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group_size is not None:
        update = {"group_size": group_size} if group_size else {"group_size": None, "strategy": "channel"}
        scheme = scheme.model_copy(update={"weights": scheme.weights.model_copy(update=update)})
    return scheme


def compress(w: torch.Tensor, preset: str, global_scale: torch.Tensor | None = None,
             group_size: int | None = None) -> dict[str, torch.Tensor]:
    """One linear's stored parts (suffix -> tensor), by the c-t compressor of `preset`'s format
    (`global_scale`: nvfp4's, given for a fused group; default: the linear's own; `group_size`:
    `scheme_of`'s)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationStrategy as S
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = scheme_of(preset, group_size)
    args = scheme.weights
    gs = None
    if args.strategy == S.TENSOR_GROUP:
        gs = generate_gparam(w.amin(), w.amax()) if global_scale is None else global_scale
    lo, hi = _minmax(w, args)
    scale, zp = calculate_qparams(lo, hi, args, global_scale=gs)
    sd = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
    if gs is not None:
        sd["weight_global_scale"] = gs
    out = BaseCompressor.get_value_from_registry(PRESETS[preset]).compress(sd, scheme)
    return {k: v.contiguous() for k, v in out.items()}


def quantization_config(preset: str, ignore=("lm_head",), group_size: int | None = None) -> dict:
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig(config_groups={"group_0": scheme_of(preset, group_size)},
                            format=PRESETS[preset], quantization_status="compressed", ignore=list(ignore))
    return json.loads(qc.model_dump_json())


def write_ct_release(dst: Path, preset: str, seed: int = 0, moe: bool = False, group_size: int | None = None,
                     **overrides) -> Path:
    """A tiny Qwen3 release with every linear but lm_head stored in `preset` by the c-t library
    (`group_size`: `scheme_of`'s)."""
    pytest.importorskip("compressed_tensors")
    config = tiny_qwen3_config(moe=moe, **overrides)
    tensors = {}
    for name, w in random_weights(config, seed).items():
        module = name[: -len(".weight")]
        if name.endswith("_proj.weight"):
            parts = compress(w.to(torch.bfloat16), preset, group_size=group_size)
            tensors.update({f"{module}.{k}": v for k, v in parts.items()})
        else:
            tensors[name] = w.float() if name.endswith("e_score_correction_bias") else w.to(torch.bfloat16)
    config["quantization_config"] = quantization_config(preset, group_size=group_size)
    return write_release(dst, config, tensors, 2, move_scale=False)


def ct_decompressed(src: Path, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """The c-t package's model-free dequantizer's output for `src` (name -> tensor)."""
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters import CompressedTensorsDequantizer
    from safetensors.torch import load_file

    dst = src.parent / (src.name + "-ct-deq")
    deq = CompressedTensorsDequantizer(src, ignore=["model.embed_tokens", "lm_head", "re:.*norm$"], dtype=dtype)
    convert_checkpoint(src, dst, deq, device="cpu", max_workers=1)
    got = {}
    for f in dst.glob("*.safetensors"):
        got.update(load_file(str(f)))
    return got


def write_ct_deepseek_release(dst: Path, preset: str = "MXFP4", seed: int = 0, shared_global: bool = False,
                              **overrides) -> Path:
    """A tiny DeepSeek-V3-shaped release (Kimi-K3's layout: MLA, a dense layer, routed and shared
    experts, an MTP layer) with every quantizable linear stored in `preset` by the c-t library, as
    llm-compressor writes it (targets Linear, lm_head ignored); kv_lora_rank 64, so that every
    in_features is a multiple of 32. `shared_global`: nvfp4's fused groups (q_a + kv_a, gate + up)
    share one global scale, the smallest of theirs, as llm-compressor's
    ``update_fused_layer_weight_global_scales`` sets them (else each linear has its own)."""
    from compressed_tensors.quantization.utils import generate_gparam

    from cvt.convert.arch import arch_for
    from cvt.testing.checkpoints import tiny_deepseek_config

    pytest.importorskip("compressed_tensors")
    config = tiny_deepseek_config(kv_lora_rank=64, **overrides)
    arch = arch_for(config)
    weights = {n: w.to(torch.bfloat16) for n, w in random_weights(config, seed).items()}
    quantized = {arch.classify(n).module: w for n, w in weights.items() if arch.classify(n).rule.quantizable
                 and arch.classify(n).param == "weight" and w.dim() == 2 and n != "lm_head.weight"}
    tensors = {}
    for name, w in weights.items():
        module = name[: -len(".weight")]
        if module not in quantized:
            tensors[name] = w.float() if name.endswith("e_score_correction_bias") else w
            continue
        gs = None
        if shared_global and arch.fused_group(module):
            gs = min((generate_gparam(quantized[m].amin(), quantized[m].amax()) for m in arch.fused_group(module)),
                     key=float)
        tensors.update({f"{module}.{k}": v for k, v in compress(w, preset, gs).items()})
    config["quantization_config"] = quantization_config(preset)
    return write_release(dst, config, tensors, 2, move_scale=False)


def corrupt_tensor(src: Path, name: str, fn) -> None:
    """Rewrite one tensor of the release `src` in the shard that holds it (`fn` returns None:
    remove it, from the index too)."""
    from safetensors.torch import load_file, save_file

    index = json.loads((src / "model.safetensors.index.json").read_text())
    f = src / index["weight_map"][name]
    tensors = load_file(str(f))
    new = fn(tensors[name])
    if new is None:
        del tensors[name], index["weight_map"][name]
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        tensors[name] = new
    save_file(tensors, str(f), metadata={"format": "pt"})


def assert_corrupt_refused(src: Path, dst: Path, verb: str, name: str, fn, why: str) -> None:
    """After `corrupt_tensor(src, name, fn)`, `cvt VERB SRC DST` (quantize: w8a8; shard: one rank)
    exits 1 with one line naming `name` and saying `why`, and writes no DST."""
    from tests.conftest import run_cvt

    corrupt_tensor(src, name, fn)
    args = {"quantize": ("--scheme", "w8a8"), "shard": ("--world-size", "1")}.get(verb, ())
    r = run_cvt(verb, str(src), str(dst), *args, "--quiet")
    assert r.rc == 1, r.err
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cvt: error: ") and name in lines[0] and why in lines[0], r.err
    assert not dst.exists()
