"""Calibrated quantization methods (cvt.quant.methods): GPTQ, AWQ, SmoothQuant, the layer-by-layer driver.

Per linear (synthetic data): each method beats RTN on output error, GPTQ's QuantizedTensor
dequantizes exactly to the weights it reports, folds leave the float function unchanged.
Whole model (the trained fixture ../shared/fixtures/tiny-dsv3-trained, read in place): KL vs
the float model on held-out text, RTN vs GPTQ / AWQ (w4a16) and RTN vs SmoothQuant (w8a8 with
injected activation outliers), and MoE experts with too few tokens falling back to RTN.
"""

from __future__ import annotations

import glob
import json
import logging
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import cvt.quant.methods.calib as calib_mod
from cvt.testing.checkpoints import random_weights, tiny_deepseek_config, tiny_qwen3_config
from cvt.errors import CvtError
from cvt.quant.methods import (HessianAccumulator, awq_clip, awq_search, calib_tokens, calibrate, gptq_quantize,
                               run_methods, scale_columns, scale_rows, smooth_scales)
from cvt.quant.methods.awq import AwqScale
from cvt.qtensor.schemes import get_scheme
from cvt.qtensor.schemes.base import QuantizedTensor
from cvt.runtime import kernels
from cvt.qtensor.primitives import per_token_quant
from cvt.runtime.metrics import logit_stats
from cvt.runtime.models import build_model

SCHEMES = {
    "w4a16-g128": ("w4a16", dict(group_size=128)),
    "w4a16-g32": ("w4a16", dict(group_size=32)),
    "w4a16-g128-asym": ("w4a16", dict(group_size=128, symmetric=False)),
    "w8a8": ("w8a8", {}),
    "nvfp4": ("fp4", dict(fp4_format="nvfp4")),
    "mxfp4": ("fp4", dict(fp4_format="mxfp4")),
}


