"""Tests of the vision study: data loaders (fake CIFAR-10 batches in the real pickle format, fake and real
Fashion-MNIST IDX files through torchvision, scikit-learn digits), subsampling and augmentation, the
paired statistics (against scipy and against published numbers), the ablation arms and their update, the
per-step movement hook, and smoke runs of every study on the digits with tiny budgets.
"""

from __future__ import annotations

import gzip
import json
import math
import pickle
import struct

import numpy as np
import pytest
import scipy.stats
import torch
from conftest import F64

from experiments.harness import ARMS, OptimConfig, RunSpec, TrainConfig, train_run
from experiments.harness.ablation_arms import (
    FrameScalarAdam,
    build_framescalar_euclidean,
)
from experiments.harness.stats import mean_ci, paired_stats
from experiments.vision.data import (
    DEBIAN_FASHION_MNIST_DIR,
    DatasetFormatError,
    DatasetNotFoundError,
    load_vision,
    prepare_fashion_mnist,
    random_crop_flip,
    subsample,
)
from experiments.vision.study import (
    STUDY_ARMS,
    StepMovement,
    VisionConfig,
    build_task,
    run_vision,
    study_cells,
    warmup_cosine,
)
from geoopt_stiefel_attention import stiefel_adam_update
from geoopt_stiefel_attention.manifolds import is_frame

#: agreement with scipy's t-test / distributions (same formulas, different code paths)
SCIPY_TOL = 1e-12
#: agreement with numbers published to 4-5 significant digits (R's `t.test` on the sleep data)
PUBLISHED_TOL = 5e-5
#: float64 agreement of the frame-scalar update with its written-out reference
UPDATE_TOL = 1e-12
#: float32 agreement of normalised pixels with the written-out normalisation
PIXEL_TOL = 1e-6
#: float32 agreement of the movement hook with hand-computed step norms
MOVE_TOL = 1e-5

TINY = dict(width=8, depth=1, heads=2, mlp=16, batch_size=64, train_size=192, eval_train_size=64)


# ------------------------------------------------------------------------------------------ statistics
# Student's sleep data (Cushny and Peebles 1905), as in R's `datasets::sleep`: extra hours of sleep of 10
# patients under two drugs. R: t.test(extra ~ group, data = sleep, paired = TRUE) gives t = -4.0621,
# df = 9, p-value = 0.002833, 95% CI (-2.4598858, -0.7001142), mean difference -1.58.
SLEEP_1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
SLEEP_2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]


def test_paired_stats_matches_published_sleep_numbers():
    s = paired_stats(SLEEP_1, SLEEP_2)
    assert s.n == 10 and s.df == 9
    assert s.mean == pytest.approx(-1.58, abs=1e-12)
    assert s.t == pytest.approx(-4.0621, abs=PUBLISHED_TOL * 10)
    assert s.p_value == pytest.approx(0.002833, abs=PUBLISHED_TOL)
    assert s.ci_low == pytest.approx(-2.4598858, abs=1e-6)
    assert s.ci_high == pytest.approx(-0.7001142, abs=1e-6)
    assert (s.n_positive, s.n_negative, s.n_zero) == (0, 9, 1)


def test_paired_stats_matches_scipy():
    rng = np.random.default_rng(3)
    a = rng.normal(0.7, 0.05, size=12)
    b = a - rng.normal(0.02, 0.01, size=12)
    s = paired_stats(a, b)
    ref = scipy.stats.ttest_rel(a, b)
    ci = ref.confidence_interval(0.95)
    assert s.t == pytest.approx(float(ref.statistic), rel=SCIPY_TOL)
    assert s.p_value == pytest.approx(float(ref.pvalue), rel=1e-9)
    assert s.ci_low == pytest.approx(float(ci.low), rel=SCIPY_TOL)
    assert s.ci_high == pytest.approx(float(ci.high), rel=SCIPY_TOL)
    d = a - b
    assert s.std == pytest.approx(float(np.std(d, ddof=1)), rel=SCIPY_TOL)
    pos = int((d > 0).sum())
    assert s.sign_test_p == pytest.approx(scipy.stats.binomtest(pos, 12).pvalue, rel=SCIPY_TOL)


