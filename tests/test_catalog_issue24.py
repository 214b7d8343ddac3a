"""The bad-input catalog, issue 24 (tests/test_catalog.py holds issue 13's): symlinks where cvt
makes or clears its own folders in DST (``.cvt-calib``, ``rank-*``), --overwrite beside files no
cvt run recorded, a verify report inside a checkpoint it reads
(`test_overwrite_deletes_only_recorded_files` and `test_no_temp_folders_left` cover the
successful runs); a second run while the first calibrates; a report on a full disk; numbers no
option may hold (NaN, inf, 1e400, 0.5 bytes) and options that do not apply (exit 2, naming the
option); configs and calibration state files that are garbage, truncated or of another kind (one
line, never an internal error); a state file changed since cvt wrote it (its recorded sha256), or
a state of another SRC with the same names, sizes and mtimes (refused, never consumed).

Each case runs through tests/catalog_harness.py's `_check`, which lists the contract it asserts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from cvt.qtensor.schemes import scheme_names
from cvt.testing.checkpoints import write_bf16_checkpoint, write_safetensors
from cvt.tests import catalog_harness as H
from cvt.tests.catalog_harness import (_CALIBRATING, _GPTQ, Case, Ctx, _edit_tensors, _nothing, _overlap, _quantize,
                                       _tree_hash, _verb, _verify, _written_outside, bad_input_params, run_bad_input)
from cvt.tests.catalog_harness import sources  # noqa: F401 (a fixture)
from cvt.tests.conftest import run_cvt


# ------------------------------------------------------------------- issue 24, items 8-11
def _calibrating(ctx: Ctx):
    """A GPTQ quantize stopped (SIGSTOP) after its first calibrated layer, holding DST; the case's
    RTN quantize into the same DST must be refused. Continued when the case ends: it finishes."""
    src = ctx.copy("qwen")
    dst = ctx.tmp / "out"
    env = {**os.environ, "CVT_TEST_STOP_AFTER_LAYER": "0", "PYTHONUNBUFFERED": "1"}
    env.pop("CVT_DEBUG", None)
    p = subprocess.Popen([sys.executable, "-m", "cvt", "quantize", str(src), str(dst), *_GPTQ, "--quiet"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not _stopped(p.pid):
        assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.poll() is not None else "slow"
        time.sleep(0.05)
    assert (dst / ".cvt-calib").is_dir() and not (dst / ".cvt-state.json").exists()  # still calibrating
    _CALIBRATING[ctx.tmp] = p
    return ["quantize", src, dst, "--scheme", "w8a8"], src, dst


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _full_disk_report(ctx: Ctx):
    """verify --report into a 16 KiB tmpfs: the html and md fit, report.json does not."""
    mnt = ctx.tmp / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.decode().strip()}")
    (ctx.tmp / ".mounted").write_text(str(mnt))
    ref = ctx.copy("qwen", "ref")
    cand = ctx.copy("qwen", "cand")
    report = mnt / "report"
    return ["verify", cand, "--reference", ref, "--report", report, "--max-sequences", "1", "--seq-len", "32"], \
        cand, report


_KILLED: dict[str, Path] = {}


def _killed_state(ctx: Ctx) -> Path:
    """A GPTQ run's DST killed (kill -9) after layer 0 was calibrated: .cvt-calib holds layer 0."""
    if "qwen" not in _KILLED:
        dst = ctx.tmp.parent / "killed-gptq"
        r = run_cvt("quantize", ctx.qwen, dst, *_GPTQ, "--quiet", env={"CVT_TEST_KILL_AFTER_LAYER": "0"})
        assert r.rc == -signal.SIGKILL and (dst / ".cvt-calib" / "layer-0.json").is_file(), r.err
        _KILLED["qwen"] = dst
    return _KILLED["qwen"]