def correlated_linear(n=96, k=256, tokens=2048, seed=0):
    """(x [tokens, k] with correlated channels and a few large ones, w [n, k])."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5
    x = torch.randn(tokens, k, generator=g) @ mix + 0.1 * torch.randn(tokens, k, generator=g)
    x[:, :6] *= 8
    w = torch.randn(n, k, generator=g) * 0.05
    return x, w


def out_err(x, w, w_hat):
    return (x @ (w - w_hat).t()).norm().item()


# ---- GPTQ ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("act_order", [False, True], ids=["natural", "act_order"])
@pytest.mark.parametrize("key", list(SCHEMES))
def test_gptq_beats_rtn_and_dequantizes_exactly(key, act_order):
    name, opts = SCHEMES[key]
    scheme = get_scheme(name, **opts)
    x, w = correlated_linear()
    acc = HessianAccumulator(w.shape[1])
    for chunk in x.split(500):
        acc.add(chunk)
    r = gptq_quantize(w, acc.H, scheme, act_order=act_order)
    rtn = out_err(x, w, scheme.fake_quant(w))
    gptq = out_err(x, w, r.weight)
    assert gptq < 0.8 * rtn, (gptq, rtn)
    # the stored tensor is exactly what GPTQ chose: scheme, runtime kernel and GPTQ's own columns agree
    assert r.exact
    assert torch.equal(scheme.dequantize(r.qtensor), r.weight)
    mod = kernels.get(r.qtensor.kernel_fmt).from_parts(r.qtensor.parts)
    assert torch.equal(mod.dense_weight(), r.weight)
    assert r.static_groups == (act_order or key == "nvfp4")


def test_gptq_act_order_keeps_the_original_groups():
    """With act_order the group scales are those of the original column grouping (static groups)."""
    scheme = get_scheme("w4a16", group_size=32)
    x, w = correlated_linear(k=128)
    H = 2 * x.t() @ x / x.shape[0]
    r = gptq_quantize(w, H, scheme, act_order=True)
    rtn = scheme.quantize(w)
    assert torch.equal(r.qtensor.parts["weight_scale"], rtn.parts["weight_scale"])
    assert r.qtensor.parts["weight_scale"].shape == (w.shape[0], 4)


def test_gptq_dead_columns_and_bad_hessians():
    scheme = get_scheme("w4a16", group_size=32)
    x, w = correlated_linear(k=64)
    x[:, 5] = 0
    H = 2 * x.t() @ x / x.shape[0]
    r = gptq_quantize(w, H, scheme)
    assert r.dead_columns == 1 and torch.all(r.weight[:, 5] == 0)
    with pytest.raises(CvtError, match="does not match"):
        gptq_quantize(w, H[:10, :10], scheme)
    with pytest.raises(CvtError, match="positive definite"):
        gptq_quantize(w, torch.full_like(H, float("nan")), scheme, name="layer.q_proj")


def test_hessian_accumulator_is_the_batch_hessian():
    x = torch.randn(300, 16, dtype=torch.float64)
    acc = HessianAccumulator(16, torch.float64)
    for chunk in x.split(70):
        acc.add(chunk)
    assert acc.n == 300
    torch.testing.assert_close(acc.H, 2 * x.t() @ x / 300)


# ---- AWQ -------------------------------------------------------------------------------------------

def salient_linear(seed=0, n=64, k=256, tokens=1024):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g)
    x[:, [3, 70, 200]] *= 40           # a few large ("salient") input channels
    w = torch.randn(n, k, generator=g) * 0.05
    return x, w


def test_awq_beats_rtn_with_salient_channels():
    scheme = get_scheme("w4a16", group_size=128)
    x, w = salient_linear()
    held, _ = salient_linear(seed=1)
    found = awq_search(x.abs().mean(0), [x[:512]], [w], [scheme])
    assert found.alpha is not None and found.loss < 0.8 * found.loss_rtn
    s = found.scales
    w_awq = scheme.fake_quant(w * s) / s       # (x / s) @ Q(w s)^T == x @ (Q(w s) / s)^T
    assert out_err(held, w, w_awq) < 0.8 * out_err(held, w, scheme.fake_quant(w))
    # the clipping search never does worse than no clipping on its samples
    wc = awq_clip(x[:256] / s, w * s, scheme)
    assert out_err(x[:256] / s, w * s, scheme.fake_quant(wc)) <= out_err(x[:256] / s, w * s, scheme.fake_quant(w * s))


def test_smoothquant_reduces_w8a8_error_and_folds_exactly():
    """Norm weight with 50x channels (activation outliers): W8A8 (per-token int8 activations,
    per-channel int8 weights) error falls with smoothing; the fold keeps the float output."""
    g = torch.Generator().manual_seed(0)
    h, n = 128, 96
    norm = torch.nn.Module()
    norm.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(h, generator=g), requires_grad=False)
    norm.weight.data[[5, 40, 99]] *= 50
    lin = torch.nn.Module()
    lin.weight = torch.nn.Parameter(torch.randn(n, h, generator=g) * 0.05, requires_grad=False)
    x = torch.randn(512, h, generator=g) * norm.weight          # the norm's output
    ref = x @ lin.weight.t()
    scheme = get_scheme("w8a8")

    def w8a8(xx, ww):
        xq, xs = per_token_quant(xx)
        return (xq.float() * xs[:, None]) @ scheme.fake_quant(ww).t()

    err_rtn = (w8a8(x, lin.weight) - ref).norm()
    s = smooth_scales(x.abs().amax(0), [lin.weight], alpha=0.5)
    scale_rows(norm, s)
    scale_columns(lin, s)
    x2 = x / s                                                   # the norm's output after the fold
    torch.testing.assert_close(x2 @ lin.weight.t(), ref, rtol=1e-5, atol=1e-5)
    err_sq = (w8a8(x2, lin.weight) - ref).norm()
    assert err_sq < 0.5 * err_rtn, (err_sq, err_rtn)


# ---- the layer-by-layer driver on random models ----------------------------------------------------

class Identity:
    """A 'scheme' that does not quantize: calibrate's folds must then leave the model unchanged."""

    name, group_size, symmetric = "identity", 0, True

    def check(self, name, shape):
        pass

    def quantize(self, w, name=None):
        return QuantizedTensor("identity", "dense", tuple(w.shape), {"weight": w.float().clone()})

    def dequantize(self, q):
        return q.parts["weight"]

    def fake_quant(self, w):
        return w.float()


