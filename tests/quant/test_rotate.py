"""`cvt quantize --rotate` (issue 39 item 1): the Hadamard matrices are orthogonal, the rotated
float model is the same function for every family that declares a rotation table, the FP8 and
BF16 paths agree byte for byte, a seed gives the same bytes, refusals are one line, and the
rotated outputs load as their consumers read them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cvt.convert.arch import arch_for
from cvt.convert.config import SourceFormat
from cvt.convert.reader import open_checkpoint
from cvt.qtensor.hadamard import Orthogonal, _paley, hadamard_factors, sylvester
from cvt.quant.rotate import RotatedCheckpoint, check, parse
from cvt.quant.stage import quantize
from cvt.runtime.loader import load_model
from cvt.testing.checkpoints import (tiny_deepseek_config, tiny_deepseek_v32_config, tiny_glm_moe_dsa_config,
                                     tiny_kimi_k25_config, tiny_qwen3_config, random_weights, write_bf16_checkpoint,
                                     write_release)
from cvt.errors import FormatError, OptionError


@pytest.mark.parametrize("order", [12, 20, 28, 36, 44, 60, 68, 108])
def test_paley_orders_are_hadamard(order):
    h = _paley(order)
    assert h is not None and set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h.T, order * torch.eye(order, dtype=torch.float64))


@pytest.mark.parametrize("n, kind", [(7168, "hadamard 28x256"), (6144, "hadamard 12x512"), (5120, "hadamard 20x256"),
                                     (1536, "hadamard 12x128"), (4096, "hadamard 1x4096"), (96, "hadamard 12x8"),
                                     (52, "random orthogonal")])
def test_orthogonal_widths_of_real_models(n, kind):
    """DeepSeek-V3's 7168, GLM-5's 6144, Qwen3's 5120, the q LoRA rank 1536: exact Hadamard
    transforms; a width no Paley order reaches (52 here) falls back to a random orthogonal Q."""
    q = Orthogonal(n, 0, "residual")
    assert q.kind == kind
    if n > 2048:  # the factors' own identity, without forming Q
        a, b = hadamard_factors(n)
        assert torch.equal(a @ a.T, a.shape[0] * torch.eye(a.shape[0], dtype=torch.float64))
        assert torch.equal(b, sylvester(b.shape[0]))
        return
    m = q.matrix().double()
    assert torch.allclose(m @ m.T, torch.eye(n, dtype=torch.float64), atol=1e-6)
    w = torch.randn(5, n)
    assert torch.allclose(q.right(w), w @ m.float(), atol=1e-5)
    assert torch.allclose(q.left_t(w.T), m.float().T @ w.T, atol=1e-5)
    assert torch.equal(Orthogonal(n, 0, "residual").matrix(), q.matrix())  # deterministic
    assert not torch.equal(Orthogonal(n, 1, "residual").matrix(), q.matrix())


def _logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = load_model(path, dtype=torch.float32).model(ids)
    return (out[0] if isinstance(out, tuple) else out).float()


def _rotated_copy(src: Path, dst: Path, spec: str = "hadamard:3") -> RotatedCheckpoint:
    """SRC's rotated float32 model written out as a checkpoint (`RotatedCheckpoint` with F32)."""
    ck = open_checkpoint(src)
    arch = arch_for(ck.config)
    rot = RotatedCheckpoint(ck, arch, check(arch, ck.config, SourceFormat.BF16), spec, arch.table.scale_param,
                            dtype="F32")
    write_release(dst, rot.config, {n: rot.read(n).clone() for n in rot.tensors}, n_shards=1, move_scale=False)
    ck.close()
    return rot


FAMILIES = {
    "deepseek_v3": tiny_deepseek_config,
    "deepseek_v3-no-q-lora": lambda: tiny_deepseek_config(q_lora_rank=None),
    "deepseek_v32": tiny_deepseek_v32_config,
    "glm_moe_dsa": lambda: tiny_glm_moe_dsa_config(indexer_types=["full", "shared", "full"]),
    "qwen3": lambda: tiny_qwen3_config(moe=False),
    "qwen3_moe": tiny_qwen3_config,
    "qwen2-bias": lambda: tiny_qwen3_config(moe=False, model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                                            attention_bias=True),  # v_proj's bias turns with its rows
}


