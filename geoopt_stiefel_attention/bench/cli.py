"""``stiefel-attention bench``: the subcommand's ``HELP``, ``add_arguments`` and ``run`` (see
:mod:`geoopt_stiefel_attention.cli`)."""

from __future__ import annotations

import argparse
import importlib.util
import json
from dataclasses import replace

from .._docfrag import fill
from ..argtypes import (
    UsageError,
    add_threads_argument,
    output_path_problem,
    positive_float,
    positive_int,
    seed_int,
)
from .gpu import CHECK_SCALES, accelerator_check, format_check
from .paths import (
    BENCH_FRAMES,
    GRID_RANKS,
    GRID_WIDTHS,
    GRIDS,
    STEP_PATHS,
    format_path_table,
    path_frame_sets,
    step_path_benchmark,
)
from .records import machine_info, provenance, to_json
from .settings import BENCH_DEFAULTS, CLOCKS, torch_threads
from .step import CONFIGS, STEP_OPTIMIZERS, format_step_table, step_time_benchmark
from .train import (
    EXTRA_TRAIN_MODELS,
    MODEL_PACKAGES,
    TRAIN_MODELS,
    TRAIN_SCALE_NAMES,
    format_train_table,
    train_step_benchmark,
)

HELP = "Time the StiefelAdam step against AdamW and stock geoopt RiemannianAdam (ratios, memory); --json."

# ----------------------------------------------------------------------------------------------- CLI
#: Flags that every benchmark reads.
EVERY_BENCHMARK_READS = ("--device", "--threads", "--out", "--json")

#: benchmark -> the other flags it reads. A flag that a benchmark does not read is refused when it is given on the
#: command line at all (even at its default value), in one line naming the flag and the benchmark, before anything
#: runs: nothing the user asks for is ignored silently.
BENCHMARK_READS: dict[str, tuple[str, ...]] = {
    "step": ("--widths", "--optimizers", "--rounds", "--steps", "--lr", "--dtype", "--clock", "--seed"),
    "paths": ("--paths", "--grid", "--compile-backend", "--rounds", "--steps", "--lr", "--dtype", "--clock",
              "--seed"),
    "train": ("--models", "--scale", "--autocast", "--rounds", "--steps", "--lr", "--clock", "--seed"),
    "gpu": ("--scale", "--compile-backend", "--clock", "--seed"),
    "muon": ("--widths", "--rounds", "--scale"),
}

#: what a flag is for, where the refusal says more than which benchmarks read it
_PURPOSE = {"--optimizers": "chooses what 'step' times", "--paths": "chooses what 'paths' times"}

#: (benchmark, flag) -> what the refusal adds
_INSTEAD = {
    ("train", "--dtype"): " (it trains float32 parameters; for mixed precision use --autocast bfloat16 or float16)",
    **{("gpu", flag): " (its sizes are fixed; --scale tiny makes them a smoke test)"
       for flag in ("--widths", "--rounds", "--steps")},
    **{("muon", flag): " (it times every optimizer in float32 at lr 1e-3, one step per round, on the wall clock)"
       for flag in ("--lr", "--dtype", "--steps", "--clock")},
}


