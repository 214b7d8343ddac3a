"""The loader: any cvt output or HF BF16/FP8 dir -> a model, with the manifest checked."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from cvt.convert.fp8_to_bf16 import fp8_to_bf16
from cvt.testing.checkpoints import tiny_qwen3_config, write_bf16_checkpoint
from cvt.errors import CvtError, ManifestError, TensorError
from cvt.runtime.loader import load_model
from cvt.tests.conftest import run_cvt

TOKENS = torch.tensor([[256, 35, 105, 110, 99, 108, 117, 100], [256, 116, 104, 101, 32, 113, 117, 105]])


def logits(loaded):
    return loaded.model(TOKENS.to(loaded.device))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return write_bf16_checkpoint(tmp_path_factory.mktemp("qwen") / "bf16", tiny_qwen3_config())


def test_bf16_weights_land_unchanged(qwen_dir):
    loaded = load_model(qwen_dir, dtype=torch.bfloat16)
    params = dict(loaded.model.named_parameters())
    for f in qwen_dir.glob("*.safetensors"):
        for name, t in load_file(f).items():
            assert torch.equal(params[name].data, t), name
    assert loaded.manifest is None and loaded.source_format == "bf16"


@pytest.mark.slow
def test_fp8_release_dequantized_on_load_equals_the_converted_output(fp8_release_session, tmp_path):
    fp8_to_bf16(fp8_release_session, tmp_path / "bf16", quiet=True)
    from_fp8 = load_model(fp8_release_session, dtype=torch.float32)
    from_bf16 = load_model(tmp_path / "bf16", dtype=torch.float32)
    assert from_bf16.manifest is not None and from_bf16.manifest.format == "hf-bf16"
    assert torch.equal(logits(from_fp8), logits(from_bf16))
    # the MTP layer is loadable: present in the model when the checkpoint has it
    n = from_bf16.model.args.num_hidden_layers
    assert len(from_bf16.model.model.layers) == n + 1


def test_checkpoint_without_mtp_runs_without_it(tmp_path, tiny_config):
    from cvt.testing.checkpoints import tiny_deepseek_config

    cfg = tiny_deepseek_config()
    cfg.pop("quantization_config")
    src = write_bf16_checkpoint(tmp_path / "m", {**cfg, "num_nextn_predict_layers": 0})
    (src / "config.json").write_text(json.dumps(cfg))  # config says 1 MTP layer, weights have none
    loaded = load_model(src, dtype=torch.float32)
    assert len(loaded.model.model.layers) == cfg["num_hidden_layers"]
    assert logits(loaded).shape == (2, 8, cfg["vocab_size"])


@pytest.fixture
def cvt_output(fp8_release_session, tmp_path):
    dst = tmp_path / "bf16"
    fp8_to_bf16(fp8_release_session, dst, quiet=True)
    return dst


def test_manifest_file_missing(cvt_output):
    victim = sorted(cvt_output.glob("model-*.safetensors"))[0]
    victim.unlink()
    with pytest.raises((ManifestError, CvtError), match=victim.name):
        load_model(cvt_output)


def test_manifest_file_modified_size(cvt_output):
    victim = sorted(cvt_output.glob("model-*.safetensors"))[-1]
    shutil.copy(victim, victim.with_suffix(".bak"))
    victim.write_bytes(victim.read_bytes() + b"\0" * 8)
    with pytest.raises(CvtError, match=victim.name):
        load_model(cvt_output)


def test_manifest_file_modified_same_size_needs_verify_files(cvt_output):
    victim = sorted(cvt_output.glob("model-*.safetensors"))[-1]
    data = bytearray(victim.read_bytes())
    data[-2] ^= 0x01
    victim.write_bytes(data)
    load_model(cvt_output)  # names, shapes and sizes still agree
    with pytest.raises(ManifestError, match="blake3 differs"):
        load_model(cvt_output, verify_files=True)


def test_unknown_tensor_and_shape_mismatch(qwen_dir, tmp_path):
    from cvt.testing.checkpoints import write_safetensors

    bad = tmp_path / "bad"
    shutil.copytree(qwen_dir, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    fname = index["weight_map"]["model.norm.weight"]
    t = {k: v.clone() for k, v in load_file(bad / fname).items()}  # not views of the file we rewrite
    t["model.norm.weight"] = torch.ones(7, dtype=torch.bfloat16)
    write_safetensors(bad / fname, t)
    with pytest.raises(TensorError, match=r"model.norm.weight: checkpoint shape \[7\]"):
        load_model(bad)


def test_cli_bad_inputs_are_one_line(cvt_output, qwen_dir, tmp_path):
    cases = []
    # a manifest whose files are modified
    victim = sorted(cvt_output.glob("model-*.safetensors"))[0]
    victim.write_bytes(victim.read_bytes()[:-4])
    cases.append((run_cvt("run", cvt_output, "--prompt", "hi", "--device", "cpu"), victim.name))
    # a config the runtime does not support
    odd = tmp_path / "odd"
    shutil.copytree(qwen_dir, odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (odd / "config.json").write_text(json.dumps(cfg))
    cases.append((run_cvt("run", odd, "--prompt", "hi", "--device", "cpu"), "hidden_act"))
    # a prompt longer than the model's max positions
    long_prompt = "x" * 600
    cases.append((run_cvt("run", qwen_dir, "--prompt", long_prompt, "--device", "cpu"), "exceeds the model's 512 positions"))
    # a device that is not available
    if not torch.cuda.is_available():
        cases.append((run_cvt("run", qwen_dir, "--prompt", "hi", "--device", "cuda"), "no CUDA device"))
    cases.append((run_cvt("run", qwen_dir, "--prompt", "hi", "--device", "npu"), "torch_npu is not installed"))
    for res, needle in cases:
        assert res.rc != 0 and "Traceback" not in res.err, res.err
        # progress frames (a model loaded before the prompt was refused) aside, one line
        lines = [ln for ln in res.err.strip().splitlines() if ln and not re.match(r"[\w ]+: +\d+%\|", ln)]
        assert len(lines) == 1 and lines[0].startswith("cvt: error:") and needle in lines[0], res.err
