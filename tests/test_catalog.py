"""The bad-input catalog, verb by verb: what a hostile or careless user can hand cvt.

Every case runs the real CLI entry point and asserts the same contract:

* the exit code (1 for refused input, 3 for `inspect` / `plan` problems, 4 for a failed
  `verify` gate);
* one line on stderr, ``cvt: error: ...``, naming the culprit (file, tensor, field or option);
  no traceback (`inspect` and `plan` print their report on stdout instead, the culprit in it);
* DST not complete-looking: no manifest, index or config appeared in it;
* SRC untouched: every file under it has the same bytes before and after;
* nothing outside the checkpoint opened: an audit hook records every file the run opens,
  and none lies in the ``outside/`` folder the case's symlinks and paths point at;
* nothing written outside DST: the same hook records every path opened for writing, made,
  renamed or deleted, and each must resolve (symlinks followed) inside DST (for `verify`: its
  --report folder) or the command's private temp folder (`cvt.scratch`); ``outside/`` keeps
  its bytes.

Case classes (issue 13): DST overlapping SRC; symlinks and manifest paths leading out of the
checkpoint; config.json disagreeing with the weights; sizes that describe no model or would
allocate without bound; placement / recipe / manifest files that are invalid; NaN / Inf
weights; a second run on a locked DST. Issue 24: symlinks where cvt makes or clears its own
folders in DST (``.cvt-calib``, ``rank-*``), --overwrite beside files no cvt run recorded, a
verify report inside a checkpoint it reads; `test_overwrite_deletes_only_recorded_files` and
`test_no_temp_folders_left` cover the successful runs.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from cvt.convert.synthetic import tiny_qwen3_config, write_bf16_checkpoint, write_safetensors
from cvt.tests.conftest import run_cvt

# ---------------------------------------------------------------------------------- harness
_OPENED: list[str] | None = None
_WRITTEN: list[str] = []
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# path-changing events: the argument positions holding a path, and of its dir_fd (a path relative
# to an open directory, e.g. inside shutil.rmtree, is covered by the event naming the directory)
_CHANGES = {"os.remove": ((0,), 1), "os.rmdir": ((0,), 1), "os.mkdir": ((0,), 2), "os.rename": ((0, 1), 2),
            "os.symlink": ((1,), 2), "os.truncate": ((0,), None), "shutil.rmtree": ((0,), 1)}


def _audit(event: str, args) -> None:
    if _OPENED is None or not args:
        return
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        _OPENED.append(path)
        mode, flags = args[1], args[2]
        if (isinstance(mode, str) and set(mode) & set("wax+")) or (isinstance(flags, int) and flags & _WRITE_FLAGS):
            _WRITTEN.append(path)
    elif event in _CHANGES:
        where, fd_at = _CHANGES[event]
        if fd_at is not None and len(args) > fd_at and args[fd_at] not in (None, -1):
            return
        _WRITTEN.extend(os.fsdecode(args[i]) for i in where if isinstance(args[i], (str, bytes, os.PathLike)))


sys.addaudithook(_audit)  # audit hooks cannot be removed: it records only while _OPENED is a list


def _tree_hash(root: Path) -> dict[str, str]:
    """name -> sha256 of every file under root (symlinks as their target text, not followed)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@dataclass
class Ctx:
    tmp: Path
    fp8: Path     # FP8 release (DeepSeek-V3 style: layers 0 dense, 1-2 MoE, MTP 3)
    bf16: Path    # cvt fp8-to-bf16 output of it (has a manifest)
    qwen: Path    # plain HF BF16 Qwen3-MoE
    outside: Path = field(init=False)

    def __post_init__(self):
        self.outside = self.tmp / "outside"
        self.outside.mkdir()
        (self.outside / "secret.json").write_text('{"model_type": "qwen3"}')

    def copy(self, which: str, name: str = "src") -> Path:
        dst = self.tmp / name
        shutil.copytree(getattr(self, which), dst, symlinks=True)
        return dst

    def edit_config(self, root: Path, **changes) -> None:
        cfg = json.loads((root / "config.json").read_text())
        cfg.update(changes)
        (root / "config.json").write_text(json.dumps(cfg))

    def link_out(self, root: Path, name: str) -> None:
        """Replace root/name by a symlink to a copy of it outside the checkpoint."""
        target = self.outside / name
        shutil.copy(root / name, target)
        (root / name).unlink()
        (root / name).symlink_to(target)


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[Ctx], tuple[list, Path, Path | None]]  # -> (argv, SRC to keep intact, DST)
    culprit: str
    rc: int = 1
    form: str = "error"  # error: one stderr line; report: stdout report (inspect / plan)


