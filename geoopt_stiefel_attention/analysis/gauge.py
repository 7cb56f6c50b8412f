r"""The gauge negative result: a symmetry direction of the loss carries no gradient.

In attention, head :math:`h` uses :math:`W_Q^h` and :math:`W_K^h` only through the logits
:math:`X W_Q^h (X W_K^h)^\top = X\,W_Q^h W_K^{h\top} X^\top`, so the loss is invariant under
:math:`(W_Q^h, W_K^h) \mapsto (W_Q^h M, W_K^h M^{-\top})` for every invertible :math:`r\times r` matrix
:math:`M` (orthogonal :math:`M` for frames, which keeps both on the Stiefel manifold). Differentiating at
:math:`M = I + tB` gives the symmetry directions :math:`(W_Q^h B, -W_K^h B^\top)`, :math:`B` arbitrary
(:math:`B` skew for frames: :math:`(W_Q^h B, W_K^h B)`, tangent). Differentiating
:math:`L(W_Q M_t, W_K M_t^{-\top}) = L(W_Q, W_K)` at :math:`t = 0` gives
:math:`\langle \nabla L, (W_Q B, -W_K B^\top)\rangle = 0`: the gradient has no component along the gauge
orbit. An optimizer therefore never moves along it (to first order), with or without the Stiefel
constraint; removing the gauge freedom cannot be what the constraint buys.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._docfrag import fill
from ._numerics import embedded_projection, random_frames
from ._result import Certificate, worst_figure
from .optimizers import OptimizerColumn

__all__ = [
    "GAUGE_GRADIENT_TOL",
    "GAUGE_MOVE_TOL",
    "multihead_attention",
    "AttentionProblem",
    "gauge_directions",
    "certify_gauge_gradient",
    "certify_gauge_moves",
    "loss_from_module",
    "certify_gauge",
]

#: Largest relative component of the gradient along the span of the gauge directions (float64).
GAUGE_GRADIENT_TOL = 1e-10
#: Largest relative change of the loss along finite gauge moves (float64).
GAUGE_MOVE_TOL = 1e-12

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def multihead_attention(x: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor,
                        w_o: torch.Tensor) -> torch.Tensor:
    r"""Plain multi-head self-attention, written out (no masking, no biases).

    .. math::

        Q_h = X W_Q^h,\quad K_h = X W_K^h,\quad V_h = X W_V^h,\quad
        O_h = \operatorname{softmax}\!\big(Q_h K_h^\top/\sqrt{r}\big) V_h,\quad
        Y = \textstyle\sum_h O_h W_O^h

    Parameters
    ----------
    x : torch.Tensor
        ``(batch, seq, D)``.
    w_q, w_k : torch.Tensor
        ``(H, D, r)``; head ``h`` computes ``x @ w_q[h]``.
    w_v : torch.Tensor
        ``(H, D, r_v)``.
    w_o : torch.Tensor
        ``(H, r_v, D)``.

    Returns
    -------
    torch.Tensor
        :math:`Y`, of shape ``(batch, seq, D)``.
    """
    r = w_q.shape[-1]
    q = torch.einsum("bnd,hdr->bhnr", x, w_q)
    k = torch.einsum("bnd,hdr->bhnr", x, w_k)
    v = torch.einsum("bnd,hdr->bhnr", x, w_v)
    att = torch.softmax(q @ k.transpose(-1, -2) / r**0.5, dim=-1)
    return torch.einsum("bhnr,hrd->bnd", att @ v, w_o)


class AttentionProblem:
    r"""A small float64 attention regression problem: random inputs, a random teacher, MSE loss.

    ``frames=True`` draws ``w_q``, ``w_k`` on St(D, r); otherwise Gaussian with entries of variance ``1/D``.

    Parameters
    ----------
    seed : int, default 0
        Seed of the inputs, the teacher and the start.
    batch, seq, embed : int, default 8, 6, 8
        Inputs of shape ``(batch, seq, embed)``; ``embed`` is :math:`D`.
    heads : int, default 2
        Heads :math:`H`.
    head_dim : int, default 4
        Head size :math:`r`.
    frames : bool, default True
        Draw ``w_q``, ``w_k`` on :math:`\mathrm{St}(D, r)` (else Gaussian).
    """

    def __init__(self, *, seed: int = 0, batch: int = 8, seq: int = 6, embed: int = 8, heads: int = 2,
                 head_dim: int = 4, frames: bool = True) -> None:
        gen = torch.Generator().manual_seed(seed)
        f64 = torch.float64

        def gauss(*shape):
            return torch.randn(*shape, dtype=f64, generator=gen) / embed**0.5

        self.x = torch.randn(batch, seq, embed, dtype=f64, generator=gen)
        teacher = [gauss(heads, embed, head_dim) * 2.0 for _ in range(2)]
        self.w_v = gauss(heads, embed, head_dim)
        self.w_o = gauss(heads, head_dim, embed)
        self.target = multihead_attention(self.x, teacher[0], teacher[1], self.w_v, self.w_o).detach()
        if frames:
            self.w_q = random_frames(heads, embed, head_dim, generator=gen)
            self.w_k = random_frames(heads, embed, head_dim, generator=gen)
        else:
            self.w_q, self.w_k = gauss(heads, embed, head_dim), gauss(heads, embed, head_dim)
        self.frames = frames

    def loss(self, w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor | None = None,
             w_o: torch.Tensor | None = None) -> torch.Tensor:
        """Mean squared error of the attention output against the teacher's.

        Parameters
        ----------
        w_q, w_k : torch.Tensor
            Query and key projections, ``(H, D, r)``.
        w_v : torch.Tensor, optional
            Value projection, ``(H, D, r)``; default the problem's own.
        w_o : torch.Tensor, optional
            Output projection, ``(H, r, D)``; default the problem's own.

        Returns
        -------
        torch.Tensor
            The scalar loss.
        """
        w_v = self.w_v if w_v is None else w_v
        w_o = self.w_o if w_o is None else w_o
        return (multihead_attention(self.x, w_q, w_k, w_v, w_o) - self.target).square().mean()


def gauge_directions(w_q: torch.Tensor, w_k: torch.Tensor, *, skew_only: bool,
                     head_dim: int | None = None, sign: float = -1.0) -> torch.Tensor:
    r"""Matrix whose rows are the gauge directions :math:`(W_Q B, \mathrm{sign}\cdot W_K B^\top)`, flattened.

    One block of directions per frame and per head block of ``head_dim`` columns (a stack ``(F, D, C)``
    with ``C = heads_per_frame * head_dim``); :math:`B` runs over the unit matrices :math:`E_{ij}` of
    that block, or over :math:`E_{ij} - E_{ji}` (``i < j``) when ``skew_only``. ``sign=-1`` gives the
    symmetry directions; ``sign=+1`` gives directions that are *not* symmetries (a control).
    """
    f, _, c = w_q.shape
    hd = head_dim or c
    if c % hd:
        raise ValueError(f"gauge_directions: head_dim={hd} does not divide the frame width {c}.")
    rows = []
    for frame in range(f):
        for start in range(0, c, hd):
            for i in range(hd):
                for j in range(hd):
                    if skew_only and i >= j:
                        continue
                    b = torch.zeros(c, c, dtype=w_q.dtype)
                    b[start + i, start + j] = 1.0
                    if skew_only:
                        b[start + j, start + i] = -1.0
                    dq = torch.zeros_like(w_q)
                    dk = torch.zeros_like(w_k)
                    dq[frame] = w_q[frame] @ b
                    dk[frame] = sign * (w_k[frame] @ b.T)
                    rows.append(torch.cat([dq.reshape(-1), dk.reshape(-1)]))
    return torch.stack(rows)


def _gradients(loss_fn: LossFn, w_q: torch.Tensor, w_k: torch.Tensor):
    wq = w_q.detach().clone().requires_grad_(True)
    wk = w_k.detach().clone().requires_grad_(True)
    loss = loss_fn(wq, wk)
    g_q, g_k = torch.autograd.grad(loss, (wq, wk))
    return float(loss.detach()), g_q, g_k


@fill
def certify_gauge_gradient(loss_fn: LossFn, w_q: torch.Tensor, w_k: torch.Tensor, *, frames: bool,
                           head_dim: int | None = None, optimizer: str | None = None) -> Certificate:
    r"""6a. The gradient has no component along the span of the gauge directions.

    The gradient :math:`(G_Q, G_K)` of ``loss_fn`` at ``(w_q, w_k)`` comes from autograd (float64). The
    span of all gauge directions (:func:`gauge_directions`; :math:`B` skew when ``frames``) is
    orthonormalised by QR, and the measured figure is :math:`\|\Pi g\| / \|g\|`, where for frames
    :math:`g` is the Riemannian gradient :math:`(\xi_Q, \xi_K)` (the gauge directions are tangent, so
    projecting :math:`G` or :math:`\xi` gives the same component) and otherwise :math:`(G_Q, G_K)`. The
    details give the same figure for the non-symmetry directions :math:`(W_Q B, +W_K B^\top)`, which
    shows the measurement is sensitive.

    Raises ``ValueError`` when :math:`g` is exactly 0, where the relative component is undefined.

    Parameters
    ----------
    {{gauge_point}}
    optimizer : str, optional
        Column name recorded in the certificate.

    Returns
    -------
    Certificate
        Row 6a.
    """
    name = "6a gauge: no gradient along symmetry"
    statement = ("the gradient's component along the span of the gauge directions (W_Q B, -W_K B^T) is zero "
                 "to rounding (relative <= 1e-10)")
    w_q = w_q.detach().to(torch.float64)
    w_k = w_k.detach().to(torch.float64)
    value, g_q, g_k = _gradients(loss_fn, w_q, w_k)
    g = torch.cat([g_q.reshape(-1), g_k.reshape(-1)])
    if frames:
        ref = torch.cat([embedded_projection(w_q, g_q).reshape(-1), embedded_projection(w_k, g_k).reshape(-1)])
    else:
        ref = g
    denom = float(ref.norm())
    if denom == 0.0:
        raise ValueError(f"certify_gauge_gradient: the {'Riemannian ' if frames else ''}gradient at (w_q, w_k) is "
                         f"exactly 0 (loss {value!r}), so the relative component ||P g|| / ||g|| this certificate "
                         f"measures is 0/0, undefined; certify at a point where the gradient is nonzero (not at an "
                         f"exact minimum, e.g. a target the model does not fit exactly).")

    def component(dirs):
        basis, _ = torch.linalg.qr(dirs.T)
        return float((basis.T @ g).norm()) / denom

    sym_dirs = gauge_directions(w_q, w_k, skew_only=frames, head_dim=head_dim)
    measured = component(sym_dirs)
    control = component(gauge_directions(w_q, w_k, skew_only=frames, head_dim=head_dim, sign=1.0))
    details = {"loss": value, "gradient_norm": denom, "n_directions": int(sym_dirs.shape[0]),
               "parametrisation": "frames (B skew)" if frames else "unconstrained (B arbitrary)",
               "control_non_symmetry_component": control}
    return Certificate.check(name, statement, measured, GAUGE_GRADIENT_TOL, optimizer=optimizer, details=details)


@fill
def certify_gauge_moves(loss_fn: LossFn, w_q: torch.Tensor, w_k: torch.Tensor, *, frames: bool,
                        head_dim: int | None = None, seed: int = 0, sizes: tuple[float, ...] = (0.1, 0.5, 1.0, 3.0),
                        optimizer: str | None = None) -> Certificate:
    r"""6b. The loss is constant along finite gauge moves :math:`(W_Q M, W_K M^{-\top})`.

    Per head block, :math:`M = \exp(tB)` with a random :math:`B` (skew for frames, so :math:`M` is
    orthogonal and the moved point stays on the manifold) and :math:`t` in ``sizes``. Measured: the largest
    :math:`|L(\text{moved}) - L|/|L|`. The details give the change for the non-symmetry move
    :math:`(W_Q M, W_K)` as a control.

    Raises ``ValueError`` when the loss at ``(w_q, w_k)`` is exactly 0, where the relative change is undefined.

    Parameters
    ----------
    {{gauge_point}}
    seed : int, default 0
        Seed of the random :math:`B`.
    sizes : tuple of float, default (0.1, 0.5, 1.0, 3.0)
        The move sizes :math:`t`.
    optimizer : str, optional
        Column name recorded in the certificate.

    Returns
    -------
    Certificate
        Row 6b.
    """
    name = "6b gauge: loss constant on orbit"
    statement = "the loss is unchanged (relative <= 1e-12) along finite gauge moves (W_Q M, W_K M^-T), M = exp(tB)"
    if not any(t != 0 for t in sizes):
        raise ValueError(f"certify_gauge_moves: sizes={tuple(sizes)} holds no move of size t != 0 (M = exp(0) = I "
                         f"leaves the point where it is), so the certificate would check nothing.")
    w_q = w_q.detach().to(torch.float64)
    w_k = w_k.detach().to(torch.float64)
    f, _, c = w_q.shape
    hd = head_dim or c
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        base = float(loss_fn(w_q, w_k))
        if base == 0.0:
            raise ValueError("certify_gauge_moves: the loss at (w_q, w_k) is exactly 0, so the relative change "
                             "|L(moved) - L| / |L| this certificate measures is undefined (rounding alone makes it "
                             "0/0 or infinite); certify at a point where the loss is nonzero (e.g. a target the "
                             "model does not fit exactly).")
        worst, control = 0.0, 0.0
        for t in sizes:
            b = torch.zeros(f, c, c, dtype=torch.float64)
            for start in range(0, c, hd):
                blk = torch.randn(f, hd, hd, dtype=torch.float64, generator=gen) / hd**0.5
                if frames:
                    blk = blk - blk.transpose(-1, -2)
                b[:, start:start + hd, start:start + hd] = blk
            m = torch.linalg.matrix_exp(t * b)
            m_inv_t = torch.linalg.inv(m).transpose(-1, -2)
            moved = float(loss_fn(w_q @ m, w_k @ m_inv_t))
            worst = worst_figure([worst, abs(moved - base) / abs(base)])
            control = worst_figure([control, abs(float(loss_fn(w_q @ m, w_k)) - base) / abs(base)])
    details = {"loss": base, "sizes": list(sizes), "control_non_symmetry_change": control,
               "parametrisation": "frames (M orthogonal)" if frames else "unconstrained (M invertible)"}
    return Certificate.check(name, statement, worst, GAUGE_MOVE_TOL, optimizer=optimizer, details=details)


def loss_from_module(module: torch.nn.Module, x: torch.Tensor, target: torch.Tensor,
                     forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None) -> LossFn:
    """A ``loss_fn(w_q, w_k)`` for an attention module with ``w_q``/``w_k`` attributes: the MSE of its
    output on ``x`` against ``target``, with ``w_q``/``w_k`` substituted by :func:`torch.func.functional_call`.

    ``forward(module, x)`` computes the output (default: ``module(x, x, x)``, taking the first element if a
    tuple comes back, as for :class:`torch.nn.MultiheadAttention`-style self-attention).

    Parameters
    ----------
    module : nn.Module
        The attention module, with ``w_q`` and ``w_k`` parameters.
    x : torch.Tensor
        Its input.
    target : torch.Tensor
        The output the MSE compares with.
    forward : callable, optional
        ``forward(module, x)``, its output; default as above.

    Returns
    -------
    callable
        ``loss_fn(w_q, w_k) -> torch.Tensor``.
    """
    from torch.func import functional_call

    def default_forward(mod, inp):
        out = mod(inp, inp, inp)
        return out[0] if isinstance(out, tuple) else out

    fwd = forward or default_forward

    class _Bound(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, inp):
            return fwd(self.inner, inp)

    bound = _Bound(module)

    def loss_fn(w_q: torch.Tensor, w_k: torch.Tensor) -> torch.Tensor:
        out = functional_call(bound, {"inner.w_q": w_q, "inner.w_k": w_k}, (x,))
        return (out - target).square().mean()

    return loss_fn


def _library_problem(frames: bool, seed: int):
    """The library's attention module (float64, 2 heads of width 4, embed 8) on a random batch and target."""
    from .. import nn as sa_nn

    gen = torch.Generator().manual_seed(seed)
    cls = sa_nn.StiefelMultiheadAttention if frames else sa_nn.EuclideanMultiheadAttention
    module = cls(8, 2, batch_first=True, head_dim=4, dtype=torch.float64, generator=gen)
    x = torch.randn(8, 6, 8, dtype=torch.float64, generator=gen)
    target = torch.randn(8, 6, 8, dtype=torch.float64, generator=gen)
    return module, loss_from_module(module, x, target)


