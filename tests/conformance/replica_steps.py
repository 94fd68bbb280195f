"""Replica groups, step by step: a small model with BatchNorm trained STEPS optimizer steps with the own-loop
API; after every step each rank records its parameters and buffers (``OUT/rank-R.pt``: one flat float64
tensor per step). ``tests/test_replica_groups.py`` runs it on every engine with
``distributed.param_sync_group_size`` and checks who equals whom after which step.

Every rank draws its own batches from a seed of (step, rank), so every engine sees the same data.
"""
from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from torch import nn

BATCH = 8


def flat(tensors: Any) -> torch.Tensor:
    """The floating tensors among ``tensors``, flattened into one float64 CPU tensor."""
    return torch.cat([t.detach().reshape(-1).double().cpu() for t in tensors if t.is_floating_point()])


def main() -> None:
    import distkit

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="adamw")
    distkit.add_arguments(parser)
    args = parser.parse_args()
    dk = distkit.init(args)
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = (torch.optim.SGD(model.parameters(), lr=0.1) if args.optimizer == "sgd"
                 else torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1))
    model, optimizer = dk.setup(model, optimizer)
    bare = dk.unwrap(model)
    # after each step: the parameters, and the floating buffers (BatchNorm's running statistics: each rank's
    # own forward updated them; the group leader's replace them before the next training forward, DDP's rule)
    record, buffers = [], []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + dk.rank)
        x, y = torch.randn(BATCH, 16, generator=g).to(dk.device), torch.randint(0, 4, (BATCH,), generator=g).to(dk.device)
        dk.backward(nn.functional.cross_entropy(model(x), y))
        dk.step()
        record.append(flat(bare.parameters()))
        buffers.append(flat(bare.buffers()))
    dk.finish()
    os.makedirs(args.out, exist_ok=True)
    torch.save({"steps": record, "buffers": buffers, "final": flat(bare.parameters()), "final_buffers": flat(bare.buffers()),
                "world_size": dk.world_size, "backend": dk.backend},
               os.path.join(args.out, f"rank-{dk.rank}.pt"))
    dk.close()


if __name__ == "__main__":
    main()
