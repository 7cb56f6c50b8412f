"""The training-step benchmark (``stiefel-attention bench train``): forward, backward and optimizer step of
a model, the stiefel arm against the adamw arm."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._docfrag import fill
from .records import Timing
from .settings import (
    DISAGREEMENT_NOTE,
    BenchSettings,
    _interleave,
    _ratio,
    _settings,
    _timing,
    ratio_disagrees,
    torch_threads,
)

#: The models of :func:`train_step_benchmark`.
TRAIN_MODELS = ("tiny_transformer", "patch_vit")
#: Stock models whose stiefel arm is converted by :func:`~geoopt_stiefel_attention.stiefelize` (the cost of the
#: converter's parametrization plus the Riemannian step); run only when asked for. ``hf_*`` need the ``models``
#: extra (HuggingFace ``transformers``), ``timm_vit`` needs ``timm``, ``torchvision_vit`` needs ``torchvision``.
EXTRA_TRAIN_MODELS = ("hf_gpt2", "hf_llama", "hf_bert", "hf_vit", "timm_vit", "torchvision_vit", "torch_encoder")
#: The package each converted model needs (``None``: torch alone).
MODEL_PACKAGES: dict[str, str | None] = {"hf_gpt2": "transformers", "hf_llama": "transformers",
                                         "hf_bert": "transformers", "hf_vit": "transformers", "timm_vit": "timm",
                                         "torchvision_vit": "torchvision", "torch_encoder": None}
#: Scales of :func:`train_step_benchmark` (keys of :data:`TRAIN_SCALES`).
TRAIN_SCALE_NAMES = ("default", "tiny", "w64")


@fill
@dataclass(frozen=True)
class TrainStepResult:
    """:func:`train_step_benchmark` for one model: full-step, optimizer-only and forward-only times per arm, and the
    ratio of the stiefel arm's full step to the adamw arm's (median over rounds). The backward pass takes the rest
    of a full step (full - forward - optimizer).

    Attributes
    ----------
    model : str
        The model's name (:data:`TRAIN_MODELS`, :data:`EXTRA_TRAIN_MODELS`).
    config : dict
        Its settings, the batch size excepted.
    batch : int
        Batch size.
    full_step, optimizer_step : dict of str to Timing
        Per arm (``"adamw"``, ``"stiefel"``).
    ratio : float
        Stiefel arm's full step over the adamw arm's.
    {{timing_run}}
    autocast : str or None
        The ``torch.autocast`` dtype of forward and loss; ``None`` without autocast.
    min_ratio : float or None
        Ratio of the two arms' fastest steps.
    forward_step : dict of str to Timing or None
        Forward and loss alone, per arm, where timed.
    """

    model: str
    config: dict[str, Any]
    batch: int
    full_step: dict[str, Timing]
    optimizer_step: dict[str, Timing]
    ratio: float
    rounds: int
    clock: str
    threads: int
    autocast: str | None = None
    #: ratio of the two arms' fastest steps (minimum over every timed step; the least disturbed samples)
    min_ratio: float | None = None
    #: forward and loss alone, with gradients recorded (the graph is freed unused): where a converted model's
    #: rebuild of W_Q/W_K and its frame check are paid
    forward_step: dict[str, Timing] | None = None

# ----------------------------------------------------------------------------------------------- train step
#: The models given one family's settings alike: text models (token ids in) and image models (patches in).
_TEXT_MODELS = ("hf_llama", "hf_bert", "torch_encoder")
_IMAGE_MODELS = ("hf_vit", "timm_vit", "torchvision_vit")

#: The settings each model (or family of models, ``text`` and ``image``) takes, in the order of its values in
#: :data:`_SETTING_VALUES`.
_SETTING_KEYS: dict[str, tuple[str, ...]] = {
    "tiny_transformer": ("vocab_size", "seq_len", "width", "depth", "heads", "mlp", "batch"),
    "patch_vit": ("image_size", "patch_size", "width", "depth", "heads", "mlp", "batch"),
    "hf_gpt2": ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "batch"),
    "text": ("vocab_size", "seq_len", "width", "depth", "heads", "batch"),
    "image": ("image_size", "patch_size", "width", "depth", "heads", "batch"),
}

#: Each model's (or family's) values, in the order of its keys, at each scale of :data:`_SCALE_COLUMNS`: one tuple
#: per scale (``default``, ``tiny``, ``w64``; :data:`TRAIN_SETTINGS`, :data:`TINY_TRAIN_SETTINGS`,
#: :data:`W64_TRAIN_SETTINGS` say what each scale is for).
_SETTING_VALUES: dict[str, tuple[tuple[int, ...], ...]] = {
    "tiny_transformer": ((99, 4, 128, 1, 4, 512, 512), (11, 4, 16, 1, 2, 32, 8), (99, 4, 64, 1, 4, 256, 512)),
    "patch_vit": ((32, 4, 64, 2, 4, 128, 128), (8, 4, 16, 1, 2, 32, 4), (32, 4, 64, 2, 4, 128, 128)),
    "hf_gpt2": ((512, 64, 128, 2, 4, 16), (32, 8, 16, 1, 2, 2), (512, 32, 64, 2, 4, 8)),
    "text": ((512, 64, 128, 2, 4, 16), (32, 8, 16, 1, 2, 2), (512, 32, 64, 2, 4, 8)),
    "image": ((32, 4, 128, 2, 4, 32), (8, 4, 16, 1, 2, 2), (32, 4, 64, 2, 4, 8)),
}
_SCALE_COLUMNS = ("default", "tiny", "w64")


def _by_model(scale: str) -> dict[str, dict[str, Any]]:
    """Model settings by model name at ``scale`` (a column of :data:`_SETTING_VALUES`): the three models with
    settings of their own, then a copy of the ``text`` settings for each of :data:`_TEXT_MODELS` and of the
    ``image`` settings for each of :data:`_IMAGE_MODELS`."""
    column = _SCALE_COLUMNS.index(scale)
    own = {name: dict(zip(_SETTING_KEYS[name], values[column], strict=True))
           for name, values in _SETTING_VALUES.items()}
    text, image = own.pop("text"), own.pop("image")
    return {**own, **{m: dict(text) for m in _TEXT_MODELS}, **{m: dict(image) for m in _IMAGE_MODELS}}


#: Model settings of :func:`train_step_benchmark`: the defaults of the grokking and vision studies.
TRAIN_SETTINGS: dict[str, dict[str, Any]] = _by_model("default")

#: The same models shrunk to a smoke test (``scale="tiny"``).
TINY_TRAIN_SETTINGS: dict[str, dict[str, Any]] = _by_model("tiny")

#: Every model at width 64 (``scale="w64"``, issue #40): small models and batches (8 sequences of 32 tokens, 8
#: images of 64 patches), where the converted weight's rebuild in each forward weighs most against the model's
#: own work (4 heads of 16; Llama with 2 key/value heads).
W64_TRAIN_SETTINGS: dict[str, dict[str, Any]] = _by_model("w64")

#: scale -> model settings.
TRAIN_SCALES: dict[str, dict[str, dict[str, Any]]] = {"default": TRAIN_SETTINGS, "tiny": TINY_TRAIN_SETTINGS,
                                                      "w64": W64_TRAIN_SETTINGS}


def _train_setup(model: str, attention: str, settings: dict[str, Any], *, seed: int,
                 device: str) -> tuple[Any, Any, Any, Callable[[Any, Any], Any]]:
    """Model, input batch, targets and loss of one arm (the same data for both arms)."""
    import torch

    from ..models import PatchViT, TinyTransformer

    gen = torch.Generator().manual_seed(seed)
    kw = {k: v for k, v in settings.items() if k != "batch"}
    batch = settings["batch"]
    if model == "tiny_transformer":
        net = TinyTransformer(attention=attention, seed=seed, **kw)
        x = torch.randint(0, kw["vocab_size"], (batch, kw["seq_len"]), generator=gen)
        y = torch.randint(0, kw["vocab_size"], (batch,), generator=gen)

        def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(out[:, -1], target)  # the answer at the last position
    elif model == "patch_vit":
        net = PatchViT(in_channels=3, num_classes=10, attention=attention, seed=seed, **kw)
        x = torch.randn(batch, 3, kw["image_size"], kw["image_size"], generator=gen)
        y = torch.randint(0, 10, (batch,), generator=gen)
        loss_fn = torch.nn.functional.cross_entropy
    elif model == "hf_gpt2":
        net, x, y, loss_fn = _hf_gpt2_setup(attention, kw, batch, seed=seed, gen=gen)
    elif model in _CONVERTED:
        net, x, y, loss_fn = _converted_setup(model, attention, kw, batch, seed=seed, gen=gen)
    else:
        raise ValueError(f"bench: model {model!r} is unknown; use one of {TRAIN_MODELS + EXTRA_TRAIN_MODELS}.")
    return net.to(device), x.to(device), y.to(device), loss_fn


def _hf_gpt2_setup(attention: str, kw: dict[str, Any], batch: int, *, seed: int, gen: Any):
    """A randomly initialised HuggingFace GPT-2 LM, converted by ``stiefelize`` (``logit_gain="learn"``) for
    the stiefel arm; next-token loss on random tokens of the full context length."""
    import torch

    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as err:
        raise ValueError("bench: model 'hf_gpt2' needs HuggingFace transformers; install the models extra "
                         "(pip install -e '.[models]').") from err
    from ..convert import stiefelize

    torch.manual_seed(seed)
    config = GPT2Config(**kw, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    net = GPT2LMHeadModel(config)
    if attention == "stiefel":
        stiefelize(net, logit_gain="learn")
    x = torch.randint(0, kw["vocab_size"], (batch, kw["n_positions"]), generator=gen)

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        logits = out.logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1))
    return net, x, x.clone(), loss_fn


def _need(package: str | None, model: str) -> None:
    import importlib.util

    if package is not None and importlib.util.find_spec(package) is None:
        extra = "the models extra (pip install -e '.[models]')" if package == "transformers" else package
        raise ValueError(f"bench: model {model!r} needs {package}; install {extra}.")


def _lm_loss(logits: Any, target: Any) -> Any:
    import torch

    logits = logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1))


def _hf_llama(kw: dict[str, Any]) -> Any:
    import transformers

    w = kw["width"]
    cfg = transformers.LlamaConfig(vocab_size=kw["vocab_size"], hidden_size=w, intermediate_size=4 * w,
                                   num_hidden_layers=kw["depth"], num_attention_heads=kw["heads"],
                                   num_key_value_heads=max(1, kw["heads"] // 2),
                                   max_position_embeddings=kw["seq_len"], bos_token_id=0, eos_token_id=0,
                                   pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def _hf_bert(kw: dict[str, Any]) -> Any:
    import transformers

    w = kw["width"]
    cfg = transformers.BertConfig(vocab_size=kw["vocab_size"], hidden_size=w, intermediate_size=4 * w,
                                  num_hidden_layers=kw["depth"], num_attention_heads=kw["heads"],
                                  max_position_embeddings=kw["seq_len"], hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg)


def _hf_vit(kw: dict[str, Any]) -> Any:
    import transformers

    w = kw["width"]
    cfg = transformers.ViTConfig(image_size=kw["image_size"], patch_size=kw["patch_size"], hidden_size=w,
                                 intermediate_size=4 * w, num_hidden_layers=kw["depth"],
                                 num_attention_heads=kw["heads"], hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0, num_labels=10)
    return transformers.ViTForImageClassification(cfg)


def _timm_vit(kw: dict[str, Any]) -> Any:
    import timm

    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=kw["image_size"],
                             patch_size=kw["patch_size"], embed_dim=kw["width"], depth=kw["depth"],
                             num_heads=kw["heads"], num_classes=10)


def _torchvision_vit(kw: dict[str, Any]) -> Any:
    import torchvision

    w = kw["width"]
    return torchvision.models.VisionTransformer(image_size=kw["image_size"], patch_size=kw["patch_size"],
                                                num_layers=kw["depth"], num_heads=kw["heads"], hidden_dim=w,
                                                mlp_dim=4 * w, num_classes=10)


def _torch_encoder(kw: dict[str, Any]) -> Any:
    import torch
    from torch import nn

    w = kw["width"]

    class EncoderLM(nn.Module):
        """Token embedding, ``nn.TransformerEncoder`` (causal mask) and a linear head."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(kw["vocab_size"], w)
            layer = nn.TransformerEncoderLayer(w, kw["heads"], dim_feedforward=4 * w, dropout=0.0,
                                               batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, kw["depth"], enable_nested_tensor=False)
            self.head = nn.Linear(w, kw["vocab_size"])
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(kw["seq_len"]),
                                 persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(self.embed(x), mask=self.mask, is_causal=True))

    return EncoderLM()


