"""Hand-written FSDP2 baseline for ``benchmarks/interleaved.py --backend fsdp`` (no distkit).

Launch under torchrun::

    torchrun --standalone --nproc_per_node 2 benchmarks/raw_fsdp.py --steps 100 --times out.json

The textbook FSDP2 loop (torchtitan's shape): a 1-D device mesh of every rank, ``fully_shard`` on each unit
innermost first and then on the root, plain SGD built over the sharded parameters (``DTensor`` shards), then
``loss.backward()`` (each unit all-gathers its parameters for forward and again for backward, and reduce-scatters
its gradients in backward), ``opt.step()``, ``opt.zero_grad(set_to_none=True)``. FSDP2's defaults:
``reshard_after_forward=True``, no mixed precision, no offload.

The units are the ones distkit's fsdp engine picks for a model without ``_no_split_modules`` (its ``units``
policy, written out here by hand): each direct child that holds parameters, a ``ModuleList`` / ``ModuleDict``
child standing for its own children, in reverse order of registration (innermost first). For charlm that is
``head, norm, blocks, pos, tok`` (``blocks`` is an ``nn.TransformerEncoder``, one unit), then the root.
``tests/test_bench_method.py`` checks that this list equals distkit's.

The workload is distkit's ``charlm`` task, as in ``raw_ddp.py``: same seed and initial parameters (every rank
seeds the same and builds the same model before sharding, so each keeps its slice of identical weights; distkit
broadcasts rank 0's, which are the same), SGD, per-rank batch, ``shard`` data order. distkit's fsdp engine runs the
same FSDP2 collectives (its own subclasses of FSDP2's default all-gather and reduce-scatter, which add timing), so
the final ``param_checksum`` (every parameter gathered whole) must equal distkit's bit for bit.

Rank 0 records ``perf_counter`` / ``process_time`` (seconds) before fetching each step's batch and after
``zero_grad`` and writes them to ``--times`` (the same keys as ``raw_ddp.py``).
"""
from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distkit.evaluation import param_checksum
from workload import RawLoop, parse_baseline_args, run_and_record, seeded_charlm, shard_batches


def unit_paths(model: nn.Module) -> list[str]:
    """The qualified names of the submodules that get their own ``fully_shard`` unit, innermost (last registered)
    first: each direct child of ``model`` that holds parameters, a container without a forward (``ModuleList``,
    ``ModuleDict``) replaced by its own children, recursively. (distkit's policy for a model without
    ``_no_split_modules`` or tied weights; charlm has neither.)"""

    def children(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
        out: list[tuple[str, nn.Module]] = []
        for name, child in module.named_children():
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                out += children(child, f"{prefix}{name}.")
            else:
                out.append((f"{prefix}{name}", child))
        return out

    return [p for p, m in reversed(children(model, "")) if any(True for _ in m.parameters())]


def gathered_checksum(model: nn.Module) -> str:
    """Collective (every rank): ``param_checksum`` of every parameter gathered whole (``DTensor.full_tensor``)."""
    from torch.distributed.tensor import DTensor

    return param_checksum([(n, p.full_tensor() if isinstance(p, DTensor) else p)
                           for n, p in model.named_parameters()])


def build(args: argparse.Namespace, rank: int, world: int) -> RawLoop:
    """The hand-written FSDP2 step on the default process group (already initialized): the model seeded with
    ``args.seed``, ``fully_shard`` on :func:`unit_paths` then the root over a 1-D CPU mesh of ``world`` ranks, plain
    SGD over the sharded parameters, the ``shard`` data order."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    train, model = seeded_charlm(args)
    mesh = init_device_mesh("cpu", (world,))
    for path in unit_paths(model):
        fully_shard(model.get_submodule(path), mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    batch = shard_batches(*train.tensors, args.seed, args.batch_size, rank, world)

    def step(i: int) -> torch.Tensor:
        x, y = batch(i)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()  # FSDP2 reduce-scatters each unit's gradients during backward
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return RawLoop(step, lambda: gathered_checksum(model))


def main() -> None:
    args = parse_baseline_args(__doc__.splitlines()[0])  # (FSDP2 has no buckets: one unit each)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    run_and_record(build(args, rank, world), args, "raw_fsdp", rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
