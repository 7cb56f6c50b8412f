r"""The scale point (issue 57, item 8): the controls study's arms at their recipes on a model 30 times its size, one
command on one GPU.

``experiments/lm/run_scale.sh`` reads an args file (``experiments/lm/configs/scale.args``): the ``lm`` flags that
every arm shares (corpus, split, model, batch, steps, evaluation: every arm sees the same tokens) and, in comment
lines,

- ``# reference <summary.json>``: the committed study whose selection gave the recipes
  (``experiments/lm/records/controls/summary.json``);
- ``# frames <arm>``: the frames arm (one of :data:`FRAMES_ARMS`), trained beside :data:`OTHER_ARMS`;
- ``# recipe <arm> <lr> <warm-up steps>``: each trained arm's lr and linear warm-up, as the reference selected
  them. A recipe that differs from the reference's selection, a recipe missing for a trained arm and one for an
  arm not trained are refused (:func:`read_plan`), so the file cannot drift from its source.

``python -m experiments.lm.scale calls OUT ARGS`` checks the plan, the device and the corpus (the reference's
text, by SHA-256) and prints one ``lm`` call per arm (``<arm> <flags>``: the arm's folder ``OUT/<arm>``, its lr,
its warm-up as ``--warmup-fraction``); the script trains them, side by side on the one GPU, then ``report OUT
ARGS`` (:func:`write_report`) writes ``summary.json`` and ``report.md`` from the records alone. ``plan ARGS``
prints the sizes (parameters against the reference model, tokens, FLOPs) and trains nothing; ``pack-corpus DIR``
copies this interpreter's standard-library sources (the corpus) into ``DIR``, for a machine whose Python is
another version. Usage errors are one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["FRAMES_ARMS", "OTHER_ARMS", "REFERENCE_KEYS", "Recipe", "ScalePlan", "read_plan", "reference_recipes",
           "model_params", "arm_calls", "check_corpus", "check_device", "pack_corpus", "summarize", "write_report",
           "main"]

#: The frames arms the scale point can train (``# frames <arm>``): the level-ground study selects between them.
FRAMES_ARMS = ("stiefel", "stiefel-gain")
#: The arms trained beside the frames arm, in report order around it (``adamw-qknorm`` first: the comparison).
OTHER_ARMS = ("adamw-qknorm", "muon", "stiefelmuon-muon")
#: ``lm`` flags that the plan sets per arm or the script sets per machine: refused in the args file.
PER_CALL_FLAGS = ("--lr", "--frame-lr", "--warmup-fraction", "--arms", "--out", "--device", "--workers", "--threads",
                  "--corpus-root", "--lrs", "--final-seeds", "--frame-lrs", "--time-steps", "--report-only",
                  "--skip-report", "--quiet")
#: The held-out sets whose bits per byte the report shows.
REFERENCE_KEYS = ("test", "test_code", "test_prose", "test_data")
#: A learning rate in the args file matches the reference's selection to this relative tolerance (both are written
#: with six significant digits).
LR_REL_TOL = 1e-6
#: A single-pair difference within this many standard deviations of the reference's paired differences is read as
#: seed noise (a yardstick for one pair, not a test).
NOISE_SDS = 2.0


@dataclass(frozen=True)
class Recipe:
    """An arm's learning rate and warm-up (steps of linear warm-up before the cosine decay)."""

    lr: float
    warmup_steps: int


@dataclass(frozen=True)
class ScalePlan:
    """The scale point of one args file: the shared ``lm`` flags, the config they give, the reference summary, the
    frames arm and each trained arm's :class:`Recipe`."""

    args_file: Path
    flags: tuple[str, ...]
    config: Any  # experiments.lm.study.LMConfig
    seeds: tuple[int, ...]
    reference: Path
    frames: str
    recipes: dict[str, Recipe]

    @property
    def arms(self) -> tuple[str, ...]:
        """The trained arms in report order: ``adamw-qknorm``, the frames arm, ``muon``, ``stiefelmuon-muon``."""
        return (OTHER_ARMS[0], self.frames, *OTHER_ARMS[1:])

    def warmup_fraction(self, arm: str) -> str:
        """``--warmup-fraction`` of ``arm``: its warm-up steps over the run's steps, as a text that the study turns
        back into exactly those steps (``int(fraction * steps)``)."""
        steps, total = self.recipes[arm].warmup_steps, self.config.total_steps
        text = f"{steps / total:.12g}"
        if int(float(text) * total) != steps:  # the study truncates; a value rounded below would lose a step
            text = f"{(steps + 1e-6) / total:.12g}"
        return text


