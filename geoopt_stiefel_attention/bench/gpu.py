"""The prepared accelerator check (``stiefel-attention bench gpu``, ``benchmarks/gpu.sh``): every benchmark
at GPU sizes in a few minutes, as one JSON document."""

from __future__ import annotations

import importlib.util
import time
from dataclasses import asdict
from typing import Any

from .paths import BENCH_FRAMES, FrameSet, step_path_benchmark
from .records import as_record, machine_info, provenance
from .settings import BenchSettings, _interleave, _timing, torch_threads
from .step import CONFIGS, step_time_benchmark
from .train import train_step_benchmark

#: Sizes of :func:`accelerator_check`: the largest step-benchmark configuration and the issue's bench
#: shape (``"default"``, a GPU run of a few minutes), or a smoke test (``"tiny"``, seconds on a CPU).
CHECK_SCALES: dict[str, dict[str, Any]] = {
    "default": dict(width=max(CONFIGS), configs=CONFIGS, frames=BENCH_FRAMES, rounds=7),
    "tiny": dict(width=64, configs={64: (1, 2)}, frames=FrameSet(2, 2, 16, 4),
                 rounds=2),
}


def accelerator_check(device: str = "cuda", *, scale: str = "default", clock: str = "wall",
                      threads: int | None = None, compile_backend: str | None = "inductor",
                      seed: int = 0) -> dict[str, Any]:
    """The prepared accelerator check of issue #18 (``benchmarks/gpu.sh``; a few minutes on one GPU).

    1. ``step``: :func:`step_time_benchmark` at the largest configuration of :data:`CONFIGS`, StiefelAdam
       against ``AdamW(fused=True)``, ``geoopt-radam`` and the product floor, in float32 and bfloat16.
    2. ``paths``: :func:`step_path_benchmark` on :data:`BENCH_FRAMES`, default (on an accelerator:
       capturable, same-shaped frames batched into one call), per-parameter and compiled step against the
       product floor (``compile_backend=None`` leaves the compiled path out).
    3. ``train``: :func:`train_step_benchmark` under bfloat16 autocast, stiefel arm against the adamw arm, of
       a HuggingFace GPT-2 converted by :func:`~geoopt_stiefel_attention.stiefelize` (``"hf_gpt2"``) when
       ``transformers`` is installed, else TinyTransformer.
    4. ``retraction``: :func:`retraction_benchmark` on the same frames, float32.
    5. ``graphs``: :func:`graph_step_benchmark` on the same frames: the capturable StiefelAdam step eager and
       replayed from a CUDA graph (on CUDA only), StiefelMuon and torch's ``Muon`` on the same frames.

    The grokking study's epochs per second, which ``benchmarks/gpu.sh`` adds next, belong to the studies
    (:mod:`experiments.grokking.speed`): the benchmarks measure the library only.

    Returns a JSON-ready dict: the provenance (:func:`~.records.provenance`: format version, git commit),
    ``machine``, ``settings``, ``seconds`` (per part) and one entry per part.

    Parameters
    ----------
    device : str, default "cuda"
        Torch device of every part.
    scale : {"default", "tiny"}, default "default"
        Sizes and rounds, from :data:`CHECK_SCALES` (``"tiny"``: a quick run of the same parts).
    clock : {"wall", "cpu"}, default "wall"
        Clock of the timings.
    threads : int, optional
        ``torch.set_num_threads`` during the check; ``None`` leaves it.
    compile_backend : str or None, default "inductor"
        ``torch.compile`` backend of the compiled path; ``None`` leaves that path out.
    seed : int, default 0
        Seed of the random frames and data.

    Returns
    -------
    dict
        The JSON-ready result, as above.
    """

    if scale not in CHECK_SCALES:
        raise ValueError(f"bench: scale={scale!r} is unknown; use one of {tuple(CHECK_SCALES)}.")
    sizes = CHECK_SCALES[scale]
    rounds = sizes["rounds"]
    timing = dict(rounds=rounds, steps_per_round=3, warmup=2, device=device, clock=clock, threads=threads,
                  seed=seed)
    seconds: dict[str, float] = {}
    out: dict[str, Any] = {}

    t0 = time.perf_counter()
    out["step"] = [as_record(r) for dtype in ("float32", "bfloat16") for r in step_time_benchmark(
        (sizes["width"],), optimizers=("stiefel", "adamw_fused", "geoopt-radam", "matmul_floor"), dtype=dtype,
        configs=sizes["configs"], **timing)]
    seconds["step"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    paths = ("eager", "eager-per-param", "compiled", "matmul_floor") if compile_backend else (
        "eager", "eager-per-param", "matmul_floor")
    out["paths"] = [as_record(r) for r in step_path_benchmark(
        [sizes["frames"]], paths=paths, compile_backend=compile_backend or "inductor", **timing)]
    seconds["paths"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    model = "hf_gpt2" if importlib.util.find_spec("transformers") is not None else "tiny_transformer"
    out["train"] = [as_record(r) for r in train_step_benchmark(
        (model,), autocast="bfloat16", scale=scale, **timing)]
    seconds["train"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    out["retraction"] = retraction_benchmark(sizes["frames"], BenchSettings(**timing))
    seconds["retraction"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    out["graphs"] = graph_step_benchmark(sizes["frames"], BenchSettings(**timing))
    seconds["graphs"] = time.perf_counter() - t0
    with torch_threads(threads):  # the machine as the parts ran on it (torch_threads: the threads they used)
        machine = asdict(machine_info(device))
    return {**provenance(), "machine": machine, "settings": dict(scale=scale, **timing,
                                                                      compile_backend=compile_backend),
            "seconds": seconds, **out}


#: Spectral norm of the tangent step :func:`retraction_benchmark` retracts: beyond the Taylor series' reach, so every
#: path does its general work (the default rule's steps at width 768 reach 22).
RETRACTION_STEP_NORM = 1.0


def retraction_benchmark(frames: FrameSet, settings: BenchSettings) -> dict[str, Any]:
    r"""Time the polar retraction :math:`R_W(Z) = (W + Z)((W + Z)^\top (W + Z))^{-1/2}` of ``frames`` (one stack,
    float32, a tangent step of spectral norm :data:`RETRACTION_STEP_NORM` per frame) three ways on
    ``settings.device``, interleaved: ``eigh`` (the inverse square root by ``torch.linalg.eigh``, the CPU's path),
    ``newton-checked`` (:func:`~geoopt_stiefel_attention._linalg.inv_sqrt_checked`, the accelerators' path), and
    ``geoopt-qr`` (stock geoopt's ``EuclideanStiefel.retr``, a QR factorisation). Also returns the largest
    distance of the two polar results from each other and from orthonormality.
    """
    import geoopt
    import torch

    from .. import _linalg

    gen = torch.Generator(device=settings.device).manual_seed(settings.seed)
    like = dict(dtype=torch.float32, device=settings.device)
    w = torch.linalg.qr(torch.randn(frames.params * frames.heads, frames.d, frames.r, generator=gen, **like)).Q
    z = _linalg.proju(w, torch.randn(w.shape, generator=gen, **like))
    z = z * (RETRACTION_STEP_NORM / torch.linalg.matrix_norm(z, ord=2).unsqueeze(-1).unsqueeze(-1))
    y = w + z

    def polar_by(inv_sqrt):
        return lambda: y @ inv_sqrt(y.mT @ y)

    steps = {"eigh": polar_by(_linalg.inv_sqrt_spd), "newton-checked": polar_by(_linalg.inv_sqrt_checked),
             "geoopt-qr": lambda: geoopt.EuclideanStiefel().retr(w, z)}
    with torch_threads(settings.threads), torch.no_grad():
        samples, failed = _interleave(steps, settings, required=("eigh", "newton-checked"))
        a, b = steps["eigh"](), steps["newton-checked"]()
    eye = torch.eye(frames.r, **like)
    return {"frames": asdict(frames), "step_norm": RETRACTION_STEP_NORM,
            "timings": {k: asdict(_timing(k, v)) for k, v in samples.items()}, "failed": failed,
            "max_abs_difference": float((a - b).abs().max()),
            "orthonormality_error": {"eigh": float((a.mT @ a - eye).abs().max()),
                                     "newton-checked": float((b.mT @ b - eye).abs().max())}}


#: Entries of :func:`graph_step_benchmark`; ``"stiefel-adam-graph"`` runs on CUDA only.
GRAPH_STEPS = ("stiefel-adam-capturable", "stiefel-adam-graph", "stiefel-muon", "torch-muon")


def _capture(step: Any, device: str) -> Any:
    """``step`` captured in a :class:`torch.cuda.CUDAGraph` (after three warm-up calls on a side stream, as
    torch's CUDA-graph notes require), returned as the graph's ``replay``. CUDA only."""
    import torch

    if not (device.startswith("cuda") and torch.cuda.is_available()):
        raise RuntimeError(f"CUDA graphs need a CUDA device; device is {device!r}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def graph_step_benchmark(frames: FrameSet, settings: BenchSettings) -> dict[str, Any]:
    """Time one optimizer step on ``frames`` (float32, fixed gradients), interleaved (:data:`GRAPH_STEPS`):
    StiefelAdam with ``capturable=True`` run eagerly and, on CUDA, replayed from a CUDA graph captured once
    (:func:`_capture`); StiefelMuon; torch's ``torch.optim.Muon`` on the same frames (one 2-D ``d x r``
    parameter per head, as it requires; ``adjust_lr_fn="match_rms_adamw"``). Off CUDA the graph entry is
    reported as skipped (``"skipped"``), and everything else runs: the CPU smoke test of ``benchmarks/gpu.sh``.
    Returns the timings, the ratios to the eager capturable step and, on CUDA, the largest difference between
    frames stepped by the graph and eagerly from the same start (``graph_max_abs_difference``).
    """
    import geoopt
    import torch

    from ..manifolds import PolarStiefel
    from ..optim import StiefelAdam, StiefelMuon

    device = settings.device
    gen = torch.Generator().manual_seed(settings.seed)
    st = PolarStiefel()
    start = [st.random(frames.heads, frames.d, frames.r, generator=gen).as_subclass(torch.Tensor)
             for _ in range(frames.params)]
    grads = [torch.randn(w.shape, generator=gen).to(device) for w in start]

    def params() -> list[Any]:
        return [geoopt.ManifoldParameter(w.clone().to(device), manifold=st) for w in start]

    def stepper(opt: Any, ps: list[Any], gs: list[Any]) -> Any:
        for p, g in zip(ps, gs, strict=True):
            p.grad = g  # fixed gradients: the step reads them in place (graph replays see the same tensors)
        return opt.step

    steps: dict[str, Any] = {}
    eager_ps = params()
    steps["stiefel-adam-capturable"] = stepper(StiefelAdam(eager_ps, lr=settings.lr, capturable=True), eager_ps,
                                               grads)
    skipped = None
    graph_ps = None
    if device.startswith("cuda") and torch.cuda.is_available():
        graph_ps = params()
        steps["stiefel-adam-graph"] = _capture(
            stepper(StiefelAdam(graph_ps, lr=settings.lr, capturable=True), graph_ps, grads), device)
    else:
        skipped = "skipped: CUDA graphs need a CUDA device"
    muon_ps = params()
    steps["stiefel-muon"] = stepper(StiefelMuon(muon_ps, lr=settings.lr), muon_ps, grads)
    flat = [torch.nn.Parameter(h.clone().to(device)) for w in start for h in w]
    flat_grads = [h for g in grads for h in g]
    steps["torch-muon"] = stepper(torch.optim.Muon(flat, lr=settings.lr, adjust_lr_fn="match_rms_adamw"), flat,
                                  flat_grads)
    with torch_threads(settings.threads):
        samples, failed = _interleave(steps, settings, required=("stiefel-adam-capturable",))
    timings = {k: asdict(_timing(k, v)) for k, v in samples.items()}
    base = timings["stiefel-adam-capturable"]["median_ms"]
    doc: dict[str, Any] = {"frames": asdict(frames), "timings": timings, "failed": failed,
                           "ratio_to_capturable": {k: t["median_ms"] / base for k, t in timings.items()},
                           "graph": skipped or "captured"}
    if graph_ps is not None:  # the graph steps what the eager step steps: same start, same gradients
        check_ps = params()
        check = StiefelAdam(check_ps, lr=settings.lr, capturable=True)
        ref_ps = params()
        replay = _capture(stepper(StiefelAdam(ref_ps, lr=settings.lr, capturable=True), ref_ps, grads), device)
        for p, g in zip(check_ps, grads, strict=True):
            p.grad = g
        for _ in range(4):  # _capture ran 3 warm-up steps and the captured one ran none: 3 + 1 replay
            check.step()
        replay()
        torch.cuda.synchronize()
        doc["graph_max_abs_difference"] = max(float((a - b).abs().max()) for a, b in zip(check_ps, ref_ps,
                                                                                        strict=True))
    return doc


def format_check(doc: dict[str, Any]) -> str:
    """A short plain-text summary of :func:`accelerator_check`'s result.

    Parameters
    ----------
    doc : dict
        What :func:`accelerator_check` returned (or its JSON file, loaded).

    Returns
    -------
    str
        The summary, a few lines: one per part of the check.
    """
    lines = [f"accelerator check on {doc['machine']['device']} ({doc['machine']['cpu']}), "
             f"torch {doc['machine']['torch']}, scale {doc['settings']['scale']}"]
    for r in doc["step"]:
        t = r["timings"]
        cells = ", ".join(f"{a} {t[a]['note']}" if t[a]["note"] else f"{a} {t[a]['median_ms']:.3f} ms" for a in t)
        ratios = [f"StiefelAdam / AdamW fused {r['ratios']['adamw_fused']:.2f}" if "adamw_fused" in r["ratios"] else "",
                  f"speed-up vs geoopt-radam {1 / r['ratios']['geoopt-radam']:.2f}x"
                  if "geoopt-radam" in r["ratios"] else ""]
        lines.append(f"step {r['dtype']} width {r['width']}: {cells}; " + ", ".join(x for x in ratios if x))
    for r in doc["paths"]:
        cells = ", ".join(f"{a} {x:.2f}x floor" for a, x in r["floor_ratio"].items())
        lines.append(f"paths {FrameSet(**r['frames']).label}: floor {r['timings']['matmul_floor']['median_ms']:.3f} ms; "
                     f"{cells}" + (f"; compiled in {r['compile_s']:.1f} s" if r["compile_s"] is not None else ""))
    for r in doc["train"]:
        lines.append(f"train {r['model']} ({r['autocast']} autocast): adamw {r['full_step']['adamw']['median_ms']:.2f}"
                     f" ms, stiefel {r['full_step']['stiefel']['median_ms']:.2f} ms, stiefel / adamw {r['ratio']:.3f}")
    rt = doc.get("retraction")  # absent from the checks run before it was added
    if rt is not None:
        cells = ", ".join(f"{k} {v['median_ms']:.3f} ms" for k, v in rt["timings"].items())
        lines.append(f"retraction {FrameSet(**rt['frames']).label}, float32, |Z|_2 = {rt['step_norm']}: {cells}; "
                     f"eigh vs newton-checked {rt['max_abs_difference']:.1e}")
    gr = doc.get("graphs")  # absent from the checks run before it was added
    if gr is not None:
        cells = ", ".join(f"{k} {v['median_ms']:.3f} ms" for k, v in gr["timings"].items())
        lines.append(f"graphs {FrameSet(**gr['frames']).label}: {cells}; StiefelAdam graph: {gr['graph']}")
    g = doc.get("grokking")  # added by experiments/speed.py (benchmarks/gpu.sh) after the library's parts
    if g is not None:
        lines.append(f"grokking, {g['epochs']} epochs: " + ", ".join(f"{a} {v:.1f} epochs/s"
                                                                   for a, v in g["epochs_per_second"].items()))
    lines.append("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in doc["seconds"].items()))
    return "\n".join(lines)
