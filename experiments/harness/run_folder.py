r"""A run's folder, the record side of :func:`~.runner.train_run`: its files (``config.json``, ``environment.json``,
``checkpoint.pt``, ``steps.jsonl``, the lock), the config check that refuses a folder trained with other flags, the
environment each call records, checkpoints written atomically, and the advisory lock that keeps two processes out
of one folder. :mod:`.records` reads and appends ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from geoopt_stiefel_attention.convert import parametrized_state_dict

from .config import RunSpec, flag_of, to_dict, with_current_config_class
from .records import METRICS_FILE, read_records

__all__ = ["CHECKPOINT_FILE", "CONFIG_FILE", "ConfigMismatchError", "ENVIRONMENT_FILE", "LOCK_FILE",
           "RunLockedError", "STEPS_FILE", "STEP_DIGITS", "check_run_dir", "environment_info"]

CONFIG_FILE = "config.json"
CHECKPOINT_FILE = "checkpoint.pt"
ENVIRONMENT_FILE = "environment.json"
#: Every training step's record (``Task.record_steps``): one JSON line per step, ``{"step", "loss", "grad_norm",
#: ...}`` with ``step`` the 0-based optimizer step, ``loss`` its training loss, ``grad_norm`` the global gradient
#: norm before clipping, and the values of the task's :class:`~.metrics.StepHook` s; floats to
#: :data:`STEP_DIGITS` significant digits.
STEPS_FILE = "steps.jsonl"
STEP_DIGITS = 6
LOCK_FILE = ".lock"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _cpu_model() -> str | None:
    """The CPU's model name from ``/proc/cpuinfo`` (Linux), else ``None``: float32 kernels round differently
    on different CPUs, and long runs such as grokking amplify that, so records name the CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def environment_info(device: torch.device) -> dict[str, Any]:
    """Versions, device, threads and git state, for ``environment.json``."""
    import geoopt
    import numpy

    from geoopt_stiefel_attention import __version__

    # uncommitted changes to anything but the committed records (experiments/<study>/records/, before 2026-12-05
    # studies/): records committed while studies train would otherwise mark every call
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                  ":(top,exclude,glob)experiments/*/records/**")
    info = {
        "geoopt_stiefel_attention": __version__,
        "git_sha": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "geoopt": geoopt.__version__,
        "numpy": numpy.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch_threads": torch.get_num_threads(),
    }
    return info


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _normalise(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


def _differences(have: Any, want: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """``(dotted path, value in have, value in want)`` for every leaf where two JSON objects differ."""
    if isinstance(have, dict) and isinstance(want, dict):
        out = []
        for key in sorted(set(have) | set(want)):
            out += _differences(have.get(key), want.get(key), f"{prefix}.{key}" if prefix else key)
        return out
    return [] if have == want else [(prefix, have, want)]


class ConfigMismatchError(ValueError):
    """A run folder holds a run with other settings; ``differences`` lists ``(path, there, now)``."""

    def __init__(self, message: str, differences: Sequence[tuple[str, Any, Any]] = ()) -> None:
        super().__init__(message)
        self.differences = tuple(differences)


def _epochs_extendable(config: Any) -> bool:
    """Whether a finished run of ``config`` may be continued to more epochs: a study whose schedule depends on
    the total number of epochs (a cosine decay) says no through ``config.epochs_extendable``."""
    return bool(getattr(config, "epochs_extendable", True))


def check_run_dir(run_dir: str | os.PathLike, spec: RunSpec) -> int | None:
    """Check a run folder's ``config.json`` (if any) against ``spec`` without writing anything.

    Returns ``None`` when the folder is new or holds the same run, and the run's old number of epochs when the
    only difference is a larger ``train.epochs`` that extends it. Raises :class:`ConfigMismatchError` naming the
    differing flags otherwise.
    """
    run_dir = Path(run_dir)
    path = run_dir / CONFIG_FILE
    if not path.exists():
        return None
    want = _normalise(to_dict(spec))
    have = with_current_config_class(json.loads(path.read_text()))
    if have == want:
        return None
    diffs = _differences(have, want)
    if [d[0] for d in diffs] == ["config.train.epochs"]:
        old, new = diffs[0][1], diffs[0][2]
        if isinstance(old, int) and isinstance(new, int) and new > old and _epochs_extendable(spec.config):
            if not (run_dir / CHECKPOINT_FILE).exists() and (run_dir / METRICS_FILE).exists():
                # records kept without their checkpoint (e.g. committed): nothing to continue from
                raise ConfigMismatchError(
                    f"{run_dir} holds the records of a run of {old} epochs but no {CHECKPOINT_FILE} to continue "
                    f"from, so it cannot be extended to {new}: use --epochs {old} (its records are kept as they "
                    f"are) or train the longer run in another --out folder.", diffs)
            return old
        why = (f"--epochs {new} is not more than the run's {old}" if not (isinstance(old, int) and new > old) else
               "its learning-rate schedule depends on the total number of epochs (use --lr-schedule constant "
               "to extend runs)")
        raise ConfigMismatchError(f"{run_dir} holds a run of {old} epochs that cannot be continued to {new}: {why}. "
                                  f"Use --epochs {old} to resume it, another --out folder, or delete {run_dir}.",
                                  diffs)
    listed = "; ".join(f"{flag_of(p)} is {json.dumps(a)} there, {json.dumps(b)} now" for p, a, b in diffs)
    flags = sorted({flag_of(p) for p, _, _ in diffs})
    raise ConfigMismatchError(f"{run_dir} holds a run with other settings ({listed}); rerun with the run's "
                              f"{', '.join(flags)} to resume it, use another --out folder, or delete {run_dir} "
                              f"to start afresh.", diffs)


def _check_or_write_config(run_dir: Path, spec: RunSpec) -> int | None:
    """:func:`check_run_dir`, then write ``config.json`` when it is new or extended (returns the old epochs)."""
    path = run_dir / CONFIG_FILE
    extended_from = check_run_dir(run_dir, spec)
    if extended_from is not None or not path.exists():
        _write_json_atomic(path, _normalise(to_dict(spec)))
    return extended_from


def _save_checkpoint(path: Path, *, model: torch.nn.Module, optimizer: Any, epoch: int, step: int,
                     n_records: int, completed: bool, device: torch.device) -> None:
    state = {
        # frames and log-gains as stored (a stiefelized model's state_dict() is the stock form, whose gains
        # come back only to float rounding): a resumed run continues bit for bit
        "model": parametrized_state_dict(model),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "step": step,
        "n_records": n_records,
        "completed": completed,
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _load_environment(path: Path) -> list[dict[str, Any]]:
    if path.exists():
        try:
            calls = json.loads(path.read_text())
            if isinstance(calls, list):
                return calls
        except json.JSONDecodeError:
            pass
    return []


class RunLockedError(RuntimeError):
    """Another process is training the same run folder."""


class _RunLock:
    """Exclusive advisory lock on ``run_dir/.lock`` for the duration of a training call.

    Two processes appending to the same ``metrics.jsonl`` and overwriting the same checkpoint would corrupt
    the records (one truncates what the other appended). ``fcntl.flock`` is released by the kernel when the
    holder exits, so a crashed run never leaves a stale lock. Where ``fcntl`` is unavailable (Windows) the
    lock is a no-op.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self._fh = None

    def __enter__(self) -> _RunLock:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - non-POSIX
            return self
        fh = open(self.path, "a+")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            holder = fh.read().strip() or "unknown"
            fh.close()
            raise RunLockedError(f"{self.path.parent} is being trained by another process ({holder}); wait for it to "
                               f"finish (rerunning afterwards resumes), or use another --out folder.") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on {platform.node()}\n")
        fh.flush()
        self._fh = fh
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fh is not None:
            self._fh.close()  # closing the descriptor releases the flock
            self._fh = None


def _truncate_steps(path: Path, step: int) -> None:
    """Keep the step records of ``path`` before ``step`` (on resume, later steps are trained and written again)."""
    if path.exists():
        kept = [r for r in read_records(path) if r["step"] < step]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, path)
