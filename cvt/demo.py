"""`cvt demo`: every stage that exists, on a tiny DeepSeek-V3-style FP8 checkpoint.

The checkpoint is `cvt.demo_model`'s: the tiny DeepSeek-V3 of `cvt.testing.checkpoints` (one
dense layer, two MoE layers, an MTP layer, dims that are not multiples of 128, scales split across
shards) trained on Python's standard library source (once, by the first run; then cached:
`cvt.demo_model`), so its text looks like Python and the quantization losses mean something. The
stages run in pipeline order: fp8-to-bf16, run, verify, quantize, shard + a 4-rank torchrun on
CPU checked against one process, ONNX export checked with onnxruntime, the atc pre-check and
command; then a tiny DeepSeek-V3.2 (lightning indexer, top-k sparse attention; random weights: a
smoke test of the architecture) and a tiny DeepSeek-V4 through fp8-to-bf16, quantize and verify;
then a tiny GLM-5 (fp8-to-bf16, W8A8 Ascend) and Kimi-K2.5 (INT4 experts to Ascend W4A16, codes
carried) with no verify (they are the V3.2 / V3 runtimes; kept to well under a second or two);
last a tiny gpt-oss MXFP4 release (fp8-to-bf16, W8A8 compressed-tensors, verify, shard over 2
ranks) and a tiny Qwen3.5-MoE FP8 release (fp8-to-bf16, W8A8 Ascend, verify), random weights:
smoke tests of those architectures, a few seconds together.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from cvt.errors import OutputError


def run_demo(directory, quiet: bool = False, echo: Callable[[str], None] = print) -> dict[str, Path]:
    root = Path(directory)
    if root.exists() and any(root.iterdir()) and not (root / ".cvt-demo").exists():
        raise OutputError(f"{root}: exists and is not a cvt demo directory; choose another DIR")
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    (root / ".cvt-demo").write_text("written by cvt demo; safe to delete\n")
    out = {"fp8": root / "source-fp8", "bf16": root / "bf16"}

    say = (lambda s: None) if quiet else echo
    step_release(root, out, say, quiet)
    step_run(out, say)
    step_verify(root, out, say)
    step_quantize(root, out, say)
    step_shard(root, out, say)
    step_export(root, out, say)
    step_v32(root, out, say)
    step_v4(root, out, say)
    step_glm_kimi(root, out, say)
    step_gpt_oss(root, out, say)
    step_qwen3_5(root, out, say)

    say("\noutputs:")
    for key, path in out.items():
        say(f"  {key:<13} {path}")
    return out


def step_release(root: Path, out: dict[str, Path], say, quiet: bool) -> None:
    """[1/13] the tiny FP8 release (trained once, cached) and the held-out text; [2/13] fp8-to-bf16."""
    from cvt import corpus
    from cvt.convert.fp8_to_bf16 import fp8_to_bf16
    from cvt.convert.inspect import inspect_checkpoint
    from cvt.demo_model import model_note, write_demo_release

    say(f"[1/13] writing a tiny DeepSeek-V3-style FP8 release, trained on Python's standard library source, "
        f"to {out['fp8']}\n{model_note()}")
    write_demo_release(out["fp8"], quiet=quiet)
    # held-out Python source (never trained on): what verify compares the models on
    out["heldout"] = root / "heldout.py.txt"
    out["heldout"].write_text(corpus.text("heldout"), encoding="utf-8")
    say(inspect_checkpoint(out["fp8"]).render())

    say(f"\n[2/13] cvt fp8-to-bf16 {out['fp8']} {out['bf16']}")
    r = fp8_to_bf16(out["fp8"], out["bf16"], quiet=True)
    say(f"dequantized {r.extra['dequantized']} tensors, passed {r.extra['passed_through']} through, "
        f"{r.bytes_out} bytes in {len(r.files)} files")
    say(inspect_checkpoint(out["bf16"]).render())


def step_run(out: dict[str, Path], say) -> None:
    """[3/13] cvt run on the BF16 output."""
    prompt = "def __init__(self"
    say(f"\n[3/13] cvt run {out['bf16']} --prompt '{prompt}' --max-new-tokens 64 --temperature 0.8 --seed 0")
    import torch

    from cvt.runtime.generate import generate
    from cvt.runtime.loader import load_model
    from cvt.runtime.tokenizer import load_tokenizer

    loaded = load_model(out["bf16"], dtype=torch.float32)
    tok = load_tokenizer(loaded.checkpoint_path, loaded.config)
    gen = generate(loaded.model, [tok.encode(prompt)], 64, temperature=0.8, seed=0)  # greedy repeats itself
    say(prompt + tok.decode(gen.outputs[0]))
    say(f"decode {gen.decode_tokens_per_s:.1f} tokens/s")
    del loaded


def step_verify(root: Path, out: dict[str, Path], say) -> None:
    """[4/13] cvt verify: the FP8 release dequantized on load against the BF16 output."""
    from cvt.runtime.verify import verify

    out["report"] = root / "verify-report"
    say(f"\n[4/13] cvt verify {out['fp8']} --reference {out['bf16']} --data {out['heldout']} --report {out['report']}")
    v = verify(out["fp8"], out["bf16"], out["report"], data=out["heldout"], seq_len=128, max_sequences=8).report
    worst = min(row.cosine for row in v.layers)
    say(f"FP8 dequantized on load vs the BF16 output: min layer cosine {worst:.6f}, mean KL {v.logits.kl_mean:.3g}, "
        f"same top-1 {v.logits.same_top1:.0%} -> {'identical' if v.logits.kl_mean == 0 else 'differs'}")


def step_quantize(root: Path, out: dict[str, Path], say) -> None:
    """[5/13] cvt quantize to W4A16 (compressed-tensors) and W8A8 (ascend); [6/13] cvt verify each."""
    from cvt.quant.stage import quantize
    from cvt.runtime.verify import verify

    out["w4a16"] = root / "w4a16-compressed-tensors"
    say(f"\n[5/13] cvt quantize {out['fp8']} {out['w4a16']} --scheme w4a16 --format compressed-tensors")
    q = quantize(out["fp8"], out["w4a16"], scheme="w4a16", fmt="compressed-tensors", quiet=True)
    say(f"quantized {q.extra['quantized']} linears from the FP8 release (dequantized on the fly), "
        f"{q.extra['float_modules']} kept float; worst SQNR {q.extra['min_sqnr_db']}")
    out["w8a8"] = root / "w8a8-ascend"
    q = quantize(out["bf16"], out["w8a8"], scheme="w8a8", fmt="ascend", quiet=True)
    say(f"cvt quantize {out['bf16']} {out['w8a8']} --scheme w8a8 --format ascend: {q.extra['quantized']} linears, "
        f"worst SQNR {q.extra['min_sqnr_db']}")

    say(f"\n[6/13] cvt verify, each quantized model against {out['bf16']} --data {out['heldout']}")
    for key in ("w8a8", "w4a16"):
        out[f"report-{key}"] = root / f"verify-{key}"
        v = verify(out[key], out["bf16"], out[f"report-{key}"], data=out["heldout"], seq_len=128,
                   max_sequences=8).report
        say(f"{key}: min layer cosine {min(row.cosine for row in v.layers):.4f}, PPL ratio {v.logits.ppl_ratio:.3f}, "
            f"mean KL {v.logits.kl_mean:.3g}, same top-1 {v.logits.same_top1:.0%}  ({out[f'report-{key}']}/report.html)")


def step_shard(root: Path, out: dict[str, Path], say) -> None:
    """Quantize to W4A16 Ascend, shard for W = 4 (tp 2, ep 4), run with torchrun on CPU and
    compare with the unsharded single-process run (float32: equal to rounding)."""
    import torch
    from safetensors.torch import load_file

    from cvt.convert.placement import make_layout
    from cvt.convert.shard import shard
    from cvt.errors import CvtError
    from cvt.quant.stage import quantize
    from cvt.runtime.generate import generate
    from cvt.runtime.launch import LogitsRecorder, launch_args, torchrun
    from cvt.runtime.loader import load_model

    out["w4a16-ascend"] = root / "w4a16-ascend"
    out["shards"] = root / "w4a16-ascend-tp2-ep4"
    say(f"\n[7/13] cvt quantize {out['bf16']} {out['w4a16-ascend']} --scheme w4a16 --format ascend --group-size 64; "
        f"cvt shard {out['w4a16-ascend']} {out['shards']} --world-size 4 --tp 2 --ep 4")
    quantize(out["bf16"], out["w4a16-ascend"], scheme="w4a16", fmt="ascend", group_size=64, quiet=True)
    r = shard(out["w4a16-ascend"], out["shards"], make_layout(world_size=4, tp=2, ep=4), quiet=True)
    say(f"4 rank directories, {len(r.manifest.files)} files, {r.bytes_out} bytes (source {r.bytes_in})")
    prompts = [[72, 101, 108, 108, 111], [87, 111, 114, 108, 100, 33, 32]]
    dump = root / "sharded-logits.safetensors"
    say(f"cvt run {out['shards']} --procs 4 --dtype fp32   (torchrun, gloo, 4 CPU processes)")
    argv = launch_args(input_ids=[",".join(map(str, p)) for p in prompts], max_new_tokens=6, device="cpu",
                       dtype="fp32", quiet=True, dump_logits=dump)
    rc = torchrun(out["shards"], 4, argv)
    if rc != 0:
        raise CvtError(f"the 4-rank run of {out['shards']} failed (exit {rc})")
    sharded = load_file(str(dump))
    ref = LogitsRecorder(load_model(out["w4a16-ascend"], dtype=torch.float32).model)
    gen = generate(ref, prompts, 6)
    want = ref.per_prompt(prompts)
    diff = max(float((sharded[f"logits.{i}"] - want[i]).abs().max()) for i in range(len(prompts)))
    same = all(sharded[f"tokens.{i}"].tolist() == p + o for i, (p, o) in enumerate(zip(prompts, gen.outputs)))
    say(f"4 ranks vs 1 process: max |logit difference| {diff:.2e}, greedy tokens "
        f"{'identical' if same else 'DIFFER'}")
    if not same or diff > 1e-3:
        raise CvtError(f"the sharded run differs from the single-process run (max logit diff {diff:.3g})")


def step_export(root: Path, out: dict[str, Path], say) -> None:
    """Export the W4A16 model to ONNX (MatMulNBits), check it against the torch runtime with
    onnxruntime, and print the atc command for OM of an atc-compatible float export. Skipped,
    saying which extra brings it, when onnx / onnxruntime are not installed (a plain install)."""
    from cvt.extras import message, missing

    lacking = missing("export")
    if lacking:
        say(f"\n[8/13] skipped: {message(lacking[0], 'cvt export onnx / om')}")
        return
    from cvt.errors import CvtError
    from cvt.export.atc import precheck
    from cvt.export.om import export_om
    from cvt.export.onnx_export import export_onnx

    out["onnx-w4a16"] = root / "onnx-w4a16"
    say(f"\n[8/13] cvt export onnx {out['w4a16']} {out['onnx-w4a16']} --int4-op matmulnbits --verify")
    r = export_onnx(out["w4a16"], out["onnx-w4a16"], int4_op="matmulnbits", verify=True, quiet=True)
    for check in r.parity:
        say(check.render())
    if not all(check.passed for check in r.parity):
        raise CvtError("the ONNX export does not match the torch runtime")
    graph = out["onnx-w4a16"] / r.graphs[0]["file"]
    refused = precheck(graph, "Ascend910B3")
    say(f"atc pre-check of {graph.name}: " + (f"refused ({refused[0]})" if refused else "passes"))
    out["onnx-fp16-atc"] = root / "onnx-fp16-atc"
    say(f"cvt export onnx {out['bf16']} {out['onnx-fp16-atc']} --dtype fp16 --moe dense   (what atc accepts)")
    r = export_onnx(out["bf16"], out["onnx-fp16-atc"], dtype="fp16", moe="dense", quiet=True)
    inputs = r.graphs[0]["inputs"]
    # a decode step: batch 1, one new token, 15 cached positions (atc wants every dim positive)
    shape = ";".join(f"{i['name']}:" + ",".join("15" if isinstance(d, str) and "past" in d
                                                else "1" if isinstance(d, str) else str(d) for d in i["shape"])
                     for i in inputs)
    om = export_om(out["onnx-fp16-atc"] / r.graphs[0]["file"], root / "om", "Ascend910B3", input_shape=shape,
                   dry_run=True)
    say("cvt export om ... --dry-run: on an Ascend host with CANN (decode step, batch 1, 15 cached tokens):\n  "
        + om.command_line)


def step_v32(root: Path, out: dict[str, Path], say) -> None:
    """A tiny DeepSeek-V3.2 FP8 release (indexer included) -> BF16 -> W8A8 Ascend (indexer kept
    float), verified against the BF16 model on sequences longer than its index_topk."""
    from cvt.testing.checkpoints import tiny_deepseek_v32_config, write_fp8_release

    cfg = tiny_deepseek_v32_config()
    out["v32-fp8"], out["v32-bf16"], out["v32-w8a8"] = (root / "v32-source-fp8", root / "v32-bf16",
                                                        root / "v32-w8a8-ascend")
    say(f"\n[9/13] DeepSeek-V3.2 (index_topk {cfg['index_topk']}): cvt fp8-to-bf16 {out['v32-fp8']} {out['v32-bf16']}; "
        f"cvt quantize ... {out['v32-w8a8']} --scheme w8a8 --format ascend; cvt verify")
    write_fp8_release(out["v32-fp8"], cfg)
    _, q, v = _w8a8_ascend_verified(out, "v32", root / "verify-v32-w8a8")
    say(f"{q.extra['quantized']} linears quantized, the indexer kept float; 32-token sequences (sparse past "
        f"{cfg['index_topk']} keys): min layer cosine {min(r.cosine for r in v.layers):.4f}, "
        f"mean KL {v.logits.kl_mean:.3g}")


def _w8a8_ascend_verified(out: dict[str, Path], key: str, report: Path, report_key: str | None = None):
    """out[KEY-fp8] -> out[KEY-bf16] -> W8A8 Ascend out[KEY-w8a8], verified against the BF16 model on
    2 sequences of 32 tokens into `report` (recorded as out[report_key], default report-KEY):
    (the fp8-to-bf16 result, the quantize result, the verify report)."""
    from cvt.convert.fp8_to_bf16 import fp8_to_bf16
    from cvt.quant.stage import quantize
    from cvt.runtime.verify import verify

    d = fp8_to_bf16(out[f"{key}-fp8"], out[f"{key}-bf16"], quiet=True)
    q = quantize(out[f"{key}-bf16"], out[f"{key}-w8a8"], scheme="w8a8", fmt="ascend", quiet=True)
    out[report_key or f"report-{key}"] = report
    return d, q, verify(out[f"{key}-w8a8"], out[f"{key}-bf16"], report, seq_len=32, max_sequences=2).report


def step_v4(root: Path, out: dict[str, Path], say) -> None:
    """A tiny DeepSeek-V4 release (release names, FP8 linears, FP4 experts, every attention type,
    hash and scored MoE, an MTP layer) -> BF16 -> W8A8 Ascend (wo_a / wo_b / compressors / indexer
    kept float), verified against the BF16 model on sequences past its window and compression rate."""
    from cvt.convert.fp8_to_bf16 import fp8_to_bf16
    from cvt.testing.checkpoints_v4 import tiny_deepseek_v4_config, write_v4_release
    from cvt.quant.stage import quantize
    from cvt.runtime.verify import verify

    cfg = tiny_deepseek_v4_config()
    out["v4-release"], out["v4-bf16"], out["v4-w8a8"] = (root / "v4-source", root / "v4-bf16",
                                                         root / "v4-w8a8-ascend")
    say(f"\n[10/13] DeepSeek-V4 (compress ratios {cfg['compress_ratios']}): cvt fp8-to-bf16 {out['v4-release']} "
        f"{out['v4-bf16']}; cvt quantize ... {out['v4-w8a8']} --scheme w8a8 --format ascend; cvt verify")
    write_v4_release(out["v4-release"], cfg)
    d = fp8_to_bf16(out["v4-release"], out["v4-bf16"], quiet=True)
    q = quantize(out["v4-bf16"], out["v4-w8a8"], scheme="w8a8", fmt="ascend", quiet=True)
    out["report-v4"] = root / "verify-v4-w8a8"
    v = verify(out["v4-w8a8"], out["v4-bf16"], out["report-v4"], seq_len=32, max_sequences=2).report
    say(f"{d.extra['dequantized']} FP8 linears and FP4 experts dequantized; {q.extra['quantized']} linears quantized; "
        f"min layer cosine {min(r.cosine for r in v.layers):.4f}, mean KL {v.logits.kl_mean:.3g}")


def step_glm_kimi(root: Path, out: dict[str, Path], say) -> None:
    """A tiny GLM-5 FP8 release (one "shared" indexer layer) -> BF16 -> W8A8 Ascend (indexer float),
    and a tiny Kimi-K2.5 INT4 release -> Ascend W4A16 g32 (the release's codes and scales carried,
    vision tower copied byte for byte). No verify: the runtimes are V3.2's / V3's, verified above."""
    from cvt.convert.fp8_to_bf16 import fp8_to_bf16
    from cvt.testing.checkpoints import (kimi_int4_tensors, tiny_glm_moe_dsa_config, tiny_kimi_k25_config,
                                         write_fp8_release, write_release)
    from cvt.quant.stage import quantize

    glm = tiny_glm_moe_dsa_config(indexer_types=["full", "shared", "full"], index_topk_pattern="FSF")
    kimi = tiny_kimi_k25_config()
    for k, d in (("glm-fp8", "glm5-source-fp8"), ("glm-bf16", "glm5-bf16"), ("glm-w8a8", "glm5-w8a8-ascend"),
                 ("kimi-int4", "kimi-k2.5-source-int4"), ("kimi-w4a16", "kimi-k2.5-w4a16-ascend")):
        out[k] = root / d
    say(f"\n[11/13] GLM-5 (indexer_types {glm['indexer_types']}): cvt fp8-to-bf16 {out['glm-fp8']} {out['glm-bf16']}; "
        f"cvt quantize ... {out['glm-w8a8']} --scheme w8a8 --format ascend; Kimi-K2.5 (INT4 g32 experts, vision "
        f"tower): cvt quantize {out['kimi-int4']} {out['kimi-w4a16']} --scheme w4a16 --format ascend --group-size 32")
    write_fp8_release(out["glm-fp8"], glm)
    fp8_to_bf16(out["glm-fp8"], out["glm-bf16"], quiet=True)
    g = quantize(out["glm-bf16"], out["glm-w8a8"], scheme="w8a8", fmt="ascend", quiet=True)
    write_release(out["kimi-int4"], kimi, kimi_int4_tensors(kimi, seed=2), n_shards=1, move_scale=False)
    q = quantize(out["kimi-int4"], out["kimi-w4a16"], scheme="w4a16", fmt="ascend", group_size=32, quiet=True)
    carried = len(q.manifest.carried)
    source = sum(t.method == "source" for t in q.manifest.quant.tensors.values())
    say(f"GLM-5: {g.extra['quantized']} linears quantized, the indexer kept float (none in the shared layer); "
        f"Kimi-K2.5: {q.extra['quantized']} linears, {source} of them the INT4 release's codes and scales carried, "
        f"{carried} vision tower / projector tensors copied byte for byte")


def step_gpt_oss(root: Path, out: dict[str, Path], say) -> None:
    """A tiny gpt-oss MXFP4 release (the experts' E2M1 blocks + E8M0 scales, random) -> BF16 (as
    transformers dequantizes it) -> W8A8 compressed-tensors straight from the release (attention
    quantized, the fused experts float, as vLLM loads gpt-oss), verified against the BF16 model past
    its sliding window; the BF16 model sharded over 2 ranks as vLLM splits it (sinks with the heads
    over tp, the fused experts by id ranges over ep)."""
    from cvt.convert.fp8_to_bf16 import fp8_to_bf16
    from cvt.convert.placement import make_layout
    from cvt.convert.shard import shard
    from cvt.quant.stage import quantize
    from cvt.runtime.verify import verify
    from cvt.testing.checkpoints import random_weights, write_release
    from cvt.testing.checkpoints_gpt_oss import mxfp4_release_tensors, tiny_gpt_oss_config

    cfg = tiny_gpt_oss_config(mxfp4=True, vocab_size=300)
    for k, d in (("gpt-oss-mxfp4", "gpt-oss-source-mxfp4"), ("gpt-oss-bf16", "gpt-oss-bf16"),
                 ("gpt-oss-w8a8", "gpt-oss-w8a8-compressed-tensors"), ("gpt-oss-tp2", "gpt-oss-bf16-tp2-ep2")):
        out[k] = root / d
    say(f"\n[12/13] gpt-oss (MXFP4 experts, sliding window {cfg['sliding_window']}, attention sinks): cvt fp8-to-bf16 "
        f"{out['gpt-oss-mxfp4']} {out['gpt-oss-bf16']}; cvt quantize {out['gpt-oss-mxfp4']} {out['gpt-oss-w8a8']} "
        f"--scheme w8a8 --format compressed-tensors; cvt verify; cvt shard ... --world-size 2 --tp 2 --ep 2")
    write_release(out["gpt-oss-mxfp4"], cfg, mxfp4_release_tensors(random_weights(cfg)), n_shards=2, move_scale=False)
    d = fp8_to_bf16(out["gpt-oss-mxfp4"], out["gpt-oss-bf16"], quiet=True)
    q = quantize(out["gpt-oss-mxfp4"], out["gpt-oss-w8a8"], scheme="w8a8", fmt="compressed-tensors", quiet=True)
    out["report-gptoss"] = root / "verify-gpt-oss-w8a8"
    v = verify(out["gpt-oss-w8a8"], out["gpt-oss-bf16"], out["report-gptoss"], seq_len=32, max_sequences=2).report
    r = shard(out["gpt-oss-bf16"], out["gpt-oss-tp2"], make_layout(2, tp=2, ep=2), quiet=True)
    say(f"{d.extra['dequantized']} MXFP4 expert tensors dequantized; {q.extra['quantized']} attention linears "
        f"quantized, the fused experts float; min layer cosine {min(x.cosine for x in v.layers):.4f}, mean KL "
        f"{v.logits.kl_mean:.3g}; 2 rank directories, {sum(t.dim is not None for t in r.manifest.shard.tensors.values())} tensors split")


def step_qwen3_5(root: Path, out: dict[str, Path], say) -> None:
    """A tiny Qwen3.5-MoE FP8 block release (3 Gated DeltaNet layers, 1 gated full-attention layer,
    routed + gated shared experts, a vision tower; random weights) -> BF16 -> W8A8 Ascend (conv1d,
    A_log, dt_bias, in_proj_b / in_proj_a, router and shared-expert gate float; the vision tower
    carried), verified against the BF16 model through the recurrent layers."""
    from cvt.testing.checkpoints import release_tensors, write_release
    from cvt.testing.checkpoints_qwen3_5 import tiny_qwen3_5_config

    cfg = tiny_qwen3_5_config(vocab_size=300)
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [128, 128]}  # Qwen's FP8 releases' own
    for k, d in (("qwen3.5-fp8", "qwen3.5-moe-source-fp8"), ("qwen3.5-bf16", "qwen3.5-moe-bf16"),
                 ("qwen3.5-w8a8", "qwen3.5-moe-w8a8-ascend")):
        out[k] = root / d
    say(f"\n[13/13] Qwen3.5-MoE (layer types {cfg['text_config']['layer_types']}): cvt fp8-to-bf16 "
        f"{out['qwen3.5-fp8']} {out['qwen3.5-bf16']}; cvt quantize ... {out['qwen3.5-w8a8']} --scheme w8a8 "
        f"--format ascend; cvt verify")
    write_release(out["qwen3.5-fp8"], cfg, release_tensors(cfg, seed=3), n_shards=2)
    d, q, v = _w8a8_ascend_verified(out, "qwen3.5", root / "verify-qwen3.5-moe-w8a8", report_key="report-qwen35")
    say(f"{d.extra['dequantized']} FP8 linears dequantized; {q.extra['quantized']} linears quantized, "
        f"{len(q.manifest.carried)} vision tower tensors carried; min layer cosine "
        f"{min(x.cosine for x in v.layers):.4f}, mean KL {v.logits.kl_mean:.3g}")
