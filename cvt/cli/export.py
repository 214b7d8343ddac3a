"""`cvt export onnx|om`: the click group over `cvt.export` (stays cheap: no onnx / torch at import)."""

from __future__ import annotations

import sys

import click

from cvt.cli.options import EXIT_THRESHOLD, SOC_VERSION, common
from cvt.export.atc import INPUT_FORMATS, LOG_LEVELS, PRECISION_MODES  # plain constants (atc imports no onnx)


@click.group("export")
def export() -> None:
    """Export a model as graphs: ONNX (onnxruntime, and the input of atc) and OM (Ascend)."""


@export.command("onnx")
@click.argument("src")
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--scope", type=click.Choice(["model", "layer", "block"]), default="model", show_default=True,
              help="model: the whole LM (input_ids + KV cache -> logits + cache); layer: one decoder layer "
                   "(--layer N); block: its self_attn and mlp modules as two graphs.")
@click.option("--layer", type=click.IntRange(0), default=None,
              help="Decoder layer for --scope layer/block (default 0).")
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32", show_default=True,
              help="Storage of float weights; the graph computes in float32.")
@click.option("--int4-op", type=click.Choice(["matmulnbits", "qdq"]), default="matmulnbits", show_default=True,
              help="W4A16 linears as com.microsoft.MatMulNBits (onnxruntime's fast path) or as opset-21 blockwise "
                   "int4 DequantizeLinear + MatMul.")
@click.option("--w8a8-op", type=click.Choice(["integer", "qdq"]), default="integer", show_default=True,
              help="W8A8 linears as MatMulInteger with per-token int8 activations (the runtime's integers exactly) "
                   "or as DequantizeLinear + MatMul (activations quantized as the runtime does).")
@click.option("--opset", type=click.IntRange(1), default=None,
              help="ONNX opset (default 21 with --int4-op qdq, else 17; at least 13).")
@click.option("--accuracy-level", type=click.IntRange(0, 4), default=0, show_default=True,
              help="MatMulNBits accuracy_level: 0/1 float32 activations (exact), 4 int8 activations "
                   "(faster, approximate).")
@click.option("--moe", type=click.Choice(["gated", "dense"]), default="gated", show_default=True,
              help="gated: an If per routed expert, run only when some token selected it; dense: every expert for "
                   "every token (no control flow, for atc). Both are exact.")
@click.option("--verify", is_flag=True, help="Run prefill + decode steps in onnxruntime and compare with the torch "
                                             "runtime on SRC; exit 4 when beyond tolerance.")
@click.option("--overwrite", is_flag=True, help="Allow a DST that is not empty: once the new export is complete, delete only the files an earlier cvt run recorded there.")
@click.option("--revision", help="Hub revision when SRC is a repo id.")
@common
def onnx_cmd(src, dst, scope, layer, dtype, int4_op, w8a8_op, opset, accuracy_level, moe, verify, overwrite,
             revision, quiet):
    """Export SRC (a cvt output or HF BF16/FP8 checkpoint, quantized ones included) to ONNX in DST.

    One graph serves prefill and decode: the KV cache is explicit (inputs past_key_values.*,
    outputs present.*, with a zero-length cache for a prefill); batch, sequence and cache
    length are dynamic. MoE layers weight each expert by the top-k routing mask (exact).
    DST also gets config.json, the tokenizer and export_manifest.json.
    """
    from cvt.export.onnx_export import export_onnx

    r = export_onnx(src, dst, scope=scope, layer=layer, dtype=dtype, int4_op=int4_op, w8a8_op=w8a8_op, opset=opset,
                    accuracy_level=accuracy_level, moe=moe, verify=verify, overwrite=overwrite, revision=revision,
                    quiet=quiet)
    if not quiet:
        m = r.manifest
        lin = ", ".join(f"{v} {k}" for k, v in m["linears"].items())
        done = "wrote" if r.extra.get("installed", True) else "exported (not installed)"
        for g in r.graphs:
            ext = f" + {g['external_data']}" if g["external_data"] else ""
            click.echo(f"{done} {r.dst / g['file']}{ext}: {g['nodes']} nodes, "
                       f"{g['weight_bytes'] / 2**20:.1f} MiB of weights")
        click.echo(f"opset {m['opset']}, {m['dtype']} weights, linears: {lin}; KV cache {m['kv_cache']['dtype']}; "
                   f"{r.seconds:.1f} s")
    failed = False
    for p in r.parity or []:
        click.echo(p.render())
        failed |= not p.passed
    if failed:
        click.echo("cvt: threshold violated: onnxruntime output differs from the torch runtime beyond tolerance; "
                   f"nothing was installed in {r.dst}", err=True)
        sys.exit(EXIT_THRESHOLD)


