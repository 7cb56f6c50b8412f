"""Tests of the language-model study (``python -m experiments lm``) and of the loop features it added to the layer
(gradient clipping, derived record values)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from experiments.cli import main as cli_main  # noqa: E402
from experiments.harness import arms as arms_module  # noqa: E402
from experiments.harness.batches import FullBatch  # noqa: E402
from experiments.harness.config import OptimConfig, RunSpec, TrainConfig  # noqa: E402
from experiments.harness.records import read_records  # noqa: E402
from experiments.harness.runner import Task, train_run  # noqa: E402
from experiments.lm.study import (  # noqa: E402
    AttentionProbe,
    LMConfig,
    build_model,
    build_task,
    lm_param_groups,
)
from geoopt_stiefel_attention import parametrized_state_dict  # noqa: E402
from geoopt_stiefel_attention.manifolds import is_frame  # noqa: E402

#: float64 reference comparisons (the probe computes in float64 from float64 weights)
REF_TOL = 1e-10

TINY = ["--depth", "2", "--width", "32", "--heads", "4", "--context", "16", "--batch-size", "4",
        "--steps-per-epoch", "3", "--epochs", "2", "--eval-windows", "4", "--train-eval-windows", "4",
        "--eval-batch", "4", "--probe-windows", "2", "--val-fraction", "0.25", "--device", "cpu", "--quiet"]


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory):
    """A small fake standard library: 40 modules of varied Python-like text."""
    root = tmp_path_factory.mktemp("stdlib")
    for k in range(40):
        body = "".join(f"def f{k}_{j}(x):\n    return x * {k + j} + {j}\n\n" for j in range(30))
        (root / f"mod{k:02d}.py").write_text(f'"""Module {k}."""\n\n' + body)
    return str(root)


def _cli(corpus_root, out, *extra):
    return cli_main(["lm", *TINY, "--corpus-root", corpus_root, "--out", str(out), *extra])


def test_smoke_every_arm_and_the_sweep_then_the_report(corpus_root, tmp_path, capsys):
    out = tmp_path / "study"
    assert _cli(corpus_root, out, "--lr", "1e-2", "--seeds", "0", "1", "--frame-lrs", "1e-2", "3e-2",
                "--skip-report") == 0
    for arm in ("adamw", "stiefel", "stiefel-gain", "geoopt-radam"):
        recs = read_records(out / "runs" / arm / "seed1" / "metrics.jsonl")
        assert [r["epoch"] for r in recs] == [0, 1, 2]
        for r in recs:
            assert r["val_bpb"] == pytest.approx(r["val_loss"] / math.log(2), rel=1e-12)
            assert {"logit_rms/1/3", "attn_entropy/0/0", "angle_max_deg/q", "move_total_rel/k"} <= set(r)
        assert recs[-1]["train_loss"] < recs[0]["train_loss"]  # it learns
        spec = json.loads((out / "runs" / arm / "seed1" / "config.json").read_text())
        assert spec["config"]["corpus_identity"]["train_files"] > 0
    # the sweep: the main frame lr (= lr 1e-2) is the main cell; only 3e-2 gets a cell, stiefel only
    assert not (out / "frame-lr-0.01").exists()
    assert sorted(p.name for p in (out / "frame-lr-0.03" / "runs").iterdir()) == ["stiefel"]
    assert json.loads((out / "frame-lr-0.03/runs/stiefel/seed0/config.json").read_text())["config"]["optim"][
        "frame_lr"] == 0.03
    capsys.readouterr()
    assert cli_main(["lm", "--report-only", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert all(f"{arm} " in printed for arm in ("adamw", "stiefel", "stiefel-gain", "geoopt-radam"))
    report = (out / "report.md").read_text()
    sha = json.loads((out / "runs/adamw/seed0/config.json").read_text())["config"]["corpus_identity"]["sha256"]
    assert sha in report and "Knight, 2026" in report and "Yoshihara, 2026" in report
    assert "| 0.03 | 2 |" in report and "stiefel-gain - adamw" in report
    for png in ("learning_curves", "principal_angles", "movement", "attention_heads", "frame_lr_sweep"):
        assert (out / f"{png}.png").exists(), png
    summary = json.loads((out / "summary.json").read_text())
    assert summary["main"]["comparisons"]["stiefel - adamw"]["n"] == 2


@pytest.mark.slow
def test_report_of_a_run_equals_its_rebuild_from_the_records(corpus_root, tmp_path):
    out = tmp_path / "study"
    assert _cli(corpus_root, out, "--seeds", "0", "--arms", "adamw", "stiefel", "--frame-lrs", "3e-3") == 0
    before = (out / "report.md").read_text()
    assert cli_main(["lm", "--report-only", "--out", str(out), "--quiet"]) == 0
    assert (out / "report.md").read_text() == before


def test_resume_equals_uninterrupted(corpus_root, tmp_path, capsys):
    flags = ["--arms", "stiefel-gain", "geoopt-radam", "--seeds", "0", "--skip-report", "--epochs", "3"]
    assert _cli(corpus_root, tmp_path / "full", *flags) == 0
    assert _cli(corpus_root, tmp_path / "cut", *flags, "--stop-after-epochs", "1") == 0
    assert "stopped before the end" in capsys.readouterr().out
    assert _cli(corpus_root, tmp_path / "cut", *flags) == 0
    for arm in ("stiefel-gain", "geoopt-radam"):
        a = read_records(tmp_path / "full" / "runs" / arm / "seed0" / "metrics.jsonl")
        b = read_records(tmp_path / "cut" / "runs" / arm / "seed0" / "metrics.jsonl")
        assert [r["epoch"] for r in a] == [0, 1, 2, 3] and a == b


def _polar(a: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(a.double(), full_matrices=False)
    return u @ vh


def test_paired_starts_share_every_non_frame_weight():
    cfg = LMConfig(depth=2, width=32, heads=4, context=16)
    plain = build_model(cfg, seed=3)
    d, h, r = 32, 4, 8
    for gain in (None, "learn"):
        conv = build_model(cfg, seed=3, stiefel=True, logit_gain=gain)
        conv_state = parametrized_state_dict(conv)  # the frames as stored (state_dict() is the stock form)
        for name, w in plain.state_dict().items():
            if name.endswith("c_attn.weight"):
                prefix = name[:-len("weight")]
                assert torch.equal(conv_state[prefix + "parametrizations.weight.original"], w[:, 2 * d:])  # values
                q = conv_state[prefix + "parametrizations.weight.0.q_frames"]
                blocks = w[:, :d].reshape(d, h, r).permute(1, 0, 2)
                assert torch.allclose(q.double(), _polar(blocks), atol=1e-5)
            else:
                assert torch.equal(conv_state[name], w), name
        gains = [v for k, v in conv_state.items() if k.endswith("q_log_gain")]
        assert (len(gains) == 2 and all(torch.equal(g, torch.zeros(h)) for g in gains)) if gain else not gains
    other = build_model(cfg, seed=4)  # companion: another seed is another start
    assert not torch.equal(other.transformer.wte.weight, plain.transformer.wte.weight)


def test_build_task_pairs_the_data_of_the_arms(corpus_root):
    cfg = LMConfig(corpus_root=corpus_root, val_fraction=0.25, depth=1, width=16, heads=2, context=8,
                   batch_size=2, steps_per_epoch=2)
    tasks = {arm: build_task(RunSpec(cfg, arm, 5), arms_module.get_arm(arm), torch.device("cpu"))
             for arm in ("adamw", "stiefel-gain")}
    a, b = (list(t.train_data.batches(1)) for t in tasks.values())
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b, strict=True))
    assert a[0][1].shape == (2 * 8,)  # targets flattened: one example per predicted byte
    other = list(build_task(RunSpec(cfg, "adamw", 6), arms_module.get_arm("adamw"),
                            torch.device("cpu")).train_data.batches(1))
    assert not torch.equal(other[0][0], a[0][0])  # companion: another seed draws other windows


def test_lm_param_groups_decay_only_the_blocks_matrices():
    cfg = LMConfig(depth=1, width=16, heads=2, context=8)
    model = build_model(cfg, seed=0, stiefel=True, logit_gain="learn")
    groups = {g["name"]: g for g in lm_param_groups(model, 0.1)}
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = sorted(names[id(p)] for p in groups["decay"]["params"])
    assert decayed == ["transformer.h.0.attn.c_attn.parametrizations.weight.original",
                       "transformer.h.0.attn.c_proj.weight", "transformer.h.0.mlp.c_fc.weight",
                       "transformer.h.0.mlp.c_proj.weight"]
    plain = {names[id(p)] for p in groups["no_decay"]["params"]}
    assert {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight",
            "transformer.h.0.attn.c_attn.parametrizations.weight.0.q_log_gain"} <= plain
    assert groups["decay"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0
    assert len(groups["frames"]["params"]) == 2 and all(is_frame(p) for p in groups["frames"]["params"])
    total = sum(len(g["params"]) for g in groups.values())
    assert total == len(list(model.parameters()))  # every parameter once (lm_head is tied to wte)


@torch.no_grad()
def _reference(model, ids):
    """Per-layer (rms, entropy) written out head by head in float64, from HF's own hidden states (input of each
    block, LayerNorm applied here) and HF's eager attention probabilities."""
    out = model(input_ids=ids, output_hidden_states=True, output_attentions=True, use_cache=False)
    result = []
    for layer, block in enumerate(model.transformer.h):
        x = torch.nn.functional.layer_norm(out.hidden_states[layer], (block.ln_1.normalized_shape[0],),
                                           block.ln_1.weight, block.ln_1.bias, block.ln_1.eps)
        w, bias = block.attn.c_attn.weight, block.attn.c_attn.bias
        d, heads = w.shape[0], block.attn.num_heads
        r = d // heads
        rms, ent = [], []
        for h in range(heads):
            sq, n = 0.0, 0
            for b in range(ids.shape[0]):
                q = x[b] @ w[:, h * r:(h + 1) * r] + bias[h * r:(h + 1) * r]
                k = x[b] @ w[:, d + h * r:d + (h + 1) * r] + bias[d + h * r:d + (h + 1) * r]
                for i in range(ids.shape[1]):
                    for j in range(i + 1):
                        sq += float(q[i] @ k[j]) ** 2 / r
                        n += 1
            rms.append(math.sqrt(sq / n))
            p = out.attentions[layer][:, h]  # (B, T, T), zero above the diagonal
            ent.append(float(-(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1).mean()))
        result.append((rms, ent))
    return result


