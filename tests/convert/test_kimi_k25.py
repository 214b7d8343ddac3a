"""Kimi-K2.5 (model_type kimi_k25) through every stage: the wrapper table on the real config, the
vision tower and projector carried byte for byte (quantize in both formats, shard, fp8-to-bf16 of an
FP8 variant), listed in the manifest and `cvt inspect`, INT4 g32 experts -> Ascend W4A16 (vllm-ascend
int32 layout) with the same integer codes and scales, W4A8_DYNAMIC requantized from the exact
float32 dequantization (never BF16), `cvt plan` totals from the real config.

The tiny release (`tiny_kimi_k25_config` + `kimi_int4_tensors`) has the release's names
(``language_model.model.*``, ``language_model.lm_head``, ``vision_tower.*``, ``mm_projector.*``),
routed experts as compressed-tensors pack-quantized INT4 (weight_packed / weight_scale / weight_shape),
everything else BF16, K2.5's quantization_config.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from cvt.convert.arch import Parallel, Role, arch_for, carried_names  # noqa: E402
from cvt.testing.checkpoints import (kimi_int4_tensors, release_tensors, tiny_deepseek_config,  # noqa: E402
                                     tiny_kimi_k25_config, write_release)
from cvt.quant.stage import quantize  # noqa: E402
from cvt.tests.conftest import run_cvt  # noqa: E402
from cvt.tests.convert.test_shard import read_all  # noqa: E402
from cvt.tests.runtime.test_kimi_k25 import unpack_ct_int4  # noqa: E402

CONFIGS = Path(__file__).parent.parent / "data" / "configs"
K25 = json.loads((CONFIGS / "kimi-k2.5.json").read_text())   # moonshotai/Kimi-K2.5 config.json
CFG = tiny_kimi_k25_config()
CARRIED = ("vision_tower.", "mm_projector.")


def test_table_of_the_real_config():
    """Names and shapes hand-checked against the release's model.safetensors.index.json inventory."""
    arch = arch_for(K25)
    assert arch.table.name == "kimi_k25" and arch.model_type == "deepseek_v3" and arch.num_layers == 61
    shapes = arch.shapes()
    vision = {n: s for n, s in shapes.items() if n.startswith(CARRIED)}
    assert len(vision) == 3 + 27 * 12 + 2 + 6 == 335
    assert vision["vision_tower.patch_embed.proj.weight"] == (1152, 3, 14, 14)
    assert vision["vision_tower.patch_embed.pos_emb.weight"] == (64, 64, 1152)
    assert vision["vision_tower.encoder.blocks.26.wqkv.weight"] == (3456, 1152)
    assert vision["vision_tower.encoder.blocks.0.mlp.fc0.weight"] == (4304, 1152)
    assert vision["mm_projector.proj.0.weight"] == (4608, 4608) and vision["mm_projector.proj.2.weight"] == (7168, 4608)
    assert vision["mm_projector.pre_norm.bias"] == (1152,)
    assert sum(math.prod(s) for s in vision.values()) == 471_143_920   # 0.88 GiB in BF16
    assert shapes["language_model.model.layers.60.mlp.experts.383.down_proj.weight"] == (7168, 2048)
    assert shapes["language_model.lm_head.weight"] == (163840, 7168) and not any(n.startswith("model.") for n in shapes)
    for name in ("vision_tower.encoder.blocks.26.norm1.bias", "mm_projector.proj.2.weight"):
        info = arch.classify(name)
        assert (info.role, info.rule.parallel, info.split_dim, info.layer) == (Role.CARRIED, Parallel.REPLICATED,
                                                                              None, None)
        assert info.rule.float_default and not info.rule.quantizable
    e = arch.classify("language_model.model.layers.60.mlp.experts.383.up_proj.weight_packed")
    assert (e.role, e.layer, e.expert, e.split_dim) == (Role.EXPERT, 60, 383, 0)
    assert arch.fused_group("language_model.model.layers.3.mlp.experts.7.gate_proj") == (
        "language_model.model.layers.3.mlp.experts.7.gate_proj", "language_model.model.layers.3.mlp.experts.7.up_proj")


def test_vision_config_errors_name_the_key():
    from cvt.errors import ArchError

    bad = {**K25, "vision_config": {**K25["vision_config"], "vt_hidden_size": 0}}
    with pytest.raises(ArchError, match=r"vision_config\.vt_hidden_size = 0"):
        arch_for(bad).shapes()


