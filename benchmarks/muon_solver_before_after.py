"""StiefelMuon's direction solver before and after issue 56, timed in one process, interleaved, at the bench widths.

"Before" is the fixed-count dual descent of commit 38fe98e (``optim/_muon.py`` there: ``dual_steps=10,
ns_steps=8``), imported from a temporary copy of that file (``git show``); "after" is the certified solver of this
checkout (:func:`geoopt_stiefel_attention.optim.muon_direction`, ``direction_tol`` at its float32 default). Timed,
each the minimum over interleaved rounds (``bench.muon._interleaved_min``), float32, one intra-op thread:

- ``direction-before`` / ``direction-after``: the direction alone, on the frames of the width's configuration
  (``bench.muon.MUON_CONFIGS``: 2 x depth parameters of ``heads`` frames, stacked) and tangent Gaussian momenta;
- ``step-before`` / ``step-after``: one StiefelMuon step of the configuration, the optimizer of this checkout with
  its direction solver swapped for the old one (everything else the same).

Also printed: the worst relative shortfall ``1 - <M, A> / (max(1, ||A||_2) OPT)`` of each direction (``OPT`` =
``muon_direction_reference`` in float64) on Gaussian and on 1/i-spectrum momenta, and on 10 x 9 frames.

Usage::

    python benchmarks/muon_solver_before_after.py --widths 128 256 512 768 --rounds 5 --out results.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from geoopt_stiefel_attention.bench.muon import MUON_CONFIGS, _frames, _interleaved_min, _stepper  # noqa: E402
from geoopt_stiefel_attention.optim import StiefelMuon, muon_direction, muon_direction_reference  # noqa: E402
from geoopt_stiefel_attention.optim import muon as muon_module  # noqa: E402
from geoopt_stiefel_attention.optim._muon import DirectionSolve  # noqa: E402

BEFORE = "38fe98e"


def load_before(commit: str = BEFORE):
    """The ``optim/_muon.py`` of ``commit`` as a module (its relative import of ``_linalg`` made absolute)."""
    text = subprocess.run(["git", "show", f"{commit}:geoopt_stiefel_attention/optim/_muon.py"], cwd=REPO,
                          check=True, capture_output=True, text=True).stdout
    text = text.replace("from .. import _linalg", "from geoopt_stiefel_attention import _linalg")
    path = Path(tempfile.mkdtemp()) / f"muon_{commit}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"muon_{commit}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _problem(d, r, n, seed, spectrum):
    gen = torch.Generator().manual_seed(seed)
    w = torch.linalg.qr(torch.randn(n, d, r, generator=gen, dtype=torch.float64)).Q
    if spectrum == "1/i":
        u = torch.linalg.qr(torch.randn(n, d, r, generator=gen, dtype=torch.float64)).Q
        v = torch.linalg.qr(torch.randn(n, r, r, generator=gen, dtype=torch.float64)).Q
        m = (u / torch.arange(1, r + 1, dtype=torch.float64)) @ v.mT
    else:
        m = torch.randn(n, d, r, generator=gen, dtype=torch.float64)
    return w, m - w @ (0.5 * (w.mT @ m + m.mT @ w))


def shortfall(m, w, a) -> float:
    """Worst ``1 - <M, A> / (max(1, ||A||_2) OPT)`` over the frames (float64)."""
    a = a.double()
    _, opt = muon_direction_reference(m, w)
    value = (m * a).sum((-2, -1)) / torch.linalg.matrix_norm(a, ord=2).clamp_min(1.0)
    return float((1.0 - value / opt.flatten()).max())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 256, 512, 768])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    old = load_before()

    def old_solver(m, w, *, tol=None, max_steps=None, synchronize=True):
        a, gap = old.muon_direction(m, w, iterations=10, ns_steps=8)
        return DirectionSolve(a, gap, gap.abs() + 1.0, torch.ones_like(gap, dtype=torch.bool), 88)

    torch.set_num_threads(args.threads)
    rows = []
    for width in args.widths:
        depth, heads = MUON_CONFIGS[width]
        d, r, n = width, width // heads, 2 * depth * heads
        w64, m64 = _problem(d, r, n, 0, "gaussian")
        w32, m32 = w64.float(), m64.float()
        steps = {
            "direction-before": lambda m=m32, w=w32: old.muon_direction(m, w, iterations=10, ns_steps=8),
            "direction-after": lambda m=m32, w=w32: muon_direction(m, w),
        }
        params, grads = _frames(width, depth, heads)
        step_after = _stepper(StiefelMuon(params, lr=1e-3), params, grads)
        params_b, grads_b = _frames(width, depth, heads)
        step_before_inner = _stepper(StiefelMuon(params_b, lr=1e-3), params_b, grads_b)

        def step_before(inner=step_before_inner):
            muon_module.muon_direction = old_solver
            try:
                inner()
            finally:
                muon_module.muon_direction = muon_direction

        steps["step-before"], steps["step-after"] = step_before, step_after
        times = _interleaved_min(steps, args.rounds)
        quality = {}
        for spectrum in ("gaussian", "1/i"):
            wq, mq = _problem(d, r, min(n, 32), 1, spectrum)
            quality[spectrum] = {
                "before": shortfall(mq, wq, old.muon_direction(mq.float(), wq.float(), iterations=10, ns_steps=8)[0]),
                "after": shortfall(mq, wq, muon_direction(mq.float(), wq.float()).direction)}
        row = {"width": width, "frames": f"{n} x {d} x {r}", "times_ms": times,
               "ratio_direction": times["direction-after"] / times["direction-before"],
               "ratio_step": times["step-after"] / times["step-before"], "shortfall_float32": quality}
        rows.append(row)
        print(f"width {width} ({row['frames']}): direction {times['direction-before']:.1f} -> "
              f"{times['direction-after']:.1f} ms ({row['ratio_direction']:.2f}x), step {times['step-before']:.1f} "
              f"-> {times['step-after']:.1f} ms ({row['ratio_step']:.2f}x); shortfall gaussian "
              f"{quality['gaussian']['before']:.1e} -> {quality['gaussian']['after']:.1e}, 1/i "
              f"{quality['1/i']['before']:.1e} -> {quality['1/i']['after']:.1e}", flush=True)
    w, m = _problem(10, 9, 16, 2, "gaussian")
    near_square = {"before": shortfall(m, w, old.muon_direction(m, w, iterations=10, ns_steps=8)[0]),
                   "after": shortfall(m, w, muon_direction(m, w).direction)}
    print(f"10 x 9 frames, float64: shortfall {near_square['before']:.1e} -> {near_square['after']:.1e}")
    if args.out:
        args.out.write_text(json.dumps({"before": BEFORE, "threads": args.threads, "rounds": args.rounds,
                                        "rows": rows, "near_square_float64": near_square}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
