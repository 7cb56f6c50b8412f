"""Reading a torch :class:`torch.nn.MultiheadAttention` as the configuration and flat weights from which
:mod:`geoopt_stiefel_attention.nn` builds its attention modules (``from_euclidean``, ``from_torch``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def _t(w: Tensor) -> Tensor:
    """A contiguous copy of the transpose (``.t().clone()`` would keep the transposed strides)."""
    return w.detach().t().clone(memory_format=torch.contiguous_format)


def torch_mha_parts(source: nn.MultiheadAttention, *, name: str, drop_qk_bias: bool, ignore_batch_first: bool
                    ) -> tuple[dict[str, Any], dict[str, Tensor | None]]:
    """Configuration and flat weights (``q, k, v, o, b_v, b_o, gain``) of the torch module ``source``, which is
    called ``name`` in the errors; ``ValueError`` naming what cannot be converted."""
    if source.bias_k is not None or source.bias_v is not None:
        raise ValueError(f"{name} has add_bias_kv=True (learned extra key/value rows), which the Stiefel "
                         f"module does not implement; build the model without add_bias_kv, or keep the torch "
                         f"module and use stiefelize(model).")
    if source.add_zero_attn:
        raise ValueError(f"{name} has add_zero_attn=True, which the Stiefel module does not implement; build "
                         f"the model without add_zero_attn, or keep the torch module and use stiefelize(model).")
    e, h = source.embed_dim, source.num_heads
    with torch.no_grad():
        if source._qkv_same_embed_dim:
            wq, wk, wv = source.in_proj_weight.detach().chunk(3, dim=0)
        else:
            wq, wk, wv = (source.q_proj_weight.detach(), source.k_proj_weight.detach(),
                          source.v_proj_weight.detach())
        b_v = b_o = None
        if source.in_proj_bias is not None:
            b_q, _b_k, b_v = source.in_proj_bias.detach().chunk(3)
            if not drop_qk_bias and bool((b_q != 0).any()):
                raise ValueError(
                    f"{name} has a non-zero query bias (max |b_Q| = {float(b_q.abs().max()):.3g}); the Stiefel "
                    f"module has no query/key biases and dropping b_Q changes the attention. Pass "
                    f"drop_qk_bias=True to drop it anyway (the key bias is always dropped: it is "
                    f"softmax-invariant).")
            b_v = b_v.clone()
            b_o = source.out_proj.bias.detach().clone() if source.out_proj.bias is not None else torch.zeros_like(b_v)
        weights = {"q": _t(wq), "k": _t(wk), "v": _t(wv), "o": _t(source.out_proj.weight), "b_v": b_v,
                   "b_o": b_o, "gain": None}
    config = dict(embed_dim=e, num_heads=h, head_dim=e // h, dropout=float(source.dropout),
                  bias=source.in_proj_bias is not None, kdim=source.kdim, vdim=source.vdim,
                  batch_first=bool(source.batch_first or ignore_batch_first), frames="head", logit_gain=False)
    return config, weights

