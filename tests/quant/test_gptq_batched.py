"""Batched GPTQ (cvt.quant.methods.gptq_batched): one column sweep for E same-shaped linears.

Each member's result equals `gptq_quantize` of that member alone, up to float reduction order
(bmm against mm): codes of all but a tiny fraction of elements, the proxy loss to 1e-4
relative, dampening and dead columns exactly; the stored tensor dequantizes exactly to the
weight reported. The members include one with dead input channels and one whose Hessian needs
a dampening retry, so that per-member handling is exercised. The column loop reads nothing
back to the host (checked by making ``Tensor.item`` / ``__bool__`` / ... raise during it).
"""

from __future__ import annotations

import pytest
import torch

import cvt.quant.methods.gptq_batched as gb
from cvt.errors import CvtError
from cvt.qtensor.schemes import get_scheme
from cvt.quant.methods.gptq import gptq_quantize
from cvt.quant.methods.gptq_batched import gptq_quantize_batched

SCHEMES = {
    "int4-g32-sym": ("w4a16", dict(group_size=32)),
    "int4-g32-asym": ("w4a16", dict(group_size=32, symmetric=False)),
    "w8a8-channel": ("w8a8", {}),
    "mxfp4": ("fp4", dict(fp4_format="mxfp4")),
    "nvfp4": ("fp4", dict(fp4_format="nvfp4")),          # a per-tensor global scale: static groups only
    "mxfp8": ("mxfp8", {}),
    "w4a4-mxfp4": ("w4a4_mxfp4", {}),
}
# (act_order, static_groups, scale_search)
MODES = {
    "dynamic": (False, False, None),
    "dynamic-search": (False, False, "hdiag"),
    "static": (False, True, None),
    "act_order-search": (True, True, "hdiag"),
}
SHRINKS = (1.0, 0.95, 0.9, 0.85, 0.8)     # fewer clip ratios than the default 21: the same code, faster
CODE_PARTS = ("weight", "weight_int4", "weight_fp4", "weight_fp8")
N, K, E = 32, 128, 3


def members(n=N, k=K, e=E, seed=0):
    """(W [e, n, k], H [e, k, k]): correlated inputs with a few large channels; member 1 has two
    dead input channels, member 2 an indefinite Hessian that dampening 0.01 does not fix."""
    g = torch.Generator().manual_seed(seed)
    Ws, Hs = [], []
    for _ in range(e):
        mix = torch.randn(k, k, generator=g) / k ** 0.5
        x = torch.randn(4 * k, k, generator=g) @ mix + 0.1 * torch.randn(4 * k, k, generator=g)
        x[:, :4] *= 8
        Ws.append(torch.randn(n, k, generator=g) * 0.05)
        Hs.append(2 * x.T @ x / x.shape[0])
    H = torch.stack(Hs)
    if e > 1:
        H[1, :, [7, 9]] = 0
        H[1, [7, 9], :] = 0
    if e > 2:
        H[2] -= 0.05 * torch.diagonal(H[2]).mean() * torch.eye(k)
    return torch.stack(Ws), H


def code_part(qt):
    return next(p for p in CODE_PARTS if p in qt.parts)


def modes_for(key):
    # nvfp4 has a per-tensor part: static groups only (dynamic ones are refused by both paths)
    return [m for m in MODES if not (key == "nvfp4" and m.startswith("dynamic"))]


@pytest.mark.parametrize("key,mode", [(k, m) for k in SCHEMES for m in modes_for(k)],
                         ids=[f"{k}-{m}" for k in SCHEMES for m in modes_for(k)])
def test_batched_matches_one_by_one(key, mode):
    name, opts = SCHEMES[key]
    scheme = get_scheme(name, **opts)
    act_order, static, search = MODES[mode]
    W, H = members()
    got = gptq_quantize_batched(W, H, scheme, act_order=act_order, static_groups=static, scale_search=search,
                                shrinks=SHRINKS, block_size=64, names=[f"experts.{e}.up_proj" for e in range(E)])
    assert len(got) == E
    for e, r in enumerate(got):
        ref = gptq_quantize(W[e], H[e], scheme, act_order=act_order, static_groups=static, scale_search=search,
                            shrinks=SHRINKS, block_size=64)
        assert (r.damp, r.dead_columns, r.static_groups) == (ref.damp, ref.dead_columns, ref.static_groups)
        part = code_part(ref.qtensor)
        assert r.qtensor.parts.keys() == ref.qtensor.parts.keys()
        same = (r.qtensor.parts[part] == ref.qtensor.parts[part]).float().mean().item()
        assert same >= 0.999, (e, same)
        assert r.loss == pytest.approx(ref.loss, rel=1e-4)
        # the stored tensor is exactly what the batched sweep chose
        assert r.exact and torch.equal(scheme.dequantize(r.qtensor).float(), r.weight)
    assert [r.damp for r in got] == [0.01, 0.01, 0.1]
    assert [r.dead_columns for r in got] == [0, 2, 0]
    assert torch.all(got[1].weight[:, [7, 9]] == 0)


def _raise(name):
    raise AssertionError(f"host sync: {name}")


