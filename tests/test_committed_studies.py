"""The committed study folders carry their records, and ``--report-only`` rebuilds their committed
``report.md`` and ``summary.json`` byte for byte from them (nothing in a report depends on when or where it was
rebuilt)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from geoopt_stiefel_attention.cli import main

ROOT = Path(__file__).resolve().parents[1]
VISION = ROOT / "experiments" / "vision" / "runs"
#: committed vision studies: folder -> --study
VISION_STUDIES = {"fashion-mnist-ablation": "ablation", "fashion-mnist-decay": "decay",
                  "fashion-mnist-scaling": "scaling", "fashion-mnist-paired": "paired"}


@pytest.mark.parametrize("name", sorted(VISION_STUDIES))
def test_committed_vision_studies_carry_their_records(name):
    folder = VISION / name
    if not (folder / "study.json").exists():
        pytest.skip(f"{name}: records not committed yet")
    metrics = sorted(folder.glob("**/runs/*/seed*/metrics.jsonl"))
    assert metrics, name
    for m in metrics:
        assert (m.parent / "config.json").exists() and (m.parent / "environment.json").exists()


def _rebuild_matches(tmp_path, name: str, *, study_flag: bool = True) -> None:
    folder = VISION / name
    if not (folder / "study.json").exists():
        pytest.skip(f"{name}: records not committed yet")
    copy = tmp_path / name
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("*.pt", ".lock"))
    (copy / "report.md").unlink()  # removed first, so the comparison below cannot pass on the copied files
    (copy / "summary.json").unlink()
    flags = ["--study", VISION_STUDIES[name]] if study_flag else []  # without it: the study in study.json
    assert main(["vision", *flags, "--report-only", "--out", str(copy)]) == 0
    for file in ("report.md", "summary.json"):
        assert (copy / file).read_bytes() == (folder / file).read_bytes(), file


def test_report_only_rebuilds_the_committed_ablation_study_byte_for_byte(tmp_path):
    _rebuild_matches(tmp_path, "fashion-mnist-ablation", study_flag=False)


@pytest.mark.slow  # the same check on the other committed studies (the ablation one stays in the default run)
@pytest.mark.parametrize("name", ["fashion-mnist-decay", "fashion-mnist-scaling", "fashion-mnist-paired"])
def test_report_only_rebuilds_every_committed_vision_study(tmp_path, name):
    _rebuild_matches(tmp_path, name)


#: the other committed studies with records: (command, folder under experiments/)
OTHER_STUDIES = [("grokking", "grokking/runs/p97_add_5seeds"), ("lm", "lm/runs/full"), ("lm", "lm/runs/pilot"),
                 ("lm", "lm/runs/lr-3e-3")]


@pytest.mark.parametrize(("command", "name"), OTHER_STUDIES)
def test_report_only_rebuilds_the_committed_grokking_and_lm_studies_byte_for_byte(tmp_path, command, name):
    folder = ROOT / "experiments" / name
    assert (folder / "study.json").exists(), f"{name}: the committed study lost its study.json"
    copy = tmp_path / "study"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("*.pt", ".lock"))
    assert sorted(copy.glob("**/runs/*/seed*/metrics.jsonl")), f"{name}: no records committed"
    (copy / "report.md").unlink()  # removed first, so the comparison below cannot pass on the copied files
    (copy / "summary.json").unlink()
    assert main([command, "--report-only", "--out", str(copy)]) == 0
    for file in ("report.md", "summary.json"):
        assert (copy / file).read_bytes() == (folder / file).read_bytes(), file
