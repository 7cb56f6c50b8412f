"""Long-run drift and low-precision movement of StiefelAdam frames.

Two measurements, both on a stack of frames of shape ``--shape`` (default 4 x 32 x 8) without ``stabilize``:

1. **Drift.** ``--steps`` steps (default 100,000) with fresh random Gaussian gradients (drawn in float64 and cast
   to the frame dtype) at ``--lr``; reports ``max |W^T W - I|`` of the parameter at the end and the largest value
   seen at 20 evenly spaced checkpoints, for float64, float32, bf16 and fp16 frames, the low-precision ones
   with and without ``master_weights=True`` (then also the error of the float32 master copy).
2. **Movement.** ``--movement-steps`` steps (default 1,000) of noisy descent towards a target frame C,
   ``G = (W - C) + N/2``, at each learning rate of ``--movement-lrs``; reports how far each variant travelled,
   ``||W_T - W_0||_F``, relative to float32, and its distance from the float32 end point relative to the float32
   travel. A bf16 parameter is re-rounded after every step, so a step smaller than half a bf16 spacing per entry
   is lost; the float32 master copy keeps it.

``--lr`` is a frame's step norm (``--adjust-lr-fn original``, the paper's step, the default here: the figures in
docs/guarantees.md were measured so); under ``match_rms_adamw`` (StiefelAdam's default) the same update runs at
``lr * sqrt(d r)``.

Prints two tables (or JSON with ``--json``). Example (the figures in docs/guarantees.md)::

    python benchmarks/drift.py --steps 100000
    python benchmarks/drift.py --steps 2000 --movement-steps 300   # a quick look
"""

from __future__ import annotations

import argparse
import json
import time

import geoopt
import torch

from geoopt_stiefel_attention import PolarStiefel, StiefelAdam
from geoopt_stiefel_attention._linalg import orthonormality_error

VARIANTS = [
    ("float64", torch.float64, False),
    ("float32", torch.float32, False),
    ("bfloat16", torch.bfloat16, False),
    ("bfloat16+master", torch.bfloat16, True),
    ("float16", torch.float16, False),
    ("float16+master", torch.float16, True),
]


def _start(shape, seed):
    return PolarStiefel().random(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def drift(dtype, master, *, steps, lr, shape, seed=7, checkpoints=20, adjust_lr_fn="original"):
    """Run ``steps`` random-gradient steps; return the orthonormality errors and the time per step."""
    w = geoopt.ManifoldParameter(_start(shape, seed).to(dtype), manifold=PolarStiefel())
    opt = StiefelAdam([w], lr=lr, master_weights=master, adjust_lr_fn=adjust_lr_fn)
    gen = torch.Generator().manual_seed(seed + 1)
    every = max(1, steps // checkpoints)
    worst = 0.0
    start = time.perf_counter()
    for k in range(1, steps + 1):
        w.grad = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        opt.step()
        if k % every == 0:
            worst = max(worst, float(orthonormality_error(w)))
    elapsed = time.perf_counter() - start
    final = float(orthonormality_error(w))
    master_err = float(orthonormality_error(opt.state[w]["master"])) if "master" in opt.state[w] else None
    return {"final": final, "worst": max(worst, final), "master": master_err, "ms_per_step": 1e3 * elapsed / steps}


def movement(dtype, master, *, steps, lr, shape, seed=11, adjust_lr_fn="original"):
    """Noisy descent towards a target frame; return the final frame (float64) and the start."""
    gen = torch.Generator().manual_seed(seed)
    start = _start(shape, seed + 1)
    target = _start(shape, seed + 2)
    w = geoopt.ManifoldParameter(start.to(dtype), manifold=PolarStiefel())
    opt = StiefelAdam([w], lr=lr, master_weights=master, adjust_lr_fn=adjust_lr_fn)
    for _ in range(steps):
        noise = torch.randn(shape, generator=gen, dtype=torch.float64)
        w.grad = ((w.detach().double() - target) + 0.5 * noise).to(dtype)
        opt.step()
    return w.detach().double(), start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000, help="drift steps (default 100000)")
    parser.add_argument("--lr", type=float, default=1e-2, help="learning rate of the drift runs")
    parser.add_argument("--shape", type=int, nargs=3, default=[4, 32, 8], metavar=("N", "D", "R"))
    parser.add_argument("--movement-steps", type=int, default=1000)
    parser.add_argument("--movement-lrs", type=float, nargs="+", default=[1e-2, 1e-3, 1e-4])
    parser.add_argument("--variants", nargs="+", default=[name for name, _, _ in VARIANTS],
                        choices=[name for name, _, _ in VARIANTS])
    parser.add_argument("--adjust-lr-fn", choices=["original", "match_rms_adamw"], default="original",
                        help="what --lr measures: a frame's step norm (original, the default here) or a per-entry "
                             "step (match_rms_adamw, StiefelAdam's default)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = tuple(args.shape)
    variants = [v for v in VARIANTS if v[0] in args.variants]

    rule = args.adjust_lr_fn
    drift_rows = {name: drift(dtype, master, steps=args.steps, lr=args.lr, shape=shape, adjust_lr_fn=rule)
                  for name, dtype, master in variants}

    movement_rows = []
    for lr in args.movement_lrs:
        ref, start = movement(torch.float32, False, steps=args.movement_steps, lr=lr, shape=shape,
                              adjust_lr_fn=rule)
        travel = float((ref - start).norm())
        for name, dtype, master in variants:
            w, _ = movement(dtype, master, steps=args.movement_steps, lr=lr, shape=shape, adjust_lr_fn=rule)
            movement_rows.append({"lr": lr, "variant": name, "travel": float((w - start).norm()),
                                  "travel_vs_float32": float((w - start).norm()) / travel,
                                  "distance_to_float32_end": float((w - ref).norm()) / travel})

    if args.json:
        print(json.dumps({"shape": shape, "drift": {"steps": args.steps, "lr": args.lr, "rows": drift_rows},
                          "movement": {"steps": args.movement_steps, "rows": movement_rows}}, indent=2))
        return 0
    print(f"Drift: {args.steps} steps, random gradients, lr={args.lr} ({rule}), frames {shape}, no stabilize")
    print(f"{'variant':<17} {'max|WtW-I| end':>15} {'worst seen':>11} {'master copy':>12} {'ms/step':>8}")
    for name, row in drift_rows.items():
        master = "-" if row["master"] is None else f"{row['master']:.2e}"
        print(f"{name:<17} {row['final']:>15.2e} {row['worst']:>11.2e} {master:>12} {row['ms_per_step']:>8.3f}")
    print()
    print(f"Movement: {args.movement_steps} steps of noisy descent towards a target frame, frames {shape}")
    print(f"{'lr':>8} {'variant':<17} {'travel':>8} {'travel / f32':>13} {'|W - W_f32| / f32 travel':>25}")
    for row in movement_rows:
        print(f"{row['lr']:>8g} {row['variant']:<17} {row['travel']:>8.4f} {row['travel_vs_float32']:>13.3f} "
              f"{row['distance_to_float32_end']:>25.3e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
