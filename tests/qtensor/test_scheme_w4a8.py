"""`w4a8` (Ascend W4A8_DYNAMIC): msModelSlim 26.1's math and on-disk form, written out here by
hand from its code and run in the dtype it runs in, against cvt's scheme and layouts.

msModelSlim 26.1 (``site-packages/msmodelslim``):

* ``core/quantizer/impl/minmax.py`` WeightPerChannelMinmax.forward: min / max over each output
  channel (``weight.T``, dim 0), calculate_qparam, quantize;
* ``ir/api/impl/int_quantization.py`` calculate_int_qparam (symmetric: ``max_bound = 2**(4-1) - 1``,
  ``scale = max(-min(w, 0), max(w, 0)) / max_bound``, ``torch.max(scale, eps)`` with eps the
  float32 epsilon ``type_as`` the weight) and int_quantize (``(w / scale + offset).round_()``,
  clamp to -8..7), all in the weight's dtype (bfloat16 for the releases);
* ``core/quant_service/modelslim_v1/save/ascendv1.py`` on_w4a8_dynamic: ``weight`` =
  w4a8_pack_int4(q), ``weight_scale`` = scale.unsqueeze(-1) float32, ``weight_offset`` zeros,
  ``scale_bias`` = process_scale(prefix, (q.float().T * scale).T, 16) float32;
* ``.../save/utils/pack.py`` _pack_int4 / w4a8_pack_int4 (pairs along n: element 2j low nibble)
  and process_scale (gate/up/q/k/v/w1/w3: ``8 * sum(dim=1, keepdim)``; down/o/w2: reshape to
  ``[-1, k // 16]``, sum, ``* 8``, back to ``[n, 16]``).

Optional referee: with ``CVT_MSMODELSLIM_PYTHON`` naming a python that has msmodelslim 26.1,
msModelSlim's own WeightPerChannelMinmax and saver helpers run on the same bf16 weight (a zero
and a tiny channel included) and must write the same bytes (they do). On a float32 weight
msModelSlim keeps float32 scales, which cvt does not (its scales are bf16 numbers).
"""

from __future__ import annotations

import pytest
import torch

import cvt.runtime.kernels as K
from cvt.errors import CvtError, FormatError
from cvt.qtensor import layouts as L
from cvt.qtensor.formats import get_format
from cvt.qtensor.schemes import get_scheme

N, KF = 64, 256
GATE, DOWN = "model.layers.1.mlp.experts.0.gate_proj", "model.layers.1.mlp.experts.0.down_proj"


def bf16_weight(n=N, k=KF, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1).to(torch.bfloat16)
    w[3] = 0  # an all-zero channel
    w[5] = (torch.linspace(-1, 1, k) * 7 * 2.0 ** -30).to(torch.bfloat16)  # below the eps floor
    return w


# ---- msModelSlim, by hand ------------------------------------------------------------------------