def test_paired_stats_sign_test_and_edge_cases():
    # 12 of 12 positive: two-sided sign-test p = 2 / 2^12
    s = paired_stats([1.0 + 0.1 * i for i in range(12)], [0.0] * 12)
    assert s.n_positive == 12 and s.sign_test_p == pytest.approx(2.0 / 4096, rel=SCIPY_TOL)
    # swapping the arms flips the statistic and keeps the p-value
    r = paired_stats([0.0] * 12, [1.0 + 0.1 * i for i in range(12)])
    assert r.t == pytest.approx(-s.t) and r.p_value == pytest.approx(s.p_value)
    # zero spread: t undefined, interval degenerate
    z = paired_stats([1.0, 2.0, 3.0], [0.0, 1.0, 2.0])
    assert z.t is None and z.p_value is None and z.ci_low == z.ci_high == pytest.approx(1.0)
    one = paired_stats([1.0], [0.5])
    assert one.t is None and one.ci_low is None and one.mean == pytest.approx(0.5)
    with pytest.raises(ValueError, match="one value per pair"):
        paired_stats([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="non-finite"):
        paired_stats([1.0, float("nan")], [1.0, 2.0])
    m, lo, hi = mean_ci([1.0, 2.0, 3.0])
    assert m == pytest.approx(2.0) and lo < 2.0 < hi


def test_paired_stats_is_not_the_unpaired_test():
    """Pairing matters: with a large between-seed spread and a small consistent gap, the paired t is large and
    the two-sample t small (the property the paired design relies on, and the case where it must differ)."""
    base = np.array([0.5, 0.6, 0.7, 0.8, 0.9, 0.55, 0.65, 0.75])
    a = base + 0.01 + 0.001 * np.arange(8)
    s = paired_stats(a, base)
    unpaired = scipy.stats.ttest_ind(a, base)
    assert s.t > 10 and abs(float(unpaired.statistic)) < 1


# ------------------------------------------------------------------------------------------ data
CIFAR_LABELS = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _write_cifar(root, n_per_batch=4):
    """Fake CIFAR-10 in the real format: python pickles of dicts with 'data' (N, 3072) uint8 rows (1024 red,
    1024 green, 1024 blue values, each 32x32 row-major) and 'labels', plus batches.meta."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    batches = {}
    for k, name in enumerate(names):
        data = rng.integers(0, 256, size=(n_per_batch, 3072), dtype=np.uint8)
        labels = [(k + j) % 10 for j in range(n_per_batch)]
        entry = {"batch_label": f"fake batch {k}", "labels": labels, "data": data,
                 "filenames": [f"img_{k}_{j}.png" for j in range(n_per_batch)]}
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f)
        batches[name] = entry
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": CIFAR_LABELS, "num_cases_per_batch": n_per_batch, "num_vis": 3072}, f)
    return batches


@pytest.fixture
def fake_cifar(tmp_path, monkeypatch):
    """Fake batches under tmp_path; torchvision's CIFAR10 checks md5 sums of the real files, so the expected
    sums are set to None (existence only), leaving the rest of its loading path as it is."""
    from torchvision.datasets import CIFAR10

    batches = _write_cifar(tmp_path)
    monkeypatch.setattr(CIFAR10, "train_list", [[n, None] for n, _ in CIFAR10.train_list])
    monkeypatch.setattr(CIFAR10, "test_list", [[n, None] for n, _ in CIFAR10.test_list])
    monkeypatch.setattr(CIFAR10, "meta", {**CIFAR10.meta, "md5": None})
    return tmp_path, batches


def test_fake_cifar10_loads_through_torchvision(fake_cifar):
    root, batches = fake_cifar
    data = load_vision("cifar10", root)
    assert data.train_inputs.shape == (20, 3, 32, 32) and data.test_inputs.shape == (4, 3, 32, 32)
    assert data.train_inputs.dtype == torch.float32 and data.num_classes == 10 and data.in_channels == 3
    labels = [lab for i in range(1, 6) for lab in batches[f"data_batch_{i}"]["labels"]]
    assert data.train_targets.tolist() == labels
    assert data.test_targets.tolist() == batches["test_batch"]["labels"]
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    # image 5 = batch 2, row 1; green channel, pixel (row 2, column 5) sits at 1024 + 2 * 32 + 5
    raw = int(batches["data_batch_2"]["data"][1, 1024 + 2 * 32 + 5])
    assert float(data.train_inputs[5, 1, 2, 5]) == pytest.approx((raw / 255 - mean[1]) / std[1], abs=PIXEL_TOL)
    raw = int(batches["test_batch"]["data"][3, 2 * 1024 + 31 * 32 + 0])  # blue, bottom-left pixel
    assert float(data.test_inputs[3, 2, 31, 0]) == pytest.approx((raw / 255 - mean[2]) / std[2], abs=PIXEL_TOL)


def test_fake_cifar10_trains_one_run(fake_cifar, tmp_path):
    root, _ = fake_cifar
    cfg = VisionConfig(dataset="cifar10", **{**TINY, "train_size": 16, "batch_size": 8},
                       train=TrainConfig(epochs=1, eval_every=1))
    import functools

    res = train_run(RunSpec(cfg, "stiefel", 0), functools.partial(build_task, data_dir=str(root)),
                    tmp_path / "run", quiet=True, device="cpu")
    assert res.completed and res.final_record["step"] == 2 and 0.0 <= res.final_record["test_acc"] <= 1.0


def _rewrite_batch(root, name, **changes):
    """Replace entries of one fake CIFAR-10 pickle (``data``, ``labels``, ``label_names``)."""
    path = root / "cifar-10-batches-py" / name
    with open(path, "rb") as f:
        entry = pickle.load(f)
    entry.update(changes)
    with open(path, "wb") as f:
        pickle.dump(entry, f)


def _corrupt_cifar(root, batches, defect):
    if defect == "rows of 1024 values":  # one grey channel per row: reshaped into a third as many colour images
        for i in range(1, 6):
            _rewrite_batch(root, f"data_batch_{i}", data=np.zeros((12, 1024), np.uint8), labels=[0] * 12)
    elif defect == "rows of 6144 values":  # two images per row: twice as many images as labels
        _rewrite_batch(root, "test_batch", data=np.zeros((4, 6144), np.uint8))
    elif defect == "a label missing":
        _rewrite_batch(root, "data_batch_5", labels=batches["data_batch_5"]["labels"][:-1])
    elif defect == "label -1":
        _rewrite_batch(root, "data_batch_1", labels=[-1, 0, 1, 2])
    elif defect == "label 10":
        _rewrite_batch(root, "test_batch", labels=[10, 0, 1, 2])
    elif defect == "empty test split":
        _rewrite_batch(root, "test_batch", data=np.zeros((0, 3072), np.uint8), labels=[])
    elif defect == "test batch = a training batch":
        _rewrite_batch(root, "test_batch", data=batches["data_batch_3"]["data"], labels=batches["data_batch_3"]["labels"])
    elif defect == "batches.meta of 100 classes":
        _rewrite_batch(root, "batches.meta", label_names=[f"class{i}" for i in range(100)])
    elif defect == "a batch cut short":
        path = root / "cifar-10-batches-py" / "data_batch_4"
        path.write_bytes(path.read_bytes()[:5000])
    else:
        raise AssertionError(defect)


CIFAR_DEFECTS = {"rows of 1024 values": "images but", "rows of 6144 values": "images but",
                 "a label missing": "images but", "label -1": "outside 0..9", "label 10": "outside 0..9",
                 "empty test split": "test split is empty", "test batch = a training batch": "equal a training image",
                 "batches.meta of 100 classes": "100 classes", "a batch cut short": "not a CIFAR-10 python batch"}


@pytest.mark.parametrize("defect", list(CIFAR_DEFECTS))
def test_cifar10_files_that_do_not_hold_cifar10_are_refused(fake_cifar, defect):
    # each loaded before without a word: images and labels of different numbers (misaligned by the batcher),
    # labels outside the 10 classes, no test images, a test split equal to training images (test accuracy =
    # training accuracy), another data set's meta; a batch cut short raised a bare UnpicklingError
    root, batches = fake_cifar
    _corrupt_cifar(root, batches, defect)
    with pytest.raises(DatasetFormatError, match=CIFAR_DEFECTS[defect]) as info:
        load_vision("cifar10", root)
    assert "cifar-10-batches-py" in str(info.value) and "intact copy" in str(info.value)


def test_cifar10_with_a_few_test_images_also_in_training_loads(fake_cifar):
    # companion: the official splits share a few images pixel for pixel; 1 of 100 is not a leaked split
    root, batches = fake_cifar
    rng = np.random.default_rng(5)
    test = rng.integers(0, 256, size=(100, 3072), dtype=np.uint8)
    test[7] = batches["data_batch_1"]["data"][2]
    _rewrite_batch(root, "test_batch", data=test, labels=[i % 10 for i in range(100)])
    data = load_vision("cifar10", root)
    assert data.test_inputs.shape == (100, 3, 32, 32) and data.test_targets.tolist()[:3] == [0, 1, 2]


def test_cli_names_corrupt_cifar10_in_one_line(fake_cifar, tmp_path, capsys):
    from experiments.cli import main

    root, batches = fake_cifar
    _corrupt_cifar(root, batches, "test batch = a training batch")
    out = tmp_path / "out"
    assert main(["vision", "--dataset", "cifar10", "--data-dir", str(root), "--out", str(out), "--quiet",
                 "--epochs", "1", "--seeds", "0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "equal a training image" in err and not out.exists()


def test_missing_cifar_names_both_flags(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="--data-dir") as info:
        load_vision("cifar10", tmp_path / "nothing")
    assert "--download" in str(info.value)
    with pytest.raises(ValueError, match="unknown"):
        load_vision("imagenet", tmp_path)


def _idx(path, array: np.ndarray) -> None:
    """Write ``array`` (uint8) as a gzipped IDX file: magic (0, 0, 0x08 = ubyte, ndim), big-endian dims, data."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_layout_from_gzipped_idx(tmp_path):
    src = tmp_path / "debian"
    src.mkdir()
    rng = np.random.default_rng(1)
    images = {"train": rng.integers(0, 256, (7, 28, 28)), "t10k": rng.integers(0, 256, (3, 28, 28))}
    labels = {"train": rng.integers(0, 10, 7), "t10k": rng.integers(0, 10, 3)}
    for split in ("train", "t10k"):
        _idx(src / f"{split}-images-idx3-ubyte.gz", images[split])
        _idx(src / f"{split}-labels-idx1-ubyte.gz", labels[split])
    data_dir = tmp_path / "data"
    assert prepare_fashion_mnist(data_dir, source=tmp_path / "empty") is None  # nothing to link: refused
    raw = prepare_fashion_mnist(data_dir, source=src)
    assert raw == data_dir / "FashionMNIST" / "raw"
    assert (raw / "train-images-idx3-ubyte.gz").is_symlink()
    data = load_vision("fashion-mnist", data_dir)
    assert data.train_inputs.shape == (7, 1, 28, 28) and data.test_inputs.shape == (3, 1, 28, 28)
    assert data.train_targets.tolist() == labels["train"].tolist()
    want = (images["t10k"][2, 13, 4] / 255 - 0.2860) / 0.3530
    assert float(data.test_inputs[2, 0, 13, 4]) == pytest.approx(want, abs=PIXEL_TOL)


def test_fashion_mnist_with_a_label_outside_the_classes_or_a_leaked_test_split_is_refused(tmp_path):
    rng = np.random.default_rng(2)
    images = rng.integers(0, 256, (7, 28, 28))
    for name, test_images, test_labels, match in (("labels", rng.integers(0, 256, (3, 28, 28)), [1, 12, 3],
                                                   "labels in 1..12, outside 0..9"),
                                                  ("leak", images[:3], [1, 2, 3], "3 of the 3 test images")):
        src = tmp_path / name / "src"
        src.mkdir(parents=True)
        _idx(src / "train-images-idx3-ubyte.gz", images)
        _idx(src / "train-labels-idx1-ubyte.gz", rng.integers(0, 10, 7))
        _idx(src / "t10k-images-idx3-ubyte.gz", test_images)
        _idx(src / "t10k-labels-idx1-ubyte.gz", np.array(test_labels))
        prepare_fashion_mnist(tmp_path / name / "data", source=src)
        with pytest.raises(DatasetFormatError, match=match):
            load_vision("fashion-mnist", tmp_path / name / "data")


@pytest.mark.skipif(not (DEBIAN_FASHION_MNIST_DIR / "t10k-labels-idx1-ubyte.gz").exists(),
                    reason="Debian's dataset-fashion-mnist is not installed")
def test_real_fashion_mnist_from_debian_package(tmp_path):
    data = load_vision("fashion-mnist", tmp_path)
    assert data.train_inputs.shape == (60000, 1, 28, 28) and data.test_inputs.shape == (10000, 1, 28, 28)
    assert torch.bincount(data.test_targets).tolist() == [1000] * 10
    # normalised with the training set's customary statistics: mean ~0, std ~1
    assert abs(float(data.train_inputs.mean())) < 1e-2 and abs(float(data.train_inputs.std()) - 1) < 1e-2


def test_digits_split_and_shape():
    data = load_vision("digits")
    assert data.train_inputs.shape == (1297, 1, 16, 16) and data.test_inputs.shape == (500, 1, 16, 16)
    # nearest 2x upsampling: every 2x2 block is constant
    x = data.train_inputs[:5, 0]
    assert torch.equal(x[:, 0::2, 0::2], x[:, 1::2, 1::2]) and torch.equal(x[:, 0::2, :], x[:, 1::2, :])
    assert sorted(torch.bincount(data.test_targets).tolist())[0] >= 45  # stratified


def test_subsample_is_a_function_of_the_seed():
    a, b = subsample(1000, 50, 3), subsample(1000, 50, 3)
    assert torch.equal(a, b) and a.unique().numel() == 50
    assert not torch.equal(a, subsample(1000, 50, 4))  # another seed, other images
    assert set(subsample(1000, 20, 3).tolist()) <= set(a.tolist())  # nested in the seed's larger subsample
    assert subsample(1000, None, 3) is None and subsample(1000, 1000, 3) is None
    with pytest.raises(ValueError, match="train_size"):
        subsample(1000, 1001, 0)


def test_random_crop_flip_against_slicing_reference():
    x = torch.randn(6, 2, 5, 5)
    out = random_crop_flip(x, torch.Generator().manual_seed(7), padding=2)
    g = torch.Generator().manual_seed(7)  # the same draws, in the same order
    dy, dx = torch.randint(0, 5, (6,), generator=g), torch.randint(0, 5, (6,), generator=g)
    flip = torch.rand(6, generator=g) < 0.5
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(6):
        ref = padded[i, :, dy[i]:dy[i] + 5, dx[i]:dx[i] + 5]
        ref = ref.flip(-1) if flip[i] else ref
        assert torch.equal(out[i], ref)
    assert torch.equal(random_crop_flip(x, torch.Generator().manual_seed(1), padding=0, flip=False), x)
    assert not torch.equal(random_crop_flip(x, torch.Generator().manual_seed(8), padding=2), out)


def test_warmup_cosine():
    assert warmup_cosine(0, total=100, warmup=10) == pytest.approx(0.1)
    assert warmup_cosine(9, total=100, warmup=10) == pytest.approx(1.0)
    assert warmup_cosine(10, total=100, warmup=10) == pytest.approx(1.0)
    assert warmup_cosine(55, total=100, warmup=10) == pytest.approx(0.5)
    assert warmup_cosine(100, total=100, warmup=10) == pytest.approx(0.0, abs=1e-12)


# ------------------------------------------------------------------------------------------ arms
def _reference_frame_scalar(w, grads, *, lr, b1, b2, eps, delta):
    """Written-out loop over steps and heads, in float64."""
    w = w.clone()
    m = torch.zeros_like(w)
    v = torch.zeros(w.shape[0], dtype=F64)
    for t, g in enumerate(grads, start=1):
        for h in range(w.shape[0]):
            m[h] = b1 * m[h] + (1 - b1) * g[h]
            v[h] = b2 * v[h] + (1 - b2) * float((g[h] ** 2).sum())
            s = lr * (m[h] / (1 - b1 ** t)) / (math.sqrt(v[h] / (1 - b2 ** t)) + eps)
            norm = float(torch.linalg.norm(s))
            if norm > delta:
                s = s * (delta / norm)
            w[h] = w[h] - s
    return w


def test_frame_scalar_adam_matches_reference():
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(3, 6, 2, dtype=F64, generator=gen)
    grads = [torch.randn(3, 6, 2, dtype=F64, generator=gen) * (10.0 ** k) for k in range(-2, 2)]
    p = torch.nn.Parameter(w0.clone())
    opt = FrameScalarAdam([p], lr=0.05, betas=(0.9, 0.99), eps=1e-8, trust_region=0.08)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    ref = _reference_frame_scalar(w0, grads, lr=0.05, b1=0.9, b2=0.99, eps=1e-8, delta=0.08)
    assert torch.allclose(p.detach(), ref, atol=UPDATE_TOL, rtol=0)
    assert opt.state[p]["exp_avg_sq"].shape == (3, 1, 1)


def _one_step(update, w, g):
    m, v = torch.zeros_like(w), torch.zeros(w.shape[:-2] + (1, 1), dtype=w.dtype)
    return update(w, g, m, v)[0] - w


def test_frame_scalar_step_is_scale_free_and_equivariant():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(2, 5, 3, dtype=F64, generator=gen)
    g = torch.randn(2, 5, 3, dtype=F64, generator=gen)
    q = torch.linalg.qr(torch.randn(5, 5, dtype=F64, generator=gen)).Q

    def fs(w, g, m, v):
        return stiefel_adam_update(w, g, m, v, step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=0.0,
                                   trust_region=None, constrained=False)

    s = _one_step(fs, w, g)
    assert torch.allclose(_one_step(fs, w, 1e3 * g), s, atol=UPDATE_TOL)  # scale-free
    assert torch.allclose(_one_step(fs, q @ w, q @ g), q @ s, atol=UPDATE_TOL)  # O(d)-equivariant

    # companion cases where each property must fail: element-wise Adam is not equivariant; plain momentum SGD
    # (the stiefel-sgd step) is not scale-free.
    def element(w, g, m, v):
        return w - 1e-2 * g / g.abs(), m, v

    e = _one_step(element, w, g)
    assert not torch.allclose(_one_step(element, q @ w, q @ g), q @ e, atol=1e-3)

    def sgd(w, g, m, v):
        return w - 1e-2 * g, m, v

    assert not torch.allclose(_one_step(sgd, w, 1e3 * g), _one_step(sgd, w, g), atol=1e-3)


def test_the_ablation_step_is_an_option_of_the_reference():
    """The ablation step is ``stiefel_adam_update(..., constrained=False)``, not a third copy: no projector, the
    decay applied, the step capped; companion: the constrained (Stiefel) step differs, and refuses a decay."""
    gen = torch.Generator().manual_seed(2)
    w, g = torch.randn(2, 5, 3, dtype=F64, generator=gen), torch.randn(2, 5, 3, dtype=F64, generator=gen)
    m, v = torch.randn(2, 5, 3, dtype=F64, generator=gen), torch.rand(2, 1, 1, dtype=F64, generator=gen)
    hyper = dict(step=3, lr=0.05, beta1=0.9, beta2=0.99, eps=1e-8, trust_region=0.08)
    new = stiefel_adam_update(w, g, m, v, constrained=False, weight_decay=0.3, **hyper)
    s = new[0] - (1.0 - 0.05 * 0.3) * w  # the decayed point minus the capped step
    assert float(s.flatten(-2).norm(dim=-1).max()) <= 0.08 + UPDATE_TOL
    w_frame = torch.linalg.qr(w).Q
    constrained = stiefel_adam_update(w_frame, g, m, v, **hyper)[0]
    unconstrained = stiefel_adam_update(w_frame, g, m, v, constrained=False, **hyper)[0]
    assert float((constrained - unconstrained).abs().max()) > 1e3 * UPDATE_TOL
    with pytest.raises(ValueError, match="weight_decay"):
        stiefel_adam_update(w_frame, g, m, v, weight_decay=0.3, **hyper)


def _tiny_vit(attention):
    from geoopt_stiefel_attention.models import PatchViT

    return PatchViT(image_size=8, patch_size=4, in_channels=1, num_classes=3, width=8, depth=1, heads=2, mlp=8,
                    attention=attention, seed=0)


@pytest.mark.parametrize("arm_name", ["stiefel-frozen", "stiefel-sgd", "stiefel-element", "framescalar-euclidean"])
def test_ablation_arms_train_what_they_claim(arm_name):
    from geoopt_stiefel_attention.nn import param_groups, query_key_projections

    arm = ARMS[arm_name]
    model = _tiny_vit(arm.attention)
    if arm.prepare is not None:
        arm.prepare(model)
    opt = arm.build(model, param_groups(model, 0.1), OptimConfig(lr=1e-2, weight_decay=0.1))
    (_, wq, _), = query_key_projections(model)
    before = wq.detach().clone()
    other = model.head.weight.detach().clone()
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 0])
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert not torch.equal(model.head.weight, other)  # the rest trains in every arm
    moved = not torch.equal(wq.detach(), before)
    assert moved == (arm_name != "stiefel-frozen")
    if arm.attention == "stiefel":
        assert is_frame(wq)
        eye = torch.eye(wq.shape[-1])
        assert torch.allclose(wq.detach().transpose(-1, -2) @ wq.detach(), eye, atol=1e-5)
    if arm_name in ("stiefel-sgd", "stiefel-element"):
        group = next(g for g in opt.param_groups if any(p is wq for p in g["params"]))
        assert group["second_moment"] == {"stiefel-sgd": None, "stiefel-element": "element"}[arm_name]
    if arm_name == "framescalar-euclidean":
        fs = opt.optimizers[0]
        assert isinstance(fs, FrameScalarAdam) and fs.param_groups[0]["weight_decay"] == 0.0
        assert {id(p) for p in fs.param_groups[0]["params"]} == {id(w) for _, a, b in query_key_projections(model)
                                                                 for w in (a, b)}


