"""Parallel layouts, expert placement files, layout validation and the per-rank memory plan."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import jsonschema
import pytest
from pydantic import ValidationError

from cvt.convert.arch import arch_for
from cvt.convert.placement import (contiguous_placement, coords, eplb_maps, group, log2phy, make_layout, moe_layers,
                                   placement_from_mindie, placement_from_phy2log, placement_to_mindie,
                                   placement_to_phy2log, read_placement, write_placement)
from cvt.convert.memory_plan import check, memory_plan, parse_bytes, validate
from cvt.testing.checkpoints import tiny_deepseek_config, tiny_qwen3_config
from cvt.errors import CvtError
from cvt.schemas import load_schema
from cvt.schemas.parallel_layout import Layout, Placement

CONFIGS = Path(__file__).resolve().parent.parent / "data" / "configs"
DSV3 = json.loads((CONFIGS / "deepseek-v3.json").read_text())
KIMI = json.loads((CONFIGS / "kimi-k2.json").read_text())
TINY = tiny_deepseek_config()  # 3 layers (0 dense), 4 experts, MTP layer 3


# ------------------------------------------------------------------------------ layout
def test_rank_rule_tp_contiguous_ep_strided():
    lay = make_layout(world_size=8, tp=2, moe_tp=2)
    assert (lay.dp, lay.ep, lay.dense_tp, lay.embed_tp, lay.lmhead_tp) == (4, 4, 2, 2, 2)
    c = coords(lay, 5)
    assert (c.tp_rank, c.dp_rank, c.moe_tp_rank, c.ep_rank) == (1, 2, 1, 2)
    assert group(lay, "tp", 5) == [4, 5] and group(lay, "moe_tp", 5) == [4, 5]
    assert group(lay, "ep", 5) == [1, 3, 5, 7] and group(lay, "dp", 0) == [0, 2, 4, 6]
    # the rule is data: a reader needs nothing but rank_rule
    rule = {r.axis: r for r in Layout.model_validate_json(lay.model_dump_json()).rank_rule}
    for rank in range(8):
        assert (rank // rule["ep"].stride) % rule["ep"].size == coords(lay, rank).ep_rank == rank // 2
    # every (tp_rank, dp_rank) and (moe_tp_rank, ep_rank) pair names exactly one rank
    assert len({(coords(lay, r).tp_rank, coords(lay, r).dp_rank) for r in range(8)}) == 8
    assert len({(coords(lay, r).moe_tp_rank, coords(lay, r).ep_rank) for r in range(8)}) == 8


def test_ep_alone_means_attention_dp():
    lay = make_layout(ep=64)
    assert (lay.world_size, lay.tp, lay.dp, lay.moe_tp, lay.ep, lay.dense_tp, lay.embed_tp) == (64, 1, 64, 1, 64, 1, 1)
    assert make_layout(world_size=16, tp=4).ep == 16 and make_layout(world_size=16, tp=4).lmhead_tp == 4


@pytest.mark.parametrize("kwargs,msg", [
    (dict(world_size=4, tp=3), "tp 3 does not divide the world size 4 (valid tp: 1, 2, 4)"),
    (dict(world_size=8, ep=2), "moe_tp 1 x ep 2 = 2 must equal the world size 8"),
    (dict(world_size=8, embed_tp=0), "embed_tp must be a positive integer"),
])
def test_impossible_factorizations_are_errors(kwargs, msg):
    with pytest.raises(CvtError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        make_layout(**kwargs)


def test_layout_json_validates_against_generated_schema():
    lay = make_layout(world_size=4, tp=2, placement=contiguous_placement(3, 4, redundant=1))
    data = json.loads(lay.model_dump_json())
    jsonschema.validate(data, load_schema("layout.schema.json"))
    assert Layout.model_validate(data) == lay
    for bad in ({**data, "surprise": 1}, {**data, "tp": "two"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, load_schema("layout.schema.json"))
    with pytest.raises(ValidationError, match="tp 4 x dp 2 must equal world_size 4"):
        Layout.model_validate({**data, "tp": 4})


# ------------------------------------------------------------------------------ placement
def test_contiguous_and_redundant_placement():
    assert contiguous_placement(8, 4).default == [[0, 1], [2, 3], [4, 5], [6, 7]]
    p = contiguous_placement(3, 2, redundant=1)  # 3 experts on 2 ranks need a redundant copy
    assert p.default == [[0, 1], [2, 0]] and p.source == "redundant"
    assert log2phy(p.default) == {0: [(0, 0), (1, 1)], 1: [(0, 1)], 2: [(1, 0)]}
    with pytest.raises(CvtError, match="3 experts \\+ 0 redundant = 3 physical experts do not divide over ep 2"):
        contiguous_placement(3, 2)


def test_moe_layers_from_config_alone():
    assert moe_layers(DSV3) == list(range(3, 62))  # 58 MoE layers + the MTP layer 61
    assert moe_layers(KIMI) == list(range(1, 61))
    assert moe_layers(TINY) == [1, 2, 3]
    assert moe_layers(tiny_qwen3_config()) == [1, 2] and moe_layers(tiny_qwen3_config(moe=False)) == []


def _custom(ep=2):
    layers = moe_layers(TINY)
    phy = [[0, 1, 2, 3, 3, 0], [3, 2, 1, 0, 1, 2], [0, 1, 2, 3, 0, 1]]  # 6 physical slots, 2 redundant
    return placement_from_phy2log(phy, layers, 4, ep), layers, phy


def test_phy2log_and_mindie_round_trips(tmp_path):
    p, layers, phy = _custom()
    assert p.for_layer(1) == [[0, 1, 2], [3, 3, 0]]  # slot r on rank r // (6 / 2)
    assert placement_to_phy2log(p, layers) == phy
    mindie = placement_to_mindie(p, layers)
    assert mindie["moe_layer_count"] == 3 and mindie["layer_list"][2]["device_list"][1] == {
        "device_id": 1, "device_expert": [3, 0, 1]}
    assert placement_from_mindie(mindie, layers, 4).layers == p.layers
    maps = eplb_maps(p, layers)
    assert maps["logcnt"][0] == [2, 1, 1, 2] and maps["log2phy"][0][3] == [3, 4]
    cfg = {**TINY, "n_routed_experts": 4}
    for fmt in ("mindie", "eplb"):
        back = read_placement(write_placement(contiguous_placement(4, 2, redundant=2), tmp_path / f"{fmt}.json",
                                              cfg, fmt), cfg, 2)
        assert all(back.for_layer(L) == [[0, 1, 2], [3, 0, 1]] for L in layers)
    (tmp_path / "bare.json").write_text(json.dumps([[1, 0, 3, 2]]))
    # one of two MoE layers listed: refused (the other would silently fall back to contiguous)
    with pytest.raises(CvtError, match=r"places 1 of the model's 2 MoE layers; layer 2 is missing"):
        read_placement(tmp_path / "bare.json", cfg, 2)
    (tmp_path / "both.json").write_text(json.dumps([[1, 0, 3, 2], [0, 1, 2, 3]]))
    assert read_placement(tmp_path / "both.json", cfg, 2).for_layer(1) == [[1, 0], [3, 2]]


def test_mindie_file_with_decoder_layer_ids_and_bad_files(tmp_path):
    layers = moe_layers(TINY)
    obj = {"moe_layer_count": 1, "layer_list": [{"layer_id": 2, "device_count": 2, "device_list": [
        {"device_id": 1, "device_expert": [2, 3]}, {"device_id": 0, "device_expert": [0, 1]}]}]}
    assert placement_from_mindie(obj, layers, 4).for_layer(2) == [[0, 1], [2, 3]]
    bad = {"moe_layer_count": 1, "layer_list": [{"layer_id": 0, "device_count": 3, "device_list": [
        {"device_id": 0, "device_expert": [0, 1]}, {"device_id": 1, "device_expert": [2, 3]}]}]}
    with pytest.raises(CvtError, match="device_count 3 but lists 2 devices"):
        placement_from_mindie(bad, layers, 4)
    with pytest.raises(CvtError, match="5 physical experts per layer do not divide over ep 2"):
        placement_from_phy2log([[0, 1, 2, 3, 0]], layers, 4, 2)
    (tmp_path / "miss.json").write_text(json.dumps({"phy2log": [[0, 1, 2, 2]]}))
    with pytest.raises(CvtError, match="expert 3 is on no rank"):
        read_placement(tmp_path / "miss.json", TINY, 2)
    (tmp_path / "x.json").write_text(json.dumps({"experts": []}))
    with pytest.raises(CvtError, match="unknown placement format"):
        read_placement(tmp_path / "x.json", TINY, 2)


# ------------------------------------------------------------------------------ validation
@pytest.mark.slow
def test_deepseek_tp64_dense_down_proj_names_tensor_blocks_and_valid_degrees():
    bad = validate(make_layout(world_size=64, tp=64), DSV3)
    down = [str(v) for v in bad if "down_proj" in v.subject]
    assert down == ["model.layers.0.mlp.down_proj.weight dim 1 (size 18432 = 144 FP8 128-blocks): dense_tp 64 "
                    "does not split it into whole FP8 128-blocks; valid dense_tp: 1, 2, 4, 8, 16 "
                    "(and 2 more tensors like it)"]
    assert {v.subject for v in bad} == {f"model.layers.0.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    assert validate(make_layout(world_size=64, tp=64, dense_tp=16), DSV3) == []
    assert validate(make_layout(world_size=64, tp=64), DSV3, scheme="bf16") == []  # BF16 shards: no blocks
    with pytest.raises(CvtError, match="cannot shard this model"):
        check(make_layout(world_size=64, tp=64), DSV3)


@pytest.mark.slow
def test_expert_mlp_tp_limit_and_int4_groups():
    ok = make_layout(world_size=64, moe_tp=16)
    assert validate(ok, DSV3) == []
    bad = validate(make_layout(world_size=64, moe_tp=32), DSV3)
    assert any("experts.0.down_proj.weight dim 1" in str(v) and "valid moe_tp: 1, 2, 4, 8, 16" in str(v)
               and "(and 15103 more tensors like it)" in str(v) for v in bad)  # 59 MoE layers x 256 - 1
    w4 = validate(make_layout(world_size=64, moe_tp=32), KIMI, scheme="w4a16", group_size=128)
    assert any("w4a16 group of 128" in str(v) and v.axis == "moe_tp" for v in w4)
    assert validate(make_layout(world_size=64, moe_tp=32), KIMI, scheme="w4a16", group_size=32) == []


def test_three_experts_on_two_ranks_fail_cleanly_and_redundancy_fixes_it():
    cfg = {**TINY, "n_routed_experts": 3, "n_group": 1}
    bad = validate(make_layout(ep=2), cfg)
    assert [v.subject for v in bad] == ["config.n_routed_experts"]
    assert "n_routed_experts = 3 routed experts: ep 2 does not divide it; valid ep: 1" in str(bad[0])
    plan = memory_plan(cfg, make_layout(ep=2))  # still plans, and says why the layout is refused
    assert plan.violations and "layout violations" in plan.render()
    lay = make_layout(ep=2, placement=contiguous_placement(3, 2, redundant=1))
    assert validate(lay, cfg) == []
    p = memory_plan(cfg, lay)
    assert p.ranks[0].weights["experts"] == p.ranks[1].weights["experts"]  # 2 slots each


def test_heads_and_kv_heads_not_divisible():
    bad = validate(make_layout(world_size=6, tp=3, ep=2, moe_tp=3), TINY)
    assert "config.num_attention_heads = 4 heads: tp 3 does not divide it; valid tp: 1, 2" in [str(v) for v in bad][0]
    q = tiny_qwen3_config(moe=False)  # 4 heads, 2 KV heads
    kv = validate(make_layout(world_size=4, tp=4), q)
    assert [v.subject for v in kv][:1] == ["config.num_key_value_heads"] and kv[0].valid == (1, 2)
    e = validate(make_layout(ep=64), {**TINY, "n_routed_experts": 16})
    assert e[0].valid == (1, 2, 4, 8, 16)  # EP 64 over 16 experts without redundancy


# ------------------------------------------------------------------------------ memory plan
def _fp8_linear(name):
    return name.endswith(("_proj.weight", "_with_mqa.weight")) and ("self_attn." in name or ".mlp." in name)


def _bytes(name, shape, scheme):
    n = math.prod(shape)
    if name.endswith("e_score_correction_bias"):
        return 4 * n
    if scheme == "fp8" and _fp8_linear(name):
        return n + math.ceil(shape[0] / 128) * math.ceil(shape[1] / 128) * 4
    return 2 * n


def _degree(name, lay):
    if "embed_tokens" in name:
        return lay.embed_tp
    if name == "lm_head.weight" or "shared_head.head" in name:
        return lay.lmhead_tp
    if "shared_experts" in name:
        return lay.moe_tp if lay.shared_experts == "moe_tp" else 1
    if any(p in name for p in ("q_b_proj.", "kv_b_proj.", "o_proj.", ".q_proj.")):
        return lay.tp
    if any(p in name for p in ("mlp.gate_proj.", "mlp.up_proj.", "mlp.down_proj.")):
        return lay.dense_tp
    return 1


@pytest.mark.parametrize("cfg,kw,scheme", [
    pytest.param(DSV3, dict(world_size=32, tp=8, moe_tp=2, dense_tp=8), "bf16", marks=pytest.mark.slow),
    pytest.param(DSV3, dict(world_size=32, tp=8, moe_tp=2, dense_tp=8), "fp8", marks=pytest.mark.slow),
    (TINY, dict(world_size=4, tp=2, moe_tp=2, embed_tp=4), "bf16"),  # tiny's 192-row q_b_proj: no FP8 TP
    (TINY, dict(world_size=4, moe_tp=2, shared_experts="replicated"), "bf16"),
    (TINY, dict(world_size=4, placement=contiguous_placement(4, 4, redundant=4)), "bf16"),
    (TINY, dict(world_size=4, placement=contiguous_placement(4, 4, redundant=4)), "fp8"),
], ids=["dsv3-w32-bf16", "dsv3-w32-fp8", "tiny-w4-bf16", "tiny-shared-replicated", "tiny-redundant-bf16",
        "tiny-redundant-fp8"])
def test_sum_over_ranks_is_model_times_replication(cfg, kw, scheme):
    lay = make_layout(**kw)
    assert validate(lay, cfg, scheme) == []
    plan = memory_plan(cfg, lay, scheme)
    copies = {}
    if lay.placement:
        for ids in lay.placement.default:
            for e in ids:
                copies[e] = copies.get(e, 0) + 1
    want = total = 0
    for name, shape in arch_for(cfg).table.param_shapes(cfg).items():
        b = _bytes(name, shape, scheme)
        total += b
        if ".experts." in name:
            want += b * copies.get(int(name.split(".")[5]), 1)
        else:
            want += b * lay.world_size // _degree(name, lay)
    assert sum(r.weight_bytes for r in plan.ranks) == want
    assert sum(plan.model_bytes.values()) == total


def _hand_count(cfg, lin, kvb, experts_per_rank, bf=lambda n, k: 2 * n * k):
    """Per-rank bytes at tp 1 / moe_tp 1 (everything but experts whole on every rank), by hand."""
    h, H, V = cfg["hidden_size"], cfg["num_attention_heads"], cfg["vocab_size"]
    ql, kl, r, nope, v = (cfg[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                           "v_head_dim"))
    E, mi, dense = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["first_k_dense_replace"]
    L, mtp = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers") or 0
    attn = lin(ql, h) + lin(H * (nope + r), ql) + lin(kl + r, h) + kvb(H * (nope + v), kl) + lin(h, H * v)
    layer = attn + 2 * (ql + kl) + 2 * 2 * h
    mlp3 = lambda i: 2 * lin(i, h) + lin(h, i)  # noqa: E731
    moe = bf(E, h) + 4 * E + mlp3(mi) + experts_per_rank * mlp3(mi)
    total = bf(V, h) * 2 + 2 * h + L * layer + dense * mlp3(cfg["intermediate_size"]) + (L - dense) * moe
    return total + mtp * (layer + moe + bf(V, h) * 2 + bf(h, 2 * h) + 3 * 2 * h)


# bytes of one n x k linear as stored (FORMATS.md; compressed-tensors pack-quantized / int-quantized,
# msModelSlim AscendV1 W8A8_DYNAMIC):
W8 = lambda n, k: n * k + 4 * n  # noqa: E731  c-t: int8 weight + f32 weight_scale [n, 1]
W8A = lambda n, k: n * k + 8 * n  # noqa: E731  ascend: int8 + f32 weight_scale and weight_offset [n, 1]
W4 = lambda n, k: n * k // 2 + 2 * n * (k // 128) + 8  # noqa: E731  c-t: int32-packed int4, bf16 scale per 128, shape i32 [2]
F8 = lambda n, k: n * k + 4 * math.ceil(n / 128) * math.ceil(k / 128)  # noqa: E731
BF = lambda n, k: 2 * n * k  # noqa: E731


@pytest.mark.parametrize("cfg,ep,scheme,lin,kvb,fmt", [
    pytest.param(KIMI, 64, "w8a8", W8, BF, None, marks=pytest.mark.slow), (KIMI, 64, "w8a8", W8A, BF, "ascend"),
    pytest.param(KIMI, 64, "w4a16", W4, BF, None, marks=pytest.mark.slow),
    (DSV3, 32, "fp8", F8, F8, None), pytest.param(DSV3, 32, "bf16", BF, BF, None, marks=pytest.mark.slow),
], ids=["kimi-ep64-w8a8", "kimi-ep64-w8a8-ascend", "kimi-ep64-w4a16", "dsv3-ep32-fp8", "dsv3-ep32-bf16"])
def test_real_configs_match_a_hand_count(cfg, ep, scheme, lin, kvb, fmt):
    plan = memory_plan(cfg, make_layout(ep=ep), scheme, fmt=fmt)
    want = _hand_count(cfg, lin, kvb, cfg["n_routed_experts"] // ep)
    assert plan.min == plan.max == pytest.approx(want, rel=0.01)
    assert plan.max == want  # exact, in fact


@pytest.mark.slow
def test_scheme_ordering_and_plausible_totals():
    lay = make_layout(ep=64)
    tot = {s: sum(memory_plan(DSV3, lay, s).model_bytes.values()) for s in ("bf16", "w8a8", "fp8", "w4a16", "fp4")}
    assert tot["bf16"] > tot["w8a8"] > tot["fp8"] > tot["w4a16"] and tot["fp4"] < tot["fp8"]
    assert 1.30e12 < tot["bf16"] < 1.40e12  # 685B parameters incl. MTP
    assert 0.67e12 < tot["fp8"] < 0.71e12  # the FP8 release is ~689 GB
    assert 1.00e12 < sum(memory_plan(KIMI, lay, "fp8").model_bytes.values()) < 1.06e12  # ~958.5 GiB


def test_kv_cache_bytes_by_hand():
    lay = make_layout(world_size=4, tp=2)  # dp 2
    p = memory_plan(TINY, lay, "bf16", kv_tokens=1001)
    assert p.ranks[0].kv_cache == 501 * 3 * (72 + 16) * 2  # ceil(1001/2) tokens x layers x (latent + rope) x bf16
    c8 = memory_plan(TINY, lay, "w8a8c8", kv_tokens=1001)
    # FAKQuant: the latent int8, the rope key bf16; scales fa_q [heads, 1] + fa_k, fa_v [1, 1] f32,
    # offsets the same shapes in int8
    assert c8.ranks[3].kv_cache == 501 * 3 * (72 + 16 * 2)
    assert c8.ranks[0].weights["kv_scales"] == 3 * (4 + 1 + 1) * (4 + 1)
    q = tiny_qwen3_config(moe=False)  # GQA: 2 KV heads of 24 over tp 2
    assert memory_plan(q, lay, kv_tokens=10).ranks[1].kv_cache == 5 * 3 * 2 * 1 * 24 * 2


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [DSV3, KIMI], ids=["deepseek-v3", "kimi-k2"])
def test_real_plans_are_fast(cfg):
    memory_plan(TINY, make_layout(ep=4), "w4a16")  # imports
    E = cfg["n_routed_experts"]
    for W in (64, 128, 256):
        redundant = -E % W  # Kimi's 384 experts need 128 redundant ones at EP 256
        placement = contiguous_placement(E, W, redundant) if redundant else None
        for scheme in ("fp8", "w4a16"):
            t = time.perf_counter()
            p = memory_plan(cfg, make_layout(ep=W, placement=placement), scheme, kv_tokens=128 * 1024,
                            hbm_bytes="64GiB")
            assert time.perf_counter() - t < 5
            assert 5 * 2**30 < p.max < 40 * 2**30 and not p.over_budget and not p.violations
            assert p.ranks[0].weights["experts"] * W * E == p.model_bytes["experts"] * (E + redundant)


def test_hbm_budget_flags_the_heaviest_ranks():
    uneven = Placement(num_experts=4, ep=2, source="test", default=[[0, 1, 2], [3]])
    lay = make_layout(ep=2, placement=uneven)
    light = memory_plan(TINY, lay).ranks[1].total
    p = memory_plan(TINY, lay, hbm_bytes=light)
    assert p.heaviest.rank == 0 and p.over_budget == [0]
    text = p.render()
    assert "1 of 2 ranks exceed it: 0" in text and "heaviest rank: 0 (ep_rank 0)" in text
    assert any("hold 1..3 experts" in str(v) for v in p.violations)
    assert memory_plan(TINY, lay, hbm_bytes=10**12).over_budget == []


def test_parse_bytes():
    assert parse_bytes("64GB") == 64 * 10**9 and parse_bytes("64GiB") == parse_bytes("64G") == 64 * 2**30
    assert parse_bytes("1.5TB") == 1.5e12 and parse_bytes(123) == 123
    with pytest.raises(CvtError, match="'64 bananas' is not a size like 5GB"):
        parse_bytes("64 bananas")


@pytest.mark.slow
def test_cli_plan_on_the_real_configs():
    """`cvt plan` from config.json alone, on the real DeepSeek-V3 and Kimi-K2 configs."""
    from cvt.tests.conftest import run_cvt

    data = Path(__file__).resolve().parents[1] / "data" / "configs"
    t0 = time.perf_counter()
    r = run_cvt("plan", data / "deepseek-v3.json", "--ep", "64", "--scheme", "w8a8", "--hbm", "64GB", "--kv-tokens", "100000")
    assert r.rc == 0, r.err
    assert "heaviest rank" in r.out and "every rank fits" in r.out
    assert time.perf_counter() - t0 < 15  # includes the interpreter and torch import of the subprocess
    bad = run_cvt("plan", data / "deepseek-v3.json", "--tp", "64", "--ep", "64", "--scheme", "fp8")
    assert bad.rc == 3 and "down_proj.weight dim 1 (size 18432 = 144 FP8 128-blocks)" in bad.out
    k2 = run_cvt("plan", data / "kimi-k2.json", "--ep", "64", "--scheme", "w4a16", "--hbm", "16GiB")
    assert k2.rc == 3 and "64 of 64 ranks exceed it" in k2.out


# ------------------------------------------------------------------------------ plan == what shard writes
PLAN_CASES = [  # (scheme, format, target, quantize options)
    ("w8a8", "compressed-tensors", None, {}), ("w8a8", "ascend", "vllm-ascend", {}), ("w8a8", "ascend", "mindie", {}),
    pytest.param("w8a8c8", "ascend", "vllm-ascend", {}, marks=pytest.mark.slow),  # calibrates the KV scales
    ("w4a16", "compressed-tensors", None, {"group_size": 32}),
    ("w4a16", "ascend", "vllm-ascend", {"group_size": 32}),
    ("w4a16", "ascend", "mindie", {}),  # group 64 by default: attention at tp 1 (tp 2 leaves no whole group)
    ("fp4", "compressed-tensors", None, {}), ("fp4", "ascend", "vllm-ascend", {"fp4_format": "mxfp4"}),
    ("w4a8", "ascend", "vllm-ascend", {}),
    ("mxfp8", "ascend", "vllm-ascend", {}), ("w4a4_mxfp4", "ascend", "vllm-ascend", {}),
    ("w4a8_mxfp", "ascend", "vllm-ascend", {}),
    # a row layer's transforms sized for the whole k (max_supported_tp), each rank its diagonal block
    ("w4a4_mxfp4_flatquant", "ascend", "vllm-ascend", {}),
]


@pytest.fixture(scope="module")
def tiny_release(tmp_path_factory):
    from cvt.testing.checkpoints import write_fp8_release

    return write_fp8_release(tmp_path_factory.mktemp("plan") / "src")


@pytest.mark.parametrize("scheme,fmt,target,opts", PLAN_CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_plan_bytes_are_what_shard_writes(tiny_release, tmp_path, scheme, fmt, target, opts):
    """Every rank's weight bytes in the plan equal the tensor bytes `cvt shard` writes for that
    rank from a `cvt quantize --format fmt --target target` output: the plan counts each
    quantized linear through the same layout table (the plan once counted the scheme's logical
    parts: W4A8 without weight_offset / scale_bias and with every linear int4, where
    vllm-ascend keeps non-experts float: 48% under on this model), and w4a16's default group as
    quantize's per format (64 for ascend)."""
    from safetensors import safe_open

    from cvt.dtypes import DTYPES
    from cvt.convert.shard import shard
    from cvt.quant.stage import quantize

    q = tmp_path / "q"
    quantize(tiny_release, q, scheme=scheme, fmt=fmt, target=target, quiet=True, **opts)
    cfg = json.loads((tiny_release / "config.json").read_text())
    # w4a4_mxfp4_flatquant at tp 1 too: its row layers' transforms differ from the others' there
    # (at tp 2 their diagonal blocks happen to hold what a column layer of k / 2 would, here)
    for tp in (1, 2) if scheme == "w4a4_mxfp4_flatquant" else (1 if target == "mindie" and scheme == "w4a16" else 2,):
        lay = make_layout(world_size=4, tp=tp, ep=4)
        shard(q, tmp_path / f"s{tp}", lay, quiet=True)
        plan = memory_plan(cfg, lay, scheme, opts.get("group_size"), fmt=fmt, target=target,
                           fp4_format=opts.get("fp4_format"))
        assert not plan.violations
        for r in plan.ranks:
            written = 0
            for f in (tmp_path / f"s{tp}" / f"rank-{r.rank:05d}").glob("*.safetensors"):
                with safe_open(f, "pt") as h:
                    for k in h.keys():
                        sl = h.get_slice(k)
                        written += math.prod(sl.get_shape()) * DTYPES[sl.get_dtype()][1]
            assert r.weight_bytes == written, (tp, r.rank, r.weight_bytes, written)


