"""`cvt quantize` of gpt-oss (issue 40 item 3): compressed-tensors as vLLM and transformers load it,
from the BF16 layout and from the MXFP4 release (dequantized on the fly); Ascend refused (vllm-ascend
serves gpt-oss in BF16 only); GPTQ / AWQ calibrate its attention through the runtime model.

What the consumer loads (vLLM's gpt_oss.py, ``_load_weights_other``; the ``mxfp4`` path is the
release's own): the attention linears through vLLM's quantized ``qkv_proj`` / ``o_proj``, the
routed experts as the fused float tensors ``gate_up_proj`` [E, h, 2I] (gate / up interleaved,
copied whole) and ``down_proj`` [E, I, h]; router (a plain ``torch.nn.Linear``), sinks and every
bias float. So the experts stay fused and float here, listed in ``ignore`` in the form vLLM's
FusedMoE looks them up (`cvt.qtensor.formats.compressed_tensors.fused_experts_ignore`).
"""

from __future__ import annotations

import json

import pytest
import torch

from cvt.qtensor.formats.compressed_tensors import match_name
from cvt.runtime.loader import load_model
from cvt.testing.checkpoints import random_weights, write_bf16_checkpoint, write_release
from cvt.testing.checkpoints_gpt_oss import mxfp4_release_tensors, tiny_gpt_oss_config
from cvt.tests.conftest import run_cvt

transformers = pytest.importorskip("transformers")

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def _read_all(path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _mxfp4_release(path, **cfg):
    config = tiny_gpt_oss_config(mxfp4=True, **cfg)
    return write_release(path, config, mxfp4_release_tensors(random_weights(config)), n_shards=2, move_scale=False)


def _quantize(src, dst, scheme="w8a8", *extra):
    r = run_cvt("quantize", src, dst, "--scheme", scheme, "--format", "compressed-tensors", "--quiet", *extra)
    assert r.rc == 0, r.err
    return json.loads((dst / "config.json").read_text())["quantization_config"]


def test_compressed_tensors_layout_and_transformers_loads_it(tmp_path):
    """RTN W4A16 (group 32): q/k/v/o packed int4 with their scales, every other tensor (the fused
    experts, their biases, router, sinks, norms, embeddings, head) byte for byte the source's; the
    experts ignored under vLLM's lookup names; transformers (compressed-tensors' own decompression)
    loads the output and its logits equal cvt's runtime on it."""
    src = write_bf16_checkpoint(tmp_path / "src", tiny_gpt_oss_config())
    out = tmp_path / "q"
    qc = _quantize(src, out, "w4a16", "--group-size", "32")
    want, got = _read_all(src), _read_all(out)
    quantized = {n[: -len(".weight")] for n in want if n.endswith(tuple(f"{p}.weight" for p in ATTN))}
    assert len(quantized) == 16
    for name, t in want.items():
        if name[: -len(".weight")] not in quantized or not name.endswith(".weight"):
            assert got[name].dtype == t.dtype and torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
    assert set(got) == {n for n in want if n[: -len(".weight")] not in quantized} | {
        f"{m}.{p}" for m in quantized for p in ("weight_packed", "weight_scale", "weight_shape")}
    ignore = qc["ignore"]
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear"] and "lm_head" in ignore
    for i in range(4):
        assert f"model.layers.{i}.mlp.router" in ignore
        # vLLM's FusedMoE asks for expert 0's three linears (CompressedTensorsMoEMethod.get_moe_method)
        assert all(any(match_name(f"model.layers.{i}.mlp.experts.{e}.{p}", x) for x in ignore)
                   for e in (0, 5) for p in ("gate_proj", "up_proj", "down_proj"))
        assert not any(match_name(f"model.layers.{i}.self_attn.{p}", x) for x in ignore for p in ATTN)
    # vLLM's hf_to_vllm_mapper renames the suffixes .down_proj / .gate_up_proj in the ignore list too
    assert not any(x.endswith((".down_proj", ".gate_up_proj", "_proj")) for x in ignore if x.startswith("re:"))

    model = transformers.GptOssForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    x = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(input_ids=x).logits.float()
        ours = load_model(out, dtype=torch.float32).model(x)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_mxfp4_release_quantizes_as_its_bf16(tmp_path):
    """The MXFP4 release dequantized on the fly: the same output bytes (weights and config.json) as
    quantizing its `cvt fp8-to-bf16` output (transformers' own dequantization, tested there)."""
    src = _mxfp4_release(tmp_path / "mx")
    bf16 = tmp_path / "bf16"
    assert run_cvt("fp8-to-bf16", src, bf16, "--quiet").rc == 0
    direct, via = tmp_path / "direct", tmp_path / "via"
    assert _quantize(src, direct, "w4a16") == _quantize(bf16, via, "w4a16")
    a, b = _read_all(direct), _read_all(via)
    assert set(a) == set(b) and all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)
    x = "model.layers.1.mlp.experts.gate_up_proj"
    assert a[x].dtype == torch.bfloat16 and a[x].shape == (6, 64, 64) and x + "_blocks" not in a
    r = run_cvt("run", direct, "--input-ids", "5,6,7,8", "--max-new-tokens", "3", "--quiet")
    assert r.rc == 0, r.err


