r"""The byte-level language-model study: ``python -m experiments lm``.

Does Stiefel attention help a small GPT trained on real text? A HuggingFace
:class:`~transformers.GPT2LMHeadModel` (pre-norm, causal; default 4 layers, width 128, 4 heads, context 128,
vocabulary the 256 byte values, no dropout) learns to predict the next byte of the Python standard library's
own sources (:mod:`.data.text`: text nobody on this project wrote, shipped with every interpreter, identified
by version and SHA-256, split by file). Every arm starts from the same seeded initialisation; the frame arms
then convert W_Q, W_K with :func:`~geoopt_stiefel_attention.stiefelize` (polar factor of every head block):

==================  ============================================================================================
arm                 what trains W_Q, W_K (everything else: AdamW)
==================  ============================================================================================
``adamw``           AdamW (all-Euclidean baseline)
``adamw-qknorm``    AdamW, with per-head RMSNorm of q and k before the dot product (:class:`QKNorm`: a learned
                    scale per head dimension, starting at 1, no weight decay; as OLMo 2 and Gemma use it)
``stiefel``         frames on :class:`~geoopt_stiefel_attention.PolarStiefel`, StiefelAdam
``stiefel-gain``    the same, plus one learned logit gain per head,
                    :math:`\gamma_h = \exp(\text{gain\_rate}\cdot\theta_h)` starting at 1
                    (``stiefelize(..., logit_gain="learn", gain_rate=10)``: Adam moves :math:`\theta` by about
                    ``lr`` per step, so a gain can change tenfold in about 230 steps at lr 1e-3)
``geoopt-radam``    frames on stock geoopt ``EuclideanStiefel`` trained by geoopt's ``RiemannianAdam``
==================  ============================================================================================

Optimisation (small-GPT defaults): AdamW lr 1e-3, betas (0.9, 0.95), weight decay 0.1 on the matrices of
the blocks only (no decay on biases, LayerNorms, gains, the token/position embeddings and hence the tied
unembedding), 5% linear warm-up then cosine decay to 0, global gradient-norm clipping at 1.0; frames at the
same lr unless ``--frame-lr`` (and the ``--frame-lrs`` sweep of the ``stiefel`` arm) says otherwise. An
"epoch" is ``steps_per_epoch`` batches of random windows (a pure function of seed and epoch), so each seed
gives every arm the same text in the same order.

Each evaluation records the validation loss (nats per byte) and bits per byte on fixed validation windows,
the same on fixed training windows, the frames' movement and principal angles to their start, and, on a fixed
probe batch, each head's attention-logit scale and attention entropy (:class:`AttentionProbe`). Every training
step records its loss, its gradient norm before clipping and, per layer, the largest attention logit and the
smallest attention entropy of that step's own forward (:class:`AttentionSteps`; ``steps.jsonl``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from geoopt_stiefel_attention.argtypes import UsageError
from geoopt_stiefel_attention.nn import param_groups

from ..harness.arms import ARMS, Arm, build_stiefel, register_arm
from ..harness.cli_args import check_distinct, check_input_folder, check_seed_range
from ..harness.command import StudyCommand
from ..harness.config import OptimConfig, RunSpec, TrainConfig, config_from_dict, require, to_dict
from ..harness.jobs import RunOptions
from ..harness.metrics import MetricHook, QKGeometry, StepHook
from ..harness.run_folder import ConfigMismatchError
from ..harness.runner import Task
from ..harness.schedules import warmup_cosine
from ..harness.study import Cell, StudyOutputs
from .controls_report import finalize as finalize_report
from .data import CORPORA, EvalWindows, RandomWindows, bits_per_byte, corpus_licence, load_corpus, stdlib_files
from .tuned import FINAL_DIR, GRID_PREFIX, find_config, is_tuned_folder, run_tuned

__all__ = ["LMConfig", "build_model", "build_task", "gpt2_query_keys", "attention_logit_stats", "AttentionProbe",
           "QKNorm", "add_qk_norm", "QK_NORM", "attention_step_stats", "AttentionSteps",
           "lm_param_groups", "SweepMismatchError", "run_lm", "finalize_lm", "sweep_cells", "STUDY_ARMS", "LOGIT_GAIN", "PUBLISHED",
           "HELP", "STUDY", "TUNED_ARMS", "TUNED_GRID_SEEDS", "add_arguments", "run"]

HELP = ("Byte-level GPT-2 on the Python standard library's sources: AdamW vs Stiefel W_Q/W_K (StiefelAdam, "
        "learned logit gain, geoopt RiemannianAdam) over paired seeds; records, plots, report.")

#: The arms of the study, baseline first (the same name as ``vision.STUDY_ARMS``; formerly ``LM_ARMS``).
STUDY_ARMS = ("adamw", "stiefel", "stiefel-gain", "geoopt-radam")

#: The arms of a tuned study (``--lrs`` / ``--final-seeds`` without ``--arms``), baselines first.
TUNED_ARMS = ("adamw", "muon", "stiefel", "stiefel-muon")

#: Seeds of every grid point of a tuned study when ``--lrs`` comes without ``--seeds``.
TUNED_GRID_SEEDS = (0, 1)

#: ``logit_gain`` passed to :func:`~geoopt_stiefel_attention.stiefelize` per arm (frame arms not listed: none).
LOGIT_GAIN = {"stiefel-gain": "learn"}

#: The arms whose model normalises q and k per head (:func:`add_qk_norm`).
QK_NORM = frozenset({"adamw-qknorm"})

if "stiefel-gain" not in ARMS:
    register_arm(Arm("stiefel-gain", "stiefel", build_stiefel,
                     "W_Q, W_K frames with a learned per-head logit gain (starting at 1) trained by StiefelAdam; "
                     "AdamW on the rest", studies=("lm",)))
if "adamw-qknorm" not in ARMS:
    from ..harness.arms import build_adamw

    register_arm(Arm("adamw-qknorm", "euclidean", build_adamw,
                     "AdamW on every parameter, with per-head RMSNorm of q and k (learned scale per head dimension, "
                     "starting at 1) before the dot product", studies=("lm",)))

#: The two published findings this study is set beside (no numbers of theirs are quoted: we have none).
#: ``(source, finding)`` pairs in prose, not a ``report.PaperReference`` (the grokking and vision studies'
#: ``PAPER``: one paper's figures, compared number for number); hence its own name.
PUBLISHED = (
    ("Knight, 2026", "rank-factored Riemannian attention on small language models \"does not conclusively "
                     "outperform AdamW\""),
    ("Yoshihara, 2026", "Stiefel-constrained attention inside Manifold Muon gave the best GPT-2 pre-training "
                        "configuration"),
)


# ---------------------------------------------------------------------------------------------- config
def _default_train() -> TrainConfig:
    return TrainConfig(epochs=20, eval_every=1)


def _default_optim() -> OptimConfig:
    return OptimConfig(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class LMConfig:
    """Configuration of the language-model study (corpus, model, batches, schedule, optimizer).

    Parameters
    ----------
    corpus : {"python-stdlib"}
        The text (:func:`~.data.text.load_corpus`).
    corpus_root : str or None
        Read the ``*.py`` files under this folder instead of the interpreter's standard library.
    val_fraction : float
        Share of files held out for validation.
    corpus_identity : dict or None
        The corpus' :meth:`~.data.text.TextCorpus.describe` (source, version, SHA-256, split), filled in by
        :func:`run_lm` so that every run's ``config.json`` names its text; a run whose corpus hashes
        differently is refused.
    context, width, depth, heads
        The GPT-2: positions, ``n_embd``, ``n_layer``, ``n_head``.
    batch_size, steps_per_epoch
        Windows per batch, batches per "epoch" (the evaluation unit).
    eval_windows, train_eval_windows, eval_batch
        Fixed validation windows, fixed training windows (for the training loss) and their batch size.
    probe_windows : int
        Validation windows of the attention probe (logit scale, entropy).
    lr_schedule : {"cosine", "constant"}
        ``"cosine"``: linear warm-up over ``warmup_fraction`` of the steps, then cosine decay to 0.
    warmup_fraction : float
        In ``[0, 1)``.
    grad_clip : float or None
        Global gradient-norm clipping before each step; ``None``: off.
    gain_rate : float
        ``gain_rate`` of the ``stiefel-gain`` arm's :func:`~geoopt_stiefel_attention.stiefelize`.
    test_fraction : float
        ``0`` (the default, and what every run recorded before the option existed used): validation windows
        evenly spaced over the validation files (:class:`~.data.text.EvalWindows`). ``> 0``: the held-out
        evaluation of :mod:`~.data.heldout`: this share of the files is a test split, validation and test
        windows are cut inside files, dropped when more than ``max_overlap`` of their ``overlap_ngram``-byte
        substrings occur in the training text, at most ``max_file_share`` of them from one file, and
        evaluated per category too (``val_code``, ``test_prose``, ...). ``eval_windows`` windows each.
    max_file_share, max_overlap, overlap_ngram
        The held-out windows' per-file cap, overlap threshold and substring length (``test_fraction > 0``).
    """

    experiment: str = "lm"
    corpus: str = "python-stdlib"
    corpus_root: str | None = None
    val_fraction: float = 0.1
    corpus_identity: dict[str, Any] | None = None
    context: int = 128
    width: int = 128
    depth: int = 4
    heads: int = 4
    batch_size: int = 32
    steps_per_epoch: int = 100
    eval_windows: int = 256
    train_eval_windows: int = 128
    eval_batch: int = 64
    probe_windows: int = 8
    lr_schedule: str = "cosine"
    warmup_fraction: float = 0.05
    grad_clip: float | None = 1.0
    gain_rate: float = 10.0
    test_fraction: float = field(default=0.0, metadata={"omit_if_default": True})
    max_file_share: float = field(default=0.03, metadata={"omit_if_default": True})
    max_overlap: float = field(default=0.25, metadata={"omit_if_default": True})
    overlap_ngram: int = field(default=32, metadata={"omit_if_default": True})
    train: TrainConfig = field(default_factory=_default_train)
    optim: OptimConfig = field(default_factory=_default_optim)

    def __post_init__(self) -> None:
        require(self.corpus in CORPORA, f"--corpus {self.corpus!r}: must be one of {', '.join(CORPORA)}.")
        require(isinstance(self.val_fraction, (int, float)) and not isinstance(self.val_fraction, bool)
                and 0 < self.val_fraction < 1, f"--val-fraction {self.val_fraction!r}: must be in (0, 1), e.g. 0.1.")
        for name in ("context", "width", "depth", "heads", "batch_size", "steps_per_epoch", "eval_windows",
                     "train_eval_windows", "eval_batch", "probe_windows"):
            v = getattr(self, name)
            require(_is_int(v) and v > 0, f"--{name.replace('_', '-')} {v!r}: must be a positive int.")
        require(self.width % self.heads == 0, f"--width {self.width} must be divisible by --heads {self.heads}.")
        require(self.lr_schedule in ("cosine", "constant"),
                f"--lr-schedule {self.lr_schedule!r}: must be cosine or constant.")
        require(isinstance(self.warmup_fraction, (int, float)) and 0 <= self.warmup_fraction < 1,
                f"--warmup-fraction {self.warmup_fraction!r}: must be in [0, 1).")
        require(self.grad_clip is None or (isinstance(self.grad_clip, (int, float)) and math.isfinite(self.grad_clip)
                                           and self.grad_clip > 0),
                f"--grad-clip {self.grad_clip!r}: must be a finite float > 0, or none.")
        require(isinstance(self.gain_rate, (int, float)) and math.isfinite(self.gain_rate) and self.gain_rate > 0,
                f"--gain-rate {self.gain_rate!r}: must be a finite float > 0.")
        require(isinstance(self.test_fraction, (int, float)) and 0 <= self.test_fraction < 1
                and self.val_fraction + self.test_fraction < 1,
                f"--test-fraction {self.test_fraction!r}: must be in [0, 1) with --val-fraction + --test-fraction < 1 "
                f"(0: no test split).")
        require(isinstance(self.max_file_share, (int, float)) and 0 < self.max_file_share <= 1,
                f"--max-file-share {self.max_file_share!r}: must be in (0, 1], e.g. 0.03.")
        require(isinstance(self.max_overlap, (int, float)) and 0 <= self.max_overlap <= 1,
                f"--max-overlap {self.max_overlap!r}: must be in [0, 1], e.g. 0.25.")
        require(_is_int(self.overlap_ngram) and self.overlap_ngram >= 8,
                f"--overlap-ngram {self.overlap_ngram!r}: must be an int >= 8, e.g. 32.")
        if not self.test_fraction:  # these shape the three-way held-out split only: refused rather than ignored
            for name in ("max_file_share", "max_overlap", "overlap_ngram"):
                value, default = getattr(self, name), self.__dataclass_fields__[name].default
                require(value == default, f"--{name.replace('_', '-')} {value!r}: filters the held-out windows of "
                                          f"the three-way split, which only --test-fraction > 0 makes (e.g. "
                                          f"--test-fraction 0.1); without it the flag would do nothing.")
        require(isinstance(self.train, TrainConfig), "LMConfig.train must be a TrainConfig.")
        require(isinstance(self.optim, OptimConfig), "LMConfig.optim must be an OptimConfig.")

    @property
    def epochs_extendable(self) -> bool:
        """Only a constant learning rate lets a finished run continue: the cosine decay depends on the total."""
        return self.lr_schedule == "constant"

    @property
    def total_steps(self) -> int:
        return self.train.epochs * self.steps_per_epoch


# ---------------------------------------------------------------------------------------------- model
def build_model(config: LMConfig, *, seed: int, logit_gain: str | None = None, stiefel: bool = False,
                qk_norm: bool = False):
    """The GPT-2 of one run: initialised from ``seed`` alone (the same weights for every arm of a seed), then,
    for a frame arm (``stiefel=True``), converted in place by :func:`~geoopt_stiefel_attention.stiefelize`
    with ``logit_gain`` and the config's ``gain_rate``; with ``qk_norm``, q and k normalised per head
    (:func:`add_qk_norm`; the other weights stay those of the seed)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from geoopt_stiefel_attention.convert import stiefelize

    gpt = GPT2Config(vocab_size=256, n_positions=config.context, n_embd=config.width, n_layer=config.depth,
                     n_head=config.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0, use_cache=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(gpt)
    if stiefel:
        stiefelize(model, logit_gain=logit_gain, **({"gain_rate": config.gain_rate} if logit_gain else {}))
    elif logit_gain is not None:
        raise ValueError(f"build_model: logit_gain={logit_gain!r} needs stiefel=True (a gain multiplies frames).")
    if qk_norm:
        add_qk_norm(model)
    return model


class QKNorm(torch.nn.Module):
    r"""Per-head RMSNorm of queries and keys, as OLMo 2 and Gemma apply it before the attention logits.

    For head :math:`h` with query :math:`q \in \mathbb{R}^r` (and key :math:`k` alike),
    :math:`\hat q = g_q \odot q / \sqrt{\tfrac1r \sum_i q_i^2 + \epsilon}`, with a learned scale
    :math:`g_q \in \mathbb{R}^r` shared by the heads of the layer (``q_norm.weight``; ``k_norm.weight`` for keys),
    starting at 1. The logits :math:`c\,\hat q\cdot\hat k` are then bounded by :math:`c\,r\max_i|g_{q,i}
    g_{k,i}|` whatever the weights.

    Parameters
    ----------
    head_dim : int
        :math:`r`.
    eps : float
        :math:`\epsilon` (1e-6, as OLMo 2 and Gemma).
    """

    def __init__(self, head_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.q_norm = torch.nn.RMSNorm(head_dim, eps=eps)
        self.k_norm = torch.nn.RMSNorm(head_dim, eps=eps)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q, k`` of shape ``(..., r)``, normalised over their last dimension."""
        return self.q_norm(q), self.k_norm(k)


def _apply_qk_norm(attention: torch.nn.Module, module: torch.nn.Module, args: Any, output: torch.Tensor
                   ) -> torch.Tensor:
    """Forward hook of ``c_attn``: its ``q | k | v`` output with q and k normalised per head."""
    d, heads = attention.embed_dim, attention.num_heads
    q, k, v = output.split(d, dim=-1)
    shape = (*q.shape[:-1], heads, d // heads)
    q, k = attention.qk_norm(q.reshape(shape), k.reshape(shape))
    return torch.cat([q.reshape(v.shape), k.reshape(v.shape), v], dim=-1)


def add_qk_norm(model: torch.nn.Module) -> None:
    """Normalise q and k per head in every GPT-2 self-attention of ``model``, in place: each attention module gets
    a :class:`QKNorm` (``<attn>.qk_norm``, so its scales train and checkpoint with the model) and a forward hook on
    its ``c_attn`` that normalises the q and k parts of the output, so the model's own attention (and anything
    reading ``c_attn``'s output) sees the normalised q and k. The package's attention code is not changed."""
    for _, attention in gpt2_attention_modules(model):
        if hasattr(attention, "qk_norm"):
            raise ValueError("add_qk_norm: the model's attention is normalised already.")
        weight = attention.c_attn.weight
        attention.qk_norm = QKNorm(attention.head_dim).to(device=weight.device, dtype=weight.dtype)
        attention.c_attn.register_forward_hook(functools.partial(_apply_qk_norm, attention))


def gpt2_attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(path, module)`` of every GPT-2 self-attention module (``c_attn`` holding q|k|v), in order."""
    found = [(p, m) for p, m in model.named_modules()
             if type(m).__name__ == "GPT2Attention" and not getattr(m, "is_cross_attention", False)]
    if not found:
        raise ValueError(f"{type(model).__name__} holds no GPT2Attention module.")
    return found


def gpt2_query_keys(model: torch.nn.Module) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    r"""``(path, w_q, w_k)`` per layer with ``w_q, w_k`` of shape ``(heads, d, r)``: head ``h``'s block of the
    module's current ``c_attn.weight`` (GPT-2's Conv1D stores it ``(d, 3d)``, columns ``q | k | v``). For a
    converted model this is the weight rebuilt from the frames (times the head's gain, if any), so every arm is
    measured on the same object; principal angles do not see the gain."""
    out = []
    for path, m in gpt2_attention_modules(model):
        w = m.c_attn.weight
        d, h = w.shape[0], m.num_heads
        r = d // h
        q = w[:, :d].reshape(d, h, r).permute(1, 0, 2)
        k = w[:, d:2 * d].reshape(d, h, r).permute(1, 0, 2)
        out.append((path, q, k))
    return out


def _lm_decays(name: str, p: torch.Tensor) -> bool:
    """GPT-style decay rule: the blocks' matrices; not the token/position embeddings (tied to the unembedding)."""
    return p.ndim >= 2 and not name.endswith(("wte.weight", "wpe.weight"))


def lm_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """GPT-style groups: :func:`~geoopt_stiefel_attention.param_groups` with frames (no decay); the blocks'
    matrices (``weight_decay``); everything else, i.e. biases, LayerNorms, logit gains and the token/position
    embeddings (tied to the unembedding), without decay. Trainable parameters only; shared ones once; empty
    groups dropped."""
    return param_groups(model, float(weight_decay), expect_frames=False, decay=_lm_decays, drop_empty=True)


# ---------------------------------------------------------------------------------------------- probe
def attention_logit_stats(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, heads: int,
                          scaling: float, qk_norm: QKNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Per-head RMS attention logit and mean attention entropy of one causal self-attention layer.

    With :math:`x` the layer's input (``hidden``, ``(B, T, d)``, after its LayerNorm), the Conv1D weight
    :math:`W` (``(d, 3d)``) and bias :math:`b`, head :math:`h` (size :math:`r = d/H`) has
    :math:`q_i = (xW + b)_{i,\,hr:(h+1)r}`, :math:`k_j` the same in the key columns, and logits
    :math:`s_{ij} = c\, q_i\cdot k_j` for :math:`j \le i` (:math:`c` = ``scaling``, :math:`1/\sqrt r` in GPT-2);
    with ``qk_norm`` (:class:`QKNorm`), :math:`q_i, k_j` normalised by it first. Returns, in float64, for each head

    - the logit scale :math:`\big(\frac{1}{N}\sum_{b,\,j\le i} s_{ij}^2\big)^{1/2}`, :math:`N = B\,T(T+1)/2`;
    - the mean attention entropy :math:`\frac{1}{BT}\sum_{b,i} -\sum_{j\le i} p_{ij}\ln p_{ij}` in nats,
      :math:`p_{i\cdot} = \mathrm{softmax}_{j \le i}(s_{ij})` (at most :math:`\ln T` averaged over positions).
    """
    b, t, d = hidden.shape
    r = d // heads
    x = hidden.detach().to(torch.float64)
    qk = x @ weight.detach().to(torch.float64)[:, :2 * d] + bias.detach().to(torch.float64)[:2 * d]
    q = qk[..., :d].reshape(b, t, heads, r).transpose(1, 2)
    k = qk[..., d:].reshape(b, t, heads, r).transpose(1, 2)
    if qk_norm is not None:
        q, k = (torch.nn.functional.rms_norm(x, (r,), n.weight.detach().to(torch.float64), n.eps)
                for x, n in ((q, qk_norm.q_norm), (k, qk_norm.k_norm)))
    logits = scaling * (q @ k.transpose(-1, -2))  # (B, H, T, T)
    mask = torch.ones(t, t, dtype=torch.bool, device=hidden.device).tril()
    rms = (logits.square() * mask).sum(dim=(0, 2, 3)).div(b * int(mask.sum())).sqrt()
    logp = logits.masked_fill(~mask, float("-inf")).log_softmax(dim=-1)
    entropy = -(logp.exp() * logp.masked_fill(~mask, 0.0)).sum(dim=-1).mean(dim=(0, 2))
    return rms, entropy


class AttentionProbe(MetricHook):
    """Each head's attention-logit scale and attention entropy on a fixed probe batch.

    At each evaluation the model runs once on ``inputs`` (eval mode, no gradient) with a forward pre-hook on
    every GPT-2 attention module that captures its input hidden states; :func:`attention_logit_stats` then
    computes the logits from those states and the module's current ``c_attn`` weight and bias (for a
    converted model the weight rebuilt from the frames and gains). Records ``logit_rms/<layer>/<head>``,
    ``attn_entropy/<layer>/<head>`` and their means over every head, ``logit_rms/mean`` and
    ``attn_entropy/mean``.
    """

    def __init__(self, inputs: torch.Tensor) -> None:
        self.inputs = inputs

    @torch.no_grad()
    def metrics(self, model: torch.nn.Module) -> dict[str, float | None]:
        modules = gpt2_attention_modules(model)
        captured: dict[int, torch.Tensor] = {}

        def capture(index: int, module, args, kwargs) -> None:
            captured[index] = args[0] if args else kwargs["hidden_states"]

        handles = [m.register_forward_pre_hook(functools.partial(capture, i), with_kwargs=True)
                   for i, (_, m) in enumerate(modules)]
        was_training = model.training
        model.eval()
        try:
            model(input_ids=self.inputs.to(next(model.parameters()).device), use_cache=False)
        finally:
            for h in handles:
                h.remove()
            model.train(was_training)
        out: dict[str, float | None] = {}
        all_rms, all_ent = [], []
        for i, (_, m) in enumerate(modules):
            rms, ent = attention_logit_stats(captured[i], m.c_attn.weight, m.c_attn.bias, m.num_heads, m.scaling,
                                             getattr(m, "qk_norm", None))
            for h in range(m.num_heads):
                out[f"logit_rms/{i}/{h}"] = float(rms[h])
                out[f"attn_entropy/{i}/{h}"] = float(ent[h])
            all_rms.append(rms)
            all_ent.append(ent)
        out["logit_rms/mean"] = float(torch.cat(all_rms).mean())
        out["attn_entropy/mean"] = float(torch.cat(all_ent).mean())
        return out


def attention_step_stats(qkv: torch.Tensor, heads: int, scaling: float) -> tuple[float, float]:
    r"""The largest attention logit and the smallest head's mean attention entropy of one causal self-attention
    layer, from the ``q | k | v`` output of its ``c_attn`` (``(B, T, 3d)``) in one training forward.

    With the logits :math:`s_{ij} = c\, q_i\cdot k_j` (:math:`j \le i`, :math:`c` = ``scaling``) of every
    window and head, returns :math:`\max_{b,h,\,j\le i} s_{ij}` (signed: the logit that most concentrates
    attention, as Dehghani et al. 2023 track it) and :math:`\min_h \frac{1}{BT}\sum_{b,i} -\sum_{j\le i}
    p_{ij}\ln p_{ij}` in nats (the head closest to one-hot attention; a mean over positions, since position 0
    always has entropy 0). Computed in the forward's precision, without gradient.
    """
    b, t, three_d = qkv.shape
    d = three_d // 3
    q = qkv[..., :d].detach().reshape(b, t, heads, d // heads).transpose(1, 2)
    k = qkv[..., d:2 * d].detach().reshape(b, t, heads, d // heads).transpose(1, 2)
    logits = scaling * (q @ k.transpose(-1, -2))  # (B, H, T, T)
    mask = torch.ones(t, t, dtype=torch.bool, device=qkv.device).tril()
    largest = logits.masked_fill(~mask, float("-inf")).amax()
    logp = logits.masked_fill(~mask, float("-inf")).log_softmax(dim=-1)
    entropy = -(logp.exp() * logp.masked_fill(~mask, 0.0)).sum(dim=-1).mean(dim=(0, 2))  # (H,)
    return float(largest), float(entropy.min())


class AttentionSteps(StepHook):
    """Per layer, the largest attention logit and the smallest attention entropy of each training step
    (:func:`attention_step_stats`), read by a forward hook on every GPT-2 attention's ``c_attn`` during the
    training forward (modules in training mode only: evaluations and the probe are not counted), after the
    q/k normalisation of :func:`add_qk_norm` where the model has one. Records ``logit_max`` and ``entropy_min``,
    lists over the layers."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[float, float]] = {}

    def attach(self, model: torch.nn.Module) -> None:
        for i, (_, attention) in enumerate(gpt2_attention_modules(model)):
            attention.c_attn.register_forward_hook(functools.partial(self._observe, i, attention))

    @torch.no_grad()
    def _observe(self, index: int, attention: torch.nn.Module, module: torch.nn.Module, args: Any,
                 output: torch.Tensor) -> None:
        if module.training:
            self._seen[index] = attention_step_stats(output, attention.num_heads, attention.scaling)

    def values(self) -> dict[str, list[float]]:
        seen = [self._seen[i] for i in sorted(self._seen)]
        self._seen.clear()
        return {"logit_max": [s[0] for s in seen], "entropy_min": [s[1] for s in seen]}


# ---------------------------------------------------------------------------------------------- task
class _Flat:
    """A window source whose targets are flattened to ``(B·T,)`` (one example per predicted byte, as the
    training loop's loss and accuracy expect), moved to ``device``."""

    def __init__(self, source: RandomWindows | EvalWindows, device: torch.device) -> None:
        self.source, self.device = source, device

    def __len__(self) -> int:
        return len(self.source)

    def batches(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for x, y in self.source.batches(epoch):
            yield x.to(self.device), y.reshape(-1).to(self.device)


def predict_bytes(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """Next-byte logits of every position, ``(B·T, 256)``."""
    logits = model(input_ids=inputs, use_cache=False).logits
    return logits.reshape(-1, logits.shape[-1])


def with_bits_per_byte(values: Mapping[str, float]) -> dict[str, float]:
    """``<set>_bpb`` for every ``<set>_loss`` (nats per byte): :func:`~.data.text.bits_per_byte`."""
    return {k[:-len("_loss")] + "_bpb": bits_per_byte(v) for k, v in values.items() if k.endswith("_loss")}


@functools.lru_cache(maxsize=4)
def _load(corpus: str, val_fraction: float, root: str | None):
    return load_corpus(corpus, val_fraction=val_fraction, root=root)


@functools.lru_cache(maxsize=2)
def _load_heldout(config: LMConfig):
    from .heldout import load_heldout_corpus

    return load_heldout_corpus(val_fraction=config.val_fraction, test_fraction=config.test_fraction,
                               context=config.context, count=config.eval_windows,
                               max_file_share=config.max_file_share, ngram=config.overlap_ngram,
                               max_overlap=config.max_overlap, root=config.corpus_root)


class _Fixed:
    """A held-out :class:`~.data.heldout.WindowSet` as an evaluation source (targets flattened, on ``device``)."""

    def __init__(self, windows, batch_size: int, device: torch.device) -> None:
        self.windows, self.batch_size, self.device = windows, batch_size, device

    def __len__(self) -> int:
        return -(-len(self.windows.files) // self.batch_size)

    def batches(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for x, y in self.windows.batches(self.batch_size):
            yield x.to(self.device), y.reshape(-1).to(self.device)


def heldout_eval_data(config: LMConfig, device: torch.device) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor]:
    """For ``test_fraction > 0``: the training stream, the evaluation sets (``val``, ``test`` and their non-empty
    categories ``val_code``, ``test_prose``, ...) and the probe windows (the first validation windows)."""
    from .heldout import CATEGORIES

    held = _load_heldout(dataclasses.replace(config, corpus_identity=None, train=TrainConfig(), optim=OptimConfig()))
    sets: dict[str, Any] = {}
    for split in (held.val, held.test):
        sets[split.name] = _Fixed(split, config.eval_batch, device)
        for category in CATEGORIES:
            part = split.subset(category)
            if part.files:
                sets[part.name] = _Fixed(part, config.eval_batch, device)
    probe = held.val.windows[:config.probe_windows, :-1].long()
    return held.train, sets, probe


def corpus_of(config: LMConfig):
    """The config's corpus (cached per process); refuses one whose identity differs from the recorded one."""
    corpus = _load(config.corpus, float(config.val_fraction), config.corpus_root)
    if config.corpus_identity is not None and config.corpus_identity.get("sha256") != corpus.sha256:
        raise ValueError(f"the corpus {config.corpus!r} read here (SHA-256 {corpus.sha256[:12]}…, "
                         f"{corpus.version}) is not the one the runs were trained on (SHA-256 "
                         f"{config.corpus_identity.get('sha256', '?')[:12]}…, {config.corpus_identity.get('version')}); "
                         f"use the same Python (or --corpus-root), or another --out folder.")
    return corpus


def build_task(spec: RunSpec, arm: Arm, device: torch.device) -> Task:
    """The LM task of one run: the seed's random training windows, fixed train/validation evaluation windows, a
    fixed probe batch, the seed's GPT-2 (converted for a frame arm, q/k-normalised for :data:`QK_NORM`'s arms),
    and every step on record (:class:`AttentionSteps`)."""
    cfg: LMConfig = spec.config
    corpus = corpus_of(cfg)
    model = build_model(cfg, seed=spec.seed, logit_gain=LOGIT_GAIN.get(spec.arm),
                        stiefel=arm.attention == "stiefel", qk_norm=spec.arm in QK_NORM)
    if cfg.test_fraction > 0:
        train_stream, held_out, probe = heldout_eval_data(cfg, device)
    else:
        train_stream, held_out = corpus.train, {"val": _Flat(EvalWindows(
            corpus.val, context=cfg.context, count=cfg.eval_windows, batch_size=cfg.eval_batch), device)}
        probe = next(iter(EvalWindows(corpus.val, context=cfg.context, count=cfg.probe_windows,
                                      batch_size=cfg.probe_windows).batches()))[0]
    train = _Flat(RandomWindows(train_stream, context=cfg.context, batch_size=cfg.batch_size,
                                steps=cfg.steps_per_epoch, seed=spec.seed), device)
    eval_data = {"train": _Flat(EvalWindows(train_stream, context=cfg.context, count=cfg.train_eval_windows,
                                            batch_size=cfg.eval_batch), device), **held_out}
    lr_factor = None
    if cfg.lr_schedule == "cosine":
        lr_factor = functools.partial(warmup_cosine, total=cfg.total_steps,
                                      warmup=int(cfg.warmup_fraction * cfg.total_steps))
    return Task(model=model, train_data=train, eval_data=eval_data, predict=predict_bytes,
                param_groups=lm_param_groups, hooks=(QKGeometry(gpt2_query_keys), AttentionProbe(probe.to(device))),
                lr_factor=lr_factor, grad_clip=cfg.grad_clip, derived=with_bits_per_byte, record_steps=True,
                step_hooks=(AttentionSteps(),))


# ---------------------------------------------------------------------------------------------- cells
def sweep_cells(config: LMConfig, frame_lrs: Sequence[float]) -> list[Cell]:
    """One cell per frame learning rate of the ``stiefel`` arm's sweep, under ``frame-lr-<value>``; a value equal
    to the main cell's frame lr is the main cell itself and gets no cell of its own."""
    values = sorted({float(v) for v in frame_lrs})
    for v in values:
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"--frame-lrs: {v:g} must be a finite float > 0.")
    return [Cell(dataclasses.replace(config, optim=dataclasses.replace(config.optim, frame_lr=v)),
                 f"frame-lr-{v:g}", "frame_lr", v)
            for v in values if not math.isclose(v, config.optim.effective_frame_lr, rel_tol=1e-12)]


# ---------------------------------------------------------------------------------------------- report
FINAL_KEYS = ("val_loss", "val_bpb", "train_bpb", "val_acc", "angle_max_deg/q", "angle_max_deg/k",
              "angle_mean_deg/q", "move_total_rel/q", "move_total_rel/k", "logit_rms/mean", "attn_entropy/mean")


def _corpus_paragraph(config: LMConfig) -> str:
    """The report's corpus line, from the recorded identity: the two-way split's (training and validation files
    and bytes) or, with a test split (``test_fraction > 0``, :func:`with_corpus_identity`), the three-way split's
    (training, validation and test files, the training bytes, the held-out windows and the licence)."""
    c = config.corpus_identity or {}
    if not c:
        return f"**Corpus: {config.corpus}** (identity not recorded)."
    head = f"**Corpus: {c['source']}** — corpus `{c['corpus']}`, version {c['version']}, SHA-256 `{c['sha256']}`; "
    if "test_files" in c:  # the three-way held-out split: no validation bytes, windows instead
        def files(n: int, kind: str) -> str:
            return f"{n} {kind} file{'' if n == 1 else 's'}"

        return (head + f"split {c['split']}: {files(c['train_files'], 'training')} ({c['train_bytes']:,} bytes), "
                f"{files(c['val_files'], 'validation')} ({c['val_windows']} windows), "
                f"{files(c['test_files'], 'test')} ({c['test_windows']} windows), val fraction {c['val_fraction']}, "
                f"test fraction {c['test_fraction']}; licence: {c['licence']}. Tokens are bytes.")
    return (head + f"split {c['split']}: {c['train_files']} training files ({c['train_bytes']:,} bytes), "
            f"{c['val_files']} validation files ({c['val_bytes']:,} bytes), val fraction {c['val_fraction']}. "
            "Tokens are bytes.")


def _setup_paragraph(config: LMConfig, arms: Sequence[str]) -> str:
    from ..harness.report import frame_rule_text

    o = config.optim
    sched = ("constant learning rate" if config.lr_schedule == "constant" else
             f"{100 * config.warmup_fraction:g}% linear warm-up then cosine decay to 0")
    clip = "no gradient clipping" if config.grad_clip is None else f"global gradient-norm clipping at {config.grad_clip:g}"
    gain = "".join(f" `{a}`: stiefelize(logit_gain=\"{LOGIT_GAIN[a]}\", gain_rate={config.gain_rate:g}), gains start at 1."
                   for a in arms if a in LOGIT_GAIN)
    return (f"HuggingFace GPT2LMHeadModel: {config.depth} layers, width {config.width}, {config.heads} heads, context "
            f"{config.context}, vocabulary 256 bytes, no dropout, tied embeddings. Batches of {config.batch_size} random "
            f"windows; {config.train.epochs} evaluation intervals × {config.steps_per_epoch} steps = {config.total_steps} steps "
            f"({config.total_steps * config.batch_size * config.context:,} training bytes). AdamW lr {o.lr:g}, betas "
            f"{o.betas}, eps {o.eps:g}, weight decay {o.weight_decay:g} on the blocks' matrices (none on biases, "
            f"LayerNorms, gains, embeddings); {sched}; {clip}. Frames: lr {o.effective_frame_lr:g}{frame_rule_text(o)}, "
            f"no weight decay (StiefelAdam trust region {o.trust_region}).{gain} Evaluation: {config.eval_windows} fixed validation windows, "
            f"{config.train_eval_windows} fixed training windows, probe batch of {config.probe_windows} validation "
            f"windows. A seed fixes the initial weights of every arm (the frames are the polar factors of the AdamW "
            f"arm's initial W_Q, W_K head blocks) and the order of the training windows (paired starts).")


def _mean_ci_text(values: Sequence[float], fmt: str = ".4f") -> str:
    from ..harness.stats import mean_ci

    m, lo, hi = mean_ci(list(values))
    if m is None:
        return "–"
    return f"{m:{fmt}}" + ("" if lo is None else f" [{lo:{fmt}}, {hi:{fmt}}]")


def _final(runs: Mapping[str, Mapping[int, list[Mapping[str, Any]]]], arm: str, key: str,
           epochs: int | None = None) -> dict[int, Any]:
    """``key`` at each seed's last record; with ``epochs``, only the seeds whose run reached that epoch (a run
    still training is not paired with a finished one)."""
    return {s: recs[-1].get(key) for s, recs in runs.get(arm, {}).items()
            if epochs is None or recs[-1]["epoch"] >= epochs}


class SweepMismatchError(ConfigMismatchError):
    """A frame-lr cell on disk was trained with other settings than the main cell, besides its frame lr (the
    command line reports it like any folder holding runs with other settings)."""


def _sweep_differences(main: LMConfig, cell: LMConfig) -> list[str]:
    """The settings in which a frame-lr cell's config differs from the main cell's, other than the frame lr."""
    a = to_dict(main)
    b = to_dict(dataclasses.replace(cell, optim=dataclasses.replace(cell.optim, frame_lr=main.optim.frame_lr)))
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _results_lines(records, arms: Sequence[str], config: LMConfig) -> list[str]:
    from ..harness.records import group_runs
    from ..harness.report import fmt_num

    runs = group_runs(records)
    lines = ["| arm | seeds | last epoch | val bpb, mean [95% CI] | val loss (nats/byte) | train bpb (fixed windows) "
             "| next-byte acc | max angle W_Q / W_K (°) | logit RMS (mean over heads) | attention entropy (nats) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    def vals(arm: str, key: str) -> list[float]:
        return [v for v in _final(runs, arm, key).values() if v is not None]

    def mean(arm: str, key: str) -> float | None:
        v = vals(arm, key)
        return sum(v) / len(v) if v else None

    for arm in arms:
        if arm not in runs:
            continue
        last = sorted({recs[-1]["epoch"] for recs in runs[arm].values()})
        lines.append(f"| {arm} | {len(runs[arm])} | {', '.join(map(str, last))} "
                     f"| {_mean_ci_text(vals(arm, 'val_bpb'))} | {_mean_ci_text(vals(arm, 'val_loss'))} "
                     f"| {fmt_num(mean(arm, 'train_bpb'), '.4f')} | {fmt_num(mean(arm, 'val_acc'), '.3f')} "
                     f"| {fmt_num(mean(arm, 'angle_max_deg/q'), '.1f')} / {fmt_num(mean(arm, 'angle_max_deg/k'), '.1f')} "
                     f"| {fmt_num(mean(arm, 'logit_rms/mean'))} | {fmt_num(mean(arm, 'attn_entropy/mean'))} |")
    lines.append("")
    ended = {recs[-1]["epoch"] for a in arms for recs in runs.get(a, {}).values()}
    if ended and ended != {config.train.epochs}:
        lines += [f"**Some runs have not reached epoch {config.train.epochs}; rerun the command to resume them "
                  f"before reading the comparisons.**", ""]
    return lines


def _per_head_lines(records, arms: Sequence[str], config: LMConfig) -> list[str]:
    from ..harness.records import group_runs

    runs = group_runs(records)
    lines = ["Per head at the last evaluation (mean over seeds): logit RMS / attention entropy (nats; uniform "
             f"attention over a causal window averages {_uniform_entropy(config.context):.2f}).", "",
             "| arm | layer | " + " | ".join(f"head {h}" for h in range(config.heads)) + " |",
             "|---|---|" + "---|" * config.heads]
    for arm in arms:
        if arm not in runs:
            continue
        for layer in range(config.depth):
            cells = []
            for h in range(config.heads):
                rms = [v for v in _final(runs, arm, f"logit_rms/{layer}/{h}").values() if v is not None]
                ent = [v for v in _final(runs, arm, f"attn_entropy/{layer}/{h}").values() if v is not None]
                cells.append("–" if not rms else f"{sum(rms) / len(rms):.3g} / {sum(ent) / len(ent):.2f}")
            lines.append(f"| {arm} | {layer} | " + " | ".join(cells) + " |")
    return lines + [""]


def _uniform_entropy(t: int) -> float:
    """Mean over positions of ln(i + 1): the entropy of uniform causal attention."""
    return sum(math.log(i + 1) for i in range(t)) / t


def _published_lines() -> list[str]:
    lines = ["## Published findings beside this study", ""]
    lines += [f"- {who}: {what}." for who, what in PUBLISHED]
    return lines + ["", "Neither used this corpus, model or budget, and we quote no numbers of theirs; the table above "
                        "is this study's own answer at its size.", ""]


NOTES = (
    "bpb = loss / ln 2 (loss in nats per byte). Validation and training-window losses are computed on the same "
    "fixed windows at every evaluation, for every arm and seed, so they pair exactly.",
    "Movement and principal angles are those of each head's block of the current c_attn weight (for frame arms the "
    "weight rebuilt from the frames, times the gain in stiefel-gain); angles are scale-free, movement is not.",
    "The frame-lr sweep runs the stiefel arm only; its paired differences are against the main cell's adamw runs "
    "(same seeds: the same initial weights and training windows; AdamW does not use the frame lr).",
    "The t-based intervals assume normally distributed per-seed values; with 3 seeds they are wide.",
)


def _sweep_folders(out_dir: Path) -> list[Cell]:
    """The frame-lr cells on disk, with the configs their runs were trained with."""
    from ..harness.records import run_paths
    from ..harness.run_folder import CONFIG_FILE

    cells = []
    for folder in sorted(out_dir.glob("frame-lr-*"), key=lambda p: float(p.name[len("frame-lr-"):])):
        specs = run_paths(folder, CONFIG_FILE)
        if specs:
            config = config_from_dict(LMConfig, json.loads(specs[0].read_text())["config"])
            cells.append(Cell(config, folder.name, "frame_lr", float(config.optim.frame_lr)))
    return cells


def finalize_lm(out_dir: str | os.PathLike, config: LMConfig, *, arms: Sequence[str] | None = None,
                seeds: Sequence[int] | None = None, results: Sequence[Any] = ()) -> StudyOutputs:
    """Summarise the records under ``out_dir`` (the main cell and every ``frame-lr-*`` cell on disk) and write
    ``summary.json``, the figures and ``report.md``. A function of the files in ``out_dir`` only."""
    from ..harness.plotting import plot_curves, plot_gap_sweep, plot_per_head, plot_principal_angles
    from ..harness.records import group_runs, summarize_cell
    from ..harness.report import comparison_table, figure_lines, run_lines, write_text
    from ..harness.stats import compare_arms
    from ..harness.study import cell_records, recorded_config, run_info_from_records, speed_from_environment

    out_dir = Path(out_dir)
    recorded = recorded_config(out_dir)  # the report shows the config as the runs recorded it
    config = config if recorded is None else config_from_dict(LMConfig, recorded)
    records = cell_records(out_dir, Cell(config), arms, seeds)
    on_disk = list(dict.fromkeys(r["arm"] for r in records))
    arms = list(arms) if arms is not None else [a for a in STUDY_ARMS if a in on_disk] + [
        a for a in on_disk if a not in STUDY_ARMS]
    main = summarize_cell(records, arms, metric="val_bpb", final_keys=FINAL_KEYS)
    runs = group_runs(records)
    speed = speed_from_environment(out_dir)

    sweep = []
    epochs = config.train.epochs
    for cell in _sweep_folders(out_dir):
        differs = _sweep_differences(config, cell.config)
        if differs:
            raise SweepMismatchError(f"lm report: the runs in {cell.subdir}/ were trained with other settings than the main "
                             f"cell's in {', '.join(differs)} (not only the frame lr), so they cannot be compared "
                             f"with its adamw runs; retrain them with the main cell's flags plus --frame-lrs, or move "
                             f"that folder out of {out_dir}.")
        recs = cell_records(out_dir, cell, ["stiefel"], seeds)
        per_seed = {"adamw": _final(runs, "adamw", "val_bpb", epochs),
                    "stiefel": _final(group_runs(recs), "stiefel", "val_bpb", epochs)}
        sweep.append({"frame_lr": cell.value, "subdir": cell.subdir,
                      "stiefel_val_bpb": per_seed["stiefel"],
                      "vs_adamw": compare_arms(per_seed, ["adamw", "stiefel"]).get("stiefel - adamw")})
        speed.update({f"{cell.subdir}/{k}": v for k, v in speed_from_environment(out_dir / cell.subdir).items()})
    if sweep and "stiefel" in runs:
        base_seeds = {"adamw": _final(runs, "adamw", "val_bpb", epochs),
                      "stiefel": _final(runs, "stiefel", "val_bpb", epochs)}
        base = {"frame_lr": config.optim.effective_frame_lr, "subdir": "", "stiefel_val_bpb": base_seeds["stiefel"],
                "vs_adamw": compare_arms(base_seeds, ["adamw", "stiefel"]).get("stiefel - adamw")}
        sweep = sorted([*sweep, base], key=lambda row: row["frame_lr"])

    figures: dict[str, Path | None] = {
        "Learning curves: bits per byte on the fixed validation and training windows (mean over seeds, band ±1 sd)":
            plot_curves(records, out_dir / "learning_curves.png", ["val_bpb", "train_bpb"],
                        title="bits per byte (log scale)", ylabel="bits per byte", logy=True),
        "Principal angles between each head's current and initial W_Q, W_K column spaces": plot_principal_angles(
            records, out_dir / "principal_angles.png"),
        "Relative movement ‖W − W₀‖_F/‖W₀‖_F of W_Q and W_K": plot_curves(
            records, out_dir / "movement.png", ["move_total_rel/q", "move_total_rel/k"],
            title="relative distance from initialisation", ylabel="‖W − W₀‖_F / ‖W₀‖_F"),
        "Per head over training: attention-logit scale (RMS of the causal logits, log scale) and attention "
        "entropy (nats); mean over seeds": plot_per_head(
            records, out_dir / "attention_heads.png", rows=(("logit_rms", "RMS logit", True),
                                                            ("attn_entropy", "entropy (nats)", False)),
            title="attention per head"),
    }
    if sweep:
        figures["Frame-lr sweep: stiefel − adamw, final validation bpb (mean ± 95% CI, dots: seeds)"] = plot_gap_sweep(
            [(row["frame_lr"], row["vs_adamw"]) for row in sweep], out_dir / "frame_lr_sweep.png",
            xlabel="frame learning rate (stiefel arm)", title="frame-lr sweep", logx=True, scale=1.0,
            ylabel="stiefel − adamw, final val bpb")
    figures = {k: v for k, v in figures.items() if v is not None}

    seeds_seen = sorted({s for a in main["arms"].values() for s in a["seeds"]})
    title = "Byte-level GPT-2 on the Python standard library: Stiefel W_Q/W_K vs AdamW"
    lines = [f"# {title}", "", _corpus_paragraph(config), "", _setup_paragraph(config, arms), "",
             "Arms: " + "; ".join(f"`{a}` ({ARMS[a].description})" for a in arms if a in ARMS)
             + f". Seeds: {', '.join(map(str, seeds_seen))}.", "", "## Results", ""]
    lines += _results_lines(records, arms, config)
    if main["comparisons"]:
        lines += ["Paired differences of the final validation bits per byte (negative: the first arm is better; same "
                  "seed: same initial weights and training windows):", ""]
        lines += comparison_table(main["comparisons"], unit="bpb") + [""]
    lines += _per_head_lines(records, arms, config)
    if sweep:
        lines += ["## Frame learning-rate sweep (stiefel arm)", "",
                  "| frame lr | seeds | stiefel val bpb, mean [95% CI] | stiefel − adamw (bpb), mean [95% CI] "
                  "| positive pairs |", "|---|---|---|---|---|"]
        for row in sweep:
            c = row["vs_adamw"]
            vals = [v for v in row["stiefel_val_bpb"].values() if v is not None]
            diff = "–" if not c or c["mean"] is None else (
                f"{c['mean']:+.4f}" + ("" if c["ci_low"] is None else f" [{c['ci_low']:+.4f}, {c['ci_high']:+.4f}]"))
            pos = "–" if not c else f"{c['n_positive']}/{c['n']}"
            lines.append(f"| {row['frame_lr']:g} | {len(vals)} | {_mean_ci_text(vals)} | {diff} | {pos} |")
        lines.append("")
    lines += _published_lines()
    lines += figure_lines({k: os.path.relpath(v, out_dir) for k, v in figures.items()})
    lines += run_lines(run_info_from_records(out_dir, speed))
    lines += ["## Configuration", "", "```json", json.dumps(to_dict(config), indent=2), "```", "",
              "## Notes", ""] + [f"- {n}" for n in NOTES] + [""]
    summary = {"title": title, "corpus": config.corpus_identity, "arms": list(arms), "seeds": seeds_seen,
               "config": to_dict(config), "published": [{"source": s, "finding": f} for s, f in PUBLISHED],
               "main": main, "frame_lr_sweep": sweep, "speed": speed,
               "figures": {k: os.path.relpath(v, out_dir) for k, v in figures.items()}}
    summary_path = out_dir / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    report_path = write_text(out_dir / "report.md", "\n".join(lines))
    return StudyOutputs(results=tuple(results), summary=summary, summary_path=summary_path, report_path=report_path,
                        figures=figures)


# ---------------------------------------------------------------------------------------------- running
def with_corpus_identity(config: LMConfig) -> LMConfig:
    """``config`` with ``corpus_identity`` set from the corpus it names (loaded here; refused if it differs).

    With a test split (``test_fraction > 0``) the identity describes the split the run uses: the three-way split of
    :mod:`~.data.heldout` (training, validation and test files, the training bytes, the evaluation windows of each
    held-out split) and the licence, where the plain corpus' two-way split would name files the run never trains
    on as training files. (The tuned study's records, written before this, describe the two-way split.)"""
    corpus = corpus_of(config)
    identity = corpus.describe()
    if config.test_fraction > 0:
        held = _load_heldout(dataclasses.replace(config, corpus_identity=None, train=TrainConfig(),
                                                 optim=OptimConfig()))
        del identity["val_bytes"]  # of the two-way split's validation files
        identity.update({k: held.identity[k] for k in ("split", "train_files", "val_files", "test_files",
                                                       "train_bytes")},
                        test_fraction=config.test_fraction, val_windows=len(held.val.files),
                        test_windows=len(held.test.files), licence=corpus_licence(config.corpus_root))
    return dataclasses.replace(config, corpus_identity=identity)


def _check_recorded_corpus(out_dir: str | os.PathLike, config: LMConfig) -> None:
    """Refuse, naming the two corpora, to add runs on one text to a folder whose runs were trained on another."""
    from ..harness.run_folder import ConfigMismatchError
    from ..harness.study import recorded_config

    recorded = (recorded_config(out_dir) or {}).get("corpus_identity")
    if recorded and recorded != config.corpus_identity:
        now = config.corpus_identity or {}
        raise ConfigMismatchError(
            f"{out_dir} holds runs trained on another corpus ({recorded.get('source')}, SHA-256 "
            f"{str(recorded.get('sha256'))[:12]}…) than the one read now ({now.get('source')}, SHA-256 "
            f"{str(now.get('sha256'))[:12]}…); use the same Python or --corpus-root, or another --out folder.")


def _tuned_folders(out_dir: str | os.PathLike) -> list[Path]:
    """The cell folders of a tuned study under ``out_dir`` (grid cells and the final cell) that exist."""
    out_dir = Path(out_dir)
    return sorted(p for p in out_dir.glob(f"{GRID_PREFIX}*") if p.is_dir()) + [
        p for p in [out_dir / FINAL_DIR] if p.is_dir()]


def run_lm(config: LMConfig, out_dir: str | os.PathLike, *, arms: Sequence[str] | None = STUDY_ARMS,
           seeds: Sequence[int] | None = (0, 1, 2), frame_lrs: Sequence[float] = (),
           options: RunOptions | None = None, report_only: bool = False, skip_report: bool = False,
           command: str | None = None, lrs: Sequence[float] = (), final_seeds: Sequence[int] = (),
           time_steps: int | None = None, allow_unbracketed: bool = False, confirm: tuple[int, int] | None = None,
           **run_kwargs: Any) -> StudyOutputs:
    """Run (or resume) every (arm, seed) of the main cell, then the ``stiefel`` arm at every extra frame lr of
    ``frame_lrs`` (:func:`sweep_cells`), and write the report into ``out_dir``. ``report_only``: train nothing,
    rebuild the report from the records (``config`` is then the recorded one; ``arms``/``seeds`` ``None``: all
    on disk). ``command`` is recorded in ``out_dir/study.json``.

    With ``lrs``, ``final_seeds`` or ``time_steps`` it is a tuned study instead (:func:`~.tuned.run_tuned`: the
    lr grid on ``seeds``, default 0 1; the final cell; the timing pass), which has no main cell; a folder holding
    one is reported by :func:`~.controls_report.finalize` (the tuned report, or the controls study's). A report that
    fails after training raises :class:`~..harness.study.ReportNotWrittenError` (the records stay complete)."""
    from ..harness.arms import get_arm
    from ..harness.study import run_cells, write_report

    if report_only:
        if is_tuned_folder(out_dir):
            return finalize_report(out_dir, LMConfig, arms=arms)
        return finalize_lm(out_dir, config, arms=arms, seeds=seeds)
    if lrs or final_seeds or time_steps:
        if frame_lrs:
            raise ValueError("--frame-lrs sweeps the main cell's stiefel arm; a tuned study (--lrs, --final-seeds, "
                             "--time-steps) has no main cell: drop --frame-lrs.")
        config = with_corpus_identity(config)
        for folder in _tuned_folders(out_dir):
            _check_recorded_corpus(folder, config)
        return run_tuned(config, out_dir, build_task, arms=list(arms or TUNED_ARMS),
                         seeds=list(TUNED_GRID_SEEDS) if lrs and seeds is None else seeds,
                         lrs=lrs, final_seeds=final_seeds, time_steps=time_steps, allow_unbracketed=allow_unbracketed,
                         confirm=confirm,
                         options=RunOptions.of(options, **run_kwargs), command=command, skip_report=skip_report,
                         config_type=LMConfig, finalize=finalize_report)
    arms = list(arms or STUDY_ARMS)
    seeds = list(seeds if seeds is not None else (0, 1, 2))
    for a in arms:
        get_arm(a, "lm")
    if frame_lrs and "stiefel" not in arms:
        raise ValueError(f"--frame-lrs sweeps the stiefel arm's frame lr, but --arms {' '.join(arms)} has no stiefel "
                         f"arm; add stiefel to --arms or drop --frame-lrs.")
    sweep = sweep_cells(config, frame_lrs)
    config = with_corpus_identity(config)
    _check_recorded_corpus(out_dir, config)
    sweep = [dataclasses.replace(c, config=with_corpus_identity(c.config)) for c in sweep]
    options = RunOptions.of(options, **run_kwargs)
    results = run_cells([Cell(config)], build_task, out_dir, arms=arms, seeds=seeds, command=command, options=options)
    if sweep:
        results += run_cells(sweep, build_task, out_dir, arms=["stiefel"], seeds=seeds, command=command,
                             options=options)
    if skip_report:
        return StudyOutputs(results=tuple(results))
    return write_report(finalize_lm, out_dir, config, arms=arms, seeds=seeds, results=results)


# ---------------------------------------------------------------------------------------------- CLI
def _none_or_positive_float(text: str) -> float | None:
    from geoopt_stiefel_attention.argtypes import positive_float

    return None if text.lower() in ("none", "off") else positive_float(text)


def _task_arguments(parser: argparse.ArgumentParser, d: LMConfig) -> None:
    from geoopt_stiefel_attention.argtypes import nonnegative_int, positive_float, positive_int

    g = parser.add_argument_group("corpus")
    g.add_argument("--corpus", choices=CORPORA, default=d.corpus,
                   help="python-stdlib: the running Python's standard-library sources (default)")
    g.add_argument("--corpus-root", default=None, metavar="DIR",
                   help="read the *.py files under DIR instead of the standard library")
    g.add_argument("--val-fraction", type=positive_float, default=d.val_fraction,
                   help=f"share of files held out for validation (default {d.val_fraction})")
    g.add_argument("--test-fraction", type=float, default=d.test_fraction,
                   help="share of files held out for a test split, with clean, capped, categorised validation and "
                        "test windows (data/heldout.py); 0: the plain validation windows (default 0)")
    g.add_argument("--max-file-share", type=positive_float, default=d.max_file_share,
                   help=f"held-out windows: largest share from one file (default {d.max_file_share})")
    g.add_argument("--max-overlap", type=float, default=d.max_overlap,
                   help=f"held-out windows: largest share of substrings also in the training text "
                        f"(default {d.max_overlap})")
    g.add_argument("--overlap-ngram", type=positive_int, default=d.overlap_ngram,
                   help=f"held-out windows: substring length of the overlap test, bytes (default {d.overlap_ngram})")
    g = parser.add_argument_group("model")
    g.add_argument("--context", type=positive_int, default=d.context, help=f"positions (default {d.context})")
    g.add_argument("--width", type=positive_int, default=d.width, help=f"n_embd (default {d.width})")
    g.add_argument("--depth", type=positive_int, default=d.depth, help=f"layers (default {d.depth})")
    g.add_argument("--heads", type=positive_int, default=d.heads, help=f"attention heads (default {d.heads})")
    g.add_argument("--gain-rate", type=positive_float, default=d.gain_rate,
                   help=f"stiefel-gain arm: gamma = exp(rate * theta) (default {d.gain_rate:g})")
    g = parser.add_argument_group("training")
    g.add_argument("--batch-size", type=positive_int, default=d.batch_size,
                   help=f"windows per batch (default {d.batch_size})")
    g.add_argument("--steps-per-epoch", type=positive_int, default=d.steps_per_epoch,
                   help=f"batches between two evaluations (default {d.steps_per_epoch})")
    g.add_argument("--eval-windows", type=positive_int, default=d.eval_windows,
                   help=f"fixed validation windows (default {d.eval_windows})")
    g.add_argument("--train-eval-windows", type=positive_int, default=d.train_eval_windows,
                   help=f"fixed training windows evaluated for the training loss (default {d.train_eval_windows})")
    g.add_argument("--eval-batch", type=positive_int, default=d.eval_batch,
                   help=f"windows per evaluation batch (default {d.eval_batch})")
    g.add_argument("--probe-windows", type=positive_int, default=d.probe_windows,
                   help=f"validation windows of the attention probe (default {d.probe_windows})")
    g.add_argument("--lr-schedule", choices=("cosine", "constant"), default=d.lr_schedule,
                   help="warm-up + cosine decay, or constant (default cosine)")
    g.add_argument("--warmup-fraction", type=float, default=d.warmup_fraction,
                   help=f"share of the steps spent warming up (default {d.warmup_fraction})")
    g.add_argument("--grad-clip", type=_none_or_positive_float, default=d.grad_clip,
                   help=f"global gradient-norm clip, or none (default {d.grad_clip})")
    g = parser.add_argument_group("study")
    g.add_argument("--frame-lrs", type=positive_float, nargs="+", default=[], metavar="LR",
                   help="frame-lr sweep of the stiefel arm: extra cells at these frame lrs (a value equal to the "
                        "frame lr reuses the main runs), e.g. 1e-3 1e-2 3e-2; default: no sweep")
    g = parser.add_argument_group("tuned study (experiments/tuned.py: lr grid, selection on validation, final "
                                  "cell on test)")
    g.add_argument("--lrs", type=positive_float, nargs="+", default=[], metavar="LR",
                   help="lr grid: every --arms arm at each lr (cells lr-<v>/; --lr is not used; the frames follow "
                        "--adjust-lr-fn, and --frame-lr if given), on --seeds (default 0 1); resumable")
    g.add_argument("--final-seeds", type=int, nargs="+", default=[], metavar="SEED",
                   help="final cell (final/): each --arms arm at its lr selected on validation from the grid on "
                        "disk, on these paired seeds, disjoint from the grid's --seeds (e.g. 2 3 4 5 6); refused while "
                        "the grid misses a run or an optimum is at a grid edge; resumable")
    g.add_argument("--allow-unbracketed", action="store_true",
                   help="with --final-seeds: run the final cell even where an arm's best lr is at a grid edge")
    g.add_argument("--confirm", type=nonnegative_int, nargs=2, default=None, metavar=("SEED", "POINTS"),
                   help="with --final-seeds or --time-steps: choose each arm's recipe on two seeds, the first of "
                        "--seeds and SEED, over its POINTS best grid points (lr x warm-up, ranked on the first seed); "
                        "the grid must hold SEED at those points")
    g.add_argument("--time-steps", type=positive_int, default=None, metavar="N",
                   help="timing pass: time every --arms arm's training step (N steps per round, 3 interleaved "
                        "rounds after a warm-up round, one process) at its selected lr; writes timing.json for the "
                        "equal-wall-clock readout")
    g.add_argument("--transfer-report", action="store_true",
                   help="train nothing: --out holds one lm study per model shape (experiments/lm/run_frame_step.sh); "
                        "write the report of the frame lr against the multiplier, one curve per shape")


def config_from_args(args: argparse.Namespace) -> LMConfig:
    from ..harness.cli_args import optim_config_from_args, train_config_from_args

    return LMConfig(corpus=args.corpus, corpus_root=args.corpus_root, val_fraction=args.val_fraction,
                    context=args.context, width=args.width, depth=args.depth, heads=args.heads,
                    batch_size=args.batch_size, steps_per_epoch=args.steps_per_epoch, eval_windows=args.eval_windows,
                    train_eval_windows=args.train_eval_windows, eval_batch=args.eval_batch,
                    probe_windows=args.probe_windows, lr_schedule=args.lr_schedule,
                    warmup_fraction=args.warmup_fraction, grad_clip=args.grad_clip, gain_rate=args.gain_rate,
                    test_fraction=args.test_fraction, max_file_share=args.max_file_share,
                    max_overlap=args.max_overlap, overlap_ngram=args.overlap_ngram,
                    train=train_config_from_args(args), optim=optim_config_from_args(args))


def _run_transfer_report(args: argparse.Namespace) -> int:
    from .transfer import transfer_report

    if not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out}: no such folder; pass the folder of per-shape lm studies "
                         f"(e.g. experiments/lm/records/frame-step).")
    parser = getattr(args, "_parser", None)
    given = [] if parser is None else [
        a.option_strings[-1] for a in parser._actions if a.option_strings
        and a.dest not in ("out", "transfer_report", "quiet", "help") and getattr(args, a.dest, a.default) != a.default]
    if given:  # the report reads only --out: a flag that would change nothing is refused, not ignored
        raise UsageError(f"--transfer-report reads only --out (the settings are those recorded with the runs); "
                         f"drop {' '.join(given)}.")
    try:
        summary = transfer_report(args.out)
    except ValueError as err:
        raise UsageError(f"--out {err}") from None
    for s in summary["shapes"]:
        print(f"  {s['name']}: best multiplier {s['best_multiplier']}, seeds {', '.join(s['seeds']) or 'none finished'}")
    print(f"lm: transfer report -> {Path(args.out) / 'report.md'}")
    return 0


class LMCommand(StudyCommand):
    """The ``python -m experiments lm`` command: flags -> :class:`LMConfig` -> :func:`run_lm` (a tuned study with
    ``--lrs``/``--final-seeds``/``--time-steps``; ``--transfer-report`` is handled by :meth:`run`)."""

    name = "lm"
    config_type = LMConfig
    arms = STUDY_ARMS
    seeds = (0, 1, 2)
    report_only_flags = frozenset({"corpus_root"})

    def task_arguments(self, parser: argparse.ArgumentParser, default: LMConfig) -> None:
        _task_arguments(parser, default)

    def config_from_args(self, args: argparse.Namespace) -> LMConfig:
        return config_from_args(args)

    def modules(self, config: LMConfig, args: argparse.Namespace) -> list[str]:
        return ["transformers"]

    def check(self, args: argparse.Namespace) -> None:
        tuned = bool(args.lrs or args.final_seeds or args.time_steps)
        if tuned and args.frame_lrs:
            raise UsageError("--frame-lrs sweeps the main cell's stiefel arm; a tuned study (--lrs, --final-seeds, "
                             "--time-steps) has no main cell: drop --frame-lrs.")
        if args.final_seeds and (min(args.final_seeds) < 0 or len(set(args.final_seeds)) != len(args.final_seeds)):
            raise UsageError(f"--final-seeds {' '.join(map(str, args.final_seeds))}: seeds are distinct ints >= 0, "
                             f"e.g. --final-seeds 2 3 4 5 6.")
        check_seed_range("--final-seeds", args.final_seeds)
        check_distinct("--lrs", args.lrs, "learning rate")
        check_distinct("--frame-lrs", args.frame_lrs, "frame learning rate")
        if args.confirm is not None:
            seed, points = args.confirm
            if not (args.final_seeds or args.time_steps):
                raise UsageError("--confirm chooses the final cell's recipes; pass --final-seeds or --time-steps too, "
                                 "or drop it.")
            if points < 1 or seed in args.final_seeds or seed in (args.seeds or []):
                raise UsageError(f"--confirm {seed} {points}: SEED must be neither a --seeds nor a --final-seeds seed, "
                                 f"and POINTS >= 1.")
            check_seed_range("--confirm", [seed])
        if args.allow_unbracketed and not args.final_seeds:
            raise UsageError("--allow-unbracketed only changes --final-seeds; pass --final-seeds too, or drop it.")
        if args.frame_lrs and args.arms is not None and "stiefel" not in args.arms:
            raise UsageError(f"--frame-lrs sweeps the stiefel arm's frame lr, but --arms {' '.join(args.arms)} has no "
                             f"stiefel arm; add stiefel to --arms or drop --frame-lrs.")
        check_input_folder("--corpus-root", args.corpus_root, "*.py files")
        if args.corpus_root is not None and not stdlib_files(args.corpus_root):
            raise UsageError(f"--corpus-root {args.corpus_root}: the folder holds no *.py files (outside test and "
                             f"site-packages folders); pass a folder holding *.py files.")

    def prepare(self, config: LMConfig, args: argparse.Namespace) -> LMConfig:
        """The sweep's (or the grid's) values and the corpus, checked before anything is written."""
        from .tuned import grid_cells

        sweep_cells(config, args.frame_lrs)
        grid_cells(config, args.lrs)
        return with_corpus_identity(config)

    def train(self, config: LMConfig, args: argparse.Namespace, **kwargs: Any) -> StudyOutputs:
        tuned = {}
        if not args.report_only and (args.lrs or args.final_seeds or args.time_steps):
            from .tuned import IncompleteSelectionError

            kwargs.update(arms=args.arms, seeds=args.seeds)  # not the plain study's defaults
            tuned = dict(lrs=args.lrs, final_seeds=args.final_seeds, time_steps=args.time_steps,
                         allow_unbracketed=args.allow_unbracketed,
                         confirm=None if args.confirm is None else tuple(args.confirm))
            try:
                return run_lm(config, args.out, frame_lrs=args.frame_lrs, skip_report=args.skip_report, **tuned,
                              **kwargs)
            except IncompleteSelectionError as err:
                raise UsageError(f"--final-seeds: {err}") from None
            except ValueError as err:
                if str(err).startswith("--"):
                    raise UsageError(str(err)) from None
                raise
        return run_lm(config, args.out, frame_lrs=args.frame_lrs, report_only=args.report_only,
                      skip_report=args.skip_report, **kwargs)

    def config_for_report(self, args: argparse.Namespace) -> LMConfig:
        """The config recorded in ``--out``: its main cell's runs, or for a tuned study (no main cell) its cells'."""
        from ..harness.records import run_paths

        if not run_paths(args.out, "config.json") and is_tuned_folder(args.out):
            return config_from_dict(LMConfig, find_config(args.out))
        return self.recorded_config(args.out)

    def result_line(self, r: Any, config: LMConfig) -> str:
        rate = "" if r.epochs_per_second is None else f", {r.epochs_per_second * config.steps_per_epoch:.2f} steps/s"
        bpb = (r.final_record or {}).get("val_bpb")
        return f"{r.run_dir}: epoch {r.epoch}{rate}" + ("" if bpb is None else f", val {bpb:.4f} bpb")

    def summary_lines(self, summary: dict[str, Any]) -> list[str]:
        if "selection" in summary:  # a tuned study
            lines = [f"{arm:<14} selected lr {s['best_lr']:g}" + ("" if s["bracketed"] else " (at a grid edge)")
                     for arm, s in summary["selection"]["arms"].items()]
            test = summary["final"]["test"]
            return lines + [f"{arm:<14} test {t['test']['mean']:.4f} bpb over {t['test']['n']} seed(s)"
                            for arm, t in test.items() if t.get("test", {}).get("mean") is not None]
        lines = []
        for arm, a in summary["main"]["arms"].items():
            f = a["final_val_bpb"]
            sd = "" if f.get("std") is None else f" ± {f['std']:.4f}"
            lines.append(f"{arm:<14} final val {f['mean']:.4f}{sd} bpb over {len(a['seeds'])} seed(s)")
        return lines

    def run(self, args: argparse.Namespace) -> int:
        """The study, or with ``--transfer-report`` the report over a folder of per-shape studies."""
        if args.transfer_report:
            return _run_transfer_report(args)
        return super().run(args)


#: The ``python -m experiments lm`` command.
STUDY = LMCommand()
add_arguments = STUDY.add_arguments
run = STUDY.run