def _probe_model(**convert):
    cfg = LMConfig(depth=2, width=16, heads=2, context=8)
    model = build_model(cfg, seed=1, **convert)
    model.config._attn_implementation = "eager"  # HF returns attention probabilities only in eager mode
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("c_attn.weight"):
                p.normal_(0.0, 0.3)  # larger than HF's 0.02: attention far from uniform
    return model.double().eval()


@pytest.mark.parametrize("convert", [{}, {"stiefel": True, "logit_gain": "learn"}], ids=["adamw", "stiefel-gain"])
def test_attention_probe_matches_a_written_out_reference(convert):
    torch.manual_seed(0)
    model = _probe_model(**convert)
    ids = torch.randint(0, 256, (2, 8))
    if convert:
        with torch.no_grad():
            model.transformer.h[1].attn.c_attn.parametrizations.weight[0].q_log_gain.fill_(math.log(3.0) / 10.0)
    got = AttentionProbe(ids).metrics(model)
    ref = _reference(model, ids)
    for layer, (rms, ent) in enumerate(ref):
        for h in range(2):
            assert got[f"logit_rms/{layer}/{h}"] == pytest.approx(rms[h], rel=REF_TOL)
            assert got[f"attn_entropy/{layer}/{h}"] == pytest.approx(ent[h], rel=REF_TOL, abs=REF_TOL)
    assert got["logit_rms/mean"] == pytest.approx(sum(sum(r) for r, _ in ref) / 4, rel=REF_TOL)
    assert min(min(e) for _, e in ref) < 0.9 * math.log(8)  # the case is not trivially uniform
    # companion: the probe reads the current weights, so changing them changes what it reports
    with torch.no_grad():
        model.transformer.h[0].ln_1.weight.mul_(2.0)
    again = AttentionProbe(ids).metrics(model)
    assert again["logit_rms/0/0"] == pytest.approx(4 * got["logit_rms/0/0"], rel=1e-9)  # q and k both double
    assert model.training is False


