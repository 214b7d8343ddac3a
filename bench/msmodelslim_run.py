"""What bench/msmodelslim_peer.py's suites share, in cvt's venv: the calibration / held-out data both
tools get, the fixture copy msModelSlim writes into, one msModelSlim or cvt quantize run with its wall
time, `cvt verify` of an output, and the layout reading / diff of two Ascend outputs.

msModelSlim itself runs in its own venv through bench/msmodelslim_inner.py (never imported here).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

from common import run_logged as run  # bench/common.py

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
HEADERS = Path("/usr/include/linux")
INNER = HERE / "msmodelslim_inner.py"   # runs in the msModelSlim venv
CALIB_SEQ = 256     # cvt quantize cuts calibration text into sequences of 256 tokens (quant/stage/__init__.py)


def fail(msg: str, code: int = 1) -> None:
    print(f"\nmsmodelslim_peer: {msg}", file=sys.stderr)
    sys.exit(code)


def tail(log: Path, n: int = 25) -> str:
    lines = log.read_text(errors="replace").splitlines()
    return "\n".join("    " + ln for ln in lines[-n:])


def make_data(root: Path, headers: Path, n_calib: int) -> dict:
    files = sorted(headers.glob("*.h"))
    if not files:
        fail(f"{headers}: no *.h files (the Linux UAPI headers the fixture was trained on; "
             "Debian: linux-libc-dev)")
    blob = lambda fs: bytes(c for f in fs for c in f.read_bytes() if c < 128).decode("ascii")  # noqa: E731
    train = blob([f for f in files if f.name[0].lower() <= "t"])
    held = blob([f for f in files if f.name[0].lower() >= "u"])
    width = CALIB_SEQ - 1                                      # + <bos> = CALIB_SEQ tokens
    step = len(train) // n_calib
    chunks = [train[i * step:i * step + width] for i in range(n_calib)]
    cvt_calib, ms_calib, held_out = root / "calib_cvt.jsonl", root / "calib_msmodelslim.jsonl", root / "heldout.txt"
    cvt_calib.write_text("".join(json.dumps({"text": c}) + "\n" for c in chunks))
    ms_calib.write_text("".join(json.dumps({"inputs_pretokenized": "<bos>" + c}) + "\n" for c in chunks))
    held_out.write_text(held)
    return {"cvt_calib": cvt_calib, "ms_calib": ms_calib, "held_out": held_out,
            "calib_tokens": n_calib * CALIB_SEQ, "held_out_bytes": len(held)}


def copy_source(fixture: Path, root: Path) -> Path:
    """A writable copy of the (read-only) fixture for msModelSlim, which writes next to its model."""
    src_copy = root / "fixture"
    shutil.copytree(fixture, src_copy)
    for p in [src_copy, *src_copy.iterdir()]:
        p.chmod(p.stat().st_mode | 0o200)
    return src_copy


def quantize_msmodelslim(name: str, recipe: Path, root: Path, src_copy: Path, data: dict, venv_py: Path,
                         versions: dict, fixture: Path) -> dict:
    """`msmodelslim quant` with RECIPE (its `dataset:` pointed at the bench's calibration .jsonl) into
    ROOT/msms-NAME; {"out", "wall_s", "cmd"}, or exit 1 with the log's tail when it fails."""
    cfg = root / f"{name}.yaml"
    cfg.write_text(re.sub(r"(?m)^(\s*dataset:).*$", lambda m: f"{m.group(1)} {data['ms_calib']}",
                          recipe.read_text()))
    out = root / f"msms-{name}"
    cmd = [str(venv_py), str(INNER), "quant", "--model_path", str(src_copy), "--save_path", str(out),
           "--device", "cpu", "--model_type", "DeepSeek-V3", "--config_path", str(cfg),
           "--trust_remote_code", "False"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    log = root / f"msms-{name}.log"
    wall, rc = run(cmd, log, env)
    if rc != 0 or not (out / "quant_model_description.json").is_file():
        print(f"msModelSlim ({name}) failed, rc {rc}: {shlex.join(cmd)}\n{tail(log)}")
        fail(f"BLOCKER: msModelSlim {versions} could not quantize {fixture} ({name}); log above")
    return {"out": out, "wall_s": wall, "cmd": cmd}


def quantize_cvt(key: str, cmd: list[str], root: Path) -> dict:
    """One `cvt quantize` CMD (its DST is ROOT/KEY); {"out", "wall_s", "cmd"}, or exit 1 with the log."""
    log = root / f"{key}.log"
    wall, rc = run(cmd, log)
    if rc != 0:
        print(f"cvt ({key}) failed, rc {rc}: {shlex.join(cmd)}\n{tail(log)}")
        fail(f"cvt quantize ({key}) failed; log above")
    return {"out": root / key, "wall_s": wall, "cmd": cmd}


# ---- layout ----

def read_output(d: Path) -> dict:
    from safetensors import safe_open

    tensors, header_meta = {}, {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            header_meta[f.name] = sf.metadata()
            for k in sf.keys():
                sl = sf.get_slice(k)
                tensors[k] = (sl.get_dtype(), tuple(sl.get_shape()))
    desc = json.loads((d / "quant_model_description.json").read_text())
    index = json.loads(next(d.glob("*.safetensors.index.json")).read_text())
    return {"tensors": tensors, "tags": {k: v for k, v in desc.items() if k in tensors},
            "globals": {k: v for k, v in desc.items() if k not in tensors},
            "desc_order": list(desc), "files": sorted(p.name for p in d.iterdir() if p.is_file()),
            "config": json.loads((d / "config.json").read_text()), "index_keys": sorted(index),
            "index_meta": index.get("metadata", {}), "header_meta": header_meta}


def pattern(name: str) -> str:
    return re.sub(r"\.experts\.\d+\.", ".experts.E.", re.sub(r"\.layers\.\d+\.", ".layers.N.", name))


def grouped(names) -> list[str]:
    return [g for g, _ in grouped_examples(names)]


def grouped_examples(names) -> list[tuple[str, str]]:
    """[(pattern with its count, one name it stands for)], names grouped by layer / expert index."""
    groups: dict[str, list[str]] = {}
    for n in sorted(names):
        groups.setdefault(pattern(n), []).append(n)
    return [(f"{p} x{len(ns)}" if len(ns) > 1 else p, ns[0]) for p, ns in groups.items()]


def layout_diff(a: dict, b: dict, an: str, bn: str) -> list[str]:
    """Every difference of tensor names / dtypes / shapes / tags, description globals, files, config,
    index and safetensors header metadata between two outputs, one line per difference group."""
    out = []
    ta, tb = a["tensors"], b["tensors"]
    for only, who in ((set(ta) - set(tb), an), (set(tb) - set(ta), bn)):
        if only:
            out.append(f"tensors only in {who} ({len(only)}): " + "; ".join(
                f"{g} {(ta.get(n) or tb.get(n))[0]} {list((ta.get(n) or tb.get(n))[1])} "
                f"[{a['tags'].get(n) or b['tags'].get(n)}]" for g, n in grouped_examples(only)))
    common = set(ta) & set(tb)
    dt = [n for n in common if ta[n][0] != tb[n][0]]
    sh = [n for n in common if ta[n][1] != tb[n][1]]
    tg = [n for n in common if a["tags"].get(n) != b["tags"].get(n)]
    for what, names, show in (("dtype", dt, lambda n: f"{ta[n][0]} vs {tb[n][0]}"),
                              ("shape", sh, lambda n: f"{list(ta[n][1])} vs {list(tb[n][1])}"),
                              ("tag", tg, lambda n: f"{a['tags'].get(n)} vs {b['tags'].get(n)}")):
        if names:
            out.append(f"{what} differs ({len(names)}): " + "; ".join(
                f"{g} ({show(n)})" for g, n in grouped_examples(names)))
    ga, gb = a["globals"], b["globals"]
    for k in sorted(set(ga) | set(gb)):
        if ga.get(k, "<absent>") != gb.get(k, "<absent>"):
            out.append(f"description key {k!r}: {json.dumps(ga.get(k, '<absent>'))} ({an}) vs "
                       f"{json.dumps(gb.get(k, '<absent>'))} ({bn})")
    if [k for k in a["desc_order"] if k in tb] != [k for k in b["desc_order"] if k in ta]:
        out.append("description key order differs")
    fa, fb = set(a["files"]), set(b["files"])
    for only, who in ((fa - fb, an), (fb - fa, bn)):
        if only:
            out.append(f"files only in {who}: {', '.join(sorted(only))}")
    ca, cb = a["config"], b["config"]
    for k in sorted(set(ca) | set(cb)):
        if ca.get(k, "<absent>") != cb.get(k, "<absent>"):
            out.append(f"config.json {k!r}: {json.dumps(ca.get(k, '<absent>'))} ({an}) vs "
                       f"{json.dumps(cb.get(k, '<absent>'))} ({bn})")
    if a["index_keys"] != b["index_keys"] or set(a["index_meta"]) != set(b["index_meta"]):
        out.append(f"index keys {a['index_keys']}/{sorted(a['index_meta'])} vs {b['index_keys']}/{sorted(b['index_meta'])}")
    ha, hb = list(a["header_meta"].values()), list(b["header_meta"].values())
    if ha != hb:
        out.append(f"safetensors __metadata__ {ha} ({an}) vs {hb} ({bn})")
    return out



def verify(cvt: str, cand: Path, fixture: Path, data: dict, rep: Path, args) -> dict:
    cmd = [cvt, "verify", str(cand), "--reference", str(fixture), "--report", str(rep), "--data",
           str(data["held_out"]), "--seq-len", str(args.seq_len), "--max-sequences", str(args.eval_sequences),
           "--device", "cpu", "--quiet"]
    rep.mkdir(parents=True, exist_ok=True)
    wall, rc = run(cmd, rep.with_suffix(".log"))
    res = {"cmd": cmd, "wall_s": wall, "rc": rc}
    if not (rep / "report.json").is_file():
        res["error"] = rep.with_suffix(".log").read_text(errors="replace").strip().splitlines()[-1:] or ["?"]
        res["error"] = res["error"][0]
        return res
    r = json.loads((rep / "report.json").read_text())
    lg = r["logits"]
    res.update(kl=lg["kl_mean"], ppl_ratio=lg["ppl_ratio"], top1=lg["same_top1"], tokens=lg["tokens"],
               min_cos=min(x["Cosine"] for x in r["layers"]))
    return res