@export.command("om")
@click.argument("onnx", type=click.Path(exists=True))
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--soc-version", type=SOC_VERSION, required=True, metavar="SOC", help="Target SoC, e.g. Ascend910B3, Ascend310P3 ('Ascend' + npu-smi's Name).")
@click.option("--input-shape", help="atc --input_shape, e.g. \"input_ids:1,128\" (-1 or a~b for dynamic dims); "
                                    "default: the graph's own shapes when all are static.")
@click.option("--dynamic-dims", help="atc --dynamic_dims profiles, one value per -1 in --input-shape, e.g. \"128;512;2048\".")
@click.option("--precision-mode", type=click.Choice(PRECISION_MODES), metavar="MODE",
              help=f"atc --precision_mode: {', '.join(PRECISION_MODES)}. atc's default is force_fp16; "
                   "must_keep_origin_dtype keeps the graph's fp32/bf16.")
@click.option("--input-format", type=click.Choice(INPUT_FORMATS), default="ND", show_default=True)
@click.option("--atc-log", type=click.Choice(LOG_LEVELS), help="atc --log level (its output goes to DST/<name>.atc.log).")
@click.option("--atc-arg", "extra", multiple=True, help="Extra atc flag passed as is, e.g. --atc-arg=--op_select_implmode=high_precision (repeatable).")
@click.option("--allow-op", "allow_ops", multiple=True,
              help="Accept this op (Op or domain.Op) although CANN's op list lacks it, for a CANN with a parser "
                   "plugin for it; repeatable.")
@click.option("--dry-run", is_flag=True, help="Check the graph and print the atc command without running it.")
@click.option("--verify", is_flag=True, help="Run the OM (needs ais_bench) and onnxruntime on the same inputs and compare.")
@click.option("--device-id", type=click.IntRange(0), default=0, show_default=True, help="NPU used by --verify.")
@click.option("--overwrite", is_flag=True, help="Replace an OM (and its log) that DST already holds for this graph.")
@common
def om_cmd(onnx, dst, soc_version, input_shape, dynamic_dims, precision_mode, input_format, atc_log, extra,
               allow_ops, dry_run, verify, device_id, overwrite, quiet):
    """Convert an ONNX graph (a file, or a directory holding one) to an Ascend OM with atc,
    written as DST/<name>.om with atc's log in DST/<name>.atc.log.

    The graph is checked first against what atc accepts (ai.onnx opset 9-18, CANN's ONNX op
    list, no int4/float8, bf16 only on A2/A3) and refused with every offending op named (exit
    code 3). Without atc on PATH the exact command is printed to run on an Ascend host, and the
    run fails (exit 1); --dry-run prints it and succeeds.
    """
    from cvt.export.om import AtcNotFoundError, export_om

    try:
        r = export_om(onnx, dst, soc_version, input_shape=input_shape, dynamic_dims=dynamic_dims,
                      precision_mode=precision_mode, input_format=input_format, atc_log=atc_log, extra=tuple(extra),
                      allow_ops=tuple(allow_ops), dry_run=dry_run, verify=verify, device_id=device_id,
                      overwrite=overwrite)
    except AtcNotFoundError as exc:
        click.echo(exc.command)
        raise
    if r.dry_run:
        click.echo(r.command_line)
        return
    if not quiet:
        click.echo(f"wrote {r.om_path} ({r.om_path.stat().st_size / 2**20:.1f} MiB) in {r.seconds:.1f} s; "
                   f"atc log: {r.log_path}")
        for name, m in r.verify.items():
            click.echo(f"verify {name}: cosine {m['Cosine']:.6f}, max abs err {m['MaxAbsErr']:.4g}")
