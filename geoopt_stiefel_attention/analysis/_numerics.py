"""Independent reference formulas and shared machinery of the certificates (float64 throughout).

Nothing here calls the library's optimizer or manifold code: the references are written out from the
definitions, so that a certificate compares the code under test with something else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .optimizers import OptimizerColumn

__all__ = [
    "DTYPE",
    "random_frames",
    "random_orthogonal",
    "sym",
    "skew",
    "embedded_projection",
    "inv_sqrt_spd",
    "polar_step",
    "polar_factor",
    "recover_polar_step",
    "step_condition",
    "orthonormality_error",
    "tangent_basis",
    "QuadraticLoss",
    "run_trajectory",
]

DTYPE = torch.float64


def random_frames(*shape: int, generator: torch.Generator, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    """Haar-random frames: the polar factor :math:`UV^\\top` of a Gaussian ``(..., d, r)`` matrix (SVD)."""
    return polar_factor(torch.randn(*shape, dtype=torch.float64, generator=generator)).to(dtype)


def random_orthogonal(n: int, *, generator: torch.Generator) -> torch.Tensor:
    """A Haar-random ``n x n`` orthogonal matrix (float64)."""
    return random_frames(n, n, generator=generator)


def sym(a: torch.Tensor) -> torch.Tensor:
    """:math:`(A + A^\\top)/2`."""
    return 0.5 * (a + a.transpose(-1, -2))


def skew(a: torch.Tensor) -> torch.Tensor:
    """:math:`(A - A^\\top)/2`."""
    return 0.5 * (a - a.transpose(-1, -2))


def embedded_projection(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Riemannian gradient in the embedded metric, :math:`\\xi = G - W\\,\\mathrm{sym}(W^\\top G)`."""
    return g - w @ sym(w.transpose(-1, -2) @ g)


def inv_sqrt_spd(a: torch.Tensor) -> torch.Tensor:
    """:math:`A^{-1/2}` of symmetric positive definite ``a`` by its eigendecomposition."""
    evals, evecs = torch.linalg.eigh(sym(a))
    return (evecs * evals.rsqrt().unsqueeze(-2)) @ evecs.transpose(-1, -2)


