"""Per-rank memory of the attention frames, replicated (DDP) versus sharded by whole heads (FSDP2).

For each world size in ``--ranks`` the script spawns that many gloo processes on the CPU, builds the same
``TinyTransformer`` with Stiefel attention on each (GPT-2-small geometry by default: width 768, 12 layers,
12 heads of 64, float32), wraps it in ``DistributedDataParallel`` (every frame replicated on every rank) or
shards it with ``fully_shard_by_heads`` (frames ``(heads, width, head_dim)`` sharded along the head
dimension), runs one training step with ``StiefelAdam`` and measures, on every rank, the bytes of the frame
tensors it holds: the local shards of the parameters, of their gradients and of their optimizer state
(``distributed.local_frame_bytes``: ``numel * element_size`` of each local tensor). It prints the largest
per-rank figure over the ranks, in MiB, as a markdown table (``--json``: every rank's figures).

Example (the table in docs/distributed.rst and the README)::

    python benchmarks/fsdp_memory.py --ranks 2 4
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from geoopt_stiefel_attention import StiefelAdam, TinyTransformer, param_groups
from geoopt_stiefel_attention.distributed import fully_shard_by_heads, local_frame_bytes

VOCAB, SEQ, BATCH_PER_RANK = 64, 16, 2


def _model(args) -> TinyTransformer:
    return TinyTransformer(VOCAB, SEQ, width=args.width, depth=args.depth, heads=args.heads, mlp=4 * args.width,
                           attention="stiefel", seed=0, dtype=torch.float32)


def _worker(rank: int, world: int, port: int, args, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(rank)
        x = torch.randint(0, VOCAB, (BATCH_PER_RANK, SEQ), generator=g)
        figures = {}
        for layout in ("replicated", "head-sharded"):
            model = _model(args)
            if layout == "replicated":
                forward = torch.nn.parallel.DistributedDataParallel(model)
            else:
                forward = fully_shard_by_heads(model, submodules=list(model.blocks))
            opt = StiefelAdam(param_groups(model), lr=1e-3)
            F.cross_entropy(forward(x).reshape(-1, VOCAB), x.reshape(-1)).backward()
            opt.step()
            figures[layout] = local_frame_bytes(model, opt)
            del forward, model, opt
        torch.save(figures, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, args) -> list[dict]:
    """Every rank's ``{layout: local_frame_bytes}`` for ``world`` gloo processes."""
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(world, _free_port(), args, out), nprocs=world, join=True)
        return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]


def _table(results: dict[int, list[dict]], args) -> str:
    mib = 2.0**20
    frames = 2 * args.depth * args.width * args.width  # query and key frames, heads * head_dim = width columns
    lines = [f"Frames of a width-{args.width}, {args.depth}-layer, {args.heads}-head model ({frames:,} float32 "
             f"entries in W_Q, W_K); largest per-rank MiB over the ranks, measured after one step.", "",
             "| ranks | layout | params | grads | optimizer state | total | vs replicated |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for world, ranks in results.items():
        base = max(r["replicated"]["total"] for r in ranks)
        for layout in ("replicated", "head-sharded"):
            worst = {key: max(r[layout][key] for r in ranks) for key in ("params", "grads", "state", "total")}
            lines.append(f"| {world} | {layout} | {worst['params'] / mib:.2f} | {worst['grads'] / mib:.2f} | "
                         f"{worst['state'] / mib:.2f} | {worst['total'] / mib:.2f} | {worst['total'] / base:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes to measure")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--json", action="store_true", help="print every rank's figures as JSON")
    args = parser.parse_args(argv)
    for name in ("width", "depth", "heads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if any(n < 1 for n in args.ranks):
        parser.error("--ranks must be >= 1")
    results = {world: measure(world, args) for world in args.ranks}
    print(json.dumps({str(k): v for k, v in results.items()}, indent=1) if args.json else _table(results, args))


if __name__ == "__main__":
    main()