def _bad_state(edit: Callable[[Path], None], forge: bool = False, prep: Callable[[Ctx, Path], None] = None):
    """The killed GPTQ state, edited, resumed. `forge`: state.json's records (size, sha256 of
    every state file: the older records' algorithm, still read) rewritten to match the edited files, so that the readers' own checks are
    what refuses it; else the records catch the edit. `prep(ctx, src)`: SRC edited first."""
    def build(ctx: Ctx):
        src = ctx.copy("qwen")
        if prep is not None:
            prep(ctx, src)
        dst = ctx.tmp / "out"
        shutil.copytree(_killed_state(ctx), dst)
        edit(dst / ".cvt-calib")
        if forge:
            st = json.loads((dst / ".cvt-calib" / "state.json").read_text())
            st["files"] = {n: {"size": (dst / ".cvt-calib" / n).stat().st_size,
                               "sha256": hashlib.sha256((dst / ".cvt-calib" / n).read_bytes()).hexdigest()}
                           for n in st["files"]}
            (dst / ".cvt-calib" / "state.json").write_text(json.dumps(st))
        return ["quantize", src, dst, *_GPTQ], src, dst
    return build


def _scaled_x3(state: Path):
    """Layer 0's q_proj scales times 3: the same size, other bytes (a resume would consume them)."""
    from safetensors.torch import load_file

    p = state / "layer-0.safetensors"
    size = p.stat().st_size
    tensors = {k: v.clone() for k, v in load_file(p).items()}  # not views of the file rewritten below
    tensors["q/model.layers.0.self_attn.q_proj/weight_scale"] *= 3
    write_safetensors(p, tensors)
    assert p.stat().st_size == size


def _other_weights_same_mtimes(ctx, src):
    """SRC another checkpoint with the killed run's names, sizes and mtimes (a fine-tune, then
    ``touch -r`` from the original): every float weight scaled by 1.25."""
    import torch

    def change(name, t):
        if t.dtype == torch.bfloat16:
            t.mul_(1.25)
            return True
    _edit_tensors(src, change)
    for p in src.iterdir():
        st = (ctx.qwen / p.name).stat()
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert p.stat().st_size == st.st_size


def _truncate(name: str, size: int):
    def edit(state: Path):
        with open(state / name, "r+b") as f:
            f.truncate(size)
    return edit


def _garbage(name: str):
    def edit(state: Path):
        p = state / name
        p.write_bytes(os.urandom(p.stat().st_size))
    return edit


def _other_method(state: Path):
    p = state / "layer-0.json"
    p.write_text(p.read_text().replace('"gptq"', '"awq"'))


def _edit_config_with(**changes):
    def prep(ctx, src):
        ctx.edit_config(src, **changes)
    return prep


def _fp8_block(block):
    def prep(ctx, src):
        cfg = json.loads((src / "config.json").read_text())
        cfg["quantization_config"]["weight_block_size"] = block
        (src / "config.json").write_text(json.dumps(cfg))
    return prep


def _config_bytes(data: bytes):
    def prep(ctx, src):
        (src / "config.json").write_bytes(data)
    return prep


def _manifest_size(ctx, src):
    m = json.loads((src / "cvt_manifest.json").read_text())
    m["files"][0]["size"] += 1
    (src / "cvt_manifest.json").write_text(json.dumps(m))


def _rewrite_qwen(**overrides):
    """SRC replaced by a Qwen3-MoE with other sizes (weights and config agreeing)."""
    def prep(ctx, src):
        from cvt.testing.checkpoints import tiny_qwen3_config

        shutil.rmtree(src)
        write_bf16_checkpoint(src, tiny_qwen3_config(moe=True, **overrides))
    return prep


def _calib_file(ctx, src):
    (ctx.tmp / "calib.txt").write_text("some calibration text " * 20)


def _fifo(ctx, src):
    os.mkfifo(ctx.tmp / "calib.fifo")


def _calib_dir_is_file(ctx: Ctx):
    src = ctx.copy("qwen")
    dst = ctx.tmp / "out"
    dst.mkdir()
    (dst / ".cvt-calib").write_text("")
    return ["quantize", src, dst, "--scheme", "w8a8", "--method", "smoothquant"], src, dst


def _verify_other_model(ctx: Ctx):
    ref = ctx.copy("bf16", "ref")
    cand = ctx.copy("qwen", "cand")
    return ["verify", cand, "--reference", ref, "--report", ctx.tmp / "report", "--max-sequences", "1",
            "--seq-len", "16"], cand, ctx.tmp / "report"


def _sized(verb: list[str], which: str, option: str, value: str, *extra, dst_name: str | None = "out"):
    return _verb(verb, which, _nothing, option, value, *extra, dst_name=dst_name)


