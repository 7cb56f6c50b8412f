"""Run folders written by an earlier version of the harness stay valid: same ``config.json`` (the key that
decides "same run"), same records, and a resume from their checkpoint continues the run exactly.

The fixture ``tests/data/format_v1`` was written by the harness as of commit d1f8f5a (before the study layer
was refactored), on CPU with one torch thread:

- ``grokking_full``: ``python -m experiments grokking --p 7 --width 16 --heads 2 --mlp 32 --epochs 40
  --eval-every 10 --arms adamw stiefel --device cpu --threads 1`` run to the end (records only);
- ``grokking_cut``: the same command with ``--stop-after-epochs 15`` (records and checkpoints);
- ``vision_full``: ``python -m experiments vision --dataset digits --seeds 0 --epochs 2 --width 8 --heads 2
  --depth 1 --mlp 16 --train-size 256 --eval-train-size 64 --arms adamw stiefel`` (records only).

Training is deterministic on one CPU for a given torch build, but another x86-64 CPU picks other kernels
(AVX-512, AVX2) that round differently, so new float records are compared with the fixture within
``TRAJECTORY_RTOL`` / ``TRAJECTORY_ATOL`` (``tests/conftest.py``, where their size is measured), and each
tolerance comparison has a companion that must fall outside it. Exact equality is kept where it is guaranteed:
``config.json``, the records written before the cut (the resume keeps them as they were), and everything that is
not a float. The tests are skipped when torch's version differs from the one that wrote the fixture.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TRAJECTORY_RTOL, record_mismatches

from experiments.cli import main
from experiments.grokking.study import GrokkingConfig
from experiments.harness import RunSpec, TrainConfig, to_dict
from experiments.harness.config import with_current_config_class
from experiments.harness.records import read_records

FIXTURE = Path(__file__).parent / "data" / "format_v1"
ARMS = ("adamw", "stiefel")
GROKKING = ["grokking", "--p", "7", "--width", "16", "--heads", "2", "--mlp", "32", "--epochs", "40",
            "--eval-every", "10", "--arms", *ARMS, "--quiet", "--device", "cpu", "--threads", "1"]
VISION = ["vision", "--dataset", "digits", "--seeds", "0", "--epochs", "2", "--width", "8", "--heads", "2",
          "--depth", "1", "--mlp", "16", "--train-size", "256", "--eval-train-size", "64", "--quiet", "--device",
          "cpu", "--threads", "1", "--arms", *ARMS]


def _fixture_torch() -> str:
    return json.loads((FIXTURE / "grokking_full" / "adamw" / "seed0" / "environment.json").read_text())[0]["torch"]


same_torch = pytest.mark.skipif(torch.__version__ != _fixture_torch(),
                                reason=f"fixture written with torch {_fixture_torch()}")


def _as_study_folder(case: str, out: Path) -> Path:
    """Copy ``FIXTURE/<case>/<arm>/seed0`` to ``out/runs/<arm>/seed0`` (the layout a study writes)."""
    for arm in ARMS:
        shutil.copytree(FIXTURE / case / arm / "seed0", out / "runs" / arm / "seed0")
    return out


def _records(folder: Path, arm: str) -> list[dict]:
    return read_records(folder / arm / "seed0" / "metrics.jsonl")


def test_config_json_of_the_old_format_is_what_the_code_writes_now():
    cfg = GrokkingConfig(p=7, width=16, heads=2, mlp=32, train=TrainConfig(epochs=40, eval_every=10))
    for arm in ARMS:
        old = json.loads((FIXTURE / "grokking_full" / arm / "seed0" / "config.json").read_text())
        # the fixture names the config class where it was then (inside the package); it is read as its new name
        assert old["config_class"] == "geoopt_stiefel_attention.experiments.grokking.GrokkingConfig"
        now = json.loads(json.dumps(to_dict(RunSpec(cfg, arm, 0))))
        assert now == with_current_config_class(old) and now["config_class"] == "experiments.grokking.study.GrokkingConfig"
        assert now != old  # companion: without reading the former name, the old run would not be "the same run"
    # companion: another setting gives another config.json, so the comparison can fail
    other = GrokkingConfig(p=7, width=16, heads=2, mlp=32, train=TrainConfig(epochs=40, eval_every=20))
    assert json.loads(json.dumps(to_dict(RunSpec(other, "adamw", 0)))) != old


@same_torch
def test_an_old_checkpoint_resumes_to_the_old_uninterrupted_records(tmp_path):
    out = _as_study_folder("grokking_cut", tmp_path / "study")
    before = {arm: _records(out / "runs", arm) for arm in ARMS}
    assert all(r[-1]["epoch"] == 10 for r in before.values())  # stopped after 15 epochs, last record at 10
    assert main([*GROKKING, "--out", str(out), "--skip-report"]) == 0
    for arm in ARMS:
        resumed, full = _records(out / "runs", arm), _records(FIXTURE / "grokking_full", arm)
        assert [r["epoch"] for r in resumed] == [0, 10, 20, 30, 40]
        assert resumed[:2] == full[:2], arm  # written before the cut and kept: exact
        assert not record_mismatches(resumed, full), (arm, record_mismatches(resumed, full))
        # companion: a trajectory perturbed by ten times the tolerance is caught
        assert record_mismatches(resumed, _perturbed(full, 10 * TRAJECTORY_RTOL)), arm
        env = json.loads((out / "runs" / arm / "seed0" / "environment.json").read_text())
        assert [c["start_epoch"] for c in env] == [0, 15] and env[-1]["end_epoch"] == 40
    # --report-only reads the resumed folder
    assert main([*GROKKING, "--out", str(out), "--report-only"]) == 0
    assert (out / "report.md").exists() and (out / "summary.json").exists()


def _perturbed(records: list[dict], rel: float) -> list[dict]:
    """``records`` with the last record's train_loss scaled by ``1 + rel``."""
    out = [dict(r) for r in records]
    out[-1]["train_loss"] *= 1 + rel
    return out


@same_torch
def test_vision_training_trajectory_is_unchanged(tmp_path):
    assert main([*VISION, "--out", str(tmp_path), "--skip-report"]) == 0
    for arm in ARMS:
        new, old = _records(tmp_path / "runs", arm), _records(FIXTURE / "vision_full", arm)
        assert not record_mismatches(new, old), (arm, record_mismatches(new, old))
        assert [{k: v for k, v in r.items() if not isinstance(v, float)} for r in new] == \
            [{k: v for k, v in r.items() if not isinstance(v, float)} for r in old]  # epochs, steps: exact
        assert (json.loads((tmp_path / "runs" / arm / "seed0" / "config.json").read_text())
                == with_current_config_class(json.loads((FIXTURE / "vision_full" / arm / "seed0" / "config.json")
                                                        .read_text())))


@same_torch
def test_trajectory_tolerance_is_smaller_than_a_one_percent_change_of_the_learning_rate(tmp_path):
    """Companion of the tolerance: the same vision run with ``--lr`` 1% larger falls outside it in both arms (its
    frames move 1% farther; its losses, after two epochs, by less than the tolerance)."""
    assert main([*VISION, "--lr", "0.00101", "--out", str(tmp_path), "--skip-report"]) == 0
    for arm in ARMS:
        mismatches = record_mismatches(_records(tmp_path / "runs", arm), _records(FIXTURE / "vision_full", arm))
        assert any("move_total/q" in m for m in mismatches), arm
