"""What transformers' save_pretrained writes, cvt reads (issue 41, item 4).

For every architecture cvt has, a tiny model built from transformers' own config class (its init,
every float tensor moved by 0.02 N(0, 1); V4's hash table random expert ids), saved in BF16 by
``save_pretrained``, is accepted by ``cvt inspect`` (no problem) and ``cvt quantize``; and the same
tensors written in the publisher's release layout (names as the release stores them, listed here
independently of cvt's tables, the release's config.json) give byte-identical quantize outputs
(every weight file, the weight index and the Ascend description). fp8-to-bf16 does not apply:
transformers writes float weights, which it refuses (no quantization_config).

Where transformers renames on save (DeepSeek-V4, Kimi-K2.5), the layout must be exactly the
release's weights: the release copy loaded by transformers and saved again gives back transformers'
files byte for byte (`test_release_layout_round_trips_through_transformers`).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

from cvt.testing.checkpoints import (tiny_deepseek_config, tiny_deepseek_v32_config, tiny_kimi_k25_config,  # noqa: E402
                                     tiny_qwen3_config, write_safetensors)
from cvt.testing.checkpoints_v4 import tiny_deepseek_v4_config  # noqa: E402
from cvt.tests.conftest import run_cvt  # noqa: E402

DROP = ("quantization_config", "architectures", "torch_dtype", "expert_dtype")
GLM5 = dict(vocab_size=256, hidden_size=64, moe_intermediate_size=32, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32,
            q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, index_topk=6, index_n_heads=2,
            index_head_dim=32, first_k_dense_replace=1, mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
V4_HF_KEYS = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
              "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "scoring_func", "routed_scaling_factor",
              "swiglu_limit", "sliding_window", "compress_ratios", "num_hash_layers", "compress_rope_theta",
              "rope_theta", "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
              "rms_norm_eps", "max_position_embeddings")

# transformers' saved name -> the release's, where they differ (DeepSeek-V4: DeepSeek's names without
# transformers' ``model.``, attention kv_norm saved as ``norm``; Kimi-K2.5: the release's
# moonshotai/Kimi-K2.5 index names), written out here, not read from cvt's tables
RELEASE_NAMES = {
    "deepseek_v4": [(r"^model\.embed_tokens\.weight$", "embed.weight"), (r"^model\.norm\.weight$", "norm.weight"),
                    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
                    (r"^model\.layers\.(\d+)\.attn\.norm\.weight$", r"layers.\1.attn.kv_norm.weight"),
                    (r"^model\.layers\.", "layers.")],
    "kimi_k25": [(r"^language_model\.model\.blocks\.", "language_model.model.layers."),
                 (r"^model\.mm_projector\.pre_norm\.", "mm_projector.pre_norm."),
                 (r"^vision_tower\.encoder\.patch_embed\.proj\.", "vision_tower.patch_embed.proj.")],
}


def _strip(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in DROP}


def _kimi_release_config() -> dict:
    cfg = tiny_kimi_k25_config()
    cfg.pop("quantization_config")
    cfg["text_config"].pop("quantization_config")
    return cfg


def _kimi_hf():
    rel = _kimi_release_config()
    vc = rel["vision_config"]
    vision = {"hidden_size": vc["vt_hidden_size"], "intermediate_size": vc["vt_intermediate_size"],
              "num_hidden_layers": vc["vt_num_hidden_layers"], "num_attention_heads": vc["vt_num_attention_heads"],
              "patch_size": vc["patch_size"], "pos_emb_height": vc["init_pos_emb_height"],
              "pos_emb_width": vc["init_pos_emb_width"]}
    cfg = transformers.Kimi_K25Config(text_config=_strip(rel["text_config"]), vision_config=vision,
                                      projection_hidden_size=vc["mm_hidden_size"], tie_word_embeddings=False)
    return transformers.Kimi_K25ForConditionalGeneration(cfg), rel


def build(arch: str):
    """(transformers model with its own init, the release's config.json for the same model)."""
    t = transformers
    if arch == "deepseek_v3":
        rel = _strip(tiny_deepseek_config(num_nextn_predict_layers=0))
        return t.DeepseekV3ForCausalLM(t.DeepseekV3Config(**rel)), rel
    if arch == "deepseek_v32":
        rel = _strip(tiny_deepseek_v32_config(num_nextn_predict_layers=0))
        return t.DeepseekV32ForCausalLM(t.DeepseekV32Config(**rel)), rel
    if arch == "glm_moe_dsa":
        cfg = t.GlmMoeDsaConfig(**GLM5)
        return t.GlmMoeDsaForCausalLM(cfg), {**cfg.to_dict(), "architectures": ["GlmMoeDsaForCausalLM"]}
    if arch in ("qwen3", "qwen3_moe"):
        rel = _strip(tiny_qwen3_config(moe=arch == "qwen3_moe"))
        cls = (t.Qwen3MoeConfig, t.Qwen3MoeForCausalLM) if arch == "qwen3_moe" else (t.Qwen3Config, t.Qwen3ForCausalLM)
        return cls[1](cls[0](**rel)), rel
    if arch == "deepseek_v4":
        rel = _strip(tiny_deepseek_v4_config(num_nextn_predict_layers=0))
        return t.DeepseekV4ForCausalLM(t.DeepseekV4Config(**{k: rel[k] for k in V4_HF_KEYS if k in rel})), rel
    return _kimi_hf()


ARCHS = ["deepseek_v3", "deepseek_v32", "glm_moe_dsa", "qwen3", "qwen3_moe", "deepseek_v4", "kimi_k25"]


def saved(tmp: Path, arch: str, seed: int = 0) -> tuple[Path, dict]:
    """save_pretrained of `arch` in BF16 at tmp/hf, and the release's config.json."""
    torch.manual_seed(seed)
    model, rel = build(arch)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("tid2eid"):
                p.copy_(torch.randint(0, rel["n_routed_experts"], p.shape, generator=g))
            elif p.is_floating_point() and "inv_freq" not in name:
                p.add_(0.02 * torch.randn(p.shape, generator=g))
    model.to(torch.bfloat16).save_pretrained(tmp / "hf")
    return tmp / "hf", rel


def read_all(d: Path) -> dict[str, "torch.Tensor"]:
    """Every tensor of d's safetensors files, floats as float32 (exact from BF16: transformers
    loads some modules in float32 whatever the file holds, and saves them so)."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, framework="pt") as sf:
            for k in sf.keys():
                t = sf.get_tensor(k)
                out[k] = t.float() if t.is_floating_point() else t
    return out


def file_order(path: Path) -> list[str]:
    """The tensor names of a safetensors file in the order of their bytes (its header's offsets)."""
    n = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8:8 + n])
    header.pop("__metadata__", None)
    return sorted(header, key=lambda k: header[k]["data_offsets"][0])