def random_model(cfg, seed=0):
    model = build_model(cfg, dtype=torch.float32)
    state = random_weights(cfg, seed)
    model.load_state_dict({k: v for k, v in state.items()}, strict=False)
    model.eval()
    return model


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "qwen3_mha"])
def test_awq_and_smoothquant_folds_leave_the_float_model_unchanged(family, monkeypatch):
    cfg = {"deepseek_v3": tiny_deepseek_config(num_nextn_predict_layers=0),
           "qwen3_moe": tiny_qwen3_config(moe=True),
           "qwen3_mha": tiny_qwen3_config(moe=False, num_key_value_heads=4)}[family]
    model = random_model(cfg)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = model(tokens)
    g = torch.Generator().manual_seed(1)
    monkeypatch.setattr(calib_mod, "awq_search",
                        lambda xm, *a, **k: AwqScale(torch.exp(torch.randn(xm.shape[0], generator=g)), 0.5, 0.0, 0.0))
    # kv_b_proj quantized too, so that the kv_a_layernorm -> kv_b_proj fold is exercised
    res = calibrate(model, tokens, lambda n: None if n.endswith(("lm_head", "mlp.gate")) else Identity(), "awq",
                    awq_clip_search=False, min_tokens=1)
    producers = set(res.smoothing)
    if family == "deepseek_v3":
        assert {"model.layers.1.input_layernorm", "model.layers.1.self_attn.q_a_layernorm",
                "model.layers.1.self_attn.kv_a_layernorm", "model.layers.1.self_attn.kv_b_proj",
                "model.layers.1.post_attention_layernorm", "model.layers.1.mlp.experts.0.up_proj",
                "model.layers.1.mlp.shared_experts.up_proj", "model.layers.0.mlp.up_proj"} <= producers
        assert "model.layers.1.mlp.gate.weight" in res.float_weights   # the router was scaled too
    if family == "qwen3_mha":
        assert "model.layers.0.self_attn.v_proj" in producers
    assert "model.layers.1.post_attention_layernorm.weight" in res.float_weights
    torch.testing.assert_close(model(tokens), ref, rtol=1e-4, atol=1e-4)
    # smoothquant folds too (w8a8-style consumers only fed by norms)
    model = random_model(cfg)
    res = calibrate(model, tokens, lambda n: None if n.endswith(("lm_head", "mlp.gate")) else Identity(),
                    "smoothquant")
    assert "model.layers.0.input_layernorm" in res.smoothing
    torch.testing.assert_close(model(tokens), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_calibrate_chunked_expert_hessians_and_layer_callbacks():
    """Hessians of routed experts collected in several passes give the same GPTQ result."""
    cfg = tiny_deepseek_config(num_nextn_predict_layers=0)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    scheme = get_scheme("w4a16", group_size=64)

    def sf(n):
        return scheme if ".mlp." in n and not n.endswith("lm_head") else None

    a = calibrate(random_model(cfg), tokens, sf, "gptq", min_tokens=1)
    events = []
    b = calibrate(random_model(cfg), tokens, sf, "gptq", min_tokens=1, max_hessian_bytes=1,
                  on_layer_start=lambda i, layer: events.append(("start", i)),
                  on_layer_end=lambda i, layer, r: events.append(("end", i, len(r.quantized))))
    assert events[0] == ("start", 0) and [e for e in events if e[0] == "end"][-1][1] == 2
    assert set(a.quantized) == set(b.quantized)
    for name in a.quantized:
        for part, t in a.quantized[name].parts.items():
            assert torch.equal(t, b.quantized[name].parts[part]), (name, part)
    assert all(m == "gptq" for m in a.methods.values())


def test_calibrate_refuses_bad_input():
    model = random_model(tiny_deepseek_config(num_nextn_predict_layers=0))
    tokens = torch.randint(0, 256, (1, 8))
    with pytest.raises(CvtError, match="unknown calibration method 'foo'"):
        calibrate(model, tokens, lambda n: None, "foo")
    with pytest.raises(CvtError, match="q_b_proj.*group size 96"):
        calibrate(model, tokens, lambda n: get_scheme("w4a16", group_size=96) if n.endswith("q_b_proj") else None)


def test_calib_tokens(tmp_path):
    tok = SimpleNamespace(encode=lambda t: [256] + list(t.encode()))
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "a" * 40}) + "\n\n" + json.dumps({"text": "b" * 40}) + "\n")
    t = calib_tokens(tok, tmp_path / "c.jsonl", seq_len=16)
    assert t.shape == (5, 16) and t[0, 0] == 256
    (tmp_path / "short.txt").write_text("int x;")
    assert calib_tokens(tok, tmp_path / "short.txt", seq_len=64).shape == (1, 7)
    assert calib_tokens(tok, None, seq_len=32, max_sequences=3).shape == (3, 32)   # built-in set
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(CvtError, match="empty"):
        calib_tokens(tok, tmp_path / "empty.txt")
    with pytest.raises(CvtError, match="does not exist"):
        calib_tokens(tok, tmp_path / "missing.txt")


