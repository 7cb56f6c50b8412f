"""``stiefel-attention bench``: what a :class:`~geoopt_stiefel_attention.StiefelAdam` step costs, measured
next to :class:`torch.optim.AdamW` and stock geoopt ``RiemannianAdam`` in the same process.

Three benchmarks, each returning frozen result objects (the CLI and ``benchmarks/*.py`` print them), and one
prepared accelerator check:

- :func:`step_time_benchmark`: the optimizer step alone on the query/key projections of transformer
  configurations (:data:`CONFIGS`: one frame per head, parameters shaped ``(heads, width, head_dim)``, two per
  layer), against ``AdamW(foreach=True)``, ``AdamW(fused=True)``, ``RiemannianAdam`` on
  ``geoopt.EuclideanStiefel()`` (QR retraction; optimizer ``"geoopt-radam"``, the name the studies and
  ``certify`` use too) and on ``geoopt.Stiefel()`` (canonical metric, Cayley retraction: a ``d x d`` solve
  per frame; optimizer ``"geoopt-radam-canonical"``), and the *matrix-product floor*: the six batched ``d x r x r``
  products a StiefelAdam step performs, run bare on tensors of the same shapes and batching.
- :func:`train_step_benchmark`: a full training step (forward, backward, optimizer) of
  :class:`~geoopt_stiefel_attention.TinyTransformer` and :class:`~geoopt_stiefel_attention.PatchViT`, the
  ``"stiefel"`` arm (Stiefel attention, StiefelAdam) against the ``"adamw"`` arm (Euclidean attention,
  ``torch.optim.AdamW``), both on :func:`~geoopt_stiefel_attention.param_groups`; optionally under
  ``torch.autocast``.
- :func:`step_path_benchmark`: the StiefelAdam step's own paths (default, ``capturable=True``,
  ``torch.compile(opt.step)``; row- and column-major frames) against the matrix-product floor, on the bench
  shape :data:`BENCH_FRAMES` and a grid of widths and ranks.
- :func:`accelerator_check` (``stiefel-attention bench gpu``, ``benchmarks/gpu.sh``): a few minutes on one
  GPU, all of the above at GPU sizes, written as JSON (``benchmarks/gpu.sh`` then adds the grokking study's
  epochs per second, which belong to the studies).

Words: what a benchmark times is an *optimizer* in ``step`` (``optimizers=``, ``--optimizers``; the floor is
timed as one), a *path* in ``paths`` (``paths=``, ``--paths``) and an *arm* in ``train``, where it is a study arm
(model preparation plus optimizer).

Protocol. What a benchmark times is interleaved: every round runs each entry for a few steps, in an order that
rotates from round to round, so slow drift of a shared machine hits all entries alike. Each step is timed on its
own; an entry's time is the median over all its steps, and a ratio is the median over rounds of the per-round ratio of
medians. ``clock="cpu"`` measures the process's CPU time instead of wall time: with one thread
(``threads=1``) it is not inflated when other processes take the core, the usual situation on a shared
machine. Timings are not assertions: nothing here decides pass or fail.

Layout, one module per job: ``settings`` (:class:`BenchSettings`, the interleaving protocol),
``records`` (timings, machine, provenance, JSON), ``step``, ``train``, ``paths`` (one benchmark each,
with its table), ``gpu`` (the accelerator check) and ``cli`` (``HELP``, ``add_arguments``, ``run``).
"""

from __future__ import annotations

# The public names only; a private helper is imported from the module that defines it (``bench.settings``,
# ``bench.step``, ...).
from .cli import HELP, add_arguments, run
from .gpu import CHECK_SCALES, accelerator_check, format_check
from .paths import (
    BENCH_FRAMES,
    GRID_RANKS,
    GRID_WIDTHS,
    GRIDS,
    STEP_PATHS,
    FrameSet,
    StepPathResult,
    format_path_table,
    path_frame_sets,
    step_path_benchmark,
)
from .records import (
    BENCH_FORMAT_VERSION,
    Machine,
    Timing,
    as_record,
    git_state,
    machine_info,
    provenance,
    read_provenance,
    to_json,
)
from .settings import (
    BENCH_DEFAULTS,
    CLOCKS,
    BenchSettings,
    torch_threads,
)
from .step import (
    CONFIGS,
    STEP_OPTIMIZERS,
    StepTimeResult,
    format_step_table,
    frame_shapes,
    step_time_benchmark,
)
from .train import (
    EXTRA_TRAIN_MODELS,
    TINY_TRAIN_SETTINGS,
    TRAIN_MODELS,
    TRAIN_SETTINGS,
    TrainStepResult,
    format_train_table,
    train_step_benchmark,
)

__all__ = [
    "BENCH_DEFAULTS", "BENCH_FORMAT_VERSION", "BENCH_FRAMES", "CHECK_SCALES", "CLOCKS", "CONFIGS",
    "EXTRA_TRAIN_MODELS", "GRIDS", "GRID_RANKS", "GRID_WIDTHS", "HELP", "STEP_OPTIMIZERS", "STEP_PATHS",
    "TINY_TRAIN_SETTINGS", "TRAIN_MODELS", "TRAIN_SETTINGS", "BenchSettings", "FrameSet", "Machine", "StepPathResult",
    "StepTimeResult", "Timing", "TrainStepResult", "accelerator_check", "add_arguments", "as_record", "format_check",
    "format_path_table", "format_step_table", "format_train_table", "frame_shapes", "git_state", "machine_info",
    "path_frame_sets", "provenance", "read_provenance", "run", "step_path_benchmark", "step_time_benchmark",
    "to_json", "torch_threads", "train_step_benchmark",
]
