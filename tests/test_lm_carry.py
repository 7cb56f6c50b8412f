"""Final runs carried from the controls study into the level-ground study (issue 57 item 4,
``experiments/lm/carry.py``): carried only where the recipe and the code path are unchanged, each refusal named."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.lm import carry, controls, controls_report, tuned

ROOT = Path(__file__).resolve().parents[1]
SOURCE_SHA = "1" * 40
STUDY_SHA = "7" * 40


def _run(folder: Path, arm: str, seed: int, *, lr: float = 0.01, warmup: float = 0.05, epochs: int = 2,
         sha: str = SOURCE_SHA, finished: bool = True) -> Path:
    """A run folder as the harness writes it: config, environment, an evaluation per epoch, a few steps."""
    folder.mkdir(parents=True)
    config = {"optim": {"lr": lr}, "warmup_fraction": warmup, "train": {"epochs": epochs}, "width": 128}
    (folder / "config.json").write_text(json.dumps({"arm": arm, "config": config, "seed": seed}))
    (folder / "environment.json").write_text(json.dumps([{"git_sha": sha, "git_dirty": False, "start_epoch": 0,
                                                          "end_epoch": epochs if finished else 1}]))
    last = epochs if finished else epochs - 1
    (folder / "metrics.jsonl").write_text("".join(
        json.dumps({"arm": arm, "seed": seed, "epoch": e, "step": 100 * e, "val_bpb": 3.0 - e / 10 + seed / 1000}) + "\n"
        for e in range(last + 1)))
    (folder / "steps.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 5.0 - s / 100}) + "\n" for s in range(1, 100 * last + 1, 50)))
    (folder / "checkpoint.pt").write_bytes(b"not carried")
    return folder


def _studies(tmp_path: Path, *, arms=("adamw", "muon"), seeds=(1, 2, 3)) -> tuple[Path, Path]:
    """``controls/`` with a final cell (every run on SOURCE_SHA) and ``level/`` with each arm's selected seed-0 run at
    lr 0.01 and the study's own warm-up, and a code-path record that found every arm unchanged."""
    source, out = tmp_path / "controls", tmp_path / "level"
    for arm in arms:
        for seed in seeds:
            _run(source / "final/runs" / arm / f"seed{seed}", arm, seed)
        _run(out / "lr-0.01/runs" / arm / "seed0", arm, 0, sha=STUDY_SHA)
    _code_path(out, {arm: None for arm in arms})
    return source, out


def _code_path(out: Path, differences: dict, *, config_is_source: bool = True) -> None:
    (out / carry.CODE_PATH_FILE).write_text(json.dumps({
        "source": "controls", "source_commit": SOURCE_SHA, "commit": STUDY_SHA, "seed": 1, "epochs": 2, "flags": [],
        "machine": {"cpu_model": "Test CPU"},
        "arms": {arm: {"identical": d is None, "first_difference": d, "config_is_source": config_is_source,
                       "against_source_record": None} for arm, d in differences.items()}}))


RECIPES = {arm: {"lr": 0.01, "warmup_steps": None, "warmup_fraction": None} for arm in ("adamw", "muon")}


def test_final_runs_are_carried_where_recipe_and_code_path_are_unchanged(tmp_path):
    source, out = _studies(tmp_path)
    lines = carry.carry_runs(out, source, RECIPES)
    assert lines == ["carry: adamw: carried 3 final run(s) from controls", "carry: muon: carried 3 final run(s) from controls"]
    for arm in RECIPES:
        for seed in (1, 2, 3):
            run = out / "final/runs" / arm / f"seed{seed}"
            assert sorted(p.name for p in run.iterdir()) == sorted(carry.CARRIED_FILES)  # no checkpoint
            for name in carry.CARRIED_FILES:
                assert (run / name).read_bytes() == (source / "final/runs" / arm / f"seed{seed}" / name).read_bytes()
    record = json.loads((out / controls_report.CARRIED_FILE).read_text())["final"]
    assert len(record["runs"]) == 6 and record["trained_on"] == [SOURCE_SHA] and "bit for bit" in record["why"]
    # the planner counts them as done: a finished final cell
    done, unfinished = tuned._finished(out / tuned.FINAL_DIR)
    assert sorted(done) == ["adamw", "muon"] and sorted(done["adamw"]) == [1, 2, 3] and not unfinished
    # idempotent: a second call copies nothing and says so
    assert carry.carry_runs(out, source, RECIPES) == [
        "carry: adamw: its final runs from controls are already here",
        "carry: muon: its final runs from controls are already here"]
    assert len(json.loads((out / controls_report.CARRIED_FILE).read_text())["final"]["runs"]) == 6