def test_gain_scales_the_logits_of_its_head_only():
    torch.manual_seed(0)
    model = _probe_model(stiefel=True, logit_gain="learn")
    ids = torch.randint(0, 256, (2, 8))
    before = AttentionProbe(ids).metrics(model)
    with torch.no_grad():
        model.transformer.h[1].attn.c_attn.parametrizations.weight[0].q_log_gain[1] = math.log(3.0) / 10.0
    after = AttentionProbe(ids).metrics(model)
    assert after["logit_rms/1/1"] == pytest.approx(3 * before["logit_rms/1/1"], rel=1e-9)
    assert after["logit_rms/1/0"] == pytest.approx(before["logit_rms/1/0"], rel=1e-12)  # companion: other head


# ---------------------------------------------------------------------------------------------- layer hooks
@pytest.fixture()
def sgd_arm():
    def build(model, groups, optim):
        return torch.optim.SGD(groups, lr=optim.lr)

    arm = arms_module.register_arm(arms_module.Arm("test-sgd", "euclidean", build, "plain SGD (test)"))
    yield arm
    del arms_module.ARMS["test-sgd"]


def _linear_task(clip):
    from dataclasses import dataclass, field

    @dataclass(frozen=True)
    class Cfg:
        experiment: str = "linear"
        train: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=1, eval_every=1))
        optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=0.5))

    x = torch.tensor([[1.0, 2.0], [3.0, -1.0]])
    y = torch.tensor([0, 1])

    def builder(spec, arm, device):
        model = torch.nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            model.weight.copy_(torch.tensor([[0.5, -0.5], [1.0, 0.25]]))
        data = FullBatch(x, y)
        return Task(model=model, train_data=data, eval_data={"val": data}, grad_clip=clip,
                    derived=lambda v: {"val_double": 2 * v["val_loss"]})

    return Cfg(), builder, x, y


