r"""The one training loop shared by every study, read top-down in :func:`train_run`: plan (check the arm, lock the
folder, check or write its config: :mod:`.run_folder`), build, resume, then train and record. The parallel runner of
a study's (arm, seed) jobs is :mod:`.jobs`; what a run folder holds, and its checks, is :mod:`.run_folder`.

A study provides ``build_task(spec, arm, device) -> Task``: the model (built from ``spec.seed`` with the
arm's attention), a training batch source, named evaluation sets, the parameter grouping, and metric
hooks. :func:`train_run` does the rest:

1. writes ``config.json`` (or checks it against the one already there) and ``environment.json`` (versions,
   device, threads, git SHA, timing of each call);
2. seeds torch's global generator with the run's seed, builds the task, lets the arm prepare the model,
   calls every hook's ``on_start``, builds the optimizer;
3. resumes from ``checkpoint.pt`` when there is one (model, optimizer, RNG state, epoch, number of records;
   ``metrics.jsonl`` is cut back to the records the checkpoint had seen);
4. trains: for each epoch, each batch: ``zero_grad``, loss of ``predict(model, x)`` against ``y``,
   ``backward``, optional gradient-norm clipping, ``step``; after epoch 0, every ``eval_every`` epochs and after the last, evaluates every
   named set under ``torch.inference_mode`` and appends one JSON line to ``metrics.jsonl``; with
   ``Task.record_steps``, every step also gets a line in ``steps.jsonl`` (:data:`STEPS_FILE`);
5. checkpoints atomically at evaluations (at most every ``checkpoint_interval_s`` seconds), when stopped by
   ``stop_after_epochs``, and at the end.

Because the batches of an epoch depend only on ``(seed, epoch)`` and the checkpoint holds the complete
state, a run resumed from any checkpoint writes the same records as an uninterrupted one (same device,
same thread count).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from .arms import Arm, check_arm, default_param_groups, get_arm
from .batches import BatchSource
from .config import RunSpec
from .metrics import MetricHook, StepHook
from .records import METRICS_FILE, append_record, read_records, truncate_records
from .run_folder import (
    CHECKPOINT_FILE,
    ENVIRONMENT_FILE,
    STEP_DIGITS,
    STEPS_FILE,
    _check_or_write_config,
    _load_environment,
    _RunLock,
    _save_checkpoint,
    _truncate_steps,
    _write_json_atomic,
    environment_info,
)

__all__ = ["RunResult", "Task", "TaskBuilder", "TrainingInterrupted", "resolve_device", "train_run"]

def _default_predict(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    return model(inputs)


@dataclass
class Task:
    """What a study hands to the training loop for one run.

    Parameters
    ----------
    model : torch.nn.Module
        Built from the run's seed with the arm's attention (:attr:`Arm.attention`).
    train_data : BatchSource
        ``batches(epoch)`` yields the ``(inputs, targets)`` of training epoch ``epoch`` (0-based).
    eval_data : mapping of str to BatchSource
        Named evaluation sets, e.g. ``{"train": ..., "val": ...}``; each adds ``<name>_loss`` and
        ``<name>_acc`` to the records.
    predict : callable, optional
        ``predict(model, inputs) -> logits (B, C)``; default ``model(inputs)``.
    loss : callable, optional
        ``loss(logits, targets) -> mean loss``; default cross-entropy.
    param_groups : callable, optional
        ``param_groups(model, weight_decay) -> list of group dicts``; default
        :func:`~experiments.harness.arms.default_param_groups`.
    hooks : sequence of MetricHook
        Extra per-evaluation metrics.
    lr_factor : callable, optional
        ``lr_factor(step) -> float`` multiplies every group's initial ``lr`` before optimizer step ``step``
        (0-based): warm-up or decay schedules.
    grad_clip : float, optional
        Clip the global gradient norm over every parameter of the model to this value before each step
        (:func:`torch.nn.utils.clip_grad_norm_`); ``None``: no clipping.
    derived : callable, optional
        ``derived(values) -> dict`` adds values computed from an evaluation's ``<set>_loss``/``<set>_acc``
        to its record (e.g. bits per byte from a per-byte loss).
    record_steps : bool
        Write every step's training loss and gradient norm (before clipping), with the values of
        ``step_hooks``, to ``steps.jsonl`` (:data:`STEPS_FILE`). Reads what the step computes anyway; it does not
        change the training.
    step_hooks : sequence of StepHook
        Extra per-step values, read from the training forward (``record_steps`` only).
    """

    model: torch.nn.Module
    train_data: BatchSource
    eval_data: Mapping[str, BatchSource]
    predict: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = _default_predict
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.nn.functional.cross_entropy
    param_groups: Callable[[torch.nn.Module, float], list[dict[str, Any]]] = default_param_groups
    hooks: Sequence[MetricHook] = field(default_factory=tuple)
    lr_factor: Callable[[int], float] | None = None
    grad_clip: float | None = None
    derived: Callable[[dict[str, float]], dict[str, float]] | None = None
    record_steps: bool = False
    step_hooks: Sequence[StepHook] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.grad_clip is not None and not (isinstance(self.grad_clip, (int, float))
                                               and not isinstance(self.grad_clip, bool) and self.grad_clip > 0):
            raise ValueError(f"Task: grad_clip={self.grad_clip!r} must be a float > 0 or None (--grad-clip).")


#: ``build_task(spec, arm, device) -> Task``; must be a module-level function for ``workers > 1``.
TaskBuilder = Callable[[RunSpec, Arm, torch.device], Task]


@dataclass(frozen=True)
class RunResult:
    """Outcome of one :func:`train_run` call.

    ``completed`` is ``True`` once the run has reached its last epoch (possibly in an earlier call);
    ``seconds`` and ``epochs_per_second`` time this call only (training and evaluation together).
    """

    name: str
    run_dir: str
    completed: bool
    start_epoch: int
    epoch: int
    n_records: int
    seconds: float
    epochs_per_second: float | None
    final_record: dict[str, Any] | None


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"``: CUDA when available, else CPU; anything else is passed to :class:`torch.device`."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} asks for CUDA, but torch sees no GPU; use --device cpu or auto.")
    return dev


@dataclass
class _Run:
    """The mutable state of one :func:`train_run` call."""

    spec: RunSpec
    run_dir: Path
    device: torch.device
    task: Task
    model: torch.nn.Module
    optimizer: Any
    epoch: int = 0
    step: int = 0
    n_records: int = 0
    checkpoint_epoch: int | None = None
    last_record: dict[str, Any] | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)  # step records not yet written

    @property
    def completed(self) -> bool:
        return self.epoch >= self.spec.config.train.epochs


def train_run(spec: RunSpec, build_task: TaskBuilder, run_dir: str | os.PathLike, *, device: str = "auto",
              threads: int | None = None, quiet: bool = False, stop_after_epochs: int | None = None,
              checkpoint_interval_s: float = 30.0, progress_position: int | None = None) -> RunResult:
    """Train one run (or resume it), writing records and checkpoints under ``run_dir``.

    Parameters
    ----------
    spec : RunSpec
        Study config, arm and seed.
    build_task : callable
        The study's ``build_task(spec, arm, device) -> Task``.
    run_dir : path
        The run's folder; created if missing. A folder with a checkpoint resumes. One whose ``config.json``
        differs from ``spec`` is refused (:class:`ConfigMismatchError`, naming the differing flags), except
        for a larger ``train.epochs``: the run is then continued from its checkpoint to the new length
        (unless the config sets ``epochs_extendable = False``).
    device : str, default "auto"
        ``"auto"`` (CUDA when present, else CPU), ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...
    threads : int, optional
        ``torch.set_num_threads(threads)`` for this process; ``None`` keeps torch's setting.
    quiet : bool, default False
        No progress bar.
    stop_after_epochs : int, optional
        Train at most this many epochs in this call, then checkpoint and return (``completed=False``
        unless the run ended): interruption on purpose, for tests and time-sliced jobs.
    checkpoint_interval_s : float, default 30
        Minimum seconds between the checkpoints taken at evaluations (the last one is always taken).
    progress_position : int, optional
        ``position`` of the tqdm bar (parallel bars).

    Returns
    -------
    RunResult

    Raises
    ------
    RuntimeError
        When another process is training the same ``run_dir`` (an advisory ``flock`` on ``run_dir/.lock``,
        released automatically when that process ends).
    TrainingInterrupted
        On Ctrl-C: the first one is honoured at the end of the current epoch, after a checkpoint; a
        ``KeyboardInterrupt`` in the middle of an epoch leaves the last checkpoint in place. Rerunning resumes.
    """
    if stop_after_epochs is not None and not (isinstance(stop_after_epochs, int) and stop_after_epochs > 0):
        raise ValueError(f"train_run: stop_after_epochs={stop_after_epochs!r} must be a positive int or None "
                         f"(--stop-after-epochs).")
    if threads is not None and not (isinstance(threads, int) and threads > 0):
        raise ValueError(f"train_run: threads={threads!r} must be a positive int or None (--threads).")
    dev = resolve_device(device)
    check_arm(spec.arm, spec.experiment, getattr(spec.config, "optim", None))
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with _RunLock(run_dir):
        if threads is not None:
            torch.set_num_threads(threads)
        extended_from = _check_or_write_config(run_dir, spec)
        return _train_locked(spec, build_task, run_dir, dev, quiet=quiet, stop_after_epochs=stop_after_epochs,
                             checkpoint_interval_s=checkpoint_interval_s, progress_position=progress_position,
                             extended_from=extended_from)


def _train_locked(spec: RunSpec, build_task: TaskBuilder, run_dir: Path, dev: torch.device, *, quiet: bool,
                  stop_after_epochs: int | None, checkpoint_interval_s: float, progress_position: int | None,
                  extended_from: int | None) -> RunResult:
    """:func:`train_run` once the folder is locked and its config checked: build, resume, then a loop over
    epochs (train one epoch; at evaluation epochs record, and checkpoint at most every
    ``checkpoint_interval_s``)."""
    run = _build(spec, build_task, run_dir, dev)
    _resume(run)
    start_epoch = run.epoch
    if run.completed:  # nothing to train: its records are final, and this call leaves them as they are
        return _result(spec, run, run_dir, start_epoch, seconds=0.0, done=0)
    calls = _log_call_start(run, extended_from)
    train_cfg = spec.config.train
    bar = _progress_bar(run, quiet, progress_position)
    t0 = last_ckpt = time.perf_counter()
    try:
        with _DeferredInterrupt() as ctrl_c:
            if run.epoch == 0 and run.n_records == 0:
                _record(run)
            while not run.completed:
                if stop_after_epochs is not None and run.epoch - start_epoch >= stop_after_epochs:
                    break
                eval_now = train_cfg.is_eval_epoch(run.epoch + 1)
                _train_epoch(run, eval_now)
                if eval_now:
                    _record(run)
                    now = time.perf_counter()
                    if run.completed or now - last_ckpt >= checkpoint_interval_s:
                        _checkpoint(run)
                        last_ckpt = now
                    if bar is not None:
                        bar.set_postfix({k: f"{run.last_record[k]:.3f}" for k in _progress_keys(run.last_record)},
                                        refresh=False)
                if bar is not None:
                    bar.update(1)
                if ctrl_c.requested:
                    _checkpoint(run)
                    raise _interrupted(run)
            if not run.completed:
                _checkpoint(run)
    except TrainingInterrupted:
        raise
    except KeyboardInterrupt:
        raise _interrupted(run) from None
    finally:
        if bar is not None:
            bar.close()
        seconds = time.perf_counter() - t0
        done = _log_call_end(run, calls, start_epoch, seconds)
    return _result(spec, run, run_dir, start_epoch, seconds=seconds, done=done)


def _build(spec: RunSpec, build_task: TaskBuilder, run_dir: Path, dev: torch.device) -> _Run:
    """Seed, build the task and the model, let the arm prepare it, start the hooks, build the optimizer."""
    arm = get_arm(spec.arm, spec.experiment)
    torch.manual_seed(spec.seed)
    task = build_task(spec, arm, dev)
    model = task.model.to(dev)
    if arm.prepare is not None:
        arm.prepare(model)
    for hook in task.hooks:
        hook.on_start(model)
    optimizer = arm.build(model, task.param_groups(model, spec.config.optim.weight_decay), spec.config.optim)
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
    if task.record_steps:
        for hook in task.step_hooks:
            hook.attach(model)
    return _Run(spec=spec, run_dir=run_dir, device=dev, task=task, model=model, optimizer=optimizer)


def _resume(run: _Run) -> None:
    """Load ``checkpoint.pt`` when there is one (cutting ``metrics.jsonl`` back to the records it had seen).

    Without one: records that reach the run's last epoch are a finished run whose checkpoint was not kept (e.g.
    records committed to a repository); they are kept as they are and nothing is trained (extending such a run is
    refused before anything is written, by :func:`check_run_dir`). Other records (a run stopped before its first
    checkpoint) cannot be continued and are removed."""
    ckpt_path, metrics_path = run.run_dir / CHECKPOINT_FILE, run.run_dir / METRICS_FILE
    if not ckpt_path.exists() and metrics_path.exists():
        recs = read_records(metrics_path)
        if recs and recs[-1]["epoch"] >= run.spec.config.train.epochs:
            run.epoch, run.n_records, run.last_record = recs[-1]["epoch"], len(recs), recs[-1]
            return
    if ckpt_path.exists():
        state = torch.load(ckpt_path, map_location=run.device, weights_only=True)
        run.model.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng_cpu"])
        if state.get("rng_cuda") is not None and run.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng_cuda"], run.device)
        run.epoch, run.step, run.n_records = int(state["epoch"]), int(state["step"]), int(state["n_records"])
        run.checkpoint_epoch = run.epoch
        truncate_records(metrics_path, run.n_records)
        _truncate_steps(run.run_dir / STEPS_FILE, run.step)
    else:
        for path in (metrics_path, run.run_dir / STEPS_FILE):  # records without a checkpoint: start over
            path.unlink(missing_ok=True)


def _train_epoch(run: _Run, eval_now: bool) -> None:
    """One pass over the epoch's batches: ``zero_grad``, loss, ``backward``, ``step`` per batch (the hooks'
    ``before_last_step`` before the last step of an epoch that ends with an evaluation)."""
    task, model, optimizer = run.task, run.model, run.optimizer
    model.train()
    for (x, y), last in _with_last(task.train_data.batches(run.epoch)):
        if eval_now and last:
            for hook in task.hooks:
                hook.before_last_step(model)
        if task.lr_factor is not None:
            factor = float(task.lr_factor(run.step))
            for group in optimizer.param_groups:
                group["lr"] = group["initial_lr"] * factor
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss(task.predict(model, x), y)
        loss.backward()
        grad_norm = None
        if task.grad_clip is not None:  # returns the total norm before clipping
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), task.grad_clip)
        if task.record_steps:
            _step_record(run, loss.detach(), grad_norm)
        optimizer.step()
        run.step += 1
    run.epoch += 1


def _step_record(run: _Run, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
    """Buffer the record of the step just taken (:data:`STEPS_FILE`); :func:`_write_steps` writes it."""
    if grad_norm is None:
        grads = [p.grad for p in run.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    rec = {"step": run.step, "loss": float(loss), "grad_norm": float(grad_norm)}
    for hook in run.task.step_hooks:
        rec.update(hook.values())
    run.steps.append({k: _rounded(v) for k, v in rec.items()})


def _rounded(value: Any) -> Any:
    """``value`` (a float, or a list of them) to :data:`STEP_DIGITS` significant digits (modest file sizes)."""
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return float(f"{value:.{STEP_DIGITS}g}") if isinstance(value, float) else value


def _write_steps(run: _Run) -> None:
    """Append the buffered step records to ``steps.jsonl`` (at evaluations and checkpoints)."""
    if run.steps:
        with open(run.run_dir / STEPS_FILE, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in run.steps))
        run.steps.clear()


def _with_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


@torch.inference_mode()
def _evaluate(task: Task, model: torch.nn.Module) -> dict[str, float]:
    out: dict[str, float] = {}
    model.eval()
    for name, source in task.eval_data.items():
        loss_sum, correct, n = 0.0, 0, 0
        for x, y in source.batches(0):
            logits = task.predict(model, x)
            loss_sum += float(task.loss(logits, y)) * y.shape[0]
            correct += int((logits.argmax(dim=-1) == y).sum())
            n += y.shape[0]
        out[f"{name}_loss"] = loss_sum / n
        out[f"{name}_acc"] = correct / n
    return out


def _record(run: _Run) -> None:
    """Evaluate every named set and the hooks, and append one record to ``metrics.jsonl`` (and the buffered
    step records to ``steps.jsonl``)."""
    _write_steps(run)
    values = _evaluate(run.task, run.model)
    if run.task.derived is not None:
        values.update(run.task.derived(dict(values)))
    rec = {"experiment": run.spec.experiment, "arm": run.spec.arm, "seed": run.spec.seed, "epoch": run.epoch,
           "step": run.step, **values}
    with torch.no_grad():
        for hook in run.task.hooks:
            rec.update(hook.metrics(run.model))
    append_record(run.run_dir / METRICS_FILE, rec)
    run.n_records += 1
    run.last_record = rec


def _checkpoint(run: _Run) -> None:
    _write_steps(run)
    _save_checkpoint(run.run_dir / CHECKPOINT_FILE, model=run.model, optimizer=run.optimizer, epoch=run.epoch,
                     step=run.step, n_records=run.n_records, completed=run.completed, device=run.device)
    run.checkpoint_epoch = run.epoch


def _result(spec: RunSpec, run: _Run, run_dir: Path, start_epoch: int, *, seconds: float, done: int) -> RunResult:
    """The :class:`RunResult` of a call that trained ``done`` epochs in ``seconds``; the final record is read
    from ``metrics.jsonl`` when this call wrote none."""
    if run.last_record is None:
        recs = read_records(run_dir / METRICS_FILE)
        run.last_record = recs[-1] if recs else None
    return RunResult(name=spec.name, run_dir=str(run_dir), completed=run.completed, start_epoch=start_epoch,
                     epoch=run.epoch, n_records=run.n_records, seconds=seconds,
                     epochs_per_second=(done / seconds) if done and seconds > 0 else None,
                     final_record=run.last_record)


def _log_call_start(run: _Run, extended_from: int | None) -> list[dict[str, Any]]:
    """Append this call (start time and epoch, versions, device) to ``environment.json``; returns all calls."""
    path = run.run_dir / ENVIRONMENT_FILE
    calls = _load_environment(path)
    calls.append({"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "start_epoch": run.epoch,
                  **({"extended_from_epochs": extended_from} if extended_from is not None else {}),
                  **environment_info(run.device)})
    _write_json_atomic(path, calls)
    return calls


def _log_call_end(run: _Run, calls: list[dict[str, Any]], start_epoch: int, seconds: float) -> int:
    """Complete this call's entry in ``environment.json`` with the epoch a rerun resumes from (the last
    checkpoint) and the time spent; returns the number of epochs this call trained and checkpointed."""
    ended = start_epoch if run.checkpoint_epoch is None else run.checkpoint_epoch
    done = ended - start_epoch
    calls[-1].update({"end_epoch": ended, "seconds": round(seconds, 3),
                      "epochs_per_second": round(done / seconds, 3) if done and seconds > 0 else None})
    _write_json_atomic(run.run_dir / ENVIRONMENT_FILE, calls)
    return done


def _progress_keys(record: dict[str, Any]) -> list[str]:
    """The record's values a progress bar shows: bits per byte where the study reports them (the language-model
    study), else accuracy (its reports' headline metric either way)."""
    bpb = [k for k in ("train_bpb", "val_bpb") if k in record]
    return bpb or [k for k in ("train_acc", "val_acc") if k in record]


def _progress_bar(run: _Run, quiet: bool, position: int | None):
    if quiet:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=run.spec.config.train.epochs, initial=run.epoch, desc=f"{run.spec.arm} seed {run.spec.seed}",
                unit="ep", position=position, leave=position is None, mininterval=0.5, dynamic_ncols=True)


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped :func:`train_run`; the message says where the run was checkpointed and how to resume."""


class _DeferredInterrupt:
    """Turn the first Ctrl-C (SIGINT) into a request that the training loop honours at the next epoch boundary,
    where the state can be checkpointed exactly; a second Ctrl-C interrupts at once. Only the main thread can
    install the handler; elsewhere Ctrl-C keeps its default behaviour."""

    def __init__(self) -> None:
        self.requested = False
        self._installed = False
        self._previous: Any = None

    def __enter__(self) -> _DeferredInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False


def _interrupted(run: _Run) -> TrainingInterrupted:
    total = run.spec.config.train.epochs
    if run.checkpoint_epoch is None:
        where = "before its first checkpoint; rerunning starts it again"
    else:
        where = f"checkpointed at epoch {run.checkpoint_epoch} of {total}; rerun the same command to resume"
    return TrainingInterrupted(f"interrupted: {run.spec.name} in {run.run_dir} {where}.")
