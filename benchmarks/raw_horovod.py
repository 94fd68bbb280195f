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

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from distkit.evaluation import param_checksum
from workload import RawLoop, parse_baseline_args, run_and_record, seeded_charlm, shard_batches


def build(args: argparse.Namespace, names: str = "") -> RawLoop:
    """The textbook Horovod step (``hvd.init()`` already called): the model seeded with ``args.seed``,
    ``hvd.broadcast_parameters``, ``hvd.DistributedOptimizer(SGD, named_parameters=..., op=hvd.Average)``, the
    ``shard`` data order. ``names`` prefixes Horovod's tensor names (a second model in the same job, as in
    ``interleaved.py``, must not reuse the first one's)."""
    rank, world = hvd.rank(), hvd.size()
    train, model = seeded_charlm(args)
    hvd.broadcast_parameters({names + k: v for k, v in model.state_dict().items()}, root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr),
                                   named_parameters=[(names + k, p) for k, p in model.named_parameters()],
                                   op=hvd.Average)
    batch = shard_batches(*train.tensors, args.seed, args.batch_size, rank, world)

    def step(i: int) -> torch.Tensor:
        x, y = batch(i)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()  # Horovod's hooks start the all-reduces
        opt.step()       # synchronize(), then SGD
        opt.zero_grad()
        return loss

    return RawLoop(step, lambda: param_checksum(model.named_parameters()))


def main() -> None:
    args = parse_baseline_args(__doc__.splitlines()[0])

    hvd.init()
    run_and_record(build(args), args, "raw_horovod", hvd.rank(), hvd.size())
    hvd.shutdown()


if __name__ == "__main__":
    main()
