"""``stiefel-attention demo``: train Stiefel frames with StiefelAdam next to stock geoopt RiemannianAdam.

The problem is the one geoopt's own ``test_adam_stiefel`` uses, on a stack of frames: minimise
:math:`\\sum_h \\|W_h - W_h^*\\|_F^2` over :math:`\\mathrm{St}(d, r)^{H}` from a random start.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from .argtypes import UsageError, add_threads_argument, positive_float, positive_int, seed_int

HELP = "Train a stack of Stiefel frames with StiefelAdam and stock geoopt RiemannianAdam; print the comparison."


@dataclass(frozen=True)
class DemoResult:
    r"""Outcome of one optimizer on the demo problem.

    ``step_size`` is the measured mean Frobenius norm of one frame's step, :math:`\|W_{k+1} - W_k\|_F`, over the
    first :data:`STEP_SIZE_STEPS` steps: the quantity the arms are matched on.
    """

    optimizer: str
    manifold: str
    lr: float
    matched: str
    final_loss: float
    steps_to_tol: int | None
    orthonormality_error: float
    ms_per_step: float
    state_floats_per_param_float: float
    step_size: float


#: Steps over which :attr:`DemoResult.step_size` is averaged.
STEP_SIZE_STEPS = 10


def demo_arms(lr: float, d: int, r: int) -> list[tuple[str, str, float, str]]:
    r"""The demo's arms as ``(optimizer, manifold, lr, how its step size is matched)``.

    With one second moment per frame, ``StiefelAdam(adjust_lr_fn="original")`` moves a frame by
    :math:`\|s\|_F \approx \mathrm{lr}`, as geoopt's ``RiemannianAdam`` does on a Stiefel manifold; the
    default ``adjust_lr_fn="match_rms_adamw"`` multiplies the step by :math:`c = \sqrt{d r}` (so that a frame moves
    about as far as AdamW would move the matrix it replaces). The two pairs below are matched in step size; the
    last line pair shows the default rule's effect on its own: geoopt at :math:`\sqrt{d r}\,\mathrm{lr}`.
    """
    c = math.sqrt(d * r)
    return [
        ("StiefelAdam original", "PolarStiefel", lr, "||s||_F ~ lr"),
        ("geoopt RiemannianAdam", "EuclideanStiefel", lr, "||s||_F ~ lr"),
        ("geoopt RiemannianAdam", "Stiefel", lr, "||s||_F ~ lr"),
        ("StiefelAdam (default)", "PolarStiefel", lr, f"||s||_F ~ sqrt(dr) lr = {c * lr:.3g}"),
        ("geoopt RiemannianAdam", "EuclideanStiefel", c * lr, f"||s||_F ~ sqrt(dr) lr = {c * lr:.3g}"),
    ]


def run_demo(*, heads: int = 4, d: int = 32, r: int = 8, steps: int = 2000, lr: float = 1e-2,
             tol: float = 1e-6, seed: int = 0, threads: int | None = 1,
             progress: Callable[[str], None] | None = None) -> list[DemoResult]:
    """Run every arm of :func:`demo_arms` from the same start and return one :class:`DemoResult` each.

    An arm stops at the tolerance (or after ``steps``); ``threads`` sets ``torch.set_num_threads`` for the run
    (``None``: unchanged; the previous count is restored); ``progress`` is called with one line per finished arm.
    """
    import geoopt
    import torch

    from . import PolarStiefel, StiefelAdam
    from ._linalg import orthonormality_error

    manifolds = {"PolarStiefel": PolarStiefel, "EuclideanStiefel": geoopt.EuclideanStiefel, "Stiefel": geoopt.Stiefel}
    gen = torch.Generator().manual_seed(seed)
    st = PolarStiefel()
    start = st.random(heads, d, r, generator=gen)
    target = st.random(heads, d, r, generator=gen)
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    results = []
    try:
        arms = demo_arms(lr, d, r)
        for i, (name, manifold_name, arm_lr, matched) in enumerate(arms, 1):
            manifold = manifolds[manifold_name]()
            w = geoopt.ManifoldParameter(start.clone(), manifold=manifold)
            if name.startswith("StiefelAdam"):
                rule = "original" if "original" in name else "match_rms_adamw"
                opt = StiefelAdam([w], lr=arm_lr, adjust_lr_fn=rule)
            else:
                opt = geoopt.optim.RiemannianAdam([w], lr=arm_lr)
            hit, moved, k = None, [], 0
            t0 = time.perf_counter()
            for k in range(1, steps + 1):
                before = w.detach().clone() if k <= STEP_SIZE_STEPS else None
                opt.zero_grad(set_to_none=True)
                loss = (w - target).square().sum() / heads
                loss.backward()
                opt.step()
                if before is not None:
                    moved.append(float((w.detach() - before).flatten(1).norm(dim=1).mean()))
                if loss.item() < tol:
                    hit = k
                    break
            elapsed = time.perf_counter() - t0
            state_numel = sum(t.numel() for t in opt.state[w].values() if torch.is_tensor(t) and t.dim() > 0)
            with torch.no_grad():
                final = float((w - target).square().sum() / heads)
            results.append(DemoResult(name, manifold_name, arm_lr, matched, final, hit,
                                      float(orthonormality_error(w)), 1e3 * elapsed / k,
                                      state_numel / w.numel(), sum(moved) / len(moved)))
            if progress is not None:
                progress(f"[{i}/{len(arms)}] {name} on {manifold_name}, lr={arm_lr:.3g}: "
                         f"{'tolerance at step ' + str(hit) if hit else f'{steps} steps, tolerance not reached'}"
                         f" ({elapsed:.1f} s)")
    finally:
        torch.set_num_threads(previous)
    return results


def format_table(results: list[DemoResult]) -> str:
    """Render demo results as an aligned plain-text table."""
    header = (f"{'optimizer':<24}{'manifold':<18}{'lr':>8}{'mean ||s||_F':>14}{'steps to tol':>14}{'final loss':>12}"
              f"{'max|WtW-I|':>12}{'ms/step':>9}{'state/param':>13}")
    lines = [header, "-" * len(header)]
    for r in results:
        hit = "-" if r.steps_to_tol is None else str(r.steps_to_tol)
        lines.append(f"{r.optimizer:<24}{r.manifold:<18}{r.lr:>8.3g}{r.step_size:>14.3g}{hit:>14}{r.final_loss:>12.3e}"
                     f"{r.orthonormality_error:>12.1e}{r.ms_per_step:>9.2f}{r.state_floats_per_param_float:>12.3f}x")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``stiefel-attention demo``; a bad value is one error line naming the flag, exit status 2."""
    parser.add_argument("--heads", type=positive_int, default=4, help="frames in the stack (default 4)")
    parser.add_argument("--d", type=positive_int, default=32, help="ambient dimension d (default 32)")
    parser.add_argument("--r", type=positive_int, default=8, help="frame width r <= d (default 8)")
    parser.add_argument("--steps", type=positive_int, default=2000, help="optimisation steps (default 2000)")
    parser.add_argument("--lr", type=positive_float, default=1e-2,
                        help="learning rate of every optimizer, > 0 (default 1e-2)")
    parser.add_argument("--seed", type=seed_int, default=0,
                        help="seed of the frames and gradients, 0 to 2**64 - 1 (default 0)")
    add_threads_argument(parser)
    parser.add_argument("--quiet", action="store_true", help="print the table only (no progress lines)")


