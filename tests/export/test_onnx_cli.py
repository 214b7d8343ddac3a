"""`cvt export onnx` and `cvt run --backend onnxruntime` through the real CLI entry point
(`cvt.cli.main`, in-process), bad input with one-line errors, and a DST that never looks
complete unless it is."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from cvt.cli import main
from cvt.testing.checkpoints import tiny_qwen3_config, write_bf16_checkpoint
from cvt.export import onnx_models
from cvt.quant.stage import quantize


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(bf16 dir, w4a16 g16 dir) of a tiny Qwen3-MoE."""
    root = tmp_path_factory.mktemp("cli-src")
    bf16 = write_bf16_checkpoint(root / "bf16", tiny_qwen3_config(moe=True))
    w4 = root / "w4a16"
    quantize(bf16, w4, scheme="w4a16", group_size=16, quiet=True)
    return bf16, w4


def cvt(capsys, *args) -> tuple[int, str, str]:
    """Run `cvt ARGS` in-process: (exit code, stdout, stderr)."""
    try:
        main([str(a) for a in args])
        rc = 0
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return rc, out.out, out.err


def new_tokens(out: str) -> list[str]:
    return re.findall(r"new tokens: \[([^\]]*)\]", out)


@pytest.mark.slow
def test_export_verify_then_run_with_onnxruntime(qwen, tmp_path, capsys):
    _, w4 = qwen
    dst = tmp_path / "onnx"
    rc, out, err = cvt(capsys, "export", "onnx", w4, dst, "--verify")
    assert rc == 0, err
    assert f"wrote {dst / 'model.onnx'}" in out and "w4a16:matmulnbits" in out
    assert "greedy tokens agree: yes: PASS" in out and "max |diff|" in out
    assert {"model.onnx", "export_manifest.json", "config.json", "tokenizer.json"} <= {p.name for p in dst.iterdir()}
    ids = "256,72,101,108,108,111"
    rc, out, err = cvt(capsys, "run", "--backend", "onnxruntime", dst, "--input-ids", ids, "--max-new-tokens", "6")
    assert rc == 0, err
    assert "onnxruntime" in out and "decode" in out and "tokens/s" in out
    rc, ref, err = cvt(capsys, "run", w4, "--input-ids", ids, "--max-new-tokens", "6", "--dtype", "fp32",
                       "--device", "cpu")
    assert rc == 0, err
    assert new_tokens(out) == new_tokens(ref) and len(new_tokens(out)) == 1
    rc, quiet, _ = cvt(capsys, "run", "--backend", "onnxruntime", dst, "--prompt", "Hi", "--max-new-tokens", "2", "-q")
    assert rc == 0 and quiet.startswith("Hi") and "tokens/s" not in quiet


def test_help_lists_options(capsys):
    rc, out, _ = cvt(capsys, "export", "onnx", "--help")
    assert rc == 0
    for opt in ("--scope", "--layer", "--dtype", "--int4-op", "--w8a8-op", "--opset", "--verify", "--overwrite",
                "--quiet", "--debug"):
        assert opt in out
    rc, out, _ = cvt(capsys, "run", "--help")
    assert rc == 0 and "--backend [torch|onnxruntime]" in out


def _bad_sources(tmp_path, bf16):
    empty = tmp_path / "empty"
    empty.mkdir()
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(bf16 / "config.json", no_weights / "config.json")
    mistral = tmp_path / "mistral"
    shutil.copytree(bf16, mistral)
    cfg = json.loads((mistral / "config.json").read_text())
    (mistral / "config.json").write_text(json.dumps({**cfg, "model_type": "mistral"}))
    return {"empty": empty, "no-weights": no_weights, "mistral": mistral}


BAD = [
    ("empty", [], "empty: no config.json"),
    ("no-weights", [], "no .safetensors files and no model.safetensors.index.json"),
    ("mistral", [], "model_type 'mistral' cannot be exported (supported: deepseek_v3"),
    ("missing", [], "no such directory"),
    ("bf16", ["--int4-op", "qdq", "--opset", "17"], "--int4-op qdq needs --opset 21 or higher"),
    ("bf16", ["--opset", "12"], "--opset 12 is outside the range"),
    ("bf16", ["--scope", "layer", "--layer", "3"], "--layer 3 is outside 0..2 (3 decoder layers)"),
    ("bf16", ["--layer", "1"], "--layer applies to --scope layer or block only"),
    ("exists", [], "already exists and is not empty (1 entries, e.g. mine.txt); pass --overwrite to replace it"),
]


@pytest.mark.parametrize("which,extra,message", BAD, ids=[f"{w}{''.join(e)}" for w, e, _ in BAD])
def test_bad_input_is_one_clear_line(qwen, tmp_path, capsys, which, extra, message):
    bf16, _ = qwen
    srcs = {**_bad_sources(tmp_path, bf16), "bf16": bf16, "exists": bf16, "missing": tmp_path / "nowhere" / "x"}
    dst = tmp_path / "out"
    if which == "exists":
        dst.mkdir()
        (dst / "mine.txt").write_text("keep")
    rc, out, err = cvt(capsys, "export", "onnx", srcs[which], dst, *extra)
    assert rc != 0
    assert err.startswith("cvt: error: ") and err.count("\n") == 1, err
    assert message in err, err
    if which == "exists":
        assert (dst / "mine.txt").read_text() == "keep" and len(list(dst.iterdir())) == 1
    else:
        assert not dst.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # nothing beside DST


