"""The committed study folders carry their records, and ``--report-only`` rebuilds their committed
``report.md`` and ``summary.json`` byte for byte from them (nothing in a report depends on when or where it was
rebuilt)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import assert_quoted

from experiments.cli import main
from experiments.harness.records import read_records

ROOT = Path(__file__).resolve().parents[1]
VISION = ROOT / "experiments" / "vision" / "records"
#: committed vision studies: folder -> --study
VISION_STUDIES = {"fashion-mnist-ablation": "ablation", "fashion-mnist-decay": "decay",
                  "fashion-mnist-scaling": "scaling", "fashion-mnist-paired": "paired"}
#: The front page, the studies' index (the paper's figures next to ours) and the lm README.
TOP, STUDIES_INDEX = ROOT / "README.md", ROOT / "experiments" / "README.md"
LM_README = ROOT / "experiments" / "lm" / "README.md"


def _lm_brief() -> str:
    """experiments/lm/README.md's "The studies in brief": what the top README said of the lm studies before it
    became a front page (moved there verbatim)."""
    text = LM_README.read_text()
    return text[text.index("## The studies in brief"):text.index("## What it shows")]


def _index_row(start: str) -> str:
    """The row of experiments/README.md's table of headline figures whose first cell is ``start``."""
    return next(line for line in STUDIES_INDEX.read_text().splitlines() if line.startswith(f"| {start} |"))


@pytest.mark.parametrize("name", sorted(VISION_STUDIES))
def test_committed_vision_studies_carry_their_records(name):
    folder = VISION / name
    if not (folder / "study.json").exists():
        pytest.skip(f"{name}: records not committed yet")
    metrics = sorted(folder.glob("**/runs/*/seed*/metrics.jsonl"))
    assert metrics, name
    for m in metrics:
        assert (m.parent / "config.json").exists() and (m.parent / "environment.json").exists()


def _rebuild_matches(tmp_path, name: str, *, study_flag: bool = True) -> None:
    folder = VISION / name
    if not (folder / "study.json").exists():
        pytest.skip(f"{name}: records not committed yet")
    copy = tmp_path / name
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("*.pt", ".lock"))
    (copy / "report.md").unlink()  # removed first, so the comparison below cannot pass on the copied files
    (copy / "summary.json").unlink()
    flags = ["--study", VISION_STUDIES[name]] if study_flag else []  # without it: the study in study.json
    assert main(["vision", *flags, "--report-only", "--out", str(copy)]) == 0
    for file in ("report.md", "summary.json"):
        assert (copy / file).read_bytes() == (folder / file).read_bytes(), file


def test_report_only_rebuilds_the_committed_ablation_study_byte_for_byte(tmp_path):
    _rebuild_matches(tmp_path, "fashion-mnist-ablation", study_flag=False)


@pytest.mark.slow  # the same check on the other committed studies (the ablation one stays in the default run)
@pytest.mark.parametrize("name", ["fashion-mnist-decay", "fashion-mnist-scaling", "fashion-mnist-paired"])
def test_report_only_rebuilds_every_committed_vision_study(tmp_path, name):
    _rebuild_matches(tmp_path, name)


#: the other committed studies with records: (command, folder under experiments/)
OTHER_STUDIES = [("grokking", "grokking/records/p97_add_5seeds"), ("grokking", "grokking/records/p97_add_arms10"),
                 ("lm", "lm/records/full"), ("lm", "lm/records/pilot"),
                 ("lm", "lm/records/lr-3e-3"), ("lm", "lm/records/tuned"),
                 ("lm", "lm/records/trust-region/w128-auto"), ("lm", "lm/records/trust-region/w256-old")]


#: the grokking check of the frame-step rule: one study folder per multiplier, those whose report is committed
OTHER_STUDIES += [("grokking", p.parent.relative_to(ROOT / "experiments").as_posix())
                  for p in sorted((ROOT / "experiments" / "grokking" / "records" / "frame-step").glob("mu-*/report.md"))]


@pytest.mark.parametrize(("command", "name"), OTHER_STUDIES)
def test_report_only_rebuilds_the_committed_grokking_and_lm_studies_byte_for_byte(tmp_path, command, name):
    folder = ROOT / "experiments" / name
    assert (folder / "study.json").exists(), f"{name}: the committed study lost its study.json"
    copy = tmp_path / "study"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("*.pt", ".lock"))
    assert sorted(copy.glob("**/runs/*/seed*/metrics.jsonl")), f"{name}: no records committed"
    (copy / "report.md").unlink()  # removed first, so the comparison below cannot pass on the copied files
    (copy / "summary.json").unlink()
    assert main([command, "--report-only", "--out", str(copy)]) == 0
    for file in ("report.md", "summary.json"):
        assert (copy / file).read_bytes() == (folder / file).read_bytes(), file


def test_grokking_readme_quotes_the_tail_and_dip_definitions_and_counts_from_the_records():
    """The README's tail window, dip definition and per-seed dip counts are the code's, from summary.json."""

    from experiments.harness.records import DIP_DEFINITION, tail_description

    readme = (ROOT / "experiments" / "grokking" / "README.md").read_text()
    summary = json.loads((ROOT / "experiments" / "grokking" / "records" / "p97_add_5seeds" / "summary.json").read_text())
    tail = tail_description(summary["summary"])
    assert tail == "the last 10% of training: the evaluations at epochs 18,000–20,000 (21 per run)"
    assert tail in readme and DIP_DEFINITION in readme
    arms = summary["summary"]["arms"]
    for key, label in (("dips_after_reaching", "dips below 95% after grokking, per seed (total)"),
                       ("evaluations_below_after_reaching", "evaluations below 95% in those dips, per seed (total)")):
        row = next(line for line in readme.splitlines() if line.startswith(f"| {label} |"))
        cells = [c.strip() for c in row.strip("|").split("|")[1:4]]
        for cell, arm in zip(cells, ("adamw", "stiefel", "geoopt-radam"), strict=True):
            per_seed = list(arms[arm][key]["per_seed"].values())
            assert cell == f"{' / '.join(map(str, per_seed))} ({sum(per_seed)})", (label, arm)
    # companion: the old wording (epochs 18,100-20,000; evaluations counted as dips) is gone
    assert "18,100" not in readme
    assert arms["adamw"]["dips_after_reaching"]["per_seed"]["4"] != arms["adamw"][
        "evaluations_below_after_reaching"]["per_seed"]["4"]


