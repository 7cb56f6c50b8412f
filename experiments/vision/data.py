r"""Image classification data for the vision study: CIFAR-10, Fashion-MNIST and scikit-learn's 8×8 digits.

Every data set is read once into memory as float32 tensors ``(N, C, S, S)`` normalised per channel,
:math:`x \mapsto (x/255 - \mu_c)/\sigma_c`, with labels ``(N,)`` (int64):

- ``cifar10``: :class:`torchvision.datasets.CIFAR10` read from ``data_dir`` (``download=True`` fetches it),
  3×32×32, normalised with the customary training-set statistics
  :math:`\mu = (0.4914, 0.4822, 0.4465)`, :math:`\sigma = (0.2470, 0.2435, 0.2616)`;
- ``fashion-mnist``: :class:`torchvision.datasets.FashionMNIST` read from ``data_dir``, into whose layout the
  IDX files of Debian's ``dataset-fashion-mnist`` package are linked (:func:`prepare_fashion_mnist`),
  1×28×28, :math:`\mu = 0.2860`, :math:`\sigma = 0.3530`;
- ``digits``: :func:`sklearn.datasets.load_digits` (1,797 images, 8×8, values 0..16), upsampled 2×
  (nearest) to 1×16×16 so that 4×4 patches fit, normalised with the mean and std of its training split.

CIFAR-10 and Fashion-MNIST keep their official train/test split; files that do not hold them (a batch cut short,
images and labels of different numbers, a label outside the 10 classes, an empty split, a test split that repeats
training images) are refused with :class:`DatasetFormatError` (:func:`check_splits`). The digits have none: a fixed, stratified
split (seed 0, not the run's seed) keeps 500 images for testing.

``train_size`` subsamples the training set to ``N`` images, uniformly at random from a generator seeded by
the run's seed only (:func:`subsample`): both arms of a pair see the same images, different seeds see
different ones. Augmentation (random crop with 4 pixels of zero padding in normalised units, horizontal flip)
is a batch transform for :class:`~.batches.MiniBatches`, off by default.

torchvision and scikit-learn are imported inside the functions that use them.
"""

from __future__ import annotations

import functools
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch

from ..harness.batches import derived_generator

__all__ = ["DATASETS", "DEBIAN_FASHION_MNIST_DIR", "VisionData", "load_vision", "subsample", "random_crop_flip",
           "prepare_fashion_mnist", "DatasetNotFoundError", "DatasetFormatError", "check_splits",
           "STREAM_SUBSAMPLE"]

#: The accepted values of ``dataset`` (with the spellings accepted on the command line).
DATASETS = ("cifar10", "fashion-mnist", "digits")
_ALIASES = {"cifar10": "cifar10", "cifar-10": "cifar10", "cifar": "cifar10", "fashion-mnist": "fashion-mnist",
            "fashion_mnist": "fashion-mnist", "fashionmnist": "fashion-mnist", "fmnist": "fashion-mnist",
            "digits": "digits", "sklearn-digits": "digits"}

#: Where Debian's ``dataset-fashion-mnist`` package puts the four gzipped IDX files.
DEBIAN_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")

#: Key of the training-subsample stream (0: batch order, 1: train/validation split; see ``batches``).
STREAM_SUBSAMPLE = 2

_FASHION_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                  "t10k-labels-idx1-ubyte")

#: Per-channel (mean, std) of the pixels scaled to [0, 1] (training-set statistics, as customary).
NORMALISATION = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
}

#: Human-readable names for reports.
DISPLAY_NAMES = {"cifar10": "CIFAR-10", "fashion-mnist": "Fashion-MNIST", "digits": "scikit-learn digits (8×8)"}

DIGITS_TEST_SIZE = 500


class DatasetNotFoundError(FileNotFoundError):
    """The data set's files are not under ``data_dir`` and downloading was not asked for (or failed)."""


class DatasetFormatError(ValueError):
    """The data set's files are there but do not hold the data set: a file cut short or not in the format, a split
    whose images and labels differ in number, an empty split, a label outside ``0..num_classes-1``, or a test split
    that repeats the training images (:func:`check_splits`). The command line prints it as one line (exit 2)."""


#: Largest share of the test images that may equal a training image pixel for pixel before the files are refused as
#: a test split that leaks the training set (the official splits share only a few: for CIFAR-10, duplicates near
#: or exact make up about 3% of the test set, Barz & Denzler 2020).
MAX_SHARED_TEST_FRACTION = 0.05


