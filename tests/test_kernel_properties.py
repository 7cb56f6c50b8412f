"""Property-based checks (hypothesis) over drawn inputs, each with a companion that must fail:

- the fused in-place kernel that ``StiefelAdam`` runs equals the readable specification ``stiefel_adam_update`` step
  for step and keeps frames on the manifold, for frame sizes from 1 x 1 to square, either layout, lr over four
  decades, betas, eps, trust radii (and none), with and without a second moment, maximising or not, the default and
  the capturable path, gradients over five decades (float64; companion: a reference with another beta2);
- the retraction planned for a step's bound (a series or Newton-Schulz) is the SVD's polar factor, float32 and
  float64 (companion: planned for a tenth of the step);
- a run saved after any step and resumed from the optimizer's state dict is the run without a break, bit for bit
  (companion: resumed without the state);
- any ``nn.MultiheadAttention`` configuration, any HuggingFace GPT-2 (with cross-attention and its scaling options),
  any grouped-query HuggingFace Llama and any timm ViT (bias, ``qk_norm``, class and register tokens), converted by
  ``stiefelize``
  round-trips through its stock state dict and ``unstiefelize`` (companions: the stock model with its own weights
  computes another function).

The parametrized comparisons of ``tests/test_optim_contract.py`` run 120 steps on a few fixed settings; these run a
few steps on many drawn ones (the retraction's plan changes with the step's size, so large steps and radii are drawn
too). ``derandomize=True``: every run draws the same examples, so CI is reproducible.
"""

from __future__ import annotations

import math
import warnings

import geoopt
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from geoopt_stiefel_attention import (  # noqa: E402
    PolarStiefel,
    StiefelAdam,
    _linalg,  # noqa: E402
)
from geoopt_stiefel_attention._linalg import orthonormality_error  # noqa: E402
from geoopt_stiefel_attention.optim import stiefel_adam_update  # noqa: E402

#: float64: the kernel against the specification after a few steps (frames, moments; measured at most 5.4e-12 over
#: 1,500 draws, lr up to 1 and radii up to 3)
PROPERTY_TOL = 1e-10
#: float64: max |W^T W - I| of a frame after the drawn steps (measured at most 4.3e-14 over the same draws)
PROPERTY_ORTHO_TOL = 1e-12
#: relative floor of the second moments' comparison, times the squared gradient scale
V_FLOOR = 1e-20
#: drawn settings per property (each a few small steps: about 0.05 s)
EXAMPLES = 60


@st.composite
def _settings(draw):
    d = draw(st.integers(1, 10))
    return dict(
        n=draw(st.integers(1, 3)), d=d, r=draw(st.integers(1, d)), column_major=draw(st.booleans()),
        lr=10.0 ** draw(st.floats(-4, 0)), beta1=draw(st.floats(0.0, 0.95)), beta2=draw(st.floats(0.5, 0.999)),
        eps=draw(st.sampled_from([1e-8, 1e-3])),
        trust_region=draw(st.one_of(st.none(), st.floats(-2, 0.5).map(lambda e: 10.0 ** e))),
        second_moment=draw(st.sampled_from(["frame", None])), maximize=draw(st.booleans()),
        capturable=draw(st.booleans()), steps=draw(st.integers(1, 5)),
        grad_scales=draw(st.lists(st.floats(-3, 2).map(lambda e: 10.0 ** e), min_size=5, max_size=5)),
        seed=draw(st.integers(0, 2**16)),
    )


def _run(s, reference_beta2=None):
    """The kernel (through StiefelAdam) and the specification on the same drawn settings and gradients; returns the
    largest difference of frames and moments, and the kernel's largest orthonormality error."""
    gen = torch.Generator().manual_seed(s["seed"])
    w0 = PolarStiefel().random(s["n"], s["d"], s["r"], dtype=torch.float64, generator=gen)
    if s["column_major"]:
        w0 = w0.mT.contiguous().mT
    p = geoopt.ManifoldParameter(w0.clone(), manifold=PolarStiefel())
    opt = StiefelAdam([p], lr=s["lr"], betas=(s["beta1"], s["beta2"]), eps=s["eps"], trust_region=s["trust_region"],
                      second_moment=s["second_moment"], maximize=s["maximize"], capturable=s["capturable"],
                      adjust_lr_fn="original")
    w, m = w0.clone(), torch.zeros_like(w0)
    v = None if s["second_moment"] is None else torch.zeros(s["n"], 1, 1, dtype=torch.float64)
    for t in range(1, s["steps"] + 1):
        g = s["grad_scales"][t - 1] * torch.randn(w0.shape, generator=gen, dtype=torch.float64)
        w, m, v, _ = stiefel_adam_update(
            w, -g if s["maximize"] else g, m, v, step=t, lr=s["lr"], beta1=s["beta1"],
            beta2=s["beta2"] if reference_beta2 is None else reference_beta2, eps=s["eps"],
            trust_region=s["trust_region"], second_moment=s["second_moment"])
        p.grad = g.clone()
        opt.step()
    state = opt.state[p]
    gap = max(float((p.detach() - w).abs().max()), float((state["exp_avg"] - m).abs().max()))
    if v is not None:  # relative, down to a floor far below any gradient's square: where the tangent space is {0}
        # (d = r = 1) the specification's xi is exactly 0 and the kernel's is rounding (v about 1e-31)
        floor = V_FLOOR * max(s["grad_scales"][:s["steps"]]) ** 2
        gap = max(gap, float(((state["exp_avg_sq"] - v).abs() / v.clamp_min(floor)).max()))
    return gap, float(orthonormality_error(p.detach()))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(_settings())