class _Given(argparse.Action):
    """Stores the value as ``store`` does, and records the flag in ``namespace._given``: a benchmark refuses a flag
    it does not read when it is given at all, even at its default value (:func:`_refuse_unread`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace._given = (*getattr(namespace, "_given", ()), self.option_strings[0])


def _read_by(flag: str) -> str:
    readers = [f"'{what}'" for what, flags in BENCHMARK_READS.items() if flag in flags]
    return f"{', '.join(readers[:-1])} and {readers[-1]}" if len(readers) > 1 else readers[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``stiefel-attention bench``; each help ends with the benchmarks that read the flag
    (:data:`BENCHMARK_READS`).

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The ``bench`` subcommand's parser.
    """

    def add(flag: str, help: str, **kwargs) -> None:
        parser.add_argument(flag, action=_Given, help=f"{help} [read by {_read_by(flag)}]", **kwargs)

    parser.add_argument("what", nargs="?", choices=tuple(BENCHMARK_READS), default="step",
                        help="'step': optimizer step on Q/K frames against competitors (default); 'train': full "
                             "training step; 'paths': the step's eager, capturable and compiled paths against "
                             "the product floor; 'gpu': the prepared accelerator check (needs --out); 'muon': "
                             "StiefelMuon beside StiefelAdam, torch's Muon on the same frames and AdamW (minimum "
                             "over --rounds interleaved rounds). A flag that the benchmark does not read is refused")
    add("--widths", type=positive_int, nargs="+", default=list(CONFIGS), choices=list(CONFIGS), metavar="WIDTH",
        help=f"configurations, any of {' '.join(map(str, CONFIGS))} (default: all)")
    add("--optimizers", nargs="+", default=None, choices=STEP_OPTIMIZERS, metavar="OPTIMIZER",
        help=f"what 'step' times, any of {' '.join(STEP_OPTIMIZERS)} (default: all)")
    add("--paths", nargs="+", default=None, choices=STEP_PATHS, metavar="PATH",
        help=f"what 'paths' times, any of {' '.join(STEP_PATHS)} (default: all)")
    add("--grid", default="short", choices=GRIDS,
        help=f"frame sets: 'short', the bench shape {BENCH_FRAMES.label} (default); 'full', also widths "
             f"{min(GRID_WIDTHS)}-{max(GRID_WIDTHS)} with r = {', '.join(map(str, GRID_RANKS))}")
    add("--compile-backend", default="inductor", help="torch.compile backend of the compiled path (default inductor)")
    add("--scale", default="default", choices=tuple(dict.fromkeys((*CHECK_SCALES, *TRAIN_SCALE_NAMES))),
        help="sizes: 'default' (for 'gpu': a few minutes on a GPU) or 'tiny' (a smoke test; for 'muon': width 128, "
             "one round); 'w64' ('train' only): every model at width 64")
    parser.add_argument("--out", default=None, metavar="PATH",
                        help="also write the JSON to PATH (its folder must exist)")
    add("--models", nargs="+", default=list(TRAIN_MODELS), choices=TRAIN_MODELS + EXTRA_TRAIN_MODELS,
        help="models (default: the first two; the others are stock models converted by stiefelize: hf_* need the "
             "models extra, timm_vit timm, torchvision_vit torchvision)")
    add("--autocast", default=None, choices=("bfloat16", "float16"),
        help="run forward and loss under torch.autocast in this dtype; parameters and optimizers stay float32 "
             "(default: off)")
    add("--rounds", type=positive_int, default=7, help="interleaved rounds (default 7)")
    add("--steps", type=positive_int, default=None,
        help="timed steps per round of each optimizer ('step'), path ('paths') or arm ('train') (default "
             + ", ".join(f"{s.steps_per_round} for '{w}'" for w, s in BENCH_DEFAULTS.items()) + ")")
    add("--lr", type=positive_float, default=1e-3, help="learning rate of every optimizer, > 0 (default 1e-3)")
    add("--dtype", default="float32", choices=("float32", "float64", "bfloat16"),
        help="of the parameters (default float32)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    add("--clock", default="wall", choices=CLOCKS,
        help="'wall' time, or process 'cpu' time (robust on a shared machine; needs --threads 1, refused on more: "
             "CPU time sums the threads)")
    add_threads_argument(parser)
    add("--seed", type=seed_int, default=0, help="seed of the parameters, gradients and data (default 0)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _refuse_unread(args: argparse.Namespace) -> None:
    """A :class:`UsageError` naming the first flag given on the command line that ``args.what`` does not read
    (:data:`BENCHMARK_READS`); a namespace not made by the parser counts the flags set away from their defaults."""
    defaults = argparse.ArgumentParser(add_help=False)
    add_arguments(defaults)
    given = [*getattr(args, "_given", ()),
             *(a.option_strings[0] for a in defaults._actions
               if isinstance(a, _Given) and getattr(args, a.dest, a.default) != a.default)]
    reads = BENCHMARK_READS[args.what]
    for flag in dict.fromkeys(given):
        if flag not in reads:
            purpose = _PURPOSE.get(flag, f"is for {_read_by(flag)}")
            raise UsageError(f"{flag} {purpose}; '{args.what}' does not take it"
                             f"{_INSTEAD.get((args.what, flag), '')}")
    if args.what == "muon" and args.scale == "tiny":
        for flag in ("--widths", "--rounds"):
            if flag in given:
                raise UsageError(f"{flag}: 'muon --scale tiny' is the smoke test (width 128, one round); "
                                 f"drop {flag} or --scale tiny")


def _refuse_repeated(args: argparse.Namespace) -> None:
    """A :class:`UsageError` for a list flag that names one value twice (a width would be timed twice, a name
    dropped)."""
    for flag in ("--widths", "--optimizers", "--paths", "--models"):
        values = getattr(args, flag[2:])
        if values is not None and len(set(values)) != len(values):  # a width would be timed twice, a name dropped
            raise UsageError(f"{flag} {' '.join(map(str, values))}: names one value twice; list each once")


def _refuse_device(args: argparse.Namespace) -> None:
    """A :class:`UsageError` for a ``--device`` that is not a torch device or not available here."""
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"--device {args.device!r} is not a torch device; use e.g. cpu or cuda") from None
    backend = getattr(torch, device.type, None)
    if device.type != "cpu" and not (backend is not None and backend.is_available()):
        raise UsageError(f"--device {args.device!r} is not available on this machine; "
                                               f"use --device cpu")


