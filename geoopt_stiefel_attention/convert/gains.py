r"""The per-head logit gain of a conversion: the gains a converted model saved into its weights, the gain each
site starts with (none, one, the saved gains, or fitted to the weights), why a gain may not be a module's logit
factor, and the query/key biases rescaled with a fitted gain so that each head keeps its logits."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .._linalg import ORTHONORMALITY_TOLERANCE, orthonormality_error
from . import families
from .parametrization import _frames_from
from .result import _where
from .sites import _Piece, _Site


def _saved_gain(site: _Site) -> Tensor | None:
    r"""The query gains a model converted with a logit gain saved into this site's weights, or ``None``.

    A converted model's state dict (``save_pretrained``, :func:`export_state_dict`, ``unstiefelize``) holds each
    query head block as :math:`\gamma_h U_h` and each key head block as a frame :math:`U_{K,g}`. Where every block
    is exactly that (orthonormal within the weight dtype's
    :data:`~geoopt_stiefel_attention._linalg.ORTHONORMALITY_TOLERANCE` after dividing the query block by
    :math:`\gamma_h = \|A_h\|_F/\sqrt r`) and some :math:`\gamma_h` differs from 1 by more than that tolerance,
    the :math:`\gamma_h` are returned; a freshly initialised or otherwise trained weight is not of that form."""
    q, k, r = site.q, site.k, site.r
    wq, wk = getattr(q.owner, q.attr), getattr(k.owner, k.attr)
    if any(w.device.type == "meta" or getattr(w, "_local_tensor", None) is not None for w in (wq, wk)):
        return None
    tol = ORTHONORMALITY_TOLERANCE.get(wq.dtype, 1e-4)
    with torch.no_grad():
        keys = _frames_from(wk, k.dim, k.start, k.length, r, k.groups).double()
        if not float(orthonormality_error(keys)) <= ORTHONORMALITY_TOLERANCE.get(wk.dtype, 1e-4):
            return None
        blocks = _frames_from(wq, q.dim, q.start, q.length, r, q.groups).double()
        gain = blocks.flatten(1).norm(dim=1) / math.sqrt(r)
        if not (bool(torch.isfinite(gain).all()) and bool((gain > 0).all())):
            return None
        if not float(orthonormality_error(blocks / gain.view(-1, 1, 1))) <= tol:
            return None
        if not float((gain - 1).abs().max()) > tol:
            return None
    return gain.to(wq.dtype)


def _gain_caveat(module: nn.Module) -> str | None:
    """Why a gain on the query rows of ``module`` would not multiply its logits (``None`` when it does): a norm of
    the queries or keys after the projection (a family's ``qk_norms``: it divides the gain out), what a family's
    ``gain_caveat`` finds (cosine attention, a clamp of q, k and v), or relative-position logits through separate
    position projections (a family's ``position_projections``: DeBERTa's c2p/p2c without ``share_att_key``)."""
    known = families.index()
    found = [n for n in known.qk_norms
             if isinstance(c := getattr(module, n, None), nn.Module) and not isinstance(c, nn.Identity)]
    # a norm of the keys alone leaves the queries' scale, and with it the gain, in the logits
    norms = [f"{n} ({type(getattr(module, n)).__name__})" for n in found] if set(found) - known.key_norms else []
    why = []
    if norms:
        why.append(f"it normalizes its queries/keys after the projection ({', '.join(norms)}), which divides a gain "
                   f"on the query rows out (a norm over all heads at once keeps only the gains' ratios)")
    why += families.gain_caveats(module)  # a clamp of q, k and v (clip_qkv); cosine attention (logit_scale)
    position = [n for n in known.position_projections if isinstance(getattr(module, n, None), nn.Module)]
    if position and getattr(module, "relative_attention", True):
        why.append(f"it adds relative-position logits that pair its queries or keys with separate position "
                   f"projections ({', '.join(position)}: DeBERTa's c2p/p2c), which a gain on the query rows, or the "
                   f"keys 'fit' rescales, scale otherwise than the content logits")
    return f"{type(module).__name__}: " + "; ".join(why) if why else None


def _initial_gain(site: _Site, logit_gain: str | None, saved: Tensor | None = None) -> Tensor | None:
    """The per-query-head gain a site starts with: none, ones (``"learn"``; the gains ``saved`` in the weights
    where :func:`_saved_gain` found them), or the product of the q and k blocks' RMS singular values
    (``"fit"``). A fitted gain must be positive and finite: a zero block would give a log-gain of -inf, a head
    whose logits stay zero for the whole of training."""
    if logit_gain is None:
        return None
    q, k, r = site.q, site.k, site.r
    wq = getattr(q.owner, q.attr)
    with torch.no_grad():
        if logit_gain == "learn":
            return saved if saved is not None else torch.ones(q.heads, dtype=wq.dtype, device=wq.device)
        gain = _rms_singular(q, r) * _rms_singular(k, r).repeat_interleave(q.heads // k.heads)
    bad = [h for h, g in enumerate(gain.tolist()) if not (math.isfinite(g) and g > 0)]
    if bad:
        raise ValueError(f"stiefelize: logit_gain='fit' at {_where(site.path)} gives query head(s) {bad} a gain of "
                         f"{[float(gain[h]) for h in bad]} (an all-zero or non-finite query/key block): such a "
                         f"head's logits would stay zero for the whole of training. Nothing was changed; use "
                         f"logit_gain='learn' (starts at 1) or give those heads non-zero weights first.")
    return gain


def _rms_singular(piece: _Piece, r: int) -> Tensor:
    r"""The RMS singular value :math:`\rho(A_h) = \|A_h\|_F/\sqrt r` of each head block of ``piece`` (as stored)."""
    w = getattr(piece.owner, piece.attr)
    with torch.no_grad():
        blocks = _frames_from(w, piece.dim, piece.start, piece.length, r, piece.groups)
        return blocks.flatten(1).norm(dim=1) / math.sqrt(r)


def _rescale_biases(site: _Site) -> None:
    r"""Rescale the query/key biases of a site ``logit_gain="fit"`` converts, before its weights are converted, so
    that each head keeps its logits exactly when its blocks are scaled orthonormal frames, biases or not: with
    :math:`A_{Q,h} = \rho_Q U_{Q,h}^\top`, :math:`A_{K,g} = \rho_K U_{K,g}^\top` and the gain
    :math:`\gamma_h = \rho_Q\rho_K` on the query frame,

    .. math:: (\gamma_h U_{Q,h}^\top x + \rho_K b_{Q,h})^\top (U_{K,g}^\top y + b_{K,g}/\rho_K)
              = (A_{Q,h} x + b_{Q,h})^\top (A_{K,g} y + b_{K,g}),

    so :math:`b_{Q,h} \leftarrow \rho_{K,g(h)} b_{Q,h}` and :math:`b_{K,g} \leftarrow b_{K,g}/\rho_{K,g}`."""
    if not isinstance(site.q_bias, list) and not isinstance(site.k_bias, list):
        return
    rho_k = _rms_singular(site.k, site.r)
    per_query = rho_k.repeat_interleave(site.q.heads // site.k.heads)
    for spans, factor in ((site.q_bias, per_query), (site.k_bias, 1 / rho_k)):
        if not isinstance(spans, list):
            continue
        head = 0
        for owner, attr, start, length in spans:  # in head order (one span per group)
            n = length // site.r
            bias = getattr(owner, attr)
            with torch.no_grad():
                bias[start:start + length].view(n, site.r).mul_(factor[head:head + n, None].to(bias.dtype))
            head += n
