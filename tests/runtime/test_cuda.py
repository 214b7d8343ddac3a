"""The runtime on a CUDA GPU gives the CPU's logits: every model family, and cvt's quantized
weights (each runtime kernel's CUDA path), through the library and `cvt verify --device cuda`.

float32 on both devices (TF32 off, torch's default for matmuls), so the two differ only by the
order of float sums: logits within 1e-4 of the CPU's relative to their scale, the same greedy
tokens. Skipped without a CUDA GPU (marker `cuda`); the CPU suite never needs one.
"""

from __future__ import annotations

import json

import pytest
import torch

from cvt.testing.checkpoints import (tiny_deepseek_config, tiny_deepseek_v32_config, tiny_glm_moe_dsa_config,
                                     tiny_qwen3_config, write_bf16_checkpoint, write_fp8_release)
from cvt.testing.checkpoints_v4 import write_v4_release
from cvt.runtime.loader import load_model
from cvt.tests.conftest import run_cvt

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOKENS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26], [2, 71, 82, 81, 82, 84, 59, 4, 5, 23, 53, 60]])


def _bf16(cfg: dict) -> dict:
    cfg = dict(cfg)
    cfg.pop("quantization_config", None)
    return cfg


def _both(path) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 logits of TOKENS on the CPU and on the GPU, the GPU's brought back."""
    out = []
    for device in ("cpu", "cuda"):
        loaded = load_model(path, device=device, dtype=torch.float32)
        assert loaded.device.type == device
        with torch.no_grad():
            out.append(loaded.model(TOKENS.to(loaded.device)).float().cpu())
        del loaded
    torch.cuda.empty_cache()
    return out[0], out[1]


def _close(cpu: torch.Tensor, gpu: torch.Tensor) -> None:
    assert torch.isfinite(gpu).all()
    scale = cpu.abs().max().item()
    assert (gpu - cpu).abs().max().item() <= 1e-4 * max(scale, 1.0), (gpu - cpu).abs().max().item()
    assert torch.equal(gpu.argmax(-1), cpu.argmax(-1))


@pytest.fixture(scope="module")
def fp8_v3(tmp_path_factory):
    return write_fp8_release(tmp_path_factory.mktemp("v3") / "src")


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32", "glm_moe_dsa", "qwen3_moe", "deepseek_v4"])
def test_every_family_runs_on_cuda_as_on_the_cpu(tmp_path, family):
    if family == "deepseek_v4":
        src = write_v4_release(tmp_path / "src")
    else:
        cfg = {"deepseek_v3": tiny_deepseek_config, "deepseek_v32": tiny_deepseek_v32_config,
               "glm_moe_dsa": tiny_glm_moe_dsa_config, "qwen3_moe": tiny_qwen3_config}[family]()
        src = write_bf16_checkpoint(tmp_path / "src", _bf16(cfg))
    _close(*_both(src))


def _linears_on_identical_inputs(path) -> int:
    """Every linear of the model on the GPU, fed the input its CPU twin saw in a CPU forward pass,
    gives the CPU's output within 1e-4 of its scale: the kernels agree where their quantizers
    get identical inputs (a whole model's activations differ in their last bits between the
    devices, and a dynamic int8 activation code can round apart there). Returns how many."""
    from cvt.runtime.kernels.linear import Linear

    cpu = load_model(path, device="cpu", dtype=torch.float32)
    gpu = load_model(path, device="cuda", dtype=torch.float32)
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(name):
        def record(mod, inp, out) -> None:  # returns None: the output stays the module's
            seen.setdefault(name, (inp[0].detach().clone(), out.detach().clone()))
        return record

    hooks = [m.register_forward_hook(hook(n)) for n, m in cpu.model.named_modules() if isinstance(m, Linear)]
    with torch.no_grad():
        cpu.model(TOKENS)
    for h in hooks:
        h.remove()
    mods = dict(gpu.model.named_modules())
    for name, (x, y) in seen.items():
        with torch.no_grad():
            got = mods[name](x.cuda()).float().cpu()
        assert (got - y).abs().max().item() <= 1e-4 * max(y.abs().max().item(), 1.0), name
    del cpu, gpu
    torch.cuda.empty_cache()
    return len(seen)


@pytest.mark.parametrize("scheme,fmt,opts,dynamic", [
    ("w8a8", "ascend", {}, True),
    ("w8a8", "compressed-tensors", {}, True),
    ("w4a16", "compressed-tensors", {"group_size": 32}, False),
    ("w4a16", "ascend", {"group_size": 32}, False),
    ("w4a8", "ascend", {}, True),
    ("fp4", "compressed-tensors", {}, False),
], ids=["w8a8-ascend", "w8a8-ct", "w4a16-ct", "w4a16-ascend", "w4a8-ascend", "nvfp4-ct"])
def test_quantized_weights_run_on_cuda_as_on_the_cpu(fp8_v3, tmp_path, scheme, fmt, opts, dynamic):
    """Each quantized linear matches on identical inputs; the whole model matches tightly for
    weight-only schemes, and with dynamic int8 activations (w8a8, w4a8) within the flips those
    allow: the same greedy token at 90% of positions, logits within 10% of their scale."""
    from cvt.quant.stage import quantize

    quantize(fp8_v3, tmp_path / "q", scheme=scheme, fmt=fmt, quiet=True, **opts)
    assert _linears_on_identical_inputs(tmp_path / "q") > 10
    cpu, gpu = _both(tmp_path / "q")
    if not dynamic:
        return _close(cpu, gpu)
    assert torch.isfinite(gpu).all()
    assert (gpu.argmax(-1) == cpu.argmax(-1)).float().mean().item() >= 0.9
    assert (gpu - cpu).abs().max().item() <= 0.1 * cpu.abs().max().item()


def test_cvt_verify_on_cuda(fp8_v3, tmp_path, monkeypatch):
    """`cvt verify --device cuda` of a w8a8 output against the FP8 release: both models are loaded
    on the GPU (the CLI run in this process, its loads watched), exit 0 and the CPU run's figures
    (dynamic int8 activations may round a few values apart where float sums differ: a token's
    top-1 at most, KL within 5%)."""
    import cvt.runtime.verify as V
    from cvt.quant.stage import quantize

    loaded_on = []
    real = V.load_model
    monkeypatch.setattr(V, "load_model", lambda *a, **k: (lambda m: loaded_on.append(m.device.type) or m)(real(*a, **k)))
    quantize(fp8_v3, tmp_path / "q", scheme="w8a8", fmt="ascend", quiet=True)
    got = {}
    for device in ("cpu", "cuda"):
        loaded_on.clear()
        r = run_cvt("verify", tmp_path / "q", "--reference", fp8_v3, "--report", tmp_path / device,
                    "--device", device, "--seq-len", "32", "--max-sequences", "2", "--quiet")
        assert r.rc == 0, r.err
        assert loaded_on == [device, device]
        got[device] = json.loads((tmp_path / device / "report.json").read_text())["logits"]
    cpu, gpu = got["cpu"], got["cuda"]
    assert gpu["tokens"] == cpu["tokens"]
    assert abs(gpu["same_top1"] - cpu["same_top1"]) <= 1 / cpu["tokens"] + 1e-9
    assert abs(gpu["kl_mean"] - cpu["kl_mean"]) <= 0.05 * cpu["kl_mean"]
