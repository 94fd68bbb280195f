"""The benchmark workload's command line, shared by the hand-written baselines and ``byo_charlm.py``.

Every side of ``overhead.py`` trains the same ``charlm`` model on the same data; these flags say
which (``overhead.py`` passes the same values to both sides). Imported as a sibling module: the
scripts run as ``python benchmarks/<script>.py``, which puts ``benchmarks/`` on ``sys.path``.
"""
from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

if TYPE_CHECKING:
    import torch

from distkit.tasks.charlm import SIZES

#: local-rank variables of the launchers the benchmarks use (torchrun, Open MPI, other MPIs)
_LOCAL_RANK = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK")


def launcher_rank() -> int:
    """This process's global rank as its launcher set it: torchrun's ``RANK``, mpirun's ``OMPI_COMM_WORLD_RANK``
    (``PMIX_RANK``/``PMI_RANK`` for other MPIs, which set no ``RANK``); 0 without a launcher."""
    return next((int(os.environ[k]) for k in ("RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
                 if os.environ.get(k, "").strip()), 0)


def pin_rank() -> None:
    """With ``DISTKIT_BENCH_PIN=1`` (``overhead.py --pin``): bind this rank, and the threads it starts from now on,
    to one core, local rank r to the r-th core it may run on (mod their number). Both sides of a comparison do
    it the same way at the start of ``main``, before torch starts its thread pool, so neither loses time to a
    rank moving between cores or two ranks sharing one."""
    if os.environ.get("DISTKIT_BENCH_PIN") != "1":
        return
    local = next((int(os.environ[k]) for k in _LOCAL_RANK if os.environ.get(k, "").strip()), 0)
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[local % len(cores)]})


def add_workload_arguments(ap: argparse.ArgumentParser, seed: bool = True) -> argparse.ArgumentParser:
    """``--size --seq-len --batch-size --steps --lr [--seed] --times``; ``seed=False`` where distkit's
    own ``++seed`` sets it (``byo_charlm.py``)."""
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps in total (warm-up included)")
    ap.add_argument("--lr", type=float, default=0.1)
    if seed:
        ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--times", required=True, help="JSON file rank 0 writes the step timestamps to")
    return ap


def seeded_charlm(args: argparse.Namespace) -> tuple[Any, "torch.nn.Module"]:
    """charlm's training set and model as every side of a comparison builds them: ``torch.manual_seed(args.seed)``,
    then the datasets of ``args.seq_len``, then the ``args.size`` model, in that order (so the model's initial
    weights are the seed's, the same on every side and rank). Returns (the training TensorDataset, the model)."""
    import torch

    from distkit.tasks.charlm import CharTransformer, datasets

    torch.manual_seed(args.seed)
    train, _, vocab = datasets(args.seq_len)
    width, layers, heads = SIZES[args.size]
    return train, CharTransformer(vocab, args.seq_len, width, layers, heads)


def shard_batches(xs: "torch.Tensor", ys: "torch.Tensor", seed: int, batch_size: int, rank: int,
                  world: int) -> Callable[[int], tuple["torch.Tensor", "torch.Tensor"]]:
    """``batch(step) -> (x, y)``: this rank's batch of global step ``step`` in distkit's ``shard`` order (one
    ``randperm`` per epoch seeded ``seed * 1_000_003 + epoch``, identical on every rank; rank r takes the r-th
    slice of each global batch; the incomplete last global batch of an epoch is dropped), what the hand-written
    baselines index by hand. The epoch's permutation is kept until the epoch changes."""
    import torch

    global_batch = batch_size * world
    steps_per_epoch = len(xs) // global_batch
    cache: dict[int, torch.Tensor] = {}

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, s = divmod(step, steps_per_epoch)
        if epoch not in cache:
            cache.clear()
            cache[epoch] = torch.randperm(len(xs), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        idx = cache[epoch][s * global_batch + rank * batch_size:][:batch_size]
        return xs[idx], ys[idx]

    return batch


class RawLoop(NamedTuple):
    """A hand-written baseline's training step, built on an engine its process has already started, so that
    ``interleaved.py`` runs it beside distkit's in the same processes (each ``raw_<engine>.py`` has ``build``
    returning one; its own ``main`` runs the same step in its timed loop).

    ``step(i)``: optimizer step ``i`` (batch fetch + forward + backward + the engine's gradient exchange + SGD +
    zero_grad), returning the loss; ``checksum()``: ``param_checksum`` of the model's parameters (every rank
    calls it: ZeRO-3 gathers)."""

    step: Callable[[int], "torch.Tensor"]
    checksum: Callable[[], str]


def run_timed(raw: RawLoop, steps: int) -> tuple[dict[str, list[float]], "torch.Tensor"]:
    """Steps ``0..steps-1`` of ``raw``, each timed on this rank from before its batch fetch to after zero_grad:
    (``{"starts", "ends", "cpu_starts", "cpu_ends"}`` in ``perf_counter`` / ``process_time`` seconds, the last loss)."""
    import time

    rec: dict[str, list[float]] = {"starts": [], "ends": [], "cpu_starts": [], "cpu_ends": []}
    loss = None
    for i in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        loss = raw.step(i)
        rec["ends"].append(time.perf_counter())
        rec["cpu_ends"].append(time.process_time())
        rec["starts"].append(t0)
        rec["cpu_starts"].append(c0)
    assert loss is not None, "steps must be at least 1"
    return rec, loss


def run_and_record(raw: RawLoop, args: argparse.Namespace, impl: str, rank: int, world: int, **extra: Any) -> None:
    """A hand-written baseline's run: :func:`run_timed` for ``args.steps`` steps, then its checksum (collective where
    the engine's is: every rank calls this), and rank 0 writes ``{"impl", **extra, "rank", "world_size", the step
    times, "final_loss", "param_checksum", "torch_threads"}`` to ``args.times``."""
    import json

    import torch

    rec, loss = run_timed(raw, args.steps)
    checksum = raw.checksum()
    if rank == 0:
        with open(args.times, "w") as f:
            json.dump({"impl": impl, **extra, "rank": rank, "world_size": world, **rec, "final_loss": loss.item(),
                       "param_checksum": checksum, "torch_threads": torch.get_num_threads()}, f)


def parse_baseline_args(description: str) -> argparse.Namespace:
    """The command line of a hand-written baseline whose engine has no bucket setting (``raw_mpi.py``,
    ``raw_horovod.py``, ``raw_fsdp.py``): the workload's flags plus ``--bucket-cap-mb`` (overhead.py passes it to every baseline),
    parsed; then this rank pinned (``--pin``) before torch starts its threads."""
    ap = argparse.ArgumentParser(description=description)
    add_workload_arguments(ap)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0, help="accepted for overhead.py's command line; unused")
    args = ap.parse_args()
    pin_rank()
    return args
