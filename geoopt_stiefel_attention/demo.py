"""``stiefel-attention demo``: train Stiefel frames with StiefelAdam next to stock geoopt RiemannianAdam.

The problem is the one geoopt's own ``test_adam_stiefel`` uses, on a stack of frames: minimise
:math:`\\sum_h \\|W_h - W_h^*\\|_F^2` over :math:`\\mathrm{St}(d, r)^{H}` from a random start.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from ._argtypes import UsageError, nonnegative_int, positive_float, positive_int

HELP = "Train a stack of Stiefel frames with StiefelAdam and stock geoopt RiemannianAdam; print the comparison."


@dataclass(frozen=True)
class DemoResult:
    """Outcome of one optimizer on the demo problem."""

    optimizer: str
    manifold: str
    final_loss: float
    steps_to_tol: int | None
    orthonormality_error: float
    ms_per_step: float
    state_floats_per_param_float: float


def run_demo(*, heads: int = 8, d: int = 64, r: int = 16, steps: int = 2000, lr: float = 1e-2,
             tol: float = 1e-6, seed: int = 0) -> list[DemoResult]:
    """Run the three optimizers from the same start and return one :class:`DemoResult` each."""
    import geoopt
    import torch

    from . import PolarStiefel, StiefelAdam
    from ._linalg import orthonormality_error

    gen = torch.Generator().manual_seed(seed)
    st = PolarStiefel()
    start = st.random(heads, d, r, generator=gen)
    target = st.random(heads, d, r, generator=gen)
    arms = [
        ("StiefelAdam", st, lambda p: StiefelAdam([p], lr=lr)),
        ("geoopt RiemannianAdam", geoopt.EuclideanStiefel(), lambda p: geoopt.optim.RiemannianAdam([p], lr=lr)),
        ("geoopt RiemannianAdam", geoopt.Stiefel(), lambda p: geoopt.optim.RiemannianAdam([p], lr=lr)),
    ]
    results = []
    for name, manifold, make in arms:
        w = geoopt.ManifoldParameter(start.clone(), manifold=manifold)
        opt = make(w)
        hit = None
        t0 = time.perf_counter()
        for k in range(1, steps + 1):
            opt.zero_grad(set_to_none=True)
            loss = (w - target).square().sum() / heads
            loss.backward()
            opt.step()
            if hit is None and loss.item() < tol:
                hit = k
        elapsed = time.perf_counter() - t0
        state_numel = sum(t.numel() for t in opt.state[w].values() if torch.is_tensor(t) and t.dim() > 0)
        with torch.no_grad():
            final = float((w - target).square().sum() / heads)
        results.append(DemoResult(name, type(manifold).__name__, final, hit,
                                  float(orthonormality_error(w)), 1e3 * elapsed / steps,
                                  state_numel / w.numel()))
    return results


def format_table(results: list[DemoResult]) -> str:
    """Render demo results as an aligned plain-text table."""
    header = f"{'optimizer':<24}{'manifold':<18}{'final loss':>12}{'steps to tol':>14}{'max|WtW-I|':>12}{'ms/step':>9}{'state/param':>13}"
    lines = [header, "-" * len(header)]
    for r in results:
        hit = "-" if r.steps_to_tol is None else str(r.steps_to_tol)
        lines.append(f"{r.optimizer:<24}{r.manifold:<18}{r.final_loss:>12.3e}{hit:>14}"
                     f"{r.orthonormality_error:>12.1e}{r.ms_per_step:>9.2f}{r.state_floats_per_param_float:>12.3f}x")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``stiefel-attention demo``; a bad value is one error line naming the flag, exit status 2."""
    parser.add_argument("--heads", type=positive_int, default=8, help="frames in the stack (default 8)")
    parser.add_argument("--d", type=positive_int, default=64, help="ambient dimension d (default 64)")
    parser.add_argument("--r", type=positive_int, default=16, help="frame width r <= d (default 16)")
    parser.add_argument("--steps", type=positive_int, default=2000, help="optimisation steps (default 2000)")
    parser.add_argument("--lr", type=positive_float, default=1e-2,
                        help="learning rate of every optimizer, > 0 (default 1e-2)")
    parser.add_argument("--seed", type=nonnegative_int, default=0)


def run(args: argparse.Namespace) -> int:
    if args.r > args.d:
        raise UsageError(f"--r {args.r} exceeds --d {args.d}: a frame in St(d, r) needs "
                                              f"r <= d; lower --r or raise --d")
    results = run_demo(heads=args.heads, d=args.d, r=args.r, steps=args.steps, lr=args.lr, seed=args.seed)
    print(f"Minimise mean_h ||W_h - W*_h||_F^2 over {args.heads} frames on St({args.d}, {args.r}), "
          f"{args.steps} steps, lr={args.lr}, float32, same start for every optimizer:\n")
    print(format_table(results))
    return 0
