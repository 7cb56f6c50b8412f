"""Command-line flags shared by the study subcommands, mapped onto the frozen configs.

A study calls :func:`add_schedule_arguments` and :func:`add_optim_arguments` with its default
:class:`TrainConfig`/:class:`OptimConfig` (so ``--help`` shows the study's defaults), and
:func:`add_runner_arguments` for how to run; :func:`train_config_from_args` and
:func:`optim_config_from_args` build the configs back from the parsed namespace.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from geoopt_stiefel_attention.argtypes import OneLineParser
from geoopt_stiefel_attention.optim import ADJUST_LR_FNS, trust_radius

from .config import OptimConfig, TrainConfig

__all__ = ["add_schedule_arguments", "add_optim_arguments", "add_runner_arguments", "train_config_from_args",
           "optim_config_from_args", "check_runner_args", "check_out_dir", "check_input_folder", "require_modules",
           "build_config",
           "invoked_command", "user_errors", "OneLineParser", "check_distinct",
           "check_seed_range"]


def _none_or_float(text: str) -> float | None:
    return None if text.lower() in ("none", "off") else float(text)


def _trust_region(text: str) -> float | str | None:
    """``--trust-region``: a float, ``auto`` (the library's default for the rule) or ``none``."""
    try:
        return "auto" if text.lower() == "auto" else _none_or_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, auto or none, got {text!r}") from None


def _trust_region_default(default: OptimConfig) -> float | str | None:
    """The ``--trust-region`` default of a study whose default config is ``default``: ``"auto"`` when its radius is
    the one ``auto`` stands for under its own rule, so that the radius follows ``--adjust-lr-fn`` (the config holds
    ``auto`` already resolved for its default rule: offered as that number, 0.1 of the paper's rule would silently
    cap every ``--adjust-lr-fn match_rms_adamw`` step at a tenth of that rule's own default radius, 1); any other
    default radius as it is."""
    return "auto" if default.trust_region == trust_radius("auto", default.adjust_lr_fn) else default.trust_region


def add_schedule_arguments(parser: argparse.ArgumentParser, default: TrainConfig) -> None:
    """``--epochs`` and ``--eval-every``."""
    parser.add_argument("--epochs", type=int, default=default.epochs,
                        help=f"training epochs (default {default.epochs})")
    parser.add_argument("--eval-every", type=int, default=default.eval_every,
                        help=f"evaluate and write a record every this many epochs (default {default.eval_every})")


def add_optim_arguments(parser: argparse.ArgumentParser, default: OptimConfig) -> None:
    """``--lr``, ``--frame-lr``, ``--betas``, ``--eps``, ``--weight-decay``, ``--trust-region``, ``--momentum``,
    ``--adjust-lr-fn``."""
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
    trust_default = _trust_region_default(default)
    g.add_argument("--trust-region", type=_trust_region, default=trust_default,
                   help=f"StiefelAdam's per-frame cap on ||s||_F in frame units, 'auto' (0.1 under "
                        f"--adjust-lr-fn original, 1 under match_rms_adamw) or 'none' (default {trust_default})")
    g.add_argument("--momentum", type=float, default=default.momentum,
                   help=f"momentum of the geoopt-rsgd arm (default {default.momentum:g})")
    g.add_argument("--adjust-lr-fn", choices=ADJUST_LR_FNS, default=default.adjust_lr_fn,
                   help="what the frames' lr measures under StiefelAdam: 'original' (a frame's step norm, the "
                        "paper's step) or 'match_rms_adamw' (a per-entry step, as for AdamW: the frame step and "
                        f"trust radius times sqrt(d r)) (default {default.adjust_lr_fn}"
                        + (", the paper's step, so that the studies rerun the paper; StiefelAdam's own default is "
                           "match_rms_adamw)" if default.adjust_lr_fn == "original" else ")"))


def add_runner_arguments(parser: argparse.ArgumentParser, *, arms: Sequence[str], seeds: Sequence[int],
                         out: str, study: str | None = None) -> None:
    """``--arms``, ``--seeds``, ``--out``, ``--workers``, ``--device``, ``--threads``, ``--quiet``,
    ``--report-only``, ``--skip-report``, ``--stop-after-epochs``, ``--checkpoint-interval``."""
    from .arms import available_arms

    g = parser.add_argument_group("running")
    g.add_argument("--arms", nargs="+", default=None,
                   help=f"arms to run (default {' '.join(arms)}; with --report-only: every arm on disk; registered: "
                        f"{', '.join(available_arms(study))})")
    g.add_argument("--seeds", nargs="+", type=int, default=None,
                   help=f"seeds; each fixes the data split/order and the initial weights (default "
                        f"{' '.join(map(str, seeds))}; with --report-only: every seed on disk)")
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
                       frame_lr=args.frame_lr, trust_region=args.trust_region, momentum=args.momentum,
                       adjust_lr_fn=args.adjust_lr_fn)


