"""The optimizer "columns" the certificates are run for.

A column bundles an optimizer with the manifold its frames live on. The certificates treat every column
as a black box: they build a parameter with :meth:`OptimizerColumn.make_parameter`, an optimizer with
:meth:`OptimizerColumn.make_optimizer`, feed gradients and look at the iterates. A deliberately broken
optimizer is just another column, which is how the tests check that each certificate can fail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["OptimizerColumn", "default_columns", "column_by_name", "stiefel_adam_column"]

OptimizerFactory = Callable[..., torch.optim.Optimizer]


@dataclass(frozen=True)
class OptimizerColumn:
    """An optimizer and the geometry of its parameter: one column of the certificate table.

    Attributes
    ----------
    name : str
        Full name (the ``optimizer`` key of the JSON report).
    label : str
        Short header for the text table.
    manifold_factory : callable or None
        Returns a fresh geoopt manifold for the frames; ``None`` for an unconstrained matrix.
    optimizer_factory : callable
        ``optimizer_factory(params, *, lr, betas, eps, weight_decay, trust_region)`` returns the optimizer.
        Options an optimizer does not have (``eps`` for SGD, ``trust_region`` for stock optimizers) are
        ignored by its factory.
    has_trust_region : bool
        Whether ``trust_region`` is honoured.
    description : str
        One line on what the column is.
    """

    name: str
    label: str
    manifold_factory: Callable[[], Any] | None
    optimizer_factory: OptimizerFactory
    has_trust_region: bool
    description: str

    @property
    def on_manifold(self) -> bool:
        """Whether the column keeps its parameter on a Stiefel manifold."""
        return self.manifold_factory is not None

    def manifold(self) -> Any:
        """A fresh instance of the column's manifold (``None`` when unconstrained).

        Returns
        -------
        geoopt.Manifold or None
            The manifold.
        """
        return None if self.manifold_factory is None else self.manifold_factory()

    def make_parameter(self, value: torch.Tensor) -> torch.nn.Parameter:
        """A trainable copy of ``value``: a ``ManifoldParameter`` on the column's manifold, or a plain one.

        Parameters
        ----------
        value : torch.Tensor
            Initial value (frames of shape ``(..., d, r)`` for a constrained column).

        Returns
        -------
        torch.nn.Parameter
            The parameter.
        """
        import geoopt

        data = value.detach().clone()
        if self.manifold_factory is None:
            return torch.nn.Parameter(data)
        return geoopt.ManifoldParameter(data, manifold=self.manifold_factory())

    def make_optimizer(self, params: Iterable[Any], *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                       eps: float = 1e-8, weight_decay: float = 0.0,
                       trust_region: float | None = 0.1) -> torch.optim.Optimizer:
        r"""Build the column's optimizer over ``params`` (tensors or parameter-group dicts).

        Parameters
        ----------
        params : iterable
            Tensors, or parameter-group dicts.
        lr : float
            Learning rate.
        betas : tuple of float, default (0.9, 0.999)
            Adam's :math:`(\beta_1, \beta_2)` (ignored by SGD).
        eps : float, default 1e-8
            Adam's :math:`\varepsilon` (ignored by SGD).
        weight_decay : float, default 0.0
            Weight decay.
        trust_region : float or None, default 0.1
            Trust radius :math:`\Delta` (ignored by optimizers without one).

        Returns
        -------
        torch.optim.Optimizer
            The optimizer.
        """
        return self.optimizer_factory(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      trust_region=trust_region)

    def rgrad(self, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """The column's Riemannian gradient map (its manifold's ``egrad2rgrad``; identity when unconstrained).

        Parameters
        ----------
        w : torch.Tensor
            Point :math:`W`.
        g : torch.Tensor
            Euclidean gradient :math:`G` at ``w``.

        Returns
        -------
        torch.Tensor
            The Riemannian gradient (:math:`P_W(G)` on the embedded-metric Stiefel manifold), or ``g``.
        """
        m = self.manifold()
        return g if m is None else m.egrad2rgrad(w, g)

    def retr(self, w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The column's retraction (its manifold's ``retr``; ``w + u`` when unconstrained).

        Parameters
        ----------
        w : torch.Tensor
            Point :math:`W`.
        u : torch.Tensor
            Step :math:`U`, tangent at ``w``.

        Returns
        -------
        torch.Tensor
            :math:`R_W(U)`, or :math:`W + U`.
        """
        m = self.manifold()
        return w + u if m is None else m.retr(w, u)


