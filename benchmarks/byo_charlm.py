"""charlm through distkit's bring-your-own-loop API, for ``benchmarks/overhead.py --path byo``.

A user-style training script: ``distkit.init`` / ``dk.setup`` / ``dk.dataloader`` /
``dk.backward`` / ``dk.step`` around the user's own loop. The engine (ddp, deepspeed, horovod,
mpi) comes only from distkit's command line or config files, never from this script::

    torchrun --standalone --nproc_per_node 2 benchmarks/byo_charlm.py --steps 100 --times out.json \\
        ++device cpu ++distributed "{'backend': 'ddp', 'reduce_type': 'grad', 'pg_backend': 'gloo'}"
    mpirun -np 2 python benchmarks/byo_charlm.py --steps 100 --times out.json \\
        ++device cpu ++distributed "{'backend': 'mpi', 'reduce_type': 'grad'}"

The workload is exactly the hand-written baselines' (``raw_ddp.py``, ``raw_horovod.py``,
``raw_mpi.py``, ``raw_deepspeed.py``): distkit's ``charlm`` model and data, torch seeded with
distkit's ``seed`` (``++seed``, default 42; ``distkit.init`` seeds before the model is built, as
the raw scripts do), plain SGD, ``--batch-size`` per rank, the ``shard`` order of
``dk.dataloader(..., shuffle=True)`` (one ``randperm`` per epoch seeded ``seed * 1_000_003 +
epoch``, rank r takes slice r of each global batch). So with the same engine settings the final
parameters equal the raw script's bit for bit (``param_checksum``).

Timing as in the raw scripts: rank 0 takes ``perf_counter`` / ``process_time`` before pulling a
step's batch from the loader's iterator and after ``dk.step()`` (optimizer step + zero_grad), and
writes ``{"impl": "distkit_byo", "starts", "ends", "cpu_starts", "cpu_ends", "final_loss",
"param_checksum", ...}`` to ``--times``; ``summary`` holds part of ``dk.summary()`` (taken after
the timed loop).
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

import distkit
from distkit.tasks.charlm import SIZES, CharTransformer, datasets
from workload import add_workload_arguments, pin_rank


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(ap, seed=False)  # the seed is distkit's own (++seed)
    distkit.add_arguments(ap)  # --config, ++key value, --nprocs, --deepspeed, --deepspeed_config, --local_rank
    args = ap.parse_args()
    pin_rank()

    # batch_size also goes into the config: DeepSpeed's train_micro_batch_size_per_gpu is taken from it.
    dk = distkit.init(args, batch_size=args.batch_size)
    train, _, vocab = datasets(args.seq_len)
    width, layers, heads = SIZES[args.size]
    model = CharTransformer(vocab, args.seq_len, width, layers, heads)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    model, optimizer = dk.setup(model, optimizer)
    loader = dk.dataloader(train, batch_size=args.batch_size, shuffle=True)
    steps_per_epoch = len(loader)

    starts, ends, cpu_starts, cpu_ends = [], [], [], []
    batches, epoch = None, -1
    for step in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        if step // steps_per_epoch != epoch:  # a new epoch: its order, a fresh iterator
            epoch = step // steps_per_epoch
            loader.set_epoch(epoch)
            batches = iter(loader)
        x, y = next(batches)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        dk.backward(loss)
        dk.step()
        ends.append(time.perf_counter())
        cpu_ends.append(time.process_time())
        starts.append(t0)
        cpu_starts.append(c0)

    dk.finish()
    summary = dk.summary()  # param_checksum: the bare model's parameters, gathered under ZeRO-3
    checksum = summary["param_checksum"]
    if dk.is_main:
        with open(args.times, "w") as f:
            json.dump({"impl": "distkit_byo", "rank": dk.rank, "world_size": dk.world_size, "starts": starts,
                       "ends": ends, "cpu_starts": cpu_starts, "cpu_ends": cpu_ends,
                       "final_loss": loss.item(), "param_checksum": checksum,
                       "torch_threads": torch.get_num_threads(),
                       "summary": {k: summary[k] for k in ("backend", "backend_impl", "launcher", "world_size",
                                                           "zero_stage", "steps", "param_checksum",
                                                           "ranks_in_sync", "wall_time_s", "compute_fraction")}},
                      f)
    dk.close()


if __name__ == "__main__":
    main()
