"""The manifold-Muon certificates (issues 41 and 56): each passes for StiefelMuon and fails for a column built to
break it (the cheap projected msign, the fixed-count solver StiefelMuon had before issue 56, torch's Muon on the
unconstrained matrix, deliberately broken optimizers)."""

import dataclasses
import math

import pytest
import torch
from conftest import fixed_count_direction

from geoopt_stiefel_attention import PolarStiefel, _linalg
from geoopt_stiefel_attention.analysis.muon import (
    DEFAULT_MUON_STEPS,
    DIRECTION_SHAPES,
    DRIFT_TOL_F32,
    MUON_ROWS,
    OPTIMALITY_TOL,
    MuonColumn,
    _stiefel_run,
    independent_direction_optimum,
    inverse_polar_retraction,
    muon_columns,
    run_muon_certificates,
)
from geoopt_stiefel_attention.optim import StiefelMuon

#: the inverse retraction recovers a tangent step to rounding (float64, measured 2e-16)
INVERSE_TOL = 1e-12
#: the drift runs at the length ``certify`` runs by default: torch's Muon, an unretracted step, must fail M4 and M5
#: there (test_companion_torch_muon_fails_tangency_drift_and_decay)
STEPS = DEFAULT_MUON_STEPS


@pytest.fixture(scope="module")
def certs():
    columns = [c for c in muon_columns() if c.name in ("StiefelMuon", "StiefelMuon (projected msign)", "torch Muon")]
    return {(c.name, c.optimizer): c for c in run_muon_certificates(columns, drift_steps=STEPS)}


def test_stiefel_muon_passes_every_row_with_the_direction_rows_on_square_and_near_square_frames(certs):
    failed = [row for row in MUON_ROWS if not certs[(row, "StiefelMuon")].passed]
    assert failed == []
    m1 = certs[(MUON_ROWS[0], "StiefelMuon")]
    assert m1.measured <= OPTIMALITY_TOL
    assert set(m1.details["optima"]) == {f"{d}x{r}" for _, d, r in DIRECTION_SHAPES}
    assert {"12x12", "9x9", "10x9", "12x11"} <= set(m1.details["optima"])


def _fixed_count_run(lr, dual_steps=10, ns_steps=8):
    """StiefelMuon's update with the direction of the fixed-count rule of 38fe98e (conftest), one step from zero
    momentum (momentum only rescales the first direction): W <- polar(W - lr sqrt(d/r) A)."""
    def run(w0, grads, *, weight_decay=0.0):
        d, r = w0.shape[-2:]
        w, out = w0.clone(), []
        for g in grads:
            a = fixed_count_direction(_linalg.proju(w, g), w, dual_steps, ns_steps)
            w = _linalg.polar_svd(w - lr * (d / r) ** 0.5 * a)
            out.append(w.clone())
        return out
    return run