def polar_step(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The written-out polar retraction of a tangent step, :math:`(W - s)(I + s^\\top s)^{-1/2}`."""
    eye = torch.eye(s.shape[-1], dtype=s.dtype, device=s.device)
    return (w - s) @ inv_sqrt_spd(eye + s.transpose(-1, -2) @ s)


def polar_factor(y: torch.Tensor) -> torch.Tensor:
    """Orthonormal polar factor :math:`UV^\\top` of ``y = U\\Sigma V^\\top`` (thin SVD)."""
    u, _, vh = torch.linalg.svd(y, full_matrices=False)
    return u @ vh


def orthonormality_error(w: torch.Tensor) -> float:
    """:math:`\\max |W^\\top W - I|` over a stack, computed in float64."""
    w = w.detach().to(torch.float64)
    eye = torch.eye(w.shape[-1], dtype=torch.float64)
    return float((w.transpose(-1, -2) @ w - eye).abs().amax())


def recover_polar_step(w: torch.Tensor, w_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The tangent step :math:`s` at ``w`` whose polar retraction is ``w_new``, and :math:`P = (I + s^\top s)^{1/2}`.

    If :math:`W' = (W - s)P^{-1}` with :math:`P` symmetric and :math:`s` tangent (:math:`W^\top s` skew),
    then :math:`W - s = W'P` and :math:`\operatorname{sym}(W^\top W' P) = I`, i.e. with
    :math:`A = W^\top W'` the Lyapunov-type equation

    .. math:: A P + P A^\top = 2 I

    determines :math:`P`; then :math:`s = W - W'P` and :math:`P^2 = (W-s)^\top(W-s) = I + s^\top s`.
    The equation is solved in Kronecker form (an :math:`r^2 \times r^2` system per frame). For an
    optimizer that retracts differently (QR, Cayley) this is the *polar-equivalent* step: the one
    tangent step that the polar retraction would need to reach the same ``w_new``.

    Returns ``(s, p)`` in float64; ``p`` is not positive definite when no such step exists.
    """
    w = w.detach().to(torch.float64)
    w_new = w_new.detach().to(torch.float64)
    r = w.shape[-1]
    a = w.transpose(-1, -2) @ w_new
    eye = torch.eye(r, dtype=torch.float64)
    # row-major vec: vec(A X B) = (A kron B^T) vec(X)  =>  vec(A P + P A^T) = (A kron I + I kron A) vec(P)
    op = _batched_kron(a, eye.expand_as(a)) + _batched_kron(eye.expand_as(a), a)
    rhs = (2.0 * eye).reshape(-1).expand(*a.shape[:-2], r * r)
    p = torch.linalg.solve(op, rhs.unsqueeze(-1)).squeeze(-1).reshape(a.shape)
    p = sym(p)
    s = w - w_new @ p
    return s, p


def _batched_kron(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Kronecker product of two stacks of square matrices."""
    n, m = a.shape[-1], b.shape[-1]
    out = a[..., :, None, :, None] * b[..., None, :, None, :]
    return out.reshape(*a.shape[:-2], n * m, n * m)


def step_condition(p: torch.Tensor) -> torch.Tensor:
    r"""Condition number of :math:`P^2 = I + s^\top s` per frame; ``inf`` where ``p`` is not positive definite."""
    evals = torch.linalg.eigvalsh(p)
    lo, hi = evals[..., 0], evals[..., -1]
    cond = (hi / lo) ** 2
    return torch.where(lo > 0, cond, torch.full_like(cond, float("inf")))


def tangent_basis(w: torch.Tensor) -> torch.Tensor:
    r"""An orthonormal basis of :math:`T_W\mathrm{St}(d,r) = \{\eta : W^\top\eta + \eta^\top W = 0\}` for one frame.

    Computed from the definition, as the null space (by SVD) of the linear map
    :math:`\eta \mapsto W^\top\eta + \eta^\top W` written as a matrix; no projection formula is used.
    Returns a ``(dr - r(r+1)/2, d, r)`` tensor.
    """
    d, r = w.shape
    n = d * r
    basis = torch.eye(n, dtype=torch.float64).reshape(n, d, r)
    images = w.transpose(-1, -2) @ basis
    images = (images + images.transpose(-1, -2)).reshape(n, r * r)  # column j: image of the j-th unit matrix
    _, sv, vh = torch.linalg.svd(images.T, full_matrices=True)
    rank = int((sv > sv[0] * 1e-12).sum())
    return vh[rank:].reshape(-1, d, r)


@dataclass(frozen=True)
class QuadraticLoss:
    r"""The test loss :math:`f(W) = \sum_h \tfrac12 \|A_h W_h - B_h\|_F^2` on a stack of frames.

    Its Euclidean gradient is :math:`A_h^\top (A_h W_h - B_h)`. It has no symmetry of its own, so the
    equivariance certificates transform it: :meth:`transformed` returns the loss
    :math:`\tilde f(W) = f(Q^\top W R^\top)`, whose gradient at :math:`Q W R` is :math:`Q\,\nabla f(W)\,R`.
    """

    a: torch.Tensor  # (H, m, d)
    b: torch.Tensor  # (H, m, r)

    @classmethod
    def random(cls, heads: int, d: int, r: int, *, generator: torch.Generator, m: int | None = None) -> QuadraticLoss:
        m = m or d
        a = torch.randn(heads, m, d, dtype=torch.float64, generator=generator) / m**0.5
        b = torch.randn(heads, m, r, dtype=torch.float64, generator=generator)
        return cls(a, b)

    def grad(self, w: torch.Tensor) -> torch.Tensor:
        w64 = w.to(torch.float64)
        return (self.a.transpose(-1, -2) @ (self.a @ w64 - self.b)).to(w.dtype)

    def value(self, w: torch.Tensor) -> float:
        return float(0.5 * (self.a @ w.to(torch.float64) - self.b).square().sum())

    def transformed(self, q: torch.Tensor | None = None, r: torch.Tensor | None = None) -> QuadraticLoss:
        a = self.a if q is None else self.a @ q.transpose(-1, -2)
        b = self.b if r is None else self.b @ r
        return QuadraticLoss(a, b)


GradFn = Callable[[torch.Tensor, int], torch.Tensor]


def run_trajectory(column: OptimizerColumn, w0: torch.Tensor, grad_fn: GradFn, steps: int, *,
                   lr: float, eps: float = 1e-8, weight_decay: float = 0.0, trust_region: float | None = 0.1,
                   betas: tuple[float, float] = (0.9, 0.999),
                   after_step: Callable[[torch.Tensor, int], None] | None = None) -> torch.Tensor:
    """Run ``column``'s optimizer from ``w0`` for ``steps`` steps and return the iterates ``(steps + 1, *w0.shape)``.

    ``grad_fn(w, t)`` gives the Euclidean gradient at the current iterate (``t = 1, 2, ...``); it is set as
    ``p.grad`` (a fresh tensor each step, since some optimizers change the gradient in place).
    ``after_step(p, t)``, if given, may modify the parameter in place (under ``torch.no_grad``).
    """
    p = column.make_parameter(w0)
    opt = column.make_optimizer([p], lr=lr, eps=eps, weight_decay=weight_decay, trust_region=trust_region,
                                betas=betas)
    out = [w0.detach().clone()]
    for t in range(1, steps + 1):
        p.grad = grad_fn(p.detach(), t).detach().clone().to(p.dtype)
        opt.step()
        if after_step is not None:
            with torch.no_grad():
                after_step(p, t)
        out.append(p.detach().clone())
    return torch.stack(out)
