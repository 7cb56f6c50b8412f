"""Shared pytest fixtures, helpers and tolerances.

Test modules import the named tolerances and helpers from here (``from conftest import F64, ORTHO_TOL_F64``);
a tolerance used by one file only stays in that file, next to the measurement that sets it.
"""

import contextlib
import io
import math
import warnings

import geoopt
import pytest
import torch

from geoopt_stiefel_attention import PolarStiefel, TinyTransformer

#: The dtype of numerical checks.
F64 = torch.float64
#: max |W^T W - I| of a float64 frame (after construction, conversion or training)
ORTHO_TOL_F64 = 1e-12
#: max |W^T W - I| of a float32 frame after training
ORTHO_TOL_F32 = 1e-5
#: symmetry of U^T A for a float64 polar factor U of A
POLAR_SYM_TOL = 1e-12


class NoHostReads(torch.overrides.TorchFunctionMode):
    """Raise on any read of a tensor's value on the host (what a GPU step must never do), except inside
    :meth:`allowing`."""

    READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
             torch.Tensor.__index__, torch.Tensor.tolist, torch.Tensor.numpy}

    def __init__(self):
        super().__init__()
        self.allowed = 0

    @contextlib.contextmanager
    def allowing(self):
        """Host reads pass inside this block (code that is not under test, e.g. torch's CPU AdamW)."""
        self.allowed += 1
        try:
            yield
        finally:
            self.allowed -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS and not self.allowed:
            raise AssertionError(f"host read: {func.__name__}")
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------- conversion references (written out)
def polar64(a: torch.Tensor) -> torch.Tensor:
    """The polar factor ``U V^T`` of ``a = U S V^T``, by SVD in float64: the independent reference of a frame."""
    u, _, vh = torch.linalg.svd(a.double(), full_matrices=False)
    return u @ vh


def assert_polar_factor(u: torch.Tensor, a: torch.Tensor) -> None:
    """``u`` is the polar factor of ``a``: U^T U = I and U^T A symmetric positive definite (per frame)."""
    eye = torch.eye(u.shape[-1], dtype=u.dtype)
    assert (u.transpose(-1, -2) @ u - eye).abs().max() < ORTHO_TOL_F64
    m = u.transpose(-1, -2) @ a
    assert (m - m.transpose(-1, -2)).abs().max() < POLAR_SYM_TOL
    assert torch.linalg.eigvalsh(0.5 * (m + m.transpose(-1, -2))).min() > 0


def reloaded(opt, build):
    """A fresh optimizer from ``build()`` that loaded ``opt``'s state dict through ``torch.save``/``torch.load``
    (a checkpoint round trip)."""
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    fresh = build()
    fresh.load_state_dict(torch.load(buffer))
    return fresh


def shares_one_buffer(tensors: list[torch.Tensor]) -> bool:
    """Whether the tensors are dense and lie one after the other, in order, in one storage (written out from
    pointers and sizes; the tensors may differ in shape): the optimizers' state stacked per batch."""
    storage = tensors[0].untyped_storage().data_ptr()
    offset = tensors[0].data_ptr()
    for t in tensors:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage or t.data_ptr() != offset:
            return False
        offset += t.numel() * t.element_size()
    return True


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in the Frobenius norm."""
    return float((a - b).detach().norm() / b.detach().norm())


def state_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model.state_dict()``."""
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def unconverted_and_unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    """Whether ``model`` holds exactly the state ``before`` (:func:`state_snapshot`), no frame and no
    parametrization: what a refused conversion must leave."""
    from torch.nn.utils import parametrize

    from geoopt_stiefel_attention import frame_parameters

    after = model.state_dict()
    return (sorted(after) == sorted(before) and all(torch.equal(after[n], before[n]) for n in before)
            and not frame_parameters(model) and not any(parametrize.is_parametrized(m) for m in model.modules()))


@torch.no_grad()
def move_every_parameter_(model: torch.nn.Module, euclidean: float = 0.05) -> None:
    """Move every parameter of ``model`` off its initial value (so a checkpoint or an export is not the initial
    state): each frame by the retraction of a random tangent step of scale 0.1, everything else by ``euclidean``
    times a standard normal draw."""
    from geoopt_stiefel_attention import is_frame

    for p in model.parameters():
        if is_frame(p):
            p.copy_(p.manifold.retr(p, 0.1 * p.manifold.proju(p, torch.randn_like(p))))
        else:
            p.add_(euclidean * torch.randn_like(p))


