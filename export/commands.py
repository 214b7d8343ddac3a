"""`cvt export ...`: the click group (imported by cvt.cli; stays cheap: no onnx / torch at import).

Subcommands: ``onnx`` (here) and ``om`` (`cvt.export.om`, when present).
"""

from __future__ import annotations

import sys

import click

EXIT_THRESHOLD = 4


@click.group("export")
def export() -> None:
    """Export a model as graphs: ONNX (onnxruntime, and the input of atc) and OM (Ascend)."""


# After `export` exists: cvt.cli imports this module at its end to register the group, so
# importing this module first (cvt.cli half-initialized) still finds `export`.
from cvt.cli import _common  # noqa: E402  (--quiet / --debug, as on every verb)


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
@_common
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
        for g in r.graphs:
            ext = f" + {g['external_data']}" if g["external_data"] else ""
            click.echo(f"wrote {r.dst / g['file']}{ext}: {g['nodes']} nodes, "
                       f"{g['weight_bytes'] / 2**20:.1f} MiB of weights")
        click.echo(f"opset {m['opset']}, {m['dtype']} weights, linears: {lin}; KV cache {m['kv_cache']['dtype']}; "
                   f"{r.seconds:.1f} s")
    failed = False
    for p in r.parity or []:
        click.echo(p.render())
        failed |= not p.passed
    if failed:
        click.echo("cvt: threshold violated: onnxruntime output differs from the torch runtime beyond tolerance",
                   err=True)
        sys.exit(EXIT_THRESHOLD)


def _add_om() -> None:
    """Register `cvt export om` (cvt.export.om.om_command) when that module exists."""
    import importlib.util

    if importlib.util.find_spec("cvt.export.om") is None:
        return
    try:
        from cvt.export.om import om_command
    except ImportError:
        if "cvt.export.om" in sys.modules:  # cvt.export.om is being imported and imported cvt.cli first
            return
        raise
    export.add_command(om_command)


_add_om()