def check_splits(dataset: str, where: str | os.PathLike, train: tuple, test: tuple, num_classes: int) -> None:
    """Refuse files that would train or test on something other than the data set, before anything is trained.

    ``train`` and ``test`` are ``(images, labels)``: images ``(N, ...)`` uint8 as read, labels ``(N,)``. Checks
    that each split is non-empty, has one label per image, every label in ``0..num_classes-1``, and that no more
    than :data:`MAX_SHARED_TEST_FRACTION` of the test images equal a training image (a test batch copied from a
    training batch would report training accuracy as test accuracy).

    Raises
    ------
    DatasetFormatError
        One sentence naming the split, the files (``where``) and what to do.
    """
    name = DISPLAY_NAMES[dataset]
    fix = f"replace the files under {where} with an intact copy of {name} (--data-dir; or fetch it with --download)"
    for split, (images, labels) in (("training", train), ("test", test)):
        labels = torch.as_tensor(labels)
        if len(images) == 0:
            raise DatasetFormatError(f"{name} at {where}: the {split} split is empty; {fix}.")
        if len(images) != len(labels):
            raise DatasetFormatError(f"{name} at {where}: the {split} split has {len(images)} images but "
                                     f"{len(labels)} labels (a file of another size or format); {fix}.")
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= num_classes:
            raise DatasetFormatError(f"{name} at {where}: the {split} split has labels in {low}..{high}, outside "
                                     f"0..{num_classes - 1}; {fix}.")
    seen = {bytes(memoryview(row)) for row in torch.as_tensor(train[0]).reshape(len(train[0]), -1).numpy()}
    test_rows = torch.as_tensor(test[0]).reshape(len(test[0]), -1).numpy()
    shared = sum(bytes(memoryview(row)) in seen for row in test_rows)
    if shared > MAX_SHARED_TEST_FRACTION * len(test_rows):
        raise DatasetFormatError(f"{name} at {where}: {shared} of the {len(test_rows)} test images equal a "
                                 f"training image pixel for pixel (the test split repeats the training set, so "
                                 f"test accuracy would be training accuracy); {fix}.")


@dataclass(frozen=True)
class VisionData:
    """A data set held in memory, normalised.

    Attributes
    ----------
    name : str
        ``"cifar10"``, ``"fashion-mnist"`` or ``"digits"``.
    train_inputs, test_inputs : torch.Tensor
        ``(N, C, S, S)`` float32, normalised.
    train_targets, test_targets : torch.Tensor
        ``(N,)`` int64 class indices.
    num_classes : int
    mean, std : tuple of float
        The per-channel normalisation that was applied (pixels scaled to [0, 1] first).
    source : str
        Where the files came from (for reports).
    """

    name: str
    train_inputs: torch.Tensor
    train_targets: torch.Tensor
    test_inputs: torch.Tensor
    test_targets: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    source: str

    @property
    def display_name(self) -> str:
        return DISPLAY_NAMES[self.name]

    @property
    def in_channels(self) -> int:
        return int(self.train_inputs.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.train_inputs.shape[-1])


def canonical_dataset(name: str) -> str:
    """``cifar10``, ``fashion-mnist`` or ``digits`` for any accepted spelling; ``ValueError`` otherwise."""
    key = str(name).lower()
    if key not in _ALIASES:
        raise ValueError(f"dataset={name!r} is unknown; use one of {', '.join(DATASETS)} (--dataset).")
    return _ALIASES[key]


def _normalise(images_u8: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """``(N, C, S, S)`` uint8 -> float32 ``(x/255 - mean)/std`` per channel."""
    x = images_u8.to(torch.float32).div_(255.0)
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return x.sub_(m).div_(s)


def _missing(dataset: str, data_dir: Path, detail: str) -> DatasetNotFoundError:
    return DatasetNotFoundError(
        f"{DISPLAY_NAMES[dataset]} was not found under --data-dir {data_dir} ({detail}). Point --data-dir at the "
        f"folder that holds it, or add --download to fetch it there (needs internet access).")


# ---------------------------------------------------------------------------------------------- CIFAR-10
def _load_cifar10(data_dir: Path, download: bool) -> VisionData:
    from torchvision.datasets import CIFAR10

    folder = data_dir / CIFAR10.base_folder
    if not download and not folder.is_dir():
        raise _missing("cifar10", data_dir, f"no folder {CIFAR10.base_folder}/")
    try:
        train = CIFAR10(str(data_dir), train=True, download=download)
        test = CIFAR10(str(data_dir), train=False, download=download)
    except RuntimeError as err:  # torchvision: "Dataset not found or corrupted"
        raise _missing("cifar10", data_dir, f"torchvision says: {err}") from err
    except OSError as err:  # no network
        raise _missing("cifar10", data_dir, f"download failed: {err}") from err
    except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError, AttributeError) as err:
        raise DatasetFormatError(  # a batch cut short, or not a pickle of the batch dict
            f"CIFAR-10 at {folder}: a file there is not a CIFAR-10 python batch ({type(err).__name__}: {err}); "
            f"replace data_batch_1..5, test_batch and batches.meta under --data-dir {data_dir} with an intact "
            f"copy (or fetch it with --download).") from None
    if len(train.classes) != 10:
        raise DatasetFormatError(f"CIFAR-10 at {folder}: batches.meta names {len(train.classes)} classes, not 10; "
                                 f"replace the files under --data-dir {data_dir} with an intact copy of CIFAR-10.")
    check_splits("cifar10", folder, (train.data, train.targets), (test.data, test.targets), 10)
    mean, std = NORMALISATION["cifar10"]

    def tensors(ds):
        images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()  # (N, 32, 32, 3) -> (N, 3, 32, 32)
        return _normalise(images, mean, std), torch.as_tensor(ds.targets, dtype=torch.int64)

    xtr, ytr = tensors(train)
    xte, yte = tensors(test)
    return VisionData("cifar10", xtr, ytr, xte, yte, 10, mean, std, source=f"torchvision CIFAR10 at {folder}")


