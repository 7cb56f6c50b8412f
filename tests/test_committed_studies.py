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


def test_report_only_rebuilds_the_committed_ablation_study_byte_for_byte(tmp_path):
    folder = VISION / "fashion-mnist-ablation"
    copy = tmp_path / "ablation"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("*.pt", ".lock"))
    (copy / "report.md").unlink()  # removed first, so the comparison below cannot pass on the copied files
    (copy / "summary.json").unlink()
    assert main(["vision", "--study", "ablation", "--report-only", "--out", str(copy)]) == 0
    for name in ("report.md", "summary.json"):
        assert (copy / name).read_bytes() == (folder / name).read_bytes(), name
