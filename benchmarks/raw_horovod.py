"""Hand-written Horovod baseline for ``benchmarks/overhead.py --backend horovod`` (no distkit).

Launch under mpirun::

    mpirun -np 2 python benchmarks/raw_horovod.py --steps 100 --times out.json

The textbook Horovod loop: ``hvd.init()``, ``hvd.broadcast_parameters(model.state_dict())``,
``hvd.DistributedOptimizer(SGD, named_parameters=...)`` (its hooks start each gradient's
all-reduce, ``hvd.Average``, as soon as backward produces it; Horovod's background thread
fuses them), ``loss.backward()``, ``opt.step()`` (waits for the all-reduces), ``opt.zero_grad()``.

The workload is distkit's ``charlm`` task, as in ``raw_ddp.py``: same seed and initial
parameters, SGD, per-rank batch, ``shard`` data order. distkit's horovod backend runs the same
Horovod calls, so the final ``param_checksum`` must equal distkit's.

Rank 0 records ``perf_counter`` / ``process_time`` before fetching each step's batch and after
``zero_grad`` and writes them to ``--times`` (the same keys as ``raw_ddp.py``).
"""
from __future__ import annotations

import argparse
import json
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from distkit.evaluation import param_checksum
from distkit.tasks.charlm import SIZES, CharTransformer, datasets
from workload import add_workload_arguments, pin_rank




def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(ap)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0, help="accepted for overhead.py's command line; unused")
    args = ap.parse_args()
    pin_rank()

    hvd.init()
    rank, world = hvd.rank(), hvd.size()

    torch.manual_seed(args.seed)
    train, _, vocab = datasets(args.seq_len)
    width, layers, heads = SIZES[args.size]
    model = CharTransformer(vocab, args.seq_len, width, layers, heads)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr),
                                   named_parameters=model.named_parameters(), op=hvd.Average)
    xs, ys = train.tensors
    global_batch = args.batch_size * world
    steps_per_epoch = len(xs) // global_batch

    starts, ends, cpu_starts, cpu_ends = [], [], [], []
    perm, perm_epoch = None, -1
    for step in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        epoch, s = divmod(step, steps_per_epoch)
        if epoch != perm_epoch:
            perm = torch.randperm(len(xs), generator=torch.Generator().manual_seed(args.seed * 1_000_003 + epoch))
            perm_epoch = epoch
        idx = perm[s * global_batch + rank * args.batch_size:][:args.batch_size]
        x, y = xs[idx], ys[idx]
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()  # Horovod's hooks start the all-reduces
        opt.step()       # synchronize(), then SGD
        opt.zero_grad()
        ends.append(time.perf_counter())
        cpu_ends.append(time.process_time())
        starts.append(t0)
        cpu_starts.append(c0)

    checksum = param_checksum(model.named_parameters())
    if rank == 0:
        with open(args.times, "w") as f:
            json.dump({"impl": "raw_horovod", "rank": rank, "world_size": world, "starts": starts, "ends": ends,
                       "cpu_starts": cpu_starts, "cpu_ends": cpu_ends,
                       "final_loss": loss.item(), "param_checksum": checksum,
                       "torch_threads": torch.get_num_threads()}, f)
    hvd.shutdown()


if __name__ == "__main__":
    main()
