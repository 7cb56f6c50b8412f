"""Reproducible experiments: one harness shared by every study, and the studies built on it.

- :mod:`.config`: frozen, validated configs (:class:`TrainConfig`, :class:`OptimConfig`, :class:`RunSpec`);
- :mod:`.arms`: the open registry of arms (``adamw``, ``stiefel``, ``geoopt-radam``, ``geoopt-rsgd``);
- :mod:`.runner`: the one training loop (:func:`train_run`); :mod:`.run_folder`: what a run's folder holds
  (config, environment, checkpoint, lock) and its checks; :mod:`.jobs`: the parallel job runner
  (:func:`run_jobs`) and how to run (:class:`RunOptions`);
- :mod:`.command`: the base class of every study command (:class:`~.command.StudyCommand`);
- :mod:`.metrics`: per-evaluation hooks (weight norms, movement and principal angles of W_Q, W_K);
- :mod:`.records`, :mod:`.plotting`, :mod:`.report`: JSON-lines records, summaries, seaborn figures,
  markdown reports;
- :mod:`.batches`: batch sources; each study's data sets live in its own folder
  (:mod:`experiments.grokking.data`, :mod:`experiments.vision.data`, :mod:`experiments.lm.data`).

Plotting libraries, pandas and tqdm are imported lazily, inside the functions that use them.

- :mod:`experiments.harness.study`: the study layer: sweep cells, the (cell, arm, seed) grid, summaries, paired statistics
  (:mod:`.stats`), figures (:mod:`.plotting`) and the markdown report (:mod:`.report`), shared by every study;
- the studies, beside the harness: :mod:`experiments.grokking`, :mod:`experiments.vision` (ViT on patches),
  :mod:`experiments.lm`.

Adding a study (the docs page "Experiments", section "Adding a study", walks through it): a study is a
config, its task builder, its arms and its report sections; the harness does the rest.

1. A frozen dataclass config with the fields ``experiment`` (str), ``train``
   (:class:`~.config.TrainConfig`), ``optim`` (:class:`~.config.OptimConfig`) and the study's own fields,
   validated in ``__post_init__`` with messages naming the flags.
2. A module-level ``build_task(spec, arm, device) -> Task``: build the model from ``spec.seed`` with
   ``arm.attention``, the data as batch sources (:class:`~.data.FullBatch`, or :class:`~.data.MiniBatches`
   seeded with ``spec.seed`` so that paired arms see the same order), the parameter grouping, and the metric
   hooks (:class:`~.metrics.WeightNorms`, :class:`~.metrics.QKGeometry`, or your own
   :class:`~.metrics.MetricHook`).
3. Its arms: the registered ones, or new ones with :func:`~.arms.register_arm`.
4. A ``run_<study>(config, out, *, arms, seeds, options, report_only, skip_report, command)`` calling
   :func:`~.study.run_study` (one cell) or :func:`~.study.run_cells` (a sweep of :class:`~.study.Cell`), and
   :func:`~.study.finalize_study` for the report: its sections are the title, intro, notes and the paper's
   figures as a :class:`~.report.PaperReference` with the ``protocol`` they were measured under. How to run
   is one :class:`~.jobs.RunOptions`.
5. The command: a subclass of :class:`~.command.StudyCommand` (class attributes ``name``, ``config_type``,
   default ``arms`` and ``seeds``; methods ``task_arguments``, ``config_from_args``, ``train`` and, where the
   study differs, ``check``, ``prepare``, ``config_for_report``, ``summary_lines``, ...), then
   ``STUDY = YourCommand()``, ``add_arguments = STUDY.add_arguments``, ``run = STUDY.run``, and the module
   listed in ``STUDIES`` of :mod:`experiments.cli`. :mod:`experiments.grokking.study` is the shortest complete
   example.
"""

from .arms import ARMS, Arm, OptimizerGroup, get_arm, register_arm
from .config import OptimConfig, RunSpec, TrainConfig, to_dict
from .jobs import RunOptions, run_jobs
from .metrics import MetricHook, QKGeometry, WeightNorms, principal_angles
from .runner import RunResult, Task, train_run

__all__ = ["ARMS", "Arm", "OptimizerGroup", "get_arm", "register_arm", "OptimConfig", "RunSpec", "TrainConfig",
           "to_dict", "MetricHook", "QKGeometry", "WeightNorms", "principal_angles", "RunOptions", "RunResult", "Task",
           "run_jobs", "train_run"]
