r"""The modular-arithmetic grokking study: ``python -m experiments grokking``.

Task: learn :math:`(a \circ b) \bmod p` from a random ``train_fraction`` of all pairs
(:mod:`.data.modular`; tokens ``[a, op, b, =]``, the answer predicted at the last position) with full-batch
training of a :class:`~geoopt_stiefel_attention.TinyTransformer` (default: 1 layer, width 128, 4 heads,
MLP 512), AdamW lr 1e-3, betas (0.9, 0.98), weight decay 1.0 on the Euclidean matrices, 20,000 epochs. The
``stiefel`` arm keeps W_Q, W_K on the Stiefel manifold and trains them with
:class:`~geoopt_stiefel_attention.StiefelAdam` (lr ``frame_lr``, default the same lr); the ``adamw`` arm is
the all-Euclidean baseline. The same seed gives both arms the same split and the same initial weights
(the Stiefel frames are the polar factors of the Euclidean arm's W_Q, W_K).

The paper reports 97.0% (Stiefel) against 61.1% (AdamW) validation accuracy at epoch 20,000, one run
each, and calls the endpoint unstable; this study reruns it over several seeds.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..harness import ablation_arms  # noqa: F401  (registers the frozen, orthostart and ablation arms)
from ..harness.arms import Arm
from ..harness.batches import FullBatch
from ..harness.command import StudyCommand
from ..harness.config import OptimConfig, RunSpec, TrainConfig, require
from ..harness.jobs import RunOptions
from ..harness.mechanism import seeds_text
from ..harness.metrics import QKGeometry, WeightNorms
from ..harness.report import PaperReference, frame_rule_text
from ..harness.runner import Task
from ..harness.study import StudyOutputs, finalize_study, run_study
from .data import canonical_operation, is_prime, modular_split

__all__ = ["GrokkingConfig", "build_task", "run_grokking", "PAPER", "HELP", "STUDY", "add_arguments", "run",
           "readme_blocks", "readme_block", "refresh_readme"]

HELP = "Modular-arithmetic grokking: Stiefel W_Q/W_K (StiefelAdam) vs AdamW over seeds; records, plots, report."

#: The paper's numbers: validation accuracy at epoch 20,000, one run per arm.
PAPER = PaperReference(
    source="R. D. Guerrero, \"Stiefel Attention\", arXiv, Sep 2026",
    epoch=20000,
    values={"stiefel": 0.970, "adamw": 0.611},
    note="One run per arm; the author calls the endpoint unstable and reads it as evidence for the mechanism, "
         "not as an effect size.",
    protocol={"p": 97, "operation": "+", "train_fraction": 0.3, "train.epochs": 20000},
)


@dataclass(frozen=True)
class GrokkingConfig:
    """Configuration of the grokking study (task, model, schedule, optimizer).

    The vocabulary (``p + 2``) and the sequence length (4) follow from ``p`` and the encoding; they are
    not fields. ``fast_forward`` evaluates the last block at the last position only
    (:func:`last_position_fast`, verified against the full forward when the model is built).
    """

    experiment: str = "grokking"
    p: int = 97
    operation: str = "+"
    train_fraction: float = 0.3
    width: int = 128
    depth: int = 1
    heads: int = 4
    mlp: int = 512
    fast_forward: bool = True
    train: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=20000, eval_every=100))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, betas=(0.9, 0.98), weight_decay=1.0))

    def __post_init__(self) -> None:
        object.__setattr__(self, "operation", canonical_operation(self.operation))
        require(isinstance(self.p, int) and self.p >= 2, f"--p {self.p!r}: the modulus must be an int >= 2.")
        require(self.operation != "/" or is_prime(self.p),
                f"--operation /: needs a prime --p, got --p {self.p}.")
        require(isinstance(self.train_fraction, float | int) and 0 < self.train_fraction < 1,
                f"--train-fraction {self.train_fraction!r}: must be in (0, 1), e.g. 0.3.")
        for name in ("width", "depth", "heads", "mlp"):
            v = getattr(self, name)
            require(isinstance(v, int) and v > 0, f"--{name} {v!r}: must be a positive int.")
        require(self.width % self.heads == 0,
                f"--width {self.width} must be divisible by --heads {self.heads}.")
        require(isinstance(self.fast_forward, bool), f"fast_forward={self.fast_forward!r} must be a bool (--no-fast-forward).")
        require(isinstance(self.train, TrainConfig), "GrokkingConfig.train must be a TrainConfig.")
        require(isinstance(self.optim, OptimConfig), "GrokkingConfig.optim must be an OptimConfig.")


#: Largest entry-wise gap accepted between :func:`last_position_fast` and :func:`last_position` (float32
#: logits of order one; the two differ only by the rounding of differently shaped matrix products).
FAST_PATH_TOLERANCE = 1e-4


def last_position(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Logits at the last position (the ``=`` token), ``(B, vocab)``: ``model(tokens)[:, -1]``."""
    return model(tokens)[:, -1, :]


