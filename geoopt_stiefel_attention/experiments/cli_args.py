"""Command-line flags shared by the study subcommands, mapped onto the frozen configs.

A study calls :func:`add_schedule_arguments` and :func:`add_optim_arguments` with its default
:class:`TrainConfig`/:class:`OptimConfig` (so ``--help`` shows the study's defaults), and
:func:`add_runner_arguments` for how to run; :func:`train_config_from_args` and
:func:`optim_config_from_args` build the configs back from the parsed namespace.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .config import OptimConfig, TrainConfig

__all__ = ["add_schedule_arguments", "add_optim_arguments", "add_runner_arguments", "train_config_from_args",
           "optim_config_from_args"]


def _none_or_float(text: str) -> float | None:
    return None if text.lower() in ("none", "off") else float(text)


def add_schedule_arguments(parser: argparse.ArgumentParser, default: TrainConfig) -> None:
    """``--epochs`` and ``--eval-every``."""
    parser.add_argument("--epochs", type=int, default=default.epochs,
                        help=f"training epochs (default {default.epochs})")
    parser.add_argument("--eval-every", type=int, default=default.eval_every,
                        help=f"evaluate and write a record every this many epochs (default {default.eval_every})")


def add_optim_arguments(parser: argparse.ArgumentParser, default: OptimConfig) -> None:
    """``--lr``, ``--frame-lr``, ``--betas``, ``--eps``, ``--weight-decay``, ``--trust-region``, ``--momentum``."""
    g = parser.add_argument_group("optimizer")
    g.add_argument("--lr", type=float, default=default.lr, help=f"learning rate (default {default.lr:g})")
    g.add_argument("--frame-lr", type=float, default=default.frame_lr,
                   help="learning rate of the Stiefel frames (default: --lr)")
    g.add_argument("--betas", type=float, nargs=2, default=list(default.betas), metavar=("BETA1", "BETA2"),
                   help=f"Adam betas (default {default.betas[0]:g} {default.betas[1]:g})")
    g.add_argument("--eps", type=float, default=default.eps, help=f"Adam epsilon (default {default.eps:g})")
    g.add_argument("--weight-decay", type=float, default=default.weight_decay,
                   help=f"decoupled weight decay of the Euclidean matrices (default {default.weight_decay:g}); "
                        f"frames get none")
    g.add_argument("--trust-region", type=_none_or_float, default=default.trust_region,
                   help=f"StiefelAdam's per-frame step cap, or 'none' (default {default.trust_region})")
    g.add_argument("--momentum", type=float, default=default.momentum,
                   help=f"momentum of the geoopt-rsgd arm (default {default.momentum:g})")


def add_runner_arguments(parser: argparse.ArgumentParser, *, arms: Sequence[str], seeds: Sequence[int],
                         out: str) -> None:
    """``--arms``, ``--seeds``, ``--out``, ``--workers``, ``--device``, ``--threads``, ``--quiet``,
    ``--report-only``, ``--skip-report``, ``--stop-after-epochs``, ``--checkpoint-interval``."""
    from .arms import ARMS

    g = parser.add_argument_group("running")
    g.add_argument("--arms", nargs="+", default=list(arms),
                   help=f"arms to run (default {' '.join(arms)}; registered: {', '.join(sorted(ARMS))})")
    g.add_argument("--seeds", nargs="+", type=int, default=list(seeds),
                   help=f"seeds; each fixes the data split/order and the initial weights (default "
                        f"{' '.join(map(str, seeds))})")
    g.add_argument("--out", default=out, help=f"output folder (default {out}); rerunning resumes")
    g.add_argument("--workers", type=int, default=1, help="(arm, seed) runs in parallel processes (default 1)")
    g.add_argument("--device", default="auto", help="auto (CUDA when present, else CPU), cpu, cuda, cuda:N")
    g.add_argument("--threads", type=int, default=None,
                   help="torch threads per run (default: torch's choice for --workers 1, else cpus // workers)")
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    g.add_argument("--report-only", action="store_true",
                   help="train nothing: rebuild summary.json, the plots and report.md from the records in --out")
    g.add_argument("--skip-report", action="store_true",
                   help="train only; build summary.json, the plots and report.md later with --report-only")
    g.add_argument("--stop-after-epochs", type=int, default=None, metavar="N",
                   help="train at most N epochs per run in this call, then checkpoint and stop (rerun to resume)")
    g.add_argument("--checkpoint-interval", type=float, default=30.0, metavar="SECONDS",
                   help="minimum seconds between checkpoints (default 30; one is always written at the end)")


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(epochs=args.epochs, eval_every=args.eval_every)


def optim_config_from_args(args: argparse.Namespace) -> OptimConfig:
    return OptimConfig(lr=args.lr, betas=tuple(args.betas), eps=args.eps, weight_decay=args.weight_decay,
                       frame_lr=args.frame_lr, trust_region=args.trust_region, momentum=args.momentum)


def invoked_command() -> str | None:
    """The command line that started this process, as ``stiefel-attention ...`` (recorded in reports)."""
    import shlex
    import sys

    return "stiefel-attention " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv else None