@pytest.mark.parametrize("clip", [0.01, None])
def test_runner_clips_the_gradient_norm_and_adds_derived_values(sgd_arm, tmp_path, clip):
    cfg, builder, x, y = _linear_task(clip)
    w0 = torch.tensor([[0.5, -0.5], [1.0, 0.25]], requires_grad=True)
    torch.nn.functional.cross_entropy(x @ w0.T, y).backward()
    g = w0.grad
    norm = float(g.norm())
    step = g * (clip / norm) if clip is not None and norm > clip else g
    expected = w0.detach() - 0.5 * step

    captured = {}

    def capture_builder(spec, arm, device):
        task = builder(spec, arm, device)
        captured["model"] = task.model
        return task

    res = train_run(RunSpec(cfg, "test-sgd", 0), capture_builder, tmp_path, device="cpu", quiet=True)
    assert torch.allclose(captured["model"].weight.detach(), expected, atol=1e-7)
    if clip is not None:  # companion: the unclipped step is far from the clipped one
        assert norm > 10 * clip
        assert not torch.allclose(captured["model"].weight.detach(), w0.detach() - 0.5 * g, atol=1e-3)
    assert res.final_record["val_double"] == pytest.approx(2 * res.final_record["val_loss"])


def test_task_refuses_a_bad_grad_clip():
    with pytest.raises(ValueError, match="grad_clip"):
        Task(model=torch.nn.Linear(1, 1), train_data=None, eval_data={}, grad_clip=0.0)


# ---------------------------------------------------------------------------------------------- errors
def _exit_code(call) -> int:
    """The exit status of a CLI call, whether it returns it or argparse raises ``SystemExit``."""
    try:
        return call()
    except SystemExit as err:
        return err.code

