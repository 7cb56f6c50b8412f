r"""Final runs carried from one study into its successor (issue 57 item 4), and the code-path check that allows it.

The level-ground study (``records/level``) reruns the controls study (``records/controls``) with every knob offered
to every arm. Issue 57 keeps a final run of the controls study only where the arm's recipe did not change and its
code path is unchanged; every other final run is trained anew.

**The code-path check** (:func:`check_code_path`, ``python -m experiments.lm.carry check``). For each arm, the final
run of seed :data:`CHECK_SEED` at the source study's recipe (its ``config.json``) is trained for the first
``--check-epochs`` epochs (``--stop-after-epochs``; default :data:`CHECK_EPOCHS`: the warm-up's start, the first steps
of the schedule and an evaluation after each epoch) on this machine twice, on the commit that trained the source's
final cell and on the commit that trains this study, each in a ``git worktree`` of it with one torch thread. The
code path is unchanged when every record of the two runs is equal, bit for bit (:func:`compare_runs`:
``metrics.jsonl``, the losses, bpb, angles, entropies and logits of each evaluation; ``steps.jsonl``, the loss,
gradient norm, logit maximum and entropy minimum of the steps it samples). The run on this study's commit is also
compared with the source's committed run of that seed, which another machine may have trained: the first
difference is recorded (a CPU with other kernels rounds differently), so that the report can say where the carried
runs come from. The result is ``OUT/code_path.json`` (:data:`CODE_PATH_FILE`).

**Carrying** (:func:`carry_final`, ``python -m experiments.lm.carry final OUT ARGS``, which
``run_controls.sh`` calls before each planning step). Nothing is carried before the plan reaches the final cell
(the selection complete, on two seeds where the protocol asks for them). Then, for every arm of the study's
``# carry-final <study>`` line (:func:`carry_source`), the source's finished final runs are copied (``config.json``,
``environment.json``, ``metrics.jsonl``, ``steps.jsonl``; no checkpoint) into ``OUT/final/runs/<arm>/`` when

1. the arm's recipe here is the source's: the run this study selected (its ``config.json`` at the selected lr and
   warm-up, seed :data:`~.controls.GRID_SEEDS`) has the source's final config, the seed aside, and
2. the code-path check found the arm's code path unchanged between the source's commit and this study's.

They are listed under ``"final"`` in ``OUT/carried_over.json``; every arm not carried is named with the reason, and
the final cell trains it.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["CODE_PATH_FILE", "CHECK_EPOCHS", "CHECK_SEED", "CARRIED_FILES", "compare_runs", "carry_source",
           "check_code_path", "carry_final", "carry_runs", "main"]

#: The record of the code-path check, in the study folder.
CODE_PATH_FILE = "code_path.json"
#: Epochs each run of the check trains (``--stop-after-epochs``).
CHECK_EPOCHS = 2
#: The final seed the check trains (the first of the final cell).
CHECK_SEED = 1
#: The files of a run that are carried (a checkpoint is not: ``*.pt`` is not committed).
CARRIED_FILES = ("config.json", "environment.json", "metrics.jsonl", "steps.jsonl")
#: The records compared bit for bit.
RECORDS = ("metrics.jsonl", "steps.jsonl")


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compare_runs(a: str | os.PathLike, b: str | os.PathLike, *, epochs: int | None = None) -> dict[str, Any] | None:
    """The first difference between the records of two runs (folders ``a`` and ``b``), or ``None`` when every
    record is equal, bit for bit (JSON numbers compared as written: a float that differs in its last bit differs).

    ``epochs``: compare only the evaluations up to that epoch and the steps up to its last step (``a`` holds a run
    of that many epochs, ``b`` may hold a longer one); ``None``: the whole files, which must have as many records.

    Returns
    -------
    dict or None
        ``{"file", "record", "key", "a", "b"}`` of the first difference (``key`` ``None`` when one file has fewer
        records: ``a`` and ``b`` are then their counts).
    """
    a, b = Path(a), Path(b)
    last_step = None
    for name in RECORDS:
        left, right = _lines(a / name), _lines(b / name)
        if name == "metrics.jsonl" and epochs is not None:
            left = [r for r in left if r["epoch"] <= epochs]
            right = [r for r in right if r["epoch"] <= epochs]
            last_step = max((r["step"] for r in left), default=0)
        elif last_step is not None:
            left = [r for r in left if r["step"] <= last_step]
            right = [r for r in right if r["step"] <= last_step]
        for k, (x, y) in enumerate(zip(left, right, strict=False)):  # lengths compared below
            if x != y:
                key = next(key for key in sorted(set(x) | set(y)) if x.get(key) != y.get(key))
                return {"file": name, "record": k, "key": key, "a": x.get(key), "b": y.get(key)}
        if len(left) != len(right):
            return {"file": name, "record": min(len(left), len(right)), "key": None, "a": len(left), "b": len(right)}
    return None


def carry_source(args_file: str | os.PathLike) -> str | None:
    """The study named by the args file's ``# carry-final <study>`` line (a folder beside the study's), or ``None``."""
    for line in Path(args_file).read_text().splitlines():
        words = line.split()
        if words[:2] == ["#", "carry-final"]:
            if len(words) != 3:
                raise ValueError(f"{args_file}: '{line.strip()}': expected '# carry-final <study folder name>'.")
            return words[2]
    return None


def _source_final(source: Path) -> Path:
    from .tuned import FINAL_DIR

    folder = source / FINAL_DIR / "runs"
    if not folder.is_dir():
        raise ValueError(f"{source}: has no final cell ({FINAL_DIR}/runs/); nothing to carry from it.")
    return folder


def _commit(run: Path) -> str:
    """The one clean commit that trained the run in folder ``run`` (every call of its ``environment.json``)."""
    calls = json.loads((run / "environment.json").read_text())
    shas = {c.get("git_sha") for c in calls}
    if len(shas) != 1 or None in shas or any(c.get("git_dirty") for c in calls):
        raise ValueError(f"{run}: not trained on one clean commit ({sorted(map(str, shas))}); its code path cannot be "
                         f"checked.")
    return shas.pop()


def _recipe_flags(config: Mapping[str, Any]) -> list[str]:
    """The ``lm`` flags of a run's recipe (its lr and warm-up fraction)."""
    c = config["config"]
    return ["--lrs", repr(float(c["optim"]["lr"])), "--warmup-fraction", repr(float(c["warmup_fraction"]))]