# ---------------------------------------------------------------------------------------------- Fashion-MNIST
def prepare_fashion_mnist(data_dir: str | os.PathLike, source: str | os.PathLike | None = None) -> Path | None:
    r"""Arrange Fashion-MNIST's IDX files in the layout :class:`torchvision.datasets.FashionMNIST` reads.

    torchvision reads ``data_dir/FashionMNIST/raw/<name>`` (uncompressed). For each of the four files that is
    missing there, the gzipped ``<name>.gz`` is taken from ``raw/`` itself or, failing that, from ``source``
    (default: Debian's :data:`DEBIAN_FASHION_MNIST_DIR`) by a symbolic link, and decompressed next to it with
    torchvision's own :func:`torchvision.datasets.utils.extract_archive`. Nothing is parsed here.

    Returns
    -------
    Path or None
        The ``raw`` folder when all four files are in place afterwards, else ``None``.
    """
    from torchvision.datasets.utils import extract_archive

    source = DEBIAN_FASHION_MNIST_DIR if source is None else Path(source)
    raw = Path(data_dir) / "FashionMNIST" / "raw"
    for name in _FASHION_FILES:
        if (raw / name).is_file():
            continue
        gz = raw / f"{name}.gz"
        if not gz.exists() and (source / f"{name}.gz").is_file():
            raw.mkdir(parents=True, exist_ok=True)
            gz.symlink_to((source / f"{name}.gz").resolve())
        if gz.exists():
            extract_archive(str(gz), str(raw))
    return raw if all((raw / n).is_file() for n in _FASHION_FILES) else None


def _load_fashion_mnist(data_dir: Path, download: bool) -> VisionData:
    from torchvision.datasets import FashionMNIST

    raw = prepare_fashion_mnist(data_dir)
    if raw is None and not download:
        raise _missing("fashion-mnist", data_dir,
                       f"no FashionMNIST/raw/ files, and none at {DEBIAN_FASHION_MNIST_DIR}; on Debian/Ubuntu "
                       f"`apt-get install dataset-fashion-mnist` provides them")
    try:
        train = FashionMNIST(str(data_dir), train=True, download=download)
        test = FashionMNIST(str(data_dir), train=False, download=download)
    except RuntimeError as err:
        raise _missing("fashion-mnist", data_dir, f"torchvision says: {err}") from err
    check_splits("fashion-mnist", Path(data_dir) / "FashionMNIST" / "raw", (train.data, train.targets),
                 (test.data, test.targets), 10)
    mean, std = NORMALISATION["fashion-mnist"]
    xtr = _normalise(train.data.unsqueeze(1), mean, std)
    xte = _normalise(test.data.unsqueeze(1), mean, std)
    src = Path(data_dir) / "FashionMNIST" / "raw"
    links = [p for p in src.glob("*.gz") if p.is_symlink()]
    origin = f" (linked from {links[0].resolve().parent})" if links else ""
    return VisionData("fashion-mnist", xtr, train.targets.to(torch.int64), xte, test.targets.to(torch.int64), 10,
                      mean, std, source=f"torchvision FashionMNIST at {src}{origin}")