@pytest.mark.parametrize("flags, fragment", [
    (["--width", "30"], "--width 30 must be divisible by --heads 4"),
    (["--frame-lrs", "-1"], "--frame-lrs"),
    (["--grad-clip", "0"], "--grad-clip"),
    (["--steps-per-epoch", "0"], "--steps-per-epoch"),
    (["--warmup-fraction", "1.5"], "--warmup-fraction"),
    (["--arms", "nope"], "--arms"),
    (["--val-fraction", "2"], "--val-fraction"),
    (["--arms", "adamw", "--frame-lrs", "3e-3"], "--frame-lrs"),
    (["--arms", "stiefel", "--frame-lrs", "3e-3", "0.003"], "--frame-lrs: 0.003 0.003 names a frame learning rate twice"),
    (["--max-overlap", "0.05"], "--max-overlap 0.05: filters the held-out windows"),
    (["--overlap-ngram", "64"], "--overlap-ngram 64: filters the held-out windows"),
    (["--max-file-share", "0.5"], "--max-file-share 0.5: filters the held-out windows"),
])
def test_cli_errors_are_one_line_exit_2_and_write_nothing(corpus_root, tmp_path, capsys, flags, fragment):
    out = tmp_path / "never"
    assert _exit_code(lambda: _cli(corpus_root, out, *flags)) == 2
    msg = capsys.readouterr().err.strip().splitlines()
    assert fragment in msg[-1] and "Traceback" not in "\n".join(msg)
    assert not out.exists()


@pytest.mark.parametrize("case, said", [
    ("missing", "the folder is missing (nothing exists at this path)"),
    ("missing/deeper", "the folder is missing (nothing exists at this path)"),
    ("afile", "is a file, not a folder"),
    ("", "is empty (it would read the current folder)"),
    ("no-python", "the folder holds no *.py files (outside test and site-packages folders)"),
    ("only-tests", "the folder holds no *.py files (outside test and site-packages folders)"),
])
def test_cli_names_a_corpus_root_that_is_missing_or_holds_no_sources(tmp_path, capsys, case, said):
    """Before: a folder without sources said that the training split was empty; an empty value read the current
    folder."""
    (tmp_path / "afile").write_text("x = 1\n")
    (tmp_path / "no-python").mkdir()
    (tmp_path / "no-python" / "notes.txt").write_text("text\n")
    (tmp_path / "only-tests" / "tests").mkdir(parents=True)
    (tmp_path / "only-tests" / "tests" / "test_x.py").write_text("x = 1\n")
    root = str(tmp_path / case) if case else ""
    out = tmp_path / "out"
    code = _exit_code(lambda: cli_main(["lm", *TINY, "--corpus-root", root, "--out", str(out)]))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    prefix = f"python -m experiments lm: error: --corpus-root{' ' + root if root else ''}: "
    assert err.startswith(prefix) and said in err and "pass a folder holding *.py files" in err, err
    assert not out.exists()


