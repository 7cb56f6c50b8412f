"""The start / constraint / step contrasts of the grokking arms (experiments.mechanism): paired statistics written
out here independently, the verdict rule, and the report's paragraph."""

from __future__ import annotations

import math

import pytest

from experiments.harness.mechanism import (
    CONTRASTS,
    VERDICTS,
    mechanism_lines,
    mechanism_summary,
    verdict,
)

EPOCH_TOL = 1e-9  # epochs: sums of small integers, exact up to rounding of the mean


def _summary(first_epochs: dict[str, dict[int, int | None]]) -> dict:
    return {"metric": "val_acc", "threshold": 0.95,
            "arms": {a: {"first_epoch_reaching": {"per_seed": {str(k): v for k, v in per.items()}}}
                     for a, per in first_epochs.items()}}


ADAMW = {0: 2000, 1: 2300, 2: 2100, 3: 2500, 4: 2200, 5: 2400}


def test_contrasts_pair_by_seed_and_name_the_question():
    frozen = {k: v - 500 + 10 * k for k, v in ADAMW.items()}           # always about 500 earlier
    ortho = {k: v + (40 if k % 2 else -40) for k, v in ADAMW.items()}   # no effect: signs alternate
    m = mechanism_summary(_summary({"adamw": ADAMW, "adamw-frozen": frozen, "adamw-orthostart": ortho}))
    by = {c["question"]: c for c in m["contrasts"]}
    assert set(by) == {"the start", "training W_Q, W_K at all"}  # only contrasts whose two arms ran
    diffs = [frozen[k] - ADAMW[k] for k in sorted(ADAMW)]
    mean = sum(diffs) / len(diffs)
    assert abs(by["training W_Q, W_K at all"]["mean"] - mean) < EPOCH_TOL and by["training W_Q, W_K at all"]["n"] == 6
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 5)
    assert by["training W_Q, W_K at all"]["t"] == pytest.approx(mean / (sd / math.sqrt(6)), rel=1e-12)
    assert by["training W_Q, W_K at all"]["verdict"] == "clear"
    # companion: an effect whose sign alternates is not called one
    assert by["the start"]["verdict"] == "not seen" and by["the start"]["n_negative"] == 3


def test_a_seed_that_never_reached_the_threshold_drops_out_of_its_pairs_and_few_pairs_are_said():
    frozen = {0: 1500, 1: None, 2: 1600}
    m = mechanism_summary(_summary({"adamw": {0: 2000, 1: 2300, 2: 2100}, "adamw-frozen": frozen}))
    c = m["contrasts"][0]
    assert c["n"] == 2 and c["labels"] == ["0", "2"] and c["verdict"] == "too few pairs"


def test_the_verdict_rule_in_order():
    base = {"n": 5, "p_holm": 0.2, "p_value": 0.2, "sign_test_p": 0.4, "n_positive": 3, "n_negative": 2}
    assert verdict(base) == "not seen"
    assert verdict({**base, "p_value": 0.01}) == "suggested"
    assert verdict({**base, "sign_test_p": 0.0625}) == "suggested"  # 5 of 5 pairs with one sign
    assert verdict({**base, "p_holm": 0.01, "p_value": 0.002}) == "clear"
    assert verdict({**base, "n": 2, "p_holm": 0.01}) == "too few pairs"
    # three or four pairs can only suggest, however small their spread
    assert verdict({**base, "n": 4, "p_holm": 0.01, "p_value": 0.002}) == "suggested"
    assert [w for w, _ in VERDICTS] == ["too few pairs", "clear", "suggested", "not seen"]


def test_the_paragraph_is_generated_from_the_summary_and_absent_without_contrast_arms():
    frozen = {k: v - 500 + 10 * k for k, v in ADAMW.items()}
    m = mechanism_summary(_summary({"adamw": ADAMW, "adamw-frozen": frozen}))
    text = "\n".join(mechanism_lines(m))
    assert "## Start, constraint or step?" in text
    assert "**training W_Q, W_K at all** (`adamw-frozen` − `adamw`" in text and ": clear (earlier)." in text
    assert all(why in text for _, why in VERDICTS)  # the rule is quoted from its one definition
    # companion: a study without any contrast's two arms has no such section
    assert mechanism_summary(_summary({"adamw": ADAMW, "stiefel": ADAMW})) is None
    assert mechanism_lines(None) == []
    assert {c.arm for c in CONTRASTS} | {c.against for c in CONTRASTS} == {
        "adamw", "adamw-orthostart", "adamw-frozen", "adamw-qk-nodecay", "stiefel", "stiefel-frozen"}
