"""Held-out evaluation text (experiments.data.heldout): split, overlap, per-file cap, categories."""

from __future__ import annotations

import random

import numpy as np
import pytest

from experiments.lm.heldout import (
    byte_categories,
    load_heldout_corpus,
    ngram_hashes,
    split_of,
    window_category,
)


def _reference_hash(data: bytes, n: int) -> list[int]:
    out = []
    for i in range(len(data) - n + 1):
        h = 0
        for b in data[i:i + n]:
            h = (h * 1099511628211 + b) % 2 ** 64
        out.append(h)
    return out


def test_ngram_hashes_equal_the_written_out_polynomial():
    data = bytes(random.Random(0).randrange(256) for _ in range(200))
    got = ngram_hashes(np.frombuffer(data, dtype=np.uint8), 16)
    assert got.tolist() == _reference_hash(data, 16)
    assert len(ngram_hashes(np.frombuffer(data[:10], dtype=np.uint8), 16)) == 0
    # companion: one changed byte changes every substring that holds it
    other = bytearray(data)
    other[100] ^= 1
    changed = ngram_hashes(np.frombuffer(bytes(other), dtype=np.uint8), 16) != got
    assert changed[85:101].all() and not changed[:85].any() and not changed[101:].any()


def test_split_of_is_per_file_and_follows_the_fractions():
    paths = [f"pkg/mod{i}.py" for i in range(4000)]
    splits = [split_of(p, 0.1, 0.2) for p in paths]
    assert splits == [split_of(p, 0.1, 0.2) for p in paths]  # a pure function of the path
    shares = {k: splits.count(k) / len(paths) for k in ("val", "test", "train")}
    assert shares["val"] == pytest.approx(0.1, abs=0.02) and shares["test"] == pytest.approx(0.2, abs=0.02)
    # the validation files do not change when a test split is added (same buckets below val_fraction)
    assert [p for p in paths if split_of(p, 0.1, 0.0) == "val"] == [p for p, s in zip(paths, splits, strict=True) if s == "val"]


def test_byte_categories_mark_docstrings_comments_literals_and_code():
    src = b'"""Doc string."""\nx = 12  # note\ny = "abc"\n'
    cats = byte_categories("m.py", src)
    text = src.decode()

    def cat_of(fragment):
        i = text.index(fragment)
        return set(cats[i:i + len(fragment)].tolist())

    assert cat_of('"""Doc string."""') == {1} and cat_of("# note") == {1}
    assert cat_of("12") == {2} and cat_of('"abc"') == {2}
    assert cat_of("x = ") == {0}
    assert window_category("encodings/cp1252.py", np.zeros(10, dtype=np.int8)) == "data"  # codec tables
    assert window_category("m.py", np.array([1] * 6 + [0] * 4, dtype=np.int8)) == "prose"
    assert window_category("m.py", np.array([1] * 4 + [0] * 6, dtype=np.int8)) == "code"  # companion
    assert byte_categories("bad.py", b"def f(:\n  '''unterminated").sum() >= 0  # never raises


def _write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _unique_text(rng, lines=80):
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "theta", "kappa"]
    return "".join(f"def f_{rng.randrange(10**9)}(x):\n    return x * {rng.randrange(10**6)} + "
                   f"{rng.choice(words)}_{rng.randrange(10**6)}\n" for _ in range(lines))


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory):
    """120 files of unique text; the test files include one that copies a training file verbatim and one huge file."""
    root = tmp_path_factory.mktemp("heldout")
    rng = random.Random(1)
    names = [f"m{k:03d}.py" for k in range(120)]
    for name in names:
        _write(root, name, _unique_text(rng))
    train = next(n for n in names if split_of(n, 0.2, 0.2) == "train")
    test = [n for n in names if split_of(n, 0.2, 0.2) == "test"]
    _write(root, test[0], (root / train).read_text())  # a verbatim copy of training text
    _write(root, test[1], _unique_text(rng, lines=3000))  # one file much larger than the rest
    return root, test[0], test[1]


def test_windows_copied_from_training_are_dropped_and_no_file_dominates(corpus_root):
    root, copied, huge = corpus_root
    held = load_heldout_corpus(val_fraction=0.2, test_fraction=0.2, context=64, count=60, max_file_share=0.05,
                               root=root)
    test = held.test.describe()
    assert copied not in held.test.files and held.test.windows.shape[1] == 65
    assert test["max_overlap"] <= 0.25 and test["largest_file_share"] <= 0.05 + 1e-12
    assert 1 <= held.test.files.count(huge) <= 3  # floor(0.05 * 60): capped, although it alone holds hundreds
    assert not set(held.val.files) & set(held.test.files)
    # companion: without the overlap filter the copied file's windows come in, with overlap 1
    loose = load_heldout_corpus(val_fraction=0.2, test_fraction=0.2, context=64, count=60, max_file_share=0.05,
                                max_overlap=1.0, root=root)
    assert copied in loose.test.files
    assert max(o for f, o in zip(loose.test.files, loose.test.overlap, strict=True) if f == copied) == 1.0
    # the training stream holds no validation or test file's text
    train_text = bytes(held.train.numpy())
    assert (root / huge).read_bytes()[:200] not in train_text


def test_bad_options_name_the_parameter(corpus_root):
    root = corpus_root[0]
    for kwargs, match in (({"test_fraction": 0.0}, "test_fraction=0.0"),
                          ({"val_fraction": 0.6, "test_fraction": 0.5}, "sum below 1"),
                          ({"max_file_share": 0.0}, "max_file_share"), ({"ngram": 4}, "ngram=4"),
                          ({"max_overlap": 1.5}, "max_overlap")):
        with pytest.raises(ValueError, match=match):
            load_heldout_corpus(root=root, **kwargs)
    with pytest.warns(UserWarning, match="only .* of 5000 windows"):
        load_heldout_corpus(val_fraction=0.2, test_fraction=0.2, context=64, count=5000, root=root)
