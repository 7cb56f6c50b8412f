"""Averages of a model with frames (EMA, SWA) and the frame check of an evaluation forward.

An average of orthonormal frames is not orthonormal, and the model-EMA classes that average ``state_dict()`` values
in place (timm's ``ModelEma``/``ModelEmaV2``/``ModelEmaV3``, the YOLO/ultralytics ``ModelEMA``) cannot reach a
converted weight, whose entry there is a copy rebuilt from its frames: before, the average's queries and keys stayed
where the copy began, and an averaged model evaluated with frames off the manifold, both without a word. Now the
first is warned once per averaged copy (a deep copy whose state-dict entries were written in place, seen at its next
``state_dict()`` or forward; no walk of the Python stack), the second at an evaluation forward (once each time the
frames change), and :func:`project_frames_` projects an average back (checked against scipy's polar decomposition).
"""

from __future__ import annotations

import copy
import io
import warnings

import numpy as np
import pytest
import torch
from scipy.linalg import polar
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from geoopt_stiefel_attention import (
    StiefelAdam,
    StiefelMultiheadAttention,
    frame_parameters,
    param_groups,
    project_frames_,
    stiefelize,
)
from geoopt_stiefel_attention._linalg import orthonormality_error
from geoopt_stiefel_attention.integrations.averaging import UNNAMED_HOLDER

EVALUATION = "off the Stiefel manifold at an evaluation forward pass"
IN_PLACE = "updates its values in place"
PROJECTED_TOL_F64 = 1e-12  # project_frames_ against scipy's polar factor, float64 (measured 1e-15)
ORTHO_TOL_F32 = 1e-5  # a projected float32 frame (the training check's tolerance)


def _encoder():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True))
    stiefelize(model)
    return model


def _train(model, opt, x, steps=3, after=None):
    for _ in range(steps):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after is not None:
            after()


def _messages(record, text):
    return [str(w.message) for w in record if text in str(w.message)]


class ModelEMA:
    """A hand-written EMA as the YOLO repositories write it: ``state_dict()`` values updated in place."""

    def __init__(self, model, decay=0.9):
        self.ema, self.decay = copy.deepcopy(model), decay

    def update(self, model):
        with torch.no_grad():
            msd = model.state_dict()
            for k, v in self.ema.state_dict().items():
                if v.dtype.is_floating_point:
                    v *= self.decay
                    v += (1 - self.decay) * msd[k].detach()


class Snapshot:
    """The companion: another class reading the state dict (to save it), named otherwise."""

    def update(self, model):
        self.saved = {k: v.clone() for k, v in model.state_dict().items()}


def _timm(name):
    timm_utils = pytest.importorskip("timm.utils")
    return lambda model: getattr(timm_utils, name)(model, decay=0.9)


@pytest.mark.parametrize("make", [_timm("ModelEmaV3"), _timm("ModelEmaV2"), _timm("ModelEma"), ModelEMA],
                         ids=["timm-ModelEmaV3", "timm-ModelEmaV2", "timm-ModelEma", "yolo-ModelEMA"])
