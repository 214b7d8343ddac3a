"""Qwen3.5 / Qwen3.5-MoE and Qwen3-Next as ``--format compressed-tensors`` (issue 41 item 3): the names and
the ``ignore`` list as vLLM's qwen3_5 / qwen3_next loaders (and their MTP drafts) read them, and
transformers 5.24 ``from_pretrained`` (compressed-tensors 0.20) loading the output with logits equal to
cvt's runtime on it.

vLLM is not installed here: its side is the model layout and ``load_weights`` routing written out in
tests/quant/vllm_ascend_referee_qwen3_5.py (``layout``, ``draft_layout``, ``route``, the model's
``hf_to_vllm`` mapper), with vLLM's compressed-tensors rule for a fused layer (``should_ignore_layer``:
all of a fused layer's shards in ``ignore`` or none, else a ValueError), for a FusedMoE (expert 0's
linears decide: ``CompressedTensorsMoEMethod.get_moe_method``) and ``apply_vllm_mapper`` mapping the
ignore list.
"""

from __future__ import annotations

import json

import pytest
import torch
from cvt.quant.stage import quantize
from cvt.runtime.loader import load_model
from cvt.testing.checkpoints import write_bf16_checkpoint
from cvt.testing.checkpoints_qwen3_5 import tiny_qwen3_5_config, tiny_qwen3_next_config
from cvt.tests.quant.test_stage import weight_only
from cvt.tests.quant.vllm_ascend_referee import read_headers
from cvt.tests.quant.vllm_ascend_referee_layouts import _Embed, _Lin, _MoE, _Plain
from cvt.tests.quant.vllm_ascend_referee_qwen3_5 import _map, draft_layout, layout, model_of, route

KINDS = ("moe", "dense", "next")
SIZES = dict(hidden_size=64, linear_value_head_dim=16, moe_intermediate_size=64, shared_expert_intermediate_size=64)
TOKENS = torch.tensor([[5, 35, 15, 11, 9, 18, 17, 10, 11, 32, 60, 18]])
SUFFIXES = ("weight", "weight_scale", "weight_packed", "weight_shape", "weight_zero_point", "bias")


@pytest.fixture(scope="module")
def ct_outputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct-qwen3.5")
    out = {}
    for kind in KINDS:
        if kind == "next":
            cfg = tiny_qwen3_next_config(mtp_num_hidden_layers=1, **SIZES, intermediate_size=64)
        else:
            cfg = tiny_qwen3_5_config(moe=kind == "moe", mtp=1, **SIZES,
                                      **({} if kind == "moe" else {"intermediate_size": 64}))
            cfg["vision_config"]["out_hidden_size"] = 64
        src = write_bf16_checkpoint(root / kind, cfg)
        for scheme in ("w8a8", "w4a16"):
            dst = root / f"{kind}-{scheme}"
            quantize(src, dst, scheme=scheme, fmt="compressed-tensors", group_size=32, quiet=True)
            out[kind, scheme] = dst
    return out


def _vllm_params(mods: list) -> set[str]:
    """Every parameter name vLLM's modules could hold under a compressed-tensors scheme (tp=1)."""
    out: set[str] = set()
    for m in mods:
        if isinstance(m, _Lin):
            out |= {f"{m.prefix}.{s}" for s in SUFFIXES}
        elif isinstance(m, _MoE):
            out |= {f"{m.prefix}.{w}_{s}" for w in ("w13", "w2") for s in SUFFIXES}
        elif isinstance(m, _Embed):
            out.add(f"{m.prefix}.weight")
        elif isinstance(m, _Plain):
            out.add(m.name)
    return out


def _vllm_name(name: str, model) -> str | None:
    """A checkpoint name as vLLM's model looks it up: the main model's through its mapper, the MTP
    draft's (its own model, prefix ``mtp``) as stored."""
    return name if name.startswith("mtp.") else _map(name, model)