_NOT_FINITE = "is not a finite number"
_BAD_SIZE = "Invalid value for '{}': size '{}'"
ISSUE_24 = [
    # item 8: the lock covers calibration
    Case("quantize-while-another-calibrates", _calibrating, "another cvt run is writing to this directory"),
    # item 9: a full disk leaves no complete-looking report and names the file
    Case("verify-report-full-disk", _full_disk_report, "report.json: write failed"),
    # item 10/11: numbers, one click type each (exit 2, naming the option)
    *[Case(f"quantize-max-shard-size-{v}", _sized(["quantize"], "qwen", "--max-shard-size", v, "--scheme", "w8a8"),
           _BAD_SIZE.format("--max-shard-size", v), rc=2) for v in ("inf", "nan", "1e400", "0.5", "1e-30", "abc")],
    Case("quantize-expert-memory-nan", _sized(["quantize"], "qwen", "--expert-memory", "nan", "--scheme", "w8a8"),
         _BAD_SIZE.format("--expert-memory", "nan"), rc=2),
    Case("fp8-to-bf16-max-shard-size-zero", _sized(["fp8-to-bf16"], "fp8", "--max-shard-size", "1e-30GB"),
         "size '1e-30GB' is less than one byte", rc=2),
    Case("shard-max-shard-size-inf", _sized(["shard"], "fp8", "--max-shard-size", "inf", "--ep", "2"),
         _BAD_SIZE.format("--max-shard-size", "inf"), rc=2),
    Case("plan-hbm-1e400", _sized(["plan"], "fp8", "--hbm", "1e400", "--ep", "2", dst_name=None),
         _BAD_SIZE.format("--hbm", "1e400"), rc=2),
    Case("shard-dry-run-hbm-nan", _sized(["shard"], "fp8", "--hbm", "nan", "--ep", "2", "--dry-run", dst_name=None),
         _BAD_SIZE.format("--hbm", "nan"), rc=2),
    Case("run-temperature-nan", _verb(["run"], "qwen", _nothing, "--input-ids", "1,2", "--temperature", "nan",
                                      dst_name=None), f"Invalid value for '--temperature': 'nan' {_NOT_FINITE}", rc=2),
    Case("run-top-p-nan", _verb(["run"], "qwen", _nothing, "--input-ids", "1,2", "--top-p", "nan", dst_name=None),
         f"Invalid value for '--top-p': 'nan' {_NOT_FINITE}", rc=2),
    Case("run-seed-2-70", _verb(["run"], "qwen", _nothing, "--input-ids", "1,2", "--seed", str(2**70), dst_name=None),
         "Invalid value for '--seed'", rc=2),
    Case("run-prompt-not-utf8", _verb(["run"], "qwen", _nothing, "--prompt", "ab\udcff\udcfe", dst_name=None),
         "--prompt 'ab\\xff\\xfe': not UTF-8 text"),
    Case("verify-min-cosine-2", _verify("qwen", _nothing, "--min-cosine", "2"),
         "Invalid value for '--min-cosine': 2.0 is not in the range -1<=x<=1", rc=2),
    # item 10: configs
    *[Case(f"{v[0]}-quantization-config-string", _verb(v, "fp8", _edit_config_with(quantization_config="fp8"),
                                                       *{"shard": ["--ep", "2"], "plan": ["--ep", "2"], "quantize": ["--scheme", "w8a8"]}.get(v[0], []),
                                                       dst_name=None if v[0] in ("inspect", "plan") else "out"),
           "quantization_config is str 'fp8'; expected an object")
      for v in (["fp8-to-bf16"], ["quantize"], ["shard"], ["inspect"], ["plan"], ["export", "onnx"])],
    Case("shard-block-size-zero", _verb(["shard"], "fp8", _fp8_block([0, 0]), "--ep", "2"),
         "weight_block_size is [0, 0]"),
    Case("inspect-block-size-one-dim", _verb(["inspect"], "fp8", _fp8_block([128]), dst_name=None),
         "weight_block_size is [128]"),
    Case("plan-block-size-zero", _verb(["plan"], "fp8", _fp8_block([0, 0]), "--ep", "2", dst_name=None),
         "weight_block_size is [0, 0]"),
    Case("quantize-config-nested", _quantize("qwen", _config_bytes(b"[" * 100000 + b"]" * 100000)),
         "config.json: JSON nested too deeply"),
    Case("run-config-binary", _verb(["run"], "qwen", _config_bytes(b"\x83\xff" + bytes(range(256))), "--input-ids",
                                    "1,2", dst_name=None), "config.json: not UTF-8 JSON text"),
    Case("verify-qwen-against-deepseek", _verify_other_model, "is a qwen3 model and the reference"),
    # item 10: calibration state files (a GPTQ run killed after layer 0, then edited)
    # (forged: state.json's records rewritten to match, so each reader's own check is tested)
    Case("quantize-state-truncated", _bad_state(_truncate("layer-0.safetensors", 5000), forge=True),
         "layer-0.safetensors: calibration state unreadable"),
    Case("quantize-state-garbage-json", _bad_state(_garbage("layer-0.json"), forge=True),
         "layer-0.json: calibration state unreadable"),
    Case("quantize-state-short-input", _bad_state(_truncate("x-1.bin", 1000), forge=True),
         "x-1.bin: calibration state unreadable"),
    Case("quantize-state-other-method", _bad_state(_other_method, forge=True), "was calibrated by awq, this run uses gptq"),
    # item 6b: the state is checksummed (each file's size and sha256 recorded as it was written)
    # and keyed on SRC's content, not its names, sizes and mtimes
    Case("quantize-state-scaled-x3", _bad_state(_scaled_x3),
         "layer-0.safetensors: calibration state file changed since cvt wrote it (blake3 "),
    Case("quantize-state-truncated-unforged", _bad_state(_truncate("layer-0.safetensors", 5000)),
         "layer-0.safetensors: calibration state file changed since cvt wrote it (5000 bytes, 112896 recorded); "
         "re-run with --no-resume"),
    Case("quantize-state-other-json", _bad_state(_other_method),
         "layer-0.json: calibration state file changed since cvt wrote it"),
    Case("quantize-state-foreign-src", _bad_state(lambda state: None, prep=_other_weights_same_mtimes),
         ".cvt-calib/state.json: calibration state of another source (model-00001-of-00002.safetensors differs); "
         "re-run with --no-resume"),
    # item 11: options that do not apply, messages that name the right thing
    Case("quantize-asym-w4a8", _quantize("qwen", _nothing, "--asym"), "--asym applies to w4a16 only, not w8a8", rc=2),
    Case("quantize-asym-w4a8-ascend", _verb(["quantize"], "qwen", _nothing, "--scheme", "w4a8", "--format", "ascend",
                                            "--asym"), "--asym applies to w4a16 only, not w4a8", rc=2),
    Case("quantize-fp4-format-with-w8a8", _quantize("qwen", _nothing, "--fp4-format", "mxfp4"),
         "--fp4-format applies to --scheme fp4 (or a recipe rule with it), not w8a8", rc=2),
    Case("quantize-calib-with-rtn", _quantize("qwen", _calib_file, "--calib", "CALIB"),
         "nothing in this run calibrates", rc=2),
    Case("quantize-calib-dev-zero", _verb(["quantize"], "qwen", _nothing, "--scheme", "w8a8", "--method",
                                          "smoothquant", "--calib", "/dev/zero"), "/dev/zero: not a regular file"),
    Case("quantize-calib-fifo", _verb(["quantize"], "qwen", _fifo, "--scheme", "w8a8", "--method", "smoothquant",
                                      "--calib", "FIFO"), "calib.fifo: not a regular file"),
    Case("quantize-calib-dir-is-a-file", _calib_dir_is_file, ".cvt-calib: exists and is not a directory"),
    Case("quantize-missing-scheme", _verb(["quantize"], "qwen", _nothing),
         "Missing option '--scheme'. Choose from: " + ", ".join(scheme_names()), rc=2),  # the registry's, sorted
    Case("shard-ep-3", _verb(["shard"], "fp8", _nothing, "--ep", "3"), "cannot shard this model: config.n_routed_experts"),
    Case("export-onnx-dst-is-src-no-overwrite", _overlap(["export", "onnx"], "qwen", overwrite=False),
         "DST is the source directory"),
    Case("shard-manifest-size", _verb(["shard"], "bf16", _manifest_size, "--ep", "2"), "the manifest says"),
    Case("quantize-w4a8-k-not-16", _verb(["quantize"], "qwen", _rewrite_qwen(moe_intermediate_size=40), "--scheme",
                                         "w4a8", "--format", "ascend"),
         "mlp.experts.0.down_proj.weight [96, 40]: scale_bias sums in_features in 16 runs, which must be a multiple of 16"),
    Case("quantize-w4a8-rows-not-8", _verb(["quantize"], "qwen", _rewrite_qwen(hidden_size=84, head_dim=21),
                                           "--scheme", "w4a8", "--format", "ascend"),
         "model.layers.1.mlp.experts.0.down_proj.weight [84, 48]"),
    Case("plan-w4a8-k-not-16", _verb(["plan"], "qwen", _edit_config_with(moe_intermediate_size=40), "--scheme", "w4a8",
                                     "--format", "ascend", "--ep", "2", dst_name=None),
         "mlp.experts.0.down_proj.weight [96, 40]", rc=3, form="report"),
]