def _reference_total_steps(summary: Mapping[str, Any]) -> int:
    config = summary["config"]
    return int(config["train"]["epochs"]) * int(config["steps_per_epoch"])


def reference_recipes(summary: Mapping[str, Any]) -> dict[str, Recipe]:
    """Each arm's recipe as a study's ``summary.json`` records its selection (``recipes``): the lr, and the warm-up
    in steps (``warmup_steps``; ``None`` is the study's own warm-up, ``int(warmup_fraction * steps)`` of its
    config, as the study computes it)."""
    own = int(float(summary["config"]["warmup_fraction"]) * _reference_total_steps(summary))
    return {arm: Recipe(float(r["lr"]), own if r.get("warmup_steps") is None else int(r["warmup_steps"]))
            for arm, r in summary["recipes"].items()}


def _parse_config(flags: Sequence[str], where: str):
    """The ``LMConfig`` and seeds the study's own parser makes of ``flags`` (its defaults for flags not given)."""
    from .study import STUDY, config_from_args

    class Parser(argparse.ArgumentParser):
        def error(self, message: str):  # one sentence naming the flag, raised rather than printed and exited
            raise ValueError(f"{where}: {message} (the lm study's flags: python -m experiments lm --help)")

    parser = Parser(prog=where, add_help=False)
    STUDY.add_arguments(parser)
    args = parser.parse_args(list(flags))
    try:
        return config_from_args(args), tuple(args.seeds or (0,))
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def read_plan(path: str | Path) -> ScalePlan:
    """The :class:`ScalePlan` of an args file (see the module docstring).

    Raises
    ------
    ValueError
        A missing or unknown ``# frames`` arm, a missing ``# reference`` or one without a selection, a recipe
        missing for a trained arm, given for an arm not trained, or different from the reference's selection, a
        warm-up not shorter than the run, a per-call flag (:data:`PER_CALL_FLAGS`) in the file, or flags the
        ``lm`` study refuses; the message names the line and the fix.
    """
    path = Path(path)
    flags: list[str] = []
    frames = reference = None
    recipes: dict[str, Recipe] = {}
    for line in path.read_text().splitlines():
        words = line.split()
        if words[:2] == ["#", "frames"]:
            frames = words[2] if len(words) == 3 else ""
        elif words[:2] == ["#", "reference"] and len(words) == 3:
            reference = words[2]
        elif words[:2] == ["#", "recipe"]:
            try:
                if len(words) != 5:
                    raise ValueError
                recipes[words[2]] = Recipe(float(words[3]), int(words[4]))
            except ValueError:
                raise ValueError(f"{path}: '{line.strip()}': a recipe line is '# recipe <arm> <lr> <warm-up steps>' "
                                 f"(a float and an int).") from None
        elif words and not words[0].startswith("#"):
            flags += words
    given = sorted({f.split("=")[0] for f in flags} & set(PER_CALL_FLAGS))
    if given:
        raise ValueError(f"{path}: {', '.join(given)} are set per arm or per machine by the plan and the script "
                         f"(recipes: '# recipe' lines; the corpus folder: SCALE_CORPUS_ROOT); drop them from the file.")
    if frames not in FRAMES_ARMS:
        raise ValueError(f"{path}: needs a line '# frames <arm>' with <arm> one of {', '.join(FRAMES_ARMS)}.")
    if reference is None:
        raise ValueError(f"{path}: needs a line '# reference <summary.json>' naming the study whose selection "
                         f"gave the recipes (e.g. experiments/lm/records/controls/summary.json).")
    config, seeds = _parse_config(flags, str(path))
    plan = ScalePlan(path, tuple(flags), config, seeds, _resolve(reference, path), frames, recipes)
    _check_recipes(plan)
    return plan


def _resolve(reference: str, args_file: Path) -> Path:
    """A reference path as written (from the working folder, as the scripts run), else beside the args file."""
    p = Path(reference)
    return p if p.is_absolute() or p.exists() else args_file.parent / p


