"""Recorded training trajectories: the proof that a reshaping commit changed nothing (issue 58, item 7).

Each entry of :data:`SCENARIOS` is a small deterministic training run on the CPU (one intra-op thread, fixed seeds)
of :class:`~geoopt_stiefel_attention.StiefelAdam` or :class:`~geoopt_stiefel_attention.StiefelMuon`, on frames of
several shapes, dtypes and options, eager, capturable and compiled, or of a model converted by
:func:`~geoopt_stiefel_attention.stiefelize` (HF GPT-2, a grouped-query HF Llama, a torch ``nn.TransformerEncoder``).
A run returns a :class:`Trajectory`: for the state before the first step and after every step, the SHA-256 of the
bytes (with dtype and shape) of every parameter and every optimizer-state tensor, in a fixed order (parameters in
their order, then each parameter's state entries by name); the loss of every step; the final parameters; the
categories of the warnings the run raised; for a converted model, the SHA-256 of its final ``state_dict()``. A record
keeps, per state, the SHA-256 of the whole state (over every tensor's full digest: it decides the bitwise
comparison) and the first 16 hex digits of each tensor's digest (to name the tensors that differ).

``python tests/trajectories.py record [GROUP ...]`` runs the scenarios of the named groups (all by default) and
writes, per group, ``tests/data/trajectories/<group>.json`` (digests, losses, warnings and the fingerprint of the
environment: torch, numpy, geoopt and transformers versions, ``platform.machine()``, the CPU model from
``/proc/cpuinfo``, ``torch.backends.cpu.get_cpu_capability()`` and the thread count) and
``tests/data/trajectories/<group>.pt`` (the final parameters). The groups: ``stiefel_adam``, ``stiefel_muon``
(kept apart: issue 56 changes the Muon direction solver, and its record is re-recorded once that lands, before the
reshaping starts) and ``converted_models``. ``python tests/trajectories.py list`` lists the scenarios.

``tests/test_trajectories.py`` replays every scenario. Where the environment's fingerprint equals the recorded one,
every state's digests and every loss must be equal bit for bit; elsewhere (another CPU, another torch), the final
parameters and the losses must agree within the tolerances named below (:data:`REPLAY_RTOL`), and the test says so
(a :class:`ReplayToleranceWarning` and the test property ``comparison``). The two compiled scenarios with inductor
are marked slow (a cold inductor compile takes a minute or more on 2 cores); the default run replays the compiled
step through ``aot_eager``.

How a reshaping commit uses it
------------------------------
1. Before the first move, the records are on the branch (recorded on the current code).
2. After each reshaping commit, run ``python -m pytest -q tests/test_trajectories.py -m "slow or not slow"`` on
   the machine that recorded them (the fingerprint in the JSON files says which): every replay is then bitwise
   (property ``comparison``; no ``ReplayToleranceWarning``), and a failure names the scenario, the first state that
   differs and the tensors that differ there. Elsewhere the test only compares within tolerances; for a bitwise
   proof there, record at the base commit in a scratch checkout (``git worktree add``), copy its
   ``tests/data/trajectories/`` over this checkout's without committing it, and run the test.
3. Re-record (``python tests/trajectories.py record GROUP``) ONLY when a change of behaviour is intended, in its own
   commit whose message says which behaviour changed and why; never to make a reshaping commit pass.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import platform
import sys
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # run as a script: the package of this checkout, not an installed one
    sys.path.insert(0, str(ROOT))

import geoopt  # noqa: E402
import torch  # noqa: E402

from geoopt_stiefel_attention import (  # noqa: E402
    PolarStiefel,
    StiefelAdam,
    StiefelMuon,
    param_groups,
    stiefelize,
)

#: Where the records live: ``<group>.json`` and ``<group>.pt`` per group.
DATA = ROOT / "tests" / "data" / "trajectories"
#: The record groups, one file pair each.
GROUPS = ("stiefel_adam", "stiefel_muon", "converted_models")
#: Intra-op threads of every scenario (set inside each run, restored after).
THREADS = 1
#: Format of the JSON records; a reader refuses another.
FORMAT = 1

# ------------------------------------------------------------------------------------------------- tolerances
#: Relative tolerance (per tensor, Frobenius norm; per loss, absolute value) of a replay in another environment
#: (another CPU or torch build: other SIMD kernels and BLAS paths, so other rounding). float64: unit roundoff
#: 1.1e-16, carried along at most 12 steps of a well-conditioned update; measured by replaying with
#: ``ATEN_CPU_CAPABILITY=avx2`` and ``=default`` (recorded with AVX-512): see tests/test_trajectories.py.
#: float32: unit roundoff 6e-8, the same argument; as conftest's TRAJECTORY_RTOL. bfloat16: compared entry by
#: entry, one bfloat16 ulp (2**-7 of the larger magnitude): a bf16 frame is the rounding of a float32 value, which
#: on another CPU may fall on the other side of a rounding boundary.
REPLAY_RTOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 2.0 ** -7}
#: float64 tolerance of the StiefelMuon scenario whose direction solve is capped short of its certificate (issue
#: 56): an uncertified direction follows rounding more closely than a converged one. Set when the scenario used the
#: earlier dual descent (measured 1.2e-10 across kernel sets there); not re-measured for the capped solve.
REPLAY_RTOL_LONG_DUAL = 1e-8
#: Absolute floor of the bfloat16 entrywise comparison: entries of a frame are O(1/sqrt(d)) >= 1e-3 or rounding
#: noise around zero, for which one ulp of the larger magnitude is below 1e-7.
REPLAY_ATOL_BF16 = 1e-6


class ReplayToleranceWarning(UserWarning):
    """A replay compared within tolerances, not bit for bit, because the environment differs from the record's."""