def test_a_model_ema_of_state_dict_values_is_warned_once_naming_the_fix(make):
    """The queries and keys of such an average never move (measured: 0.0 while the model's frames moved 0.26);
    the warning says so once per EMA object, naming the class, a converted weight and what to use instead."""
    model, x = _encoder(), torch.randn(2, 5, 16)
    opt = StiefelAdam(param_groups(model), lr=3e-2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ema = make(model)
        holder = getattr(ema, "module", None) or getattr(ema, "ema", None)
        start = [f.detach().clone() for f in frame_parameters(holder)]
        _train(model, opt, x, after=lambda: ema.update(model))
    found = _messages(record, IN_PLACE)
    assert len(found) == 1, found
    # the writer is named when it holds the copy as a child module (timm's ModelEmaV2/V3); a plain object holding it
    # as an attribute (timm's ModelEma, the YOLO ModelEMA) cannot be named without a walk of the Python stack (the
    # stated limit of integrations/averaging.py), and the warning says "Something holding a deep copy"
    who = type(ema).__name__ if isinstance(ema, torch.nn.Module) else UNNAMED_HOLDER
    assert found[0].startswith(f"{who} reads state_dict() of a model converted by stiefelize "
                               f"(0.self_attn.in_proj_weight, ...)")
    assert "project_frames_(ema)" in found[0] and "exclude_buffers=True" in found[0]
    # what the warning is about: the average's frames stayed where they began
    assert all(torch.equal(f, s) for f, s in zip(frame_parameters(holder), start, strict=True))
    assert min(float((f.detach() - s).abs().max()) for f, s in zip(frame_parameters(model), start, strict=True)) > 1e-2


def test_companion_other_readers_of_the_state_dict_and_unconverted_models_are_not_warned():
    model, x = _encoder(), torch.randn(2, 5, 16)
    opt = StiefelAdam(param_groups(model), lr=3e-2)
    snapshot = Snapshot()
    plain = torch.nn.Linear(3, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(model, opt, x, after=lambda: snapshot.update(model))
        ModelEMA(plain).update(plain)  # nothing converted: nothing to warn about
    assert "0.self_attn.in_proj_weight" in snapshot.saved


def test_a_single_update_is_warned_at_the_averaged_copys_next_forward():
    """The writes of an update are seen at the copy's next ``state_dict()`` or forward: an EMA updated once and then
    evaluated is warned at that evaluation. Companion: the same EMA evaluated before any update is not warned."""
    model, x = _encoder(), torch.randn(2, 5, 16)
    opt = StiefelAdam(param_groups(model), lr=3e-2)
    quiet, ema = ModelEMA(model), ModelEMA(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            quiet.ema(x)
    _train(model, opt, x, steps=1, after=lambda: ema.update(model))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with torch.no_grad():
            ema.ema(x)
            ema.ema(x)
    found = _messages(record, IN_PLACE)
    assert len(found) == 1 and found[0].startswith(UNNAMED_HOLDER), found


class _Holder(torch.nn.Module):
    """A module of another name holding a deep copy, averaged through ``state_dict()`` values."""

    def __init__(self, model):
        super().__init__()
        self.average = copy.deepcopy(model)

    def update(self, model):
        with torch.no_grad():
            for v, w in zip(self.average.state_dict().values(), model.state_dict().values(), strict=True):
                v.lerp_(w, 0.5)


def test_the_module_holding_the_copy_is_named_whatever_its_name():
    """The writer is named by the module that took the copy as a child, not by a pattern in its class name."""
    model, x = _encoder(), torch.randn(2, 5, 16)
    opt = StiefelAdam(param_groups(model), lr=3e-2)
    holder = _Holder(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _train(model, opt, x, steps=3, after=lambda: holder.update(model))
    found = _messages(record, IN_PLACE)
    assert len(found) == 1 and found[0].startswith("_Holder reads state_dict()"), found


def test_companion_copies_whose_state_dict_is_only_read_are_not_warned():
    """A deep copy kept as the best model, and an ``AveragedModel``, saved again and again (their state dicts read,
    not written) and evaluated: no warning, and the entries a copy handed out are let go at its next forward."""
    model, x = _encoder(), torch.randn(2, 5, 16)
    opt = StiefelAdam(param_groups(model), lr=3e-2)
    best = copy.deepcopy(model)
    swa = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    buffer = io.BytesIO()

    def save():
        swa.update_parameters(model)
        project_frames_(swa)
        torch.save(swa.state_dict(), buffer)
        torch.save(best.state_dict(), buffer)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(model, opt, x, steps=3, after=save)
        with torch.no_grad():
            best(x)
    weight = best[0].self_attn.parametrizations.in_proj_weight[0]
    assert "_handed_out" not in weight.__dict__


def test_limit_an_average_that_is_not_a_deep_copy_is_not_seen():
    """The stated limit of integrations/averaging.py: an average built anew and filled by ``load_state_dict`` (not a
    deep copy) and then averaged through its ``state_dict()`` values is not warned, and its frames do not move. Before,
    a stack walk named such a class when its name held "ModelEma"; the guard no longer reads the caller."""
    model, x = _encoder(), torch.randn(2, 5, 16)
    opt = StiefelAdam(param_groups(model), lr=3e-2)
    average = _encoder()
    average.load_state_dict(model.state_dict())
    start = [f.detach().clone() for f in frame_parameters(average)]

    def update():
        with torch.no_grad():
            for v, w in zip(average.state_dict().values(), model.state_dict().values(), strict=True):
                v.lerp_(w, 0.5)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _train(model, opt, x, steps=3, after=update)
    assert _messages(record, IN_PLACE) == []
    assert all(torch.equal(f, s) for f, s in zip(frame_parameters(average), start, strict=True))


def test_an_average_of_parameters_warns_at_evaluation_until_projected_and_then_is_a_frame_average():
    """``AveragedModel`` with an EMA averages the frames' entries: evaluated, it warns once (not at every forward);
    after ``project_frames_`` it is silent, its frames are orthonormal, and closer to the model's frames than the
    copy it began from (the average moved)."""
    model, x = _encoder(), torch.randn(2, 5, 16)
    opt = StiefelAdam(param_groups(model), lr=3e-2)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    start = [f.detach().clone() for f in frame_parameters(ema)]
    _train(model, opt, x, steps=5, after=lambda: ema.update_parameters(model))
    assert max(float(orthonormality_error(f.detach())) for f in frame_parameters(ema)) > 1e-4
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with torch.no_grad():
            ema(x)
            ema(x)  # the frames did not change: no second warning
    found = _messages(record, EVALUATION)
    assert len(found) == 1 and "project_frames_(averaged_model)" in found[0], found
    assert project_frames_(ema) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            ema(x)
    frames = [f.detach() for f in frame_parameters(ema)]
    assert max(float(orthonormality_error(f)) for f in frames) < ORTHO_TOL_F32
    now = [f.detach() for f in frame_parameters(model)]
    assert all(float((f - n).norm()) < float((s - n).norm())
               for f, s, n in zip(frames, start, now, strict=True))


def test_companion_frames_the_library_trains_are_never_warned_at_evaluation():
    model, x = _encoder(), torch.randn(2, 5, 16)
    opt = StiefelAdam(param_groups(model), lr=3e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            _train(model, opt, x, steps=1)
            with torch.no_grad():
                model(x)


def test_the_librarys_own_module_warns_at_evaluation_once_per_change():
    torch.manual_seed(0)
    attn = StiefelMultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        attn.w_q.mul_(1.01)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with torch.no_grad():
            attn(x, x, x)
            attn(x, x, x)
            attn.w_q.mul_(1.01)  # changed again: checked again
            attn(x, x, x)
    found = _messages(record, EVALUATION)
    assert len(found) == 2 and all("StiefelMultiheadAttention: frame 'w_q'" in m for m in found), found


def test_project_frames_is_the_polar_factor_in_float64():
    """Against scipy's polar decomposition W = U_p P (U_p the closest frame), frame by frame."""
    model = _encoder().double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for f in frame_parameters(model):
            f.add_(0.2 * torch.randn(f.shape, generator=g, dtype=f.dtype))
    moved = [f.detach().clone() for f in frame_parameters(model)]
    ids = [id(f) for f in frame_parameters(model)]
    assert project_frames_(model) == len(moved)
    assert [id(f) for f in frame_parameters(model)] == ids  # the parameter objects are kept
    for f, before in zip(frame_parameters(model), moved, strict=True):
        for h in range(f.shape[0]):
            reference = polar(before[h].numpy())[0]
            assert np.abs(f[h].detach().numpy() - reference).max() < PROJECTED_TOL_F64


def test_companion_a_model_without_frames_projects_nothing():
    assert project_frames_(torch.nn.Linear(3, 3)) == 0


def test_the_advertised_timm_path_averages_the_frames_on_the_manifold():
    """What the warning recommends to timm users: ``ModelEmaV3(model, exclude_buffers=True)`` (parameters, not the
    state dict), then ``project_frames_``: no warning, the average's frames move towards the model's and stay
    orthonormal."""
    timm_utils = pytest.importorskip("timm.utils")
    model, x = _encoder(), torch.randn(2, 5, 16)
    opt = StiefelAdam(param_groups(model), lr=3e-2)
    ema = timm_utils.ModelEmaV3(model, decay=0.5, exclude_buffers=True)
    start = [f.detach().clone() for f in frame_parameters(ema.module)]

    def update():
        ema.update(model)
        project_frames_(ema.module)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(model, opt, x, steps=4, after=update)
        with torch.no_grad():
            ema.module(x)
    frames = [f.detach() for f in frame_parameters(ema.module)]
    assert max(float(orthonormality_error(f)) for f in frames) < ORTHO_TOL_F32
    assert min(float((f - s).abs().max()) for f, s in zip(frames, start, strict=True)) > 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (captures an inference CUDA graph)")
def test_cuda_graph_capture_of_an_evaluation_forward_skips_the_evaluation_check():
    """No host read is allowed while a CUDA graph is captured: the evaluation check, which reads the frames' distance
    when they changed, must stand aside there (replays run no Python). The captured forward replays as eager."""
    model = _encoder().cuda().eval()
    opt = StiefelAdam(param_groups(model), lr=1e-2)
    x = torch.randn(2, 5, 16, device="cuda")
    model(x).sum().backward()
    opt.step()  # the frames changed: the next evaluation forward would check them
    static = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        model(static)  # warm-up outside the capture (checks the frames once)
        opt.step()  # and changes them again, so the capture would check
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = model(static)
    graph.replay()
    with torch.no_grad():
        torch.testing.assert_close(out, model(static))


def _count_host_reads(monkeypatch):
    """Count ``Tensor.item``, ``bool(t)`` and ``float(t)`` from now on (each a host read, a synchronisation on an
    accelerator); the list's length is the count."""
    reads = []
    for name in ("item", "__bool__", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            reads.append(1)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def _reads_by_the_evaluation_check(monkeypatch, model, opt, x):
    """Host reads of an evaluation forward right after a step (the frames changed), minus those of the next one
    (the frames unchanged: the check does not run, whatever else the forward reads)."""
    _train(model, opt, x, steps=1)
    with monkeypatch.context() as counting, torch.no_grad():
        reads = _count_host_reads(counting)
        model(x)
        changed = len(reads)
        model(x)
    return changed - (len(reads) - changed)


def _deep_encoder():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
    stiefelize(model)
    return model


def test_an_evaluation_forward_checks_all_changed_frames_with_one_host_read(monkeypatch):
    """After a step, the evaluation check tests the frames of every converted weight at once: one host read for the
    whole model (on an accelerator, one synchronisation instead of one per weight)."""
    model = _deep_encoder()
    opt = StiefelAdam(param_groups(model), lr=1e-2)
    x = torch.randn(2, 5, 16)
    _train(model, opt, x, steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and the frames on the manifold are not warned
        assert _reads_by_the_evaluation_check(monkeypatch, model, opt, x) == 1


def test_companion_weight_by_weight_the_evaluation_check_reads_the_host_once_per_frame(monkeypatch):
    """The count above can fail: with the grouped test taken away (each weight checks itself, as before), the same
    evaluation reads each of the 6 frames (3 layers, query and key) on the host."""
    from geoopt_stiefel_attention.convert import parametrization

    monkeypatch.setattr(parametrization, "_frames_pass", lambda weights: None)
    model = _deep_encoder()
    opt = StiefelAdam(param_groups(model), lr=1e-2)
    x = torch.randn(2, 5, 16)
    _train(model, opt, x, steps=1)
    assert _reads_by_the_evaluation_check(monkeypatch, model, opt, x) == len(frame_parameters(model)) == 6


def test_a_grouped_evaluation_check_that_fails_names_the_weight_off_the_manifold():
    """When the grouped test fails, each changed weight runs its own check: only the weight whose frame is off is
    warned, by name, and the others are recorded as checked."""
    model = _deep_encoder()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        model(x)  # every weight checked once
        model.layers[1].self_attn.parametrizations.in_proj_weight[0].q_frames.mul_(1.01)
        model.layers[2].self_attn.parametrizations.in_proj_weight[0].k_frames.mul_(1.0)  # changed, still on it
        with pytest.warns(UserWarning, match=EVALUATION) as record:
            model(x)
    messages = _messages(record, EVALUATION)
    assert len(messages) == 1 and messages[0].startswith("layers.1.self_attn.in_proj_weight: frame 'q_frames'")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model(x)  # nothing changed since: no check, no warning
