"""A torchrun script of your own that is one Decoupled DiLoCo learner, its model plain,
wrapped in DDP or sharded by FSDP2 (``--wrap``). Learners wrapped differently train one
model: the syncer knows every tensor by its name in the unwrapped module.

Start a syncer, then learners of any layout (each on its own machines, or all on one):

    export DDILOCO_TOKEN=secret
    ddiloco syncer --port 50051 &
    python examples/torchrun_learner.py --syncer 127.0.0.1:50051 --learner 0 &
    torchrun --nproc-per-node 2 examples/torchrun_learner.py --syncer 127.0.0.1:50051 \\
        --learner 1 --wrap ddp &
    torchrun --nproc-per-node 2 examples/torchrun_learner.py --syncer 127.0.0.1:50051 \\
        --learner 2 --wrap fsdp

The model is ddiloco's small built-in GPT and the data are counting sequences made here,
so nothing is downloaded. The lines that add Decoupled DiLoCo are marked. Every rank prints
one JSON line at the end: its rank, steps, first and last loss, what it sent, and the sum
of the parameters it holds (the replicas of an island hold the same).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from ddiloco import DecoupledLearner, exit_island_rank  # Decoupled DiLoCo
from ddiloco.models import build_model

VOCAB, SEQ, BATCH = 64, 32, 8


def counting_batches(seed: int):
    """Sequences x_{i+1} = x_i + k (mod VOCAB) as (x, y), forever; one seed per rank."""
    g = torch.Generator().manual_seed(seed)
    while True:
        ids = (
            torch.randint(0, VOCAB, (BATCH, 1), generator=g)
            + torch.randint(1, 4, (BATCH, 1), generator=g) * torch.arange(SEQ + 1)
        ) % VOCAB
        yield ids[:, :-1], ids[:, 1:]


def wrap(model: torch.nn.Module, how: str) -> torch.nn.Module:
    """The model as this rank trains it: plain, DDP over the world, or FSDP2-sharded over
    it (``hsdp``: a 2 x (world / 2) mesh, replicas of shards)."""
    if how == "plain":
        return model
    if how == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if how == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--syncer", required=True)
    ap.add_argument("--learner", type=int, required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--wrap", choices=("plain", "ddp", "fsdp", "hsdp"), default="plain")
    ap.add_argument("--codec", default="bf16")
    args = ap.parse_args()
    torch.set_num_threads(1)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if args.wrap != "plain":
        dist.init_process_group("gloo")
    torch.manual_seed(0)  # every learner starts from the same model
    model = wrap(build_model("gpt_tiny", vocab_size=VOCAB, block_size=SEQ), args.wrap)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = counting_batches(seed=args.learner * 100 + rank)
    losses = []
    with DecoupledLearner(  # Decoupled DiLoCo: the island's ranks are found by the hook
        model, opt, syncer=args.syncer, learner=args.learner, P=4, H=8, tau=2,
        codec=args.codec, tokens_per_step=BATCH * SEQ * world, load_global_on_exit=True,
    ) as dl:  # fmt: skip
        for _ in range(args.steps):
            x, y = next(data)
            loss = model(x, y)[1]
            loss.backward()
            opt.step()  # the hook runs after every optimizer step
            opt.zero_grad()
            losses.append(float(loss.detach()))
            if dl.should_stop:
                break
    report = dl.report()
    local = [t.to_local() if hasattr(t, "to_local") else t for t in model.parameters()]
    line = json.dumps(
        {
            "rank": rank,
            "world": world,
            "wrap": args.wrap,
            "steps": len(losses),
            "first_loss": losses[0],
            "last_loss": sum(losses[-10:]) / len(losses[-10:]),
            # this rank's own traffic (rank 0's report sums its island's ranks)
            "bytes_sent": dl.stats["bytes_sent"],
            "pushes": dl.stats["pushes"],
            "pushes_accepted": dl.stats["pushes_accepted"],
            "installs": report["installs"],
            "loaded_global": dl.loaded_global_on_exit,
            "rank_bytes_sent": report.get("rank_bytes_sent"),
            "local_sum": float(sum(t.detach().double().sum() for t in local)),
        }
    )
    # one write per line: the ranks share one stdout, and print's two writes (the text,
    # then the newline) can interleave with another rank's line
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    if dist.is_initialized():
        dist.destroy_process_group()
        # leave without interpreter finalization, where Gloo's worker threads, which DDP
        # keeps alive past destroy_process_group, can abort the rank (SIGABRT)
        exit_island_rank()


if __name__ == "__main__":
    main()
