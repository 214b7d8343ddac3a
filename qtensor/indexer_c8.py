"""DeepSeek-V3.2's lightning-indexer C8 ("sparse LI C8"): on-disk layout, description keys, math.

What vllm-ascend main loads and runs (read at 182b75e, 2026-08; v0.23.0 is the same, v0.22.1rc1
names the switch ``enable_sparse_c8``; ``vllm_ascend/quantization/methods/kv_c8.py``
AscendSFAQuantAttentionMethod, ``quantization/modelslim_config.py`` get_quant_type_for_layer /
_add_kvcache_quant_metadata / get_cache_scale_mapper, ``ascend_config.py``
_parse_sparse_li_c8_layers_from_quant_config, ``attention/sfa_v1.py`` AscendSFAImpl
process_weights_after_loading / indexer_select_pre_process / indexer_select_post_process,
``device/device_op.py`` indexer_select_post_process -> npu_lightning_indexer_quant):

* tensors, per decoder layer i (tag ``FLOAT``, as msModelSlim's on_online_rotation_wrapper)::

      model.layers.{i}.self_attn.indexer.q_rot   float32 [index_head_dim, index_head_dim]
      model.layers.{i}.self_attn.indexer.k_rot   float32 [index_head_dim, index_head_dim]

  cvt writes the normalized Sylvester Hadamard H / sqrt(Di), the matrix vllm-ascend's SFA applies
  (``scipy.linalg.hadamard(128) / 128**0.5``; it loads q_rot / k_rot but multiplies by that
  constant). msModelSlim's saver writes its seeded random_hadamard_matrix (seed 1234) instead; both
  are orthogonal and q and k share one, so q . k is unchanged either way.
* description: per layer ``model.layers.{i}.self_attn.indexer.quant_type: "INT8_DYNAMIC"`` (the
  layer filter of ``enable_sparse_li_c8``) and the global ``indexer_quant_type: "INT8_DYNAMIC"``
  (selects the ``("INT8_DYNAMIC", "attention")`` scheme that declares q_rot / k_rot).
* math (dynamic: no stored scales, nothing to calibrate): after RoPE, key k [Di] and query heads
  q [Hi, Di] are rotated (x @ rot), then each row is quantized (``npu_dynamic_quant``):
  ``scale = amax|row| / 127`` (float32), ``x_q = round(x / scale)`` int8, scale kept float16
  (A2/A3; the key cache stores int8 keys [T, Di] and float16 scales [T, 1]). Index score per
  head ``relu(scale_q * scale_k * (q_q . k_q))`` (npu_lightning_indexer_quant), weighted over heads.

The MLA's own cache is not in the file for V3.2: vllm-ascend gives each attention layer one
scheme (the indexer's, or FAKQuant) and its SFA backend never reads ``fa_k``; its SFA cache C8
(``enable_sparse_sfa_c8``) is dynamic per block. msModelSlim's V3.2 adapter puts its C8
placeholders in the indexer only.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from cvt.lazy import torch  # module level must not touch torch.<attr> (cvt.lazy)
from cvt.qtensor.layouts import ASCEND

MODEL_TYPE = "deepseek_v32"
QUANT_TYPE = "INT8_DYNAMIC"                  # vllm-ascend's scheme key and layer-filter value
GLOBAL_KEY = "indexer_quant_type"
ROT_DTYPE = "float32"
SCALE_DTYPE = "float16"                      # A2/A3 (int8); A5 keeps float32 with an fp8 cache
QMAX = 127.0

ROT_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.indexer\.([qk])_rot$")

CONVENTION: dict[str, Any] = {
    "name": "sparse-li-c8",
    "version": 1,
    "applies": "deepseek_v32, ascend format: the lightning indexer's key cache (the MLA cache stays float)",
    "rotation": "q_rot = k_rot = sylvester_hadamard(index_head_dim) / sqrt(index_head_dim), float32, "
                "applied after RoPE: x @ rot",
    "quantize": "per row (key per token, query per token and head): scale = amax / 127, "
                "q = clamp(round_half_to_even(x / scale), -128, 127), scale stored float16",
    "score": "relu(scale_q * scale_k * (q_int8 . k_int8)) per head, weighted sum over heads",
    "dynamic": True,
    "tensors": "model.layers.{i}.self_attn.indexer.{q_rot,k_rot} float32 [index_head_dim, index_head_dim]",
    "description": {"model.layers.{i}.self_attn.indexer.quant_type": QUANT_TYPE, GLOBAL_KEY: QUANT_TYPE},
    "layers": "decoder layers 0 .. num_hidden_layers-1 (no MTP layers)",
    "serving": "vllm-ascend 0.23.0 and main: --additional-config '{\"enable_sparse_li_c8\": true}' (0.22: "
               "enable_sparse_c8); its SFA backend applies a 128x128 Hadamard, the release's index_head_dim",
}


def applies(cfg: Mapping[str, Any], fmt: str) -> bool:
    """Whether an int8 KV cache of this model in this format is the indexer C8 (DeepSeek-V3.2 in
    the Ascend format) rather than the MLA FAKQuant scales; `cfg` the language model's config."""
    return fmt == ASCEND and cfg.get("model_type") == MODEL_TYPE


def index_head_dim(cfg: Mapping[str, Any]) -> int:
    # an absent key means transformers' DeepseekV32Config default, 128 (convert.arch.deepseek_v32
    # INDEX_DEFAULTS; that layer sits above this one)
    return int(cfg.get("index_head_dim") or 128)


def problem(cfg: Mapping[str, Any]) -> str | None:
    """Why this config cannot have the indexer C8 (None: it can)."""
    d = index_head_dim(cfg)
    if d < 1 or d & (d - 1):
        return (f"w8a8c8 for deepseek_v32 (ascend): the indexer C8 rotates q and k by a {d}x{d} Hadamard matrix, "
                f"which exists only for a power-of-two index_head_dim (config.json index_head_dim {d}; the "
                "release's is 128)")
    return None


def hadamard(n: int) -> torch.Tensor:
    """float32 [n, n] Sylvester Hadamard / sqrt(n) (H_1 = [1], H_2m = [[H, H], [H, -H]]; orthogonal
    and symmetric). ValueError when n is not a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n ** 0.5).to(getattr(torch, ROT_DTYPE))


def rotation_tensors(cfg: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """{name: float32 [Di, Di]} of every decoder layer's q_rot and k_rot (layer order)."""
    why = problem(cfg)
    if why is not None:
        raise ValueError(why)
    rot = hadamard(index_head_dim(cfg))
    return {f"model.layers.{i}.self_attn.indexer.{r}_rot": rot.clone()
            for i in range(int(cfg["num_hidden_layers"])) for r in "qk"}


def description_keys(cfg: Mapping[str, Any]) -> dict[str, str]:
    """The quant_model_description.json keys that switch the indexer C8 on (module docstring)."""
    out = {f"model.layers.{i}.self_attn.indexer.quant_type": QUANT_TYPE for i in range(int(cfg["num_hidden_layers"]))}
    out[GLOBAL_KEY] = QUANT_TYPE
    return out


def dynamic_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D], float16 scale [..., 1]): symmetric per row, scale = amax / 127
    (float32), q = clamp(round_half_even(x / scale), -128, 127); the float16 scale is the stored
    copy (the int8 values are computed with the float32 one). An all-zero row gives q 0, scale 0."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / QMAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))   # an all-zero row divides by 1: q = 0
    q = torch.round(xf / safe).clamp_(-128, 127).to(torch.int8)
    return q, scale.to(getattr(torch, SCALE_DTYPE))