def _calib_link(*extra):
    """DST/.cvt-calib a symlink to a folder outside DST holding a file: the calibration state's
    clean-up deleted that file, and the run exited 0 (issue 24)."""
    def build(ctx: Ctx):
        src = ctx.copy("fp8")
        dst = ctx.tmp / "out"
        dst.mkdir()
        victim = ctx.outside / "somedir"
        victim.mkdir()
        (victim / "precious.txt").write_text("not cvt's")
        (dst / ".cvt-calib").symlink_to(victim)
        return ["quantize", src, dst, "--scheme", "w8a8c8", "--format", "ascend", "--calib-tokens", "256",
                "--quiet", *extra], src, dst
    return build


def _rank_link(resume: bool):
    """DST/rank-00000 a symlink to a folder outside DST: shard wrote rank 0's files through it."""
    def build(ctx: Ctx):
        src = ctx.copy("bf16")
        dst = ctx.tmp / "out"
        target = ctx.outside / "rank-00000"
        if resume:  # a killed run of the same command (its journal, no manifest), rank 0 moved out and linked
            assert run_cvt("shard", src, dst, "--ep", "2", "--quiet").rc == 0
            m = json.loads((dst / "cvt_manifest.json").read_text())
            files = {f["path"]: {"size": f["size"], "blake3": f["blake3"], "tensors": f["tensors"]} for f in m["files"]}
            (dst / ".cvt-state.json").write_text(json.dumps({"plan_id": m["plan_id"], "files": files}))
            (dst / "cvt_manifest.json").unlink()
            shutil.move(dst / "rank-00000", target)
        else:  # a DST no cvt run wrote, taken with --overwrite
            dst.mkdir()
            target.mkdir()
            (target / "notes.txt").write_text("not cvt's")
        (dst / "rank-00000").symlink_to(target)
        return ["shard", src, dst, "--ep", "2", "--quiet", *([] if resume else ["--overwrite"])], src, dst
    return build


