"""FlatQuant (Sun et al., 2024, "FlatQuant: Flatness Matters for LLM Quantization"): the online
Kronecker transforms of `w4a4_flatquant` fitted on calibration data.

The scheme (`cvt.qtensor.schemes.flatquant`) computes, per linear ``[n, k]`` with ``k = a * b``,
``y = Q(L^T X R) Q(W')^T`` with ``W' = W T^-1`` (per row ``L^-1 W_r R^-T``) and a per-token
activation scale ``amax * clip / 7``. `fit` learns L [a, a], R [b, b], the clip ratio and a
per-row weight clip (the weight scale ``amax * c_r / 7``, written into ``weight_scale``) of one
input site -- every `--method flatquant` linear reading the same activation (q / k / v, q_a / kv_a,
gate / up: the shards vLLM fuses into one layer with one ``left_trans`` / ``right_trans`` /
``clip_ratio``) -- by minimising the MSE between their quantized outputs and the float outputs
``X W^T`` on the site's calibration rows, as msModelSlim's FlatQuant does
(``msmodelslim/processor/flat_quant``: trainer.py LayerTrainer.train_layer, MSE loss, cosine
schedule; trans_matrix.py InvSingleTransMatrix, the transform itself the parameter and its
inverse computed for the weight; fake_clip_quantizer.py ActivationQuantizer ``lac``, the clip a
sigmoid of a parameter initialised at 4.0 with ten times the learning rate, and WeightQuantizer
``lwc``, the weight clip likewise; round with a straight-through gradient). Differences, on
purpose: the loss is the site's linears' outputs (not the decoder layer's, as msModelSlim's layer
trainer), no learnable diagonal smoothing (FlatQuant folds it into the producer norm;
vllm-ascend's layout has no place for it, and the scheme's AWQ covers that fold), full-batch Adam
(no weight decay) over the sampled rows.

Start: the scheme's randomised Hadamard pair for `seed` (seed 0 = what `--method rtn` writes) and
clips 1; a RowParallelLinear's left transform in `w4a4_mxfp4_flatquant` stays block-diagonal (its
gradient masked: vllm-ascend's ranks each keep one diagonal block,
`cvt.qtensor.schemes.flatquant_mx`). After `steps` the transforms are rounded to bfloat16 (what
is stored and multiplied by) and the site's loss is measured with the runtime kernel's exact arithmetic
(`cvt.runtime.kernels.flatquant`); the start is kept when the fit did not beat it, so a fitted
site never does worse than the Hadamard start on its rows. Deterministic: same rows, steps, lr,
seed and intra-op threads, same bits (CPU; the loss norm and a large site's steps reduce in
per-thread chunks). `--procs N` fits each site on one rank from the rows every rank gathered, in
rank order: one process's rows, so one process's fit up to the summation order.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from cvt.errors import CvtError
from cvt.qtensor.schemes.flatquant import init_transforms
from cvt.qtensor.schemes.flatquant_mx import block_mask
from cvt.qtensor.schemes.w4a8 import QDIV, QMAX, QMIN
from cvt.quant.recipe import FLATQUANT_FIT

STEPS, LR, SEED = (FLATQUANT_FIT[k] for k in ("steps", "lr", "seed"))  # the defaults (`cvt.quant.recipe`)
SMALL_STEP = 1 << 30  # flops of one step (forward and backward) below which the fit runs on one thread
CLIP_INIT = 4.0  # the clip parameter's start, sigmoid(4) = 0.982 (msModelSlim's ActivationQuantizer)


@dataclass
class FlatFit:
    """One site's fitted transforms: ``left`` [a, a] / ``right`` [b, b] bfloat16 as stored,
    ``clip`` in (0, 1], ``weight_clips`` per linear; ``loss`` the output MSE at them, ``loss_init`` at the Hadamard start
    (clip 1); ``fitted`` False when the start was kept."""

    left: torch.Tensor
    right: torch.Tensor
    clip: float
    weight_clips: list  # per linear of the site, float32 [n_i, 1] in (0, 1], or None: 1 (the scheme's amax / 7)
    loss: float
    loss_init: float
    fitted: bool


@contextmanager
def _threads_for(flops: int):
    """One intra-op thread for a step of fewer than `SMALL_STEP` flops (restored after): such a
    step is a few hundred tiny ops, latency-bound, and more threads only add synchronisation --
    on the 2-core test machine under load a small site's backward took 190 ms with 2 threads,
    3.5 ms with 1. A larger step keeps the process's threads."""
    threads = torch.get_num_threads()
    if flops >= SMALL_STEP or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class _Adam:
    """torch.optim.Adam's update (no weight decay) under CosineAnnealingLR(T_max=steps, eta_min=lr
    / 1000), written out: the same arithmetic without importing torch.optim (seconds on a small
    machine, for a few lines)."""

    B1, B2, EPS = 0.9, 0.999, 1e-8

    def __init__(self, params: list[tuple[torch.Tensor, float]], steps: int):
        self.params, self.steps, self.t = params, steps, 0
        self.m = [torch.zeros_like(p) for p, _ in params]
        self.v = [torch.zeros_like(p) for p, _ in params]

    @torch.no_grad()
    def step(self) -> None:
        t, self.t = self.t + 1, self.t + 1
        for (p, lr), m, v in zip(self.params, self.m, self.v):
            rate = lr / 1000 + (lr - lr / 1000) * (1 + math.cos(math.pi * (t - 1) / self.steps)) / 2
            m.lerp_(p.grad, 1 - self.B1)
            v.mul_(self.B2).addcmul_(p.grad, p.grad, value=1 - self.B2)
            denom = (v.sqrt() / math.sqrt(1 - self.B2 ** t)).add_(self.EPS)
            p.addcdiv_(m, denom, value=-rate / (1 - self.B1 ** t))


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    return (torch.round(x) - x).detach() + x


