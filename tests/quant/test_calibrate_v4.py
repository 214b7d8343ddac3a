"""DeepSeek-V4 through the streaming calibration driver (issue 26, item 4): GPTQ / AWQ /
SmoothQuant on a tiny V4 release built from the real naming (`cvt.testing.checkpoints_v4`).

* the driver runs V4's hyper-connected blocks on their own state: the hc streams
  ``[b, s, hc, d]`` between blocks, the token ids (hash routing) sliced with each mini-batch --
  pinned against the model's own forward;
* the smoothing folds V4 declares (`Block.smooth_groups`) leave the float model's output
  unchanged (a fold that misses a float reader of the normed input does not);
* `cvt quantize --method gptq|awq|smoothquant` end to end: the output loads in `cvt verify`,
  KL vs the BF16 model (``cvt fp8-to-bf16`` of the release) below RTN's at W4A16 for GPTQ / AWQ,
  a run killed after layer 1 resumes to the same bytes; the FP4 experts an MX scheme carries are
  not recalibrated (method "source", the RTN output's bytes); what stays refused is one line.
"""

from __future__ import annotations

import json
import signal

import pytest
import torch

from cvt.convert.arch import TABLES
from cvt.testing.checkpoints_v4 import write_v4_release
from cvt.tests.conftest import run_cvt
from cvt.tests.quant.test_calibrate_stream import snapshot

# Ascend (compressed-tensors is refused for V4: its Format.refused_models): W4A16 for the routed
# experts (vllm-ascend loads it for MoE experts only) and, by a recipe, W8A8 for the attention's
# quantized projections and the shared experts, so that every linear the V4 table allows is calibrated
RECIPE = {"rules": [{"pattern": r"\.attn\.(wq_a|wq_b|wkv)$", "scheme": "w8a8"},
                    {"pattern": r"\.shared_experts\.", "scheme": "w8a8"}]}


@pytest.fixture(scope="module")
def w4(tmp_path_factory) -> tuple:
    recipe = tmp_path_factory.mktemp("v4recipe") / "recipe.json"
    recipe.write_text(json.dumps(RECIPE))
    return ("--scheme", "w4a16", "--format", "ascend", "--recipe", str(recipe), "--calib-tokens", "256", "--quiet")


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return write_v4_release(tmp_path_factory.mktemp("v4cal") / "src")


@pytest.fixture(scope="module")
def model(release):
    """The release in float32 through the runtime loader (FP8 X.scale and FP4 experts dequantized)."""
    from cvt.runtime.loader import load_model

    return load_model(release, dtype=torch.float32).model


def _tokens(n: int = 3, s: int = 40) -> torch.Tensor:
    # every token of the tiny vocabulary's byte range: the hash layers route each by tid2eid
    return torch.randint(0, 256, (n, s), generator=torch.Generator().manual_seed(0))


def test_layer_by_layer_equals_the_models_forward(model):
    """`_layer_args` captures block 0's arguments (hc streams, token ids, positions, ropes); each
    block run on the stored state a mini-batch of one sequence at a time (the token ids sliced
    with it) gives the model's own hidden states (`Model.forward(hidden_states=...)`)."""
    from cvt.quant.methods.calib import _layer_args, _PerSequence, _run_layer

    tokens = _tokens()
    hidden: list[torch.Tensor] = []
    model(tokens, hidden_states=hidden)
    x, args, kwargs = _layer_args(model, tokens)
    a = model.args
    assert x.shape == (3, 40, a.hc_mult, a.hidden_size) and isinstance(args[0], _PerSequence)
    assert torch.equal(args[0].t, tokens)
    one = x
    for i, layer in enumerate(model.layers):
        x = _run_layer(layer, x, args, kwargs, batch_size=8)  # all three sequences at once: the same ops
        assert torch.equal(x.flatten(2), hidden[i + 1]), i
        # one sequence a mini-batch (a different matmul blocking: float32 rounding only)
        one = _run_layer(layer, one, args, kwargs, batch_size=1)
        torch.testing.assert_close(one.flatten(2), hidden[i + 1], rtol=1e-4, atol=1e-4)


