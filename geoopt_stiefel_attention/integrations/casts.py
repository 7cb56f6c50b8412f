r"""Dtype casts and module conversions (``.double()``, ``.to(dtype)``, ``to_empty()``) of the modules that hold frames.

**What goes wrong silently without it.** A frame made in float32 is orthonormal to float32's rounding only
(:math:`\max|W^\top W - I|` about :math:`10^{-6}`); cast to float64 it keeps those values, so it is off the manifold
by far more than float64's rounding, and every check and the first optimizer step treat it as a frame moved by
hand. And torch's ``Module._apply`` installs a plain ``Parameter`` where the cast tensor cannot take the old one's
place (``to_empty()`` from the meta device, ``torch.__future__.set_overwrite_module_params_on_conversion(True)``),
which drops the ``geoopt.ManifoldParameter`` class and its manifold: the frame would then be trained, and checked,
as a plain matrix.

**How it is detected.** The modules that hold frames as their own parameters (the parametrization of
:func:`~geoopt_stiefel_attention.stiefelize` and :class:`~geoopt_stiefel_attention.StiefelMultiheadAttention`) derive
from :class:`_FrameOwner`, whose ``_apply`` (the one method torch's casts and moves go through) reads each frame's
dtype and manifold before the cast and compares after it.

**What the user is shown.** Nothing: the fix is made in place. A frame the cast moved to a more precise dtype is
replaced by its polar factor (:func:`reproject_after_cast_`), and a frame that lost its class is wrapped again on its
manifold (:func:`_rewrap_frames_`). A frame that was off the manifold before the cast is left as it is, for the frame
check (:mod:`geoopt_stiefel_attention._guard`) or the optimizer's first step to report.

Tests: ``tests/test_casts.py``.
"""

from __future__ import annotations

import torch

from .. import _linalg
from ..manifolds import is_frame

__all__ = ["frame_dtypes", "reproject_after_cast_"]


def frame_dtypes(module: torch.nn.Module) -> dict[str, torch.dtype]:
    """The dtype of every frame that ``module`` holds itself (not its children's), by parameter name: what
    :func:`reproject_after_cast_` compares with after a cast.

    Parameters
    ----------
    module : nn.Module
        Owner of the frames.

    Returns
    -------
    dict of str to torch.dtype
        Dtype of each frame, by the name in ``module._parameters``.
    """
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


def _frame_manifolds(module: torch.nn.Module) -> dict[str, object]:
    """The manifold of every frame ``module`` holds itself, by parameter name (taken before a cast, for
    :func:`_rewrap_frames_`)."""
    return {name: p.manifold for name, p in module._parameters.items() if p is not None and is_frame(p)}


def _rewrap_frames_(module: torch.nn.Module, manifolds: dict[str, object]) -> None:
    """After ``module._apply``: give back its manifold to a frame that the cast replaced by a plain ``Parameter``.

    torch's ``Module._apply`` keeps a parameter object (``param.data = new``) only when the new tensor can take the
    old one's place; otherwise (``to_empty()`` from the meta device) it installs ``Parameter(new)``, which drops the
    ``geoopt.ManifoldParameter`` class and its manifold, so the frame would be trained, and checked, as a plain
    matrix; so does ``torch.__future__.set_overwrite_module_params_on_conversion(True)`` at every cast. The new
    parameter is wrapped again on the same manifold (same data, ``requires_grad`` and gradient)."""
    import geoopt

    for name, manifold in manifolds.items():
        p = module._parameters.get(name)
        if p is not None and not is_frame(p):
            frame = geoopt.ManifoldParameter(p.data, manifold=manifold, requires_grad=p.requires_grad)
            frame.grad = p.grad
            module._parameters[name] = frame


class _FrameOwner(torch.nn.Module):
    """Base of the modules that hold frames as their own parameters (the parametrization of
    :func:`~geoopt_stiefel_attention.stiefelize` and :class:`~geoopt_stiefel_attention.StiefelMultiheadAttention`):
    their ``_apply`` (``.to()``, ``.double()``, ``.half()``, ``to_empty()``, ...) keeps every frame a frame on its
    manifold (:func:`_rewrap_frames_`) and re-projects the frames a cast moved to a more precise dtype
    (:func:`reproject_after_cast_`)."""

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN201 - torch's signature
        before, manifolds = frame_dtypes(self), _frame_manifolds(self)
        super()._apply(fn, recurse)
        _rewrap_frames_(self, manifolds)  # to_empty() from the meta device installs plain Parameters
        reproject_after_cast_(self, before)
        return self
