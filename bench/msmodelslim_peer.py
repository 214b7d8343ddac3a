"""msModelSlim as a peer: quantize the trained DeepSeek-V3 fixture to W8A8 mixed (static attention,
dynamic MLP; `--suite w8a8`, the default) or to W4A8 with and without QuaRot (`--suite w4a8-quarot`:
bench/msmodelslim_quarot.py says what it runs) with msModelSlim 26.1 on CPU and with cvt, then compare
layout and accuracy.

Usage: .venv/bin/python bench/msmodelslim_peer.py --msmodelslim-venv VENV --fixture DIR
       [--suite w8a8|w4a8-quarot] [--cvt .venv/bin/cvt] [--dir DIR] [--keep] [--calib-sequences 8]
       [--eval-sequences 32] [--seq-len 256]

msModelSlim lives in its own venv (it pins neither torch nor transformers, but its DeepSeek-V3 path
needs a transformers whose DeepseekV3 experts are nn.Linear modules). To build it (CPU only; no NPU,
no torch_npu; Python 3.11):

    python3 -m venv VENV                                  # any directory: pass it as --msmodelslim-venv VENV
    VENV/bin/pip install torch==2.13.0                    # first: the CPU wheel (never a CUDA one)
    VENV/bin/pip install msmodelslim==26.1.0 transformers==4.57.1 numpy

msmodelslim 26.1.0's own requirements are small (easydict, einops, pydantic, wcmatch, accelerate,
requests, scipy, pygtrie) and install with it; with torch already there, accelerate pulls no other.

What runs, in one process tree (CPU):
  1. data: calibration = --calib-sequences chunks of 255 ASCII bytes, evenly spaced through the
     Linux UAPI headers a-t (/usr/include/linux, the fixture's training split); evaluation = the
     held-out headers u-z. cvt gets the chunks as .jsonl "text" (its tokenizer prepends <bos>; it
     calibrates on sequences of 256 tokens) with --calib-tokens = 256 x --calib-sequences;
     msModelSlim gets "<bos>" + chunk, one sample each (its HF tokenizer maps the literal to id 256
     and adds nothing), so both calibrate on the same token ids (default 8 x 256: cvt's default
     --calib-tokens 2048).
  2. msModelSlim: `msmodelslim quant --model_path FIXTURE_COPY --save_path OUT --device cpu
     --model_type DeepSeek-V3 --config_path RECIPE --trust_remote_code False`, run by
     bench/msmodelslim_inner.py in the msModelSlim venv (patch the adapter, then msModelSlim's own
     CLI `main()`), for two recipes in bench/msmodelslim/:
       flexsmooth  lab_practice/deepseek_v3_2/deepseek_w8a8.yaml as shipped: flex_smooth_quant
                   (norm-linear, ov) + W8A8 per-tensor asymmetric static attention (kv_b_proj float)
                   + W8A8_DYNAMIC MLP and experts (router float) -- the closest practice to V3 W8A8;
       nosmooth    the same without flex_smooth_quant (min-max only; the counterpart of cvt's rtn).
  3. cvt: `cvt quantize FIXTURE DST --scheme w8a8 --format ascend --static-attention --calib C`,
     with the default --method rtn and with --method smoothquant.
  4. layout: every tensor name / dtype / shape and description tag of msModelSlim's flexsmooth output
     against cvt's smoothquant output (and each against its sibling), global description keys,
     files, config.json, index; differences printed grouped by pattern (layer -> N, expert -> E).
     Value checks: activation offsets, bf16-rounded scales, the MLP int8 codes of the two RTN-like
     outputs, float tensors changed by smoothing.
  5. accuracy: `cvt verify OUT --reference FIXTURE --data HELD_OUT --seq-len S --max-sequences M
     --device cpu` for all four, each output verified AS WRITTEN first (msModelSlim's ascendv1_saver
     writes static W8A8 linears without `weight_scale` / `weight_offset`; cvt's loader reads them as
     written). Only if cvt's loader refuses an msModelSlim output is the refusal printed as a finding
     and a copy with `weight_scale` / `weight_offset` derived by this bench (deq_scale / input_scale
     as [n, 1]; zeros) verified instead (cvt's static W8A8 kernel reads only weight / input_scale /
     input_offset / deq_scale / quant_bias, so the numbers stay msModelSlim's); the "loads in cvt as
     written" column says which happened. Mean KL, PPL ratio, same top-1, min layer cosine and wall
     times, then Markdown tables for the README.

Workarounds needed to run msModelSlim 26.1 here (each also stated in the output):
  a. No HF modeling_deepseek.py (trust_remote_code; not downloadable): transformers' built-in
     DeepseekV3ForCausalLM with --trust_remote_code False. transformers 4.57.1, not 5.x: 5.x fuses
     the routed experts into 3-D parameters (DeepseekV3Experts), which linear_quant (nn.Linear only)
     would leave float; 4.57.1 keeps a ModuleList of DeepseekV3MLP, named like the HF remote code
     (mlp.experts.E.{gate,up,down}_proj). msModelSlim logs "Environment does not meet dependency
     requirements: transformers==4.48.2" (4.48 has no DeepseekV3) and goes on.
  b. DeepSeekV3ModelAdapter (msmodelslim/model/deepseek_v3/model_adapter.py) assumes the 671B
     release: init_model adds an MTP layer (num_hidden_layers + 1) read from
     model-00163-of-000163.safetensors and needs model.safetensors.index.json; the fixture has no MTP
     weights and one model.safetensors. Patched in the msModelSlim process only (no file of the
     package is edited): init_model loads the whole (2.7M-parameter) model with from_pretrained
     instead of layer by layer, no MTP; generate_decoder_layer yields the real layers only;
     generate_model_forward is the adapter's without mtp_preprocess and takes a decoder layer's
     output as a tensor (transformers >= 4.54 returns a tensor; the adapter indexes [0], which would
     drop the batch dim); get_adapter_config_for_subgraph is the original called with
     num_hidden_layers + 1 so that it smooths every real layer (it skips its last, the MTP layer).
  c. transformers' DeepseekV3TopkRouter holds e_score_correction_bias as a buffer; the HF remote
     code's MoEGate has an nn.Parameter, which the AscendV1 saver writes as FLOAT. Turned into a
     float32 Parameter after loading (the fixture stores it F32) so the saver writes it as msModelSlim
     would for the real model.
  d. The recipe's `dataset:` is replaced by the absolute path of the bench's calibration .jsonl
     (msModelSlim accepts absolute paths; its lab_calib sets are not this model's domain).
  e. QuaRot only (bench/msmodelslim_inner.py `_patch_quarot_maps`): model/deepseek_v3/quarot.py's
     norm-fold and rotation maps take the adapter's last layer for the MTP layer (its enorm / hnorm /
     eh_proj / embed_tokens / shared_head); built for num_hidden_layers + 1 layers with that absent
     layer's entries dropped, so every real layer is rotated as in the 671B release.
Nothing else is changed: processors, quantizers and the AscendV1 saver are msModelSlim's.

A report, not a test: exit 0 when everything ran (a loader refusal of an msModelSlim output that the
derived copy works around is a finding, not a failure); 1 when msModelSlim or cvt failed, cvt verify
included (the blocker is printed); 2 when the msModelSlim venv is absent or broken.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import scratch_dir  # bench/common.py
from msmodelslim_run import (CALIB_SEQ, HEADERS, HERE, INNER, REPO, copy_source, fail, grouped, layout_diff,
                             make_data, pattern, quantize_cvt, quantize_msmodelslim, read_output, verify)

RECIPES = {"flexsmooth": HERE / "msmodelslim" / "w8a8_mixed_flexsmooth.yaml",
           "nosmooth": HERE / "msmodelslim" / "w8a8_mixed_nosmooth.yaml"}
CVT_METHODS = ("rtn", "smoothquant")
SUITES = ("w8a8", "w4a8-quarot")


# ---- W8A8 values ----

def value_checks(outs: dict[str, Path], fixture: Path, labels: dict[str, str]) -> tuple[list[str], dict]:
    import torch
    from safetensors.torch import load_file

    def load(d):
        sd = {}
        for f in sorted(d.glob("*.safetensors")):
            sd.update(load_file(str(f)))
        return sd

    src = load(fixture)
    sds = {k: load(d) for k, d in outs.items()}
    lines, facts = [], {}
    for key, sd in sds.items():
        offs = [n for n in sd if n.endswith(".input_offset")]
        nz = sum(int(sd[n].item() != 0) for n in offs)
        scales = [sd[n] for n in sd if n.endswith(".input_scale")]
        bf16 = all(bool((s.float() == s.float().bfloat16().float()).all()) for s in scales)
        changed = [n for n in src if n in sd and sd[n].dtype == src[n].dtype and not torch.equal(sd[n], src[n])]
        facts[key] = {"nonzero_input_offsets": nz, "static_linears": len(offs), "input_scales_bf16": bf16,
                      "floats_changed": grouped(changed)}
        lines.append(f"{labels[key]}: static W8A8 input_offset non-zero on {nz}/{len(offs)} linears "
                     f"({'asymmetric' if nz else 'symmetric'} activations); input_scale values "
                     f"{'all bf16-representable' if bf16 else 'not all bf16-representable'}; float tensors changed "
                     f"vs the source: {', '.join(grouped(changed)) or 'none'}")
    # the two RTN-like outputs' dynamic MLP weights: same recipe (per-channel symmetric min-max int8)
    a, b = sds.get("cvt-rtn"), sds.get("msms-nosmooth")
    if a is not None and b is not None:
        same = tot = scales_equal = n_lin = 0
        err_a = err_b = 0.0
        bf16_match = 0
        for n in a:
            if not (n.endswith(".weight") and a[n].dtype == torch.int8 and ".mlp." in n and n in b):
                continue
            m = n[:-len(".weight")]
            w = src[n]
            n_lin += 1
            same += int((a[n] == b[n]).sum())
            tot += a[n].numel()
            scales_equal += int(torch.equal(a[m + ".weight_scale"], b[m + ".weight_scale"]))
            err_a += float(((a[n].float() * a[m + ".weight_scale"].float() - w.float()) ** 2).sum())
            err_b += float(((b[n].float() * b[m + ".weight_scale"].float() - w.float()) ** 2).sum())
            s_bf16 = b[m + ".weight_scale"].to(torch.bfloat16)
            q_bf16 = torch.round(w / s_bf16).clamp(-128, 127).to(torch.int8)      # division in bf16
            bf16_match += int(torch.equal(q_bf16, b[n]))
        facts["mlp_int8"] = {"linears": n_lin, "same_codes": same / tot, "scales_equal": scales_equal,
                             "mse_cvt_over_msms": err_a / err_b, "msms_equals_bf16_division": bf16_match}
        lines.append(f"dynamic MLP/expert weights, cvt rtn vs msModelSlim nosmooth ({n_lin} linears): weight_scale "
                     f"bit-identical on {scales_equal}/{n_lin}; int8 codes identical for {same / tot:.1%} "
                     f"(the rest +-1); msModelSlim's codes equal round(w_bf16 / scale_bf16) computed in bf16 on "
                     f"{bf16_match}/{n_lin} linears (cvt divides in float32); weight MSE vs the BF16 source "
                     f"cvt / msModelSlim = {err_a / err_b:.3f}")
    return lines, facts


# ---- accuracy ----

def derive_weight_scale(src: Path, dst: Path) -> int:
    """Copy an msModelSlim output, adding weight_scale = deq_scale / input_scale [n, 1] and zero
    weight_offset [n, 1] (tag W8A8) to every static W8A8 linear; returns how many were completed."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    desc_p, index_p = dst / "quant_model_description.json", next(dst.glob("*.safetensors.index.json"))
    desc, index = json.loads(desc_p.read_text()), json.loads(index_p.read_text())
    added = 0
    for f in sorted(dst.glob("*.safetensors")):
        sd = load_file(str(f))
        for n in [n for n in sd if n.endswith(".deq_scale")]:
            m = n[:-len(".deq_scale")]
            if m + ".weight_scale" in sd:
                continue
            if sd[n].dtype != torch.float32:
                raise SystemExit(f"{f.name}: {n} is {sd[n].dtype}; only float32 deq_scale (bf16 models) handled")
            ws = (sd[n] / sd[m + ".input_scale"].float()).reshape(-1, 1)
            sd[m + ".weight_scale"], sd[m + ".weight_offset"] = ws, torch.zeros_like(ws)
            for s in ("weight_scale", "weight_offset"):
                desc[f"{m}.{s}"] = "W8A8"
                index["weight_map"][f"{m}.{s}"] = f.name
            added += 1
        save_file(sd, str(f), metadata={"format": "pt"})
    desc_p.write_text(json.dumps(desc, indent=2))
    index_p.write_text(json.dumps(index, indent=2))
    return added