def ms_minmax_int4_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale [n] in w's dtype, q int8 [n, k]) as WeightPerChannelMinmax + calculate_int_qparam +
    int_quantize compute them (in w's dtype)."""
    wt = w.T
    min_val, max_val = torch.amin(wt, 0), torch.amax(wt, 0)
    eps = torch.tensor([torch.finfo(torch.float32).eps]).type_as(min_val)
    min_val = torch.min(min_val, torch.zeros_like(min_val))
    max_val = torch.max(max_val, torch.zeros_like(max_val))
    scale = torch.max(torch.max(-min_val, max_val) / float(7), eps)
    offset = torch.tensor(0.0).type_as(min_val).expand(scale.shape)
    q = (wt / scale + offset).round_().clamp_(min=-8, max=7)
    return scale, q.T.to(torch.int8)


def ms_pack(q: torch.Tensor) -> torch.Tensor:
    weight = q.transpose(-1, -2).contiguous().to(torch.int8)
    k, n = weight.shape
    weight = weight.reshape(-1, 2)
    packed = torch.bitwise_or(torch.bitwise_left_shift(weight[:, 1:], 4), weight[:, :1] & 0b00001111)
    return packed.reshape(k, n // 2).transpose(-1, -2).contiguous()


def ms_process_scale(name: str, bias: torch.Tensor, tp_num: int = 16) -> torch.Tensor:
    if any(c in name for c in ["up_proj", "gate_proj", "q_proj", "k_proj", "v_proj", "w1", "w3"]):
        return 8 * bias.sum(dim=1, keepdim=True)
    pre_shape, sum_shape = bias.shape[0], bias.shape[1] // tp_num
    return (8 * bias.reshape(-1, sum_shape).sum(dim=1, keepdim=True)).reshape(pre_shape, -1)


def ms_save(name: str, q: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    weight_scale = scale.unsqueeze(-1)
    deq_weight = q.to(torch.float32).T * scale
    return {"weight": ms_pack(q), "weight_scale": weight_scale.to(torch.float32),
            "weight_offset": torch.zeros_like(weight_scale).to(torch.float32),
            "scale_bias": ms_process_scale(name, deq_weight.T, 16).to(torch.float32)}


# ---- the scheme ---------------------------------------------------------------------------------

def test_quantize_is_msmodelslim_minmax_in_bf16():
    w = bf16_weight()
    ms_scale, ms_q = ms_minmax_int4_per_channel(w)
    q = get_scheme("w4a8").quantize(w.float(), name="w")
    assert (q.scheme, q.kernel_fmt, q.shape, q.group_size, q.symmetric, q.extra) == \
        ("w4a8", "w4a8_dynamic", (N, KF), 0, True, {})
    assert sorted(q.parts) == ["weight_int4", "weight_scale"]
    assert q.parts["weight_scale"].dtype == torch.float32 and q.parts["weight_scale"].shape == (N, 1)
    assert torch.equal(q.parts["weight_scale"].reshape(-1), ms_scale.float())
    assert torch.equal(q.parts["weight_int4"], ms_q)
    assert q.parts["weight_scale"][3].item() == 2.0 ** -23 and not q.parts["weight_int4"][3].any()
    assert q.parts["weight_scale"][5].item() == 2.0 ** -23  # the eps floor: values clamp at -8 / 7
    # the quotient is rounded to bf16 before round(): msModelSlim's bf16 arithmetic, not float32's
    s = q.parts["weight_scale"]
    f32 = torch.clamp(torch.round(w.float() / s), -8, 7).to(torch.int8)
    assert (f32 != ms_q).any()


def test_dequantize_and_accuracy():
    s = get_scheme("w4a8")
    w = bf16_weight().float()
    w[5] = 0
    q = s.quantize(w)
    d = s.dequantize(q)
    assert torch.equal(d, q.parts["weight_int4"].float() * q.parts["weight_scale"])
    assert torch.equal(s.fake_quant(w), d)
    assert bool((d.abs().amax(1) <= w.abs().amax(1) * (1 + 2 ** -8)).all())  # amax / 7: nothing saturates
    keep = [i for i in range(N) if i not in (3, 5)]
    sqnr = 20 * torch.log10(w[keep].norm() / (w[keep] - d[keep]).norm())
    assert sqnr > 14


@pytest.mark.parametrize("opts, msg", [
    (dict(group_size=64), "per output channel only"),
    (dict(symmetric=False), "symmetric only"),
    (dict(fp4_format="mxfp4"), "takes no fp4_format"),
    (dict(static_activations=True), "per token at run time"),
])
def test_options_refused(opts, msg):
    with pytest.raises(CvtError, match=msg):
        get_scheme("w4a8", **opts)
    s = get_scheme("w4a8", group_size=0, symmetric=True)
    assert s.param_info((8, 32)) == {"weight_int4": ((8, 32), torch.int8), "weight_scale": ((8, 1), torch.float32)}


def test_nonfinite_refused():
    w = bf16_weight().float()
    w[0, 0] = float("nan")
    with pytest.raises(CvtError, match="'x.weight'.*non-finite"):
        get_scheme("w4a8").quantize(w, name="x.weight")


# ---- the Ascend layouts ---------------------------------------------------------------------------

@pytest.mark.parametrize("module, layout, sb_cols", [(GATE, "ascend-w4a8-dynamic", 1),
                                                     (DOWN, "ascend-w4a8-dynamic-row", 16)])
def test_disk_tensors_are_msmodelslims(module, layout, sb_cols):
    w = bf16_weight()
    ms_scale, ms_q = ms_minmax_int4_per_channel(w)
    want = ms_save(module, ms_q, ms_scale)
    fmt = get_format("ascend")
    q = get_scheme("w4a8").quantize(w.float())
    assert fmt.layout_for(module, q, expert=True).name == layout
    got = fmt.disk_tensors(module, q, expert=True)
    assert sorted(got) == sorted(f"{module}.{s}" for s in want)
    for s, t in want.items():
        g = got[f"{module}.{s}"]
        assert (g.dtype, tuple(g.shape)) == (t.dtype, tuple(t.shape)), s
        assert torch.equal(g, t), s
    assert got[f"{module}.scale_bias"].shape == (N, sb_cols)
    assert set(fmt.tags(module, q, expert=True).values()) == {"W4A8_DYNAMIC"}
    back = fmt.read(module, got, "W4A8_DYNAMIC")
    assert (back.scheme, back.kernel_fmt, back.shape, back.group_size, back.symmetric, back.extra) == \
        (q.scheme, q.kernel_fmt, q.shape, q.group_size, q.symmetric, q.extra)
    assert all(torch.equal(back.parts[p], q.parts[p]) and back.parts[p].dtype == q.parts[p].dtype for p in q.parts)
    assert sorted(back.parts) == sorted(q.parts)


def test_scale_bias_is_the_ops_correction_term():
    """8 * sum_k(w_q * scale) per output channel: the row form holds it in 16 runs of k/16."""
    q = get_scheme("w4a8").quantize(bf16_weight().float())
    fmt = get_format("ascend")
    want = 8 * (q.parts["weight_int4"].double() * q.parts["weight_scale"].double()).sum(1, keepdim=True)
    col = fmt.disk_tensors(GATE, q, expert=True)[GATE + ".scale_bias"]
    row = fmt.disk_tensors(DOWN, q, expert=True)[DOWN + ".scale_bias"]
    torch.testing.assert_close(col.double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(row.double().sum(1, keepdim=True), want, rtol=1e-6, atol=1e-6)
    runs = (q.parts["weight_int4"].double() * q.parts["weight_scale"].double()).reshape(N, 16, KF // 16).sum(-1) * 8
    torch.testing.assert_close(row.double(), runs, rtol=1e-6, atol=1e-6)


def test_layout_entries_and_roles():
    col, row = L.LAYOUTS.get("ascend-w4a8-dynamic"), L.LAYOUTS.get("ascend-w4a8-dynamic-row")
    for lo in (col, row):
        assert (lo.kernel_fmt, lo.format, lo.targets, lo.tag, lo.experts_only) == \
            ("w4a8_dynamic", "ascend", ("vllm-ascend",), "W4A8_DYNAMIC", True)
    assert col.shapes(256, 7168, 0) == {"weight": ((128, 7168), "I8"), "weight_scale": ((256, 1), "F32"),
                                        "weight_offset": ((256, 1), "F32"), "scale_bias": ((256, 1), "F32")}
    assert row.shapes(7168, 2048, 0)["scale_bias"] == ((7168, 16), "F32")
    # what a TP split must keep whole: pairs of rows; for the row form k/16 (tp divides 16)
    assert col.split_units("n", 0, 7168) == 2 and col.split_units("k", 0, 7168) == 1
    assert row.split_units("k", 0, 2048) == 128 and row.tensor("scale_bias").along("k", 0, 2048) == (1, 128)
    assert [L.scale_bias_role(m) for m in (GATE, DOWN, "m.up_proj", "m.o_proj", "m.experts.3.w2", "m.w1")] == \
        ["column", "row", "column", "row", "row", "column"]
    with pytest.raises(FormatError, match=r"'gate_up' is neither"):
        L.scale_bias_role("model.layers.1.mlp.experts.0.gate_up")
    assert L.kernel_fmt_of("w4a8") == "w4a8_dynamic" and L.kernel_formats("w4a8") == {"w4a8_dynamic"}


def test_ascend_refusals():
    fmt = get_format("ascend")
    s = get_scheme("w4a8")
    fmt.supports(s)  # vllm-ascend (the default target)
    with pytest.raises(FormatError, match="for mindie has no layout for scheme 'w4a8'"):
        fmt.supports(s, target="mindie")
    with pytest.raises(FormatError, match="compressed-tensors.*w4a8|w4a8.*compressed-tensors"):
        get_format("compressed-tensors").supports(s)
    q = s.quantize(bf16_weight().float())
    for module in ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.kv_a_proj_with_mqa"):
        with pytest.raises(FormatError, match="for MoE experts only"):  # before any scale_bias question
            fmt.disk_tensors(module, q, expert=False)
    q12 = s.quantize(torch.randn(12, KF))
    with pytest.raises(FormatError, match="multiple of 8, got 12"):
        fmt.disk_tensors(GATE, q12, expert=True)
    q_odd_k = s.quantize(torch.randn(16, 40))
    with pytest.raises(FormatError, match="multiple of 16, got 40"):
        fmt.disk_tensors(DOWN, q_odd_k, expert=True)
    fmt.disk_tensors(GATE, q_odd_k, expert=True)  # summed whole: any k


def test_read_refusals():
    fmt = get_format("ascend")
    q = get_scheme("w4a8").quantize(bf16_weight().float())
    disk = fmt.disk_tensors(GATE, q, expert=True)

    def read(**change):
        d = dict(disk)
        for k, v in change.items():
            if v is None:
                del d[f"{GATE}.{k}"]
            else:
                d[f"{GATE}.{k}"] = v
        return fmt.read(GATE, d, "W4A8_DYNAMIC")

    with pytest.raises(FormatError, match="per-group W4A8_DYNAMIC"):
        read(weight_scale_second=torch.ones(N, 2), weight_offset_second=torch.zeros(N, 2))
    with pytest.raises(FormatError, match="weight_offset must be 64 zeros"):
        read(weight_offset=torch.ones(N, 1))
    with pytest.raises(FormatError, match=r"missing scale_bias"):
        read(scale_bias=None)
    with pytest.raises(FormatError, match=r"scale_bias is \[64, 5\]"):
        read(scale_bias=torch.zeros(N, 5))
    with pytest.raises(FormatError, match=r"weight_scale is \[32, 1\]: expected \[64, 1\]"):
        read(weight_scale=torch.ones(32, 1))
    # a TP shard of the row form holds 16 / tp runs
    read(scale_bias=torch.zeros(N, 4))


def test_kernel_runs_what_the_layout_reads():
    fmt = get_format("ascend")
    q = get_scheme("w4a8").quantize(bf16_weight().float())
    back = fmt.read(DOWN, fmt.disk_tensors(DOWN, q, expert=True), "W4A8_DYNAMIC")
    mod = K.get(back.kernel_fmt).from_parts(back.parts)
    assert isinstance(mod, K.W4A8DynamicLinear)
    assert torch.equal(mod.dense_weight(), get_scheme("w4a8").dequantize(q))


# ---- msModelSlim itself (optional) ------------------------------------------------------------------

_MS_PY = __import__("os").environ.get("CVT_MSMODELSLIM_PYTHON", "")
_MS_SCRIPT = r"""
import sys, torch
from safetensors.torch import load_file, save_file
from msmodelslim.ir.qal import QDType, QStorage
from msmodelslim.core.quantizer.base import QConfig
from msmodelslim.core.quantizer.impl.minmax import WeightPerChannelMinmax
from msmodelslim.core.quant_service.modelslim_v1.save.utils.pack import w4a8_pack_int4, process_scale
w = load_file(sys.argv[1])["w"]
wq = WeightPerChannelMinmax(QConfig(dtype="int4", scope="per_channel", symmetric=True, method="minmax"))
wq.init_weight(QStorage(QDType.FLOAT, value=w))
wq.forward(None)
scale, q = wq.get_q_param().ext["scale"], wq.get_q_storage().value
deq = q.to(torch.float32).T * scale  # AscendV1Saver.on_w4a8_dynamic
out = {"weight": w4a8_pack_int4(q.to(torch.int8)), "weight_scale": scale.unsqueeze(-1).to(torch.float32)}
for role, name in (("column", sys.argv[3]), ("row", sys.argv[4])):
    out["scale_bias_" + role] = process_scale(name, deq.T, 16).to(torch.float32).contiguous()
save_file({k: v.contiguous() for k, v in out.items()}, sys.argv[2])
"""


@pytest.mark.skipif(not _MS_PY, reason="set CVT_MSMODELSLIM_PYTHON to a python with msmodelslim 26.1 installed")
def test_msmodelslim_itself_writes_the_same_tensors(tmp_path):
    import subprocess

    from safetensors.torch import load_file, save_file

    save_file({"w": bf16_weight()}, tmp_path / "w.safetensors")
    subprocess.run([_MS_PY, "-c", _MS_SCRIPT, str(tmp_path / "w.safetensors"), str(tmp_path / "ms.safetensors"),
                    GATE, DOWN], check=True, capture_output=True, timeout=600)
    ms = load_file(tmp_path / "ms.safetensors")
    fmt = get_format("ascend")
    q = get_scheme("w4a8").quantize(bf16_weight().float())
    for module, role in ((GATE, "column"), (DOWN, "row")):
        got = fmt.disk_tensors(module, q, expert=True)
        assert torch.equal(got[f"{module}.weight"], ms["weight"])
        assert torch.equal(got[f"{module}.weight_scale"], ms["weight_scale"])
        assert torch.equal(got[f"{module}.scale_bias"], ms[f"scale_bias_{role}"])