def test_builtin_calibration_set_reaches_the_default_and_short_data_warns(tmp_path, caplog):
    """Without --calib the built-in set gives the --calib-tokens default (32768 = 128 x 256, as
    the stage asks) with a byte-level tokenizer, the one that needs the most text; with a model of
    128 positions, twice as many sequences of 128. Fewer tokens than asked: one warning line."""
    from cvt import corpus

    tok = SimpleNamespace(encode=lambda t: [256] + list(t.encode()))
    with caplog.at_level(logging.WARNING, logger="cvt"):
        t = calib_tokens(tok, None, seq_len=256, max_sequences=128)
        assert t.shape == (128, 256) and t[0, 0] == 256
        assert calib_tokens(tok, None, seq_len=256, max_sequences=128, max_len=128).shape == (256, 128)
        assert caplog.records == []
        want = list(corpus.text("calibration").encode())[:32767]
        assert t.flatten().tolist() == [256] + want  # the set's text, in order, one BOS
        (tmp_path / "short.txt").write_text("x = 1\n" * 100)  # 601 tokens
        assert calib_tokens(tok, tmp_path / "short.txt", seq_len=256, max_sequences=128).shape == (2, 256)
    [rec] = caplog.records
    assert rec.levelno == logging.WARNING and "\n" not in rec.getMessage()
    assert rec.getMessage() == (f"--calib {tmp_path / 'short.txt'} gives 601 calibration tokens, fewer than the "
                                "32768 asked for (--calib-tokens); calibrating on 512")


# ---- the trained fixture ---------------------------------------------------------------------------

def _header_text(letters: str, limit: int) -> str | None:
    files = sorted(f for f in glob.glob("/usr/include/linux/*.h") if Path(f).name[0] in letters)
    text = "".join(Path(f).read_text(errors="replace") for f in files)
    return text[:limit] if len(text) >= limit else None


def _generated_headers(seed: int, limit: int) -> str:
    """C-header-like text (the fixture's training domain) when the system headers are absent."""
    rnd = random.Random(seed)
    words = ["dev", "buf", "len", "flags", "addr", "count", "state", "mode", "id", "size", "cmd", "reg", "irq"]
    types = ["__u8", "__u16", "__u32", "__u64", "__s32", "int", "unsigned int", "char"]
    out = []
    while sum(map(len, out)) < limit:
        name = "_".join(rnd.sample(words, 2))
        out.append(f"#define {name.upper()}_{rnd.randint(0, 99)}\t0x{rnd.randint(0, 4095):x}\n")
        fields = "".join(f"\t{rnd.choice(types)} {rnd.choice(words)}_{rnd.choice(words)};\n"
                         for _ in range(rnd.randint(2, 6)))
        out.append(f"struct {name} {{\n{fields}}};\n\n")
    return "".join(out)[:limit]


@pytest.fixture(scope="module")
def fixture_data(trained_fixture):
    from cvt.runtime.loader import load_model
    from cvt.runtime.tokenizer import load_tokenizer

    loaded = load_model(trained_fixture, dtype=torch.float32)
    tok = load_tokenizer(trained_fixture, loaded.config)
    cal = _header_text("abcdefghijklmnopqrst", 60000) or _generated_headers(0, 60000)
    held = _header_text("uvwxyz", 40000) or _generated_headers(1, 40000)   # the fixture's held-out files
    enc = lambda text, n: torch.tensor(tok.encode(text)[: n * 256]).view(n, 256)   # noqa: E731
    calib, ev = enc(cal, 8), enc(held, 8)
    return SimpleNamespace(calib=calib, ev=ev, ref=loaded.model(ev),
                           load=lambda: load_model(trained_fixture, dtype=torch.float32).model)


def _kl(model, d) -> float:
    logits = model(d.ev)
    v = logits.shape[-1]
    return logit_stats(logits[:, :-1].reshape(-1, v), d.ref[:, :-1].reshape(-1, v), d.ev[:, 1:].reshape(-1))["kl_mean"]