# ---------------------------------------------------------------------------------------------- factories
def _stiefel_adam(second_moment: str | None) -> OptimizerFactory:
    def make(params, *, lr, betas, eps, weight_decay, trust_region):
        from ..optim import StiefelAdam

        # StiefelAdam validates eps > 0; the update is well defined with eps = 0 whenever xi != 0, which the
        # scale certificate needs, so eps = 0 is set on the groups after construction.
        # lr is a frame's step norm here (adjust_lr_fn="original"), as for the other columns, and trust_region
        # caps ||s||_F in the frame's own units under either rule (issue 40); the default rule "match_rms_adamw"
        # is this same update at sqrt(d r) lr with the same radius, so every certificate, which holds at every
        # lr and radius, covers it too.
        opt = StiefelAdam(params, lr=lr, betas=betas, eps=eps if eps > 0 else 1e-8, weight_decay=weight_decay,
                          trust_region=trust_region, second_moment=second_moment, adjust_lr_fn="original")
        if eps == 0:
            for group in opt.param_groups:
                group["eps"] = 0.0
        return opt

    return make


def _riemannian_adam(params, *, lr, betas, eps, weight_decay, trust_region):
    import geoopt

    return geoopt.optim.RiemannianAdam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def _riemannian_sgd(params, *, lr, betas, eps, weight_decay, trust_region):
    import geoopt

    return geoopt.optim.RiemannianSGD(params, lr=lr, weight_decay=weight_decay)


def _adamw(params, *, lr, betas, eps, weight_decay, trust_region):
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def _polar_stiefel():
    from ..manifolds import PolarStiefel

    return PolarStiefel()


def _euclidean_stiefel():
    import geoopt

    return geoopt.EuclideanStiefel()


def _canonical_stiefel():
    import geoopt

    return geoopt.Stiefel()


def stiefel_adam_column(second_moment: str | None = "frame", *, name: str | None = None,
                        label: str | None = None) -> OptimizerColumn:
    """A column for :class:`~geoopt_stiefel_attention.StiefelAdam` with the given ``second_moment`` option.

    Parameters
    ----------
    second_moment : str or None, default "frame"
        StiefelAdam's ``second_moment`` option (:data:`~geoopt_stiefel_attention.optim.SECOND_MOMENTS`).
    name : str, optional
        Full name; default ``"StiefelAdam"`` for ``"frame"``, else one naming the option.
    label : str, optional
        Short header; default ``"StiefelAdam"`` for ``"frame"``, else ``"SA <second_moment>"``.

    Returns
    -------
    OptimizerColumn
        The column.
    """
    default_name = "StiefelAdam" if second_moment == "frame" else f"StiefelAdam(second_moment={second_moment!r})"
    default_label = "StiefelAdam" if second_moment == "frame" else f"SA {second_moment}"
    return OptimizerColumn(
        name=name or default_name,
        label=label or default_label,
        manifold_factory=_polar_stiefel,
        optimizer_factory=_stiefel_adam(second_moment),
        has_trust_region=True,
        description=f"StiefelAdam, second_moment={second_moment!r}, on PolarStiefel (polar retraction)",
    )


def default_columns() -> tuple[OptimizerColumn, ...]:
    """The columns of the certificate table, in order.

    ``StiefelAdam`` (the method); geoopt ``RiemannianAdam`` on ``EuclideanStiefel`` (embedded metric, QR
    retraction) and on ``geoopt.Stiefel()`` (canonical metric, Cayley retraction); geoopt ``RiemannianSGD``
    (no momentum) on ``EuclideanStiefel``; ``torch.optim.AdamW`` on an unconstrained matrix; and the
    element-wise and per-column second-moment variants of ``StiefelAdam``. The geoopt columns carry the
    baseline names used by ``stiefel-attention bench`` and the studies' arms: ``geoopt-radam``,
    ``geoopt-radam-canonical`` and ``geoopt-rsgd``.

    Returns
    -------
    tuple of OptimizerColumn
        The columns.
    """
    return (
        stiefel_adam_column("frame"),
        OptimizerColumn("geoopt-radam", "geoopt-radam", _euclidean_stiefel,
                        _riemannian_adam, False,
                        "geoopt RiemannianAdam on EuclideanStiefel: embedded metric, QR retraction"),
        OptimizerColumn("geoopt-radam-canonical", "geoopt-radam-canonical", _canonical_stiefel,
                        _riemannian_adam, False,
                        "geoopt RiemannianAdam on geoopt.Stiefel(): canonical metric, Cayley retraction"),
        OptimizerColumn("geoopt-rsgd", "geoopt-rsgd", _euclidean_stiefel,
                        _riemannian_sgd, False,
                        "geoopt RiemannianSGD, no momentum, on EuclideanStiefel (QR retraction)"),
        OptimizerColumn("torch AdamW (unconstrained)", "AdamW", None, _adamw, False,
                        "torch.optim.AdamW on an unconstrained d x r matrix started at the same frame"),
        stiefel_adam_column("element"),
        stiefel_adam_column("column"),
    )


def column_by_name(name: str) -> OptimizerColumn:
    """The default column called ``name`` (full name or short label).

    Parameters
    ----------
    name : str
        Full name or label of a column of :func:`default_columns`.

    Returns
    -------
    OptimizerColumn
        The column.
    """
    for column in default_columns():
        if name in (column.name, column.label):
            return column
    names = [c.name for c in default_columns()]
    raise KeyError(f"No optimizer column named {name!r}; choose one of {names}.")