def _fold_all(model, groups_of, seed: int = 0) -> None:
    """Fold a random positive s (0.25..4) into every group: producer / s, consumers and extras * s."""
    from cvt.quant.methods.smoothquant import scale_columns, scale_rows

    g = torch.Generator().manual_seed(seed)
    mods = dict(model.named_modules())
    for i, layer in enumerate(model.layers):
        for prod, cons, extras in groups_of(layer, f"layers.{i}"):
            k = mods[cons[0]].weight.shape[1]
            s = torch.exp2(torch.rand(k, generator=g) * 4 - 2)
            scale_rows(mods[prod], s)
            for c in cons + extras:
                scale_columns(mods[c], s)


def test_v4_smoothing_folds_are_exact(model):
    """attn_norm -> wq_a / wkv (+ the compressors' and the indexer's float readers), q_norm ->
    wq_b (+ the indexer's wq_b), ffn_norm -> every expert's and the shared expert's w1 / w3 (+
    the router): the smoothed float model's logits equal the unsmoothed ones; dropping the float
    extras (the compressors, indexer and router also read the normed input) breaks that, so the
    equality is not vacuous."""
    import copy

    from cvt.quant.methods.sites import _smooth_groups

    tokens = _tokens(2, 40)  # past the sliding window (8) and 2x the CSA rate
    want = model(tokens)
    v4 = TABLES["deepseek_v4"]
    groups = _smooth_groups(model.layers[1], "layers.1", v4)  # a CSA layer (ratio 4: compressor + indexer)
    assert [(g.producer, g.consumers[:2], g.extras) for g in groups] == [
        ("layers.1.attn_norm", ["layers.1.attn.wq_a", "layers.1.attn.wkv"],
         ["layers.1.attn.compressor.wkv", "layers.1.attn.compressor.wgate", "layers.1.attn.indexer.weights_proj",
          "layers.1.attn.indexer.compressor.wkv", "layers.1.attn.indexer.compressor.wgate"]),
        ("layers.1.attn.q_norm", ["layers.1.attn.wq_b"], ["layers.1.attn.indexer.wq_b"]),
        ("layers.1.ffn_norm", ["layers.1.ffn.experts.0.w1", "layers.1.ffn.experts.0.w3"], ["layers.1.ffn.gate"])]
    assert len(groups[2].consumers) == 2 * (model.args.n_routed_experts + 1)

    smoothed = copy.deepcopy(model)
    _fold_all(smoothed, lambda layer, p: [(g.producer, g.consumers, g.extras) for g in _smooth_groups(layer, p, v4)])
    got = smoothed(tokens)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    broken = copy.deepcopy(model)
    _fold_all(broken, lambda layer, p: [(g.producer, g.consumers, []) for g in _smooth_groups(layer, p, v4)])
    assert (broken(tokens) - want).abs().max() > 1e-2


@pytest.fixture(scope="module")
def outputs(release, w4, tmp_path_factory):
    """The BF16 reference and the release quantized to W4A16 (group 128) by RTN, GPTQ and AWQ."""
    from cvt.convert.fp8_to_bf16 import fp8_to_bf16

    root = tmp_path_factory.mktemp("v4q")
    out = {"bf16": fp8_to_bf16(release, root / "bf16", quiet=True).dst}
    for method in ("rtn", "gptq", "awq"):
        r = run_cvt("quantize", release, root / method, *w4, "--method", method)
        assert r.rc == 0, r.err
        out[method] = root / method
    return out


def _kl(candidate, reference, tmp) -> float:
    from cvt.runtime.verify import verify

    return verify(candidate, reference, tmp / f"report-{candidate.name}", seq_len=64, max_sequences=4).report.logits.kl_mean


