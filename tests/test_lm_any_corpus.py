"""The language-model study on a corpus folder of one's own, held-out split included (issue 57, item 7): the
report is written for ``--corpus-root`` with ``--test-fraction``, and a report that cannot be written says why in
one line and leaves the run records complete."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("transformers")

from conftest import TINY_LM_FLAGS  # noqa: E402

from experiments.cli import main as cli_main  # noqa: E402
from experiments.harness.records import read_records  # noqa: E402
from experiments.lm import study as lm_study  # noqa: E402

#: the fewest evaluation intervals and steps: one interval of two steps (the issue's reproduction); every held-out
#: window may come from one file (the folder's test split has one)
ONE_SHORT_EPOCH = ["--epochs", "1", "--steps-per-epoch", "2", "--max-file-share", "1"]


@pytest.fixture(scope="module")
def own_corpus(tmp_path_factory):
    """A folder of 14 small ``*.py`` files whose text does not repeat across files (so held-out windows pass the
    overlap filter); at val fraction 0.2 and test fraction 0.2 each of the three splits gets files (12, 1 and 1)."""
    rng = random.Random(57)
    root = tmp_path_factory.mktemp("own_corpus")
    for k in range(14):
        body = "".join(f"def g_{rng.randrange(10**9)}(y):\n    return y + {rng.randrange(10**6)}\n" for _ in range(25))
        (root / f"part{k:02d}.py").write_text(f'"""Part {k}: {rng.randrange(10**9)}."""\n\n' + body)
    return str(root)


def _lm(root, out, *extra) -> int:
    """``python -m experiments lm`` with the tiny flags (``--test-fraction 0.2`` among them), one arm, one seed."""
    return cli_main(["lm", *TINY_LM_FLAGS, *ONE_SHORT_EPOCH, "--corpus-root", root, "--out", str(out),
                     "--arms", "adamw", "--seeds", "0", *extra])


def _records_complete(out) -> None:
    """The run's records: its config (with the three-way split's identity), environment and every evaluation."""
    run = out / "runs" / "adamw" / "seed0"
    config = json.loads((run / "config.json").read_text())["config"]
    assert config["test_fraction"] == 0.2 and config["corpus_identity"]["test_files"] >= 1
    assert (run / "environment.json").is_file()
    records = read_records(run / "metrics.jsonl")
    assert [r["epoch"] for r in records] == [0, 1]
    assert all("test_bpb" in r and "val_bpb" in r for r in records)


def test_report_is_written_for_a_corpus_root_with_a_test_split(own_corpus, tmp_path, capsys):
    """End to end: the study trains on the folder's three-way split and writes its report, which names the corpus
    and its split. The code before this fix trained, wrote the records, then raised ``KeyError: 'val_bytes'`` in
    ``_corpus_paragraph`` (the three-way identity has no validation bytes), so this call did not return 0."""
    out = tmp_path / "study"
    assert _lm(own_corpus, out) == 0
    _records_complete(out)
    report = (out / "report.md").read_text()
    assert f"**Corpus: *.py files under {own_corpus}**" in report
    identity = json.loads((out / "summary.json").read_text())["corpus"]
    assert (f"{identity['test_files']} test file" in report and f"({identity['test_windows']} windows)" in report
            and "test fraction 0.2" in report)
    assert "report: " in capsys.readouterr().out


def test_corpus_paragraph_of_either_split():
    """The corpus line of the two-way split (validation bytes) and of the three-way split (test files and windows,
    no validation bytes)."""
    two = {"corpus": "c", "source": "s", "version": "v", "sha256": "h", "split": "by file", "train_files": 3,
           "val_files": 1, "train_bytes": 1200, "val_bytes": 300, "val_fraction": 0.25}
    three = {k: v for k, v in two.items() if k != "val_bytes"}
    three.update(test_files=1, test_fraction=0.2, val_windows=4, test_windows=2, licence="MIT")
    line = lm_study._corpus_paragraph(lm_study.LMConfig(corpus_identity=two))
    assert "1 validation files (300 bytes)" in line and "test" not in line
    line = lm_study._corpus_paragraph(lm_study.LMConfig(corpus_identity=three))
    assert "1 validation file (4 windows), 1 test file (2 windows)" in line and "licence: MIT" in line
    assert "3 training files (1,200 bytes)" in line and line.count("bytes)") == 1  # no validation bytes


def test_a_report_that_cannot_be_written_says_why_in_one_line_and_keeps_the_records(own_corpus, tmp_path,
                                                                                       monkeypatch, capsys):
    """The report step fails after training: one line on stderr (the folder, the cause, how to rebuild), exit
    status 1, no traceback, and the records complete: a ``--report-only`` afterwards trains nothing and reports."""
    out = tmp_path / "study"

    def broken(*args, **kwargs):
        raise KeyError("val_bytes")

    monkeypatch.setattr(lm_study, "finalize_lm", broken)
    assert _lm(own_corpus, out) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err
    assert (f"the runs' records in {out} are complete, but the report could not be written (KeyError: 'val_bytes')"
            in lines[0] and f"--report-only --out {out}" in lines[0])
    assert not (out / "report.md").exists()
    _records_complete(out)
    monkeypatch.undo()
    # companion: the same records, reported without the failure, give the report and train nothing
    assert cli_main(["lm", "--report-only", "--out", str(out), "--quiet"]) == 0
    assert "0 run(s)" in capsys.readouterr().out and (out / "report.md").is_file()
