"""The study arms beside Muon (issue 41): ``stiefeladam-muon`` (StiefelAdam frames, the arm the tuned study
recorded as ``stiefel-muon``) and ``stiefelmuon-muon`` (StiefelMuon frames); each gives the frames to its frame
optimizer, the other hidden matrices to torch's Muon and the rest to AdamW, and refuses a model with nothing for
Muon."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from experiments.harness.arms import get_arm, hidden_matrices  # noqa: E402
from experiments.harness.config import OptimConfig  # noqa: E402
from experiments.lm.study import LMConfig, build_model, lm_param_groups  # noqa: E402
from geoopt_stiefel_attention._linalg import orthonormality_error  # noqa: E402

FRAME_OPTIMIZER = {"stiefeladam-muon": "StiefelAdam", "stiefel-muon": "StiefelAdam",
                   "stiefelmuon-muon": "StiefelMuon"}


@pytest.mark.parametrize("arm", list(FRAME_OPTIMIZER))
def test_frames_go_to_their_optimizer_hidden_matrices_to_muon_the_rest_to_adamw(arm):
    spec = get_arm(arm)
    model = build_model(LMConfig(depth=1, width=16, heads=2, context=8), seed=0, stiefel=spec.attention == "stiefel")
    names = {id(p): n for n, p in model.named_parameters()}
    opt = spec.build(model, lm_param_groups(model, 0.1), OptimConfig(lr=1e-2, weight_decay=0.1,
                                                                      adjust_lr_fn="match_rms_adamw"))
    by_type = {type(o).__name__: {names[id(p)] for g in o.param_groups for p in g["params"]} for o in opt.optimizers}
    frames = {n for n in names.values() if n.endswith(("q_frames", "k_frames"))}
    assert by_type[FRAME_OPTIMIZER[arm]] == frames
    assert by_type["Muon"] == {names[id(p)] for p in hidden_matrices(model)}
    assert sorted(n for members in by_type.values() for n in members) == sorted(names.values())
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(3):
        opt.zero_grad()
        model(ids, labels=ids).loss.backward()
        opt.step()
    params = dict(model.named_parameters())
    for n in frames:
        assert not torch.equal(params[n].detach(), before[n]) and orthonormality_error(params[n]) < 1e-5


def test_companion_the_two_arms_train_the_frames_differently():
    moved = {}
    for arm in ("stiefeladam-muon", "stiefelmuon-muon"):
        spec = get_arm(arm)
        model = build_model(LMConfig(depth=1, width=16, heads=2, context=8), seed=0, stiefel=True)
        opt = spec.build(model, lm_param_groups(model, 0.1), OptimConfig(lr=1e-2, adjust_lr_fn="match_rms_adamw"))
        ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
        opt.zero_grad()
        model(ids, labels=ids).loss.backward()
        opt.step()
        moved[arm] = next(p.detach().clone() for n, p in model.named_parameters() if n.endswith("q_frames"))
    assert (moved["stiefeladam-muon"] - moved["stiefelmuon-muon"]).abs().max() > 1e-6


@pytest.mark.parametrize("arm", ["stiefeladam-muon", "stiefelmuon-muon"])
def test_an_arm_with_nothing_for_muon_is_refused_naming_the_arm(arm):
    from geoopt_stiefel_attention.nn import StiefelMultiheadAttention

    attn = StiefelMultiheadAttention(8, 2, bias=False)
    attn.w_v.requires_grad_(False)
    attn.w_o.requires_grad_(False)
    with pytest.raises(ValueError, match=f"arm '{arm}'.*no hidden"):
        get_arm(arm).build(attn, [{"params": [attn.w_q, attn.w_k], "weight_decay": 0.0}], OptimConfig())