@pytest.mark.slow
def test_gptq_and_awq_on_v4_load_and_beat_rtn(outputs, tmp_path):
    """Every linear the scheme quantizes in the decoder layers is calibrated (MTP: RTN, reported
    as a fallback); the outputs load in `cvt verify`; KL vs BF16 below RTN's (measured: RTN 0.147,
    GPTQ 0.089, AWQ 0.136 on this release)."""
    kl = {m: _kl(outputs[m], outputs["bf16"], tmp_path) for m in ("rtn", "gptq", "awq")}
    assert kl["gptq"] < kl["rtn"] and kl["awq"] < kl["rtn"], kl
    for method in ("gptq", "awq"):
        q = json.loads((outputs[method] / "cvt_manifest.json").read_text())["quant"]
        methods = {m: t["method"] for m, t in q["tensors"].items()}
        # RTN instead: the MTP layer (outside the decoder layers the calibration runs) and routed
        # experts the hash / score routing gave fewer than min_tokens (32) of the 256 tokens
        few = {f["module"] for f in q["fallbacks"] if f["tokens"] is not None and f["tokens"] < 32}
        assert {m for m, v in methods.items() if v == "rtn-fallback"} == {m for m in methods if m.startswith("mtp.")} | few
        assert all(".ffn.experts." in m for m in few) and len(few) <= 6, few
        # the attention's quantized projections, the shared experts and the other routed experts
        calibrated = {m for m, v in methods.items() if v == method}
        assert {f"layers.{i}.attn.{p}" for i in range(4) for p in ("wq_a", "wq_b", "wkv")} <= calibrated
        assert {f"layers.{i}.ffn.shared_experts.w{j}" for i in range(4) for j in (1, 2, 3)} <= calibrated
        assert sum(".ffn.experts." in m for m in calibrated) + len(few) == 4 * 4 * 3
        assert not [m for m in methods if m.endswith(("wo_a", "wo_b")) or ".compressor." in m or ".indexer." in m]
        assert q["calibration"]["layers"] == 4 and q["calibration"]["tokens"] == 256


@pytest.mark.slow
def test_v4_awq_killed_after_layer_1_resumes_byte_identically(release, outputs, w4, tmp_path):
    """AWQ (its state holds quantized linears and the folded float tensors: norms, the float
    readers of attn_norm's output, the router): a run killed after layer 1 resumes from the
    stored hc streams and writes the uninterrupted run's bytes."""
    dst = tmp_path / "k"
    argv = ("quantize", release, dst, *w4, "--method", "awq")
    killed = run_cvt(*argv, env={"CVT_TEST_KILL_AFTER_LAYER": "1"})
    assert killed.rc == -signal.SIGKILL
    assert json.loads((dst / ".cvt-calib" / "state.json").read_text())["done"] == 2
    # layer 2's input is the hc streams [b, s, hc, d] float32: 1 sequence of 256 tokens
    cfg = json.loads((release / "config.json").read_text())
    assert (dst / ".cvt-calib" / "x-2.bin").stat().st_size == 4 * 256 * cfg["hc_mult"] * cfg["hidden_size"]
    again = run_cvt(*argv)  # the same command
    assert again.rc == 0, again.err
    assert json.loads((dst / "cvt_manifest.json").read_text())["quant"]["calibration"]["resumed_layers"] == 2
    assert snapshot(dst) == snapshot(outputs["awq"])


@pytest.mark.slow
def test_v4_gptq_on_two_ranks(release, outputs, w4, tmp_path):
    """`--procs 2` (gloo, CPU ranks; one calibration sequence each): the ranks combine the
    statistics of V4's sites and the output loads, better than RTN (measured KL 0.078, RTN 0.147)."""
    dst = tmp_path / "w2"
    r = run_cvt("quantize", release, dst, *w4[:-3], "--calib-tokens", "512", "--procs", "2", "--method", "gptq",
                "-q", subprocess_=True)
    assert r.rc == 0, r.err
    cal = json.loads((dst / "cvt_manifest.json").read_text())["quant"]["calibration"]
    assert cal["ranks"] == 2 and cal["tokens"] == 512
    assert _kl(dst, outputs["bf16"], tmp_path) < _kl(outputs["rtn"], outputs["bf16"], tmp_path)