#: converted model -> (builder from the settings, input kind: "tokens" or "images")
_CONVERTED: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "hf_llama": (_hf_llama, "tokens"), "hf_bert": (_hf_bert, "tokens"), "torch_encoder": (_torch_encoder, "tokens"),
    "hf_vit": (_hf_vit, "images"), "timm_vit": (_timm_vit, "images"), "torchvision_vit": (_torchvision_vit, "images"),
}


def _converted_setup(model: str, attention: str, kw: dict[str, Any], batch: int, *, seed: int, gen: Any):
    """A randomly initialised stock model (:data:`_CONVERTED`), converted by ``stiefelize``
    (``logit_gain="learn"``) for the stiefel arm; next-token loss on random tokens (``hf_bert``: the masked-LM
    head predicting every token), or classification of random images into 10 classes."""
    import torch

    from ..convert import stiefelize

    _need(MODEL_PACKAGES[model], model)
    build, kind = _CONVERTED[model]
    torch.manual_seed(seed)
    net = build(kw)
    if attention == "stiefel":
        stiefelize(net, logit_gain="learn")
    if kind == "images":
        x = torch.randn(batch, 3, kw["image_size"], kw["image_size"], generator=gen)
        y = torch.randint(0, 10, (batch,), generator=gen)

        def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(getattr(out, "logits", out), target)
        return net, x, y, loss_fn
    x = torch.randint(0, kw["vocab_size"], (batch, kw["seq_len"]), generator=gen)
    if model == "hf_bert":
        def bert_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), target.reshape(-1))
        return net, x, x.clone(), bert_loss
    return net, x, x.clone(), lambda out, target: _lm_loss(getattr(out, "logits", out), target)


