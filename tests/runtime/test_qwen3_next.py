"""cvt.runtime.models.qwen3_next against transformers (the referee): a tiny Qwen3-Next built from
transformers' own Qwen3NextConfig (3 Gated DeltaNet layers with fused in_proj_qkvz / in_proj_ba,
1 gated full-attention layer, layer 1 a dense SwiGLU via mlp_only_layers), random weights, CPU fp32.

Prefill crosses a 64-position chunk of the gated delta rule; cached decode carries the conv and
recurrent states; a checkpoint written by transformers' save_pretrained (the release's names) and
one with the release's MTP draft load by their names and run.
"""

from __future__ import annotations

import pytest
import torch

from cvt.convert.arch import arch_for
from cvt.runtime.loader import load_model
from cvt.runtime.models import build_model
from cvt.runtime.models.base import ConfigError
from cvt.runtime.models.gated_deltanet import FusedGatedDeltaNet
from cvt.runtime.models.qwen3_next import Args
from cvt.testing.checkpoints import write_release
from cvt.testing.checkpoints_qwen3_5 import tiny_qwen3_next_config
from cvt.tests.conftest import run_cvt
from cvt.tests.runtime.test_qwen3_5 import assert_logits_close, perturb, release_state, run_schedule, tokens

transformers = pytest.importorskip("transformers")

SEQ = 70


def hf_model(cfg: dict):
    """transformers' Qwen3NextForCausalLM of `cfg` (Qwen3NextConfig from its keys), weights perturbed."""
    conf = transformers.Qwen3NextConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    torch.manual_seed(0)
    return perturb(transformers.Qwen3NextForCausalLM(conf).eval())


def pair(**overrides):
    cfg = tiny_qwen3_next_config(**overrides)
    ref = hf_model(cfg)
    ours = build_model(cfg, dtype=torch.float32)
    ours.load_state_dict(release_state(ref), strict=True)
    return ref, ours


def test_logits_match_transformers():
    ref, ours = pair()
    assert isinstance(ours.model.layers[0].linear_attn, FusedGatedDeltaNet)
    assert [type(layer.mlp).__name__ for layer in ours.model.layers] == ["MoE", "MLP", "MoE", "MoE"]
    x = tokens()
    with torch.no_grad():
        expected = ref(input_ids=x).logits.float()
    assert expected.abs().max() > 1
    assert_logits_close(ours(x), expected)


@pytest.mark.parametrize("cuts", [(66,), (40, 66)], ids=["prefill-decode", "prefill-continue-decode"])
def test_cached_decode_carries_conv_and_recurrent_state(cuts):
    ref, ours = pair()
    x = tokens()
    cache = ours.new_cache(2, 80)
    assert cache[0].conv.shape == (2, 2 * 2 * 8 + 4 * 12, 3) and cache[0].recurrent.shape == (2, 4, 8, 12)
    got = run_schedule(ours, x, cuts, cache, lambda t, p: ours(t, p, cache))
    hf_cache = transformers.DynamicCache(config=ref.config)
    with torch.no_grad():
        want = run_schedule(ref, x, cuts, hf_cache,
                            lambda t, p: ref(input_ids=t, cache=hf_cache, use_cache=True).logits)
    assert_logits_close(got, want)
    assert cache[0].pos == SEQ


def test_decoder_sparse_step_picks_the_moe_layers():
    """(i + 1) % decoder_sparse_step: layers 1 and 3 MoE, 0 and 2 dense, as transformers builds them."""
    ref, ours = pair(mlp_only_layers=[], decoder_sparse_step=2)
    assert [type(layer.mlp).__name__ for layer in ours.model.layers] == ["MLP", "MoE", "MLP", "MoE"]
    x = tokens(1, 9)
    with torch.no_grad():
        assert_logits_close(ours(x), ref(input_ids=x).logits.float())


def test_config_is_read_strictly():
    cfg = tiny_qwen3_next_config()
    with pytest.raises(ConfigError, match="linear_attn_flavour"):
        Args.from_config({**cfg, "linear_attn_flavour": 1})
    with pytest.raises(ConfigError, match="intermediate_size"):      # layer 1 is dense
        Args.from_config({k: v for k, v in cfg.items() if k != "intermediate_size"})
    assert Args.from_config({k: v for k, v in cfg.items() if k not in ("intermediate_size", "mlp_only_layers")}).moe


@pytest.mark.slow  # ~11 s: save_pretrained, two loads and a `cvt run`
def test_saved_and_release_checkpoints_load_by_their_names_and_run(tmp_path):
    """transformers' save_pretrained writes the release's names (experts one by one); a release
    with its MTP draft (mtp.*) loads with the draft carried, not run."""
    cfg = tiny_qwen3_next_config(mtp_num_hidden_layers=1)
    ref = hf_model(tiny_qwen3_next_config())
    ref.save_pretrained(tmp_path / "saved")
    mtp = {n: torch.randn(s) for n, s in arch_for(cfg).shapes().items() if n.startswith("mtp.")}
    assert "mtp.layers.0.mlp.experts.5.down_proj.weight" in mtp and "mtp.fc.weight" in mtp
    src = write_release(tmp_path / "release", cfg, {**release_state(ref), **mtp}, n_shards=2, move_scale=False)
    x = tokens(1, 12)
    with torch.no_grad():
        want = ref(input_ids=x).logits.float()
    saved = load_model(tmp_path / "saved", dtype=torch.float32)
    assert_logits_close(saved.model(x), want)
    loaded = load_model(src, dtype=torch.float32)
    assert sorted(loaded.skipped) == sorted(mtp)
    assert_logits_close(loaded.model(x), want)
    r = run_cvt("run", src, "--input-ids", "5,6,7,8", "--max-new-tokens", "3", "--device", "cpu", "--quiet")
    assert r.rc == 0, r.err
    assert f"running the text model only (the {len(mtp)} MTP draft tensors are not loaded)" in r.err


def test_a_rank_holds_its_share_of_the_linear_heads_or_refuses():
    """`cvt run --procs N`'s local model: key and value heads / tp (vLLM's split); a tp that does not
    divide them is one line."""
    from cvt.convert.placement import make_layout
    from cvt.errors import CvtError
    from cvt.runtime.models.qwen3_next import Model
    from cvt.runtime.parallel import local_args

    args = Args.from_config(tiny_qwen3_next_config())
    local = local_args(args, make_layout(2, tp=2), Model.parallel)
    assert (local.linear_num_key_heads, local.linear_num_value_heads) == (1, 2)
    with torch.device("meta"):
        gdn = Model(local).model.layers[0].linear_attn
    assert tuple(gdn.in_proj_qkvz.weight.shape) == ((8 + 8 + 2 * 2 * 12), 48) and gdn.A_log.shape == (2,)
    with pytest.raises(CvtError, match="^config.json linear_num_key_heads = 2 does not divide over tp 4$"):
        local_args(Args.from_config(tiny_qwen3_next_config(num_key_value_heads=4)), make_layout(4, tp=4),
                   Model.parallel)
