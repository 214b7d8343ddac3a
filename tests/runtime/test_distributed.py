"""Multi-rank runtime on CPU (gloo): sharded tiny models give the single-process logits and tokens.

Every layout of one world size runs in one spawned world (the ranks call
`cvt.runtime.launch.main` once per case, dumping every call's logits with ``{rank}`` in the
file name); the test compares each rank's dump with `load_model` + `generate` in this
process, both in float32 (a source with quantized activations: on the rank's own tokens,
see `QUANTIZED_ACTIVATIONS`). Start-up refusals (topology, missing / altered rank file, layout
against config.json) are checked on `preflight` and `main` directly, one altered-file case
runs inside a world (no rank may hang), and `cvt run --procs 2` goes through torchrun (also
from a directory holding a folder named `cvt`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from cvt.convert.placement import contiguous_placement, make_layout, read_placement, write_placement
from cvt.convert.shard import shard
from cvt.testing.checkpoints import tiny_deepseek_config, tiny_qwen3_config, write_bf16_checkpoint
from cvt.errors import CvtError, ManifestError
from cvt.runtime import launch
from cvt.tests.conftest import run_cvt

pytestmark = pytest.mark.slow  # the module fixtures quantize and shard nine layouts before any test runs

PROMPTS = ["hello", "world", "MoE!"]  # two of one length (a batch of 2) and one alone
NEW_TOKENS = 4
ARGV = [a for p in PROMPTS for a in ("--prompt", p)] + ["--max-new-tokens", str(NEW_TOKENS), "--dtype", "fp32",
                                                        "--device", "cpu", "--quiet"]


# ------------------------------------------------------------------------------ helpers
def _worker(rank: int, world: int, store: str, cases: list, out: str, argv: list | None = None) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    codes = {}
    try:
        for name, dst in cases:
            codes[name] = launch.main([str(dst), *(argv or ARGV), "--dump-logits",
                                       f"{out}/{name}.{{rank}}.safetensors"])
    finally:
        Path(out, f"codes.{rank}.json").write_text(json.dumps(codes))
        dist.barrier()  # no rank tears the world down under a peer still in it
        dist.destroy_process_group()


def _spawn(world: int, cases: list, tmp: Path, timeout: float = 240, argv: list | None = None) -> dict[str, list[int]]:
    """Run `cases` [(name, dst)] in one spawned world (`launch.main` with `argv`, default ARGV);
    exit codes per case, by rank."""
    import torch.multiprocessing as mp

    out = tmp / f"out-{world}"
    out.mkdir()
    ctx = mp.start_processes(_worker, args=(world, str(tmp / f"store-{world}"), cases, str(out), argv), nprocs=world,
                             join=False, start_method="spawn")
    import time

    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {world}-rank world did not finish in {timeout} s")
    codes = [json.loads((out / f"codes.{r}.json").read_text()) for r in range(world)]
    return {name: [c[name] for c in codes] for name, _ in cases}


def _reference(src: Path, prompts: list[str] = PROMPTS) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Single-process tokens (prompt + generated) and per-call logits of every prompt, float32."""
    from cvt.runtime.generate import generate
    from cvt.runtime.loader import load_model
    from cvt.runtime.tokenizer import load_tokenizer

    loaded = load_model(src, dtype=torch.float32)
    tok = load_tokenizer(loaded.checkpoint_path, loaded.config)
    ids = [tok.encode(p) for p in prompts]
    rec = launch.LogitsRecorder(loaded.model)
    res = generate(rec, ids, NEW_TOKENS, eos_id=tok.eos_id, device=torch.device("cpu"))
    return [p + o for p, o in zip(ids, res.outputs)], rec.per_prompt(ids)


def _check_dumps(out: Path, name: str, world: int, ref, prompts: list[str] = PROMPTS, atol: float = 1e-4) -> None:
    from safetensors.torch import load_file

    tokens, logits = ref
    for rank in range(world):
        d = load_file(out / f"{name}.{rank}.safetensors")
        for i in range(len(prompts)):
            assert d[f"tokens.{i}"].tolist() == tokens[i], (name, rank, i)
            torch.testing.assert_close(d[f"logits.{i}"], logits[i], atol=atol, rtol=1e-4,
                                       msg=lambda m: f"{name} rank {rank} prompt {i}: {m}")


