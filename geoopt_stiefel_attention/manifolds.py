"""The Stiefel manifold with the embedded metric and the polar retraction."""

from __future__ import annotations

import torch
from geoopt.manifolds import Euclidean, EuclideanStiefel
from geoopt.manifolds.stiefel import Stiefel

from . import _linalg

__all__ = ["PolarStiefel", "is_frame", "has_manifold", "frame_dtypes", "reproject_after_cast_"]


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
    one tensor. ``float32`` and ``float64`` compute in their own dtype; ``bfloat16``/``float16`` points are
    retracted in ``float32`` and rounded back.

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

    def _assert_check_shape(self, shape: tuple[int, ...], name: str) -> None:
        ok, reason = self._check_shape(shape, name)
        if not ok:
            raise ValueError(_shape_message(tuple(shape), reason))

    def assert_check_point(self, x: torch.Tensor) -> None:
        self._assert_check_shape(tuple(x.shape), "x")

    def retr(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        ct = _linalg.compute_dtype(x.dtype)
        y = x.to(ct) + u.to(ct)
        return _polar_factor(y, _linalg.polar_any_rank).to(x.dtype)

    def retr_transp(self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.retr(x, u)
        return y, self.transp(x, y, v)

    def projx(self, x: torch.Tensor) -> torch.Tensor:
        ct = _linalg.compute_dtype(x.dtype)
        return _polar_factor(x.to(ct), _linalg.polar_svd).to(x.dtype)

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
        """
        import geoopt
        from geoopt.utils import size2shape

        shape = size2shape(*size)
        self._assert_check_shape(shape, "x")
        gauss = torch.randn(shape, dtype=dtype, device=device, generator=generator)
        return geoopt.ManifoldTensor(self.projx(gauss), manifold=self)

    random_naive = random

    def extra_repr(self) -> str:
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


def _shape_message(shape: tuple[int, ...], reason: str | None) -> str:
    """The error for a tensor that cannot hold Stiefel frames, naming the fix."""
    if len(shape) >= 2 and shape[-1] > shape[-2]:
        d, r = shape[-2], shape[-1]
        return (f"PolarStiefel: a tensor of shape {shape} is not a stack of d x r frames with r <= d: it has "
                f"r={r} columns but only d={d} rows, and at most d columns can be orthonormal. Store frames as "
                f"(..., d, r), e.g. transpose an (r, d) matrix with .mT, or use at most {d} columns.")
    return (f"PolarStiefel: a tensor of shape {shape} cannot hold Stiefel frames ({reason}); pass a tensor of "
            f"shape (..., d, r) with r <= d.")


def has_manifold(p: torch.Tensor) -> bool:
    """Whether ``p`` is a geoopt tensor on a non-Euclidean manifold (whose points a Euclidean update, or a
    sharding that splits the tensor, would move off the manifold)."""
    manifold = getattr(p, "manifold", None)
    return manifold is not None and not isinstance(manifold, Euclidean)


def is_frame(p: torch.Tensor) -> bool:
    """Whether ``p`` is a stack of Stiefel frames: a geoopt tensor on any Stiefel manifold.

    This is the package's one definition of "frame", used by :class:`~geoopt_stiefel_attention.StiefelAdam`,
    :func:`~geoopt_stiefel_attention.param_groups`, :func:`~geoopt_stiefel_attention.frame_parameters` and
    :mod:`~geoopt_stiefel_attention.distributed`. It includes geoopt's canonical-metric ``Stiefel()``, which
    ``StiefelAdam`` refuses with a message saying how to move it to :class:`PolarStiefel`.
    """
    return isinstance(getattr(p, "manifold", None), Stiefel)


def frame_dtypes(module: torch.nn.Module) -> dict[str, torch.dtype]:
    """The dtype of every frame that ``module`` holds itself (not its children's), by parameter name: what
    :func:`reproject_after_cast_` compares with after a cast."""
    return {name: p.dtype for name, p in module._parameters.items() if p is not None and is_frame(p)}


def reproject_after_cast_(module: torch.nn.Module, before: dict[str, torch.dtype]) -> tuple[str, ...]:
    r"""Re-project, in place, the frames of ``module`` that a cast moved to a more precise dtype.

    Called by the ``_apply`` of the modules that own frames (the parametrization of
    :func:`~geoopt_stiefel_attention.stiefelize` and :class:`~geoopt_stiefel_attention.StiefelMultiheadAttention`)
    after ``.double()``, ``.float()``, ``.to(dtype)``: ``before`` is :func:`frame_dtypes` taken before the cast.

    A frame made in dtype :math:`a` is orthonormal to :math:`a`'s rounding only (:math:`\max|W^\top W - I|`
    about :math:`10^{-6}` in float32). A cast to a dtype :math:`b` with a smaller machine epsilon,
    :math:`\varepsilon_b < \varepsilon_a` (float32 to float64, float16 or bfloat16 to float32), keeps the
    values, so the frame is then off the manifold by far more than :math:`b`'s rounding, and StiefelAdam
    refuses it at its first step. Each such frame is replaced by its polar factor, computed in float64 and
    rounded to :math:`b`,

    .. math::

        W \leftarrow U V^\top, \qquad W = U \Sigma V^\top \ \text{(thin SVD)}, \qquad
        \|W - U V^\top\|_F = \|\Sigma - I\|_F \le \|\Sigma^2 - I\|_F = \|W^\top W - I\|_F,

    the closest frame in Frobenius norm, which moves :math:`W` by no more than its rounding offset. The
    parameter object is kept (optimizers hold references to it); only its values change.

    Left as they are:

    - frames cast to a coarser or equal dtype (``.half()``, ``.bfloat16()`` of a float32 frame, device moves):
      rounding an orthonormal frame to :math:`b` is already orthonormal to :math:`b`'s rounding, the best
      :math:`b` can hold, and StiefelAdam's tolerance for :math:`b` accepts it;
    - frames that were off the manifold before the cast, by more than StiefelAdam's first-step tolerance
      ``ORTHONORMALITY_TOLERANCE`` for their old dtype (changed by hand, or trained by a Euclidean
      optimizer): that is not rounding, and StiefelAdam's first step reports it, naming ``proj_()``;
    - sharded (``DTensor``), meta and empty frames.

    Parameters
    ----------
    module : nn.Module
        Owner of the frames (its own parameters only; children are re-projected by their own ``_apply``).
    before : dict of str to torch.dtype
        :func:`frame_dtypes` of ``module`` before the cast.

    Returns
    -------
    tuple of str
        Names of the frames re-projected.
    """
    done = []
    for name, old in before.items():
        p = module._parameters.get(name)
        if p is None or not is_frame(p) or not p.is_floating_point() or p.dtype == old:
            continue
        tol = _linalg.ORTHONORMALITY_TOLERANCE.get(old)
        if tol is None or not torch.finfo(p.dtype).eps < torch.finfo(old).eps:
            continue
        if type(p.data) is not torch.Tensor or p.device.type == "meta" or p.numel() == 0:
            continue
        # float64 where the device has it (not on MPS); the work is one small SVD per frame, once per cast
        device = p.device if p.device.type in ("cpu", "cuda") else torch.device("cpu")
        with torch.no_grad():
            w64 = p.detach().to(device=device, dtype=torch.float64)
            if not float(_linalg.orthonormality_error(w64)) <= tol:
                continue
            p.copy_(_linalg.polar_svd(w64).to(device=p.device, dtype=p.dtype))
        done.append(name)
    return tuple(done)