# ------------------------------------------------------------------------------------------------- digests
def digest(value: Any) -> str:
    """The SHA-256 (hex) of a tensor's dtype, shape and bytes (its values in row-major order, whatever its
    strides or storage), or of the ``repr`` of a non-tensor value."""
    h = hashlib.sha256()
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(f"{type(value).__name__}|{value!r}".encode())
    return h.hexdigest()


def state_digests(named: list[tuple[str, torch.Tensor]], opt: torch.optim.Optimizer) -> tuple[list[str], list[str]]:
    """Labels and digests of every parameter of ``named`` (in its order), then of every optimizer-state entry of
    each parameter (parameters in order, entries by name): ``name`` and ``name:key``."""
    labels, digests = [], []
    for name, p in named:
        labels.append(name)
        digests.append(digest(p))
    for name, p in named:
        state = opt.state.get(p, {})
        for key in sorted(state):
            labels.append(f"{name}:{key}")
            digests.append(digest(state[key]))
    return labels, digests


#: Hex digits of each tensor's digest kept in a record (64 bits of its SHA-256, to name the tensors that differ);
#: each state's full SHA-256 over every tensor's full digest is kept too and decides the bitwise comparison.
PREFIX = 16


def combined(labels: list[str], digests: list[str]) -> str:
    """The SHA-256 (hex) of a whole state: its labels and their full digests, in order."""
    return hashlib.sha256("\n".join(f"{a} {b}" for a, b in zip(labels, digests, strict=True)).encode()).hexdigest()


@dataclass
class Trajectory:
    """What a scenario run returns: the labels of the tensors digested, their digests per state (index 0: before
    the first step, ``k``: after step ``k``), the loss of each step, the final parameters, the categories of the
    warnings raised, the intra-op thread count the run observed and, for a converted model, the digest of its
    final ``state_dict()`` (the stock form, rebuilt from the frames)."""

    labels: list[str]
    digests: list[list[str]]
    losses: list[float]
    final: dict[str, torch.Tensor]
    warnings: list[str] = field(default_factory=list)
    threads: int = THREADS
    state_dict: str | None = None

    def add(self, named: list[tuple[str, torch.Tensor]], opt: torch.optim.Optimizer) -> None:
        """Append the digests of the current state. Labels seen for the first time (optimizer state is created at
        the first step) are appended to :attr:`labels`; an entry absent now gets the digest ``""``."""
        labels, digests = state_digests(named, opt)
        self.labels += [label for label in labels if label not in self.labels]
        now = dict(zip(labels, digests, strict=True))
        self.digests.append([now.get(label, "") for label in self.labels])

    def record(self) -> dict[str, Any]:
        """The JSON form: per state its full SHA-256 (:func:`combined`) and each tensor's digest cut to
        :data:`PREFIX` hex digits (``""``: an entry absent at that state, e.g. optimizer state before the first
        step)."""
        rows = [row + [""] * (len(self.labels) - len(row)) for row in self.digests]
        out = {"labels": self.labels, "states": [combined(self.labels, row) for row in rows],
               "digests": [[d[:PREFIX] for d in row] for row in rows], "losses": self.losses,
               "warnings": self.warnings, "threads": self.threads}
        if self.state_dict is not None:
            out["state_dict"] = self.state_dict
        return out