# ---- main ----

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # no defaults: both live outside the clone, wherever whoever runs the bench put them
    ap.add_argument("--msmodelslim-venv", required=True, help="venv with msmodelslim 26.1 (see docstring)")
    ap.add_argument("--fixture", required=True, help="a trained BF16 DeepSeek-V3 checkpoint directory")
    ap.add_argument("--suite", choices=SUITES, default="w8a8",
                    help="w8a8: W8A8 mixed, static attention (the default); w4a8-quarot: W4A8 with and without "
                         "QuaRot / --rotate hadamard (bench/msmodelslim_quarot.py)")
    ap.add_argument("--cvt", default=str(REPO / ".venv" / "bin" / "cvt"), help="cvt executable")
    ap.add_argument("--headers", default=str(HEADERS), help="Linux UAPI headers (calibration a-t, evaluation u-z)")
    ap.add_argument("--calib-sequences", type=int, default=8, help=f"calibration sequences of {CALIB_SEQ} tokens")
    ap.add_argument("--eval-sequences", type=int, default=32, help="cvt verify --max-sequences")
    ap.add_argument("--seq-len", type=int, default=256, help="evaluation sequence length (cvt verify --seq-len)")
    ap.add_argument("--dir", type=scratch_dir, help="where the work dir goes (default: the system temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (outputs, logs, reports)")
    args = ap.parse_args()

    venv_py = Path(args.msmodelslim_venv) / "bin" / "python"
    if not venv_py.is_file():
        fail(f"no msModelSlim venv at {args.msmodelslim_venv} ({venv_py} missing); build it as the docstring "
             "says or pass --msmodelslim-venv PATH", 2)
    probe = subprocess.run([str(venv_py), str(INNER), "--versions"], capture_output=True, text=True)
    if probe.returncode != 0:
        fail(f"{venv_py} cannot import msmodelslim / transformers / torch:\n{probe.stderr[-2000:]}", 2)
    versions = json.loads(probe.stdout.strip().splitlines()[-1])
    fixture, cvt = Path(args.fixture), args.cvt
    if not (fixture / "config.json").is_file():
        fail(f"{fixture}: no config.json (the trained fixture)", 2)
    if not Path(cvt).is_file():
        fail(f"{cvt}: no cvt executable (pass --cvt)", 2)

    root = Path(tempfile.mkdtemp(prefix="cvt-bench-msmodelslim-", dir=args.dir))
    try:
        if args.suite == "w8a8":
            report(args, root, fixture, cvt, venv_py, versions)
        else:
            import msmodelslim_quarot  # bench/msmodelslim_quarot.py
            msmodelslim_quarot.report(args, root, fixture, cvt, venv_py, versions)
    finally:
        if args.keep:
            print(f"\nwork dir kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def report(args, root: Path, fixture: Path, cvt: str, venv_py: Path, versions: dict) -> None:
    data = make_data(root, Path(args.headers), args.calib_sequences)
    src_copy = copy_source(fixture, root)
    labels = {"msms-flexsmooth": "msModelSlim flex_smooth_quant", "msms-nosmooth": "msModelSlim min-max",
              "cvt-rtn": "cvt rtn", "cvt-smoothquant": "cvt smoothquant"}
    quant: dict[str, dict] = {}
    for name, recipe in RECIPES.items():
        quant[f"msms-{name}"] = quantize_msmodelslim(name, recipe, root, src_copy, data, venv_py, versions, fixture)
    for method in CVT_METHODS:
        out = root / f"cvt-{method}"
        cmd = [cvt, "quantize", str(fixture), str(out), "--scheme", "w8a8", "--format", "ascend",
               "--static-attention", "--method", method, "--calib", str(data["cvt_calib"]),
               "--calib-tokens", str(data["calib_tokens"]), "--device", "cpu", "--quiet"]
        quant[f"cvt-{method}"] = quantize_cvt(f"cvt-{method}", cmd, root)
    outs = {k: q["out"] for k, q in quant.items()}

    # ---- layout ----
    lay = {k: read_output(d) for k, d in outs.items()}
    main_diff = layout_diff(lay["msms-flexsmooth"], lay["cvt-smoothquant"], "msModelSlim", "cvt")
    sib = {"msModelSlim flexsmooth vs nosmooth": layout_diff(lay["msms-flexsmooth"], lay["msms-nosmooth"], "flex", "nosmooth"),
           "cvt smoothquant vs rtn": layout_diff(lay["cvt-smoothquant"], lay["cvt-rtn"], "smoothquant", "rtn")}
    values, facts = value_checks(outs, fixture, labels)
    (root / "layout.json").write_text(json.dumps(
        {k: {"tensors": {n: [dt, list(sh), v["tags"].get(n)] for n, (dt, sh) in sorted(v["tensors"].items())},
             "globals": v["globals"], "files": v["files"]} for k, v in lay.items()}, indent=1))

    # ---- accuracy ----
    acc: dict[str, dict] = {}
    for key, out in outs.items():
        res = verify(cvt, out, fixture, data, root / "reports" / key, args)     # as written first
        if "error" in res and key.startswith("msms-"):
            res["refused"] = res.pop("error")
            derived = root / f"{key}+weight_scale"
            res["derived_linears"] = derive_weight_scale(out, derived)
            res2 = verify(cvt, derived, fixture, data, root / "reports" / f"{key}+weight_scale", args)
            res.update({k: v for k, v in res2.items() if k not in ("cmd",)})
            res["verify_cmd"] = res2["cmd"]
        acc[key] = res
    (root / "results.json").write_text(json.dumps({"versions": versions, "quantize": quant, "verify": acc,
                                                   "facts": facts, "layout_diff": main_diff}, indent=1, default=str))
    print_report(args, fixture, cvt, versions, data, quant, acc, labels, lay, main_diff, sib, values, facts)


def print_report(args, fixture, cvt, versions, data, quant, acc, labels, lay, main_diff, sib, values, facts) -> None:
    import torch

    n_tensors = {k: len(v["tensors"]) for k, v in lay.items()}
    print(f"\nmsModelSlim as a peer: W8A8 mixed (static attention, dynamic MLP) on {fixture}")
    print(f"command:      {shlex.join([sys.executable, *sys.argv])}")
    print(f"msModelSlim:  {versions['msmodelslim']} (transformers {versions['transformers']}, torch "
          f"{versions['torch']}), `msmodelslim quant --device cpu --model_type DeepSeek-V3`, run through "
          "bench/msmodelslim_inner.py's adapter patches (docstring a-d: built-in DeepseekV3 classes, no MTP layer, tensor layer "
          "outputs, router bias as a Parameter)")
    print(f"cvt:          {cvt} (torch {torch.__version__}); CPU: {os.cpu_count()} cores")
    print(f"calibration:  {args.calib_sequences} x {CALIB_SEQ} tokens (<bos> + ASCII bytes of {args.headers} a-t, "
          f"the training split), the same ids for both tools")
    print(f"evaluation:   cvt verify --data held-out headers u-z ({data['held_out_bytes']} bytes) --seq-len "
          f"{args.seq_len} --max-sequences {args.eval_sequences} --device cpu --dtype fp32, against the BF16 fixture")
    print("\nlayout: msModelSlim flex_smooth_quant output vs cvt smoothquant output "
          f"({n_tensors['msms-flexsmooth']} vs {n_tensors['cvt-smoothquant']} tensors)")
    for ln in main_diff:
        print(f"  - {ln}")
    for what, d in sib.items():
        print(f"  {what}: " + ("same names / dtypes / shapes / tags / keys" if not [x for x in d if not x.startswith(
            "config.json") and "order" not in x] else "; ".join(d)))
    print("\nvalues:")
    for ln in values:
        print(f"  - {ln}")
    print("\nloading with cvt's runtime:")
    for key, r in acc.items():
        if "refused" in r:
            print(f"  - {labels[key]}: REFUSED by cvt's loader: {r['refused']}")
            print(f"    -> verified a copy with weight_scale = deq_scale / input_scale [n,1] and weight_offset = 0 "
                  f"added to {r['derived_linears']} static W8A8 linears (cvt's static kernel does not read them)")
        else:
            print(f"  - {labels[key]}: loads as written" + ("" if "kl" in r else f"; cvt verify FAILED: {r.get('error')}"))

    print("\n| output (W8A8 mixed, static attention) | quantize wall s | loads in cvt as written | mean KL | "
          "PPL ratio | same top-1 | min layer cosine | verify wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for key in ("cvt-rtn", "cvt-smoothquant", "msms-nosmooth", "msms-flexsmooth"):
        r = acc[key]
        loads = "yes" if "refused" not in r else "no: refused (verified a copy with `weight_scale` derived)"
        if "kl" in r:
            print(f"| {labels[key]} | {quant[key]['wall_s']:.1f} | {loads} | {r['kl']:.5f} | {r['ppl_ratio']:.4f} | "
                  f"{r['top1']:.2%} | {r['min_cos']:.5f} | {r['wall_s']:.1f} |")
        else:
            print(f"| {labels[key]} | {quant[key]['wall_s']:.1f} | {loads} | - | - | - | - | failed: {r.get('error')} |")

    g_ms, g_cvt = lay["msms-flexsmooth"]["globals"], lay["cvt-smoothquant"]["globals"]
    st = lambda k: sorted({pattern(n).rsplit(".", 1)[1] for n, t in lay[k]["tags"].items() if t == "W8A8"})  # noqa: E731
    dy = lambda k: sorted({pattern(n).rsplit(".", 1)[1] for n, t in lay[k]["tags"].items() if t == "W8A8_DYNAMIC"})  # noqa: E731
    extra = lambda a, b: ", ".join(sorted(set(lay[a]["files"]) - set(lay[b]["files"]))) or "-"  # noqa: E731
    cfg_extra = sorted(k for k in lay["cvt-smoothquant"]["config"] if k not in lay["msms-flexsmooth"]["config"])
    f_ms, f_cvt = facts["msms-flexsmooth"], facts["cvt-smoothquant"]
    print("\n| layout | cvt (`--format ascend --static-attention`) | msModelSlim 26.1 (ascendv1_saver) |")
    print("|---|---|---|")
    print(f"| static W8A8 tensors per linear | {', '.join(st('cvt-smoothquant'))} | {', '.join(st('msms-flexsmooth'))} |")
    print(f"| W8A8_DYNAMIC tensors per linear | {', '.join(dy('cvt-smoothquant'))} | {', '.join(dy('msms-flexsmooth'))} |")
    print(f"| static activations | symmetric (input_offset 0 on {f_cvt['static_linears'] - f_cvt['nonzero_input_offsets']}"
          f"/{f_cvt['static_linears']}) | asymmetric (input_offset != 0 on {f_ms['nonzero_input_offsets']}"
          f"/{f_ms['static_linears']}) |")
    print(f"| description globals | {', '.join(f'{k}={json.dumps(v)}' for k, v in g_cvt.items())} | "
          f"{', '.join(f'{k}={json.dumps(v)}' for k, v in g_ms.items())} |")
    print(f"| extra files | {extra('cvt-smoothquant', 'msms-flexsmooth')} | {extra('msms-flexsmooth', 'cvt-smoothquant')} |")
    print(f"| config.json | adds {', '.join(cfg_extra) or 'nothing'} | the source's (no quantization_config to strip) |")
    print(f"| float tensors changed by smoothing | {', '.join(f_cvt['floats_changed'])} | {', '.join(f_ms['floats_changed'])} |")
    if "mlp_int8" in facts:
        m = facts["mlp_int8"]
        print(f"| MLP int8 codes (rtn vs min-max) | round(w_f32 / scale) | round(w_bf16 / scale_bf16) in bf16: "
              f"{1 - m['same_codes']:.1%} of codes differ by 1, weight MSE x{1 / m['mse_cvt_over_msms']:.2f} |")
    failed = [labels[k] for k, r in acc.items() if "kl" not in r]
    if failed:
        fail(f"BLOCKER: cvt verify failed on {', '.join(failed)}: "
             + "; ".join(f"{labels[k]}: {r.get('error')}" for k, r in acc.items() if "kl" not in r))


if __name__ == "__main__":
    main()
