"""`cvt run` and `cvt verify` end to end on the trained tiny DeepSeek-V3 fixture."""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest
import torch
from safetensors.torch import load_file, save_file

from cvt.runtime.generate import generate
from cvt.runtime.loader import load_model
from cvt.runtime.tokenizer import load_tokenizer
from cvt.schemas import load_schema
from cvt.tests.conftest import run_cvt

pytestmark = pytest.mark.slow  # generation and verify on the trained fixture


@pytest.fixture(scope="module")
def loaded(trained_fixture):
    return load_model(trained_fixture, dtype=torch.float32)


def test_greedy_generation_agrees_with_full_forward(trained_fixture, loaded):
    tok = load_tokenizer(trained_fixture, loaded.config)
    prompt = tok.encode("#include <linux/")
    res = generate(loaded.model, [prompt], 24)
    seq = torch.tensor([prompt + res.outputs[0]])
    full = loaded.model(seq)  # one full pass, no cache
    greedy = full[0, len(prompt) - 1 : -1].argmax(-1).tolist()
    assert greedy == res.outputs[0]
    assert tok.decode(res.outputs[0]).strip()  # the trained model writes something


def test_batch_equals_single_prompts(trained_fixture, loaded):
    tok = load_tokenizer(trained_fixture, loaded.config)
    prompts = [tok.encode("struct a {"), tok.encode("struct b {"), tok.encode("#define X")]
    batch = generate(loaded.model, prompts, 8).outputs
    single = [generate(loaded.model, [p], 8).outputs[0] for p in prompts]
    assert batch == single


def test_sampling_is_seeded_and_top_p_tiny_is_greedy(trained_fixture, loaded):
    tok = load_tokenizer(trained_fixture, loaded.config)
    p = [tok.encode("int main(")]
    a = generate(loaded.model, p, 12, temperature=1.0, top_p=0.9, seed=3).outputs
    b = generate(loaded.model, p, 12, temperature=1.0, top_p=0.9, seed=3).outputs
    assert a == b
    assert generate(loaded.model, p, 12, temperature=1.0, top_p=1e-6).outputs == generate(loaded.model, p, 12).outputs


def test_cli_run_prints_text_and_speed(trained_fixture):
    r = run_cvt("run", trained_fixture, "--prompt", "#include <linux/", "--max-new-tokens", "8", "--device", "cpu")
    assert r.rc == 0, r.err
    assert r.out.startswith("#include <linux/")
    assert "tokens/s" in r.out and "decode" in r.out
    ids = run_cvt("run", trained_fixture, "--input-ids", "256,35,105", "--max-new-tokens", "4", "--device", "cpu",
                  "--quiet")
    assert ids.rc == 0 and ids.out.startswith("#i")


def test_verify_identical_models(trained_fixture, tmp_path):
    r = run_cvt("verify", trained_fixture, "--reference", trained_fixture, "--report", tmp_path / "rep",
                "--device", "cpu", "--min-cosine", "0.9999", "--max-ppl-ratio", "1.0001", "--min-top1", "1")
    assert r.rc == 0, r.err
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    jsonschema.validate(report, load_schema("report.schema.json"))
    assert all(row["Cosine"] == 1.0 for row in report["layers"])
    lg = report["logits"]
    assert (lg["kl_mean"], lg["ppl_ratio"], lg["same_top1"], lg["rms_delta_p"]) == (0.0, 1.0, 1.0, 0.0)
    assert report["passed"] and report["first_divergent_layer"] is None
    assert all(w["sqnr_db"] == "Infinity" for w in report["weights"])
    html = (tmp_path / "rep" / "report.html").read_text()
    assert html.count("<svg") >= 2 and "http://" not in html.replace("http://www.w3.org/2000/svg", "")


@pytest.fixture
def perturbed(trained_fixture, tmp_path):
    """The fixture with layer 1's attention output projection perturbed by 2% noise."""
    dst = tmp_path / "perturbed"
    shutil.copytree(trained_fixture, dst)
    tensors = {k: v.clone() for k, v in load_file(dst / "model.safetensors").items()}
    w = tensors["model.layers.1.self_attn.o_proj.weight"]
    g = torch.Generator().manual_seed(0)
    tensors["model.layers.1.self_attn.o_proj.weight"] = (w.float() * (1 + 0.02 * torch.randn(w.shape, generator=g))).to(w.dtype)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_verify_finds_the_perturbed_layer_first(trained_fixture, perturbed, tmp_path):
    r = run_cvt("verify", perturbed, "--reference", trained_fixture, "--report", tmp_path / "rep", "--device", "cpu",
                "--min-cosine", "0.999999")
    assert r.rc == 4, r.err
    assert "threshold violated" in r.err
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    rows = {row["name"]: row for row in report["layers"]}
    assert rows["embed"]["Cosine"] == 1.0 and rows["layer.0"]["Cosine"] == 1.0
    assert rows["layer.1"]["Cosine"] < 1.0
    assert report["first_divergent_layer"] == "layer.1"
    sqnr = {w["name"]: w["sqnr_db"] for w in report["weights"]}
    assert isinstance(sqnr["model.layers.1.self_attn.o_proj.weight"], float)
    assert 25 < sqnr["model.layers.1.self_attn.o_proj.weight"] < 40  # 2% noise ~ 34 dB
    assert sqnr["model.layers.0.self_attn.o_proj.weight"] == "Infinity"
    assert report["logits"]["kl_mean"] > 0 and not report["passed"]
