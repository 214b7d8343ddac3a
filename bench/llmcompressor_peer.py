"""llm-compressor as a peer: GPTQ W4A16 (int4, symmetric, group 128, compressed-tensors
pack-quantized) of the trained DeepSeek-V3 fixture with llm-compressor and with cvt, on the same
calibration token ids, judged by one referee; cvt's RTN as the baseline row.

Usage: .venv/bin/python bench/llmcompressor_peer.py --llmc-venv VENV --fixture DIR
       [--cvt .venv/bin/cvt] [--num-seq 128] [--seq-len 256] [--eval-seq 32]
       [--group-size 128] [--llmc-actorder static] [--cvt-arg=--OPTION ...] [--cvt-verify]
       [--dir DIR] [--keep]

llm-compressor lives in its own venv, never in `make test` (CPU only; no CUDA wheels):

    python3 -m venv VENV                                # any directory: pass it as --llmc-venv VENV
    VENV/bin/pip install torch==2.13.0                  # first: the local CPU wheel
    VENV/bin/pip install llmcompressor==0.14.0.1
    # -> transformers 5.17.0, compressed-tensors 0.19.0, accelerate, datasets, auto-round; torch
    #    stays 2.13.0+cpu (llmcompressor wants torch>=2.10,<=2.14.0), nothing needs --no-deps.

llmcompressor 0.14 requires transformers 5.15-5.17, whose DeepseekV3 experts are fused 3-D
parameters; llm-compressor's own `load_context()` (load_quantizable_moe) loads them as one
nn.Linear per expert (LinearExperts2D: experts.E.{gate,up,down}_proj), so GPTQ quantizes every
routed expert and the output has cvt's per-expert tensor names.

What runs, in one process tree (CPU):
  1. data: --num-seq calibration texts of --seq-len - 1 ASCII bytes evenly spaced through the
     Linux UAPI headers a-t (/usr/include/linux, the fixture's training split), each tokenized as
     <bos> + bytes with the fixture's tokenizer.json (`tokenizers`); evaluation: --eval-seq
     sequences built the same way from the held-out headers u-z. cvt gets the calibration texts
     as .jsonl (its tokenizer prepends <bos> to each text, it concatenates and cuts 256-token
     sequences: quant/stage/__init__.py); the bench checks that cvt's own `calib_tokens` gives exactly
     these ids, and after the run that cvt_manifest.json's calibration sha256 is theirs.
     llm-compressor gets the ids as a pre-tokenized `datasets.Dataset` (no shuffle,
     max_seq_length --seq-len); a hook on embed_tokens records what its calibration fed the
     model, checked to be the same sequences (its LengthAwareSampler may reorder samples of
     equal length; the GPTQ Hessians are sums over tokens).
  2. cvt: `cvt quantize FIXTURE DST --scheme w4a16 --format compressed-tensors --method gptq
     --group-size 128 --recipe R --calib C.jsonl --calib-tokens N --device cpu` (+ --cvt-arg),
     and the same with --method rtn (no --cvt-arg). R keeps the group size for every linear
     whose in_features it divides and makes the others per channel (below).
  3. llm-compressor: `oneshot(model, dataset, recipe=GPTQModifier(config_groups=...,
     ignore=IGNORE))` in the llm-compressor venv (this file's `--_llmc-inner` mode), saved with
     save_pretrained(save_compressed=True). config_groups = the W4A16 preset's weights (int4,
     symmetric, group 128, static minmax) for "Linear" plus a per-channel int4 group for the
     linears the group does not divide (matched first: compressed-tensors ranks regex targets
     above class names); IGNORE = the `quantization_config.ignore` list of cvt's GPTQ output
     (lm_head, MLA kv_b_proj, the routers mlp.gate), as exact module names. GPTQ settings are
     llm-compressor's defaults (block 128, dampening 0.01, actorder static: --llmc-actorder),
     all experts see every calibration token (moe_calibrate_all_experts, its default).
  4. referee, the same for all three outputs, in cvt's venv (transformers 5.23,
     compressed-tensors 0.20): each output's packed weights are decompressed with
     compressed-tensors' own compressor for the module's scheme (resolved with its
     `match_targets` priority: exact name, regex, class), in float32 (scales upcast, so
     int4 x scale is exact), the float tensors copied, and the result loaded with transformers'
     DeepseekV3ForCausalLM (no missing / unexpected keys allowed); it and the BF16 fixture (as
     float32) run the held-out ids; printed: mean per-token KL(bf16 || quant), share of
     positions with the same top-1, PPL(quant) / PPL(bf16) over the next-token targets, and the
     module count per scheme. With --cvt-verify, `cvt verify` on the same held-out sequences as
     a second opinion (cvt's runtime, its own loader), in separate columns.
  5. one table: tool, method, calibration tokens, quantize wall s (the whole child process:
     imports, load, calibration, save), mean KL, same top-1, PPL ratio, KL / llm-compressor's.

Workarounds needed (each stated in the output):
  a. transformers 5.17's from_pretrained runs `apply_patches()` when llm-compressor's
     load_context() registers its expert patch; it calls dir() on every loaded transformers.*
     module, and the lazy `image_processing_*_fast` alias modules import torchvision on dir()
     (ModuleNotFoundError: no torchvision here; its CUDA-built wheel is not installed on
     purpose). The inner mode drops those broken alias modules from sys.modules before loading.
  b. The fixture's MLA q_b_proj has in_features 96 (q_lora_rank), which group 128 does not
     divide: llm-compressor's W4A16 preset fails in its observer (`unflatten: ... [-1, 128] don't
     multiply up to ... (96)`), and cvt refuses (`group size 128 does not divide
     in_features=96`). Both get per-channel int4 for such linears (in < group: one group would
     span the row, so the numbers are the same). Which linears: 2-D weights of the fixture whose
     in_features the group size does not divide, less what cvt keeps float (read from a
     per-channel RTN probe run's quantization_config.ignore, so kv_b_proj, in 64, stays float).
     A linear wider than the group that it does not divide is refused (exit 2).
  c. transformers 5.23's compressed-tensors loader (dequantize=True) gives llm-compressor's
     q_b_proj the "Linear" group's scheme instead of its regex group's and fails (`tensor column
     shape must be divisible by the given group_size 128 but got 96`), and 5.17's leaves the
     per-expert targets of cvt's output unmatched (3-D experts): hence the referee of step 4,
     which runs compressed-tensors' dequantizer per module itself.

A report, not a test: exit 0 when everything ran; 1 when a tool failed (the blocker and a log
tail are printed) or a check failed (token ids differ, an output does not load); 2 when the
llm-compressor venv is absent or broken, or the fixture / headers / cvt are missing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import run_logged as run, scratch_dir  # bench/common.py

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
HEADERS = Path("/usr/include/linux")
CVT_CALIB_SEQ = 256     # cvt quantize cuts calibration text into sequences of 256 tokens (quant/stage/__init__.py)
INNER = "--_llmc-inner"


# --------------------------------------------------------------------------------------------
# inner mode: runs in the llm-compressor venv
# --------------------------------------------------------------------------------------------

def _drop_broken_transformers_aliases() -> list[str]:
    """Workaround a: transformers.* modules whose dir() raises ImportError (torchvision-backed
    image-processor aliases) out of sys.modules, so that apply_patches() can walk the rest."""
    dropped = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("transformers"):
            continue
        try:
            dir(mod)
        except ImportError:
            del sys.modules[name]
            dropped.append(name)
    return dropped


def llmc_inner(argv: list[str]) -> None:
    from importlib.metadata import version

    versions = {p: version(p) for p in ("llmcompressor", "transformers", "compressed-tensors", "torch")}
    if argv and argv[0] == "--versions":
        import llmcompressor  # noqa: F401  (importable)
        print(json.dumps(versions))
        return
    job = json.loads(Path(argv[0]).read_text())
    t0 = time.perf_counter()
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.utils import load_context

    ids = job["ids"]
    dropped = _drop_broken_transformers_aliases()
    with load_context():
        model = AutoModelForCausalLM.from_pretrained(job["fixture"], dtype=torch.bfloat16)
    experts = [type(m.experts).__name__ for m in model.modules() if hasattr(m, "experts")]
    t_load = time.perf_counter()

    fed: list[tuple[int, ...]] = []

    def record(_mod, args):
        for row in args[0].reshape(-1, args[0].shape[-1]).tolist():
            fed.append(tuple(row))

    hook = model.get_input_embeddings().register_forward_pre_hook(record)
    ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]})
    # the modifier's actorder wins over config_groups' (its default "static" overrides a None there)
    actorder = None if job["actorder"] == "none" else job["actorder"]
    recipe = GPTQModifier(config_groups=job["config_groups"], ignore=job["ignore"], actorder=actorder)
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=job["seq_len"],
            num_calibration_samples=len(ids), shuffle_calibration_samples=False)
    hook.remove()
    t_cal = time.perf_counter()
    model.save_pretrained(job["out"], save_compressed=True)
    t_save = time.perf_counter()

    seen, first = set(), []
    for row in fed:                     # the sequential pipeline may run the embedding more than once
        if row not in seen:
            seen.add(row)
            first.append(row)
    arr = np.asarray(first, dtype=np.int64)
    Path(job["result"]).write_text(json.dumps({
        "versions": versions, "dropped_alias_modules": len(dropped), "experts_modules": sorted(set(experts)),
        "load_s": t_load - t0, "oneshot_s": t_cal - t_load, "save_s": t_save - t_cal,
        "fed_sequences": len(first), "fed_tokens": int(arr.size), "embedding_calls": len(fed),
        "fed_sha256": hashlib.sha256(arr.tobytes()).hexdigest(),
        "fed_sorted_sha256": hashlib.sha256(np.asarray(sorted(first), dtype=np.int64).tobytes()).hexdigest(),
        "gptq": {"block_size": recipe.block_size, "dampening_frac": recipe.dampening_frac},
    }))


# --------------------------------------------------------------------------------------------
# outer mode: runs in cvt's venv
# --------------------------------------------------------------------------------------------

def fail(msg: str, code: int = 1) -> None:
    print(f"\nllmcompressor_peer: {msg}", file=sys.stderr)
    sys.exit(code)


def tail(log: Path, n: int = 25) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if "it/s]" not in ln and "s/it]" not in ln]
    return "\n".join("    " + ln[:300] for ln in lines[-n:])


def sha(ids) -> str:
    import numpy as np

    return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()


def chunks(text: str, n: int, width: int) -> list[str]:
    step = len(text) // n
    if step < width:
        fail(f"{n} chunks of {width} bytes do not fit in {len(text)} bytes of text", 2)
    return [text[i * step:i * step + width] for i in range(n)]


def make_data(root: Path, args, fixture: Path) -> dict:
    import tokenizers

    files = sorted(Path(args.headers).glob("*.h"))
    if not files:
        fail(f"{args.headers}: no *.h files (the Linux UAPI headers the fixture was trained on; "
             "Debian: linux-libc-dev)", 2)
    blob = lambda fs: bytes(c for f in fs for c in f.read_bytes() if c < 128).decode("ascii")  # noqa: E731
    train = blob([f for f in files if f.name[0].lower() <= "t"])
    held = blob([f for f in files if f.name[0].lower() >= "u"])
    tok = tokenizers.Tokenizer.from_file(str(fixture / "tokenizer.json"))
    bos = json.loads((fixture / "config.json").read_text())["bos_token_id"]

    def encode(texts: list[str]) -> list[list[int]]:
        out = []
        for t in texts:
            ids = tok.encode(t, add_special_tokens=False).ids
            if ids != list(t.encode("ascii")):
                fail(f"{fixture}/tokenizer.json is not byte-level as its README says (token id != byte)", 2)
            out.append([bos] + ids)
        return out

    calib_texts = chunks(train, args.num_seq, args.seq_len - 1)
    eval_texts = chunks(held, args.eval_seq, args.seq_len - 1)
    cvt_calib, eval_jsonl = root / "calib.jsonl", root / "heldout.jsonl"
    cvt_calib.write_text("".join(json.dumps({"text": t}) + "\n" for t in calib_texts))
    eval_jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in eval_texts))
    calib_ids = encode(calib_texts)
    return {"calib_ids": calib_ids, "eval_ids": encode(eval_texts), "cvt_calib": cvt_calib, "eval_jsonl": eval_jsonl,
            "calib_tokens": args.num_seq * args.seq_len, "train_bytes": len(train), "held_bytes": len(held),
            "calib_sha256": sha(calib_ids)}


def check_cvt_tokens(fixture: Path, data: dict) -> None:
    """cvt's own tokenization of the calibration file (the code `cvt quantize` runs) against ours."""
    import torch

    from cvt.quant.methods.data import calib_tokens
    from cvt.runtime.tokenizer import load_tokenizer

    cfg = json.loads((fixture / "config.json").read_text())
    got = calib_tokens(load_tokenizer(fixture, cfg), data["cvt_calib"], seq_len=CVT_CALIB_SEQ,
                       max_sequences=max(1, data["calib_tokens"] // CVT_CALIB_SEQ),
                       max_len=cfg.get("max_position_embeddings"))
    ours = torch.tensor(data["calib_ids"], dtype=torch.long).reshape(-1, CVT_CALIB_SEQ)
    if got.shape != ours.shape or not torch.equal(got, ours):
        fail(f"cvt's calib_tokens of {data['cvt_calib']} gives {list(got.shape)} ids that differ from the "
             f"{list(ours.shape)} fed to llm-compressor")


def linear_shapes(fixture: Path) -> dict[str, tuple[int, int]]:
    from safetensors import safe_open

    out = {}
    for f in sorted(fixture.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                shape = sf.get_slice(k).get_shape()
                if k.endswith(".weight") and len(shape) == 2 and "embed" not in k:
                    out[k[:-len(".weight")]] = tuple(shape)
    return out


def pattern(name: str) -> str:
    return re.sub(r"\.experts\.\d+\.", ".experts.E.", re.sub(r"\.layers\.\d+\.", ".layers.N.", name))


def qconfig(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())["quantization_config"]


# ---- referee ----

def dequantized_checkpoint(out: Path, dst: Path, fixture: Path) -> dict:
    """Decompress OUT with compressed-tensors' own compressors (float32) into a float checkpoint
    at DST that transformers loads as a plain DeepseekV3ForCausalLM. Returns counts for the report."""
    from collections import OrderedDict

    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name, match_targets
    from safetensors.torch import load_file, save_file

    cfg = json.loads((out / "config.json").read_text())
    qc = QuantizationConfig.model_validate(cfg["quantization_config"])
    target_to_scheme = OrderedDict((t, s) for s in qc.config_groups.values() for t in s.targets)
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    ref = {}
    for f in sorted(fixture.glob("*.safetensors")):
        ref.update(load_file(str(f)))
    probe = torch.nn.Linear(1, 1, device="meta")
    modules = sorted(k[:-len(".weight_packed")] for k in sd if k.endswith(".weight_packed"))
    float_sd: dict[str, torch.Tensor] = {}
    per_scheme: dict[str, int] = {}
    for m in modules:
        if any(match_name(m, ig) for ig in qc.ignore):
            raise SystemExit(f"{out}: {m} is packed but matches ignore {qc.ignore}")
        matched = match_targets(m, probe, list(target_to_scheme))
        if not matched:
            raise SystemExit(f"{out}: {m} is packed but matches no config_groups target")
        scheme = target_to_scheme[matched[0]]
        fmt = scheme.format or qc.format
        local = {k[len(m) + 1:]: v for k, v in sd.items() if k.startswith(m + ".") and "." not in k[len(m) + 1:]}
        local["weight_scale"] = local["weight_scale"].float()          # exact int4 x scale in float32
        w = BaseCompressor.get_value_from_registry(fmt).decompress(local, scheme)["weight"]
        float_sd[m + ".weight"] = w.float()
        wa = scheme.weights
        key = f"{wa.type}{wa.num_bits} {'sym' if wa.symmetric else 'asym'} {wa.strategy}" + (
            f" {wa.group_size}" if wa.strategy == "group" else "")
        per_scheme[key] = per_scheme.get(key, 0) + 1
    consumed = {k for k in sd if any(k.startswith(m + ".") for m in modules)}
    same_float = 0
    for k, v in sd.items():
        if k in consumed:
            continue
        float_sd[k] = v.float() if v.is_floating_point() else v
        same_float += int(k in ref and ref[k].dtype == v.dtype and torch.equal(ref[k], v))
    missing, extra = sorted(set(ref) - set(float_sd)), sorted(set(float_sd) - set(ref))
    if missing or extra:
        raise SystemExit(f"{out}: tensor names differ from the fixture's after decompression: missing "
                         f"{missing[:4]} ({len(missing)}), extra {extra[:4]} ({len(extra)})")
    rel = [float((float_sd[m + ".weight"] - ref[m + ".weight"].float()).norm() / ref[m + ".weight"].float().norm())
           for m in modules]
    dst.mkdir(parents=True)
    save_file(float_sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg.pop("quantization_config")
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return {"modules": len(modules), "per_scheme": per_scheme, "float_tensors": len(sd) - len(consumed),
            "float_same": same_float, "ignore": list(qc.ignore), "weight_rel_err": sum(rel) / max(1, len(rel)),
            "unchanged_weights": sum(r == 0.0 for r in rel)}


def load_float(path: Path):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager",
                                                       output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise SystemExit(f"{path}: transformers load report: {bad}")
    return model.eval()


def logits_of(model, ids) -> "torch.Tensor":  # noqa: F821
    import torch

    with torch.no_grad():
        return torch.cat([model(ids[i:i + 8]).logits.float() for i in range(0, len(ids), 8)])


def compare(ref_logits, logits, ids) -> dict:
    import torch

    lp_ref, lp = torch.log_softmax(ref_logits, -1), torch.log_softmax(logits, -1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    tgt = ids[:, 1:]
    nll_ref = -lp_ref[:, :-1].gather(-1, tgt[..., None]).mean()
    nll = -lp[:, :-1].gather(-1, tgt[..., None]).mean()
    return {"kl": float(kl.mean()), "top1": float((ref_logits.argmax(-1) == logits.argmax(-1)).float().mean()),
            "ppl_ratio": float(torch.exp(nll - nll_ref)), "ppl_ref": float(torch.exp(nll_ref)), "tokens": int(kl.numel())}


def cvt_verify(cvt: str, out: Path, fixture: Path, data: dict, rep: Path, args) -> dict:
    cmd = [cvt, "verify", str(out), "--reference", str(fixture), "--report", str(rep), "--data", str(data["eval_jsonl"]),
           "--seq-len", str(args.seq_len), "--max-sequences", str(args.eval_seq), "--device", "cpu", "--quiet"]
    rep.mkdir(parents=True, exist_ok=True)
    wall, rc = run(cmd, rep.with_suffix(".log"))
    if not (rep / "report.json").is_file():
        return {"error": (rep.with_suffix(".log").read_text(errors="replace").strip().splitlines() or ["?"])[-1]}
    lg = json.loads((rep / "report.json").read_text())["logits"]
    return {"kl": lg["kl_mean"], "top1": lg["same_top1"], "ppl_ratio": lg["ppl_ratio"], "wall_s": wall}


def tree_state() -> str:
    """The commit cvt runs from and its uncommitted changes to the quantizer (results depend on them)."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "quant"], capture_output=True,
                               text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    dirty = sorted(ln[3:] for ln in dirty if ln.strip())
    return f"commit {head}" + (f", uncommitted: {', '.join(dirty)}" if dirty else "")


# ---- main ----

def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == INNER:
        llmc_inner(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # no defaults: both live outside the clone, wherever whoever runs the bench put them
    ap.add_argument("--llmc-venv", required=True, help="venv with llmcompressor (see the docstring)")
    ap.add_argument("--fixture", required=True, help="a trained BF16 DeepSeek-V3 checkpoint directory")
    ap.add_argument("--cvt", default=str(REPO / ".venv" / "bin" / "cvt"), help="cvt executable")
    ap.add_argument("--headers", default=str(HEADERS), help="Linux UAPI headers (calibration a-t, evaluation u-z)")
    ap.add_argument("--num-seq", type=int, default=128, help="calibration sequences")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per calibration / evaluation sequence (<bos> included)")
    ap.add_argument("--eval-seq", type=int, default=32, help="held-out evaluation sequences")
    ap.add_argument("--group-size", type=int, default=128, help="int4 group size (both tools)")
    ap.add_argument("--llmc-actorder", default="static", choices=["static", "weight", "group", "none"],
                    help="llm-compressor GPTQ actorder (its default: static)")
    ap.add_argument("--cvt-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for cvt's GPTQ run (repeatable; write --cvt-arg=--option)")
    ap.add_argument("--cvt-verify", action="store_true", help="also run `cvt verify` on each output (second opinion)")
    ap.add_argument("--dir", type=scratch_dir, help="where the work dir goes (default: the system temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (outputs, logs)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where both tools calibrate: cvt quantize --device; llm-compressor's sequential pipeline "
                         "onloads each layer to the GPU when it sees one (cpu: CUDA_VISIBLE_DEVICES='' for it)")
    args = ap.parse_args()
    if args.seq_len < 2 or (args.num_seq * args.seq_len) % CVT_CALIB_SEQ:
        fail(f"--num-seq x --seq-len must be a multiple of {CVT_CALIB_SEQ} (cvt's calibration sequence length)", 2)

    venv_py = Path(args.llmc_venv) / "bin" / "python"
    if not venv_py.is_file():
        fail(f"no llm-compressor venv at {args.llmc_venv} ({venv_py} missing); build it as the docstring says "
             "or pass --llmc-venv PATH", 2)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["TOKENIZERS_PARALLELISM"] = "false"
    probe = subprocess.run([str(venv_py), __file__, INNER, "--versions"], capture_output=True, text=True, env=env)
    if probe.returncode != 0:
        fail(f"{venv_py} cannot import llmcompressor / transformers / torch:\n{probe.stderr[-2000:]}", 2)
    versions = json.loads(probe.stdout.strip().splitlines()[-1])
    fixture, cvt = Path(args.fixture), args.cvt
    if not (fixture / "config.json").is_file():
        fail(f"{fixture}: no config.json (the trained fixture)", 2)
    if not Path(cvt).is_file():
        fail(f"{cvt}: no cvt executable (pass --cvt)", 2)

    root = Path(tempfile.mkdtemp(prefix="cvt-bench-llmc-", dir=args.dir))
    try:
        report(args, root, fixture, cvt, venv_py, env, versions)
    finally:
        if args.keep:
            print(f"\nwork dir kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def report(args, root: Path, fixture: Path, cvt: str, venv_py: Path, env: dict, versions: dict) -> None:
    import torch

    t_start = time.perf_counter()
    data = make_data(root, args, fixture)
    check_cvt_tokens(fixture, data)
    G = args.group_size

    # which linears the group does not divide, and which of them cvt quantizes (workaround b)
    shapes = linear_shapes(fixture)
    ragged = {m: s for m, s in shapes.items() if G and s[1] % G}
    probe_out = root / "cvt-probe"
    cmd = [cvt, "quantize", str(fixture), str(probe_out), "--scheme", "w4a16", "--format", "compressed-tensors",
           "--method", "rtn", "--group-size", "0", "--quiet"]
    _, rc = run(cmd, root / "cvt-probe.log")
    if rc != 0:
        print(f"cvt (per-channel probe) failed, rc {rc}: {shlex.join(cmd)}\n{tail(root / 'cvt-probe.log')}")
        fail("cvt quantize (per-channel RTN probe for the float list) failed; log above")
    cvt_float = set(qconfig(probe_out)["ignore"])
    shutil.rmtree(probe_out)
    per_channel = sorted(m for m in ragged if m not in cvt_float)
    wide = [m for m in per_channel if ragged[m][1] > G]
    if wide:
        fail(f"group {G} does not divide in_features of {', '.join(f'{m} {ragged[m]}' for m in wide)}: no "
             "equivalent per-channel fallback (in > group); pick another --group-size", 2)
    pc_patterns = sorted({re.escape(pattern(m).split(".layers.N.", 1)[-1]).replace(r"experts\.E\.", r"experts\.\d+\.")
                          for m in per_channel})
    recipe = root / "cvt-recipe.json"
    recipe.write_text(json.dumps({"rules": [{"pattern": rf"\.{p}$", "scheme": "w4a16", "group_size": 0}
                                            for p in pc_patterns]}))

    # ---- cvt ----
    quant: dict[str, dict] = {}
    outs: dict[str, Path] = {}
    for method in ("gptq", "rtn"):
        out = root / f"cvt-{method}"
        cmd = [cvt, "quantize", str(fixture), str(out), "--scheme", "w4a16", "--format", "compressed-tensors",
               "--method", method, "--group-size", str(G), "--recipe", str(recipe), "--device", args.device,
               "--quiet"]
        if method != "rtn":
            cmd += ["--calib", str(data["cvt_calib"]), "--calib-tokens", str(data["calib_tokens"]), *args.cvt_arg]
        log = root / f"cvt-{method}.log"
        wall, rc = run(cmd, log)
        if rc != 0:
            print(f"cvt ({method}) failed, rc {rc}: {shlex.join(cmd)}\n{tail(log)}")
            fail(f"BLOCKER: cvt quantize --method {method} failed; log above")
        man = json.loads((out / "cvt_manifest.json").read_text())
        stage = next(s for s in man["stages"] if s["name"] == "quantize")
        cal = stage["parameters"].get("calibration") or {}
        if method != "rtn" and cal.get("sha256") != data["calib_sha256"]:
            fail(f"cvt calibrated on other ids: manifest {cal} vs ours {data['calib_tokens']} tokens "
                 f"sha256 {data['calib_sha256']}")
        secs = (man.get("quant", {}).get("calibration") or {}).get("seconds_per_layer") or []
        outs[f"cvt-{method}"] = out
        quant[f"cvt-{method}"] = {"wall_s": wall, "cmd": cmd, "tokens": cal.get("tokens", 0),
                                  "inner": f"calibration {sum(secs):.1f} s" if secs else "no calibration"}
    ignore = list(qconfig(outs["cvt-gptq"])["ignore"])

    # ---- llm-compressor ----
    groups = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                               "strategy": "group", "group_size": G}}}
    if pc_patterns:
        groups["group_1"] = {"targets": [f"re:.*\\.{p}$" for p in pc_patterns],
                             "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}}
    out = root / "llmc-gptq"
    job = {"fixture": str(fixture), "out": str(out), "ids": data["calib_ids"], "seq_len": args.seq_len,
           "config_groups": groups, "ignore": ignore, "actorder": args.llmc_actorder,
           "result": str(root / "llmc-result.json")}
    (root / "llmc-job.json").write_text(json.dumps(job))
    cmd = [str(venv_py), __file__, INNER, str(root / "llmc-job.json")]
    log = root / "llmc-gptq.log"
    wall, rc = run(cmd, log, {**env, "CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else env)
    if rc != 0 or not (out / "config.json").is_file():
        print(f"llm-compressor failed, rc {rc}: {shlex.join(cmd)}\n{tail(log)}")
        fail(f"BLOCKER: llm-compressor {versions['llmcompressor']} could not quantize {fixture}; log above")
    lr = json.loads((root / "llmc-result.json").read_text())
    if lr["fed_sorted_sha256"] != sha(sorted(data["calib_ids"])):
        fail(f"llm-compressor's calibration fed {lr['fed_sequences']} sequences / {lr['fed_tokens']} tokens "
             f"to the embedding, not our {args.num_seq} x {args.seq_len} (compared as a set of sequences)")
    same_order = lr["fed_sha256"] == data["calib_sha256"]
    outs["llmc-gptq"] = out
    lr["gptq"]["actorder"] = "/".join(sorted({str(g["weights"].get("actorder")) for g in qconfig(out)["config_groups"].values()}))
    quant["llmc-gptq"] = {"wall_s": wall, "cmd": cmd, "tokens": lr["fed_tokens"],
                          "inner": f"load {lr['load_s']:.1f} s, oneshot {lr['oneshot_s']:.1f} s, save {lr['save_s']:.1f} s"}

    # ---- referee ----
    t_ref = time.perf_counter()
    eval_ids = torch.tensor(data["eval_ids"], dtype=torch.long)
    ref_logits = logits_of(load_float(fixture), eval_ids)
    acc: dict[str, dict] = {}
    for key, o in outs.items():
        try:
            deq = dequantized_checkpoint(o, root / f"{key}-float32", fixture)
            res = compare(ref_logits, logits_of(load_float(root / f"{key}-float32"), eval_ids), eval_ids)
        except SystemExit as exc:
            fail(f"referee: {key}: {exc}")
        res.update(deq)
        acc[key] = res
    ref_wall = time.perf_counter() - t_ref
    if args.cvt_verify:
        for key, o in outs.items():
            acc[key]["cvt_verify"] = cvt_verify(cvt, o, fixture, data, root / "reports" / key, args)
    (root / "results.json").write_text(json.dumps({"versions": versions, "llmc": lr, "quantize": quant,
                                                   "referee": acc}, indent=1, default=str))

    # ---- print ----
    from importlib.metadata import version

    rows = [("llm-compressor", "gptq", "llmc-gptq"), ("cvt", "gptq", "cvt-gptq"), ("cvt", "rtn", "cvt-rtn")]
    base_kl = acc["llmc-gptq"]["kl"]
    print(f"\nllm-compressor as a peer: W4A16 GPTQ (int4 sym, group {G}, compressed-tensors pack-quantized) "
          f"on {fixture}")
    print(f"command:        {shlex.join([sys.executable, *sys.argv])}")
    print(f"llm-compressor: {versions['llmcompressor']} (transformers {versions['transformers']}, compressed-tensors "
          f"{versions['compressed-tensors']}, torch {versions['torch']}); experts as {', '.join(lr['experts_modules'])}; "
          f"GPTQ block {lr['gptq']['block_size']}, dampening {lr['gptq']['dampening_frac']}, actorder "
          f"{lr['gptq']['actorder']}, all experts calibrated on every token")
    print(f"cvt:            {cvt} (torch {torch.__version__}; {tree_state()}); GPTQ extra args: "
          f"{shlex.join(args.cvt_arg) or '-'}; CPU: {os.cpu_count()} cores; device {args.device}")
    print(f"calibration:    {args.num_seq} x {args.seq_len} = {data['calib_tokens']} tokens (<bos> + ASCII of "
          f"{args.headers} a-t, {data['train_bytes']} bytes, the training split), sha256 {data['calib_sha256'][:16]}: "
          f"equal to cvt's calib_tokens and its manifest, and to what llm-compressor's calibration fed the embedding "
          f"({lr['fed_sequences']} distinct sequences in {lr['embedding_calls']} embedding calls"
          + (")" if same_order else "; in another order: its LengthAwareSampler argsorts equal lengths, "
             "which the Hessians do not depend on)")
          + ("" if args.seq_len == CVT_CALIB_SEQ else f"; cvt cuts the same stream into {CVT_CALIB_SEQ}-token sequences"))
    print(f"evaluation:     {args.eval_seq} x {args.seq_len} = {acc['llmc-gptq']['tokens']} held-out tokens (<bos> + "
          f"ASCII of u-z, {data['held_bytes']} bytes); BF16 fixture PPL {acc['llmc-gptq']['ppl_ref']:.3f} "
          f"({math.log(acc['llmc-gptq']['ppl_ref']):.3f} nats/token)")
    print(f"referee:        compressed-tensors {version('compressed-tensors')} decompress (float32) + transformers "
          f"{version('transformers')} DeepseekV3ForCausalLM (fp32, eager) vs the BF16 fixture as fp32; {ref_wall:.1f} s")
    print(f"float (ignore): {', '.join(sorted({pattern(m) for m in ignore}))} (cvt's GPTQ output, passed to "
          "llm-compressor as exact names)")
    if per_channel:
        print(f"per channel:    {', '.join(sorted({pattern(m) for m in per_channel}))} (in_features "
              f"{sorted({ragged[m][1] for m in per_channel})} < group {G}; both tools, workaround b)")
    print("workarounds:    a. torchvision-backed transformers alias modules dropped before llm-compressor's load "
          f"({lr['dropped_alias_modules']}); b. per-channel int4 where group {G} does not divide in_features; "
          "c. the referee decompresses per module itself (transformers' own compressed-tensors loaders mis-resolve "
          "these outputs)")
    for key in ("llmc-gptq", "cvt-gptq", "cvt-rtn"):
        r = acc[key]
        print(f"  {key}: {r['modules']} linears dequantized ({', '.join(f'{k} x{v}' for k, v in sorted(r['per_scheme'].items()))}), "
              f"{r['unchanged_weights']} unchanged by quantization, mean weight rel. error {r['weight_rel_err']:.4f}; "
              f"{r['float_same']}/{r['float_tensors']} float tensors bit-identical to the fixture; "
              f"{quant[key]['inner']}")

    print("\n| tool | method | calibration tokens | quantize wall s | mean KL | same top-1 | PPL ratio | KL / llm-compressor's |"
          + (" cvt verify KL | cvt verify top-1 |" if args.cvt_verify else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|---|" if args.cvt_verify else ""))
    for tool, method, key in rows:
        r, q = acc[key], quant[key]
        line = (f"| {tool} | {method} | {q['tokens'] or '-'} | {q['wall_s']:.1f} | {r['kl']:.5f} | {r['top1']:.2%} | "
                f"{r['ppl_ratio']:.4f} | {r['kl'] / base_kl:.2f}x |")
        if args.cvt_verify:
            cv = r["cvt_verify"]
            line += (f" {cv['kl']:.5f} | {cv['top1']:.2%} |" if "kl" in cv else f" failed: {cv['error']} | - |")
        print(line)
    print("\nmean KL, same top-1, PPL ratio: the referee (compressed-tensors dequantizer + transformers)"
          + ("; cvt verify KL / top-1: `cvt verify --data HELD_OUT --seq-len "
             f"{args.seq_len} --max-sequences {args.eval_seq}` (cvt's runtime) on the same sequences"
             if args.cvt_verify else ""))
    print(f"total bench wall: {time.perf_counter() - t_start:.0f} s")
    bad = [k for k, r in acc.items() if not r["kl"] > 0]
    if bad:
        fail(f"KL is 0 for {', '.join(bad)}: the quantized weights are not in use")


if __name__ == "__main__":
    main()
