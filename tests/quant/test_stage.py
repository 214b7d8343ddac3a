"""`cvt quantize` end to end on the tiny DeepSeek-V3 FP8 release and a dense Qwen3 model."""

from __future__ import annotations

import json
import signal

import jsonschema
import numpy as np
import pytest
import torch
from safetensors import safe_open

from cvt.testing.checkpoints import tiny_qwen3_config, write_bf16_checkpoint
from cvt.qtensor.formats import get_format
from cvt.qtensor.schemes import get_scheme
from cvt.quant.stage import quantize
from cvt.runtime.kernels import Linear
from cvt.runtime.loader import load_model
from cvt.schemas import load_schema
from cvt.tests.conftest import run_cvt
from cvt.tests.convert.fp8_reference import decode_scale, dequant

CASES = [
    ("compressed-tensors", "w8a8", {}),
    ("compressed-tensors", "w4a16", {}),
    ("compressed-tensors", "w4a16", {"asym": True, "group_size": 32}),
    ("compressed-tensors", "fp4", {}),
    ("compressed-tensors", "fp4", {"fp4_format": "mxfp4"}),
    ("compressed-tensors", "w8a8c8", {}),
    ("ascend", "w8a8", {}),
    ("ascend", "w8a8", {"static_attention": True}),
    ("ascend", "w4a16", {}),  # vllm-ascend (default target): int32 experts, other linears float
    ("ascend", "w4a16", {"target": "mindie"}),
    ("ascend", "w4a16", {"asym": True, "group_size": 64, "target": "mindie"}),
    ("ascend", "fp4", {"fp4_format": "mxfp4"}),  # vllm-ascend W4A16_MXFP4 experts
    ("ascend", "w8a8c8", {}),  # MLA: FAKQuant
]
IDS = [f"{f}-{s}" + "".join(f"-{k}={v}" for k, v in o.items()) for f, s, o in CASES]


def read_dir(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def source_float_weights(src) -> dict[str, torch.Tensor]:
    """The FP8 release's weights dequantized by the tests' independent numpy reference."""
    raw = {}
    for f in sorted(src.glob("*.safetensors")):
        data = f.read_bytes()
        hlen = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + hlen])
        header.pop("__metadata__", None)
        for name, info in header.items():
            a, b = info["data_offsets"]
            raw[name] = (info["dtype"], info["shape"], np.frombuffer(data[8 + hlen + a : 8 + hlen + b], np.uint8))
    out = {}
    for name, (dt, shape, buf) in raw.items():
        if dt == "F8_E4M3":
            sdt, sshape, sbuf = raw[name + "_scale_inv"]
            bits = dequant(buf.reshape(shape), decode_scale(sbuf, sdt).reshape(sshape))
            out[name] = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).float()
    return out


