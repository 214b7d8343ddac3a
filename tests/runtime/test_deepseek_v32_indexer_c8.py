"""DeepSeek-V3.2's indexer C8 in cvt's runtime and through quantize -> load -> run -> verify.

Semantics pinned to vllm-ascend main (see tests/qtensor/test_indexer_c8.py for the file + function
citations): rotate q and key by the same Hadamard after RoPE, quantize each row to int8 with a
dynamic scale (amax / 127, kept float16), cache int8 keys + scales, score
relu(scale_q * scale_k * q_int8 . k_int8) per head (npu_lightning_indexer_quant's formula).

Measured on the tiny V3.2 (index_head_dim 32, 16 indexer heads, index_topk 8, 64-token prompts):
top-k overlap of the C8 indexer with the float indexer on the same inputs, per layer, over the
queries that see more than index_topk keys (the acceptance bound is 0.95).
"""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")

from cvt.convert.fp8_to_bf16 import fp8_to_bf16  # noqa: E402
from cvt.testing.checkpoints import random_weights, tiny_deepseek_v32_config, write_fp8_release  # noqa: E402
from cvt.errors import CvtError  # noqa: E402
from cvt.quant.stage import quantize  # noqa: E402
from cvt.qtensor import indexer_c8  # noqa: E402
from cvt.qtensor.layouts import ASCEND  # noqa: E402
from cvt.runtime.loader import load_model  # noqa: E402
from cvt.runtime.models.deepseek_v32 import Args, Indexer, Model  # noqa: E402
from cvt.tests.conftest import run_cvt  # noqa: E402
from cvt.tests.convert.test_shard import read_all  # noqa: E402

TOPK, SEQ = 8, 64


def c8_config(**overrides) -> dict:
    cfg = tiny_deepseek_v32_config(index_head_dim=32, index_n_heads=16, index_topk=TOPK, **overrides)
    cfg.pop("quantization_config")
    cfg["torch_dtype"] = "float32"
    return cfg


@pytest.fixture(scope="module")
def model() -> Model:
    cfg = c8_config()
    m = Model(Args.from_config(cfg), dtype=torch.float32)
    m.load_state_dict(random_weights(cfg, seed=5), strict=True)
    return m


