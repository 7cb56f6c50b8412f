r"""Statistics of paired comparisons: paired t-test, confidence interval of the mean difference, sign test.

Two arms run on the same seeds (same initial weights, same data order) give pairs :math:`(a_i, b_i)`,
:math:`i = 1..n`. With the differences :math:`\delta_i = a_i - b_i`:

.. math::

    \bar\delta = \frac1n \sum_i \delta_i, \qquad
    s_\delta = \Big(\frac{1}{n-1} \sum_i (\delta_i - \bar\delta)^2\Big)^{1/2}, \qquad
    t = \frac{\bar\delta}{s_\delta / \sqrt n},

and under the null hypothesis of zero mean difference (differences i.i.d. normal) :math:`t` follows Student's
t distribution with :math:`n - 1` degrees of freedom: the two-sided p-value is
:math:`2\,P(T_{n-1} \ge |t|)`, and the :math:`1-\alpha` confidence interval of the mean difference is
:math:`\bar\delta \pm t_{1-\alpha/2,\,n-1}\, s_\delta/\sqrt n`. The sign test counts positive differences
among the non-zero ones; its two-sided p-value is the binomial one with probability 1/2.

scipy (for the t and binomial distributions) is imported inside the functions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["PairedStats", "paired_stats", "paired_from_mapping", "mean_ci", "describe", "compare_arms", "holm",
           "with_holm"]


@dataclass(frozen=True)
class PairedStats:
    """Result of :func:`paired_stats` (differences ``a - b``).

    ``t``, ``p_value``, ``ci_low`` and ``ci_high`` are ``None`` for fewer than two pairs, and ``t`` and
    ``p_value`` also when all differences are equal (zero spread: the t statistic is undefined).
    """

    n: int
    differences: tuple[float, ...]
    mean: float | None
    std: float | None
    sem: float | None
    t: float | None
    df: int | None
    p_value: float | None
    confidence: float
    ci_low: float | None
    ci_high: float | None
    n_positive: int
    n_negative: int
    n_zero: int
    sign_test_p: float | None
    labels: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        out = asdict(self)
        out["differences"] = list(self.differences)
        out["labels"] = list(self.labels)
        return out


def _clean(values: Sequence[float], name: str) -> list[float]:
    out = []
    for v in values:
        v = float(v)
        if not math.isfinite(v):
            raise ValueError(f"paired_stats: {name} holds a non-finite value {v!r}; drop that pair first.")
        out.append(v)
    return out


def paired_stats(a: Sequence[float], b: Sequence[float], *, confidence: float = 0.95,
                 labels: Sequence[str] = ()) -> PairedStats:
    r"""Paired t-test, confidence interval and sign test of ``a - b``.

    Parameters
    ----------
    a, b : sequence of float
        Paired values (same length, same order), e.g. the final accuracies of two arms per seed.
    confidence : float, default 0.95
        Level of the interval :math:`\bar\delta \pm t_{(1+c)/2,\,n-1}\, s_\delta/\sqrt n`.
    labels : sequence of str, optional
        A name per pair (e.g. the seeds), kept in the result.

    Returns
    -------
    PairedStats
        Mean, sample standard deviation (``ddof=1``) and standard error of the differences, the t statistic
        :math:`\bar\delta/(s_\delta/\sqrt n)` with ``n - 1`` degrees of freedom and its two-sided p-value, the
        interval, and the counts of positive/negative/zero differences with the two-sided sign-test p-value.
    """
    from scipy import stats

    a, b = _clean(a, "a"), _clean(b, "b")
    if len(a) != len(b):
        raise ValueError(f"paired_stats: a has {len(a)} values and b {len(b)}; pass one value per pair in each.")
    if not 0 < confidence < 1:
        raise ValueError(f"paired_stats: confidence={confidence!r} must be in (0, 1), e.g. 0.95.")
    if labels and len(labels) != len(a):
        raise ValueError(f"paired_stats: {len(labels)} labels for {len(a)} pairs; pass one label per pair.")
    d = [x - y for x, y in zip(a, b, strict=True)]
    n = len(d)
    pos, neg = sum(v > 0 for v in d), sum(v < 0 for v in d)
    nz = pos + neg
    sign_p = float(stats.binomtest(pos, nz, 0.5).pvalue) if nz else None
    mean = std = sem = t = p = lo = hi = None
    df = None
    if n:
        mean = sum(d) / n
    if n >= 2:
        df = n - 1
        std = math.sqrt(sum((v - mean) ** 2 for v in d) / df)
        sem = std / math.sqrt(n)
        half = float(stats.t.ppf(0.5 + confidence / 2, df)) * sem
        lo, hi = mean - half, mean + half
        if sem > 0:
            t = mean / sem
            p = float(2.0 * stats.t.sf(abs(t), df))
    return PairedStats(n=n, differences=tuple(d), mean=mean, std=std, sem=sem, t=t, df=df, p_value=p,
                       confidence=confidence, ci_low=lo, ci_high=hi, n_positive=pos, n_negative=neg,
                       n_zero=n - nz, sign_test_p=sign_p, labels=tuple(str(x) for x in labels))


def paired_from_mapping(a: Mapping[Any, float | None], b: Mapping[Any, float | None], *,
                        confidence: float = 0.95) -> PairedStats:
    """:func:`paired_stats` on the keys (e.g. seeds) present, with a value, in both mappings, in sorted order."""
    keys = sorted(k for k in a if k in b and a[k] is not None and b[k] is not None)
    return paired_stats([a[k] for k in keys], [b[k] for k in keys], confidence=confidence,
                        labels=[str(k) for k in keys])


def mean_ci(values: Sequence[float], *, confidence: float = 0.95) -> tuple[float | None, float | None, float | None]:
    r"""Mean and Student-t confidence interval :math:`\bar x \pm t_{(1+c)/2,\,n-1}\, s/\sqrt n` of ``values``
    (``(mean, None, None)`` for a single value, all ``None`` for none)."""
    s = paired_stats(values, [0.0] * len(values), confidence=confidence)
    return s.mean, s.ci_low, s.ci_high


def describe(values: Sequence[float | None]) -> dict[str, Any] | None:
    """``n``, ``min``, ``max``, ``median``, ``mean`` and sample ``std`` (``ddof=1``; ``None`` for one value) of the
    finite values (``None`` entries skipped); ``None`` when there are none."""
    vals = sorted(float(v) for v in values if v is not None and math.isfinite(float(v)))
    if not vals:
        return None
    n = len(vals)
    median = vals[n // 2] if n % 2 else 0.5 * (vals[n // 2 - 1] + vals[n // 2])
    mean = sum(vals) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else None
    return {"n": n, "min": vals[0], "max": vals[-1], "median": median, "mean": mean, "std": std}


def compare_arms(per_arm: Mapping[str, Mapping[Any, float | None]], arms: Sequence[str], *,
                 against: Sequence[str] = ("stiefel",), confidence: float = 0.95) -> dict[str, dict[str, Any]]:
    """Paired comparisons of one per-seed quantity between arms, as :meth:`PairedStats.to_dict` dicts.

    ``"<arm> - <baseline>"`` for every arm against the first of ``arms`` (the baseline), then
    ``"<a> - <arm>"`` for each ``a`` in ``against`` that ran and every other arm (e.g. the frozen frames' cost
    ``stiefel - stiefel-frozen``). Pairs are the seeds both arms ran with a value.
    """
    arms = [a for a in arms if a in per_arm]
    out: dict[str, dict[str, Any]] = {}
    if not arms:
        return out
    base = arms[0]
    for arm in arms[1:]:
        out[f"{arm} - {base}"] = paired_from_mapping(per_arm[arm], per_arm[base], confidence=confidence).to_dict()
    for a in against:
        if a not in per_arm:
            continue
        for arm in arms:
            if arm not in (a, base):
                out[f"{a} - {arm}"] = paired_from_mapping(per_arm[a], per_arm[arm], confidence=confidence).to_dict()
    return out


def holm(p_values: Sequence[float | None]) -> list[float | None]:
    r"""Holm's step-down adjustment of a family of p-values (``None`` entries are left out of the family).

    With the :math:`m` p-values sorted, :math:`p_{(1)} \le \dots \le p_{(m)}`, the adjusted values are
    :math:`\tilde p_{(i)} = \min\big(1, \max_{j \le i} (m - j + 1)\, p_{(j)}\big)`: rejecting where
    :math:`\tilde p < \alpha` keeps the family-wise error rate at most :math:`\alpha` (no assumption on the
    dependence between the tests). Returned in the order given.
    """
    present = sorted((float(p), i) for i, p in enumerate(p_values) if p is not None)
    m = len(present)
    out: list[float | None] = [None] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(present):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out


def with_holm(comparisons: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """``comparisons`` (:func:`compare_arms`) with ``p_holm`` and ``sign_test_p_holm`` added: the paired-t and
    sign-test p-values adjusted by :func:`holm` over the family of every comparison listed."""
    names = list(comparisons)
    t_adj = holm([comparisons[n].get("p_value") for n in names])
    s_adj = holm([comparisons[n].get("sign_test_p") for n in names])
    return {n: {**comparisons[n], "p_holm": t, "sign_test_p_holm": s}
            for n, t, s in zip(names, t_adj, s_adj, strict=True)}