@pytest.fixture(scope="module")
def outputs(fp8_release_session, tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    res = {}
    for (fmt, scheme, opts), cid in zip(CASES, IDS):
        r = quantize(fp8_release_session, root / cid, scheme=scheme, fmt=fmt, quiet=True, **opts)
        res[cid] = (root / cid, r)
    return res


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_written_weights_are_the_scheme_applied_to_the_source(outputs, fp8_release_session, case):
    """Every quantized linear on disk reads back (format reader) to exactly what the scheme makes
    of the independently dequantized FP8 weight; the runtime kernel multiplies by the same."""
    fmt, scheme_name, opts = case
    folder, result = outputs[IDS[CASES.index(case)]]
    manifest = json.loads((folder / "cvt_manifest.json").read_text())
    jsonschema.validate(manifest, load_schema("manifest.schema.json"))
    quant = manifest["quant"]
    disk = read_dir(folder)
    form = get_format(fmt)
    meta = (json.loads((folder / "quant_model_description.json").read_text()) if fmt == "ascend"
            else json.loads((folder / "config.json").read_text())["quantization_config"])
    floats = source_float_weights(fp8_release_session)
    loaded = load_model(folder, dtype=torch.float32).model
    from cvt.convert.arch import arch_for

    arch = arch_for(json.loads((folder / "config.json").read_text()))
    checked = 0
    for module, info in quant["tensors"].items():
        scheme = get_scheme(info["scheme"], **({"group_size": info["group_size"], "symmetric": info["symmetric"]}
                                               if info["scheme"] == "w4a16" else
                                               {"fp4_format": info["kernel_fmt"]} if info["scheme"] == "fp4" else {}))
        group = arch.fused_group(module) if getattr(scheme, "per_tensor_scale", False) else None
        if group and all(m in quant["tensors"] for m in group):  # NVFP4: one global scale per fused group
            want = scheme.quantize(floats[module + ".weight"],
                                   global_scale=scheme.shared_scale([floats[m + ".weight"] for m in group]))
        else:
            want = scheme.quantize(floats[module + ".weight"])
        got = form.read(module, {k: v for k, v in disk.items() if k.startswith(module + ".")}, meta)
        parts = got.parts if info["kernel_fmt"] != "w8a8_static" else {"weight": got.parts["weight"]}
        for p, t in parts.items():
            assert torch.equal(t, want.parts[p]), f"{module}.{p}"
        mod = loaded.get_submodule(module)
        assert isinstance(mod, Linear) and mod.fmt == info["kernel_fmt"]
        if info["kernel_fmt"] != "w8a8_static":
            assert torch.equal(mod.dense_weight(), scheme.dequantize(want)), module
        checked += 1
    assert checked == result.extra["quantized"] > 0
    # defaults kept float: router, kv_b_proj, lm_head, embeddings, MTP eh_proj / head
    floats_kept = quant["float_modules"]
    assert "lm_head" in floats_kept and "model.layers.0.self_attn.kv_b_proj" in floats_kept
    assert "model.layers.1.mlp.gate" in floats_kept and "model.layers.3.eh_proj" in floats_kept
    assert all(isinstance(v["sqnr_db"], float) and v["sqnr_db"] > 10 for v in quant["tensors"].values())


@pytest.mark.slow
def test_ascend_layout_matches_the_formats_table(outputs):
    """W8A8 dynamic / static; the per-target W4A16, MXFP4 and C8 layouts are pinned to the
    consumers' code in test_ascend_targets.py."""
    folder, _ = outputs["ascend-w8a8"]
    disk, desc = read_dir(folder), json.loads((folder / "quant_model_description.json").read_text())
    x = "model.layers.0.mlp.down_proj."
    assert disk[x + "weight"].dtype == torch.int8 and disk[x + "weight"].shape == (256, 384)
    assert disk[x + "weight_scale"].shape == (256, 1) and disk[x + "weight_scale"].dtype == torch.float32
    assert torch.equal(disk[x + "weight_offset"], torch.zeros(256, 1)) and desc[x + "weight"] == "W8A8_DYNAMIC"

    folder, _ = outputs["ascend-w8a8-static_attention=True"]
    disk, desc = read_dir(folder), json.loads((folder / "quant_model_description.json").read_text())
    x = "model.layers.0.self_attn.o_proj."
    assert desc[x + "weight"] == "W8A8" and desc["model.layers.0.mlp.down_proj.weight"] == "W8A8_DYNAMIC"
    assert disk[x + "input_scale"].shape == (1,) and disk[x + "deq_scale"].shape == (256,)
    assert disk[x + "quant_bias"].dtype == torch.int32 and disk[x + "deq_scale"].dtype == torch.float32
    assert torch.allclose(disk[x + "deq_scale"], disk[x + "input_scale"] * disk[x + "weight_scale"].view(-1))

    folder, _ = outputs["ascend-w8a8c8"]
    desc = json.loads((folder / "quant_model_description.json").read_text())
    assert desc["fa_quant_type"] == "FAKQuant" and "kv_cache_type" not in desc  # MLA: FAKQuant, not GQA C8
    assert desc["model.layers.0.self_attn.fa_k.scale"] == "FAQuant"


@pytest.mark.slow
def test_compressed_tensors_config(outputs):
    folder, _ = outputs["compressed-tensors-w4a16"]
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["strategy"], w["group_size"], w["symmetric"]) == (4, "int", "group", 128, True)
    assert "lm_head" in qc["ignore"] and "model.layers.0.self_attn.kv_b_proj" in qc["ignore"]
    assert "model.layers.1.mlp.gate" in qc["ignore"]
    assert qc["kv_cache_scheme"] is None
    c8 = json.loads((outputs["compressed-tensors-w8a8c8"][0] / "config.json").read_text())["quantization_config"]
    assert c8["kv_cache_scheme"]["num_bits"] == 8 and c8["format"] == "int-quantized"
    assert json.loads((outputs["compressed-tensors-fp4"][0] / "config.json").read_text())[
        "quantization_config"]["format"] == "nvfp4-pack-quantized"