#: Frame stacks of the demo's size alive at once (start, target, the parameter and its gradient, optimizer state,
#: the step's temporaries): what ``--heads``/``--d``/``--r`` are checked against before anything is allocated
DEMO_COPIES = 16


def _physical_memory() -> int | None:
    """The machine's physical memory in bytes (``None`` where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def run(args: argparse.Namespace) -> int:
    if args.r > args.d:
        raise UsageError(f"--r {args.r} exceeds --d {args.d}: a frame in St(d, r) needs "
                         f"r <= d; lower --r or raise --d")

    need = DEMO_COPIES * args.heads * args.d * args.r * 4  # float32 frame stacks the arms hold at once
    have = _physical_memory()
    if have is not None and need > have:
        raise UsageError(f"--heads {args.heads} --d {args.d} --r {args.r}: the demo holds about {DEMO_COPIES} float32 "
                         f"stacks of {args.heads} x {args.d} x {args.r} frames ({need / 2**30:.3g} GiB), more than "
                         f"this machine's memory ({have / 2**30:.3g} GiB); lower --heads, --d or --r")

    def progress(line: str) -> None:
        if not args.quiet:
            print("  " + line, file=sys.stderr, flush=True)

    results = run_demo(heads=args.heads, d=args.d, r=args.r, steps=args.steps, lr=args.lr, seed=args.seed,
                       threads=args.threads, progress=progress)
    c = math.sqrt(args.d * args.r)
    print(f"Minimise mean_h ||W_h - W*_h||_F^2 over {args.heads} frames on St({args.d}, {args.r}), at most "
          f"{args.steps} steps (each arm stops at loss < 1e-6), float32, the same start for every arm, "
          f"{args.threads} thread(s).\n"
          f"Step sizes are matched: StiefelAdam(adjust_lr_fn='original') and geoopt's RiemannianAdam both move a "
          f"frame by about lr per step (Frobenius norm; measured in the column 'mean ||s||_F', first "
          f"{STEP_SIZE_STEPS} steps). The default adjust_lr_fn='match_rms_adamw' multiplies StiefelAdam's step by "
          f"sqrt(d r) = {c:.3g}, so that a frame moves as far as AdamW would move the matrix it replaces; the last "
          f"line gives geoopt that step size too (lr x {c:.3g}).\n")
    print(format_table(results))
    return 0
