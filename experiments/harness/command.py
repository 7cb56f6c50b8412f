"""The base class of every study command (``python -m experiments grokking``, ``vision``, ``lm``, ...).

A study subclasses :class:`StudyCommand` and overrides its methods; a reader follows one call by reading them in
the order :meth:`StudyCommand.run` calls them: the flags (:meth:`~StudyCommand.task_arguments`, then the shared
schedule, optimizer and running flags of :mod:`.cli_args`), the config (:meth:`~StudyCommand.config_from_args`, or
:meth:`~StudyCommand.config_for_report` for ``--report-only``; then :meth:`~StudyCommand.prepare`), the arms and
seeds (:meth:`~StudyCommand.arms_to_run`, :meth:`~StudyCommand.seeds_to_run`) and the training
(:meth:`~StudyCommand.train`, which calls the study's ``run_<study>``: :func:`.study.run_study` trains each (arm,
seed) with the optimizer its arm builds, ``Arm.build(model, groups, optim)`` in :mod:`.arms`), then what is printed
(:meth:`~StudyCommand.header`, :meth:`~StudyCommand.result_line`, :meth:`~StudyCommand.summary_lines`).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from geoopt_stiefel_attention.argtypes import UsageError

from .jobs import RunOptions
from .runner import RunResult
from .study import ReportNotWrittenError, StudyOutputs

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


class StudyCommand:
    """A study as a command: subclass it, set the class attributes and override the methods the study needs.

    Attributes
    ----------
    name : str
        The subcommand and the study's ``experiment`` (its arms are registered under it).
    config_type : type
        The study's frozen config; ``config_type()`` gives the defaults ``--help`` shows.
    arms, seeds : tuple
        Defaults of ``--arms`` (empty: the study picks them in :meth:`train`) and ``--seeds``.
    report_only_flags : frozenset of str
        The study's own flags (argparse ``dest``) that ``--report-only`` honours.
    errors : tuple of exception types
        More errors of :meth:`train` that are the user's (missing data, ...): printed as usage errors.
    arms_help : str or None
        The help of ``--arms`` when the defaults depend on the study's flags.

    Notes
    -----
    :meth:`task_arguments`, :meth:`config_from_args` and :meth:`train` are abstract; every other method has a
    default that a study overrides only where it differs. :meth:`add_arguments`, :meth:`run`,
    :meth:`recorded_config` and :meth:`print_outputs` are what every study shares.
    """

    name: str
    config_type: type
    arms: tuple[str, ...] = ()
    seeds: tuple[int, ...] = (0,)
    report_only_flags: frozenset[str] = frozenset()
    errors: tuple[type[Exception], ...] = ()
    arms_help: str | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for attribute in ("name", "config_type"):
            if not hasattr(cls, attribute):
                raise TypeError(f"{cls.__name__}: a study command sets the class attribute {attribute!r}.")

    # ------------------------------------------------------------------------------ what a study overrides
    def task_arguments(self, parser: argparse.ArgumentParser, default: Any) -> None:
        """Add the study's own flags to ``parser``; ``default`` is ``config_type()`` (for the help texts)."""
        raise NotImplementedError(f"{type(self).__name__}.task_arguments")

    def config_from_args(self, args: argparse.Namespace) -> Any:
        """The study's config from the parsed flags; a ``ValueError`` (naming the flag) becomes a usage error."""
        raise NotImplementedError(f"{type(self).__name__}.config_from_args")

    def check(self, args: argparse.Namespace) -> None:
        """More checks of the flags, before anything is read or written (raise :class:`UsageError`)."""

    def config_for_report(self, args: argparse.Namespace) -> Any:
        """The config ``--report-only`` reports with: by default the one recorded with the runs in ``--out``."""
        return self.recorded_config(args.out)

    def prepare(self, config: Any, args: argparse.Namespace) -> Any:
        """The config to train, after checking the values a sweep or the data need (before anything is loaded
        or written); a ``ValueError`` or ``FileNotFoundError`` becomes a usage error."""
        return config

    def modules(self, config: Any, args: argparse.Namespace) -> list[str]:
        """The optional packages training needs beyond the runner's."""
        return []

    def arms_to_run(self, args: argparse.Namespace) -> list[str] | None:
        """``--arms``, else the study's default :attr:`arms` (``None``: every arm on disk with ``--report-only``,
        or the study's own choice when :attr:`arms` is empty)."""
        if args.arms is not None or args.report_only:
            return args.arms
        return list(self.arms) or None

    def seeds_to_run(self, args: argparse.Namespace) -> list[int] | None:
        """``--seeds``, else the study's default :attr:`seeds` (``None`` with ``--report-only``: every seed on
        disk)."""
        if args.seeds is not None or args.report_only:
            return args.seeds
        return list(self.seeds)

    def train(self, config: Any, args: argparse.Namespace, *, arms: list[str] | None, seeds: list[int] | None,
              options: RunOptions, command: str | None) -> StudyOutputs:
        """Run (or resume) the study, or with ``args.report_only`` rebuild its report; returns its outputs."""
        raise NotImplementedError(f"{type(self).__name__}.train")

    def header(self, config: Any, args: argparse.Namespace, outputs: StudyOutputs) -> str:
        """The first word(s) of the summary line."""
        return self.name

    def result_line(self, result: RunResult, config: Any) -> str | None:
        """One line per run trained in this call, or ``None``."""
        return None

    def summary_lines(self, summary: dict[str, Any]) -> list[str]:
        """Lines printed from the written summary."""
        return []

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
        """Run the study command ``args`` (parsed by a parser of :meth:`add_arguments`); returns the exit status:
        0, or 1 when the runs trained but their report could not be written (:class:`~.study.ReportNotWrittenError`,
        said in one line on stderr; the records stay complete)."""
        from .cli_args import (
            build_config,
            check_runner_args,
            invoked_command,
            require_modules,
            runner_modules,
            user_errors,
        )

        check_runner_args(args, study=self.name)
        self.check(args)
        config = self.config_for_report(args) if args.report_only else build_config(self.config_from_args, args)
        ignored = ignored_by_report_only(args, self.report_only_flags)
        if ignored:  # not silent: say that these flags do nothing here (after the checks: an error stays one line)
            print(f"python -m experiments {self.name}: note: --report-only rebuilds the report with the settings "
                  f"recorded in --out; ignoring {' '.join(ignored)}", file=sys.stderr)
        require_modules(runner_modules(args) + ([] if args.report_only else self.modules(config, args)))
        if not args.report_only:
            try:  # values checked before anything is loaded or written
                config = self.prepare(config, args)
            except (ValueError, FileNotFoundError) as err:
                raise UsageError(str(err)) from None
        t0 = time.perf_counter()
        try:
            with user_errors():
                outputs = self.train(config, args, arms=self.arms_to_run(args), seeds=self.seeds_to_run(args),
                                     options=RunOptions.from_args(args),
                                     command=None if args.report_only else invoked_command())
        except self.errors as err:
            raise UsageError(str(err)) from None
        except ReportNotWrittenError as err:  # trained, records complete: say why the report is missing, in one line
            print(f"python -m experiments {self.name}: error: {err}.", file=sys.stderr)
            return 1
        self.print_outputs(config, args, outputs, time.perf_counter() - t0)
        return 0

    def print_outputs(self, config: Any, args: argparse.Namespace, outputs: StudyOutputs, seconds: float) -> None:
        """The summary of a call: runs, the runs still pending, the study's summary lines, the report's path."""
        print(f"{self.header(config, args, outputs)}: {len(outputs.results)} run(s) in {seconds:.1f} s -> {args.out}")
        for r in outputs.results:
            line = self.result_line(r, config)
            if line is not None:
                print(f"  {line}")
        pending = [r.name for r in outputs.results if not r.completed]
        if pending:
            print(f"  stopped before the end (rerun the same command to resume): {', '.join(pending)}")
        if outputs.summary is not None:
            for line in self.summary_lines(outputs.summary):
                print(f"  {line}")
            print(f"  report: {outputs.report_path}")