def _written_outside(written: list[str], dst: Path | None) -> list[str]:
    """The paths of `written` that resolve outside DST and outside cvt's private temp folders."""
    import tempfile

    allowed = [os.path.join(os.path.realpath(tempfile.gettempdir()), "cvt-")]
    if dst is not None:
        allowed.append(os.path.realpath(dst))
    return [p for p in written if not os.path.realpath(p).startswith(tuple(allowed)) and not p.endswith(".pyc")]


def _report_dir(argv: list) -> Path | None:
    """verify's DST: its --report folder."""
    return next((Path(b) for a, b in zip(argv, argv[1:]) if a == "--report"), None)


def _check(ctx: Ctx, case: Case) -> None:
    global _OPENED
    argv, src, dst = case.build(ctx)
    before = _tree_hash(src)
    outside_before = _tree_hash(ctx.outside)
    dst_before = _tree_hash(dst) if dst is not None and dst.is_dir() else {}
    _OPENED = []
    _WRITTEN.clear()
    try:
        r = run_cvt(*argv)
    finally:
        opened, _OPENED = _OPENED, None
    assert r.rc == case.rc, (r.rc, r.out[-2000:], r.err[-2000:])
    assert "Traceback" not in r.err and "Traceback" not in r.out, r.err
    if case.form == "error":
        lines = [ln for ln in r.err.splitlines() if ln.strip()]
        assert lines and lines[-1].startswith("cvt: "), r.err
        err = [ln for ln in lines if ln.startswith("cvt:")]
        assert len(err) == 1 or case.rc == 4, r.err  # verify: one line per violated gate
        assert case.culprit in r.err, (case.culprit, r.err)
    else:
        assert case.culprit in r.out, (case.culprit, r.out)
    assert _tree_hash(src) == before, "SRC was modified"
    assert _tree_hash(ctx.outside) == outside_before, "a folder outside DST was modified"
    written = _written_outside(_WRITTEN, dst if dst is not None else _report_dir(argv))
    assert not written, f"written outside DST: {written}"
    if dst is not None and dst != src and dst.is_dir():
        after = _tree_hash(dst)
        kept = {k: v for k, v in dst_before.items() if not k.startswith(".")}
        assert {k: after.get(k) for k in kept} == kept, "a file DST held before was changed or deleted"
        new = set(after) - set(dst_before)
        looks_done = {"cvt_manifest.json", "export_manifest.json", "config.json", "model.safetensors.index.json"}
        assert not (new & looks_done), f"DST looks complete: {sorted(new)}"
    outside = str(ctx.outside.resolve())
    leaked = [p for p in opened if os.path.realpath(p).startswith(outside)]
    assert not leaked, f"opened outside the checkpoint: {leaked}"


# --------------------------------------------------------------------------- the cases
def _overlap(verb: list[str], which: str, sub: bool = False, overwrite: bool = True):
    def build(ctx: Ctx):
        src = ctx.copy(which)
        dst = src / "sub" if sub else src
        return [*verb, src, dst, *verb_opts(verb[0]), *(["--overwrite"] if overwrite else [])], src, dst
    return build


def verb_opts(verb: str) -> list[str]:
    return {"quantize": ["--scheme", "w8a8"], "shard": ["--ep", "2"], "fp8-to-bf16": [], "export": []}[verb]


def _quantize(which: str, prep: Callable[[Ctx, Path], None], *extra):
    def build(ctx: Ctx):
        src = ctx.copy(which)
        prep(ctx, src)
        dst = ctx.tmp / "out"
        return ["quantize", src, dst, "--scheme", "w8a8", *extra], src, dst
    return build