def prompt(batch: int = 2, seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 300, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_topk_overlap_with_the_float_indexer(model, monkeypatch):
    """Each layer's float and C8 top-k on the float model's own inputs (so a layer's overlap is not
    moved by the layers before it)."""
    rots = indexer_c8.rotation_tensors(model.args.__dict__ | {"model_type": "deepseek_v32"})
    indexers = [layer.self_attn.indexer for layer in model.model.layers]
    pairs = []
    real = Indexer.forward

    def both(ix, x, qr, cos, sin, mask, start_pos, cache):
        keep = real(ix, x, qr, cos, sin, mask, start_pos, cache)
        i = indexers.index(ix)
        ix.rot = tuple(rots[f"model.layers.{i}.self_attn.indexer.{r}_rot"] for r in "qk")
        try:
            keep_c8 = real(ix, x, qr, cos, sin, mask, start_pos, None)
            s_c8 = ix.index_scores(x, qr, cos, sin, mask, start_pos, None)
        finally:
            ix.rot = None
        assert not torch.equal(s_c8, ix.index_scores(x, qr, cos, sin, mask, start_pos, None))  # C8 did run
        pairs.append((keep, keep_c8, mask.sum(-1) > TOPK))
        return keep

    monkeypatch.setattr(Indexer, "forward", both)
    model(prompt())
    assert len(pairs) == model.args.num_hidden_layers
    for i, (keep, keep_c8, past) in enumerate(pairs):
        assert int(past.sum()) == SEQ - TOPK
        assert bool((keep[:, past].sum(-1) == TOPK).all())
        overlap = int((keep & keep_c8)[:, past].sum()) / int(keep[:, past].sum())
        print(f"layer {i}: top-k overlap with the float indexer {overlap:.4f}")
        assert 0.95 <= overlap < 1.0, i


def test_c8_decode_equals_full_forward_and_caches_int8(model):
    t = prompt(2, 20, seed=3)
    cfg = model.args.__dict__ | {"model_type": "deepseek_v32"}
    float_logits = model(t)
    model.attach_indexer_rotations(indexer_c8.rotation_tensors(cfg))
    try:
        assert model.has_indexer_rotations()
        full = model(t)
        assert not torch.equal(full, float_logits)
        cache = model.new_cache(batch=2, max_len=30)
        c = cache[0]
        assert c.index_quant and c.index_k.dtype == torch.int8 and tuple(c.index_k.shape) == (2, 30, 32)
        assert c.index_scale.dtype == torch.float16 and tuple(c.index_scale.shape) == (2, 30, 1)
        assert c.nbytes == c.mla.nbytes + 2 * 30 * 32 + 2 * 30 * 2
        # prefill past index_topk, a chunk, then one token at a time
        steps = [model(t[:, :10], 0, cache), model(t[:, 10:16], 10, cache)]
        steps += [model(t[:, p:p + 1], p, cache) for p in range(16, 20)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5 * full.abs().max().item())
        assert bool(c.index_scale[:, :20].gt(0).all()) and not bool(c.index_scale[:, 20:].any())
        # quant=None: the model without C8 (float indexer cache, float scores)
        fc = model.new_cache(batch=2, max_len=30, quant=None)
        assert not fc[0].index_quant and fc[0].index_k.dtype == torch.float32
        torch.testing.assert_close(model(t, 0, fc), float_logits, rtol=1e-5, atol=1e-5 * full.abs().max().item())
    finally:
        model.detach_indexer_rotations()
    assert not model.has_indexer_rotations()


def test_attach_refuses_bad_rotations(model):
    cfg = model.args.__dict__ | {"model_type": "deepseek_v32"}
    good = indexer_c8.rotation_tensors(cfg)
    name = "model.layers.1.self_attn.indexer.k_rot"
    cases = [
        ({n: t for n, t in good.items() if n != name}, f"needs {name}"),
        ({**good, name: torch.ones(32, 32)}, f"{name} is not an orthogonal matrix"),
        ({**good, name: torch.eye(16)}, f"{name}: shape \\[16, 16\\], expected \\[32, 32\\]"),
        ({**good, "model.layers.3.self_attn.indexer.q_rot": torch.eye(32)}, "has no place in the 3-layer"),
    ]
    for tensors, words in cases:
        with pytest.raises(CvtError, match=words):
            model.attach_indexer_rotations(tensors)
    model.detach_indexer_rotations()


# ---------------------------------------------------------------------------------------------
# quantize -> files -> load -> run / verify
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("v32c8")
    cfg = tiny_deepseek_v32_config(index_head_dim=32, index_n_heads=16, index_topk=TOPK)
    fp8 = write_fp8_release(root / "fp8", cfg)
    bf16 = fp8_to_bf16(fp8, root / "bf16", quiet=True).dst
    quantize(fp8, root / "c8", scheme="w8a8c8", fmt=ASCEND, quiet=True)
    quantize(fp8, root / "w8", scheme="w8a8", fmt=ASCEND, quiet=True)
    return {"fp8": fp8, "bf16": bf16, "c8": root / "c8", "w8": root / "w8"}


def test_c8_output_holds_the_indexer_c8(outputs):
    c8, w8 = read_all(outputs["c8"]), read_all(outputs["w8"])
    rots = {n: t for n, t in c8.items() if indexer_c8.ROT_RE.match(n)}
    assert sorted(rots) == sorted(f"model.layers.{i}.self_attn.indexer.{r}_rot" for i in range(3) for r in "qk")
    want = indexer_c8.hadamard(32)
    assert all(t.dtype == torch.float32 and torch.equal(t, want) for t in rots.values())
    # everything else is the w8a8 output's, bit for bit: no MLA (FAKQuant) scales for V3.2
    assert sorted(set(c8) - set(rots)) == sorted(w8)
    assert all(torch.equal(c8[n], w8[n]) for n in w8)
    desc = json.loads((outputs["c8"] / "quant_model_description.json").read_text())
    assert desc["indexer_quant_type"] == "INT8_DYNAMIC"
    assert all(desc[f"model.layers.{i}.self_attn.indexer.quant_type"] == "INT8_DYNAMIC" for i in range(3))
    assert all(desc[n] == "FLOAT" for n in rots)
    assert "model.layers.3.self_attn.indexer.quant_type" not in desc                  # MTP: none
    assert not {"fa_quant_type", "kv_cache_type", "kv_quant_type"} & set(desc)
    manifest = json.loads((outputs["c8"] / "cvt_manifest.json").read_text())
    assert manifest["quant"]["kv_cache"]["convention"]["name"] == "sparse-li-c8"
    assert manifest["quant"]["kv_cache"]["tensors"] == sorted(rots)


@pytest.mark.slow
def test_c8_output_loads_runs_and_verifies(outputs, tmp_path):
    loaded = load_model(outputs["c8"], dtype=torch.float32).model
    assert [loaded.model.layers[i].self_attn.indexer.rot is not None for i in range(4)] == [True] * 3 + [False]
    cache = loaded.new_cache(batch=1, max_len=40)
    assert cache[0].index_quant and cache[0].quant is None                           # int8 indexer, float MLA
    r = run_cvt("run", outputs["c8"], "--input-ids", ",".join(map(str, range(40, 60))), "--max-new-tokens", "3",
                "--device", "cpu", "--quiet")
    assert r.rc == 0, r.err
    reports = {}
    for name in ("c8", "w8"):
        r = run_cvt("verify", outputs[name], "--reference", outputs["bf16"], "--report", tmp_path / name,
                    "--device", "cpu", "--max-sequences", "2", "--seq-len", "32")     # 32 > index_topk 8
        assert r.rc == 0, r.err
        reports[name] = json.loads((tmp_path / name / "report.json").read_text())
    logits = {n: rep["logits"] for n, rep in reports.items()}
    print("KL vs BF16: w8a8c8 (indexer C8)", logits["c8"]["kl_mean"], "w8a8", logits["w8"]["kl_mean"])
    assert logits["c8"]["kl_mean"] != logits["w8"]["kl_mean"]                      # the C8 indexer ran
    # the numbers docs/formats.md quotes (w8a8c8 0.0469, w8a8 0.0418), to float noise across CPUs
    assert abs(logits["c8"]["kl_mean"] - 0.0469) < 1e-3 and abs(logits["w8"]["kl_mean"] - 0.0418) < 1e-3


def test_non_power_of_two_index_head_dim_is_refused(tmp_path):
    fp8 = write_fp8_release(tmp_path / "fp8", tiny_deepseek_v32_config())            # index_head_dim 40
    r = run_cvt("quantize", fp8, tmp_path / "out", "--scheme", "w8a8c8", "--format", ASCEND)
    assert r.rc != 0 and r.err.startswith("cvt: error: ") and len(r.err.strip().splitlines()) == 1, r.err
    assert "power-of-two index_head_dim" in r.err and "40" in r.err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not os.environ.get("CVT_VLLM_ASCEND_SRC"),
                    reason="set CVT_VLLM_ASCEND_SRC to a local vllm-ascend (main) source tree to run its own "
                           "quantization package on the indexer C8 output")