def test_the_kernel_equals_the_specification_and_keeps_frames_on_the_manifold(s):
    gap, ortho = _run(s)
    assert gap < PROPERTY_TOL, s
    assert ortho < PROPERTY_ORTHO_TOL, s


@st.composite
def _moving_settings(draw):
    """Drawn settings under which a second-moment decay changes the frames: a second moment, a frame with a tangent
    space (r < d), several steps, an lr above rounding, and a radius (if any) that does not cap the steps."""
    s = draw(_settings())
    d = draw(st.integers(2, 10))
    lr = 10.0 ** draw(st.floats(-2, 0))
    return {**s, "second_moment": "frame", "d": d, "r": draw(st.integers(1, d - 1)),
            "steps": draw(st.integers(2, 5)), "lr": lr,
            "trust_region": draw(st.one_of(st.none(), st.just(10 * lr)))}


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(_moving_settings())
def test_companion_the_comparison_separates_another_second_moment_decay(s):
    """The comparison can fail: a reference run whose beta2 is 0.3 away from the drawn one ends elsewhere."""
    other = s["beta2"] - 0.3 if s["beta2"] > 0.8 else s["beta2"] + 0.3
    gap, _ = _run(s, reference_beta2=other)
    assert gap > 1e3 * PROPERTY_TOL and math.isfinite(gap), s


# ----------------------------------------------------------------------------- the retraction's plan
#: entrywise error accepted of the planned polar factor against the float64 SVD's, in units of roundoff of the
#: retraction's dtype: in float32 the reference is far more precise (16, as tests/test_linalg.py's worst case;
#: measured at most 7.5 over 1,500 draws); in float64 it rounds as much as the retraction does (measured at most 22)
RETRACTION_ROUNDOFF_UNITS = {torch.float32: 16, torch.float64: 48}


@st.composite
def _steps(draw, smallest=-4.0):
    d = draw(st.integers(1, 12))
    return dict(n=draw(st.integers(1, 3)), d=d, r=draw(st.integers(1, d)),
                radius=10.0 ** draw(st.floats(smallest, math.log10(3.0))),
                dtype=draw(st.sampled_from([torch.float32, torch.float64])), seed=draw(st.integers(0, 2**16)))


def _planned_polar(s, planned_for=None):
    """W - s retracted by the plan for ||s||_F^2 (or for ``planned_for``^2) in ``dtype``, and the float64 SVD polar
    factor of the same matrix: a frame W and a tangent step s of Frobenius norm ``radius``."""
    gen = torch.Generator().manual_seed(s["seed"])
    w = PolarStiefel().random(s["n"], s["d"], s["r"], dtype=torch.float64, generator=gen)
    g = torch.randn(w.shape, generator=gen, dtype=torch.float64)
    step = g - w @ ((w.mT @ g + g.mT @ w) / 2)  # its tangent part
    norm = torch.linalg.matrix_norm(step, keepdim=True)
    step = torch.where(norm > 0, step * s["radius"] / norm.clamp_min(1e-300), step)
    eps = torch.finfo(s["dtype"]).eps
    bound = (s["radius"] if planned_for is None else planned_for) ** 2 + 64 * eps
    plan = _linalg.retraction_plan(bound, s["dtype"])
    y = (w - step).to(s["dtype"])
    planned = (y @ _linalg.inv_sqrt_planned(y.mT @ y, bound, plan)).double()
    return planned, _linalg.polar_svd(w - step), RETRACTION_ROUNDOFF_UNITS[s["dtype"]] * eps


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(_steps())
def test_the_planned_retraction_is_the_polar_factor_to_rounding(s):
    """Any tangent step within the bound the plan is made for (||s||_2 <= ||s||_F), from 1e-4 to 3 (a Gram
    spectrum up to [1, 10]): the planned retraction, a series or Newton-Schulz, gives the SVD's polar factor."""
    planned, reference, tol = _planned_polar(s)
    assert float((planned - reference).abs().max()) < tol, s


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(_steps(smallest=0.0))
def test_companion_a_retraction_planned_for_a_tenth_of_the_step_misses_the_polar_factor(s):
    """The comparison can fail: planned for a bound ten times below the step taken (a frame with a tangent space and
    a step of at least 1), the same retraction is off (measured: by at least 7,700 units of roundoff)."""
    hypothesis.assume(s["r"] < s["d"])
    planned, reference, tol = _planned_polar(s, planned_for=s["radius"] / 10)
    assert float((planned - reference).abs().max()) > tol, s