def _convert_beside_foreign(ctx: Ctx):
    """fp8-to-bf16 --overwrite into a DST holding a config.json no cvt run wrote: it was replaced."""
    src = ctx.copy("fp8")
    dst = ctx.tmp / "out"
    dst.mkdir()
    (dst / "config.json").write_text('{"mine": true}')
    return ["fp8-to-bf16", src, dst, "--overwrite", "--quiet"], src, dst


def _export_beside_foreign(ctx: Ctx):
    """--overwrite into a DST holding files no cvt run wrote, one named like a file the export
    writes: the export removed the whole DST (issue 24); now nothing unrecorded is replaced."""
    src = ctx.copy("qwen")
    dst = ctx.tmp / "onnx"
    (dst / "data").mkdir(parents=True)
    (dst / "data" / "keep.bin").write_bytes(b"\x00mine")
    (dst / "config.json").write_text('{"mine": true}')
    return ["export", "onnx", src, dst, "--overwrite", "--quiet"], src, dst


CASES = [
    *ISSUE_24,
    # --- issue 24: cvt's own folders in DST are never links; --overwrite keeps unrecorded files;
    # a report is never written into a checkpoint being read
    Case("quantize-calib-state-symlink", _calib_link(), ".cvt-calib: is a symlink"),
    Case("quantize-calib-state-symlink-no-resume", _calib_link("--no-resume"), ".cvt-calib: is a symlink"),
    Case("shard-rank-dir-symlink-resume", _rank_link(resume=True), "rank-00000: is a symlink"),
    Case("shard-rank-dir-symlink-overwrite", _rank_link(resume=False),
         "rank-00000: exists and no cvt run recorded it"),
    Case("fp8-to-bf16-overwrite-unrecorded-file", _convert_beside_foreign,
         "config.json: exists and no cvt run recorded it"),
    Case("export-onnx-overwrite-unrecorded-file", _export_beside_foreign, "config.json: exists and no cvt run recorded it"),
    Case("verify-report-inside-candidate", _verify("qwen", _nothing, report_in="cand"),
         "--report is inside the candidate checkpoint"),
    Case("verify-report-inside-reference", _verify("qwen", _nothing, report_in="ref"),
         "--report is inside the reference checkpoint"),
    Case("verify-report-symlink-into-candidate", _verify("qwen", _nothing, report_in="link"),
         "--report is inside the candidate checkpoint"),
]