def test_the_column_loop_reads_nothing_back(monkeypatch):
    """Inside `_sweep_batched` (dynamic groups' RTN calls excepted) no tensor value goes to the
    host: item / tolist / __bool__ / __int__ / __float__ / __index__ raise there."""
    real_sweep = gb._sweep_batched
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
    saved = {nm: getattr(torch.Tensor, nm) for nm in names}
    calls = []

    def forbid():
        for nm in names:
            setattr(torch.Tensor, nm, lambda *a, _nm=nm, **k: _raise(_nm))

    def allow():
        for nm, f in saved.items():
            setattr(torch.Tensor, nm, f)

    def sweep(W, U, grid, G, perm, block_size, dyn_parts, regroup):
        def regroup_allowed(cur, j):     # the scheme's RTN of a new group: once per group, may check on the host
            allow()
            try:
                return regroup(cur, j)
            finally:
                forbid()
        calls.append(perm is not None)
        forbid()
        try:
            return real_sweep(W, U, grid, G, perm, block_size, dyn_parts, regroup_allowed)
        finally:
            allow()

    monkeypatch.setattr(gb, "_sweep_batched", sweep)
    W, H = members(k=64)
    for key in ("int4-g32-asym", "mxfp4", "mxfp8"):
        name, opts = SCHEMES[key]
        for act_order, static in ((False, False), (True, True)):
            gptq_quantize_batched(W, H, get_scheme(name, **opts), act_order=act_order, static_groups=static,
                                  block_size=32)
    assert calls == [False, True] * 3
    with pytest.raises(AssertionError, match="host sync"):     # the guard does catch a sync
        forbid()
        try:
            torch.ones(1).item()
        finally:
            allow()


def test_batched_refusals():
    scheme = get_scheme("w4a16", group_size=32)
    W, H = members(k=64)
    with pytest.raises(CvtError, match=r"\[E, n, k\]"):
        gptq_quantize_batched(W, H[:, :10, :10], scheme)
    with pytest.raises(CvtError, match="2 names for 3"):
        gptq_quantize_batched(W, H, scheme, names=["a", "b"])
    bad = H.clone()
    bad[1] = float("nan")
    with pytest.raises(CvtError, match="experts.1.down_proj.*positive definite"):
        gptq_quantize_batched(W, bad, scheme, names=[f"experts.{e}.down_proj" for e in range(E)])
    W[2, 0, 0] = float("inf")
    with pytest.raises(CvtError, match="w2.*non-finite"):
        gptq_quantize_batched(W, H, scheme, names=["w0", "w1", "w2"])


@pytest.mark.slow
def test_calibration_solves_same_shaped_experts_together(monkeypatch):
    """`calibrate` hands a layer's routed experts of one shape to one batched call; the quantized
    model is the one the per-linear path gives: on this CPU the same bits; anywhere, the codes of
    at least 99.5% of the weights (bmm and mm may sum in another order on another BLAS, and one
    flipped code changes the next layer's inputs)."""
    import cvt.quant.methods.calib as calib_mod
    from cvt.quant.methods import calibrate
    from cvt.testing.checkpoints import tiny_qwen3_config
    from cvt.tests.quant.test_methods import random_model

    cfg = tiny_qwen3_config(moe=True)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    scheme = get_scheme("w4a16", group_size=16)

    def sf(n):
        return None if n.endswith(("lm_head", "mlp.gate")) else scheme

    shapes = []
    real = gb.gptq_quantize_batched
    monkeypatch.setattr(gb, "gptq_quantize_batched",
                        lambda W, *a, **k: shapes.append(tuple(W.shape)) or real(W, *a, **k))
    batched = calibrate(random_model(cfg), tokens, sf, "gptq", min_tokens=1)
    assert shapes and all(E > 1 for E, _, _ in shapes)
    monkeypatch.setattr(calib_mod, "solve_together", lambda *a, **k: {})
    alone = calibrate(random_model(cfg), tokens, sf, "gptq", min_tokens=1)
    assert batched.quantized.keys() == alone.quantized.keys()
    same = total = 0
    for name, qt in alone.quantized.items():
        for part, t in qt.parts.items():
            got = batched.quantized[name].parts[part]
            assert got.shape == t.shape and got.dtype == t.dtype, (name, part)
            if not t.is_floating_point():  # the codes
                same += int((got == t).sum())
                total += t.numel()
    assert total and same / total >= 0.995, same / total


def test_members_of_one_hessian_share_its_factor(monkeypatch):
    """`same`: gate and up of one expert hand in one Hessian; its inverse-Hessian factor is
    computed once for both (the batch factors 2 matrices for 3 members), and each member's
    result is the one computing it again gives (codes >= 99.5% equal anywhere; damp exact)."""
    g = torch.Generator().manual_seed(1)
    x = [torch.randn(128, 64, generator=g) for _ in range(2)]
    H1, H2 = (2 * a.T @ a / 128 for a in x)
    W = torch.randn(3, 32, 64, generator=g)
    H = torch.stack([H1, H1, H2])
    scheme = get_scheme("w4a16", group_size=16)
    seen = []
    real = gb._inverse_cholesky_batched
    monkeypatch.setattr(gb, "_inverse_cholesky_batched",
                        lambda Hs, *a, **k: seen.append(Hs.shape[0]) or real(Hs, *a, **k))
    shared = gb.gptq_quantize_batched(W, H, scheme, act_order=True, same=[0, 0, 2])
    each = gb.gptq_quantize_batched(W, H, scheme, act_order=True)
    assert seen == [2, 3]
    for a, b in zip(shared, each):
        assert a.damp == b.damp
        code = next(k for k, t in b.qtensor.parts.items() if not t.is_floating_point())
        assert (a.qtensor.parts[code] == b.qtensor.parts[code]).float().mean() >= 0.995