def test_the_report_quotes_the_carried_final_runs_and_the_check_against_their_record(tmp_path):
    source, out = _studies(tmp_path)
    (out / controls_report.CARRIED_FILE).write_text(json.dumps({"from": "x", "why": "grid", "trained_on": [SOURCE_SHA],
                                                                 "runs": ["lr-0.01/runs/adamw/seed0"]}))
    carry.carry_runs(out, source, RECIPES)
    difference = {"file": "metrics.jsonl", "record": 0, "key": "val_code_loss", "a": 5.3392481, "b": 5.3392483}
    record = json.loads((out / carry.CODE_PATH_FILE).read_text())
    record["arms"]["adamw"]["against_source_record"] = difference
    (out / carry.CODE_PATH_FILE).write_text(json.dumps(record))
    carried = controls_report._carried_over(out)
    assert carried["runs"] == 1 and carried["final"]["runs"] == 6 and carried["final"]["arms"] == ["adamw", "muon"]
    text = controls_report._against_record_text(carried["final"])
    assert "`adamw` first differs at metrics.jsonl record 0 `val_code_loss`" in text
    assert "`muon` reproduces it bit for bit" in text and "Test CPU" in text
    # companion: without a final entry the report says nothing of final runs
    (out / controls_report.CARRIED_FILE).write_text(json.dumps({"from": "x", "why": "grid", "trained_on": [],
                                                                 "runs": []}))
    assert "final" not in controls_report._carried_over(out)


@pytest.mark.parametrize("change, why", [
    ("recipe", "its recipe changed: the selected run's config differs from the source's final in optim"),
    ("warm-up", "its recipe changed"),
    ("code path", "its code path changed: metrics.jsonl record 1 val_bpb differs between 111111111111 and "
                  "777777777777"),
    ("no record", "no code_path.json: run `python -m experiments.lm.carry check` first"),
    ("unchecked", "code_path.json did not check it"),
    ("other config", "checked it on another config than the source's final"),
    ("other commit", "some of its final runs were trained on 222222222222"),
])
def test_an_arm_is_not_carried_when_its_recipe_or_code_path_may_have_changed(tmp_path, change, why):
    """Each condition alone keeps ``adamw``'s runs out (the final cell then trains it); ``muon``, unchanged, is carried
    beside it in the same call (the companion)."""
    source, out = _studies(tmp_path)
    recipes = {arm: dict(r) for arm, r in RECIPES.items()}
    if change == "recipe":
        recipes["adamw"]["lr"] = 0.0057735
        _run(out / "lr-0.0057735/runs/adamw/seed0", "adamw", 0, lr=0.0057735, sha=STUDY_SHA)
    elif change == "warm-up":
        recipes["adamw"].update(warmup_steps=400, warmup_fraction=0.2)
        _run(out / "warmup-400/lr-0.01/runs/adamw/seed0", "adamw", 0, warmup=0.2, sha=STUDY_SHA)
    elif change == "code path":
        _code_path(out, {"adamw": {"file": "metrics.jsonl", "record": 1, "key": "val_bpb", "a": 1.0, "b": 1.5},
                         "muon": None})
    elif change == "no record":
        (out / carry.CODE_PATH_FILE).unlink()
    elif change == "unchecked":
        _code_path(out, {"muon": None})
    elif change == "other config":
        _code_path(out, {"adamw": None, "muon": None}, config_is_source=False)
    else:
        _run(source / "final/runs/adamw/seed4", "adamw", 4, sha="2" * 40)
    lines = carry.carry_runs(out, source, recipes)
    if change in ("no record", "other config"):  # these concern every arm
        assert all(why in line and "the final cell trains it" in line for line in lines)
        assert not (out / "final").exists() and not (out / controls_report.CARRIED_FILE).exists()
        return
    assert lines[0].startswith("carry: adamw: not carried (") and why in lines[0]
    assert lines[0].endswith("the final cell trains it.")
    assert lines[1] == "carry: muon: carried 3 final run(s) from controls"
    assert not (out / "final/runs/adamw").exists() and len(list((out / "final/runs/muon").iterdir())) == 3


