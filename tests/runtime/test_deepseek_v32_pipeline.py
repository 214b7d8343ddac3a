"""DeepSeek-V3.2 through quantize -> run -> verify, and shard -> a 2-rank world.

The lightning indexer stays float under every scheme (arch table `deepseek_v32`): its tensors in a
W8A8 (Ascend) and a W4A16 (compressed-tensors) output are the BF16 dequantization of the FP8
release, bit for bit, described as FLOAT / listed in ``ignore``; both outputs run and verify. A
tensor-parallel shard (indexer replicated) gives the single-process tokens and logits on 2 ranks,
with prompts long enough for the indexer to drop keys.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from cvt.convert.fp8_to_bf16 import fp8_to_bf16  # noqa: E402
from cvt.convert.placement import make_layout  # noqa: E402
from cvt.convert.shard import shard  # noqa: E402
from cvt.testing.checkpoints import tiny_deepseek_v32_config, write_bf16_checkpoint, write_fp8_release  # noqa: E402
from cvt.quant.stage import quantize  # noqa: E402
from cvt.runtime.loader import load_model  # noqa: E402
from cvt.runtime.kernels import Linear  # noqa: E402
from cvt.tests.conftest import run_cvt  # noqa: E402
from cvt.tests.convert.test_shard import read_all  # noqa: E402

INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")
CASES = {"w8a8": dict(scheme="w8a8", fmt="ascend"),
         "w4a16": dict(scheme="w4a16", fmt="compressed-tensors", group_size=32)}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v32")
    out = {"fp8": write_fp8_release(root / "fp8", tiny_deepseek_v32_config())}
    out["bf16"] = fp8_to_bf16(out["fp8"], root / "bf16", quiet=True).dst
    for name, kw in CASES.items():
        quantize(out["fp8"], root / name, quiet=True, **kw)
        out[name] = root / name
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_indexer_stays_float(outputs, case):
    dst, ref = read_all(outputs[case]), read_all(outputs["bf16"])
    layers = [n.split(".")[2] for n in ref if n.endswith(".indexer.wk.weight")]
    assert len(layers) == 4                                             # 3 decoder layers + MTP
    for i in layers:
        p = f"model.layers.{i}.self_attn.indexer"
        assert sorted(n for n in dst if n.startswith(p + ".")) == sorted(f"{p}.{t}" for t in INDEXER)
        for t in INDEXER:
            a, b = dst[f"{p}.{t}"], ref[f"{p}.{t}"]
            assert a.dtype == b.dtype and torch.equal(a, b), f"{p}.{t}"
    # ...and the attention around it is quantized
    assert any(n.startswith("model.layers.1.self_attn.o_proj.weight_") for n in dst)
    if CASES[case]["fmt"] == "ascend":
        desc = json.loads((outputs[case] / "quant_model_description.json").read_text())
        # vllm-ascend builds every indexer linear with the checkpoint's quant config and looks each
        # weight up in this description (a missing key is a KeyError at start-up)
        assert all(desc[f"model.layers.{i}.self_attn.indexer.{t}"] == "FLOAT" for i in layers for t in INDEXER)
    else:
        ignore = json.loads((outputs[case] / "config.json").read_text())["quantization_config"]["ignore"]
        assert {f"model.layers.1.self_attn.indexer.{m}" for m in ("wq_b", "wk", "weights_proj")} <= set(ignore)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_run_and_verify(outputs, case, tmp_path):
    loaded = load_model(outputs[case], dtype=torch.float32)
    ix = loaded.model.model.layers[1].self_attn.indexer
    assert all(type(getattr(ix, m)) is Linear for m in ("wq_b", "wk", "weights_proj"))         # dense
    assert type(loaded.model.model.layers[1].self_attn.o_proj) is not Linear                   # quantized
    r = run_cvt("run", outputs[case], "--input-ids", ",".join(map(str, range(40, 60))), "--max-new-tokens", "3",
                "--device", "cpu", "--quiet")
    assert r.rc == 0, r.err
    r = run_cvt("verify", outputs[case], "--reference", outputs["bf16"], "--report", tmp_path / "rep",
                "--device", "cpu", "--max-sequences", "2", "--seq-len", "32")         # 32 > index_topk 8
    assert r.rc == 0, r.err
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    sqnr = {w["name"]: w["sqnr_db"] for w in report["weights"]}
    assert sqnr["model.layers.1.self_attn.indexer.wk.weight"] == "Infinity"
    assert isinstance(sqnr["model.layers.1.self_attn.o_proj.weight"], float)


@pytest.mark.slow
def test_two_ranks_match_one_process(tmp_path):
    from cvt.tests.runtime.test_distributed import _check_dumps, _reference, _spawn

    # the prompts (4-5 tokens + 4 generated) outgrow index_topk 3; 16 heads: no exact ties at the top-k edge
    cfg = tiny_deepseek_v32_config(index_topk=3, index_n_heads=16)
    cfg.pop("quantization_config")
    src = write_bf16_checkpoint(tmp_path / "src", cfg)
    dst = shard(src, tmp_path / "tp2", make_layout(2, tp=2, ep=2), quiet=True).dst
    codes = _spawn(2, [("v32-tp2-ep2", str(dst))], tmp_path)
    assert codes["v32-tp2-ep2"] == [0, 0]
    _check_dumps(tmp_path / "out-2", "v32-tp2-ep2", 2, _reference(src))


@pytest.mark.slow
def test_smoothquant_keeps_the_indexer_inputs(outputs, tmp_path):
    """A fold x / s into a norm must multiply every reader's columns by s, the float indexer included
    (quant/methods/sites.py `_smooth_groups` extras):
    norm weight (.) reader column is invariant (up to bf16 rounding)."""
    quantize(outputs["bf16"], tmp_path / "sq", scheme="w8a8", fmt="ascend", method="smoothquant", quiet=True,
             calib_tokens=2048)
    src, dst = read_all(outputs["bf16"]), read_all(tmp_path / "sq")
    a = "model.layers.1.self_attn"
    for norm, reader in (("model.layers.1.input_layernorm", f"{a}.indexer.wk"),
                         ("model.layers.1.input_layernorm", f"{a}.indexer.weights_proj"),
                         (f"{a}.q_a_layernorm", f"{a}.indexer.wq_b")):
        assert not torch.equal(src[f"{norm}.weight"], dst[f"{norm}.weight"]), norm   # the fold did happen
        want = src[f"{reader}.weight"].float() * src[f"{norm}.weight"].float()
        got = dst[f"{reader}.weight"].float() * dst[f"{norm}.weight"].float()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item(), msg=reader)