def last_position_fast(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    r"""The same logits as :func:`last_position`, computing only what the last position needs.

    In the last pre-LayerNorm block only the last position's output is read, so its query, attention
    output, MLP, final norm and unembedding are evaluated at that position alone (keys and values still
    come from every position; the last position attends to all of them, so no causal mask is needed):

    .. math:: x_T' = x_T + \mathrm{Attn}(\mathrm{LN}(x)_T, \mathrm{LN}(x), \mathrm{LN}(x)), \qquad
              \text{logits} = \mathrm{LN}\big(x_T' + \mathrm{MLP}(\mathrm{LN}(x_T'))\big)\, U.

    It is the same function of the weights (so the same gradients) at about a third of the cost for
    ``T = 4``. It reads :class:`~geoopt_stiefel_attention.TinyTransformer`'s submodules, so
    :func:`build_task` checks it against :func:`last_position` on every new model and falls back to the
    latter (with a warning) if they disagree by more than :data:`FAST_PATH_TOLERANCE`.
    """
    t = tokens.shape[1]
    x = model.token_embedding(tokens) + model.position_embedding[:t]
    for block in model.blocks[:-1]:
        x = block(x, causal=True)
    last = model.blocks[-1]
    h = last.norm1(x)
    x = x[:, -1:] + last.attn(h[:, -1:], h, h, need_weights=False)[0]
    x = x + last.mlp(last.norm2(x))
    return model.unembed(model.final_norm(x))[:, 0]


def _choose_predict(model: torch.nn.Module, sample: torch.Tensor):
    """:func:`last_position_fast` when it reproduces :func:`last_position` on ``sample``, else the latter."""
    import warnings

    try:
        with torch.no_grad():
            gap = float((last_position_fast(model, sample) - last_position(model, sample)).abs().max())
    except (AttributeError, TypeError, RuntimeError, ValueError) as err:
        gap, reason = float("inf"), f"it failed ({err})"
    else:
        reason = f"it differs from model(tokens)[:, -1] by {gap:.3g}"
    if gap <= FAST_PATH_TOLERANCE:
        return last_position_fast
    warnings.warn(f"grokking: the last-position fast path is off because {reason}; training uses the full "
                  f"forward (about 3x slower). Results are unaffected.", RuntimeWarning, stacklevel=3)
    return last_position


def build_task(spec: RunSpec, arm: Arm, device: torch.device) -> Task:
    """The grokking task of one run: the seed's split (full batch) and a TinyTransformer with the arm's
    attention, built from the seed."""
    from geoopt_stiefel_attention.models import TinyTransformer
    from geoopt_stiefel_attention.nn import param_groups, query_key_projections

    cfg: GrokkingConfig = spec.config
    split = modular_split(cfg.p, cfg.operation, cfg.train_fraction, spec.seed)
    model = TinyTransformer(split.vocab_size, split.seq_len, width=cfg.width, depth=cfg.depth, heads=cfg.heads,
                            mlp=cfg.mlp, attention=arm.attention, seed=spec.seed)
    train = FullBatch(split.train_inputs.to(device), split.train_targets.to(device))
    val = FullBatch(split.val_inputs.to(device), split.val_targets.to(device))
    predict = _choose_predict(model, split.train_inputs[:64]) if cfg.fast_forward else last_position
    return Task(model=model, train_data=train, eval_data={"train": train, "val": val}, predict=predict,
                param_groups=param_groups, hooks=(WeightNorms(), QKGeometry(query_key_projections)))


def _intro(config: GrokkingConfig) -> str:
    return (f"Task: (a {config.operation} b) mod {config.p}, train fraction {config.train_fraction}, full batch. "
            f"TinyTransformer {config.depth} layer(s), width {config.width}, {config.heads} heads, MLP {config.mlp}. "
            f"AdamW lr {config.optim.lr:g}, betas {config.optim.betas}, weight decay {config.optim.weight_decay:g} on "
            f"the Euclidean matrices; frames lr {config.optim.effective_frame_lr:g}{frame_rule_text(config.optim)}, no "
            f"weight decay. "
            f"{config.train.epochs} epochs, evaluated every {config.train.eval_every}. Each seed gives every arm the "
            f"same split and the same initial weights.")


NOTES = (
    "The paper's numbers are one run per arm at epoch 20,000 and, in the author's words, an unstable endpoint; "
    "compare them with the spread over seeds here, not with the mean alone.",
    "'First epoch ≥ 95%' is resolved to the evaluation interval.",
    "Movement ‖W_Q − W_Q0‖_F compares matrices of different scale across arms (frames have ‖W‖_F = √(heads·r)); "
    "the principal angles are scale-free.",
)


def run_grokking(config: GrokkingConfig, out_dir, *, arms=("adamw", "stiefel"), seeds=(0,),
                 options: RunOptions | None = None, report_only: bool = False, skip_report: bool = False,
                 command: str | None = None, **run_kwargs) -> StudyOutputs:
    """Run (or resume) the study and write ``summary.json``, ``report.md`` and the PNG figures into
    ``out_dir``; returns :class:`~.study.StudyOutputs` (without a summary when ``skip_report``). With
    ``report_only`` nothing is trained and the report is rebuilt from the records (``arms``/``seeds`` ``None``:
    every arm and seed on disk). ``command`` is recorded in ``out_dir/study.json`` and shown in the report.
    ``options`` (:class:`~.jobs.RunOptions`) says how to run; its fields may also be given by keyword."""
    kwargs = dict(title=f"Grokking on (a {config.operation} b) mod {config.p}: Stiefel W_Q/W_K vs AdamW",
                  intro=_intro(config), paper=PAPER, notes=NOTES)
    if report_only:
        return _finalize(out_dir, config, arms=None if arms is None else list(arms),
                         seeds=None if seeds is None else list(seeds), **kwargs)
    trained = run_study(config, build_task, out_dir, arms=list(arms), seeds=list(seeds),
                        options=RunOptions.of(options, **run_kwargs), skip_report=True, command=command)
    if skip_report:
        return trained
    return _finalize(out_dir, config, arms=list(arms), seeds=list(seeds), results=trained.results, **kwargs)


def _finalize(out_dir, config: GrokkingConfig, **kwargs) -> StudyOutputs:
    """:func:`~.study.finalize_study`, then the contrasts of the arms that separate start, constraint and step with
    runs of one machine kind per pair, from the folders beside ``runs/`` (``repro/``, ``same_cpu/``), and W_Q's
    shrinkage, movement and rotation per arm (:func:`~..harness.mechanism.refine_study_outputs`)."""
    from ..harness.mechanism import refine_study_outputs

    outputs = finalize_study(out_dir, config=config, **kwargs)
    return refine_study_outputs(outputs, out_dir, decay=(config.optim.lr, config.optim.weight_decay))


# ---------------------------------------------------------------------------------------------- CLI
def _task_arguments(parser: argparse.ArgumentParser, d: GrokkingConfig) -> None:
    g = parser.add_argument_group("task and model")
    g.add_argument("--p", type=int, default=d.p, help=f"modulus (default {d.p})")
    g.add_argument("--operation", default=d.operation, help="+ - * / (or add sub mul div; default +)")
    g.add_argument("--train-fraction", type=float, default=d.train_fraction,
                   help=f"share of all pairs used for training (default {d.train_fraction})")
    g.add_argument("--width", type=int, default=d.width, help=f"model width (default {d.width})")
    g.add_argument("--depth", type=int, default=d.depth, help=f"layers (default {d.depth})")
    g.add_argument("--heads", type=int, default=d.heads, help=f"attention heads (default {d.heads})")
    g.add_argument("--mlp", type=int, default=d.mlp, help=f"MLP hidden width (default {d.mlp})")
    g.add_argument("--no-fast-forward", dest="fast_forward", action="store_false",
                   help="run the full forward at every position (default: last block at the last position only)")


def config_from_args(args: argparse.Namespace) -> GrokkingConfig:
    from ..harness.cli_args import optim_config_from_args, train_config_from_args

    return GrokkingConfig(p=args.p, operation=args.operation, train_fraction=args.train_fraction, width=args.width,
                          depth=args.depth, heads=args.heads, mlp=args.mlp,
                          fast_forward=args.fast_forward, train=train_config_from_args(args),
                          optim=optim_config_from_args(args))


class GrokkingCommand(StudyCommand):
    """The ``python -m experiments grokking`` command: flags -> :class:`GrokkingConfig` -> :func:`run_grokking`."""

    name = "grokking"
    config_type = GrokkingConfig
    arms = ("adamw", "stiefel")
    seeds = (0,)

    def task_arguments(self, parser: argparse.ArgumentParser, default: GrokkingConfig) -> None:
        _task_arguments(parser, default)

    def config_from_args(self, args: argparse.Namespace) -> GrokkingConfig:
        return config_from_args(args)

    def prepare(self, config: GrokkingConfig, args: argparse.Namespace) -> GrokkingConfig:
        """Refuse a split with an empty training or validation set before any run folder is written (its sizes
        depend on --p and --train-fraction only, not on the seed)."""
        from .data import modular_split

        try:
            modular_split(config.p, config.operation, config.train_fraction, seed=0)
        except ValueError as err:
            raise ValueError(f"--train-fraction {config.train_fraction} with --p {config.p}: {err}") from None
        return config

    def train(self, config: GrokkingConfig, args: argparse.Namespace, **kwargs) -> StudyOutputs:
        return run_grokking(config, args.out, report_only=args.report_only, skip_report=args.skip_report, **kwargs)

    def result_line(self, r, config: GrokkingConfig) -> str:
        rate = "" if r.epochs_per_second is None else f", {r.epochs_per_second:.2f} epochs/s"
        acc = (r.final_record or {}).get("val_acc")
        return f"{r.name}: epoch {r.epoch}{rate}" + ("" if acc is None else f", val acc {100 * acc:.1f}%")

    def summary_lines(self, summary: dict) -> list[str]:
        lines = []
        for arm, s in summary["summary"]["arms"].items():
            fin = s["final"]
            std = "" if fin["std"] is None else f" ± {100 * fin['std']:.1f}"
            lines.append(f"{arm:<14} final val acc {100 * fin['mean']:.1f}%{std} over seeds {s['seeds']}; "
                         f"reached 95% in {s['first_epoch_reaching']['n_reached']}/{s['first_epoch_reaching']['n']}; "
                         f"stays ≥95% (last 10%): {s['stays_above']['fraction']:.2f}")
        return lines


#: The ``python -m experiments grokking`` command.
STUDY = GrokkingCommand()
add_arguments = STUDY.add_arguments
run = STUDY.run


# ---------------------------------------------------------------------------------------------- README blocks
#: The committed ten-seed, six-arm study whose numbers the README's generated blocks quote.
ARMS10 = Path(__file__).resolve().parent / "records" / "p97_add_arms10"
README = Path(__file__).resolve().parent / "README.md"
#: The new arm of issue 38 and the arms retrained on its commit and CPU kind to pair with it.
NODECAY, RETRAINED = "adamw-qk-nodecay", ("adamw", "adamw-frozen")


def _signed(x: float) -> str:
    return f"{x:+,.0f}".replace("-", "−")


def _ci(c: Mapping[str, Any]) -> str:
    return f"[{_signed(c['ci_low'])}, {_signed(c['ci_high'])}]" if c.get("ci_low") is not None else "[–, –]"


def _numbers(c: Mapping[str, Any]) -> dict[str, Any]:
    """The fields a contrast's sentence quotes, formatted as the README writes them."""
    def p(x):
        return "–" if x is None else f"{x:.2g}"
    return {"mean": "–" if c["mean"] is None else _signed(c["mean"]), "ci": _ci(c), "n": c["n"],
            "n_neg": c["n_negative"], "n_pos": c["n_positive"], "p_holm": p(c.get("p_holm")),
            "sign_p": p(c.get("sign_test_p")), "sign_p_holm": p(c.get("sign_test_p_holm")), "verdict": c.get("verdict"),
            "seeds": seeds_text(sorted(int(s) for s in c.get("pairs", {}))), "machines": ", ".join(c.get("machines", [])),
            "side": "*later*" if (c["mean"] or 0) > 0 else "*earlier*"}


#: The README's sentence per contrast of the study's own runs, with the verdict its words were written for (a
#: rebuilt summary with another verdict fails :func:`readme_blocks`: the words need rewriting, not just the numbers).
OWN_RUNS_SENTENCES = {
    "the start": ("suggested", "- **The start** does not make grokking earlier. AdamW from the `stiefel` arm's "
                  "orthonormal frames groks {mean} epochs *later* than from random W_Q/W_K (95% CI {ci}; later on "
                  "{n_pos}/{n} seeds, sign test p = {sign_p}, {sign_p_holm} after Holm; t-test Holm p = {p_holm}): "
                  "{verdict}, no more."),
    "training W_Q, W_K at all": ("clear", "- **Not training W_Q/W_K at all** makes it earlier: frozen at AdamW's "
                                 "random start, {mean} epochs (CI {ci}, {n_neg}/{n} seeds, Holm p = {p_holm}): "
                                 "{verdict}."),
    "orthonormality of frozen W_Q, W_K": ("not seen", "- **Orthonormality of frozen W_Q/W_K** adds nothing we can "
                                          "see: {mean} epochs (CI {ci}, {n_neg}/{n} seeds, Holm p = {p_holm}): "
                                          "{verdict}."),
    "the constraint with its step": ("clear", "- **The constraint with its step**, from the same frames: {mean} "
                                     "epochs against AdamW (CI {ci}, {n_neg}/{n} seeds, Holm p = {p_holm}): "
                                     "{verdict}."),
    "the step on the manifold": ("not seen", "- **The step on the manifold**, against holding the same frames "
                                 "fixed: {mean} epochs (CI {ci}, earlier on {n_neg}/{n} seeds, Holm p = {p_holm}): "
                                 "{verdict}."),
}
#: The sentences of the two contrasts of issue 38 (any verdict), each followed by its cross-CPU comparison.
NODECAY_SENTENCES = {
    "weight decay on W_Q, W_K": "- **Weight decay on W_Q/W_K** (issue 38): AdamW without decay on W_Q/W_K groks "
                                "{mean} epochs {side} than with it, over {n} seed pairs of one CPU kind ({machines}; "
                                "seeds {seeds}; CI {ci}, earlier on {n_neg}/{n}, Holm p = {p_holm}): {verdict}.",
    "training W_Q, W_K without decay": "- **Training W_Q/W_K without decay**, against freezing them: frozen groks "
                                       "{mean} epochs {side}, over {n} seed pairs of one CPU kind ({machines}; seeds "
                                       "{seeds}; CI {ci}, earlier on {n_neg}/{n}, Holm p = {p_holm}): {verdict}.",
}
CROSS_SENTENCE = ("  Paired across CPU kinds instead (the study's own runs, {machines}; for comparison only): {mean} "
                  "epochs over {n} pairs (CI {ci}).")


def _conclusion(decay: Mapping[str, Any], trained: Mapping[str, Any]) -> str:
    """What the two contrasts of issue 38 say together, by their verdicts and signs."""
    if decay["verdict"] == "clear" and decay["mean"] > 0 and trained["verdict"] == "clear" and trained["mean"] < 0:
        return ("So it is attention that is *not trained*, not attention that is *not decayed*, that groks early "
                "here: AdamW without decay on W_Q/W_K groks later, not earlier, than with it, and freezing W_Q/W_K "
                "groks earlier than training them without decay.")
    if "too few pairs" in (decay["verdict"], trained["verdict"]):
        return ("Too few pairs of one CPU kind yet to tell attention that is not trained from attention that is not "
                "decayed.")
    return (f"These pairs do not settle whether it is attention that is not trained or attention that is not decayed "
            f"that groks early (verdicts: {decay['verdict']}; {trained['verdict']}).")


def _contrast_block(mech: Mapping[str, Any]) -> list[str]:
    by = {c["question"]: c for c in mech["contrasts"]}
    own = [by[q] for q in OWN_RUNS_SENTENCES]
    machines = sorted({m for c in own for m in c["machines"]})
    new = [by[q] for q in NODECAY_SENTENCES]
    lines = [f"The seven contrasts (arm − against, paired by seed, Holm's adjustment over the seven; from the report's "
             f"section \"Start, constraint or step?\"). The first five pair the study's own runs ({', '.join(machines)}); "
             f"the two with `{NODECAY}` pair its runs with {' and '.join(f'`{a}`' for a in RETRAINED)} runs retrained "
             f"on its commit and CPU kind, seed by seed (\"Trained, or only not decayed?\" below):", ""]
    for q, (expected, sentence) in OWN_RUNS_SENTENCES.items():
        c = by[q]
        if c["verdict"] != expected:
            raise ValueError(f"README: the contrast '{q}' is now '{c['verdict']}', its sentence was written for "
                             f"'{expected}'; rewrite OWN_RUNS_SENTENCES['{q}'].")
        lines.append(sentence.format(**_numbers(c)))
    for q, sentence in NODECAY_SENTENCES.items():
        c = by[q]
        lines.append(sentence.format(**_numbers(c)))
        if "cross_machine" in c:
            x = c["cross_machine"]
            lines.append(CROSS_SENTENCE.format(**{**_numbers(x), "machines": "; ".join(x["machines"])}))
    return lines + ["", _conclusion(*new)]


def _issue38_block(full: Mapping[str, Any]) -> list[str]:
    summary = full["summary"]
    mech, arms = summary["mechanism"], summary["arms"]
    sources = {(s["folder"], s["arm"]): s for s in mech["runs"]}
    new = sources[("runs", NODECAY)]
    others = [s for (f, a), s in sources.items() if f == "runs" and a != NODECAY]
    old_machines = sorted({m for s in others for m in s["machines"]})
    old_commits = sorted({c for s in others for c in s["commits"]})
    train, paper_epochs = full["config"]["train"], full["paper"]["epoch"]
    repro = sources.get(("repro", "adamw"))
    retrained = {a: sorted({k for f in ("repro", "same_cpu") for k in sources.get((f, a), {}).get("seeds", [])})
                 for a in RETRAINED}
    by = {c["question"]: c for c in mech["contrasts"]}
    pairs = [by[q]["n"] for q in NODECAY_SENTENCES]
    lines = ["## Trained, or only not decayed? (issue 38)", "",
             f"The arm `{NODECAY}` (AdamW exactly as `adamw`, weight decay 0 on W_Q, W_K only) joined "
             f"`records/p97_add_arms10` with {len(arms[NODECAY]['seeds'])} seeds on the protocol of the other arms "
             f"({train['epochs']:,} epochs, the paper ran {paper_epochs:,}; evaluation every {train['eval_every']} "
             f"epochs), trained on commit {', '.join(new['commits'])} on an {', '.join(new['machines'])}; the other "
             f"arms' runs were trained on an {', '.join(old_machines)} (commits {', '.join(old_commits)})."]
    if repro:
        committed = arms["adamw"]["first_epoch_reaching"]["per_seed"]
        seeds = [str(s) for s in repro["seeds"]]
        again = " and ".join(f"{repro['first_epoch'][s]:,}" for s in seeds)
        before = " and ".join(f"{committed[s]:,}" for s in seeds)
        lines[-1] += (f" `adamw` seeds {seeds_text(repro['seeds'])} retrained on {', '.join(repro['commits'])} and "
                      f"the {', '.join(repro['machines'])} (`repro/adamw`) first reach {summary['threshold']:.0%} at "
                      f"epochs {again}, against {before} in the study's runs: the trajectories part between the two "
                      f"CPU kinds, and the committed records are not reproduced across them (issue 38, item 2).")
    lines[-1] += (f" To pair strictly, {' and '.join(f'`{a}`' for a in RETRAINED)} are retrained on the new arm's "
                  f"commit and CPU kind (`run_same_cpu.sh`, into `same_cpu/<arm>/seed<k>`; `repro/adamw` is reused). "
                  f"The report pairs each seed's runs of one CPU kind only and leaves a seed out until its pair exists; "
                  f"`--report-only` picks new seeds up from the folders. Retrained so far: "
                  + "; ".join(f"`{a}` seeds {seeds_text(s)}" for a, s in retrained.items())
                  + f", so the two contrasts have {' and '.join(map(str, pairs))} pairs"
                  + ("." if min(pairs) == len(arms[NODECAY]["seeds"]) else
                     f" of {len(arms[NODECAY]['seeds'])} (the rest are being trained; rerun the report and "
                     f"`refresh_readme` when they are in)."))
    w = mech.get("w_q")
    if w:
        i = {e: k for k, e in enumerate(w["epochs"])}
        end = w["epochs"][-1]

        def med(arm, key, epoch, fmt=".3g"):
            return format(w["arms"][arm][key][i[epoch]]["median"], fmt)
        decay = w.get("decay_alone")
        alone = f" (decay alone would leave {format(decay['values'][i[1000]], '.3g')})" if decay and 1000 in i else ""
        lines += ["", f"What decay does to W_Q (the report's table \"W_Q over training\" and `w_q_norm_movement.png`, "
                      f"medians over seeds): with decay (`adamw`), ‖W_Q‖_F falls from {med('adamw', 'norm', 0)} to "
                      f"{med('adamw', 'norm', 1000)} by epoch 1,000{alone}, {med('adamw', 'norm', 2000)} at 2,000 "
                      f"and {med('adamw', 'norm', end)} at {end:,}, so its movement ‖W_Q − W_Q0‖_F = "
                      f"{med('adamw', 'move', end)} at {end:,} is mostly the fall of its norm, while its column space "
                      f"also turns (largest principal angle to the start {med('adamw', 'angle', end, '.1f')}°). Without decay (`{NODECAY}`) ‖W_Q‖_F stays at "
                      f"{med(NODECAY, 'norm', end)} and W_Q moves by {med(NODECAY, 'move', end)} (largest principal "
                      f"angle {med(NODECAY, 'angle', end, '.1f')}°): it rotates part of the way and does not shrink. Frozen "
                      f"W_Q/W_K neither shrink nor turn."]
    return lines


def readme_blocks(full: Mapping[str, Any]) -> dict[str, list[str]]:
    """The README's generated blocks on the ten-seed study, from its ``summary.json`` (``full``): ``arms10-contrasts``
    (the seven contrasts and what the two of issue 38 say together) and ``issue38`` (the section "Trained, or only
    not decayed?")."""
    blocks = {"arms10-contrasts": _contrast_block(full["summary"]["mechanism"]), "issue38": _issue38_block(full)}
    return {name: [w for line in lines for w in _wrap(line)] for name, lines in blocks.items()}


def _wrap(line: str, width: int = 115) -> list[str]:
    """A paragraph or list item as the README writes them: lines of at most ``width`` characters, an item's lines
    after its first indented by two spaces."""
    import textwrap

    if not line or line.startswith("#"):
        return [line]
    indent = "  " if line.startswith(("- ", "  ")) else ""
    return textwrap.wrap(line.removeprefix("  "), width, initial_indent="  " if line.startswith("  ") else "",
                         subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def _marker(name: str) -> tuple[str, str]:
    return (f"<!-- generated: {name}, by experiments.grokking.study.refresh_readme() from "
            f"records/p97_add_arms10/summary.json -->", f"<!-- end {name} -->")


def readme_block(text: str, name: str) -> list[str]:
    """The lines of the README's block ``name`` (between its markers)."""
    start, end = _marker(name)
    return text.split(start + "\n", 1)[1].split("\n" + end, 1)[0].split("\n")


def refresh_readme(readme: str | Path = README, summary: str | Path = ARMS10 / "summary.json") -> list[str]:
    """Rewrite the README's generated blocks (:func:`readme_blocks`) from ``summary``; returns the names of the blocks
    that changed. Run it after rebuilding the study's report:
    ``python -c "from experiments.grokking.study import refresh_readme; print(refresh_readme())"``."""
    import json

    readme = Path(readme)
    text = readme.read_text()
    changed = []
    for name, lines in readme_blocks(json.loads(Path(summary).read_text())).items():
        start, end = _marker(name)
        if start not in text or end not in text:
            raise ValueError(f"{readme}: no block '{name}' (markers {start!r} ... {end!r}).")
        old = "\n".join(readme_block(text, name))
        if old != "\n".join(lines):
            text = text.replace(f"{start}\n{old}\n{end}", f"{start}\n" + "\n".join(lines) + f"\n{end}")
            changed.append(name)
    readme.write_text(text)
    return changed
