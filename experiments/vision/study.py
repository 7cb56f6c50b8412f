r"""The ViT-on-patches study: ``python -m experiments vision``.

A :class:`~geoopt_stiefel_attention.PatchViT` (default: 4×4 patches, width 64, 2 layers, 4 heads, MLP 128,
class token) is trained on CIFAR-10, Fashion-MNIST or scikit-learn's digits (:mod:`.data.vision`) with
minibatch AdamW (lr 1e-3, betas (0.9, 0.999), weight decay 0.05 on the Euclidean matrices, 5% linear warm-up
then cosine decay). The ``stiefel`` arm keeps W_Q, W_K on the Stiefel manifold and trains them with
:class:`~geoopt_stiefel_attention.StiefelAdam`; every other parameter is trained exactly as in the ``adamw``
arm. A seed fixes the training subsample, the batch order and the initial weights, so the arms of a seed form a
pair (the frames are the polar factors of the AdamW arm's initial W_Q, W_K).

Studies (``--study``), each a grid of (arm, seed) runs of the shared training loop
(:func:`~experiments.harness.jobs.run_jobs`):

- ``paired``: ``adamw`` vs ``stiefel``; per-pair differences of the final test accuracy, paired t-test, 95%
  interval, count of positive pairs (:mod:`.stats`);
- ``scaling``: the paired comparison at several training-set sizes (``--train-sizes``), gap against size;
- ``movement``: per-step ‖ΔW_Q‖_F of the frames against the identically shaped W_Q of the AdamW arm (root mean
  square over the steps between evaluations, :class:`StepMovement`), and the distance from initialisation;
- ``frozen``: adds ``stiefel-frozen`` (frames fixed at initialisation); its cost against ``stiefel``;
- ``decay``: the paired comparison at several weight decays (``--weight-decays``), gap against decay;
- ``ablation``: adds ``stiefel-sgd``, ``stiefel-element`` and ``framescalar-euclidean``
  (:mod:`.ablation_arms`), each taking one ingredient of the update away.

Every study writes ``report.md``, ``summary.json`` and PNG figures into ``--out`` and the runs under
``--out/runs`` (or ``--out/<cell>/runs`` for the sweeps). Every report names the data set it ran on.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from geoopt_stiefel_attention.argtypes import UsageError

from ..harness import ablation_arms  # noqa: F401  (registers the ablation and frozen arms)
from ..harness.arms import Arm
from ..harness.batches import MiniBatches
from ..harness.cli_args import build_config
from ..harness.command import StudyCommand
from ..harness.config import OptimConfig, RunSpec, TrainConfig, config_from_dict, require, to_dict
from ..harness.jobs import RunOptions
from ..harness.metrics import QKGeometry, StepMovement, WeightNorms
from ..harness.records import group_runs, run_paths, summarize_cell
from ..harness.report import (
    PaperReference,
    comparison_table,
    figure_lines,
    fmt_num,
    fmt_p,
    fmt_pp,
    frame_rule_text,
    paper_section_intro,
    protocol_differences,
    run_lines,
)
from ..harness.runner import Task
from ..harness.schedules import warmup_cosine  # noqa: F401  (re-exported: vision.warmup_cosine)
from ..harness.stats import describe
from ..harness.study import Cell, StudyOutputs
from .data import (
    DISPLAY_NAMES,
    DatasetFormatError,
    DatasetNotFoundError,
    canonical_dataset,
    load_vision,
    random_crop_flip,
    subsample,
)

__all__ = ["VisionConfig", "StepMovement", "build_task", "study_cells", "run_vision", "finalize_vision",
           "analyze_cell", "STUDIES", "STUDY_ARMS", "PAPER", "HELP", "STUDY", "add_arguments", "run"]

HELP = ("ViT on image patches (CIFAR-10, Fashion-MNIST, digits): paired Stiefel-vs-AdamW starts, data scaling, "
        "movement, frozen frames, weight decay, ablation; records, plots, report.")

STUDIES = ("paired", "scaling", "movement", "frozen", "decay", "ablation")

#: The arms each study runs (the first is the baseline of the paired comparisons).
STUDY_ARMS = {
    "paired": ("adamw", "stiefel"),
    "scaling": ("adamw", "stiefel"),
    "movement": ("adamw", "stiefel"),
    "frozen": ("adamw", "stiefel", "stiefel-frozen"),
    "decay": ("adamw", "stiefel"),
    "ablation": ("adamw", "stiefel", "stiefel-sgd", "stiefel-element", "framescalar-euclidean"),
}

#: What each ablation arm keeps of the Stiefel update.
INGREDIENTS = {
    "stiefel": "projector + retraction + scale-free, O(d)-equivariant step",
    "stiefel-sgd": "projector + retraction; step of degree one in the gradient (not scale-free)",
    "stiefel-element": "projector + retraction; scale-free per coordinate, not O(d)-equivariant",
    "framescalar-euclidean": "scale-free, O(d)-equivariant step; no projector, no retraction",
    "stiefel-frozen": "frames fixed at initialisation",
}

#: The paper's CIFAR-10 figures, and the one setting we know they were measured with.
PAPER = PaperReference(
    source='R. D. Guerrero, "Stiefel Attention", arXiv, Sep 2026 (ViT on CIFAR-10 patches)',
    epoch=None,
    values={},
    note="Model sizes, epochs and learning rates are not given in the paper.",
    extra={"paired_gap_pp": 8.98, "paired_t": 60.6, "paired_n": 12, "paired_positive": 12,
           "movement_ratio": (24.0, 40.0), "frozen_cost_pp": 0.28,
           "scaling": "the gap widens with more training data",
           "ablation": "the whole gain comes from making the step scale-free; nothing measurable from the projector "
                       "or from O(d)-equivariance"},
    protocol={"dataset": "cifar10"},
)


# ---------------------------------------------------------------------------------------------- config
def _default_train() -> TrainConfig:
    return TrainConfig(epochs=10, eval_every=1)


def _default_optim() -> OptimConfig:
    return OptimConfig(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.05)


@dataclass(frozen=True)
class VisionConfig:
    """Configuration of one cell of the vision study (data, model, schedule, optimizer).

    The image size, channels and number of classes follow from ``dataset``; they are not fields.

    Parameters
    ----------
    dataset : {"cifar10", "fashion-mnist", "digits"}
    train_size : int or None
        Training images per run, drawn per seed (:func:`~.data.vision.subsample`); ``None``: all.
    patch_size, width, depth, heads, mlp, pool
        The :class:`~geoopt_stiefel_attention.PatchViT`.
    batch_size : int
        Minibatch size; the last, smaller batch of an epoch is kept.
    augment : bool
        Random crop (4-pixel padding) and horizontal flip of each training batch.
    lr_schedule : {"cosine", "constant"}
        ``"cosine"``: linear warm-up over ``warmup_fraction`` of the steps, then cosine decay to 0.
    warmup_fraction : float
        In ``[0, 1)``.
    eval_train_size : int or None
        Training images (the first of the run's subsample) evaluated for ``train_acc``; ``None``: all.
    amp : {None, "bf16"}
        Mixed precision: the forward pass under ``torch.autocast(dtype=bfloat16)``; the weights and the
        optimizer states stay float32.
    sgd_frame_lr : float or None
        Learning rate of the frames in the ``stiefel-sgd`` arm (a step of degree one in the gradient needs its
        own scale); ``None``: ``optim.effective_frame_lr``.
    """

    experiment: str = "vision"
    dataset: str = "cifar10"
    train_size: int | None = None
    patch_size: int = 4
    width: int = 64
    depth: int = 2
    heads: int = 4
    mlp: int = 128
    pool: str = "cls"
    batch_size: int = 128
    augment: bool = False
    lr_schedule: str = "cosine"
    warmup_fraction: float = 0.05
    eval_train_size: int | None = 2000
    amp: str | None = None
    sgd_frame_lr: float | None = None
    train: TrainConfig = field(default_factory=_default_train)
    optim: OptimConfig = field(default_factory=_default_optim)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dataset", canonical_dataset(self.dataset))
        for name in ("patch_size", "width", "depth", "heads", "mlp", "batch_size"):
            v = getattr(self, name)
            require(isinstance(v, int) and not isinstance(v, bool) and v > 0,
                    f"--{name.replace('_', '-')} {v!r}: must be a positive int.")
        for name in ("train_size", "eval_train_size"):
            v = getattr(self, name)
            require(v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0),
                    f"--{name.replace('_', '-')} {v!r}: must be a positive int, or all.")
        require(self.width % self.heads == 0,
                f"--width {self.width} must be divisible by --heads {self.heads}.")
        require(self.pool in ("cls", "mean"), f"--pool {self.pool!r}: must be cls or mean.")
        require(self.lr_schedule in ("cosine", "constant"),
                f"--lr-schedule {self.lr_schedule!r}: must be cosine or constant.")
        require(isinstance(self.warmup_fraction, (int, float)) and 0 <= self.warmup_fraction < 1,
                f"--warmup-fraction {self.warmup_fraction!r}: must be in [0, 1).")
        require(self.amp in (None, "bf16"), f"--amp {self.amp!r}: must be none or bf16.")
        require(self.sgd_frame_lr is None or (isinstance(self.sgd_frame_lr, (int, float)) and self.sgd_frame_lr > 0),
                f"--sgd-frame-lr {self.sgd_frame_lr!r}: must be a float > 0.")
        require(isinstance(self.train, TrainConfig), "VisionConfig.train must be a TrainConfig.")
        require(isinstance(self.optim, OptimConfig), "VisionConfig.optim must be an OptimConfig.")
        image = {"cifar10": 32, "fashion-mnist": 28, "digits": 16}[self.dataset]
        require(image % self.patch_size == 0,
                f"--patch-size {self.patch_size} does not divide the {image}x{image} images of "
                f"{self.dataset}; pick a divisor of {image} (--patch-size).")

    @property
    def display_name(self) -> str:
        return DISPLAY_NAMES[self.dataset]

    @property
    def epochs_extendable(self) -> bool:
        """A finished run can be continued to more epochs only under a constant learning rate: the cosine
        schedule is a function of the total number of steps."""
        return self.lr_schedule == "constant"


def arm_config(config: VisionConfig, arm: str) -> VisionConfig:
    """The config a run of ``arm`` uses: ``config`` itself, except that ``stiefel-sgd`` gets
    ``optim.frame_lr = sgd_frame_lr`` when that is set."""
    if arm == "stiefel-sgd" and config.sgd_frame_lr is not None:
        return dataclasses.replace(config, optim=dataclasses.replace(config.optim, frame_lr=config.sgd_frame_lr))
    return config


# ---------------------------------------------------------------------------------------------- task
def predict_autocast(model: torch.nn.Module, images: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Logits from a forward pass under :func:`torch.autocast` (mixed precision), returned as float32."""
    with torch.autocast(device_type=images.device.type, dtype=dtype):
        return model(images).float()


def _no_matrix(name: str, p: torch.Tensor) -> bool:
    return False


EVAL_BATCH = 1000


def build_task(spec: RunSpec, arm: Arm, device: torch.device, *, data_dir: str = "data") -> Task:
    """The vision task of one run: the seed's training subsample (minibatches in the seed's order), the test set,
    and a PatchViT with the arm's attention built from the seed. Pass ``data_dir`` with
    :func:`functools.partial` (the data set must be there already: download it first with
    :func:`~.data.vision.load_vision`)."""
    from geoopt_stiefel_attention.models import PatchViT
    from geoopt_stiefel_attention.nn import param_groups, query_key_projections

    cfg: VisionConfig = spec.config
    data = load_vision(cfg.dataset, data_dir)
    idx = subsample(data.train_inputs.shape[0], cfg.train_size, spec.seed)
    xtr, ytr = (data.train_inputs, data.train_targets) if idx is None else (data.train_inputs[idx],
                                                                             data.train_targets[idx])
    xtr, ytr = xtr.to(device), ytr.to(device)
    model = PatchViT(image_size=data.image_size, patch_size=cfg.patch_size, in_channels=data.in_channels,
                     num_classes=data.num_classes, width=cfg.width, depth=cfg.depth, heads=cfg.heads, mlp=cfg.mlp,
                     pool=cfg.pool, attention=arm.attention, seed=spec.seed)
    train = MiniBatches(xtr, ytr, cfg.batch_size, seed=spec.seed, transform=random_crop_flip if cfg.augment else None)
    n_eval = xtr.shape[0] if cfg.eval_train_size is None else min(cfg.eval_train_size, xtr.shape[0])
    eval_data = {"train": MiniBatches(xtr[:n_eval], ytr[:n_eval], EVAL_BATCH, shuffle=False),
                 "test": MiniBatches(data.test_inputs.to(device), data.test_targets.to(device), EVAL_BATCH,
                                     shuffle=False)}
    lr_factor = None
    if cfg.lr_schedule == "cosine":
        total = cfg.train.epochs * len(train)
        lr_factor = functools.partial(warmup_cosine, total=total, warmup=int(cfg.warmup_fraction * total))
    extra = {"predict": functools.partial(predict_autocast, dtype=torch.bfloat16)} if cfg.amp == "bf16" else {}
    hooks = (QKGeometry(query_key_projections), StepMovement(query_key_projections), WeightNorms(include=_no_matrix))
    return Task(model=model, train_data=train, eval_data=eval_data, param_groups=param_groups, hooks=hooks,
                lr_factor=lr_factor, **extra)


# ---------------------------------------------------------------------------------------------- cells
def _fraction_or_count(x: float, base: int) -> int:
    n = round(x * base) if x <= 1 else int(x)
    if not 1 <= n <= base:
        raise ValueError(f"--train-sizes: {x:g} gives {n} images; use fractions in (0, 1] or counts in [1, {base}].")
    return n


def study_cells(study: str, config: VisionConfig, *, train_sizes: Sequence[float] = (0.1, 0.25, 0.5, 1.0),
                weight_decays: Sequence[float] = (0.0, 0.05, 0.5), n_train: int | None = None) -> list[Cell]:
    """The cells of ``study``: one for paired/movement/frozen/ablation; one per training-set size for
    ``scaling`` (fractions ``<= 1`` of ``config.train_size`` or of all ``n_train`` images, or counts ``> 1``);
    one per weight decay for ``decay``."""
    if study not in STUDIES:
        raise ValueError(f"study={study!r} is unknown; use one of {', '.join(STUDIES)} (--study).")
    if study == "scaling":
        base = config.train_size or n_train
        if base is None:
            raise ValueError("study_cells: scaling needs n_train (the size of the training set) or a train_size.")
        if not train_sizes:
            raise ValueError("--train-sizes: no size given; pass at least one, e.g. --train-sizes 0.1,0.5,1.")
        sizes = [_fraction_or_count(float(x), base) for x in train_sizes]
        repeated = sorted({n for n in sizes if sizes.count(n) > 1})
        if repeated:
            raise ValueError(f"--train-sizes: {','.join(f'{float(x):g}' for x in train_sizes)} gives "
                             f"{', '.join(map(str, repeated))} images more than once; list each size once.")
        return [Cell(dataclasses.replace(config, train_size=n), f"size-{n}", "train_size", n) for n in sorted(sizes)]
    if study == "decay":
        decays = [float(wd) for wd in weight_decays]
        if not decays:
            raise ValueError("--weight-decays: no weight decay given; pass at least one, e.g. --weight-decays 0,0.05.")
        bad = [wd for wd in decays if not (math.isfinite(wd) and wd >= 0)]
        if bad:
            raise ValueError(f"--weight-decays: {bad[0]:g} must be a finite float >= 0.")
        if len(set(decays)) != len(decays):
            raise ValueError(f"--weight-decays: {','.join(f'{wd:g}' for wd in decays)} names a weight decay twice; "
                             f"list each once.")
        return [Cell(dataclasses.replace(config, optim=dataclasses.replace(config.optim, weight_decay=wd)),
                     f"wd-{wd:g}", "weight_decay", wd) for wd in sorted(decays)]
    return [Cell(config)]


# ---------------------------------------------------------------------------------------------- analysis
def _movement(runs: Mapping[str, Mapping[int, list[Mapping[str, Any]]]], base: str = "adamw") -> dict[str, Any]:
    """Ratios of the baseline's per-step rms movement to each other arm's, per (seed, evaluation)."""
    out: dict[str, Any] = {}
    if base not in runs:
        return out
    for arm, seeds in runs.items():
        if arm == base:
            continue
        entry: dict[str, Any] = {}
        for x in ("q", "k"):
            key = f"move_step_rms/{x}"
            ratios, per_seed = [], {}
            for seed, recs in seeds.items():
                theirs = {r["epoch"]: r.get(key) for r in runs[base].get(seed, [])}
                rs = [theirs[r["epoch"]] / r[key] for r in recs
                      if r.get(key) and theirs.get(r["epoch"]) is not None]
                if rs:
                    ratios += rs
                    per_seed[str(seed)] = sum(rs) / len(rs)
            if ratios:
                entry[f"ratio_{x}"] = {**describe(ratios), "per_seed_mean": per_seed,
                                       "per_seed_range": [min(per_seed.values()), max(per_seed.values())]}
        if entry:
            out[f"{base} / {arm}"] = entry
    return out


def analyze_cell(records: Sequence[Mapping[str, Any]], arms: Sequence[str],
                 metric: str = "test_acc") -> dict[str, Any]:
    """:func:`~.records.summarize_cell` of one cell's records (final accuracies, paired comparisons), plus
    ``movement``: ``"adamw / <arm>"`` ratios of the per-step rms movement of W_Q (``ratio_q``) and W_K
    (``ratio_k``) over every (seed, evaluation) pair."""
    out = summarize_cell(records, arms, metric=metric, final_keys=FINAL_KEYS, all_keys=ALL_KEYS)
    runs = group_runs(records)
    run_arms = [a for a in arms if a in runs]
    out["movement"] = _movement(runs, run_arms[0]) if run_arms else {}
    return out


#: record keys summarised at the last evaluation, and over every evaluation, of each run (the same names as
#: ``lm.FINAL_KEYS``; formerly ``VISION_FINAL_KEYS``, ``VISION_ALL_KEYS``)
FINAL_KEYS = ("train_acc", "move_total_rel/q", "move_total_rel/k", "angle_max_deg/q", "angle_mean_deg/q",
                     "norm/euclidean")
ALL_KEYS = ("move_step_rms/q", "move_step_rms/k", "move_step_rel_rms/q")


# ---------------------------------------------------------------------------------------------- report
def _dataset_paragraph(config: VisionConfig, n_train_full: int | None, n_test: int | None) -> str:
    name = config.display_name
    size = ("all training images" if config.train_size is None else
            f"a training subset of {config.train_size:,} images drawn per seed")
    counts = "" if n_train_full is None else f"{n_train_full:,} training / {n_test:,} test images; "
    text = (f"**Dataset: {name}** ({counts}each run uses {size} and is evaluated on the whole test set).")
    if config.dataset != "cifar10":
        text += " **This is not CIFAR-10**, the data set of the paper's figures."
    return text


def _setup_paragraph(config: VisionConfig) -> str:
    o = config.optim
    sched = ("constant learning rate" if config.lr_schedule == "constant" else
             f"{100 * config.warmup_fraction:g}% linear warm-up then cosine decay to 0")
    return (f"PatchViT: {config.patch_size}×{config.patch_size} patches, width {config.width}, {config.depth} layer(s), "
            f"{config.heads} heads, MLP {config.mlp}, {config.pool} pooling. Minibatches of {config.batch_size}, "
            f"{config.train.epochs} epochs, augmentation {'on' if config.augment else 'off'}, "
            f"{'bf16 autocast' if config.amp else 'float32'}. AdamW lr {o.lr:g}, betas {o.betas}, eps {o.eps:g}, "
            f"weight decay {o.weight_decay:g} on the Euclidean matrices; {sched}. Frames: StiefelAdam lr "
            f"{o.effective_frame_lr:g}{frame_rule_text(o)}, trust region {o.trust_region}, no weight decay. A seed fixes the training "
            f"subsample, the batch order and the initial weights of every arm (paired starts).")


def _cell_sections(analysis: Mapping[str, Any], config: VisionConfig, study: str) -> list[str]:
    arms = analysis["arms"]
    lines = ["| arm | seeds | last epoch | final test acc (mean ± sd) | min – max | final train acc (eval subset) "
             "| ‖W_Q − W_Q0‖/‖W_Q0‖ | max angle to W_Q0 span (°) | per-step ‖ΔW_Q‖_F (median) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm, a in arms.items():
        f = a["final_test_acc"]
        tr = a.get("final_train_acc")
        rel, ang, step = a.get("final_move_total_rel/q"), a.get("final_angle_max_deg/q"), a.get("all_move_step_rms/q")
        sd = "" if f.get("std") is None else f" ± {fmt_pp(f['std'], sign=False)}"
        lines.append(f"| {arm} | {len(a['seeds'])} | {', '.join(map(str, a['last_epoch']))} | {fmt_pp(f['mean'], sign=False)}%{sd} | {fmt_pp(f['min'], sign=False)} – "
                     f"{fmt_pp(f['max'], sign=False)} | {fmt_pp(tr and tr['mean'], sign=False)}% | {fmt_num(rel and rel['mean'])} "
                     f"| {fmt_num(ang and ang['mean'])} | {fmt_num(step and step['median'])} |")
    lines.append("")
    if len({e for a in arms.values() for e in a["last_epoch"]}) > 1 or config.train.epochs not in {
            e for a in arms.values() for e in a["last_epoch"]}:
        lines += [f"**Some runs have not reached epoch {config.train.epochs} yet; rerun the command to resume them "
                  f"before reading the comparisons.**", ""]
    if analysis["comparisons"]:
        lines += ["Paired differences of the final test accuracy (same seed: same subsample, batch order and initial "
                  "weights):", ""] + comparison_table(analysis["comparisons"]) + [""]
    return lines


def _paper_lines(study: str, cells: Sequence[tuple[Cell, Mapping[str, Any]]], config: VisionConfig) -> list[str]:
    """The "Next to the paper" section: the paper's CIFAR-10 figures beside this study's only when the study
    follows the paper's protocol (:data:`PAPER` ``.protocol``); otherwise the settings that differ."""
    diffs = protocol_differences(PAPER, config)
    lines = paper_section_intro(PAPER, diffs)
    if diffs:
        return lines
    x = PAPER.extra
    first = cells[0][1]
    comp = first["comparisons"].get("stiefel - adamw")
    lines += ["| quantity | paper | this study |", "|---|---|---|"]
    if comp is not None and study not in ("scaling", "decay"):
        lines.append(f"| gap stiefel − adamw, final test accuracy | {x['paired_gap_pp']:+.2f} pp "
                     f"| {fmt_pp(comp['mean'])} pp (95% CI [{fmt_pp(comp['ci_low'])}, {fmt_pp(comp['ci_high'])}]) |")
        lines.append(f"| paired t | {x['paired_t']} (n = {x['paired_n']}) | {fmt_num(comp['t'])} (n = {comp['n']}, "
                     f"p = {fmt_p(comp['p_value'])}) |")
        lines.append(f"| positive pairs | {x['paired_positive']}/{x['paired_n']} | {comp['n_positive']}/{comp['n']} |")
    mv = first["movement"].get("adamw / stiefel", {}).get("ratio_q")
    if mv is not None:
        lo, hi = x["movement_ratio"]
        lines.append(f"| per-step movement, AdamW W_Q ÷ frames | {lo:g}–{hi:g}× | {mv['min']:.1f}–{mv['max']:.1f}× over "
                     f"all (seed, evaluation) windows; median {mv['median']:.1f}×; per-seed means "
                     f"{mv['per_seed_range'][0]:.1f}–{mv['per_seed_range'][1]:.1f}× |")
    st = first["arms"].get("stiefel", {})
    rel, ang = st.get("final_move_total_rel/q"), st.get("final_angle_max_deg/q")
    if rel is not None:
        lines.append(f"| frames' distance from initialisation at the end | \"barely leave their initialisation\" "
                     f"| ‖W − W₀‖_F/‖W₀‖_F = {rel['mean']:.3g} (mean); largest principal angle "
                     f"{fmt_num(ang and ang['mean'])}° |")
    fz = first["comparisons"].get("stiefel - stiefel-frozen")
    if fz is not None:
        lines.append(f"| cost of freezing the frames (stiefel − stiefel-frozen) | {x['frozen_cost_pp']:.2f} pp "
                     f"| {fmt_pp(fz['mean'])} pp (95% CI [{fmt_pp(fz['ci_low'])}, {fmt_pp(fz['ci_high'])}], "
                     f"{fz['n_positive']}/{fz['n']} positive) |")
    if study == "scaling":
        gaps = ", ".join(f"{c.value:,.0f}: {fmt_pp(a['comparisons'].get('stiefel - adamw', {}).get('mean'))} pp"
                         for c, a in cells)
        lines.append(f"| gap against training-set size | {x['scaling']} | {gaps} |")
    if study == "decay":
        gaps = ", ".join(f"wd {c.value:g}: {fmt_pp(a['comparisons'].get('stiefel - adamw', {}).get('mean'))} pp"
                         for c, a in cells)
        lines.append(f"| gap against weight decay | (not given) | {gaps} |")
    if study == "ablation":
        parts = [f"{arm}: {fmt_pp(first['comparisons'][f'{arm} - adamw']['mean'])} pp"
                 for arm in ("stiefel-sgd", "stiefel-element", "framescalar-euclidean")
                 if f"{arm} - adamw" in first["comparisons"]]
        lines.append(f"| ablation: gap over adamw per arm | {x['ablation']} | {'; '.join(parts)} |")
    lines.append("")
    return lines


NOTES = (
    "Accuracies are the final test accuracy after the last epoch (no early stopping, no model selection on the "
    "test set).",
    "Per-step movement is the root mean square of ‖ΔW‖_F over the optimizer steps between two evaluations, over all "
    "layers and heads together; the AdamW arm's W_Q has exactly the frames' shape (heads, width, width/heads).",
    "The t-test assumes normally distributed pair differences; the sign test does not.",
)


#: (training images, test images) of each data set (the digits split is fixed: :mod:`.data.vision`).
DATASET_SIZES = {"cifar10": (50000, 10000), "fashion-mnist": (60000, 10000), "digits": (1297, 500)}


def _cell_figures(cell: Cell, cells: Sequence[Cell], records, arms: Sequence[str], analysis: Mapping[str, Any],
                  study: str, out_dir: Path, name: str) -> dict[str, Path | None]:
    from ..harness.plotting import plot_ablation, plot_accuracy, plot_distance, plot_movement_ratio, plot_pairs

    tag = f" ({cell.label})" if cell.sweep else ""
    stem = f"{cell.subdir}-" if cell.subdir else ""
    made: dict[str, Path | None] = {
        f"Final test accuracy per arm{tag}; grey lines join the arms of one seed, black: mean ± 95% CI":
            plot_pairs(records, arms, out_dir / f"{stem}pairs.png", title=f"{name}{tag}: final test accuracy"),
    }
    if not cell.sweep or cell is cells[-1]:
        made[f"Accuracy over training{tag} (mean over seeds, band ±1 sd)"] = plot_accuracy(
            records, out_dir / f"{stem}accuracy.png", sets=("train", "test"), threshold=None)
        made[f"Per-step movement of W_Q and its AdamW/frame ratio{tag}"] = plot_movement_ratio(
            records, arms, out_dir / f"{stem}movement_ratio.png", title=f"{name}{tag}",
            band=None if protocol_differences(PAPER, cell.config) else PAPER.extra["movement_ratio"],
            band_label="paper")
        made[f"Distance of W_Q from its initialisation{tag}"] = plot_distance(
            records, arms, out_dir / f"{stem}distance.png", title=f"{name}{tag}")
    if study == "ablation":
        made["Ablation: gap over adamw per arm (bars: mean, whiskers: 95% CI, dots: seeds)"] = plot_ablation(
            analysis["comparisons"], arms, out_dir / "ablation.png", title=f"{name}: ablation")
    return made


def finalize_vision(out_dir: str | os.PathLike, study: str, cells: Sequence[Cell], arms: Sequence[str] | None = None,
                    seeds: Sequence[int] | None = None, *, results: Sequence[Any] = ()) -> StudyOutputs:
    """Analyse the records of every cell under ``out_dir`` and write ``summary.json``, the figures and
    ``report.md`` (``arms``/``seeds`` ``None``: every one on disk). Everything written is a function of the
    files in ``out_dir``, so a rebuild gives the same bytes."""
    from ..harness.plotting import plot_gap_sweep
    from ..harness.report import write_text
    from ..harness.study import cell_records, run_info_from_records, speed_from_environment

    out_dir = Path(out_dir)
    config = cells[0].config
    name = config.display_name
    n_train_full, n_test = DATASET_SIZES[config.dataset]
    analysed: list[tuple[Cell, dict[str, Any]]] = []
    figures: dict[str, Path] = {}
    speed: dict[str, Any] = {}
    cell_arms: list[str] = []
    for cell in cells:
        records = cell_records(out_dir, cell, arms, seeds)
        on_disk = list(dict.fromkeys(r["arm"] for r in records))
        run_arms = list(arms) if arms is not None else (
            [a for a in STUDY_ARMS[study] if a in on_disk] + [a for a in on_disk if a not in STUDY_ARMS[study]])
        cell_arms = list(dict.fromkeys([*cell_arms, *run_arms]))
        analysis = analyze_cell(records, run_arms)
        analysed.append((cell, analysis))
        for k, v in speed_from_environment(cell.folder(out_dir)).items():
            speed[f"{cell.subdir + '/' if cell.subdir else ''}{k}"] = v
        made = _cell_figures(cell, cells, records, run_arms, analysis, study, out_dir, name)
        figures.update({k: v for k, v in made.items() if v is not None})
    arms = cell_arms
    seeds = sorted({s for _, a in analysed for arm in a["arms"].values() for s in arm["seeds"]})
    if study in ("scaling", "decay"):
        rows = [(c.value, a["comparisons"].get("stiefel - adamw")) for c, a in analysed]
        xlabel = "training images per run" if study == "scaling" else "weight decay"
        p = plot_gap_sweep(rows, out_dir / f"gap_vs_{'size' if study == 'scaling' else 'decay'}.png", xlabel=xlabel,
                           title=f"{name}: paired gap against {xlabel}", logx=study == "scaling")
        if p is not None:
            figures = {f"Paired gap (stiefel − adamw) against {xlabel}, mean ± 95% CI, dots: seeds": p, **figures}

    title = f"ViT on {name}: {study} study (Stiefel W_Q/W_K vs AdamW)"
    lines = [f"# {title}", "", _dataset_paragraph(config, n_train_full, n_test), "", _setup_paragraph(config), "",
             "Arms: " + "; ".join(f"`{a}`" + (f" ({INGREDIENTS[a]})" if a in INGREDIENTS else "") for a in arms)
             + f". Seeds: {', '.join(map(str, seeds))}.", ""]
    if config.sgd_frame_lr is not None and "stiefel-sgd" in arms:
        lines += [f"The `stiefel-sgd` arm's frames use lr {config.sgd_frame_lr:g} (`--sgd-frame-lr`).", ""]
    lines += _paper_lines(study, analysed, config)
    if study in ("scaling", "decay"):
        key = "training images" if study == "scaling" else "weight decay"
        lines += [f"## Gap against {key}", "", f"| {key} | pairs | stiefel (mean) | adamw (mean) | mean Δ (pp) "
                  f"| 95% CI (pp) | paired t | p | positive |", "|---|---|---|---|---|---|---|---|---|"]
        for c, a in analysed:
            cmp = a["comparisons"].get("stiefel - adamw")
            if cmp is None:
                continue
            st, ad = a["arms"]["stiefel"]["final_test_acc"], a["arms"]["adamw"]["final_test_acc"]
            lines.append(f"| {c.value:g} | {cmp['n']} | {fmt_pp(st['mean'], sign=False)}% "
                         f"| {fmt_pp(ad['mean'], sign=False)}% | {fmt_pp(cmp['mean'])} "
                         f"| [{fmt_pp(cmp['ci_low'])}, {fmt_pp(cmp['ci_high'])}] | {fmt_num(cmp['t'])} "
                         f"| {fmt_p(cmp['p_value'])} | {cmp['n_positive']}/{cmp['n']} |")
        lines.append("")
    for c, a in analysed:
        lines += [f"## Results{' — ' + c.label if c.sweep else ''}", ""] + _cell_sections(a, c.config, study)
        for pair, mv in a["movement"].items():
            for x, label in (("ratio_q", "W_Q"), ("ratio_k", "W_K")):
                r = mv.get(x)
                if r:
                    lines.append(f"- per-step movement ratio {pair}, {label}: {r['min']:.1f}–{r['max']:.1f}× "
                                 f"(median {r['median']:.1f}×, {r['n']} windows; per-seed means "
                                 f"{r['per_seed_range'][0]:.1f}–{r['per_seed_range'][1]:.1f}×)")
        lines.append("")
    lines += figure_lines({k: os.path.relpath(v, out_dir) for k, v in figures.items()})
    lines += run_lines(run_info_from_records(out_dir, speed))
    lines += ["## Configuration", "", "```json", json.dumps(to_dict(config), indent=2), "```", "",
              "## Notes", ""] + [f"- {n}" for n in NOTES] + [""]
    summary = {"title": title, "dataset": config.dataset, "dataset_name": name, "study": study, "arms": list(arms),
               "seeds": list(seeds), "config": to_dict(config), "paper": to_dict(PAPER),
               "cells": [{"label": c.label, "subdir": c.subdir, "sweep": c.sweep, "value": c.value,
                          "config": to_dict(c.config), **a} for c, a in analysed],
               "speed": speed, "figures": {k: os.path.relpath(v, out_dir) for k, v in figures.items()}}
    summary_path = out_dir / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    report_path = write_text(out_dir / "report.md", "\n".join(lines))
    return StudyOutputs(results=tuple(results), summary=summary, summary_path=summary_path, report_path=report_path,
                        figures=figures)


# ---------------------------------------------------------------------------------------------- running
def recorded_cells(out_dir: str | os.PathLike, study: str) -> list[Cell]:
    """The cells of a study folder, with the configs their runs were trained with (``--report-only``)."""
    from ..harness.run_folder import CONFIG_FILE

    out_dir = Path(out_dir)
    sweep = {"scaling": ("train_size", "size-"), "decay": ("weight_decay", "wd-")}.get(study)
    folders = [out_dir] if sweep is None else sorted(
        (p for p in out_dir.glob(f"{sweep[1]}*") if p.is_dir()), key=lambda p: float(p.name[len(sweep[1]):]))
    cells = []
    for folder in folders:
        specs = [json.loads(p.read_text()) for p in run_paths(folder, CONFIG_FILE)]
        base = [s for s in specs if s["arm"] != "stiefel-sgd"] or specs  # stiefel-sgd may carry its own frame lr
        if not base:
            continue
        config = config_from_dict(VisionConfig, base[0]["config"])
        if sweep is None:
            cells.append(Cell(config))
        else:
            value = config.train_size if sweep[0] == "train_size" else config.optim.weight_decay
            cells.append(Cell(config, folder.name, sweep[0], float(value)))
    if not cells:
        raise UsageError(f"--out {out_dir}: holds no runs of a {study} study (runs/<arm>/seed<k>/config.json"
                         f"{'' if sweep is None else ' under ' + sweep[1] + '*/'}); check --out and --study, or train "
                         f"the study first, without --report-only.")
    return cells


def run_vision(config: VisionConfig, out_dir: str | os.PathLike, *, study: str = "paired",
               arms: Sequence[str] | None = None, seeds: Sequence[int] = tuple(range(12)),
               train_sizes: Sequence[float] = (0.1, 0.25, 0.5, 1.0),
               weight_decays: Sequence[float] = (0.0, 0.05, 0.5), data_dir: str | os.PathLike = "data",
               download: bool = False, options: RunOptions | None = None, report_only: bool = False,
               skip_report: bool = False, command: str | None = None, **run_kwargs: Any) -> StudyOutputs:
    """Run (or resume) every (cell, arm, seed) of ``study`` and write the report; returns
    :class:`~.study.StudyOutputs` (without a summary when ``skip_report``). ``arms=None`` takes
    :data:`STUDY_ARMS` ``[study]``. ``report_only``: train nothing, rebuild the report from the records of
    every cell on disk (``arms``/``seeds`` ``None``: every one on disk). ``command`` is recorded in
    ``out_dir/study.json``. ``options`` (:class:`~.jobs.RunOptions`) says how to run; its fields may also be
    given by keyword."""
    from ..harness.arms import get_arm
    from ..harness.study import run_cells

    if report_only:
        return finalize_vision(out_dir, study, recorded_cells(out_dir, study), arms, seeds)
    arms = list(STUDY_ARMS[study] if not arms else arms)
    for a in arms:
        get_arm(a, "vision")
    data_dir = str(data_dir)
    load_vision(config.dataset, data_dir, download=download)  # fails early, names --data-dir/--download
    cells = study_cells(study, config, train_sizes=train_sizes, weight_decays=weight_decays,
                        n_train=DATASET_SIZES[config.dataset][0])
    results = run_cells(cells, functools.partial(build_task, data_dir=data_dir), out_dir, arms=arms, seeds=seeds,
                        arm_config=arm_config, command=command, options=RunOptions.of(options, **run_kwargs))
    if skip_report:
        return StudyOutputs(results=tuple(results))
    return finalize_vision(out_dir, study, cells, arms, seeds, results=results)


# ---------------------------------------------------------------------------------------------- CLI
#: the defaults of ``--train-sizes`` (``--study scaling``) and ``--weight-decays`` (``--study decay``)
SWEEP_DEFAULTS = {"train_sizes": [0.1, 0.25, 0.5, 1.0], "weight_decays": [0.0, 0.05, 0.5]}


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, e.g. 0.1,0.5, got {text!r}") from None


def _none_or_int(text: str) -> int | None:
    try:
        return None if text.lower() in ("none", "all") else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or all, got {text!r}") from None


def _task_arguments(parser: argparse.ArgumentParser, d: VisionConfig) -> None:
    g = parser.add_argument_group("data")
    g.add_argument("--dataset", default=d.dataset,
                   help="cifar10 (the paper's), fashion-mnist (Debian's dataset-fashion-mnist, or torchvision), "
                        "digits (scikit-learn, for smoke tests); default cifar10")
    g.add_argument("--data-dir", default="data",
                   help="folder holding the data set in torchvision's layout (default ./data)")
    g.add_argument("--download", action="store_true", help="let torchvision download missing files (internet)")
    g.add_argument("--train-size", type=_none_or_int, default=d.train_size, metavar="N",
                   help="training images per run, drawn per seed (default: all)")
    g.add_argument("--augment", action="store_true", help="random crop (pad 4) and horizontal flip (default off)")
    g.add_argument("--eval-train-size", type=_none_or_int, default=d.eval_train_size, metavar="N",
                   help=f"training images evaluated for train_acc (default {d.eval_train_size}; 'all')")
    g = parser.add_argument_group("study")
    g.add_argument("--study", choices=STUDIES, default=None,
                   help="which study (default paired; with --report-only: the one recorded in --out/study.json)")
    g.add_argument("--train-sizes", type=_floats, default=list(SWEEP_DEFAULTS["train_sizes"]),
                   help="scaling: training-set sizes, fractions <= 1 of --train-size (or of all) or counts, "
                        "comma-separated (default 0.1,0.25,0.5,1)")
    g.add_argument("--weight-decays", type=_floats, default=list(SWEEP_DEFAULTS["weight_decays"]),
                   help="decay: weight decays, comma-separated (default 0,0.05,0.5)")
    g.add_argument("--sgd-frame-lr", type=float, default=d.sgd_frame_lr,
                   help="ablation: frame lr of the stiefel-sgd arm (default: the frame lr)")
    g = parser.add_argument_group("model")
    g.add_argument("--patch-size", type=int, default=d.patch_size, help=f"patch side (default {d.patch_size})")
    g.add_argument("--width", type=int, default=d.width, help=f"model width (default {d.width})")
    g.add_argument("--depth", type=int, default=d.depth, help=f"layers (default {d.depth})")
    g.add_argument("--heads", type=int, default=d.heads, help=f"attention heads (default {d.heads})")
    g.add_argument("--mlp", type=int, default=d.mlp, help=f"MLP hidden width (default {d.mlp})")
    g.add_argument("--pool", choices=("cls", "mean"), default=d.pool, help="class token or mean pooling")
    g = parser.add_argument_group("training")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help=f"minibatch size (default {d.batch_size})")
    g.add_argument("--lr-schedule", choices=("cosine", "constant"), default=d.lr_schedule,
                   help="warm-up + cosine decay, or constant (default cosine)")
    g.add_argument("--warmup-fraction", type=float, default=d.warmup_fraction,
                   help=f"share of the steps spent warming up (default {d.warmup_fraction})")
    g.add_argument("--amp", choices=("none", "bf16"), default="none", help="mixed precision: bf16 autocast of the forward on the run's device (CPU or CUDA)")


def config_from_args(args: argparse.Namespace) -> VisionConfig:
    from ..harness.cli_args import optim_config_from_args, train_config_from_args

    return VisionConfig(dataset=args.dataset, train_size=args.train_size, patch_size=args.patch_size,
                        width=args.width, depth=args.depth, heads=args.heads, mlp=args.mlp, pool=args.pool,
                        batch_size=args.batch_size, augment=args.augment, lr_schedule=args.lr_schedule,
                        warmup_fraction=args.warmup_fraction, eval_train_size=args.eval_train_size,
                        amp=None if args.amp == "none" else args.amp, sgd_frame_lr=args.sgd_frame_lr,
                        train=train_config_from_args(args), optim=optim_config_from_args(args))


def _recorded_study(out: str) -> str | None:
    """The ``--study`` of the last command recorded in ``out/study.json``, if any."""
    import shlex

    from ..harness.study import recorded_commands

    for command in reversed(recorded_commands(out)):
        words = shlex.split(command)
        if "--study" in words[:-1]:
            return words[words.index("--study") + 1]
    return None


def _study_of(args: argparse.Namespace) -> str:
    """The study a command trains or reports: ``--study``, else (``--report-only``) the recorded one, else paired."""
    return args.study or (_recorded_study(args.out) if args.report_only else None) or "paired"


class VisionCommand(StudyCommand):
    """The ``python -m experiments vision`` command: flags -> :class:`VisionConfig` -> :func:`run_vision` (the study,
    the data's place and its sweep from ``--study``, ``--data-dir``, ``--train-sizes``, ``--weight-decays``)."""

    name = "vision"
    config_type = VisionConfig
    arms = ()
    seeds = tuple(range(12))
    report_only_flags = frozenset({"study", "data_dir", "download"})
    errors = (DatasetNotFoundError, DatasetFormatError)
    arms_help = ("arms to run (default: the study's: " + "; ".join(f"{k}: {' '.join(v)}" for k, v in STUDY_ARMS.items())
                 + ")")

    def task_arguments(self, parser: argparse.ArgumentParser, default: VisionConfig) -> None:
        _task_arguments(parser, default)

    def config_from_args(self, args: argparse.Namespace) -> VisionConfig:
        return config_from_args(args)

    def config_for_report(self, args: argparse.Namespace) -> VisionConfig:
        """``--report-only`` reads the study, the data's place, from its flags."""
        return build_config(config_from_args, args)

    def check(self, args: argparse.Namespace) -> None:
        """Refuse a sweep flag of a study that does not sweep it, and ``--sgd-frame-lr`` without the ``stiefel-sgd``
        arm: each would be ignored."""
        if args.report_only:  # the note on ignored flags covers them
            return
        study = _study_of(args)
        for flag, dest, sweeping in (("--train-sizes", "train_sizes", "scaling"),
                                     ("--weight-decays", "weight_decays", "decay")):
            if study != sweeping and list(getattr(args, dest)) != SWEEP_DEFAULTS[dest]:
                raise UsageError(f"{flag} is the sweep of --study {sweeping}; --study {study} does not read it: "
                                 f"pass --study {sweeping}, or drop {flag}.")
        if args.dataset == "digits" and (args.data_dir != "data" or args.download):
            given = " and ".join(f for f, on in (("--data-dir", args.data_dir != "data"), ("--download", args.download))
                                 if on)
            raise UsageError(f"{given}: --dataset digits is scikit-learn's, loaded from the package, not from a "
                             f"folder; drop {given}, or pass --dataset fashion-mnist or cifar10.")
        arms = args.arms or STUDY_ARMS[study]
        if args.sgd_frame_lr is not None and "stiefel-sgd" not in arms:
            raise UsageError(f"--sgd-frame-lr sets the stiefel-sgd arm's frame lr, but the arms to run "
                             f"({' '.join(arms)}) have no stiefel-sgd: add it to --arms (or pass --study ablation), "
                             f"or drop --sgd-frame-lr.")

    def prepare(self, config: VisionConfig, args: argparse.Namespace) -> VisionConfig:
        """Check the sweep's values before anything is loaded or written."""
        study_cells(_study_of(args), config, train_sizes=args.train_sizes, weight_decays=args.weight_decays,
                    n_train=DATASET_SIZES[config.dataset][0])
        return config

    def modules(self, config: VisionConfig, args: argparse.Namespace) -> list[str]:
        return ["sklearn" if config.dataset == "digits" else "torchvision"]

    def train(self, config: VisionConfig, args: argparse.Namespace, *, arms, seeds, **kwargs) -> StudyOutputs:
        return run_vision(config, args.out, study=_study_of(args), arms=arms, seeds=seeds,
                          train_sizes=args.train_sizes, weight_decays=args.weight_decays, data_dir=args.data_dir,
                          download=args.download, report_only=args.report_only, skip_report=args.skip_report,
                          **kwargs)

    def header(self, config: VisionConfig, args: argparse.Namespace, outputs: StudyOutputs) -> str:
        name = config.display_name if outputs.summary is None else outputs.summary["dataset_name"]
        return f"vision ({name}, study {_study_of(args)})"

    def summary_lines(self, summary: dict) -> list[str]:
        lines = []
        for cell in summary.get("cells", []):
            prefix = f"[{cell['label']}] " if cell["sweep"] else ""
            for arm, a in cell["arms"].items():
                f = a["final_test_acc"]
                sd = "" if f.get("std") is None else f" ± {100 * f['std']:.2f}"
                lines.append(f"{prefix}{arm:<22} final test acc {100 * f['mean']:.2f}%{sd} over {len(a['seeds'])} seed(s)")
            for name, c in cell["comparisons"].items():
                t = "–" if c["t"] is None else f"{c['t']:.2f}"
                p = "–" if c["p_value"] is None else f"{c['p_value']:.2g}"
                lines.append(f"{prefix}{name:<34} {100 * c['mean']:+.2f} pp, t = {t}, p = {p}, "
                             f"{c['n_positive']}/{c['n']} positive")
            for name, mv in cell["movement"].items():
                r = mv.get("ratio_q")
                if r:
                    lines.append(f"{prefix}per-step movement {name} (W_Q): {r['min']:.1f}–{r['max']:.1f}x, "
                                 f"median {r['median']:.1f}x")
        return lines


#: The ``python -m experiments vision`` command.
STUDY = VisionCommand()
add_arguments = STUDY.add_arguments
run = STUDY.run

