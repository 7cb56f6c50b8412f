"""Typed, frozen configuration of an experiment run.

A study's config is a frozen dataclass that holds its own fields (task, model) plus two shared blocks,
:class:`TrainConfig` (how long, how often to evaluate) and :class:`OptimConfig` (optimizer hyper-parameters
that every arm reads). One run is a :class:`RunSpec`: a study config, an arm name and a seed. Everything is
validated in ``__post_init__`` with an error that names the field and the fix, and serialises to plain JSON
with :func:`to_dict` (the run directory's ``config.json``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from geoopt_stiefel_attention.optim import ADJUST_LR_FNS, trust_radius

__all__ = ["TrainConfig", "OptimConfig", "RunSpec", "to_dict", "require", "flag_of", "config_value", "config_from_dict",
           "FORMER_CONFIG_CLASSES", "with_current_config_class"]


def require(ok: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``ok``; configs use it to validate their fields."""
    if not ok:
        raise ValueError(message)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class TrainConfig:
    """The schedule of the shared training loop.

    Parameters
    ----------
    epochs : int
        Passes over the training data. A full-batch study takes one optimizer step per epoch.
    eval_every : int
        Evaluate (and write a record) at epoch 0, at every multiple of ``eval_every``, and at the last epoch.
    """

    epochs: int = 1000
    eval_every: int = 10

    def __post_init__(self) -> None:
        require(_positive_int(self.epochs), f"--epochs {self.epochs!r}: must be a positive int (field epochs).")
        require(_positive_int(self.eval_every),
                f"--eval-every {self.eval_every!r}: must be a positive int, e.g. 100 (field eval_every).")

    def eval_epochs(self) -> list[int]:
        """The epochs at which a record is written: ``0, k, 2k, ..., epochs`` (the last one always)."""
        out = list(range(0, self.epochs + 1, self.eval_every))
        if out[-1] != self.epochs:
            out.append(self.epochs)
        return out

    def is_eval_epoch(self, epoch: int) -> bool:
        """Whether a record is written after ``epoch`` epochs."""
        return epoch % self.eval_every == 0 or epoch == self.epochs


@dataclass(frozen=True)
class OptimConfig:
    r"""Optimizer hyper-parameters shared by every arm (each arm reads the ones it uses).

    Parameters
    ----------
    lr : float
        Learning rate of the Euclidean parameters (AdamW) and, unless ``frame_lr`` is set, of the frames.
    betas : (float, float)
        Adam decay rates :math:`(\beta_1, \beta_2)`, used by every Adam-type optimizer of the arm.
    eps : float
        Adam's :math:`\epsilon`.
    weight_decay : float
        Decoupled weight decay :math:`\lambda` of the decayed Euclidean matrices (AdamW:
        :math:`W \leftarrow W - \mathrm{lr}\,\lambda W` each step). Frames never get weight decay.
    frame_lr : float or None
        Learning rate of the Stiefel frames; ``None`` means ``lr``.
    trust_region : float, "auto" or None
        :class:`~geoopt_stiefel_attention.StiefelAdam`'s per-frame cap :math:`\Delta` on :math:`\|s\|_F`, in the
        frame's own units; ``"auto"``: the library's default for ``adjust_lr_fn`` (0.1 under ``"original"``, 1
        under ``"match_rms_adamw"``), resolved to that number at construction. Records written before issue 40
        hold 0.1, which under
        ``"match_rms_adamw"`` then meant :math:`0.1\sqrt{d r}`.
    momentum : float
        Momentum of the ``geoopt-rsgd`` arm's :class:`geoopt.optim.RiemannianSGD` on the frames.
    adjust_lr_fn : {"original", "match_rms_adamw"}
        What the frames' learning rate measures under :class:`~geoopt_stiefel_attention.StiefelAdam`
        (:func:`~geoopt_stiefel_attention.optim.frame_step_scale`): ``"original"`` (the paper's step, and what
        every run recorded before the option existed used) or ``"match_rms_adamw"``.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    frame_lr: float | None = None
    trust_region: float | str | None = "auto"
    momentum: float = 0.9
    adjust_lr_fn: str = dataclasses.field(default="original", metadata={"omit_if_default": True})

    def __post_init__(self) -> None:
        require(_finite(self.lr) and self.lr > 0, f"--lr {self.lr!r}: must be a finite float > 0 (field lr).")
        betas = tuple(self.betas) if isinstance(self.betas, (list, tuple)) else self.betas
        require(isinstance(betas, tuple) and len(betas) == 2 and all(_finite(b) and 0 <= b < 1 for b in betas),
                f"--betas {self.betas!r}: must be two floats in [0, 1), e.g. 0.9 0.98 (field betas).")
        object.__setattr__(self, "betas", tuple(float(b) for b in betas))
        require(_finite(self.eps) and self.eps > 0, f"--eps {self.eps!r}: must be a finite float > 0 (field eps).")
        require(_finite(self.weight_decay) and self.weight_decay >= 0,
                f"--weight-decay {self.weight_decay!r}: must be a finite float >= 0 (field weight_decay).")
        require(self.frame_lr is None or (_finite(self.frame_lr) and self.frame_lr > 0),
                f"--frame-lr {self.frame_lr!r}: must be a finite float > 0, or None to use --lr (field frame_lr).")
        require(self.trust_region is None or self.trust_region == "auto"
                or (_finite(self.trust_region) and self.trust_region > 0),
                f"--trust-region {self.trust_region!r}: must be a finite float > 0, auto, or none "
                f"(field trust_region).")
        require(_finite(self.momentum) and 0 <= self.momentum < 1,
                f"--momentum {self.momentum!r}: must be a float in [0, 1) (field momentum).")
        require(self.adjust_lr_fn in ADJUST_LR_FNS,
                f"--adjust-lr-fn {self.adjust_lr_fn!r}: must be one of {', '.join(ADJUST_LR_FNS)} "
                f"(field adjust_lr_fn).")
        if self.trust_region == "auto":  # recorded as the radius it stands for, so that records say what ran
            object.__setattr__(self, "trust_region", trust_radius("auto", self.adjust_lr_fn))

    @property
    def effective_frame_lr(self) -> float:
        """The frames' learning rate: ``frame_lr`` when set, else ``lr``."""
        return self.lr if self.frame_lr is None else self.frame_lr


