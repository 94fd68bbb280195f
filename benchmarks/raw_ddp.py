"""Hand-written torch DDP baseline for ``benchmarks/overhead.py`` (nanoGPT style, no distkit).

Launch under torchrun::

    torchrun --standalone --nproc_per_node 2 benchmarks/raw_ddp.py --steps 100 --times out.json

The workload is distkit's ``charlm`` task (model class and dataset builder are imported: they
are the workload, not the framework): same seed, same initial parameters, same plain SGD,
same per-rank batch, same ``shard`` data order (one global permutation per epoch, seeded
``seed * 1_000_003 + epoch``, rank r takes the r-th slice of each global batch) and the same
DDP ``bucket_cap_mb``. So after N steps its parameters equal distkit's bit for bit, which the
benchmark checks through ``param_checksum``.

Each rank records ``time.perf_counter()`` (and ``time.process_time()``, this process's CPU
time over all its threads) before fetching a step's batch and after ``zero_grad``; rank 0
writes ``{"starts": [...], "ends": [...], "cpu_starts": [...], "cpu_ends": [...], ...}``
to ``--times``.
"""
from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from distkit.evaluation import param_checksum
from workload import RawLoop, add_workload_arguments, pin_rank, run_and_record, seeded_charlm, shard_batches


def build(args: argparse.Namespace, rank: int, world: int) -> RawLoop:
    """The hand-written DDP step on the default process group (already initialized): the model seeded with
    ``args.seed``, wrapped in ``DDP(bucket_cap_mb=...)``, plain SGD, the ``shard`` data order."""
    train, bare = seeded_charlm(args)
    model = DDP(bare, bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    batch = shard_batches(*train.tensors, args.seed, args.batch_size, rank, world)

    def step(i: int) -> torch.Tensor:
        x, y = batch(i)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()  # DDP all-reduces gradient buckets during backward
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return RawLoop(step, lambda: param_checksum(model.module.named_parameters()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(ap)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    args = ap.parse_args()
    pin_rank()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    run_and_record(build(args, rank, world), args, "raw_ddp", rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
