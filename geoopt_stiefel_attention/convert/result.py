r"""What :func:`~geoopt_stiefel_attention.stiefelize` returns: one row per converted module, the modules it left, and
the output change on a probe batch; with the two helpers that name a module's path and group paths by reason."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ConvertedAttention:
    r"""One converted attention module (a row of the :class:`ConversionResult`).

    Attributes
    ----------
    path : str
        The module's path in ``model.named_modules()`` (``""`` for the model itself).
    layout : str
        Name of the :class:`Layout` that converted it.
    q_heads, k_heads : int
        Query frames :math:`H` and key frames :math:`H_{kv}` (fewer under grouped-query attention).
    d_q, d_k : int
        Input widths: query frames lie in :math:`\mathrm{St}(d_q, r)`, key frames in :math:`\mathrm{St}(d_k, r)`.
    r : int
        Head size.
    logit_gain : str
        ``"none"``, ``"learn (1)"``, ``"learn (kept from the weights: min..max)"`` (the gains a converted model
        saved, see :func:`stiefelize`) or ``"fit (min..max)"`` (the fitted gains' range).
    """

    path: str
    layout: str
    q_heads: int
    k_heads: int
    d_q: int
    d_k: int
    r: int
    logit_gain: str

    def __str__(self) -> str:
        heads = f"{self.q_heads}" if self.q_heads == self.k_heads else f"{self.q_heads}/{self.k_heads}"
        return (f"{self.path or '<root>'}: {self.layout}, heads q/kv {heads}, q in St({self.d_q}, {self.r}), "
                f"k in St({self.d_k}, {self.r}), logit gain {self.logit_gain}")


@dataclass(frozen=True)
class ConversionResult:
    """What :func:`stiefelize` did. ``str(result)`` is a readable summary; iterate for the rows.

    Attributes
    ----------
    converted : tuple of ConvertedAttention
        One row per converted attention module, in ``named_modules()`` order.
    skipped : tuple of (path, reason)
        Modules that look like attention and were left unchanged (only with ``strict=False``).
    output_change : float or None
        :math:`\\|y_\\text{after} - y_\\text{before}\\|_F / \\|y_\\text{before}\\|_F` on the probe batch, when
        ``probe`` was given and the ratio is defined; ``None`` without a probe, or when the output before
        conversion is zero or not finite (``str(result)`` then says which, and gives the absolute change).
    output_change_abs : float or None
        :math:`\\|y_\\text{after} - y_\\text{before}\\|_F`, when ``probe`` was given.
    output_norm_before : float or None
        :math:`\\|y_\\text{before}\\|_F`, when ``probe`` was given (zero, for example, for a model whose head is
        initialised to zero, as torchvision's ViT is).
    """

    converted: tuple[ConvertedAttention, ...]
    skipped: tuple[tuple[str, str], ...] = ()
    output_change: float | None = None
    output_change_abs: float | None = None
    output_norm_before: float | None = None

    @property
    def num_frames(self) -> int:
        """Number of frames created (query heads plus key heads)."""
        return sum(c.q_heads + c.k_heads for c in self.converted)

    def __len__(self) -> int:
        return len(self.converted)

    def __iter__(self):
        return iter(self.converted)

    def __str__(self) -> str:
        lines = [f"stiefelize: {len(self.converted)} attention module(s) converted, {self.num_frames} frames"]
        lines += [f"  {c}" for c in self.converted]
        lines += [f"  skipped {_where(p)}: {why}" for p, why in self.skipped]
        if self.output_change is not None:
            lines.append(f"  relative output change on the probe batch: {self.output_change:.3g}")
        elif self.output_norm_before is not None:
            why = "zero" if self.output_norm_before == 0 else f"not finite (norm {self.output_norm_before})"
            lines.append(f"  relative output change on the probe batch undefined: the output before conversion is "
                         f"{why}; absolute change {self.output_change_abs:.3g}")
        return "\n".join(lines)



def _where(path: str) -> str:
    return repr(path) if path else "<root>"


def _grouped(problems: Sequence[tuple[str, str]], shown: int = 3) -> list[str]:
    """``"<paths>: <why>"`` once per distinct reason, naming at most ``shown`` paths (and how many there are)."""
    groups: dict[str, list[str]] = {}
    for path, why in problems:
        groups.setdefault(why, []).append(path)
    lines = []
    for why, paths in groups.items():
        more = f", ... ({len(paths)} modules)" if len(paths) > shown else ""
        lines.append(f"{', '.join(_where(p) for p in paths[:shown])}{more}: {why}")
    return lines
