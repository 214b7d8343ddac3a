"""Gated DeltaNet, the linear attention of Qwen3.5's and Qwen3-Next's linear layers: the layer, its fixed-size state
and the two forms of the gated delta rule, in torch (the reference form, float32 inside).

Shapes: b batch, s new tokens, h hidden_size, Hk / Hv key / value heads (each key head serves
Hv / Hk consecutive value heads), Dk / Dv their widths, C = 2 Hk Dk + Hv Dv conv channels, k the
conv kernel.

    qkv      = in_proj_qkv(x)                                   [b, s, C]
    qkv      = silu(causal depthwise conv1d over [conv_state | qkv])   conv_state: last k-1 inputs
    q, k, v  = split(qkv, [Hk Dk, Hk Dk, Hv Dv]) -> heads; q, k repeated to Hv heads
    q, k     = l2norm(q), l2norm(k)  (x / sqrt(sum x^2 + 1e-6));  q *= Dk^-1/2
    beta     = sigmoid(in_proj_b(x));  g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)   [b, s, Hv]
    per head, S [Dk, Dv] from the state:  S = exp(g_t) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
    o        = out_proj(rmsnorm(o) * weight * silu(in_proj_z(x)))        gated RMSNorm over Dv

The recurrent form runs that loop token by token (cached decode, one token); the chunked form
(prefill, chunks of 64) computes the same sum as transformers' torch_chunk_gated_delta_rule does
(the WY / UT transform inside a chunk, the state carried between chunks), so the runtime matches
transformers' own path in each case (modeling_qwen3_5_moe.py, transformers 5.24, without fla).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cvt.errors import CvtError
from cvt.runtime.kernels import Linear

CHUNK = 64  # transformers' chunk_size


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_rule(q, k, v, g, beta, state):
    """q, k [b, H, s, Dk], v [b, H, s, Dv], g / beta [b, H, s] float32, state [b, H, Dk, Dv] ->
    (o [b, H, s, Dv], the new state): the delta rule one token at a time (q unscaled: / sqrt(Dk) here)."""
    q = q / q.shape[-1] ** 0.5
    out = torch.zeros_like(v)
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        kv_mem = (state * k[:, :, t, :, None]).sum(dim=-2)                      # S^T k   [b, H, Dv]
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = (state * q[:, :, t, :, None]).sum(dim=-2)
    return out, state


def chunked_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The same as `recurrent_rule`, a chunk of positions at a time (prefill; q scaled by Dk^-1/2 here)."""
    s = q.shape[2]
    q = q * q.shape[-1] ** -0.5
    pad = (chunk - s % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    kb, vb = k * beta[..., None], v * beta[..., None]
    q, k, kb, vb = (x.reshape(*x.shape[:2], -1, chunk, x.shape[-1]) for x in (q, k, kb, vb))   # [b, H, N, c, D]
    g = g.reshape(*g.shape[:2], -1, chunk).cumsum(dim=-1)                        # decay from the chunk start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [b, H, N, c, c]
    system = (kb @ k.transpose(-1, -2)) * decay      # unit lower-triangular solve: the diagonal reads as 1
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * g.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    step = g[..., -1].exp()[..., None, None]
    out = torch.zeros_like(u)
    for i in range(q.shape[2]):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * step[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    return out.reshape(*out.shape[:2], -1, out.shape[-1])[:, :, :s], state


class LinearState:
    """One linear layer's cache: the conv's last k-1 inputs ``conv [batch, C, k-1]`` and the
    recurrent state ``recurrent [batch, Hv, Dk, Dv]`` (float32, as transformers keeps it), after
    ``pos`` positions of the sequence. A fixed size, whatever the length."""

    quant = None

    def __init__(self, batch: int, channels: int, kernel: int, heads: int, dk: int, dv: int, dtype=None, device=None):
        self.conv = torch.zeros(batch, channels, kernel - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(batch, heads, dk, dv, dtype=torch.float32, device=device)
        self.pos = 0

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    def take(self, b: int, start_pos: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(conv, recurrent) for a call at `start_pos` (None, None at 0: a new sequence); a
        CvtError when the state is of another position or too small a batch."""
        if b > self.conv.shape[0]:
            raise CvtError(f"linear-attention state of batch {self.conv.shape[0]} cannot hold batch {b}")
        if start_pos == 0:
            return None, None
        if start_pos != self.pos:
            raise CvtError(f"linear-attention state holds positions 0..{self.pos - 1}, not a call at {start_pos}: "
                           "its recurrent state cannot skip or repeat positions")
        return self.conv[:b], self.recurrent[:b]

    def put(self, conv: torch.Tensor, recurrent: torch.Tensor, end: int) -> None:
        b = conv.shape[0]
        self.conv[:b] = conv
        self.recurrent[:b] = recurrent
        self.pos = end


class GatedRMSNorm(nn.Module):
    """rmsnorm(x) * weight (in x's dtype), times silu(gate) in float32 (transformers' RMSNormGated)."""

    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * y.to(dtype)
        return (y * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """A linear layer's token mixer (module docstring); `forward(x, start_pos, state)`."""

    def __init__(self, args, dtype=None, device=None):
        super().__init__()
        h, kw = args.hidden_size, dict(dtype=dtype, device=device)
        self.hk, self.hv = args.linear_num_key_heads, args.linear_num_value_heads
        self.dk, self.dv, self.kernel = args.linear_key_head_dim, args.linear_value_head_dim, args.linear_conv_kernel_dim
        self.channels = 2 * self.hk * self.dk + self.hv * self.dv
        self.build_projections(h, kw)
        self.conv1d = nn.Module()   # the checkpoint's linear_attn.conv1d.weight [C, 1, k], depthwise, no bias
        self.conv1d.weight = nn.Parameter(torch.zeros(self.channels, 1, self.kernel, **kw), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.hv, **kw), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv, **kw), requires_grad=False)
        self.norm = GatedRMSNorm(self.dv, args.rms_norm_eps, **kw)
        self.out_proj = Linear(self.hv * self.dv, h, **kw)

    def build_projections(self, h: int, kw: dict) -> None:
        """Qwen3.5's four input projections, one linear each."""
        self.in_proj_qkv = Linear(h, self.channels, **kw)
        self.in_proj_z = Linear(h, self.hv * self.dv, **kw)
        self.in_proj_b = Linear(h, self.hv, **kw)
        self.in_proj_a = Linear(h, self.hv, **kw)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [b, s, h] -> (qkv [b, s, C] in q | k | v order, z [b, s, Hv*Dv], b and a [b, s, Hv])."""
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def new_state(self, batch: int, dtype, device) -> LinearState:
        return LinearState(batch, self.channels, self.kernel, self.hv, self.dk, self.dv, dtype, device)

    def _conv(self, qkv: torch.Tensor, conv: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv [b, C, s], conv state [b, C, k-1] or None (zeros) -> (silu(conv) [b, C, s], new state)."""
        w = self.conv1d.weight
        prev = conv if conv is not None else qkv.new_zeros(qkv.shape[0], self.channels, self.kernel - 1)
        full = torch.cat([prev.to(w.dtype), qkv.to(w.dtype)], dim=-1)
        out = F.conv1d(full, w, groups=self.channels)                          # [b, C, s]
        return F.silu(out).to(qkv.dtype), full[:, :, -(self.kernel - 1):]

    def forward(self, x: torch.Tensor, start_pos: int, state: LinearState | None) -> torch.Tensor:
        b, s, _ = x.shape
        conv, rec = state.take(b, start_pos) if state is not None else (None, None)
        qkv, z, beta, a = self.project(x)
        mixed, new_conv = self._conv(qkv.transpose(1, 2), conv)
        q, k, v = torch.split(mixed.transpose(1, 2), [self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        rep = self.hv // self.hk
        q = q.reshape(b, s, self.hk, self.dk).repeat_interleave(rep, dim=2)
        k = k.reshape(b, s, self.hk, self.dk).repeat_interleave(rep, dim=2)
        v = v.reshape(b, s, self.hv, self.dv)
        beta = beta.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        q, k, v, beta, g = (t.transpose(1, 2).float() for t in (q, k, v, beta, g))   # heads first, float32
        q, k = l2norm(q), l2norm(k)
        init = rec if rec is not None else q.new_zeros(b, self.hv, self.dk, self.dv)
        rule = recurrent_rule if rec is not None and s == 1 else chunked_rule   # transformers' choice
        o, new_rec = rule(q, k, v, g, beta, init)
        if state is not None:
            state.put(new_conv, new_rec, start_pos + s)
        o = o.transpose(1, 2).to(x.dtype)                                        # [b, s, Hv, Dv]
        z = z.view(b, s, self.hv, self.dv)
        return self.out_proj(self.norm(o, z).reshape(b, s, -1))


class FusedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's Gated DeltaNet: the same layer with q, k, v, z fused into ``in_proj_qkvz`` and
    b, a into ``in_proj_ba``, rows grouped per key head (`cvt.convert.arch.qwen3_next`),
    regrouped here as transformers' Qwen3NextGatedDeltaNet.fix_query_key_value_ordering does."""

    def build_projections(self, h: int, kw: dict) -> None:
        self.in_proj_qkvz = Linear(h, 2 * self.hk * self.dk + 2 * self.hv * self.dv, **kw)
        self.in_proj_ba = Linear(h, 2 * self.hv, **kw)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        r = self.hv // self.hk
        qkvz = self.in_proj_qkvz(x).view(b, s, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = torch.split(qkvz, [self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        beta, a = torch.split(self.in_proj_ba(x).view(b, s, self.hk, 2 * r), [r, r], dim=-1)
        qkv = torch.cat([t.reshape(b, s, -1) for t in (q, k, v)], dim=-1)
        return qkv, z.reshape(b, s, -1), beta.reshape(b, s, -1), a.reshape(b, s, -1)