def _load_reference(plan: ScalePlan) -> dict[str, Any]:
    try:
        summary = json.loads(plan.reference.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{plan.args_file}: '# reference {plan.reference}' is not a readable summary.json "
                         f"({err}).") from None
    if not isinstance(summary.get("recipes"), dict) or "config" not in summary:
        raise ValueError(f"{plan.args_file}: '# reference {plan.reference}' holds no selection (no 'recipes'); "
                         f"name the summary.json of a study that selected recipes.")
    return summary


def _check_recipes(plan: ScalePlan) -> None:
    chosen = reference_recipes(_load_reference(plan))
    missing = [a for a in plan.arms if a not in plan.recipes]
    extra = [a for a in plan.recipes if a not in plan.arms]
    if missing or extra:
        raise ValueError(f"{plan.args_file}: the trained arms are {', '.join(plan.arms)}; "
                         + (f"add '# recipe' lines for {', '.join(missing)}" if missing else "")
                         + ("; " if missing and extra else "")
                         + (f"drop the '# recipe' lines of {', '.join(extra)} (not trained)" if extra else "") + ".")
    for arm in plan.arms:
        mine, theirs = plan.recipes[arm], chosen.get(arm)
        if theirs is None:
            raise ValueError(f"{plan.args_file}: {plan.reference} selected no recipe for {arm}; point '# reference' "
                             f"at the summary.json of a study that did (e.g. the level-ground study's).")
        if not math.isclose(mine.lr, theirs.lr, rel_tol=LR_REL_TOL) or mine.warmup_steps != theirs.warmup_steps:
            raise ValueError(f"{plan.args_file}: '# recipe {arm} {mine.lr:g} {mine.warmup_steps}' is not the "
                             f"selection of {plan.reference} (lr {theirs.lr:g}, warm-up {theirs.warmup_steps} steps); "
                             f"write the selected recipe.")
        if not 0 <= mine.warmup_steps < plan.config.total_steps:
            raise ValueError(f"{plan.args_file}: {arm}'s warm-up of {mine.warmup_steps} steps does not fit in the "
                             f"run's {plan.config.total_steps} steps; train for more steps.")


def model_params(config: Any) -> int:
    """The number of parameters of the study's GPT-2 at ``config``'s size (:func:`~.study.build_model`, seed 0)."""
    from .study import build_model

    return sum(p.numel() for p in build_model(config, seed=0).parameters())


def _reference_config(summary: Mapping[str, Any]):
    from ..harness.config import config_from_dict
    from .study import LMConfig

    return config_from_dict(LMConfig, summary["config"])


def sizes(plan: ScalePlan) -> dict[str, Any]:
    """The scale point's sizes: parameters (and against the reference model), tokens and model FLOPs per arm."""
    c = plan.config
    ref = _reference_config(_load_reference(plan))
    params, ref_params = model_params(c), model_params(ref)
    tokens = c.total_steps * c.batch_size * c.context
    return {"model": {"width": c.width, "depth": c.depth, "heads": c.heads, "context": c.context, "params": params},
            "reference_model": {"width": ref.width, "depth": ref.depth, "heads": ref.heads, "context": ref.context,
                                "params": ref_params},
            "param_ratio": params / ref_params, "steps": c.total_steps, "batch_size": c.batch_size,
            "tokens_per_arm": tokens, "reference_tokens": ref.total_steps * ref.batch_size * ref.context,
            "flops_per_arm": 6 * params * tokens}


