"""Epochs per second of the grokking study: the study's part of the accelerator check (``benchmarks/gpu.sh``).

``stiefel-attention bench`` measures the library (the optimizer step, its code paths, a training step); how
fast a study trains is the study's own figure, so it lives with the studies. ``benchmarks/gpu.sh`` runs
``stiefel-attention bench gpu`` and then ``python -m experiments.grokking.speed`` with the
same flags, which adds a ``grokking`` entry (and its seconds) to the JSON file the check wrote.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

__all__ = ["GROKKING_SCALES", "grokking_speed", "main"]

#: ``--scale`` of the accelerator check -> (GrokkingConfig overrides, epochs per arm).
GROKKING_SCALES: dict[str, tuple[dict[str, Any], int]] = {
    "default": ({}, 300),
    "tiny": (dict(p=7, width=16, heads=2, mlp=32), 5),
}


def grokking_speed(device: str = "cpu", *, epochs: int = 300, arms: tuple[str, ...] = ("adamw", "stiefel"),
                   seed: int = 0, threads: int | None = None, workdir: str | None = None,
                   **config: Any) -> dict[str, float]:
    """Epochs per second of the grokking study's runs (its model, data and the shared training loop,
    full batch, evaluated at the first and last epoch) for ``epochs`` epochs of each arm.

    ``config`` overrides :class:`~experiments.grokking.study.GrokkingConfig` fields (the
    study's defaults otherwise). Run folders go to a temporary directory unless ``workdir`` is given; torch's
    thread count is restored afterwards.
    """
    import tempfile

    import torch

    from ..harness.config import RunSpec, TrainConfig
    from ..harness.runner import train_run
    from .study import GrokkingConfig, build_task

    cfg = GrokkingConfig(train=TrainConfig(epochs=epochs, eval_every=epochs), **config)
    speeds = {}
    previous = torch.get_num_threads()
    try:
        with tempfile.TemporaryDirectory(dir=workdir) as tmp:
            for arm in arms:
                result = train_run(RunSpec(cfg, arm, seed), build_task, Path(tmp) / arm, device=device, quiet=True,
                                   threads=threads)
                speeds[arm] = result.epochs_per_second
    finally:
        torch.set_num_threads(previous)
    return speeds


def main(argv: list[str] | None = None) -> int:
    """Add the grokking study's epochs per second to the accelerator check's JSON ``--out`` (flags of
    ``stiefel-attention bench`` that this part does not use are accepted and ignored)."""
    parser = argparse.ArgumentParser(prog="python -m experiments.grokking.speed",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", choices=tuple(GROKKING_SCALES), default="default")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="the JSON file `stiefel-attention bench gpu` wrote")
    args, _ = parser.parse_known_args(argv)
    overrides, epochs = GROKKING_SCALES[args.scale]
    t0 = time.perf_counter()
    speeds = grokking_speed(args.device, epochs=epochs, seed=args.seed, threads=args.threads, **overrides)
    path = Path(args.out)
    doc = json.loads(path.read_text())
    doc["grokking"] = dict(epochs=epochs, epochs_per_second=speeds)
    doc.setdefault("seconds", {})["grokking"] = time.perf_counter() - t0
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"grokking, {epochs} epochs: " + ", ".join(f"{a} {v:.1f} epochs/s" for a, v in speeds.items())
          + f"\nwritten to {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