def _study_flags(args_file: Path) -> list[str]:
    return [word for line in args_file.read_text().splitlines() if not line.startswith("#") for word in line.split()]


def _worktree(repo: Path, sha: str, where: Path) -> Path:
    """A clean ``git worktree`` of commit ``sha`` at ``where`` (created when missing)."""
    if not where.exists():
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(where), sha], check=True,
                       capture_output=True, text=True)
    head = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"], check=True,
                           capture_output=True, text=True).stdout.strip()
    if head != sha or dirty:
        raise ValueError(f"{where}: is not a clean checkout of {sha[:12]}; remove it (git worktree remove) and rerun.")
    return where


def _machine() -> dict[str, Any]:
    import torch

    from ..harness.run_folder import _cpu_model

    return {"cpu_model": _cpu_model(), "processor": platform.processor(), "torch": torch.__version__,
            "python": platform.python_version()}


def check_code_path(out: str | os.PathLike, args_file: str | os.PathLike, *, commit: str, arms: Sequence[str],
                    workdir: str | os.PathLike, epochs: int = CHECK_EPOCHS,
                    extra: Sequence[str] = ()) -> dict[str, Any]:
    """Train each of ``arms`` at the source study's final recipe for ``epochs`` epochs on the source's commit and on
    ``commit`` (this study's), compare their records bit for bit, and write ``OUT/code_path.json`` (module
    docstring). ``workdir`` holds the worktrees and the runs; ``extra`` are further ``lm`` flags (a smaller model
    in a test).

    Returns
    -------
    dict
        What ``code_path.json`` holds: ``{"source", "source_commit", "commit", "seed", "epochs", "flags",
        "machine", "arms": {arm: {"recipe", "identical", "first_difference", "config_is_source",
        "against_source_record"}}}``: ``config_is_source`` whether the runs have the source's final config (not with
        ``extra`` flags), ``against_source_record`` then the first difference from the source's committed run
        (:func:`compare_runs` over ``epochs``), else ``None``.
    """
    out, args_file, workdir = Path(out), Path(args_file), Path(workdir)
    if not out.is_dir():
        raise ValueError(f"{out}: no such study folder (the check writes {CODE_PATH_FILE} into it).")
    name = carry_source(args_file)
    if name is None:
        raise ValueError(f"{args_file}: has no '# carry-final <study>' line: there is no study to check against.")
    source = out.resolve().parent / name
    final = _source_final(source)
    repo = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], check=True, capture_output=True, text=True,
                               cwd=Path(__file__).parent).stdout.strip())
    ours = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", f"{commit}^{{commit}}"],
                          capture_output=True, text=True)
    if ours.returncode:
        raise ValueError(f"--commit {commit}: no such commit.")
    ours_sha = ours.stdout.strip()
    runs = {arm: final / arm / f"seed{CHECK_SEED}" for arm in arms}
    lacking = [arm for arm, run in runs.items() if not (run / "config.json").is_file()]
    if lacking:
        raise ValueError(f"{final}: no final run of seed {CHECK_SEED} for {', '.join(lacking)}; check only arms the "
                         f"source study has.")
    theirs = {_commit(run) for run in runs.values()}
    if len(theirs) != 1:
        raise ValueError(f"{final}: the arms' final runs were trained on several commits ({sorted(theirs)}); check "
                         f"them one commit at a time.")
    source_sha = theirs.pop()
    flags = _study_flags(args_file) + list(extra)
    results: dict[str, dict[str, Any]] = {arm: {"recipe": _recipe_flags(json.loads((run / "config.json").read_text()))}
                                         for arm, run in runs.items()}
    folders = {}
    for sha in dict.fromkeys((source_sha, ours_sha)):
        tree = _worktree(repo, sha, workdir / f"wt-{sha[:12]}")
        folders[sha] = workdir / f"runs-{sha[:12]}"
        for arm in arms:
            command = [sys.executable, "-m", "experiments", "lm", *flags, "--out", str(folders[sha] / arm), "--arms", arm,
                       *results[arm]["recipe"], "--seeds", str(CHECK_SEED), "--stop-after-epochs", str(epochs),
                       "--threads", "1", "--quiet", "--skip-report"]
            done = subprocess.run(command, cwd=tree, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"training {arm} on {sha[:12]} failed (exit {done.returncode}): "
                                   f"{done.stderr.strip().splitlines()[-1:] or done.stdout[-300:]}")
    for arm in arms:
        trained = {sha: _run_folder(folders[sha] / arm, arm) for sha in folders}
        for sha, run in trained.items():
            if _commit(run) != sha:
                raise RuntimeError(f"{run}: trained on {_commit(run)[:12]}, not {sha[:12]} (the worktree's package was "
                                   f"not the one imported?)")
        difference = compare_runs(trained[source_sha], trained[ours_sha])
        same_config = (json.loads((trained[ours_sha] / "config.json").read_text())["config"]
                       == json.loads((runs[arm] / "config.json").read_text())["config"])
        results[arm].update(identical=difference is None, first_difference=difference, config_is_source=same_config,
                            against_source_record=compare_runs(trained[ours_sha], runs[arm], epochs=epochs)
                            if same_config else None)
    record = {"source": name, "source_commit": source_sha, "commit": ours_sha, "seed": CHECK_SEED, "epochs": epochs,
              "flags": flags, "machine": _machine(), "arms": results}
    (out / CODE_PATH_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def _run_folder(folder: Path, arm: str) -> Path:
    found = sorted(folder.glob(f"*/runs/{arm}/seed{CHECK_SEED}"))
    if len(found) != 1:
        raise RuntimeError(f"{folder}: expected one run of {arm} seed {CHECK_SEED}, found {len(found)}.")
    return found[0]


def _selected_run(out: Path, recipe: Mapping[str, Any], arm: str, seed: int) -> Path:
    from .tuned import GRID_PREFIX, WARMUP_PREFIX, _lr_text

    folder = out if recipe["warmup_steps"] is None else out / f"{WARMUP_PREFIX}{recipe['warmup_steps']}"
    return folder / f"{GRID_PREFIX}{_lr_text(recipe['lr'])}" / "runs" / arm / f"seed{seed}"


def _recipes(out: Path, args_file: Path) -> dict[str, Any] | None:
    """The recipes the final cell trains (``None`` while the plan has not reached it): the two-seed selection
    where the protocol has a ``# confirm`` line, else the one-seed selection with the warm-up grids."""
    from . import tuned
    from .controls import GRID_SEEDS, read_protocol, stages

    protocol = read_protocol(args_file)
    if not any(st.name == "final" for st in stages(out, protocol)):  # the stages before it miss runs
        return None
    grid, warmups = tuned.read_grid(out), tuned.warmup_grids(out)
    if protocol.confirm is not None:
        seed, points = protocol.confirm
        return tuned.confirm_recipes(grid, warmups, arms=protocol.arms, seeds=(GRID_SEEDS[0], seed), points=points)
    return tuned.select_recipes(tuned.select_lrs(grid, arms=protocol.arms), warmups)


def carry_final(out: str | os.PathLike, args_file: str | os.PathLike) -> list[str]:
    """Carry the final runs of the study named by the args file's ``# carry-final`` line into ``out`` where the
    recipe and the code path allow it (module docstring), once the plan reaches the final cell.

    Returns
    -------
    list of str
        :func:`carry_runs`' lines; empty when the args file has no ``# carry-final`` line or the plan has not
        reached the final cell.
    """
    out, args_file = Path(out), Path(args_file)
    name = carry_source(args_file)
    recipes = _recipes(out, args_file) if name is not None else None
    return [] if recipes is None else carry_runs(out, out.resolve().parent / name, recipes)


def carry_runs(out: str | os.PathLike, source: str | os.PathLike, recipes: Mapping[str, Mapping[str, Any]]
               ) -> list[str]:
    """Copy each arm's finished final runs of the study folder ``source`` into ``OUT/final/runs/<arm>/`` when the
    arm's recipe here (``recipes``, as :func:`~.tuned.confirm_recipes` or :func:`~.tuned.select_recipes` give
    them) is the source's and ``OUT/code_path.json`` found its code path unchanged, and list them under ``"final"``
    in ``OUT/carried_over.json``. Idempotent: a run already in ``OUT/final`` is left as it is.

    Returns
    -------
    list of str
        One line per arm of the source's final cell: how many runs were carried, or why none was (the final
        cell then trains the arm).
    """
    from .controls import GRID_SEEDS
    from .controls_report import CARRIED_FILE
    from .tuned import FINAL_DIR, _finished

    out, source = Path(out), Path(source)
    final = _source_final(source)
    finished, _ = _finished(source / FINAL_DIR)  # the runs that reached their epochs, as the final cell counts them
    path = out / CODE_PATH_FILE
    code = json.loads(path.read_text()) if path.is_file() else None
    lines, carried = [], []
    for arm_dir in sorted(p for p in final.iterdir() if p.is_dir()):
        arm = arm_dir.name
        why = _refusal(out, arm, arm_dir, recipes, code, GRID_SEEDS[0])
        if why is not None:
            lines.append(f"carry: {arm}: not carried ({why}); the final cell trains it.")
            continue
        runs = []
        for run in sorted(arm_dir.glob("seed*"), key=lambda p: int(p.name[4:])):
            target = out / FINAL_DIR / "runs" / arm / run.name
            if target.exists() or int(run.name[4:]) not in finished.get(arm, {}):
                continue
            target.mkdir(parents=True)
            for f in CARRIED_FILES:
                shutil.copy2(run / f, target / f)
            runs.append(f"{FINAL_DIR}/runs/{arm}/{run.name}")
        carried += runs
        lines.append(f"carry: {arm}: " + (f"carried {len(runs)} final run(s) from {source.name}" if runs
                                          else f"its final runs from {source.name} are already here"))
    if carried:
        _record(out / CARRIED_FILE, source.name, code, carried)
    return lines


def _refusal(out: Path, arm: str, arm_dir: Path, recipes: Mapping[str, Any], code: Mapping[str, Any] | None,
             seed: int) -> str | None:
    """Why ``arm``'s final runs may not be carried, or ``None`` (module docstring, conditions 1 and 2)."""
    if arm not in recipes:
        return "not an arm of this study"
    selected = _selected_run(out, recipes[arm], arm, seed)
    if not (selected / "config.json").is_file():
        return f"no config.json at its selected point {selected}"
    mine = json.loads((selected / "config.json").read_text())
    theirs = json.loads((arm_dir / f"seed{CHECK_SEED}" / "config.json").read_text())
    if mine["arm"] != theirs["arm"] or mine["config"] != theirs["config"]:
        differ = sorted(k for k in set(mine["config"]) | set(theirs["config"])
                        if mine["config"].get(k) != theirs["config"].get(k))
        return f"its recipe changed: the selected run's config differs from the source's final in {', '.join(differ)}"
    if code is None:
        return f"no {CODE_PATH_FILE}: run `python -m experiments.lm.carry check` first"
    entry = code["arms"].get(arm)
    if entry is None:
        return f"{CODE_PATH_FILE} did not check it"
    if not entry["identical"]:
        d = entry["first_difference"]
        return (f"its code path changed: {d['file']} record {d['record']} {d['key']} differs between "
                f"{code['source_commit'][:12]} and {code['commit'][:12]}")
    if not entry.get("config_is_source"):
        return f"{CODE_PATH_FILE} checked it on another config than the source's final (extra flags)"
    others = sorted({c[:12] for run in arm_dir.glob("seed*") if (c := _commit(run)) != code["source_commit"]})
    if others:
        return (f"some of its final runs were trained on {', '.join(others)}, which the check did not cover (it ran "
                f"{code['source_commit'][:12]})")
    return None


def _record(path: Path, name: str, code: Mapping[str, Any], runs: Sequence[str]) -> None:
    """Add the carried final ``runs`` (folders relative to the study) to ``carried_over.json``'s ``"final"``."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    final = data.get("final", {"from": f"experiments/lm/records/{name}", "runs": []})
    final["why"] = (f"the arm's recipe here is the source's (the selected run's config equals its final's, the seed "
                    f"aside) and its code path is unchanged ({CODE_PATH_FILE}: {code['epochs']} epochs of seed "
                    f"{code['seed']} equal bit for bit on {code['source_commit'][:12]} and {code['commit'][:12]})")
    final["trained_on"] = sorted({code["source_commit"]})
    final["runs"] = sorted(set(final["runs"]) | set(runs))
    data["final"] = final
    path.write_text(json.dumps(data, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """``check OUT ARGS --commit C --arms ...``: the code-path check; ``final OUT ARGS``: carry what may be carried.
    A usage error is one line on stderr, exit 2."""
    from ..harness.cli_args import OneLineParser

    parser = OneLineParser(prog="python -m experiments.lm.carry", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("check", "final"))
    parser.add_argument("out", help="the study folder, e.g. experiments/lm/records/level")
    parser.add_argument("args", help="its args file, e.g. experiments/lm/configs/level.args")
    parser.add_argument("--commit", help="check: the commit that trains this study")
    parser.add_argument("--arms", nargs="+", help="check: the arms to check")
    parser.add_argument("--workdir", help="check: a folder for the worktrees and the runs")
    parser.add_argument("--check-epochs", type=int, default=CHECK_EPOCHS, help="check: epochs of each run")
    a, extra = parser.parse_known_args(argv)
    try:
        if a.command == "check":
            for flag, value in (("--commit", a.commit), ("--arms", a.arms), ("--workdir", a.workdir)):
                if not value:
                    parser.error(f"check needs {flag}")
            if a.check_epochs < 1:
                parser.error("--check-epochs: must be >= 1")
            record = check_code_path(a.out, a.args, commit=a.commit, arms=a.arms, workdir=a.workdir,
                                     epochs=a.check_epochs, extra=extra)
            for arm, entry in record["arms"].items():
                print(f"check: {arm}: code path " + ("unchanged" if entry["identical"] else
                                                     f"changed ({entry['first_difference']})"))
            return 0
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        for line in carry_final(a.out, a.args):
            print(line)
        return 0
    except (OSError, ValueError) as err:  # one line: the message names the file or flag
        print(f"carry: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # a training of the check failed: its last words
        print(f"carry: {' '.join(str(err).split())}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