def test_ablation_arms_refuse_the_wrong_model():
    from geoopt_stiefel_attention.nn import param_groups

    with pytest.raises(ValueError, match="euclidean"):
        model = _tiny_vit("stiefel")
        build_framescalar_euclidean(model, param_groups(model, 0.0), OptimConfig())
    with pytest.raises(ValueError, match="no Stiefel frames"):
        ARMS["stiefel-frozen"].prepare(_tiny_vit("euclidean"))


# ------------------------------------------------------------------------------------------ movement hook
def test_step_movement_hook_matches_hand_computed_steps():
    from geoopt_stiefel_attention.nn import query_key_projections

    model = _tiny_vit("euclidean")
    hook = StepMovement(query_key_projections)
    hook.on_start(model)
    (_, wq, wk), = query_key_projections(model)
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 0])
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    snaps = [wq.detach().clone()]
    for _ in range(4):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        snaps.append(wq.detach().clone())
    # the hook sees a step at the next backward: 4 backward passes measure the first 3 steps
    out = hook.metrics(model)
    steps = [float((snaps[i + 1] - snaps[i]).square().sum()) for i in range(3)]
    assert out["move_steps"] == 3
    assert out["move_step_rms/q"] == pytest.approx(math.sqrt(sum(steps) / 3), rel=MOVE_TOL)
    assert out["move_step_rms/q"] != pytest.approx(math.sqrt(steps[-1]), rel=MOVE_TOL)  # not just the last step
    again = hook.metrics(model)  # the window restarts after each evaluation
    assert again["move_step_rms/q"] is None and again["move_steps"] == 0


