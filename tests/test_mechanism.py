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


# ---------------------------------------------------------------------------------------------- one machine kind per pair
INTEL, AMD = "Intel(R) Xeon(R) Processor", "AMD EPYC"


def _write_run(out, folder, arm, seed, grok_at, *, machine, commit="1111111aaaa", epochs=100, p=7, w_q=(10.0, 10.0)):
    """One run folder as a study leaves it: config.json, environment.json (one call on ``machine``) and metrics.jsonl
    with val_acc reaching 0.99 at ``grok_at`` and ‖W_Q‖_F going linearly from ``w_q[0]`` to ``w_q[1]``; a run whose
    last epoch is below ``epochs`` is an unfinished one."""
    import json

    from experiments.grokking.study import GrokkingConfig
    from experiments.harness import to_dict
    from experiments.harness.config import RunSpec, TrainConfig

    run = out / folder / arm / f"seed{seed}"
    run.mkdir(parents=True)
    cfg = GrokkingConfig(p=p, train=TrainConfig(epochs=100, eval_every=10))
    (run / "config.json").write_text(json.dumps(to_dict(RunSpec(cfg, arm, seed))))
    (run / "environment.json").write_text(json.dumps([{
        "start_epoch": 0, "end_epoch": epochs, "seconds": 1.0, "device": "cpu", "cpu_model": machine,
        "torch_threads": 1, "torch": "x", "git_sha": commit, "git_dirty": False}]))
    lines = []
    for e in range(0, epochs + 1, 10):
        norm = w_q[0] + (w_q[1] - w_q[0]) * e / 100
        lines.append(json.dumps({"experiment": "grokking", "arm": arm, "seed": seed, "epoch": e, "step": e,
                                 "train_acc": 1.0, "val_acc": 0.99 if e >= grok_at else 0.1, "train_loss": 0.1,
                                 "val_loss": 1.0, "norm/blocks.0.attn.w_q": norm, "move_total/q": abs(norm - w_q[0]),
                                 "angle_max_deg/q": 0.5 * e if arm != "adamw-frozen" else 0.0}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


#: first epoch at 95% per seed: the study's own runs (adamw, adamw-frozen on Intel; the new arm on AMD) and the
#: runs retrained on AMD
OWN = {"adamw": (INTEL, [50, 60, 50, 70]), "adamw-frozen": (INTEL, [30, 40, 30, 50]),
       "adamw-qk-nodecay": (AMD, [70, 80, 70, 90])}
RETRAINED = {"adamw": [60, 60, 40], "adamw-frozen": [40, 40, 30, 60]}


def _mixed_study(out):
    """Seeds 0-3 of three arms on two CPU kinds, with retrained runs on the new arm's kind: ``adamw`` seeds 0-2
    (seed 3 is unfinished), ``adamw-frozen`` seeds 0-3 (seed 3 on a third CPU kind)."""
    for arm, (machine, firsts) in OWN.items():
        for seed, at in enumerate(firsts):
            _write_run(out, "runs", arm, seed, at, machine=machine, commit="2222222bbbb" if machine == AMD else "1111111aaaa")
    for seed, at in enumerate(RETRAINED["adamw"]):
        _write_run(out, "repro" if seed < 2 else "same_cpu", "adamw", seed, at, machine=AMD, commit="2222222bbbb")
    _write_run(out, "same_cpu", "adamw", 3, 60, machine=AMD, commit="2222222bbbb", epochs=50)  # not finished
    for seed, at in enumerate(RETRAINED["adamw-frozen"]):
        _write_run(out, "same_cpu", "adamw-frozen", seed, at, machine=AMD if seed < 3 else "Other CPU",
                   commit="2222222bbbb")
    return out


def _summary_of(out):
    from experiments.harness.records import load_study_records, summarize

    return summarize(load_study_records(out))


def test_contrasts_pair_runs_of_one_cpu_kind_from_the_folders_and_keep_the_cross_cpu_one_apart(tmp_path):
    from experiments.harness.mechanism import study_runs
    from experiments.harness.stats import holm, paired_stats

    out = _mixed_study(tmp_path / "study")
    summary = _summary_of(out)
    runs, left_out = study_runs(out, summary)
    assert left_out == ["same_cpu/adamw/seed3 (last epoch 50, the study's adamw runs end at 100)"]
    m = mechanism_summary(summary, runs, left_out=left_out)
    by = {c["question"]: c for c in m["contrasts"]}
    decay, trained, frozen = by["weight decay on W_Q, W_K"], by["training W_Q, W_K without decay"], \
        by["training W_Q, W_K at all"]
    # decay on W_Q/W_K: the new arm (AMD) against adamw retrained on AMD, seeds 0-2; seed 3 has no AMD adamw run
    assert decay["pairs"] == {"0": ["runs/adamw-qk-nodecay/seed0", "repro/adamw/seed0"],
                              "1": ["runs/adamw-qk-nodecay/seed1", "repro/adamw/seed1"],
                              "2": ["runs/adamw-qk-nodecay/seed2", "same_cpu/adamw/seed2"]}
    assert decay["differences"] == [70 - 60, 80 - 60, 70 - 40] and decay["unpaired_seeds"] == [3]
    assert decay["machines"] == [AMD] and decay["commits"] == ["2222222"]
    # training without decay: adamw-frozen retrained on AMD against the new arm; seed 3's retrained run is on a
    # third CPU kind and is refused, as is the study's own Intel run of that seed
    assert trained["differences"] == [40 - 70, 40 - 80, 30 - 70] and trained["unpaired_seeds"] == [3]
    assert all(a.startswith("same_cpu/adamw-frozen/") for a, _ in trained["pairs"].values())
    # both keep the by-seed contrast of the study's own runs across CPU kinds, apart (no Holm, no verdict)
    assert decay["cross_machine"]["differences"] == [20.0, 20.0, 20.0, 20.0]
    assert decay["cross_machine"]["machines"] == [f"{AMD} × {INTEL}"] and "p_holm" not in decay["cross_machine"]
    # a contrast whose own runs share a CPU kind stays on them, with no cross-CPU twin
    assert frozen["differences"] == [-20.0] * 4 and set(frozen["pairs"]["0"]) == {"runs/adamw-frozen/seed0",
                                                                               "runs/adamw/seed0"}
    assert "cross_machine" not in frozen and frozen["machines"] == [INTEL]
    # Holm over the family of the contrasts present, on the same-CPU p-values
    ps = [c["p_value"] for c in m["contrasts"]]
    assert [c["p_holm"] for c in m["contrasts"]] == holm(ps)
    assert decay["p_value"] == paired_stats([70, 80, 70], [60, 60, 40]).p_value
    assert decay["verdict"] == "not seen"  # t p 0.074, sign test p 0.25 (three pairs can at most suggest)
    sources = {(s["folder"], s["arm"]): s for s in m["runs"]}
    assert sources[("repro", "adamw")]["first_epoch"] == {"0": 60, "1": 60}
    assert sources[("same_cpu", "adamw-frozen")]["machines"] == [AMD, "Other CPU"]


def test_runs_of_different_cpu_kinds_are_never_paired():
    from experiments.harness.mechanism import UNRECORDED, Run, pair_by_machine, run_machine

    a = Run("runs", "adamw-qk-nodecay", 0, 70, AMD)
    intel, amd = Run("runs", "adamw", 0, 50, INTEL), Run("same_cpu", "adamw", 0, 60, AMD)
    assert pair_by_machine([a], [intel]) is None  # refused: another CPU kind
    assert pair_by_machine([a], [intel, amd]) == (a, amd)
    assert pair_by_machine([intel], [Run("runs", "adamw-frozen", 0, 30, INTEL), amd])[1].folder == "runs"  # own first
    mixed = Run("runs", "adamw", 0, 50, None)  # a run resumed on another CPU kind pairs with none
    assert pair_by_machine([mixed], [mixed]) is None
    assert run_machine([{"device": "cpu", "cpu_model": AMD}, {"device": "cpu", "cpu_model": INTEL}]) is None
    assert run_machine([{"device": "cpu"}]) == UNRECORDED == run_machine([])
    assert run_machine([{"device": "cuda", "device_name": "H100", "cpu_model": AMD}]) == "H100"


def test_without_a_same_cpu_pair_a_contrast_has_none_and_says_so(tmp_path):
    """Companion: the same study without the retrained runs: the two contrasts of the new arm would only pair
    across CPU kinds, so they have no pairs (too few), their seeds are listed, and the cross-CPU contrast is shown
    only as the labelled comparison."""
    from experiments.harness.mechanism import study_runs

    out = tmp_path / "study"
    for arm, (machine, firsts) in OWN.items():
        for seed, at in enumerate(firsts):
            _write_run(out, "runs", arm, seed, at, machine=machine)
    summary = _summary_of(out)
    m = mechanism_summary(summary, *study_runs(out, summary)[:1])
    decay = next(c for c in m["contrasts"] if c["arm"] == "adamw-qk-nodecay")
    assert decay["n"] == 0 and decay["pairs"] == {} and decay["unpaired_seeds"] == [0, 1, 2, 3]
    assert decay["verdict"] == "too few pairs" and decay["cross_machine"]["n"] == 4
    text = "\n".join(mechanism_lines(m))
    assert "| weight decay on W_Q, W_K | 0 | – | – | – | – | 0–3 |" in text
    assert "**For comparison only, across machine kinds** (not in the Holm family, no verdict)" in text
    assert f"- weight decay on W_Q, W_K (`adamw-qk-nodecay` − `adamw`, {AMD} × {INTEL}): +20 epochs over 4 pair(s)" \
        in text


def test_the_section_names_the_runs_each_contrast_pairs(tmp_path):
    from experiments.harness.mechanism import study_runs

    out = _mixed_study(tmp_path / "study")
    summary = _summary_of(out)
    runs, left_out = study_runs(out, summary)
    text = "\n".join(mechanism_lines(mechanism_summary(summary, runs, left_out=left_out)))
    assert ("| weight decay on W_Q, W_K | 3 | `runs/adamw-qk-nodecay/` seeds 0–2 | `repro/adamw/` seeds 0, 1; "
            f"`same_cpu/adamw/` seeds 2 | {AMD} | 2222222 | 3 |") in text
    assert f"| training W_Q, W_K at all | 4 | `runs/adamw-frozen/` seeds 0–3 | `runs/adamw/` seeds 0–3 | {INTEL} |" in text
    assert "Runs in those folders not used: same_cpu/adamw/seed3 (last epoch 50" in text


def test_w_q_over_training_shows_shrinkage_movement_and_rotation_apart():
    from experiments.harness.mechanism import w_q_over_training
    from experiments.harness.records import w_q_norm

    def rec(arm, seed, epoch, norm, move, angle):
        return {"arm": arm, "seed": seed, "epoch": epoch, "step": epoch, "norm/blocks.0.attn.w_q": norm,
                "norm/blocks.0.attn.w_k": 99.0, "move_total/q": move, "angle_max_deg/q": angle}

    records = [rec("adamw", s, e, n0 * 0.5 ** (e / 1000), n0 * (1 - 0.5 ** (e / 1000)), 10.0 * e / 1000)
               for s, n0 in ((0, 10.0), (1, 12.0), (2, 11.0)) for e in range(0, 3001, 500)]
    records += [rec("adamw-qk-nodecay", s, e, 11.0, 0.001 * e, 20.0 * e / 1000) for s in (0, 1) for e in (0, 1500, 3000)]
    w = w_q_over_training(records, decay=(1e-3, 1.0))
    assert w["epochs"] == [0, 1000, 2000, 3000]
    norm = w["arms"]["adamw"]["norm"]
    assert [d["median"] for d in norm] == pytest.approx([11.0, 5.5, 2.75, 1.375])
    assert (norm[1]["min"], norm[1]["max"]) == pytest.approx((5.0, 6.0))
    assert w["arms"]["adamw"]["angle"][3]["median"] == pytest.approx(30.0)
    # the new arm is read at its last evaluation at or before each epoch (1,000 -> its evaluation at 0)
    assert [d["median"] for d in w["arms"]["adamw-qk-nodecay"]["move"]] == pytest.approx([0.0, 0.0, 1.5, 3.0])
    assert w["decay_alone"]["values"] == pytest.approx([11.0 * 0.999 ** e for e in (0, 1000, 2000, 3000)])
    # ‖W_Q‖_F over layers is the root sum of squares of the W_Q matrices only
    assert w_q_norm({"norm/blocks.0.attn.w_q": 3.0, "norm/blocks.1.attn.w_q": 4.0, "norm/blocks.0.attn.w_k": 7.0}) == 5.0
    # companion: records without any W_Q norm give no table
    assert w_q_over_training([{"arm": "a", "seed": 0, "epoch": 0, "val_acc": 0.1}]) is None


def test_report_only_picks_up_retrained_runs_from_the_folders_and_new_seeds_on_a_rebuild(tmp_path):
    import json

    from experiments.cli import main

    out = _mixed_study(tmp_path / "study")
    assert main(["grokking", "--report-only", "--out", str(out)]) == 0  # no flag names the folders
    mech = json.loads((out / "summary.json").read_text())["summary"]["mechanism"]
    decay = next(c for c in mech["contrasts"] if c["question"] == "weight decay on W_Q, W_K")
    assert mech["paired_by"] == "machine" and decay["n"] == 3 and decay["unpaired_seeds"] == [3]
    report = (out / "report.md").read_text()
    assert "| contrast | pairs | arm's runs | against's runs | machine | commits | seeds without a pair |" in report
    assert "### W_Q over training: shrinkage, movement, rotation" in report and (out / "w_q_norm_movement.png").exists()
    assert report.count("## Start, constraint or step?") == 1
    # seed 3 of adamw is retrained on AMD: the next rebuild pairs it
    import shutil

    shutil.rmtree(out / "same_cpu" / "adamw" / "seed3")
    _write_run(out, "same_cpu", "adamw", 3, 60, machine=AMD, commit="2222222bbbb")
    assert main(["grokking", "--report-only", "--out", str(out)]) == 0
    mech = json.loads((out / "summary.json").read_text())["summary"]["mechanism"]
    decay = next(c for c in mech["contrasts"] if c["question"] == "weight decay on W_Q, W_K")
    assert decay["n"] == 4 and decay["unpaired_seeds"] == [] and decay["differences"][-1] == 90 - 60
    assert mech["left_out"] == []


def test_the_generic_table_says_when_the_arms_own_runs_cross_machine_kinds(tmp_path):
    """The new arm's own runs are on AMD, the others' on Intel: the report says so under the paired-comparisons
    table, once (a rebuild does not repeat it). Companion: with every arm's own runs on one kind, no note."""
    from experiments.cli import main
    from experiments.harness.mechanism import PAIRED_HEADING, cross_machine_note, study_runs

    out = _mixed_study(tmp_path / "study")
    for _ in range(2):
        assert main(["grokking", "--report-only", "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    note = cross_machine_note(study_runs(out, _summary_of(out))[0])
    assert note is not None and report.count(note) == 1 and PAIRED_HEADING + note in report
    assert f"`adamw`, `adamw-frozen` on {INTEL}; `adamw-qk-nodecay` on {AMD}" in note
    # companion: the same study with the new arm's own runs on Intel has no such note
    same = tmp_path / "same"
    for arm, (_, firsts) in OWN.items():
        for seed, at in enumerate(firsts):
            _write_run(same, "runs", arm, seed, at, machine=INTEL, commit="1111111aaaa")
    assert cross_machine_note(study_runs(same, _summary_of(same))[0]) is None
    assert main(["grokking", "--report-only", "--out", str(same)]) == 0
    assert "compares across them" not in (same / "report.md").read_text()
