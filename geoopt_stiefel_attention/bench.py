"""``stiefel-attention bench``: what a :class:`~geoopt_stiefel_attention.StiefelAdam` step costs, measured
next to :class:`torch.optim.AdamW` and stock geoopt ``RiemannianAdam`` in the same process.

Three benchmarks, each returning frozen result objects (the CLI and ``benchmarks/*.py`` print them), and one
prepared accelerator check:

- :func:`step_time_benchmark`: the optimizer step alone on the query/key projections of transformer
  configurations (:data:`CONFIGS`: one frame per head, parameters shaped ``(heads, width, head_dim)``, two per
  layer), against ``AdamW(foreach=True)``, ``AdamW(fused=True)``, ``RiemannianAdam`` on
  ``geoopt.EuclideanStiefel()`` (QR retraction; arm ``"geoopt-radam"``, the name the studies and
  ``certify`` use too) and on ``geoopt.Stiefel()`` (canonical metric, Cayley retraction: a ``d x d`` solve
  per frame; arm ``"geoopt-radam-canonical"``), and the *matrix-product floor*: the six batched ``d x r x r``
  products a StiefelAdam step performs, run bare on tensors of the same shapes and batching.
- :func:`train_step_benchmark`: a full training step (forward, backward, optimizer) of
  :class:`~geoopt_stiefel_attention.TinyTransformer` and :class:`~geoopt_stiefel_attention.PatchViT`, the
  ``"stiefel"`` arm (Stiefel attention, StiefelAdam) against the ``"adamw"`` arm (Euclidean attention,
  ``torch.optim.AdamW``), both on :func:`~geoopt_stiefel_attention.param_groups`; optionally under
  ``torch.autocast``.
- :func:`step_path_benchmark`: the StiefelAdam step's own paths (default, ``capturable=True``,
  ``torch.compile(opt.step)``; row- and column-major frames) against the matrix-product floor, on the bench
  shape :data:`BENCH_FRAMES` and a grid of widths and ranks.
- :func:`accelerator_check` (``stiefel-attention bench gpu``, ``benchmarks/gpu.sh``): a few minutes on one
  GPU, all of the above at GPU sizes plus the grokking study's epochs per second, written as JSON.

Protocol. The arms are interleaved: every round runs each arm for a few steps, in an order that rotates from
round to round, so slow drift of a shared machine hits all arms alike. Each step is timed on its own; an arm's
time is the median over all its steps, and a ratio is the median over rounds of the per-round ratio of
medians. ``clock="cpu"`` measures the process's CPU time instead of wall time: with one thread
(``threads=1``) it is not inflated when other processes take the core, the usual situation on a shared
machine. Timings are not assertions: nothing here decides pass or fail.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ._argtypes import UsageError, nonnegative_int, output_path_problem, positive_float, positive_int

HELP = "Time the StiefelAdam step against AdamW and stock geoopt RiemannianAdam (ratios, memory); --json."

#: Benchmark configurations, width -> (depth, heads); head_dim = width // heads, one frame per head.
CONFIGS: dict[int, tuple[int, int]] = {128: (2, 4), 256: (4, 4), 512: (8, 8), 768: (12, 12)}

#: The arms of :func:`step_time_benchmark`, in display order.
STEP_ARMS = ("stiefel", "adamw_foreach", "adamw_fused", "geoopt-radam", "geoopt-radam-canonical", "matmul_floor")

#: The models of :func:`train_step_benchmark`.
TRAIN_MODELS = ("tiny_transformer", "patch_vit")
#: Models that need the ``models`` extra (HuggingFace ``transformers``); run only when asked for.
EXTRA_TRAIN_MODELS = ("hf_gpt2",)

CLOCKS = ("wall", "cpu")


@dataclass(frozen=True)
class BenchSettings:
    """The settings every benchmark shares: the interleaving protocol (see the module docstring), the
    optimizers' learning rate, and where and how the benchmark runs.

    Each benchmark takes ``settings=`` (default: its entry of :data:`BENCH_DEFAULTS`) and accepts any of these
    fields as a keyword too, which replaces the field (``step_time_benchmark(rounds=3)``).

    Attributes
    ----------
    rounds, steps_per_round, warmup : int
        Interleaved rounds, timed steps per arm and round (one for arms slower than 0.25 s per
        step), untimed steps per arm before the first round.
    lr : float
        Learning rate of every optimizer (1e-3: a typical value; with it a StiefelAdam step is far inside its
        trust region, and on CPU the retraction's series has order 1).
    dtype : str
        Of the parameters of :func:`step_time_benchmark` and :func:`step_path_benchmark`;
        :func:`train_step_benchmark` trains float32 parameters (mixed precision: its ``autocast``).
    device : str
        Torch device of the parameters.
    clock : {"wall", "cpu"}
        Wall time, or the process's CPU time (robust to other processes on a shared machine with one thread).
    threads : int or None
        ``torch.set_num_threads`` for the run (restored afterwards); ``None`` keeps the current setting.
    seed : int
        Seed of the parameters, gradients and data (each arm gets identical copies).
    """

    rounds: int = 7
    steps_per_round: int = 5
    warmup: int = 3
    lr: float = 1e-3
    dtype: str = "float32"
    device: str = "cpu"
    clock: str = "wall"
    threads: int | None = None
    seed: int = 0


#: Default :class:`BenchSettings` of each benchmark (``stiefel-attention bench step|train|paths``).
BENCH_DEFAULTS: dict[str, BenchSettings] = {
    "step": BenchSettings(steps_per_round=5, warmup=3),
    "train": BenchSettings(steps_per_round=3, warmup=2),
    "paths": BenchSettings(steps_per_round=5, warmup=3),
}


def _settings(benchmark: str, settings: BenchSettings | None, overrides: dict[str, Any]) -> BenchSettings:
    """``settings`` (default ``BENCH_DEFAULTS[benchmark]``) with the fields named in ``overrides`` replaced."""
    names = {f.name for f in fields(BenchSettings)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(f"bench: {', '.join(unknown)} is not a benchmark setting; use any of {sorted(names)}.")
    return replace(BENCH_DEFAULTS[benchmark] if settings is None else settings, **overrides)


_SLOW_STEP_S = 0.25  # an arm whose warm-up step takes longer runs one step per round


# ----------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class ArmTiming:
    """Step time of one arm: median and quartiles over every timed step (milliseconds)."""

    arm: str
    median_ms: float
    q1_ms: float
    q3_ms: float
    steps: int
    state_bytes: int | None = None
    workspace_bytes: int | None = None
    note: str = ""


@dataclass(frozen=True)
class StepTimeResult:
    """:func:`step_time_benchmark` for one configuration.

    ``ratios[arm]`` is StiefelAdam's time over ``arm``'s (median over rounds), so ``ratios["adamw_foreach"]``
    below 1.5 meets the AdamW target, ``ratios["matmul_floor"]`` below 1.3 the floor target, and
    ``1 / ratios["geoopt-radam"]`` is the speed-up over stock geoopt. ``state_ratio`` is optimizer-state
    bytes over parameter bytes per arm.
    """

    width: int
    depth: int
    heads: int
    head_dim: int
    frames: int
    param_bytes: int
    dtype: str
    timings: dict[str, ArmTiming]
    ratios: dict[str, float]
    state_ratio: dict[str, float]
    rounds: int
    clock: str
    threads: int


@dataclass(frozen=True)
class TrainStepResult:
    """:func:`train_step_benchmark` for one model: full-step and optimizer-only times per arm, and the ratio
    of the stiefel arm's full step to the adamw arm's (median over rounds)."""

    model: str
    config: dict[str, Any]
    batch: int
    full_step: dict[str, ArmTiming]
    optimizer_step: dict[str, ArmTiming]
    ratio: float
    rounds: int
    clock: str
    threads: int
    autocast: str | None = None


@dataclass(frozen=True)
class Machine:
    """Where a benchmark ran."""

    cpu: str
    logical_cpus: int
    torch_threads: int
    torch: str
    geoopt: str
    python: str
    platform: str
    device: str
    extra: dict[str, str] = field(default_factory=dict)


def machine_info(device: str = "cpu") -> Machine:
    """Describe the machine and library versions (the model name from ``/proc/cpuinfo`` where available)."""
    import os

    import geoopt
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    if device.startswith("cuda") and torch.cuda.is_available():
        cpu = f"{cpu}; GPU {torch.cuda.get_device_name(torch.device(device))}"
    return Machine(cpu=cpu, logical_cpus=os.cpu_count() or 0, torch_threads=torch.get_num_threads(),
                   torch=torch.__version__, geoopt=geoopt.__version__, python=platform.python_version(),
                   platform=platform.platform(), device=device)


# ----------------------------------------------------------------------------------------------- timing
def _clock(clock: str) -> Callable[[], float]:
    if clock not in CLOCKS:
        raise ValueError(f"bench: clock={clock!r} is unknown; use one of {CLOCKS}.")
    return time.perf_counter if clock == "wall" else time.process_time


def _synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _interleave(steps: dict[str, Callable[[], Any]], settings: BenchSettings, *, warmup: int | None = None,
                required: tuple[str, ...] = ()) -> tuple[dict[str, list[list[float]]], dict[str, str]]:
    """Run every arm ``warmup`` times (default ``settings.warmup``), then ``settings.rounds`` rounds of
    ``settings.steps_per_round`` timed steps per arm (one step for arms slower than ``_SLOW_STEP_S``), rotating
    the arm order each round, timed with ``settings.clock`` on ``settings.device``.

    Returns the per-round lists of step times (seconds) of each arm that completed, and a note for each arm
    that raised (a competitor's bug must not abort the whole benchmark; an arm in ``required`` re-raises).
    """
    warmup = settings.warmup if warmup is None else warmup
    rounds, steps_per_round, device = settings.rounds, settings.steps_per_round, settings.device
    now = _clock(settings.clock)
    per_round, failed = {}, {}
    for name, fn in steps.items():
        t0 = time.perf_counter()
        try:
            for _ in range(max(warmup, 1)):
                fn()
            _synchronize(device)
        except Exception as exc:  # noqa: BLE001 - reported in the result, see the docstring
            if name in required:
                raise
            failed[name] = f"failed: {type(exc).__name__}: {exc}".splitlines()[0][:160]
            continue
        slow = (time.perf_counter() - t0) / max(warmup, 1) > _SLOW_STEP_S
        per_round[name] = 1 if slow else steps_per_round
    names = [name for name in steps if name not in failed]
    samples: dict[str, list[list[float]]] = {name: [] for name in names}
    for k in range(rounds):
        order = names[k % len(names):] + names[: k % len(names)]
        for name in order:
            if name in failed:
                continue
            fn, times = steps[name], []
            try:
                for _ in range(per_round[name]):
                    _synchronize(device)
                    t0 = now()
                    fn()
                    _synchronize(device)
                    times.append(now() - t0)
            except Exception as exc:  # noqa: BLE001
                if name in required:
                    raise
                failed[name] = f"failed: {type(exc).__name__}: {exc}".splitlines()[0][:160]
                continue
            samples[name].append(times)
    return {name: t for name, t in samples.items() if name not in failed}, failed


def _timing(name: str, rounds: list[list[float]], **extra: Any) -> ArmTiming:
    flat = sorted(t for r in rounds for t in r)
    q = statistics.quantiles(flat, n=4) if len(flat) > 1 else [flat[0]] * 3
    return ArmTiming(arm=name, median_ms=1e3 * statistics.median(flat), q1_ms=1e3 * q[0], q3_ms=1e3 * q[2],
                     steps=len(flat), **extra)


def _ratio(num: list[list[float]], den: list[list[float]]) -> float:
    """Median over rounds of the ratio of per-round medians."""
    return statistics.median(statistics.median(a) / statistics.median(b) for a, b in zip(num, den, strict=True))


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """``torch.set_num_threads(threads)`` inside the block (``None``: unchanged), the previous count restored."""
    import torch

    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _workspace_bytes(opt: Any) -> int | None:
    """Bytes of an optimizer's step workspaces (StiefelAdam's ``_workspaces``), ``None`` when it keeps none."""
    ws = getattr(opt, "_workspaces", None)
    return None if ws is None else sum(b.numel() * b.element_size() for b in ws.values())


def _state_bytes(opt: Any) -> int:
    import torch

    return sum(v.numel() * v.element_size() for state in opt.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


# ----------------------------------------------------------------------------------------------- step time
def frame_shapes(width: int, depth: int, heads: int) -> list[tuple[int, int, int]]:
    """Shapes of the query/key projections of a ``depth``-layer model, one frame per head: ``2 * depth``
    parameters of shape ``(heads, width, width // heads)``."""
    if width % heads:
        raise ValueError(f"bench: width={width} is not a multiple of heads={heads}; pick heads dividing width.")
    return [(heads, width, width // heads)] * (2 * depth)


def _matmul_floor(params: list[Any], steps: list[int]) -> Callable[[], None]:
    """The six ``d x r x r`` products of a StiefelAdam step, batched as StiefelAdam batches ``params``, on
    preallocated tensors of the same shapes, with the same destinations (``out=`` / ``baddbmm``), in the dtype
    the step computes in (float32 for bfloat16 and float16 frames)."""
    import torch

    from ._linalg import compute_dtype
    from .optim import _frame_batches

    gen = torch.Generator(device=params[0].device).manual_seed(0)
    work = []
    for _, batch in _frame_batches(params, steps):
        d, r = batch[0].shape[-2:]
        n = sum(p.numel() for p in batch) // (d * r)
        like = dict(dtype=compute_dtype(batch[0].dtype), device=batch[0].device, generator=gen)
        w, g, m = (torch.randn(n, d, r, **like) for _ in range(3))
        x = torch.randn(n, r, r, **like)
        y, w_new, m_new = (torch.empty_like(w) for _ in range(3))  # separate outputs: no feedback between runs
        work.append((w, g, m, x, y, w_new, m_new))

    def run() -> None:
        for w, g, m, x, y, w_new, m_new in work:
            a = torch.bmm(w.mT, g)  # W^T G
            torch.baddbmm(g, w, a, alpha=-0.5, out=y)  # G - W S
            torch.bmm(y.mT, y)  # Gram of W - s
            torch.bmm(y, x, out=w_new)  # (W - s) X
            b = torch.bmm(w_new.mT, m)  # W+^T m
            torch.baddbmm(m, w_new, b, alpha=-0.5, out=m_new)  # m - W+ S'

    return run


def _step_arms(shapes: list[tuple[int, ...]], *, arms: tuple[str, ...], lr: float, dtype: Any, device: str,
               seed: int) -> tuple[dict[str, Callable[[], Any]], dict[str, Any], dict[str, str]]:
    """Build each arm's step function on its own copy of the same frames and gradients."""
    import geoopt
    import torch

    from .manifolds import PolarStiefel
    from .optim import StiefelAdam

    gen = torch.Generator().manual_seed(seed)
    st = PolarStiefel()
    start = [st.random(*s, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device) for s in shapes]
    grads = [(1e-2 * torch.randn(s, generator=gen, dtype=torch.float64)).to(dtype=dtype, device=device)
             for s in shapes]

    def params(manifold: Any | None) -> list[torch.Tensor]:
        out = []
        for w, g in zip(start, grads, strict=True):
            p = (torch.nn.Parameter(w.clone()) if manifold is None
                 else geoopt.ManifoldParameter(w.clone(), manifold=manifold))
            p.grad = g.clone()
            out.append(p)
        return out

    steps: dict[str, Callable[[], Any]] = {}
    opts: dict[str, Any] = {}
    notes: dict[str, str] = {}
    for arm in arms:
        if arm == "stiefel":
            opts[arm] = StiefelAdam(params(PolarStiefel()), lr=lr)
        elif arm == "adamw_foreach":
            opts[arm] = torch.optim.AdamW(params(None), lr=lr, weight_decay=0.0, foreach=True)
        elif arm == "adamw_fused":
            try:
                opts[arm] = torch.optim.AdamW(params(None), lr=lr, weight_decay=0.0, fused=True)
                opts[arm].step()
            except (RuntimeError, ValueError) as exc:  # fused AdamW is not built for every device and dtype
                notes[arm] = f"unavailable: {exc}".splitlines()[0][:120]
                opts.pop(arm)
                continue
        elif arm == "geoopt-radam":
            opts[arm] = geoopt.optim.RiemannianAdam(params(geoopt.EuclideanStiefel()), lr=lr)
        elif arm == "geoopt-radam-canonical":
            opts[arm] = geoopt.optim.RiemannianAdam(params(geoopt.Stiefel()), lr=lr)
        elif arm == "matmul_floor":
            continue
        else:
            raise ValueError(f"bench: arm {arm!r} is unknown; use any of {STEP_ARMS}.")
        steps[arm] = opts[arm].step
    if "matmul_floor" in arms:
        frames = params(PolarStiefel())
        steps["matmul_floor"] = _matmul_floor(frames, [1] * len(frames))
    return steps, opts, notes


def step_time_benchmark(
    widths: tuple[int, ...] = tuple(CONFIGS),
    *,
    arms: tuple[str, ...] = STEP_ARMS,
    configs: dict[int, tuple[int, int]] | None = None,
    settings: BenchSettings | None = None,
    **overrides: Any,
) -> list[StepTimeResult]:
    """Time one optimizer step on the query/key frames of each configuration, every arm in one process.

    Parameters
    ----------
    widths : tuple of int
        Keys of ``configs`` (default :data:`CONFIGS`: 128, 256, 512, 768).
    arms : tuple of str
        Any of :data:`STEP_ARMS`; ``"stiefel"`` must be among them (the ratios are relative to it).
    configs : dict, optional
        ``width -> (depth, heads)``; defaults to :data:`CONFIGS`.
    settings : BenchSettings, optional
        Protocol, lr, dtype, device, clock, threads and seed; default ``BENCH_DEFAULTS["step"]``. Arms slower
        than 0.25 s per step (geoopt's canonical Stiefel at large widths) run one step per round.
    **overrides
        Fields of :class:`BenchSettings` replacing those of ``settings`` (``rounds=3``, ``clock="cpu"``).

    Returns
    -------
    list of StepTimeResult
        One per width, in the order given.
    """
    import torch

    s = _settings("step", settings, overrides)
    _clock(s.clock)  # an unknown clock is refused before anything is built
    configs = CONFIGS if configs is None else configs
    if "stiefel" not in arms:
        raise ValueError("bench: arms must include 'stiefel' (every ratio is relative to it).")
    bad = [w for w in widths if w not in configs]
    if bad:
        raise ValueError(f"bench: widths {bad} have no configuration; choose from {sorted(configs)} or pass configs.")
    with torch_threads(s.threads):
        results = []
        for width in widths:
            depth, heads = configs[width]
            shapes = frame_shapes(width, depth, heads)
            tdtype = getattr(torch, s.dtype)
            steps, opts, notes = _step_arms(shapes, arms=arms, lr=s.lr, dtype=tdtype, device=s.device, seed=s.seed)
            samples, failed = _interleave(steps, s, required=("stiefel",))
            notes.update(failed)
            param_bytes = sum(math.prod(s) for s in shapes) * torch.tensor([], dtype=tdtype).element_size()
            timings, state_ratio = {}, {}
            for arm in samples:
                state = workspace = None
                if arm in opts:
                    state = _state_bytes(opts[arm])
                    state_ratio[arm] = state / param_bytes
                    workspace = _workspace_bytes(opts[arm])
                timings[arm] = _timing(arm, samples[arm], state_bytes=state, workspace_bytes=workspace,
                                       note=notes.get(arm, ""))
            for arm, note in notes.items():
                timings[arm] = ArmTiming(arm=arm, median_ms=math.nan, q1_ms=math.nan, q3_ms=math.nan, steps=0,
                                         note=note)
            ratios = {arm: _ratio(samples["stiefel"], samples[arm]) for arm in samples if arm != "stiefel"}
            results.append(StepTimeResult(
                width=width, depth=depth, heads=heads, head_dim=width // heads, frames=len(shapes) * heads,
                param_bytes=param_bytes, dtype=s.dtype, timings=timings, ratios=ratios, state_ratio=state_ratio,
                rounds=s.rounds, clock=s.clock, threads=torch.get_num_threads()))
            del steps, opts
        return results


# ----------------------------------------------------------------------------------------------- train step
#: Model settings of :func:`train_step_benchmark`: the defaults of the grokking and vision studies.
TRAIN_SETTINGS: dict[str, dict[str, Any]] = {
    "tiny_transformer": dict(vocab_size=99, seq_len=4, width=128, depth=1, heads=4, mlp=512, batch=512),
    "patch_vit": dict(image_size=32, patch_size=4, width=64, depth=2, heads=4, mlp=128, batch=128),
    "hf_gpt2": dict(vocab_size=512, n_positions=64, n_embd=128, n_layer=2, n_head=4, batch=16),
}

#: The same models shrunk to a smoke test (``scale="tiny"``).
TINY_TRAIN_SETTINGS: dict[str, dict[str, Any]] = {
    "tiny_transformer": dict(vocab_size=11, seq_len=4, width=16, depth=1, heads=2, mlp=32, batch=8),
    "patch_vit": dict(image_size=8, patch_size=4, width=16, depth=1, heads=2, mlp=32, batch=4),
    "hf_gpt2": dict(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2, batch=2),
}


def _train_setup(model: str, attention: str, settings: dict[str, Any], *, seed: int,
                 device: str) -> tuple[Any, Any, Any, Callable[[Any, Any], Any]]:
    """Model, input batch, targets and loss of one arm (the same data for both arms)."""
    import torch

    from .models import PatchViT, TinyTransformer

    gen = torch.Generator().manual_seed(seed)
    kw = {k: v for k, v in settings.items() if k != "batch"}
    batch = settings["batch"]
    if model == "tiny_transformer":
        net = TinyTransformer(attention=attention, seed=seed, **kw)
        x = torch.randint(0, kw["vocab_size"], (batch, kw["seq_len"]), generator=gen)
        y = torch.randint(0, kw["vocab_size"], (batch,), generator=gen)

        def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(out[:, -1], target)  # the answer at the last position
    elif model == "patch_vit":
        net = PatchViT(in_channels=3, num_classes=10, attention=attention, seed=seed, **kw)
        x = torch.randn(batch, 3, kw["image_size"], kw["image_size"], generator=gen)
        y = torch.randint(0, 10, (batch,), generator=gen)
        loss_fn = torch.nn.functional.cross_entropy
    elif model == "hf_gpt2":
        net, x, y, loss_fn = _hf_gpt2_setup(attention, kw, batch, seed=seed, gen=gen)
    else:
        raise ValueError(f"bench: model {model!r} is unknown; use one of {TRAIN_MODELS + EXTRA_TRAIN_MODELS}.")
    return net.to(device), x.to(device), y.to(device), loss_fn


def _hf_gpt2_setup(attention: str, kw: dict[str, Any], batch: int, *, seed: int, gen: Any):
    """A randomly initialised HuggingFace GPT-2 LM, converted by ``stiefelize`` (``logit_gain="learn"``) for
    the stiefel arm; next-token loss on random tokens of the full context length."""
    import torch

    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as err:
        raise ValueError("bench: model 'hf_gpt2' needs HuggingFace transformers; install the models extra "
                         "(pip install -e '.[models]').") from err
    from .convert import stiefelize

    torch.manual_seed(seed)
    config = GPT2Config(**kw, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    net = GPT2LMHeadModel(config)
    if attention == "stiefel":
        stiefelize(net, logit_gain="learn")
    x = torch.randint(0, kw["vocab_size"], (batch, kw["n_positions"]), generator=gen)

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        logits = out.logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1))
    return net, x, x.clone(), loss_fn


def train_step_benchmark(
    models: tuple[str, ...] = TRAIN_MODELS,
    *,
    weight_decay: float = 0.1,
    scale: str = "default",
    autocast: str | None = None,
    settings: BenchSettings | None = None,
    **overrides: Any,
) -> list[TrainStepResult]:
    """Time a full training step (zero_grad, forward, loss, backward, optimizer step) of each model for the
    ``"adamw"`` arm (Euclidean attention, ``torch.optim.AdamW`` with its default implementation) and the
    ``"stiefel"`` arm (Stiefel attention, :class:`~geoopt_stiefel_attention.StiefelAdam`), both on
    ``param_groups(model, weight_decay)``, interleaved in one process. ``"hf_gpt2"`` (in
    :data:`EXTRA_TRAIN_MODELS`) is a HuggingFace GPT-2 whose stiefel arm is converted by
    :func:`~geoopt_stiefel_attention.stiefelize` (``logit_gain="learn"``): the cost of the converter's
    parametrization plus the Riemannian step.

    ``scale="default"`` uses :data:`TRAIN_SETTINGS` (the grokking and vision studies' default models; the
    grokking batch is 512 rather than the study's full batch, which only lowers the optimizer's share),
    ``scale="tiny"`` :data:`TINY_TRAIN_SETTINGS`. The optimizer step is also timed on its own.
    ``autocast="bfloat16"`` (or ``"float16"``) runs forward and loss under ``torch.autocast`` on the device
    (parameters and optimizer stay float32: mixed precision the way torch users do it). ``settings`` (default
    ``BENCH_DEFAULTS["train"]``) and ``**overrides`` as in :func:`step_time_benchmark`; its ``dtype`` must
    stay ``"float32"``.
    """
    import torch

    from .nn import param_groups
    from .optim import StiefelAdam

    s = _settings("train", settings, overrides)
    if s.dtype != "float32":
        raise ValueError(f"bench: dtype={s.dtype!r}: the train benchmark trains float32 parameters; use "
                         f"autocast='bfloat16' or 'float16' for mixed precision.")
    device = s.device
    table = {"default": TRAIN_SETTINGS, "tiny": TINY_TRAIN_SETTINGS}.get(scale)
    if table is None:
        raise ValueError(f"bench: scale={scale!r} is unknown; use 'default' or 'tiny'.")
    if autocast not in (None, "bfloat16", "float16"):
        raise ValueError(f"bench: autocast={autocast!r} is unknown; use None, 'bfloat16' or 'float16'.")
    amp = dict(device_type=torch.device(device).type, dtype=getattr(torch, autocast or "bfloat16"),
               enabled=autocast is not None)
    with torch_threads(s.threads):
        results = []
        for model in models:
            if model not in table:
                raise ValueError(f"bench: model {model!r} is unknown; use one of "
                                 f"{TRAIN_MODELS + EXTRA_TRAIN_MODELS}.")
            steps: dict[str, Callable[[], Any]] = {}
            opt_steps: dict[str, Callable[[], Any]] = {}
            for arm, attention in (("adamw", "euclidean"), ("stiefel", "stiefel")):
                net, x, y, loss_fn = _train_setup(model, attention, table[model], seed=s.seed, device=device)
                groups = param_groups(net, weight_decay=weight_decay, expect_frames=arm == "stiefel")
                opt = torch.optim.AdamW(groups, lr=s.lr) if arm == "adamw" else StiefelAdam(groups, lr=s.lr)

                def full(net=net, opt=opt, x=x, y=y, loss_fn=loss_fn) -> None:
                    opt.zero_grad(set_to_none=True)
                    with torch.autocast(**amp):
                        loss = loss_fn(net(x), y)
                    loss.backward()
                    opt.step()

                steps[arm], opt_steps[arm] = full, opt.step
            samples, _ = _interleave(steps, s, required=tuple(steps))
            # the optimizer alone, on the gradients of the last full step
            opt_samples, _ = _interleave(opt_steps, s, warmup=1, required=tuple(opt_steps))
            settings = dict(table[model])
            results.append(TrainStepResult(
                model=model, config={k: v for k, v in settings.items() if k != "batch"}, batch=settings["batch"],
                full_step={arm: _timing(arm, samples[arm]) for arm in steps},
                optimizer_step={arm: _timing(arm, opt_samples[arm]) for arm in opt_steps},
                ratio=_ratio(samples["stiefel"], samples["adamw"]), rounds=s.rounds, clock=s.clock,
                threads=torch.get_num_threads(), autocast=autocast))
        return results


# ----------------------------------------------------------------------------------------------- step paths
@dataclass(frozen=True)
class FrameSet:
    """``params`` frame parameters of shape ``(heads, d, r)``: ``params * heads`` frames of ``St(d, r)``."""

    params: int
    heads: int
    d: int
    r: int

    def __post_init__(self) -> None:
        for name in ("params", "heads", "d", "r"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value > 0):
                raise ValueError(f"bench: FrameSet {name}={value!r} must be a positive int.")
        if self.r > self.d:
            raise ValueError(f"bench: FrameSet r={self.r} exceeds d={self.d}; a frame needs r <= d.")

    @property
    def label(self) -> str:
        return f"{self.params} x ({self.heads}, {self.d}, {self.r})"


#: The bench shape of issue #18: 12 layers x (W_Q, W_K) x 8 heads of 512 x 64 frames.
BENCH_FRAMES = FrameSet(params=24, heads=8, d=512, r=64)
#: Widths and ranks of the ``grid="full"`` sweep (24 parameters of 8 heads each, like the bench shape).
GRID_WIDTHS = (128, 256, 512, 1024)
GRID_RANKS = (32, 64, 128)

#: The arms of :func:`step_path_benchmark`, in display order. ``-colmajor``: the same frames stored
#: column-major (the layout ``torch.linalg.qr(...).Q`` returns).
PATH_ARMS = ("eager", "capturable", "compiled", "eager-colmajor", "capturable-colmajor", "eager-per-param",
             "matmul_floor")
GRIDS = ("short", "full")


def path_frame_sets(grid: str = "short") -> list[FrameSet]:
    """``"short"``: the bench shape alone; ``"full"``: the bench shape, then 24 parameters of 8 heads of
    ``d x r`` frames for ``d`` in :data:`GRID_WIDTHS` and ``r`` in :data:`GRID_RANKS` (``r < d``; the bench
    shape once)."""
    if grid not in GRIDS:
        raise ValueError(f"bench: grid={grid!r} is unknown; use one of {GRIDS}.")
    sets = [BENCH_FRAMES]
    if grid == "full":
        grid_sets = (FrameSet(24, 8, d, r) for d in GRID_WIDTHS for r in GRID_RANKS if r < d)
        sets += [fs for fs in grid_sets if fs != BENCH_FRAMES]
    return sets


@dataclass(frozen=True)
class StepPathResult:
    """:func:`step_path_benchmark` for one :class:`FrameSet`.

    ``floor_ratio[arm]`` is the arm's step time over the matrix-product floor's (median over rounds of the
    per-round ratio of medians); ``compile_s`` the seconds the compiled arm's first steps took (compilation;
    excluded from its timing), ``None`` without that arm.
    """

    frames: FrameSet
    dtype: str
    device: str
    timings: dict[str, ArmTiming]
    floor_ratio: dict[str, float]
    compile_s: float | None
    compile_backend: str | None
    rounds: int
    clock: str
    threads: int


def _path_steps(fs: FrameSet, *, arms: tuple[str, ...], lr: float, dtype: Any, device: str, seed: int,
                compile_backend: str) -> tuple[dict[str, Callable[[], Any]], dict[str, Any], float | None]:
    """Each arm's step on its own copy of the same frames and gradients; compiles the compiled arm (its
    first three calls, timed and returned) so that its timed steps exclude compilation."""
    import geoopt
    import torch

    from .manifolds import PolarStiefel
    from .optim import StiefelAdam

    gen = torch.Generator().manual_seed(seed)
    st = PolarStiefel()
    shape = (fs.heads, fs.d, fs.r)
    start = [st.random(*shape, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
             for _ in range(fs.params)]
    grads = [(1e-2 * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype=dtype, device=device)
             for _ in range(fs.params)]

    def frames(column_major: bool) -> list[torch.Tensor]:
        def layout(t: torch.Tensor) -> torch.Tensor:  # column-major: strides (d r, 1, d), as linalg.qr's Q
            return t.mT.contiguous().mT if column_major else t.clone()

        out = []
        for w, g in zip(start, grads, strict=True):
            p = geoopt.ManifoldParameter(layout(w), manifold=PolarStiefel())
            p.grad = layout(g)
            out.append(p)
        return out

    steps: dict[str, Callable[[], Any]] = {}
    opts: dict[str, Any] = {}
    compile_s = None
    for arm in arms:
        if arm not in PATH_ARMS:
            raise ValueError(f"bench: arm {arm!r} is unknown; use any of {PATH_ARMS}.")
        if arm == "matmul_floor":
            steps[arm] = _matmul_floor(frames(False), [1] * fs.params)
            continue
        capturable = None if arm.startswith("eager") else True  # None: the device's default (False on CPU)
        opts[arm] = StiefelAdam(frames(arm.endswith("-colmajor")), lr=lr, capturable=capturable)
        if arm == "eager-per-param":  # one update call per parameter: what batching saves
            opts[arm]._stack_numel = 1
        steps[arm] = opts[arm].step
        if arm == "compiled":
            steps[arm] = torch.compile(opts[arm].step, backend=compile_backend)
            t0 = time.perf_counter()
            for _ in range(3):  # the first step creates the state; the next ones run the steady-state graph
                steps[arm]()
            _synchronize(device)
            compile_s = time.perf_counter() - t0
    return steps, opts, compile_s


def step_path_benchmark(
    frame_sets: list[FrameSet] | None = None,
    *,
    arms: tuple[str, ...] = PATH_ARMS,
    compile_backend: str = "inductor",
    settings: BenchSettings | None = None,
    **overrides: Any,
) -> list[StepPathResult]:
    """Time the paths of one :class:`~geoopt_stiefel_attention.StiefelAdam` step against the six batched
    ``d x r x r`` products alone (``"matmul_floor"``, see :func:`_matmul_floor`), every arm in one process.

    Arms (:data:`PATH_ARMS`): ``"eager"``, the default path (``capturable=None``: the host-reading path on
    the CPU, the capturable one on accelerators); ``"capturable"``, ``capturable=True`` (step counts as
    tensors, no host read: the path a GPU runs, selectable on the CPU); ``"compiled"``,
    ``torch.compile(opt.step, backend=compile_backend)`` of a capturable optimizer, timed after its first
    three (compiling) calls; ``"eager-colmajor"`` and ``"capturable-colmajor"``, the same frames stored
    column-major, as ``torch.linalg.qr(...).Q`` returns them; ``"eager-per-param"``, the default path with one
    update call per parameter instead of one per batch of same-shaped parameters (on an accelerator the batches
    span up to :data:`~geoopt_stiefel_attention.optim.ACCELERATOR_STACK_NUMEL` elements, on the CPU
    :data:`~geoopt_stiefel_attention.optim.STACK_NUMEL`). ``"matmul_floor"`` must be among the arms.

    Parameters
    ----------
    frame_sets : list of FrameSet, optional
        Default ``[BENCH_FRAMES]`` (:func:`path_frame_sets`).
    arms : tuple of str
        Any of :data:`PATH_ARMS`.
    compile_backend : str, default "inductor"
        ``torch.compile`` backend of the compiled arm (``"aot_eager"`` traces without generating code).
    settings : BenchSettings, optional
        Default ``BENCH_DEFAULTS["paths"]``; with ``**overrides`` as in :func:`step_time_benchmark`.

    Returns
    -------
    list of StepPathResult
        One per frame set, in the order given.
    """
    import torch

    s = _settings("paths", settings, overrides)
    if "matmul_floor" not in arms:
        raise ValueError("bench: arms must include 'matmul_floor' (every ratio is relative to it).")
    frame_sets = [BENCH_FRAMES] if frame_sets is None else frame_sets
    with torch_threads(s.threads):
        results = []
        for fs in frame_sets:
            steps, opts, compile_s = _path_steps(fs, arms=arms, lr=s.lr, dtype=getattr(torch, s.dtype),
                                                 device=s.device, seed=s.seed, compile_backend=compile_backend)
            samples, _ = _interleave(steps, s, required=tuple(steps))
            timings = {}
            for arm in samples:
                timings[arm] = _timing(arm, samples[arm], state_bytes=_state_bytes(opts[arm]) if arm in opts else None,
                                       workspace_bytes=_workspace_bytes(opts.get(arm)))
            results.append(StepPathResult(
                frames=fs, dtype=s.dtype, device=s.device, timings=timings,
                floor_ratio={arm: _ratio(samples[arm], samples["matmul_floor"]) for arm in samples
                             if arm != "matmul_floor"},
                compile_s=compile_s, compile_backend=compile_backend if "compiled" in arms else None,
                rounds=s.rounds, clock=s.clock, threads=torch.get_num_threads()))
            del steps, opts
            torch._dynamo.reset()  # each frame set compiles its own step; drop the last one's graphs
        return results


def format_path_table(results: list[StepPathResult]) -> str:
    """A Markdown table: per frame set, each arm's median step time and its ratio to the product floor."""
    arms = [a for a in PATH_ARMS if a != "matmul_floor" and any(a in r.timings for r in results)]
    head = ["frames (params x (heads, d, r))", "floor ms"] + [f"{a} ms (x floor)" for a in arms]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        row = [r.frames.label, f"{r.timings['matmul_floor'].median_ms:.3f}"]
        row += [f"{r.timings[a].median_ms:.3f} ({r.floor_ratio[a]:.2f})" if a in r.timings else "n/a" for a in arms]
        lines.append("| " + " | ".join(row) + " |")
    compiled = [f"{r.frames.label}: {r.compile_s:.1f} s" for r in results if r.compile_s is not None]
    if compiled:
        lines += ["", f"Compilation ({results[0].compile_backend}; first three calls, excluded): "
                      + ", ".join(compiled)]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- accelerator check
#: Sizes of :func:`accelerator_check`: the largest step-benchmark configuration and the issue's bench
#: shape (``"default"``, a GPU run of a few minutes), or a smoke test (``"tiny"``, seconds on a CPU).
CHECK_SCALES: dict[str, dict[str, Any]] = {
    "default": dict(width=max(CONFIGS), configs=CONFIGS, frames=BENCH_FRAMES, rounds=7),
    "tiny": dict(width=64, configs={64: (1, 2)}, frames=FrameSet(2, 2, 16, 4),
                 rounds=2),
}


def accelerator_check(device: str = "cuda", *, scale: str = "default", clock: str = "wall",
                      threads: int | None = None, compile_backend: str | None = "inductor",
                      seed: int = 0) -> dict[str, Any]:
    """The prepared accelerator check of issue #18 (``benchmarks/gpu.sh``; a few minutes on one GPU).

    1. ``step``: :func:`step_time_benchmark` at the largest configuration of :data:`CONFIGS`, StiefelAdam
       against ``AdamW(fused=True)``, ``geoopt-radam`` and the product floor, in float32 and bfloat16.
    2. ``paths``: :func:`step_path_benchmark` on :data:`BENCH_FRAMES`, default (on an accelerator:
       capturable, same-shaped frames batched into one call), per-parameter and compiled step against the
       product floor (``compile_backend=None`` leaves the compiled arm out).
    3. ``train``: :func:`train_step_benchmark` under bfloat16 autocast, stiefel arm against the adamw arm, of
       a HuggingFace GPT-2 converted by :func:`~geoopt_stiefel_attention.stiefelize` (``"hf_gpt2"``) when
       ``transformers`` is installed, else TinyTransformer.

    The grokking study's epochs per second, which ``benchmarks/gpu.sh`` adds next, belong to the studies
    (:mod:`geoopt_stiefel_attention.experiments.speed`): the benchmarks measure the library only.

    Returns a JSON-ready dict: ``machine``, ``settings``, ``seconds`` (per part) and one entry per part.
    """

    if scale not in CHECK_SCALES:
        raise ValueError(f"bench: scale={scale!r} is unknown; use one of {tuple(CHECK_SCALES)}.")
    sizes = CHECK_SCALES[scale]
    rounds = sizes["rounds"]
    timing = dict(rounds=rounds, steps_per_round=3, warmup=2, device=device, clock=clock, threads=threads,
                  seed=seed)
    seconds: dict[str, float] = {}
    out: dict[str, Any] = {}

    t0 = time.perf_counter()
    out["step"] = [asdict(r) for dtype in ("float32", "bfloat16") for r in step_time_benchmark(
        (sizes["width"],), arms=("stiefel", "adamw_fused", "geoopt-radam", "matmul_floor"), dtype=dtype,
        configs=sizes["configs"], **timing)]
    seconds["step"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    arms = ("eager", "eager-per-param", "compiled", "matmul_floor") if compile_backend else (
        "eager", "eager-per-param", "matmul_floor")
    out["paths"] = [asdict(r) for r in step_path_benchmark(
        [sizes["frames"]], arms=arms, compile_backend=compile_backend or "inductor", **timing)]
    seconds["paths"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    model = "hf_gpt2" if importlib.util.find_spec("transformers") is not None else "tiny_transformer"
    out["train"] = [asdict(r) for r in train_step_benchmark(
        (model,), autocast="bfloat16", scale=scale, **timing)]
    seconds["train"] = time.perf_counter() - t0


    return {"machine": asdict(machine_info(device)), "settings": dict(scale=scale, **timing,
                                                                      compile_backend=compile_backend),
            "seconds": seconds, **out}


def format_check(doc: dict[str, Any]) -> str:
    """A short plain-text summary of :func:`accelerator_check`'s result."""
    lines = [f"accelerator check on {doc['machine']['device']} ({doc['machine']['cpu']}), "
             f"torch {doc['machine']['torch']}, scale {doc['settings']['scale']}"]
    for r in doc["step"]:
        t = r["timings"]
        cells = ", ".join(f"{a} {t[a]['note']}" if t[a]["note"] else f"{a} {t[a]['median_ms']:.3f} ms" for a in t)
        ratios = [f"StiefelAdam / AdamW fused {r['ratios']['adamw_fused']:.2f}" if "adamw_fused" in r["ratios"] else "",
                  f"speed-up vs geoopt-radam {1 / r['ratios']['geoopt-radam']:.2f}x"
                  if "geoopt-radam" in r["ratios"] else ""]
        lines.append(f"step {r['dtype']} width {r['width']}: {cells}; " + ", ".join(x for x in ratios if x))
    for r in doc["paths"]:
        cells = ", ".join(f"{a} {x:.2f}x floor" for a, x in r["floor_ratio"].items())
        lines.append(f"paths {FrameSet(**r['frames']).label}: floor {r['timings']['matmul_floor']['median_ms']:.3f} ms; "
                     f"{cells}" + (f"; compiled in {r['compile_s']:.1f} s" if r["compile_s"] is not None else ""))
    for r in doc["train"]:
        lines.append(f"train {r['model']} ({r['autocast']} autocast): adamw {r['full_step']['adamw']['median_ms']:.2f}"
                     f" ms, stiefel {r['full_step']['stiefel']['median_ms']:.2f} ms, stiefel / adamw {r['ratio']:.3f}")
    g = doc.get("grokking")  # added by experiments/speed.py (benchmarks/gpu.sh) after the library's parts
    if g is not None:
        lines.append(f"grokking, {g['epochs']} epochs: " + ", ".join(f"{a} {v:.1f} epochs/s"
                                                                   for a, v in g["epochs_per_second"].items()))
    lines.append("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in doc["seconds"].items()))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- rendering
_ARM_LABELS = {
    "adamw_foreach": "AdamW foreach",
    "adamw_fused": "AdamW fused",
    "geoopt-radam": "geoopt-radam",
    "geoopt-radam-canonical": "geoopt-radam-canonical",
    "matmul_floor": "matmul floor",
}


def format_step_table(results: list[StepTimeResult]) -> str:
    """A Markdown table: StiefelAdam's median step time, and for each competitor its time and the ratio
    (StiefelAdam / competitor for AdamW and the floor; competitor / StiefelAdam, the speed-up, for geoopt)."""
    arms = [a for a in STEP_ARMS if a != "stiefel" and any(a in r.timings for r in results)]
    head = ["width (layers x heads x head_dim)", "StiefelAdam ms"]
    for arm in arms:
        label = _ARM_LABELS[arm]
        head += [f"{label} ms", f"speed-up vs {label}" if arm.startswith("geoopt") else f"x {label}"]
    head += ["state / params (StiefelAdam, AdamW)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        row = [f"{r.width} ({r.depth} x {r.heads} x {r.head_dim})", f"{r.timings['stiefel'].median_ms:.3f}"]
        for arm in arms:
            t = r.timings.get(arm)
            if t is None or arm not in r.ratios:
                row += ["n/a", "n/a"]
                continue
            ratio = r.ratios[arm]
            row += [f"{t.median_ms:.3f}", f"{1 / ratio:.1f}x" if arm.startswith("geoopt") else f"{ratio:.2f}"]
        adamw = r.state_ratio.get("adamw_foreach", math.nan)
        row += [f"{r.state_ratio.get('stiefel', math.nan):.4f}, {adamw:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    notes = [f"- width {r.width}, {_ARM_LABELS.get(t.arm, t.arm)}: {t.note}" for r in results
             for t in r.timings.values() if t.note]
    return "\n".join(lines + ([""] + notes if notes else []))


def format_train_table(results: list[TrainStepResult]) -> str:
    """A Markdown table of full-step times per arm and the stiefel / adamw ratio."""
    lines = ["| model | batch | adamw step ms (optimizer ms) | stiefel step ms (optimizer ms) | stiefel / adamw |",
             "|---|---|---|---|---|"]
    for r in results:
        cells = [f"{r.full_step[a].median_ms:.2f} ({r.optimizer_step[a].median_ms:.2f})" for a in ("adamw", "stiefel")]
        cfg = ", ".join(f"{k}={v}" for k, v in r.config.items())
        lines.append(f"| {r.model} ({cfg}) | {r.batch} | {cells[0]} | {cells[1]} | {r.ratio:.3f} |")
    return "\n".join(lines)


def to_json(results: list[Any], machine: Machine, **meta: Any) -> str:
    """JSON document with the machine, the run's settings and every result."""
    return json.dumps({"machine": asdict(machine), "settings": meta, "results": [asdict(r) for r in results]},
                      indent=2, default=str)


# ----------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``stiefel-attention bench``."""
    parser.add_argument("what", nargs="?", choices=("step", "train", "paths", "gpu"), default="step",
                        help="'step': optimizer step on Q/K frames against competitors (default); 'train': full "
                             "training step; 'paths': the step's eager, capturable and compiled paths against "
                             "the product floor; 'gpu': the prepared accelerator check (needs --out)")
    parser.add_argument("--widths", type=positive_int, nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                        metavar="WIDTH", help=f"configurations for 'step', any of {' '.join(map(str, CONFIGS))} "
                                              f"(default: all)")
    parser.add_argument("--arms", nargs="+", default=None, choices=tuple(dict.fromkeys(STEP_ARMS + PATH_ARMS)),
                        help=f"arms for 'step', any of {' '.join(STEP_ARMS)}, or for 'paths', any of "
                             f"{' '.join(PATH_ARMS)} (default: all)")
    parser.add_argument("--grid", default="short", choices=GRIDS,
                        help=f"frame sets for 'paths': 'short', the bench shape {BENCH_FRAMES.label} (default); "
                             f"'full', also widths {min(GRID_WIDTHS)}-{max(GRID_WIDTHS)} with r = "
                             f"{', '.join(map(str, GRID_RANKS))}")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend of the compiled arm of 'paths' and 'gpu' (default inductor)")
    parser.add_argument("--scale", default="default", choices=tuple(CHECK_SCALES),
                        help="sizes of 'gpu': 'default' (a few minutes on a GPU) or 'tiny' (a smoke test)")
    parser.add_argument("--out", default=None, metavar="PATH", help="also write the JSON to PATH")
    parser.add_argument("--models", nargs="+", default=list(TRAIN_MODELS), choices=TRAIN_MODELS + EXTRA_TRAIN_MODELS,
                        help="models for 'train' (default: the first two; hf_gpt2, a HuggingFace GPT-2 "
                             "converted by stiefelize, needs the models extra)")
    parser.add_argument("--rounds", type=positive_int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="timed steps per arm and round (default "
                             + ", ".join(f"{s.steps_per_round} for '{w}'" for w, s in BENCH_DEFAULTS.items()) + ")")
    parser.add_argument("--lr", type=positive_float, default=1e-3,
                        help="learning rate of every optimizer, > 0 (default 1e-3)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64", "bfloat16"))
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--clock", default="wall", choices=CLOCKS,
                        help="'wall' time, or process 'cpu' time (robust on a shared machine with --threads 1)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads for the run")
    parser.add_argument("--seed", type=nonnegative_int, default=0)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark and print a Markdown table (or JSON with ``--json``)."""
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"--device {args.device!r} is not a torch device; use e.g. cpu or cuda") from None
    backend = getattr(torch, device.type, None)
    if device.type != "cpu" and not (backend is not None and backend.is_available()):
        raise UsageError(f"--device {args.device!r} is not available on this machine; "
                                               f"use --device cpu")
    if args.what == "train" and "hf_gpt2" in args.models and importlib.util.find_spec("transformers") is None:
        raise UsageError("--models hf_gpt2 needs HuggingFace transformers; install the "
                                               "models extra (pip install -e '.[models]')")
    allowed = PATH_ARMS if args.what == "paths" else STEP_ARMS
    args.arms = list(allowed) if args.arms is None else args.arms
    wrong = [a for a in args.arms if a not in allowed]
    if args.what in ("step", "paths") and wrong:
        raise UsageError(f"--arms {' '.join(wrong)}: not an arm of '{args.what}'; use any of "
                                               f"{' '.join(allowed)}")
    if args.what == "step" and "stiefel" not in args.arms:
        raise UsageError("--arms must include 'stiefel' (every ratio is relative to it)")
    if args.what == "paths" and "matmul_floor" not in args.arms:
        raise UsageError("--arms must include 'matmul_floor' (every ratio is relative to it)")
    if args.compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise UsageError(f"--compile-backend {args.compile_backend!r} is not a torch.compile "
                                               f"backend; use e.g. inductor or aot_eager")
    if args.what == "gpu" and args.out is None:
        raise UsageError("'gpu' writes its results as JSON: pass --out PATH")
    problem = None if args.out is None else output_path_problem(args.out, folder=False)
    if problem is not None:  # checked before the benchmark runs, not after
        raise UsageError(f"--out {args.out}: {problem}")
    if args.what == "gpu":
        doc = accelerator_check(args.device, scale=args.scale, clock=args.clock, threads=args.threads,
                                compile_backend=args.compile_backend, seed=args.seed)
        text = json.dumps(doc, indent=2, default=str)
        _write_out(args.out, text)
        print(text if args.json else format_check(doc) + f"\nwritten to {args.out}")
        return 0
    defaults = BENCH_DEFAULTS[args.what]
    steps = defaults.steps_per_round if args.steps is None else args.steps
    settings = replace(defaults, rounds=args.rounds, steps_per_round=steps, lr=args.lr, device=args.device,
                       clock=args.clock, threads=args.threads, seed=args.seed,
                       dtype=defaults.dtype if args.what == "train" else args.dtype)  # train: float32 + autocast
    if args.what == "paths":
        results = step_path_benchmark(path_frame_sets(args.grid), arms=tuple(args.arms),
                                      compile_backend=args.compile_backend, settings=settings)
        table = format_path_table(results)
    elif args.what == "step":
        results = step_time_benchmark(tuple(args.widths), arms=tuple(args.arms), settings=settings)
        table = format_step_table(results)
    else:
        results = train_step_benchmark(tuple(args.models), settings=settings)
        table = format_train_table(results)
    with torch_threads(args.threads):
        machine = machine_info(args.device)
    text = to_json(results, machine, benchmark=args.what, rounds=args.rounds, steps_per_round=steps, lr=args.lr,
                   dtype=args.dtype, clock=args.clock, threads=args.threads, seed=args.seed,
                   **(dict(grid=args.grid, compile_backend=args.compile_backend) if args.what == "paths" else {}))
    if args.out is not None:
        _write_out(args.out, text)
    if args.json:
        print(text)
    else:
        print(table)
        print(f"\n{machine.cpu}, {machine.logical_cpus} logical CPUs, torch {machine.torch} "
              f"({machine.torch_threads} threads), geoopt {machine.geoopt}; clock={args.clock}, "
              f"rounds={args.rounds}, steps/round={steps}, lr={args.lr}, {args.dtype} on {args.device}.")
    return 0


def _write_out(path: str, text: str) -> None:
    from pathlib import Path

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text + "\n")


def __getattr__(name: str) -> Any:
    """``bench.grokking_speed``: moved to :mod:`geoopt_stiefel_attention.experiments.speed` (deprecated alias)."""
    if name == "grokking_speed":
        import warnings

        from .experiments.speed import grokking_speed

        warnings.warn("geoopt_stiefel_attention.bench.grokking_speed moved to "
                      "geoopt_stiefel_attention.experiments.speed.grokking_speed (the benchmarks measure the library, "
                      "not the studies)", DeprecationWarning, stacklevel=2)
        return grokking_speed
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