def _swap_in_kernels(model, res):
    """Run the quantized linears through the runtime kernels (W8A8: int8 activations per token)."""
    for name, qt in res.quantized.items():
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, leaf, kernels.get(qt.kernel_fmt).from_parts(qt.parts, getattr(owner, leaf).bias))


def _inject_outliers(model, factor=50.0, n_ch=4, seed=0):
    """Activation outliers the float model does not see: a few channels of every input /
    post-attention norm x factor, the consumers' columns / factor (router included)."""
    g = torch.Generator().manual_seed(seed)
    for i in range(model.args.num_hidden_layers):
        layer = model.model.layers[i]
        for norm, block in (("input_layernorm", layer.self_attn), ("post_attention_layernorm", layer.mlp)):
            ch = torch.randperm(getattr(layer, norm).weight.shape[0], generator=g)[:n_ch]
            getattr(layer, norm).weight.data[ch] *= factor
            for name, mod in block.named_modules():
                leaf = name.rsplit(".", 1)[-1]
                if leaf in ("q_a_proj", "q_proj", "kv_a_proj_with_mqa", "gate_proj", "up_proj", "gate"):
                    mod.weight.data[:, ch] /= factor


W4 = {g: get_scheme("w4a16", group_size=g) for g in (32, 128)}
W8 = get_scheme("w8a8")


def _w4(model):
    mods = dict(model.named_modules())

    def sf(name):
        if name.endswith(("kv_b_proj", "lm_head")):     # float by default (the arch table)
            return None
        return W4[128 if mods[name].weight.shape[1] % 128 == 0 else 32]   # q_b_proj: in 96
    return sf


def _w8(name):
    return None if name.endswith(("kv_b_proj", "lm_head")) else W8


@pytest.mark.slow
def test_fixture_gptq_beats_rtn_w4a16(fixture_data):
    d = fixture_data
    kl = {}
    for method in ("rtn", "gptq", "awq"):
        model = d.load()
        res = calibrate(model, d.calib, _w4(model), method)
        # only routed experts that the (small) calibration batch barely reaches fall back to RTN
        assert all(".mlp.experts." in f.name and f.tokens < 32 for f in res.fallbacks), res.fallbacks
        assert len(res.fallbacks) <= 6 or method == "rtn", res.fallbacks
        kl[method] = _kl(model, d)
    assert kl["gptq"] < 0.8 * kl["rtn"], kl
    # the fixture has no activation outliers (max / median of mean|x| <= ~2 at every norm), so AWQ's
    # scales have little to protect: it must not be worse than RTN beyond the rounding noise
    assert kl["awq"] < 1.15 * kl["rtn"], kl


@pytest.mark.slow
def test_fixture_awq_and_smoothquant_beat_rtn_with_activation_outliers(fixture_data):
    d = fixture_data
    kl = {}
    for scheme, method in (("w4a16", "rtn"), ("w4a16", "awq"), ("w8a8", "rtn"), ("w8a8", "smoothquant")):
        model = d.load()
        _inject_outliers(model)
        if method == "rtn" and scheme == "w4a16":
            assert _kl(model, d) < 1e-9          # the injection leaves the float model unchanged
        res = calibrate(model, d.calib, _w4(model) if scheme == "w4a16" else _w8, method)
        _swap_in_kernels(model, res)
        kl[scheme, method] = _kl(model, d)
    assert kl["w4a16", "awq"] < 0.8 * kl["w4a16", "rtn"], kl
    assert kl["w8a8", "smoothquant"] < 0.5 * kl["w8a8", "rtn"], kl


