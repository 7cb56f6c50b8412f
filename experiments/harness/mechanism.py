r"""Why does an arm grok earlier? The start, the constraint and the step, as paired contrasts.

The grokking study's arms differ from each other in one ingredient at a time (see
:mod:`~experiments.harness.ablation_arms`), so the difference of their first epochs at the
threshold, seed by seed, measures that ingredient:

- **the start**: ``adamw-orthostart`` − ``adamw`` (W_Q, W_K start orthonormal, from the ``stiefel`` arm's
  frames, instead of random; AdamW as usual);
- **training W_Q, W_K at all**: ``adamw-frozen`` − ``adamw`` (W_Q, W_K frozen at AdamW's random start);
- **orthonormality of frozen W_Q, W_K**: ``stiefel-frozen`` − ``adamw-frozen``;
- **the constraint with its step**: ``stiefel`` − ``adamw-orthostart`` (from the same frames, trained on the
  manifold by StiefelAdam instead of freely by AdamW);
- **the step on the manifold**: ``stiefel`` − ``stiefel-frozen`` (frames moved by StiefelAdam instead of held);
- **weight decay on W_Q, W_K**: ``adamw-qk-nodecay`` − ``adamw`` (the same AdamW, without decay on W_Q, W_K);
- **training W_Q, W_K without decay**: ``adamw-frozen`` − ``adamw-qk-nodecay`` (frozen instead of trained, neither
  decayed): with the contrast above, it tells "attention that is not trained" from "attention that is not decayed".

:func:`mechanism_summary` computes the contrasts that both arms ran (paired t and sign tests on the seeds where
both reached the threshold, Holm's adjustment over the contrasts present) and a verdict per contrast by one
written rule (:data:`VERDICTS`); :func:`mechanism_lines` is the report's paragraph, generated from that summary
so that the words cannot drift from the records.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Contrast", "CONTRASTS", "VERDICTS", "verdict", "mechanism_summary", "mechanism_lines"]


@dataclass(frozen=True)
class Contrast:
    """One question: ``arm - against`` in first epoch at the threshold (negative: ``arm`` groks earlier)."""

    question: str
    arm: str
    against: str
    differs: str


CONTRASTS: tuple[Contrast, ...] = (
    Contrast("the start", "adamw-orthostart", "adamw",
             "W_Q, W_K start orthonormal (the stiefel arm's frames) instead of random, then AdamW as usual"),
    Contrast("training W_Q, W_K at all", "adamw-frozen", "adamw", "W_Q, W_K frozen at AdamW's random start"),
    Contrast("orthonormality of frozen W_Q, W_K", "stiefel-frozen", "adamw-frozen",
             "frozen orthonormal frames instead of frozen random W_Q, W_K"),
    Contrast("the constraint with its step", "stiefel", "adamw-orthostart",
             "from the same frames, trained on the manifold by StiefelAdam instead of freely by AdamW"),
    Contrast("the step on the manifold", "stiefel", "stiefel-frozen",
             "frames moved by StiefelAdam instead of held at their start"),
    Contrast("weight decay on W_Q, W_K", "adamw-qk-nodecay", "adamw",
             "W_Q, W_K trained by AdamW without weight decay instead of with it (lambda = 1)"),
    Contrast("training W_Q, W_K without decay", "adamw-frozen", "adamw-qk-nodecay",
             "W_Q, W_K frozen at their random start instead of trained by AdamW without decay"),
)

#: The rule that turns a contrast into words, applied in this order.
VERDICTS = (
    ("too few pairs", "fewer than 3 pairs"),
    ("clear", "at least 5 pairs and Holm-adjusted paired-t p < 0.05"),
    ("suggested", "unadjusted paired-t p < 0.05 or unadjusted sign-test p < 0.1"),
    ("not seen", "otherwise"),
)


def verdict(comparison: Mapping[str, Any]) -> str:
    """The :data:`VERDICTS` word for one paired comparison (a :func:`~.stats.with_holm` entry)."""
    n = comparison["n"]
    if n < 3:
        return "too few pairs"
    if n >= 5 and comparison.get("p_holm") is not None and comparison["p_holm"] < 0.05:
        return "clear"
    t_p, sign_p = comparison.get("p_value"), comparison.get("sign_test_p")
    if (t_p is not None and t_p < 0.05) or (sign_p is not None and sign_p < 0.1):
        return "suggested"
    return "not seen"


def mechanism_summary(summary: Mapping[str, Any]) -> dict[str, Any] | None:
    """The contrasts of :data:`CONTRASTS` whose two arms are in ``summary`` (the output of
    :func:`~.records.summarize`), on the first epoch at the threshold; ``None`` when no contrast's arms ran."""
    from .stats import paired_from_mapping, with_holm

    arms = summary["arms"]
    present = [c for c in CONTRASTS if c.arm in arms and c.against in arms]
    if not present:
        return None
    first = {a: {int(k): v for k, v in arms[a]["first_epoch_reaching"]["per_seed"].items()} for a in arms}
    comparisons = with_holm({f"{c.arm} - {c.against}": paired_from_mapping(first[c.arm], first[c.against]).to_dict()
                             for c in present})
    return {"threshold": summary["threshold"], "metric": summary["metric"],
            "contrasts": [{"question": c.question, "arm": c.arm, "against": c.against, "differs": c.differs,
                           **comparisons[f"{c.arm} - {c.against}"],
                           "verdict": verdict(comparisons[f"{c.arm} - {c.against}"])} for c in present]}


def _epochs(x: float | None, sign: bool = True) -> str:
    return "–" if x is None else (f"{x:+,.0f}" if sign else f"{x:,.0f}")


def mechanism_lines(mechanism: Mapping[str, Any] | None) -> list[str]:
    """The report's section: one sentence per contrast, generated from :func:`mechanism_summary`."""
    if not mechanism:
        return []
    thr = f"{mechanism['threshold']:.0%}"
    rule = "; ".join(f"**{word}**: {why}" for word, why in VERDICTS)
    lines = ["## Start, constraint or step?", "",
             f"Each question is one paired contrast of the first epoch with `{mechanism['metric']}` ≥ {thr} "
             f"(arm − against, seed by seed, on the seeds where both reached it; negative: the arm groks earlier), "
             f"with Holm's adjustment over the contrasts listed. Verdicts by one rule: {rule}.", ""]
    for c in mechanism["contrasts"]:
        later = "earlier" if (c["mean"] or 0) < 0 else "later"
        ci = ("" if c["ci_low"] is None
              else f", 95% CI [{_epochs(c['ci_low'])}, {_epochs(c['ci_high'])}]")
        p = "" if c.get("p_holm") is None else f", Holm p {c['p_holm']:.2g}"
        lines.append(f"- **{c['question']}** (`{c['arm']}` − `{c['against']}`: {c['differs']}): "
                     f"{_epochs(c['mean'])} epochs over {c['n']} pair(s){ci}, {c['n_negative']}/{c['n']} earlier"
                     f"{p}: {c['verdict']}" + ("" if c["verdict"] in ("not seen", "too few pairs")
                                                   else f" ({later})") + ".")
    return lines + [""]
