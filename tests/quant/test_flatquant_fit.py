"""`--method flatquant` (issue 39 item 2): the Kronecker transforms and clip of `w4a4_flatquant`
fitted on calibration rows (`cvt.quant.methods.flatquant`).

On a small layer: the fit lowers the quantized layer's output error (measured through the runtime
kernel, not the fit's own loss) below the Hadamard start, and is the same bits for a seed. Through
the stage on a tiny Qwen3: the manifest records the method and the fit, the shards vLLM fuses
(q / k / v, gate / up) carry one set of transforms, and the bytes repeat for a seed. Bad values of
the fit's options are refused with one line (exit 2).
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from cvt.quant.methods import flatquant as FQ
from cvt.quant.stage import quantize
from cvt.qtensor.schemes.flatquant import W4A4FlatQuant, init_transforms
from cvt.runtime.kernels.flatquant import W4A4FlatQuantLinear
from cvt.testing.checkpoints import tiny_qwen3_config, write_bf16_checkpoint
from cvt.tests.conftest import run_cvt


def _layer(seed: int = 0, k: int = 64, n: int = 48, m: int = 256):
    """Rows with a few outlier channels (what FlatQuant flattens) and a weight, float32."""
    g = torch.Generator().manual_seed(seed)
    channel = torch.exp(torch.randn(k, generator=g))
    x = torch.randn(m, k, generator=g) * channel   # the first rows of a larger m are the same rows
    x[:, :3] *= 15
    return x, torch.randn(n, k, generator=g) * 0.05


def _output_mse(x, w, left, right, clip) -> float:
    """The layer as it is written and run: the scheme's parts through the runtime kernel."""
    q = W4A4FlatQuant().quantize_with(w, left, right, clip)
    y = W4A4FlatQuantLinear.from_parts(q.parts).reference(x)
    return float((y - x @ w.T).pow(2).mean())


@pytest.mark.slow  # ~0.5 s on 2 busy cores
def test_fit_lowers_the_layer_output_error_below_the_hadamard_start():
    x, w = _layer()
    f = FQ.fit(x, [w], steps=15, lr=2e-2)
    start = _output_mse(x, w, *init_transforms(x.shape[1]), 1.0)
    fitted = _output_mse(x, w, f.left, f.right, f.clip)
    assert f.fitted and fitted < 0.6 * start, (fitted, start)   # measured 0.23x
    assert f.left.dtype == f.right.dtype == torch.bfloat16 and 0 < f.clip < 1
    (wc,) = f.weight_clips   # the rows' weight clips, one [n, 1] per linear of the site
    assert wc.shape == (w.shape[0], 1) and bool((wc > 0).all() and (wc <= 1).all()) and float(wc.min()) < 1
    assert not torch.equal(f.left, init_transforms(x.shape[1])[0])
    # held-out rows of the same distribution gain too (not only the rows fitted on)
    xh = _layer(seed=0, m=512)[0][256:]
    held = _output_mse(xh, w, f.left, f.right, f.clip), _output_mse(xh, w, *init_transforms(x.shape[1]), 1.0)
    assert held[0] < 0.8 * held[1], held


def test_fit_is_the_same_bits_for_a_seed_and_another_for_another_seed():
    x, w = _layer(1, m=64)
    a, b, c = (FQ.fit(x, [w], steps=3, lr=1e-2, seed=s) for s in (3, 3, 4))
    assert torch.equal(a.left, b.left) and torch.equal(a.right, b.right) and a.clip == b.clip
    assert not torch.equal(a.left, c.left)


def test_a_fit_that_does_not_beat_the_start_keeps_it():
    x, w = _layer(2)
    f = FQ.fit(x, [w], steps=1, lr=1.0)   # one huge step: far off
    left, right = init_transforms(x.shape[1])
    assert not f.fitted and torch.equal(f.left, left) and torch.equal(f.right, right) and f.clip == 1.0
    assert f.loss == f.loss_init


def _weight_hashes(dst) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(dst.glob("*.safetensors")))).hexdigest()


