r"""Byte-level text available offline, and the batch sources of a causal language model.

The corpus is text nobody on this project wrote and that every machine running the library already has:
the source files of the running interpreter's **Python standard library** (``*.py`` under
``sysconfig.get_paths()["stdlib"]``, without ``site-packages``, ``__pycache__`` and the interpreter's own
test suites). Nothing is downloaded. Its identity is recorded, not assumed: :meth:`TextCorpus.describe` gives
the Python version, the number of files and bytes, and a SHA-256 over the sorted relative paths and the
contents, so a report can say exactly which text a number was measured on (another Python version is
another corpus).

Tokens are bytes (vocabulary 256), so the per-token loss in nats converts to **bits per byte** as
:math:`\text{bpb} = \text{loss} / \ln 2`.

Split: by file, never inside a file. A file goes to validation when the first 8 hex digits of the SHA-256
of its relative path, read as an integer, fall below ``val_fraction · 16^8``; the assignment of a file
does not depend on which other files exist. Files are joined in path order, each followed by a blank line.
"""

from __future__ import annotations

import hashlib
import math
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..harness.batches import epoch_generator

__all__ = ["CORPORA", "TextCorpus", "load_corpus", "corpus_licence", "stdlib_files", "RandomWindows", "EvalWindows",
           "bits_per_byte"]

#: Corpus names accepted by :func:`load_corpus`.
CORPORA = ("python-stdlib",)

_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
_SEPARATOR = b"\n\n"