def test_text_names_need_the_release_prefix():
    """The release names every text tensor under ``language_model.`` (calibration and the KV-cache
    scales rely on it): a bare text name is refused, naming the prefix (issue 37); the towers keep
    theirs, and a checkpoint mixing both is one survey line, not one per tensor."""
    from cvt.errors import ArchError

    arch = arch_for(K25)
    with pytest.raises(ArchError, match=r"tensor model\.layers\.3\.mlp\.gate\.weight: lacks the 'language_model\.' "
                                        r"prefix \(expected language_model\.model\.layers\.3\.mlp\.gate\.weight\)"):
        arch.classify("model.layers.3.mlp.gate.weight")
    assert arch.classify("language_model.model.layers.3.mlp.gate.weight").role is Role.ROUTER
    assert not arch.lacks_prefix("vision_tower.encoder.blocks.0.wo.weight") and not arch.lacks_prefix("lm_head.x")
    names = ["language_model.model.norm.weight", "model.layers.0.input_layernorm.weight", "lm_head.weight",
             "mm_projector.proj.0.weight"]
    assert arch.prefix_problem(names) == (
        "2 text-model tensors lack the 'language_model.' prefix (e.g. model.layers.0.input_layernorm.weight, while "
        "others have it): a kimi_k25 checkpoint (config.json model_type) names every one under it")
    assert arch.prefix_problem(names[:1] + names[3:]) is None


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[Path, dict]:
    tensors = kimi_int4_tensors(CFG, seed=2)
    return write_release(tmp_path_factory.mktemp("k25") / "int4", CFG, tensors, n_shards=3, move_scale=False), tensors


def assert_carried_identical(out: Path, src: Path) -> int:
    """Every vision / projector tensor of `src` is in `out` with the same dtype, shape and bytes."""
    got, want = read_all(out), read_all(src)
    names = [n for n in want if n.startswith(CARRIED)]
    for n in names:
        assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape, n
        assert got[n].contiguous().view(torch.uint8).equal(want[n].contiguous().view(torch.uint8)), n
    return len(names)


def test_inspect_lists_the_carried_towers(release):
    src, tensors = release
    r = run_cvt("inspect", src)
    assert r.rc == 0, r.err
    n = len([t for t in tensors if t.startswith(CARRIED)])
    assert "problems        none" in r.out and "(table: kimi_k25)" in r.out
    assert f"carried         {n} tensors (mm_projector, vision_tower): float, copied byte for byte" in r.out


