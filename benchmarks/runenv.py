"""The environment the benchmarks start distkit's processes in (imported as a sibling module: the
scripts run as ``python benchmarks/<script>.py``, which puts ``benchmarks/`` on ``sys.path``)."""
from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment plus: one thread per rank (ranks share the 2 cores), this checkout
    first on ``PYTHONPATH``, Open MPI allowed to run as root (unless set), then ``extra``."""
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    e.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    e.update(extra)
    return e