def test_mxfp4_experts_are_not_carried_even_onto_their_own_grid(tmp_path, caplog):
    """`fp4 --fp4-format mxfp4` is the experts' own grid, yet they come out as their BF16
    dequantization (transformers' own, via `cvt fp8-to-bf16`), ignored, with no note line: no
    consumer loads a carried form. vLLM reads ``*_blocks`` / ``*_scales`` only under
    ``quant_method: "mxfp4"`` (gpt_oss.py ``load_weights`` -> ``_load_weights_mxfp4``), the
    release's own layout and config; under compressed-tensors ``_load_weights_other`` copies the
    fused experts as float tensors."""
    import logging

    src = _mxfp4_release(tmp_path / "mx")
    bf16 = tmp_path / "bf16"
    assert run_cvt("fp8-to-bf16", src, bf16, "--quiet").rc == 0
    out = tmp_path / "q"
    with caplog.at_level(logging.WARNING, logger="cvt"):
        qc = _quantize(src, out, "fp4", "--fp4-format", "mxfp4")
    assert caplog.records == []
    got, want = _read_all(out), _read_all(bf16)
    experts = [n for n in want if ".mlp.experts." in n]
    assert len(experts) == 16 and not [n for n in got if n.endswith(("_blocks", "_scales"))]
    for n in experts:
        assert got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]), n
    quant = json.loads((out / "cvt_manifest.json").read_text())["quant"]["tensors"]
    assert quant and not [m for m in quant if ".mlp.experts" in m]
    assert qc["format"] == "mxfp4-pack-quantized"
    assert all(any(match_name(f"model.layers.{i}.mlp.experts.0.{p}", x) for x in qc["ignore"])
               for i in range(4) for p in ("gate_proj", "up_proj", "down_proj"))


@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16", "mxfp4"])
def test_ascend_is_refused_before_dst(tmp_path, mxfp4):
    """vllm-ascend has no quantized gpt-oss path (`Format.refused_models`): one line, exit 1,
    nothing written."""
    src = _mxfp4_release(tmp_path / "src") if mxfp4 else write_bf16_checkpoint(tmp_path / "src", tiny_gpt_oss_config())
    dst = tmp_path / "out"
    r = run_cvt("quantize", src, dst, "--scheme", "w8a8", "--format", "ascend")
    assert r.rc == 1 and len(r.err.strip().splitlines()) == 1, r.err
    assert "gpt_oss: --format ascend is refused: vllm-ascend serves gpt-oss in BF16 only" in r.err
    assert not dst.exists()


def _mean_kl(tmp_path, out, src) -> float:
    report = tmp_path / f"report-{out.name}"
    r = run_cvt("verify", out, "--reference", src, "--report", report, "--quiet")
    assert r.rc == 0, r.err
    return json.loads((report / "report.json").read_text())["logits"]["kl_mean"]


@pytest.mark.slow  # 4 quantize runs (2 calibrated), 4 verifies: ~1 min on 2 cores
def test_calibrated_methods_and_quality(tmp_path):
    """GPTQ and AWQ calibrate every attention linear through the runtime model (the fused float
    experts run as they are); `cvt verify` against the BF16 source: each KL under a bound measured
    here, GPTQ's well under RTN's."""
    src = write_bf16_checkpoint(tmp_path / "src", tiny_gpt_oss_config(vocab_size=300))
    kl = {}
    for scheme, method in (("w8a8", "rtn"), ("w4a16", "rtn"), ("w4a16", "gptq"), ("w4a16", "awq")):
        out = tmp_path / f"{scheme}-{method}"
        _quantize(src, out, scheme, "--method", method, "--group-size", "32", "--calib-tokens", "512")
        m = json.loads((out / "cvt_manifest.json").read_text())["quant"]
        methods = {n: t["method"] for n, t in m["tensors"].items()}
        assert set(methods) == {f"model.layers.{i}.self_attn.{p}" for i in range(4) for p in ATTN}
        assert set(methods.values()) == {method}, m["fallbacks"]
        kl[scheme, method] = _mean_kl(tmp_path, out, src)
    # measured (512 tokens): w8a8 rtn 0.0035, w4a16 rtn 0.067, gptq 0.032, awq 0.042
    assert kl["w8a8", "rtn"] < 0.005 and kl["w4a16", "rtn"] < 0.09, kl
    assert kl["w4a16", "gptq"] < 0.6 * kl["w4a16", "rtn"] and kl["w4a16", "awq"] < 0.75 * kl["w4a16", "rtn"], kl