def test_companion_the_fixed_count_solver_fails_optimality_on_the_near_square_frames():
    """The direction rows with the fixed-count rule StiefelMuon had before issue 56 (dual_steps=10, ns_steps=8):
    M1 fails (it is percents short on the near-square frames the rows now draw); on the r << d frames alone,
    which were the only ones drawn before, it passes at its stated 1e-3 and fails at StiefelMuon's tolerance."""
    lr = 1e-2
    column = dataclasses.replace(muon_columns()[0], name="fixed count", run=_fixed_count_run(lr), direction=None)
    cell = run_muon_certificates([column], drift_steps=2, rows=[MUON_ROWS[0]])[0]
    assert cell.passed is False and cell.measured > 1e-2
    w0 = PolarStiefel().random(3, 12, 4, dtype=torch.float64,
                               generator=torch.Generator().manual_seed(0)).as_subclass(torch.Tensor)
    g = torch.randn(3, 12, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    xi = _linalg.proju(w0, g)
    a = fixed_count_direction(xi, w0)
    value = (xi * a).sum((-2, -1)) / torch.linalg.matrix_norm(a, ord=2).clamp_min(1.0)
    short = max(1 - float(value[k]) / independent_direction_optimum(xi[k].numpy(), w0[k].numpy()) for k in range(3))
    assert OPTIMALITY_TOL < short < 1e-3


def test_companion_the_projected_msign_fails_optimality(certs):
    cert = certs[(MUON_ROWS[0], "StiefelMuon (projected msign)")]
    assert cert.passed is False and cert.measured > 1e-2


def test_companion_torch_muon_fails_tangency_drift_and_decay(certs):
    for row in (MUON_ROWS[1], MUON_ROWS[3], MUON_ROWS[4], MUON_ROWS[7]):
        assert certs[(row, "torch Muon")].passed is False, row


def _broken(name, transform_grad):
    """StiefelMuon fed transform_grad(G) instead of G: a deliberately broken optimizer."""
    base = _stiefel_run(lambda params, weight_decay: StiefelMuon(params, lr=1e-2, weight_decay=weight_decay,
                                                                  adjust_lr_fn="original"))

    def run(w0, grads, *, weight_decay=0.0):
        return base(w0, [transform_grad(g) for g in grads], weight_decay=weight_decay)

    column = muon_columns()[0]
    return dataclasses.replace(column, name=name, run=run)


def test_companion_a_step_with_a_fixed_bias_fails_equivariance_and_scale_freedom():
    """StiefelMuon fed G + F for a fixed matrix F: neither O(d) x O(r)-equivariant nor scale-free."""
    fixed = torch.randn(3, 12, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    shifted = dataclasses.replace(_broken("shifted", lambda g: g + fixed.to(g.dtype)), eta=None)
    cells = {c.name: c for c in run_muon_certificates([shifted], drift_steps=5)}
    assert cells[MUON_ROWS[5]].passed is False and cells[MUON_ROWS[6]].passed is False


def test_companion_an_optimizer_that_decays_frames_fails_decay_immunity():
    def run(w0, grads, *, weight_decay=0.0):
        out = muon_columns()[0].run(w0, grads, weight_decay=0.0)
        return [w * (1 - 1e-2 * weight_decay) for w in out]

    column = MuonColumn("decays", run, 1e-2, None, True, "frames shrunk by decay")
    cells = {c.name: c for c in run_muon_certificates([column], drift_steps=5)}
    assert cells[MUON_ROWS[7]].passed is False


def _msign(x):
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    return u @ vh


def _unprojected_msign_run(lr):
    """Steps along msign(G), not made tangent, then the polar retraction: on the manifold, wrong direction."""
    def run(w0, grads, *, weight_decay=0.0):
        w, out = w0.clone(), []
        for g in grads:
            w = PolarStiefel().projx(w - lr * 3 ** 0.5 * _msign(g))
            out.append(w.clone())
        return out
    return run


def test_tangency_is_read_from_the_direction_a_column_computes_not_from_its_iterates():
    """Row M2 of a column on the manifold reads the column's own direction: a solver that returns msign(xi)
    unprojected fails it. The step recovered from its iterates is tangent whatever it did (measured below), which
    is why a column on the manifold without a direction gets "not applicable" rather than a pass."""
    lr = 1e-2
    eta = lambda d, r: lr * (d / r) ** 0.5  # noqa: E731
    broken = MuonColumn("msign", _unprojected_msign_run(lr), lr, eta, True, "unprojected msign",
                        direction=lambda w, xi: _msign(xi + w))  # a normal part: not tangent
    cell = run_muon_certificates([broken], drift_steps=2, rows=[MUON_ROWS[1]])[0]
    assert cell.passed is False and cell.measured > 0.1
    blind = dataclasses.replace(broken, direction=None)
    cell = run_muon_certificates([blind], drift_steps=2, rows=[MUON_ROWS[1]])[0]
    assert cell.passed is None and "by construction" in cell.details["reason"]
    # the reason it is not applicable: the recovered step of the broken column is tangent to rounding
    w0 = PolarStiefel().random(3, 12, 4, dtype=torch.float64,
                               generator=torch.Generator().manual_seed(0)).as_subclass(torch.Tensor)
    g = torch.randn(3, 12, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    z = inverse_polar_retraction(w0, broken.run(w0, [g])[0])
    assert float((w0.mT @ z + z.mT @ w0).abs().max()) < INVERSE_TOL


def test_companion_the_library_solver_passes_tangency_through_its_direction(certs):
    for name in ("StiefelMuon", "StiefelMuon (projected msign)"):
        assert muon_columns()[0].direction is not None
        cell = certs[(MUON_ROWS[1], name)]
        assert cell.passed is True and cell.measured is not None, name


def test_inverse_polar_retraction_recovers_a_tangent_step():
    st = PolarStiefel()
    w = st.random(3, 9, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).as_subclass(torch.Tensor)
    z = 0.4 * st.proju(w, torch.randn_like(w))
    assert (inverse_polar_retraction(w, st.retr(w, z)) - z).abs().max() < INVERSE_TOL
    # companion: a step with a normal component is not what the inverse returns (it returns the tangent step
    # that reaches the same point)
    n = z + w @ torch.diag_embed(torch.full((3, 4), 0.3, dtype=torch.float64))
    assert (inverse_polar_retraction(w, st.retr(w, n)) - n).abs().max() > 1e-2


def test_columns_by_name_or_label_and_row_selection():
    from geoopt_stiefel_attention.analysis.muon import muon_column_by_name, select_muon_rows

    assert muon_column_by_name("SM msign").name == "StiefelMuon (projected msign)"
    assert muon_column_by_name("torch Muon").on_manifold is False
    with pytest.raises(KeyError, match="No Muon-table column named 'Nope'"):
        muon_column_by_name("Nope")
    assert select_muon_rows(["M"]) == MUON_ROWS
    assert select_muon_rows(["M8", "M1", "5"]) == (MUON_ROWS[0], MUON_ROWS[7])
    assert select_muon_rows(["5", "3a"]) == ()


def test_companion_iterates_that_turn_nan_fail_equivariance_scale_and_decay():
    """A run whose iterates are NaN after its first step: rows M6-M8 took the worst entry difference over the
    steps with max(), which kept the first (finite) step's figure and dropped every NaN after it, so they passed."""
    base = dataclasses.replace(_broken("healthy", lambda g: g), eta=None)

    def run(w0, grads, *, weight_decay=0.0):
        out = base.run(w0, grads[:1], weight_decay=weight_decay)
        return out + [torch.full_like(out[0], float("nan")) for _ in grads[1:]]

    nan_after_one = dataclasses.replace(base, name="nan after one step", run=run)
    rows = MUON_ROWS[5:]
    for column, passes in ((base, True), (nan_after_one, False)):  # companion first: the same step, no NaN
        cells = {c.name: c for c in run_muon_certificates([column], drift_steps=5, rows=rows)}
        assert [cells[row].passed for row in rows] == [passes] * len(rows), column.name
    assert all(math.isnan(cells[row].measured) for row in rows)


def test_a_drift_row_fails_when_the_run_comes_back_in_another_dtype():
    """Row M5 certifies float32: a column whose run upcasts to float64 measured a float64 drift (4e-16) and passed
    it as float32."""
    base = dataclasses.replace(_broken("healthy", lambda g: g), eta=None)

    def run64(w0, grads, *, weight_decay=0.0):
        return base.run(PolarStiefel().projx(w0.double()), [g.double() for g in grads], weight_decay=weight_decay)

    upcast = dataclasses.replace(base, name="upcasts to float64", run=run64)
    cell = run_muon_certificates([upcast], drift_steps=STEPS, rows=(MUON_ROWS[4],))[0]
    assert cell.passed is False and cell.measured < DRIFT_TOL_F32
    assert cell.details["dtype_of_iterates"] == "float64" and "not torch.float32" in cell.details["failure"]
    companion = run_muon_certificates([base], drift_steps=STEPS, rows=(MUON_ROWS[3], MUON_ROWS[4]))
    assert [c.passed for c in companion] == [True, True]
    assert [c.details["dtype_of_iterates"] for c in companion] == ["float64", "float32"]


def test_drift_runs_are_made_only_when_a_drift_row_is_asked_for():
    """--muon-steps is refused unless M4 or M5 is computed; the drift runs are skipped otherwise (they were made
    and thrown away)."""
    lengths = []
    base = dataclasses.replace(_broken("healthy", lambda g: g), eta=None)

    def run(w0, grads, *, weight_decay=0.0):
        lengths.append(len(grads))
        return base.run(w0, grads, weight_decay=weight_decay)

    counted = dataclasses.replace(base, run=run)
    run_muon_certificates([counted], drift_steps=STEPS, rows=(MUON_ROWS[6],))
    assert STEPS not in lengths and lengths
    lengths.clear()
    run_muon_certificates([counted], drift_steps=STEPS, rows=(MUON_ROWS[3],))  # companion
    assert lengths.count(STEPS) == 1  # the float64 run of M4, not the float32 one of M5
