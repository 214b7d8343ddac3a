"""The hostile catalog's reliability cases (issue 37): files that break what cvt promises to write,
and configs whose promises the files break, through every verb they reach.

The harness is `tests/catalog_harness.py`'s (`Case`, `Ctx`, `_check`): the real CLI entry point; the
exit code (1 refused input, 3 `inspect` problems); one ``cvt: error:`` line naming the culprit (the
report for inspect); SRC untouched; nothing opened or written outside the checkpoint, DST and the
command's temp folder; DST not complete-looking (no manifest, index or config). Causes:

1. a NaN in a tensor a verb writes float (an e4m3 NaN code, 0x7F / 0xFF, in ``kv_b_proj``, which
   stays float under every scheme; in an expert kept float by ``--ignore``; in DeepSeek-V4's
   ``wq_b`` under ``--scheme w4a8_mxfp``; a NaN in a BF16 norm every verb copies): written as NaN
   with exit 0 before (`cvt.convert.finite`);
12. a DeepSeek-V4 release without its ``mtp.*`` tensors while config.json counts an MTP layer, or
    with a ``tid2eid`` entry no expert has; a V3-family checkpoint holding some of its MTP layers;
13. a Kimi-K2.5 checkpoint whose text names lack ``language_model.``, wholly or in one layer.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from cvt.testing.checkpoints import (kimi_int4_tensors, release_tensors, tiny_deepseek_config, tiny_kimi_k25_config,
                                     write_fp8_release, write_release, write_safetensors)
from cvt.testing.checkpoints_v4 import write_v4_release
from cvt.tests.catalog_harness import Case, Ctx, _check, sources  # noqa: F401  (sources: a fixture)

KV_B = "model.layers.0.self_attn.kv_b_proj.weight"
EXPERT = "model.layers.1.mlp.experts.2.down_proj.weight"
NORM = "model.layers.1.post_attention_layernorm.weight"
TEXT = "language_model."


@dataclass
class RCtx(Ctx):
    v4: Path = None      # DeepSeek-V4 release (`write_v4_release`: 4 layers + 1 MTP, 2 hash layers)
    kimi: Path = None    # Kimi-K2.5 release (INT4 experts, `language_model.` text names)
    kimi8: Path = None   # Kimi-K2.5 layout with FP8 text linears


def _weight_map(src: Path) -> dict[str, str]:
    return json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]


def _set(name: str, value, code: bool = True):
    """A prep setting element 0 of `name` to FP8 / integer code `value` (the stored byte or the
    integer), or (``code=False``) to the float `value`."""
    def prep(ctx, src):
        import torch
        from safetensors.torch import load_file

        f = src / _weight_map(src)[name]
        tensors = {k: v.clone() for k, v in load_file(f).items()}
        t = tensors[name]
        if code and t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).reshape(-1)[0] = value
        else:
            t.reshape(-1)[7 if t.dtype == torch.int64 else 0] = value
        write_safetensors(f, tensors)
    return prep


def _drop(prefix: str):
    """A prep removing every tensor whose name starts with `prefix` (files and index)."""
    def prep(ctx, src):
        from safetensors.torch import load_file

        wm = _weight_map(src)
        for f in sorted({f for n, f in wm.items() if n.startswith(prefix)}):
            tensors = {k: v.clone() for k, v in load_file(src / f).items() if not k.startswith(prefix)}
            write_safetensors(src / f, tensors)
        index = json.loads((src / "model.safetensors.index.json").read_text())
        index["weight_map"] = {n: f for n, f in wm.items() if not n.startswith(prefix)}
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return prep


def _unprefix(layer: str | None = None):
    """A prep renaming the text tensors (those of `layer` only, e.g. ``model.layers.1.``) without
    ``language_model.``."""
    def prep(ctx, src):
        from safetensors.torch import load_file

        def bare(n: str) -> str:
            return n[len(TEXT):] if n.startswith(TEXT + (layer or "")) else n

        wm = _weight_map(src)
        for f in sorted(set(wm.values())):
            write_safetensors(src / f, {bare(k): v.clone() for k, v in load_file(src / f).items()})
        index = json.loads((src / "model.safetensors.index.json").read_text())
        index["weight_map"] = {bare(n): f for n, f in wm.items()}
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return prep


def _v3_two_mtp_one_stored(ctx, src):
    """config.json counts 2 MTP layers; the files hold the first (layer 3) only."""
    ctx.edit_config(src, num_nextn_predict_layers=2)


def _case(verb: list[str], which: str, prep, culprit: str, *extra, rc: int = 1) -> Case:
    inspect = verb[0] == "inspect"

    def build(ctx):
        src = ctx.copy(which)
        prep(ctx, src)
        dst = None if inspect or verb[0] == "run" else ctx.tmp / "out"
        return [*verb, src, *([dst] if dst is not None else []), *extra, *([] if inspect else ["--quiet"])], src, dst
    return Case("-".join([*verb, which]), build, culprit, 3 if inspect else rc, "report" if inspect else "error")


def _named(case: Case, what: str) -> Case:
    return Case(f"{case.id}-{what}", case.build, case.culprit, case.rc, case.form)


_NAN_CODE = "values in rows 0..255 are NaN codes"
_NAN = "values are NaN / Inf"
_MTP = "MTP layer 0 (layer index 4) has no tensors, but config.json num_nextn_predict_layers = 1"
_TID = ("layers.0.ffn.gate.tid2eid (I64 [320, 2], model-00001-of-00003.safetensors): entry 99 at [3, 1] is not one "
        "of the 4 experts (ids 0..3; config.json n_routed_experts = 4)")
_BARE = "lack the 'language_model.' prefix (e.g. model.embed_tokens.weight)"
_MIXED = "lack the 'language_model.' prefix (e.g. model.layers.1.input_layernorm.weight, while others have it)"
_BARE_ONE = "tensor model.layers.1.input_layernorm.weight: lacks the 'language_model.' prefix"
_V3_MTP = "MTP layer 1 (layer index 4) has no tensors, but config.json num_nextn_predict_layers = 2"

CASES = [
    # ---- 1. no NaN written: every verb that writes weights refuses, naming the tensor and its file
    _named(_case(["fp8-to-bf16"], "fp8", _set(KV_B, 0x7F), f"{KV_B} (F8_E4M3 [256, 72], model-0000"), "nan-kv-b"),
    _named(_case(["fp8-to-bf16"], "fp8", _set(NORM, float("nan"), code=False), f"{NORM} (BF16 [256], model-0000"),
           "nan-norm"),
    _named(_case(["quantize"], "fp8", _set(KV_B, 0xFF), f"{KV_B} (F8_E4M3", "--scheme", "w8a8"), "nan-kv-b"),
    _named(_case(["quantize"], "fp8", _set(KV_B, 0x7F), _NAN_CODE, "--scheme", "w4a8", "--format", "ascend"),
           "w4a8-ascend-nan-kv-b"),
    _named(_case(["quantize"], "fp8", _set(EXPERT, 0x7F), f"{EXPERT} (F8_E4M3 [256, 128]", "--scheme", "w4a16",
                 "--ignore", r".*\.experts\.2\..*"), "nan-ignored-expert"),
    _named(_case(["quantize"], "qwen", _set("model.layers.0.input_layernorm.weight", float("nan"), code=False),
                 "model.layers.0.input_layernorm.weight (BF16 [96]", "--scheme", "w8a8"), "nan-norm"),
    _named(_case(["quantize"], "v4", _set("layers.0.attn.wq_b.weight", 0x7F),
                 "layers.0.attn.wq_b.weight (F8_E4M3 [256, 200]", "--scheme", "w4a8_mxfp", "--format", "ascend"),
           "w4a8-mxfp-nan-wq-b"),
    _named(_case(["shard"], "fp8", _set(KV_B, 0x7F), f"{KV_B} (F8_E4M3 [256, 72]", "--ep", "2"), "nan-kv-b"),
    _named(_case(["shard"], "qwen", _set("model.norm.weight", float("inf"), code=False), f"model.norm.weight (BF16 [96]",
                 "--ep", "2"), "inf-norm"),
    _named(_case(["export", "onnx"], "fp8", _set(KV_B, 0x7F), "model.layers.0.self_attn.kv_b_proj"), "nan-kv-b"),
    # ---- 12. configs whose promises the files break: refused before any work
    _named(_case(["inspect"], "v4", _drop("mtp."), _MTP), "no-mtp"),
    _named(_case(["fp8-to-bf16"], "v4", _drop("mtp."), _MTP), "no-mtp"),
    _named(_case(["quantize"], "v4", _drop("mtp."), _MTP, "--scheme", "w8a8", "--format", "ascend"), "no-mtp"),
    _named(_case(["shard"], "v4", _drop("mtp."), _MTP, "--ep", "2"), "no-mtp"),
    _named(_case(["inspect"], "v4", _set("layers.0.ffn.gate.tid2eid", 99), _TID), "tid2eid-99"),
    _named(_case(["fp8-to-bf16"], "v4", _set("layers.0.ffn.gate.tid2eid", 99), _TID), "tid2eid-99"),
    _named(_case(["quantize"], "v4", _set("layers.0.ffn.gate.tid2eid", 99), _TID, "--scheme", "w8a8", "--format",
                 "ascend"), "tid2eid-99"),
    _named(_case(["shard"], "v4", _set("layers.0.ffn.gate.tid2eid", -1), "entry -1 at [3, 1]", "--ep", "2"),
           "tid2eid-negative"),
    _named(_case(["inspect"], "fp8", _v3_two_mtp_one_stored, _V3_MTP), "mtp-one-of-two"),
    _named(_case(["fp8-to-bf16"], "fp8", _v3_two_mtp_one_stored, _V3_MTP), "mtp-one-of-two"),
    # ---- 13. Kimi-K2.5 text names without language_model. (wholly, or one layer)
    _named(_case(["inspect"], "kimi", _unprefix(), _BARE), "bare"),
    _named(_case(["quantize"], "kimi", _unprefix(), "tensor model.embed_tokens.weight: lacks the 'language_model.' "
                 "prefix (expected language_model.model.embed_tokens.weight)", "--scheme", "w8a8"), "bare"),
    _named(_case(["quantize"], "kimi", _unprefix(), "tensor model.embed_tokens.weight: lacks the 'language_model.' "
                 "prefix", "--scheme", "w8a8", "--method", "gptq", "--calib-tokens", "256"), "gptq-bare"),
    _named(_case(["inspect"], "kimi", _unprefix("model.layers.1."), _MIXED), "one-layer-bare"),
    _named(_case(["quantize"], "kimi", _unprefix("model.layers.1."), _BARE_ONE, "--scheme", "w4a16", "--format",
                 "ascend"), "one-layer-bare"),
    _named(_case(["fp8-to-bf16"], "kimi8", _unprefix("model.layers.1."), _BARE_ONE), "one-layer-bare"),
    _named(_case(["shard"], "kimi8", _unprefix("model.layers.1."), _MIXED, "--ep", "2"), "one-layer-bare"),
    _named(_case(["run"], "kimi", _unprefix("model.layers.1."), _MIXED, "--input-ids", "1,2"), "one-layer-bare"),
]


@pytest.fixture(scope="module")
def reliability_sources(tmp_path_factory, sources):
    """The catalog's sources (FP8 release, its BF16 conversion, a Qwen3-MoE) and a V4 release, a
    Kimi-K2.5 INT4 release and its FP8 variant."""
    fp8, bf16, qwen = sources
    root = tmp_path_factory.mktemp("reliability-src")
    v4 = write_v4_release(root / "v4")
    cfg = tiny_kimi_k25_config()
    kimi = write_release(root / "kimi", cfg, kimi_int4_tensors(cfg), move_scale=False)
    qc = tiny_deepseek_config()["quantization_config"]
    cfg8 = {**cfg, "quantization_config": qc, "text_config": {**cfg["text_config"], "quantization_config": qc}}
    kimi8 = write_release(root / "kimi8", cfg8, release_tensors(cfg8, seed=4), n_shards=3)
    return dict(fp8=fp8, bf16=bf16, qwen=qwen, v4=v4, kimi=kimi, kimi8=kimi8)


@pytest.mark.slow  # (its module fixture builds five checkpoints)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_reliability_case(case: Case, reliability_sources, tmp_path):
    _check(RCtx(tmp_path, **reliability_sources), case)


def test_ids_are_unique():
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["v3-no-mtp", "kimi"])
def test_the_legitimate_layouts_still_pass(which, reliability_sources, tmp_path):
    """What the checks must not refuse: a V3-family checkpoint without any MTP layer while config.json
    counts one (transformers' save_pretrained drops it; cvt's runtime runs without), and the Kimi-K2.5
    release layout itself."""
    from cvt.tests.conftest import run_cvt

    src = tmp_path / "src"
    shutil.copytree(reliability_sources["fp8" if which == "v3-no-mtp" else "kimi"], src)
    if which == "v3-no-mtp":
        _drop("model.layers.3.")(None, src)
    r = run_cvt("inspect", src)
    assert r.rc == 0 and "problems        none" in r.out, r.out
    r = run_cvt("quantize", src, tmp_path / "out", "--scheme", "w8a8", "--quiet")
    assert r.rc == 0, r.err