# ----------------------------------------------------------------------------- the converter's round trips
#: float64: a converted model against the stock model loaded from its exported state dict, and against itself after
#: unstiefelize (the same products in another order)
ROUND_TRIP_TOL = 1e-12


def _convert(model, **options):
    from geoopt_stiefel_attention import stiefelize

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what the options say of a drawn configuration (no bias to drop, ...)
        stiefelize(model, **options)
    return model


def _assert_round_trips(s, model, stock, run):
    """``run`` of the converted ``model`` equals ``run`` of ``stock`` loaded from ``export_state_dict(model)``
    (strict), and ``run`` of ``model`` after ``unstiefelize``."""
    from geoopt_stiefel_attention import export_state_dict, unstiefelize

    with torch.no_grad():
        y = run(model)
        stock.load_state_dict(export_state_dict(model))
        assert float((run(stock) - y).abs().max()) < ROUND_TRIP_TOL, s
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # unstiefelize's note on optimizers (none here)
            unstiefelize(model)
        assert float((run(model) - y).abs().max()) < ROUND_TRIP_TOL, s


def _assert_functions_differ(s, converted, stock, run):
    """The companions: ``run`` of a model converted without gains differs from ``run`` of the stock model with its own
    weights (each query/key head block replaced by its polar factor changes the logits)."""
    with torch.no_grad():
        assert float((run(stock) - run(converted)).abs().max()) > 1e3 * ROUND_TRIP_TOL, s


@st.composite
def _attention(draw):
    heads, head_dim = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    embed = heads * head_dim
    kv = draw(st.one_of(st.none(), st.integers(head_dim, 9)))  # a key frame is (kdim, head_dim): head_dim <= kdim
    return dict(embed=embed, heads=heads, bias=draw(st.booleans()), add_bias_kv=draw(st.booleans()),
                add_zero_attn=draw(st.booleans()), kdim=kv, vdim=draw(st.one_of(st.none(), st.integers(1, 9))),
                batch_first=draw(st.booleans()), logit_gain=draw(st.sampled_from([None, "learn", "fit"])),
                qk_bias=draw(st.sampled_from(["keep", "drop"])), seed=draw(st.integers(0, 2**16)))


def _mha(s):
    torch.manual_seed(s["seed"])
    return torch.nn.Sequential(torch.nn.MultiheadAttention(
        s["embed"], s["heads"], bias=s["bias"], add_bias_kv=s["add_bias_kv"], add_zero_attn=s["add_zero_attn"],
        kdim=s["kdim"], vdim=s["vdim"], batch_first=s["batch_first"], dtype=torch.float64))


def _mha_run(s):
    """Cross-attention of 3 queries to 4 keys and values, batch 2, in the module's layout."""
    gen = torch.Generator().manual_seed(s["seed"] + 1)

    def inputs(length, features):
        x = torch.randn(2, length, features, generator=gen, dtype=torch.float64)
        return x if s["batch_first"] else x.transpose(0, 1)
    q, k, v = inputs(3, s["embed"]), inputs(4, s["kdim"] or s["embed"]), inputs(4, s["vdim"] or s["embed"])
    return lambda model: model[0](q, k, v)[0]


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(_attention())
def test_a_converted_attention_round_trips_through_the_stock_state_dict_and_unstiefelize(s):
    """Any ``nn.MultiheadAttention`` configuration (fused or separate projections, biases, bias_kv, zero attention,
    either layout) with any gain and bias option."""
    _assert_round_trips(s, _convert(_mha(s), logit_gain=s["logit_gain"], qk_bias=s["qk_bias"]), _mha(s), _mha_run(s))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(_attention().filter(lambda s: s["heads"] > 1))