def _verb(verb: list[str], which: str, prep: Callable[[Ctx, Path], None], *extra, dst_name: str | None = "out"):
    def build(ctx: Ctx):
        src = ctx.copy(which)
        prep(ctx, src)
        dst = ctx.tmp / dst_name if dst_name else None
        return [*verb, src, *([dst] if dst is not None else []), *extra], src, dst
    return build


def _nothing(ctx, src):
    pass


def _link_tokenizer(ctx, src):
    ctx.link_out(src, "tokenizer.json")


def _link_config(ctx, src):
    ctx.link_out(src, "config.json")


def _link_weights(ctx, src):
    ctx.link_out(src, sorted(p.name for p in src.glob("model-*.safetensors"))[0])


def _experts_lie(ctx, src):
    ctx.edit_config(src, n_routed_experts=8)


def _heads_zero(ctx, src):
    ctx.edit_config(src, num_attention_heads=0)


def _hidden_negative(ctx, src):
    ctx.edit_config(src, hidden_size=-256)


def _q_a_wrong_shape(ctx, src):
    """model.layers.0.self_attn.q_a_proj.weight stored with other rows than config.json says."""
    ctx.edit_config(src, q_lora_rank=64)


def _nan_weight(ctx, src):
    from safetensors.torch import load_file

    f = sorted(src.glob("model-*.safetensors"))[0]
    tensors = {k: v.clone() for k, v in load_file(f).items()}
    name = next(n for n in tensors if n.endswith("mlp.down_proj.weight") and tensors[n].is_floating_point())
    tensors[name][0, 0] = float("inf") if "inf" in src.name else float("nan")
    write_safetensors(f, tensors)


def _manifest_path(path: str):
    def prep(ctx, src):
        m = json.loads((src / "cvt_manifest.json").read_text())
        m["files"][0]["path"] = path
        (src / "cvt_manifest.json").write_text(json.dumps(m))
    return prep


def _manifest_invalid(ctx, src):
    m = json.loads((src / "cvt_manifest.json").read_text())
    m["files"][0]["sha256"] = "zz"
    m["tensor_count"] = -1
    (src / "cvt_manifest.json").write_text(json.dumps(m))


def _pickle_only(ctx, src):
    for p in list(src.glob("model*")):
        p.unlink()
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04not really")


def _index_escape(ctx, src):
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    name = next(iter(idx["weight_map"]))
    idx["weight_map"][name] = "../outside/x.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))


def _placement(layers: list[int], bad_id: int | None = None):
    def build(ctx: Ctx):
        src = ctx.copy("fp8")
        entries = []
        for i, L in enumerate(layers):
            devs = [[0, 1], [2, 3]] if bad_id is None else [[0, bad_id], [2, 3]]
            entries.append({"layer_id": L, "device_count": 2,
                            "device_list": [{"device_id": r, "device_expert": d} for r, d in enumerate(devs)]})
        p = ctx.tmp / "placement.json"
        p.write_text(json.dumps({"moe_layer_count": len(entries), "layer_list": entries}))
        dst = ctx.tmp / "out"
        return ["shard", src, dst, "--ep", "2", "--placement", p], src, dst
    return build


def _bad_recipe(ctx, src):
    (ctx.tmp / "recipe.yaml").write_text('rules:\n  - pattern: "x\n    scheme: [w4a16\n')