# Sources with quantized activations (W8A8, int8 KV cache). Their ranks sum partial outputs across
# ranks (all-reduce) in another order than one process does, and a per-token or KV-cache int8
# rounding downstream can flip on that last bit (which ones depends on the CPU's float kernels):
# up to ~3e-2 of the logits' range, more for a token whose MoE routing then changes, and from there
# a different greedy token. So these are checked on the rank's own tokens (the single process
# replays them) with the int8 tolerance on every row but 1/8 of them. A wrong shard (scale, bias,
# KV heads, experts) moves most rows far beyond it.
QUANTIZED_ACTIVATIONS = {"qw-w8a8c8"}
INT8_TOLERANCE, FLIP_SHARE = 3e-2, 1 / 8


def _check_replayed(out: Path, name: str, world: int, src: Path) -> None:
    from safetensors.torch import load_file

    from cvt.runtime.loader import load_model
    from cvt.runtime.tokenizer import load_tokenizer

    loaded = load_model(src, dtype=torch.float32)
    tok = load_tokenizer(loaded.checkpoint_path, loaded.config)
    for rank in range(world):
        d = load_file(out / f"{name}.{rank}.safetensors")
        off = rows = 0
        for i, prompt in enumerate(PROMPTS):
            got, seq, n = d[f"logits.{i}"], d[f"tokens.{i}"], len(tok.encode(prompt))
            picks = got[n - 1:].argmax(-1)      # its greedy token after each row from the prompt's last on
            assert picks[: len(seq) - n].tolist() == seq[n:].tolist(), (name, rank, i)
            fed = torch.cat([seq[:n], picks[:-1]])     # what it fed: the prompt, then every pick but the last
            cache = loaded.model.new_cache(1, len(fed))
            want = torch.cat([loaded.model(fed[None, :n], 0, cache)]
                             + [loaded.model(fed[None, p:p + 1], p, cache) for p in range(n, len(fed))], dim=1)[0]
            assert want.shape == got.shape, (name, rank, i)
            diff = (got - want).abs().amax(-1)
            off += int((~(diff <= INT8_TOLERANCE * max(1.0, want.abs().max().item()))).sum())   # NaN is off
            rows += diff.numel()
        assert off <= FLIP_SHARE * rows, (name, rank, off, rows)


# ------------------------------------------------------------------------------ sources
@pytest.fixture(scope="module")
def sources(tmp_path_factory, fp8_release_session) -> dict[str, Path]:
    """Tiny BF16 DeepSeek-V3 and Qwen3-MoE (attention biases: a row-parallel o_proj bias), a
    w4a16 compressed-tensors DeepSeek, a w8a8c8 Ascend Qwen3 with static attention (o_proj
    quant_bias non-zero; int8 KV cache with per-channel scales, which each rank cuts to its KV
    heads) and the FP8 release (dequantized on load, per rank)."""
    from cvt.quant.stage import quantize

    root = tmp_path_factory.mktemp("dist-src")
    ds_cfg = tiny_deepseek_config()
    ds_cfg.pop("quantization_config")
    out = {"fp8": fp8_release_session, "ds": write_bf16_checkpoint(root / "ds", ds_cfg),
           "qw": write_bf16_checkpoint(root / "qw", tiny_qwen3_config(moe=True, attention_bias=True))}
    quantize(out["ds"], root / "ds-w4a16", scheme="w4a16", fmt="compressed-tensors", group_size=32, quiet=True)
    quantize(out["qw"], root / "qw-w8a8c8", scheme="w8a8c8", fmt="ascend", static_attention=True, quiet=True,
             target="mindie")  # vllm-ascend would drop Qwen3-MoE's C8 scales: refused for it
    out["ds-w4a16"], out["qw-w8a8c8"] = root / "ds-w4a16", root / "qw-w8a8c8"
    return out


def _config(src: Path) -> dict:
    return json.loads((src / "config.json").read_text())


def _mindie(path: Path, ranks_per_layer: list[list[list[int]]]) -> Path:
    """A hand-written MindIE / vllm-ascend expert map (layer_id = MoE-layer index)."""
    path.write_text(json.dumps({"moe_layer_count": len(ranks_per_layer), "layer_list": [
        {"layer_id": i, "device_count": len(ranks), "device_list": [
            {"device_id": r, "device_expert": ids} for r, ids in enumerate(ranks)]}
        for i, ranks in enumerate(ranks_per_layer)]}))
    return path


