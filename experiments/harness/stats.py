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

**What a null can say** (:func:`paired_t_power`, :func:`min_detectable_difference`). A comparison that is not
resolved is not evidence of sameness: the interval says which differences the data leave open, and the *minimum
detectable difference* says how large a true difference must be for the study to resolve it. For a true mean
difference :math:`\delta` and differences of standard deviation :math:`\sigma`, the statistic :math:`t` follows
the noncentral t distribution with :math:`n - 1` degrees of freedom and noncentrality
:math:`\lambda = \delta\sqrt n/\sigma`, so the power of the two-sided test at level :math:`\alpha` is

.. math::

    \pi(\delta) = P(T_{n-1,\lambda} > t_c) + P(T_{n-1,\lambda} < -t_c), \qquad t_c = t_{1-\alpha/2,\,n-1},

and the minimum detectable difference at power :math:`\beta` is the :math:`\delta > 0` with
:math:`\pi(\delta) = \beta`. The normal approximation replaces both t distributions by normal ones:
:math:`\delta = (z_{1-\alpha/2} + z_\beta)\,\sigma/\sqrt n` (smaller: it ignores that :math:`\sigma` is
estimated). Computed with the sample :math:`s_\delta` for :math:`\sigma`, it is the effect the study could have
detected at the spread it found (a planning figure, not a bound on the true difference).

scipy (for the t and binomial distributions) is imported inside the functions.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["PairedStats", "paired_stats", "paired_from_mapping", "mean_ci", "describe", "compare_arms", "holm",
           "with_holm", "DETECTABLE_METHODS", "paired_t_power", "min_detectable_difference", "with_detectable"]

#: How :func:`min_detectable_difference` computes the power: the noncentral t (exact for normal differences) or
#: the normal approximation.
DETECTABLE_METHODS = {"noncentral-t": "noncentral t", "normal": "normal approximation"}


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


def _check_level(name: str, value: float, fix: str) -> float:
    value = float(value)
    if not 0 < value < 1:
        raise ValueError(f"{name}={value!r} must be in (0, 1), {fix}.")
    return value


def paired_t_power(difference: float, sd: float, n: int, *, alpha: float = 0.05) -> float:
    r"""Power of the two-sided paired t-test of ``n`` pairs at level ``alpha`` against a true mean difference.

    Parameters
    ----------
    difference : float
        The true mean difference :math:`\delta` (its sign does not matter: the test is two-sided).
    sd : float
        The standard deviation :math:`\sigma > 0` of the differences.
    n : int
        The number of pairs, at least 2.
    alpha : float, default 0.05
        The test's level.

    Returns
    -------
    float
        :math:`\pi(\delta) = P(T_{n-1,\lambda} > t_c) + P(T_{n-1,\lambda} < -t_c)` with
        :math:`\lambda = |\delta|\sqrt n/\sigma` and :math:`t_c = t_{1-\alpha/2,\,n-1}` (module docstring);
        the lower tail is computed as :math:`P(T_{n-1,-\lambda} > t_c)`, which scipy evaluates where its
        ``cdf`` far in the tail does not.
    """
    import numpy as np
    from scipy import stats

    alpha = _check_level("alpha", alpha, "e.g. 0.05")
    if int(n) != n or n < 2:
        raise ValueError(f"paired_t_power: n={n!r} must be an int >= 2 (a t-test needs two pairs).")
    if not (math.isfinite(sd) and sd > 0) or not math.isfinite(difference):
        raise ValueError(f"paired_t_power: sd={sd!r} must be finite and > 0 and difference={difference!r} finite.")
    df = int(n) - 1
    crit = float(stats.t.ppf(1 - alpha / 2, df))
    nc = abs(float(difference)) * math.sqrt(n) / float(sd)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # scipy's series warnings far in a tail: checked below
        upper, lower = float(stats.nct.sf(crit, df, nc)), float(stats.nct.sf(crit, df, -nc))
    if not (math.isfinite(upper) and math.isfinite(lower)):
        raise ArithmeticError(f"paired_t_power: scipy's noncentral t gave no finite tail at df={df}, "
                              f"noncentrality {nc:g}, critical value {crit:g}.")
    return min(1.0, upper + lower)


