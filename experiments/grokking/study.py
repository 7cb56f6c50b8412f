r"""The modular-arithmetic grokking study: ``python -m experiments grokking``.

Task: learn :math:`(a \circ b) \bmod p` from a random ``train_fraction`` of all pairs
(:mod:`.data.modular`; tokens ``[a, op, b, =]``, the answer predicted at the last position) with full-batch
training of a :class:`~geoopt_stiefel_attention.TinyTransformer` (default: 1 layer, width 128, 4 heads,
MLP 512), AdamW lr 1e-3, betas (0.9, 0.98), weight decay 1.0 on the Euclidean matrices, 20,000 epochs. The
``stiefel`` arm keeps W_Q, W_K on the Stiefel manifold and trains them with
:class:`~geoopt_stiefel_attention.StiefelAdam` (lr ``frame_lr``, default the same lr); the ``adamw`` arm is
the all-Euclidean baseline. The same seed gives both arms the same split and the same initial weights
(the Stiefel frames are the polar factors of the Euclidean arm's W_Q, W_K).

The paper reports 97.0% (Stiefel) against 61.1% (AdamW) validation accuracy at epoch 20,000, one run
each, and calls the endpoint unstable; this study reruns it over several seeds.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

from ..harness import ablation_arms  # noqa: F401  (registers the frozen, orthostart and ablation arms)
from ..harness.arms import Arm
from ..harness.batches import FullBatch
from ..harness.command import StudyCommand
from ..harness.config import OptimConfig, RunSpec, TrainConfig, require
from ..harness.metrics import QKGeometry, WeightNorms
from ..harness.report import PaperReference
from ..harness.runner import RunOptions, Task
from ..harness.study import StudyOutputs, finalize_study, run_study
from .data import canonical_operation, is_prime, modular_split

__all__ = ["GrokkingConfig", "build_task", "run_grokking", "PAPER", "HELP", "STUDY", "add_arguments", "run"]

HELP = "Modular-arithmetic grokking: Stiefel W_Q/W_K (StiefelAdam) vs AdamW over seeds; records, plots, report."

#: The paper's numbers: validation accuracy at epoch 20,000, one run per arm.
PAPER = PaperReference(
    source="R. D. Guerrero, \"Stiefel Attention\", arXiv, Sep 2026",
    epoch=20000,
    values={"stiefel": 0.970, "adamw": 0.611},
    note="One run per arm; the author calls the endpoint unstable and reads it as evidence for the mechanism, "
         "not as an effect size.",
    protocol={"p": 97, "operation": "+", "train_fraction": 0.3, "train.epochs": 20000},
)


@dataclass(frozen=True)
class GrokkingConfig:
    """Configuration of the grokking study (task, model, schedule, optimizer).

    The vocabulary (``p + 2``) and the sequence length (4) follow from ``p`` and the encoding; they are
    not fields. ``fast_forward`` evaluates the last block at the last position only
    (:func:`last_position_fast`, verified against the full forward when the model is built).
    """

    experiment: str = "grokking"
    p: int = 97
    operation: str = "+"
    train_fraction: float = 0.3
    width: int = 128
    depth: int = 1
    heads: int = 4
    mlp: int = 512
    fast_forward: bool = True
    train: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=20000, eval_every=100))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, betas=(0.9, 0.98), weight_decay=1.0))

    def __post_init__(self) -> None:
        object.__setattr__(self, "operation", canonical_operation(self.operation))
        require(isinstance(self.p, int) and self.p >= 2, f"--p {self.p!r}: the modulus must be an int >= 2.")
        require(self.operation != "/" or is_prime(self.p),
                f"--operation /: needs a prime --p, got --p {self.p}.")
        require(isinstance(self.train_fraction, float | int) and 0 < self.train_fraction < 1,
                f"--train-fraction {self.train_fraction!r}: must be in (0, 1), e.g. 0.3.")
        for name in ("width", "depth", "heads", "mlp"):
            v = getattr(self, name)
            require(isinstance(v, int) and v > 0, f"--{name} {v!r}: must be a positive int.")
        require(self.width % self.heads == 0,
                f"--width {self.width} must be divisible by --heads {self.heads}.")
        require(isinstance(self.fast_forward, bool), f"fast_forward={self.fast_forward!r} must be a bool (--no-fast-forward).")
        require(isinstance(self.train, TrainConfig), "GrokkingConfig.train must be a TrainConfig.")
        require(isinstance(self.optim, OptimConfig), "GrokkingConfig.optim must be an OptimConfig.")


#: Largest entry-wise gap accepted between :func:`last_position_fast` and :func:`last_position` (float32
#: logits of order one; the two differ only by the rounding of differently shaped matrix products).
FAST_PATH_TOLERANCE = 1e-4


def last_position(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Logits at the last position (the ``=`` token), ``(B, vocab)``: ``model(tokens)[:, -1]``."""
    return model(tokens)[:, -1, :]


