"""The bad-input catalog, verb by verb: what a hostile or careless user can hand cvt.

Every case runs the real CLI entry point and asserts the contract tests/catalog_harness.py's
docstring lists (exit code, one line naming the culprit, DST not complete-looking, SRC untouched,
nothing opened or written outside).

Case classes (issue 13): DST overlapping SRC; symlinks and manifest paths leading out of the
checkpoint; config.json disagreeing with the weights; sizes that describe no model or would
allocate without bound; placement / recipe / manifest files that are invalid; NaN / Inf
weights; a second run on a locked DST.

The harness (`_check`, `Ctx`, `Case`, the shared builders, `sources`) is tests/catalog_harness.py;
issue 24's cases (cvt's own folders in DST, --overwrite, calibration state, numbers and options
that do not apply) are tests/test_catalog_issue24.py.
"""

from __future__ import annotations

import fcntl
import json
import os

import pytest

from cvt.testing.checkpoints import write_safetensors
from cvt.tests.catalog_harness import (Case, Ctx, _edit_tensors, _nothing, _overlap, _quantize, _verb, _verify,
                                       bad_input_params, run_bad_input)
from cvt.tests.catalog_harness import sources  # noqa: F401 (a fixture)


# --------------------------------------------------------------------------- the cases
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


def _config(**changes):
    def prep(ctx, src):
        ctx.edit_config(src, **changes)
    return prep


def _fifo_tokenizer(ctx, src):
    (src / "tokenizer.json").unlink()
    os.mkfifo(src / "tokenizer.json")


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


def _bf16_max_rows(ctx, src):
    """Finite weights at the top of bfloat16's range: row 0 of every float projection = bf16 max."""
    import torch

    def change(name, t):
        if name.endswith("proj.weight") and t.dtype == torch.bfloat16 and t.dim() == 2:
            t[0, :] = torch.finfo(torch.bfloat16).max
            return True
    _edit_tensors(src, change)


def _nan_norm(ctx, src):
    def change(name, t):
        if name.endswith("layers.0.post_attention_layernorm.weight"):
            t[0] = float("nan")
            return True
    _edit_tensors(src, change)


def _scale_3e38(ctx, src):
    def change(name, t):
        if name == "model.layers.0.mlp.down_proj.weight_scale_inv":
            t[0, 0] = 3e38
            return True
    _edit_tensors(src, change)


def _manifest_path(path: str):
    def prep(ctx, src):
        m = json.loads((src / "cvt_manifest.json").read_text())
        m["files"][0]["path"] = path
        (src / "cvt_manifest.json").write_text(json.dumps(m))
    return prep