def min_detectable_difference(sd: float | None, n: int, *, alpha: float = 0.05, power: float = 0.8,
                              method: str = "noncentral-t") -> float | None:
    r"""The smallest true mean difference a two-sided paired t-test of ``n`` pairs resolves with probability
    ``power`` at level ``alpha``, for differences of standard deviation ``sd``.

    Parameters
    ----------
    sd : float or None
        The standard deviation of the differences (the sample one, ``ddof=1``, for a study's figure).
    n : int
        The number of pairs.
    alpha : float, default 0.05
        The level (e.g. 0.05 unadjusted, or a Holm level such as 0.05 / m).
    power : float, default 0.8
        The power asked for, in (``alpha``, 1).
    method : {"noncentral-t", "normal"}, default "noncentral-t"
        :data:`DETECTABLE_METHODS`: solve :math:`\pi(\delta) = \beta` with :func:`paired_t_power` (Brent's
        method on the noncentrality, to a relative tolerance of 1e-12), or the normal approximation
        :math:`(z_{1-\alpha/2} + z_\beta)\,\sigma/\sqrt n`.

    Returns
    -------
    float or None
        The difference :math:`\delta > 0` (module docstring), in the units of ``sd``; ``None`` for fewer than two
        pairs or an ``sd`` that is ``None``, zero or not finite (no spread: the t statistic is undefined).
    """
    from scipy import optimize, stats

    if method not in DETECTABLE_METHODS:
        raise ValueError(f"min_detectable_difference: method={method!r}; use one of {', '.join(DETECTABLE_METHODS)}.")
    alpha = _check_level("alpha", alpha, "e.g. 0.05")
    power = _check_level("power", power, "e.g. 0.8")
    if power <= alpha:
        raise ValueError(f"min_detectable_difference: power={power!r} must exceed alpha={alpha!r} (a test at "
                         f"level alpha already rejects with probability alpha when there is no difference).")
    if sd is None or not math.isfinite(sd) or sd <= 0 or n < 2:
        return None
    se = float(sd) / math.sqrt(n)
    z = float(stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power))
    if method == "normal":
        return z * se
    crit = float(stats.t.ppf(1 - alpha / 2, n - 1))

    def short(nc: float) -> float:
        return paired_t_power(nc * se, sd, n, alpha=alpha) - power

    high = max(z, crit) + 1.0  # a first guess; doubled until the power there reaches the target (it rises with nc)
    while short(high) < 0:
        high *= 2
    nc = optimize.brentq(short, 0.0, high, xtol=1e-14, rtol=1e-12)
    return nc * se


def with_detectable(comparisons: Mapping[str, Mapping[str, Any]], *, alpha: float = 0.05, power: float = 0.8,
                    method: str = "noncentral-t") -> dict[str, dict[str, Any]]:
    r"""``comparisons`` (:func:`with_holm`) with ``detectable`` added to each: the minimum detectable difference
    (:func:`min_detectable_difference`, from the comparison's ``n`` and ``std``) at ``alpha`` and at the Holm
    level :math:`\alpha/m`, :math:`m` the comparisons of the family with a p-value (Holm's first and strictest
    step: a comparison whose p falls below it is resolved whatever the others show).

    Parameters
    ----------
    comparisons : mapping
        Name -> paired statistics (:meth:`PairedStats.to_dict`), the whole family.
    alpha, power : float
        The unadjusted level and the power.
    method : str
        :data:`DETECTABLE_METHODS`.

    Returns
    -------
    dict
        The comparisons, each with ``detectable = {"power", "method", "alpha", "difference", "holm_alpha",
        "holm_difference", "family"}`` (``difference`` ``None`` where it is undefined).
    """
    m = sum(c.get("p_value") is not None for c in comparisons.values())
    holm_alpha = alpha / m if m else None
    out = {}
    for name, c in comparisons.items():
        sd, n = c.get("std"), int(c.get("n") or 0)
        out[name] = {**c, "detectable": {
            "power": power, "method": DETECTABLE_METHODS[method], "alpha": alpha,
            "difference": min_detectable_difference(sd, n, alpha=alpha, power=power, method=method),
            "holm_alpha": holm_alpha, "family": m,
            "holm_difference": None if holm_alpha is None else min_detectable_difference(
                sd, n, alpha=holm_alpha, power=power, method=method)}}
    return out