def test_companion_the_stock_attention_with_its_own_weights_computes_another_function(s):
    """Several heads, so each block is a part of its weight."""
    _assert_functions_differ(s, _convert(_mha(s), qk_bias=s["qk_bias"]), _mha(s), _mha_run(s))


@st.composite
def _llama(draw):
    kv, groups = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    hidden = kv * groups * draw(st.integers(2, 4))  # transformers wants the width a multiple of the heads
    head_dim = 2 * draw(st.integers(1, min(hidden, 6) // 2))  # even (rotary embeddings), at most the width (frames)
    return dict(kv=kv, groups=groups, hidden=hidden, head_dim=head_dim,
                logit_gain=draw(st.sampled_from([None, "learn", "fit"])), seed=draw(st.integers(0, 2**16)))


def _llama_model(s):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(s["seed"])
    cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=s["hidden"], intermediate_size=8, num_hidden_layers=1,
                                   num_attention_heads=s["kv"] * s["groups"], num_key_value_heads=s["kv"],
                                   head_dim=s["head_dim"], max_position_embeddings=8, bos_token_id=0,
                                   eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg).double().eval()


def _llama_run(s):
    ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(s["seed"]))
    return lambda model: model(ids).logits


@settings(max_examples=EXAMPLES // 3, deadline=None, derandomize=True)
@given(_llama())
def test_a_converted_grouped_query_llama_round_trips_through_the_stock_state_dict_and_unstiefelize(s):
    """HuggingFace Llama with grouped-query attention in any proportion (1 to 3 key/value heads, 1 to 3 query heads
    each, head sizes 2, 4 or 6 set apart from the width, so q_proj's output may differ from the model's width), any
    gain."""
    _assert_round_trips(s, _convert(_llama_model(s), logit_gain=s["logit_gain"]), _llama_model(s), _llama_run(s))


@settings(max_examples=EXAMPLES // 6, deadline=None, derandomize=True)
@given(_llama())
def test_companion_the_stock_llama_with_its_own_weights_gives_other_logits(s):
    _assert_functions_differ(s, _convert(_llama_model(s)), _llama_model(s), _llama_run(s))


@st.composite
def _gpt2(draw):
    heads = draw(st.integers(1, 4))
    return dict(heads=heads, width=heads * draw(st.integers(1, 6)), cross=draw(st.booleans()),
                scale=draw(st.booleans()), by_layer=draw(st.booleans()), upcast=draw(st.booleans()),
                logit_gain=draw(st.sampled_from([None, "learn", "fit"])), seed=draw(st.integers(0, 2**16)))


def _gpt2_model(s):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(s["seed"])
    cfg = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=s["width"], n_layer=2, n_head=s["heads"],
                                  add_cross_attention=s["cross"], scale_attn_weights=s["scale"],
                                  scale_attn_by_inverse_layer_idx=s["by_layer"], reorder_and_upcast_attn=s["upcast"])
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def _gpt2_run(s):
    gen = torch.Generator().manual_seed(s["seed"])
    kwargs = {"input_ids": torch.randint(0, 16, (2, 5), generator=gen)}
    if s["cross"]:
        kwargs["encoder_hidden_states"] = torch.randn(2, 3, s["width"], generator=gen, dtype=torch.float64)
    return lambda model: model(**kwargs).logits


@settings(max_examples=EXAMPLES // 3, deadline=None, derandomize=True)
@given(_gpt2())
def test_a_converted_gpt2_round_trips_through_the_stock_state_dict_and_unstiefelize(s):
    """HuggingFace GPT-2 (Conv1D ``c_attn``, and with ``add_cross_attention`` the ``q_attn`` + ``c_attn``
    cross-attention layout) with any of its attention-scaling options and any gain."""
    _assert_round_trips(s, _convert(_gpt2_model(s), logit_gain=s["logit_gain"]), _gpt2_model(s), _gpt2_run(s))


@settings(max_examples=EXAMPLES // 6, deadline=None, derandomize=True)
@given(_gpt2().filter(lambda s: s["width"] > 1))
def test_companion_the_stock_gpt2_with_its_own_weights_gives_other_logits(s):
    """At width 1 the layer norm before attention outputs zeros, so no query or key matters there."""
    _assert_functions_differ(s, _convert(_gpt2_model(s)), _gpt2_model(s), _gpt2_run(s))


@st.composite
def _timm_vit(draw):
    heads = draw(st.integers(1, 4))
    return dict(heads=heads, width=heads * draw(st.integers(1, 6)), qkv_bias=draw(st.booleans()),
                qk_norm=draw(st.booleans()), class_token=draw(st.booleans()), reg_tokens=draw(st.integers(0, 2)),
                logit_gain=draw(st.sampled_from([None, "learn", "fit"])), qk_bias=draw(st.sampled_from(["keep", "drop"])),
                seed=draw(st.integers(0, 2**16)))


def _timm_vit_model(s):
    timm = pytest.importorskip("timm")
    torch.manual_seed(s["seed"])
    return timm.models.vision_transformer.VisionTransformer(
        img_size=8, patch_size=4, embed_dim=s["width"], depth=1, num_heads=s["heads"], mlp_ratio=1.0,
        qkv_bias=s["qkv_bias"], qk_norm=s["qk_norm"], class_token=s["class_token"], reg_tokens=s["reg_tokens"],
        global_pool="token" if s["class_token"] else "avg", num_classes=3).double().eval()


def _timm_vit_run(s):
    """The features of every token, before the head (which timm starts at zero, hiding any difference)."""
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(s["seed"]), dtype=torch.float64)
    return lambda model: model.forward_features(x)


@settings(max_examples=EXAMPLES // 3, deadline=None, derandomize=True)
@given(_timm_vit())
def test_a_converted_timm_vit_round_trips_through_the_stock_state_dict_and_unstiefelize(s):
    """timm's VisionTransformer (fused ``qkv``) with or without its bias, with or without ``qk_norm``, class and
    register tokens, any gain and bias option."""
    _assert_round_trips(s, _convert(_timm_vit_model(s), logit_gain=s["logit_gain"], qk_bias=s["qk_bias"]),
                        _timm_vit_model(s), _timm_vit_run(s))


@settings(max_examples=EXAMPLES // 6, deadline=None, derandomize=True)
@given(_timm_vit().filter(lambda s: s["heads"] > 1 and s["width"] >= 2 * s["heads"]))
def test_companion_the_stock_timm_vit_with_its_own_weights_computes_another_function(s):
    """Heads of at least 2: ``qk_norm`` of a 1-wide head is its bias alone, whatever the weights."""
    _assert_functions_differ(s, _convert(_timm_vit_model(s), qk_bias=s["qk_bias"]), _timm_vit_model(s),
                             _timm_vit_run(s))


# ----------------------------------------------------------------------------- checkpoints
def _train_frames(s, p, opt, grads):
    for g in grads:
        p.grad = g.clone()
        opt.step()


def _optimizer(s, p):
    return StiefelAdam([p], lr=s["lr"], betas=(s["beta1"], s["beta2"]), eps=s["eps"], trust_region=s["trust_region"],
                       second_moment=s["second_moment"], maximize=s["maximize"], capturable=s["capturable"],
                       adjust_lr_fn="original")


def _resume(s, stop, reload=True):
    """Frames trained for ``s["steps"] + 2`` steps without a break, and the same run saved after ``stop`` steps,
    loaded into a new optimizer over a copy of the frames (``reload=False``: the new optimizer starts afresh), and
    continued."""
    import copy

    gen = torch.Generator().manual_seed(s["seed"])
    w0 = PolarStiefel().random(s["n"], s["d"], s["r"], dtype=torch.float64, generator=gen)
    total = s["steps"] + 2
    grads = [torch.randn(w0.shape, generator=gen, dtype=torch.float64) for _ in range(total)]
    straight = geoopt.ManifoldParameter(w0.clone(), manifold=PolarStiefel())
    _train_frames(s, straight, _optimizer(s, straight), grads)
    first = geoopt.ManifoldParameter(w0.clone(), manifold=PolarStiefel())
    opt = _optimizer(s, first)
    _train_frames(s, first, opt, grads[:stop])
    saved = copy.deepcopy(opt.state_dict())
    second = geoopt.ManifoldParameter(first.detach().clone(), manifold=PolarStiefel())
    resumed = _optimizer(s, second)
    if reload:
        resumed.load_state_dict(saved)
    _train_frames(s, second, resumed, grads[stop:])
    return straight.detach(), second.detach()


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(_settings(), st.integers(1, 6))
def test_a_run_saved_and_resumed_from_its_state_dict_is_the_run_without_a_break(s, stop):
    """Any drawn setting, saved after any step: a new optimizer over a copy of the frames, loaded from the state dict,
    continues the run bit for bit."""
    stop = min(stop, s["steps"] + 1)
    straight, resumed = _resume(s, stop)
    assert torch.equal(straight, resumed), s


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(_moving_settings())
def test_companion_a_run_resumed_without_its_optimizer_state_goes_elsewhere(s):
    """The comparison can fail: the same run continued by a fresh optimizer (moments and step count lost) ends
    elsewhere."""
    straight, resumed = _resume(s, 1, reload=False)
    assert not torch.equal(straight, resumed), s