def test_vllm_ascend_main_declares_what_the_output_holds(outputs):
    """vllm-ascend's own AscendModelSlimConfig (on the referee's stubs, tests/quant/vllm_ascend_referee.py)
    picks AscendSFAQuantAttentionMethod for every decoder layer's attention from the description, and
    the parameters its create_weights declares are the output's tensors, same names, shapes, dtypes.
    The MLA attention prefix is the one vLLM passes (``…self_attn.attn``), parameters live under
    ``…self_attn.mla_attn.mla_attn`` and load from ``…self_attn.{local}`` (get_cache_scale_mapper)."""
    from pathlib import Path

    from cvt.tests.quant.vllm_ascend_referee_layouts import _Attn
    from cvt.tests.quant.vllm_ascend_referee_slots import _declare_attention
    from cvt.tests.quant.vllm_ascend_referee_stubs import _vllm_ascend

    src = Path(os.environ["CVT_VLLM_ASCEND_SRC"])
    src = src.parent if src.name == "vllm_ascend" else src
    dst = outputs["c8"]
    config = json.loads((dst / "config.json").read_text())
    desc = json.loads((dst / "quant_model_description.json").read_text())
    stored = {n: t for n, t in read_all(dst).items() if indexer_c8.ROT_RE.match(n)}
    declared = {}
    with _vllm_ascend(src, config, torch.bfloat16) as env:
        cfg = env.mc.AscendModelSlimConfig(json.loads(json.dumps(desc)))
        env.holder.quant_config = cfg
        for i in range(config["num_hidden_layers"]):
            a = f"model.layers.{i}.self_attn"
            slots: dict = {}
            name = _declare_attention(env, cfg, _Attn(f"{a}.attn", f"{a}.mla_attn.mla_attn", a,
                                                      config["num_attention_heads"], 1, config["kv_lora_rank"]),
                                      slots, config["model_type"])
            assert name == "AscendSFAQuantAttentionMethod", (i, name)
            declared.update({s.ckpt: (tuple(s.shape), s.dtype) for s in slots.values()})
    assert declared == {n: (tuple(t.shape), t.dtype) for n, t in stored.items()}


