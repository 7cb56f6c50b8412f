"""Tests of the scale point (issue 57, item 8): ``experiments/lm/configs/scale.args``, ``experiments/lm/scale.py``
and ``experiments/lm/run_scale.sh``, the script run end to end on the CPU at a tiny size."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from conftest import TINY_LM_FLAGS  # noqa: E402

from experiments.harness.config import TrainConfig, to_dict  # noqa: E402
from experiments.harness.records import read_records  # noqa: E402
from experiments.lm import scale  # noqa: E402
from experiments.lm.data import load_corpus  # noqa: E402
from experiments.lm.study import LMConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "lm" / "run_scale.sh"
SCALE_ARGS = ROOT / "experiments" / "lm" / "configs" / "scale.args"
CONTROLS = ROOT / "experiments" / "lm" / "records" / "controls" / "summary.json"
ARMS = ("adamw-qknorm", "stiefel", "muon", "stiefelmuon-muon")
#: bits per byte are read back from the records' JSON: only float formatting stands between two readings
BPB_TOL = 1e-12


def gpt2_params(width: int, depth: int, context: int, vocab: int = 256) -> int:
    """GPT-2's parameter count written out: token and position embeddings (the unembedding is tied), per block two
    LayerNorms (2d each), q|k|v (d x 3d + 3d), the attention output (d x d + d), the MLP (d x 4d + 4d, 4d x d + d),
    and the final LayerNorm."""
    block = 2 * 2 * width + (3 * width * width + 3 * width) + (width * width + width) + (
        4 * width * width + 4 * width) + (4 * width * width + width)
    return vocab * width + context * width + depth * block + 2 * width


# ---------------------------------------------------------------------------------------------- the committed config
def test_the_committed_config_trains_the_controls_selection_on_a_model_30x_larger():
    plan = scale.read_plan(SCALE_ARGS)  # refuses recipes that are not the reference's selection
    assert plan.arms == ARMS and plan.frames == "stiefel" and plan.reference.resolve() == CONTROLS.resolve()
    controls = json.loads(CONTROLS.read_text())
    for arm in ARMS:  # the selection as the controls summary writes it; null warm-up = its own 5% of 2000 steps
        selected = controls["recipes"][arm]
        assert plan.recipes[arm].lr == selected["lr"]
        assert plan.recipes[arm].warmup_steps == (selected["warmup_steps"] or 100)
    c = plan.config
    assert (c.width, c.depth, c.heads, c.context) == (512, 8, 16, 128) and plan.seeds == (1,)
    assert c.total_steps * c.batch_size * c.context == 2000 * 32 * 128  # the controls study's tokens per run
    ref = controls["config"]
    assert (ref["width"], ref["depth"], ref["heads"], ref["context"]) == (128, 4, 4, 128)
    big, small = gpt2_params(512, 8, 128), gpt2_params(128, 4, 128)
    assert (scale.model_params(c), scale.model_params(LMConfig(width=128, depth=4, heads=4))) == (big, small)
    assert big / small >= 20 and round(big / small, 2) == 30.17  # the ratio the args file and README state


@pytest.mark.parametrize("edit, fragment", [
    (("# recipe muon 0.0173205 100", "# recipe muon 0.01 100"), "is not the selection"),  # another lr
    (("# recipe adamw-qknorm 0.00519615 400", "# recipe adamw-qknorm 0.00519615 100"), "is not the selection"),
    (("# recipe stiefel 0.00519615 100\n", ""), "add '# recipe' lines for stiefel"),
    (("# frames stiefel", "# frames stiefel-gain"), "add '# recipe' lines for stiefel-gain"),
    (("# frames stiefel", "# frames adamw"), "'# frames <arm>'"),
    (("--seeds 1", "--seeds 1\n--lr 1e-3"), "--lr are set per arm"),
    (("--seeds 1", "--seeds 1\n--no-such-flag 3"), "unrecognized arguments: --no-such-flag"),
    (("--width 512", "--width 500"), "scale.args: --width 500 must be divisible by --heads 16"),
    (("# recipe muon 0.0173205 100", "# recipe muon 0.0173205 1e2"), "a recipe line is .*an int"),
])
def test_a_config_that_is_not_the_references_selection_is_refused(tmp_path, edit, fragment):
    """The companion of the test above: each edit makes the same file fail, naming what to fix."""
    text = SCALE_ARGS.read_text()
    assert edit[0] in text
    bad = tmp_path / "scale.args"
    bad.write_text(text.replace(edit[0], edit[1]).replace("experiments/lm/records", str(ROOT / "experiments/lm/records")))
    with pytest.raises(ValueError, match=fragment):
        scale.read_plan(bad)


def test_switching_the_frames_arm_needs_a_reference_that_selected_it(tmp_path):
    """stiefel-gain with its own recipe line: the controls study selected none for it, so the plan names the fix
    (the level-ground study's summary)."""
    text = SCALE_ARGS.read_text().replace("# frames stiefel", "# frames stiefel-gain").replace(
        "# recipe stiefel ", "# recipe stiefel-gain ").replace("experiments/lm/records", str(ROOT / "experiments/lm/records"))
    (tmp_path / "scale.args").write_text(text)
    with pytest.raises(ValueError, match="selected no recipe for stiefel-gain.*level-ground"):
        scale.read_plan(tmp_path / "scale.args")


@pytest.mark.parametrize("steps, total", [(2, 6), (29, 100), (100, 2000), (400, 2000), (0, 7), (1, 3), (57, 100)])
def test_the_warmup_fraction_gives_back_the_recipes_steps(steps, total):
    """The study turns --warmup-fraction back into int(fraction * total) steps; the text the plan writes gives the
    recipe's steps. Companion: the plain quotient loses a step where the product rounds down (29/100, 57/100)."""
    plan = scale.ScalePlan(Path("x"), (), LMConfig(steps_per_epoch=total, train=TrainConfig(epochs=1)), (0,),
                           Path("ref"), "stiefel", {"stiefel": scale.Recipe(1e-3, steps)})
    assert int(float(plan.warmup_fraction("stiefel")) * total) == steps
    if (steps, total) in ((29, 100), (57, 100)):
        assert int(float(f"{steps / total}") * total) == steps - 1


# ---------------------------------------------------------------------------------------------- the script
def _reference(tmp_path: Path, root: str, sha: str | None = None) -> Path:
    """A reference summary.json on the tiny corpus: a model of width 16 (the scale config's is 32), 6 steps, each
    arm's recipe, and a final test cell of three seeds per arm."""
    config = LMConfig(width=16, depth=1, heads=2, context=16, batch_size=4, steps_per_epoch=3,
                      train=TrainConfig(epochs=2))
    recipes = {"adamw-qknorm": {"lr": 1e-2, "warmup_steps": 2}, "stiefel": {"lr": 3e-3, "warmup_steps": None},
               "muon": {"lr": 2e-2, "warmup_steps": None}, "stiefelmuon-muon": {"lr": 1e-2, "warmup_steps": None}}
    test = {arm: {"test": {"per_seed": {str(s): 2.0 + 0.1 * k + 0.01 * s * (k % 2) for s in (1, 2, 3)}}}
            for k, arm in enumerate(ARMS)}
    path = tmp_path / "reference.json"
    path.write_text(json.dumps({"config": to_dict(config), "recipes": recipes, "final": {"test": test},
                                "corpus": {"sha256": sha or load_corpus(root=root).sha256, "source": "tiny"}}))
    return path


def _tiny_args(tmp_path: Path, reference: Path) -> Path:
    lines = ["# frames stiefel", f"# reference {reference}", "# recipe adamw-qknorm 0.01 2", "# recipe stiefel 0.003 0",
             "# recipe muon 0.02 0", "# recipe stiefelmuon-muon 0.01 0", "--seeds 4"]
    for k, word in enumerate(TINY_LM_FLAGS):  # the tiny model's flags; the script sets device, threads and output
        if word.startswith("--") and word not in ("--device", "--quiet", "--threads"):
            lines.append(word)
        elif not word.startswith("--") and TINY_LM_FLAGS[k - 1] not in ("--device", "--threads"):
            lines[-1] += f" {word}"
    path = tmp_path / "tiny.args"
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(out: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SCALE_")}
    return subprocess.run(["bash", str(SCRIPT), str(out), *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env={**base, "PYTHON": sys.executable, **env})


def test_the_script_trains_every_arm_at_its_recipe_on_matched_tokens_and_reports(varied_root, tmp_path):
    """run_scale.sh end to end on the CPU (SCALE_DEVICE=cpu) at a tiny size, two arms side by side: every arm's
    records, at its own lr and warm-up and otherwise the same settings, then summary.json and report.md whose
    numbers are those of the records."""
    args = _tiny_args(tmp_path, _reference(tmp_path, varied_root))
    out = tmp_path / "scale"
    proc = _run(out, {"SCALE_ARGS": str(args), "SCALE_DEVICE": "cpu", "SCALE_CORPUS_ROOT": varied_root, "JOBS": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    recipes = {"adamw-qknorm": (1e-2, 2), "stiefel": (3e-3, 0), "muon": (2e-2, 0), "stiefelmuon-muon": (1e-2, 0)}
    configs, test = {}, {}
    for arm in ARMS:
        run = out / arm / "runs" / arm / "seed4"
        recs = read_records(run / "metrics.jsonl")
        assert [r["epoch"] for r in recs] == [0, 1, 2] and recs[-1]["step"] == 6
        test[arm] = recs[-1]["test_bpb"]
        c = json.loads((run / "config.json").read_text())["config"]
        assert c["optim"]["lr"] == recipes[arm][0] and int(c["warmup_fraction"] * 6) == recipes[arm][1]
        c["optim"].pop("lr"), c.pop("warmup_fraction")
        configs[arm] = c
        assert len(read_records(run / "steps.jsonl")) == 6  # every step on record
    assert all(c == configs["adamw-qknorm"] for c in configs.values())  # same model, data, batch, steps: same tokens
    summary = json.loads((out / "summary.json").read_text())
    assert summary["param_ratio"] == gpt2_params(32, 2, 16) / gpt2_params(16, 1, 16)
    assert summary["tokens_per_arm"] == 6 * 4 * 16 and summary["same_corpus"] and not summary["missing_arms"]
    for arm in ARMS:
        assert abs(summary["arms"][arm]["test_bpb"]["4"] - test[arm]) < BPB_TOL
        assert summary["arms"][arm]["reference_test_bpb"]["n"] == 3
    d = summary["differences"]["stiefel - adamw-qknorm"]
    assert abs(d["mean"] - (test["stiefel"] - test["adamw-qknorm"])) < BPB_TOL
    # the reference's pairs: stiefel 2.1 + 0.01 s against adamw-qknorm 2.0 on seeds 1-3: mean 0.12, sd 0.01
    assert abs(d["reference"]["mean"] - 0.12) < 1e-9 and abs(d["reference"]["sd"] - 0.01) < 1e-9
    assert d["read"] == ("within seed noise" if abs(d["mean"]) < 2 * d["reference"]["sd"] else "beyond seed noise")
    report = (out / "report.md").read_text()
    assert f"| stiefel | 0.003 | 0 | {test['stiefel']:.4f} |" in report
    assert "the reference's text" in report and "not the reference's text" not in report
    log = (out / "log.txt").read_text()
    assert all(f"=== {arm} done" in log for arm in ARMS) and "FAILED" not in log

    # the report refuses records that are not the plan's: one arm's lr edited on disk (the companion)
    cfg = out / "muon" / "runs" / "muon" / "seed4" / "config.json"
    doc = json.loads(cfg.read_text())
    doc["config"]["optim"]["lr"] = 0.5
    cfg.write_text(json.dumps(doc))
    assert scale.main(["report", str(out), str(args)]) == 2
    with pytest.raises(ValueError, match="muon seed 4 was trained at lr 0.5"):
        scale.summarize(out, scale.read_plan(args))
    # and records whose arms differ in more than the recipe (another batch: not the same tokens)
    doc["config"]["optim"]["lr"], doc["config"]["batch_size"] = 0.02, 8
    cfg.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="other settings.*batch_size.*same tokens"):
        scale.summarize(out, scale.read_plan(args))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no GPU")
def test_without_a_gpu_the_script_refuses_in_one_line_and_writes_nothing(varied_root, tmp_path):
    args = _tiny_args(tmp_path, _reference(tmp_path, varied_root))
    out = tmp_path / "scale"
    proc = _run(out, {"SCALE_ARGS": str(args), "SCALE_CORPUS_ROOT": varied_root})
    assert proc.returncode == 2 and not out.exists()
    (line,) = proc.stderr.strip().splitlines()
    assert "torch sees no GPU" in line and "SCALE_DEVICE=cpu" in line


def test_another_corpus_or_bad_usage_is_refused_in_one_line_and_writes_nothing(varied_root, tmp_path):
    """The corpus check: a reference trained on other text refuses (the same call trains with the right SHA-256,
    above); a second argument or an unknown device is a usage error."""
    args = _tiny_args(tmp_path, _reference(tmp_path, varied_root, sha="0" * 64))
    out = tmp_path / "scale"
    env = {"SCALE_ARGS": str(args), "SCALE_DEVICE": "cpu", "SCALE_CORPUS_ROOT": varied_root}
    for proc, fragment in ((_run(out, env), "is not the one of"), (_run(out, env, "extra"), "at most one argument"),
                           (_run(out, {**env, "SCALE_DEVICE": "tpu"}), "SCALE_DEVICE tpu")):
        assert proc.returncode == 2 and not out.exists()
        (line,) = proc.stderr.strip().splitlines()
        assert fragment in line


def test_pack_corpus_copies_the_text_the_study_reads(varied_root, tmp_path, monkeypatch):
    """pack-corpus copies the interpreter's standard library: pointed at the tiny corpus (as if it were the
    standard library), the copy hashes as the original; a folder that is not empty is refused."""
    import sysconfig

    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": varied_root})
    dest = tmp_path / "corpus"
    assert scale.pack_corpus(dest) == load_corpus(root=varied_root).sha256
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in Path(varied_root).iterdir())
    with pytest.raises(ValueError, match="not empty"):
        scale.pack_corpus(dest)
    shutil.rmtree(dest)