def test_onnx_backend_refuses_what_it_cannot_run(qwen, tmp_path, capsys):
    bf16, _ = qwen
    rc, _, err = cvt(capsys, "run", "--backend", "onnxruntime", bf16, "--prompt", "x")
    assert rc != 0 and "no export_manifest.json; not a finished `cvt export onnx` output" in err
    rc, _, err = cvt(capsys, "export", "onnx", bf16, tmp_path / "layer", "--scope", "layer", "-q")
    assert rc == 0, err
    rc, _, err = cvt(capsys, "run", "--backend", "onnxruntime", tmp_path / "layer", "--prompt", "x")
    assert rc != 0 and "an export of --scope layer (graphs: layer_0); generation needs a --scope model export" in err
    rc, _, err = cvt(capsys, "export", "onnx", tmp_path / "layer", tmp_path / "again")
    assert rc != 0 and "an ONNX export, not a checkpoint" in err
    rc, _, err = cvt(capsys, "run", "--backend", "onnxruntime", tmp_path / "layer", "--prompt", "x", "--device", "cuda")
    assert rc != 0 and "--backend onnxruntime runs on one CPU process" in err


def test_failed_export_leaves_no_dst_and_keeps_the_old_one(qwen, tmp_path, capsys, monkeypatch):
    """A crash while writing removes the hidden temp dir; --overwrite replaces DST only once the
    new export is complete."""
    bf16, _ = qwen
    dst = tmp_path / "onnx"

    def crash(*a, **k):
        raise RuntimeError("disk on fire")

    with monkeypatch.context() as mp:
        mp.setattr(onnx_models, "build_model_graph", crash)
        rc, _, err = cvt(capsys, "export", "onnx", bf16, dst)
        assert rc != 0 and "disk on fire" in err
        assert not dst.exists() and not list(tmp_path.glob(".onnx*"))
        assert cvt(capsys, "export", "onnx", bf16, dst, "--scope", "layer", "-q")[0] == 0
        old = json.loads((dst / "export_manifest.json").read_text())
        rc, _, err = cvt(capsys, "export", "onnx", bf16, dst, "--overwrite")
        assert rc != 0 and json.loads((dst / "export_manifest.json").read_text()) == old
    rc, _, err = cvt(capsys, "export", "onnx", bf16, dst, "--overwrite", "-q")
    assert rc == 0, err
    m = json.loads((dst / "export_manifest.json").read_text())
    assert m["scope"] == "model" and not (dst / "layer_0.onnx").exists()
    assert not list(tmp_path.glob(".onnx*")) and not (dst / ".cvt-tmp").exists()  # nothing beside DST, no temp


@pytest.mark.slow
def test_w4a8_export_keeps_the_int8_activation_step(qwen, tmp_path, capsys):
    """Issue 24 item 6a: a W4A8_DYNAMIC linear was exported as its dequantized float weight (no
    per-token int8 activation step: max diff 0.079, other greedy tokens). Now it is the W8A8
    dynamic graph with int4 values held as int8, and the parity check passes."""
    src = tmp_path / "w4a8"
    quantize(qwen[0], src, scheme="w4a8", fmt="ascend", quiet=True)
    rc, out, err = cvt(capsys, "export", "onnx", src, tmp_path / "onnx", "--verify", "--quiet")
    assert rc == 0, (out, err)
    manifest = json.loads((tmp_path / "onnx" / "export_manifest.json").read_text())
    assert manifest["linears"]["w4a8_dynamic:integer"] > 0
    assert "w4a8_dynamic:dequantized" not in manifest["linears"]
    assert "greedy tokens agree: yes: PASS" in out


def test_sharded_source_is_refused_naming_what_to_export(qwen, tmp_path, capsys):
    """A `cvt shard` output: one line saying it needs the unsharded checkpoint, and which one
    (it said "no .safetensors files"); nothing is written."""
    from cvt.convert.placement import make_layout
    from cvt.convert.shard import shard

    bf16, _ = qwen
    sharded = shard(bf16, tmp_path / "sh", make_layout(ep=2), quiet=True).dst
    rc, out, err = cvt(capsys, "export", "onnx", sharded, tmp_path / "onnx")
    assert rc == 1 and out == ""
    assert err == (f"cvt: error: {sharded}: a cvt shard output (2 per-rank directories); export onnx needs an "
                   f"unsharded checkpoint: pass the one it was sharded from, {bf16}\n")
    assert not (tmp_path / "onnx").exists()


def test_the_exported_attention_kinds_are_the_graphs():
    """`onnx_export.EXPORTED_KINDS` (checked before onnx is imported) names the kinds `GRAPHS` emits."""
    from cvt.export import onnx_models
    from cvt.export.onnx_export import EXPORTED_KINDS, exportable_types

    assert set(EXPORTED_KINDS) == set(onnx_models.GRAPHS)
    assert set(exportable_types()) == {"deepseek_v3", "kimi_k2", "qwen3_moe", "qwen3", "qwen2", "llama"}