def test_an_unfinished_source_run_is_not_carried(tmp_path):
    source, out = _studies(tmp_path, arms=("adamw",))
    _run(source / "final/runs/adamw/seed4", "adamw", 4, finished=False)
    assert carry.carry_runs(out, source, RECIPES) == ["carry: adamw: carried 3 final run(s) from controls"]
    assert sorted(p.name for p in (out / "final/runs/adamw").iterdir()) == ["seed1", "seed2", "seed3"]


def test_a_source_without_a_final_cell_is_refused_in_one_sentence(tmp_path):
    (tmp_path / "controls").mkdir()
    (tmp_path / "level").mkdir()
    with pytest.raises(ValueError, match="has no final cell"):
        carry.carry_runs(tmp_path / "level", tmp_path / "controls", RECIPES)


# ---------------------------------------------------------------------------------------------- when it carries
def test_nothing_is_carried_before_the_plan_reaches_the_final_cell(tmp_path, monkeypatch):
    """``carry_final`` asks the planner: while a stage before the final cell misses runs, nothing is carried; once
    the plan holds the final stage, the recipes are the two-seed selection's (``# confirm``) and the runs are
    carried (the companion)."""
    source, out = _studies(tmp_path)
    args = tmp_path / "level.args"
    text = (ROOT / "experiments/lm/configs/level.args").read_text()
    assert "# carry-final controls" in text  # the committed protocol carries from the controls study
    args.write_text(text)
    monkeypatch.setattr(controls, "stages", lambda out, protocol: [controls.Stage("second seed 11", (("--x",),))])
    assert carry.carry_final(out, args) == [] and not (out / "final").exists()
    seen = {}

    def confirm_recipes(grid, warmups, *, arms, seeds, points):
        seen.update(arms=arms, seeds=seeds, points=points)
        return RECIPES

    monkeypatch.setattr(controls, "stages", lambda out, protocol: [controls.Stage("final", (("--x",),))])
    monkeypatch.setattr(tuned, "confirm_recipes", confirm_recipes)
    assert carry.carry_final(out, args)[0] == "carry: adamw: carried 3 final run(s) from controls"
    assert seen == {"arms": list(controls.read_protocol(args).grids), "seeds": (0, 11), "points": 3}
    # companion: an args file without the line carries nothing, whatever the plan
    args.write_text("".join(line + "\n" for line in text.splitlines() if "carry-final" not in line))
    assert carry.carry_final(tmp_path / "elsewhere", args) == []


def test_carry_source_reads_one_study_name(tmp_path):
    args = tmp_path / "a.args"
    args.write_text("# grid adamw 1e-2\n# carry-final controls\n--epochs 2\n")
    assert carry.carry_source(args) == "controls"
    args.write_text("# grid adamw 1e-2\n--epochs 2\n")
    assert carry.carry_source(args) is None
    args.write_text("# carry-final controls tuned\n")
    with pytest.raises(ValueError, match="expected '# carry-final <study folder name>'"):
        carry.carry_source(args)


# ---------------------------------------------------------------------------------------------- the comparison
def _two(tmp_path: Path, epochs_b: int = 2) -> tuple[Path, Path]:
    a = _run(tmp_path / "a", "adamw", 1, epochs=2)
    b = _run(tmp_path / "b", "adamw", 1, epochs=epochs_b)
    return a, b


def test_records_equal_bit_for_bit_compare_equal(tmp_path):
    a, b = _two(tmp_path)
    assert carry.compare_runs(a, b) is None


def test_a_difference_in_the_last_bit_is_found(tmp_path):
    """Companion of the test above: one float one ulp away is a difference, named by file, record and key."""
    a, b = _two(tmp_path)
    lines = (b / "steps.jsonl").read_text().splitlines()
    record = json.loads(lines[2])
    record["loss"] = math.nextafter(record["loss"], math.inf)  # one ulp up
    lines[2] = json.dumps(record)
    (b / "steps.jsonl").write_text("\n".join(lines) + "\n")
    d = carry.compare_runs(a, b)
    assert d["file"] == "steps.jsonl" and d["record"] == 2 and d["key"] == "loss" and d["a"] != d["b"]
    assert abs(d["a"] - d["b"]) < 1e-14