@pytest.mark.parametrize("family", FAMILIES)
def test_rotated_float_model_is_the_same_function(family, tmp_path):
    """Logits of the rotated float32 model within 1e-4 relative of SRC's (the acceptance), past
    DeepSeek-V3.2 / GLM-5's index_topk so the indexer's selection runs; every residual norm is ones."""
    cfg = FAMILIES[family]()
    weights = {n: t for n, t in random_weights(cfg, seed=4).items() if not n.endswith("o_proj.bias")}  # Qwen2: qkv only
    src = write_bf16_checkpoint(tmp_path / "src", cfg, weights=weights)
    rot = _rotated_copy(src, tmp_path / "rot")
    ids = torch.randint(0, cfg["vocab_size"] - 10, (2, 40), generator=torch.Generator().manual_seed(0))
    a, b = _logits(src, ids), _logits(tmp_path / "rot", ids)
    assert float((a - b).abs().max() / a.abs().max()) < 1e-4
    kinds = rot.rotator.kinds()
    assert f"residual:{cfg['hidden_size']}" in kinds and any(k.startswith("values:") for k in kinds), kinds
    norms = [n for n in rot.tensors if n.endswith(("input_layernorm.weight", "post_attention_layernorm.weight"))]
    assert norms and all(torch.equal(rot.read(n), torch.ones_like(rot.read(n))) for n in norms)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_mtp_layer_rotates_with_the_stream(tmp_path):
    """DeepSeek's MTP layer (which cvt's runtime does not run): eh_proj over [enorm(emb), hnorm(h)]
    writes the rotated stream, and its shared head reads it, by hand."""
    cfg = tiny_deepseek_config()
    src = write_bf16_checkpoint(tmp_path / "src", cfg, seed=5)
    rot = _rotated_copy(src, tmp_path / "rot")
    ck = open_checkpoint(src)
    p = f"model.layers.{cfg['num_hidden_layers']}."
    w = {n: ck.read(p + n).float() for n in ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
                                            "shared_head.norm.weight", "shared_head.head.weight")}
    r = {n: rot.read(p + n).float() for n in w}
    q = rot.rotator.space("residual", cfg["hidden_size"]).matrix()
    tok, h = torch.tensor([3, 7, 11]), torch.randn(3, cfg["hidden_size"])
    out = torch.cat([_rms(w["embed_tokens.weight"][tok]) * w["enorm.weight"], _rms(h) * w["hnorm.weight"]], -1)
    out = out @ w["eh_proj.weight"].T
    got = torch.cat([_rms(r["embed_tokens.weight"][tok]), _rms(h @ q)], -1) @ r["eh_proj.weight"].T
    assert torch.allclose(got, out @ q, atol=1e-4 * float(out.abs().max()))
    head = (_rms(out) * w["shared_head.norm.weight"]) @ w["shared_head.head.weight"].T
    assert torch.allclose(_rms(got) @ r["shared_head.head.weight"].T, head, atol=1e-4 * float(head.abs().max()))
    ck.close()


def _weights(d: Path) -> dict[str, bytes]:
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            out.update({n: s.get_tensor(n).view(torch.uint8).numpy().tobytes() for n in s.keys()})
    return out


def test_fp8_release_rotates_as_its_bf16_dequant(fp8_release, tmp_path):
    """An FP8 block release, rotated on the fly, writes the bytes its `cvt fp8-to-bf16` output writes
    rotated; the manifest records the rotation; the same seed the same bytes, another seed others."""
    from cvt.convert.fp8_to_bf16 import fp8_to_bf16

    bf16 = tmp_path / "bf16"
    fp8_to_bf16(fp8_release, bf16, quiet=True)
    outs = {}
    for name, src, spec in (("fp8", fp8_release, "hadamard:5"), ("bf16", bf16, "hadamard:5"),
                            ("again", fp8_release, "HADAMARD:5"), ("other", fp8_release, "hadamard:6")):
        quantize(src, tmp_path / f"out-{name}", scheme="w8a8", fmt="ascend", quiet=True, rotate=spec)
        outs[name] = _weights(tmp_path / f"out-{name}")
    assert outs["fp8"] == outs["bf16"] == outs["again"]
    assert outs["other"].keys() == outs["fp8"].keys() and outs["other"] != outs["fp8"]
    stage = json.loads((tmp_path / "out-fp8" / "cvt_manifest.json").read_text())["stages"][-1]
    assert stage["parameters"]["rotation"] == "hadamard:5"
    plain = tmp_path / "plain"
    quantize(fp8_release, plain, scheme="w8a8", fmt="ascend", quiet=True)
    assert "rotation" not in json.loads((plain / "cvt_manifest.json").read_text())["stages"][-1]["parameters"]