def invoked_command() -> str | None:
    """The command line that started this process, as ``python -m experiments ...`` (recorded in reports)."""
    import shlex
    import sys

    return "python -m experiments " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv else None


def check_runner_args(args: argparse.Namespace, study: str | None = None) -> None:
    """Refuse bad running flags before anything is written: unknown or repeated ``--arms``, negative, repeated or
    too large ``--seeds`` (torch takes seeds up to 2**64 - 1), ``--workers``/``--threads``/``--stop-after-epochs``
    below 1, ``--threads`` above :data:`~geoopt_stiefel_attention.argtypes.THREADS_MAX`, a negative
    ``--checkpoint-interval``, a ``--device`` torch cannot use, and an ``--out`` that cannot be a folder.
    Raises :class:`~geoopt_stiefel_attention.argtypes.UsageError` naming the flag."""
    import math

    from geoopt_stiefel_attention.argtypes import THREADS_MAX, UsageError

    from .arms import ARMS, available_arms

    if args.arms is not None:
        unknown = [a for a in args.arms if a not in ARMS]
        if unknown:
            raise UsageError(f"--arms: unknown arm(s) {', '.join(unknown)}; registered arms: "
                             f"{', '.join(available_arms(study))}.")
        foreign = [a for a in args.arms if a not in available_arms(study)]
        if foreign:
            raise UsageError(f"--arms: {', '.join(foreign)} belongs to another study (its model builder gives it its "
                             f"meaning); arms of this study: {', '.join(available_arms(study))}.")
        check_distinct("--arms", args.arms, "arm")
    if args.seeds is not None:
        bad = [s for s in args.seeds if s < 0]
        if bad:
            raise UsageError(f"--seeds: {' '.join(map(str, bad))} is negative; seeds are ints >= 0 (e.g. --seeds 0 1 2).")
        check_seed_range("--seeds", args.seeds)
        check_distinct("--seeds", args.seeds, "seed")
    for flag, value in (("--workers", args.workers), ("--threads", args.threads),
                        ("--stop-after-epochs", args.stop_after_epochs)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} {value}: must be an int >= 1.")
    if args.threads is not None and args.threads > THREADS_MAX:
        raise UsageError(f"--threads {args.threads}: must be an int from 1 to {THREADS_MAX}.")
    if not (math.isfinite(args.checkpoint_interval) and args.checkpoint_interval >= 0):
        raise UsageError(f"--checkpoint-interval {args.checkpoint_interval}: must be a number of seconds >= 0.")
    if args.report_only and args.skip_report:
        raise UsageError("--report-only and --skip-report exclude each other; pass one of them.")
    if not args.report_only:
        from .runner import resolve_device

        try:
            resolve_device(args.device)
        except ValueError:
            raise UsageError(f"--device {args.device}: torch sees no GPU on this machine; use --device cpu or "
                             f"auto.") from None
        except RuntimeError:
            raise UsageError(f"--device {args.device}: not a device torch knows; use auto, cpu, cuda or "
                             f"cuda:N.") from None
    check_out_dir(args.out, must_exist=args.report_only)


def check_seed_range(flag: str, seeds: Sequence[int]) -> None:
    """Refuse a seed above :data:`~geoopt_stiefel_attention.argtypes.SEED_MAX`, the largest torch takes (beyond it
    a run failed inside torch with a traceback, after its folder was made). Raises
    :class:`~geoopt_stiefel_attention.argtypes.UsageError` naming ``flag``.

    Parameters
    ----------
    flag : str
        The flag, e.g. ``"--seeds"``.
    seeds : sequence of int
        Its values as parsed.
    """
    from geoopt_stiefel_attention.argtypes import SEED_MAX, UsageError

    big = [s for s in seeds if s > SEED_MAX]
    if big:
        raise UsageError(f"{flag}: {' '.join(map(str, big))} is above 2**64 - 1 = {SEED_MAX}, the largest seed torch "
                         f"takes; pass seeds from 0 to {SEED_MAX}.")


def check_distinct(flag: str, values: Sequence, word: str = "value") -> None:
    """Refuse a list flag that names one value twice (a sweep would otherwise drop the repeat silently, or run it
    twice). Raises :class:`~geoopt_stiefel_attention.argtypes.UsageError` naming ``flag``.

    Parameters
    ----------
    flag : str
        The flag, e.g. ``"--seeds"``.
    values : sequence
        Its values as parsed (numbers compare by value: ``1e-3`` and ``0.001`` are one value).
    word : str
        What one value is, for the message (``"seed"``, ``"arm"``, ...).
    """
    from geoopt_stiefel_attention.argtypes import UsageError

    if len(set(values)) != len(values):
        raise UsageError(f"{flag}: {' '.join(map(str, values))} names a{'n' if word[0] in 'aeiou' else ''} {word} "
                         f"twice; list each {word} once.")