def _fake_quant_rows(x: torch.Tensor, clip: torch.Tensor | float) -> torch.Tensor:
    """Symmetric int4 per row with scale ``amax * clip / 7``, rounded with a straight-through gradient."""
    scale = (x.abs().amax(dim=1, keepdim=True) * clip / QDIV).clamp(min=1e-12)
    return torch.clamp(_round_ste(x / scale), QMIN, QMAX) * scale


def _fake_mx(x: torch.Tensor) -> torch.Tensor:
    """MXFP4 per block of 32 along each row (`cvt.qtensor.mx`: exponents from the detached block
    max, E2M1 elements with a straight-through gradient): `w4a4_mxfp4_flatquant`'s quantizer."""
    from cvt.qtensor import mx as MX

    g = x.reshape(x.shape[0], -1, MX.BLOCK)
    s = (2 ** MX.shared_exponent(g.detach().abs().amax(dim=-1), MX.FP4))[..., None]
    v = g / s
    return (((MX.quantize_elements(v.detach(), MX.FP4) - v).detach() + v) * s).reshape(x.shape)


def _fake_output(x: torch.Tensor, w: torch.Tensor, left: torch.Tensor, right: torch.Tensor,
                 clip: torch.Tensor, wclip: torch.Tensor | None, mx: bool = False) -> torch.Tensor:
    """The differentiable stand-in of the quantized layer: x [m, k], w [n, k] -> [m, n] (`mx`:
    MXFP4 for both, no clips)."""
    a, b = left.shape[0], right.shape[0]
    xt = (left.T @ (x.reshape(-1, a, b) @ right)).reshape(x.shape[0], a * b)
    wf = (torch.linalg.inv(left) @ w.reshape(-1, a, b) @ torch.linalg.inv(right).T).reshape(w.shape)
    if mx:
        return _fake_mx(xt) @ _fake_mx(wf).T
    return _fake_quant_rows(xt, clip) @ _fake_quant_rows(wf, wclip).T


def site_loss(x: torch.Tensor, weights: list[torch.Tensor], left: torch.Tensor, right: torch.Tensor,
              clip: float, weight_clips: list | None = None, scheme=None, names: list | None = None) -> float:
    """sum_i |y_i - X W_i^T|^2 / sum_i numel of the linears quantized with these transforms, run
    through the scheme's runtime kernel (`cvt.runtime.kernels.flatquant`), x [m, k] float32.
    `scheme`: w4a4_flatquant (None) or w4a4_mxfp4_flatquant; `names` the linears' (its row rule)."""
    from cvt.qtensor.schemes.flatquant import W4A4FlatQuant
    from cvt.runtime.kernels import get as kernel

    scheme = scheme or W4A4FlatQuant()
    linear, err, total = kernel(scheme.kernel_fmt()), 0.0, 0
    with torch.no_grad():
        for i, w in enumerate(weights):
            q = scheme.quantize_with(w, left, right, clip, name=names[i] if names else None,
                                     weight_clip=None if weight_clips is None else weight_clips[i])
            y = linear.from_parts(q.parts).reference(x)
            err += float((y - x @ w.T).pow(2).sum(dtype=torch.float64))
            total += y.numel()
    return err / max(total, 1)