def test_plan_counts_the_indexer_c8_and_shard_replicates_it(outputs, tmp_path):
    """`cvt plan` (convert.memory_plan.memory_plan) sizes what the V3.2 Ascend C8 output holds and caches; `cvt shard`
    puts every rotation whole on every rank, byte for byte."""
    from cvt.convert.placement import make_layout
    from cvt.convert.memory_plan import memory_plan
    from cvt.convert.shard import shard

    cfg = json.loads((outputs["c8"] / "config.json").read_text())
    lay = make_layout(world_size=2, tp=2)
    p = memory_plan(cfg, lay, "w8a8c8", fmt=ASCEND, kv_tokens=10)
    assert p.ranks[0].weights["kv_scales"] == 3 * 2 * 32 * 32 * 4                 # q_rot + k_rot f32 per layer
    kvl, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    # dp 1: 10 tokens x 3 layers x (bf16 latent + bf16 rope key + int8 indexer key + f16 scale)
    assert p.ranks[1].kv_cache == 10 * 3 * (kvl * 2 + rope * 2 + 32 + 2)
    with pytest.raises(CvtError, match="power-of-two index_head_dim"):
        memory_plan({**cfg, "index_head_dim": 40}, lay, "w8a8c8", fmt=ASCEND)
    dst = shard(outputs["c8"], tmp_path / "tp2", lay, quiet=True).dst
    whole = read_all(outputs["c8"])
    for r in range(2):
        part = read_all(dst / f"rank-{r:05d}")
        rots = sorted(n for n in part if indexer_c8.ROT_RE.match(n))
        assert rots == sorted(n for n in whole if indexer_c8.ROT_RE.match(n))
        assert all(part[n].dtype == whole[n].dtype and torch.equal(part[n], whole[n]) for n in rots)
        desc = json.loads((dst / f"rank-{r:05d}" / "quant_model_description.json").read_text())
        assert desc["indexer_quant_type"] == "INT8_DYNAMIC" and desc["model.layers.2.self_attn.indexer.quant_type"]


def test_rank_loader_keeps_the_rotations_whole(outputs):
    """A TP rank narrows head-covering KV-cache scales to its heads (runtime.parallel._local_kv) but the
    indexer is replicated: each rank attaches the whole [Di, Di] rotations (a 2-rank `cvt run` of the
    sharded output failed on a [16, 32] half before)."""
    from cvt.convert.placement import make_layout
    from cvt.runtime.parallel import ParallelContext, _local_kv, coords

    lay = make_layout(world_size=2, tp=2)
    rots = {n: t for n, t in read_all(outputs["c8"]).items() if indexer_c8.ROT_RE.match(n)}
    for r in range(2):
        got = _local_kv(rots, ParallelContext(lay, r, torch.device("cpu"), coords(lay, r)))
        assert sorted(got) == sorted(rots) and all(torch.equal(got[n], rots[n]) for n in rots)