def check_out_dir(out: str, *, must_exist: bool = False) -> None:
    """Refuse an ``--out`` that is a file, lies under a file, cannot be created for lack of permission (or on a
    read-only file system), or (for ``--report-only``) does not exist. Leaves nothing behind."""
    from pathlib import Path

    from geoopt_stiefel_attention.argtypes import UsageError, output_path_problem

    path = Path(out)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {out}: is a file, not a folder; pass a folder (it is created if missing).")
    if must_exist:
        if not path.is_dir():
            raise UsageError(f"--out {out}: no such folder; --report-only rebuilds the report of a study folder "
                             f"that holds runs.")
    problem = output_path_problem(out, folder=True)
    if problem is not None:
        raise UsageError(f"--out {out}: {problem}")


def check_input_folder(flag: str, value: str | None, holding: str) -> None:
    """Refuse an input folder flag (``--corpus-root``) whose value is empty, names nothing, or names a file: a
    :class:`~geoopt_stiefel_attention.argtypes.UsageError` naming ``flag``, the value, what is wrong and the fix
    (``holding``: what the folder must hold, e.g. ``"*.py files"``). ``None`` (the flag not given) passes."""
    from pathlib import Path

    from geoopt_stiefel_attention.argtypes import UsageError

    if value is None:
        return
    if value == "":
        raise UsageError(f"{flag}: is empty (it would read the current folder); pass a folder holding {holding}.")
    path = Path(value)
    if not path.exists():
        raise UsageError(f"{flag} {value}: the folder is missing (nothing exists at this path); pass a folder "
                         f"holding {holding}.")
    if not path.is_dir():
        raise UsageError(f"{flag} {value}: is a file, not a folder; pass a folder holding {holding}.")


#: optional package -> what needs it
OPTIONAL_PACKAGES = {"tqdm": "progress bars (or pass --quiet)", "seaborn": "the figures (or pass --skip-report)",
                     "pandas": "the figures (or pass --skip-report)",
                     "matplotlib": "the figures (or pass --skip-report)", "scipy": "the statistics",
                     "torchvision": "the CIFAR-10 and Fashion-MNIST data", "sklearn": "the digits data",
                     "transformers": "the lm study's model (GPT-2)"}
#: import name -> the name pip installs it by, where they differ
PIP_NAMES = {"sklearn": "scikit-learn"}
#: The extra of pyproject.toml that brings every optional package of :data:`OPTIONAL_PACKAGES` (and everything else
#: the studies import: tests/test_packaging.py checks it).
STUDIES_EXTRA = "experiments"


def require_modules(names: Sequence[str]) -> None:
    """Import each optional package in ``names``; one missing raises
    :class:`~geoopt_stiefel_attention.argtypes.UsageError` saying what needs it and how to install it: alone, or
    with everything the studies import through the :data:`STUDIES_EXTRA` extra."""
    import importlib

    from geoopt_stiefel_attention.argtypes import UsageError

    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            pip = PIP_NAMES.get(name, name)
            raise UsageError(f"the optional package {pip} is not installed; it is needed for "
                             f"{OPTIONAL_PACKAGES.get(name, 'this command')}. Install it with: pip install {pip} "
                             f"(or, with everything the studies need: pip install "
                             f"'geoopt-stiefel-attention[{STUDIES_EXTRA}]').") from None


def runner_modules(args: argparse.Namespace) -> list[str]:
    """The optional packages a study command will use, given its running flags."""
    names = ["scipy"]
    if not args.quiet and not args.report_only:
        names.append("tqdm")
    if not args.skip_report:
        names += ["pandas", "matplotlib", "seaborn"]
    return names


def build_config(factory, args: argparse.Namespace):
    """``factory(args)`` with a config error turned into a :class:`~geoopt_stiefel_attention.argtypes.UsageError`
    (the config messages name the flags)."""
    from geoopt_stiefel_attention.argtypes import UsageError

    try:
        return factory(args)
    except ValueError as err:
        raise UsageError(str(err)) from None


class user_errors:  # noqa: N801 - used as a context manager: ``with user_errors(): ...``
    """Turn the harness's user-facing errors (a run folder holding another run, a folder being trained by
    another process, an arm run under a frame-step rule it does not follow, records that contradict each other) into :class:`~geoopt_stiefel_attention.argtypes.UsageError` (one line, exit status 2)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, tb) -> bool:
        from geoopt_stiefel_attention.argtypes import UsageError

        from .arms import ArmRuleError
        from .records import InconsistentRecordsError
        from .run_folder import ConfigMismatchError, RunLockedError

        if isinstance(err, (ConfigMismatchError, RunLockedError, ArmRuleError, InconsistentRecordsError)):
            raise UsageError(str(err)) from None
        return False
