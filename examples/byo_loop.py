"""Bring your own loop: a plain PyTorch training script that runs on every distkit engine and mode.

The loop is yours; the engine (ddp, deepspeed, horovod, mpi) and the mode (grad, param) come
from the command line or a config file only. The model is a small MLP on scikit-learn's
8x8 handwritten digits.

    python examples/byo_loop.py                                   # 1 process
    python examples/byo_loop.py --nprocs 2                        # DDP, 2 ranks (distkit starts them)
    torchrun --nproc_per_node 2 examples/byo_loop.py --deepspeed --deepspeed_config configs/ds_byo.json
    deepspeed --num_gpus 2 examples/byo_loop.py --deepspeed_config configs/ds_byo.json
    mpirun -np 2 python examples/byo_loop.py ++use_horovod True
    python examples/byo_loop.py --nprocs 2 ++distributed '{"backend": "mpi", "reduce_type": "param", "param_sync_step": 10}'
    python examples/byo_loop.py --config configs/returnn_param.py --nprocs 2

Rank 0 prints one line per epoch and the summary, and writes OUT/summary.json; the final
model is saved to OUT/ckpt (``distkit export OUT/ckpt model.pt`` makes a plain state_dict).
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from torch import nn

import distkit
from distkit.tasks.digits import datasets, make_model


def evaluate(dk: distkit.Session, model: nn.Module, data: torch.utils.data.Dataset) -> float:
    """Accuracy over the eval set, every rank a slice; one all-reduce at the end."""
    correct, seen = torch.zeros(()), torch.zeros(())
    model.eval()
    with torch.no_grad():
        for x, y in dk.dataloader(data, batch_size=40, shuffle=False):  # the same count on every rank
            correct += (model(x).argmax(-1) == y).sum().cpu()
            seen += len(y)
    model.train()
    counts = dk.all_reduce(torch.stack([correct, seen]), op="sum")
    return float(counts[0] / counts[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--out", default="runs/byo_loop", help="where summary.json and ckpt/ go")
    distkit.add_arguments(parser)  # --config, ++key value, --nprocs, --deepspeed, --deepspeed_config, --local_rank
    args = parser.parse_args()

    dk = distkit.init(args)  # seeds every rank alike; under `python ... --nprocs N` this starts N ranks
    train_set, eval_set = datasets()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    model, optimizer = dk.setup(model, optimizer)
    loader = dk.dataloader(train_set, batch_size=args.batch_size, shuffle=True)

    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        total = torch.zeros(())
        for x, y in loader:  # already on dk.device
            loss = nn.functional.cross_entropy(model(x), y)
            dk.backward(loss)
            dk.step()  # optimizer step, zero_grad, averaging when due (param mode)
            total += loss.detach().cpu()
        mean = float(dk.all_reduce(total / len(loader), op="mean"))
        dk.print(f"epoch {epoch + 1}: train loss {mean:.4f}")

    dk.finish()  # param mode: the final sync; every rank now holds the average
    accuracy = evaluate(dk, model, eval_set)
    dk.save(os.path.join(args.out, "ckpt"), {"model": model, "optimizer": optimizer, "epoch": args.epochs})
    summary = dk.summary(eval_accuracy=accuracy)
    if dk.is_main:
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    dk.print(f"{summary['backend']}/{summary['reduce_type']} on {dk.world_size} rank(s): {summary['steps']} steps, "
             f"eval accuracy {accuracy:.3f}, ranks in sync: {summary['ranks_in_sync']}")


if __name__ == "__main__":
    main()
