"""mpi4py's import for the mpi and Horovod engines: Open MPI's settings chosen before MPI starts, and what runs."""
from __future__ import annotations

import os
from typing import Any

from distkit.errors import BackendUnavailable

INSTALL_HINT = "pip install 'distkit[mpi]' (mpi4py + the Open MPI wheel), then launch with mpirun -np N"


#: Open MPI's all-reduce for large messages, chosen before MPI starts (unless the user chose, by
#: ``mpirun --mca`` or the environment). Its non-blocking all-reduce (libnbc, the gradient buckets)
#: picks by default, for 2 ranks, an algorithm that sends the data one way and then back: 1.1 s
#: for 7.3 MB on a 100 Mbit/s link where gloo's ring takes 0.65 s; libnbc's ring takes 0.65 s too,
#: and on one host (shared memory) 16 ms either way (measured: benchmarks/slow_link.py, and
#: mpi4py ``Iallreduce`` between two network namespaces). The ring is bandwidth-optimal for
#: any number of ranks. Large blocking all-reduces go through the same path (:data:`distkit.backends.mpi.NONBLOCKING_MIN_BYTES`).
MCA_DEFAULTS = {"OMPI_MCA_coll_libnbc_iallreduce_algorithm": "1"}  # 1 = ring


def import_mpi() -> Any:
    """mpi4py's MPI module (initialises MPI on first import, with :data:`MCA_DEFAULTS` unless set), or
    BackendUnavailable with the fix."""
    for key, value in MCA_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise BackendUnavailable(f"the mpi engine needs mpi4py ({e}): {INSTALL_HINT}") from None
    return MPI


def mpi_impl() -> str:
    """e.g. "mpi4py 4.1.2 (Open MPI v5.0.11)"."""
    import mpi4py

    MPI = import_mpi()
    lib = MPI.Get_library_version().strip().split(",")[0].splitlines()[0]
    return f"mpi4py {mpi4py.__version__} ({lib})"