@pytest.mark.slow
def test_referee_compressed_tensors_dequantizes_the_stage_output(outputs, tmp_path):
    """compressed-tensors' model-free dequantizer, run on a whole cvt output directory, gives back
    the weights cvt's runtime multiplies by (pack-quantized: the package computes in bf16)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters import CompressedTensorsDequantizer
    from safetensors.torch import load_file

    for cid in ("compressed-tensors-w8a8", "compressed-tensors-w4a16"):
        folder, _ = outputs[cid]
        deq = CompressedTensorsDequantizer(folder, dtype=torch.float32, ignore=[
            "re:.*embed_tokens$", "re:.*norm$", "re:.*head$", "lm_head", "re:.*mlp\\.gate$", "re:.*kv_b_proj$",
            "re:.*eh_proj$"])
        convert_checkpoint(folder, tmp_path / cid, deq, device="cpu", max_workers=1)
        got = {}
        for f in (tmp_path / cid).glob("*.safetensors"):
            got.update(load_file(str(f)))
        model = load_model(folder, dtype=torch.float32).model
        quant = json.loads((folder / "cvt_manifest.json").read_text())["quant"]["tensors"]
        for module in quant:
            ours = model.get_submodule(module).dense_weight()
            theirs = got[module + ".weight"].float()
            assert torch.equal(theirs, ours if "w8a8" in cid else ours.bfloat16().float()), module


@pytest.mark.slow
def test_runtime_runs_every_output(outputs):
    tokens = torch.tensor([[256, 72, 101, 108, 108, 111]])
    for cid, (folder, _) in outputs.items():
        logits = load_model(folder, dtype=torch.float32).model(tokens)
        assert torch.isfinite(logits).all(), cid


def weight_only(model, bf16_experts: bool = False):
    """cvt's model with every quantized linear computing with its dequantized weight and float
    activations - what transformers runs on CPU after decompressing. transformers 5 fuses MoE
    experts into bf16 tensors on load, so `bf16_experts` rounds those the same way."""
    for name, mod in list(model.named_modules()):
        if isinstance(mod, Linear) and mod.fmt != "dense":
            w = mod.dense_weight()
            w = w.bfloat16().float() if bf16_experts and ".experts." in name else w
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, Linear.from_parts({"weight": w}, mod.bias))
    return model


TOKENS = torch.tensor([[256, 35, 105, 110, 99, 108, 117, 100, 101, 32, 60, 108]])


@pytest.mark.parametrize("files", [1, 4])
def test_transformers_loads_w4a16_deepseek_and_logits_match(trained_fixture, tmp_path, monkeypatch, files):
    """The trained DeepSeek-V3 fixture as compressed-tensors W4A16 g32 loads in transformers and
    its logits match cvt's runtime on the same output. transformers decompresses the fused
    experts to bf16 (equal bit for bit to cvt's dequant rounded to bf16, checked here) and runs
    them in bf16, hence the 2e-3 relative tolerance; the top-1 tokens are identical. files=4:
    the output cut into balanced files (the writer's threshold lowered, as a release of 1 GB or
    more is), so that an expert's parts transformers fuses may sit in different files."""
    from cvt.convert import writer

    transformers = pytest.importorskip("transformers")
    dst = tmp_path / "w4a16"
    if files > 1:
        monkeypatch.setattr(writer, "MIN_BALANCED_SHARD", 1)
    quantize(trained_fixture, dst, scheme="w4a16", fmt="compressed-tensors", group_size=32, quiet=True)
    assert len(list(dst.glob("model-*.safetensors"))) == files
    if files > 1:  # what this case is for: some expert's parts in two files
        where = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
        homes: dict[str, set] = {}
        for k, f in where.items():
            if ".mlp.experts." in k:
                homes.setdefault(k.rsplit(".", 2)[0], set()).add(f)
        assert any(len(v) > 1 for v in homes.values())
    hf = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    ours = load_model(dst, dtype=torch.float32).model
    fused = hf.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    gate = ours.get_submodule("model.layers.1.mlp.experts.0.gate_proj")
    assert torch.equal(fused[0, : gate.out_features].float(), gate.dense_weight().bfloat16().float())
    with torch.no_grad():
        a = hf(TOKENS).logits
    b = weight_only(ours, bf16_experts=True)(TOKENS)
    assert torch.allclose(a, b, rtol=0, atol=2e-3 * a.abs().max().item()), (a - b).abs().max()
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.fixture(scope="module")
def dense_qwen(tmp_path_factory):
    cfg = tiny_qwen3_config(moe=False, hidden_size=128, intermediate_size=256, head_dim=32)
    return write_bf16_checkpoint(tmp_path_factory.mktemp("qwen") / "bf16", cfg)


def ct_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' dynamic per-token int8 fake quantization: scale amax/127.5."""
    scale = (x.abs().amax(-1, keepdim=True) / 127.5).clamp(min=1e-12)
    return (x / scale).round().clamp(-128, 127) * scale


def test_transformers_loads_w8a8_dense_qwen3_and_logits_match(dense_qwen, tmp_path):
    """Dense Qwen3 W8A8 (int-quantized) loads in transformers, which runs compressed-tensors' fake
    quantization: the int8 weights decompressed, activations fake-quantized per token with
    scale amax/127.5. cvt's runtime (like vLLM's and Ascend's kernels) uses amax/127.

    Compared per linear, on the very inputs transformers' linears saw: two whole-model forwards
    differ in the last bits of their activations (other matmul kernels), and a per-token int8
    rounding then flips by one step here and there, which no tight logits tolerance survives on
    every CPU. On identical inputs the quantizer is deterministic, so each linear is checked
    tightly; the end to end logits only by cosine."""
    transformers = pytest.importorskip("transformers")
    dst = tmp_path / "w8a8"
    quantize(dense_qwen, dst, scheme="w8a8", fmt="compressed-tensors", quiet=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    model = load_model(dst, dtype=torch.float32).model
    quantized = [n for n, m in model.named_modules() if isinstance(m, Linear) and m.fmt != "dense"]
    theirs = {n: m for n, m in hf.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    assert set(theirs) == set(quantized) and quantized
    seen = {}

    def keep(name):
        def hook(_m, args, out):
            seen[name] = (args[0], out)
        return hook

    hooks = [theirs[n].register_forward_hook(keep(n)) for n in quantized]
    with torch.no_grad():
        a = hf(TOKENS).logits
    for h in hooks:
        h.remove()
    for n in quantized:
        x, y = seen[n]
        mod = model.get_submodule(n)
        # transformers' decompressed weight is cvt's dequantized weight, bit for bit
        assert torch.equal(theirs[n].weight.float(), mod.dense_weight()), n
        # same input, ct's activation rule, cvt's weight: only the float GEMM's rounding differs;
        # a wrong weight scale, packing or activation rule (amax/127: ~1% of max|y|) fails this
        fake = Linear.from_parts({"weight": mod.dense_weight()}, mod.bias)(ct_fake_quant(x))
        torch.testing.assert_close(fake, y, rtol=0, atol=1e-5 * y.abs().max().item(), msg=n)
        # cvt's real int8 kernel on the same input: off by the amax/127 vs /127.5 activation
        # rounding only (~1% of max|y| at most), far from what a broken kernel gives
        real = mod(x)
        assert (real - y).abs().max() < 0.03 * y.abs().max(), n
        assert torch.nn.functional.cosine_similarity(real.flatten(), y.flatten(), dim=0) > 0.9995, n
    # end to end, cvt's real int8 runtime: per-token roundings may flip anywhere, so cosine only
    real = model(TOKENS)
    assert torch.nn.functional.cosine_similarity(a.flatten(), real.flatten(), dim=0) > 0.99


@pytest.mark.slow
def test_kimi_int4_source_reemitted_without_loss(tmp_path):
    """A compressed-tensors pack-quantized INT4 g32 source with int4 experts (as Kimi-K2-Thinking
    ships) re-emitted as Ascend W4A16 g32 for vllm-ascend (int32 experts) and, at g64, for MindIE
    (int8 pairs): the dequantized weights are identical."""
    src = write_bf16_checkpoint(tmp_path / "bf16", tiny_qwen3_config(moe=True, hidden_size=128, head_dim=32, intermediate_size=256, moe_intermediate_size=64))
    for g, target in ((32, "vllm-ascend"), (64, "mindie")):
        ct = tmp_path / f"ct-int4-g{g}"
        quantize(src, ct, scheme="w4a16", fmt="compressed-tensors", group_size=g, quiet=True)
        asc = tmp_path / f"ascend-{target}"
        r = quantize(ct, asc, scheme="w4a16", fmt="ascend", group_size=g, target=target, quiet=True)
        assert all(t.method == "source" for t in r.manifest.quant.tensors.values())  # re-emitted, not requantized
        a, b = load_model(ct, dtype=torch.float32).model, load_model(asc, dtype=torch.float32).model
        checked = 0
        for name, mod in b.named_modules():
            if isinstance(mod, Linear) and mod.fmt == "w4a16":
                assert torch.equal(mod.dense_weight(), a.get_submodule(name).dense_weight()), name
                checked += 1
        assert checked and (target == "mindie" or all(".experts." in n for n in r.manifest.quant.tensors))


def test_recipe_mixed_precision(fp8_release_session, tmp_path):
    from cvt.quant.recipe import Recipe

    recipe = Recipe.model_validate({"rules": [{"pattern": r"mlp\.experts\.", "scheme": "w4a16", "group_size": 32},
                                              {"pattern": r"self_attn\.o_proj", "scheme": "float"}]})
    quantize(fp8_release_session, tmp_path / "mixed", scheme="w8a8", fmt="compressed-tensors", recipe=recipe, quiet=True)
    m = json.loads((tmp_path / "mixed" / "cvt_manifest.json").read_text())["quant"]
    assert m["tensors"]["model.layers.1.mlp.experts.0.up_proj"]["scheme"] == "w4a16"
    assert m["tensors"]["model.layers.1.mlp.shared_experts.up_proj"]["scheme"] == "w8a8"
    assert "model.layers.0.self_attn.o_proj" in m["float_modules"]
    qc = json.loads((tmp_path / "mixed" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision" and len(qc["config_groups"]) == 2
    load_model(tmp_path / "mixed", dtype=torch.float32)


@pytest.mark.slow
def test_kill_and_resume_is_byte_identical(fp8_release_session, tmp_path):
    args = ["quantize", fp8_release_session, None, "--scheme", "w4a16", "--format", "ascend", "--max-shard-size",
            "300000", "--quiet"]
    golden = tmp_path / "golden"
    assert run_cvt(*[golden if a is None else a for a in args]).rc == 0
    total = sum(p.stat().st_size for p in golden.iterdir())
    dst = tmp_path / "resumed"
    killed = run_cvt(*[dst if a is None else a for a in args], env={"CVT_TEST_KILL_AT_BYTE": str(total // 2)})
    assert killed.rc == -signal.SIGKILL
    assert run_cvt(*[dst if a is None else a for a in args]).rc == 0
    assert {p.name: p.read_bytes() for p in golden.iterdir()} == {p.name: p.read_bytes() for p in dst.iterdir()}


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--scheme", "w9"], "Invalid value for '--scheme': 'w9' is not one of"),
        (["--scheme", "w8a8", "--format", "gguf"], "Invalid value for '--format'"),
        # ascend: one global group_size, so no per-channel fallback (compressed-tensors has one:
        # tests/quant/test_group_fallback.py)
        (["--scheme", "w4a16", "--format", "ascend", "--group-size", "48"], "group size 48 does not divide"),
        (["--scheme", "fp4", "--format", "ascend"], "has no layout for scheme 'fp4' (nvfp4)"),
        (["--scheme", "w4a16", "--method", "gptq", "--calib", "/nonexistent.txt"], "no such file"),
        (["--scheme", "w8a8", "--format", "compressed-tensors", "--static-attention"], "exists only in the ascend format"),
    ],
    ids=["unknown-scheme", "unknown-format", "group-not-dividing", "fp4-as-ascend", "calib-missing", "static-ct"],
)
def test_bad_requests_are_one_line_and_write_nothing(fp8_release_session, tmp_path, args, needle):
    dst = tmp_path / "out"
    r = run_cvt("quantize", fp8_release_session, dst, *args)
    assert r.rc != 0 and "Traceback" not in r.err
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cvt: error:") and needle in lines[0], r.err
    assert not (dst / "cvt_manifest.json").exists() and not list(dst.glob("*.safetensors")) if dst.exists() else True


def test_empty_calibration_file(fp8_release_session, tmp_path):
    empty = tmp_path / "calib.txt"
    empty.write_text("   \n")
    r = run_cvt("quantize", fp8_release_session, tmp_path / "out", "--scheme", "w8a8c8", "--calib", empty)
    assert r.rc != 0 and "no text to calibrate on" in r.err and len(r.err.strip().splitlines()) == 1


def test_nan_weight_refused_before_writing(tmp_path, tiny_config):
    from cvt.testing.checkpoints import random_weights, write_release

    cfg = {k: v for k, v in tiny_config.items() if k != "quantization_config"}
    weights = {n: (t if n.endswith("bias") else t.to(torch.bfloat16)) for n, t in random_weights(cfg).items()}
    weights["model.layers.0.mlp.up_proj.weight"][3, 5] = float("nan")
    src = write_release(tmp_path / "src", cfg, weights, move_scale=False)
    r = run_cvt("quantize", src, tmp_path / "out", "--scheme", "w8a8", "--quiet")
    assert r.rc != 0 and "model.layers.0.mlp.up_proj.weight" in r.err and "non-finite" in r.err
    assert len(r.err.strip().splitlines()) == 1 and r.err.startswith("cvt: error:")
    left = {p.name for p in (tmp_path / "out").iterdir()} if (tmp_path / "out").exists() else set()
    assert not left & {"cvt_manifest.json", "config.json", "model.safetensors.index.json"}


@pytest.mark.parametrize("what", ["nan-scale-of-a-float-module", "misshaped-scale", "missing-scale"])
def test_bad_fp8_scales_refused_before_writing(fp8_release, tmp_path, what):
    """quantize checks the FP8 release's scales up front, for modules kept float too (kv_b_proj)."""
    from safetensors.torch import load_file, save_file

    index = json.loads((fp8_release / "model.safetensors.index.json").read_text())
    name = "model.layers.0.self_attn.kv_b_proj.weight_scale_inv"
    fname = index["weight_map"][name]
    t = {k: v.clone() for k, v in load_file(fp8_release / fname).items()}
    if what == "nan-scale-of-a-float-module":
        t[name][0, 0] = float("nan")
    elif what == "misshaped-scale":
        t[name] = t[name][:1]
    else:
        del t[name]
        del index["weight_map"][name]
        (fp8_release / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file(t, fp8_release / fname, metadata={"format": "pt"})
    r = run_cvt("quantize", fp8_release, tmp_path / "out", "--scheme", "w8a8")
    assert r.rc != 0 and "kv_b_proj" in r.err and len(r.err.strip().splitlines()) == 1, r.err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["ascend", "compressed-tensors"])
def test_c8_outputs_load_with_their_kv_scales(outputs, dense_qwen, tmp_path, fmt):
    """w8a8c8 of an MLA and a GQA model, both formats: the runtime attaches the KV-cache scales
    (so generation uses the int8 cache). The MLA one is the module's own `outputs` case."""
    from cvt.runtime.kv_cache import has_kv_cache_scales

    for name in ("mla", "gqa"):
        dst = outputs[f"{fmt}-w8a8c8"][0] if name == "mla" else tmp_path / f"{name}-{fmt}"
        if name == "gqa":
            quantize(dense_qwen, dst, scheme="w8a8c8", fmt=fmt, quiet=True)
        model = load_model(dst, dtype=torch.float32).model
        assert has_kv_cache_scales(model), (name, fmt)
        assert model.new_cache(1, 8)[0].__class__.__name__.startswith("Int8"), (name, fmt)


def test_int4_source_modules_kept_float_are_in_the_ignore_list(dense_qwen, tmp_path):
    ct = tmp_path / "ct-int4"
    quantize(dense_qwen, ct, scheme="w4a16", fmt="compressed-tensors", group_size=32, quiet=True)
    out = tmp_path / "out"
    quantize(ct, out, scheme="w4a16", fmt="compressed-tensors", group_size=32, ignore=(r"mlp\.down_proj",), quiet=True)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.down_proj" in qc["ignore"]
    assert read_dir(out)["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    load_model(out, dtype=torch.float32)