# ------------------------------------------------------------------------------------------ studies
def test_config_validation_and_cells():
    with pytest.raises(ValueError, match="--patch-size"):
        VisionConfig(dataset="fashion-mnist", patch_size=5)
    with pytest.raises(ValueError, match="unknown"):
        VisionConfig(dataset="mnist")
    cfg = VisionConfig(dataset="digits", train_size=1000)
    cells = study_cells("scaling", cfg, train_sizes=(0.1, 0.5, 1.0))
    assert [c.config.train_size for c in cells] == [100, 500, 1000]
    cells = study_cells("decay", cfg, weight_decays=(0.5, 0.0))
    assert [c.config.optim.weight_decay for c in cells] == [0.0, 0.5] and cells[0].subdir == "wd-0"
    assert len(study_cells("paired", cfg)) == 1
    with pytest.raises(ValueError, match="--study"):
        study_cells("nope", cfg)


def _tiny_config(**kw):
    return VisionConfig(dataset="digits", **{**TINY, **kw}, train=TrainConfig(epochs=1, eval_every=1),
                        optim=OptimConfig(lr=3e-3, weight_decay=0.05))


@pytest.mark.parametrize("study", ["paired", "scaling", "movement", "frozen", "decay", "ablation"])
def test_every_study_runs_on_digits(study, tmp_path):
    kw = dict(train_sizes=(0.5, 1.0), weight_decays=(0.0, 0.5))
    out = run_vision(_tiny_config(), tmp_path, study=study, seeds=(0, 1), device="cpu", quiet=True, threads=1, **kw)
    results = out.results
    n_cells = 2 if study in ("scaling", "decay") else 1
    assert len(results) == n_cells * 2 * len(STUDY_ARMS[study]) and all(r.completed for r in results)
    report = (tmp_path / "report.md").read_text()
    assert "Dataset: scikit-learn digits" in report and "This is not CIFAR-10" in report
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["dataset"] == "digits" and len(saved["cells"]) == n_cells
    cell = saved["cells"][0]
    assert set(cell["arms"]) == set(STUDY_ARMS[study])
    comp = cell["comparisons"]["stiefel - adamw"]
    assert comp["n"] == 2 and len(comp["differences"]) == 2
    assert all((tmp_path / p).exists() for p in saved["figures"].values())
    if study in ("scaling", "decay"):
        assert any(p.startswith("gap_vs_") for p in saved["figures"].values())
    if study == "ablation":
        assert (tmp_path / "ablation.png").exists()
        assert {"stiefel - stiefel-sgd", "framescalar-euclidean - adamw"} <= set(cell["comparisons"])
    if study == "frozen":
        assert "stiefel - stiefel-frozen" in cell["comparisons"]
        assert cell["arms"]["stiefel-frozen"]["final_move_total_rel/q"]["max"] == 0.0
    if study in ("paired", "movement"):
        ratio = cell["movement"]["adamw / stiefel"]["ratio_q"]
        assert ratio["min"] > 1.0  # the frames move less per step than AdamW's W_Q


