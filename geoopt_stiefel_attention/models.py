r"""Small transformer builders for paired Euclidean/Stiefel experiments.

- :class:`TinyTransformer`: decoder-only language model for algorithmic tasks (e.g. modular arithmetic).
- :class:`PatchViT`: a small vision transformer for 32x32 images.

Both draw every weight from one :class:`torch.Generator` seeded with ``seed``, in an order that does not
depend on ``attention``. The attention modules draw the same numbers in both arms
(:class:`~geoopt_stiefel_attention.nn.EuclideanMultiheadAttention` keeps them,
:class:`~geoopt_stiefel_attention.nn.StiefelMultiheadAttention` keeps the polar factors of the query/key
draws), so two models built with the same seed share every parameter except ``w_q``/``w_k`` exactly, and
the Stiefel ``w_q``/``w_k`` are the polar factors of the Euclidean ones.

Initialisation (``d`` = width): token/position embeddings and the class token
:math:`\sim \mathcal N(0, 1/d)` (rows of norm about 1); linear and convolution weights
:math:`\sim U(\pm 1/\sqrt{\text{fan_in}})` (torch's default bound); attention as documented in
:mod:`geoopt_stiefel_attention.nn`; every bias 0; LayerNorm weights 1.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .nn import FRAME_GRANULARITIES, EuclideanMultiheadAttention, StiefelMultiheadAttention

__all__ = ["ATTENTION_KINDS", "TinyTransformer", "PatchViT"]

#: The accepted values of the ``attention`` option.
ATTENTION_KINDS = ("euclidean", "stiefel")


def _check_int(owner: str, name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {name}={value!r} is invalid; pass an int >= {minimum}.")
    return value


def _check_common(owner: str, *, width, depth, heads, mlp, attention, frames, seed) -> None:
    for name, value in (("width", width), ("depth", depth), ("heads", heads), ("mlp", mlp)):
        _check_int(owner, name, value)
    if width % heads:
        raise ValueError(f"{owner}: width={width} is not divisible by heads={heads}; choose heads that "
                         f"divide the width (head_dim = width // heads).")
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"{owner}: attention={attention!r} is unknown; use 'euclidean' or 'stiefel'.")
    if frames not in FRAME_GRANULARITIES:
        raise ValueError(f"{owner}: frames={frames!r} is not a frame granularity; use 'head' or 'layer'.")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{owner}: seed={seed!r} is invalid; pass an int.")


def _normal(shape: tuple[int, ...], std: float, generator: torch.Generator, dtype: torch.dtype) -> Tensor:
    return torch.randn(shape, generator=generator, dtype=dtype) * std


def _uniform(shape: tuple[int, ...], bound: float, generator: torch.Generator, dtype: torch.dtype) -> Tensor:
    return (2.0 * torch.rand(shape, generator=generator, dtype=dtype) - 1.0) * bound


def _linear(fan_in: int, fan_out: int, generator: torch.Generator, dtype: torch.dtype, *, bias: bool = True) -> nn.Linear:
    """``nn.Linear`` with weight :math:`U(\\pm 1/\\sqrt{\\text{fan_in}})` drawn from ``generator`` and zero bias."""
    layer = nn.utils.skip_init(nn.Linear, fan_in, fan_out, bias=bias, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(_uniform((fan_out, fan_in), 1.0 / math.sqrt(fan_in), generator, dtype))
        if bias:
            layer.bias.zero_()
    return layer


class _Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(LN(x))`` then ``x + MLP(LN(x))`` with a GELU MLP."""

    def __init__(self, width: int, heads: int, mlp: int, attention: str, frames: str,
                 generator: torch.Generator, dtype: torch.dtype) -> None:
        super().__init__()
        cls = StiefelMultiheadAttention if attention == "stiefel" else EuclideanMultiheadAttention
        self.norm1 = nn.LayerNorm(width, dtype=dtype)
        self.attn = cls(width, heads, batch_first=True, frames=frames, dtype=dtype, generator=generator)
        self.norm2 = nn.LayerNorm(width, dtype=dtype)
        self.mlp = nn.Sequential(_linear(width, mlp, generator, dtype), nn.GELU(),
                                 _linear(mlp, width, generator, dtype))

    def forward(self, x: Tensor, *, causal: bool) -> Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False, is_causal=causal)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    r"""Decoder-only transformer for small algorithmic tasks.

    .. math::

        x_0 = E[\text{tokens}] + P_{0:T}, \qquad
        x_{l+1} = x_l' + \mathrm{MLP}(\mathrm{LN}(x_l')),\quad x_l' = x_l + \mathrm{Attn}_{\text{causal}}(\mathrm{LN}(x_l)),
        \qquad \text{logits} = \mathrm{LN}(x_L)\, U

    with learned token embedding :math:`E` (vocab x width), learned positions :math:`P` (seq_len x width),
    ``depth`` pre-LayerNorm blocks (causal multi-head attention, then a GELU MLP width -> mlp -> width), a
    final LayerNorm and an untied unembedding :math:`U` (no bias).

    Parameters
    ----------
    vocab_size : int
        Number of tokens.
    seq_len : int
        Longest input sequence (size of the position table).
    width, depth, heads, mlp : int
        Residual width (divisible by ``heads``), number of blocks, heads per block, MLP hidden width.
    attention : {"euclidean", "stiefel"}
        :class:`~geoopt_stiefel_attention.EuclideanMultiheadAttention` or
        :class:`~geoopt_stiefel_attention.StiefelMultiheadAttention`.
    seed : int
        Seed of the generator every weight is drawn from (see the module docstring for the laws and order).
    frames : {"head", "layer"}
        Frame granularity of the attention modules (one frame per head or per layer).
    dtype, device : optional
        Parameter dtype (draws are made in it) and device (parameters are moved there after drawing).

    Examples
    --------
    >>> import torch
    >>> from geoopt_stiefel_attention import TinyTransformer
    >>> model = TinyTransformer(97, 3, width=32, heads=4, mlp=64, attention="stiefel", seed=1)
    >>> model(torch.randint(0, 97, (8, 3))).shape
    torch.Size([8, 3, 97])
    """

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        *,
        width: int = 128,
        depth: int = 1,
        heads: int = 4,
        mlp: int = 512,
        attention: str = "euclidean",
        seed: int = 0,
        frames: str = "head",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        owner = "TinyTransformer"
        _check_int(owner, "vocab_size", vocab_size)
        _check_int(owner, "seq_len", seq_len)
        _check_common(owner, width=width, depth=depth, heads=heads, mlp=mlp, attention=attention,
                      frames=frames, seed=seed)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        self.vocab_size, self.seq_len, self.width, self.depth = vocab_size, seq_len, width, depth
        self.heads, self.mlp_width, self.attention, self.seed, self.frames = heads, mlp, attention, seed, frames
        g = torch.Generator().manual_seed(seed)
        std = 1.0 / math.sqrt(width)
        self.token_embedding = nn.Embedding(vocab_size, width, _weight=_normal((vocab_size, width), std, g, dtype))
        self.position_embedding = nn.Parameter(_normal((seq_len, width), std, g, dtype))
        self.blocks = nn.ModuleList(_Block(width, heads, mlp, attention, frames, g, dtype) for _ in range(depth))
        self.final_norm = nn.LayerNorm(width, dtype=dtype)
        self.unembed = _linear(width, vocab_size, g, dtype, bias=False)
        if device is not None:
            self.to(device)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``(B, T, vocab_size)`` for ``tokens`` of shape ``(B, T)`` (integer, ``T <= seq_len``).

        Parameters
        ----------
        tokens : torch.Tensor
            Integer token ids, shape ``(B, T)`` with ``T <= seq_len``.

        Returns
        -------
        torch.Tensor
            Logits, shape ``(B, T, vocab_size)``.

        Raises
        ------
        ValueError
            For another shape or dtype, or ``T > seq_len``.
        """
        if tokens.dim() != 2 or tokens.dtype not in (torch.long, torch.int32, torch.int64):
            raise ValueError(f"TinyTransformer: tokens must be an integer tensor of shape (batch, seq), got "
                             f"shape {tuple(tokens.shape)} and dtype {tokens.dtype}.")
        t = tokens.shape[1]
        if t > self.seq_len:
            raise ValueError(f"TinyTransformer: sequence length {t} exceeds seq_len={self.seq_len}; build the "
                             f"model with a larger seq_len.")
        x = self.token_embedding(tokens) + self.position_embedding[:t]
        for block in self.blocks:
            x = block(x, causal=True)
        return self.unembed(self.final_norm(x))

    def extra_repr(self) -> str:
        """The constructor's options shown in the model's ``repr``.

        Returns
        -------
        str
            ``attention``, ``frames`` and ``seed``.
        """
        return f"attention={self.attention!r}, frames={self.frames!r}, seed={self.seed}"


class PatchViT(nn.Module):
    r"""A small vision transformer on non-overlapping patches.

    The image is cut into :math:`(S/p)^2` patches of size :math:`p \times p`, each linearly embedded (a
    convolution with kernel = stride = ``patch_size``); with ``pool="cls"`` a learned class token is
    prepended; learned positions are added; ``depth`` pre-LayerNorm blocks (bidirectional attention, GELU
    MLP) and a final LayerNorm follow; the class token (``"cls"``) or the mean over patches (``"mean"``)
    goes through a linear head.

    Parameters
    ----------
    image_size, patch_size, in_channels, num_classes : int
        Square images of side ``image_size`` (divisible by ``patch_size``) with ``in_channels`` channels;
        ``num_classes`` logits.
    width, depth, heads, mlp : int
        Residual width (divisible by ``heads``), blocks, heads, MLP hidden width.
    pool : {"cls", "mean"}
        Class-token or mean pooling.
    attention, seed, frames, dtype, device
        As in :class:`TinyTransformer`.

    Examples
    --------
    >>> import torch
    >>> from geoopt_stiefel_attention import PatchViT
    >>> model = PatchViT(width=32, depth=1, heads=4, mlp=64, attention="stiefel")
    >>> model(torch.randn(2, 3, 32, 32)).shape
    torch.Size([2, 10])
    """

    def __init__(
        self,
        *,
        image_size: int = 32,
        patch_size: int = 4,
        in_channels: int = 3,
        num_classes: int = 10,
        width: int = 64,
        depth: int = 2,
        heads: int = 4,
        mlp: int = 128,
        pool: str = "cls",
        attention: str = "euclidean",
        seed: int = 0,
        frames: str = "head",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        owner = "PatchViT"
        for name, value in (("image_size", image_size), ("patch_size", patch_size),
                            ("in_channels", in_channels), ("num_classes", num_classes)):
            _check_int(owner, name, value)
        if image_size % patch_size:
            raise ValueError(f"PatchViT: image_size={image_size} is not divisible by patch_size={patch_size}; "
                             f"choose a patch_size that divides the image side (e.g. 4 for 32x32 images).")
        if pool not in ("cls", "mean"):
            raise ValueError(f"PatchViT: pool={pool!r} is unknown; use 'cls' or 'mean'.")
        _check_common(owner, width=width, depth=depth, heads=heads, mlp=mlp, attention=attention,
                      frames=frames, seed=seed)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        self.image_size, self.patch_size, self.in_channels, self.num_classes = (image_size, patch_size,
                                                                                in_channels, num_classes)
        self.width, self.depth, self.heads, self.mlp_width = width, depth, heads, mlp
        self.pool, self.attention, self.seed, self.frames = pool, attention, seed, frames
        self.num_patches = (image_size // patch_size) ** 2
        g = torch.Generator().manual_seed(seed)
        std = 1.0 / math.sqrt(width)
        fan_in = in_channels * patch_size * patch_size
        self.patch_embedding = nn.utils.skip_init(nn.Conv2d, in_channels, width, patch_size, stride=patch_size,
                                                  dtype=dtype)
        with torch.no_grad():
            self.patch_embedding.weight.copy_(_uniform(tuple(self.patch_embedding.weight.shape),
                                                       1.0 / math.sqrt(fan_in), g, dtype))
            self.patch_embedding.bias.zero_()
        if pool == "cls":
            self.cls_token = nn.Parameter(_normal((1, 1, width), std, g, dtype))
        else:
            self.register_parameter("cls_token", None)
        tokens = self.num_patches + (1 if pool == "cls" else 0)
        self.position_embedding = nn.Parameter(_normal((tokens, width), std, g, dtype))
        self.blocks = nn.ModuleList(_Block(width, heads, mlp, attention, frames, g, dtype) for _ in range(depth))
        self.final_norm = nn.LayerNorm(width, dtype=dtype)
        self.head = _linear(width, num_classes, g, dtype)
        if device is not None:
            self.to(device)

    def forward(self, images: Tensor) -> Tensor:
        """Logits ``(B, num_classes)`` for ``images`` of shape ``(B, in_channels, image_size, image_size)``.

        Parameters
        ----------
        images : torch.Tensor
            Shape ``(B, in_channels, image_size, image_size)``.

        Returns
        -------
        torch.Tensor
            Logits, shape ``(B, num_classes)``.

        Raises
        ------
        ValueError
            For another shape.
        """
        expected = (self.in_channels, self.image_size, self.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != expected:
            raise ValueError(f"PatchViT: images must have shape (batch, {', '.join(map(str, expected))}), got "
                             f"{tuple(images.shape)}.")
        x = self.patch_embedding(images).flatten(2).transpose(1, 2)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.position_embedding
        for block in self.blocks:
            x = block(x, causal=False)
        x = self.final_norm(x)
        pooled = x[:, 0] if self.cls_token is not None else x.mean(dim=1)
        return self.head(pooled)

    def extra_repr(self) -> str:
        """The constructor's options shown in the model's ``repr``.

        Returns
        -------
        str
            ``pool``, ``attention``, ``frames`` and ``seed``.
        """
        return f"pool={self.pool!r}, attention={self.attention!r}, frames={self.frames!r}, seed={self.seed}"