@dataclass(frozen=True)
class RunSpec:
    """One run: a study config, an arm and a seed.

    The seed fixes everything random in the run (data split or order, initialisation); two runs with the
    same config and seed but different arms start from the same weights and see the same data (paired
    starts).

    Parameters
    ----------
    config : dataclass
        The study's frozen config; it must have the fields ``experiment`` (str), ``train``
        (:class:`TrainConfig`) and ``optim`` (:class:`OptimConfig`).
    arm : str
        A name registered in :data:`experiments.harness.arms.ARMS`.
    seed : int
        A non-negative int.
    """

    config: Any
    arm: str
    seed: int = 0

    def __post_init__(self) -> None:
        cfg = self.config
        require(dataclasses.is_dataclass(cfg) and not isinstance(cfg, type),
                f"RunSpec: config must be a study config dataclass instance, got {type(cfg).__name__}.")
        for name, kind in (("experiment", str), ("train", TrainConfig), ("optim", OptimConfig)):
            require(isinstance(getattr(cfg, name, None), kind),
                    f"RunSpec: config {type(cfg).__name__} needs a field {name!r} of type {kind.__name__}.")
        require(isinstance(self.arm, str) and self.arm != "", f"RunSpec: arm={self.arm!r} must be an arm name.")
        require(isinstance(self.seed, int) and not isinstance(self.seed, bool) and self.seed >= 0,
                f"RunSpec: seed={self.seed!r} must be an int >= 0.")

    @property
    def experiment(self) -> str:
        return self.config.experiment

    @property
    def name(self) -> str:
        """``<arm>/seed<k>``: the run's sub-directory under a study's output folder."""
        return f"{self.arm}/seed{self.seed}"


def to_dict(obj: Any) -> Any:
    """Plain-JSON form of a (nested) config: dataclasses become dicts, tuples lists. A field added after runs
    were recorded (``metadata={"omit_if_default": True}``) is written only when it differs from its default,
    which is what the older records, written without it, mean: their configs and reports stay byte for byte."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)
               if not (f.metadata.get("omit_if_default") and getattr(obj, f.name) == f.default)}
        if isinstance(obj, RunSpec):
            out["config_class"] = f"{type(obj.config).__module__}.{type(obj.config).__qualname__}"
        return out
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_dict(v) for k, v in obj.items()}
    return obj


#: Former name -> name of each study's config class, as a run's ``config.json`` records it (``config_class``):
#: the studies left the package on 2026-12-05 (issue 39), and the runs recorded before keep their files as they are.
FORMER_CONFIG_CLASSES = {
    "geoopt_stiefel_attention.experiments.grokking.GrokkingConfig": "experiments.grokking.study.GrokkingConfig",
    "geoopt_stiefel_attention.experiments.vision.VisionConfig": "experiments.vision.study.VisionConfig",
    "geoopt_stiefel_attention.experiments.lm.LMConfig": "experiments.lm.study.LMConfig",
}


def with_current_config_class(recorded: dict[str, Any]) -> dict[str, Any]:
    """A run's recorded ``config.json`` with a former ``config_class`` (:data:`FORMER_CONFIG_CLASSES`) read as its
    current name, so that a run recorded before the studies moved is still "the same run" (it resumes and extends);
    anything else is returned unchanged.

    Examples
    --------
    >>> from experiments.harness.config import with_current_config_class
    >>> with_current_config_class({"config_class": "geoopt_stiefel_attention.experiments.lm.LMConfig", "seed": 0})
    {'config_class': 'experiments.lm.study.LMConfig', 'seed': 0}
    >>> with_current_config_class({"config_class": "tests.Other", "seed": 0})
    {'config_class': 'tests.Other', 'seed': 0}
    """
    name = recorded.get("config_class")
    if name not in FORMER_CONFIG_CLASSES:
        return recorded
    return {**recorded, "config_class": FORMER_CONFIG_CLASSES[name]}


#: Config fields whose command-line flag is not ``--<field-with-dashes>``.
_FLAG_OF_FIELD = {"arm": "--arms", "seed": "--seeds", "fast_forward": "--no-fast-forward",
                  "experiment": "the study", "config_class": "the study"}


def flag_of(path: str) -> str:
    """The command-line flag of a config field given by its dotted path (``config.train.epochs`` -> ``--epochs``)."""
    name = path.rsplit(".", 1)[-1]
    return _FLAG_OF_FIELD.get(name, "--" + name.replace("_", "-"))


def config_value(config: Any, path: str) -> Any:
    """The value at a dotted path of a config (``"train.epochs"``), read from its plain-JSON form."""
    node = to_dict(config)
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(f"config has no field {path!r}")
        node = node[part]
    return node


def config_from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Rebuild a study config of class ``cls`` from its :func:`to_dict` form (a run's ``config.json``): the
    ``train`` and ``optim`` blocks become :class:`TrainConfig` and :class:`OptimConfig` again."""
    fields = {k: v for k, v in data.items() if k not in ("train", "optim")}
    optim = {**data["optim"], "betas": tuple(data["optim"]["betas"])}
    return cls(**fields, train=TrainConfig(**data["train"]), optim=OptimConfig(**optim))