@pytest.mark.slow  # three calibrated quantize runs of a tiny Qwen3 (~1.5 s each)
def test_stage_records_the_fit_shares_fused_transforms_and_repeats_for_a_seed(tmp_path):
    from safetensors.torch import load_file

    src = write_bf16_checkpoint(tmp_path / "q", tiny_qwen3_config(moe=False, hidden_size=128, head_dim=32,
                                                                   intermediate_size=256))
    runs = {}
    for tag, seed in (("a", 0), ("b", 0), ("c", 1)):
        dst = tmp_path / tag
        quantize(src, dst, scheme="w4a4_flatquant", fmt="ascend", method="flatquant", calib_tokens=256, quiet=True,
                 fit={"flatquant_steps": 8, "flatquant_seed": seed})
        runs[tag] = _weight_hashes(dst)
    assert runs["a"] == runs["b"] != runs["c"]
    q = json.loads((tmp_path / "a" / "cvt_manifest.json").read_text())["quant"]
    assert q["method"] == "flatquant"
    assert {t["method"] for t in q["tensors"].values()} == {"flatquant"}
    fq = q["calibration"]["flatquant"]
    assert (fq["steps"], fq["lr"], fq["seed"], fq["linears"]) == (8, FQ.LR, 0, len(q["tensors"]))
    assert fq["loss"] < fq["loss_start"]
    t = {}
    for p in sorted((tmp_path / "a").glob("*.safetensors")):
        t.update(load_file(p))
    pre = "model.layers.0."
    for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
        for part in ("left_trans", "right_trans", "clip_ratio"):
            first = t[f"{pre}{group[0]}.{part}"]
            assert all(torch.equal(first, t[f"{pre}{m}.{part}"]) for m in group[1:]), (group, part)
    hadamard, _ = init_transforms(128)
    assert not torch.equal(t[f"{pre}self_attn.q_proj.left_trans"], hadamard)


@pytest.mark.parametrize("args, says", [
    (["--method", "flatquant", "--flatquant-steps", "0"], "Invalid value for '--flatquant-steps'"),
    (["--method", "flatquant", "--flatquant-lr", "nan"], "Invalid value for '--flatquant-lr'"),
    (["--method", "flatquant", "--flatquant-lr", "0"], "Invalid value for '--flatquant-lr'"),
    (["--method", "flatquant", "--flatquant-seed", "-1"], "Invalid value for '--flatquant-seed'"),
    (["--flatquant-steps", "5"], "--flatquant-steps: no module is quantized with --method flatquant"),
], ids=["steps-0", "lr-nan", "lr-0", "seed-negative", "without-the-method"])
def test_bad_values_exit_2_with_one_line(trained_fixture, tmp_path, args, says):
    dst = tmp_path / "out"
    r = run_cvt("quantize", trained_fixture, dst, "--scheme", "w4a4_flatquant", "--format", "ascend", "--quiet", *args)
    lines = r.err.strip().splitlines()
    assert r.rc == 2 and len(lines) == 1 and lines[0].startswith("cvt: error: ") and says in lines[0], r.err
    assert not dst.exists()


def test_method_refuses_other_schemes_with_one_line(trained_fixture, tmp_path):
    r = run_cvt("quantize", trained_fixture, tmp_path / "out", "--scheme", "w4a8", "--method", "flatquant", "--quiet")
    line, = r.err.strip().splitlines()
    assert r.rc == 2 and line.startswith("cvt: error: --method flatquant does not apply to --scheme w4a8"), r.err
    assert "applies to --scheme w4a4_flatquant" in line