def test_int4_experts_to_ascend_w4a16_keep_codes_and_scales(release, tmp_path):
    """vllm-ascend's W4A16 MoE layout is compressed-tensors' int32 packing (FORMATS.md 2.2): at group 32
    the output holds the release's integer codes and scales, unpacked independently here."""
    src, tensors = release
    out = tmp_path / "w4a16"
    r = quantize(src, out, scheme="w4a16", fmt="ascend", group_size=32, target="vllm-ascend", quiet=True)
    got = read_all(out)
    experts = [n[: -len(".weight_packed")] for n in tensors if n.endswith(".weight_packed")]
    assert len(experts) == 2 * 4 * 3
    for e in experts:
        n, k = tensors[e + ".weight_shape"].tolist()
        assert torch.equal(unpack_ct_int4(got[e + ".weight_packed"], n, k), unpack_ct_int4(tensors[e + ".weight_packed"], n, k))
        assert torch.equal(got[e + ".weight_scale"].float(), tensors[e + ".weight_scale"].float()), e
        assert got[e + ".weight_scale"].shape == (n, k // 32)
        assert r.manifest.quant.tensors[e].method == "source" and r.manifest.quant.tensors[e].sqnr_db == "Infinity"
    desc = json.loads((out / "quant_model_description.json").read_text())
    assert desc[experts[0] + ".weight_packed"] == "W4A16" and desc["group_size"] == 32
    assert assert_carried_identical(out, src) == 35
    assert all(desc[n] == "FLOAT" for n in got if n.startswith(CARRIED))
    manifest = json.loads((out / "cvt_manifest.json").read_text())
    assert manifest["carried"] == [n for n in tensors if n.startswith(CARRIED)]


def test_w4a8_requantizes_from_the_exact_float32_weight(release, tmp_path):
    """INT4 g32 codes do not fit W4A8_DYNAMIC's per-channel int4 grid, so the experts are requantized
    (RTN, SQNR in the manifest) from the exact dequantization code * scale in float32, never through
    BF16: the same output as from an F32 checkpoint holding those products (computed independently)."""
    src, tensors = release
    exact = {}
    for n, t in tensors.items():
        if n.endswith(".weight_packed"):
            e = n[: -len(".weight_packed")]
            rows, k = tensors[e + ".weight_shape"].tolist()
            exact[e + ".weight"] = (unpack_ct_int4(t, rows, k).float()
                                    * tensors[e + ".weight_scale"].float().repeat_interleave(32, dim=1))
        elif not n.endswith((".weight_scale", ".weight_shape")):
            exact[n] = t
    bf16 = exact[next(iter(k for k in exact if ".experts." in k))]
    assert not torch.equal(bf16.to(torch.bfloat16).float(), bf16)      # the products do not fit BF16
    cfg = {**CFG, "text_config": {k: v for k, v in CFG["text_config"].items() if k != "quantization_config"}}
    cfg.pop("quantization_config")
    f32 = write_release(tmp_path / "f32", cfg, exact, n_shards=2, move_scale=False)
    a, b = tmp_path / "from-int4", tmp_path / "from-f32"
    r = quantize(src, a, scheme="w4a8", fmt="ascend", quiet=True)
    quantize(f32, b, scheme="w4a8", fmt="ascend", quiet=True)
    ga, gb = read_all(a), read_all(b)
    experts = [n for n in ga if ".experts." in n]
    assert experts and all(torch.equal(ga[n], gb[n]) for n in experts)
    info = r.manifest.quant.tensors["language_model.model.layers.1.mlp.experts.0.down_proj"]
    assert info.method == "rtn" and isinstance(info.sqnr_db, float)
    assert assert_carried_identical(a, src) == 35


@pytest.mark.slow
def test_compressed_tensors_output_and_shard_replicate_the_vision_tower(release, tmp_path):
    src, tensors = release
    ct = tmp_path / "ct"
    r = quantize(src, ct, scheme="w4a16", fmt="compressed-tensors", group_size=32, quiet=True)
    assert assert_carried_identical(ct, src) == 35
    experts = {m: t for m, t in r.manifest.quant.tensors.items() if ".experts." in m}
    assert len(experts) == 24 and all(t.method == "source" for t in experts.values())     # the release's INT4
    r = run_cvt("shard", ct, tmp_path / "sh", "--ep", "2", "--quiet")
    assert r.rc == 0, r.err
    m = json.loads((tmp_path / "sh" / "cvt_manifest.json").read_text())
    assert m["carried"] == [n for n in tensors if n.startswith(CARRIED)]
    t = m["shard"]["tensors"]
    assert all(t[n]["dim"] is None and t[n]["expert"] is None for n in m["carried"])
    for rank in m["shard"]["ranks"]:
        assert assert_carried_identical(tmp_path / "sh" / rank["dir"], src) == 35
    r = run_cvt("run", tmp_path / "sh", "--procs", "2", "--input-ids", "5,6,7", "--max-new-tokens", "2",
                "--device", "cpu", "--quiet")
    assert r.rc == 0, r.err
    assert "running the text model only" in r.err


def test_fp8_variant_to_bf16_carries_the_vision_tower(tmp_path):
    """A K2.5-layout FP8 block checkpoint (text linears FP8, the rest BF16): fp8-to-bf16 dequantizes
    the text model and copies the vision tower and projector byte for byte."""
    from cvt.convert.fp8_to_bf16 import fp8_to_bf16

    qc = tiny_deepseek_config()["quantization_config"]
    cfg = {**CFG, "quantization_config": qc, "text_config": {**CFG["text_config"], "quantization_config": qc}}
    tensors = release_tensors(cfg, seed=4)
    assert tensors["language_model.model.layers.1.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn
    src = write_release(tmp_path / "fp8", cfg, tensors, n_shards=3)
    res = fp8_to_bf16(src, tmp_path / "bf16", quiet=True)
    assert assert_carried_identical(tmp_path / "bf16", src) == 35
    assert res.manifest.carried == carried_names(cfg, tensors) and len(res.manifest.carried) == 35
    out_cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in out_cfg and "quantization_config" not in out_cfg["text_config"]
    assert out_cfg["vision_config"] == CFG["vision_config"]


@pytest.mark.slow
def test_calibrated_c8_reads_and_writes_the_release_names(release, tmp_path):
    """Layer-by-layer calibration (int8 KV-cache ranges) reads the text model under
    ``language_model.`` and writes the FAKQuant scales under the same prefix, which the runtime
    attaches; the vision tower stays byte-identical."""
    from cvt.runtime.loader import load_model

    src, tensors = release
    out = tmp_path / "c8"
    r = quantize(src, out, scheme="w8a8c8", fmt="ascend", calib_tokens=64, quiet=True)
    assert r.manifest.quant.calibration["layers"] == 3
    got = read_all(out)
    for i in range(3):
        for part in ("fa_q", "fa_k", "fa_v"):
            assert f"language_model.model.layers.{i}.self_attn.{part}.scale" in got
    assert not any(n.startswith("model.") for n in got)
    assert assert_carried_identical(out, src) == 35
    loaded = load_model(out, dtype=torch.float32)
    assert all(layer.self_attn.kv_scales is not None for layer in loaded.model.model.layers)
    assert loaded.model.new_cache(batch=1, max_len=8)[0].quant == "int8"