@fill
def certify_gauge(column: OptimizerColumn, *, seed: int = 0, use_library_module: bool = True) -> list[Certificate]:
    """6a and 6b for the parametrisation of ``column``: frames for a manifold column, unconstrained matrices
    otherwise. By default on the library's attention module
    (:class:`~geoopt_stiefel_attention.nn.StiefelMultiheadAttention` or
    :class:`~geoopt_stiefel_attention.nn.EuclideanMultiheadAttention`), else on :func:`multihead_attention`.
    The result does not depend on the optimizer: it is a property of the loss.

    Parameters
    ----------
    {{column_seed}}
    use_library_module : bool, default True
        Certify the library's attention module (else :func:`multihead_attention`).

    Returns
    -------
    list of Certificate
        Rows 6a and 6b.
    """
    frames = column.on_manifold
    model = "written-out multihead_attention"
    if use_library_module:
        try:
            module, loss_fn = _library_problem(frames, seed)
            w_q, w_k = module.w_q, module.w_k
            model = type(module).__name__
        except ImportError:
            use_library_module = False
    if not use_library_module:
        prob = AttentionProblem(seed=seed, frames=frames)
        loss_fn, w_q, w_k = prob.loss, prob.w_q, prob.w_k
    out = []
    for cert in (certify_gauge_gradient(loss_fn, w_q, w_k, frames=frames, optimizer=column.name),
                 certify_gauge_moves(loss_fn, w_q, w_k, frames=frames, seed=seed, optimizer=column.name)):
        out.append(Certificate(cert.name, cert.statement, cert.measured, cert.tolerance, cert.passed,
                               {**cert.details, "model": model}, cert.optimizer, cert.comparison))
    return out
