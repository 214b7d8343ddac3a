"""`cvt shard`: per-rank directories that put back together byte for byte, validation before
writing, streaming (each source tensor read once), resume after kill -9, the dry-run plan.

The reassembly below is the tests' own: it reads the rank files with the safetensors library
and concatenates runs as the manifest's per-tensor split says, independently of cvt's writer.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from cvt.cli import cli
from cvt.convert.placement import contiguous_placement, make_layout, write_placement
from cvt.convert.safetensors_io import MappedFile
from cvt.convert.shard import shard
from cvt.testing.checkpoints import tiny_deepseek_config, tiny_qwen3_config, write_bf16_checkpoint, write_fp8_release
from cvt.errors import CvtError
from cvt.quant.stage import quantize
from cvt.tests.conftest import run_cvt

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"


def _bf16_config(**kw):
    cfg = tiny_deepseek_config(**kw)
    cfg.pop("quantization_config")
    return cfg


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def reassemble(dst: Path) -> dict[str, torch.Tensor]:
    """Every source tensor rebuilt from the rank files, by the manifest alone; also checks that
    every holder of a run holds the same bytes and that each rank holds exactly its share."""
    m = json.loads((dst / "cvt_manifest.json").read_text())
    sh = m["shard"]
    ranks = {r["rank"]: r for r in sh["ranks"]}
    held = {r: read_all(dst / e["dir"]) for r, e in ranks.items()}
    for r, e in ranks.items():  # the rank's index lists exactly its files' tensors
        index = json.loads((dst / e["dir"] / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(held[r])
        assert sorted(f"{e['dir']}/{v}" for v in set(index["weight_map"].values())) == sorted(e["files"])
    out = {}
    for name, ts in sh["tensors"].items():
        holders = [r for r in ranks if name in held[r]]
        assert holders, name
        if ts["expert"] is not None:
            layer, expert = ts["expert"]
            assert {r for r in ranks if expert in ranks[r]["experts"][str(layer)]} == set(holders), name
        else:
            assert len(holders) == len(ranks), name
        if ts["dim"] is None:
            runs = {0: held[holders[0]][name]}
            for r in holders:
                assert raw(held[r][name]) == raw(runs[0]), (name, r)
        else:
            runs = {}
            for r in holders:
                i = ranks[r]["coords"][f"{ts['axis']}_rank"]
                t = held[r][name]
                if i in runs:
                    assert raw(t) == raw(runs[i]), (name, r)
                runs[i] = t
            assert sorted(runs) == list(range(ts["degree"])), name
        if ts.get("parts"):  # each holder: its run of every part, in order (a Gated DeltaNet's q | k | v)
            pieces = [runs[i].split([p // ts["degree"] for p in ts["parts"]], dim=ts["dim"]) for i in sorted(runs)]
            whole = torch.cat([piece[j] for j in range(len(ts["parts"])) for piece in pieces], dim=ts["dim"])
        elif ts.get("diagonal"):  # each holder: its diagonal block of a block-diagonal square tensor
            whole = torch.block_diag(*[runs[i] for i in sorted(runs)])
        elif ts["dim"] is not None:
            whole = torch.cat([runs[i] for i in sorted(runs)], dim=ts["dim"])
        else:
            whole = runs[0]
        assert list(whole.shape) == ts["shape"], name
        out[name] = whole
    return out


def assert_reproduces(src: Path, dst: Path) -> dict:
    source = read_all(src)
    back = reassemble(dst)
    assert sorted(back) == sorted(source)
    for name, t in source.items():
        assert back[name].dtype == t.dtype and raw(back[name]) == raw(t), name
    return json.loads((dst / "cvt_manifest.json").read_text())


@pytest.fixture(scope="module")
def bf16_src(tmp_path_factory) -> Path:
    return write_bf16_checkpoint(tmp_path_factory.mktemp("bf16") / "src", _bf16_config())


@pytest.mark.parametrize("degrees", [
    dict(world_size=4, tp=2, ep=4),
    dict(world_size=4, tp=1, ep=2, moe_tp=2, embed_tp=4, lmhead_tp=2),
    dict(world_size=2, tp=2, ep=2, dense_tp=1),
], ids=["tp2-ep4", "moe_tp2-ep2-embed4", "tp2-ep2-dense1"])
def test_bf16_shards_reassemble_byte_for_byte(bf16_src, tmp_path, degrees):
    layout = make_layout(**degrees)
    m = assert_reproduces(bf16_src, shard(bf16_src, tmp_path / "out", layout, quiet=True, max_shard_size=300_000).dst)
    t = m["shard"]["tensors"]
    # the arch table's split dims, by the degree of each part of the model
    assert (t["model.layers.0.self_attn.q_b_proj.weight"]["dim"], t["model.layers.0.self_attn.o_proj.weight"]["dim"]) == (
        (0, 1) if layout.tp > 1 else (None, None))
    assert t["model.embed_tokens.weight"]["degree"] == layout.embed_tp
    assert t["model.layers.1.mlp.gate.weight"]["dim"] is None  # router replicated
    files = {f["path"]: f for f in m["files"]}
    for r in m["shard"]["ranks"]:  # sizes and hashes of every rank file recorded
        for rel in r["files"]:
            assert (tmp_path / "out" / rel).stat().st_size == files[rel]["size"]
            assert files[rel]["tensors"] > 0 and (tmp_path / "out" / rel).stat().st_size <= 300_000 + 20_000
    # experts keep global ids; contiguous placement by default
    assert m["shard"]["ranks"][-1]["experts"]["1"] == [3] if layout.ep == 4 else [2, 3]
    assert m["shard"]["layout"]["rank_rule"]
    assert json.loads((tmp_path / "out" / "expert_placement.json").read_text())["moe_layer_count"] == 3


def test_fp8_release_scales_split_with_their_blocks(tmp_path):
    # moe_intermediate 256: expert linears split moe_tp 2 ways in whole 128-blocks
    cfg = tiny_deepseek_config(moe_intermediate_size=256)
    src = write_fp8_release(tmp_path / "src", cfg)
    layout = make_layout(world_size=4, tp=1, ep=2, moe_tp=2, embed_tp=2)
    m = assert_reproduces(src, shard(src, tmp_path / "out", layout, quiet=True).dst)
    t = m["shard"]["tensors"]
    w, s = t["model.layers.1.mlp.experts.0.down_proj.weight"], t["model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"]
    assert (w["dim"], s["dim"], w["dtype"]) == (1, 1, "F8_E4M3") and s["shape"] == [2, 2]
    # a layout cutting FP8 blocks is refused before anything is written
    with pytest.raises(CvtError, match=r"q_b_proj\.weight dim 0 .*FP8 128-block"):
        shard(src, tmp_path / "bad", make_layout(world_size=2, tp=2, ep=2), quiet=True)
    assert not (tmp_path / "bad").exists()


QUANT = [
    ("compressed-tensors", "w8a8", {}),
    ("compressed-tensors", "w4a16", {"group_size": 32}),
    ("compressed-tensors", "fp4", {}),
    ("compressed-tensors", "w8a8c8", {}),
    ("ascend", "w8a8", {"static_attention": True}),
    ("ascend", "w4a16", {"group_size": 64, "asym": True, "target": "mindie"}),
    ("ascend", "w4a16", {"group_size": 32}),  # vllm-ascend: int32 experts
    ("ascend", "fp4", {"fp4_format": "mxfp4"}),
    ("ascend", "w8a8c8", {}),
]


# the cases that calibrate (KV-cache or static attention scales) are slow
@pytest.mark.parametrize("fmt,scheme,opts", [pytest.param(*c, marks=pytest.mark.slow)
                                             if c[1] == "w8a8c8" or c[2].get("static_attention") else c for c in QUANT],
                         ids=[f"{f}-{s}" + (f"-{o['target']}" if "target" in o else "") for f, s, o in QUANT])
def test_quantized_shards_reassemble_byte_for_byte(bf16_src, tmp_path, fmt, scheme, opts):
    q = tmp_path / "q"
    quantize(bf16_src, q, scheme=scheme, fmt=fmt, quiet=True, calib_tokens=64, **opts)
    layout = make_layout(world_size=4, tp=2, ep=4)
    m = assert_reproduces(q, shard(q, tmp_path / "out", layout, quiet=True).dst)
    t = m["shard"]["tensors"]
    assert m["quant"]["scheme"] == scheme
    o_proj = "model.layers.0.self_attn.o_proj"
    if fmt == "compressed-tensors" and scheme == "w4a16":
        assert t[f"{o_proj}.weight_packed"]["dim"] == 1 and t[f"{o_proj}.weight_scale"]["dim"] == 1
        assert t[f"{o_proj}.weight_shape"]["dim"] is None  # the global shape, copied whole
    if fmt == "ascend":
        desc = json.loads((tmp_path / "out" / "rank-00000" / "quant_model_description.json").read_text())
        held = read_all(tmp_path / "out" / "rank-00000")
        src_desc = json.loads((q / "quant_model_description.json").read_text())
        assert {k for k in desc if k in src_desc and k not in held} <= {k for k in src_desc if not k.startswith("model.")
                                                                           and k != "lm_head.weight"}
        assert all(desc[k] == src_desc[k] for k in held if k in src_desc)
    if opts.get("static_attention"):  # per-output-channel parts follow column splits, whole on row splits
        q_b = "model.layers.0.self_attn.q_b_proj"
        assert t[f"{q_b}.deq_scale"]["dim"] == 0 and t[f"{o_proj}.deq_scale"]["dim"] is None


def test_redundant_experts_from_a_placement_file(bf16_src, tmp_path):
    from cvt.convert.placement import read_placement
    from cvt.convert.safetensors_io import load_json

    config = load_json(bf16_src / "config.json")
    path = write_placement(contiguous_placement(4, 4, redundant=4), tmp_path / "p.json", config, "mindie")
    layout = make_layout(world_size=4, ep=4, placement=read_placement(path, config, 4))
    m = assert_reproduces(bf16_src, shard(bf16_src, tmp_path / "out", layout, quiet=True).dst)
    assert [r["experts"]["2"] for r in m["shard"]["ranks"]] == [[0, 1], [2, 3], [0, 1], [2, 3]]


def test_invalid_layouts_are_refused_naming_the_problem(bf16_src, tmp_path):
    with pytest.raises(CvtError, match=r"num_attention_heads = 4 heads: tp 3 does not divide it; valid tp: 1, 2(?s:.*)ep 6 does not divide"):
        shard(bf16_src, tmp_path / "a", make_layout(world_size=6, tp=3, ep=6), quiet=True)
    with pytest.raises(CvtError, match=r"n_routed_experts = 4 routed experts: ep 8 does not divide.*redundant"):
        shard(bf16_src, tmp_path / "b", make_layout(ep=8), quiet=True)
    big = tmp_path / "big.json"  # EP 64 over 16 experts, no redundancy: the example
    big.write_text(json.dumps(_bf16_config(n_routed_experts=16, n_group=1)))
    r = CliRunner().invoke(cli, ["shard", str(big), "--dry-run", "--ep", "64"])
    assert r.exit_code == 3 and "ep 64 does not divide it" in r.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_each_source_tensor_is_read_once(bf16_src, tmp_path, monkeypatch):
    released: dict[str, int] = {}
    orig = MappedFile.release

    def counting(self, ref):
        released[ref.name] = released.get(ref.name, 0) + 1
        return orig(self, ref)

    monkeypatch.setattr(MappedFile, "release", counting)
    shard(bf16_src, tmp_path / "out", make_layout(world_size=4, tp=2, ep=4), quiet=True, max_shard_size=100_000)
    assert released and set(released.values()) == {1}
    assert len(released) == len(read_all(bf16_src))


def test_qwen3_moe_gqa_heads_split(tmp_path):
    cfg = tiny_qwen3_config(moe=True)
    src = write_bf16_checkpoint(tmp_path / "src", cfg)
    m = assert_reproduces(src, shard(src, tmp_path / "out", make_layout(world_size=2, tp=2, ep=2), quiet=True).dst)
    assert m["shard"]["tensors"]["model.layers.0.self_attn.k_proj.weight"]["dim"] == 0


@pytest.mark.slow
def test_kill_9_mid_write_then_resume_is_byte_identical(bf16_src, tmp_path):
    args = ("shard", str(bf16_src), "--tp", "2", "--ep", "4", "--max-shard-size", "400KB", "-q")
    golden = run_cvt(*args[:2], str(tmp_path / "golden"), *args[2:])
    assert golden.rc == 0, golden.err
    killed = run_cvt(*args[:2], str(tmp_path / "out"), *args[2:], env={"CVT_TEST_KILL_AT_BYTE": "3000000"})
    assert killed.rc == -signal.SIGKILL
    assert not (tmp_path / "out" / "cvt_manifest.json").exists()
    assert list((tmp_path / "out").glob("rank-*/.*.tmp"))  # a half-written rank file, hidden
    again = run_cvt(*args[:2], str(tmp_path / "out"), *args[2:])
    assert again.rc == 0, again.err
    for f in sorted(p.relative_to(tmp_path / "golden") for p in (tmp_path / "golden").rglob("*") if p.is_file()):
        assert (tmp_path / "out" / f).read_bytes() == (tmp_path / "golden" / f).read_bytes(), f
    assert not list((tmp_path / "out").glob("rank-*/.*.tmp"))


@pytest.mark.slow
def test_dry_run_plans_the_real_kimi_config():
    kimi = str(CONFIGS / "kimi-k2.json")
    r = CliRunner().invoke(cli, ["shard", kimi, "--dry-run", "--ep", "64", "--scheme", "w8a8", "--hbm", "64GB",
                                 "--kv-tokens", "65536"])
    assert r.exit_code == 0, r.output
    assert "world 64 = tp 1 x dp 64 = moe_tp 1 x ep 64" in r.output and "every rank fits" in r.output
    r = CliRunner().invoke(cli, ["shard", kimi, "--dry-run", "--ep", "64", "--hbm", "16GB"])
    assert r.exit_code == 3 and "ranks exceed it" in r.output