@pytest.mark.slow
def test_v4_smoothquant_w8a8_runs_and_folds_the_norms(release, outputs, tmp_path):
    """SmoothQuant at W8A8: the folded norms are written (attn_norm, q_norm, ffn_norm of each
    layer), the output loads. Random weights have no activation outliers for SmoothQuant to move,
    so it is not expected to gain here: the check is that its folds and the smaller weights' grid
    do not wreck the model -- KL within 1.5x RTN's (measured 1.29x at 256 tokens, 1.10x at 512);
    that the folds themselves are exact is `test_v4_smoothing_folds_are_exact`."""
    rtn, sq = tmp_path / "rtn", tmp_path / "sq"
    for dst, method in ((rtn, "rtn"), (sq, "smoothquant")):
        r = run_cvt("quantize", release, dst, "--scheme", "w8a8", "--format", "ascend", "--calib-tokens", "256",
                    "--method", method, "--quiet")
        assert r.rc == 0, r.err
    from cvt.tests.convert.test_shard import read_all

    a, b = read_all(rtn), read_all(sq)
    changed = sorted(n for n in a if n.endswith("norm.weight") and not torch.equal(a[n], b[n]))
    assert changed == sorted(f"layers.{i}.{n}.weight" for i in range(4) for n in ("attn_norm", "attn.q_norm", "ffn_norm"))
    assert torch.equal(a["layers.0.attn.kv_norm.weight"], b["layers.0.attn.kv_norm.weight"])  # nothing to fold into
    kl_rtn, kl_sq = _kl(rtn, outputs["bf16"], tmp_path), _kl(sq, outputs["bf16"], tmp_path)
    assert kl_sq <= 1.5 * kl_rtn, (kl_sq, kl_rtn)


@pytest.mark.slow
def test_carried_fp4_experts_are_not_recalibrated(release, tmp_path):
    """W4A8_MXFP carries the release's FP4 experts (method "source"); with --method gptq they stay
    the release's bytes: the output equals the RTN run's, file for file."""
    outs = {}
    for method in ("rtn", "gptq"):
        dst = tmp_path / method
        r = run_cvt("quantize", release, dst, "--scheme", "w4a8_mxfp", "--format", "ascend", "--calib-tokens", "256",
                    "--method", method, "--quiet")
        assert r.rc == 0, r.err
        outs[method] = {p.name: p.read_bytes() for p in sorted(dst.glob("*.safetensors"))}
        q = json.loads((dst / "cvt_manifest.json").read_text())["quant"]
        assert {t["method"] for t in q["tensors"].values()} == {"source"}
    assert outs["gptq"] == outs["rtn"]


_NO_KV = ("quantizes the KV cache, and cvt has no KV-cache quantization for DeepSeek-V4 (its cache is not "
          "calibrated); give a scheme without a KV cache")


@pytest.mark.parametrize("scheme,extra,what", [
    ("w8a8", ["--static-attention"], "--static-attention is not calibrated for this model family "
                                     "(--method gptq / awq / smoothquant are)"),
    ("w8a8c8", [], f"--scheme w8a8c8 {_NO_KV}"),
    # issue 37: not vllm-ascend's GQA C8 cache (V4 has no kv_lora_rank), but V4's own lack of one
    ("w8a8c8", ["--kv-dtype", "fp8"], f"--scheme w8a8c8 --kv-dtype fp8 {_NO_KV}")])
def test_kv_and_static_attention_stay_refused_for_v4_before_writing(release, tmp_path, scheme, extra, what):
    r = run_cvt("quantize", release, tmp_path / "q", "--scheme", scheme, "--format", "ascend", "--method", "gptq",
                *extra)
    errors = [line for line in r.err.splitlines() if line.startswith("cvt: error:")]
    assert r.rc == 2 and errors == [f"cvt: error: deepseek_v4: {what}"], r.err
    assert "requantized" not in r.err  # the FP4 experts' note is for a run that writes, after every refusal
    assert not (tmp_path / "q").exists()


def test_the_release_loads_as_its_bf16_copy(release, model, tmp_path):
    """The runtime loader reads the release itself (FP8 with X.scale, FP4 experts): weight for
    weight what it reads from `cvt fp8-to-bf16`'s output (the bit-exact official dequant)."""
    from cvt.convert.fp8_to_bf16 import fp8_to_bf16
    from cvt.runtime.loader import load_model

    bf16 = dict(load_model(fp8_to_bf16(release, tmp_path / "bf16", quiet=True).dst, dtype=torch.float32)
                .model.state_dict())
    got = model.state_dict()
    assert sorted(got) == sorted(bf16)
    for n, t in got.items():
        assert torch.equal(t, bf16[n]), n


