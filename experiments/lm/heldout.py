r"""Held-out evaluation text for the language model: validation and test files, clean windows, categories.

The plain split of :mod:`.text` evaluates on windows evenly spaced over the validation stream, so one long file
can hold most of them, and text that also appears in training (codec tables, licence headers) is scored as if it
were new. This module builds evaluation sets a comparison can be read from:

1. **Three-way split by file.** A file's bucket is the first 8 hex digits of the SHA-256 of its relative path,
   read as :math:`u \in [0, 1)`: validation when :math:`u < f_v`, test when :math:`f_v \le u < f_v + f_t`,
   training otherwise (:func:`split_of`). Choices (learning rates) are made on validation; the result is read
   once on test.
2. **No long verbatim overlap with training.** Every window of ``context + 1`` bytes is cut inside one file
   (consecutive, non-overlapping). Its *overlap* is the share of its ``ngram``-byte substrings that occur
   anywhere in the training text (:func:`ngram_hashes`: a 64-bit polynomial hash of every substring; a hash
   collision could only raise the overlap). Windows with overlap above ``max_overlap`` are dropped.
3. **No file dominates.** Windows are taken round-robin over the files (in the order of their path hash), at
   most ``max_file_share · count`` from any one file, spread evenly over each file.
4. **Categories.** Each byte is classed by Python's tokenizer as *prose* (comments and string statements, i.e.
   docstrings), *data* (other string and number literals) or *code* (everything else); a window is ``data``
   when its file is a codec table (``encodings/``) or at least half its bytes are literals, ``prose`` when at
   least half are prose, and ``code`` otherwise (:data:`CATEGORIES`). Bits per byte are reported per category.

Everything is a pure function of the files and the options, so every run of a study sees the same windows.
"""

from __future__ import annotations

import hashlib
import io
import math
import sysconfig
import tokenize
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .data import _SEPARATOR, stdlib_files

__all__ = ["CATEGORIES", "split_of", "ngram_hashes", "byte_categories", "window_category", "WindowSet",
           "HeldOutCorpus", "load_heldout_corpus"]

#: Window categories, in report order.
CATEGORIES = ("code", "prose", "data")

_PROSE, _DATA, _CODE = 1, 2, 0
_HASH_BASE = np.uint64(1099511628211)  # the 64-bit FNV prime, as a polynomial base (arithmetic mod 2^64)


def _bucket(relpath: str) -> float:
    return int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16) / 16 ** 8


def split_of(relpath: str, val_fraction: float, test_fraction: float) -> str:
    """``"val"``, ``"test"`` or ``"train"`` for the file at ``relpath`` (see the module docstring, item 1)."""
    u = _bucket(relpath)
    if u < val_fraction:
        return "val"
    if u < val_fraction + test_fraction:
        return "test"
    return "train"


def ngram_hashes(data: np.ndarray, n: int) -> np.ndarray:
    r"""The hash of every ``n``-byte substring of ``data`` (``uint8``), ``len(data) - n + 1`` values:
    :math:`h_i = \sum_{j<n} b_{i+j}\, B^{n-1-j} \bmod 2^{64}` (Horner's rule, vectorised over :math:`i`)."""
    if len(data) < n:
        return np.empty(0, dtype=np.uint64)
    b = data.astype(np.uint64)
    m = len(data) - n + 1
    h = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * _HASH_BASE + b[j:j + m]
    return h