def seeded_f64(make, *, biases, std: float = 1.0):
    """``make`` (a model factory) wrapped for a conversion test: the model built after ``torch.manual_seed(0)``
    (the warnings of a toy vocabulary's config silenced), in float64 and eval mode, then each bias that
    ``biases(name, p)`` picks, zero at init, redrawn normal with ``std`` so that it matters."""

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # configs of a toy vocabulary warn about their token ids
            model = make().to(F64).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if biases(name, p):
                    p.normal_(0, std)
        return model
    return build

# The tests use small tensors, for which intra-op threading only adds overhead; on a loaded 2-core machine
# two threads made a 16x10 optimizer step 10-70x slower. One thread also makes timings reproducible.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic_torch():
    """Each test starts from the same global RNG state and default dtype."""
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    yield
    torch.set_default_dtype(previous)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Every test starts on one intra-op thread, whatever an earlier test (a CLI run with ``--threads``) set."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _make_bad_frame(kind):
    """A parameter the optimizer must refuse, the exception it raises and a pattern of its message."""
    st = PolarStiefel()
    frames = st.random(2, 9, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    if kind == "off_manifold":
        return geoopt.ManifoldParameter(1.01 * frames, manifold=st), ValueError, r"proj_\(\)"
    if kind == "r_greater_than_d":
        p = geoopt.ManifoldParameter(frames, manifold=st)
        p.data = torch.randn(2, 3, 9, dtype=torch.float64)  # e.g. a transposed frame assigned later
        return p, ValueError, r"r <= d.*transpose"
    if kind == "canonical":
        canonical = geoopt.Stiefel()
        return geoopt.ManifoldParameter(canonical.random(9, 3, dtype=torch.float64), manifold=canonical), \
            ValueError, "PolarStiefel"
    if kind == "sphere":
        sphere = geoopt.Sphere()
        return geoopt.ManifoldParameter(sphere.random(9, dtype=torch.float64), manifold=sphere), ValueError, \
            "RiemannianAdam"
    if kind == "complex":  # assigned later: PolarStiefel itself refuses a complex tensor at ManifoldParameter()
        p = geoopt.ManifoldParameter(frames[0], manifold=st, requires_grad=True)
        p.data = torch.linalg.qr(torch.randn(9, 3, dtype=torch.complex128)).Q
        return p, TypeError, "real"
    raise AssertionError(kind)


@pytest.fixture()
def bad_frame():
    """``bad_frame(kind) -> (parameter, exception, message pattern)`` for the kinds of parameter the optimizer
    refuses: off_manifold, r_greater_than_d, canonical, sphere, complex."""
    return _make_bad_frame


# ---------------------------------------------------------------------------------------------- checkpoints
#: logits of two float32 models that should compute the same function (a converted model against the stock
#: class loaded from its checkpoint, or a restored converted model): float32 rounding (measured 0 to 8e-8)
F32_LOGIT_TOL = 1e-5
#: a frame or log-gain brought back from the stock form, whose blocks are gamma_h * U_h rounded to float32
#: (measured 2.4e-7)
F32_ROUNDTRIP_TOL = 1e-6
#: max |W^T W - I| of a float32 frame after a step
F32_ORTHO_TOL = 1e-5
#: a change of the function (relative) must exceed this in a companion case
CHANGED_MIN = 1e-4


# ------------------------------------------------------------------------ trajectories recorded on another CPU
#: Relative tolerance of a float record (loss, accuracy, norm, movement, angle) of a float32 training run compared
#: with a fixture recorded on another x86-64 CPU. The same torch build picks other kernels on other CPUs (AVX-512,
#: AVX2 or no SIMD: other reduction orders), so each float32 operation may round differently (unit roundoff 6e-8)
#: and the difference is carried along the trajectory. Measured for tests/data/format_v1 (recorded with AVX-512)
#: by rerunning with ``ATEN_CPU_CAPABILITY=avx2`` and ``=default``: losses differ by at most 1.1e-7 relative, norms
#: by 2e-8, principal angles by 2.7e-6 and per-step movements by 1.2e-5 (a difference of two nearby frames, so
#: cancellation magnifies the rounding); 1e-4 leaves a margin of 8 over the largest. A real change falls
#: outside it: the vision run with ``--lr`` 1% larger moves its frames 1% farther (the companion test).
TRAJECTORY_RTOL = 1e-4
#: Absolute floor of the same comparison, for values that are rounding noise around zero (principal angles of a
#: frame with itself at epoch 0 are 1e-14 degrees, computed in float64); in the measurements above, values below
#: 0.2 differed by at most 4e-8, and one training step moves a frame by about 1e-3, far above the floor.
TRAJECTORY_ATOL = 1e-6


def record_mismatches(new: list[dict], old: list[dict], *, rtol: float = TRAJECTORY_RTOL,
                      atol: float = TRAJECTORY_ATOL) -> list[str]:
    """Where two lists of run records differ beyond float rounding across machines.

    Parameters
    ----------
    new, old : list of dict
        Records (``metrics.jsonl`` rows) of the run to check and of the fixture.
    rtol, atol : float
        Float values ``x, y`` agree when ``|x - y| <= max(rtol * max(|x|, |y|), atol)`` (:func:`math.isclose`);
        every other value (epoch, step, arm, ``None``, strings) and the set of keys must be equal exactly.

    Returns
    -------
    list of str
        One line per disagreement (empty when the records agree).
    """
    if len(new) != len(old):
        return [f"{len(new)} records against {len(old)}"]
    out = []
    for i, (a, b) in enumerate(zip(new, old, strict=True)):
        if a.keys() != b.keys():
            out.append(f"record {i}: keys {sorted(a.keys() ^ b.keys())} in one only")
            continue
        for key, x in a.items():
            y = b[key]
            floats = isinstance(x, float) or isinstance(y, float)
            if floats and isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(x, bool):
                if not math.isclose(x, y, rel_tol=rtol, abs_tol=atol):
                    out.append(f"record {i} (epoch {a.get('epoch')}): {key} = {x!r}, fixture {y!r}")
            elif x != y:
                out.append(f"record {i} (epoch {a.get('epoch')}): {key} = {x!r}, fixture {y!r}")
    return out


def tiny_transformer(vocab: int = 11, seq: int = 4, **overrides) -> TinyTransformer:
    """The tests' tiny Stiefel model: a one-layer TinyTransformer of width 16 with two heads, seed 0;
    ``overrides`` replace any of its keyword arguments (``attention``, ``seed``, ``dtype``, ...)."""
    kwargs = dict(width=16, heads=2, mlp=32, attention="stiefel", seed=0)
    return TinyTransformer(vocab, seq, **{**kwargs, **overrides})


@pytest.fixture()
def tiny_model():
    """``tiny_model(**overrides)``: :func:`tiny_transformer` as a fixture."""
    return tiny_transformer


@pytest.fixture
def cli_status():
    """``cli_status(argv)``: the exit status of ``stiefel-attention argv``, whether :func:`main` returns it (a
    :class:`UsageError`) or argparse raises ``SystemExit`` (a bad flag value)."""
    from geoopt_stiefel_attention.cli import main

    def status(argv: list[str]) -> int:
        try:
            return main(argv)
        except SystemExit as err:
            return err.code

    return status


# ---------------------------------------------------------------------------------------------- text corpora
@pytest.fixture(scope="session")
def varied_root(tmp_path_factory):
    """A fake standard library for the language-model tests: 40 modules of text that does not repeat across files (so held-out windows pass the overlap test)."""
    import random

    rng = random.Random(3)
    root = tmp_path_factory.mktemp("varied")
    for k in range(40):
        body = "".join(f"def f_{rng.randrange(10**9)}(x):\n    # note {rng.randrange(10**9)}\n    return x * "
                       f"{rng.randrange(10**6)}\n" for _ in range(40))
        (root / f"mod{k:02d}.py").write_text(f'"""Module {k}: {rng.randrange(10**9)}."""\n\n' + body)
    return str(root)


#: the flags of a language-model run that trains in seconds (the tuned and controls studies' tests)
TINY_LM_FLAGS = ["--depth", "2", "--width", "32", "--heads", "4", "--context", "16", "--batch-size", "4",
                 "--steps-per-epoch", "3", "--epochs", "2", "--eval-windows", "4", "--train-eval-windows", "4",
                 "--eval-batch", "4", "--probe-windows", "2", "--val-fraction", "0.2", "--test-fraction", "0.2",
                 "--max-file-share", "0.5", "--adjust-lr-fn", "match_rms_adamw", "--device", "cpu", "--quiet",
                 "--threads", "1"]


def lm_cli(root, out, *extra) -> int:
    """``python -m experiments lm`` with :data:`TINY_LM_FLAGS` on the corpus ``root``, into ``out``."""
    from experiments.cli import main

    return main(["lm", *TINY_LM_FLAGS, "--corpus-root", root, "--out", str(out), *extra])


# ---------------------------------------------------------------------------------------------- README numbers
def missing_phrases(text: str, expected: list[str]) -> list[str]:
    """The phrases of ``expected`` that ``text`` does not contain, line breaks and runs of spaces read as one space."""
    words = " ".join(text.split())
    return [e for e in expected if " ".join(e.split()) not in words]


def one_digit_changed(text: str, phrase: str) -> str:
    """``text`` (whitespace folded) with the last digit of ``phrase`` changed wherever ``phrase`` occurs."""
    words, phrase = " ".join(text.split()), " ".join(phrase.split())
    i = max(k for k, c in enumerate(phrase) if c.isdigit())
    return words.replace(phrase, phrase[:i] + str((int(phrase[i]) + 1) % 10) + phrase[i + 1:])


def assert_quoted(text: str, expected: list[str]) -> None:
    """Every phrase of ``expected`` is in ``text``; companion: with one digit of any of them changed, it is not."""
    assert missing_phrases(text, expected) == []
    for phrase in expected:
        assert missing_phrases(one_digit_changed(text, phrase), [phrase]) == [phrase], phrase


# ---------------------------------------------------------------------- StiefelMuon's earlier solver (written out)
def fixed_count_direction(m: torch.Tensor, w: torch.Tensor, dual_steps: int = 10, ns_steps: int = 8) -> torch.Tensor:
    """The direction StiefelMuon took before issue 56 (commit 38fe98e, ``muon_direction``), written out as the
    reference of what a fixed-count stopping rule gives: ``dual_steps`` trial steps of a backtracking gradient
    descent on the dual ``min_L ||M - 2WL||_*`` (step 0.3 ||P_W M||_F / sqrt(r), grown 1.5x on acceptance, halved on
    refusal), every r x r inverse square root by ``ns_steps`` coupled Newton-Schulz iterations, from
    ``L = sym(W^T M) / 2``; the direction is ``P_W(Z (Z^T Z)^{-1/2})`` at the last accepted ``L``."""
    def sym(a):
        return 0.5 * (a + a.mT)

    def inv_sqrt_and_trace(gram):
        r = gram.shape[-1]
        c = torch.linalg.matrix_norm(gram).clamp_min(torch.finfo(gram.dtype).tiny)[..., None, None]
        eye = torch.eye(r, dtype=gram.dtype)
        y, z = gram / c, eye.expand_as(gram)
        for _ in range(ns_steps):
            t = 1.5 * eye - 0.5 * z @ y
            y, z = y @ t, t @ z
        return sym(z) / c.sqrt(), y.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None] * c.sqrt()

    wtm, mtm = w.mT @ m, m.mT @ m
    scale = (mtm.diagonal(dim1=-2, dim2=-1).sum(-1) - sym(wtm).square().sum((-2, -1))).clamp_min(0).sqrt()
    scale = scale[..., None, None] / math.sqrt(m.shape[-1])

    def evaluate(lam):
        cross = wtm.mT @ lam
        inv_root, nuclear = inv_sqrt_and_trace(sym(mtm - 2 * (cross + cross.mT) + 4 * lam @ lam))
        return inv_root, nuclear, sym((wtm - 2 * lam) @ inv_root)

    lam = 0.5 * sym(wtm)
    inv_root, g, grad = evaluate(lam)
    step = torch.full_like(g, 0.3)
    for _ in range(dual_steps):
        trial = lam + step * scale * grad
        inv_t, g_t, grad_t = evaluate(trial)
        ok = g_t <= g
        lam, inv_root = torch.where(ok, trial, lam), torch.where(ok, inv_t, inv_root)
        g, grad = torch.where(ok, g_t, g), torch.where(ok, grad_t, grad)
        step = torch.where(ok, step * 1.5, step * 0.5)
    a = (m - 2 * w @ lam) @ inv_root
    return a - w @ sym(w.mT @ a)


# ----------------------------------------------------------------------------- one-rank process groups (FSDP2/DTensor)
@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of one rank (world size 1) for the test, destroyed after it."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def dtensor_frame(placement):
    """A stack of four float64 8 x 3 frames as a ``DTensor`` parameter on a one-rank CPU mesh with ``placement``
    (the manifold set), and the frames it was made from (a geoopt ``ManifoldTensor``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    frames = PolarStiefel().random(4, 8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    p = torch.nn.Parameter(distribute_tensor(frames.detach().clone(), mesh, [placement]))
    p.manifold = PolarStiefel()
    return p, frames