def _cases(sources, tmp: Path) -> dict[int, list[tuple[str, str, object]]]:
    """world -> [(case, source key, layout)]."""
    ds, qw = _config(sources["ds"]), _config(sources["qw"])
    eplb = write_placement(contiguous_placement(4, 2, redundant=2), tmp / "ds-redundant.json", ds, "eplb")
    mindie = _mindie(tmp / "qw-mindie.json", [[[0, 1], [2, 3], [3, 0], [1, 2]],
                                              [[3, 2], [1, 0], [0, 2], [1, 3]]])
    return {
        2: [("ds-tp2-ep2", "ds", make_layout(2, tp=2, ep=2)),
            ("qw-tp2-ep2", "qw", make_layout(2, tp=2, ep=2)),
            ("ds-w4a16-tp2-ep2", "ds-w4a16", make_layout(2, tp=2, ep=2)),
            # static attention splits exactly; dense_tp 1 keeps the dynamic MLP whole
            ("qw-w8a8c8-tp2-ep2", "qw-w8a8c8", make_layout(2, tp=2, ep=2, dense_tp=1)),
            # FP8 128-blocks do not survive tp 2 on the tiny model (192-row q_b_proj): EP only
            ("fp8-ep2", "fp8", make_layout(2, ep=2))],
        4: [("ds-tp2-ep4-embed4", "ds", make_layout(4, tp=2, ep=4, embed_tp=4, lmhead_tp=2)),
            ("ds-tp4-moetp2-ep2", "ds", make_layout(4, tp=4, ep=2, moe_tp=2, dense_tp=2, embed_tp=1)),
            ("ds-redundant-replicated", "ds", make_layout(4, tp=1, ep=2, moe_tp=2, shared_experts="replicated",
                                                          placement=read_placement(eplb, ds, 2))),
            ("qw-mindie-tp2-ep4", "qw", make_layout(4, tp=2, ep=4, placement=read_placement(mindie, qw, 4)))],
    }