@pytest.mark.slow  # four calibrated runs
@pytest.mark.parametrize("scheme", ["w8a8", "w4a8_mxfp"])  # w4a8_mxfp: the FP4 experts carried, frozen
def test_blocks_stream_their_experts_a_chunk_at_a_time_with_the_same_bytes(release, tmp_path, scheme, monkeypatch):
    """A V4 block whose routed experts pass --expert-memory is calibrated a chunk of experts at a
    time, as the HF layout's layers are (issue 38: V4-Flash's ~26 GiB a block was a refusal): the
    output is byte-identical to calibrating each block whole (each expert sees the same tokens,
    the routed sum continues in expert order, the block's hyper-connection arithmetic runs once
    on that sum)."""
    from cvt.quant.methods import expert_stream
    from cvt.quant.stage import quantize
    from cvt.tests.quant.test_calibrate_stream import snapshot

    chunks: list[tuple[str, int]] = []
    real = expert_stream.ExpertStream._chunks_then_output
    monkeypatch.setattr(expert_stream.ExpertStream, "_chunks_then_output",
                        lambda self, *a, **k: chunks.append((self.prefix, len(self.chunks))) or real(self, *a, **k))
    kw = dict(scheme=scheme, fmt="ascend", method="gptq", calib_tokens=256, quiet=True)
    quantize(release, tmp_path / "whole", **kw)
    assert chunks == []
    quantize(release, tmp_path / "chunks", expert_memory=40_000, **kw)  # about one expert in float32
    assert [n for _, n in chunks] == [4] * 4 and chunks[0][0] == "layers.0", chunks
    assert snapshot(tmp_path / "chunks") == snapshot(tmp_path / "whole")


def test_the_resume_identity_includes_the_carried_experts():
    """Experts carried from the source (frozen) block the ffn_norm fold, so a run with them and one
    without can plan the same schemes yet store different layers: their identities differ (and a
    run without any is identified as before)."""
    from types import SimpleNamespace

    from cvt.quant.methods.stream import stream_plan_id

    plan = SimpleNamespace(schemes={}, methods={})
    args = (None, plan, torch.zeros(1, 4, dtype=torch.int64), "cpu", {}, {"files": []})
    assert stream_plan_id(*args) == stream_plan_id(*args, frozenset())
    assert stream_plan_id(*args) != stream_plan_id(*args, frozenset({"layers.0.ffn.experts.0.w1"}))


def test_smoothing_groups_name_the_experts_a_block_holds():
    """A block built with some routed experts (a rank's: global ids) folds into those, by id."""
    from cvt.testing.checkpoints_v4 import tiny_deepseek_v4_config
    from cvt.runtime.models.deepseek_v4 import Args, Block

    args = Args.from_config(tiny_deepseek_v4_config())
    with torch.device("meta"):
        block = Block(args, 2, 0, experts=[1, 3])
    ffn = [g for g in block.smooth_groups("layers.2") if g[0] == "layers.2.ffn_norm"][0]
    assert ffn[1] == [f"layers.2.ffn.{m}.{w}" for m in ("experts.1", "experts.3", "shared_experts") for w in ("w1", "w3")]


def test_a_refused_destination_prints_its_error_alone(release, tmp_path):
    """The FP4 experts' requantize note is printed once the output is written: a DST cvt may not
    write into (a foreign file in it) gets its one error line and nothing else."""
    dst = tmp_path / "q"
    dst.mkdir()
    (dst / "mine.txt").write_text("keep")
    r = run_cvt("quantize", release, dst, "--scheme", "w8a8", "--format", "ascend")
    assert r.rc != 0 and r.err.count("\n") == 1 and r.err.startswith("cvt: error:"), r.err
    assert (dst / "mine.txt").read_text() == "keep"
