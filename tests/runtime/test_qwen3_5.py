"""cvt.runtime.models.qwen3_5 against transformers (the referee): tiny Qwen3.5-MoE and Qwen3.5 models
built from transformers' own config classes (Qwen3_5MoeConfig / Qwen3_5Config with their text and
vision configs), random weights, CPU fp32.

Prefill crosses a 64-position chunk of the gated delta rule; cached decode carries the conv and
recurrent states of the linear layers and the KV cache of the full ones; greedy decode equals
transformers' generate; a release-layout checkpoint (vision tower and MTP draft carried) loads by
its names and runs.
"""

from __future__ import annotations

import pytest
import torch

from cvt.errors import CvtError
from cvt.runtime.loader import load_model
from cvt.runtime.models import build_model
from cvt.runtime.models.base import ConfigError
from cvt.runtime.models.gated_deltanet import LinearState, chunked_rule, recurrent_rule
from cvt.runtime.models.qwen3_5 import Args
from cvt.testing.checkpoints import write_release
from cvt.testing.checkpoints_qwen3_5 import tiny_qwen3_5_config
from cvt.tests.conftest import run_cvt

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 96, 70   # 70 positions: one full 64-chunk of the delta rule and a padded one


def hf_model(cfg: dict):
    """transformers' Qwen3_5(Moe)ForConditionalGeneration of `cfg`, random weights of useful size:
    zero-centred norms near 0, the gated norm near 1, decays exp(-A softplus(a + dt)) spread."""
    moe = cfg["model_type"] == "qwen3_5_moe"
    conf = (transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config)(
        text_config=cfg["text_config"], vision_config=cfg["vision_config"])
    cls = transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
    torch.manual_seed(0)
    return perturb(cls(conf).eval())


