"""What a null can say (issue 57, item 5): the power of the paired t-test and the minimum detectable difference
(:func:`experiments.harness.stats.paired_t_power`, :func:`~experiments.harness.stats.min_detectable_difference`),
in float64 against a written-out reference (the noncentral t's tail as an integral over the chi-square law of the
variance, by quadrature; its critical value solved from the same integral, so nothing of scipy.stats enters) and
against a simulation with a fixed seed, with the issue's figures and companion cases that must fail."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, optimize

from experiments.harness.stats import (
    min_detectable_difference,
    paired_t_power,
    with_detectable,
    with_holm,
)

#: the reference's quadrature agrees with scipy's noncentral t to about 1e-13 in a probability
POWER_TOL = 1e-10
#: two minimum detectable differences that must agree (each solved to a relative 1e-12 by Brent's method)
MDE_RTOL = 1e-7


def _phi(x: float) -> float:
    """The standard normal cdf, written out."""
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def _chi2_pdf(v: float, df: int) -> float:
    """The chi-square density with ``df`` degrees of freedom, written out."""
    if v <= 0:
        return 0.0
    k = df / 2.0
    return math.exp((k - 1) * math.log(v) - v / 2 - k * math.log(2.0) - math.lgamma(k))


def _reference_power(nc: float, crit: float, df: int) -> float:
    """P(T > crit) + P(T < -crit) for T = (Z + nc) / sqrt(V / df), Z standard normal, V chi-square(df):
    E_V[Phi(nc - crit sqrt(V/df)) + Phi(-nc - crit sqrt(V/df))], by quadrature over V."""
    def integrand(v: float) -> float:
        s = crit * math.sqrt(v / df)
        return (_phi(nc - s) + _phi(-nc - s)) * _chi2_pdf(v, df)

    mode = max(df - 2.0, 0.0)
    parts = [integrate.quad(integrand, lo, hi, epsabs=1e-12, epsrel=1e-10, limit=200)[0]
             for lo, hi in ((0.0, mode + 1.0), (mode + 1.0, mode + 40.0 + 10 * df))]
    tail = integrate.quad(integrand, mode + 40.0 + 10 * df, np.inf, epsabs=1e-12, limit=200)[0]
    return sum(parts) + tail


def _reference_crit(alpha: float, df: int) -> float:
    """The two-sided critical value of Student's t: the crit at which the reference power at nc = 0 is alpha."""
    return optimize.brentq(lambda c: _reference_power(0.0, c, df) - alpha, 1e-6, 1e6, xtol=1e-13, rtol=1e-14)


@pytest.mark.parametrize(("n", "difference", "sd", "alpha"), [
    (10, 0.02, 0.0228, 0.05), (10, 0.04, 0.0228, 0.05 / 48), (5, 0.01, 0.0105, 0.05), (3, 1.0, 0.4, 0.01),
    (20, -0.5, 1.0, 0.05),
])
def test_power_matches_the_written_out_noncentral_t(n, difference, sd, alpha):
    df = n - 1
    crit = _reference_crit(alpha, df)
    ref = _reference_power(abs(difference) * math.sqrt(n) / sd, crit, df)
    assert paired_t_power(difference, sd, n, alpha=alpha) == pytest.approx(ref, abs=POWER_TOL)
    # companion: no difference gives the level itself, not a power
    assert paired_t_power(0.0, sd, n, alpha=alpha) == pytest.approx(alpha, abs=POWER_TOL)


