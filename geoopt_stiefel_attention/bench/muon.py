"""The manifold-Muon benchmarks (``stiefel-attention bench muon``): StiefelMuon's step beside StiefelAdam, torch's
``Muon`` on the same frames and AdamW; and the formatting of the issue-41 table of the earlier fixed-count solver's
optimality gap against step time per setting (:class:`SolverRow`, committed in ``benchmarks/results``; that solver
was replaced in issue 56 by one that stops on a certified gap, and ``benchmarks/muon_solver_before_after.py``
times the two in one run).

Timings are the minimum over interleaved rounds (each round runs every entry once, in a rotated order), on the
threads given, so that a machine busy with other work inflates every entry alike and the minimum is the least
disturbed sample; results are returned as frozen objects (nothing is printed here).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: (width, depth, heads) of the bench's configurations (those of ``bench step``); frames are ``(heads, width,
#: width // heads)``, two per layer (W_Q, W_K).
MUON_CONFIGS: dict[int, tuple[int, int]] = {128: (2, 4), 256: (4, 4), 512: (8, 8), 768: (12, 12)}

#: The optimality gap (relative to the optimum) the issue-41 default solver setting had to stay below.
GAP_TARGET = 1e-3


@dataclass(frozen=True)
class MuonStepResult:
    """Step times (ms, minimum over ``rounds`` interleaved rounds) of one configuration, per optimizer, and the
    ratios of StiefelMuon's time to each other entry's. StiefelMuon's solver: ``direction_tol`` (the certified
    solver of issue 56, at its float32 default), or, in results committed before it, the earlier fixed-count
    setting ``dual_steps``/``ns_steps`` (``None`` in new results)."""

    width: int
    depth: int
    heads: int
    head_dim: int
    times_ms: dict[str, float]
    ratios: dict[str, float]
    dual_steps: int | None
    ns_steps: int | None
    rounds: int
    threads: int
    direction_tol: float | None = None


@dataclass(frozen=True)
class SolverRow:
    """One row of the issue-41 gap/time table of the earlier fixed-count solver: a setting at one width; the worst
    and median relative optimality gap ``(OPT - <M, A>) / OPT`` of the float32 direction over the frames (``OPT``
    from a float64 solve of 150 dual steps), and the StiefelMuon step time (ms, minimum over interleaved rounds)
    of the whole configuration."""

    width: int
    d: int
    r: int
    dual_steps: int
    ns_steps: int
    worst_gap: float
    median_gap: float
    step_ms: float


def _frames(width: int, depth: int, heads: int, seed: int = 0, device: str = "cpu"):
    import geoopt
    import torch

    from ..manifolds import PolarStiefel

    st = PolarStiefel()
    gen = torch.Generator().manual_seed(seed)
    params = [geoopt.ManifoldParameter(st.random(heads, width, width // heads, generator=gen)
                                       .as_subclass(torch.Tensor).to(device), manifold=st) for _ in range(2 * depth)]
    grads = [torch.randn(p.shape, generator=gen).to(device) for p in params]
    return params, grads


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _interleaved_min(steps: dict[str, Callable[[], None]], rounds: int, warmup: int = 2,
                     device: str = "cpu") -> dict[str, float]:
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    names = list(steps)
    best = {name: float("inf") for name in names}
    for k in range(rounds):
        for name in names[k % len(names):] + names[:k % len(names)]:
            _sync(device)
            t0 = time.perf_counter()
            steps[name]()
            _sync(device)
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: 1e3 * t for name, t in best.items()}


def _stepper(opt, params, grads) -> Callable[[], None]:
    def step() -> None:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
    return step


def muon_step_benchmark(widths: Sequence[int] = (128, 512), *, rounds: int = 7, threads: int = 1,
                        direction_tol: float | None = None, device: str = "cpu") -> list[MuonStepResult]:
    """Time one step of StiefelMuon, StiefelAdam, torch's ``Muon`` on the same frames (one 2-D ``d x r``
    parameter per head, as torch's Muon requires) and AdamW (foreach) on the query/key frames of each width, in
    float32 on ``device`` (synchronised around every timed step off the CPU).

    Returns
    -------
    list of MuonStepResult
        ``ratios[name]`` is StiefelMuon's time over ``name``'s.
    """
    import torch

    from ..optim import StiefelAdam, StiefelMuon
    from ..optim._muon import DEFAULT_DIRECTION_TOL

    tol = DEFAULT_DIRECTION_TOL[torch.float32] if direction_tol is None else direction_tol
    results = []
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for width in widths:
            depth, heads = MUON_CONFIGS[width]
            steps = {}
            params, grads = _frames(width, depth, heads, device=device)
            steps["stiefel-muon"] = _stepper(StiefelMuon(params, lr=1e-3, direction_tol=tol), params, grads)
            params, grads = _frames(width, depth, heads, device=device)
            steps["stiefel-adam"] = _stepper(StiefelAdam(params, lr=1e-3), params, grads)
            flat = [torch.nn.Parameter(h.detach().clone()) for p in _frames(width, depth, heads, device=device)[0]
                    for h in p]
            flat_grads = [torch.randn_like(p) for p in flat]
            steps["torch-muon"] = _stepper(torch.optim.Muon(flat, lr=1e-3, adjust_lr_fn="match_rms_adamw"),
                                           flat, flat_grads)
            plain = [torch.nn.Parameter(p.detach().clone()) for p in _frames(width, depth, heads, device=device)[0]]
            plain_grads = [torch.randn_like(p) for p in plain]
            steps["adamw"] = _stepper(torch.optim.AdamW(plain, lr=1e-3, foreach=True), plain, plain_grads)
            times = _interleaved_min(steps, rounds, device=device)
            ratios = {name: times["stiefel-muon"] / t for name, t in times.items() if name != "stiefel-muon"}
            results.append(MuonStepResult(width, depth, heads, width // heads, times, ratios, None, None, rounds,
                                          threads, tol))
    finally:
        torch.set_num_threads(previous)
    return results


def cheapest_setting(rows: Sequence[SolverRow], target: float = GAP_TARGET) -> tuple[int, int] | None:
    """The solver setting whose worst gap is below ``target`` at every width in ``rows`` with the smallest total
    step time over those widths; ``None`` if no setting meets the target everywhere."""
    by_setting: dict[tuple[int, int], list[SolverRow]] = {}
    for row in rows:
        by_setting.setdefault((row.dual_steps, row.ns_steps), []).append(row)
    ok = {key: sum(r.step_ms for r in group) for key, group in by_setting.items()
          if all(r.worst_gap < target for r in group)}
    return min(ok, key=ok.get) if ok else None


def format_muon_table(results: Sequence[MuonStepResult]) -> str:
    """A Markdown table of :func:`muon_step_benchmark`: times (ms, minimum over rounds) and StiefelMuon's ratios."""
    lines = ["| width | heads x d x r | StiefelMuon | StiefelAdam | torch Muon | AdamW | / StiefelAdam | / torch Muon "
             "| / AdamW | solver |", "|---" * 10 + "|"]
    for res in results:
        t, q = res.times_ms, res.ratios
        lines.append(f"| {res.width} | {res.heads} x {res.width} x {res.head_dim} | {t['stiefel-muon']:.2f} | "
                     f"{t['stiefel-adam']:.2f} | {t['torch-muon']:.2f} | {t['adamw']:.2f} | {q['stiefel-adam']:.1f}x "
                     f"| {q['torch-muon']:.2f}x | {q['adamw']:.1f}x | {_solver_label(res)} |")
    return "\n".join(lines)


def _solver_label(res: MuonStepResult) -> str:
    if res.dual_steps is not None:  # committed before issue 56
        return f"dual_steps={res.dual_steps}, ns_steps={res.ns_steps}"
    return f"certified, direction_tol={res.direction_tol:g}"


def format_solver_table(rows: Sequence[SolverRow]) -> str:
    """A Markdown table of :func:`solver_table`, with the setting :func:`cheapest_setting` chooses marked."""
    best = cheapest_setting(rows)
    lines = ["| width (d x r) | dual_steps | ns_steps | worst gap | median gap | step (ms) |", "|---" * 6 + "|"]
    for row in rows:
        mark = " **(default)**" if (row.dual_steps, row.ns_steps) == best else ""
        lines.append(f"| {row.width} ({row.d} x {row.r}) | {row.dual_steps}{mark} | {row.ns_steps} | "
                     f"{row.worst_gap:.1e} | {row.median_gap:.1e} | {row.step_ms:.1f} |")
    return "\n".join(lines)