def check_device(device: str) -> None:
    """Refuse a CUDA ``device`` that torch cannot see (one sentence naming the override)."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("torch sees no GPU here; the scale point is sized for one H100/H200 (minutes there, many "
                         "hours on a CPU); SCALE_DEVICE=cpu trains on the CPU anyway (the smoke test's tiny config).")


def check_corpus(plan: ScalePlan, corpus_root: str | None) -> dict[str, Any]:
    """The corpus the runs would read (``corpus_root``, else this interpreter's standard library), refused unless
    its SHA-256 is the reference's: the scale point is on the same text as the study it is set beside."""
    from .data import load_corpus

    ref = _load_reference(plan).get("corpus") or {}
    try:
        here = load_corpus(plan.config.corpus, val_fraction=plan.config.val_fraction, root=corpus_root).describe()
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(f"SCALE_CORPUS_ROOT {corpus_root}: {err}") from None
    if here["sha256"] != ref.get("sha256"):
        raise ValueError(f"the corpus read here ({here['source']}, SHA-256 {here['sha256'][:12]}) is not the one of "
                         f"{plan.reference} ({ref.get('source')}, SHA-256 {str(ref.get('sha256'))[:12]}); on a "
                         f"machine with another Python, `python -m experiments.lm.scale pack-corpus DIR` where the "
                         f"reference's Python is, then SCALE_CORPUS_ROOT=DIR.")
    return here


def arm_calls(plan: ScalePlan, out: str | Path, *, device: str, corpus_root: str | None = None
              ) -> list[tuple[str, list[str]]]:
    """``(arm, flags)`` per trained arm: the ``lm`` flags that follow the args file's own (its folder
    ``out/<arm>``, the arm, its lr and warm-up, the device, the corpus folder)."""
    calls = []
    for arm in plan.arms:
        flags = ["--out", str(Path(out) / arm), "--arms", arm, "--lr", f"{plan.recipes[arm].lr:g}",
                 "--warmup-fraction", plan.warmup_fraction(arm), "--device", device]
        calls.append((arm, flags + (["--corpus-root", corpus_root] if corpus_root else [])))
    return calls


def pack_corpus(dest: str | Path) -> str:
    """Copy this interpreter's standard-library sources as the corpus reads them (``*.py``, relative paths kept)
    and its ``LICENSE.txt`` into the new folder ``dest``; returns the corpus' SHA-256 (read back from ``dest``)."""
    import sysconfig

    from .data import load_corpus, stdlib_files

    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise ValueError(f"pack-corpus {dest}: the folder is not empty; remove it or name a new one.")
    base = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_files(base):
        target = dest / path.relative_to(base)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    if (base / "LICENSE.txt").is_file():
        shutil.copyfile(base / "LICENSE.txt", dest / "LICENSE.txt")
    return load_corpus(root=dest).sha256


# ---------------------------------------------------------------------------------------------- report
def _runs(out: Path, arm: str) -> dict[int, dict[str, Any]]:
    """The runs of ``arm`` in ``out/<arm>``: per seed its config, evaluation records, calls and last step record."""
    from ..harness.records import read_records, run_paths, seed_of
    from ..harness.run_folder import CONFIG_FILE, ENVIRONMENT_FILE, STEPS_FILE

    runs = {}
    for path in run_paths(out / arm, CONFIG_FILE, parent=f"runs/{arm}"):
        folder = path.parent
        env = folder / ENVIRONMENT_FILE
        steps = read_records(folder / STEPS_FILE)
        runs[seed_of(folder)] = {"config": json.loads(path.read_text())["config"],
                                 "records": read_records(folder / "metrics.jsonl"),
                                 "calls": json.loads(env.read_text()) if env.exists() else [],
                                 "last_step": steps[-1] if steps else None}
    return runs


#: Settings in which the arms' runs may differ: the recipe, and where the corpus was read from (its SHA-256 may not).
_RECIPE_KEYS = ("optim.lr", "warmup_fraction", "corpus_root", "corpus_identity")


def _shared(config: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in config.items() if k not in _RECIPE_KEYS}
    out["optim"] = {k: v for k, v in config["optim"].items() if k != "lr"}
    out["corpus_sha256"] = (config.get("corpus_identity") or {}).get("sha256")  # the text, wherever it was read
    return out


def _check_runs(plan: ScalePlan, runs: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> None:
    """Refuse records that are not the plan's: an arm trained at another recipe, or arms whose runs differ in
    anything but their recipes (then they did not see the same tokens, or not the same model)."""
    first = None
    for arm, per_seed in runs.items():
        for seed, run in per_seed.items():
            c = run["config"]
            steps = int(c["train"]["epochs"]) * int(c["steps_per_epoch"])
            recipe = plan.recipes[arm]
            if not math.isclose(c["optim"]["lr"], recipe.lr, rel_tol=LR_REL_TOL) or \
                    int(c["warmup_fraction"] * steps) != recipe.warmup_steps:
                raise ValueError(f"{arm} seed {seed} was trained at lr {c['optim']['lr']:g} with "
                                 f"{int(c['warmup_fraction'] * steps)} warm-up steps, not at the recipe of "
                                 f"{plan.args_file} (lr {recipe.lr:g}, {recipe.warmup_steps}); train it into another "
                                 f"folder, or report it with the args file it was trained with.")
            if first is None:
                first = (arm, seed, _shared(c))
            elif _shared(c) != first[2]:
                differs = sorted(k for k in set(first[2]) | set(_shared(c)) if first[2].get(k) != _shared(c).get(k))
                raise ValueError(f"{arm} seed {seed} was trained with other settings than {first[0]} seed "
                                 f"{first[1]} ({', '.join(differs)}): the arms did not see the same tokens or model; "
                                 f"retrain them from one args file.")


def _calls_span(runs: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> tuple[float | None, bool]:
    """The wall time from the first training call's start to the last one's end (seconds), and whether two arms'
    calls overlapped in time (trained side by side, sharing the device)."""
    from datetime import datetime

    spans = []
    for per_seed in runs.values():
        for run in per_seed.values():
            for call in run["calls"]:
                if call.get("seconds") is not None:
                    start = datetime.fromisoformat(call["started"]).timestamp()
                    spans.append((start, start + call["seconds"]))
    if not spans:
        return None, False
    spans.sort()
    overlap = any(b[0] < a[1] - 1.0 for a, b in zip(spans, spans[1:], strict=False))  # ISO times: whole seconds
    return max(e for _, e in spans) - spans[0][0], overlap


def _reference_per_seed(summary: Mapping[str, Any], arm: str, key: str) -> dict[str, float]:
    cell = ((summary.get("final") or {}).get("test") or {}).get(arm) or {}
    return {str(s): v for s, v in (cell.get(key) or {}).get("per_seed", {}).items() if v is not None}


def _mean_sd(values: Sequence[float]) -> tuple[float | None, float | None]:
    from ..harness.records import mean_std

    return mean_std(list(values))


def _arm_summary(plan: ScalePlan, arm: str, per_seed: Mapping[int, Mapping[str, Any]], reference: Mapping[str, Any],
                 flops: int) -> dict[str, Any]:
    epochs = plan.config.train.epochs
    row: dict[str, Any] = {"lr": plan.recipes[arm].lr, "warmup_steps": plan.recipes[arm].warmup_steps,
                           "seeds": sorted(per_seed), "finished": {}, "epoch": {}}
    for key in ("val", *REFERENCE_KEYS):
        row[f"{key}_bpb"] = {}
    row["logit_max_last_step"], row["train_seconds"], row["devices"] = {}, {}, []
    for seed, run in sorted(per_seed.items()):
        last = run["records"][-1] if run["records"] else {}
        row["epoch"][seed] = last.get("epoch", 0)
        row["finished"][seed] = last.get("epoch", 0) >= epochs
        for key in ("val", *REFERENCE_KEYS):
            row[f"{key}_bpb"][seed] = last.get(f"{key}_bpb")
        step = run["last_step"] or {}
        row["logit_max_last_step"][seed] = max(step["logit_max"]) if step.get("logit_max") else None
        row["train_seconds"][seed] = round(sum(c.get("seconds") or 0.0 for c in run["calls"]), 1)
        row["devices"] += [c.get("device_name") or c.get("device") for c in run["calls"]]
    row["devices"] = sorted({d for d in row["devices"] if d})
    done = [s for s in row["seeds"] if row["finished"][s] and row["train_seconds"][s] > 0]
    row["ms_per_step"] = {s: round(1e3 * row["train_seconds"][s] / plan.config.total_steps, 1) for s in done}
    row["tflops_achieved"] = {s: round(flops / row["train_seconds"][s] / 1e12, 2) for s in done}
    ref = _reference_per_seed(reference, arm, "test")
    m, sd = _mean_sd(list(ref.values()))
    row["reference_test_bpb"] = {"mean": m, "sd": sd, "n": len(ref)}
    return row


def _differences(plan: ScalePlan, arms: Mapping[str, Mapping[str, Any]], reference: Mapping[str, Any]
                 ) -> dict[str, Any]:
    """Each arm against ``adamw-qknorm`` (and ``stiefelmuon-muon`` against ``muon``): the paired test-bpb
    differences of the finished seeds here, beside the reference's paired differences (mean, sd, pairs)."""
    pairs = [(a, OTHER_ARMS[0]) for a in plan.arms[1:]] + [("stiefelmuon-muon", "muon")]
    out = {}
    for a, b in pairs:
        here = {s: arms[a]["test_bpb"][s] - arms[b]["test_bpb"][s] for s in arms[a]["seeds"]
                if s in arms[b]["seeds"] and arms[a]["finished"][s] and arms[b]["finished"][s]
                and arms[a]["test_bpb"][s] is not None and arms[b]["test_bpb"][s] is not None}
        ra, rb = _reference_per_seed(reference, a, "test"), _reference_per_seed(reference, b, "test")
        ref = [ra[s] - rb[s] for s in ra if s in rb]
        m, sd = _mean_sd(ref)
        mean = sum(here.values()) / len(here) if here else None
        read = None
        if mean is not None and all(math.isfinite(v) for v in here.values()) and sd is not None:
            read = "within seed noise" if abs(mean) < NOISE_SDS * sd else "beyond seed noise"
        out[f"{a} - {b}"] = {"per_seed": here, "mean": mean, "reference": {"mean": m, "sd": sd, "n": len(ref)},
                             "read": read}
    return out


def summarize(out: str | Path, plan: ScalePlan) -> dict[str, Any]:
    """The scale point's summary from the records under ``out`` (``out/<arm>/runs/<arm>/seed<k>/``), checked
    against the plan (:func:`_check_runs`)."""
    out = Path(out)
    reference = _load_reference(plan)
    runs = {arm: r for arm in plan.arms if (r := _runs(out, arm))}
    _check_runs(plan, runs)
    size = sizes(plan)
    arms = {arm: _arm_summary(plan, arm, runs[arm], reference, size["flops_per_arm"]) for arm in runs}
    wall, side_by_side = _calls_span(runs)
    identities = [run["config"].get("corpus_identity") or {} for per in runs.values() for run in per.values()]
    ref_corpus = reference.get("corpus") or {}
    pythons = sorted({c.get("python") for per in runs.values() for run in per.values() for c in run["calls"]} - {None})
    return {"title": f"Scale point: four arms at their recipes, {size['param_ratio']:.1f}x the parameters (issue 57, "
                     f"item 8)",
            "args_file": str(plan.args_file), "reference": str(plan.reference), "frames": plan.frames,
            **size, "corpus": identities[0] if identities else None,
            "same_corpus": bool(identities) and all(i.get("sha256") == ref_corpus.get("sha256") for i in identities),
            "reference_corpus_sha256": ref_corpus.get("sha256"), "missing_arms": [a for a in plan.arms if a not in runs],
            "arms": arms, "differences": _differences(plan, arms, reference) if len(arms) == len(plan.arms) else {},
            "wall_seconds": None if wall is None else round(wall, 1), "side_by_side": side_by_side,
            "commits": sorted({(c.get("git_sha") or "")[:12] + ("*" if c.get("git_dirty") else "")
                               for per in runs.values() for run in per.values() for c in run["calls"]} - {""}),
            "pythons": pythons, "reference_python": ref_corpus.get("version"), "noise_sds": NOISE_SDS}


def _num(v: float | None, fmt: str = ".4f") -> str:
    if v is None:
        return "–"
    return f"{v:{fmt}}" if math.isfinite(v) else "diverged"


def _per_seed(values: Mapping[Any, float | None], fmt: str = ".4f", sign: bool = False) -> str:
    """One seed's value, or the mean and each seed's value."""
    vals = [v for v in values.values() if v is not None]
    f = ("+" if sign else "") + fmt
    if len(vals) <= 1:
        return _num(vals[0] if vals else None, f)
    return f"{_num(sum(vals) / len(vals), f)} ({', '.join(_num(v, f) for v in vals)})"


def _report_lines(s: Mapping[str, Any]) -> list[str]:
    m, r = s["model"], s["reference_model"]
    corpus = s["corpus"] or {}
    same = "the reference's text" if s["same_corpus"] else "**not the reference's text: its numbers do not compare**"
    tokens = ("as many as the reference's runs" if s["tokens_per_arm"] == s["reference_tokens"]
              else f"the reference's runs saw {s['reference_tokens']:,}")
    seeds = sorted({seed for a in s["arms"].values() for seed in a["seeds"]})
    lines = [f"# {s['title']}", "",
             f"`{s['args_file']}` trains {', '.join(f'`{a}`' for a in s['arms'])} at the recipes that "
             f"`{s['reference']}` selected, on a GPT-2 of {m['params']:,} parameters (width {m['width']}, depth "
             f"{m['depth']}, {m['heads']} heads of {m['width'] // m['heads']}, context {m['context']}): "
             f"{s['param_ratio']:.1f}x the {r['params']:,} of the reference's model (width {r['width']}, depth "
             f"{r['depth']}, {r['heads']} heads), both counted with the study's own `build_model`. Every arm sees the "
             f"same {s['tokens_per_arm']:,} training bytes ({s['steps']} steps of {s['batch_size']} windows of "
             f"{m['context']}; {tokens}). Corpus: {corpus.get('source')}, SHA-256 `{str(corpus.get('sha256'))[:12]}`: "
             f"{same}. Seed(s) {', '.join(map(str, seeds)) or '–'}: with one seed per arm every difference below is "
             f"a single pair, read against the reference's seed spread, not a test.", ""]
    for arm in s["missing_arms"]:
        lines += [f"**{arm}: no runs yet; rerun `experiments/lm/run_scale.sh`.**", ""]
    for arm, a in s["arms"].items():
        stopped = [f"seed {k} at epoch {a['epoch'][k]}" for k in a["seeds"] if not a["finished"][k]]
        if stopped:
            lines += [f"**{arm}: stopped before the end ({', '.join(stopped)}); rerun the script to resume. Its "
                      f"numbers below are not final and it is left out of the differences.**", ""]
    devices = sorted({d for a in s["arms"].values() for d in a["devices"]})
    wall = "–" if s["wall_seconds"] is None else f"{s['wall_seconds'] / 60:.1f} min"
    lines += [f"Trained on {', '.join(devices) or '–'}, commit(s) {', '.join(s['commits']) or 'not recorded'} "
              f"(* = with uncommitted changes); {wall} of training from the first start to the last end"
              + (", the arms side by side on one device (their per-step times include the sharing)"
                 if s["side_by_side"] else "") + "; eager float32 (the study has no mixed precision).", "",
              "## Results (bits per byte, last evaluation; lower is better)", "",
              "| arm | lr | warm-up (steps) | test | test code / prose / data | val | reference test, mean ± sd (seeds) "
              "| here − reference | largest logit, last step | ms / step | model TFLOP/s |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, a in s["arms"].items():
        ref = a["reference_test_bpb"]
        test = [v for v in a["test_bpb"].values() if v is not None]
        delta = (sum(test) / len(test) - ref["mean"]) if test and ref["mean"] is not None else None
        parts = " / ".join(_per_seed(a[f"{k}_bpb"]) for k in REFERENCE_KEYS[1:])
        lines.append(f"| {arm} | {a['lr']:g} | {a['warmup_steps']} | {_per_seed(a['test_bpb'])} | {parts} "
                     f"| {_per_seed(a['val_bpb'])} | {_num(ref['mean'])} ± {_num(ref['sd'])} ({ref['n']}) "
                     f"| {_num(delta, '+.4f')} | {_per_seed(a['logit_max_last_step'], '.1f')} "
                     f"| {_per_seed(a['ms_per_step'], '.1f')} | {_per_seed(a['tflops_achieved'], '.2f')} |")
    lines.append("")
    if s["differences"]:
        lines += ["## Differences (test bpb, paired by seed; negative: the first arm is better)", "",
                  "| comparison | here | reference: mean, sd of the pairs (pairs) | read |", "|---|---|---|---|"]
        for name, d in s["differences"].items():
            ref = d["reference"]
            lines.append(f"| {name} | {_per_seed(d['per_seed'], '.4f', sign=True)} | {_num(ref['mean'], '+.4f')}, "
                         f"{_num(ref['sd'])} ({ref['n']}) | {d['read'] or '–'} |")
        lines += ["", f"Read: *within seed noise* when the difference here is smaller than {s['noise_sds']:g} standard "
                      f"deviations of the reference's paired differences (a yardstick for one pair at the small "
                      f"model's seed spread, not a test), *beyond seed noise* otherwise.", ""]
    lines += ["## Notes", "",
              "- The recipes were selected at the reference's size and not re-tuned here: the scale point asks "
              "whether the arms keep their order at this size at the recipes chosen small, not which arm is best "
              "tuned at this size (under the standard parametrization AdamW's best lr usually falls as the width "
              "grows).",
              "- Model TFLOP/s is 6 x parameters x training bytes over the training seconds (evaluations and "
              "checkpoints included): a model this small is bound by kernel launches and host work, far below the "
              "device's peak.",
              *([f"- Trained under Python {', '.join(s['pythons'])}, the reference's corpus under "
                 f"{s['reference_python']}: the same files and the same windows (the SHA-256 above), but a window's "
                 f"code / prose / data label comes from the running Python's tokenizer (3.12 splits f-strings into "
                 f"parts), so the per-category columns may label a few windows differently; the totals compare."]
                if s["reference_python"] and s["pythons"] and s["pythons"] != [s["reference_python"]] else []),
              f"- The records: `<arm>/runs/<arm>/seed<k>/` (`config.json`, `metrics.jsonl`, `steps.jsonl`, "
              f"`environment.json`); `python -m experiments.lm.scale report OUT {s['args_file']}` rebuilds this "
              f"report from them.", ""]
    return lines


def write_report(out: str | Path, plan: ScalePlan) -> tuple[dict[str, Any], Path]:
    """Write ``summary.json`` and ``report.md`` into ``out`` from its records (:func:`summarize`)."""
    from ..harness.report import write_text

    out = Path(out)
    summary = summarize(out, plan)
    if not summary["arms"]:
        raise ValueError(f"{out}: holds no runs of {', '.join(plan.arms)}; train them first "
                         f"(experiments/lm/run_scale.sh).")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary, write_text(out / "report.md", "\n".join(_report_lines(summary)))


# ---------------------------------------------------------------------------------------------- CLI
def _plan_lines(plan: ScalePlan) -> list[str]:
    s = sizes(plan)
    m, r = s["model"], s["reference_model"]
    lines = [f"scale point of {plan.args_file}: arms {', '.join(plan.arms)} (frames arm: {plan.frames}), seeds "
             f"{' '.join(map(str, plan.seeds))}",
             f"  model: width {m['width']} depth {m['depth']} heads {m['heads']} context {m['context']}: "
             f"{m['params']:,} parameters, {s['param_ratio']:.2f}x the reference's {r['params']:,} (width "
             f"{r['width']} depth {r['depth']} heads {r['heads']})",
             f"  tokens per arm: {s['tokens_per_arm']:,} ({s['steps']} steps x {s['batch_size']} x {m['context']}; "
             f"reference {s['reference_tokens']:,}); model FLOPs per arm 6 N T = {s['flops_per_arm']:.3g}"]
    lines += [f"  {arm}: lr {plan.recipes[arm].lr:g}, warm-up {plan.recipes[arm].warmup_steps} steps "
              f"(--warmup-fraction {plan.warmup_fraction(arm)})" for arm in plan.arms]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """``calls OUT ARGS [--device D] [--corpus-root DIR]``: check and print one ``<arm> <lm flags>`` line per arm;
    ``report OUT ARGS``: write the report; ``plan ARGS``: print the sizes; ``pack-corpus DIR``: copy the corpus.
    A usage error is one line on stderr, exit 2."""
    from geoopt_stiefel_attention.argtypes import OneLineParser

    parser = OneLineParser(prog="python -m experiments.lm.scale", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    calls = sub.add_parser("calls", help="check the plan, the device and the corpus; print the lm calls")
    calls.add_argument("out")
    calls.add_argument("args")
    calls.add_argument("--device", default="cuda")
    calls.add_argument("--corpus-root", default=None)
    report = sub.add_parser("report", help="write summary.json and report.md from the records")
    report.add_argument("out")
    report.add_argument("args")
    sub.add_parser("plan", help="print the sizes; train nothing").add_argument("args")
    sub.add_parser("pack-corpus", help="copy this Python's standard-library sources").add_argument("dir")
    a = parser.parse_args(argv)
    try:
        if a.command == "pack-corpus":
            print(f"scale: corpus copied to {a.dir}, SHA-256 {pack_corpus(a.dir)}")
            return 0
        plan = read_plan(a.args)
        if a.command == "plan":
            print("\n".join(_plan_lines(plan)))
        elif a.command == "calls":
            check_device(a.device)
            check_corpus(plan, a.corpus_root)
            for arm, flags in arm_calls(plan, a.out, device=a.device, corpus_root=a.corpus_root):
                print(arm, *flags)
        else:
            summary, path = write_report(a.out, plan)
            print(f"scale: report -> {path}")
    except (OSError, ValueError, KeyError) as err:
        print(f"scale: {err}".replace("\n", " "), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