def test_the_committed_frame_step_transfer_report_rebuilds_byte_for_byte(tmp_path):
    folder = ROOT / "experiments" / "lm" / "records" / "frame-step"
    if not (folder / "report.md").exists():
        pytest.skip("frame-step transfer report not committed yet")
    copy = tmp_path / folder.relative_to(ROOT)
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("*.pt", ".lock"))
    # the checks on other models (checks.json, paths relative to the folder) keep their place next to it
    checks = json.loads((folder / "checks.json").read_text())["checks"] if (folder / "checks.json").exists() else []
    for rel in [c[k] for c in checks for k in ("path", "reference") if k in c]:
        source = (folder / rel).resolve()
        shutil.copytree(source, tmp_path / source.relative_to(ROOT), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.pt", ".lock", "*.png", "report.md", "summary.json"))
    for name in ("report.md", "summary.json", "transfer.png"):
        (copy / name).unlink()  # removed first, so the comparison cannot pass on the copied files
    assert main(["lm", "--transfer-report", "--out", str(copy)]) == 0
    for name in ("report.md", "summary.json"):
        assert (copy / name).read_bytes() == (folder / name).read_bytes(), name


def test_the_lm_readme_words_on_the_frame_step_sweep_match_its_summary():
    """'the optimum sits at the same multiplier for three of the four shapes and one grid point higher for the
    narrowest' (experiments/lm/README.md) against the committed summary.json."""
    import math

    readme = (ROOT / "experiments" / "lm" / "README.md").read_text()
    phrase = ("the optimum sits at the same multiplier for three of\nthe four shapes and one grid point higher for "
              "the narrowest")
    assert phrase in readme
    shapes = json.loads((ROOT / "experiments" / "lm" / "records" / "frame-step" / "summary.json").read_text())["shapes"]
    assert len(shapes) == 4 and all(s["bracketed"] for s in shapes)
    best = {s["name"]: s["best_multiplier"] for s in shapes}
    common = max(set(best.values()), key=list(best.values()).count)
    others = [n for n, m in best.items() if m != common]
    assert list(best.values()).count(common) == 3 and others == ["w64"]  # w64 is the narrowest
    assert math.isclose(best["w64"] / common, 3.0)  # one grid point (x3) higher


def test_the_readme_table_and_words_on_the_default_frame_step_match_the_transfer_summary():
    """experiments/lm/README.md's table of what the default gives is default_table(summary.json), line for line; its
    words and the docs' (quickstart, optimizer) are checked against the same summary. To regenerate the table:
    replace the lines between that README's frame-step-default-table markers by default_table(summary)."""
    import math

    from experiments.lm.transfer import default_table

    summary = json.loads((ROOT / "experiments" / "lm" / "records" / "frame-step" / "summary.json").read_text())
    readme = LM_README.read_text()
    block = readme.split("<!-- frame-step-default-table")[1].split("<!-- end frame-step-default-table -->")[0]
    assert block.splitlines()[1:] == default_table(summary)
    shapes, checks = summary["shapes"], {c["experiment"]: c for c in summary["checks"]}
    words = " ".join(readme.split())
    assert ("The default is within one grid point of the best at three of the four language-model shapes and two "
            "grid points away at width 64 and on the vision model, where the best frame step is 9 times the "
            "model's lr") in words
    assert sorted(s["default_grid_distance"] for s in shapes) == [1, 1, 1, 2] and len(shapes) == 4
    assert [s["width"] for s in shapes if s["default_grid_distance"] == 2] == [64]
    assert checks["vision"]["default_grid_distance"] == 2 and checks["vision"]["bracketed"]
    assert checks["vision"]["best_multiplier"] == 9 and shapes[0]["best_multiplier"] == 9
    assert ("The paper's step, the default before, is worse than the default on every language-model shape and "
            "on the vision model, and worse than AdamW on all of them but the widest language model") in words
    rule_at_one = {s["name"]: next(r["mean"] for r in s["rows"] if r["multiplier"] == 1.0) for s in shapes}
    assert all(s["papers_step_mean"] > rule_at_one[s["name"]] for s in shapes)  # bpb: lower is better
    vision_one = next(r["mean"] for r in checks["vision"]["rows"] if r["multiplier"] == 1.0)
    assert checks["vision"]["papers_step_mean"] < vision_one  # accuracy: higher is better
    worse_than_adamw = [s["papers_step_mean"] > s["adamw_mean"] for s in shapes]
    assert worse_than_adamw == [s["width"] != max(x["width"] for x in shapes) for s in shapes]
    assert checks["vision"]["papers_step_mean"] < checks["vision"]["adamw_mean"]
    # grokking: "the smallest steps grok earliest, the paper's step among them, and the default groks later than
    # AdamW"
    g = checks["grokking"]
    means = [r["mean"] for r in g["rows"]]
    assert means == sorted(means) and g["papers_step_mean"] <= means[0]
    one = next(r["mean"] for r in g["rows"] if r["multiplier"] == 1.0)
    assert one > g["adamw_mean"]
    # docs: "the best being 3 to 9 times larger" and "about five grid points" for the paper's step
    quick = " ".join((ROOT / "docs" / "quickstart.rst").read_text().split())
    assert "the best being 3 to 9 times larger" in quick
    assert {s["best_multiplier"] for s in shapes} | {checks["vision"]["best_multiplier"]} == {3, 9}
    optimizer_doc = " ".join((ROOT / "docs" / "optimizer.rst").read_text().split())
    assert "where the paper's step was about five grid points too small" in optimizer_doc
    papers = [(s["best_multiplier"], 1 / math.sqrt(s["width"] * s["head_size"])) for s in shapes]
    papers.append((checks["vision"]["best_multiplier"], checks["vision"]["papers_step_multiplier"]))
    for best, mu0 in papers:  # grid points (factors of 3) from the paper's step to the best
        assert 4.5 <= math.log(best / mu0, 3) <= 5.5, (best, mu0)
    # companion: a wrong table line is caught
    assert block.splitlines()[1:] != default_table({**summary, "shapes": shapes[:3]})


def test_the_readmes_numbers_on_the_language_model_study_match_its_records():
    """Issue 26, item 4: the words and numbers the lm README states about runs/full and runs/lr-3e-3 (its sections
    and "The studies in brief", the top README's paragraph before it became a front page), rounded as printed,
    recomputed from their summary.json and records (the angles from the runs' last records)."""
    lm = ROOT / "experiments" / "lm" / "records"
    full = json.loads((lm / "full" / "summary.json").read_text())
    follow = json.loads((lm / "lr-3e-3" / "summary.json").read_text())
    comp = full["main"]["comparisons"]
    sweep = {r["frame_lr"]: r["vs_adamw"] for r in full["frame_lr_sweep"]}
    readme = " ".join(_lm_brief().split())
    lm_readme = LM_README.read_text()

    def signed(x, digits=3):
        return f"{x:+.{digits}f}".replace("-", "−")

    main = comp["stiefel - adamw"]
    assert (f"{signed(main['mean'])} bpb (95% CI [{signed(main['ci_low'])}, {signed(main['ci_high'])}]"
            .replace("−", "-") in readme.replace("−", "-"))
    assert main["n_positive"] == 3 and main["sign_test_p"] == 0.25  # "on all three paired seeds", p >= 0.25
    gain = comp["stiefel-gain - adamw"]["mean"]
    assert f"({signed(gain)})" in readme and "cuts the gap by about 40%" in readme
    assert round(1 - gain / main["mean"], 2) == 0.41  # "halves" was wrong: 41%
    same = comp["stiefel - geoopt-radam"]["differences"]
    assert f"{max(abs(d) for d in same):.1e}" == "1.3e-04" and f"{abs(sum(same) / len(same)):.1e}" == "2.5e-05"
    assert "to 1.3e-4 per seed (2.5e-5 on average)" in readme
    assert "by 2.5e-5 on average and by at\n   most 1.3e-4 on a seed" in lm_readme
    for lr, text in ((0.01, "+0.092 at 1e-2"), (0.03, "+0.049 at 3e-2")):
        assert text in readme and f"{sweep[lr]['mean']:+.3f}" == text.split()[0]
    best = sweep[0.1]
    assert f"{signed(best['mean'])} bpb at 1e-1 (CI [{signed(best['ci_low'])}, {signed(best['ci_high'])}]" in readme
    assert f"p = {best['p_value']:.3f}" in readme and best["n_negative"] == 3
    again = follow["frame_lr_sweep"][0]["vs_adamw"]
    assert (f"{signed(again['mean'])} bpb (CI [{signed(again['ci_low'])}, {signed(again['ci_high'])}], 3/3 seeds, "
            f"p = {again['p_value']:.3f}" in readme)
    assert f"{follow['main']['arms']['adamw']['final_val_bpb']['mean']:.3f} bpb" in readme
    # the table's angle ranges: largest principal angle of W_Q to its start at the last record, over the seeds
    for cell, printed in (("frame-lr-0.01", "24.8–32.5°"), ("frame-lr-0.03", "54.8–59.4°"),
                          ("frame-lr-0.1", "73.4–76.2°")):
        angles = [read_records(f)[-1]["angle_max_deg/q"]
                  for f in sorted((lm / "full" / cell / "runs" / "stiefel").glob("seed*/metrics.jsonl"))]
        assert len(angles) == 3 and f"{min(angles):.1f}–{max(angles):.1f}°" == printed
        assert f"| {printed} |" in lm_readme
    # companion: the wordings the issue found wrong are gone
    for old in ("clearly worse", "halves the gap", "to 3e-5 bpb", "21–33°", "71–76°", "stays ahead"):
        assert old not in readme and old not in lm_readme, old


def test_the_grokking_readme_on_start_constraint_or_step_matches_its_records():
    """Issues 27 and 38: the README's table of the six arms (grokking epoch median [min, max], W_Q's largest angle to
    its start) and every figure of its seven contrasts and of the section on issue 38 are the committed summary's,
    rounded as written (the contrasts and that section are generated blocks: a stale one fails here)."""
    import statistics

    from experiments.grokking.study import readme_block, readme_blocks

    folder = ROOT / "experiments" / "grokking" / "records" / "p97_add_arms10"
    data = json.loads((folder / "summary.json").read_text())
    arms, contrasts = data["summary"]["arms"], data["summary"]["mechanism"]["contrasts"]
    readme = (ROOT / "experiments" / "grokking" / "README.md").read_text()
    block = readme.split("<!-- arms10-table")[1].split("<!-- end arms10-table -->")[0]
    rows = {r.split("|")[1].strip(" `"): [c.strip() for c in r.strip("|").split("|")]
            for r in block.splitlines() if r.startswith("| `")}
    assert sorted(rows) == sorted(arms)

    def range_deg(values):
        lo, hi = min(values), max(values)
        return "0°" if hi < 1e-6 else f"{lo:.1f}–{hi:.1f}°"

    for arm, cells in rows.items():
        first = arms[arm]["first_epoch_reaching"]
        assert first["n_reached"] == first["n"] == 10, arm
        epochs = list(first["per_seed"].values())
        assert cells[2] == f"{statistics.median(epochs):,.0f} [{min(epochs):,}, {max(epochs):,}]", arm
        assert cells[3] == range_deg(arms[arm]["final_angle_max_deg/q"]["per_seed"].values()), arm
    words = " ".join(readme.split())
    # the seven contrasts and the section on issue 38 are generated from summary.json (refresh_readme rewrites them)
    for name, lines in readme_blocks(data).items():
        assert readme_block(readme, name) == lines, f"README block {name} is stale: run refresh_readme()"
    own = [c for c in contrasts if c["arm"] != "adamw-qk-nodecay" and c["against"] != "adamw-qk-nodecay"]
    assert len(own) == 5 and all(c["n"] == 10 and c["machines"] == ["Intel(R) Xeon(R) Processor"] for c in own)
    assert all(f"Holm p = {c['p_holm']:.2g}" in words for c in contrasts)
    start = next(c for c in contrasts if c["question"] == "the start")
    assert f"later on {start['n_positive']}/10 seeds, sign test p = {start['sign_test_p']:.2g}" in words
    assert f"{start['sign_test_p_holm']:.2g} after Holm" in words
    step = next(c for c in contrasts if c["question"] == "the step on the manifold")
    assert step["verdict"] == "not seen" and step["ci_low"] < 0 < step["ci_high"]
    move = {a: arms[a]["final_move_total/q"]["mean"] for a in ("stiefel", "adamw")}
    assert f"‖W_Q − W_Q0‖_F = {move['stiefel']:.2g} against {move['adamw']:.3g} for AdamW" in words
    minutes = sorted(v["seconds"] / 60 for v in data["speed"].values())
    assert (f"{sum(minutes):.0f} minutes of training in all (median {statistics.median(minutes):.1f} minutes a run, "
            f"from {minutes[0]:.1f} to {minutes[-1]:.1f}") in words
    # the row of experiments/README.md's table of headline figures says the same, from the same records
    row = _index_row("grokking: why the Stiefel arm groks earlier")
    by_question = {c["question"]: c for c in contrasts}
    for question, text in (("training W_Q, W_K at all", "{neg:.0f} epochs before AdamW (CI [{lo}, {hi}], {n}/10"),
                           ("the step on the manifold", "({mean} epochs, CI [{lo}, {hi}])"),
                           ("the start", "({mean}, CI [{lo}, {hi}])")):
        c = by_question[question]
        fmt = {"neg": -c["mean"], "n": c["n_negative"], "mean": f"{c['mean']:+.0f}",
               "lo": f"{c['ci_low']:+.0f}".replace("-", "−"), "hi": f"{c['ci_high']:+.0f}".replace("-", "−")}
        assert text.format(**fmt) in row, (question, text.format(**fmt))
    # the protocol as it is, from the summary: the paper's task and model, fewer epochs than the paper
    train = data["config"]["train"]
    assert (f"The paper's task and model settings (the defaults above), {train['epochs']:,} epochs (the paper ran "
            f"{data['paper']['epoch']:,}), an evaluation every {train['eval_every']} epochs" in words)
    # companion: a seed that moved would change the table's range; the old in-progress wording is gone
    assert range_deg([1.0, 2.0]) == "1.0–2.0°" and "in progress" not in readme.split("## Start, constraint")[1][:80]
    assert "Paper protocol" not in readme and "partly done" not in readme


def test_the_grokking_readmes_say_what_the_decay_control_showed():
    """Issue 57, item 6: the grokking README's paragraph after the contrasts and experiments/README.md's row say what
    `adamw-qk-nodecay` showed, every figure from the committed summary.json (W_Q's median movement and largest
    angle at the last epoch, the decay contrast and the frozen one, each with its interval): it moves W_Q less than
    `adamw` yet groks later, so "only through how little it moves the frames" is gone; the top row names all the
    arms, the decay control among them. Companion (assert_quoted): any of these phrases with one digit changed is
    not in the text."""
    from experiments.grokking.study import NODECAY

    data = json.loads((ROOT / "experiments" / "grokking" / "records" / "p97_add_arms10" / "summary.json").read_text())
    arms, mech = data["summary"]["arms"], data["summary"]["mechanism"]
    w = mech["w_q"]
    end = w["epochs"][-1]

    def med(arm: str, key: str, fmt: str) -> str:
        return format(w["arms"][arm][key][-1]["median"], fmt)

    by = {c["question"]: c for c in mech["contrasts"]}
    decay, frozen = by["weight decay on W_Q, W_K"], by["training W_Q, W_K without decay"]
    assert decay["arm"] == NODECAY and decay["against"] == "adamw" and len(decay["machines"]) == 1
    assert frozen["arm"] == "adamw-frozen" and frozen["against"] == NODECAY and len(frozen["machines"]) == 1
    # what the paragraph states: less movement and a smaller angle than adamw, yet later grokking, resolved
    assert w["arms"][NODECAY]["move"][-1]["median"] < w["arms"]["adamw"]["move"][-1]["median"]
    assert w["arms"][NODECAY]["angle"][-1]["median"] < w["arms"]["adamw"]["angle"][-1]["median"]
    assert decay["ci_low"] > 0 and frozen["ci_high"] < 0

    def ci(c: dict) -> str:
        return f"CI [{_signed(c['ci_low'], '+.0f')}, {_signed(c['ci_high'], '+.0f')}]"

    readme = (ROOT / "experiments" / "grokking" / "README.md").read_text()
    paragraph = readme[readme.index("So the data point to the **step**"):readme.index("## Earlier single-seed result")]
    assert_quoted(paragraph, [
        f"‖W_Q − W_Q0‖_F {med(NODECAY, 'move', '.2g')} against {med('adamw', 'move', '.3g')}",
        f"largest principal angle to the start {med(NODECAY, 'angle', '.1f')}° against {med('adamw', 'angle', '.1f')}°",
        f"medians at epoch {end:,}",
        f"groks {decay['mean']:.0f} epochs *later* ({ci(decay)}, {decay['n']} pairs of one CPU kind)",
        f"{-frozen['mean']:.0f} epochs after W_Q/W_K frozen at the same start ({ci(frozen)})"])
    assert "only through how little it moves the frames" not in readme
    row = _index_row("grokking: why the Stiefel arm groks earlier")
    words = {5: "five", 6: "six", 7: "seven", 8: "eight"}
    assert f"ten paired seeds, {words[len(arms)]} arms (" in row
    assert all(f"`{arm}`" in row for arm in arms) and f"the decay control `{NODECAY}`" in row
    assert_quoted(row, [
        f"largest angle to its start {med(NODECAY, 'angle', '.1f')}° vs {med('adamw', 'angle', '.1f')}°",
        f"groks {decay['mean']:.0f} epochs later ({ci(decay)}, {decay['n']} pairs on one CPU kind)"])


def test_the_grokking_contrasts_of_issue_38_pair_runs_of_one_cpu_kind_only():
    """Issue 38: the two contrasts with adamw-qk-nodecay pair, seed by seed, runs whose environment.json name the
    same CPU model, as many as the folders hold (runs/, repro/, same_cpu/); a stale summary fails here. Companion:
    the by-seed pairs of the study's own runs would cross CPU kinds, and are kept only as the labelled comparison."""
    from experiments.harness.mechanism import run_machine

    folder = ROOT / "experiments" / "grokking" / "records" / "p97_add_arms10"
    data = json.loads((folder / "summary.json").read_text())
    mechanism = data["summary"]["mechanism"]

    def machine(path):
        return run_machine(json.loads((folder / path / "environment.json").read_text()))

    def finished(arm):  # seeds of arm trained on the new arm's CPU kind, by the folders
        kind = machine("runs/adamw-qk-nodecay/seed0")
        return {int(p.parent.name[4:]) for f in ("runs", "repro", "same_cpu")
                for p in (folder / f / arm).glob("seed*/metrics.jsonl")
                if machine(p.parent.relative_to(folder)) == kind
                and read_records(p)[-1]["epoch"] == data["config"]["train"]["epochs"]}

    by = {c["question"]: c for c in mechanism["contrasts"]}
    for question, other in (("weight decay on W_Q, W_K", "adamw"), ("training W_Q, W_K without decay", "adamw-frozen")):
        c = by[question]
        assert {int(s) for s in c["pairs"]} == finished(other), question
        assert c["n"] == len(c["pairs"]) and c["n"] + len(c["unpaired_seeds"]) == 10
        for arm_run, against_run in c["pairs"].values():
            assert machine(arm_run) == machine(against_run) == "AMD EPYC", (question, arm_run, against_run)
        own = c["cross_machine"]
        assert own["n"] == 10 and own["machines"] in (["AMD EPYC × Intel(R) Xeon(R) Processor"],
                                                      ["Intel(R) Xeon(R) Processor × AMD EPYC"])
        assert "p_holm" not in own and "verdict" not in own
    # Holm over the family of seven, on the same-CPU contrasts
    from experiments.harness.stats import holm

    assert [c["p_holm"] for c in mechanism["contrasts"]] == holm([c["p_value"] for c in mechanism["contrasts"]])
    assert len(mechanism["contrasts"]) == 7


def _tuned_paragraphs() -> dict[str, str]:
    """The words the lm README says about the tuned study (issue 26): its paragraph in "The studies in brief" (the
    top README's before it became a front page) and the study's status, up to its generated results block."""
    brief = _lm_brief()
    start = brief.index("A comparison tuned against tuned")
    lm_readme = LM_README.read_text()
    section = lm_readme[lm_readme.index("## Tuned against tuned"):]
    status = section[section.index("**Status** ("):section.index("Results (this block is generated")]
    return {"experiments/lm/README.md in brief": brief[start:brief.index("\n\n", start)],
            "experiments/lm/README.md status": status}


def test_the_readmes_words_on_the_tuned_study_quote_only_its_summary():
    """Issue 26, item 4: every decimal number the READMEs state about the tuned study (lrs, bpb, differences) is one
    of its summary.json's, at the precision printed; the generated table is checked in test_lm_tuned."""
    from experiments.lm.tuned import numbers_not_in_summary

    summary = json.loads((ROOT / "experiments" / "lm" / "records" / "tuned" / "summary.json").read_text())
    for where, text in _tuned_paragraphs().items():
        assert numbers_not_in_summary(text, summary) == [], where
    # companion: a number the summary does not hold is caught in the same text
    status = _tuned_paragraphs()["experiments/lm/README.md status"]
    assert numbers_not_in_summary(status + " 1.2345 bpb", summary) == ["1.2345"]
    # the counts, which numbers_not_in_summary does not read (integers): seeds lower, the comparisons Holm adjusts
    comp = summary["final"]["comparisons"]
    gap, beside = comp["test: stiefel - adamw"], comp["test: stiefel-muon - muon"]
    floor = min(c["sign_test_p"] for c in comp.values())
    assert floor == 2 / 2 ** gap["n"]  # the smallest two-sided sign-test p of n pairs
    for text in _tuned_paragraphs().values():
        assert_quoted(text, [f"lower on {gap['n_negative']}/{gap['n']} seeds",
                             f"give a sign-test p below {floor:g}"])
    assert_quoted(status, [f"lower on {beside['n_negative']} of {beside['n']} seeds",
                           f"Holm over each section's {len(comp)} comparisons"])


def test_the_lm_readme_table_on_the_trust_region_units_matches_its_records():
    """experiments/lm/README.md 'The trust region in frame units': each row's final val bpb is the records', and the
    two runs of a pair agree at every evaluation (the words 'bit for bit equal'). Companion: the frame-step study's
    own run of w128 seed 1 (another commit and CPU) is not bit-equal to it, so the comparison can fail."""
    folder = ROOT / "experiments" / "lm" / "records" / "trust-region"
    readme = (ROOT / "experiments" / "lm" / "README.md").read_text()
    for shape in ("w128", "w256"):
        for seed in (0, 1):
            runs = [read_records(folder / f"{shape}-{radius}" / "runs" / "stiefel" / f"seed{seed}" / "metrics.jsonl")
                    for radius in ("auto", "old")]
            assert [r["val_bpb"] for r in runs[0]] == [r["val_bpb"] for r in runs[1]], (shape, seed)
            assert len(runs[0]) == 11 and runs[0][-1]["step"] == 1000
            row = f"| {shape} | {seed} | {runs[0][-1]['val_bpb']:.6f} | {runs[1][-1]['val_bpb']:.6f} |"
            assert row in readme, row
    other = read_records(ROOT / "experiments" / "lm" / "records" / "frame-step" / "w128" / "runs" / "stiefel" / "seed1"
                         / "metrics.jsonl")
    ours = read_records(folder / "w128-auto" / "runs" / "stiefel" / "seed1" / "metrics.jsonl")
    assert [r["val_bpb"] for r in other] != [r["val_bpb"] for r in ours]


# ---------------------------------------------------------------------------------------------- README numbers
# The tests below build, from the committed records, each phrase a README states (rounded as printed) and require it
# in the text with conftest.assert_quoted, whose companion changes one digit of each phrase and requires the check to
# catch it.
LM = ROOT / "experiments" / "lm" / "records"


def _signed(x: float, fmt: str) -> str:
    """``x`` formatted by ``fmt`` (which may hold ``+``) with the READMEs' typographic minus."""
    return f"{x:{fmt}}".replace("-", "−")


def _lm_last(study: str, subdir: str, arm: str) -> list[dict]:
    """The last record of every seed of ``arm`` in a language-model study's cell (``subdir``: '' for the main one)."""
    runs = (LM / study / subdir / "runs" / arm).glob("seed*/metrics.jsonl")
    return [read_records(f)[-1] for f in sorted(runs)]


def _lm_row(study: str, subdir: str, arm: str, frame_lr: str, vs: dict | None, angle: str, attention: str | None
            ) -> str:
    """A row of the LM README's result tables from the records: val bpb with its t-interval, the paired difference
    against AdamW (bold, with t and p, where the arm is better on every pair), pairs worse, W_Q's largest angle to
    its start (``angle``: '.0f' for the mean, 'range .1f' for min–max) and the mean logit RMS / entropy."""
    import statistics

    from experiments.harness.stats import mean_ci

    last = _lm_last(study, subdir, arm)
    mean, low, high = mean_ci([r["val_bpb"] for r in last])
    cells = [f"`{arm}`", frame_lr, f"{mean:.3f} [{low:.3f}, {high:.3f}]"]
    if vs is None:
        cells += ["–", "–"]
    else:
        diff = f"{_signed(vs['mean'], '+.3f')} [{_signed(vs['ci_low'], '+.3f')}, {_signed(vs['ci_high'], '+.3f')}]"
        if vs["n_negative"] == vs["n"]:
            diff = f"**{diff}** (t = {_signed(vs['t'], '.2g')}, p = {vs['p_value']:.2g})"
        cells += [diff, f"{vs['n_positive']}/{vs['n']}"]
    angles = [r["angle_max_deg/q"] for r in last]
    fmt = angle.split()[-1]
    cells.append(f"{min(angles):{fmt}}–{max(angles):{fmt}}°" if angle.startswith("range")
                 else f"{statistics.mean(angles):{fmt}}°")
    if attention:
        rms, entropy = (statistics.mean(r[k] for r in last) for k in ("logit_rms/mean", "attn_entropy/mean"))
        cells.append(f"{rms:{attention}} / {entropy:{attention}}")
    return "| " + " | ".join(cells) + " |"


def test_the_lm_readme_on_the_full_study_and_its_lr_3e_3_follow_up_quotes_their_records():
    """experiments/lm/README.md, "What it shows" and "A stronger AdamW baseline": both tables row for row and every
    figure of the words under them (and the angles of "The studies in brief"), from runs/full and runs/lr-3e-3
    (summary.json and the runs' last records). Companion: any of these phrases with one digit changed is caught."""
    import statistics

    full = json.loads((LM / "full" / "summary.json").read_text())
    follow = json.loads((LM / "lr-3e-3" / "summary.json").read_text())
    comp, arms = full["main"]["comparisons"], full["main"]["arms"]
    sweep = {r["frame_lr"]: r["vs_adamw"] for r in full["frame_lr_sweep"]}
    again = follow["frame_lr_sweep"][0]["vs_adamw"]
    readme = (ROOT / "experiments" / "lm" / "README.md").read_text()
    top = _lm_brief()
    rows = [_lm_row("full", "", "adamw", "–", None, ".0f", ".2f")]
    rows += [_lm_row("full", "", arm, "1e-3", comp[f"{arm} - adamw"], ".0f", ".2f")
             for arm in ("stiefel", "geoopt-radam", "stiefel-gain")]
    rows += [_lm_row("full", f"frame-lr-{lr}", "stiefel", label, sweep[lr], "range .1f", ".1f")
             for lr, label in ((0.01, "1e-2"), (0.03, "3e-2"), (0.1, "1e-1"))]
    rows += [_lm_row("lr-3e-3", "", "adamw", "–", None, ".0f", None),
             _lm_row("lr-3e-3", "frame-lr-0.1", "stiefel", "1e-1", again, "range .0f", None)]
    assert all(row in readme.splitlines() for row in rows), [r for r in rows if r not in readme.splitlines()]
    main, best = comp["stiefel - adamw"], sweep[0.1]
    mean = {k: {a: arms[a][f"final_{k}"]["mean"] for a in ("adamw", "stiefel")}
            for k in ("train_bpb", "angle_max_deg/q", "attn_entropy/mean")}
    gain = comp["stiefel - stiefel-gain"]
    layer1 = [statistics.mean(r[f"logit_rms/1/{h}"] for r in _lm_last("full", "", "stiefel-gain")) for h in range(4)]
    same = comp["stiefel - geoopt-radam"]

    def e(x):  # one significant digit in e notation, as "−2e-4"
        return _signed(x, "+.0e").replace("e−0", "e-")

    follow_stiefel = statistics.mean(r["train_bpb"] for r in _lm_last("lr-3e-3", "frame-lr-0.1", "stiefel"))
    assert main["n_positive"] == main["n"] == 3 and best["n_negative"] == 3 and gain["n_positive"] == 3
    assert again["n_negative"] == again["n"] == 3
    phrases = [
        f"{_signed(main['mean'], '+.2f')} bpb on all three seeds (with three pairs no sign test can go below "
        f"p = {main['sign_test_p']:.2g})",
        f"({mean['train_bpb']['stiefel']:.2f} vs {mean['train_bpb']['adamw']:.2f} training-window bpb)",
        f"({mean['angle_max_deg/q']['stiefel']:.0f}° against AdamW's {mean['angle_max_deg/q']['adamw']:.0f}°)",
        f"(entropy {mean['attn_entropy/mean']['stiefel']:.2f} vs {mean['attn_entropy/mean']['adamw']:.2f} nats)",
        " → ".join(_signed(sweep[lr]["mean"], "+.3f") for lr in (0.001, 0.01, 0.03)),
        f"better than AdamW on all three seeds** by {-best['mean']:.3f} bpb",
        f"(p = {best['p_value']:.3f} with {best['n']} pairs)",
        f"(−{gain['mean']:.3f} bpb against `stiefel`, {gain['n_positive']}/{gain['n']} seeds)",
        f"(logit RMS {min(layer1):.0f}–{max(layer1):.0f} in layer 1)",
        f"(95% CI of the difference [{e(same['ci_low'])}, {e(same['ci_high'])}])",
        f"ahead again: {_signed(again['mean'], '+.3f')} bpb, {again['n_negative']}/{again['n']} seeds",
        f"({follow['main']['arms']['adamw']['final_val_bpb']['mean']:.3f} against "
        f"{arms['adamw']['final_val_bpb']['mean']:.3f} bpb)",
        f"({follow_stiefel:.2f} against {follow['main']['arms']['adamw']['final_train_bpb']['mean']:.2f})",
    ]
    assert_quoted(readme, phrases)
    assert_quoted(top, [f"({mean['angle_max_deg/q']['stiefel']:.0f}° vs {mean['angle_max_deg/q']['adamw']:.0f}° "
                         f"after training)"])
    # companion: a row with one digit changed is not a line of the README
    assert rows[0].replace("1.993", "1.994") not in readme.splitlines()


def test_the_lm_readme_settings_time_pilot_and_controls_figures_match_their_records():
    """experiments/lm/README.md: the corpus and budget figures of "Settings" (summary.json of runs/full), the uniform
    entropy (the report's), the seed-0 angles; the measured wall times of "Time" (the runs' environment.json as
    summary.json's speed sums them); the pilot's table and figures (runs/pilot); the frame-step seeds; the parameter
    count (the model the study builds; "The studies in brief" too); the tuned study's run counts (its run folders); the
    controls study's split (its runs' config.json). Companion: any of these phrases with one digit changed is
    caught."""
    from datetime import datetime, timedelta
    from types import SimpleNamespace

    from experiments.lm.study import _uniform_entropy, build_model

    readme = (ROOT / "experiments" / "lm" / "README.md").read_text()
    full = json.loads((LM / "full" / "summary.json").read_text())
    config, corpus = full["config"], full["corpus"]
    steps = config["train"]["epochs"] * config["steps_per_epoch"]
    trained = steps * config["batch_size"] * config["context"]
    angle0 = {arm: read_records(LM / "full" / "runs" / arm / "seed0" / "metrics.jsonl")[-1]["angle_max_deg/q"]
              for arm in ("stiefel", "adamw")}
    model = build_model(SimpleNamespace(**{k: config[k] for k in ("context", "width", "depth", "heads")}), seed=0)
    parameters = f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters"
    assert_quoted(_lm_brief(), [f"a byte-level GPT-2, {parameters}"])
    phrases = [
        f"{corpus['train_files']} training files ({corpus['train_bytes']:,} bytes), {corpus['val_files']} validation "
        f"files ({corpus['val_bytes']:,} bytes), corpus SHA-256 `{corpus['sha256'][:8]}…`",
        f"One model size ({parameters})",
        f"width 128, 4 layers, 4 heads (head size 32), MLP 512, no dropout, tied embeddings, pre-norm causal; "
        f"{parameters}",
        f"({trained / 1e6:.1f} M training bytes, about {trained / corpus['train_bytes']:.1f} passes over the training "
        f"text)",
        f"uniform causal attention averages {_uniform_entropy(config['context']):.2f} over {config['context']} "
        f"positions",
        f"(measured at seed 0: {angle0['stiefel']:.0f}° against {angle0['adamw']:.0f}° of largest principal angle "
        f"after {steps:,} steps)",
    ]
    # Time: every run of the study in one of the groups the paragraph names
    minutes = {k: v["seconds"] / 60 for k, v in full["speed"].items()}
    groups = {"seed 0": ["adamw/seed0", "stiefel/seed0"], "adamw 1-2": ["adamw/seed1", "adamw/seed2"],
              "side by side": ["stiefel/seed1", "stiefel/seed2", *(f"{a}/seed{s}" for a in ("stiefel-gain",
                               "geoopt-radam", "frame-lr-0.01/stiefel") for s in range(3))],
              "3e-2": [f"frame-lr-0.03/stiefel/seed{s}" for s in range(3)],
              "1e-1": [f"frame-lr-0.1/stiefel/seed{s}" for s in range(3)]}
    assert sorted(k for g in groups.values() for k in g) == sorted(minutes) and len(minutes) == 21

    def span(group):
        values = [minutes[k] for k in groups[group]]
        return f"{min(values):.1f}–{max(values):.1f} min"

    spans = []
    for env in (LM / "full").glob("**/runs/*/seed*/environment.json"):
        for call in json.loads(env.read_text()):
            start = datetime.fromisoformat(call["started"])
            spans.append((start, start + timedelta(seconds=call["seconds"])))
    hours = (max(e for _, e in spans) - min(s for s, _ in spans)).total_seconds() / 3600
    adamw12 = {f"{minutes[k]:.1f}" for k in groups["adamw 1-2"]}
    assert len(adamw12) == 1
    phrases += [
        f"{minutes['adamw/seed0']:.1f} min (`adamw`) and {minutes['stiefel/seed0']:.1f} min (`stiefel`) for the "
        f"first two seed-0 runs",
        f"{span('side by side')} for the other `stiefel`, `stiefel-gain` and `geoopt-radam` runs and the frame-lr "
        f"1e-2 cell",
        f"{adamw12.pop()} min for `adamw` seeds 1–2",
        f"{span('3e-2')} for the frame-lr 3e-2 cell and {span('1e-1')} for the 1e-1 cell",
        f"the study took {hours:.1f} hours of wall time",
    ]
    # the pilot
    pilot = json.loads((LM / "pilot" / "summary.json").read_text())
    a, s = pilot["main"]["arms"]["adamw"], pilot["main"]["arms"]["stiefel"]
    pilot_steps = pilot["config"]["train"]["epochs"] * pilot["config"]["steps_per_epoch"]
    rates = {f"{pilot_steps / v['seconds']:.2f}" for v in pilot["speed"].values()}
    start = read_records(LM / "pilot" / "runs" / "adamw" / "seed0" / "metrics.jsonl")[0]
    assert len(rates) == 1 and start["step"] == 0

    def m(arm, key, fmt):
        return f"{arm[f'final_{key}']['mean']:{fmt}}"

    phrases += [
        f"| validation bits per byte (256 fixed windows) | {m(a, 'val_bpb', '.3f')} | {m(s, 'val_bpb', '.3f')} |",
        f"| training-window bits per byte | {m(a, 'train_bpb', '.3f')} | {m(s, 'train_bpb', '.3f')} |",
        f"| largest principal angle of W_Q / W_K to its start | {m(a, 'angle_max_deg/q', '.0f')}° / "
        f"{m(a, 'angle_max_deg/k', '.0f')}° | {m(s, 'angle_max_deg/q', '.1f')}° / {m(s, 'angle_max_deg/k', '.1f')}° |",
        f"| attention-logit RMS / entropy, mean over the 16 heads | {m(a, 'logit_rms/mean', '.2f')} / "
        f"{m(a, 'attn_entropy/mean', '.2f')} nats | {m(s, 'logit_rms/mean', '.2f')} / "
        f"{m(s, 'attn_entropy/mean', '.2f')} nats |",
        f"({rates.pop()} steps/s per run with both runs side by side",
        f"grows from {start['logit_rms/mean']:.2f} at initialisation",
        f"to about {m(a, 'logit_rms/mean', '.1f')}, with lower attention entropy",
    ]
    # the frame-step sweep's seeds per shape
    shapes = {s["name"]: len(s["seeds"]) for s in json.loads((LM / "frame-step" / "summary.json").read_text())["shapes"]}
    assert shapes == {"w64": 2, "w128": 2, "w128-h64": 1, "w256": 1}
    phrases.append("(2 seeds at width 64 and at width 128 with 32-dimensional heads, 1 at width 256 and at width 128 "
                   "with 64-dimensional heads)")
    # the tuned study's run counts, from its run folders
    grid = len(list((LM / "tuned").glob("lr-*/runs/*/seed*/metrics.jsonl")))
    final = len(list((LM / "tuned" / "final").glob("runs/*/seed*/metrics.jsonl")))
    phrases += [f"{grid} grid runs, {final} final runs", f"The grid ({grid} runs:", f"(seeds 2-6, {final} runs)"]
    # the controls study's three-way split, as every run of it so far records it
    splits = {tuple(json.loads(f.read_text())["config"]["corpus_identity"][f"{k}_files"] for k in ("train", "val",
                                                                                                    "test"))
              for f in (LM / "controls").glob("**/runs/*/seed*/config.json")}
    if splits:
        assert len(splits) == 1
        phrases.append("names the three-way split it used ({}/{}/{} files)".format(*splits.pop()))
    assert_quoted(readme, phrases)


def _pp(x: float, digits: int = 2, sign: bool = True) -> str:
    """A fraction as the READMEs print it in percentage points: signed, typographic minus."""
    return f"{x * 100:{'+' if sign else ''}.{digits}f}".replace("-", "−")


def test_the_readmes_numbers_on_the_vision_studies_match_their_summaries():
    """Every figure the vision README's result sections and experiments/README.md's Fashion-MNIST rows state about the
    committed paired, ablation, scaling and decay studies, rounded as printed, from their summary.json and records.
    Companion: a gap one hundredth of a point off is not in the text."""
    paired = json.loads((VISION / "fashion-mnist-paired" / "summary.json").read_text())["cells"][0]
    ablation = json.loads((VISION / "fashion-mnist-ablation" / "summary.json").read_text())["cells"][0]
    scaling = json.loads((VISION / "fashion-mnist-scaling" / "summary.json").read_text())["cells"]
    decay = json.loads((VISION / "fashion-mnist-decay" / "summary.json").read_text())["cells"]
    vision = " ".join((ROOT / "experiments" / "vision" / "README.md").read_text().split())
    row = _index_row

    arms, comp = paired["arms"], paired["comparisons"]
    gap, frozen = comp["stiefel - adamw"], comp["stiefel - stiefel-frozen"]
    for arm in ("adamw", "stiefel"):
        acc = arms[arm]["final_test_acc"]
        assert f"| final test accuracy, {arm} | – | {acc['mean'] * 100:.2f}% ± {acc['std'] * 100:.2f} |" in vision, arm
    ci = f"95% CI [{_pp(gap['ci_low'])}, {_pp(gap['ci_high'])}]"
    assert f"**{_pp(gap['mean'])} pp** (sd {_pp(gap['std'], sign=False)}, {ci})" in vision
    p_value = f"{gap['p_value']:.1e}".replace("e-0", "e-")  # 1.2e-5
    assert f"| {gap['t']:.2g} (p = {p_value})".replace("-", "−", 1) in vision
    assert gap["n_positive"] == 0 and gap["n"] == 12 and "**0/12**" in vision
    assert f"all {gap['n']} pairs ({_pp(max(gap['differences']))} to {_pp(min(gap['differences']))} pp)" in vision
    ratio_q, ratio_k = paired["movement"]["adamw / stiefel"]["ratio_q"], paired["movement"]["adamw / stiefel"]["ratio_k"]
    band = f"{ratio_q['min']:.0f}–{ratio_q['max']:.0f}×"
    assert (f"**{band}** over all (seed, window) pairs, median {ratio_q['median']:.0f}×; "
            f"W_K {ratio_k['min']:.0f}–{ratio_k['max']:.0f}×") in vision
    assert f"The frames move {band} less per step" in vision
    move = {a: arms[a]["final_move_total_rel/q"]["mean"] for a in ("stiefel", "adamw")}
    angle = {a: arms[a]["final_angle_max_deg/q"]["mean"] for a in ("stiefel", "adamw")}
    assert (f"‖W − W₀‖_F/‖W₀‖_F = {move['stiefel']:.2g}; largest principal angle to the initial span "
            f"{angle['stiefel']:.1f}° (AdamW's W_Q: {move['adamw']:.2f} and {angle['adamw']:.0f}°)") in vision
    assert f"barely leave their initialisation ({angle['stiefel']:.1f}°)" in vision
    assert (f"| {_pp(frozen['mean'])} pp (95% CI [{_pp(frozen['ci_low'])}, {_pp(frozen['ci_high'])}], "
            f"{frozen['n_positive']}/{frozen['n']} positive, p = {frozen['p_value']:.1g})") in vision
    assert f"freezing them costs only {_pp(frozen['mean'])} pp" in vision
    assert f"worth about {-comp['stiefel-frozen - adamw']['mean'] * 100:.1f} pp" in vision
    # 8 epochs of 10,000 images in batches of 128: the last record's step
    last = read_records(VISION / "fashion-mnist-paired" / "runs" / "adamw" / "seed0" / "metrics.jsonl")[-1]
    assert last["epoch"] == 8 and f"8 epochs ({last['step']} steps)" in vision and f"a {last['step']}-step" in vision
    # experiments/README.md's rows
    t = f"{gap['t']:.2g}".replace("-", "−")
    assert (f"**Fashion-MNIST: {_pp(gap['mean'])} pp** ({ci}), t = {t}, {gap['n_positive']}/{gap['n']} positive") in row("ViT gap stiefel − adamw, 12 paired starts")
    assert f"Fashion-MNIST: {band} (median {ratio_q['median']:.0f}×)" in row("per-step movement, AdamW W_Q ÷ frames")
    assert (f"‖W − W₀‖/‖W₀‖ = {move['stiefel']:.1g}, largest principal angle {angle['stiefel']:.1f}°"
            in row("frames leave their initialisation"))
    assert (f"Fashion-MNIST: {_pp(frozen['mean'])} pp (CI [{_pp(frozen['ci_low'])}, {_pp(frozen['ci_high'])}])"
            in row("cost of freezing the frames"))
    # ablation: the table's gaps, CIs and movement bands, and the words on them
    for arm in ("stiefel", "stiefel-sgd", "stiefel-element", "framescalar-euclidean"):
        c, r = ablation["comparisons"][f"{arm} - adamw"], ablation["movement"][f"adamw / {arm}"]["ratio_q"]
        digits = 1 if r["max"] < 2 else 0
        cells = (f"| {_pp(c['mean'])} [{_pp(c['ci_low'])}, {_pp(c['ci_high'])}] | "
                 f"{r['min']:.{digits}f}–{r['max']:.{digits}f}× |")
        assert cells in vision.replace("**", ""), (arm, cells)
    element = ablation["comparisons"]["stiefel-element - adamw"]["mean"]
    assert (f"the element-wise variant (which moves like AdamW) is best, {_pp(element)} pp over AdamW"
            in row("ablation: gain from the scale-free step"))
    below = [-ablation["comparisons"][f"{a} - adamw"]["mean"] * 100 for a in ("stiefel", "stiefel-sgd",
                                                                               "framescalar-euclidean")]
    assert f"all sit {min(below):.1f}–{max(below):.1f} pp below AdamW" in vision
    # scaling and decay: the gap per cell, every pair negative
    gaps = [c["comparisons"]["stiefel - adamw"] for c in scaling]
    assert [c["value"] for c in scaling] == [2500, 5000, 10000, 20000]
    assert all(g["n_negative"] == g["n"] == 4 for g in gaps)  # "all pairs negative at every size"
    assert (f"gap {_pp(gaps[0]['mean'])} pp (2,500 images), {_pp(gaps[1]['mean'])} (5,000), "
            f"{_pp(gaps[2]['mean'])} (10,000), {_pp(gaps[3]['mean'])} (20,000), all pairs negative") in vision
    assert (f"Fashion-MNIST, 4 seeds: {_pp(gaps[0]['mean'])} pp (2,500 images) → {_pp(gaps[1]['mean'])} → "
            f"{_pp(gaps[2]['mean'])} → {_pp(gaps[3]['mean'])} pp (20,000)") in row("the gap as training data grows")
    d = [c["comparisons"]["stiefel - adamw"]["mean"] for c in decay]
    assert [c["value"] for c in decay] == [0, 0.05, 0.5]
    assert f"gap {_pp(d[0])} pp (decay 0), {_pp(d[1])} (0.05), {_pp(d[2])} (0.5)" in vision
    # companion: the same sentence with a gap one hundredth of a point off is not in the text
    assert f"gap {_pp(d[0] + 1e-4)} pp (decay 0)" not in vision


def test_the_vision_readme_run_figures_match_the_committed_records():
    """experiments/vision/README.md: the paired study's commit, run count and training time (the committed runs'
    environment.json, as summary.json's speed sums them; the README quoted the original runs' 26.8 min and 44 s a run,
    which no committed file holds), the run count of each study in the table on how the reports were rebuilt, and
    the frame-step check's seeds and grid (the transfer study's summary.json). Companion: any of these phrases with one digit changed is caught."""
    import statistics

    readme = (ROOT / "experiments" / "vision" / "README.md").read_text()
    speed = json.loads((VISION / "fashion-mnist-paired" / "summary.json").read_text())["speed"]
    seconds = [v["seconds"] for v in speed.values()]
    commits = {v["git_sha"][:7] for v in speed.values()}
    assert len(commits) == 1
    phrases = [f"retrained at commit {commits.pop()}",
               f"{len(seconds)} runs, one at a time, CPU only, one torch thread, {sum(seconds) / 60:.1f} min of "
               f"training in all ({statistics.mean(seconds):.0f} s a run on average, {max(seconds):.0f} s the longest"]
    for name in sorted(VISION_STUDIES):
        runs = len(list((VISION / name).glob("**/runs/*/seed*/metrics.jsonl")))
        phrases.append(f"| {VISION_STUDIES[name]} ({runs} runs) |")
    # the frame-step check: its seeds, the two values added because the best of the first five was at the edge
    checks = json.loads((LM / "frame-step" / "summary.json").read_text())["checks"]
    vision = next(c for c in checks if c["experiment"] == "vision")
    best = {r["multiplier"]: r["mean"] for r in vision["rows"]}
    first = [m for m in sorted(best) if m <= 9]
    assert len(first) == 5 and max(first, key=best.get) == first[-1] == 9 and sorted(best)[5:] == [27, 81]
    phrases.append(f"## Frame-step check: Fashion-MNIST, {len(vision['seeds'])} seeds (not CIFAR-10)")
    assert_quoted(readme, phrases)
    assert "26.8 min" not in readme and "44 s per run" not in readme


def test_the_readme_row_on_the_five_seed_grokking_study_matches_its_summary():
    """experiments/README.md's claims-table row on p97_add_5seeds: endpoints, tail means, grokking epochs, dips and
    angles, rounded as printed, from its summary.json. It said "17 vs 21 drops", counting AdamW's evaluations below
    95% (21) against the Stiefel arm's dips (17); AdamW dipped 20 times."""
    import statistics

    s = json.loads((ROOT / "experiments" / "grokking" / "records" / "p97_add_5seeds" / "summary.json").read_text())
    s = s["summary"]
    arms = s["arms"]
    row = _index_row("grokking, (a + b) mod 97, epoch 20,000")

    def signed(x, fmt):
        return f"{x:{fmt}}".replace("-", "−")

    final = {a: list(arms[a]["final"]["per_seed"].values()) for a in ("stiefel", "adamw")}
    assert final["stiefel"] == [1.0] * 5 and "stiefel 100% on 5/5 seeds" in row
    ad = final["adamw"]
    assert (f"adamw {statistics.mean(ad) * 100:.1f}% ({min(ad) * 100:.1f}–{max(ad) * 100:.0f}%)") in row
    tails = {f"{arms[a]['tail_mean']['mean'] * 100:.1f}" for a in ("stiefel", "adamw")}
    tail = s["paired_tail_mean"]["stiefel - adamw"]
    assert len(tails) == 1 and (f"tail means {tails.pop()}% both (paired {signed(tail['mean'] * 100, '+.2f')} pp, "
                                f"95% CI [{signed(tail['ci_low'] * 100, '+.2f')}, "
                                f"{signed(tail['ci_high'] * 100, '+.2f')}])") in row
    first = s["paired_first_epoch"]["stiefel - adamw"]
    medians = [arms[a]["first_epoch_reaching"]["distribution"]["median"] for a in ("stiefel", "adamw")]
    assert first["n_negative"] == first["n"] == 5 and "Stiefel groks earlier on **5/5 seeds**" in row
    assert (f"by {-first['mean']:.0f} epochs (CI [{signed(first['ci_low'], '+.0f')}, "
            f"{signed(first['ci_high'], '+.0f')}], p = {first['p_value']:.2g}, {first['p_holm']:.2g} after Holm; "
            f"medians {medians[0]:,.0f} vs {medians[1]:,.0f})") in row
    dips = {a: sum(arms[a]["dips_after_reaching"]["per_seed"].values()) for a in ("stiefel", "adamw")}
    assert f"({dips['stiefel']} vs {dips['adamw']} dips over 5 seeds, some to near chance)" in row
    angles = {a: list(arms[a]["final_angle_max_deg/q"]["per_seed"].values()) for a in ("stiefel", "adamw")}
    assert (f"W_Q's largest angle to its start: {min(angles['stiefel']):.0f}–{max(angles['stiefel']):.0f}° "
            f"(frames) vs {statistics.mean(angles['adamw']):.0f}° (AdamW)") in row
    same = s["paired_first_epoch"]["stiefel - geoopt-radam"]
    assert same["n_zero"] == same["n"] == 3 and "(3 seeds) groks at the Stiefel arm's epochs" in row
    # companion: the old count (AdamW's evaluations below 95%) is not the dip count
    assert sum(arms["adamw"]["evaluations_below_after_reaching"]["per_seed"].values()) == 21 != dips["adamw"]
    assert "17 vs 21" not in row


def test_the_grokking_readme_table_and_words_on_the_five_seed_study_match_its_summary():
    """experiments/grokking/README.md, five-seed study: the table's rows (grokking epochs, endpoints, tail means,
    seeds above 95% over the tail, lowest accuracy after grokking, W_Q's angles to its start) and the paired
    figures and words below it, rounded as printed, from summary.json (the mean principal angles from the runs' last
    records). The dip rows and the tail definition are checked above. Companion: a changed per-seed epoch fails."""
    import statistics

    folder = ROOT / "experiments" / "grokking" / "records" / "p97_add_5seeds"
    s = json.loads((folder / "summary.json").read_text())["summary"]
    arms = s["arms"]
    readme = (ROOT / "experiments" / "grokking" / "README.md").read_text()
    section = readme[readme.index("## Five-seed study"):readme.index("## Start, constraint or step?")]
    words = " ".join(section.split())
    order = ("adamw", "stiefel", "geoopt-radam")

    def cells(label):
        line = next(x for x in section.splitlines() if x.startswith(f"| {label} |"))
        return dict(zip(order, [c.strip() for c in line.strip("|").split("|")[1:4]], strict=True))

    def signed(x, fmt):
        return f"{x:{fmt}}".replace("-", "−")

    def pct(x):
        return f"{x * 100:.3g}"

    expected = {"first epoch with val acc ≥ 95%, per seed": {}, "val acc at epoch 20,000, per seed": {},
                "seeds at ≥ 95% at every evaluation of the tail": {}, "lowest val acc after grokking, per seed": {},
                "largest / mean principal angle of W_Q to its start": {}}
    for arm in order:
        a = arms[arm]
        first = list(a["first_epoch_reaching"]["per_seed"].values())
        expected["first epoch with val acc ≥ 95%, per seed"][arm] = (
            f"{' / '.join(f'{e:,}' for e in first)} (median {statistics.median(first):,.0f})")
        final = list(a["final"]["per_seed"].values())
        expected["val acc at epoch 20,000, per seed"][arm] = (
            "100% on every seed" if all(f == 1.0 for f in final)
            else f"{' / '.join(pct(f) for f in final)}% (mean {statistics.mean(final) * 100:.1f}%)")
        stays = list(a["stays_above"]["per_seed"].values())
        expected["seeds at ≥ 95% at every evaluation of the tail"][arm] = f"{sum(stays)} / {len(stays)}"
        lowest = list(a["lowest_after_reaching"]["per_seed"].values())
        expected["lowest val acc after grokking, per seed"][arm] = f"{' / '.join(f'{x * 100:.1f}' for x in lowest)}%"
        largest = list(a["final_angle_max_deg/q"]["per_seed"].values())
        means = [read_records(f)[-1]["angle_mean_deg/q"]
                 for f in sorted((folder / "runs" / arm).glob("seed*/metrics.jsonl"))]
        assert len(means) == len(largest), arm
        d = 1 if max(means) > 10 else 2
        expected["largest / mean principal angle of W_Q to its start"][arm] = (
            f"{min(largest):.1f}–{max(largest):.1f}° / {min(means):.{d}f}–{max(means):.{d}f}°")
    for label, by_arm in expected.items():
        assert cells(label) == by_arm, label
    tail_row = next(x for x in section.splitlines() if x.startswith("| mean val acc over the tail"))
    tails = " | ".join(f"{arms[a]['tail_mean']['mean'] * 100:.1f}% ± {arms[a]['tail_mean']['std'] * 100:.1f}"
                       for a in order)
    assert f"| {tails} |" in tail_row
    # the paired bullets
    first, final, tail = (s[k]["stiefel - adamw"] for k in ("paired_first_epoch", "paired", "paired_tail_mean"))
    assert first["n_negative"] == 5 and "**Stiefel groks earlier, on 5 of 5 seeds**" in words
    assert (f"{-first['mean']:.0f} epochs earlier on average ([{signed(first['ci_low'], '.0f')}, "
            f"{signed(first['ci_high'], '.0f')}], paired t = {signed(first['t'], '.3g')}, p = {first['p_value']:.2g}; "
            f"sign test p = {first['sign_test_p']:.2g}; after Holm's correction over the two comparisons with AdamW, "
            f"p = {first['p_holm']:.2g} and {first['sign_test_p_holm']:.3g}: with five seeds this suggests, no more)"
            ) in words
    assert (f"final val acc {signed(final['mean'] * 100, '+.2f')} pp ([{signed(final['ci_low'] * 100, '+.2f')}, "
            f"{signed(final['ci_high'] * 100, '+.2f')}], p = {final['p_value']:.2g}); tail mean "
            f"{signed(tail['mean'] * 100, '+.2f')} pp ([{signed(tail['ci_low'] * 100, '+.2f')}, "
            f"{signed(tail['ci_high'] * 100, '+.2f')}], p = {tail['p_value']:.1f})") in words
    radam = s["paired_first_epoch"]["geoopt-radam - adamw"]
    assert (f"{-radam['mean']:.0f} epochs before AdamW on average ([{signed(radam['ci_low'], ',.0f')}, "
            f"{signed(radam['ci_high'], '+.0f')}], p = {radam['p_value']:.1g}, {radam['n']} pairs)") in words
    same = s["paired_first_epoch"]["stiefel - geoopt-radam"]
    assert same["n_zero"] == same["n"] == 3  # "groks at the very epochs of the Stiefel arm"
    rf, rt = s["paired"]["geoopt-radam - adamw"], s["paired_tail_mean"]["geoopt-radam - adamw"]
    assert (f"(final {signed(rf['mean'] * 100, '+.2f')} pp against AdamW, [{signed(rf['ci_low'] * 100, '+.2f')}, "
            f"{signed(rf['ci_high'] * 100, '+.2f')}]; tail mean {signed(rt['mean'] * 100, '+.2f')} pp)") in words
    low = sorted(arms["geoopt-radam"]["lowest_after_reaching"]["per_seed"].values())
    assert f"deeper: {low[0] * 100:.1f}–{low[-1] * 100:.1f}%" in words
    # "What this shows"
    assert f"(lowest: {min(arms['adamw']['final']['per_seed'].values()) * 100:.1f}%)" in words
    dips = {a: sum(arms[a]["dips_after_reaching"]["per_seed"].values()) for a in ("adamw", "stiefel")}
    evals = sum(arms["adamw"]["evaluations_below_after_reaching"]["per_seed"].values())
    assert f"(AdamW {dips['adamw']} dips over 5 seeds, spanning {evals} evaluations; Stiefel {dips['stiefel']})" in words
    assert all(min(arms[a]["dips_after_reaching"]["per_seed"].values()) >= 2 for a in order)  # "at least twice"
    lows = {a: arms[a]["lowest_after_reaching"]["per_seed"]["4"] * 100 for a in ("adamw", "stiefel")}
    assert f"(AdamW seed 4: {lows['adamw']:.1f}%; Stiefel seed 4: {lows['stiefel']:.1f}%)" in words
    assert "(3/5 vs 4/5)" in words and [sum(arms[a]["stays_above"]["per_seed"].values()) for a in
                                         ("stiefel", "adamw")] == [3, 4]
    largest = {a: list(arms[a]["final_angle_max_deg/q"]["per_seed"].values()) for a in ("stiefel", "adamw")}
    assert (f"their start {min(largest['stiefel']):.0f}–{max(largest['stiefel']):.0f}° after 20,000 epochs, against "
            f"about {statistics.mean(largest['adamw']):.0f}° for AdamW's W_Q") in words
    # companion: one seed's grokking epoch changed is caught by the row check
    changed = dict(arms["adamw"]["first_epoch_reaching"]["per_seed"], **{"0": 2100})
    row = " / ".join(f"{e:,}" for e in changed.values())
    assert not cells("first epoch with val acc ≥ 95%, per seed")["adamw"].startswith(row)


def test_the_grokking_readme_table_on_the_single_seed_run_matches_its_summary():
    """experiments/grokking/README.md, 'Earlier single-seed result': the figures its committed summary.json holds
    (grokking epoch, endpoint, tail mean, W_Q's movement and largest angle, last-step movement, speed and seconds,
    dip count), rounded as printed. The run's records are not committed: its mean principal angles and the epochs and
    depths of its drops are in no committed file, and the README says so instead of quoting them (it did). Companion:
    a changed epoch fails, and so does any figure of the words with one digit changed."""
    data = json.loads((ROOT / "experiments" / "grokking" / "records" / "p97_add_clean" / "summary.json").read_text())
    arms, speed = data["summary"]["arms"], data["speed"]
    readme = (ROOT / "experiments" / "grokking" / "README.md").read_text()
    section = readme[readme.index("## Earlier single-seed result"):readme.index("## Files")]
    words = " ".join(section.split())

    def row(label):
        line = next(x for x in section.splitlines() if x.startswith(f"| {label} |"))
        return [c.strip() for c in line.strip("|").split("|")[1:3]]

    a, s = arms["adamw"], arms["stiefel"]

    def one(arm, key):
        return arm[key]["per_seed"]["0"] if "per_seed" in arm[key] else arm[key]["mean"]

    assert row("first epoch with val acc ≥ 95%") == [f"{one(x, 'first_epoch_reaching'):,}" for x in (a, s)]
    assert row("val acc at epoch 20,000") == [f"{one(x, 'final') * 100:.0f}%" for x in (a, s)]
    assert row("mean val acc over the tail: the last 10% of training: the evaluations at epochs 18,000–20,000 "
               "(21 per run)") == [f"{one(x, 'tail_mean') * 100:.1f}%" for x in (a, s)]
    assert row("‖W_Q − W_Q0‖_F (relative to ‖W_Q0‖_F)") == [
        f"{one(a, 'final_move_total/q'):.3g} ({one(a, 'final_move_total_rel/q'):.2f})",
        f"{one(s, 'final_move_total/q'):.3g} ({one(s, 'final_move_total_rel/q'):.3f})"]
    assert row("largest principal angle of W_Q to its start") == [
        f"{one(x, 'final_angle_max_deg/q'):.1f}°" for x in (a, s)]
    assert row("mean last-step ‖ΔW_Q‖_F over evaluations") == [
        f"{one(x, 'mean_move_step/q'):.1e}".replace("e-0", "e-") for x in (a, s)]
    dips = [one(x, "dips_after_reaching") for x in (a, s)]
    assert row("drops below 95% after grokking") == [str(d) for d in dips] and dips == [4, 4]
    rates = [speed[f"{arm}/seed0"]["epochs_per_second"] for arm in ("adamw", "stiefel")]
    seconds = [speed[f"{arm}/seed0"]["seconds"] for arm in ("adamw", "stiefel")]
    assert_quoted(section, [
        f"Speed of this run: {rates[0]:.2f} (AdamW) and {rates[1]:.2f} (Stiefel) epochs/s, evaluation included; "
        f"{seconds[0]:,.0f} s and {seconds[1]:,.0f} s of training",
        "each arm drops briefly below 95% four times",
        f"the largest principal angle is about {one(a, 'final_angle_max_deg/q'):.0f}°. The Stiefel frames stay within "
        f"about {one(s, 'final_angle_max_deg/q'):.0f}°"])
    # the Speed section quotes the same run
    speed_section = readme[readme.index("## Speed"):readme.index("## Five-seed study")]
    assert_quoted(speed_section, [
        "**{:.1f}–{:.1f} epochs/s per run**".format(*sorted(20000 / x for x in seconds)),
        f"took {min(seconds) / 60:.1f}–{max(seconds) / 60:.1f} minutes on one core"])
    assert {v["epochs_trained"] for v in speed.values()} == {20000} and len(speed) == 2
    epochs = [one(x, "first_epoch_reaching") for x in (a, s)]
    assert f"Both arms grok, at epoch {epochs[0]:,} (AdamW) and {epochs[1]:,} (Stiefel)" in words
    ratio = one(a, "mean_move_step/q") / one(s, "mean_move_step/q")
    assert 80 <= ratio <= 120 and "last-step movement is about 100× smaller" in words
    # companion: another grokking epoch is not the row
    assert row("first epoch with val acc ≥ 95%") != [f"{epochs[0] + 100:,}", f"{epochs[1]:,}"]


def test_the_grokking_readme_figures_across_its_studies_match_their_summaries():
    """experiments/grokking/README.md: the five-seed study's speed range (its summary's speed), the seed-0 grokking
    epochs it sets beside the single-seed run's, the seed-0 epochs that led to the fifth arm of p97_add_arms10 and
    that study's run count, each from the committed summary.json. Companion: any of them with one digit changed is
    caught."""
    records = ROOT / "experiments" / "grokking" / "records"
    five, clean, arms10 = (json.loads((records / name / "summary.json").read_text())
                           for name in ("p97_add_5seeds", "p97_add_clean", "p97_add_arms10"))
    rates = [v["epochs_trained"] / v["seconds"] for v in five["speed"].values()]

    def seed0(study, arm):
        return f"{study['summary']['arms'][arm]['first_epoch_reaching']['per_seed']['0']:,}"

    own = [c for c in arms10["summary"]["mechanism"]["contrasts"] if "adamw-qk-nodecay" not in (c["arm"], c["against"])]
    runs = len(arms10["speed"])
    assert runs == 10 * len(arms10["summary"]["arms"])  # every arm's ten seeds, nothing of repro/ or same_cpu/
    assert all(c["n"] == 10 for c in own)
    assert_quoted((ROOT / "experiments" / "grokking" / "README.md").read_text(), [
        f"({min(rates):.0f}–{max(rates):.0f} epochs/s per run, depending",
        f"grok at {seed0(five, 'adamw')} / {seed0(five, 'stiefel')} instead of {seed0(clean, 'adamw')} / "
        f"{seed0(clean, 'stiefel')} epochs",
        f"`stiefel-frozen` grokked with `stiefel` ({seed0(arms10, 'stiefel-frozen')} and {seed0(arms10, 'stiefel')} "
        f"epochs) and `adamw-orthostart` with `adamw` ({seed0(arms10, 'adamw-orthostart')} and "
        f"{seed0(arms10, 'adamw')})",
        f"The {runs} runs took"])


def _words(path: Path) -> str:
    return " ".join(path.read_text().split())


def test_the_readmes_say_what_the_lm_data_can_say():
    """Issue 57, item 6: the READMEs' words on the tuned and controls studies (the lm README's sections and "The
    studies in brief", where the top README's paragraphs moved) claim no sameness from a null. Every
    "not resolved" states the interval and the smallest difference detectable at 80% power (unadjusted, and at the
    Holm level where quoted), every "suggested" an unadjusted interval that excludes 0, each built here from the
    committed summary.json; the controls paragraph says the warm-up grid was the AdamW arms' only, from the grids
    on record, and names the level-ground study. Companion (assert_quoted): a phrase with one digit changed is not
    in the text; the old words are gone."""
    from experiments.lm import tuned as tuned_study

    front, top, lm = _words(TOP), " ".join(_lm_brief().split()), _words(LM_README)  # top: the former top paragraphs
    for text in (front, top, lm):
        for old in ("neither help nor hurt", "neither helps nor hurts", "what QK-norm also gives",
                    "Equal wall-clock changes nothing", "match Muon without beating it"):
            assert old not in text, old

    def mde(c: dict, fmt: str = ".2g") -> tuple[str, str]:
        d = c["detectable"]
        assert d["method"] == "noncentral t" and d["power"] == 0.8 and d["alpha"] == 0.05
        return format(d["difference"], fmt), format(d["holm_difference"], fmt)

    # the tuned study (5 pairs): the null beside Muon, and equal wall-clock read at the same step
    summary = json.loads((LM / "tuned" / "summary.json").read_text())
    null = summary["final"]["comparisons"]["test: stiefel-muon - muon"]
    assert tuned_study.reading(null) == "not resolved"
    low, holm = mde(null)
    family = null["detectable"]["family"]
    prose = summary["final"]["comparisons"]["test_prose: stiefel-muon - muon"]
    assert tuned_study.reading(prose) == "suggested"
    wall = summary["equal_wallclock"]["comparisons"]
    beside, frames = wall["test: stiefel-muon - muon"], wall["test: stiefel - adamw"]
    assert {c["read"]["rule"] for c in wall.values()} == {"same step"}  # the rounds' noise covers every pair
    assert tuned_study.reading(beside) == "suggested"
    steps = sorted({s for c in wall.values() for v in c["read"]["steps"].values() for s in v}, reverse=True)
    assert_quoted(lm, [
        f"with {null['n']} pairs the smallest difference the study could detect at 80% power is {low} bpb ({holm} at "
        f"the Holm level α/{family}; noncentral t)",
        f"suggested (−{abs(prose['mean']):.4f}, unadjusted CI [{_signed(prose['ci_low'], '.4f')}, "
        f"{_signed(prose['ci_high'], '.4f')}], p {prose['p_value']:.2g}; Holm p {prose['p_holm']:.2g})",
        f"`stiefel` − `adamw` {_signed(frames['mean'], '.4f')} (Holm p {frames['p_holm']:.2g})",
        f"`muon` {_signed(beside['mean'], '.4f')} at step {beside['read']['steps']['muon'][0]:,} (suggested: unadjusted "
        f"CI [{_signed(beside['ci_low'], '.4f')}, {_signed(beside['ci_high'], '.4f')}], p {beside['p_value']:.2g}; "
        f"Holm p {beside['p_holm']:.2g})"])
    assert f"each pair is read at the same step, {' or '.join(f'{s:,}' for s in steps)} of 2,000" in lm
    assert_quoted(top, [
        f"and {null['n']} pairs could detect at 80% power only a difference of {low} bpb or more",
        f"`stiefel` − `adamw` {_signed(frames['mean'], '.4f')}; `stiefel-muon` − `muon` "
        f"{_signed(beside['mean'], '.4f')} is suggested (unadjusted CI [{_signed(beside['ci_low'], '.4f')}, "
        f"{_signed(beside['ci_high'], '.4f')}]; Holm p {beside['p_holm']:.2g})"])

    # the controls study (10 pairs, a family of 48): the null against QK-norm, the suggested cost beside Muon
    summary = json.loads((LM / "controls" / "summary.json").read_text())
    comps = summary["final"]["comparisons"]
    gap, cost, other = (comps[k] for k in ("test: stiefel - adamw-qknorm", "test: stiefeladam-muon - muon",
                                           "test: stiefelmuon-muon - muon"))
    assert [tuned_study.reading(c) for c in (gap, cost, other)] == ["not resolved", "suggested", "not resolved"]
    low, holm = mde(gap, ".3f")
    assert_quoted(top, [
        f"with these {gap['n']} pairs (sd of the differences {gap['std']:.2g}) the smallest difference the study "
        f"could detect at 80% power is {low} bpb, {holm} at its Holm level α/{gap['detectable']['family']} "
        "(noncentral t)",
        f"`stiefeladam-muon` − `muon` {_signed(cost['mean'], '+.4f')} (CI [{_signed(cost['ci_low'], '+.4f')}, "
        f"{_signed(cost['ci_high'], '+.4f')}], higher on {cost['n_positive']} of {cost['n']} pairs, unadjusted p "
        f"{cost['p_value']:.2g}; Holm-adjusted p {cost['p_holm']:.2g}: suggested, not resolved)",
        "not resolved; detectable at 80% power: {} bpb, {} at the Holm level)".format(*mde(other, ".3f"))])
    # the warm-up grid on record holds the AdamW arms only; the lm README says so (twice), and names the level-ground
    # study (the front page's row on it: test_the_front_pages_findings_table_quotes_the_records)
    grids = [g for g in summary["controls"]["stable_range"]
             if g["warmup_steps"] != summary["controls"]["own_warmup_steps"]]
    assert [sorted(g["arms"]) for g in grids] == [["adamw", "adamw-qknorm"]] and grids[0]["warmup_steps"] == 400
    assert "warm-up 400 was offered to the AdamW arms only (`stiefel` and the Muon arms ran at warm-up 100)" in top
    assert "warm-up 400 was offered to `adamw` and `adamw-qknorm` only" in lm
    for text in (top, lm):
        assert "level.args" in text and "`stiefel-gain`" in text and "under way" in text
    assert (ROOT / "experiments" / "lm" / "configs" / "level.args").is_file()


# ---------------------------------------------------------------------------------------------- the front page
def _unlinked(markdown: str) -> str:
    """``markdown`` with every link ``[text](url)`` replaced by its text (a URL's digits are not figures)."""
    import re

    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", markdown)


def _findings_rows(text: str) -> list[str]:
    """The rows of the front page's findings table (between its markers), links replaced by their text."""
    block = text.split("<!-- findings-table")[1].split("<!-- end findings-table -->")[0]
    return [_unlinked(line) for line in block.splitlines()
            if line.startswith("| ") and not line.startswith("| study |")]


def _unchecked_numbers(row: str, checked: list[str]) -> list[str]:
    """The numbers of ``row`` outside the ``checked`` phrases (whitespace folded): a figure no test derives."""
    import re

    rest = " ".join(row.split())
    for phrase in sorted(checked, key=len, reverse=True):
        rest = rest.replace(" ".join(phrase.split()), " ")
    return re.findall(r"\d+(?:[.,]\d+)*", rest)


def test_the_front_pages_findings_table_quotes_the_records():
    """The front page's table "What the studies found", one row per study: every figure in it is built here from the
    study's committed summary.json (and records), rounded as printed, and no other number is in the table (names
    that hold digits, such as GPT-2, are checked too: a folder name exists, an issue number is the config's). The
    level-ground study (issue 57) is "under way" exactly while its folder holds no summary, and the front page says
    it is under way in that one place. Companions: a phrase with one digit changed is caught (assert_quoted), and so
    is a number added to a row."""
    import statistics
    from types import SimpleNamespace

    from experiments.lm.study import build_model
    from experiments.lm.transfer import default_table

    text = TOP.read_text()
    rows = _findings_rows(text)
    assert len(rows) == 8
    grok5, arms10, vision, lm_full, frame_step, tuned, controls, level = rows
    checked: dict[int, list[str]] = {}

    def ci(c: dict, fmt: str = "+.0f", scale: float = 1.0) -> str:
        return f"[{_signed(c['ci_low'] * scale, fmt)}, {_signed(c['ci_high'] * scale, fmt)}]"

    # grokking, five seeds
    g = json.loads((ROOT / "experiments" / "grokking" / "records" / "p97_add_5seeds" / "summary.json").read_text())
    first, arms = g["summary"]["paired_first_epoch"]["stiefel - adamw"], g["summary"]["arms"]
    tails = {f"{arms[a]['tail_mean']['mean'] * 100:.1f}" for a in ("stiefel", "adamw")}
    assert len(tails) == 1 and first["n_negative"] == first["n"] and g["config"]["operation"] == "+"
    checked[0] = [
        f"(a + b) mod {g['config']['p']}, {first['n']} paired seeds",
        f"groks earlier on {first['n_negative']}/{first['n']} seeds, by {-first['mean']:.0f} epochs "
        f"(95% CI {ci(first)}, Holm p = {first['p_holm']:.2g})",
        f"(tail means {tails.pop()}% both)",
        f"the paper's single AdamW run at {g['paper']['values']['adamw'] * 100:.1f}%"]
    # grokking, why: the contrasts of the six arms
    a = json.loads((ROOT / "experiments" / "grokking" / "records" / "p97_add_arms10" / "summary.json").read_text())
    by = {c["question"]: c for c in a["summary"]["mechanism"]["contrasts"]}
    frozen, step, decay = (by[q] for q in ("training W_Q, W_K at all", "the step on the manifold",
                                           "weight decay on W_Q, W_K"))
    seeds = {c["n"] for c in by.values()}
    assert len(seeds) == 1 and frozen["mean"] < 0 < decay["mean"] and step["verdict"] == "not seen"
    checked[1] = [
        f"{len(a['summary']['arms'])} arms, {seeds.pop()} paired seeds",
        f"grok {-frozen['mean']:.0f} epochs before AdamW (CI {ci(frozen)})",
        f"({_signed(step['mean'], '+.0f')} epochs, CI {ci(step)})",
        f"groks {decay['mean']:.0f} epochs later (CI {ci(decay)})"]
    # vision: Fashion-MNIST, substituted for the paper's CIFAR-10
    v = json.loads((VISION / "fashion-mnist-paired" / "summary.json").read_text())
    gap, paper = v["cells"][0]["comparisons"]["stiefel - adamw"], v["paper"]
    ratio = v["cells"][0]["movement"]["adamw / stiefel"]["ratio_q"]
    assert v["dataset_name"] == "Fashion-MNIST" and paper["protocol"]["dataset"] == "cifar10"
    assert "**Fashion-MNIST (substituted for CIFAR-10)**" in vision
    low, high = paper["extra"]["movement_ratio"]
    checked[2] = [
        f"{gap['n']} paired seeds",
        f"stiefel − adamw is {_pp(gap['mean'])} pp (95% CI {ci(gap, '+.2f', 100)}), {gap['n_positive']}/{gap['n']} "
        "pairs positive",
        f"the paper reports {paper['extra']['paired_gap_pp']:+.2f} pp on CIFAR-10",
        f"the frames move {ratio['min']:.0f}–{ratio['max']:.0f}× less per step than AdamW's W_Q; paper: "
        f"{low:.0f}–{high:.0f}×"]
    # language model: the paper's step at AdamW's lr, and the frame lr that closes the gap
    full = json.loads((LM / "full" / "summary.json").read_text())
    comp, sweep = full["main"]["comparisons"]["stiefel - adamw"], {r["frame_lr"]: r["vs_adamw"]
                                                                   for r in full["frame_lr_sweep"]}
    config = full["config"]
    model = build_model(SimpleNamespace(**{k: config[k] for k in ("context", "width", "depth", "heads")}), seed=0)
    angle = {arm: statistics.mean(r["angle_max_deg/q"] for r in _lm_last("full", "", arm))
             for arm in ("stiefel", "adamw")}
    top_lr = max(sweep)
    checked[3] = [
        f"GPT-2, {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters",
        f"the paper's step, {comp['n']} paired seeds",
        f"({angle['stiefel']:.0f}° vs {angle['adamw']:.0f}°)",
        f"{_signed(comp['mean'], '+.3f')} bpb (95% CI {ci(comp, '+.3f')})",
        f"a frame lr {top_lr / config['optim']['lr']:.0f} times larger gives {_signed(sweep[top_lr]['mean'], '+.3f')} "
        f"bpb (CI {ci(sweep[top_lr], '+.3f')})"]
    # language model: the frame-step transfer study
    fs = json.loads((LM / "frame-step" / "summary.json").read_text())
    shapes, checks = fs["shapes"], {c["experiment"]: c for c in fs["checks"]}
    near = [s for s in shapes if s["default_grid_distance"] == 1]
    far = [s["width"] for s in shapes if s["default_grid_distance"] == 2]
    assert len(near) + len(far) == len(shapes) and checks["vision"]["default_grid_distance"] == 2 and len(far) == 1
    assert "default (μ = 1)" in default_table(fs)[0]
    checked[4] = [f"{len(shapes)} shapes and {len(checks)} other models", "(μ = 1)",
                  f"within one grid point of the best at {len(near)} of {len(shapes)} shapes and two at width {far[0]} "
                  "and on the vision model"]
    # language model: tuned against tuned
    t = json.loads((LM / "tuned" / "summary.json").read_text())["final"]["comparisons"]
    muon, frames, beside = t["test: muon - adamw"], t["test: stiefel - adamw"], t["test: stiefel-muon - muon"]
    checked[5] = [
        f"{frames['n']} paired seeds",
        f"({_signed(muon['mean'], '.4f')} bpb against AdamW)",
        f"by {_signed(frames['mean'], '.4f')} bpb (95% CI {ci(frames, '.4f')}, Holm p = {frames['p_holm']:.2g})",
        f"({_signed(beside['mean'], '.4f')}, CI {ci(beside, '+.4f')})"]
    # language model: controls
    cs = json.loads((LM / "controls" / "summary.json").read_text())
    c = cs["final"]["comparisons"]
    qk, mu = c["test: stiefel - adamw-qknorm"], c["test: muon - adamw"]
    warm = {arm: r["warmup_steps"] for arm, r in cs["recipes"].items() if r["warmup_steps"]}
    assert sorted(warm) == ["adamw", "adamw-qknorm"] and len(set(warm.values())) == 1
    assert qk["detectable"]["method"] == "noncentral t" and mu["mean"] < 0
    checked[6] = [
        f"{len(cs['final']['seeds'])} arms, {qk['n']} paired seeds",
        f"(warm-up {warm['adamw']} offered to the AdamW arms only)",
        f"is {_signed(qk['mean'], '.4f')} bpb (95% CI {ci(qk, '+.4f')}; detectable at "
        f"{qk['detectable']['power'] * 100:.0f}% power: {qk['detectable']['difference']:.3f})",
        f"Muon stays {-mu['mean']:.4f} bpb below a stabilised AdamW"]
    # level ground: under way while its folder has no summary; its issue number is its config's
    level_args = (ROOT / "experiments" / "lm" / "configs" / "level.args").read_text()
    assert "Level ground (issue 57)" in level_args
    checked[7] = ["(issue 57)"]
    under_way = not (LM / "level" / "summary.json").is_file()
    assert ("**Under way**" in level) == under_way, "the level-ground study's row: update it from its summary"
    assert " ".join(text.lower().split()).count("under way") == (1 if under_way else 0)
    # names holding digits: folders that exist, the model's family, the paper's data set
    names = ["p97_add_5seeds", "p97_add_arms10"]
    assert all((ROOT / "experiments" / "grokking" / "records" / n).is_dir() for n in names)
    for i, row in enumerate(rows):
        phrases = checked[i]
        assert_quoted(row, phrases)
        assert _unchecked_numbers(row, [*phrases, *names, "CIFAR-10"]) == [], (i, row)
    # companion: a number added to a row is caught
    assert _unchecked_numbers(tuned + " (at 0.01)", checked[5]) == ["0.01"]