def test_rotate_spellings():
    assert parse("hadamard") == "hadamard:0" and parse(" Hadamard:12 ") == "hadamard:12"
    for bad in ("", "walsh", "hadamard:", "hadamard:-1", "hadamard:1e3", "hadamard:1234567890"):
        with pytest.raises(OptionError, match="--rotate"):
            parse(bad)


def test_refusals_are_one_line_and_leave_dst_alone(tmp_path):
    from cvt.testing.checkpoints_v4 import tiny_deepseek_v4_config, write_v4_release
    from cvt.tests.conftest import run_cvt

    cases = {
        "tied": (write_bf16_checkpoint(tmp_path / "tied", tiny_qwen3_config(moe=False, tie_word_embeddings=True)),
                 "tie_word_embeddings"),
        "v4": (write_v4_release(tmp_path / "v4", tiny_deepseek_v4_config()), "hyper-connections"),
        "k25": (write_bf16_checkpoint(tmp_path / "k25", tiny_kimi_k25_config()), "vision projector"),
    }
    for name, (src, why) in cases.items():
        dst = tmp_path / f"out-{name}"
        r = run_cvt("quantize", str(src), str(dst), "--scheme", "w8a8", "--format", "ascend", "--rotate", "hadamard")
        assert r.rc == 1 and len(r.err.strip().splitlines()) == 1 and why in r.err and "--rotate" in r.err, r.err
        assert not dst.exists()
    r = run_cvt("quantize", str(cases["tied"][0]), str(tmp_path / "x"), "--scheme", "w8a8", "--rotate", "walsh")
    assert r.rc == 2 and "--rotate 'walsh'" in r.err and not (tmp_path / "x").exists()


def test_compressed_tensors_output_needs_nothing_online(tmp_path):
    """compressed-tensors' own dequantizer (the package vLLM loads with) turns a rotated W8A8 output
    back into a float model that runs as SRC does, with no rotation left to apply: the folded norms
    are ones and the weights carry Q (mean KL of the next-token distributions against SRC small)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters import CompressedTensorsDequantizer

    cfg = tiny_qwen3_config(moe=False, hidden_size=128, head_dim=32)  # dense: no routing flips in the KL
    src = write_bf16_checkpoint(tmp_path / "src", cfg, seed=6)
    ids = torch.randint(0, cfg["vocab_size"] - 10, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = _logits(src, ids).log_softmax(-1)
    kl = {}
    for rotate in (None, "hadamard:2"):
        out, deq = tmp_path / f"w8a8-{rotate}", tmp_path / f"deq-{rotate}"
        quantize(src, out, scheme="w8a8", fmt="compressed-tensors", quiet=True, rotate=rotate)
        ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
        ignore = [*ignore, "model.embed_tokens", "re:.*norm$"]  # what the package's dequantizer cannot tell itself
        convert_checkpoint(out, deq, CompressedTensorsDequantizer(out, ignore=ignore, dtype=torch.float32),
                           device="cpu", max_workers=1)
        (deq / "cvt_manifest.json").unlink()  # the package copies every side file: cvt's no longer describes it
        assert "quantization_config" not in json.loads((deq / "config.json").read_text())  # a plain float model
        got = _logits(deq, ids).log_softmax(-1)
        kl[rotate] = float((ref.exp() * (ref - got)).sum(-1).mean())
    assert kl["hadamard:2"] < 1.5 * kl[None], kl  # weight rounding noise, not a wrong function (that is ~1)
