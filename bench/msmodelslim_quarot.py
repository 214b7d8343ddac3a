"""`bench/msmodelslim_peer.py --suite w4a8-quarot`: msModelSlim 26.1's QuaRot against cvt's
`--rotate hadamard`, W4A8 on the trained DeepSeek-V3 fixture, on the same calibration token ids and
the same held-out evaluation as the W8A8 suite (bench/msmodelslim_peer.py's docstring, steps 1 and 5).

msModelSlim (recipes in bench/msmodelslim/, each citing the lab_practice file it follows):
  quarot          w4a8_quarot.yaml: lab_practice/deepseek_v3_2/deepseek_w4a8.yaml -- QuaRot (offline,
                  `type: quarot`, data-free), flex AWQ (ssz) on the routed experts, flex smooth on the
                  rest, W8A8_DYNAMIC q_b_proj / o_proj / dense MLP / shared experts, W4A8_DYNAMIC routed
                  experts (int4 per channel, "ssz"); q_a_proj / kv_a_proj_with_mqa / kv_b_proj float;
  noquarot        the same without QuaRot;
  quarot-minmax   QuaRot as the only outlier step, int4 "minmax" (RTN: cvt's w4a8 math), same layout;
  minmax          neither: the layout alone.
  QuaRot on this model needs workaround e (bench/msmodelslim_peer.py docstring) besides a-d.
cvt (rtn unless named; each with and without `--rotate hadamard`, seed 0):
  `--scheme w4a8 --format ascend` (routed experts W4A8_DYNAMIC, the rest float: cvt's default), and
  the same with `--recipe bench/msmodelslim/cvt_w4a8_layout.json` (msModelSlim's layout above), rtn
  and awq (calibrated on the bench's tokens, the counterpart of the practice's flex AWQ / smooth).
Then `cvt verify` of each as written; an output cvt's loader refuses is a finding in the table, never
replaced by a number from elsewhere. msModelSlim's QuaRot output adds `optional/quarot.safetensors`
(the global rotation) and `optional.quarot.rotation_map` in quant_model_description.json: extra
files, reported with the layout. Per-layer cosines are left out: a rotated model's residual stream is
turned by Q, so its hidden states are not comparable with the reference's layer by layer.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

from msmodelslim_run import (CALIB_SEQ, HERE, copy_source, fail, layout_diff, make_data, quantize_cvt,
                             quantize_msmodelslim, read_output, verify)

RECIPES = {"w4a8-quarot": HERE / "msmodelslim" / "w4a8_quarot.yaml",
           "w4a8-noquarot": HERE / "msmodelslim" / "w4a8_noquarot.yaml",
           "w4a8-quarot-minmax": HERE / "msmodelslim" / "w4a8_quarot_minmax.yaml",
           "w4a8-minmax": HERE / "msmodelslim" / "w4a8_minmax.yaml"}
CVT_LAYOUT = HERE / "msmodelslim" / "cvt_w4a8_layout.json"
# key -> (label, cvt quantize options after SRC DST); "--rotate" rows pair with the row before them
CVT_RUNS = {
    "cvt-experts": ("cvt rtn, experts only (`--scheme w4a8`)", []),
    "cvt-experts-rot": ("cvt rtn, experts only, `--rotate hadamard`", ["--rotate", "hadamard"]),
    "cvt-layout": ("cvt rtn, msModelSlim's layout (`--recipe`)", ["--recipe", str(CVT_LAYOUT)]),
    "cvt-layout-rot": ("cvt rtn, msModelSlim's layout, `--rotate hadamard`",
                       ["--recipe", str(CVT_LAYOUT), "--rotate", "hadamard"]),
    "cvt-layout-awq": ("cvt awq, msModelSlim's layout", ["--recipe", str(CVT_LAYOUT), "--method", "awq", "CALIB"]),
    "cvt-layout-awq-rot": ("cvt awq, msModelSlim's layout, `--rotate hadamard`",
                           ["--recipe", str(CVT_LAYOUT), "--method", "awq", "CALIB", "--rotate", "hadamard"]),
}
MSMS_LABELS = {"msms-w4a8-minmax": "msModelSlim min-max, msModelSlim's layout",
               "msms-w4a8-quarot-minmax": "msModelSlim min-max, msModelSlim's layout, QuaRot",
               "msms-w4a8-noquarot": "msModelSlim practice (flex AWQ ssz + flex smooth) without QuaRot",
               "msms-w4a8-quarot": "msModelSlim practice: QuaRot + flex AWQ ssz + flex smooth"}
ORDER = ("cvt-experts", "cvt-experts-rot", "cvt-layout", "cvt-layout-rot", "msms-w4a8-minmax",
         "msms-w4a8-quarot-minmax", "cvt-layout-awq", "cvt-layout-awq-rot", "msms-w4a8-noquarot", "msms-w4a8-quarot")


def cvt_cmd(cvt: str, fixture: Path, out: Path, opts: list[str], data: dict) -> list[str]:
    calib = ["--calib", str(data["cvt_calib"]), "--calib-tokens", str(data["calib_tokens"])]
    opts = [x for o in opts for x in (calib if o == "CALIB" else [o])]
    return [cvt, "quantize", str(fixture), str(out), "--scheme", "w4a8", "--format", "ascend", *opts,
            "--device", "cpu", "--quiet"]


def extra_files(d: Path) -> list[str]:
    """Files below an output's top level (read_output lists the top level only)."""
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and p.parent != d)