# ---------------------------------------------------------------------------------------------- digits
def _load_digits() -> VisionData:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = torch.as_tensor(bunch.images, dtype=torch.float32) / 16.0  # (1797, 8, 8) in [0, 1]
    targets = torch.as_tensor(bunch.target, dtype=torch.int64)
    idx_train, idx_test = train_test_split(torch.arange(len(targets)).numpy(), test_size=DIGITS_TEST_SIZE,
                                           random_state=0, stratify=bunch.target)
    up = torch.nn.functional.interpolate(images.unsqueeze(1), scale_factor=2, mode="nearest")  # (N, 1, 16, 16)
    xtr, xte = up[torch.as_tensor(idx_train)], up[torch.as_tensor(idx_test)]
    mean, std = float(xtr.mean()), float(xtr.std())
    return VisionData("digits", (xtr - mean) / std, targets[torch.as_tensor(idx_train)], (xte - mean) / std,
                      targets[torch.as_tensor(idx_test)], 10, (mean,), (std,),
                      source="sklearn.datasets.load_digits (bundled with scikit-learn), upsampled 2x (nearest)")


# ---------------------------------------------------------------------------------------------- public API
@functools.lru_cache(maxsize=4)
def _load_cached(dataset: str, data_dir: str, download: bool) -> VisionData:
    if dataset == "digits":
        return _load_digits()
    path = Path(data_dir).expanduser()
    if dataset == "cifar10":
        return _load_cifar10(path, download)
    return _load_fashion_mnist(path, download)


def load_vision(dataset: str, data_dir: str | os.PathLike = "data", *, download: bool = False) -> VisionData:
    """Load a data set into memory, normalised (cached per process: repeated calls return the same tensors).

    Parameters
    ----------
    dataset : {"cifar10", "fashion-mnist", "digits"}
        Which data set (``--dataset``).
    data_dir : path, default "data"
        Folder that holds (or receives) the files (``--data-dir``); unused for ``digits``.
    download : bool, default False
        Let torchvision fetch missing files (``--download``; needs internet access).

    Raises
    ------
    DatasetNotFoundError
        When the files are absent and ``download`` is off (or the download failed); the message names
        ``--data-dir`` and ``--download``.
    """
    return _load_cached(canonical_dataset(dataset), str(data_dir), bool(download))


def subsample(n_total: int, train_size: int | None, seed: int) -> torch.Tensor | None:
    r"""Indices of a training subsample of ``train_size`` out of ``n_total`` images, or ``None`` for all.

    The indices are the first ``train_size`` entries of a uniformly random permutation drawn from
    :func:`~.batches.derived_generator` ``(STREAM_SUBSAMPLE, seed)``, sorted: a function of ``seed`` alone, and
    the subsamples of one seed are nested (the 1,000 images of a seed are among its 5,000).
    """
    if train_size is None or train_size == n_total:
        return None
    if not (isinstance(train_size, int) and 0 < train_size <= n_total):
        raise ValueError(f"train_size={train_size!r} must be an int in [1, {n_total}] (the training set has "
                         f"{n_total} images), or None for all of them (--train-size).")
    perm = torch.randperm(n_total, generator=derived_generator(STREAM_SUBSAMPLE, int(seed)))
    return perm[:train_size].sort().values


def random_crop_flip(images: torch.Tensor, generator: torch.Generator, *, padding: int = 4,
                     flip: bool = True) -> torch.Tensor:
    r"""Random crop after zero padding, and a random horizontal flip, per image of a batch.

    Each image is padded by ``padding`` pixels of 0 (the mean, in normalised units) on every side and a window of
    the original size is cut at an offset drawn uniformly from :math:`\{0, \dots, 2\,\text{padding}\}^2`; with
    ``flip`` it is mirrored left-right with probability 1/2. All randomness comes from ``generator`` (the
    epoch's generator of :class:`~.batches.MiniBatches`), so a run and its resumption see the same batches.

    Parameters
    ----------
    images : torch.Tensor
        ``(B, C, S, S)``.
    generator : torch.Generator
        A CPU generator.
    """
    b, c, h, w = images.shape
    dev = images.device
    dy = torch.randint(0, 2 * padding + 1, (b,), generator=generator).to(dev)
    dx = torch.randint(0, 2 * padding + 1, (b,), generator=generator).to(dev)
    padded = torch.nn.functional.pad(images, (padding, padding, padding, padding))
    rows = (dy.view(b, 1) + torch.arange(h, device=dev).view(1, h))  # (B, H)
    cols = (dx.view(b, 1) + torch.arange(w, device=dev).view(1, w))  # (B, W)
    if flip:
        mirror = (torch.rand(b, generator=generator) < 0.5).to(dev)
        cols = torch.where(mirror.view(b, 1), cols.flip(1), cols)
    out = padded.gather(2, rows.view(b, 1, h, 1).expand(b, c, h, w + 2 * padding))
    return out.gather(3, cols.view(b, 1, 1, w).expand(b, c, h, w))