def perturb(model):
    """`model`'s weights, of useful size (Qwen3.5's and Qwen3-Next's parameter names alike)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("A_log"):
                p.copy_((0.5 + 3 * torch.rand_like(p)).log())
            elif n.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif n.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "norm" in n:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_((0.5 if "embed" in n else 0.2) * torch.randn_like(p))
    return model


def release_state(model, visual: bool = False) -> dict[str, torch.Tensor]:
    """The model's tensors under the release's names: fused experts split per expert (the FP8
    release's layout), the vision tower dropped unless asked for."""
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj"):                  # [E, 2I, h]: gate rows, then up rows
            pre = k[: -len("gate_up_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"], out[f"{pre}{e}.up_proj.weight"] = v[e].chunk(2, dim=0)
        elif k.endswith("mlp.experts.down_proj"):                   # [E, h, I]
            pre = k[: -len("down_proj")]
            out.update({f"{pre}{e}.down_proj.weight": v[e] for e in range(v.shape[0])})
        elif visual or not k.startswith("model.visual."):
            out[k] = v
    return out


def pair(moe: bool):
    cfg = tiny_qwen3_5_config(moe=moe)
    ref = hf_model(cfg)
    ours = build_model(cfg, dtype=torch.float32)
    ours.load_state_dict(release_state(ref), strict=True)
    return ref, ours


def tokens(b=2, s=SEQ, seed=1):
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_logits_match_transformers(moe):
    ref, ours = pair(moe)
    x = tokens()
    with torch.no_grad():
        expected = ref(input_ids=x).logits.float()
    got = ours(x)
    assert got.shape == (2, SEQ, VOCAB) and expected.abs().max() > 1
    assert_logits_close(got, expected)


def assert_logits_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Within 1e-5 of the reference, relative to its largest logit (the runtime tests' convention)."""
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got, ref.float(), rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def run_schedule(model, x, cuts, cache, call):
    """Logits of x fed as x[:, :cuts[0]], x[:, cuts[0]:cuts[1]], ..., then one token at a time."""
    out, start = [], 0
    for end in [*cuts, *range(cuts[-1] + 1, x.shape[1] + 1)]:
        out.append(call(x[:, start:end], start))
        start = end
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
@pytest.mark.parametrize("cuts", [(66,), (40, 66)], ids=["prefill-decode", "prefill-continue-decode"])
def test_cached_decode_carries_conv_and_recurrent_state(moe, cuts):
    """A cached run (prefill; a continuation from the state, chunked form; then one token at a time,
    recurrent form) gives transformers' logits for the same calls on its own cache."""
    ref, ours = pair(moe)
    x = tokens()
    cache = ours.new_cache(2, 80)
    assert [type(c).__name__ for c in cache] == ["LinearState"] * 3 + ["KVCache"]
    lin = cache[0]
    assert lin.conv.shape == (2, 2 * 2 * 8 + 4 * 12, 3) and lin.recurrent.shape == (2, 4, 8, 12)
    got = run_schedule(ours, x, cuts, cache, lambda t, p: ours(t, p, cache))
    hf_cache = transformers.DynamicCache(config=ref.config.text_config)
    with torch.no_grad():
        want = run_schedule(ref, x, cuts, hf_cache, lambda t, p: ref(input_ids=t, cache=hf_cache, use_cache=True).logits)
    assert_logits_close(got, want)
    if cuts == (66,):
        assert_logits_close(got, ours(x))      # and the full forward of the same positions
    assert lin.pos == SEQ
    with pytest.raises(CvtError, match="cannot skip or repeat"):
        ours(x[:, :1], 5, cache)


def test_greedy_decode_equals_transformers_generate():
    ref, ours = pair(True)
    prompt = tokens(1, 9, seed=4)
    with torch.no_grad():
        want = ref.generate(input_ids=prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, 9:].tolist()
    cache = ours.new_cache(1, 32)
    logits, got, t = ours(prompt, 0, cache), [], 9
    for _ in range(8):
        nxt = int(logits[0, -1].argmax())
        got.append(nxt)
        logits = ours(torch.tensor([[nxt]]), t, cache)
        t += 1
    assert got == want


def test_chunked_and_recurrent_rules_agree():
    g = torch.Generator().manual_seed(2)
    b, h, s, dk, dv = 1, 2, 75, 8, 6
    q, k = (torch.nn.functional.normalize(torch.randn(b, h, s, dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(b, h, s, dv, generator=g)
    decay, beta = -torch.rand(b, h, s, generator=g), torch.rand(b, h, s, generator=g)
    state = torch.randn(b, h, dk, dv, generator=g)
    o1, s1 = recurrent_rule(q, k, v, decay, beta, state)
    o2, s2 = chunked_rule(q, k, v, decay, beta, state)
    torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s2, s1, rtol=1e-5, atol=1e-5)


def test_config_is_read_strictly():
    text = tiny_qwen3_5_config()["text_config"]
    with pytest.raises(ConfigError, match="linear_attn_flavour"):
        Args.from_config({**text, "linear_attn_flavour": 1})
    with pytest.raises(ConfigError, match="attn_output_gate"):
        Args.from_config({**text, "attn_output_gate": False})
    with pytest.raises(ConfigError, match="rope"):
        Args.from_config({**text, "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}})
    assert Args.from_config({**text, "mtp_num_hidden_layers": 1, "dtype": "bfloat16"}).num_hidden_layers == 4
    assert LinearState(1, 4, 4, 2, 2, 2).nbytes == 4 * 3 * 4 + 2 * 2 * 2 * 4


def test_release_checkpoint_loads_by_its_names_and_runs(tmp_path):
    cfg = tiny_qwen3_5_config(mtp=1)
    ref = hf_model(tiny_qwen3_5_config())
    tensors = release_state(ref, visual=True)
    mtp = {n: torch.randn(s) for n, s in __import__("cvt.convert.arch", fromlist=["arch_for"]).arch_for(cfg)
           .shapes().items() if n.startswith("mtp.")}
    src = write_release(tmp_path / "q35", cfg, {**tensors, **mtp}, n_shards=3, move_scale=False)
    loaded = load_model(src, dtype=torch.float32)
    carried = sorted(n for n in {**tensors, **mtp} if n.startswith(("model.visual.", "mtp.")))
    assert sorted(loaded.skipped) == carried and any(n.startswith("mtp.") for n in carried)
    x = tokens(1, 12)
    with torch.no_grad():
        want = ref(input_ids=x).logits.float()
    assert_logits_close(loaded.model(x), want)
    r = run_cvt("run", src, "--input-ids", "5,6,7,8", "--max-new-tokens", "3", "--device", "cpu", "--quiet")
    assert r.rc == 0, r.err


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["ascend", "compressed-tensors"])
def test_rtn_w8a8_quantize_and_run(tmp_path, fmt):
    """`cvt quantize --scheme w8a8` (RTN) keeps the Gated DeltaNet's small parts, the router and the
    shared-expert gate float, quantizes the big linears, and `cvt run` runs its output."""
    import json

    from cvt.testing.checkpoints import write_bf16_checkpoint

    src = write_bf16_checkpoint(tmp_path / "src", tiny_qwen3_5_config(mtp=1))
    dst = tmp_path / "w8"
    r = run_cvt("quantize", src, dst, "--scheme", "w8a8", "--format", fmt, "--quiet")
    assert r.rc == 0, r.err
    if fmt == "ascend":
        tags = json.loads((dst / "quant_model_description.json").read_text())
        p = "model.language_model.layers.0."
        assert {k: tags[p + k] for k in ("linear_attn.in_proj_b.weight", "linear_attn.conv1d.weight",
                                         "linear_attn.A_log", "mlp.shared_expert_gate.weight", "mlp.gate.weight")} \
            == dict.fromkeys(("linear_attn.in_proj_b.weight", "linear_attn.conv1d.weight", "linear_attn.A_log",
                              "mlp.shared_expert_gate.weight", "mlp.gate.weight"), "FLOAT")
        assert tags[p + "linear_attn.in_proj_qkv.weight"] == tags[p + "mlp.experts.1.up_proj.weight"] == "W8A8_DYNAMIC"
        assert tags["mtp.fc.weight"] == tags["model.visual.blocks.0.attn.qkv.weight"] == "FLOAT"
    r = run_cvt("run", dst, "--input-ids", "5,6,7", "--max-new-tokens", "3", "--device", "cpu", "--quiet")
    assert r.rc == 0, r.err