@pytest.mark.slow
def test_fixture_experts_with_few_tokens_fall_back_to_rtn(fixture_data):
    d = fixture_data
    tokens = d.calib[:2, :48]                     # 96 tokens, 2 of 8 experts each: ~24 per expert
    model = d.load()
    sf = _w4(model)
    plan = SimpleNamespace(schemes={}, methods={})
    for name, mod in model.named_modules():
        if isinstance(mod, kernels.Linear) and sf(name) is not None:
            plan.schemes[name], plan.methods[name] = sf(name), "gptq"
    seen = run_methods(d.load(), tokens, plan, min_tokens=1).calib.stats
    counts = sorted({v["tokens"] for n, v in seen.items() if ".mlp.experts." in n})
    assert len(counts) > 2, counts
    threshold = counts[len(counts) // 2]          # some experts fall under it, some do not
    out = run_methods(model, tokens, plan, min_tokens=threshold)
    res = out.calib
    fell = {f.module for f in out.fallbacks}
    experts = {n for n in plan.schemes if ".mlp.experts." in n}
    assert fell == {n for n, v in res.stats.items() if v["tokens"] < threshold}
    assert fell and fell < experts, (threshold, counts)
    for f in out.fallbacks:
        assert ".mlp.experts." in f.module and f.tokens < threshold and f.method == "gptq"
        assert "min_tokens" in f.reason and res.methods[f.module] == "rtn"
    for name in plan.schemes:
        assert name in out.quantized
        if name not in fell:
            assert res.methods[name] == "gptq" and res.stats[name]["tokens"] >= threshold
    assert out.act_absmax["model.layers.0.self_attn.q_a_proj"] > 0


@pytest.mark.parametrize("scheme", [get_scheme("w4a16", group_size=32), get_scheme("w4a16", group_size=32, symmetric=False),
                                    get_scheme("w8a8"), get_scheme("fp4", fp4_format="mxfp4")],
                         ids=["int4-sym", "int4-asym", "int8", "mxfp4"])
def test_scale_search_never_worse_than_absmax_on_its_metric(scheme):
    """`search_scales` picks, per row and group, the clip ratio with the least diag(H)-weighted
    error; the absmax grid (ratio 1.0) is a candidate, so no group is worse than with it, and with
    only that candidate the result is the scheme's own quantization, part for part."""
    from cvt.quant.methods.gptq import _Grid, _group_loss, search_scales

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=g) * torch.rand(48, 1, generator=g)
    w[:, 5] *= 8                                                    # an outlier column: clipping helps
    x = torch.randn(512, 128, generator=g) * torch.rand(128, generator=g)
    H = 2 * x.T @ x / 512
    rtn = scheme.quantize(w)
    G = 128 if rtn.kernel_fmt == "w8a8_dynamic" else 32
    # the loss of w (unclipped) on each grid, as GPTQ will quantize on it (`_Grid.fake`)
    base = _group_loss(w - _Grid(rtn, 128 // G).fake(w), H, G, "hdiag")
    found = search_scales(w, H, scheme, G, tuple(1 - i / 100 for i in range(21)), "hdiag")
    loss = _group_loss(w - _Grid(found, 128 // G).fake(w), H, G, "hdiag")
    assert (loss <= base).all() and (loss < base).any()
    same = search_scales(w, H, scheme, G, (1.0,), "hdiag")
    assert same.parts.keys() == rtn.parts.keys()
    assert all(torch.equal(same.parts[k], rtn.parts[k]) for k in rtn.parts)


def test_linears_of_one_input_share_the_inverse_hessian_factor(monkeypatch):
    """Gate and up read one input (one Hessian): the O(k^3) inverse-Hessian factor is computed
    for the first and reused by the second (`gptq_quantize(factor=)`, the site's dict in the
    driver), which then quantizes to exactly what computing it again gives."""
    from cvt.qtensor.schemes import get_scheme
    from cvt.quant.methods import gptq as G

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g)
    H = 2 * x.T @ x / 256
    w_gate, w_up = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
    scheme = get_scheme("w4a16", group_size=16)
    calls = []
    real = G._inverse_cholesky
    monkeypatch.setattr(G, "_inverse_cholesky", lambda *a, **k: calls.append(1) or real(*a, **k))
    shared: dict = {}
    for act_order in (False, True):
        shared.clear()
        calls.clear()
        a = G.gptq_quantize(w_gate, H, scheme, act_order=act_order, factor=shared)
        b = G.gptq_quantize(w_up, H, scheme, act_order=act_order, factor=shared)
        assert len(calls) == 1
        alone = G.gptq_quantize(w_up, H, scheme, act_order=act_order)
        assert len(calls) == 2
        for key, t in alone.qtensor.parts.items():
            assert torch.equal(b.qtensor.parts[key], t), key
        assert (b.damp, b.loss) == (alone.damp, alone.loss) and a.damp == b.damp
    G.gptq_quantize(w_up, H, scheme, act_order=False, damp=0.1, factor=shared)  # other settings: computed anew
    assert len(calls) == 3
