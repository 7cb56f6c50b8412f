r"""The shared docstring fragments of :mod:`geoopt_stiefel_attention.nn`'s two attention modules (their forward
pass, parameter layout and constructor), written once and joined into each class's ``__doc__`` there.
"""

FORWARD_DOC = r"""
    Forward pass, with the call interface of :class:`torch.nn.MultiheadAttention`. Inputs are
    ``(L, N, features)`` (``batch_first=False``, torch's default), ``(N, L, features)`` (``batch_first=True``)
    or unbatched ``(L, features)``; ``L`` is the query length, ``S`` the key length. For each head :math:`h`,

    .. math::

        Q_h = X_q W_{Q,h}\,e^{g_h}, \quad K_h = X_k W_{K,h}, \quad V_h = X_v W_{V,h} + b_{V,h}, \\
        A_h = \operatorname{softmax}\!\Big(\frac{Q_h K_h^\top}{\sqrt{d_h}} + M\Big), \qquad
        Y = [A_1 V_1, \dots, A_H V_H]\, W_O + b_O,

    with :math:`e^{g_h} = 1` unless ``logit_gain=True``. Computed by
    :func:`torch.nn.functional.scaled_dot_product_attention` when ``need_weights=False``, written out
    otherwise (pass ``need_weights=False`` for speed, as torch recommends).

    Parameters
    ----------
    query, key, value : Tensor
        Query ``(L, N, embed_dim)``, key ``(S, N, kdim)``, value ``(S, N, vdim)`` (batch dimension first
        when ``batch_first=True``), or unbatched ``(L, embed_dim)``, ``(S, kdim)``, ``(S, vdim)``.
    key_padding_mask : Tensor, optional
        ``(N, S)`` (``(S,)`` unbatched); bool ``True`` = that key is ignored, or a float mask added to the
        logits.
    need_weights : bool, default True
        Also return the attention probabilities. As in :class:`torch.nn.MultiheadAttention` they are the
        probabilities multiplied into ``V``, i.e. after attention dropout in training mode.
    attn_mask : Tensor, optional
        ``(L, S)`` or ``(N * num_heads, L, S)`` (``(num_heads, L, S)`` unbatched; entry ``n * num_heads + h``
        for batch ``n``, head ``h``); bool ``True`` = not allowed to attend, or float added to the logits.
        Combined with ``key_padding_mask`` by addition (bool masks become ``-inf``).
    average_attn_weights : bool, default True
        Return weights averaged over heads, ``(N, L, S)``, instead of per head, ``(N, num_heads, L, S)``
        (``(L, S)`` / ``(num_heads, L, S)`` unbatched). Weights are batch-first whatever ``batch_first``
        is, as in torch.
    is_causal : bool, default False
        With ``attn_mask``: a hint that ``attn_mask`` is the causal mask, as in torch; pass it only when that
        is true (torch may then apply its own causal mask instead of ``attn_mask``, this module always applies
        ``attn_mask``). Without ``attn_mask``: the causal mask is applied (query ``i`` sees keys ``j <= i``,
        top-left aligned as in SDPA); ``nn.MultiheadAttention`` raises instead.

    Returns
    -------
    output : Tensor
        Shaped like ``query`` with ``embed_dim`` features.
    weights : Tensor or None
        Attention probabilities when ``need_weights``, else ``None``.

    Raises
    ------
    ValueError
        For inputs or masks of the wrong rank or shape (the message names the tensor and the expected shape).
    TypeError
        For a mask that is neither bool nor floating point.

    Notes
    -----
    A query whose keys are all masked gets NaN with ``need_weights=True`` (output and weights); with
    ``need_weights=False`` it gets what :func:`~torch.nn.functional.scaled_dot_product_attention` gives such a
    row, zero attention on the CPU, so its output is ``b_O``. Both are what :class:`torch.nn.MultiheadAttention`
    gives outside its inference fast path (which gives NaN with ``need_weights=False``); neither is a signal to
    rely on: drop such queries, or keep one key unmasked.
"""