def train_step_benchmark(
    models: tuple[str, ...] = TRAIN_MODELS,
    *,
    weight_decay: float = 0.1,
    scale: str = "default",
    autocast: str | None = None,
    settings: BenchSettings | None = None,
    **overrides: Any,
) -> list[TrainStepResult]:
    """Time a full training step (zero_grad, forward, loss, backward, optimizer step) of each model for the
    ``"adamw"`` arm (Euclidean attention, ``torch.optim.AdamW`` with its default implementation) and the
    ``"stiefel"`` arm (Stiefel attention, :class:`~geoopt_stiefel_attention.StiefelAdam`), both on
    ``param_groups(model, weight_decay)``, interleaved in one process. ``"hf_gpt2"`` (in
    :data:`EXTRA_TRAIN_MODELS`) is a HuggingFace GPT-2 whose stiefel arm is converted by
    :func:`~geoopt_stiefel_attention.stiefelize` (``logit_gain="learn"``): the cost of the converter's
    parametrization plus the Riemannian step.

    ``scale="default"`` uses :data:`TRAIN_SETTINGS` (the grokking and vision studies' default models; the
    grokking batch is 512 rather than the study's full batch, which only lowers the optimizer's share),
    ``scale="tiny"`` :data:`TINY_TRAIN_SETTINGS`, ``scale="w64"`` :data:`W64_TRAIN_SETTINGS` (every model at
    width 64, where the converted models' per-forward rebuild of W_Q/W_K weighs most). The converted models of
    :data:`EXTRA_TRAIN_MODELS` (GPT-2, Llama with grouped-query attention, BERT, HuggingFace/timm/torchvision
    ViT, ``nn.TransformerEncoder``) compare the stock model under AdamW with the same model converted by
    :func:`~geoopt_stiefel_attention.stiefelize` under StiefelAdam. The optimizer step is also timed on its own.
    ``autocast="bfloat16"`` (or ``"float16"``) runs forward and loss under ``torch.autocast`` on the device
    (parameters and optimizer stay float32: mixed precision the way torch users do it). ``settings`` (default
    ``BENCH_DEFAULTS["train"]``) and ``**overrides`` as in :func:`step_time_benchmark`; its ``dtype`` must
    stay ``"float32"``.

    Parameters
    ----------
    models : tuple of str, default TRAIN_MODELS
        Names from :data:`TRAIN_MODELS` and :data:`EXTRA_TRAIN_MODELS`.
    weight_decay : float, default 0.1
        Of both arms' optimizers, through :func:`~geoopt_stiefel_attention.param_groups`.
    scale : {"default", "tiny", "w64"}, default "default"
        Model sizes, as above.
    autocast : {"bfloat16", "float16"}, optional
        Mixed precision of forward and loss; ``None`` (the default) runs in float32.
    settings : BenchSettings, optional
        Default ``BENCH_DEFAULTS["train"]``.
    **overrides
        Fields of :class:`BenchSettings` replacing those of ``settings``.

    Returns
    -------
    list of TrainStepResult
        One per model, in the order given.
    """
    import torch

    from ..nn import param_groups
    from ..optim import StiefelAdam

    s = _settings("train", settings, overrides)
    if s.dtype != "float32":
        raise ValueError(f"bench: dtype={s.dtype!r}: the train benchmark trains float32 parameters; use "
                         f"autocast='bfloat16' or 'float16' for mixed precision.")
    device = s.device
    table = TRAIN_SCALES.get(scale)
    if table is None:
        raise ValueError(f"bench: scale={scale!r} is unknown; use one of {TRAIN_SCALE_NAMES}.")
    if autocast not in (None, "bfloat16", "float16"):
        raise ValueError(f"bench: autocast={autocast!r} is unknown; use None, 'bfloat16' or 'float16'.")
    amp = dict(device_type=torch.device(device).type, dtype=getattr(torch, autocast or "bfloat16"),
               enabled=autocast is not None)
    with torch_threads(s.threads):
        results = []
        for model in models:
            if model not in table:
                raise ValueError(f"bench: model {model!r} is unknown; use one of "
                                 f"{TRAIN_MODELS + EXTRA_TRAIN_MODELS}.")
            steps: dict[str, Callable[[], Any]] = {}
            opt_steps: dict[str, Callable[[], Any]] = {}
            forwards: dict[str, Callable[[], Any]] = {}
            for arm, attention in (("adamw", "euclidean"), ("stiefel", "stiefel")):
                net, x, y, loss_fn = _train_setup(model, attention, table[model], seed=s.seed, device=device)
                groups = param_groups(net, weight_decay=weight_decay, expect_frames=arm == "stiefel")
                opt = torch.optim.AdamW(groups, lr=s.lr) if arm == "adamw" else StiefelAdam(groups, lr=s.lr)

                def full(net=net, opt=opt, x=x, y=y, loss_fn=loss_fn) -> None:
                    opt.zero_grad(set_to_none=True)
                    with torch.autocast(**amp):
                        loss = loss_fn(net(x), y)
                    loss.backward()
                    opt.step()

                def forward(net=net, x=x, y=y, loss_fn=loss_fn) -> None:
                    with torch.autocast(**amp):
                        loss_fn(net(x), y)

                steps[arm], opt_steps[arm], forwards[arm] = full, opt.step, forward
            samples, _ = _interleave(steps, s, required=tuple(steps))
            # the optimizer alone, on the gradients of the last full step; the forward alone
            opt_samples, _ = _interleave(opt_steps, s, warmup=1, required=tuple(opt_steps))
            forward_samples, _ = _interleave(forwards, s, warmup=1, required=tuple(forwards))
            settings = dict(table[model])
            results.append(TrainStepResult(
                model=model, config={k: v for k, v in settings.items() if k != "batch"}, batch=settings["batch"],
                full_step={arm: _timing(arm, samples[arm]) for arm in steps},
                optimizer_step={arm: _timing(arm, opt_samples[arm]) for arm in opt_steps},
                ratio=_ratio(samples["stiefel"], samples["adamw"]), rounds=s.rounds, clock=s.clock,
                threads=torch.get_num_threads(), autocast=autocast,
                min_ratio=min(map(min, samples["stiefel"])) / min(map(min, samples["adamw"])),
                forward_step={arm: _timing(arm, forward_samples[arm]) for arm in forwards}))
        return results

