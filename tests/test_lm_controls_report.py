"""Tests of the controls study's report (issue 42, :mod:`experiments.lm.controls_report`): the stable lr range and
its divergence rule, the spikes of the every-step records, the figures, the final comparisons (paired t, sign test,
Holm) against three baselines, ``--report-only`` on a controls folder, and the README paragraph against
``summary.json``. Built on synthetic record folders; each property test has a companion case that must fail."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
from conftest import TINY_LM_FLAGS

from experiments.harness.config import OptimConfig, RunSpec, TrainConfig, to_dict
from experiments.lm import controls_report as cr
from experiments.lm import tuned
from experiments.lm.study import LMConfig

ROOT = Path(__file__).resolve().parents[1]
STAT_TOL = 1e-9
ARMS = cr.CONTROL_ARMS
#: each arm's best lr on the synthetic grid
BEST = {"adamw": 1e-2, "adamw-qknorm": 1e-2, "muon": 3e-2, "stiefel": 1e-2, "stiefeladam-muon": 1e-2,
        "stiefelmuon-muon": 1e-2}
#: synthetic final test bpb per arm (seed s adds a seed-dependent wobble): stiefel clearly below adamw-qknorm
FINAL_BASE = {"adamw": 2.00, "adamw-qknorm": 1.96, "muon": 1.70, "stiefel": 1.90, "stiefeladam-muon": 1.69,
              "stiefelmuon-muon": 1.71}
FINAL_SEEDS = range(1, 11)
STEPS_PER_EPOCH, EPOCHS = 100, 2
LAYERS = 2


def _write_run(folder: Path, config: LMConfig, arm: str, seed: int, records: list[dict],
               steps: list[dict] | None = None) -> Path:
    run = folder / "runs" / arm / f"seed{seed}"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(to_dict(RunSpec(config, arm, seed)), indent=2, sort_keys=True))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"arm": arm, "seed": seed, **r}) + "\n" for r in records))
    (run / "environment.json").write_text(json.dumps([{"git_sha": "b" * 40, "git_dirty": False, "device": "cpu",
                                                       "cpu_model": "test CPU", "torch_threads": 1, "torch": "x",
                                                       "start_epoch": 0, "end_epoch": EPOCHS, "seconds": 10.0}]))
    if steps is not None:
        (run / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    return run


def _steps(arm: str, seed: int, *, spike_at: int | None = None, nan_from: int | None = None) -> list[dict]:
    """A smooth run: loss falling from ln 256 towards 1.2 with a small seeded wobble, the gradient norm falling,
    per layer a largest logit that grows to an arm-specific level and an entropy that falls; a doubled loss and a
    tenfold gradient norm for 3 steps from ``spike_at``; NaN from ``nan_from``."""
    top = {"adamw": 40.0, "adamw-qknorm": 8.0, "muon": 15.0}.get(arm, 5.0)
    out = []
    for t in range(STEPS_PER_EPOCH * EPOCHS):
        wobble = 0.01 * math.sin(1.7 * t + seed)
        loss = 1.2 + (math.log(256) - 1.2) * math.exp(-t / 30) + wobble
        grad = 0.5 + 2.0 * math.exp(-t / 50) + 0.01 * math.cos(t + seed)
        if spike_at is not None and spike_at <= t < spike_at + 3:
            loss, grad = 2 * loss, 10 * grad
        if nan_from is not None and t >= nan_from:
            loss = grad = float("nan")
        logits = [top * (1 - math.exp(-t / 60)) * (1 + 0.5 * k) + 1 + 0.01 * seed for k in range(LAYERS)]
        ent = [0.5 + 2.0 * math.exp(-t / 80) + 0.1 * k for k in range(LAYERS)]
        out.append({"step": t, "loss": loss, "grad_norm": grad, "logit_max": logits, "entropy_min": ent})
    return out


def _bowl(arm: str, lr: float, seed: int) -> float:
    return 2.0 + abs(math.log(lr / BEST[arm])) / 10 + 0.002 * seed


@pytest.fixture()
def controls(tmp_path):
    """A controls study written by hand: every arm's grid at 3 lrs around its best plus ×√3 each side (seed 0),
    adamw diverging at 3e-2 (val bpb 3.5) and muon at 9e-2 (non-finite loss and val bpb), a warm-up grid (40 steps
    against the study's 10) of adamw and adamw-qknorm at the three lrs around their optimum (40 slightly better), a final cell of 10 seeds
    with every-step records (adamw seed 3 with one loss spike at step 150), and a timing file."""
    out = tmp_path / "controls"
    base = LMConfig(corpus_root="/nowhere", test_fraction=0.1, steps_per_epoch=STEPS_PER_EPOCH,
                    train=TrainConfig(epochs=EPOCHS), warmup_fraction=0.05,
                    optim=OptimConfig(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
                    corpus_identity={"source": "fake", "sha256": "0" * 64, "licence": "PSF License Agreement"})
    r3 = math.sqrt(3)
    for arm, best in BEST.items():
        for lr in (best / 3, best / r3, best, best * r3, best * 3):
            val = _bowl(arm, lr, 0)
            nan_from = None
            if arm == "adamw" and lr == best * 3:
                val = 3.5
            if arm == "muon" and lr == best * 3:
                val, nan_from = float("nan"), 120
            _write_run(out / f"lr-{lr:g}", tuned.with_lr(base, lr), arm, 0,
                       [{"epoch": 0, "val_bpb": 8.0}, {"epoch": EPOCHS, "val_bpb": val, "test_bpb": -1.0}],
                       _steps(arm, 0, nan_from=nan_from))
    warm = tuned.dataclasses.replace(base, warmup_fraction=0.2)
    for arm in ("adamw", "adamw-qknorm"):
        for lr in (BEST[arm] / r3, BEST[arm], BEST[arm] * r3):
            _write_run(out / "warmup-40" / f"lr-{lr:g}", tuned.with_lr(warm, lr), arm, 0,
                       [{"epoch": EPOCHS, "val_bpb": _bowl(arm, lr, 0) - 0.01}], _steps(arm, 0))
    for arm in ARMS:
        config = tuned.with_lr(warm if arm.startswith("adamw") else base, BEST[arm])
        for seed in FINAL_SEEDS:
            t = FINAL_BASE[arm] + 0.01 * math.sin(seed * (1 + ARMS.index(arm)))
            recs = [{"epoch": e, "val_bpb": 3.0, "test_bpb": t + (EPOCHS - e) * 0.1, "test_code_bpb": t - 0.1}
                    for e in range(EPOCHS + 1)]
            _write_run(out / "final", config, arm, seed, recs,
                       _steps(arm, seed, spike_at=150 if (arm, seed) == ("adamw", 3) else None))
    (out / tuned.TIMING_FILE).write_text(json.dumps({"steps_per_round": 5, "rounds": 3, "arms": {
        a: {"lr": BEST[a], "seconds_per_step": 0.5 + 0.1 * k, "rounds": [0.5 + 0.1 * k] * 3}
        for k, a in enumerate(ARMS)}, "environment": {"device": "cpu", "cpu_model": "test CPU", "torch_threads": 1,
                                                      "git_sha": "b" * 40}}))
    return out


# ---------------------------------------------------------------------------------------------- spikes
def test_step_summary_finds_a_loss_spike_at_its_step_and_none_in_a_smooth_run():
    s = cr.step_summary(_steps("adamw", 0, spike_at=150))
    assert s["loss_spikes"] == 1 and s["loss_spike_steps"] == [150]  # three spiking steps: one spike
    assert s["grad_spikes"] == 1 and s["grad_spike_steps"] == [150]
    assert s["nonfinite_loss"] == 0 and len(s["logit_max_per_layer"]) == LAYERS
    assert s["logit_max"] == max(max(r["logit_max"]) for r in _steps("adamw", 0, spike_at=150))
    # companion: the same run without the spike has none (the fast fall of the first steps is no spike either)
    smooth = cr.step_summary(_steps("adamw", 0))
    assert smooth["loss_spikes"] == smooth["grad_spikes"] == 0
    # the rule's edge: just below SPIKE_FACTOR x the median of the 100 steps before is no spike, just above is one
    mild = _steps("adamw", 0)
    median = sorted(r["loss"] for r in mild[50:150])[49:51]
    reference = (median[0] + median[1]) / 2
    mild[150]["loss"] = cr.SPIKE_FACTOR * reference * 0.999
    assert cr.step_summary(mild)["loss_spikes"] == 0
    mild[150]["loss"] = cr.SPIKE_FACTOR * reference * 1.001
    assert cr.step_summary(mild)["loss_spike_steps"] == [150]
    # a run that turns NaN is counted as non-finite, and its NaNs are neither spikes nor maxima
    broken = cr.step_summary(_steps("muon", 0, nan_from=120))
    assert broken["nonfinite_loss"] == 80 and broken["loss_spikes"] == 0 and math.isfinite(broken["grad_norm_max"])


# ---------------------------------------------------------------------------------------------- stable range
def test_stable_range_takes_the_band_and_finds_the_first_diverging_lr(controls):
    summary = _finalize(controls).summary
    assert "controls" in summary
    own, warm = summary["controls"]["stable_range"]
    assert own["warmup_steps"] == 10 and warm["warmup_steps"] == 40 and set(warm["arms"]) == {"adamw", "adamw-qknorm"}
    adamw = own["arms"]["adamw"]
    # |ln(x)|/10 <= 0.05 holds for the neighbours at ×√3 (0.0549: no) -> only the best is within 0.05
    assert adamw["best_lr"] == pytest.approx(1e-2) and adamw["within"] == pytest.approx([1e-2])
    assert adamw["diverges_at"] == pytest.approx(3e-2)
    point = next(p for p in adamw["points"] if math.isclose(p["lr"], 3e-2))
    assert point["diverged"] and "more than 0.5 above the best" in point["why"][0]
    muon = own["arms"]["muon"]
    assert muon["diverges_at"] == pytest.approx(9e-2)
    why = next(p for p in muon["points"] if math.isclose(p["lr"], 9e-2))["why"]
    assert any("non-finite validation bpb" in w for w in why) and any("non-finite training loss" in w for w in why)
    # companion: arms whose grid ends without a divergence say so
    stiefel = own["arms"]["stiefel"]
    assert stiefel["diverges_at"] is None and stiefel["highest_lr"] == pytest.approx(3e-2)
    report = (controls / tuned.REPORT_FILE).read_text()
    assert "| adamw | 10 | 0.01 | 2.0000 | 0.01 (1 grid lr) | diverges first at lr 0.03 |" in report
    assert "| stiefel | 10 | 0.01 | 2.0000 | 0.01 (1 grid lr) | no divergence up to lr 0.03 |" in report
    assert "## Run" in report.split("## 7. The study's questions")[1]  # the controls' sections come before "Run"


def test_stable_range_rule_on_its_edges():
    rows = [{"lr": lr, "mean": m, "per_seed": {"0": m}} for lr, m in ((1e-3, 2.04), (3e-3, 2.0), (1e-2, 2.06),
                                                                      (3e-2, 2.49), (9e-2, 2.51))]
    sel = {"best_lr": 3e-3, "best_mean": 2.0, "rows": rows}
    r = cr.stable_range(sel, "x")
    assert r["within"] == [1e-3, 3e-3] and r["diverges_at"] == 9e-2  # 2.06 is outside the band; 2.49 has not diverged
    # companion: a non-finite training loss diverges a point whose validation bpb looks fine
    steps = {("x", 3e-2, 0): {**cr.step_summary(_steps("x", 0)), "nonfinite_loss": 3}}
    assert cr.stable_range(sel, "x", steps)["diverges_at"] == 3e-2
    # and a divergence below the best is not "above the best"
    rows[0]["per_seed"]["0"] = rows[0]["mean"] = float("nan")
    r = cr.stable_range(sel, "x")
    assert r["diverges_at"] == 9e-2 and r["within"] == [3e-3] and r["points"][0]["mean"] is None


# ---------------------------------------------------------------------------------------------- final cell
def test_final_comparisons_have_paired_t_sign_test_and_holm_over_three_baselines(controls):
    from scipy import stats

    summary = _finalize(controls).summary
    comps = summary["final"]["comparisons"]
    per = {a: [FINAL_BASE[a] + 0.01 * math.sin(s * (1 + ARMS.index(a))) for s in FINAL_SEEDS] for a in ARMS}
    c = comps["test: stiefel - adamw-qknorm"]
    ref = stats.ttest_rel(per["stiefel"], per["adamw-qknorm"])
    assert c["n"] == 10 and c["t"] == pytest.approx(ref.statistic, rel=1e-9)
    assert c["p_value"] == pytest.approx(ref.pvalue, rel=1e-9) and c["sign_test_p"] == pytest.approx(2 * 0.5 ** 10)
    # every arm against adamw (5), against adamw-qknorm (4 more), against muon (3 more), in 2 sets: Holm over 24
    assert len(comps) == 2 * (5 + 4 + 3)
    ps = sorted(v["p_value"] for v in comps.values())
    assert min(v["p_holm"] for v in comps.values()) == pytest.approx(min(1.0, 24 * ps[0]), rel=1e-12)
    assert min(v["sign_test_p_holm"] for v in comps.values()) == pytest.approx(
        min(1.0, 24 * min(v["sign_test_p"] for v in comps.values())), rel=1e-12)
    assert "test: adamw-qknorm - adamw" in comps and "test: adamw - adamw-qknorm" not in comps
    # companion: the tuned study's baselines alone would not compare the frames with QK-norm
    assert "test: stiefel - adamw-qknorm" not in tuned.tuned_comparisons(
        {"test": {a: dict(enumerate(v)) for a, v in per.items()}}, list(ARMS))
    report = (controls / tuned.REPORT_FILE).read_text()
    assert "| test: stiefel - adamw-qknorm | 10 |" in report and "With 10 pairs the smallest two-sided sign-test p " \
        "is 0.00195." in report


def test_every_step_records_of_the_final_cell_are_summarised_and_drawn(controls):
    out = _finalize(controls, figures=True)
    steps = out.summary["controls"]["final_steps"]
    assert list(steps) == list(ARMS) and all(s["seeds"] == list(FINAL_SEEDS) for s in steps.values())
    assert steps["adamw"]["loss_spikes"] == 1 and steps["adamw"]["runs_with_loss_spikes"] == 1
    assert steps["stiefel"]["loss_spikes"] == 0  # companion: no spike where none was written
    assert steps["adamw"]["logit_max"] > 40 > steps["adamw-qknorm"]["logit_max"] > steps["stiefel"]["logit_max"]
    assert len(steps["adamw"]["logit_max_per_layer"]) == LAYERS
    for name in (cr.STEPS_FIGURE, cr.LAYERS_FIGURE):
        assert (controls / name).stat().st_size > 10_000 and f"]({name})" in out.report_path.read_text()
    assert set(out.figures) == {"lr_grid", "steps", "steps_layers"}
    # warm-up 40 against 10: three (lr, seed) pairs per arm, each 0.01 lower
    w = out.summary["controls"]["warmup"]["40"]["adamw"]
    assert w["n"] == 3 and w["mean"] == pytest.approx(-0.01, abs=STAT_TOL) and w["n_negative"] == 3


def test_report_only_on_a_controls_folder_rebuilds_byte_for_byte(controls, tmp_path):
    from experiments.cli import main as cli_main

    cr.finalize(controls, LMConfig)  # hands a controls folder to finalize_controls
    copy = tmp_path / "copy"
    shutil.copytree(controls, copy)
    for f in ("report.md", "summary.json", cr.STEPS_FIGURE):
        (copy / f).unlink()
    assert cli_main(["lm", "--report-only", "--out", str(copy), "--quiet"]) == 0
    for f in ("report.md", "summary.json"):
        assert (copy / f).read_bytes() == (controls / f).read_bytes(), f
    assert (copy / cr.STEPS_FIGURE).exists()
    assert "## 4. Stable lr range per arm" in (copy / "report.md").read_text()
    # companion: a tuned folder without a controls arm keeps the tuned report
    for arm in cr.CONTROL_ONLY_ARMS:
        for run in copy.glob(f"**/runs/{arm}"):
            shutil.rmtree(run)
    assert not cr.is_controls_folder(copy)
    assert "## 4. Stable lr range" not in cr.finalize(copy, LMConfig).report_path.read_text()


def test_report_only_reads_the_records_of_real_runs(varied_root, tmp_path):
    """Real (tiny) runs of two arms: a grid, a warm-up grid, a final cell, then --report-only writes the controls
    report from their metrics.jsonl and steps.jsonl (the synthetic tests above cover the rules)."""
    pytest.importorskip("transformers")
    from experiments.cli import main as cli_main

    out = tmp_path / "tiny"
    base = ["lm", *TINY_LM_FLAGS, "--corpus-root", varied_root]
    grid = ["--arms", "adamw", "adamw-qknorm", "--lrs", "1e-3", "1e-2", "--seeds", "0", "--skip-report"]
    assert cli_main([*base, "--out", str(out), *grid]) == 0
    assert cli_main([*base, "--out", str(out / "warmup-3"), "--warmup-fraction", "0.5", *grid]) == 0
    assert cli_main([*base, "--out", str(out), "--arms", "adamw", "adamw-qknorm", "--seeds", "0", "--final-seeds",
                     "1", "2", "--allow-unbracketed", "--skip-report"]) == 0
    assert cli_main(["lm", "--report-only", "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["controls"]["final_steps"]["adamw-qknorm"]
    assert steps["seeds"] == [1, 2] and len(steps["logit_max_per_layer"]) == 2 and steps["runs_with_nonfinite_loss"] == 0
    assert [g["warmup_steps"] for g in summary["controls"]["stable_range"]] == [0, 3]  # 5% of 6 steps, 50%
    assert summary["controls"]["warmup"]["3"]["adamw"]["n"] == 2
    assert "test: adamw-qknorm - adamw" in summary["final"]["comparisons"]
    assert (out / cr.STEPS_FIGURE).exists() and "## 7. The study's questions" in (out / "report.md").read_text()


# ---------------------------------------------------------------------------------------------- README
def test_readme_paragraph_answers_the_three_questions_from_the_summary(controls):
    summary = _finalize(controls).summary
    q1, _, q2, _, q3 = cr.readme_paragraph(summary)
    diff = sum(math.sin(s * 4) - math.sin(s * 2) for s in FINAL_SEEDS) * 0.01 / 10 + FINAL_BASE["stiefel"] - \
        FINAL_BASE["adamw-qknorm"]  # stiefel's and adamw-qknorm's seed wobbles (arm indices 3 and 1)
    assert q1.startswith("**Geometry or logit control?** The frames do more than bound the logits: `stiefel`'s test "
                         f"bpb is lower than `adamw-qknorm`'s by {abs(diff):.4f} (95% CI of the difference")
    assert "10 pairs" in q1 and "Stable lr range" in q1 and "`adamw` 0.01 (1 grid lr), diverges first at lr 0.03" in q1
    assert q2.startswith("**Is the AdamW baseline stable?** Warm-up: on the grid (validation, 3 pairs of lr and seed")
    assert "warm-up 40 gives lower validation bpb than warm-up 10 by 0.0100" in q2
    assert "the selection trains the final cell at warm-up 40, lr 0.01" in q2
    assert "`adamw` had 1 loss spike(s) in 1 of 10 runs" in q2
    assert q3.startswith("**Beside Muon, does the constraint help?** ") and "At equal wall-clock" in q3
    text = "\n".join(cr.readme_paragraph(summary))
    assert tuned.numbers_not_in_summary(text, summary) == []
    assert (controls / tuned.REPORT_FILE).read_text().count(q1) == 1  # the report carries the same paragraph


def test_readme_paragraph_says_suggest_with_few_pairs(controls):
    for seed in range(4, 11):  # four pairs left: below MIN_SEEDS_FOR_CLAIM, nothing is resolved
        for arm in ARMS:
            shutil.rmtree(controls / "final" / "runs" / arm / f"seed{seed}")
    summary = _finalize(controls).summary
    q1 = cr.readme_paragraph(summary)[0]
    # three pairs: below MIN_SEEDS_FOR_CLAIM, so never "is"; each interval excludes 0, so each is "suggested"
    assert ("This study does not separate the geometry from logit control. Suggested, not resolved: `stiefel`'s "
            "test bpb is lower than `adamw-qknorm`'s" in q1)
    assert q1.count("3 pairs") == q1.lower().count("suggested, not resolved") == q1.count("test bpb is") == 3
    assert q1.count("unadjusted 95% CI") == 3
    # companion: with ten pairs the same paragraph states them (test_readme_paragraph_answers_...)


def test_a_zero_difference_reads_equal_not_higher(controls):
    """A comparison (either way round) or a warm-up difference of exactly 0 reads "equal"/"the same", never
    "higher"; companion: the same summary's non-zero differences keep their direction."""
    summary = _finalize(controls).summary
    q1, _, q2 = cr.readme_paragraph(summary)[:3]
    assert "`stiefel`'s test bpb is lower than `adamw-qknorm`'s" in q1 and "gives lower validation bpb" in q2
    comps = summary["final"]["comparisons"]
    key = "test: stiefel - adamw-qknorm" if "test: stiefel - adamw-qknorm" in comps else "test: adamw-qknorm - stiefel"
    comps[key] = {**comps[key], "mean": 0.0}
    for per_arm in summary["controls"]["warmup"].values():
        if per_arm.get("adamw") is not None:
            per_arm["adamw"] = {**per_arm["adamw"], "mean": 0.0}
    q1, _, q2 = cr.readme_paragraph(summary)[:3]
    for a, b in (("stiefel", "adamw-qknorm"), ("adamw-qknorm", "stiefel")):  # both ways round (one is flipped)
        claim = cr._claim(comps, a, b)
        assert claim.startswith(f"`{a}`'s test bpb equals `{b}`'s on average, not resolved (mean difference 0; "), claim
        assert "higher" not in claim and "lower" not in claim and "suggested" not in claim
    assert "`stiefel`'s test bpb equals `adamw-qknorm`'s on average" in q1
    assert "gives the same mean validation bpb as warm-up 10 (mean difference 0)" in q2
    assert "higher validation bpb" not in q2


def test_readme_check_catches_a_number_that_disagrees_with_the_summary(controls, tmp_path):
    summary = _finalize(controls).summary
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n\n{cr.README_BEGIN}\n{cr.README_PLACEHOLDER}\n{cr.README_END}\n\nrest\n")
    assert cr.readme_problems(readme.read_text(), None) == []
    assert cr.write_readme(readme, summary) and not cr.write_readme(readme, summary)
    text = readme.read_text()
    assert text.startswith("intro\n\n") and text.endswith("\n\nrest\n")
    assert cr.readme_problems(text, summary) == []
    # companion: one misquoted number is caught twice (not the generated block; not a number of the summary)
    good = f"{summary['final']['comparisons']['test: stiefel - adamw-qknorm']['mean']:+.4f}"[1:]
    assert good in text
    bad = f"{float(good) + 0.0071:.4f}"
    problems = cr.readme_problems(text.replace(good, bad), summary)
    assert len(problems) == 2 and f"{bad} is quoted" in problems[1]
    # companion: a results paragraph without a summary on record, or a summary with the placeholder, is caught
    assert cr.readme_problems(text, None) and cr.readme_problems(
        text.replace(_block(text), cr.README_PLACEHOLDER), summary)
    assert cr.readme_problems("no markers", summary)[0].startswith("the README lacks the markers")


def test_readme_command_errors_are_one_line_naming_the_file(controls, tmp_path, capsys):
    """``readme --check`` on a corrupt, non-object or missing ``--summary``, or a missing ``--readme``: one line naming
    the file, exit status 2, no traceback; companion: a good summary and README check clean (0), a disagreeing README
    exit 1."""
    summary = _finalize(controls).summary
    good = tmp_path / "summary.json"
    good.write_text(json.dumps(summary))
    readme = tmp_path / "README.md"
    readme.write_text(f"{cr.README_BEGIN}\n" + "\n".join(cr.readme_paragraph(summary)) + f"\n{cr.README_END}\n")
    bad, listed = tmp_path / "bad.json", tmp_path / "list.json"
    bad.write_text(json.dumps(summary)[:-20])  # cut short
    listed.write_text("[1, 2]")
    for argv, needle in ((["--summary", str(bad), "--readme", str(readme)], f"--summary {bad}: cannot be read as JSON"),
                         (["--summary", str(listed), "--readme", str(readme)], f"--summary {listed}: holds a JSON list"),
                         (["--summary", str(tmp_path / "none.json"), "--readme", str(readme)], "none.json: no such file"),
                         (["--summary", str(good), "--readme", str(tmp_path / "none.md")], "none.md: no such file")):
        assert cr.main(["readme", "--check", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.splitlines() == [err] and needle in err and "Traceback" not in err, err
    assert cr.main(["readme", "--check", "--summary", str(good), "--readme", str(readme)]) == 0  # companion
    readme.write_text(readme.read_text().replace("**Geometry", "**Geometry!"))
    assert cr.main(["readme", "--check", "--summary", str(good), "--readme", str(readme)]) == 1


def test_readme_command_names_a_key_the_summary_lacks(controls, tmp_path, capsys):
    """``readme`` (with or without ``--check``) on a valid-JSON summary that lacks a key the paragraph needs: one
    line naming the file, the key's place in the summary and the rebuild command, exit status 2, no traceback, the
    README unchanged; companion: the complete summary checks clean (0) and writes (0)."""
    summary = _finalize(controls).summary
    readme = tmp_path / "README.md"
    readme.write_text(f"{cr.README_BEGIN}\n{cr.README_PLACEHOLDER}\n{cr.README_END}\n")
    good = tmp_path / "summary.json"
    good.write_text(json.dumps(summary))
    key = "test: stiefel - adamw-qknorm"
    for where, cut in (('["controls"]', lambda s: s.pop("controls")),
                       ('["final"]["in_progress"]', lambda s: s["final"].pop("in_progress")),
                       (f'["final"]["comparisons"]["{key}"]["n"]', lambda s: s["final"]["comparisons"][key].pop("n")),
                       ('["controls"]["stable_range"][0]["arms"]["stiefel"]["within"]',
                        lambda s: s["controls"]["stable_range"][0]["arms"]["stiefel"].pop("within"))):
        lacking = json.loads(json.dumps(summary))
        cut(lacking)
        bad = tmp_path / "lacking.json"
        bad.write_text(json.dumps(lacking))
        before = readme.read_text()
        for check in (["--check"], []):
            assert cr.main(["readme", *check, "--summary", str(bad), "--readme", str(readme)]) == 2, (where, check)
            err = capsys.readouterr().err.strip()
            assert err.splitlines() == [err] and "Traceback" not in err, err
            assert f"--summary {bad}: lacks the key {where} that the README paragraph needs" in err, err
            assert f"rebuild it with python -m experiments lm --report-only --out {tmp_path}." in err, err
            assert readme.read_text() == before
    # companion: the complete summary writes the paragraph, then checks clean
    assert cr.main(["readme", "--summary", str(good), "--readme", str(readme)]) == 0
    assert cr.main(["readme", "--check", "--summary", str(good), "--readme", str(readme)]) == 0
    assert _block(readme.read_text()) == "\n".join(cr.readme_paragraph(summary))


class _Reads(cr._SummaryNode):
    """A summary object that records the place of every key read with ``[]`` (the keys the paragraph needs)."""

    def __getitem__(self, key):
        value = super().__getitem__(key)
        self.reads.add(f"{self.where}[{json.dumps(key)}]")
        return value


def _reading(value, reads, where=""):
    """``value`` (parsed JSON) with every object a :class:`_Reads` adding to ``reads``."""
    if isinstance(value, dict):
        node = _Reads({k: _reading(v, reads, f"{where}[{json.dumps(k)}]") for k, v in value.items()}, where)
        node.reads = reads
        return node
    if isinstance(value, list):
        return [_reading(v, reads, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def test_every_key_the_paragraph_needs_is_named_when_missing(controls):
    """Each key :func:`readme_paragraph` reads with ``[]`` from the synthetic summary, deleted alone: the check
    raises :class:`~experiments.lm.controls_report.SummaryKeyError` naming exactly that key's place (never a bare
    KeyError, never another exception), or, for a key read only where present, reports the changed paragraph (never
    checks clean); companion: the complete summary, read the same way, checks clean."""
    summary = _finalize(controls).summary
    text = f"{cr.README_BEGIN}\n" + "\n".join(cr.readme_paragraph(summary)) + f"\n{cr.README_END}\n"
    reads: set[str] = set()
    assert cr.readme_problems(text, _reading(json.loads(json.dumps(summary)), reads)) == []  # companion
    paths = {}  # where -> the path of keys to delete

    def walk(value, where="", path=()):
        if isinstance(value, dict):
            for k, v in value.items():
                paths[f"{where}[{json.dumps(k)}]"] = (*path, k)
                walk(v, f"{where}[{json.dumps(k)}]", (*path, k))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{where}[{i}]", (*path, i))

    walk(summary)
    assert len(reads) > 50 and reads <= set(paths)
    named = []
    for where in sorted(reads):
        lacking = json.loads(json.dumps(summary))
        node = lacking
        for k in paths[where][:-1]:
            node = node[k]
        del node[paths[where][-1]]
        try:
            problems = cr.readme_problems(text, cr._located(lacking))
        except cr.SummaryKeyError as err:
            assert err.where == where
            named.append(where)
        else:  # a key read only where present (an arm's stable range): the paragraph changes, and the check says so
            assert problems, where
    assert len(named) > 50


def test_readme_paragraph_waits_for_a_complete_final_cell(controls):
    shutil.rmtree(controls / "final" / "runs" / "muon" / "seed10")
    summary = _finalize(controls).summary
    assert cr.readme_paragraph(summary) == [cr.README_IN_PROGRESS]
    assert not re.search(r"\d", cr.README_IN_PROGRESS) and not re.search(r"\d", cr.README_PLACEHOLDER)
    # companion: complete again, it answers
    shutil.rmtree(controls / "final" / "runs" / "adamw" / "seed10")
    for arm in ARMS:
        if (controls / "final" / "runs" / arm / "seed10").exists():
            shutil.rmtree(controls / "final" / "runs" / arm / "seed10")
    assert cr.readme_paragraph(_finalize(controls).summary)[0].startswith("**Geometry")


def _finalize(out: Path, figures: bool = False):
    """The controls report, without the every-step figures unless asked (they take seconds to draw)."""
    return cr.finalize_controls(out, LMConfig, figures=figures)


def _block(text: str) -> str:
    return text.split(cr.README_BEGIN, 1)[1].split(cr.README_END, 1)[0].strip()


def test_the_lm_readme_paragraph_agrees_with_the_committed_summary():
    """The README's controls paragraph is readme_paragraph of records/controls/summary.json, every number in it a
    number of that file; while the study has no summary, the README says it is in progress."""
    path = cr.RECORDS / tuned.SUMMARY_FILE
    summary = json.loads(path.read_text()) if path.exists() else None
    text = cr.README.read_text()
    assert cr.readme_problems(text, summary) == []
    if summary is None:
        assert _block(text) == cr.README_PLACEHOLDER and "in progress" in _block(text)
    # the README's account of the rules quotes the code's constants
    for phrase in (f"within {cr.STABLE_BPB:g} of its\nbest", f"more than {cr.DIVERGE_BPB:g} bpb above the best",
                   f"{cr.SPIKE_FACTOR:g}× the median of the {cr.SPIKE_WINDOW} steps before it"):
        assert phrase in text, phrase


# ---------------------------------------------------------------------------------------------- reuse (item 5)
def _tuned_beside(controls: Path, commit: str) -> None:
    tuned_dir = controls.parent / cr.TUNED_FOLDER
    tuned_dir.mkdir()
    (tuned_dir / tuned.SUMMARY_FILE).write_text(json.dumps({"trained_on": {
        "grid": {"commits": ["1" * 12]}, "final": {"commits": [commit]}}}))


def test_reuse_check_finds_no_run_of_the_tuned_study_when_commits_differ(controls):
    _tuned_beside(controls, "2" * 12)
    out = cr.finalize_controls(controls, LMConfig, figures=False)
    reuse = out.summary["controls"]["reuse"]
    assert reuse == {"tuned": ["1" * 12, "2" * 12], "commits": ["b" * 12], "shared": []}
    assert "None: every run here was trained on bbbbbbbbbbbb" in out.report_path.read_text()


def test_companion_reuse_check_names_a_run_trained_on_a_tuned_commit(controls):
    # one final run carried over from the tuned study: its environment.json holds the tuned study's commit
    env = controls / "final" / "runs" / "muon" / "seed4" / "environment.json"
    env.write_text(env.read_text().replace("b" * 40, "2" * 40))
    _tuned_beside(controls, "2" * 12 + "*")  # a dirty tuned commit still matches its bare hash
    out = cr.finalize_controls(controls, LMConfig, figures=False)
    assert out.summary["controls"]["reuse"]["shared"] == ["2" * 12]
    assert "**Runs trained on a commit of the tuned study** (222222222222)" in out.report_path.read_text()


def test_reuse_check_says_not_checked_without_the_tuned_summary_and_refuses_a_broken_one(controls):
    out = cr.finalize_controls(controls, LMConfig, figures=False)
    assert out.summary["controls"]["reuse"] is None
    assert "Not checked: no `tuned/summary.json` beside this folder" in out.report_path.read_text()
    (controls.parent / cr.TUNED_FOLDER).mkdir()
    (controls.parent / cr.TUNED_FOLDER / tuned.SUMMARY_FILE).write_text("{}")
    with pytest.raises(ValueError, match=r"tuned/summary.json: not a tuned study's summary .*'trained_on'"):
        cr.reuse_check(controls, {})


def test_the_committed_controls_study_reuses_no_run_of_the_tuned_study():
    """Issue 42, item 5: every committed controls run was trained on a commit that trained no run of runs/tuned
    (read from the runs' environment.json, not from a summary)."""
    tuned_summary = cr.RECORDS.parent / cr.TUNED_FOLDER / tuned.SUMMARY_FILE
    if not (cr.RECORDS / "final").is_dir() or not tuned_summary.is_file():
        pytest.skip("the controls or tuned records are not in this checkout")
    reuse = cr.reuse_check(cr.RECORDS, tuned._trained_on(cr.RECORDS))
    assert reuse["tuned"] and reuse["commits"]
    assert reuse["shared"] == [], reuse


# ---------------------------------------------------------------------------------------------- steps to reach
def _evals(values: list[float]) -> list[dict]:
    return [{"epoch": e, "test_bpb": v} for e, v in enumerate(values)]


def test_steps_to_reach_takes_the_first_evaluation_at_or_below_the_other_arms_final():
    runs = {"adamw": {1: _evals([5.0, 3.0, 2.5, 2.0]), 2: _evals([5.0, 3.0, 2.6, 2.2]), 3: _evals([5.0, 3.0, 2.0])},
            # seed 1 reaches 2.0 exactly at epoch 2; seed 2 first goes below 2.2 at epoch 1; seed 3 never reaches
            # its adamw's 2.0; seed 4 has no adamw twin
            "muon": {1: _evals([5.0, 2.4, 2.0, 1.8]), 2: _evals([5.0, 2.1, 2.5, 1.9]), 3: _evals([5.0, 2.5, 2.1]),
                     4: _evals([5.0, 1.0])}}
    r = cr.steps_to_reach(runs, "muon", "adamw", steps_per_epoch=100)
    assert r["pairs"] == 3 and r["per_seed"] == {"1": 200, "2": 100} and r["never"] == [3]
    assert r["steps_against"] == 200  # the last seed's adamw run (3 evaluations)
    assert (r["median"], r["low"], r["high"]) == (150, 100, 200)
    assert r["efficiency_median"] == pytest.approx(200 / 150, abs=STAT_TOL)
    # companion: against itself, an arm reaches its own final only at its last evaluation (efficiency 1)
    own = cr.steps_to_reach({"adamw": runs["adamw"], "muon": runs["adamw"]}, "muon", "adamw", 100)
    assert own["per_seed"] == {"1": 300, "2": 300, "3": 200} and own["never"] == []


def test_steps_to_reach_never_counts_the_start_and_is_none_without_shared_seeds():
    # a run that starts below the target (epoch 0) and is above it after training never reached it: step 0 is the
    # evaluation before training
    runs = {"adamw": {1: _evals([5.0, 3.0])}, "muon": {1: _evals([2.0, 3.5])}}
    r = cr.steps_to_reach(runs, "muon", "adamw", 100)
    assert r["never"] == [1] and r["median"] is None
    assert "never reaches `adamw`'s final test bpb" in cr._reach_text(r)
    assert cr.steps_to_reach({"adamw": {1: _evals([1.0])}, "muon": {2: _evals([1.0])}}, "muon", "adamw", 100) is None


def test_the_report_and_the_paragraph_give_muons_steps_to_reach(controls):
    out = cr.finalize_controls(controls, LMConfig, figures=False)
    reach = {r["arm"]: r for r in out.summary["controls"]["reach"]}
    assert set(reach) == {"muon", "adamw-qknorm", "stiefel"}
    # the fixture's final test bpb falls 0.1 per epoch to FINAL_BASE (+ a wobble): muon's 1.70 is below adamw's
    # final 2.00 already at epoch 1 of 2 on every seed, stiefel's 1.90 too
    assert reach["muon"]["per_seed"] == {str(s): STEPS_PER_EPOCH for s in FINAL_SEEDS}
    text = out.report_path.read_text()
    assert (f"`muon` reaches `adamw`'s final test bpb (same seed) by step {STEPS_PER_EPOCH} of {STEPS_PER_EPOCH * EPOCHS}"
            f" (on each of 10 of 10 pairs), a step efficiency of at least 2.00×") in text
    # companion: seeds that reach at different steps give the median and the range
    assert "by step 150 of 200 (median over 2 of 3 pairs; 100–200; never on seed(s) 3)" in cr._reach_text(
        cr.steps_to_reach({"adamw": {1: _evals([5, 3, 2.0]), 2: _evals([5, 3, 2.2]), 3: _evals([5, 3, 2.0])},
                           "muon": {1: _evals([5, 2.4, 2.0]), 2: _evals([5, 2.1, 2.5]), 3: _evals([5, 2.5, 2.1])}},
                          "muon", "adamw", 100))
    paragraph = "\n".join(cr.readme_paragraph(out.summary))
    assert "`muon` reaches `adamw`'s final test bpb" in paragraph
    assert "`stiefel` reaches" not in paragraph  # the paragraph quotes Muon's only (the question it answers)


def test_the_lm_readme_quotes_the_tuned_studys_steps_to_reach_from_its_records():
    final = cr.RECORDS.parent / cr.TUNED_FOLDER / tuned.FINAL_DIR
    if not final.is_dir():
        pytest.skip("the tuned study's records are not in this checkout")
    done, _ = tuned._finished(final)
    r = cr.steps_to_reach(done, "muon", "adamw", steps_per_epoch=100)
    quoted = (f"reached its AdamW's final test bpb by step {r['median']:,g} of\n{r['steps_against']:,}, median of "
              f"{len(r['per_seed'])} pairs, {r['low']:,}–{r['high']:,};")
    assert quoted in cr.README.read_text()
    # companion: the step the issue estimated between evaluations (1,150) is not what the README quotes
    assert quoted.replace(f"by step {r['median']:,g}", "by step 1,150") not in cr.README.read_text()


def _controls_paragraph() -> str:
    """The controls paragraph of the lm README's "The studies in brief" (the top README's before it became a front
    page)."""
    readme = cr.README.read_text()
    start = readme.index("**Controls: what the frames' gain is**")
    return readme[start:readme.index("\n\n", start)]


def test_the_lm_readmes_brief_words_on_the_controls_study_quote_only_its_summary():
    """The controls paragraph of the lm README's "The studies in brief": every decimal number is one of
    records/controls/summary.json's at the precision printed, and the counts it states are the summary's."""
    path = cr.RECORDS / tuned.SUMMARY_FILE
    if not path.is_file():
        pytest.skip("the controls study's summary is not in this checkout")
    summary = json.loads(path.read_text())
    text = _controls_paragraph()
    assert tuned.numbers_not_in_summary(text, summary) == []
    # companion: a number the summary does not hold is caught in the same text
    assert tuned.numbers_not_in_summary(text + " 0.1234 bpb", summary) == ["0.1234"]
    comps, final = summary["final"]["comparisons"], summary["final"]
    assert {len(v) for v in final["seeds"].values()} == {10}
    gap = comps["test: stiefel - adamw-qknorm"]
    assert f"lower on {gap['n_negative']} of {gap['n']} pairs" in text
    assert not cr._resolved(gap) and not cr._resolved(comps["test: stiefeladam-muon - muon"])
    reach = next(r for r in summary["controls"]["reach"] if r["arm"] == "muon")
    assert reach["low"] == reach["high"] == reach["median"] and len(reach["per_seed"]) == reach["pairs"]
    assert f"by step\n{reach['median']:,g} of {reach['steps_against']:,} on every seed" in text
    for arm, warmup in (("adamw", 400), ("adamw-qknorm", 400)):
        assert summary["recipes"][arm]["warmup_steps"] == warmup, arm


def test_the_committed_controls_report_reads_out_what_the_data_can_say():
    """Issue 57, item 5, on the committed records/controls: the geometry question's null carries its interval and
    the smallest detectable difference (0.023 bpb at alpha 0.05, 0.042 at the Holm level 0.05/48, the issue's
    figures), stiefeladam-muon's cost beside Muon is "suggested", and at equal wall-clock muon and stiefeladam-muon
    (median step times 0.6 ms apart, rounds spread over 56 ms) are read at the same step, each from the summary
    and worded so in report.md. Companion: rounds without spread would read that pair by the budget."""
    path = cr.RECORDS / tuned.SUMMARY_FILE
    if not path.is_file():
        pytest.skip("the controls study's summary is not in this checkout")
    summary = json.loads(path.read_text())
    report = (cr.RECORDS / tuned.REPORT_FILE).read_text()
    comps = summary["final"]["comparisons"]
    gap, cost = comps["test: stiefel - adamw-qknorm"], comps["test: stiefeladam-muon - muon"]
    d = gap["detectable"]
    assert (f"{d['difference']:.3f}", f"{d['holm_difference']:.3f}", d["family"]) == ("0.023", "0.042", len(comps))
    assert d["holm_alpha"] == pytest.approx(tuned.ALPHA / len(comps), rel=1e-15)
    assert tuned.reading(gap) == "not resolved" and tuned.reading(cost) == "suggested"
    assert cost["ci_low"] > 0 and cost["p_holm"] >= tuned.ALPHA
    for name in ("test: stiefel - adamw-qknorm", "test: stiefeladam-muon - muon"):
        assert tuned._sentence(name, comps[name]) in report
    # equal wall-clock: the rule recomputed from the timing pass's rounds
    timing, wall = summary["timing"]["arms"], summary["equal_wallclock"]
    a, b = timing["stiefeladam-muon"], timing["muon"]
    spread = max(max(x["rounds"]) - min(x["rounds"]) for x in (a, b))
    assert abs(a["seconds_per_step"] - b["seconds_per_step"]) < spread
    fits = min(wall["arms"][x]["steps_fit"] for x in ("stiefeladam-muon", "muon"))
    step = fits // summary["config"]["steps_per_epoch"] * summary["config"]["steps_per_epoch"]
    row = wall["comparisons"]["test: stiefeladam-muon - muon"]
    assert row["read"]["rule"] == "same step" and row["read"]["steps"] == {"stiefeladam-muon": [step], "muon": [step]}
    assert tuned._sentence("test: stiefeladam-muon - muon", row) in report
    assert (f"| stiefeladam-muon - muon | {1000 * a['seconds_per_step']:.1f} / {1000 * b['seconds_per_step']:.1f} | "
            f"{1000 * row['read']['difference_seconds']:.1f} | {1000 * spread:.1f} | same step") in report
    # companion: the same medians with rounds that do not spread would be read by the budget rule
    still = [{**x, "rounds": [x["seconds_per_step"]] * 3} for x in (a, b)]
    assert tuned.wallclock_rule(*still)["rule"] == "budget"


def test_a_folder_with_the_stiefel_gain_arm_is_reported_as_the_level_ground_study(controls):
    """The title comes from the records: a run of ``stiefel-gain`` marks the level-ground study (issue 57), and the
    controls study keeps its own title (the companion: the same folder without that run)."""
    assert cr.report_title(controls) == cr.TITLE
    assert _finalize(controls).report_path.read_text().startswith(f"# {cr.TITLE}\n")
    shutil.copytree(controls / "lr-0.01" / "runs" / "stiefel", controls / "lr-0.01" / "runs" / "stiefel-gain")
    assert cr.report_title(controls) == cr.LEVEL_TITLE
    assert "issue 57" in cr.LEVEL_TITLE and "issue 57" not in cr.TITLE


def test_runs_copied_from_another_study_are_named_in_the_report(controls):
    """A folder's ``carried_over.json`` (the level study copied the controls grid) is quoted: how many runs, from
    where, why and on which commit; the companion (no such file, as in the controls study) says nothing of it."""
    assert "copied unchanged" not in _finalize(controls).report_path.read_text()
    (controls / cr.CARRIED_FILE).write_text(json.dumps({
        "from": "experiments/lm/records/controls", "why": "the same flags", "trained_on": ["c" * 40],
        "runs": ["lr-0.01/runs/stiefel/seed0", "lr-0.01/runs/adamw/seed0"]}))
    outputs = _finalize(controls)
    assert outputs.summary["controls"]["carried_over"]["runs"] == 2
    assert ("**2 runs copied unchanged from `experiments/lm/records/controls`** (the same flags; trained on "
            + "c" * 12) in outputs.report_path.read_text()


def test_the_level_study_answers_geometry_or_logit_control_with_the_gain_arm(controls):
    """With ``stiefel-gain`` in the final cell (the level-ground study), the answer adds its comparison with
    ``adamw-qknorm`` and with ``adamw``, its largest logit and its stable range; the controls study's answer (the
    companion: no such arm) has none of it."""
    plain = cr.readme_paragraph(_finalize(controls).summary)[0]
    assert "stiefel-gain" not in plain and "learned logit gain" not in plain
    base = json.loads((controls / "final" / "runs" / "stiefel" / "seed1" / "config.json").read_text())
    lr = base["config"]["optim"]["lr"]
    for arm_dir in (controls / "final" / "runs" / "stiefel").iterdir():
        shutil.copytree(arm_dir, controls / "final" / "runs" / "stiefel-gain" / arm_dir.name)
    for lr_dir in controls.glob("lr-*"):
        if (lr_dir / "runs" / "stiefel").exists():
            shutil.copytree(lr_dir / "runs" / "stiefel", lr_dir / "runs" / "stiefel-gain")
    for path in controls.glob("**/runs/stiefel-gain/seed*/*"):
        if path.name in ("config.json", "metrics.jsonl"):
            path.write_text(path.read_text().replace('"arm": "stiefel"', '"arm": "stiefel-gain"'))
    summary = _finalize(controls).summary
    assert "stiefel-gain" in summary["final"]["seeds"] and lr > 0
    level = cr.readme_paragraph(summary)[0]
    assert "With a learned logit gain per head, the scale QK-norm learns too: " in level
    for phrase in ("`stiefel-gain` and `adamw-qknorm`", "`stiefel-gain` and `adamw`"):
        assert phrase not in level  # both comparisons have pairs
    assert level.count("`stiefel-gain`") >= 4  # the two claims, its largest logit and its stable range


def test_the_level_block_of_the_lm_readme_agrees_with_the_level_records():
    """experiments/lm/README.md quotes the level-ground study's answers in a block of its own, generated from
    records/level/summary.json (its placeholder while there is none); the controls block is checked alike above.
    Companions: the controls placeholder in the level block, and no level markers, are both refused."""
    text = (ROOT / "experiments" / "lm" / "README.md").read_text()
    begin, end, placeholder, records = cr.study_block("level")
    path = records / tuned.SUMMARY_FILE
    summary = cr._located(json.loads(path.read_text())) if path.exists() else None
    assert cr.readme_problems(text, summary, "level") == []
    if summary is None:
        assert cr._readme_block(text, "level") == placeholder
        assert cr.readme_problems(text.replace(placeholder, cr.README_PLACEHOLDER), None, "level")
    assert cr.readme_problems(text.replace(begin, ""), summary, "level")[0].startswith("the README lacks the markers")
    with pytest.raises(ValueError, match="not one of"):
        cr.study_block("tuned")


def test_the_readme_command_writes_the_level_block_alone(controls, tmp_path):
    """``readme --study level`` fills the level block from the given summary and leaves the controls block as it
    was (and the default, the controls study, the level block)."""
    summary_path = _finalize(controls).summary_path
    begin, end, placeholder, _ = cr.study_block("level")
    readme = tmp_path / "README.md"
    readme.write_text(f"{cr.README_BEGIN}\n{cr.README_PLACEHOLDER}\n{cr.README_END}\n\n{begin}\n{placeholder}\n{end}\n")
    assert cr.main(["readme", "--study", "level", "--summary", str(summary_path), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert cr._readme_block(text) == cr.README_PLACEHOLDER
    assert cr._readme_block(text, "level").startswith("**Geometry or logit control?**")
    assert cr.main(["readme", "--check", "--study", "level", "--summary", str(summary_path),
                    "--readme", str(readme)]) == 0
    assert cr.main(["readme", "--check", "--summary", str(summary_path), "--readme", str(readme)]) == 1  # companion