LAYOUT_DOC = r"""
    Parameters (the layout is the same in :class:`StiefelMultiheadAttention` and
    :class:`EuclideanMultiheadAttention`; ``H = num_heads``, ``Dh = head_dim``):

    - ``w_q``: ``(H, embed_dim, Dh)`` for ``frames="head"`` (head ``h`` computes ``q_h = x @ w_q[h]``), or
      ``(1, embed_dim, H*Dh)`` for ``frames="layer"`` (head ``h`` uses columns ``h*Dh:(h+1)*Dh``);
    - ``w_k``: the same with ``kdim`` rows;
    - ``w_v``: ``(H, vdim, Dh)``; ``b_v``: ``(H*Dh,)`` (entries ``h*Dh:(h+1)*Dh`` for head ``h``) or ``None``;
    - ``w_o``: ``(H*Dh, embed_dim)``, rows ``h*Dh:(h+1)*Dh`` belong to head ``h`` (``y = concat_h(o_h) @ w_o``);
      ``b_o``: ``(embed_dim,)`` or ``None``;
    - ``logit_gain``: ``(H,)`` log-gains :math:`g_h` (initialised to 0) when ``logit_gain=True``, else ``None``.

    There are no query/key biases.
"""

CONSTRUCTOR_DOC = r"""
    The constructor takes the arguments of :class:`torch.nn.MultiheadAttention` in its order (positionally
    too), then keyword-only ``head_dim``, ``frames``, ``logit_gain`` and ``generator``.

    Parameters
    ----------
    embed_dim : int
        Width of the query (and of the output).
    num_heads : int
        Number of heads ``H``.
    dropout : float, default 0
        Dropout on the attention probabilities (training mode only).
    bias : bool, default True
        Biases on the value and output projections (never on queries and keys: unlike torch's ``bias``,
        which also adds query/key biases).
    add_bias_kv, add_zero_attn : bool, default False
        Accepted for torch's signature; ``True`` raises ``ValueError`` (not implemented: both append an
        extra key/value row to every sequence).
    kdim, vdim : int, optional
        Feature sizes of ``key`` and ``value`` (cross-attention); default ``embed_dim``. Key frames lie in
        :math:`\mathrm{St}(\text{kdim}, r)`.
    batch_first : bool, default False
        ``True``: inputs and output are ``(batch, seq, features)``; ``False`` (torch's default):
        ``(seq, batch, features)``.
    device, dtype
        Where and in which dtype the parameters live (default: torch's defaults).
    head_dim : int, optional
        ``Dh``; default ``embed_dim // num_heads`` (which must then divide exactly).
    frames : {"head", "layer"}, default "head"
        The frame granularity (:data:`~geoopt_stiefel_attention.nn.FRAME_GRANULARITIES`). ``"head"``: each
        head's ``(d, Dh)`` block is one frame (needs ``Dh <= embed_dim, kdim``). ``"layer"``: the whole ``(d, H*Dh)`` projection is one frame, so heads are also mutually orthogonal
        (needs ``H*Dh <= embed_dim, kdim``).
    logit_gain : bool, default False
        Learn a per-head logit gain :math:`e^{g_h}`. Orthonormal frames cannot scale the logits:
        :math:`|q_h^\top k_h| \le \|x_q\|\,\|x_k\|` for every frame, so with LayerNorm'd inputs the attention
        cannot sharpen beyond what the input norms allow, whereas a Euclidean ``W_Q`` can grow its singular
        values. The gain restores that one degree of freedom per head; it is off by default so that the
        module is a pure Stiefel constraint.
    generator : torch.Generator, optional
        Source of the initialisation (torch's global RNG if ``None``). Q, K, V and O are drawn in that order
        from the Xavier-uniform law :math:`U(\pm\sqrt{6/(\text{fan_in}+\text{fan_out})})` of each
        ``(fan_in, fan_out)`` projection; biases and log-gains start at 0. Both classes draw the same numbers.
"""
