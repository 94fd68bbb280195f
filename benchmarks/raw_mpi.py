"""Hand-written mpi4py baseline for ``benchmarks/overhead.py --backend mpi`` (no distkit, no torch.distributed).

Launch under mpirun::

    mpirun -np 2 python benchmarks/raw_mpi.py --steps 100 --times out.json

The simplest correct data-parallel loop over MPI: after ``loss.backward()`` every gradient is
all-reduced on its own, blocking, ``Allreduce(IN_PLACE)`` on the gradient's numpy view (no
copy), then divided by the world size, then plain SGD steps. Parameters start from rank 0's
(one ``Bcast`` per tensor, as distkit does).

The workload is distkit's ``charlm`` task, as in ``raw_ddp.py``: same seed and initial
parameters, SGD, per-rank batch, ``shard`` data order. For two ranks the sum a+b is the same
float whatever the grouping, so the final parameters equal distkit's mpi engine (bucketed,
overlapped ``Iallreduce``, then divide) bit for bit; the benchmark checks ``param_checksum``.

Rank 0 records ``perf_counter`` / ``process_time`` before fetching each step's batch and after
``zero_grad`` and writes them to ``--times`` (the same keys as ``raw_ddp.py``).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from mpi4py import MPI

from distkit.evaluation import param_checksum
from workload import RawLoop, parse_baseline_args, run_and_record, seeded_charlm, shard_batches


def build(args: argparse.Namespace, comm: "MPI.Comm") -> RawLoop:
    """The hand-written mpi4py step on ``comm`` (MPI already initialized): the model seeded with ``args.seed``,
    parameters from rank 0 (one ``Bcast`` per tensor), a blocking in-place ``Allreduce`` per gradient then the
    division by the world size, plain SGD, the ``shard`` data order."""
    rank, world = comm.Get_rank(), comm.Get_size()
    train, model = seeded_charlm(args)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            comm.Bcast(t.detach().reshape(-1).numpy(), root=0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=args.lr)
    batch = shard_batches(*train.tensors, args.seed, args.batch_size, rank, world)

    def step(i: int) -> torch.Tensor:
        x, y = batch(i)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        for p in params:  # one blocking all-reduce per gradient, in place on its memory
            comm.Allreduce(MPI.IN_PLACE, p.grad.reshape(-1).numpy(), op=MPI.SUM)
            p.grad.div_(world)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return RawLoop(step, lambda: param_checksum(model.named_parameters()))


def main() -> None:
    args = parse_baseline_args(__doc__.splitlines()[0])

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    run_and_record(build(args, comm), args, "raw_mpi", rank, world)


if __name__ == "__main__":
    main()