def test_the_issues_figures_and_the_reference_power_at_the_detectable_difference():
    """stiefel - adamw-qknorm (controls study): 10 pairs, sd 0.0228 -> 0.023 bpb at 80% power and alpha 0.05,
    0.042 at the Holm level 0.05 / 48 (the family of 48 comparisons); at each, the reference power is 0.8."""
    sd, n = 0.022816, 10
    for alpha, quoted in ((0.05, "0.023"), (0.05 / 48, "0.042")):
        mde = min_detectable_difference(sd, n, alpha=alpha, power=0.8)
        assert f"{mde:.3f}" == quoted
        crit = _reference_crit(alpha, n - 1)
        assert _reference_power(mde * math.sqrt(n) / sd, crit, n - 1) == pytest.approx(0.8, abs=POWER_TOL)
        # companion: the normal approximation is smaller, and at it the test has less than 80% power
        normal = min_detectable_difference(sd, n, alpha=alpha, power=0.8, method="normal")
        assert normal < mde and _reference_power(normal * math.sqrt(n) / sd, crit, n - 1) < 0.8 - 0.02
    # stiefeladam-muon - muon: 10 pairs, sd 0.0057: resolvable at 80% power from about 0.0057 bpb
    assert f"{min_detectable_difference(0.0057, 10):.4f}" == "0.0057"


def test_detectable_difference_by_simulation_with_a_fixed_seed():
    """20,000 paired t-tests of 10 normal differences with mean the minimum detectable difference reject at
    alpha 0.05 with frequency 0.8 (within 4 standard errors); companion: at half of it, far less often."""
    from scipy import stats

    rng = np.random.default_rng(57)
    sd, n, trials = 1.0, 10, 20_000
    mde = min_detectable_difference(sd, n)
    crit = float(stats.t.ppf(0.975, n - 1))

    def rate(mean: float) -> float:
        d = rng.normal(mean, sd, size=(trials, n))
        t = d.mean(axis=1) / (d.std(axis=1, ddof=1) / math.sqrt(n))
        return float(np.mean(np.abs(t) > crit))

    se = math.sqrt(0.8 * 0.2 / trials)
    assert abs(rate(mde) - 0.8) < 4 * se
    assert rate(mde / 2) < 0.8 - 20 * se


def test_detectable_difference_scales_with_sd_and_is_undefined_without_spread():
    base = min_detectable_difference(1.0, 8)
    assert min_detectable_difference(3.0, 8) == pytest.approx(3 * base, rel=MDE_RTOL)
    assert min_detectable_difference(1.0, 32) < base / 1.9  # about 1/sqrt(n)
    assert min_detectable_difference(None, 8) is None and min_detectable_difference(0.0, 8) is None
    assert min_detectable_difference(1.0, 1) is None and min_detectable_difference(float("nan"), 8) is None
    # two pairs at a tiny level: far in the noncentral t's tail, still solved (the power there is 0.8)
    far = min_detectable_difference(1.0, 2, alpha=1e-4)
    assert paired_t_power(far, 1.0, 2, alpha=1e-4) == pytest.approx(0.8, abs=1e-9)


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"alpha": 0.0}, "alpha=0.0 must be in (0, 1)"), ({"power": 1.0}, "power=1.0 must be in (0, 1)"),
    ({"power": 0.04}, "power=0.04 must exceed alpha=0.05"), ({"method": "exact"}, "method='exact'"),
])
def test_bad_options_name_the_parameter(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        min_detectable_difference(1.0, 10, **kwargs)
    with pytest.raises(ValueError, match="n=1 must be an int >= 2"):
        paired_t_power(0.1, 1.0, 1)


def test_with_detectable_uses_the_family_for_the_holm_level():
    comps = with_holm({"a": {"n": 10, "std": 0.022816, "p_value": 0.55, "sign_test_p": 1.0},
                       "b": {"n": 10, "std": 0.0057, "p_value": 0.011, "sign_test_p": 0.1},
                       "c": {"n": 1, "std": None, "p_value": None, "sign_test_p": None}})
    out = with_detectable(comps)
    a = out["a"]["detectable"]
    assert a["family"] == 2 and a["holm_alpha"] == pytest.approx(0.025) and a["method"] == "noncentral t"
    assert a["difference"] == pytest.approx(min_detectable_difference(0.022816, 10), rel=MDE_RTOL)
    assert a["holm_difference"] == pytest.approx(min_detectable_difference(0.022816, 10, alpha=0.025), rel=MDE_RTOL)
    assert out["c"]["detectable"]["difference"] is None and out["a"]["p_holm"] == comps["a"]["p_holm"]
    # companion: the stricter level needs a larger difference
    assert a["holm_difference"] > a["difference"]
