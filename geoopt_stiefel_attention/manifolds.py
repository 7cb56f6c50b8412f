"""The Stiefel manifold with the embedded metric and the polar retraction."""

from __future__ import annotations

import warnings

import torch
from geoopt.manifolds import Euclidean, EuclideanStiefel
from geoopt.manifolds.stiefel import Stiefel

from . import _linalg
from ._docfrag import fill

__all__ = ["PolarStiefel", "is_frame", "has_manifold"]


class PolarStiefel(EuclideanStiefel):
    r"""Stiefel manifold :math:`\mathrm{St}(d, r) = \{W \in \mathbb{R}^{d\times r} : W^\top W = I_r\}`
    with the embedded (Euclidean) metric and the polar retraction.

    Everything but the retraction is inherited from :class:`geoopt.manifolds.EuclideanStiefel`:

    .. math::

        \langle U, V \rangle_W = \operatorname{tr}(U^\top V), \qquad
        P_W(G) = G - W \operatorname{sym}(W^\top G), \qquad
        \operatorname{sym}(A) = \tfrac12 (A + A^\top).

    The retraction is the polar factor of the moved point,

    .. math::

        R_W(Z) = (W + Z)\,\big((W + Z)^\top (W + Z)\big)^{-1/2},

    an ``r x r`` inverse square root (an eigendecomposition on the CPU; on accelerators Newton–Schulz with a
    residual check, :func:`~geoopt_stiefel_attention._linalg.inv_sqrt_checked`) and :math:`O(d r^2)` products: no ``d x d``
    work and no SVD of the ``d x r`` matrix (geoopt's ``EuclideanStiefel`` uses a QR factorisation, its
    default ``Stiefel()`` a ``d x d`` Cayley solve). For tangent ``Z`` the Gram matrix equals
    :math:`I + Z^\top Z` in exact arithmetic; the code forms the Gram of the actual ``W + Z`` so that each
    retraction also corrects the rounding drift of the previous one. A step that is not tangent can make
    ``W + Z`` rank-deficient (``Z = -W``), where that inverse square root does not exist: each result is checked
    at :math:`O(d r)` cost and a frame that fails is retracted by its thin SVD, :math:`U V^\top`, so ``retr``
    always returns a point of the manifold (:func:`~geoopt_stiefel_attention._linalg.polar_any_rank`). Vector
    transport is projection onto the new tangent space, :math:`\mathcal{T}_{W\to W'}(V) = P_{W'}(V)`. ``projx``
    is the exact closest frame :math:`U V^\top` from a thin SVD.

    Points are stacks of frames of shape ``(..., d, r)`` with ``r <= d``: a stack of attention heads is
    one tensor. What ``EuclideanStiefel`` would compute on silently is refused: ``r > d`` and a vector whose last
    two dimensions are not the point's (``ValueError``; leading dimensions broadcast), complex tensors
    (``TypeError``), non-finite input of ``projx``/``retr`` (``ValueError``); ``projx`` of a rank-deficient frame
    warns, since its closest frame is not unique. Every result has the point's dtype, and a vector (``u``, ``v``)
    of another dtype than the point is refused (``TypeError``) by ``proju``/``egrad2rgrad``, ``inner``,
    ``transp``, ``expmap``, ``retr`` and ``retr_transp``: cast one to the other first (``retr`` rounded such a
    vector to the point's dtype, geoopt's QR retraction promotes the result to the wider dtype, and the other
    methods stopped in a matrix product). ``float32`` and ``float64`` compute in their own dtype;
    ``bfloat16``/``float16`` points are retracted in ``float32`` and rounded back.

    Parameters
    ----------
    canonical : bool, optional
        geoopt's ``Stiefel(canonical=...)`` picks the canonical or the Euclidean metric by it; this manifold has the
        Euclidean (embedded) metric only, so ``canonical=True`` is refused (``ValueError``: use
        ``geoopt.Stiefel(canonical=True)`` for the canonical metric) and ``False`` or leaving it out are the same.

    Examples
    --------
    >>> import torch, geoopt
    >>> from geoopt_stiefel_attention import PolarStiefel
    >>> st = PolarStiefel()
    >>> w = geoopt.ManifoldParameter(st.random(4, 16, 8, dtype=torch.float64), manifold=st)
    >>> z = st.proju(w, torch.randn_like(w))
    >>> st.check_point_on_manifold(st.retr(w, 0.1 * z))
    True
    """

    name = "Stiefel(euclidean)"

    def __new__(cls, canonical: bool | None = None) -> PolarStiefel:
        # geoopt's Stiefel.__new__ picks CanonicalStiefel for canonical=True only when called as Stiefel(...); a
        # subclass got the Euclidean metric whatever was asked for
        if canonical:
            raise ValueError("PolarStiefel: canonical=True asks for the canonical metric, but PolarStiefel is a "
                             "EuclideanStiefel (the embedded metric, with the polar retraction); use "
                             "geoopt.Stiefel(canonical=True) for the canonical metric, or leave canonical out.")
        return super().__new__(cls)

    def _assert_check_shape(self, shape: tuple[int, ...], name: str) -> None:
        ok, reason = self._check_shape(shape, name)
        if not ok:
            raise ValueError(_shape_message(tuple(shape), reason))

    def assert_check_point(self, x: torch.Tensor) -> None:
        r"""Refuse a tensor that cannot hold points of :math:`\mathrm{St}(d, r)`: complex, or not ``(..., d, r)``
        with :math:`r \le d`.

        Parameters
        ----------
        x : torch.Tensor
            Candidate point, of shape ``(..., d, r)``.

        Raises
        ------
        TypeError
            For a complex ``x``.
        ValueError
            For a shape that cannot hold frames (:math:`r > d`, fewer than two dimensions).
        """
        _check_real(x, "a point")
        self._assert_check_shape(tuple(x.shape), "x")

    def _check_args(self, method: str, x: torch.Tensor, *, point: str = "x", **vectors: torch.Tensor | None) -> None:
        r"""Refuse what geoopt's ``EuclideanStiefel`` computes on silently or fails on without naming the cause: a
        point that is not a stack of real ``d x r`` frames with :math:`r \le d`, a vector whose last two dimensions
        are not the point's (torch would broadcast an ``(d, 1)`` or ``(r,)`` tensor against ``x``, returning a
        full-shape result of the wrong vector), and a vector whose dtype is not the point's (``retr`` rounded it to
        the point's dtype, geoopt's QR retraction promotes the result away from it, and the other methods stopped
        in a matrix product with torch's "expected scalar type"). ``point`` is the point's name in the method's
        signature (``y`` for :meth:`transp`)."""
        _check_real(x, f"PolarStiefel.{method}: the point {point}")
        self._assert_check_shape(tuple(x.shape), point)
        for name, v in vectors.items():
            if v is None:
                continue
            _check_real(v, f"PolarStiefel.{method}: {name}")
            if v.dim() < 2 or tuple(v.shape[-2:]) != tuple(x.shape[-2:]):
                raise ValueError(
                    f"PolarStiefel.{method}: {name} has shape {tuple(v.shape)} but the point {point} has shape "
                    f"{tuple(x.shape)}; a tangent vector at {point} is a (..., {x.shape[-2]}, {x.shape[-1]}) tensor "
                    f"(its last two dimensions are not broadcast), so pass one of {point}'s frame shape.")
            if v.dtype != x.dtype:
                raise TypeError(
                    f"PolarStiefel.{method}: {name} is {v.dtype} but the point {point} is {x.dtype}; a tangent "
                    f"vector at {point} has {point}'s dtype (mixed, the result would be rounded to one of the two "
                    f"without a word), so cast one to the other first, e.g. {name}.to({point}.dtype).")

    @fill
    def proju(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""Projection onto the tangent space at ``x``: :math:`P_X(U) = U - X \operatorname{sym}(X^\top U)`,
        :math:`\operatorname{sym}(A) = \tfrac12 (A + A^\top)` (geoopt's ``EuclideanStiefel.proju``).

        Raises ``ValueError`` when ``u``'s last two dimensions differ from ``x``'s, or ``x`` has :math:`r > d`,
        and ``TypeError`` for a complex tensor or a ``u`` whose dtype is not
        ``x``'s.

        Parameters
        ----------
        {{point_x}}
        u : torch.Tensor
            Ambient vector :math:`U`, of ``x``'s dtype; its last two dimensions are ``x``'s (leading ones broadcast).

        Returns
        -------
        torch.Tensor
            The tangent vector :math:`P_X(U)`.
        """
        self._check_args("proju", x, u=u)
        return super().proju(x, u)

    # geoopt binds egrad2rgrad to EuclideanStiefel.proju in its class body; bind it to the checked one
    egrad2rgrad = proju

    def transp(self, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        r"""Vector transport by projection onto the new tangent space, :math:`\mathcal{T}_{X\to Y}(V) = P_Y(V)`.

        Parameters
        ----------
        x : torch.Tensor
            Point :math:`X`, a stack of frames of shape ``(..., d, r)``. Not used: the projection depends on ``y`` only.
        y : torch.Tensor
            The new point :math:`Y`.
        v : torch.Tensor
            Tangent vector :math:`V` at ``x``, of ``y``'s dtype.

        Returns
        -------
        torch.Tensor
            :math:`P_Y(V)`, tangent at ``y``.
        """
        self._check_args("transp", y, point="y", v=v)
        return super().proju(y, v)

    @fill
    def inner(self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor | None = None, *,
              keepdim: bool = False) -> torch.Tensor:
        r"""The embedded metric :math:`\langle U, V \rangle_X = \operatorname{tr}(U^\top V)`, one value per frame.

        Parameters
        ----------
        {{point_x}}
        u : torch.Tensor
            Tangent vector :math:`U` at ``x``.
        v : torch.Tensor, optional
            Tangent vector :math:`V` at ``x``; ``None`` (the default) takes :math:`V = U`, the squared norm.
        keepdim : bool, default False
            Keep the two reduced dimensions (as size 1).

        Returns
        -------
        torch.Tensor
            :math:`\operatorname{tr}(U^\top V)`, of shape ``x.shape[:-2]`` (``(..., 1, 1)`` with ``keepdim``).
        """
        self._check_args("inner", x, u=u, v=v)
        return super().inner(x, u, v, keepdim=keepdim)

    @fill
    def expmap(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""The exponential map of the embedded metric (geoopt's ``EuclideanStiefel.expmap``, a
        :math:`2r \times 2r` matrix exponential; not the retraction, which is :meth:`retr`).

        Parameters
        ----------
        {{point_x}}
        u : torch.Tensor
            Tangent vector :math:`U` at ``x``, of ``x``'s dtype.

        Returns
        -------
        torch.Tensor
            :math:`\operatorname{Exp}_X(U)`, a point of the manifold.
        """
        self._check_args("expmap", x, u=u)
        return super().expmap(x, u)

    @fill
    def retr(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""The polar retraction :math:`R_X(U) = (X + U)\big((X + U)^\top (X + U)\big)^{-1/2}`.

        Raises ``ValueError`` for a non-finite ``x + u`` (no frame is its polar factor), a ``u`` whose last two
        dimensions differ from ``x``'s, or ``r > d``; ``TypeError`` for a complex tensor or a ``u`` whose dtype is not
        ``x``'s.

        Parameters
        ----------
        {{point_x}}
        u : torch.Tensor
            Step :math:`U` (tangent at ``x`` for the formula to be a retraction), of ``x``'s dtype.

        Returns
        -------
        torch.Tensor
            :math:`R_X(U)`, a stack of frames of ``x``'s shape and dtype.
        """
        self._check_args("retr", x, u=u)
        ct = _linalg.compute_dtype(x.dtype)
        y = x.to(ct) + u.to(ct)
        _check_finite(y, "PolarStiefel.retr: x + u")
        return _polar_factor(y, _linalg.polar_any_rank).to(x.dtype)

    @fill
    def retr_transp(self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r""":meth:`retr` and :meth:`transp` at once: :math:`(Y, P_Y(V))` with :math:`Y = R_X(U)`.

        Parameters
        ----------
        {{point_x}}
        u : torch.Tensor
            Step :math:`U`, as for :meth:`retr`.
        v : torch.Tensor
            Tangent vector :math:`V` at ``x`` to transport.

        Returns
        -------
        tuple of torch.Tensor
            :math:`(Y, P_Y(V))`.
        """
        self._check_args("retr_transp", x, u=u, v=v)
        y = self.retr(x, u)
        return y, self.transp(x, y, v)

    def projx(self, x: torch.Tensor) -> torch.Tensor:
        r"""The closest frame in Frobenius norm, :math:`U V^\top` from the thin SVD :math:`X = U \Sigma V^\top`.

        The closest frame is unique exactly when :math:`X` has full column rank. A rank-deficient frame
        (:math:`\sigma_r \le \max(d, r)\,\varepsilon\,\sigma_1`, the rank tolerance of
        :func:`torch.linalg.matrix_rank`; an all-zero matrix among them) has a continuum of closest frames, of
        which the SVD returns one that depends on rounding: a ``UserWarning`` names such frames.

        Raises ``ValueError`` for a non-finite ``x`` (its SVD fails or returns an arbitrary frame) or
        :math:`r > d`, ``TypeError`` for a complex ``x``.

        Parameters
        ----------
        x : torch.Tensor
            Matrices :math:`X` of shape ``(..., d, r)``, :math:`r \le d`.

        Returns
        -------
        torch.Tensor
            :math:`U V^\top`, of ``x``'s shape and dtype.
        """
        self._check_args("projx", x)
        ct = _linalg.compute_dtype(x.dtype)
        y = x.to(ct)
        _check_finite(y, "PolarStiefel.projx: x")
        return _polar_factor(y, _polar_svd_warn_rank).to(x.dtype)

    def random(self, *size, dtype=None, device=None, generator: torch.Generator | None = None) -> torch.Tensor:
        r"""A random frame: the polar factor of a Gaussian matrix, i.e. Haar-distributed on :math:`\mathrm{St}(d, r)`.

        Parameters
        ----------
        *size : int
            ``(..., d, r)`` with ``r <= d``.
        dtype, device
            As for :func:`torch.randn`.
        generator : torch.Generator, optional
            Source of randomness, for reproducible draws.

        Returns
        -------
        geoopt.ManifoldTensor
            Frames of shape ``size`` on this manifold.
        """
        import geoopt
        from geoopt.utils import size2shape

        shape = size2shape(*size)
        self._assert_check_shape(shape, "x")
        gauss = torch.randn(shape, dtype=dtype, device=device, generator=generator)
        return geoopt.ManifoldTensor(self.projx(gauss), manifold=self)

    random_naive = random

    def extra_repr(self) -> str:
        """The retraction's name in the manifold's ``repr``.

        Returns
        -------
        str
            ``"polar"``.
        """
        return "polar"

    # Equal by type, hashed by identity. Equal: the manifold has no state, so two instances are the same manifold,
    # and geoopt compares manifolds with ``!=`` when a tensor of one is wrapped with another
    # (``ManifoldParameter(PolarStiefel().random(...), manifold=PolarStiefel())``, which users and the tests
    # write). Hashed by identity: a Manifold is an nn.Module, and module traversal (children(), modules(),
    # named_modules()) skips a module already in its memo set, which compares hashes first, so instances with one
    # hash would be listed once however many a module holds. The price is that a set or dict keyed by
    # PolarStiefel instances keeps equal instances apart (tests/test_manifolds.py checks both sides).
    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    __hash__ = torch.nn.Module.__hash__  # identity (object's), as for every module


class _PolarFactorFunction(torch.autograd.Function):
    r"""The polar factor :math:`Q = Y (Y^\top Y)^{-1/2}` with its analytic derivative.

    Autograd through an eigendecomposition or SVD divides by differences of eigenvalues, which vanish exactly
    where the retraction is used most (a zero step: :math:`Y^\top Y = I`) and where ``projx`` meets a point
    already on the manifold (every singular value 1), so it returns non-finite gradients there although the
    polar factor is smooth at every full-rank :math:`Y`. With :math:`H = Q^\top Y = (Y^\top Y)^{1/2}`, differentiating
    :math:`Y = Q H` gives :math:`dQ = Q\Omega + (I - QQ^\top)\, dY H^{-1}` with :math:`\Omega` skew solving the
    Sylvester equation :math:`H\Omega + \Omega H = Q^\top dY - dY^\top Q`; its adjoint is

    .. math:: \bar Y = Q\,\mathcal L^{-1}(Q^\top \bar Q - \bar Q^\top Q) + (I - QQ^\top)\,\bar Q H^{-1},
              \qquad \mathcal L(X) = HX + XH,

    solved in the eigenbasis :math:`H = V \operatorname{diag}(\sigma) V^\top` as
    :math:`\mathcal L^{-1}(X) = V\big[(V^\top X V)_{ij} / (\sigma_i + \sigma_j)\big]V^\top`: only sums
    :math:`\sigma_i + \sigma_j > 0` are divided by, so the gradient is finite wherever :math:`Y` has full rank.
    """

    @staticmethod
    def forward(ctx, y: torch.Tensor, polar_fn) -> torch.Tensor:  # noqa: ANN001 - torch's signature
        q = polar_fn(y)
        ctx.save_for_backward(y, q)
        return q

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor):  # noqa: ANN205 - torch's signature
        y, q = ctx.saved_tensors
        qt = q.transpose(-1, -2)
        h = _linalg.sym(qt @ y)
        sigma, v = torch.linalg.eigh(h)
        vt = v.transpose(-1, -2)
        skew = qt @ grad_q
        skew = skew - skew.transpose(-1, -2)
        k = v @ ((vt @ skew @ v) / (sigma.unsqueeze(-1) + sigma.unsqueeze(-2))) @ vt
        h_inv = (v / sigma.unsqueeze(-2)) @ vt
        normal = grad_q - q @ (qt @ grad_q)
        return q @ k + normal @ h_inv, None


def _polar_factor(y: torch.Tensor, polar_fn) -> torch.Tensor:  # noqa: ANN001
    """``polar_fn(y)`` (the polar factor), through :class:`_PolarFactorFunction` when a gradient is wanted."""
    if torch.is_grad_enabled() and y.requires_grad:
        return _PolarFactorFunction.apply(y, polar_fn)
    return polar_fn(y)


def _check_real(t: torch.Tensor, what: str) -> None:
    r"""Refuse a complex tensor: the manifold is the real one, :math:`W^\top W = I` (not :math:`W^H W = I`)."""
    if t.is_complex():
        raise TypeError(f"{what} is complex ({t.dtype}); PolarStiefel is the real Stiefel manifold W^T W = I, "
                        f"whose checks and retraction use W^T, not W^H, so pass a real floating-point tensor.")


def _check_finite(t: torch.Tensor, what: str) -> None:
    """Refuse a non-finite input of the polar factor (one host read; skipped where the host cannot read)."""
    if t.numel() == 0 or t.device.type == "meta" or _linalg.traced(t):
        return
    finite = torch.isfinite(t).reshape(-1, t.shape[-2] * t.shape[-1]).all(dim=-1)
    if not bool(finite.all()):
        bad = (~finite).nonzero().flatten().tolist()
        raise ValueError(f"{what} has non-finite entries (inf or NaN) in frame(s) {bad[:8]} of the flattened stack "
                         f"of shape {tuple(t.shape)}; no frame is their polar factor (an SVD fails or returns an "
                         f"arbitrary frame), so find where the non-finite values came from before projecting.")


def _polar_svd_warn_rank(x: torch.Tensor) -> torch.Tensor:
    r""":func:`~geoopt_stiefel_attention._linalg.polar_svd`, :math:`U V^\top`, warning when a frame of ``x`` is
    rank-deficient, :math:`\sigma_r \le \max(d, r)\,\varepsilon\,\sigma_1`, where :math:`U V^\top` is one of
    many closest frames (its columns in the null directions are arbitrary)."""
    u, sigma, vh = torch.linalg.svd(x, full_matrices=False)
    if sigma.numel() and x.device.type != "meta" and not _linalg.traced(sigma):
        d, r = x.shape[-2], x.shape[-1]
        tol = max(d, r) * torch.finfo(sigma.dtype).eps * sigma[..., 0]
        deficient = (sigma[..., -1] <= tol).reshape(-1)
        if bool(deficient.any()):
            bad = deficient.nonzero().flatten().tolist()
            warnings.warn(f"PolarStiefel.projx: frame(s) {bad[:8]} of the flattened stack of shape "
                          f"{tuple(x.shape)} have rank < r={r} (smallest singular value <= max(d, r) * eps * "
                          f"largest), so their closest frame is not unique and the one returned is arbitrary "
                          f"(set by rounding); give them full column rank (e.g. a random init rather than "
                          f"zeros) before projecting.", UserWarning, stacklevel=4)
    return u @ vh


def _shape_message(shape: tuple[int, ...], reason: str | None) -> str:
    """The error for a tensor that cannot hold Stiefel frames, naming the fix."""
    if len(shape) >= 2 and shape[-1] > shape[-2]:
        d, r = shape[-2], shape[-1]
        return (f"PolarStiefel: a tensor of shape {shape} is not a stack of d x r frames with r <= d: it has "
                f"r={r} columns but only d={d} rows, and at most d columns can be orthonormal. Store frames as "
                f"(..., d, r), e.g. transpose an (r, d) matrix with .mT, or use at most {d} columns.")
    return (f"PolarStiefel: a tensor of shape {shape} cannot hold Stiefel frames ({reason}); pass a tensor of "
            f"shape (..., d, r) with r <= d.")


@fill
def has_manifold(p: torch.Tensor) -> bool:
    """Whether ``p`` is a geoopt tensor on a non-Euclidean manifold (whose points a Euclidean update, or a
    sharding that splits the tensor, would move off the manifold).

    {{parameters_p}}

    Returns
    -------
    bool
        ``True`` when ``p.manifold`` exists and is not geoopt's ``Euclidean``.
    """
    manifold = getattr(p, "manifold", None)
    return manifold is not None and not isinstance(manifold, Euclidean)


@fill
def is_frame(p: torch.Tensor) -> bool:
    """Whether ``p`` is a stack of Stiefel frames: a geoopt tensor on any Stiefel manifold.

    This is the package's one definition of "frame", used by :class:`~geoopt_stiefel_attention.StiefelAdam`,
    :func:`~geoopt_stiefel_attention.param_groups`, :func:`~geoopt_stiefel_attention.frame_parameters` and
    :mod:`~geoopt_stiefel_attention.distributed`. It includes geoopt's canonical-metric ``Stiefel()``, which
    ``StiefelAdam`` refuses with a message saying how to move it to :class:`PolarStiefel`.

    {{parameters_p}}

    Returns
    -------
    bool
        ``True`` when ``p.manifold`` is a geoopt ``Stiefel`` manifold.
    """
    return isinstance(getattr(p, "manifold", None), Stiefel)