def fit(x: torch.Tensor, weights: list[torch.Tensor], *, steps: int = STEPS, lr: float = LR,
        seed: int = SEED, scheme=None, names: list | None = None) -> FlatFit:
    """Fit L, R and the clip of one input site (module doc): x [m, k] its calibration rows,
    `weights` [n_i, k] the float weights of the linears reading it, `names` theirs. `scheme`:
    w4a4_flatquant (None) or w4a4_mxfp4_flatquant, whose MXFP4 quantizer the fit then uses (its
    transform sizes and start too; E8M0 block exponents leave no clip to learn: clips stay 1)."""
    from cvt.qtensor import kernel_formats as KF

    mx = scheme is not None and scheme.kernel_fmt() == KF.W4A4_MXFP4_FLATQUANT
    x = x.detach().to(torch.float32)
    ws = [w.detach().to(torch.float32) for w in weights]
    k = x.shape[1]
    name0 = names[0] if names else None
    left0, right0 = scheme.init_transforms(k, name0, seed) if mx else init_transforms(k, seed)
    loss_init = site_loss(x, ws, left0, right0, 1.0, scheme=scheme, names=names)
    if steps == 0 or x.shape[0] == 0:
        return FlatFit(left0, right0, 1.0, None, loss_init, loss_init, False)
    w = torch.cat(ws)
    ref = x @ w.T
    norm = ref.pow(2).mean().clamp(min=1e-30)   # the loss in units of the output's power: lr means the same anywhere
    left = left0.to(torch.float32).clone().requires_grad_(True)
    # a RowParallelLinear's L stays block-diagonal (`cvt.qtensor.schemes.flatquant_mx.left_blocks`):
    # no gradient outside the blocks, so Adam never moves those entries off zero
    mask = block_mask(left.shape[0], scheme.left_blocks) if mx and scheme.left_blocks > 1 else None
    right = right0.to(torch.float32).clone().requires_grad_(True)
    c = torch.full((1,), CLIP_INIT, requires_grad=True)
    cw = torch.full((w.shape[0], 1), CLIP_INIT, requires_grad=True)
    adam = _Adam([(left, lr), (right, lr)] + ([] if mx else [(c, lr * 10), (cw, lr * 10)]), steps)
    with torch.enable_grad(), _threads_for(6 * x.shape[0] * k * w.shape[0]):
        for _ in range(steps):
            loss = (_fake_output(x, w, left, right, torch.sigmoid(c), torch.sigmoid(cw), mx) - ref).pow(2).mean() / norm
            left.grad = right.grad = c.grad = cw.grad = None
            loss.backward()
            if mask is not None:
                left.grad.mul_(mask)
            adam.step()
    left_b, right_b = left.detach().to(torch.bfloat16), right.detach().to(torch.bfloat16)
    clip = 1.0 if mx else float(torch.sigmoid(c.detach()).to(torch.float32))
    wclips = None if mx else list(torch.sigmoid(cw.detach()).split([wi.shape[0] for wi in ws]))
    try:  # a fit that left a transform singular in bfloat16 (or a clip of 0) is not kept
        loss = site_loss(x, ws, left_b, right_b, clip, wclips, scheme=scheme, names=names)
    except (CvtError, torch.linalg.LinAlgError):
        loss = float("inf")
    if not loss < loss_init:
        return FlatFit(left0, right0, 1.0, None, loss_init, loss_init, False)
    return FlatFit(left_b, right_b, clip, wclips, loss, loss_init, True)


def flatquant_site(lc, name: str, site, stats: dict) -> None:
    """Quantize linear `name` of the layer driver `lc` (`cvt.quant.methods.calib._LayerCalib`)
    behind its input site's fitted transforms, and put its dequantized weight in the model: the
    site's first `--method flatquant` linear fits them for all of the site's (`fit`: one set for
    the shards vLLM fuses), the others reuse them. `stats` (the manifest's per-linear record)
    gains the site's loss before and after."""
    from cvt.quant.recipe import FLATQUANT, mixed_site
    from cvt.runtime.metrics import sqnr_db

    key, o = lc.site_of[name], lc.o
    found = lc.flat_fits.get(key)
    if found is None:
        peers = [t for t in lc.schemes if lc.site_of[t] == key and lc.method[t] == FLATQUANT]
        other = [t for t in lc.schemes if lc.site_of[t] == key and t not in peers
                 and lc.schemes[t].kernel_fmt() == lc.schemes[name].kernel_fmt()]
        if other:  # vLLM fuses the linears of one input: one left_trans / right_trans / clip_ratio for them
            # (the stage refuses this from its plan before DST; here for `calibrate`'s own callers)
            raise mixed_site(name, other[0], lc.schemes[other[0]].name, lc.method[other[0]])
        found = fit(site.samples(), [lc.linears[t].weight for t in peers], steps=o["flatquant_steps"],
                    lr=o["flatquant_lr"], seed=o["flatquant_seed"], scheme=lc.schemes[name], names=peers)
        lc.flat_fits[key] = (found, peers)
    found, peers = lc.flat_fits[key]
    mod, scheme = lc.linears[name], lc.schemes[name]
    w = mod.weight.detach().to(torch.float32)
    qt = scheme.quantize_with(w, found.left, found.right, found.clip, name=name,
                              weight_clip=None if found.weight_clips is None else found.weight_clips[peers.index(name)])
    deq = scheme.dequantize(qt)
    lc.res.quantized[name] = qt
    lc.res.methods[name] = FLATQUANT
    stats.update(flatquant_loss=found.loss, flatquant_loss_init=found.loss_init, flatquant_clip=found.clip,
                 sqnr_db=sqnr_db(w, deq))
    mod.weight.data = deq.to(device=mod.weight.device, dtype=mod.weight.dtype)