def _refuse_missing_models(args: argparse.Namespace) -> None:
    """A :class:`UsageError` for a ``train --models`` entry whose package (:data:`~.train.MODEL_PACKAGES`) is not
    installed."""
    if args.what != "train":
        return
    for model in args.models:
        package = MODEL_PACKAGES.get(model)
        if package is not None and importlib.util.find_spec(package) is None:
            hint = ("HuggingFace transformers; install the models extra (pip install -e '.[models]')"
                    if package == "transformers" else f"{package}; install it (pip install {package})")
            raise UsageError(f"--models {model} needs {hint}")


def _refuse_run_settings(args: argparse.Namespace) -> None:
    """A :class:`UsageError` for an unknown ``--compile-backend``, ``--clock cpu`` on more than one thread, 'gpu'
    without ``--out``, or an ``--out`` that cannot be written; checked before the benchmark runs, not after."""
    import torch

    if "--compile-backend" in BENCHMARK_READS[args.what] and \
            args.compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise UsageError(f"--compile-backend {args.compile_backend!r} is not a torch.compile "
                                               f"backend; use e.g. inductor or aot_eager")
    if "--clock" in BENCHMARK_READS[args.what] and args.clock == "cpu" and args.threads != 1:
        raise UsageError(f"--clock cpu with --threads {args.threads}: process CPU time sums the threads' times, so "
                         f"a ratio between entries that parallelise differently is not a wall-time ratio; use "
                         f"--threads 1 with --clock cpu, or --clock wall")
    if args.what == "gpu" and args.out is None:
        raise UsageError("'gpu' writes its results as JSON: pass --out PATH")
    problem = None if args.out is None else output_path_problem(args.out, folder=False)
    if problem is not None:  # checked before the benchmark runs, not after
        raise UsageError(f"--out {args.out}: {problem}")