def _manifest_invalid(ctx, src):
    m = json.loads((src / "cvt_manifest.json").read_text())
    m["files"][0]["blake3"] = "zz"
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
    # --- config.json values the runtime refuses: every writer refuses them first (issue 24 item 7)
    Case("fp8-to-bf16-first-k-dense-past-layers", _verb(["fp8-to-bf16"], "fp8", _config(first_k_dense_replace=5)),
         "config.json first_k_dense_replace = 5: past the model's 3 decoder layers"),
    Case("quantize-n-group-not-dividing", _quantize("bf16", _config(n_group=3)),
         "config.json n_group = 3: must divide n_routed_experts (4)"),
    Case("shard-rms-norm-eps-negative", _verb(["shard"], "fp8", _config(rms_norm_eps=-1e-6), "--ep", "2"),
         "config.json rms_norm_eps = -1e-06: must be a finite number > 0"),
    Case("quantize-yarn-factor-negative", _quantize("qwen", _config(rope_scaling={"rope_type": "yarn", "factor": -4})),
         "config.json rope_scaling.factor = -4: must be a finite number >= 1"),
    Case("inspect-experts-per-token-past-experts", _verb(["inspect"], "fp8", _config(num_experts_per_tok=9),
                                                       dst_name=None),
         "config.json num_experts_per_tok = 9: must be an integer in 1..4", rc=3, form="report"),
    Case("fp8-to-bf16-dense-layer-holds-experts", _verb(["fp8-to-bf16"], "fp8", _config(first_k_dense_replace=3)),
         "layer 1 holds MoE tensors"),
    # --- a FIFO where a file is expected (issue 24 item 6d): refused, not skipped nor read forever
    Case("quantize-tokenizer-fifo", _quantize("qwen", _fifo_tokenizer), "tokenizer.json: not a regular file (a FIFO)"),
    Case("shard-tokenizer-fifo", _verb(["shard"], "fp8", _fifo_tokenizer, "--ep", "2"),
         "tokenizer.json: not a regular file (a FIFO)"),
    # --- sizes that describe no model, unbounded work
    Case("plan-heads-zero", _verb(["plan"], "fp8", _heads_zero, "--ep", "2", dst_name=None),
         "num_attention_heads = 0"),
    Case("shard-dry-run-heads-zero", _verb(["shard"], "fp8", _heads_zero, "--ep", "2", "--dry-run", dst_name=None),
         "num_attention_heads = 0"),
    Case("run-hidden-negative", _verb(["run"], "qwen", _hidden_negative, "--input-ids", "1,2", dst_name=None),
         "hidden_size = -256"),
    Case("plan-ep-huge", _verb(["plan"], "fp8", _nothing, "--ep", "1000000000", dst_name=None),
         "a world of 1000000000 ranks"),
    # --- calibration / evaluation text read only as far as it is used (issue 24 item 5)
    Case("verify-data-dev-zero", _verify("qwen", _nothing, "--data", "/dev/zero"),
         "--data /dev/zero: not a regular file (a character device)"),
    # --- invalid side files
    Case("shard-placement-bad-expert-id", _placement([1, 2], bad_id=-1), "expert id -1 is outside 0..3"),
    Case("shard-placement-missing-layer", _placement([1]), "places 1 of the model's 2 MoE layers"),
    Case("quantize-bad-yaml-recipe", _quantize("qwen", _bad_recipe, "--recipe", "RECIPE"), "recipe.yaml: not valid YAML"),
    Case("run-manifest-invalid", _verb(["run"], "bf16", _manifest_invalid, "--input-ids", "1,2", dst_name=None),
         "files.0.blake3"),
    Case("run-procs-manifest-invalid", _verb(["run"], "bf16", _manifest_invalid, "--input-ids", "1,2",
                                            "--procs", "2", dst_name=None), "tensor_count"),
    # --- NaN / Inf
    Case("quantize-nan-weight", _quantize("qwen", _nan_weight), "non-finite"),
    Case("run-nan-weight", _verb(["run"], "qwen", _nan_weight, "--input-ids", "1,2", "--dtype", "fp32",
                                 dst_name=None), "non-finite logits"),
    Case("verify-nan-candidate", _verify("qwen", _nan_weight, "--min-cosine", "0.99", "--max-mean-kl", "1"),
         "is NaN", rc=4),
    Case("verify-inf-candidate", _verify("qwen", _nan_weight, "--min-cosine", "0.99", "inf"), "non-finite", rc=4),
    Case("verify-threshold-nan", _verify("qwen", _nothing, "--min-cosine", "nan"),
         "Invalid value for '--min-cosine': 'nan' is not a finite number", rc=2),
    # --- finite input, non-finite output (issue 24 item 6c): refused, naming the tensor
    Case("quantize-w4a8-bf16-max-scale-bias", _quantize("qwen", _bf16_max_rows, "--scheme", "w4a8", "--format",
                                                        "ascend"),
         "mlp.experts.0.gate_proj.scale_bias: 1 of its 48 values are NaN / Inf"),
    Case("quantize-w8a8c8-bf16-max-fa-scales", _quantize("bf16", _bf16_max_rows, "--scheme", "w8a8c8", "--format",
                                                         "ascend"),
         "model.layers.0.self_attn.fa_q.scale: 4 of its 4 values are NaN / Inf"),
    Case("quantize-mxfp4-bf16-max", _quantize("bf16", _bf16_max_rows, "--scheme", "fp4", "--fp4-format", "mxfp4"),
         "q_a_proj.weight: its fp4 quantization is not finite"),
    Case("quantize-smoothquant-nan-norm", _quantize("qwen", _nan_norm, "--method", "smoothquant"),
         "model.layers.0.post_attention_layernorm.weight: 1 of its 96 values are NaN / Inf"),
    Case("fp8-to-bf16-scale-overflows-bf16", _verb(["fp8-to-bf16"], "fp8", _scale_3e38),
         "down_proj.weight_scale_inv (F32 [2, 3], model-00001-of-00003.safetensors): 3.0000000054977558e+38 at block "
         "[0, 0] times 448 (the largest e4m3 value) overflows bfloat16"),
    # --- two runs at once
    Case("export-onnx-locked", _locked_export, "another cvt run is writing to this directory"),
]


@pytest.mark.parametrize("case", bad_input_params(CASES), ids=[c.id for c in CASES])
def test_bad_input(case: Case, sources, tmp_path):
    run_bad_input(case, sources, tmp_path)


def test_every_verb_has_cases():
    verbs = {c.id.split("-")[0] for c in CASES}
    assert {"quantize", "fp8", "shard", "plan", "run", "verify", "export", "inspect"} <= verbs
