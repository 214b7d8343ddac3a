"""Tiny NVIDIA ModelOpt releases (NVFP4, FP8, MXFP8, FP8_PB_WO, MIXED_PRECISION) for the source-precision tests, written
from ModelOpt's published code, since its package does not install here with its dependencies
(nvidia-modelopt 0.47: omegaconf, pulp, nvidia-ml-py, ...):

* codes and scales: ``NVFP4QTensor.quantize`` / ``get_weights_scaling_factor(_2)`` / ``_cast_fp4``,
  ``FP8QTensor.quantize`` (per-tensor amax / 448), ``MXFP8QTensor.quantize`` (E8M0 exponent
  ceil(log2(amax / 448)) + 127), TensorRT-Model-Optimizer modelopt/torch/quantization/qtensor/
  {nvfp4,fp8,mxfp8}_tensor.py; `test_modelopt_sources.py` checks these bytes against the package
  itself where it imports;
* names and configs: modelopt/torch/export/unified_export_hf.py (``X.weight``, ``X.weight_scale``,
  ``X.weight_scale_2``, ``X.input_scale``, float32 scalars; hf_quant_config.json with
  ``producer`` / ``quantization``) and convert_hf_config.py (the same in config.json's
  quantization_config, quant_method "modelopt");
* FP8_PB_WO: quant_utils.py ``to_quantized_weight`` (``FP8QTensor.quantize`` with block_sizes
  {-1: 128, -2: 128}: the weight divided by its block's amax / 448), the scale exported
  [out_blk, 1, in_blk, 1] float32 as vLLM's ``ModelOptFp8PbWoLinearMethod`` reads it
  (vllm/model_executor/layers/quantization/modelopt.py, commit 00155cdecca7); partial edge blocks
  (the tiny sizes are not multiples of 128) take their own amax;
* MIXED_PRECISION: quant_utils.py ``process_layer_quant_config`` (``quantized_layers``: every
  quantized layer -> {"quant_algo": "FP8"} / {"quant_algo": "NVFP4", "group_size": 16}, no
  exclude_modules, the rest float), read by vLLM's ``ModelOptMixedPrecisionConfig``.

`reference_dequant` is the dequantization written out independently of cvt (bit operations on
the stored bytes), after ``NVFP4QTensor.dequantize`` and vLLM's ``dequantize_to_dtype``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cvt.testing.checkpoints import random_weights, tiny_qwen3_config, write_release

ALGOS = ("NVFP4", "FP8", "MXFP8")
MIXED = "MIXED_PRECISION"
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float32)
_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5])


def _cast_fp4(x: torch.Tensor) -> torch.Tensor:
    """NVFP4QTensor._cast_fp4: the E2M1 code (sign << 3 | magnitude), ties to even."""
    sign = (x < 0).to(torch.uint8)
    a = x.abs()
    ordinal = torch.searchsorted(_BOUNDS, a, out_int32=True).to(torch.uint8)
    odd = torch.any(a.unsqueeze(-1) == _BOUNDS[[1, 3, 5]], dim=-1).to(torch.uint8)
    return (sign << 3) + ordinal + odd


def nvfp4(w: torch.Tensor, s2: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One linear as ModelOpt NVFP4 (`w` float32 [n, k], k % 16 == 0; `s2`: its weight_scale_2,
    default amax / (6 * 448), given for a fused group from the group's amax)."""
    n, k = w.shape
    s2 = w.abs().amax().float() / (6.0 * 448.0) if s2 is None else s2.float()
    amax = w.reshape(n, k // 16, 16).abs().amax(-1).float()
    s = amax / (6.0 * s2)
    s[s == 0] = 1.0
    s = s.clamp(min=2**-9, max=448.0).to(torch.float8_e4m3fn)
    scaled = (w.reshape(n, k // 16, 16) / (s.to(torch.float32) * s2).unsqueeze(-1)).reshape(n, k)
    q = _cast_fp4(scaled)
    return {"weight": (q[:, 1::2] << 4) | q[:, 0::2], "weight_scale": s, "weight_scale_2": s2.reshape(())}


def fp8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """One linear as ModelOpt FP8 (per-tensor scale amax / 448)."""
    s = (w.abs().amax().float() / 448.0).reshape(())
    return {"weight": (w / s).to(torch.float8_e4m3fn), "weight_scale": s}


def mxfp8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """One linear as ModelOpt MXFP8 (E8M0 per 32 along k, stored uint8)."""
    n, k = w.shape
    amax = w.reshape(n, k // 32, 32).abs().amax(-1).float() / 448.0
    e = torch.clamp(torch.ceil(torch.where(amax > 0, torch.log2(amax), torch.tensor(-127.0))), -127, 127)
    scale = (e + 127).to(torch.uint8)
    scaled = w.reshape(n, k // 32, 32) * torch.exp2(127 - scale.float()).unsqueeze(-1)
    q = torch.clamp(scaled, -448.0, 448.0).to(torch.float8_e4m3fn).reshape(n, k)
    return {"weight": q, "weight_scale": scale}


def fp8_pb_wo(w: torch.Tensor, block: int = 128) -> dict[str, torch.Tensor]:
    """One linear as ModelOpt FP8_PB_WO: a float32 scale amax / 448 per block x block (an all-zero
    block 1.0), stored [ceil(n/block), 1, ceil(k/block), 1]."""
    n, k = w.shape
    a, b = -(-n // block), -(-k // block)
    padded = torch.zeros(a * block, b * block, dtype=torch.float32)
    padded[:n, :k] = w
    blocks = padded.reshape(a, block, b, block)
    s = blocks.abs().amax(dim=(1, 3), keepdim=True) / 448.0
    s[s == 0] = 1.0
    q = (blocks / s).reshape(a * block, b * block)[:n, :k].to(torch.float8_e4m3fn)
    return {"weight": q.contiguous(), "weight_scale": s.contiguous()}


WRITERS = {"NVFP4": nvfp4, "FP8": fp8, "MXFP8": mxfp8, "FP8_PB_WO": fp8_pb_wo, "W4A16_NVFP4": nvfp4}


def mixed_algo(module: str) -> str | None:
    """The MIXED_PRECISION release's per-layer algorithm: attention FP8, routed experts NVFP4 (the
    last layer's W4A16_NVFP4, the same storage), the dense layer 0's MLP and o_proj left float."""
    if module.startswith("model.layers.0.") and module.endswith(("mlp.gate_proj", "mlp.up_proj", "o_proj")):
        return None
    if ".mlp.experts." in module:
        return "W4A16_NVFP4" if module.startswith("model.layers.2.") else "NVFP4"
    return "FP8"


def hf_quant_config(algo: str, layers: list[str] | None = None) -> dict:
    """hf_quant_config.json for `algo`; MIXED_PRECISION: `layers` are the quantized linears."""
    if algo == MIXED:
        listed = {m: {"quant_algo": a, **({"group_size": 16} if "NVFP4" in a else {})}
                  for m in layers or [] if (a := mixed_algo(m)) is not None}
        quant = {"quant_algo": MIXED, "kv_cache_quant_algo": "FP8", "quantized_layers": listed}
        return {"producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": quant}
    quant = {"quant_algo": algo, "kv_cache_quant_algo": "FP8" if algo == "FP8" else None,
             "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"]}
    if algo == "NVFP4":
        quant["group_size"] = 16
    return {"producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": quant}


def config_json_form(algo: str, layers: list[str] | None = None) -> dict:
    """convert_hf_quant_config_format's config.json quantization_config for `algo`."""
    q = hf_quant_config(algo, layers)["quantization"]
    out = {"ignore": q.get("exclude_modules", []), "quant_algo": algo, "producer": hf_quant_config(algo)["producer"],
           "quant_method": "modelopt"}
    if "quantized_layers" in q:
        out["quantized_layers"] = q["quantized_layers"]
    if q["kv_cache_quant_algo"]:
        out["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    return out


def write_modelopt_release(dst: Path, algo: str, seed: int = 0, side_only: bool = True, scale_2=None,
                           **overrides) -> Path:
    """A tiny Qwen3-MoE release with every ``*_proj`` linear in ModelOpt `algo`, the rest BF16;
    `side_only`: the quantization described by hf_quant_config.json alone (older exports, e.g.
    nvidia/DeepSeek-R1-FP4), else also in config.json (newer ones write both). `scale_2` (NVFP4):
    ``f(module, s2) -> s2``; given, the linears vLLM fuses (q/k/v, gate/up) share one
    weight_scale_2 from their largest amax, as ModelOpt's export unifies them
    (modelopt/torch/export/quant_utils.py ``preprocess_linear_fusion``), which `f` may then move
    (upward, so that no block scale overflows E4M3)."""
    from cvt.convert.arch import arch_for

    config = tiny_qwen3_config(**{"moe_intermediate_size": 64, **overrides})  # k % 32 for MXFP8
    raw = random_weights(config, seed)
    weights = {n: w.to(torch.bfloat16).float() for n, w in raw.items()}
    arch = arch_for(config)
    tensors = {}
    for name, w in raw.items():
        module = name[: -len(".weight")]
        layer_algo = mixed_algo(module) if algo == MIXED else algo
        if name.endswith("_proj.weight") and layer_algo is not None:
            w = weights[name]
            if scale_2 is None or "NVFP4" not in layer_algo:  # `scale_2`: the NVFP4 linears' only
                parts = WRITERS[layer_algo](w)
            else:
                group = arch.fused_group(module) or (module,)
                amax = max(float(weights[f"{m}.weight"].abs().amax()) for m in group)
                parts = nvfp4(w, scale_2(module, torch.tensor(amax, dtype=torch.float32) / (6.0 * 448.0)))
            tensors.update({f"{module}.{k}": v.contiguous() for k, v in parts.items()})
            tensors[f"{module}.input_scale"] = torch.tensor(0.0125, dtype=torch.float32)
            if layer_algo == "FP8" and name.endswith(("k_proj.weight", "v_proj.weight")):
                tensors[f"{module}.{name[-len('k_proj.weight')]}_scale"] = torch.tensor(1.0, dtype=torch.float32)
        else:
            tensors[name] = w.float() if name.endswith("e_score_correction_bias") else w.to(torch.bfloat16)
    layers = [n[: -len(".weight")] for n in raw if n.endswith("_proj.weight")]
    if not side_only:
        config["quantization_config"] = config_json_form(algo, layers)
    out = write_release(dst, config, tensors, 2, move_scale=False)
    (out / "hf_quant_config.json").write_text(json.dumps(hf_quant_config(algo, layers), indent=4))
    return out


def load_all(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint folder `d`."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def dequantized(tmp_path: Path, algo: str, side_only: bool) -> tuple[Path, dict, dict, list[str]]:
    """An `algo` release through `cvt fp8-to-bf16`: (SRC, BF16's tensors, SRC's, BF16's 39
    linear weight names)."""
    from tests.conftest import run_cvt

    src = write_modelopt_release(tmp_path / "src", algo, side_only=side_only)
    r = run_cvt("fp8-to-bf16", str(src), str(tmp_path / "bf16"), "--quiet")
    assert r.rc == 0, r.err
    ours = load_all(tmp_path / "bf16")
    linears = [n for n in ours if n.endswith("_proj.weight")]
    assert len(linears) == 39
    return src, ours, load_all(src), linears


def reference_dequant(parts: dict[str, torch.Tensor], algo: str) -> torch.Tensor:
    """float32 [n, k] of one stored linear, from its bytes: nibbles by shift and mask (low first),
    E4M3 / E8M0 decoded by the tables of the formats, the products in float32 as ModelOpt's own
    ``dequantize`` and vLLM's ``dequantize_to_dtype`` compute them."""
    w = parts["weight"]
    if algo in ("NVFP4", "W4A16_NVFP4"):
        n, half = w.shape
        codes = torch.stack(((w & 0x0F), (w >> 4)), dim=-1).reshape(n, 2 * half).long()
        block = parts["weight_scale"].view(torch.uint8)
        scale = _e4m3(block) * parts["weight_scale_2"].to(torch.float32)
        return (E2M1[codes].reshape(n, -1, 16) * scale.unsqueeze(-1)).reshape(n, 2 * half)
    values = _e4m3(w.view(torch.uint8))
    if algo == "FP8":
        return values * parts["weight_scale"].to(torch.float32)
    if algo == "FP8_PB_WO":  # scale [a, 1, b, 1]: block (i // 128, j // 128)
        n, k = w.shape
        s = parts["weight_scale"].to(torch.float32)[:, 0, :, 0]
        rows, cols = torch.arange(n) // 128, torch.arange(k) // 128
        return values * s[rows][:, cols]
    n, k = w.shape
    exp = parts["weight_scale"].to(torch.int64) - 127
    return (values.reshape(n, k // 32, 32) * torch.pow(2.0, exp.double()).float().unsqueeze(-1)).reshape(n, k)


def _e4m3(b: torch.Tensor) -> torch.Tensor:
    """float32 of E4M3FN bytes: sign, 4-bit exponent (bias 7), 3-bit mantissa; 0x7F / 0xFF NaN."""
    b = b.to(torch.int64)
    sign = torch.where(b & 0x80 > 0, -1.0, 1.0).double()
    e, m = (b >> 3) & 0xF, b & 0x7
    mag = torch.where(e == 0, m.double() / 8 * 2.0**-6, (1 + m.double() / 8) * torch.pow(2.0, (e - 7).double()))
    mag = torch.where((b & 0x7F) == 0x7F, torch.tensor(float("nan"), dtype=torch.float64), mag)
    return (sign * mag).float()
