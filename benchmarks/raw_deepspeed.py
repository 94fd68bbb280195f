"""Hand-written DeepSpeed baseline for ``benchmarks/overhead.py --backend deepspeed`` (no distkit).

Launch under torchrun (or the deepspeed launcher)::

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 benchmarks/raw_deepspeed.py \
        --zero-stage 2 --steps 100 --times out.json

The workload is the same as ``raw_ddp.py`` and distkit's ``charlm`` task: same seed and initial
parameters, plain SGD passed to ``deepspeed.initialize`` as a client optimizer, same per-rank
batch (DeepSpeed's ``train_micro_batch_size_per_gpu``), same ``shard`` data order, no clipping
(``gradient_clipping`` 0; DeepSpeed's default would be 1.0), no accumulation. The DeepSpeed
config is exactly what distkit's deepspeed backend resolves for
``{"zero_optimization": {"stage": S}}``, so the final ``param_checksum`` equals distkit's.

Per step rank 0 records ``perf_counter`` / ``process_time`` before fetching the batch and after
``engine.step()``; it writes ``{"impl": "raw_deepspeed", "starts", "ends", "cpu_starts", "cpu_ends",
"final_loss", "param_checksum", ...}`` to ``--times`` (the same keys as ``raw_ddp.py``).
"""
from __future__ import annotations

import argparse
import datetime
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distkit.evaluation import param_checksum
from workload import RawLoop, add_workload_arguments, pin_rank, run_and_record, seeded_charlm, shard_batches


def build(args: argparse.Namespace, rank: int, world: int) -> RawLoop:
    """The textbook DeepSpeed step (``deepspeed.init_distributed`` already called): the model seeded with
    ``args.seed``, plain SGD, ``deepspeed.initialize`` with ZeRO stage ``args.zero_stage`` and DeepSpeed's
    default buckets, ``engine.backward``/``engine.step``, the ``shard`` data order."""
    train, model = seeded_charlm(args)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    config = {"zero_optimization": {"stage": args.zero_stage}, "train_micro_batch_size_per_gpu": args.batch_size,
              "gradient_accumulation_steps": 1, "train_batch_size": args.batch_size * world,
              "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    batch = shard_batches(*train.tensors, args.seed, args.batch_size, rank, world)

    def step(i: int) -> torch.Tensor:
        x, y = batch(i)
        logits = engine(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        engine.backward(loss)
        engine.step()
        return loss

    def checksum() -> str:
        if args.zero_stage == 3:
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
                return param_checksum(engine.module.named_parameters())
        return param_checksum(engine.module.named_parameters())

    return RawLoop(step, checksum)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(ap)
    ap.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0,
                    help="accepted for overhead.py's common command line; DeepSpeed's buckets keep their defaults "
                         "on both sides")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help="passed by the deepspeed launcher")
    args = ap.parse_args()
    pin_rank()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    run_and_record(build(args, rank, world), args, "raw_deepspeed", rank, world, zero_stage=args.zero_stage)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
