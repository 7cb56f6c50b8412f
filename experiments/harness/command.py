"""One entry point for every study command (``python -m experiments grokking``, ``vision``, ``lm``, ...).

A study declares a :class:`StudyCommand`: its name, its config, how to train it, its default arms and seeds,
the flags of its own that ``--report-only`` honours, and what its report prints. :meth:`StudyCommand.run` does
what every study command does, in this order: note the flags ``--report-only`` ignores, check the running
flags, build the config (or read the recorded one for ``--report-only``), require the optional packages, train
(or rebuild the report), and print the runs, the ones still pending and the report's path.
:meth:`StudyCommand.add_arguments` adds the study's own flags, then the schedule, optimizer and running flags
of :mod:`.cli_args` with the study's defaults.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from geoopt_stiefel_attention._argtypes import UsageError

from .runner import RunOptions, RunResult
from .study import StudyOutputs

__all__ = ["StudyCommand", "RUNNER_REPORT_ONLY_FLAGS", "ignored_by_report_only"]

#: Flags of every study that ``--report-only`` honours or that only say how to run (everything else sets up
#: training, which a report-only call does not do: it reads the settings recorded with the runs), and the
#: parser's own entries.
RUNNER_REPORT_ONLY_FLAGS = frozenset({"report_only", "out", "arms", "seeds", "workers", "device", "threads", "quiet",
                                      "skip_report", "stop_after_epochs", "checkpoint_interval", "command", "_run",
                                      "_parser", "help"})


def ignored_by_report_only(args: argparse.Namespace, honoured: frozenset[str] = frozenset()) -> list[str]:
    """The flags given with ``--report-only`` (different from their defaults) that it does not use: all but
    :data:`RUNNER_REPORT_ONLY_FLAGS` and the study's own ``honoured`` ones."""
    parser = getattr(args, "_parser", None)
    if parser is None or not getattr(args, "report_only", False):
        return []
    keep = RUNNER_REPORT_ONLY_FLAGS | honoured
    return [action.option_strings[-1] for action in parser._actions
            if action.option_strings and action.dest not in keep
            and getattr(args, action.dest, action.default) != action.default]


