"""The study subcommands (``grokking``, ``vision``) as a user meets them: every user error is one line on
stderr naming the flag, exit status 2, no traceback, and nothing written; a finished run is extended by a
larger ``--epochs``; other changed settings are refused naming the flags; Ctrl-C checkpoints and says how to
resume (exit status 130), and the resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments.cli import build_parser, main
from experiments.grokking import study as grokking
from experiments.harness.metrics import MetricHook
from experiments.harness.records import read_records

TINY = ["--p", "7", "--width", "16", "--heads", "2", "--mlp", "32", "--eval-every", "10", "--quiet", "--device",
        "cpu", "--threads", "1", "--arms", "stiefel", "--skip-report"]
VISION_TINY = ["vision", "--dataset", "digits", "--seeds", "0", "--epochs", "1", "--width", "8", "--heads", "2",
               "--depth", "1", "--mlp", "16", "--train-size", "128", "--eval-train-size", "64", "--quiet",
               "--device", "cpu", "--threads", "1"]



def _usage_error(capsys, argv: list[str], *needles: str) -> str:
    """Run ``main(argv)``, expect exit status 2 and one stderr line holding every needle; return that line."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err and "error:" in err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


@pytest.mark.parametrize("flags, needles", [
    (["--arms", "adamw", "nope"], ["--arms", "nope", "geoopt-radam"]),
    (["--arms", "adamw", "adamw"], ["--arms", "twice"]),
    (["--seeds", "-1"], ["--seeds", "-1"]),
    (["--seeds", "0", "0"], ["--seeds", "twice"]),
    (["--workers", "0"], ["--workers 0"]),
    (["--threads", "0"], ["--threads 0"]),
    (["--epochs", "-5"], ["--epochs -5"]),
    (["--eval-every", "0"], ["--eval-every 0"]),
    (["--lr", "-1"], ["--lr -1"]),
    (["--width", "30", "--heads", "4"], ["--width 30", "--heads 4"]),
    (["--p", "12", "--operation", "/"], ["--operation", "--p 12"]),
    (["--device", "nonsense"], ["--device nonsense"]),
    (["--report-only", "--skip-report"], ["--report-only", "--skip-report"]),
    (["--seeds", str(2**64)], ["--seeds", str(2**64), "2**64 - 1"]),  # was torch's traceback, after the run folder
    (["--threads", "1025"], ["--threads 1025", "1 to 1024"]),  # was a traceback: torch ran out of memory maps
    (["--operation", "foo"], ["--operation", "'foo'"]),
    (["--epochs", "3", "--report-only"], ["--out", "no such folder"]),  # the note on --epochs no second line
])
def test_grokking_user_errors_are_one_line_exit_2_and_leave_nothing(tmp_path, capsys, flags, needles):
    out = tmp_path / "out"
    err = _usage_error(capsys, ["grokking", "--quiet", "--out", str(out), *flags], *needles)
    assert "Config:" not in err  # flags, not internal classes
    assert not out.exists()


@pytest.mark.parametrize("flags, needles", [
    (["--study", "scaling", "--train-sizes", "0"], ["--train-sizes"]),
    (["--study", "decay", "--weight-decays", "-1"], ["--weight-decay", "-1"]),
    (["--train-size", "0"], ["--train-size 0"]),
    (["--patch-size", "5"], ["--patch-size 5"]),
    (["--arms", "stiefel", "nope"], ["--arms", "nope"]),
    # an empty sweep trained nothing, silently, and wrote study.json; a sweep flag of another study was ignored
    (["--study", "decay", "--weight-decays", ""], ["--weight-decays", "no weight decay given"]),
    (["--study", "scaling", "--train-sizes", ""], ["--train-sizes", "no size given"]),
    (["--weight-decays", "0.1"], ["--weight-decays", "--study decay", "--study paired does not read it"]),
    (["--study", "decay", "--train-sizes", "0.5"], ["--train-sizes", "--study scaling"]),
    (["--sgd-frame-lr", "0.1"], ["--sgd-frame-lr", "no stiefel-sgd"]),
    # scikit-learn's digits come from the package: a data folder or a download was ignored
    (["--dataset", "digits", "--data-dir", "elsewhere"], ["--data-dir: --dataset digits is scikit-learn's"]),
    (["--dataset", "digits", "--download"], ["--download: --dataset digits"]),
    # a repeated value was dropped silently
    (["--study", "decay", "--weight-decays", "0,0.0"], ["--weight-decays", "twice"]),
    (["--study", "scaling", "--train-sizes", "0.5,64"], ["--train-sizes", "64 images more than once"]),
])
def test_vision_user_errors_are_one_line_exit_2_and_leave_nothing(tmp_path, capsys, flags, needles):
    out = tmp_path / "out"
    err = _usage_error(capsys, [*VISION_TINY, "--out", str(out), *flags], *needles)
    assert "invalid _" not in err
    assert not out.exists()


