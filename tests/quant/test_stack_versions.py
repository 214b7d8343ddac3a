"""`--target-version` (vllm-ascend release lines) and `--kv-dtype fp8` (FAKQuant's Ascend 950 cache).

Pinned to vllm-ascend's repository (main at 182b75e; tags v0.23.0, v0.24.0rc1, v0.25.1rc1):

* PR #13713 (commit efda044, in main, in no tag): ``quantization/methods/w4a8.py`` registers
  ("W4A8_DYNAMIC", "moe") only (v0.23.0 .. v0.25.1rc1 also ("W4A8_DYNAMIC", "linear")), and
  AscendW4A8DynamicFusedMoEMethod.__init__ raises "The current weights use Per-Group quantization,
  which is no longer supported" when the description's group_size > 0.
* ``attention/mla_v1.py`` (v0.23.0 and main): a FAKQuant layer's cache dtype is
  ``torch.float8_e4m3fn if get_ascend_device_type() == AscendDeviceType.A5 else torch.int8``; on A5
  ``exec_kv_decode`` / ``exec_kv_prefill`` pass ``c_kv_scale = fak_descale_reciprocal`` (1 / fa_k.scale)
  to npu_kv_rmsnorm_rope_cache and the latent is read back times ``fak_descale_float`` (fa_k.scale);
  ``quantization/methods/kv_c8.py`` AscendFAQuantAttentionMethod.create_weights declares the same
  fa_{q,k,v}.{scale,offset} as for int8. GQA C8 (AscendC8KVCacheAttentionMethod) is int8 only.
* ``quantization/methods/w4a4_mxfp4.py`` (v0.23.0; v0.24.0rc1 alike): the linear method's
  process_weights_after_loading does ``weight_scale.reshape(n_dim, k_dim // 2, 2)`` with k_dim the
  scale's k / 32 columns, unpadded (v0.25.1rc1 pads them to even first, PR #12201).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from cvt.testing.checkpoints import tiny_qwen3_config, write_bf16_checkpoint
from cvt.errors import CvtError
from cvt.quant.recipe import Recipe
from cvt.quant.stage import quantize
from cvt.qtensor.stack_versions import DEFAULT_LINE, LINES
from cvt.runtime import kv_cache as K
from cvt.runtime.loader import load_model

O_PROJ_W4A8 = {"rules": [{"pattern": r"self_attn\.o_proj", "scheme": "w4a8"}]}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("lines")


def _quant(dst):
    return json.loads((dst / "cvt_manifest.json").read_text())["quant"]


def _tensors(dst):
    return {k: v for f in sorted(dst.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_lines_are_the_tagged_releases_and_main():
    assert LINES == ("0.23", "0.24", "0.25", "main") and DEFAULT_LINE == "0.23"


def test_manifest_records_the_line(fp8_release_session, root):
    quantize(fp8_release_session, root / "main", fmt="ascend", scheme="w4a8", target_version="main", quiet=True)
    q = _quant(root / "main")
    assert q["target"] == "vllm-ascend" and q["target_version"] == "main"
    assert {t["layout"] for t in q["tensors"].values()} <= {"ascend-w4a8-dynamic", "ascend-w4a8-dynamic-row"}
    quantize(fp8_release_session, root / "default", fmt="ascend", scheme="w8a8", quiet=True)
    assert _quant(root / "default")["target_version"] == DEFAULT_LINE
    quantize(fp8_release_session, root / "ct", scheme="w8a8", quiet=True)
    assert _quant(root / "ct")["target_version"] is None


def test_main_refuses_what_pr_13713_removed(fp8_release_session, root):
    rec = Recipe.model_validate(O_PROJ_W4A8)
    with pytest.raises(CvtError, match=r"o_proj: --target-version main: W4A8_DYNAMIC for a dense linear: .*PR #13713"):
        quantize(fp8_release_session, root / "r1", fmt="ascend", scheme="w8a8", recipe=rec, target_version="main",
                 quiet=True)
    with pytest.raises(CvtError, match=r"--target-version main: per-group W4A8_DYNAMIC: .*no longer supported"):
        quantize(fp8_release_session, root / "r2", fmt="ascend", scheme="w4a8", group_size=64, target_version="main",
                 quiet=True)
    # 0.23 has a W4A8 linear method, but not for what cvt writes: refused with that reason instead
    with pytest.raises(CvtError, match="for MoE experts only") as e:
        quantize(fp8_release_session, root / "r3", fmt="ascend", scheme="w8a8", recipe=rec, quiet=True)
    assert "13713" not in str(e.value)
    assert not any((root / n).exists() and any((root / n).iterdir()) for n in ("r1", "r2", "r3"))


@pytest.mark.slow
def test_w4a4_mxfp4_linear_with_odd_k_over_32_is_float_on_0_23_and_0_24(tmp_path):
    """q_b_proj with 96 in_features (3 scale columns) cannot be loaded by 0.23 / 0.24's W4A4_MXFP4
    linear method: kept float there with the reason (a recipe asking for it is refused); 0.25 and
    main pad the scales and get it quantized."""
    from cvt.testing.checkpoints import tiny_deepseek_config, write_fp8_release

    src = write_fp8_release(tmp_path / "fp8", tiny_deepseek_config(q_lora_rank=96))
    qb = "model.layers.0.self_attn.q_b_proj"
    for line, quantized in (("0.23", False), ("0.24", False), ("0.25", True), ("main", True)):
        dst = tmp_path / f"q{line}"
        quantize(src, dst, fmt="ascend", scheme="w4a4_mxfp4", target_version=line, quiet=True)
        desc = json.loads((dst / "quant_model_description.json").read_text())
        assert desc[f"{qb}.weight"] == ("W4A4_MXFP4" if quantized else "FLOAT"), line
        assert desc["model.layers.0.self_attn.o_proj.weight"] == "W4A4_MXFP4", line  # k 128: 4 columns
        if not quantized:
            why = json.loads((dst / "cvt_manifest.json").read_text())["quant"]["float_modules"][qb]
            assert "in_features / 32 must be even (got 96 / 32 = 3" in why, why
    rec = Recipe.model_validate({"rules": [{"pattern": r"q_b_proj", "scheme": "w4a4_mxfp4"}]})
    with pytest.raises(CvtError, match=r"q_b_proj: --target-version 0.23: .*in_features / 32 must be even"):
        quantize(src, tmp_path / "r", fmt="ascend", scheme="w4a4_mxfp4", recipe=rec, quiet=True)


@pytest.mark.parametrize("kw,msg", [
    (dict(fmt="ascend", target_version="0.9"), r"unknown vllm-ascend release line \(known: 0.23, 0.24, 0.25, main\)"),
    (dict(fmt="ascend", target="mindie", target_version="main"), "applies to --format ascend --target vllm-ascend"),
    (dict(target_version="main"), "applies to --format ascend --target vllm-ascend only, not compressed-tensors"),
])
def test_line_option_refusals(fp8_release_session, root, kw, msg):
    with pytest.raises(CvtError, match=msg):
        quantize(fp8_release_session, root / "bad", scheme="w8a8", quiet=True, **kw)


# ---- --kv-dtype fp8: FAKQuant's e4m3 cache (Ascend 950) -----------------------------------------

@pytest.mark.slow
def test_fakquant_fp8_cache_written_and_run(fp8_release_session, root):
    kw = dict(fmt="ascend", scheme="w8a8c8", calib_tokens=64, quiet=True)
    quantize(fp8_release_session, root / "c8", **kw)
    quantize(fp8_release_session, root / "c8fp8", kv_dtype="fp8", **kw)
    i8, f8 = _tensors(root / "c8"), _tensors(root / "c8fp8")
    names = {n for n in i8 if ".fa_" in n}
    assert names and names == {n for n in f8 if ".fa_" in n}  # same tensors, names, shapes, dtypes
    for n in names:
        assert f8[n].dtype == i8[n].dtype and f8[n].shape == i8[n].shape
        if n.endswith(".scale"):  # amax / 448 instead of amax / 127 (same calibration, same amax)
            torch.testing.assert_close(f8[n] * 448, (i8[n] * 127).clamp_min(448 * 2.0 ** -14), rtol=1e-6, atol=0)
        else:
            assert not f8[n].any()
    d8 = json.loads((root / "c8fp8" / "quant_model_description.json").read_text())
    assert d8["fa_quant_type"] == "FAKQuant" and all(d8[n] == "FAQuant" for n in names)
    conv = _quant(root / "c8fp8")["kv_cache"]["convention"]
    assert conv["dtype"] == "float8_e4m3fn" and "448" in conv["scale"] and "A5" in conv["device"]
    assert _quant(root / "c8")["kv_cache"]["convention"]["dtype"] == "int8"

    loaded = load_model(root / "c8fp8", dtype=torch.float32)
    m = loaded.model
    assert K.kv_codec(m) == "fp8"
    cache = m.new_cache(1, 12)
    assert cache[0].kv.dtype == torch.float8_e4m3fn and cache[0].pe.dtype == torch.float32
    tokens = torch.arange(1, 13)[None]
    full = m(tokens)
    torch.testing.assert_close(m(tokens, 0, cache), full, rtol=0, atol=0)  # the same cache semantics
    assert cache[0].kv[0, :12].float().abs().amax() > 127  # the e4m3 range past int8's is in use


@pytest.mark.parametrize("kw,msg", [
    (dict(scheme="w8a8", kv_dtype="fp8"), "applies to a scheme with a quantized KV cache"),
    (dict(scheme="w8a8c8", kv_dtype="fp8", target="mindie"), "mindie caches FAKQuant in int8"),
    (dict(scheme="w8a8c8", kv_dtype="int4"), "not supported"),
    (dict(scheme="w8a8c8", kv_dtype="int8", fmt="compressed-tensors"), "KV cache is fp8"),
])
def test_kv_dtype_refusals(fp8_release_session, root, kw, msg):
    kw.setdefault("fmt", "ascend")
    with pytest.raises(CvtError, match=msg):
        quantize(fp8_release_session, root / "badkv", quiet=True, calib_tokens=64, **kw)


def test_kv_dtype_fp8_refused_for_gqa(root):
    src = write_bf16_checkpoint(root / "qwen3", tiny_qwen3_config(moe=False))
    with pytest.raises(CvtError, match="GQA C8 cache is int8"):
        quantize(src, root / "q-fp8", fmt="ascend", scheme="w8a8c8", kv_dtype="fp8", quiet=True, calib_tokens=64)