def _no_lines(*_: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class StudyCommand:
    """What makes a study a ``python -m experiments`` subcommand; everything else is shared.

    Parameters
    ----------
    name : str
        The subcommand and the study's ``experiment`` (its arms are registered under it).
    config_type : type
        The study's frozen config; ``config_type()`` gives the defaults ``--help`` shows.
    task_arguments : callable
        ``task_arguments(parser, default_config)`` adds the study's own flags.
    config_from_args : callable
        ``config_from_args(args) -> config``; a ``ValueError`` (naming the flag) becomes a usage error.
    train : callable
        ``train(config, args, arms=, seeds=, options=, command=) -> StudyOutputs``: run (or resume) the study, or
        with ``args.report_only`` rebuild its report (``arms``/``seeds`` ``None``: all on disk).
    arms, seeds : sequence
        Defaults of ``--arms`` (empty: the study picks them) and ``--seeds``.
    report_only_flags : frozenset of str
        The study's own flags (argparse ``dest``) that ``--report-only`` honours.
    check : callable, optional
        ``check(args)``: more checks of the flags, before anything is read or written (raise :class:`UsageError`).
    config_for_report : callable, optional
        ``config_for_report(args)`` for ``--report-only``; default: the config recorded with the runs in ``--out``.
    prepare : callable, optional
        ``prepare(config, args) -> config`` before training (sweep values, data identity); a ``ValueError`` or
        ``FileNotFoundError`` becomes a usage error.
    modules : callable, optional
        ``modules(config, args)``: optional packages training needs beyond the runner's.
    errors : tuple of exception types
        More errors of ``train`` that are the user's (missing data, ...): printed as usage errors.
    header : callable, optional
        ``header(config, args, outputs)``: the first word(s) of the summary line (default: ``name``).
    result_line : callable, optional
        ``result_line(result, config)``: one line per run trained in this call, or ``None``.
    summary_lines : callable, optional
        ``summary_lines(summary)``: lines printed from the written summary.
    arms_help : str, optional
        The help of ``--arms`` when the defaults depend on the study's flags.
    """

    name: str
    config_type: type
    task_arguments: Callable[[argparse.ArgumentParser, Any], None]
    config_from_args: Callable[[argparse.Namespace], Any]
    train: Callable[..., StudyOutputs]
    arms: Sequence[str] = ()
    seeds: Sequence[int] = (0,)
    report_only_flags: frozenset[str] = frozenset()
    check: Callable[[argparse.Namespace], None] | None = None
    config_for_report: Callable[[argparse.Namespace], Any] | None = None
    prepare: Callable[[Any, argparse.Namespace], Any] | None = None
    modules: Callable[[Any, argparse.Namespace], list[str]] = _no_lines
    errors: tuple[type[Exception], ...] = ()
    header: Callable[[Any, argparse.Namespace, StudyOutputs], str] | None = None
    result_line: Callable[[RunResult, Any], str | None] | None = None
    summary_lines: Callable[[dict[str, Any]], list[str]] = _no_lines
    arms_help: str | None = None

    # ------------------------------------------------------------------------------------------ flags
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """The study's own flags, then ``--epochs``/``--eval-every``, the optimizer and the running flags."""
        from .cli_args import add_optim_arguments, add_runner_arguments, add_schedule_arguments

        default = self.config_type()
        self.task_arguments(parser, default)
        add_schedule_arguments(parser, default.train)
        add_optim_arguments(parser, default.optim)
        add_runner_arguments(parser, arms=self.arms, seeds=self.seeds, out=f"runs/{self.name}", study=self.name)
        if self.arms_help is not None:
            for action in parser._actions:
                if action.dest == "arms":
                    action.help = self.arms_help

    # ------------------------------------------------------------------------------------------ running
    def recorded_config(self, out: str) -> Any:
        """The config the runs in ``out`` were trained with (their ``config.json``), for ``--report-only``."""
        from .config import config_from_dict
        from .study import recorded_config

        recorded = recorded_config(out)
        if recorded is None:
            raise UsageError(f"--out {out}: holds no runs (no runs/<arm>/seed<k>/config.json); train the study "
                             f"first, without --report-only.")
        return config_from_dict(self.config_type, recorded)

    def run(self, args: argparse.Namespace) -> int:
        """Run the study command ``args`` (parsed by a parser of :meth:`add_arguments`); returns the exit status."""
        from .cli_args import (
            build_config,
            check_runner_args,
            invoked_command,
            require_modules,
            runner_modules,
            user_errors,
        )

        ignored = ignored_by_report_only(args, self.report_only_flags)
        if ignored:  # not silent: say that these flags do nothing here
            print(f"python -m experiments {self.name}: note: --report-only rebuilds the report with the settings recorded "
                  f"in --out; ignoring {' '.join(ignored)}", file=sys.stderr)
        check_runner_args(args, study=self.name)
        if self.check is not None:
            self.check(args)
        if not args.report_only:
            config = build_config(self.config_from_args, args)
        elif self.config_for_report is not None:
            config = self.config_for_report(args)
        else:
            config = self.recorded_config(args.out)
        require_modules(runner_modules(args) + ([] if args.report_only else self.modules(config, args)))
        if not args.report_only and self.prepare is not None:
            try:  # values checked before anything is loaded or written
                config = self.prepare(config, args)
            except (ValueError, FileNotFoundError) as err:
                raise UsageError(str(err)) from None
        arms = args.arms if args.arms is not None or args.report_only else (list(self.arms) or None)
        seeds = args.seeds if args.seeds is not None or args.report_only else list(self.seeds)
        t0 = time.perf_counter()
        try:
            with user_errors():
                outputs = self.train(config, args, arms=arms, seeds=seeds, options=RunOptions.from_args(args),
                                     command=None if args.report_only else invoked_command())
        except self.errors as err:
            raise UsageError(str(err)) from None
        self.print_outputs(config, args, outputs, time.perf_counter() - t0)
        return 0

    def print_outputs(self, config: Any, args: argparse.Namespace, outputs: StudyOutputs, seconds: float) -> None:
        """The summary of a call: runs, the runs still pending, the study's summary lines, the report's path."""
        header = self.name if self.header is None else self.header(config, args, outputs)
        print(f"{header}: {len(outputs.results)} run(s) in {seconds:.1f} s -> {args.out}")
        for r in outputs.results:
            line = None if self.result_line is None else self.result_line(r, config)
            if line is not None:
                print(f"  {line}")
        pending = [r.name for r in outputs.results if not r.completed]
        if pending:
            print(f"  stopped before the end (rerun the same command to resume): {', '.join(pending)}")
        if outputs.summary is not None:
            for line in self.summary_lines(outputs.summary):
                print(f"  {line}")
            print(f"  report: {outputs.report_path}")