def test_pairs_share_initialisation_and_data(tmp_path):
    """Same seed: both arms start from the same weights (frames = polar factors) and see the same batches."""
    from experiments.harness.arms import get_arm

    cfg = _tiny_config()
    tasks = {a: build_task(RunSpec(cfg, a, 3), get_arm(a), torch.device("cpu")) for a in ("adamw", "stiefel")}
    e, s = tasks["adamw"], tasks["stiefel"]
    assert torch.equal(e.model.head.weight, s.model.head.weight)
    wq_e = e.model.blocks[0].attn.w_q.detach()
    u, _, vh = torch.linalg.svd(wq_e, full_matrices=False)
    assert torch.allclose(s.model.blocks[0].attn.w_q.detach(), u @ vh, atol=1e-5)
    (xe, ye), (xs, ys) = next(iter(e.train_data.batches(2))), next(iter(s.train_data.batches(2)))
    assert torch.equal(xe, xs) and torch.equal(ye, ys)
    other = build_task(RunSpec(cfg, "adamw", 4), get_arm("adamw"), torch.device("cpu"))
    assert not torch.equal(next(iter(other.train_data.batches(2)))[1], ye)  # another seed: other data


def test_bf16_autocast_predicts_float32_logits():
    from experiments.harness.arms import get_arm

    task = build_task(RunSpec(_tiny_config(amp="bf16"), "stiefel", 0), get_arm("stiefel"), torch.device("cpu"))
    x, y = next(iter(task.train_data.batches(0)))
    logits = task.predict(task.model, x)
    assert logits.dtype == torch.float32 and logits.shape == (x.shape[0], 10)
    assert not torch.equal(logits, task.model(x))  # the forward pass did run in bf16


def test_cli_vision_runs_and_reports(tmp_path, capsys):
    from experiments.cli import main

    out = tmp_path / "out"
    args = ["vision", "--dataset", "digits", "--seeds", "0", "1", "--epochs", "1", "--width", "8", "--heads", "2",
            "--depth", "1", "--mlp", "16", "--train-size", "128", "--eval-train-size", "64", "--out", str(out),
            "--quiet", "--device", "cpu", "--threads", "1"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "scikit-learn digits" in text and "stiefel - adamw" in text
    (out / "report.md").unlink()
    assert main([*args, "--skip-report"]) == 0  # everything is complete: nothing to train, no report
    assert not (out / "report.md").exists()
    assert main([*args, "--report-only"]) == 0
    assert (out / "report.md").exists()
    assert "ignoring" in capsys.readouterr().err  # the training flags repeated with --report-only are named
    assert main(["vision", "--dataset", "cifar10", "--data-dir", str(tmp_path / "none"), "--out", str(tmp_path / "c"),
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--data-dir" in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "c").exists()
