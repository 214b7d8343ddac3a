"""cvt.runtime.models.gpt_oss against transformers (the referee): tiny gpt-oss models built from
transformers' own GptOssConfig, random weights, CPU fp32, eager attention (transformers' reference).

30 positions over a sliding window of 5: the sliding layers' mask and the sinks matter; cached
decode (prefill, continuation, one token at a time) gives transformers' logits on its own cache;
greedy decode equals generate; the MXFP4 release loads (experts dequantized as transformers does)
and runs, and `cvt run` runs it.
"""

from __future__ import annotations

import pytest
import torch

from cvt.runtime.loader import load_model
from cvt.runtime.models import build_model
from cvt.runtime.models.base import ConfigError
from cvt.runtime.models.gpt_oss import Args
from cvt.testing.checkpoints import write_release
from cvt.testing.checkpoints_gpt_oss import mxfp4_release_tensors, tiny_gpt_oss_config
from cvt.tests.conftest import run_cvt

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 96, 30


def hf_model(cfg: dict):
    """transformers' GptOssForCausalLM of `cfg` (eager attention), random weights of useful size."""
    conf = transformers.GptOssConfig(**{k: v for k, v in cfg.items()
                                        if k not in ("architectures", "model_type", "quantization_config")})
    conf._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(conf).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else (0.5 if "embed" in n else 0.2) * torch.randn_like(p))
    return model


def pair(**overrides):
    cfg = tiny_gpt_oss_config(**overrides)
    ref = hf_model(cfg)
    ours = build_model(cfg, dtype=torch.float32)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def tokens(b=2, s=SEQ, seed=1):
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


def assert_logits_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Within 1e-5 of the reference, relative to its largest logit (the runtime tests' convention)."""
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got, ref.float(), rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("types", [("sliding_attention", "full_attention") * 2, ("full_attention",) * 4,
                                   ("sliding_attention",) * 4], ids=["alternating", "full", "sliding"])
def test_logits_match_transformers(types):
    ref, ours = pair(layer_types=list(types))
    x = tokens()
    with torch.no_grad():
        expected = ref(input_ids=x).logits.float()
    got = ours(x)
    assert got.shape == (2, SEQ, VOCAB) and expected.abs().max() > 1
    assert_logits_close(got, expected)


def test_the_window_and_the_sinks_matter():
    """The referee's agreement is not vacuous: without the window, or without the sinks, the logits differ."""
    ref, ours = pair()
    x = tokens()
    with torch.no_grad():
        expected = ref(input_ids=x).logits.float()
    for layer in ours.model.layers:
        layer.self_attn.window = None
    assert not torch.allclose(ours(x), expected, rtol=1e-3, atol=1e-3 * expected.abs().max().item())
    _, ours = pair()
    for layer in ours.model.layers:
        layer.self_attn.sinks.zero_()
    assert not torch.allclose(ours(x), expected, rtol=1e-3, atol=1e-3 * expected.abs().max().item())


def run_schedule(x, cuts, call):
    """Logits of x fed as x[:, :cuts[0]], x[:, cuts[0]:cuts[1]], ..., then one token at a time."""
    out, start = [], 0
    for end in [*cuts, *range(cuts[-1] + 1, x.shape[1] + 1)]:
        out.append(call(x[:, start:end], start))
        start = end
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("cuts", [(12,), (3, 12)], ids=["prefill-decode", "prefill-continue-decode"])
def test_cached_decode_matches_transformers(cuts):
    ref, ours = pair()
    x = tokens()
    cache = ours.new_cache(2, 40)
    got = run_schedule(x, cuts, lambda t, p: ours(t, p, cache))
    hf_cache = transformers.DynamicCache(config=ref.config)
    with torch.no_grad():
        want = run_schedule(x, cuts, lambda t, p: ref(input_ids=t, cache=hf_cache, use_cache=True).logits)
    assert_logits_close(got, want)
    assert_logits_close(got, ours(x))      # and the full forward of the same positions


def test_greedy_decode_equals_transformers_generate():
    ref, ours = pair()
    prompt = tokens(1, 9, seed=4)
    with torch.no_grad():
        want = ref.generate(input_ids=prompt, max_new_tokens=10, do_sample=False, min_new_tokens=10)[0, 9:].tolist()
    cache = ours.new_cache(1, 32)
    logits, got, t = ours(prompt, 0, cache), [], 9
    for _ in range(10):
        nxt = int(logits[0, -1].argmax())
        got.append(nxt)
        logits = ours(torch.tensor([[nxt]]), t, cache)
        t += 1
    assert got == want


def test_config_is_read_strictly():
    cfg = tiny_gpt_oss_config()
    with pytest.raises(ConfigError, match="swiglu_flavour"):
        Args.from_config({**cfg, "swiglu_flavour": 1})
    with pytest.raises(ConfigError, match="rope type 'longrope'"):
        Args.from_config({**cfg, "rope_parameters": {"rope_type": "longrope", "factor": 2.0}})
    # the release's own config.json keys (transformers 4.55 names) read
    release = {**cfg, "experts_per_token": 2, "initial_context_length": 32, "rope_theta": 150000,
               "rope_scaling": cfg["rope_parameters"]}
    release.pop("rope_parameters")
    assert Args.from_config(release).rope()["factor"] == 4.0


def test_mxfp4_release_loads_and_runs(tmp_path):
    """The release layout (experts as MXFP4 blocks + scales) loads with its experts dequantized as
    transformers' own conversion does, runs as transformers' model with those weights, and `cvt run` runs it."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg = tiny_gpt_oss_config(mxfp4=True)
    ref = hf_model(cfg)
    release = mxfp4_release_tensors({k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()})
    src = write_release(tmp_path / "go", cfg, release, n_shards=2, move_scale=False)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name + "_blocks" in release:
                p.copy_(convert_moe_packed_tensors(release[name + "_blocks"], release[name + "_scales"]).float())
            else:
                p.copy_(release[name].float())
    loaded = load_model(src, dtype=torch.float32)
    assert loaded.source_format == "gpt-oss-mxfp4"
    x = tokens(1, 16)
    with torch.no_grad():
        want = ref(input_ids=x).logits.float()
    assert_logits_close(loaded.model(x), want)
    r = run_cvt("run", src, "--input-ids", "5,6,7,8", "--max-new-tokens", "3", "--device", "cpu", "--quiet")
    assert r.rc == 0, r.err
