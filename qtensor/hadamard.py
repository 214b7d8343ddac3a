"""Orthogonal matrices for `cvt quantize --rotate`: randomised Hadamard transforms Q = diag(d) H /
sqrt(n), with H a Kronecker product of a Paley-constructed order (12, 20, 28, 36, ...) and a
Sylvester power of two, so the widths real models have (7168 = 28 x 256, 6144 = 12 x 512, 5120 =
20 x 256, 1536 = 12 x 128, and every power of two) are exact Hadamard transforms applied in
O(n (a + b)) per row; a width no known order reaches gets a seeded random orthogonal matrix (QR of
a Gaussian), said in the manifest. d: seeded random signs. Everything is deterministic in the seed.
"""

from __future__ import annotations

import math
import zlib

import torch


def _is_prime(q: int) -> bool:
    return q > 1 and all(q % p for p in range(2, math.isqrt(q) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = chi(j - i) for the quadratic character chi of GF(q), q prime."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0] + [1 if a in squares else -1 for a in range(1, q)], dtype=torch.float64)
    idx = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    return chi[idx]


def _paley(order: int) -> torch.Tensor | None:
    """A Hadamard matrix of `order` from Paley's constructions (I: order - 1 a prime = 3 mod 4;
    II: order / 2 - 1 a prime = 1 mod 4), or None."""
    q = order - 1
    if _is_prime(q) and q % 4 == 3:
        s = torch.zeros(order, order, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, _jacobsthal(q)
        return torch.eye(order, dtype=torch.float64) + s
    q = order // 2 - 1
    if order % 2 == 0 and _is_prime(q) and q % 4 == 1:
        c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1, 1, _jacobsthal(q)
        plus = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        minus = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        return torch.kron(c, plus) + torch.kron(torch.eye(q + 1, dtype=torch.float64), minus)
    return None


def sylvester(n: int) -> torch.Tensor:
    """The Sylvester-Hadamard matrix of a power of two `n`."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_factors(n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(A, B) with A (x) B a Hadamard matrix of order n: A of Paley's orders (or [[1]]), B a
    power-of-two Sylvester matrix; None when n has no such split."""
    two = n & -n  # the largest power of two dividing n
    odd = n // two
    if odd == 1:
        return torch.ones(1, 1, dtype=torch.float64), sylvester(n)
    a, b = odd, two
    while b >= 1:
        h = _paley(a)
        if h is not None:
            return h, sylvester(b)
        a, b = a * 2, b // 2
    return None


class Orthogonal:
    """Q [n, n] of the module docstring, applied without forming it where it is a Hadamard
    transform. `label` separates the spaces one seed rotates (residual stream, latents, values)."""

    def __init__(self, n: int, seed: int, label: str):
        self.n = n
        g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(f"{label}:{n}".encode())) % 2**63)
        self.signs = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
        factors = hadamard_factors(n)
        if factors is None:
            q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
            self.dense = (q * torch.sign(torch.diagonal(r))).float()  # Haar-distributed, sign-fixed
            self.kind = "random orthogonal"
        else:
            self.dense = None
            self.a, self.b = (f.float() for f in factors)
            self.kind = f"hadamard {self.a.shape[0]}x{self.b.shape[0]}"

    def right(self, w: torch.Tensor) -> torch.Tensor:
        """w @ Q for w [..., n] (float32)."""
        x = w * self.signs
        if self.dense is not None:
            return x @ self.dense
        lead = x.shape[:-1]
        x = x.reshape(-1, self.a.shape[0], self.b.shape[0])
        # (x (A kron B)) reshaped [a, b] is A^T X B
        y = torch.matmul(self.a.T, torch.matmul(x, self.b))
        return (y / math.sqrt(self.n)).reshape(*lead, self.n)

    def left_t(self, w: torch.Tensor) -> torch.Tensor:
        """Q^T @ w for w [n, ...] (float32; a bias [n] too)."""
        if w.dim() == 1:
            return self.right(w)
        return self.right(w.T).T

    def matrix(self) -> torch.Tensor:
        """Q itself (tests)."""
        return self.right(torch.eye(self.n))