# ------------------------------------------------------------------------------------------------- environment
def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``platform.processor()`` where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() in ("model name", "Model", "cpu model"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def fingerprint() -> dict[str, Any]:
    """What decides whether a replay can be compared bit for bit with a record: the versions of the libraries
    whose kernels or code run, the machine, the CPU and the kernels torch picked for it, the thread count."""
    import numpy
    import transformers

    return {"torch": torch.__version__, "numpy": numpy.__version__, "geoopt": geoopt.__version__,
            "transformers": transformers.__version__, "machine": platform.machine(), "cpu": cpu_model(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": THREADS}


def comparison_mode(recorded: dict[str, Any], current: dict[str, Any]) -> tuple[str, str]:
    """``("bitwise", "")`` when the fingerprints are equal, else ``("tolerance", what differs)``."""
    differ = [f"{k}: recorded {recorded.get(k)!r}, here {current.get(k)!r}"
              for k in sorted(recorded.keys() | current.keys()) if recorded.get(k) != current.get(k)]
    return ("tolerance", "; ".join(differ)) if differ else ("bitwise", "")


@contextmanager
def _deterministic(seed: int):
    """One intra-op thread, the global seed ``seed``, float32 default dtype, fresh dynamo; warnings recorded.
    Restores the thread count and default dtype after."""
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    torch.set_num_threads(THREADS)
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(seed)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield caught
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)


def _dependency_dirs() -> tuple[str, ...]:
    """The folders of torch, geoopt and transformers (found without importing transformers)."""
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    dirs = [Path(torch.__file__).parent, Path(geoopt.__file__).parent]
    if spec is not None and spec.origin:
        dirs.append(Path(spec.origin).parent)
    return tuple(f"{d}{'/'}" for d in dirs)


def _categories(caught: list[warnings.WarningMessage]) -> list[str]:
    """The categories of the warnings a run raised, each once, sorted (messages may be reworded; a warning that
    disappears or appears is a change). Warnings attributed to a file of torch, geoopt or transformers are left
    out: they depend on the dependencies' state, not on the library (a cold inductor compile warns, a warm one
    does not)."""
    foreign = _dependency_dirs()
    return sorted({w.category.__name__ for w in caught if not str(w.filename).startswith(foreign)})


def _checkpoint_copy(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` saved and loaded through ``torch.save``, as a checkpoint is."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# ------------------------------------------------------------------------------------------------- optimizer runs
@dataclass(frozen=True)
class FrameRun:
    """A run of a frame optimizer on stacks of random frames ``shapes`` (dtype ``dtype``) and one bias vector,
    minimizing ``sum_i 0.5 |W_i R_i - T_i|^2 + 0.5 |b - c|^2`` (fixed random ``R_i`` (r x r), ``T_i``, ``c``;
    computed in float32 for bfloat16 frames).

    ``nan_at=(step, i)`` puts a NaN into entry ``[0, 0, 0]`` of frame stack ``i``'s gradient at that step;
    ``resume_at=k`` replaces the optimizer after step ``k`` by a new one loaded from a checkpoint copy of its
    ``state_dict``; ``compile`` names the ``torch.compile`` backend of the step function; ``groups`` puts the
    bias into its own group with these options.
    """

    optimizer: type
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype = torch.float64
    steps: int = 8
    options: dict[str, Any] = field(default_factory=dict)
    nan_at: tuple[int, int] | None = None
    resume_at: int | None = None
    compile: str | None = None
    groups: dict[str, Any] | None = None
    seed: int = 0
    rtol: dict[torch.dtype, float] = field(default_factory=dict)

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float32 if self.dtype == torch.bfloat16 else self.dtype

    def __call__(self, steps: int | None = None, **overrides: Any) -> Trajectory:
        """Run it, ``steps`` steps (default ``self.steps``), with optimizer options ``overrides`` replacing
        those of the scenario (a perturbed replay)."""
        steps = self.steps if steps is None else steps
        options = {"lr": 1e-2, **self.options, **overrides}
        with _deterministic(self.seed) as caught:
            gen = torch.Generator().manual_seed(self.seed)
            st, cd = PolarStiefel(), self.compute_dtype
            frames = [geoopt.ManifoldParameter(st.random(*s, dtype=torch.float64, generator=gen).to(self.dtype),
                                               manifold=st) for s in self.shapes]
            rots = [torch.randn(s[-1], s[-1], generator=gen, dtype=torch.float64).to(cd) for s in self.shapes]
            targets = [(torch.randn(s, generator=gen, dtype=torch.float64) / math.sqrt(s[-2])).to(cd)
                       for s in self.shapes]
            bias = torch.nn.Parameter(torch.zeros(5, dtype=cd))
            centre = torch.randn(5, generator=gen, dtype=torch.float64).to(cd)
            named = [(f"frame{i} {tuple(s)}", w) for i, (s, w) in enumerate(zip(self.shapes, frames, strict=True))]
            named.append(("bias", bias))

            def build():
                if self.groups is None:
                    return self.optimizer([w for _, w in named], **options)
                return self.optimizer([{"params": frames}, {"params": [bias], **self.groups}], **options)

            holder = [build()]

            def opt_step():
                holder[0].step()

            if self.compile is not None:
                torch._dynamo.reset()
                step = torch.compile(opt_step, backend=self.compile)
            else:
                step = opt_step
            out = Trajectory([], [], [], {})
            out.add(named, holder[0])
            try:
                for k in range(1, steps + 1):
                    holder[0].zero_grad()
                    loss = 0.5 * ((bias - centre) ** 2).sum()
                    for w, rot, target in zip(frames, rots, targets, strict=True):
                        loss = loss + 0.5 * ((w.to(cd) @ rot - target) ** 2).sum()
                    loss.backward()
                    if self.nan_at is not None and self.nan_at[0] == k:
                        frames[self.nan_at[1]].grad[0, 0, 0] = float("nan")
                    step()
                    out.losses.append(float(loss.detach()))
                    out.add(named, holder[0])
                    if self.resume_at == k:
                        saved = _checkpoint_copy(holder[0].state_dict())
                        holder[0] = build()
                        holder[0].load_state_dict(saved)
            finally:
                if self.compile is not None:
                    torch._dynamo.reset()
            out.threads = torch.get_num_threads()
            out.final = {name: p.detach().clone() for name, p in named}
        out.warnings = _categories(caught)
        return out


# ------------------------------------------------------------------------------------------------- converted models
#: Vocabulary, sequence length and batch size of the converted models' token batches.
VOCAB, SEQ, BATCH = 64, 16, 4


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, n_inner=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel._from_config(config, attn_implementation="eager")


def _llama_gqa() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM._from_config(config, attn_implementation="eager")


class _EncoderLM(torch.nn.Module):
    """Token embedding, a 2-layer ``nn.TransformerEncoder`` (width 32, 4 heads, batch first) and a linear head."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)))


@torch.no_grad()
def _reinitialize_(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Every parameter drawn from ``gen`` (matrices ``0.02 N(0, 1)``; vectors ``0.01 N(0, 1)``, plus 1 for norm
    weights), so that the scenario does not depend on the library's initialisation scheme."""
    for name, p in model.named_parameters():
        scale = 0.02 if p.ndim >= 2 else 0.01
        base = 1.0 if p.ndim == 1 and name.endswith("weight") and ("norm" in name or "ln" in name) else 0.0
        p.copy_(base + scale * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))


@dataclass(frozen=True)
class ModelRun:
    """A model built by ``build`` (its parameters redrawn by :func:`_reinitialize_`), converted by
    ``stiefelize(model, **convert)``, trained ``steps`` steps by ``StiefelAdam(param_groups(model,
    weight_decay=0.1), lr=...)`` on random token batches (next-token loss; HF models' ``labels``)."""

    build: Callable[[], torch.nn.Module]
    convert: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    hf: bool = True
    rtol: dict[torch.dtype, float] = field(default_factory=dict)
    steps: int = 6
    seed: int = 0
    dtype: torch.dtype = torch.float32

    compile = None  # the model's step is not compiled (the frame scenarios hold the compiled ones)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.dtype

    def __call__(self, steps: int | None = None, **overrides: Any) -> Trajectory:
        steps = self.steps if steps is None else steps
        options = {"lr": 1e-2, **self.options, **overrides}
        with _deterministic(self.seed) as caught:
            gen = torch.Generator().manual_seed(self.seed)
            model = self.build()
            _reinitialize_(model, gen)
            model.train()
            stiefelize(model, **self.convert)
            opt = StiefelAdam(param_groups(model, weight_decay=0.1), **options)
            named = list(model.named_parameters())
            out = Trajectory([], [], [], {})
            out.add(named, opt)
            for _ in range(steps):
                x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
                opt.zero_grad()
                if self.hf:
                    loss = model(input_ids=x, labels=x).loss
                else:
                    logits = model(x[:, :-1])
                    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
                loss.backward()
                opt.step()
                out.losses.append(float(loss.detach()))
                out.add(named, opt)
            out.threads = torch.get_num_threads()
            out.final = {name: p.detach().clone() for name, p in named}
            stock = model.state_dict()
            out.state_dict = combined(list(stock), [digest(v) for v in stock.values()])
        out.warnings = _categories(caught)
        return out


# ------------------------------------------------------------------------------------------------- the scenarios
@dataclass(frozen=True)
class Scenario:
    """A named run: ``run(steps=None, **overrides) -> Trajectory``, its record group, and whether it is slow."""

    name: str
    group: str
    run: FrameRun | ModelRun
    slow: bool = False

    @property
    def tolerances(self) -> dict[torch.dtype, float]:
        """:data:`REPLAY_RTOL` with the scenario's own values (``run.rtol``) in place."""
        return {**REPLAY_RTOL, **self.run.rtol}


#: Frame stacks of every optimizer scenario: two of the same shape (batched together, stacked state), a square
#: and a near-square frame.
SHAPES = ((4, 16, 4), (4, 16, 4), (2, 12, 12), (3, 10, 9))
#: The same with a larger stack (float32 scenarios).
SHAPES_LARGE = (*SHAPES, (8, 64, 16))
#: Smaller stacks for bfloat16 and compiled scenarios.
SHAPES_SMALL = ((4, 16, 4), (3, 10, 9))
#: StiefelMuon's solver options in its compiled scenarios.
MUON_COMPILED = {"direction_steps": 6}


def _scenarios() -> dict[str, Scenario]:
    A, M = StiefelAdam, StiefelMuon
    bf16, f32 = torch.bfloat16, torch.float32
    adam = {
        "adam-f64": FrameRun(A, SHAPES, options={"foreach": False}),
        "adam-f64-foreach": FrameRun(A, SHAPES, options={"foreach": True}),
        "adam-f64-capturable": FrameRun(A, SHAPES, options={"capturable": True}),
        "adam-f32": FrameRun(A, SHAPES_LARGE, f32),
        "adam-f32-capturable": FrameRun(A, SHAPES, f32, options={"capturable": True}),
        "adam-bf16-master": FrameRun(A, SHAPES_SMALL, bf16, options={"master_weights": True}),
        "adam-bf16-master-capturable": FrameRun(A, SHAPES_SMALL, bf16,
                                                options={"master_weights": True, "capturable": True}),
        "adam-bf16": FrameRun(A, SHAPES_SMALL, bf16),
        "adam-original": FrameRun(A, SHAPES, options={"adjust_lr_fn": "original", "lr": 3e-2}),
        "adam-original-capturable": FrameRun(A, SHAPES, options={"adjust_lr_fn": "original", "lr": 3e-2,
                                                                 "capturable": True}),
        "adam-trust-none": FrameRun(A, SHAPES, options={"trust_region": None, "lr": 5e-2}),
        "adam-trust-binding": FrameRun(A, SHAPES, options={"trust_region": 0.05, "lr": 5e-2}),
        "adam-trust-binding-capturable": FrameRun(A, SHAPES, options={"trust_region": 0.05, "lr": 5e-2,
                                                                      "capturable": True}),
        "adam-second-column": FrameRun(A, SHAPES, options={"second_moment": "column"}),
        "adam-second-element": FrameRun(A, SHAPES, options={"second_moment": "element"}),
        "adam-second-none": FrameRun(A, SHAPES, options={"second_moment": None}),
        "adam-stabilize": FrameRun(A, SHAPES, options={"stabilize": 3}),
        "adam-weight-decay": FrameRun(A, SHAPES, options={"weight_decay": 0.1}),
        "adam-maximize": FrameRun(A, SHAPES, options={"maximize": True}),
        "adam-amsgrad": FrameRun(A, SHAPES, options={"amsgrad": True, "betas": (0.8, 0.95)}),
        "adam-groups": FrameRun(A, SHAPES, options={"trust_region": 0.5},
                                groups={"lr": 3e-3, "weight_decay": 0.1, "betas": (0.85, 0.99)}),
        "adam-nan": FrameRun(A, SHAPES, nan_at=(3, 1)),
        "adam-nan-capturable": FrameRun(A, SHAPES, nan_at=(3, 1), options={"capturable": True}),
        "adam-resume": FrameRun(A, SHAPES, resume_at=4),
        "adam-compiled-aot-eager": FrameRun(A, SHAPES_SMALL, f32, steps=4, compile="aot_eager",
                                            options={"capturable": True}),
        "adam-compiled-inductor": FrameRun(A, SHAPES_SMALL, f32, steps=4, compile="inductor",
                                           options={"capturable": True}),
    }
    muon = {
        "muon-f64": FrameRun(M, SHAPES, options={"foreach": False}),
        "muon-f64-foreach": FrameRun(M, SHAPES, options={"foreach": True}),
        "muon-f64-capturable": FrameRun(M, SHAPES, options={"capturable": True}),
        "muon-f32": FrameRun(M, SHAPES_LARGE, f32),
        "muon-f32-capturable": FrameRun(M, SHAPES, f32, options={"capturable": True}),
        "muon-bf16-master": FrameRun(M, SHAPES_SMALL, bf16, options={"master_weights": True}),
        "muon-bf16": FrameRun(M, SHAPES_SMALL, bf16),
        "muon-no-nesterov": FrameRun(M, SHAPES, options={"nesterov": False}),
        "muon-direction-loose": FrameRun(M, SHAPES, options={"direction_tol": 1e-3}),
        "muon-direction-capped": FrameRun(M, SHAPES, options={"direction_steps": 3},
                                          rtol={torch.float64: REPLAY_RTOL_LONG_DUAL}),
        "muon-original": FrameRun(M, SHAPES, options={"adjust_lr_fn": "original"}),
        "muon-original-capturable": FrameRun(M, SHAPES, options={"adjust_lr_fn": "original", "capturable": True}),
        "muon-momentum": FrameRun(M, SHAPES, options={"momentum": 0.8, "weight_decay": 0.0}),
        "muon-maximize": FrameRun(M, SHAPES, options={"maximize": True}),
        "muon-amsgrad": FrameRun(M, SHAPES, options={"amsgrad": True}),
        "muon-groups": FrameRun(M, SHAPES, groups={"lr": 3e-3, "weight_decay": 0.0}),
        "muon-nan": FrameRun(M, SHAPES, nan_at=(3, 1)),
        "muon-nan-capturable": FrameRun(M, SHAPES, nan_at=(3, 1), options={"capturable": True}),
        "muon-resume": FrameRun(M, SHAPES, resume_at=4),
        # one frame stack and a short solve: dynamo unrolls the dual descent (17 s to trace the default's)
        "muon-compiled-aot-eager": FrameRun(M, SHAPES_SMALL[:1], f32, steps=3, compile="aot_eager",
                                            options={"capturable": True, **MUON_COMPILED}),
        "muon-compiled-inductor": FrameRun(M, SHAPES_SMALL[:1], f32, steps=3, compile="inductor",
                                           options={"capturable": True, **MUON_COMPILED}),
    }
    models = {
        "gpt2-qk-bias-drop": ModelRun(_gpt2, convert={"qk_bias": "drop"}),
        "llama-gqa-gain": ModelRun(_llama_gqa, convert={"logit_gain": "learn"}),
        # Its key bias (kept) does not change the function (softmax is shift-invariant), so its gradient is
        # rounding noise (1e-12 to 1e-10); with eps 1e-8 Adam turns that into steps of about 1% of lr whose signs
        # are the rounding's, and another CPU's kernels moved it 1e-3 (relative) elsewhere. eps 1e-6 keeps them
        # below 1e-4 lr (measured 8.7e-6 relative).
        "transformer-encoder": ModelRun(_EncoderLM, hf=False, options={"eps": 1e-6}),
    }
    out = {}
    for group, runs in (("stiefel_adam", adam), ("stiefel_muon", muon), ("converted_models", models)):
        for name, run in runs.items():
            out[name] = Scenario(name, group, run, slow=getattr(run, "compile", None) == "inductor")
    return out


#: Every scenario by name.
SCENARIOS: dict[str, Scenario] = _scenarios()


# ------------------------------------------------------------------------------------------------- records
def load(group: str) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """The JSON record of ``group`` and its final tensors (scenario -> label -> tensor)."""
    doc = json.loads((DATA / f"{group}.json").read_text())
    if doc.get("format") != FORMAT:
        raise ValueError(f"{group}.json: format {doc.get('format')!r}, this reader reads {FORMAT}; re-record it "
                         f"(python tests/trajectories.py record {group})")
    return doc, torch.load(DATA / f"{group}.pt", weights_only=True)


def record(groups: list[str], *, out: Path = DATA, echo: Callable[[str], None] = print) -> None:
    """Run every scenario of ``groups`` and write ``<group>.json`` and ``<group>.pt`` into ``out``."""
    import subprocess
    import time

    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    for group in groups:
        doc = {"format": FORMAT, "group": group, "fingerprint": fingerprint(), "recorded_at": commit or None,
               "scenarios": {}}
        finals = {}
        for name, scenario in SCENARIOS.items():
            if scenario.group != group:
                continue
            start = time.perf_counter()
            traj = scenario.run()
            if traj.threads != THREADS:
                raise RuntimeError(f"{name}: ran on {traj.threads} threads, not {THREADS}")
            doc["scenarios"][name] = {"compute_dtype": str(scenario.run.compute_dtype), **traj.record()}
            finals[name] = traj.final
            echo(f"{group}/{name}: {len(traj.digests) - 1} steps, {len(traj.labels)} tensors, "
                 f"{time.perf_counter() - start:.1f} s")
        (out / f"{group}.json").write_text(_dumps(doc) + "\n")
        torch.save(finals, out / f"{group}.pt")
        echo(f"wrote {out / group}.json and .pt")


def _dumps(doc: dict[str, Any]) -> str:
    """JSON with one line per state's digests (readable diffs, no indentation of every digest)."""
    lines = ["{"]
    head = [k for k in doc if k != "scenarios"]
    for k in head:
        lines.append(f"  {json.dumps(k)}: {json.dumps(doc[k])},")
    lines.append('  "scenarios": {')
    names = list(doc["scenarios"])
    for i, name in enumerate(names):
        s = doc["scenarios"][name]
        lines.append(f"    {json.dumps(name)}: {{")
        for k in s:
            if k == "digests":
                rows = ",\n".join(f"        {json.dumps(row)}" for row in s[k])
                lines.append(f'      "digests": [\n{rows}\n      ],')
            else:
                lines.append(f"      {json.dumps(k)}: {json.dumps(s[k])},")
        lines[-1] = lines[-1].rstrip(",")
        lines.append("    }" + ("," if i < len(names) - 1 else ""))
    lines.append("  }")
    lines.append("}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- comparisons
def bitwise_mismatches(recorded: dict[str, Any], replay: Trajectory) -> list[str]:
    """Where ``replay`` differs from a scenario's record at all: labels, number of states, the first state whose
    digests differ (naming its tensors) and how many states differ, losses (exact), warning categories."""
    out = []
    got = replay.record()
    if got["labels"] != recorded["labels"]:
        missing = [x for x in recorded["labels"] if x not in got["labels"]]
        extra = [x for x in got["labels"] if x not in recorded["labels"]]
        return [f"tensors differ: recorded only {missing}, replayed only {extra}"
                + ("" if missing or extra else " (same tensors, other order)")]
    if len(got["states"]) != len(recorded["states"]):
        out.append(f"{len(got['states'])} states replayed against {len(recorded['states'])} recorded")
    differing = [k for k, (a, b) in enumerate(zip(got["states"], recorded["states"], strict=False)) if a != b]
    if differing:
        k = differing[0]
        names = [label for label, a, b in zip(recorded["labels"], got["digests"][k], recorded["digests"][k],
                                              strict=True) if a != b]
        out.append(f"{len(differing)} state(s) differ, first the state after step {k} (0: before the first step), "
                   f"in {names}")
    bad_losses = [k + 1 for k, (a, b) in enumerate(zip(got["losses"], recorded["losses"], strict=False)) if a != b]
    if bad_losses or len(got["losses"]) != len(recorded["losses"]):
        out.append(f"losses differ at steps {bad_losses} ({len(got['losses'])} replayed, "
                   f"{len(recorded['losses'])} recorded)")
    if got["warnings"] != recorded["warnings"]:
        out.append(f"warnings: replayed {got['warnings']}, recorded {recorded['warnings']}")
    if got.get("state_dict") != recorded.get("state_dict"):
        out.append("the model's final state_dict() (stock form) differs")
    return out


def tensor_mismatch(a: torch.Tensor, b: torch.Tensor, tolerances: dict[torch.dtype, float] = REPLAY_RTOL
                    ) -> str | None:
    """Why ``a`` (replayed) and ``b`` (recorded) disagree beyond ``tolerances`` (by dtype), or ``None``."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype} {tuple(a.shape)} against recorded {b.dtype} {tuple(b.shape)}"
    if not a.is_floating_point():
        return None if torch.equal(a, b) else "integer values differ"
    rtol = tolerances.get(a.dtype)
    if rtol is None:
        raise ValueError(f"no replay tolerance for {a.dtype}; name one in REPLAY_RTOL")
    if a.dtype == torch.bfloat16:
        x, y = a.double(), b.double()
        bound = rtol * torch.maximum(x.abs(), y.abs()) + REPLAY_ATOL_BF16
        excess = float(((x - y).abs() - bound).max()) if a.numel() else 0.0
        return None if excess <= 0 else f"bfloat16 entries differ by more than one ulp (excess {excess:.3g})"
    err = float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))
    return None if err <= rtol else f"relative difference {err:.3g} > {rtol:g}"


def tolerance_mismatches(recorded: dict[str, Any], final: dict[str, torch.Tensor], replay: Trajectory,
                         compute_dtype: torch.dtype, tolerances: dict[torch.dtype, float] = REPLAY_RTOL) -> list[str]:
    """Where ``replay`` differs from a record beyond the tolerances of another environment: the tensors digested
    and the number of steps (exactly), the final tensors and the losses (within ``tolerances``, by dtype; a loss
    by ``compute_dtype``), the warning categories (exactly)."""
    out = []
    if replay.labels != recorded["labels"] or replay.final.keys() != final.keys():
        out.append("the tensors differ from the record's (names or optimizer state entries)")
    if len(replay.losses) != len(recorded["losses"]):
        out.append(f"{len(replay.losses)} steps replayed against {len(recorded['losses'])} recorded")
    for name in replay.final.keys() & final.keys():
        why = tensor_mismatch(replay.final[name], final[name], tolerances)
        if why:
            out.append(f"final {name}: {why}")
    rtol = tolerances[compute_dtype]
    for k, (a, b) in enumerate(zip(replay.losses, recorded["losses"], strict=False)):
        if not math.isclose(a, b, rel_tol=rtol):
            out.append(f"loss of step {k + 1}: {a!r}, recorded {b!r}")
    if replay.warnings != recorded["warnings"]:
        out.append(f"warnings: replayed {replay.warnings}, recorded {recorded['warnings']}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tests/trajectories.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run the scenarios and write their records")
    rec.add_argument("groups", nargs="*", metavar="GROUP", help=f"groups to record (default: all of {GROUPS})")
    sub.add_parser("list", help="list the scenarios")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, s in SCENARIOS.items():
            print(f"{s.group:18s} {name}{'  (slow)' if s.slow else ''}")
        return 0
    unknown = [g for g in args.groups if g not in GROUPS]
    if unknown:
        parser.error(f"record: unknown group(s) {unknown}; the groups are {list(GROUPS)}")
    record(list(args.groups) or list(GROUPS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