def byte_categories(relpath: str, data: bytes) -> np.ndarray:
    """Per byte of ``data``: 1 for prose (comments, string statements), 2 for other literals, 0 for code. A file
    the tokenizer rejects is all code."""
    out = np.zeros(len(data), dtype=np.int8)
    lines = data.splitlines(keepends=True)
    offsets = np.concatenate([[0], np.cumsum([len(line) for line in lines])]).astype(np.int64)

    def span(start: tuple[int, int], end: tuple[int, int]) -> slice:
        # tokenize counts columns in characters of the decoded line; for ASCII lines they are bytes (non-ASCII
        # lines are rare in the standard library and only shift a category boundary by a few bytes)
        a = offsets[min(start[0] - 1, len(lines))] + start[1]
        b = offsets[min(end[0] - 1, len(lines))] + end[1]
        return slice(int(a), int(b))

    try:
        tokens = list(tokenize.tokenize(io.BytesIO(data).readline))
    except (tokenize.TokenError, SyntaxError, UnicodeDecodeError, IndentationError):
        return out
    boundary = {tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}
    for k, tok in enumerate(tokens):
        if tok.type == tokenize.COMMENT:
            out[span(tok.start, tok.end)] = _PROSE
        elif tok.type == tokenize.STRING:
            before = tokens[k - 1].type if k else tokenize.ENCODING
            after = tokens[k + 1].type if k + 1 < len(tokens) else tokenize.NEWLINE
            statement = before in boundary and after in (tokenize.NEWLINE, tokenize.ENDMARKER)
            out[span(tok.start, tok.end)] = _PROSE if statement else _DATA
        elif tok.type == tokenize.NUMBER:
            out[span(tok.start, tok.end)] = _DATA
    return out


def window_category(relpath: str, categories: np.ndarray) -> str:
    """The category of a window from its bytes' categories (module docstring, item 4)."""
    if relpath.startswith("encodings/") or np.mean(categories == _DATA) >= 0.5:
        return "data"
    if np.mean(categories == _PROSE) >= 0.5:
        return "prose"
    return "code"


