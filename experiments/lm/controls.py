r"""The plan of the controls study (issue 42) and of the level-ground study (issue 57): which ``lm`` calls train
next, read from the records on disk.

``experiments/lm/run_controls.sh`` asks ``python -m experiments.lm.controls next OUT`` for the calls of the first
stage that still misses runs, trains them, and asks again until nothing is left; ``plan`` lists every stage (the
runs known now, and the stages that wait on results). Each call is one line of ``lm`` flags (the study's flags
from the args file come first in the script). The stages, in order, each one started only once the stages before
it are complete (so the first runs are those that say most: every arm's coarse grid, seed 0 first):

1. **coarse**: every arm at the lrs of its ``# grid <arm> <lr> ...`` line, one stage per grid seed
   (:data:`GRID_SEEDS`).
2. **extend**: an arm whose best lr is at a grid edge gets the next value beyond it (:func:`~.tuned.select_lrs`),
   until every optimum is bracketed.
3. **refine**: a point at ×√3 on each side of each arm's best lr (after it, the best lr has neighbours at ×√3
   whichever point wins).
4. **warm-up**: each ``# warmup <steps> <arm> ...`` line: those arms at the three lrs around their optimum (the
   best lr and its neighbours) with that warm-up, in ``warmup-<steps>/`` (:func:`~.tuned.select_recipes`). A
   warm-up grid whose best lr (validation) is at its edge gets the next lr beyond it, the neighbour in the arm's
   own grid (else ×√3 beyond the edge), until its optimum is bracketed too: a warm-up that moves the optimum is
   tuned as finely as the arm itself (tuned against tuned). A warm-up line names every arm of the study: the
   protocol refuses one that tunes a knob for some arms only (:class:`Protocol`; tune symmetrically, issue 57).
   The committed controls study (``controls.args``) offered warm-up 400 to ``adamw`` and ``adamw-qknorm`` only,
   so the planner refuses its args file now; ``level.args`` is its successor.
5. **second seed** (``# confirm <seed> <points>``, :func:`confirm_points`): a second seed at each arm's ``points``
   best grid points (lr × warm-up, ranked on the first seed), so that the recipe is chosen on the mean of two
   seeds where neighbouring points differ by less than the seed spread; the final cell and the timing pass then
   select with ``--confirm <seed> <points>`` (:func:`~.tuned.confirm_recipes`).
6. **final**: every arm at its recipe (lr, warm-up) on the final seeds, disjoint from the grid's, seed by seed
   (a call trains the arms missing a seed, or the next two seeds missing the same arms), so that a cell stopped
   part-way holds whole pairs; the test split is read here only.
7. **timing**: the timing pass for the equal-wall-clock readout.

Selection uses validation only (:func:`~.tuned.read_grid` never reads the grid's test numbers).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .tuned import (
    FINAL_DIR,
    LR_REL_TOL,
    TIMING_FILE,
    WARMUP_PREFIX,
    _finished,
    _lr_text,
    read_grid,
    select_lrs,
    top_points,
)

__all__ = ["GRID_SEEDS", "FINAL_SEEDS", "REFINE_RATIO", "Protocol", "read_protocol", "Stage", "stages", "confirm_points",
           "per_run", "main"]

#: Seeds of every grid point: one, so that the budget goes to the final cell's ten pairs. In the tuned study two seeds
#: of one grid point differed by 0.018 bpb (median; 0.001-0.026 at the arms' optima), about the size of the gaps
#: between ×√3 neighbours near an optimum: the refinement then picks one of near-equal lrs, which is what it is for.
GRID_SEEDS = (0,)
#: Seeds of the final cell: ten, disjoint from the grid's.
FINAL_SEEDS = tuple(range(1, 11))
#: Final seeds missing the same arms that one call trains (two: whole pairs early, no idle worker)
FINAL_SEEDS_PER_CALL = 2
#: Refinement: one point at best × and ÷ this ratio.
REFINE_RATIO = math.sqrt(3)
#: Timing pass: steps per round.
TIME_STEPS = 20


@dataclass(frozen=True)
class Protocol:
    """The study's grids (``# grid <arm> <lr> ...``), warm-up variants (``# warmup <steps> <arm> ...``), the steps
    of one run (``--epochs`` × ``--steps-per-epoch``) and, optionally, the selection's second seed
    (``# confirm <seed> <points>``: that seed at each arm's ``points`` best grid points), read from its args file.

    Raises
    ------
    ValueError
        A warm-up variant that leaves out an arm of the grid (tune symmetrically: a knob tuned for one arm is
        tuned for every arm it is compared with), or a second seed that is a grid or final seed.
    """

    grids: dict[str, tuple[float, ...]]
    warmups: dict[int, tuple[str, ...]]
    total_steps: int
    confirm: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        # tune symmetrically (issue 57): a knob tuned for one arm is tuned for every arm it is compared with, and in
        # this study every arm is compared with every other (the baselines adamw and muon, and the frames against
        # adamw-qknorm), so a warm-up variant names every arm or none
        for steps, arms in self.warmups.items():
            unknown = sorted(set(arms) - set(self.grids))
            lacking = [a for a in self.grids if a not in arms]
            if unknown:
                raise ValueError(f"'# warmup {steps}' names arms without a grid: {', '.join(unknown)}.")
            if lacking:
                raise ValueError(
                    f"'# warmup {steps}' tunes the warm-up of {', '.join(arms)} but not of {', '.join(lacking)}: a knob "
                    f"tuned for one arm is tuned for every arm it is compared with; name every arm on the line (or "
                    f"drop it).")
        if self.confirm is not None:
            seed, points = self.confirm
            if seed in GRID_SEEDS or seed in FINAL_SEEDS or points < 1:
                raise ValueError(f"'# confirm {seed} {points}': the second selection seed must differ from the grid's "
                                 f"({', '.join(map(str, GRID_SEEDS))}) and the final cell's "
                                 f"({FINAL_SEEDS[0]}-{FINAL_SEEDS[-1]}), and the points must be >= 1.")

    @property
    def arms(self) -> list[str]:
        return list(self.grids)


def read_protocol(path: str | Path) -> Protocol:
    """The :class:`Protocol` of an args file (``experiments/lm/configs/controls.args``)."""
    grids: dict[str, tuple[float, ...]] = {}
    warmups: dict[int, tuple[str, ...]] = {}
    flags: dict[str, str] = {}
    confirm: tuple[int, int] | None = None
    for line in Path(path).read_text().splitlines():
        words = line.split()
        if words[:2] == ["#", "grid"]:
            grids[words[2]] = tuple(sorted(float(v) for v in words[3:]))
        elif words[:2] == ["#", "warmup"]:
            warmups[int(words[2])] = tuple(words[3:])
        elif words[:2] == ["#", "confirm"]:
            confirm = (int(words[2]), int(words[3]))
        elif words and words[0].startswith("--") and len(words) == 2:
            flags[words[0]] = words[1]
    if not grids:
        raise ValueError(f"{path}: needs '# grid <arm> <lr> ...' lines.")
    try:
        return Protocol(grids, warmups, int(flags["--epochs"]) * int(flags["--steps-per-epoch"]), confirm)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


@dataclass(frozen=True)
class Stage:
    """One stage of the plan: its name, the ``lm`` calls that train its missing runs (each a list of flags), the
    runs they train (``arm lr seed`` words), and, for a stage that waits on results, why (``calls`` empty)."""

    name: str
    calls: tuple[tuple[str, ...], ...] = ()
    runs: tuple[str, ...] = ()
    waiting: str | None = None


def _has(values: Sequence[float], v: float) -> bool:
    return any(math.isclose(v, x, rel_tol=LR_REL_TOL) for x in values)


def _grid_stage(name: str, out: Path, missing: dict[str, list[float]], seeds: Sequence[int],
                extra: Sequence[str] = ()) -> Stage:
    """The calls training ``missing`` (arm -> lrs) on ``seeds`` in ``out``; arms with the same lrs share a call."""
    groups: dict[tuple[float, ...], list[str]] = {}
    for arm, lrs in missing.items():
        if lrs:
            groups.setdefault(tuple(sorted(lrs)), []).append(arm)
    calls = tuple(("--out", str(out), *extra, "--arms", *arms, "--lrs", *map(_lr_text, lrs),
                   "--seeds", *map(str, seeds), "--skip-report") for lrs, arms in groups.items())
    runs = tuple(f"{out.name}: {arm} lr {_lr_text(lr)} seed {s}" for lrs, arms in groups.items() for arm in arms
                 for lr in lrs for s in seeds)
    return Stage(name, calls, runs)


def _missing(grid: dict, arm: str, lrs: Sequence[float], seed: int) -> list[float]:
    have = grid["finals"].get(arm, {})
    return [lr for lr in lrs if not any(math.isclose(lr, x, rel_tol=LR_REL_TOL) and seed in per
                                         for x, per in have.items())]


def _beyond_warmup_edge(warm: dict, arm: str, grid: Sequence[float]) -> float | None:
    """The next lr to train on the warm-up grid ``warm`` of ``arm`` when its best point (mean validation bpb over
    :data:`GRID_SEEDS`, points missing a seed aside) is its lowest or highest lr: the neighbour beyond it in the
    arm's own ``grid`` (sorted lrs), else the edge ÷ or × :data:`REFINE_RATIO`; ``None`` when the best is inside."""
    points = {lr: sum(per[s] for s in GRID_SEEDS) / len(GRID_SEEDS)
              for lr, per in warm["finals"].get(arm, {}).items() if all(s in per for s in GRID_SEEDS)}
    if len(points) < 2:
        return None
    lrs = sorted(points)
    best = min(lrs, key=points.__getitem__)
    if best == lrs[0]:
        below = [v for v in grid if v < best and not math.isclose(v, best, rel_tol=LR_REL_TOL)]
        return below[-1] if below else best / REFINE_RATIO
    if best == lrs[-1]:
        above = [v for v in grid if v > best and not math.isclose(v, best, rel_tol=LR_REL_TOL)]
        return above[0] if above else best * REFINE_RATIO
    return None


def confirm_points(out: Path, protocol: Protocol, grid: dict | None = None
                   ) -> dict[Path, tuple[tuple[str, ...], dict[str, list[float]]]]:
    """The grid points that still miss the second selection seed (``protocol.confirm``): for each arm, its
    ``points`` best grid points by validation bpb on the first grid seed, over the study's own grid and every
    warm-up grid (lr × warm-up); ``{folder: (extra lm flags, {arm: [lr, ...]})}`` for the folders with runs to
    train. A diverged point (non-finite bpb) ranks last."""
    assert protocol.confirm is not None
    seed, top = protocol.confirm
    sources: list[tuple[int | None, float | None, dict]] = [(None, None, grid if grid is not None else read_grid(out))]
    sources += [(steps, steps / protocol.total_steps, read_grid(out / f"{WARMUP_PREFIX}{steps}"))
                for steps in sorted(protocol.warmups)]
    found: dict[Path, tuple[tuple[str, ...], dict[str, list[float]]]] = {}
    for arm in protocol.arms:
        for point in top_points(sources, arm, seed=GRID_SEEDS[0], points=top):
            if str(seed) in point["per_seed"]:
                continue
            steps = point["warmup_steps"]
            folder = out if steps is None else out / f"{WARMUP_PREFIX}{steps}"
            flags = () if steps is None else ("--warmup-fraction", f"{steps / protocol.total_steps:g}")
            found.setdefault(folder, (flags, {}))[1].setdefault(arm, []).append(point["lr"])
    return found


def stages(out: str | Path, protocol: Protocol) -> list[Stage]:
    """Every stage in order, up to and including the first that cannot be planned yet (module docstring); a stage
    whose runs are all on record has no calls."""
    out = Path(out)
    grid = read_grid(out)
    plan = [_grid_stage(f"coarse, seed {s}", out, {a: _missing(grid, a, lrs, s) for a, lrs in protocol.grids.items()},
                        [s]) for s in GRID_SEEDS]
    if any(st.calls for st in plan):
        return plan + [Stage("extend, refine, warm-up, final, timing", waiting="the coarse grid")]
    selection = select_lrs(grid, arms=protocol.arms, seeds=GRID_SEEDS)["arms"]
    extend = {a: [s["next_lr"]] for a, s in selection.items() if not s["bracketed"]}
    plan.append(_grid_stage("extend", out, extend, GRID_SEEDS))
    if extend:
        return plan + [Stage("refine, warm-up, final, timing", waiting="every optimum bracketed")]
    refine = {a: [v for v in (s["best_lr"] / REFINE_RATIO, s["best_lr"] * REFINE_RATIO) if not _has(s["grid"], v)]
              for a, s in selection.items()}
    plan.append(_grid_stage("refine", out, refine, GRID_SEEDS))
    if any(refine.values()):
        return plan + [Stage("warm-up, final, timing", waiting="the refined grid")]
    for steps, arms in protocol.warmups.items():
        folder = out / f"{WARMUP_PREFIX}{steps}"
        around = {}
        for a in arms:
            lrs = selection[a]["grid"]
            k = next(i for i, v in enumerate(lrs) if math.isclose(v, selection[a]["best_lr"], rel_tol=LR_REL_TOL))
            around[a] = lrs[max(k - 1, 0):k + 2]
        warm = read_grid(folder)
        missing = {a: sorted({lr for s in GRID_SEEDS for lr in _missing(warm, a, lrs, s)}) for a, lrs in around.items()}
        if not any(missing.values()):  # the three points are on record: extend a grid whose best is at its edge
            missing = {a: [v] for a in arms if (v := _beyond_warmup_edge(warm, a, selection[a]["grid"])) is not None}
        plan.append(_grid_stage(f"warm-up {steps} steps", folder, missing, GRID_SEEDS,
                                ("--warmup-fraction", f"{steps / protocol.total_steps:g}")))
        if any(missing.values()):
            return plan + [Stage("final, timing", waiting=f"the warm-up {steps} grid")]
    extra: tuple[str, ...] = ()
    if protocol.confirm is not None:
        seed, points = protocol.confirm
        missing_by_folder = confirm_points(out, protocol, grid)
        # one stage over every folder (its runs named with their folder): the points are independent, so a call of
        # one folder never waits for another's to finish
        parts = [_grid_stage("", folder, missing, [seed], flags) for folder, (flags, missing) in missing_by_folder.items()]
        confirm = Stage(f"second seed {seed}", tuple(c for p in parts for c in p.calls),
                        tuple(r for p in parts for r in p.runs))
        plan.append(confirm)
        if confirm.calls:
            return plan + [Stage("final, timing", waiting=f"the second seed {seed}")]
        extra = ("--confirm", str(seed), str(points))  # the final cell and the timing pass select on both seeds
    done, _ = _finished(out / FINAL_DIR)
    todo = [(a, s) for s in FINAL_SEEDS for a in protocol.arms if s not in done.get(a, {})]
    # seed by seed, every arm missing it: a cell stopped part-way holds whole pairs of every arm, not all ten seeds
    # of the first arms and none of the others; the next two seeds missing the same arms share a call, so that an
    # odd number of runs per seed does not leave a worker idle at the end of every call
    missing = [(s, tuple(a for a in protocol.arms if (a, s) in todo)) for s in FINAL_SEEDS]
    batches: list[tuple[tuple[str, ...], list[int]]] = []
    for s, arms in missing:
        if not arms:
            continue
        if batches and batches[-1][0] == arms and len(batches[-1][1]) < FINAL_SEEDS_PER_CALL:
            batches[-1][1].append(s)
        else:
            batches.append((arms, [s]))
    final_calls = tuple(("--out", str(out), "--arms", *arms, "--seeds", *map(str, GRID_SEEDS), *extra,
                         "--final-seeds", *map(str, seeds), "--skip-report") for arms, seeds in batches)
    plan.append(Stage("final", final_calls, tuple(f"final: {a} seed {s}" for a, s in todo)))
    timing = () if (out / TIMING_FILE).exists() else (("--out", str(out), "--arms", *protocol.arms, "--seeds",
                                                        *map(str, GRID_SEEDS), *extra, "--time-steps",
                                                        str(TIME_STEPS), "--skip-report"),)
    if todo:
        return plan + [Stage("timing", waiting="the final cell")]
    return plan + [Stage("timing", timing, ("timing pass",) if timing else ())]


def _values(call: Sequence[str], flag: str) -> tuple[int, int]:
    """The span ``(start, end)`` of the values of ``flag`` in ``call`` (``start`` the flag's index)."""
    start = call.index(flag)
    end = next((i for i in range(start + 1, len(call)) if call[i].startswith("--")), len(call))
    return start, end


def per_run(call: Sequence[str]) -> list[tuple[str, ...]]:
    """A planned call split into one call per run, in the order the call trains them: a grid call (``--arms``,
    ``--lrs``, ``--seeds``) into one per seed, arm and lr; a final call (``--final-seeds``) into one per final seed
    and arm (seed by seed: a cell stopped part-way still holds whole pairs); the timing pass (``--time-steps``,
    which times the arms together) as it is. Every other flag is kept in place."""
    call = tuple(call)
    if "--time-steps" in call:
        return [call]
    final = "--final-seeds" in call
    axes = ["--final-seeds", "--arms"] if final else ["--seeds", "--arms", "--lrs"]
    spans = {flag: _values(call, flag) for flag in axes}
    values = {flag: call[start + 1:end] for flag, (start, end) in spans.items()}

    def one(choice: Mapping[str, str]) -> tuple[str, ...]:
        out: list[str] = []
        i = 0
        while i < len(call):
            flag = call[i]
            if flag in spans:
                out += [flag, choice[flag]]
                i = spans[flag][1]
            else:
                out.append(flag)
                i += 1
        return tuple(out)

    return [one(dict(zip(axes, combo, strict=True))) for combo in itertools.product(*(values[f] for f in axes))]


def main(argv: Sequence[str] | None = None) -> int:
    """``next OUT ARGS``: the calls of the first stage that misses runs, one line of flags each (none: the study
    is trained; ``--per-run``: one call per run, :func:`per_run`); ``plan OUT ARGS``: every stage with its runs. A
    usage error is one line on stderr, exit 2."""
    parser = argparse.ArgumentParser(prog="python -m experiments.lm.controls", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("next", "plan"))
    parser.add_argument("out", help="the study folder, e.g. experiments/lm/records/controls")
    parser.add_argument("args", help="the args file, e.g. experiments/lm/configs/controls.args")
    parser.add_argument("--per-run", action="store_true",
                        help="next: one call per run (run_controls.sh keeps JOBS of them running at once)")
    a = parser.parse_args(argv)
    try:
        protocol = read_protocol(a.args)
    except (OSError, ValueError, KeyError) as err:
        print(f"controls: not a usable args file: {err}", file=sys.stderr)
        return 2
    plan = stages(a.out, protocol)
    if a.command == "next":
        first = next((st for st in plan if st.calls), None)
        for call in first.calls if first else ():
            for one in per_run(call) if a.per_run else [call]:
                print(" ".join(one))
        return 0
    for st in plan:
        if st.waiting:
            print(f"== {st.name}: waits on {st.waiting}")
            continue
        print(f"== {st.name}: {len(st.runs)} run(s) to train" + ("" if st.runs else " (all on record)"))
        for run in st.runs:
            print(f"   {run}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
