"""The benchmark workload's command line, shared by the hand-written baselines and ``byo_charlm.py``.

Every side of ``overhead.py`` trains the same ``charlm`` model on the same data; these flags say
which (``overhead.py`` passes the same values to both sides). Imported as a sibling module: the
scripts run as ``python benchmarks/<script>.py``, which puts ``benchmarks/`` on ``sys.path``.
"""
from __future__ import annotations

import argparse
import os

from distkit.tasks.charlm import SIZES

#: local-rank variables of the launchers the benchmarks use (torchrun, Open MPI, other MPIs)
_LOCAL_RANK = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK")


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