def bits_per_byte(loss_nats: float) -> float:
    r"""Bits per byte of a mean per-byte cross-entropy in nats: :math:`\text{loss}/\ln 2`."""
    return float(loss_nats) / math.log(2.0)


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The ``*.py`` files of the standard library under ``root`` (default: this interpreter's), sorted by
    relative path, skipping ``site-packages``, ``__pycache__`` and test-suite folders."""
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    if not base.exists():
        raise FileNotFoundError(f"stdlib_files: root={str(base)!r}: the folder is missing (nothing exists at this "
                                f"path); pass a folder holding *.py files.")
    if not base.is_dir():
        raise FileNotFoundError(f"stdlib_files: root={str(base)!r} is a file, not a folder; pass a folder holding "
                                f"*.py files.")
    files = [p for p in base.rglob("*.py")
             if p.is_file() and not _EXCLUDED_DIRS.intersection(p.relative_to(base).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def _is_validation(relpath: str, val_fraction: float) -> bool:
    bucket = int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16)
    return bucket < val_fraction * 16 ** 8


@dataclass(frozen=True)
class TextCorpus:
    """A byte corpus split by file into train and validation streams.

    Attributes
    ----------
    name : str
        The corpus name (:data:`CORPORA`).
    source : str
        Where the text comes from, in words.
    version : str
        Version of what ships the text (here the Python version).
    sha256 : str
        SHA-256 over every file's relative path and the SHA-256 of its content, in path order.
    train, val : torch.Tensor
        ``uint8`` byte streams.
    train_files, val_files : int
        Number of files in each stream.
    val_fraction : float
        The requested share of files in validation.
    """

    name: str
    source: str
    version: str
    sha256: str
    train: torch.Tensor
    val: torch.Tensor
    train_files: int
    val_files: int
    val_fraction: float

    def describe(self) -> dict[str, Any]:
        """The corpus' identity as a JSON-ready dict (for ``config.json`` and reports)."""
        return {"corpus": self.name, "source": self.source, "version": self.version, "sha256": self.sha256,
                "train_files": self.train_files, "val_files": self.val_files,
                "train_bytes": int(self.train.numel()), "val_bytes": int(self.val.numel()),
                "val_fraction": self.val_fraction, "split": "by file (SHA-256 of the relative path)"}


#: The licence of the Python standard library's sources, as its ``LICENSE.txt`` names it.
PSF_LICENCE = "PSF License Agreement (Python Software Foundation License Version 2)"


def corpus_licence(root: str | Path | None = None) -> str:
    """The licence of the corpus' text, in words, read from the ``LICENSE.txt`` that CPython installs next to the
    standard library (``root=None``); for another folder, what its ``LICENSE*`` file's first line says, or that
    none was found."""
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files = sorted(base.glob("LICEN[CS]E*"))
    if not files:
        return f"not stated (no LICENSE file in {base.name if root is not None else 'the standard library'})"
    text = files[0].read_text(errors="replace")
    if "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in text:
        return f"{PSF_LICENCE}; {files[0].name} next to the sources"
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"see {files[0].name} ({first[:80]})"


def load_corpus(name: str = "python-stdlib", *, val_fraction: float = 0.1,
                root: str | Path | None = None) -> TextCorpus:
    """Read a corpus and split it by file.

    Parameters
    ----------
    name : str
        ``"python-stdlib"``: the standard library's Python sources (see the module docstring).
    val_fraction : float
        Expected share of files held out for validation, in ``(0, 1)``.
    root : path, optional
        Read the files from this folder instead of the interpreter's standard library (tests).

    Raises
    ------
    ValueError
        For an unknown ``name``, a ``val_fraction`` outside ``(0, 1)``, a ``root`` that holds no ``*.py`` file,
        or a split that leaves either side empty.
    FileNotFoundError
        For a ``root`` that does not exist or is a file.
    """
    if name not in CORPORA:
        raise ValueError(f"load_corpus: name={name!r} is unknown; use one of {', '.join(CORPORA)}.")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
        raise ValueError(f"load_corpus: val_fraction={val_fraction!r} must be a number in (0, 1).")
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files = stdlib_files(base)
    if not files:
        raise ValueError(f"load_corpus: the folder {str(base)!r} holds no *.py files (outside test and site-packages "
                         f"folders); pass a folder holding *.py files.")
    digest = hashlib.sha256()
    streams: dict[bool, list[bytes]] = {True: [], False: []}
    for path in files:
        rel = path.relative_to(base).as_posix()
        data = path.read_bytes()
        digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
        streams[_is_validation(rel, val_fraction)].append(data + _SEPARATOR)
    if not streams[False] or not streams[True]:
        raise ValueError(f"load_corpus: {len(files)} files under {str(base)!r} leave the "
                         f"{'training' if not streams[False] else 'validation'} split empty at "
                         f"val_fraction={val_fraction}; use a folder with more files or another val_fraction.")

    def as_tensor(chunks: list[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).clone()

    version = ".".join(map(str, sys.version_info[:3])) if root is None else "n/a (custom root)"
    source = (f"Python {version} standard library sources (*.py, no tests, no site-packages)" if root is None
              else f"*.py files under {base}")
    return TextCorpus(name=name, source=source, version=version, sha256=digest.hexdigest(),
                      train=as_tensor(streams[False]), val=as_tensor(streams[True]),
                      train_files=len(streams[False]), val_files=len(streams[True]),
                      val_fraction=float(val_fraction))


def _check_positive(owner: str, **values: int) -> None:
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}: {key}={value!r} must be a positive int.")


def _windows(stream: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + torch.arange(context + 1)
    chunk = stream[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


class RandomWindows:
    """Training batches of random windows of a byte stream; the next byte is the target at every position.

    An "epoch" is ``steps`` batches. Window starts are drawn uniformly from ``[0, len(stream) - context - 1]``
    by :func:`~experiments.harness.batches.epoch_generator` ``(seed, epoch)``, so arms
    with the same seed see the same text in the same order and a resumed run sees what the uninterrupted
    run would have seen.

    Parameters
    ----------
    stream : torch.Tensor
        1-D ``uint8`` bytes.
    context : int
        Positions per window.
    batch_size : int
        Windows per batch.
    steps : int
        Batches per epoch.
    seed : int
        The run's seed.
    """

    def __init__(self, stream: torch.Tensor, *, context: int, batch_size: int, steps: int, seed: int) -> None:
        _check_positive("RandomWindows", context=context, batch_size=batch_size, steps=steps)
        if stream.dim() != 1 or stream.numel() < context + 2:
            raise ValueError(f"RandomWindows: the stream holds {stream.numel()} bytes, fewer than context + 2 = "
                             f"{context + 2}; lower context or use more text.")
        self.stream, self.context, self.batch_size, self.steps, self.seed = stream, context, batch_size, steps, seed

    def __len__(self) -> int:
        return self.steps

    def batches(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = epoch_generator(self.seed, epoch)
        high = self.stream.numel() - self.context
        for _ in range(self.steps):
            starts = torch.randint(0, high, (self.batch_size,), generator=gen)
            yield _windows(self.stream, starts, self.context)


class EvalWindows:
    """Fixed validation windows: ``count`` windows whose starts are evenly spaced over the stream.

    Every evaluation, every arm and every seed sees the same bytes, so validation losses pair exactly.
    """

    def __init__(self, stream: torch.Tensor, *, context: int, count: int, batch_size: int) -> None:
        _check_positive("EvalWindows", context=context, count=count, batch_size=batch_size)
        high = stream.numel() - context - 1
        if stream.dim() != 1 or high < 0:
            raise ValueError(f"EvalWindows: the stream holds {stream.numel()} bytes, fewer than context + 1 = "
                             f"{context + 1}; lower context or use more text.")
        self.starts: Sequence[int] = torch.linspace(0, high, count).round().long()
        self.stream, self.context, self.batch_size = stream, context, batch_size

    def __len__(self) -> int:
        return -(-len(self.starts) // self.batch_size)

    def batches(self, epoch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for k in range(len(self)):
            yield _windows(self.stream, self.starts[k * self.batch_size:(k + 1) * self.batch_size], self.context)