def test_vision_sweep_flags_pass_with_their_study():
    """Companions of the refusals above: each sweep flag with its own study, distinct values, --sgd-frame-lr with the
    stiefel-sgd arm, and --data-dir where it is read (its default with digits) pass the checks, and the sweeps give
    one cell per value."""
    from experiments.vision import study as vision

    parser = build_parser()
    for argv in (["--study", "decay", "--weight-decays", "0,0.1"], ["--study", "scaling", "--train-sizes", "0.5,1"],
                 ["--study", "ablation", "--sgd-frame-lr", "0.1"], ["--arms", "stiefel-sgd", "--sgd-frame-lr", "0.1"],
                 ["--dataset", "digits", "--data-dir", "data"], ["--dataset", "fashion-mnist", "--data-dir", "x"]):
        args = parser.parse_args([*VISION_TINY, *argv])
        vision.STUDY.check(args)
        config = vision.config_from_args(args)
        cells = vision.study_cells(vision._study_of(args), config, train_sizes=args.train_sizes,
                                   weight_decays=args.weight_decays, n_train=128)
        assert len(cells) == {"decay": 2, "scaling": 2}.get(args.study, 1), argv


def test_seed_and_thread_bounds_pass_at_the_bound():
    """Companions: the largest seed torch takes and 1024 threads pass the running checks."""
    from experiments.harness.cli_args import check_runner_args

    args = build_parser().parse_args(["grokking", "--seeds", "0", str(2**64 - 1), "--threads", "1024", "--device",
                                      "cpu", "--out", "unused"])
    check_runner_args(args, study="grokking")