@pytest.fixture(scope="module")
def sharded(sources, tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("dist-shards")
    out = {}
    for cases in _cases(sources, tmp).values():
        for name, key, layout in cases:
            out[name] = shard(sources[key], tmp / name, layout, quiet=True).dst
    return out


# ------------------------------------------------------------------------------ multi-rank runs
@pytest.mark.parametrize("world", [2, 4])
def test_multi_rank_matches_single_process(world, sources, sharded, tmp_path):
    cases = _cases(sources, tmp_path)[world]
    runs = [(name, sharded[name]) for name, _, _ in cases]
    if world == 2:  # a rank that refuses to start: every rank stops, none hangs
        bad = tmp_path / "altered"
        shutil.copytree(sharded["ds-tp2-ep2"], bad)
        _flip_byte(bad / "rank-00001" / "model-00001-of-00001.safetensors")
        runs.append(("altered", bad))
    codes = _spawn(world, runs, tmp_path)
    refs = {key: _reference(sources[key]) for key in {key for _, key, _ in cases} - QUANTIZED_ACTIVATIONS}
    for name, key, _ in cases:
        assert codes[name] == [0] * world, (name, codes[name])
        if key in QUANTIZED_ACTIVATIONS:
            _check_replayed(tmp_path / f"out-{world}", name, world, sources[key])
        else:
            _check_dumps(tmp_path / f"out-{world}", name, world, refs[key])
    if world == 2:
        assert codes["altered"][1] == 1 and codes["altered"][0] != 0
        assert not list((tmp_path / "out-2").glob("altered.*"))  # nobody got as far as generating


def test_cvt_run_world_size_launches_torchrun(sources, sharded, tmp_path):
    """...and leaves nothing in $TMPDIR (torchrun's agent made a torchelastic_* log folder there
    per launch and kept it: its TMPDIR is now the command's private one, `cvt.scratch`)."""
    tokens, _ = _reference(sources["qw"])
    from cvt.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(sources["qw"], _config(sources["qw"]))
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    r = run_cvt("run", sharded["qw-tp2-ep2"], "--procs", 2, "--prompt", PROMPTS[0], "--max-new-tokens",
                NEW_TOKENS, "--dtype", "fp32", "--device", "cpu", "--quiet", env={"TMPDIR": str(tmpdir)})  # ranks print to fd 1
    assert r.rc == 0, r.err
    assert r.out == tok.decode(tokens[0]) + "\n"
    assert sorted(p.name for p in tmpdir.iterdir()) == []


def test_cvt_run_world_size_from_a_folder_holding_cvt(sources, sharded, tmp_path):
    """Started from a directory holding a folder named `cvt` (e.g. the clone's parent): the ranks
    still import the installed package, not that folder (`python -m` puts the current directory
    first on sys.path). The folders are packages that fail on import: any process taking one fails
    (a clone's folder, a namespace package, failed the same way under an editable install)."""
    import subprocess
    import sys

    tokens, _ = _reference(sources["qw"])
    from cvt.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(sources["qw"], _config(sources["qw"]))
    here = tmp_path / "elsewhere"
    (here / "cvt").mkdir(parents=True)
    (here / "cvt" / "__init__.py").write_text("raise ImportError('imported ./cvt from the current directory')\n")
    (here / "torch").mkdir()  # nor torchrun's agent the torch package
    (here / "torch" / "__init__.py").write_text("raise ImportError('imported ./torch from the current directory')\n")
    # the console script, as a user runs it (`python -m cvt` would itself import ./cvt)
    cli = Path(sys.executable).with_name("cvt")
    cmd = [str(cli)] if cli.exists() else [sys.executable, "-c", "import sys; del sys.path[0]; "
                                           "from cvt.cli import main; main(sys.argv[1:])"]
    r = subprocess.run([*cmd, "run", str(sharded["qw-tp2-ep2"]), "--procs", "2", "--prompt", PROMPTS[0],
                        "--max-new-tokens", str(NEW_TOKENS), "--dtype", "fp32", "--device", "cpu", "--quiet"],
                       cwd=here, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == tok.decode(tokens[0]) + "\n"


# ------------------------------------------------------------------------------ refusals
def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # tensor data, same size
    path.write_bytes(bytes(data))


def test_topology_differing_from_manifest(sharded, monkeypatch, capsys):
    dst = sharded["ds-tp2-ep4-embed4"]
    with pytest.raises(CvtError, match=r"sharded for a world of 4 ranks .* but 2 were launched .*"
                                       r"--nproc-per-node 4"):
        launch.preflight(dst, 0, 2, prompts=["x"])
    # a plain `python -m cvt.runtime.launch` is a world of 1: refused before any weight is read
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr("cvt.runtime.parallel.load_rank", lambda *a, **k: pytest.fail("weights were loaded"))
    assert launch.main([str(dst), "--prompt", "x", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cvt: error: rank 0: ") and "1 were launched" in err


def test_missing_rank_file(sharded, tmp_path):
    dst = tmp_path / "dst"
    shutil.copytree(sharded["ds-tp2-ep2"], dst)
    (dst / "rank-00001" / "model-00001-of-00001.safetensors").unlink()
    with pytest.raises(ManifestError, match=r"rank-00001/model-00001-of-00001.safetensors: missing"):
        launch.preflight(dst, 1, 2, prompts=["x"])
    launch.preflight(dst, 0, 2, prompts=["x"])  # a rank checks only its own files


def test_altered_rank_file(sharded, tmp_path):
    dst = tmp_path / "dst"
    shutil.copytree(sharded["ds-tp2-ep2"], dst)
    _flip_byte(dst / "rank-00001" / "model-00001-of-00001.safetensors")
    with pytest.raises(ManifestError, match=r"rank-00001/model-00001-of-00001.safetensors: blake3 differs"):
        launch.preflight(dst, 1, 2, prompts=["x"])
    launch.preflight(dst, 1, 2, prompts=["x"], verify_files=False)  # --no-verify-files: sizes only


def test_layout_checked_against_config(sharded, tmp_path):
    dst = tmp_path / "dst"
    shutil.copytree(sharded["ds-tp4-moetp2-ep2"], dst)
    cfg = dst / "config.json"
    cfg.write_text(cfg.read_text().replace('"num_attention_heads": 4', '"num_attention_heads": 6'))
    with pytest.raises(CvtError, match="config.json: blake3 differs"):
        launch.preflight(dst, 0, 4, prompts=["x"])
    with pytest.raises(CvtError, match=r"num_attention_heads = 6 heads: tp 4 does not divide it"):
        launch.preflight(dst, 0, 4, prompts=["x"], verify_files=False)


def test_single_process_run_on_sharded_dir(sharded, capsys):
    from cvt.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["run", str(sharded["ds-tp2-ep2"]), "--prompt", "x"])
    assert exc.value.code == 1
    assert "is sharded for 2 ranks: run it with `cvt run" in capsys.readouterr().err
    from cvt.runtime.loader import load_model

    with pytest.raises(ManifestError, match="sharded for 2 ranks"):
        load_model(sharded["ds-tp2-ep2"])
