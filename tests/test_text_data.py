"""Tests of the offline byte corpus and the language-model batch sources."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from experiments.lm.data import (
    EvalWindows,
    RandomWindows,
    bits_per_byte,
    load_corpus,
    stdlib_files,
)


@pytest.fixture()
def tree(tmp_path):
    """A fake standard library: 40 modules, a test package and a site-packages folder that must be skipped."""
    for k in range(40):
        sub = tmp_path / ("pkg" if k % 3 == 0 else "") / f"mod{k:02d}.py"
        sub.parent.mkdir(parents=True, exist_ok=True)
        sub.write_bytes(f"# module {k}\nx = {k}\n".encode() * (k + 1))
    for skipped in ("test/test_x.py", "site-packages/foo/bar.py", "pkg/__pycache__/mod.py", "pkg/tests/t.py"):
        (tmp_path / skipped).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / skipped).write_text("SKIPPED\n")
    (tmp_path / "notes.txt").write_text("not python\n")
    return tmp_path


def test_stdlib_files_skips_tests_site_packages_and_caches(tree):
    rel = [p.relative_to(tree).as_posix() for p in stdlib_files(tree)]
    assert len(rel) == 40
    assert rel == sorted(rel)
    assert not any(part in r for r in rel for part in ("test/", "site-packages", "__pycache__", "tests/"))


def test_split_is_by_file_and_covers_every_byte_once(tree):
    corpus = load_corpus(root=tree, val_fraction=0.25)
    files = stdlib_files(tree)
    # independent reference: hash each relative path, threshold at 0.25 * 16^8, join in path order
    expected = {True: b"", False: b""}
    for p in files:
        rel = p.relative_to(tree).as_posix()
        in_val = int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) < 0.25 * 16 ** 8
        expected[in_val] += p.read_bytes() + b"\n\n"
    assert bytes(corpus.train.tolist()) == expected[False]
    assert bytes(corpus.val.tolist()) == expected[True]
    assert corpus.train_files + corpus.val_files == len(files)
    assert corpus.train_files > 0 and corpus.val_files > 0
    assert b"SKIPPED" not in expected[False] + expected[True]


def test_split_of_a_file_does_not_depend_on_the_other_files(tree):
    before = load_corpus(root=tree, val_fraction=0.3)
    (tree / "zz_extra.py").write_text("y = 1\n")
    after = load_corpus(root=tree, val_fraction=0.3)
    extra_in_val = int(hashlib.sha256(b"zz_extra.py").hexdigest()[:8], 16) < 0.3 * 16 ** 8
    assert after.val_files - before.val_files == int(extra_in_val)
    assert after.train_files - before.train_files == int(not extra_in_val)


def test_hash_identifies_the_text(tree):
    a = load_corpus(root=tree).sha256
    assert load_corpus(root=tree).sha256 == a
    (tree / "mod05.py").write_text("changed\n")
    assert load_corpus(root=tree).sha256 != a  # companion: a changed file must change the identity


def test_describe_names_source_version_hash_and_split(tree):
    d = load_corpus(root=tree, val_fraction=0.2).describe()
    for key in ("corpus", "source", "version", "sha256", "train_files", "val_files", "train_bytes", "val_bytes",
                "val_fraction", "split"):
        assert key in d
    assert d["val_fraction"] == 0.2


@pytest.mark.parametrize("kwargs, match", [
    ({"name": "wikitext"}, "name='wikitext'"),
    ({"val_fraction": 0.0}, "val_fraction"),
    ({"val_fraction": 1.0}, "val_fraction"),
    ({"val_fraction": True}, "val_fraction"),
])
def test_bad_arguments_are_named(tree, kwargs, match):
    with pytest.raises(ValueError, match=match):
        load_corpus(root=tree, **kwargs)


def test_a_split_that_leaves_one_side_empty_is_refused(tmp_path):
    (tmp_path / "only.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(root=tmp_path, val_fraction=0.1)


def test_the_real_standard_library_loads():
    corpus = load_corpus()
    d = corpus.describe()
    assert d["train_bytes"] > 1_000_000 and d["val_bytes"] > 100_000
    assert 0.03 < corpus.val_files / (corpus.train_files + corpus.val_files) < 0.2
    assert d["version"].startswith("3.")


def test_random_windows_targets_are_the_next_byte_and_in_range():
    stream = torch.arange(200, dtype=torch.uint8)
    src = RandomWindows(stream, context=16, batch_size=8, steps=5, seed=3)
    batches = list(src.batches(0))
    assert len(batches) == len(src) == 5
    for x, y in batches:
        assert x.shape == y.shape == (8, 16) and x.dtype == torch.long
        assert torch.equal(y[:, :-1], x[:, 1:])
        assert torch.equal(y[:, -1], x[:, -1] + 1)  # the stream counts up by one
        assert int(y.max()) < 200


def test_random_windows_are_a_function_of_seed_and_epoch():
    stream = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))

    def draw(seed, epoch):
        return torch.cat([x for x, _ in RandomWindows(stream, context=8, batch_size=4, steps=3,
                                                      seed=seed).batches(epoch)])

    assert torch.equal(draw(1, 2), draw(1, 2))
    assert not torch.equal(draw(1, 2), draw(1, 3))  # companion: another epoch, other windows
    assert not torch.equal(draw(1, 2), draw(2, 2))  # and another seed


def test_eval_windows_are_fixed_and_cover_the_stream():
    stream = torch.arange(250, dtype=torch.uint8)
    ev = EvalWindows(stream, context=9, count=7, batch_size=3)
    first = [x for x, _ in ev.batches()]
    assert len(first) == len(ev) == 3
    xs = torch.cat(first)
    assert xs.shape == (7, 9)
    assert int(xs[0, 0]) == 0 and int(xs[-1, -1]) == 248  # first window at 0, last ends at the end
    assert all(torch.equal(a, b) for a, b in zip(first, [x for x, _ in ev.batches(5)], strict=True))


@pytest.mark.parametrize("cls, kwargs", [
    (RandomWindows, {"context": 0, "batch_size": 2, "steps": 1, "seed": 0}),
    (RandomWindows, {"context": 4, "batch_size": 2, "steps": 0, "seed": 0}),
    (RandomWindows, {"context": 100, "batch_size": 2, "steps": 1, "seed": 0}),
    (EvalWindows, {"context": 100, "count": 2, "batch_size": 1}),
    (EvalWindows, {"context": 4, "count": 0, "batch_size": 1}),
])
def test_window_sources_refuse_bad_sizes(cls, kwargs):
    with pytest.raises(ValueError, match=cls.__name__):
        cls(torch.zeros(50, dtype=torch.uint8), **kwargs)


def test_bits_per_byte():
    assert bits_per_byte(math.log(256)) == pytest.approx(8.0, abs=1e-12)
    assert bits_per_byte(math.log(2)) == pytest.approx(1.0, abs=1e-12)