@dataclass(frozen=True)
class WindowSet:
    """Fixed evaluation windows: ``windows`` is ``(n, context + 1)`` ``uint8`` (inputs are the first ``context``
    bytes, targets the last ``context``); ``files`` and ``categories`` name each window's file and category."""

    name: str
    windows: torch.Tensor
    files: tuple[str, ...]
    categories: tuple[str, ...]
    overlap: tuple[float, ...]

    def subset(self, category: str) -> WindowSet:
        """The windows of one category (possibly none)."""
        keep = [i for i, c in enumerate(self.categories) if c == category]
        return WindowSet(f"{self.name}_{category}", self.windows[keep], tuple(self.files[i] for i in keep),
                         tuple(category for _ in keep), tuple(self.overlap[i] for i in keep))

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(inputs, targets)`` batches of ``batch_size`` windows, in order."""
        for k in range(0, len(self.files), batch_size):
            chunk = self.windows[k:k + batch_size].long()
            yield chunk[:, :-1], chunk[:, 1:]

    def describe(self) -> dict[str, Any]:
        """Counts per category, the number of files, the largest share of windows from one file, the overlap."""
        counts: dict[str, int] = {}
        for f in self.files:
            counts[f] = counts.get(f, 0) + 1
        n = len(self.files)
        return {"windows": n, "files": len(counts),
                "per_category": {c: sum(x == c for x in self.categories) for c in CATEGORIES},
                "largest_file_share": max(counts.values()) / n if n else None,
                "largest_file": max(counts, key=counts.get) if counts else None,
                "mean_overlap": float(np.mean(self.overlap)) if n else None,
                "max_overlap": float(np.max(self.overlap)) if n else None}


@dataclass(frozen=True)
class HeldOutCorpus:
    """The training stream and the validation and test :class:`WindowSet` s of :func:`load_heldout_corpus`."""

    train: torch.Tensor
    val: WindowSet
    test: WindowSet
    identity: dict[str, Any]


def _select(files: Sequence[tuple[str, bytes]], *, name: str, context: int, count: int, max_file_share: float,
            ngram: int, max_overlap: float, index: np.ndarray) -> WindowSet:
    length = context + 1
    cap = max(1, math.floor(max_file_share * count))
    candidates: list[list[tuple[np.ndarray, str, float]]] = []
    for rel, data in sorted(files, key=lambda f: hashlib.sha256(f[0].encode()).hexdigest()):
        arr = np.frombuffer(data, dtype=np.uint8)
        if len(arr) < length:
            continue
        cats = byte_categories(rel, data)
        mine = []
        for start in range(0, len(arr) - length + 1, length):
            window = arr[start:start + length]
            hashes = ngram_hashes(window, ngram)
            pos = np.searchsorted(index, hashes)
            found = (pos < len(index)) & (index[np.minimum(pos, len(index) - 1)] == hashes)
            overlap = float(found.mean()) if len(hashes) else 0.0
            if overlap <= max_overlap:
                mine.append((window, window_category(rel, cats[start:start + length]), overlap, rel))
        if mine:
            candidates.append(mine)
    chosen: list[tuple[np.ndarray, str, float, str]] = []
    for k in range(cap):
        for mine in candidates:
            if len(chosen) == count:
                break
            take = min(cap, len(mine))
            if k < take:
                chosen.append(mine[(k * len(mine)) // take])
    if len(chosen) < count:
        warnings.warn(f"held-out {name} set: only {len(chosen)} of {count} windows pass (at most {cap} per file, "
                      f"overlap <= {max_overlap}); the set is smaller than asked. Raise max_file_share or the "
                      f"split's fraction.", UserWarning, stacklevel=3)
    windows = torch.from_numpy(np.stack([c[0] for c in chosen]).copy()) if chosen else torch.empty(
        0, length, dtype=torch.uint8)
    return WindowSet(name, windows, tuple(c[3] for c in chosen), tuple(c[1] for c in chosen),
                     tuple(c[2] for c in chosen))


def load_heldout_corpus(*, val_fraction: float = 0.1, test_fraction: float = 0.1, context: int = 128,
                        count: int = 256, max_file_share: float = 0.02, ngram: int = 32, max_overlap: float = 0.25,
                        root: str | Path | None = None) -> HeldOutCorpus:
    """The standard library's sources (or the ``*.py`` files under ``root``) split three ways by file, with
    ``count`` clean windows for validation and for test (module docstring).

    Raises
    ------
    ValueError
        For fractions outside ``(0, 1)`` or summing to 1 or more, a ``max_file_share`` outside ``(0, 1]``, an
        ``ngram`` below 8, a ``max_overlap`` outside ``[0, 1]``, or a split that leaves a side without files.
    """
    for key, v in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
            raise ValueError(f"load_heldout_corpus: {key}={v!r} must be a number in (0, 1).")
    if val_fraction + test_fraction >= 1:
        raise ValueError(f"load_heldout_corpus: val_fraction + test_fraction = {val_fraction + test_fraction} leaves "
                         f"no training text; keep their sum below 1 (e.g. 0.1 and 0.1).")
    if not 0 < max_file_share <= 1:
        raise ValueError(f"load_heldout_corpus: max_file_share={max_file_share!r} must be in (0, 1], e.g. 0.02.")
    if isinstance(ngram, bool) or not isinstance(ngram, int) or ngram < 8:
        raise ValueError(f"load_heldout_corpus: ngram={ngram!r} must be an int >= 8 (e.g. 32).")
    if not 0 <= max_overlap <= 1:
        raise ValueError(f"load_heldout_corpus: max_overlap={max_overlap!r} must be in [0, 1], e.g. 0.25.")
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    digest = hashlib.sha256()
    parts: dict[str, list[tuple[str, bytes]]] = {"train": [], "val": [], "test": []}
    for path in stdlib_files(base):
        rel = path.relative_to(base).as_posix()
        data = path.read_bytes()
        digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
        parts[split_of(rel, val_fraction, test_fraction)].append((rel, data))
    empty = [k for k, v in parts.items() if not v]
    if empty:
        raise ValueError(f"load_heldout_corpus: the {', '.join(empty)} split(s) of the files under {str(base)!r} are "
                         f"empty at val_fraction={val_fraction}, test_fraction={test_fraction}; use more files.")
    train_bytes = b"".join(data + _SEPARATOR for _, data in parts["train"])
    train = np.frombuffer(train_bytes, dtype=np.uint8)
    index = np.unique(ngram_hashes(train, ngram))
    options = dict(context=context, count=count, max_file_share=max_file_share, ngram=ngram,
                   max_overlap=max_overlap, index=index)
    val = _select(parts["val"], name="val", **options)
    test = _select(parts["test"], name="test", **options)
    identity = {"sha256": digest.hexdigest(), "train_files": len(parts["train"]), "val_files": len(parts["val"]),
                "test_files": len(parts["test"]), "train_bytes": len(train_bytes),
                "split": "by file, three ways (SHA-256 of the relative path)",
                "val": val.describe(), "test": test.describe()}
    return HeldOutCorpus(torch.from_numpy(train.copy()), val, test, identity)