def expert_codes(a: Path, b: Path) -> dict:
    """Routed-expert W4A8 weights of two unrotated RTN / min-max outputs: packed bytes and scales equal?"""
    import torch
    from safetensors.torch import load_file

    def load(d):
        sd = {}
        for f in sorted(d.glob("*.safetensors")):
            sd.update(load_file(str(f)))
        return sd

    sa, sb = load(a), load(b)
    names = [n for n in sa if ".mlp.experts." in n and n.endswith(".weight") and n in sb]
    same_bytes = sum(int(torch.equal(sa[n], sb[n])) for n in names)
    same_scale = sum(int(torch.equal(sa[n + "_scale"], sb[n + "_scale"])) for n in names)
    frac = sum(int((sa[n] == sb[n]).sum()) for n in names) / max(1, sum(sa[n].numel() for n in names))
    return {"linears": len(names), "bytes_equal": same_bytes, "scales_equal": same_scale, "byte_share_equal": frac}


def quantize_all(args, root: Path, fixture: Path, cvt: str, venv_py: Path, versions: dict, data: dict) -> dict:
    src_copy = copy_source(fixture, root)
    quant: dict[str, dict] = {}
    for name, recipe in RECIPES.items():
        quant[f"msms-{name}"] = quantize_msmodelslim(name, recipe, root, src_copy, data, venv_py, versions, fixture)
    for key, (_, opts) in CVT_RUNS.items():
        quant[key] = quantize_cvt(key, cvt_cmd(cvt, fixture, root / key, opts, data), root)
    return quant


def report(args, root: Path, fixture: Path, cvt: str, venv_py: Path, versions: dict) -> None:
    data = make_data(root, Path(args.headers), args.calib_sequences)
    quant = quantize_all(args, root, fixture, cvt, venv_py, versions, data)
    labels = {**{k: v[0] for k, v in CVT_RUNS.items()}, **MSMS_LABELS}
    lay = {k: read_output(q["out"]) for k, q in quant.items()}
    diff = layout_diff(lay["msms-w4a8-quarot"], lay["cvt-layout-rot"], "msModelSlim QuaRot", "cvt --rotate")
    extras = {k: extra_files(q["out"]) for k, q in quant.items()}
    codes = expert_codes(quant["cvt-layout"]["out"], quant["msms-w4a8-minmax"]["out"])
    acc = {k: verify(cvt, q["out"], fixture, data, root / "reports" / k, args) for k, q in quant.items()}
    (root / "results.json").write_text(json.dumps({"versions": versions, "quantize": quant, "verify": acc,
                                                   "layout_diff": diff, "extra_files": extras,
                                                   "expert_codes": codes}, indent=1, default=str))
    print_report(args, fixture, cvt, versions, data, quant, acc, labels, diff, extras, codes)
    failed = [labels[k] for k in ORDER if "kl" not in acc[k] and not k.startswith("msms-")]
    if failed:
        fail(f"BLOCKER: cvt verify failed on cvt's own {', '.join(failed)}")