def test_a_missing_record_is_a_difference(tmp_path):
    a, b = _two(tmp_path)
    (b / "metrics.jsonl").write_text("".join((b / "metrics.jsonl").read_text().splitlines(keepends=True)[:-1]))
    assert carry.compare_runs(a, b) == {"file": "metrics.jsonl", "record": 2, "key": None, "a": 3, "b": 2}


def test_a_short_run_is_compared_with_the_first_epochs_of_a_long_one(tmp_path):
    """``epochs``: the evaluations up to that epoch and the steps up to its last step; what follows in the long run
    is not read, and a difference inside the window is (the companion)."""
    a, b = _two(tmp_path, epochs_b=5)
    assert carry.compare_runs(a, b) is not None  # the whole files: the long run has more records
    assert carry.compare_runs(a, b, epochs=2) is None
    metrics = [json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines()]
    metrics[1]["val_bpb"] += 1e-9
    (b / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    assert carry.compare_runs(a, b, epochs=2)["key"] == "val_bpb"


# ---------------------------------------------------------------------------------------------- the command
@pytest.mark.parametrize("argv, words", [
    (["check", "{out}", "{args}", "--arms", "adamw", "--workdir", "/tmp/w"], "check needs --commit"),
    (["check", "{out}", "{args}", "--commit", "HEAD", "--workdir", "/tmp/w"], "check needs --arms"),
    (["check", "{out}", "{args}", "--commit", "HEAD", "--arms", "adamw", "--workdir", "/tmp/w", "--check-epochs",
      "0"], "--check-epochs: must be >= 1"),
    (["final", "{out}", "{args}", "--width", "16"], "unrecognized arguments: --width 16"),
    (["final", "{out}", "{nowhere}"], "No such file"),
    (["check", "{nowhere}", "{args}", "--commit", "HEAD", "--arms", "adamw", "--workdir", "/tmp/w"],
     "no such study folder"),
])
def test_usage_errors_are_one_line_exit_2(tmp_path, argv, words):
    args = tmp_path / "level.args"
    args.write_text("# carry-final controls\n")
    (tmp_path / "level").mkdir()
    names = {"out": tmp_path / "level", "args": args, "nowhere": tmp_path / "nowhere"}
    res = subprocess.run([sys.executable, "-m", "experiments.lm.carry", *(a.format(**names) for a in argv)],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and words in res.stderr, res.stderr


# ---------------------------------------------------------------------------------------------- the committed check
def test_the_committed_code_path_check_compares_the_controls_final_commit_with_the_level_grids():
    """``records/level/code_path.json`` checked the commit that trained the controls study's final cell against the
    commit that trains the level study's own runs, on the source's final config (seed 1); it records, arm by arm,
    whether the code path is unchanged."""
    path = ROOT / "experiments/lm/records/level" / carry.CODE_PATH_FILE
    if not path.exists():
        pytest.skip("no code-path check committed yet")
    record = json.loads(path.read_text())
    final = ROOT / "experiments/lm/records/controls/final/runs"
    assert {carry._commit(run) for run in final.glob("*/seed*")} == {record["source_commit"]}
    level = ROOT / "experiments/lm/records/level"
    carried = set(json.loads((level / controls_report.CARRIED_FILE).read_text())["runs"])
    own = {carry._commit(p.parent) for p in level.glob("**/runs/*/seed*/environment.json")
           if str(p.parent.relative_to(level)) not in carried and not str(p.parent.relative_to(level)).startswith("final")}
    assert own == {record["commit"]}
    assert record["seed"] == carry.CHECK_SEED and record["epochs"] >= 1
    for arm, entry in record["arms"].items():
        assert entry["config_is_source"], arm
        assert entry["identical"] == (entry["first_difference"] is None)
        theirs = json.loads((final / arm / f"seed{record['seed']}" / "config.json").read_text())["config"]
        assert entry["recipe"] == ["--lrs", repr(theirs["optim"]["lr"]), "--warmup-fraction",
                                   repr(theirs["warmup_fraction"])]