def release_copy(hf: Path, dst: Path, arch: str, config: dict) -> Path:
    """hf's tensors, in its order, under the release's names, with the release's config.json."""
    renames = [(re.compile(a), b) for a, b in RELEASE_NAMES.get(arch, [])]
    tensors = {}
    with safe_open(hf / "model.safetensors", framework="pt") as sf:
        for k in file_order(hf / "model.safetensors"):
            name = next((rx.sub(to, k, count=1) for rx, to in renames if rx.match(k)), k)
            tensors[name] = sf.get_tensor(k)
    dst.mkdir()
    write_safetensors(dst / "model.safetensors", tensors, {"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def outputs(d: Path) -> dict[str, bytes]:
    """A quantize output's weight files, weight index and Ascend description (config.json and the
    manifest name the source, so they differ)."""
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())
            if p.suffix == ".safetensors" or p.name.endswith("index.json") or p.name.startswith("quant_model_desc")}


@pytest.mark.parametrize("arch", ARCHS)
def test_save_pretrained_reads_like_the_release(tmp_path, arch):
    hf, rel_cfg = saved(tmp_path, arch)
    rel = release_copy(hf, tmp_path / "release", arch, rel_cfg)
    r = run_cvt("inspect", hf)
    assert r.rc == 0 and re.search(r"problems\s+none", r.out), r.out[-2000:]
    for src in (hf, rel):
        r = run_cvt("fp8-to-bf16", src, tmp_path / f"bf16-{src.name}", "--quiet")
        assert r.rc == 1 and "not an FP8 block checkpoint" in r.err
        r = run_cvt("quantize", src, tmp_path / f"q-{src.name}", "--scheme", "w8a8", "--format", "ascend", "--quiet")
        assert r.rc == 0, r.err
    a, b = outputs(tmp_path / "q-hf"), outputs(tmp_path / "q-release")
    assert any(n.endswith(".safetensors") for n in a) and a.keys() == b.keys()
    for name in a:
        assert a[name] == b[name], f"{arch}: {name} differs between the save_pretrained and the release input"


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(RELEASE_NAMES))
def test_release_layout_round_trips_through_transformers(tmp_path, arch):
    """The release copy, loaded by transformers (its conversion mapping) and saved again, is
    transformers' own files: the renamed layout holds exactly the release's weights."""
    hf, _ = saved(tmp_path, arch)
    rel = release_copy(hf, tmp_path / "release", arch, json.loads((hf / "config.json").read_text()))
    cls = getattr(transformers, json.loads((hf / "config.json").read_text())["architectures"][0])
    cls.from_pretrained(rel, dtype=torch.bfloat16).save_pretrained(tmp_path / "again")
    again, want = read_all(tmp_path / "again"), read_all(hf)
    assert again.keys() == want.keys()
    for name, t in want.items():
        assert again[name].dtype == t.dtype and torch.equal(again[name], t), name


def test_mixed_layout_is_refused(tmp_path):
    """A V4 holding a tensor under both names is refused with one line naming both."""
    hf, _ = saved(tmp_path, "deepseek_v4")
    with safe_open(hf / "model.safetensors", framework="pt") as sf:
        tensors = {k: sf.get_tensor(k).clone() for k in sf.keys()}
    tensors["embed.weight"] = tensors["model.embed_tokens.weight"]
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(hf / "config.json", mixed / "config.json")
    write_safetensors(mixed / "model.safetensors", tensors, {"format": "pt"})
    r = run_cvt("inspect", mixed)
    assert r.rc == 1 and "embed.weight is stored twice" in r.err and "model.embed_tokens.weight" in r.err
    assert len(r.err.strip().splitlines()) == 1