def test_load_corpus_names_a_root_that_is_missing_or_holds_no_sources(corpus_root, tmp_path):
    from experiments.lm.data import load_corpus

    with pytest.raises(FileNotFoundError, match="the folder is missing"):
        load_corpus(root=tmp_path / "missing")
    with pytest.raises(ValueError, match=r"holds no \*\.py files"):
        load_corpus(root=tmp_path)
    # companions: a folder with sources loads; one with too few files for a split says so
    assert load_corpus(root=corpus_root, val_fraction=0.25).train_files > 0
    (tmp_path / "one.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="split empty"):
        load_corpus(root=tmp_path, val_fraction=0.25)


def test_cli_refuses_a_missing_corpus_root_and_another_corpus(corpus_root, tmp_path, capsys):
    code = _exit_code(lambda: cli_main(["lm", *TINY, "--corpus-root", str(tmp_path / "missing"),
                                        "--out", str(tmp_path / "x")]))
    assert code == 2 and "--corpus-root" in capsys.readouterr().err
    out = tmp_path / "study"
    assert _cli(corpus_root, out, "--arms", "adamw", "--seeds", "0", "--skip-report", "--epochs", "1") == 0
    other = tmp_path / "other"
    other.mkdir()
    for k in range(40):
        (other / f"m{k}.py").write_text(f"y = {k}\n" * 200)
    code = _exit_code(lambda: cli_main(["lm", *TINY, "--corpus-root", str(other), "--out", str(out), "--arms",
                                        "adamw", "--seeds", "0", "--skip-report", "--epochs", "1"]))
    text = capsys.readouterr().err
    assert code == 2 and "another corpus" in text and len(text.strip().splitlines()) == 1


def test_report_refuses_a_sweep_cell_trained_with_other_settings(corpus_root, tmp_path, capsys):
    """A frame-lr cell is paired with the main cell's adamw runs: it must differ from them only in the frame lr."""
    out = tmp_path / "study"
    assert _cli(corpus_root, out, "--arms", "adamw", "stiefel", "--seeds", "0", "--frame-lrs", "3e-3",
                "--skip-report", "--epochs", "1") == 0
    assert _cli(corpus_root, out, "--report-only") == 0  # companion: a consistent sweep gives a report
    assert "frame-lr" in (out / "report.md").read_text()
    cfg_path = next((out / "frame-lr-0.003").glob("runs/stiefel/seed0/config.json"))
    cfg = json.loads(cfg_path.read_text())
    cfg["config"]["width"] = 64  # as if the cell had been trained with another --width
    cfg_path.write_text(json.dumps(cfg))
    before = (out / "report.md").read_text()
    assert _exit_code(lambda: _cli(corpus_root, out, "--report-only")) == 2
    err = capsys.readouterr().err
    assert "frame-lr-0.003" in err and "width" in err and "Traceback" not in err
    assert (out / "report.md").read_text() == before


# ------------------------------------------------------------------------------------------ Muon arms
@pytest.mark.parametrize("arm", ["muon", "stiefel-muon"])
def test_muon_arms_give_muon_the_hidden_matrices_and_adamw_the_rest(arm):
    from experiments.harness.arms import get_arm, hidden_matrices

    spec = get_arm(arm)
    cfg = LMConfig(depth=1, width=16, heads=2, context=8)
    model = build_model(cfg, seed=0, stiefel=spec.attention == "stiefel")
    names = {id(p): n for n, p in model.named_parameters()}
    hidden = sorted(names[id(p)] for p in hidden_matrices(model))
    c_attn = ("transformer.h.0.attn.c_attn.weight" if arm == "muon"
              else "transformer.h.0.attn.c_attn.parametrizations.weight.original")  # value rows only under frames
    assert hidden == sorted([c_attn, "transformer.h.0.attn.c_proj.weight", "transformer.h.0.mlp.c_fc.weight",
                             "transformer.h.0.mlp.c_proj.weight"])
    opt = spec.build(model, lm_param_groups(model, 0.1), OptimConfig(lr=1e-3, weight_decay=0.1,
                                                                      adjust_lr_fn="match_rms_adamw"))
    by_type = {type(o).__name__: {names[id(p)] for g in o.param_groups for p in g["params"]} for o in opt.optimizers}
    assert by_type["Muon"] == set(hidden)
    assert "transformer.wte.weight" in by_type["AdamW"] and "transformer.ln_f.weight" in by_type["AdamW"]
    covered = [n for members in by_type.values() for n in members]
    assert sorted(covered) == sorted(names.values())  # every parameter exactly once
    if arm == "stiefel-muon":
        assert by_type["StiefelAdam"] == {n for n in names.values() if n.endswith(("q_frames", "k_frames"))}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    opt.zero_grad()
    model(ids, labels=ids).loss.backward()
    opt.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert set(hidden) <= moved


def test_muon_arm_refuses_a_model_with_frames_and_hidden_matrices_skip_the_output_layer():
    from experiments.harness.arms import get_arm, hidden_matrices
    from geoopt_stiefel_attention.models import TinyTransformer

    model = build_model(LMConfig(depth=1, width=16, heads=2, context=8), seed=0, stiefel=True)
    with pytest.raises(ValueError, match="arm 'muon'.*attention='euclidean'"):
        get_arm("muon").build(model, lm_param_groups(model, 0.1), OptimConfig())
    # a model whose only matrices are frames: stiefel-muon refuses instead of silently running as stiefel
    from geoopt_stiefel_attention.nn import StiefelMultiheadAttention

    attn = StiefelMultiheadAttention(8, 2, bias=False)
    attn.w_v.requires_grad_(False)
    attn.w_o.requires_grad_(False)
    with pytest.raises(ValueError, match="arm 'stiefel-muon'.*no hidden"):
        get_arm("stiefel-muon").build(attn, [{"params": [attn.w_q, attn.w_k], "weight_decay": 0.0}], OptimConfig())
    tiny = TinyTransformer(11, 4, width=16, heads=2, mlp=32, attention="euclidean")
    names = {id(p): n for n, p in tiny.named_parameters()}
    hidden = {names[id(p)] for p in hidden_matrices(tiny)}
    assert hidden and not any(n.startswith(("unembed", "token_embedding", "position_embedding")) for n in hidden)
    assert any(n.startswith("unembed") for n in names.values())  # companion: the output layer exists, and is skipped


def test_held_out_filters_are_accepted_with_a_test_split():
    """The companion of the refusals above: with --test-fraction the same flags are taken and recorded."""
    from experiments.lm.study import LMConfig

    cfg = LMConfig(test_fraction=0.1, max_overlap=0.05, overlap_ngram=64, max_file_share=0.5)
    assert (cfg.max_overlap, cfg.overlap_ngram, cfg.max_file_share) == (0.05, 64, 0.5)


def test_held_out_test_split_is_evaluated_per_category_and_kept_out_of_training(varied_root, tmp_path):
    out = tmp_path / "held"
    assert _cli(varied_root, out, "--arms", "adamw", "--seeds", "0", "--val-fraction", "0.2", "--test-fraction",
                "0.2", "--max-file-share", "0.5", "--skip-report") == 0
    recs = read_records(out / "runs" / "adamw" / "seed0" / "metrics.jsonl")
    keys = set(recs[-1])
    assert {"val_bpb", "test_bpb"} <= keys
    categories = {k for k in keys if k.endswith("_bpb") and k.startswith(("val_", "test_"))} - {"val_bpb", "test_bpb"}
    assert categories and all(k.split("_")[1] in ("code", "prose", "data") for k in categories)
    config = json.loads((out / "runs" / "adamw" / "seed0" / "config.json").read_text())["config"]
    assert config["test_fraction"] == 0.2
    cfg = LMConfig(corpus_root=varied_root, val_fraction=0.2, test_fraction=0.2, max_file_share=0.5, context=16,
                   eval_windows=4, eval_batch=4)
    from experiments.lm.heldout import split_of
    from experiments.lm.study import heldout_eval_data

    train, sets, _ = heldout_eval_data(cfg, torch.device("cpu"))
    test_files = set(sets["test"].windows.files)
    assert test_files and all(split_of(f, 0.2, 0.2) == "test" for f in test_files)
    held_text = (Path(varied_root) / sorted(test_files)[0]).read_bytes()[:64]
    assert held_text not in bytes(train.numpy())  # the test files' text is not trained on
    # companion: without a test split the records have no test set (the plain validation windows)
    plain = tmp_path / "plain"
    assert _cli(varied_root, plain, "--arms", "adamw", "--seeds", "0", "--skip-report") == 0
    assert "test_bpb" not in read_records(plain / "runs" / "adamw" / "seed0" / "metrics.jsonl")[-1]


def test_the_progress_bar_shows_the_metric_the_report_uses():
    """The language-model records carry bits per byte, and the bar shows them (its report is in bpb); a study
    without them (grokking: accuracy) keeps accuracy (the companion)."""
    from experiments.harness.runner import _progress_keys

    lm = {"train_loss": 1.2, "train_acc": 0.4, "val_acc": 0.3, "train_bpb": 1.7, "val_bpb": 1.9}
    assert _progress_keys(lm) == ["train_bpb", "val_bpb"]
    assert _progress_keys({"train_acc": 0.4, "val_acc": 0.3, "val_loss": 2.0}) == ["train_acc", "val_acc"]