def last_position_fast(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    r"""The same logits as :func:`last_position`, computing only what the last position needs.

    In the last pre-LayerNorm block only the last position's output is read, so its query, attention
    output, MLP, final norm and unembedding are evaluated at that position alone (keys and values still
    come from every position; the last position attends to all of them, so no causal mask is needed):

    .. math:: x_T' = x_T + \mathrm{Attn}(\mathrm{LN}(x)_T, \mathrm{LN}(x), \mathrm{LN}(x)), \qquad
              \text{logits} = \mathrm{LN}\big(x_T' + \mathrm{MLP}(\mathrm{LN}(x_T'))\big)\, U.

    It is the same function of the weights (so the same gradients) at about a third of the cost for
    ``T = 4``. It reads :class:`~geoopt_stiefel_attention.TinyTransformer`'s submodules, so
    :func:`build_task` checks it against :func:`last_position` on every new model and falls back to the
    latter (with a warning) if they disagree by more than :data:`FAST_PATH_TOLERANCE`.
    """
    t = tokens.shape[1]
    x = model.token_embedding(tokens) + model.position_embedding[:t]
    for block in model.blocks[:-1]:
        x = block(x, causal=True)
    last = model.blocks[-1]
    h = last.norm1(x)
    x = x[:, -1:] + last.attn(h[:, -1:], h, h, need_weights=False)[0]
    x = x + last.mlp(last.norm2(x))
    return model.unembed(model.final_norm(x))[:, 0]


def _choose_predict(model: torch.nn.Module, sample: torch.Tensor):
    """:func:`last_position_fast` when it reproduces :func:`last_position` on ``sample``, else the latter."""
    import warnings

    try:
        with torch.no_grad():
            gap = float((last_position_fast(model, sample) - last_position(model, sample)).abs().max())
    except (AttributeError, TypeError, RuntimeError, ValueError) as err:
        gap, reason = float("inf"), f"it failed ({err})"
    else:
        reason = f"it differs from model(tokens)[:, -1] by {gap:.3g}"
    if gap <= FAST_PATH_TOLERANCE:
        return last_position_fast
    warnings.warn(f"grokking: the last-position fast path is off because {reason}; training uses the full "
                  f"forward (about 3x slower). Results are unaffected.", RuntimeWarning, stacklevel=3)
    return last_position


def build_task(spec: RunSpec, arm: Arm, device: torch.device) -> Task:
    """The grokking task of one run: the seed's split (full batch) and a TinyTransformer with the arm's
    attention, built from the seed."""
    from geoopt_stiefel_attention.models import TinyTransformer
    from geoopt_stiefel_attention.nn import param_groups, query_key_projections

    cfg: GrokkingConfig = spec.config
    split = modular_split(cfg.p, cfg.operation, cfg.train_fraction, spec.seed)
    model = TinyTransformer(split.vocab_size, split.seq_len, width=cfg.width, depth=cfg.depth, heads=cfg.heads,
                            mlp=cfg.mlp, attention=arm.attention, seed=spec.seed)
    train = FullBatch(split.train_inputs.to(device), split.train_targets.to(device))
    val = FullBatch(split.val_inputs.to(device), split.val_targets.to(device))
    predict = _choose_predict(model, split.train_inputs[:64]) if cfg.fast_forward else last_position
    return Task(model=model, train_data=train, eval_data={"train": train, "val": val}, predict=predict,
                param_groups=param_groups, hooks=(WeightNorms(), QKGeometry(query_key_projections)))


def _intro(config: GrokkingConfig) -> str:
    return (f"Task: (a {config.operation} b) mod {config.p}, train fraction {config.train_fraction}, full batch. "
            f"TinyTransformer {config.depth} layer(s), width {config.width}, {config.heads} heads, MLP {config.mlp}. "
            f"AdamW lr {config.optim.lr:g}, betas {config.optim.betas}, weight decay {config.optim.weight_decay:g} on "
            f"the Euclidean matrices; frames lr {config.optim.effective_frame_lr:g}, no weight decay. "
            f"{config.train.epochs} epochs, evaluated every {config.train.eval_every}. Each seed gives every arm the "
            f"same split and the same initial weights.")


NOTES = (
    "The paper's numbers are one run per arm at epoch 20,000 and, in the author's words, an unstable endpoint; "
    "compare them with the spread over seeds here, not with the mean alone.",
    "'First epoch ≥ 95%' is resolved to the evaluation interval.",
    "Movement ‖W_Q − W_Q0‖_F compares matrices of different scale across arms (frames have ‖W‖_F = √(heads·r)); "
    "the principal angles are scale-free.",
)


def run_grokking(config: GrokkingConfig, out_dir, *, arms=("adamw", "stiefel"), seeds=(0,),
                 options: RunOptions | None = None, report_only: bool = False, skip_report: bool = False,
                 command: str | None = None, **run_kwargs) -> StudyOutputs:
    """Run (or resume) the study and write ``summary.json``, ``report.md`` and the PNG figures into
    ``out_dir``; returns :class:`~.study.StudyOutputs` (without a summary when ``skip_report``). With
    ``report_only`` nothing is trained and the report is rebuilt from the records (``arms``/``seeds`` ``None``:
    every arm and seed on disk). ``command`` is recorded in ``out_dir/study.json`` and shown in the report.
    ``options`` (:class:`~.runner.RunOptions`) says how to run; its fields may also be given by keyword."""
    kwargs = dict(title=f"Grokking on (a {config.operation} b) mod {config.p}: Stiefel W_Q/W_K vs AdamW",
                  intro=_intro(config), paper=PAPER, notes=NOTES)
    if report_only:
        return finalize_study(out_dir, config=config, arms=None if arms is None else list(arms),
                              seeds=None if seeds is None else list(seeds), **kwargs)
    return run_study(config, build_task, out_dir, arms=list(arms), seeds=list(seeds),
                     options=RunOptions.of(options, **run_kwargs), skip_report=skip_report, command=command, **kwargs)


# ---------------------------------------------------------------------------------------------- CLI
def _task_arguments(parser: argparse.ArgumentParser, d: GrokkingConfig) -> None:
    g = parser.add_argument_group("task and model")
    g.add_argument("--p", type=int, default=d.p, help=f"modulus (default {d.p})")
    g.add_argument("--operation", default=d.operation, help="+ - * / (or add sub mul div; default +)")
    g.add_argument("--train-fraction", type=float, default=d.train_fraction,
                   help=f"share of all pairs used for training (default {d.train_fraction})")
    g.add_argument("--width", type=int, default=d.width, help=f"model width (default {d.width})")
    g.add_argument("--depth", type=int, default=d.depth, help=f"layers (default {d.depth})")
    g.add_argument("--heads", type=int, default=d.heads, help=f"attention heads (default {d.heads})")
    g.add_argument("--mlp", type=int, default=d.mlp, help=f"MLP hidden width (default {d.mlp})")
    g.add_argument("--no-fast-forward", dest="fast_forward", action="store_false",
                   help="run the full forward at every position (default: last block at the last position only)")


def config_from_args(args: argparse.Namespace) -> GrokkingConfig:
    from ..harness.cli_args import optim_config_from_args, train_config_from_args

    return GrokkingConfig(p=args.p, operation=args.operation, train_fraction=args.train_fraction, width=args.width,
                          depth=args.depth, heads=args.heads, mlp=args.mlp,
                          fast_forward=args.fast_forward, train=train_config_from_args(args),
                          optim=optim_config_from_args(args))


class GrokkingCommand(StudyCommand):
    """The ``python -m experiments grokking`` command: flags -> :class:`GrokkingConfig` -> :func:`run_grokking`."""

    name = "grokking"
    config_type = GrokkingConfig
    arms = ("adamw", "stiefel")
    seeds = (0,)

    def task_arguments(self, parser: argparse.ArgumentParser, default: GrokkingConfig) -> None:
        _task_arguments(parser, default)

    def config_from_args(self, args: argparse.Namespace) -> GrokkingConfig:
        return config_from_args(args)

    def train(self, config: GrokkingConfig, args: argparse.Namespace, **kwargs) -> StudyOutputs:
        return run_grokking(config, args.out, report_only=args.report_only, skip_report=args.skip_report, **kwargs)

    def result_line(self, r, config: GrokkingConfig) -> str:
        rate = "" if r.epochs_per_second is None else f", {r.epochs_per_second:.2f} epochs/s"
        acc = (r.final_record or {}).get("val_acc")
        return f"{r.name}: epoch {r.epoch}{rate}" + ("" if acc is None else f", val acc {100 * acc:.1f}%")

    def summary_lines(self, summary: dict) -> list[str]:
        lines = []
        for arm, s in summary["summary"]["arms"].items():
            fin = s["final"]
            std = "" if fin["std"] is None else f" ± {100 * fin['std']:.1f}"
            lines.append(f"{arm:<14} final val acc {100 * fin['mean']:.1f}%{std} over seeds {s['seeds']}; "
                         f"reached 95% in {s['first_epoch_reaching']['n_reached']}/{s['first_epoch_reaching']['n']}; "
                         f"stays ≥95% (last 10%): {s['stays_above']['fraction']:.2f}")
        return lines


#: The ``python -m experiments grokking`` command.
STUDY = GrokkingCommand()
add_arguments = STUDY.add_arguments
run = STUDY.run