def test_w8a8c8_calibrates_the_kv_cache_and_decodes_on_it(tmp_path):
    """W8A8C8: the KV cache's static FP8 scales calibrated through both attention kinds (the
    runtime's `cache_input`), and the cached decode on the quantized cache gives the full forward's
    logits (which fake-quantizes k / v the same way)."""
    src = write_bf16_checkpoint(tmp_path / "src", tiny_gpt_oss_config(vocab_size=300))
    out = tmp_path / "c8"
    qc = _quantize(src, out, "w8a8c8", "--calib-tokens", "256")
    assert qc["kv_cache_scheme"]["type"] == "float" and qc["kv_cache_scheme"]["strategy"] == "tensor"
    got = _read_all(out)
    assert all(got[f"model.layers.{i}.self_attn.{k}_scale"].item() > 0 for i in range(4) for k in "kv")
    model = load_model(out, dtype=torch.float32).model
    x = torch.randint(0, 300, (1, 14), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache(1, 14)
        assert type(cache[0]).__name__ == "Int8KVCache"
        steps = [model(x[:, :8], start_pos=0, cache=cache)] + [model(x[:, t:t + 1], start_pos=t, cache=cache)
                                                              for t in range(8, 14)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-4 * full.abs().max().item())


@pytest.mark.parametrize("axis", ["tp", "ep"])
def test_shard_reassembles(tmp_path, axis):
    """`cvt shard` (--tp 2 / --ep 2, in a world of 2: ep is 2 either way) as vLLM's gpt-oss loader
    splits it (`cvt.convert.arch.gpt_oss`): under TP the attention linears and the sinks by heads
    (and the vocab-parallel embedding / head), every fused experts tensor by expert id ranges along
    dim 0 (rank 0 experts 0-2, rank 1 experts 3-5); each concatenates back to the source, byte for
    byte; the router and every other tensor are whole on both ranks."""
    src = write_bf16_checkpoint(tmp_path / "src", tiny_gpt_oss_config())
    dst = tmp_path / "sh"
    r = run_cvt("shard", src, dst, "--world-size", "2", f"--{axis}", "2", "--quiet")
    assert r.rc == 0, r.err
    want, ranks = _read_all(src), [_read_all(dst / f"rank-0000{i}") for i in range(2)]
    manifest = json.loads((dst / "cvt_manifest.json").read_text())["shard"]
    splits = manifest["tensors"]
    split = {n for n, t in splits.items() if t["dim"] is not None}
    heads = {n for n in want if n.endswith(("q_proj.weight", "k_proj.bias", "v_proj.weight", "o_proj.weight",
                                            "self_attn.sinks"))}
    experts = {n for n in want if ".mlp.experts." in n}
    assert len(heads) == 5 * 4 and len(experts) == 4 * 4
    assert heads <= split if axis == "tp" else not split & heads
    assert experts <= split and all(splits[n]["axis"] == "ep" and splits[n]["dim"] == 0 for n in experts)
    assert not any(".mlp.router." in n for n in split)
    assert [rk["experts"]["1"] for rk in manifest["ranks"]] == [[0, 1, 2], [3, 4, 5]]
    x = "model.layers.1.mlp.experts.down_proj"
    assert torch.equal(ranks[1][x], want[x][3:])   # rank 1's slice is experts 3-5
    for name, t in want.items():
        parts = [rk[name] for rk in ranks]
        if name in split:
            got = torch.cat(parts, splits[name]["dim"])
        else:
            assert torch.equal(parts[0].view(torch.uint8), parts[1].view(torch.uint8)), name
            got = parts[0]
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name


@pytest.mark.parametrize("extra, culprit", [(("--ep", "1", "--moe-tp", "2"), "moe_tp 2 would split each expert's "
                                             "width"), (("--ep", "2", "--redundant", "2"), "is not contiguous")],
                         ids=["moe-tp", "redundant"])
def test_shard_refuses_what_fused_experts_cannot_split_into(tmp_path, extra, culprit):
    """Fused experts split only into contiguous id ranges over ep: `cvt shard` refuses in one line naming a
    fused tensor, writing nothing; `cvt plan` lists the same violation (exit 3, problems found)."""
    src = write_bf16_checkpoint(tmp_path / "src", tiny_gpt_oss_config())
    r = run_cvt("shard", src, tmp_path / "sh", "--world-size", "2", "--tp", "1", *extra, "--quiet")
    assert r.rc == 1, r.err
    assert r.err.count("\n") == 1 and "model.layers.0.mlp.experts.gate_up_proj (experts fused" in r.err
    assert culprit in r.err and not (tmp_path / "sh").exists()
    r = run_cvt("plan", src, "--world-size", "2", "--tp", "1", *extra)
    assert r.rc == 3 and culprit in r.out.split("layout violations (cvt shard refuses this layout):", 1)[1]