@pytest.mark.parametrize("case", bad_input_params(CASES), ids=[c.id for c in CASES])
def test_bad_input(case: Case, sources, tmp_path):
    run_bad_input(case, sources, tmp_path)


# ------------------------------------------------------------ issue 24: the runs that succeed
OVERWRITE = {  # verb -> (argv before SRC DST, source, options): each a run other than the one DST holds
    "fp8-to-bf16": (["fp8-to-bf16"], "fp8", ["--max-shard-size", "1MB"]),
    "quantize": (["quantize"], "qwen", ["--scheme", "w8a8"]),
    "shard": (["shard"], "bf16", ["--ep", "2"]),
    "export-onnx": (["export", "onnx"], "qwen", []),
}


@pytest.mark.parametrize("verb", OVERWRITE)
def test_overwrite_deletes_only_recorded_files(verb, sources, tmp_path):
    """--overwrite of an earlier cvt run's output that also holds files no cvt run wrote: the
    earlier run's recorded files go, everything else stays with its bytes, nothing is written
    outside DST (export onnx removed the whole DST and kept a lock file beside it)."""
    fp8, bf16, qwen = sources
    ctx = Ctx(tmp_path, fp8, bf16, qwen)
    argv, which, opts = OVERWRITE[verb]
    src = ctx.copy(which)
    dst = ctx.copy("bf16", "out")  # the earlier run: a cvt fp8-to-bf16 output
    old = {f["path"] for f in json.loads((dst / "cvt_manifest.json").read_text())["files"]}
    (dst / "notes.txt").write_text("mine")
    (dst / "data").mkdir()
    (dst / "data" / "keep.bin").write_bytes(b"\x00mine")
    (dst / "linked").symlink_to(ctx.outside / "secret.json")
    foreign = {k: v for k, v in _tree_hash(dst).items() if k.split("/")[0] in ("notes.txt", "data", "linked")}
    beside = sorted(p.name for p in tmp_path.iterdir())
    outside = _tree_hash(ctx.outside)
    H._OPENED = []
    H._WRITTEN.clear()
    try:
        r = run_cvt(*argv, src, dst, *opts, "--overwrite", "--quiet")
    finally:
        H._OPENED = None
    assert r.rc == 0, r.err
    after = _tree_hash(dst)
    assert {k: after.get(k) for k in foreign} == foreign, "an unrecorded file was changed or deleted"
    manifest = json.loads(((dst / "export_manifest.json") if verb == "export-onnx" else
                           (dst / "cvt_manifest.json")).read_text())
    new = {f["path"] for f in manifest["files"]}
    assert not [p for p in old - new if (dst / p).exists()], "a file of the earlier run survived"
    assert sorted(p.name for p in tmp_path.iterdir()) == beside, "written beside DST"
    assert not [k for k in after if k.startswith(".")], "a temp or state file was left in DST"
    assert _tree_hash(ctx.outside) == outside
    assert not _written_outside(H._WRITTEN, dst), _written_outside(H._WRITTEN, dst)


@pytest.mark.slow
def test_no_temp_folders_left(sources, tmp_path):
    """`run` (as verify and export: the loader's imports) imports torch._dynamo, which made
    $TMPDIR/torchinductor_<user> and left it: each command's temp folder is private and removed
    (`cvt.scratch`, around every command). A subprocess with a fresh TMPDIR and no
    TORCHINDUCTOR_CACHE_DIR: torch makes the folder when it is first imported in a process."""
    import subprocess

    _, _, qwen = sources
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "CVT_DEBUG")}
    r = subprocess.run([sys.executable, "-m", "cvt", "run", str(qwen), "--input-ids", "1,2", "--max-new-tokens", "1",
                        "--quiet"], capture_output=True, text=True, env={**env, "TMPDIR": str(tmpdir)}, timeout=300)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmpdir.iterdir()) == []
