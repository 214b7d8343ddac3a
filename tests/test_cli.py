"""The command line as a user meets it: help, demo, one-line errors, cheap imports."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cvt.tests.conftest import run_cvt

VERBS = ["fp8-to-bf16", "quantize", "inspect", "run", "verify", "plan", "shard", "export onnx", "export om", "demo"]


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_has_help_with_quiet_and_debug(verb):
    r = run_cvt(*verb.split(), "--help")
    assert r.rc == 0 and "Usage: cvt " + verb in r.out
    assert "--quiet" in r.out and "--debug" in r.out


def test_top_level_help_lists_verbs_and_version():
    r = run_cvt("--help", subprocess_=True)  # the real entry point, python -m cvt
    assert r.rc == 0 and all(v.split()[0] in r.out for v in VERBS)
    assert run_cvt("--version").out.strip() == "cvt, version 0.1.0"


def test_usage_errors_are_one_line():
    r = run_cvt("fp8-to-bf16", "only-src", subprocess_=True)
    assert r.rc == 2 and r.err.count("\n") == 1 and r.err.startswith("cvt: error: Missing argument 'DST'")
    r = run_cvt("fp8-to-bf16", "a", "b", "--workers", "0")
    assert r.rc == 2 and r.err.startswith("cvt: error: Invalid value for '--workers'")
    r = run_cvt("fp8-to-bf16", "a", "b", "--max-shard-size", "lots")  # one click type: exit 2, naming the option
    assert r.rc == 2 and "Invalid value for '--max-shard-size': size 'lots' is not a size like 5GB" in r.err


@pytest.mark.slow
def test_demo_runs_the_pipeline(tmp_path, demo_weights):
    r = run_cvt("demo", tmp_path / "demo")
    assert r.rc == 0, r.err
    assert "outputs:" in r.out and str(tmp_path / "demo" / "bf16") in r.out
    # the trained model (demo_weights: trained once into the cache) writes Python-looking text, and on
    # the held-out text W8A8 stays closer to BF16 than W4A16
    text = r.out.split("--seed 0\n", 1)[1].split("\ndecode ", 1)[0]
    assert text.startswith("def __init__(self") and "\ufffd" not in text and len(text) > 40, text
    kl = {k: float(r.out.split(f"\n{k}: ", 1)[1].split("mean KL ", 1)[1].split(",", 1)[0]) for k in ("w8a8", "w4a16")}
    assert kl["w4a16"] > 3 * kl["w8a8"], kl
    # the sharded 4-rank run agreed with one process; the ONNX export with the torch runtime
    assert "4 ranks vs 1 process" in r.out and "greedy tokens identical" in r.out
    assert "greedy tokens agree: yes: PASS" in r.out and "atc --framework=5" in r.out
    assert "[9/13] DeepSeek-V3.2" in r.out and "the indexer kept float" in r.out
    assert "[10/13] DeepSeek-V4" in r.out and "FP4 experts" in r.out
    # GLM-5 and Kimi-K2.5 (issue 27): the indexer float in GLM's W8A8 description; every Kimi expert the
    # INT4 release's own codes (method "source"), the vision tower carried
    assert "[11/13] GLM-5" in r.out and "copied byte for byte" in r.out
    desc = json.loads((tmp_path / "demo" / "glm5-w8a8-ascend" / "quant_model_description.json").read_text())
    assert desc["model.layers.2.self_attn.indexer.wq_b.weight"] == "FLOAT"
    assert desc["model.layers.2.mlp.experts.0.down_proj.weight"] == "W8A8_DYNAMIC"
    k25 = json.loads((tmp_path / "demo" / "kimi-k2.5-w4a16-ascend" / "cvt_manifest.json").read_text())
    experts = {n: t["method"] for n, t in k25["quant"]["tensors"].items() if ".experts." in n}
    assert experts and set(experts.values()) == {"source"} and k25["carried"]
    assert (tmp_path / "demo" / "verify-v32-w8a8" / "report.json").is_file()
    # gpt-oss (issue 40) and Qwen3.5-MoE (issue 41): released precision in, quantized, verified; gpt-oss sharded
    # with its fused experts split over ep (rank 1 holds experts 3-5 of 6) and its sinks over tp
    assert "[12/13] gpt-oss" in r.out and "8 MXFP4 expert tensors dequantized" in r.out
    assert "[13/13] Qwen3.5-MoE" in r.out and "vision tower tensors carried" in r.out
    for report in ("verify-gpt-oss-w8a8", "verify-qwen3.5-moe-w8a8"):  # W8A8 of random weights: ~0.97 measured
        layers = json.loads((tmp_path / "demo" / report / "report.json").read_text())["layers"]
        assert len(layers) > 4 and min(row["Cosine"] for row in layers) > 0.9, report
    gpt = json.loads((tmp_path / "demo" / "gpt-oss-bf16-tp2-ep2" / "cvt_manifest.json").read_text())["shard"]
    assert gpt["tensors"]["model.layers.0.mlp.experts.down_proj"]["axis"] == "ep"
    assert gpt["tensors"]["model.layers.0.self_attn.sinks"]["axis"] == "tp" and gpt["ranks"][1]["experts"]["0"] == [3, 4, 5]
    manifest = json.loads((tmp_path / "demo" / "bf16" / "cvt_manifest.json").read_text())
    assert manifest["format"] == "hf-bf16"
    # an unrelated directory is refused (a demo directory is replaced: cvt.demo checks its marker)
    assert (tmp_path / "demo" / ".cvt-demo").is_file()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("x")
    r = run_cvt("demo", tmp_path / "mine")
    assert r.rc == 1 and "not a cvt demo directory" in r.err and (tmp_path / "mine" / "keep.txt").exists()


@pytest.mark.parametrize("module", ["cvt", "cvt.cli", "cvt.errors", "cvt.schemas"])
def test_imports_stay_cheap(module):
    """Importing cvt pulls in no torch, onnx, onnxruntime, torch_npu or transformers."""
    code = (f"import sys, {module}; heavy = [m for m in ('torch', 'onnx', 'onnxruntime', 'torch_npu', 'transformers') "
            "if m in sys.modules]; print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


@pytest.mark.parametrize("preset", [None, "28"])
def test_cli_quiets_numpys_blas_threads_unless_told(preset):
    """numpy's OpenBLAS spins its threads ~0.1 s after loading unless OPENBLAS_THREAD_TIMEOUT is
    small (OpenBLAS's openblas_read_env reads it at load): on x86-64 the CLI sets 4, its minimum,
    before anything imports numpy, and keeps a user's own value."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if preset is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = preset
    code = ("import os, sys, cvt; before = 'numpy' in sys.modules; import cvt.cli; "
            "print(before, os.environ.get('OPENBLAS_THREAD_TIMEOUT'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    numpy_before, value = out.stdout.split()
    assert numpy_before == "False"  # the package itself loads no numpy: the CLI's setting comes first
    import platform

    x86 = platform.machine().lower() in ("x86_64", "amd64")  # elsewhere torch's own OpenBLAS would read it too
    assert value == (preset or ("4" if x86 else "None"))


@pytest.mark.slow
def test_cli_choices_follow_the_registries():
    """The CLI's choices are the registries' names, read when first needed: `cvt --help`
    imports no registry, `cvt quantize --help` lists them all."""
    r = subprocess.run([sys.executable, "-c", "import sys; from cvt.cli import main\ntry: main(['--help'])\n"
                        "except SystemExit: pass\nprint(sorted(m for m in sys.modules if m.startswith('cvt.quant')))"],
                       capture_output=True, text=True, check=True)
    assert r.stdout.strip().splitlines()[-1] == "[]"
    from cvt.cli.options import FORMATS, METHODS, PLAN_SCHEMES, SCHEMES, TARGETS
    from cvt.quant.recipe import METHODS as registered_methods
    from cvt.qtensor.formats import format_names
    from cvt.qtensor.layouts import ASCEND_TARGETS
    from cvt.qtensor.schemes import scheme_names

    assert list(SCHEMES.choices) == scheme_names() and list(FORMATS.choices) == format_names()
    assert METHODS.choices == registered_methods and TARGETS.choices == ASCEND_TARGETS
    assert PLAN_SCHEMES.choices == ("bf16", "fp8", *scheme_names())
    out = subprocess.run([sys.executable, "-m", "cvt", "quantize", "--help"], capture_output=True, text=True).stdout
    assert all(n in out for n in scheme_names() + format_names())