@fill
def format_train_table(results: list[TrainStepResult]) -> str:
    """A Markdown table of full-step times per arm and the stiefel / adamw ratio (median over rounds, and of
    the fastest steps), with each arm's forward (and loss) alone where it was timed.

    Parameters
    ----------
    results : list of TrainStepResult
        From :func:`train_step_benchmark`.

    {{returns_table}}
    """
    lines = ["| model | batch | adamw step ms (optimizer ms) | stiefel step ms (optimizer ms) | stiefel / adamw "
             "| of fastest | forward ms, adamw / stiefel |",
             "|---|---|---|---|---|---|---|"]
    flagged = False
    for r in results:
        cells = [f"{r.full_step[a].median_ms:.2f} ({r.optimizer_step[a].median_ms:.2f})" for a in ("adamw", "stiefel")]
        cfg = ", ".join(f"{k}={v}" for k, v in r.config.items())
        flag = "†" if ratio_disagrees(r.full_step["stiefel"].median_ms, r.full_step["adamw"].median_ms, r.ratio) else ""
        flagged = flagged or bool(flag)
        fastest = "" if r.min_ratio is None else f"{r.min_ratio:.3f}"
        forward = ("" if r.forward_step is None else
                   f"{r.forward_step['adamw'].median_ms:.2f} / {r.forward_step['stiefel'].median_ms:.2f}")
        lines.append(f"| {r.model} ({cfg}) | {r.batch} | {cells[0]} | {cells[1]} | {r.ratio:.3f}{flag} | {fastest} "
                     f"| {forward} |")
    return "\n".join(lines + (["", DISAGREEMENT_NOTE] if flagged else []))