@pytest.mark.slow  # a tiny Qwen3's first calibrated layer (~1 s)
def test_fused_shards_with_another_method_are_refused_by_the_driver_too():
    """q / k / v read one input and vLLM fuses them (one left_trans): k_proj with RTN's Hadamard
    transforms while q / v are fitted would write shards the fused layer cannot hold. The stage
    refuses this from its plan (below); a caller of the calibration driver itself, which has no
    plan, gets the same line when the layer is reached (`flatquant_site`)."""
    from cvt.errors import OptionError
    from cvt.quant.methods import calibrate
    from cvt.qtensor.schemes import get_scheme
    from cvt.runtime.models import build_model
    from cvt.testing.checkpoints import random_weights

    cfg = tiny_qwen3_config(moe=False, hidden_size=128, head_dim=32, intermediate_size=256)
    model = build_model(cfg, dtype=torch.float32)
    model.load_state_dict(random_weights(cfg, 0), strict=False)
    scheme = get_scheme("w4a4_flatquant")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(OptionError, match=r"^model\.layers\.0\.self_attn\.k_proj reads the same input as "
                                          r"model\.layers\.0\.self_attn\.q_proj and is w4a4_flatquant too, but "
                                          r"--method rtn: vLLM fuses them"):
        calibrate(model, tokens, lambda n: None if n.endswith("lm_head") else scheme,
                  lambda n: "rtn" if n.endswith("k_proj") else "flatquant", flatquant_steps=2, min_tokens=1)


@pytest.mark.parametrize("parent, flat, other", [("self_attn", "q_a_proj", "kv_a_proj_with_mqa"),
                                                  ("mlp", "up_proj", "gate_proj")],   # the dense MLP's (layer 0)
                         ids=["q_a-kv_a", "gate-up"])
def test_fused_linears_with_another_method_are_refused_from_the_plan(fp8_release, tmp_path, monkeypatch, parent, flat,
                                                                     other):
    """The same refusal from the plan, through the CLI: before DST (not even its calibration
    folder) and before any calibration starts. DeepSeek-V3's q_a / kv_a (vLLM's fused_qkv_a_proj)
    and gate / up read one input (the table's `calib_shared_inputs`)."""
    from cvt.quant.stage import run as stage_run

    started = []

    def spy(fn):
        real = getattr(stage_run, fn)
        return lambda *a, **k: (started.append(fn), real(*a, **k))[1]

    for fn in ("calib_data", "calibrate"):  # nothing may calibrate (tokenize, or run a layer) before the refusal
        monkeypatch.setattr(stage_run, fn, spy(fn))
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"rules": [
        {"pattern": rf"\.{parent}\.{flat}$", "scheme": "w4a4_flatquant", "method": "flatquant"},
        {"pattern": rf"\.{parent}\.{other}$", "scheme": "w4a4_flatquant", "method": "rtn"}]}))
    dst = tmp_path / "out"
    r = run_cvt("quantize", fp8_release, dst, "--scheme", "w4a4_flatquant", "--format", "ascend", "--recipe", recipe)
    line, = r.err.strip().splitlines()
    assert r.rc == 2 and line == (
        f"cvt: error: model.layers.0.{parent}.{other} reads the same input as model.layers.0.{parent}.{flat} and "
        "is w4a4_flatquant too, but --method rtn: vLLM fuses them into one layer with one set of transforms, so "
        "give them the same method"), r.err
    assert not dst.exists() and started == [], (sorted(p.name for p in dst.rglob("*")), started)


def test_weight_clip_scales_the_rows_and_bad_clips_are_refused():
    from cvt.errors import CvtError

    x, w = _layer(3, m=8)
    left, right = init_transforms(w.shape[1])
    clip = torch.full((w.shape[0], 1), 0.5)
    full, half = (W4A4FlatQuant().quantize_with(w, left, right, 1.0, weight_clip=c) for c in (None, clip))
    # the scale is bf16(amax * c / 7): half the rows' range, so the codes reach the clamp
    ratio = half.parts["weight_scale"] / full.parts["weight_scale"]
    assert bool(((ratio - 0.5).abs() <= 2 ** -8).all()) and int(half.parts["weight_int4"].abs().max()) >= 8
    for bad in (torch.zeros(w.shape[0], 1), torch.full((w.shape[0], 1), 1.5), torch.ones(3, 1)):
        with pytest.raises(CvtError, match="weight_clip"):
            W4A4FlatQuant().quantize_with(w, left, right, 1.0, weight_clip=bad)
