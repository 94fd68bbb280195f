"""The benchmark workload's command line, shared by the hand-written baselines and ``byo_charlm.py``.

Every side of ``overhead.py`` trains the same ``charlm`` model on the same data; these flags say
which (``overhead.py`` passes the same values to both sides). Imported as a sibling module: the
scripts run as ``python benchmarks/<script>.py``, which puts ``benchmarks/`` on ``sys.path``.
"""
from __future__ import annotations

import argparse

from distkit.tasks.charlm import SIZES


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