def _locked_export(ctx: Ctx):
    src = ctx.copy("qwen")
    dst = ctx.tmp / "onnx"
    dst.mkdir()
    fd = os.open(dst, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a first run holding DST; released when the test ends
    ctx.tmp.joinpath(".held").write_text(str(fd))
    return ["export", "onnx", src, dst], src, dst


def _verify(which_cand: str, prep, *extra, report_in: str | None = None):
    """`report_in`: put --report inside "cand", "ref", or inside cand through a symlink ("link")."""
    def build(ctx: Ctx):
        ref = ctx.copy(which_cand, "ref")
        cand = ctx.copy(which_cand, "cand-inf" if "inf" in extra else "cand")
        prep(ctx, cand)
        report = ctx.tmp / "report"
        if report_in == "link":
            (ctx.tmp / "link").symlink_to(cand)
            report = ctx.tmp / "link" / "rep"
        elif report_in is not None:
            report = {"cand": cand, "ref": ref}[report_in] / "rep"
        args = [a for a in extra if a != "inf"]
        return ["verify", cand, "--reference", ref, "--report", report, "--max-sequences", "1", "--seq-len", "32",
                *args], ref if report_in == "ref" else cand, None
    return build


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
            files = {f["path"]: {"size": f["size"], "sha256": f["sha256"], "tensors": f["tensors"]} for f in m["files"]}
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
    # --- DST overlapping SRC (every writing verb), --overwrite never deletes a source file
    Case("quantize-dst-is-cvt-src-overwrite", _overlap(["quantize"], "bf16"), "DST is the source directory"),
    Case("quantize-dst-is-hf-src-overwrite", _overlap(["quantize"], "qwen"), "DST is the source directory"),
    Case("quantize-dst-inside-src", _overlap(["quantize"], "qwen", sub=True, overwrite=False),
         "DST is inside the source directory"),
    Case("fp8-to-bf16-dst-is-src", _overlap(["fp8-to-bf16"], "fp8"), "DST is the source directory"),
    Case("shard-dst-is-src-overwrite", _overlap(["shard"], "bf16"), "DST is the source directory"),
    Case("shard-dst-inside-src", _overlap(["shard"], "bf16", sub=True), "DST is inside the source directory"),
    Case("export-onnx-dst-is-src", _overlap(["export", "onnx"], "qwen"), "DST is the source directory"),
    # --- reads outside the checkpoint
    Case("quantize-tokenizer-symlink-out", _quantize("qwen", _link_tokenizer), "tokenizer.json: symlink resolves to"),
    Case("shard-tokenizer-symlink-out", _verb(["shard"], "fp8", _link_tokenizer, "--ep", "2"),
         "tokenizer.json: symlink resolves to"),
    Case("export-tokenizer-symlink-out", _verb(["export", "onnx"], "qwen", _link_tokenizer),
         "tokenizer.json: symlink resolves to"),
    Case("fp8-to-bf16-weights-symlink-out", _verb(["fp8-to-bf16"], "fp8", _link_weights),
         "model-00001-of-00003.safetensors: symlink resolves to"),
    Case("inspect-config-symlink-out", _verb(["inspect"], "qwen", _link_config, dst_name=None),
         "config.json: symlink resolves to"),
    Case("run-config-symlink-out", _verb(["run"], "qwen", _link_config, "--input-ids", "1,2", dst_name=None),
         "config.json: symlink resolves to"),
    Case("run-manifest-absolute-path", _verb(["run"], "bf16", _manifest_path("/etc/shadow"), "--input-ids", "1,2",
                                            dst_name=None), "'/etc/shadow' is absolute"),
    Case("run-manifest-dotdot-path", _verb(["run"], "bf16", _manifest_path("../../outside/secret.json"),
                                          "--input-ids", "1,2", dst_name=None), "escapes the checkpoint directory"),
    Case("inspect-manifest-absolute-path", _verb(["inspect"], "bf16", _manifest_path("/etc/shadow"), dst_name=None),
         "'/etc/shadow' is absolute", rc=3, form="report"),
    Case("quantize-index-escapes", _quantize("qwen", _index_escape), "escapes the checkpoint directory"),
    Case("export-index-escapes", _verb(["export", "onnx"], "qwen", _index_escape), "escapes the checkpoint directory"),
    Case("export-pickle-only", _verb(["export", "onnx"], "qwen", _pickle_only), "only pickle weights found"),
    # --- config vs weights, checked before anything is written
    Case("quantize-experts-lie", _quantize("fp8", _experts_lie), "4 of 8 experts missing"),
    Case("shard-experts-lie", _verb(["shard"], "fp8", _experts_lie, "--ep", "2"), "4 of 8 experts missing"),
    Case("fp8-to-bf16-experts-lie", _verb(["fp8-to-bf16"], "fp8", _experts_lie), "4 of 8 experts missing"),
    Case("quantize-q-a-proj-shape", _quantize("bf16", _q_a_wrong_shape), "q_a_proj.weight"),
    Case("shard-q-a-proj-shape", _verb(["shard"], "bf16", _q_a_wrong_shape, "--ep", "2"), "q_a_proj.weight"),
    Case("inspect-experts-lie", _verb(["inspect"], "fp8", _experts_lie, dst_name=None), "4 of 8 experts missing",
         rc=3, form="report"),
    # --- sizes that describe no model, unbounded work
    Case("plan-heads-zero", _verb(["plan"], "fp8", _heads_zero, "--ep", "2", dst_name=None),
         "num_attention_heads = 0"),
    Case("shard-dry-run-heads-zero", _verb(["shard"], "fp8", _heads_zero, "--ep", "2", "--dry-run", dst_name=None),
         "num_attention_heads = 0"),
    Case("run-hidden-negative", _verb(["run"], "qwen", _hidden_negative, "--input-ids", "1,2", dst_name=None),
         "hidden_size = -256"),
    Case("plan-ep-huge", _verb(["plan"], "fp8", _nothing, "--ep", "1000000000", dst_name=None),
         "a world of 1000000000 ranks"),
    # --- invalid side files
    Case("shard-placement-bad-expert-id", _placement([1, 2], bad_id=-1), "expert id -1 is outside 0..3"),
    Case("shard-placement-missing-layer", _placement([1]), "places 1 of the model's 2 MoE layers"),
    Case("quantize-bad-yaml-recipe", _quantize("qwen", _bad_recipe, "--recipe", "RECIPE"), "recipe.yaml: not valid YAML"),
    Case("run-manifest-invalid", _verb(["run"], "bf16", _manifest_invalid, "--input-ids", "1,2", dst_name=None),
         "files.0.sha256"),
    Case("run-world-size-manifest-invalid", _verb(["run"], "bf16", _manifest_invalid, "--input-ids", "1,2",
                                                 "--world-size", "2", dst_name=None), "tensor_count"),
    # --- NaN / Inf
    Case("quantize-nan-weight", _quantize("qwen", _nan_weight), "non-finite"),
    Case("run-nan-weight", _verb(["run"], "qwen", _nan_weight, "--input-ids", "1,2", "--dtype", "fp32",
                                 dst_name=None), "non-finite logits"),
    Case("verify-nan-candidate", _verify("qwen", _nan_weight, "--min-cosine", "0.99", "--max-mean-kl", "1"),
         "is NaN", rc=4),
    Case("verify-inf-candidate", _verify("qwen", _nan_weight, "--min-cosine", "0.99", "inf"), "non-finite", rc=4),
    Case("verify-threshold-nan", _verify("qwen", _nothing, "--min-cosine", "nan"),
         "--min-cosine nan: must be a finite number"),
    # --- two runs at once
    Case("export-onnx-locked", _locked_export, "another cvt run is writing to this directory"),
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


@pytest.fixture(scope="module")
def sources(tmp_path_factory, fp8_release_session):
    root = tmp_path_factory.mktemp("catalog-src")
    bf16 = root / "bf16"
    assert run_cvt("fp8-to-bf16", fp8_release_session, bf16, "--quiet").rc == 0
    qwen = write_bf16_checkpoint(root / "qwen", tiny_qwen3_config(moe=True))
    return fp8_release_session, bf16, qwen


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, sources, tmp_path):
    fp8, bf16, qwen = sources
    ctx = Ctx(tmp_path, fp8, bf16, qwen)
    build = case.build

    def with_recipe(c: Ctx):
        argv, src, dst = build(c)
        return [str(c.tmp / "recipe.yaml") if a == "RECIPE" else a for a in argv], src, dst

    try:
        _check(ctx, Case(case.id, with_recipe, case.culprit, case.rc, case.form))
    finally:
        held = tmp_path / ".held"
        if held.exists():
            os.close(int(held.read_text()))


def test_every_verb_has_cases():
    verbs = {c.id.split("-")[0] for c in CASES}
    assert {"quantize", "fp8", "shard", "plan", "run", "verify", "export", "inspect"} <= verbs


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
    global _OPENED
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
    _OPENED = []
    _WRITTEN.clear()
    try:
        r = run_cvt(*argv, src, dst, *opts, "--overwrite", "--quiet")
    finally:
        _OPENED = None
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
    assert not _written_outside(_WRITTEN, dst), _written_outside(_WRITTEN, dst)


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