def test_an_unreadable_trust_region_names_the_flag_not_a_function(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["grokking", "--trust-region", "abc", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.splitlines() == [err]
    assert "argument --trust-region: expected a number, auto or none, got 'abc'" in err and "_trust_region" not in err
    assert build_parser().parse_args(["grokking", "--trust-region", "none"]).trust_region is None  # companion


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_names_the_flag(tmp_path, capsys):
    _usage_error(capsys, ["grokking", "--device", "cuda", "--out", str(tmp_path / "o")], "--device cuda", "no GPU")
    _usage_error(capsys, [*VISION_TINY, "--device", "cuda", "--out", str(tmp_path / "v")], "--device cuda")
    assert not (tmp_path / "o").exists() and not (tmp_path / "v").exists()


def test_out_that_is_a_file_or_under_a_file_or_missing_for_report_only(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    _usage_error(capsys, ["grokking", "--out", str(afile)], "--out", "is a file")
    _usage_error(capsys, ["grokking", "--out", str(afile / "sub")], "--out", "is a file")
    _usage_error(capsys, [*VISION_TINY, "--out", str(afile)], "--out", "is a file")
    _usage_error(capsys, ["grokking", "--report-only", "--out", str(tmp_path / "none")], "--out", "no such folder")
    (tmp_path / "empty").mkdir()
    _usage_error(capsys, ["grokking", "--report-only", "--out", str(tmp_path / "empty")], "--out", "no runs")
    assert afile.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["afile", "empty"]


def test_unwritable_out(tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    # the permission check itself (as root, chmod cannot take write access away, so the answer is faked)
    monkeypatch.setattr(os, "access", lambda path, mode: False if str(path) == str(locked) else real_access(path, mode))
    _usage_error(capsys, ["grokking", "--out", str(locked / "study")], "--out", "not writable")
    assert list(locked.iterdir()) == []
    # companion: a writable parent passes the check
    monkeypatch.setattr(os, "access", real_access)
    assert main(["grokking", *TINY, "--epochs", "10", "--out", str(locked / "study")]) == 0


def _read_only_file_system(monkeypatch, root: Path) -> None:
    """Creating anything under ``root`` fails as on a read-only or virtual file system (``/proc``, ``/sys``),
    where ``os.access`` still answers yes to root; elsewhere the real ``tempfile.mkdtemp`` runs."""
    import errno
    import tempfile

    real = tempfile.mkdtemp

    def mkdtemp(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).resolve().is_relative_to(root.resolve()):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)


@pytest.mark.parametrize("study", ["grokking", "vision", "lm"])
def test_out_on_a_read_only_file_system_is_one_line_before_any_work(tmp_path, capsys, monkeypatch, study):
    """As root, ``os.access`` says yes on a read-only file system; the check tries for real, before training."""
    ro = tmp_path / "ro"
    ro.mkdir()
    _read_only_file_system(monkeypatch, ro)
    argv = {"grokking": ["grokking", *TINY], "vision": VISION_TINY, "lm": ["lm", "--device", "cpu"]}[study]
    _usage_error(capsys, [*argv, "--out", str(ro / "a" / "study")], "--out", "nothing can be created",
                 "Read-only file system")
    (ro / "done").mkdir()
    _usage_error(capsys, [study, "--report-only", "--out", str(ro / "done")], "--out", "nothing can be created")
    assert sorted(p.name for p in ro.iterdir()) == ["done"] and not list((ro / "done").iterdir())
    # companion: elsewhere the same check passes (the probe folder it makes is removed again)
    from geoopt_stiefel_attention.argtypes import output_path_problem

    assert output_path_problem(tmp_path / "rw" / "study", folder=True) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ro"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_out_under_proc_is_one_line(capsys):
    """The case met in practice: a virtual file system refuses mkdir even to root."""
    _usage_error(capsys, ["grokking", *TINY, "--out", "/proc/stiefel-attention-study"], "--out /proc/")


def test_output_path_problem_for_files_and_folders(tmp_path, monkeypatch):
    from geoopt_stiefel_attention.argtypes import output_path_problem

    afile = tmp_path / "afile"
    afile.write_text("x")
    assert "is a folder" in output_path_problem(tmp_path, folder=False)
    assert "is a file, not a folder" in output_path_problem(afile, folder=True)
    assert "is a file, so the file cannot be created" in output_path_problem(afile / "x.json", folder=False)
    assert "is a file, so the folder cannot be created" in output_path_problem(afile / "sub", folder=True)
    assert "is empty" in output_path_problem("", folder=False)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if str(path) == str(tmp_path) else real_access(path, mode))
    assert "is not writable" in output_path_problem(tmp_path / "x.md", folder=False)
    assert "is not writable" in output_path_problem(tmp_path / "new" / "study", folder=True)
    monkeypatch.setattr(os, "access", real_access)
    # a file in a folder that does not exist: refused, naming the folder (it was created, tree and all, silently)
    for missing in (tmp_path / "new" / "x.md", tmp_path / "new" / "deeper" / "x.md"):
        said = output_path_problem(missing, folder=False)
        assert said is not None and f"its folder {missing.parent} does not exist" in said, said
    # companions: a new file in an existing folder, an existing file to overwrite, a new folder (with a new parent):
    # all fine, none created
    assert output_path_problem(tmp_path / "x.md", folder=False) is None
    assert output_path_problem(afile, folder=False) is None
    assert output_path_problem(tmp_path / "new", folder=True) is None
    assert output_path_problem(tmp_path / "new" / "study", folder=True) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def _extra_specs(extra: str) -> set[str]:
    """The distributions pyproject.toml's ``extra`` brings (lower-case names, no versions)."""
    import re

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    specs = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"][extra]
    return {re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0].strip().lower() for spec in specs}


@pytest.mark.parametrize("module, study", [("seaborn", "grokking"), ("tqdm", "grokking"), ("torchvision", "vision"),
                                           ("sklearn", "vision-digits"), ("transformers", "lm")])
def test_missing_optional_dependency_is_one_line_naming_the_extra_that_brings_it(tmp_path, capsys, monkeypatch,
                                                                                  module, study):
    """Before: ``lm`` without transformers said to install the experiments extra, which did not bring it."""
    import re

    from experiments.harness.cli_args import PIP_NAMES

    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError, as if not installed
    argv = {"grokking": ["grokking"], "vision": ["vision", "--dataset", "fashion-mnist", "--quiet"],
            "vision-digits": ["vision", "--dataset", "digits", "--quiet"], "lm": ["lm", "--device", "cpu"]}[study]
    pip = PIP_NAMES.get(module, module)
    err = _usage_error(capsys, [*argv, "--out", str(tmp_path / "o")], pip, f"pip install {pip}")
    assert not (tmp_path / "o").exists()
    extras = re.findall(r"geoopt-stiefel-attention\[([a-z]+)\]", err)
    assert len(extras) == 1 and pip in _extra_specs(extras[0]), err  # (the companion is in test_packaging.py)


@pytest.mark.parametrize("argv, needle", [
    (["lm", "--lrs", "abc"], "argument --lrs: expected a number, got 'abc'"),
    (["lm", "--final-seeds", "x"], "argument --final-seeds: invalid int value: 'x'"),
    (["lm", "--seeds"], "argument --seeds: expected at least one argument"),
    (["grokking", "--epochs", "1.5"], "argument --epochs: invalid int value: '1.5'"),
    # named by the study that does not know it (argparse named the top-level program)
    (["lm", "--bogus"], "python -m experiments lm: error: unrecognized arguments: --bogus"),
    (["lmx"], "argument STUDY: invalid choice: 'lmx'"),
    # argparse named the study's own function: "invalid _floats value: 'a,b'"
    (["vision", "--study", "decay", "--weight-decays", "a,b"], "argument --weight-decays: expected comma-separated "
                                                                 "numbers, e.g. 0.1,0.5, got 'a,b'"),
    (["vision", "--train-size", "abc"], "argument --train-size: expected an integer or all, got 'abc'"),
])
def test_argparse_errors_are_one_line_exit_2_without_the_usage_block(tmp_path, capsys, argv, needle):
    """A value of the wrong type (or a missing value, an unknown flag or study) is argparse's error, said in one line
    naming the flag, exit status 2, like every other usage error; companion: a plain ``ArgumentParser`` prints its
    usage block too (what this one must not)."""
    import argparse

    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.splitlines() == [err] and needle in err and "usage:" not in err
    assert err.startswith("python -m experiments") and not (tmp_path / "o").exists()
    plain = argparse.ArgumentParser(prog="p")
    plain.add_argument("--lrs", type=float)
    with pytest.raises(SystemExit):
        plain.parse_args(["--lrs", "abc"])
    assert len(capsys.readouterr().err.strip().splitlines()) > 1  # companion


def test_a_user_error_prints_no_traceback_from_python_m_experiments(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "experiments", "grokking", "--seeds", "-1",
                           "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "--seeds" in proc.stderr
    assert proc.stderr.startswith("python -m experiments grokking: error:")


@pytest.mark.parametrize("study", ["grokking", "vision", "lm"])
def test_the_installed_command_says_where_the_studies_are(tmp_path, study):
    """The package's ``stiefel-attention`` has no study subcommands: ``stiefel-attention <study>`` (any flags) is one
    line naming ``python -m experiments <study>``, exit status 2, and nothing trained or written."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}  # this checkout's package
    proc = subprocess.run([sys.executable, "-m", "geoopt_stiefel_attention", study, "--seeds", "0"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert f"run `python -m experiments {study} ...`" in proc.stderr
    # companion: a name that is neither a subcommand nor a study is argparse's usage error, not this line
    other = subprocess.run([sys.executable, "-m", "geoopt_stiefel_attention", f"{study}x"], capture_output=True,
                           text=True, timeout=120, cwd=tmp_path, env=env)
    assert list(tmp_path.iterdir()) == []
    assert other.returncode == 2 and "python -m experiments" not in other.stderr and "invalid choice" in other.stderr


def _records(out: Path) -> list[dict]:
    return read_records(out / "runs" / "stiefel" / "seed0" / "metrics.jsonl")


def test_a_larger_epochs_extends_a_finished_run_and_other_changes_are_refused(tmp_path, capsys):
    short, full = tmp_path / "short", tmp_path / "full"
    assert main(["grokking", *TINY, "--epochs", "20", "--out", str(short)]) == 0
    assert main(["grokking", *TINY, "--epochs", "40", "--out", str(short)]) == 0
    assert main(["grokking", *TINY, "--epochs", "40", "--out", str(full)]) == 0
    assert [r["epoch"] for r in _records(short)] == [0, 10, 20, 30, 40]
    assert _records(short) == _records(full)  # extending = having trained longer from the start
    env = json.loads((short / "runs" / "stiefel" / "seed0" / "environment.json").read_text())
    assert env[-1]["start_epoch"] == 20 and env[-1]["extended_from_epochs"] == 20
    capsys.readouterr()
    before = (short / "runs" / "stiefel" / "seed0" / "metrics.jsonl").read_text()
    _usage_error(capsys, ["grokking", *TINY, "--epochs", "40", "--lr", "0.002", "--out", str(short)],
                 "--lr is 0.001 there, 0.002 now")
    _usage_error(capsys, ["grokking", *TINY, "--epochs", "30", "--out", str(short)], "--epochs 30", "40")
    _usage_error(capsys, ["grokking", *TINY, "--epochs", "40", "--eval-every", "20", "--width", "8", "--out",
                          str(short)], "--eval-every", "--width")
    assert (short / "runs" / "stiefel" / "seed0" / "metrics.jsonl").read_text() == before


def test_a_cosine_schedule_cannot_be_extended(tmp_path, capsys):
    out = tmp_path / "v"
    assert main([*VISION_TINY, "--arms", "adamw", "--skip-report", "--out", str(out)]) == 0
    capsys.readouterr()
    _usage_error(capsys, [*VISION_TINY, "--arms", "adamw", "--skip-report", "--epochs", "2", "--out", str(out)],
                 "--lr-schedule constant")
    # companion: under a constant schedule the same call extends the run
    const = tmp_path / "c"
    flags = [*VISION_TINY, "--arms", "adamw", "--skip-report", "--lr-schedule", "constant", "--out", str(const)]
    assert main(flags) == 0 and main([*flags, "--epochs", "2"]) == 0
    assert [r["epoch"] for r in read_records(const / "runs" / "adamw" / "seed0" / "metrics.jsonl")] == [0, 1, 2]


class _CtrlC(MetricHook):
    """Sends this process a SIGINT (a real Ctrl-C) when the record of epoch ``at`` is made."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def metrics(self, model):
        self.calls += 1
        if self.calls == self.at // 10 + 1:
            os.kill(os.getpid(), signal.SIGINT)
        return {}


class _RaiseInLoss:
    """A loss that raises KeyboardInterrupt at its ``at``-th call (training steps and evaluations both call it)."""

    def __init__(self, loss, at: int) -> None:
        self.loss, self.at, self.calls = loss, at, 0

    def __call__(self, logits, targets):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.loss(logits, targets)


def _patched_build(monkeypatch, change):
    original = grokking.build_task

    def build(spec, arm, device):
        task = original(spec, arm, device)
        change(task)
        return task

    monkeypatch.setattr(grokking, "build_task", build)
    return original


def test_ctrl_c_checkpoints_at_the_epoch_boundary_and_the_rerun_resumes_exactly(tmp_path, capsys, monkeypatch):
    flags = ["grokking", *TINY, "--epochs", "40"]
    handler = signal.getsignal(signal.SIGINT)  # the caller's (SIG_IGN in a background job, else Python's default)
    assert main([*flags, "--out", str(tmp_path / "full")]) == 0
    original = _patched_build(monkeypatch, lambda task: setattr(task, "hooks", (*task.hooks, _CtrlC(at=20))))
    assert main([*flags, "--out", str(tmp_path / "cut")]) == 130
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "checkpointed at epoch 20 of 40" in err and "rerun the same command to resume" in err
    assert signal.getsignal(signal.SIGINT) == handler  # the caller's handler is restored
    monkeypatch.setattr(grokking, "build_task", original)
    assert main([*flags, "--out", str(tmp_path / "cut")]) == 0
    assert _records(tmp_path / "cut") == _records(tmp_path / "full")


def test_keyboard_interrupt_mid_epoch_keeps_the_last_checkpoint(tmp_path, capsys, monkeypatch):
    flags = ["grokking", *TINY, "--epochs", "40", "--checkpoint-interval", "0"]
    assert main([*flags, "--out", str(tmp_path / "full")]) == 0
    original = _patched_build(monkeypatch, lambda task: setattr(task, "loss", _RaiseInLoss(task.loss, at=30)))
    assert main([*flags, "--out", str(tmp_path / "cut")]) == 130
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "checkpointed at epoch 20 of 40" in err
    monkeypatch.setattr(grokking, "build_task", original)
    assert main([*flags, "--out", str(tmp_path / "cut")]) == 0
    assert _records(tmp_path / "cut") == _records(tmp_path / "full")
    # companion: without any checkpoint yet, the message says the rerun starts over
    _patched_build(monkeypatch, lambda task: setattr(task, "loss", _RaiseInLoss(task.loss, at=3)))
    assert main([*flags[:-2], "--out", str(tmp_path / "early")]) == 130
    assert "before its first checkpoint" in capsys.readouterr().err


def test_an_arm_of_another_study_is_refused_not_run_as_another(tmp_path, capsys):
    """``stiefel-gain`` gets its gain from the language-model study's builder; grokking and vision would build
    plain frames and run it as ``stiefel`` without a word, so they refuse it (CLI and Python API)."""
    from experiments.harness.arms import available_arms, get_arm
    from experiments.harness.config import RunSpec
    from experiments.harness.jobs import run_jobs
    from experiments.lm import study as lm  # noqa: F401  (registers the lm arms)

    out = tmp_path / "out"
    _usage_error(capsys, ["grokking", "--quiet", "--out", str(out), "--arms", "stiefel-gain"],
                 "--arms", "stiefel-gain", "another study")
    _usage_error(capsys, [*VISION_TINY, "--out", str(out), "--arms", "stiefel-gain"], "--arms", "stiefel-gain")
    assert not out.exists()
    spec = RunSpec(grokking.GrokkingConfig(p=7, width=16, heads=2, mlp=32), "stiefel-gain", 0)
    with pytest.raises(ValueError, match="only in the lm study"):
        run_jobs([spec], grokking.build_task, out)
    assert not out.exists()
    # companion: the study the arm belongs to takes it, and study-free arms stay available everywhere
    assert get_arm("stiefel-gain", "lm").name == "stiefel-gain"
    assert "stiefel-gain" in available_arms("lm") and "stiefel-gain" not in available_arms("grokking")
    assert {"adamw", "stiefel", "geoopt-radam"} <= set(available_arms("grokking")) & set(available_arms("lm"))


def test_report_only_names_the_training_flags_it_ignores(tmp_path, capsys):
    """``--report-only`` reads the recorded settings; a training flag given with it is said to be ignored."""
    out = tmp_path / "out"
    assert main(["grokking", *TINY, "--epochs", "10", "--seeds", "0", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["grokking", "--report-only", "--quiet", "--out", str(out), "--lr", "5", "--epochs", "999"]) == 0
    err = capsys.readouterr().err
    assert "--report-only" in err and "ignoring --epochs --lr" in err
    # companion: the flags report-only uses (and how to run) draw no note
    assert main(["grokking", "--report-only", "--quiet", "--out", str(out), "--arms", "stiefel", "--seeds", "0"]) == 0
    assert "ignoring" not in capsys.readouterr().err


def test_run_options_are_made_once_from_the_flags():
    from experiments.harness.jobs import RunOptions

    args = build_parser().parse_args(["grokking", "--workers", "2", "--device", "cpu", "--threads", "3", "--quiet",
                                      "--stop-after-epochs", "5", "--checkpoint-interval", "7"])
    options = RunOptions.from_args(args)
    assert options == RunOptions(workers=2, device="cpu", threads=3, quiet=True, stop_after_epochs=5,
                                 checkpoint_interval_s=7.0)
    # the keyword form replaces single fields and leaves the others; companion: a field that does not exist fails
    assert RunOptions.of(options, workers=1) == RunOptions(1, "cpu", 3, True, 5, 7.0)
    with pytest.raises(TypeError):
        RunOptions.of(options, worker=1)


def test_report_only_flags_are_declared_beside_their_study():
    from experiments.harness.command import ignored_by_report_only
    from experiments.lm.study import STUDY as LM
    from experiments.vision.study import STUDY as VISION

    args = build_parser().parse_args(["vision", "--report-only", "--study", "scaling", "--data-dir", "d",
                                      "--width", "8"])
    assert ignored_by_report_only(args, VISION.report_only_flags) == ["--width"]
    # companion: without the study's own flags, --study and --data-dir are reported as ignored too
    assert ignored_by_report_only(args) == ["--data-dir", "--study", "--width"]
    assert LM.report_only_flags == {"corpus_root"} and LM.arms and VISION.seeds == tuple(range(12))


def test_usage_error_is_one_class_for_the_cli_and_the_studies():
    from experiments.harness import command
    from geoopt_stiefel_attention import argtypes, cli

    assert cli.UsageError is argtypes.UsageError is command.UsageError


@pytest.mark.parametrize("study", ["grokking", "vision", "lm"])
def test_help_says_the_study_default_step_differs_from_the_optimizers(study, capsys):
    """The studies default to the paper's step (adjust_lr_fn='original') and StiefelAdam to match_rms_adamw; the
    --help of each study says both, so that a user copying a study's flags into their own code is not surprised."""
    import inspect

    from geoopt_stiefel_attention import StiefelAdam

    with pytest.raises(SystemExit):
        main([study, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default original, the paper's step" in text
    own = inspect.signature(StiefelAdam).parameters["adjust_lr_fn"].default
    assert own == "match_rms_adamw" and f"StiefelAdam's own default is {own}" in text


def test_a_study_command_is_a_subclass_whose_methods_say_flag_config_arms_train():
    """Issue 39: each study is a :class:`StudyCommand` subclass; ``run`` goes through its methods in order
    (flags -> config -> arms -> train). Companions: a subclass without a name is refused at definition, and the
    base class's abstract methods say which one a study forgot."""
    import argparse

    from experiments.harness.command import StudyCommand
    from experiments.lm import study as lm_study
    from experiments.vision import study as vision_study

    for module in (grokking, vision_study, lm_study):
        assert isinstance(module.STUDY, StudyCommand) and type(module.STUDY) is not StudyCommand
        assert module.run == module.STUDY.run and module.add_arguments == module.STUDY.add_arguments
    calls = []

    class Traced(type(grokking.STUDY)):
        def config_from_args(self, args):
            calls.append("config")
            return super().config_from_args(args)

        def arms_to_run(self, args):
            calls.append("arms")
            return super().arms_to_run(args)

        def train(self, config, args, **kwargs):
            calls.append(("train", kwargs["arms"], kwargs["seeds"]))
            raise KeyboardInterrupt("stop here")

    parser = argparse.ArgumentParser()
    Traced().add_arguments(parser)
    args = parser.parse_args(["--quiet", "--device", "cpu", "--out", "unused"])
    with pytest.raises(KeyboardInterrupt, match="stop here"):
        Traced().run(args)
    assert calls == ["config", "arms", ("train", ["adamw", "stiefel"], [0])]
    with pytest.raises(TypeError, match="'name'"):
        type("Nameless", (StudyCommand,), {"config_type": object})
    with pytest.raises(NotImplementedError, match="Forgetful.train"):
        type("Forgetful", (StudyCommand,), {"name": "x", "config_type": object})().train(
            None, args, arms=None, seeds=None, options=None, command=None)


@pytest.mark.parametrize("study", ["grokking", "vision", "lm"])
def test_the_default_trust_region_follows_the_rule_given_on_the_command_line(study):
    """Without --trust-region a study runs the library's default radius for the rule it runs: 0.1 under its default
    'original', 1 (frame units) under --adjust-lr-fn match_rms_adamw. The study's default config holds 'auto' already
    resolved for 'original'; offered as that number, the default used to cap match_rms_adamw steps at 0.1 without a
    word (the companion: that resolved number, given explicitly, is what such a run would have had)."""
    from experiments.harness.cli_args import optim_config_from_args
    from geoopt_stiefel_attention._linalg import trust_radius

    parser = build_parser()

    def radius(*flags):
        return optim_config_from_args(parser.parse_args([study, *flags])).trust_region

    assert radius() == trust_radius("auto", "original") == 0.1
    assert radius("--adjust-lr-fn", "match_rms_adamw") == trust_radius("auto", "match_rms_adamw") == 1.0
    assert radius("--adjust-lr-fn", "match_rms_adamw", "--trust-region", "auto") == 1.0
    # an explicit radius is kept, whatever the rule: the old default's number under match_rms_adamw binds at 0.1
    assert radius("--adjust-lr-fn", "match_rms_adamw", "--trust-region", "0.1") == 0.1 != radius(
        "--adjust-lr-fn", "match_rms_adamw")
    assert radius("--trust-region", "none") is None


def test_an_arm_that_steps_by_its_own_rule_is_refused_under_another():
    """Stock geoopt (and the frame-scalar ablation) step frames by the paper's rule and ``stiefelmuon-muon`` by
    match_rms_adamw, whatever the run's --adjust-lr-fn: a run under the other rule would record a rule it did not
    use, so the CLI refuses it in one line, before any work (companion: the same arms under their own rule)."""
    from experiments.harness.arms import check_arm
    from experiments.harness.config import OptimConfig, RunSpec
    from experiments.harness.jobs import run_jobs

    for arm, own, other in (("geoopt-radam", "original", "match_rms_adamw"),
                            ("geoopt-rsgd", "original", "match_rms_adamw"),
                            ("framescalar-euclidean", "original", "match_rms_adamw"),
                            ("stiefelmuon-muon", "match_rms_adamw", "original")):
        with pytest.raises(ValueError, match=f"--arms {arm}: the arm steps its frames by adjust_lr_fn='{own}'"):
            check_arm(arm, None, OptimConfig(adjust_lr_fn=other))
        assert check_arm(arm, None, OptimConfig(adjust_lr_fn=own)).name == arm
    for arm in ("stiefel", "adamw", "stiefel-sgd"):  # these follow the run's rule
        assert check_arm(arm, None, OptimConfig(adjust_lr_fn="original")).name == arm
        assert check_arm(arm, None, OptimConfig(adjust_lr_fn="match_rms_adamw")).name == arm
    config = grokking.GrokkingConfig(p=7, width=16, heads=2, mlp=32, optim=OptimConfig(adjust_lr_fn="match_rms_adamw"))
    with pytest.raises(ValueError, match="would be recorded but not used"):  # the Python API too, before any work
        run_jobs([RunSpec(config, "geoopt-radam", 0)], grokking.build_task, Path("/nonexistent/never"))


def test_the_cli_refuses_geoopt_radam_under_match_rms_adamw_in_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    _usage_error(capsys, ["grokking", "--quiet", "--out", str(out), "--arms", "geoopt-radam", "--adjust-lr-fn",
                          "match_rms_adamw"], "geoopt-radam", "--adjust-lr-fn original")
    assert not out.exists()