def _check_fused_ignore(m: _Lin, ignore: set[str], stored: dict[str, str]) -> None:
    """vLLM: a fused layer's shards all in ``ignore`` (float weights) or none (quantized parts), else a
    ValueError; the vision tower's, in_proj_ba's and the MTP draft's all ignored."""
    shards = [ck for ck, _, _ in m.shards]
    hit = [ck in ignore for ck in shards]
    assert all(hit) or not any(hit), (m.prefix, hit)
    for ck in shards:
        if all(hit):
            assert stored[f"{ck}.weight"] in ("BF16", "F32"), ck
        else:
            assert f"{ck}.weight_scale" in stored, ck
            assert stored.get(f"{ck}.weight", stored.get(f"{ck}.weight_packed")) in ("I8", "I32"), ck
    if m.prefix.startswith(("visual.", "mtp.")) or m.prefix.endswith("in_proj_ba"):
        assert all(hit), m.prefix


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scheme", ["w8a8", "w4a16"])
def test_vllm_qwen3_5_reads_the_names_and_the_ignore_list(ct_outputs, kind, scheme):
    """Mapped as vLLM maps them, cvt's ignore entries cover whole fused layers (in_proj_ba: b and a, or
    Qwen3-Next's one fused tensor; never half of qkv_proj / in_proj_qkvz / gate_up_proj), every
    vision-tower linear (vLLM builds the tower with the quant config), every linear of the MTP draft
    (vLLM's draft model builds them with it too; its experts through expert 0) and the routers; every
    other linear holds quantized parts, an ignored one a float weight; every tensor routes to a
    parameter (the MTP draft's aside)."""
    dst = ct_outputs[kind, scheme]
    config = json.loads((dst / "config.json").read_text())
    model = model_of(config)
    qc = config.get("quantization_config") or config["text_config"]["quantization_config"]
    ignore = {_vllm_name(i, model) for i in qc["ignore"]}
    assert not any(i.startswith("re:") for i in qc["ignore"])  # a regex would not be mapped to vLLM's names
    tensors, _ = read_headers(dst)
    stored = {_vllm_name(n, model): v[0] for n, v in tensors.items()}
    mods = layout(config, torch.bfloat16)
    draft = draft_layout(config, torch.bfloat16)
    assert draft, "the tiny release has an MTP layer"
    for m in mods + draft:
        if isinstance(m, _Lin) and m.quant:
            _check_fused_ignore(m, ignore, stored)
        elif isinstance(m, _MoE) and m.prefix.startswith("mtp."):
            assert all(f"{m.prefix}.0.{w}_proj" in ignore for w in ("gate", "up", "down")), m.prefix
    params = _vllm_params(mods)
    for name, (dt, _, _) in tensors.items():
        verdict, _ = route(name, params, config, None)
        assert verdict in ("load", "carried"), (name, verdict)
        if verdict == "carried":
            assert dt in ("BF16", "F32"), name


@pytest.mark.parametrize("kind", KINDS)
def test_transformers_loads_qwen3_5_and_logits_match(ct_outputs, kind):
    """transformers' from_pretrained loads the W4A16 output with no missing or unexpected key (the vision
    tower stays float: before cvt listed its linears in ``ignore``, transformers made them W4A16 modules
    the float weights did not fill); its quantized linears are cvt's; on the same inputs each gives cvt's
    dequantized weight's output bit for bit, the experts it fuses are cvt's dequant rounded to bf16, and
    with those experts run in float32 the logits are cvt's within 1e-5 of their range."""
    transformers = pytest.importorskip("transformers")
    dst = ct_outputs[kind, "w4a16"]
    auto = transformers.AutoModelForCausalLM if kind == "next" else transformers.AutoModelForImageTextToText
    hf, info = auto.from_pretrained(dst, dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours = load_model(dst, dtype=torch.float32).model
    theirs = {n: m for n, m in hf.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    assert theirs and not any("visual" in n for n in theirs)
    seen = {}
    hooks = [m.register_forward_hook(lambda mod, a, o, n=n: seen.__setitem__(n, (a[0], o))) for n, m in theirs.items()]
    with torch.no_grad():
        hf(input_ids=TOKENS)
    for h in hooks:
        h.remove()
    for n, (x, y) in seen.items():
        assert torch.equal(y, x @ ours.get_submodule(n).dense_weight().T), n
    params = dict(hf.named_parameters())
    for name, p in params.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            pre = name[: -len(".gate_up_proj")]
            g = ours.get_submodule(f"{pre}.2.gate_proj").dense_weight()
            assert torch.equal(p[2, : g.shape[0]].float(), g.bfloat16().float()), name
        if p.dtype == torch.bfloat16:  # the fused experts: run them in float32, as cvt's runtime does
            p.data = p.data.float()
    ours = weight_only(ours, bf16_experts=True)
    with torch.no_grad():
        a, b = hf(input_ids=TOKENS).logits, ours(TOKENS)
    assert torch.allclose(a, b, rtol=0, atol=1e-5 * a.abs().max().item()), (a - b).abs().max()
    assert torch.equal(a.argmax(-1), b.argmax(-1))