def print_report(args, fixture, cvt, versions, data, quant, acc, labels, diff, extras, codes) -> None:
    import torch

    print(f"\nmsModelSlim as a peer: W4A8 with and without rotation (QuaRot / --rotate hadamard) on {fixture}")
    print(f"command:      {shlex.join([sys.executable, *sys.argv])}")
    print(f"msModelSlim:  {versions['msmodelslim']} (transformers {versions['transformers']}, torch "
          f"{versions['torch']}), `msmodelslim quant --device cpu --model_type DeepSeek-V3`, through "
          "bench/msmodelslim_inner.py's patches (bench/msmodelslim_peer.py docstring a-e)")
    print(f"cvt:          {cvt} (torch {torch.__version__}); CPU: {os.cpu_count()} cores")
    print(f"calibration:  {args.calib_sequences} x {CALIB_SEQ} tokens, the same ids for both tools (awq / "
          "msModelSlim's flex steps use them; rtn, min-max and both rotations are data-free)")
    print(f"evaluation:   cvt verify --data held-out headers u-z ({data['held_out_bytes']} bytes) --seq-len "
          f"{args.seq_len} --max-sequences {args.eval_sequences} --device cpu, against the BF16 fixture")
    print("\nlayout: msModelSlim QuaRot practice output vs cvt `--recipe ... --rotate hadamard`:")
    for ln in diff or ["same tensor names / dtypes / shapes / tags"]:
        print(f"  - {ln}")
    for k in ORDER:
        if extras[k]:
            print(f"  - {labels[k]} writes besides the checkpoint: {', '.join(extras[k])}")
    print(f"  - routed experts, cvt rtn vs msModelSlim min-max (no rotation, {codes['linears']} linears): packed "
          f"int4 bytes identical on {codes['bytes_equal']}, weight_scale identical on {codes['scales_equal']} "
          f"({codes['byte_share_equal']:.2%} of bytes equal)")
    print("\n| output (W4A8, trained fixture) | quantize wall s | loads in cvt as written | mean KL | PPL ratio "
          "| same top-1 | verify wall s |")
    print("|---|---|---|---|---|---|---|")
    for k in ORDER:
        r, q = acc[k], quant[k]
        if "kl" in r:
            print(f"| {labels[k]} | {q['wall_s']:.1f} | yes | {r['kl']:.5f} | {r['ppl_ratio']:.4f} | "
                  f"{r['top1']:.2%} | {r['wall_s']:.1f} |")
        else:
            print(f"| {labels[k]} | {q['wall_s']:.1f} | no: {r.get('error')} | - | - | - | {r['wall_s']:.1f} |")
    pairs = [("cvt-experts", "cvt-experts-rot"), ("cvt-layout", "cvt-layout-rot"),
             ("msms-w4a8-minmax", "msms-w4a8-quarot-minmax"), ("cvt-layout-awq", "cvt-layout-awq-rot"),
             ("msms-w4a8-noquarot", "msms-w4a8-quarot")]
    print("\nrotated / unrotated mean KL: " + "; ".join(
        f"{labels[b]}: {acc[b]['kl'] / acc[a]['kl']:.2f}x" for a, b in pairs if "kl" in acc[a] and "kl" in acc[b]))