def test_cli_shard_dry_run_plans_a_quantized_output_in_its_own_format(tiny_release, tmp_path):
    """`cvt shard --dry-run` on a cvt quantize output plans it in the format and target it was
    written in (its manifest), as `cvt plan --format --target` does."""
    from cvt.quant.stage import quantize
    from cvt.tests.conftest import run_cvt

    q = tmp_path / "q"
    quantize(tiny_release, q, scheme="w4a8", fmt="ascend", target="vllm-ascend", quiet=True)
    dry = run_cvt("shard", q, "--dry-run", "--world-size", "4", "--tp", "2", "--ep", "4")
    plan = run_cvt("plan", q, "--world-size", "4", "--tp", "2", "--ep", "4", "--scheme", "w4a8", "--format", "ascend")
    assert dry.rc == 0 and plan.rc == 0, (dry.err, plan.err)
    assert "--format ascend --target vllm-ascend" in dry.out and dry.out == plan.out


@pytest.mark.parametrize("kw,msg", [
    (dict(scheme="bf16", fmt="ascend"), "describe quantized weights, not bf16"),
    (dict(scheme="fp8", target="mindie"), "describe quantized weights, not fp8"),
    (dict(scheme="w8a8", fp4_format="mxfp4"), "fp4_format applies to scheme fp4"),
    (dict(scheme="w4a8", fmt="compressed-tensors"), "not supported"),
    (dict(scheme="fp4", fmt="ascend"), "no layout for scheme 'fp4' \\(nvfp4\\)"),
    (dict(scheme="w8a8", target="mindie"), "does not apply to the compressed-tensors format"),
    # a layout refusal names the model's module, not the layout table's probe
    (dict(scheme="w4a16", fmt="ascend", target="mindie", group_size=32), "^model.layers.0.self_attn.q_a_proj: mindie"),
])
def test_plan_refuses_what_quantize_refuses(kw, msg):
    with pytest.raises(CvtError, match=msg):
        memory_plan(DSV3, make_layout(ep=64), **kw)


def test_plan_refuses_an_int8_kv_cache_the_target_would_load_wrong():
    """The same rule as cvt quantize (`cvt.qtensor.kv_tensors.kv_target_problem`): vllm-ascend drops
    Qwen3-MoE's C8 scales."""
    cfg = tiny_qwen3_config(moe=True)
    lay = make_layout(world_size=2, tp=2, ep=2)
    with pytest.raises(CvtError, match="vllm-ascend 0.23 loads C8 KV-cache scales only"):
        memory_plan(cfg, lay, "w8a8c8", fmt="ascend")
    assert memory_plan(cfg, lay, "w8a8c8", fmt="ascend", target="mindie").ranks
    assert memory_plan(tiny_qwen3_config(moe=False), make_layout(world_size=2, tp=2), "w8a8c8", fmt="ascend").ranks