@fill
def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark and print a Markdown table (or JSON with ``--json``).

    {{parameters_args}}

    Returns
    -------
    int
        The exit status (0 on success).
    """
    _refuse_unread(args)  # before anything else: a flag the benchmark would ignore is a user error
    _refuse_repeated(args)
    _refuse_device(args)
    _refuse_missing_models(args)
    if args.scale not in CHECK_SCALES and args.what != "train":
        raise UsageError(f"--scale {args.scale} is for 'train' only; '{args.what}' takes "
                         f"{' or '.join(CHECK_SCALES)}")
    timed = _timed(args)
    _refuse_run_settings(args)
    if args.what == "gpu":
        doc = accelerator_check(args.device, scale=args.scale, clock=args.clock, threads=args.threads,
                                compile_backend=args.compile_backend, seed=args.seed)
        text = json.dumps(doc, indent=2, default=str)
        _write_out(args.out, text)
        print(text if args.json else format_check(doc) + f"\nwritten to {args.out}")
        return 0
    if args.what == "muon":
        return _run_muon(args)
    return _run_timed(args, timed)


def _run_timed(args: argparse.Namespace, timed: tuple[str, ...] | None) -> int:
    """``bench step``, ``bench paths`` or ``bench train`` with the settings of the command line (``timed``: what
    'step' or 'paths' times, :func:`_timed`), as a table with a line on the machine and settings, or JSON."""
    defaults = BENCH_DEFAULTS[args.what]
    steps = defaults.steps_per_round if args.steps is None else args.steps
    settings = replace(defaults, rounds=args.rounds, steps_per_round=steps, lr=args.lr, device=args.device,
                       clock=args.clock, threads=args.threads, seed=args.seed,
                       dtype=defaults.dtype if args.what == "train" else args.dtype)  # train: float32 (--dtype refused)
    if args.what == "paths":
        results = step_path_benchmark(path_frame_sets(args.grid), paths=timed,
                                      compile_backend=args.compile_backend, settings=settings)
        table = format_path_table(results)
    elif args.what == "step":
        results = step_time_benchmark(tuple(args.widths), optimizers=timed, settings=settings)
        table = format_step_table(results)
    else:
        results = train_step_benchmark(tuple(args.models), scale=args.scale, autocast=args.autocast,
                                       settings=settings)
        table = format_train_table(results)
    with torch_threads(args.threads):
        machine = machine_info(args.device)
    # the settings the benchmark ran with (train: float32 parameters, whatever --dtype's default says)
    text = to_json(results, machine, benchmark=args.what, rounds=settings.rounds, steps_per_round=steps,
                   lr=settings.lr, dtype=settings.dtype, clock=settings.clock, threads=args.threads, seed=settings.seed,
                   **(dict(grid=args.grid, compile_backend=args.compile_backend) if args.what == "paths" else {}),
                   **(dict(scale=args.scale, autocast=args.autocast) if args.what == "train" else {}))
    if args.out is not None:
        _write_out(args.out, text)
    if args.json:
        print(text)
    else:
        print(table)
        print(f"\n{machine.cpu}, {machine.logical_cpus} logical CPUs, torch {machine.torch} "
              f"({machine.torch_threads} threads), geoopt {machine.geoopt}; clock={args.clock}, "
              f"rounds={settings.rounds}, steps/round={steps}, lr={settings.lr}, {settings.dtype}"
              f"{f' ({args.autocast} autocast)' if args.what == 'train' and args.autocast else ''} on {args.device}.")
    return 0


#: benchmark -> (its option naming what it times, that option's destination, the choices, the one that every
#: ratio is relative to, the word for one of them)
_TIMED_OPTIONS = {
    "step": ("--optimizers", "optimizers", STEP_OPTIMIZERS, "stiefel", "an optimizer"),
    "paths": ("--paths", "paths", STEP_PATHS, "matmul_floor", "a path"),
}


def _timed(args: argparse.Namespace) -> tuple[str, ...] | None:
    """What 'step' (``--optimizers``) or 'paths' (``--paths``) times, checked; ``None`` for the other benchmarks
    (which refuse both flags, :func:`_refuse_unread`)."""
    if args.what not in _TIMED_OPTIONS:
        return None
    flag, dest, allowed, relative_to, word = _TIMED_OPTIONS[args.what]
    chosen = getattr(args, dest)
    chosen = list(allowed) if chosen is None else chosen
    wrong = [a for a in chosen if a not in allowed]
    if wrong:
        raise UsageError(f"{flag} {' '.join(wrong)}: not {word} of '{args.what}'; use any of {' '.join(allowed)}")
    if relative_to not in chosen:
        raise UsageError(f"{flag} must include '{relative_to}' (every ratio is relative to it)")
    return tuple(chosen)


def _run_muon(args: argparse.Namespace) -> int:
    """``bench muon``: :func:`~.muon.muon_step_benchmark` at ``--widths`` (``--scale tiny``: width 128, one
    round, the smoke test of ``benchmarks/gpu.sh``), as a table or JSON."""
    from dataclasses import asdict

    from .muon import format_muon_table, muon_step_benchmark

    widths, rounds = (128,) if args.scale == "tiny" else tuple(args.widths), 1 if args.scale == "tiny" else args.rounds
    results = muon_step_benchmark(widths, rounds=rounds, threads=args.threads or 1, device=args.device)
    with torch_threads(args.threads):
        machine = machine_info(args.device)
    text = json.dumps({**provenance(), "benchmark": "muon", "rounds": rounds, "threads": args.threads, "device": args.device,
                       "machine": asdict(machine), "results": [asdict(r) for r in results]}, indent=2, default=str)
    if args.out is not None:
        _write_out(args.out, text)
    print(text if args.json else format_muon_table(results))
    return 0


def _write_out(path: str, text: str) -> None:
    from pathlib import Path

    Path(path).write_text(text + "\n")  # its folder exists: checked before the benchmark ran
