r"""The frame check of a training forward pass: a frame moved off the Stiefel manifold by anything other than the
library's own update is reported at the next training forward of the module that holds it.

A frame :math:`W \in \mathbb R^{d\times r}` is on the manifold when :math:`W^\top W = I_r`. The library's updates
(:class:`~geoopt_stiefel_attention.StiefelAdam` and the other frame optimizers, geoopt's Riemannian optimizers)
end every step with a retraction, so :math:`\max |W^\top W - I_r|` stays at the rounding level of the dtype
(measured at most 2.5e-6 in float32 over 300 steps at lr 3e-2, 512 x 64 and 64 x 16 frames). An optimizer that
does not know the constraint (torch's ``AdamW`` over ``model.parameters()``, the HuggingFace ``Trainer``'s
default) moves the entries freely: one AdamW step at lr 1e-5 already leaves 6e-5 (measured, same shapes), and
the error grows from there. :data:`FRAME_CHECK_TOLERANCE` sits between the two.

Cost: one :math:`r\times r` Gram matrix per frame (:math:`d r^2` multiply-adds, against the forward's
:math:`B\,T\,d\,r` for :math:`B\,T` tokens) less the identity, in one ``baddbmm``, and its largest absolute entry:
three operations; one read of a scalar per module off the CPU. A converted weight that its module's forward reads
several times (``nn.MultiheadAttention``) is rebuilt, and checked, once per forward. It raises in eager training forward
passes (forward passes with gradients enabled, whatever ``module.training`` says: a model trained in
eval mode to switch dropout off is checked too). A forward without gradients (an evaluation) runs it only when
the frames changed since its last check (their version counters, which writes through ``.data`` do not move) and
warns instead of raising (:func:`~geoopt_stiefel_attention.integrations.averaging.check_at_evaluation`): an average
of frames (an EMA, ``AveragedModel``) is evaluated, not trained. Under ``torch.compile`` a data-dependent ``raise``
cannot be part of a graph, so the check is traced into it as an assertion (``torch._assert_async``, the same Gram product
and distance per frame): a frame off the manifold stops the compiled forward with a ``RuntimeError`` carrying
the same message (without the measured distance). On the CPU it is raised by the forward itself; on CUDA it is
a device-side assert, reported at a later kernel launch, after which the process's CUDA context is unusable
(run :func:`check_frames` eagerly to see which frame and by how much). A training forward captured in a CUDA graph
records the same assertion (no host read is allowed during a capture), run at every replay. ``torch.export``, ``torch.jit.trace``
and sharded (``DTensor``) frames under ``torch.compile`` skip it; :func:`check_frames` runs it on a whole
model on demand (e.g. after each optimizer step).

This is the check the guards share (``geoopt_stiefel_attention/integrations/``, indexed in ``docs/guarantees.md``):
the one against optimizers that do not know the constraint (:mod:`~geoopt_stiefel_attention.integrations.optimizers`)
runs it at every training forward and when a model is saved; the one for averaged models
(:mod:`~geoopt_stiefel_attention.integrations.averaging`) at evaluation forwards.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

__all__ = ["FRAME_CHECK_TOLERANCE", "FrameOffManifoldError", "check_frame_tensors", "check_frames"]

#: Largest :math:`\max |W^\top W - I_r|` of a frame at a training forward pass, per dtype: 4x the worst error
#: measured after the library's own float32 updates (2.5e-6, also at 2048 x 128 and on the capturable path) and
#: 6x below one AdamW step at lr 1e-5 (6e-5); the first AdamW step of a HuggingFace Trainer (lr 5e-5) leaves 3.7e-5.
#: bfloat16/float16 frames are rounded orthonormal frames (:data:`~._linalg.ORTHONORMALITY_TOLERANCE` for them).
FRAME_CHECK_TOLERANCE = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.bfloat16: 3e-2,
    torch.float16: 5e-3,
}

#: A frame's max |W^T W - I| beyond which the message names uninitialised memory first (a zero frame has 1; one
#: AdamW step at lr 1e-2 on a 64 x 16 frame leaves about 0.05).
FAR_OFF = 0.5

_FIX = ("train frames with the library's optimizer: opt = StiefelAdam(param_groups(model), lr=...) (with a "
        "HuggingFace Trainer pass optimizers=(opt, None) or optimizer_cls_and_kwargs), or re-project "
        "(with torch.no_grad(): w.proj_()) if you changed the frame on purpose")


class FrameOffManifoldError(RuntimeError):
    """A frame is off the Stiefel manifold at a training forward pass (see :mod:`._guard`)."""


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (then no tensor may be read on the host)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _is_sharded(w: Tensor) -> bool:
    from .distributed import is_sharded

    return is_sharded(w)


_MINUS_EYES: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}


def _minus_eye(r: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """:math:`-I_r`, subtracted from the Gram matrices inside one ``baddbmm``; made once per size, dtype and
    device, read only, never written."""
    key = (r, dtype, device)
    eye = _MINUS_EYES.get(key)
    if eye is None:
        eye = _MINUS_EYES[key] = torch.eye(r, dtype=dtype, device=device).neg_()
    return eye


def frame_error(x: Tensor) -> Tensor:
    r""":math:`\max |W^\top W - I|` over every frame of the stack ``x`` (``(..., d, r)``, detached): a 0-d tensor,
    NaN if any entry is. Computed in ``x``'s own precision (float32 for bf16/fp16, autocast off) by one ``baddbmm``
    against :func:`_minus_eye`, its absolute value and its largest entry: the check of a training forward, shared by
    :func:`check_frame_tensors` and the model-level check of a converted model."""
    if x.dtype in (torch.bfloat16, torch.float16):
        x = x.float()
    x = x if x.dim() == 3 else x.reshape(-1, *x.shape[-2:])  # a stack of frames, for the batched product
    minus_eye = _minus_eye(x.shape[-1], x.dtype, x.device)
    if torch.is_autocast_enabled(x.device.type):
        with torch.autocast(x.device.type, enabled=False):  # in the frame's own precision
            deviation = torch.baddbmm(minus_eye, x.mT, x)  # W^T W - I
    else:
        deviation = torch.baddbmm(minus_eye, x.mT, x)
    return deviation.abs_().amax()


def check_frame_tensors(owner: str, frames: Iterable[tuple[str, Tensor]], *,
                        where: str = "a training forward pass") -> None:
    """Raise :class:`FrameOffManifoldError` if any ``(name, frame)`` of ``owner`` is off the manifold.

    Three operations per frame (:math:`W^\top W - I` by one ``baddbmm``, its absolute value and its largest
    entry); on the CPU each error is read as it comes (a host read costs nothing there), on other
    devices all of them at once (one host read per call).

    Parameters
    ----------
    owner : str
        What holds the frames, for the message (a class name or a parameter path).
    frames : iterable of (str, Tensor)
        Stacks of frames ``(..., d, r)``; sharded ones (``DTensor``) are checked on their local shard (whole
        frames, see :mod:`~geoopt_stiefel_attention.distributed`); meta and empty tensors are skipped.
    where : str, default "a training forward pass"
        Where the check runs, for the message (eager only; a compiled check names its own place).
    """
    if torch.jit.is_tracing() or torch.jit.is_scripting():
        return
    traced = torch.compiler.is_compiling()
    if traced and torch.compiler.is_exporting():
        return
    # a CUDA graph being captured (torch.cuda.graph, make_graphed_callables): no host read is allowed, so the check
    # is an assertion recorded into the graph, as under torch.compile, and runs at every replay
    captured = not traced and capturing()
    checked = []
    for name, w in frames:
        if traced and _is_sharded(w):  # a DTensor's local shard is not read inside a compiled graph
            continue
        w = getattr(w, "_local_tensor", w)
        if w.device.type == "meta" or w.numel() == 0 or w.dim() < 2:
            continue
        x = w.detach()  # no graph is recorded for it
        err = frame_error(x)  # max |W^T W - I|; NaN if any entry is
        tol = FRAME_CHECK_TOLERANCE.get(w.dtype, FRAME_CHECK_TOLERANCE[torch.float32])
        if traced or captured:  # in the graph: an assertion, no host read (NaN fails too)
            torch._assert_async(err <= tol, _message(owner, name, w.dtype, tol, None,
                                                     "a compiled training forward pass" if traced else
                                                     "a training forward pass captured in a CUDA graph"))
            continue
        if x.device.type == "cpu":
            if not err.item() <= tol:  # NaN fails too
                _report(owner, name, w.dtype, tol, err, where)
            continue
        checked.append((name, w.dtype, tol, err))
    if not checked:
        return
    # off the CPU: one host read per call
    tols = {tol for _, _, tol, _ in checked}
    if len(tols) == 1:  # the usual case: one dtype
        errs = torch.stack([err for *_, err in checked]) if len(checked) > 1 else checked[0][3]
        if bool(errs.amax() <= tols.pop()):  # NaN compares False and falls through to the message
            return
    elif all(float(err) <= tol for _, _, tol, err in checked):
        return
    for name, dtype, tol, err in checked:
        if not float(err) <= tol:  # NaN fails too
            _report(owner, name, dtype, tol, err, where)


def _message(owner: str, name: str, dtype: torch.dtype, tol: float, err: Tensor | None,
             where: str = "a training forward pass") -> str:
    gap = "" if err is None else f" = {float(err):.3g}"
    far = err is not None and not float(err) <= FAR_OFF  # NaN too
    cause = ("so far off (not a drift) that it is most likely uninitialised memory (a model converted on the meta "
             "device, then materialised by to_empty(): load a state dict into it, whose stock weights become the "
             "frames, or convert after materialising and initialising the stock model) or values written into it "
             "by hand; else " if far else "most likely ")
    return (f"{owner}: frame {name!r} is off the Stiefel manifold at {where} "
            f"(max |W^T W - I|{gap} > {tol:g} for {str(dtype).removeprefix('torch.')}); {cause}"
            f"an optimizer that does not know the constraint updated it (a torch optimizer over "
            f"model.parameters(), the HuggingFace Trainer's default AdamW); {_FIX}.")


def _report(owner: str, name: str, dtype: torch.dtype, tol: float, err: Tensor,
            where: str = "a training forward pass") -> None:
    raise FrameOffManifoldError(_message(owner, name, dtype, tol, err, where))


def check_frames(model: nn.Module) -> None:
    """Check every frame of ``model`` now, whatever its mode (the check that eager training forward passes run
    by themselves, as a :class:`FrameOffManifoldError` with the measured distance; after a compiled step's
    assertion fired on the CPU, it names the frame and how far it is off).

    Parameters
    ----------
    model : nn.Module
        Any model; each of its frames (:func:`~geoopt_stiefel_attention.is_frame`) is checked.

    Raises
    ------
    FrameOffManifoldError
        Naming the first frame off the manifold, by its parameter path.
    """
    from .manifolds import is_frame

    check_frame_tensors(type(model).__name__, [(n, p) for n, p in model.named_parameters() if is_frame(p)])
