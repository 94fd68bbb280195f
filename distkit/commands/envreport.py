"""``distkit env``: one report of what this machine has for distributed training, to paste into an issue.

    distkit env [--json] [--rendezvous HOST]

What it reports: distkit, Python and the platform; torch (its CUDA/ROCm build, NCCL, the process-group
backends gloo/NCCL/MPI); DeepSpeed (version, accelerator, each op: installed and compatible, as ``ds_report``
says); Horovod (version, frameworks, controllers MPI/gloo, tensor operations, whether ``horovod.torch``
imports with this torch, as ``horovodrun --check-build`` says); mpi4py and the MPI library it loads (Open
MPI, MPICH; ``mpirun`` on PATH); which engines can run here and, for each that cannot, why and the command
that fixes it (each engine's own pre-start check, the one ``distkit train`` runs); the launcher and cluster
environment distkit detects (``distkit.env.detect``: torchrun, mpirun, SLURM, and the variables it read);
the network interfaces and the one distkit would use toward the rendezvous address (``--rendezvous``, else
``MASTER_ADDR``); GPUs. ``--json``: the same as one JSON object (sections as keys).

Nothing in it starts a process group or initialises MPI (mpi4py is imported with ``rc.initialize = False``),
so it runs on a login node, inside an allocation, or where a run failed. A section whose library is missing
says so with the install command; the report itself never fails on that.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import socket
import subprocess
import sys
from typing import Any, Callable, Optional

#: environment variables of launchers and schedulers that the launcher section lists (prefixes and names)
LAUNCH_VARS = ("SLURM_", "OMPI_COMM_WORLD_", "PMI_", "PMIX_RANK", "TORCHELASTIC_", "MASTER_ADDR", "MASTER_PORT",
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "HOROVOD_", "PBS_NODEFILE")
#: the install command for each missing piece
FIX = {"torch": "pip install torch==2.13.0 (the CPU wheel on these machines)",
       "deepspeed": "pip install 'distkit[deepspeed]'",
       "horovod": "make horovod (scripts/build_horovod.sh builds Horovod against this torch)",
       "mpi4py": "pip install 'distkit[mpi]' (mpi4py and Open MPI from PyPI)"}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("env", help="report what this machine has for distributed training (paste it into an issue)",
                       description=(__doc__ or "").split("\n\n")[0].strip(), allow_abbrev=False)
    p.add_argument("--json", action="store_true", help="one JSON object instead of the text report")
    p.add_argument("--rendezvous", metavar="HOST", default=None,
                   help="the rendezvous address whose route the network section shows (default: $MASTER_ADDR)")


def _section(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()``, or what went wrong in it: one section's failure must not lose the rest of the report."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported, not hidden: the section says what failed
        return {"error": f"{type(e).__name__}: {e}"}


@contextlib.contextmanager
def _quiet() -> Any:
    """Python-level output of a library's import (DeepSpeed's accelerator lines) kept out of the report."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def _distkit() -> dict[str, Any]:
    import distkit

    return {"version": distkit.__version__, "path": os.path.dirname(os.path.abspath(distkit.__file__))}


def _python() -> dict[str, Any]:
    return {"version": platform.python_version(), "executable": sys.executable, "platform": platform.platform(),
            "cpus": os.cpu_count()}


def _torch() -> dict[str, Any]:
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        return {"installed": False, "why": str(e), "fix": FIX["torch"]}
    nccl = None
    with contextlib.suppress(Exception):  # a CPU build has no NCCL
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    return {"installed": True, "version": torch.__version__, "cuda_build": torch.version.cuda,
            "rocm_build": getattr(torch.version, "hip", None), "cuda_available": torch.cuda.is_available(),
            "nccl": nccl, "backends": {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
                                       "mpi": dist.is_mpi_available()}}


def _deepspeed() -> dict[str, Any]:
    try:
        with _quiet():
            import deepspeed  # type: ignore[import-untyped]
            from deepspeed.accelerator import get_accelerator  # type: ignore[import-untyped]
            from deepspeed.env_report import probe_is_compatible  # type: ignore[import-untyped]
            from deepspeed.git_version_info import installed_ops  # type: ignore[import-untyped]
            from deepspeed.ops.op_builder.all_ops import ALL_OPS  # type: ignore[import-untyped]
    except ImportError as e:
        return {"installed": False, "why": str(e), "fix": FIX["deepspeed"]}
    ops = {}
    for name, builder in sorted(ALL_OPS.items()):
        with _quiet():
            compatible = bool(probe_is_compatible(builder, False))
        ops[name] = {"installed": bool(installed_ops.get(name, False)), "compatible": compatible}
    return {"installed": True, "version": deepspeed.__version__, "accelerator": get_accelerator()._name, "ops": ops}


def _horovod() -> dict[str, Any]:
    try:
        import horovod
    except ImportError as e:
        return {"installed": False, "why": str(e), "fix": FIX["horovod"]}
    out: dict[str, Any] = {"installed": True, "version": getattr(horovod, "__version__", "?")}
    try:
        import horovod.torch as hvd
    except Exception as e:  # noqa: BLE001 - built against another torch, or without PyTorch support
        out.update({"torch": False, "why": f"horovod.torch does not import: {e}", "fix": FIX["horovod"]})
        return out
    out.update({"torch": True,
                "controllers": {"mpi": bool(hvd.mpi_built()), "gloo": bool(hvd.gloo_built())},
                "tensor_ops": {"nccl": bool(hvd.nccl_built()), "ddl": bool(hvd.ddl_built()),
                               "ccl": bool(hvd.ccl_built()), "cuda": bool(hvd.cuda_built()),
                               "rocm": bool(hvd.rocm_built())}})
    return out


def _mpi() -> dict[str, Any]:
    try:
        import mpi4py
    except ImportError as e:
        return {"installed": False, "why": str(e), "fix": FIX["mpi4py"]}
    # no MPI_Init: this report may run where a launcher is about to start ranks, or on a login node
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    from mpi4py import MPI

    library = MPI.Get_library_version().strip("\x00 \n").splitlines()[0].strip()
    from distkit.launch.spawner import mpirun_path

    mpirun = mpirun_path()
    version = None
    if mpirun:
        with contextlib.suppress(Exception):
            res = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=20)
            version = (res.stdout.strip().splitlines() or [""])[0]
    return {"installed": True, "mpi4py": mpi4py.__version__, "library": library,
            "standard": ".".join(map(str, MPI.Get_version())), "mpirun": mpirun, "mpirun_version": version}


def _engines() -> dict[str, Any]:
    """Each engine's own pre-start check (what ``distkit train`` runs before anything starts) on its defaults."""
    from distkit.backends import REGISTRY, check_backend, strategy_class
    from distkit.config import load_config
    from distkit.errors import DistkitError

    out: dict[str, Any] = {}
    for name in REGISTRY:
        try:
            with _quiet():
                check_backend(load_config([], [("distributed.backend", name)]))
                cls = strategy_class(name)
        except DistkitError as e:
            out[name] = {"runs": False, "why": str(e)}
            continue
        fallback = getattr(cls, "reason", "")
        out[name] = ({"runs": True, "note": f"on distkit's mpi engine: horovod.torch does not import ({fallback}); "
                                            f"for real Horovod: {FIX['horovod']}"} if fallback else {"runs": True})
    return out


def _launcher() -> dict[str, Any]:
    from distkit.env import detect

    found = detect(os.environ)
    variables = {k: v for k, v in sorted(os.environ.items()) if k.startswith(LAUNCH_VARS)}
    return {"launcher": found.launcher, "rank": found.rank, "world_size": found.world_size,
            "local_rank": found.local_rank, "nodes": found.num_nodes, "job_id": found.job_id,
            "nodelist": found.nodelist, "variables": variables}


def _network(rendezvous: Optional[str]) -> dict[str, Any]:
    from distkit.errors import ConfigError
    from distkit.launch.netif import host_identity, interface_addresses, route_to

    target = rendezvous or os.environ.get("MASTER_ADDR")
    # the host's name first; the identity (boot id, network namespace) tells apart hosts that share a name
    out: dict[str, Any] = {"host": socket.gethostname(), "host_identity": host_identity(),
                           "interfaces": interface_addresses(), "rendezvous": target}
    if target:
        try:
            iface, addr = route_to(target)
            out["chosen"] = {"interface": iface, "address": addr}
        except ConfigError as e:
            out["chosen"] = {"error": str(e)}
    return out


def _gpus() -> dict[str, Any]:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"count": count, "devices": [{"name": torch.cuda.get_device_name(i),
                                         "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2 ** 30, 1)}
                                        for i in range(count)]}


#: the optional packages distkit uses when they are there (trackers, plots, replica groups, the bridges), by the name
#: ``importlib.metadata`` knows them
OPTIONAL = ("torchft", "tensorboard", "mlflow", "mlflow-skinny", "wandb", "matplotlib", "safetensors", "transformers", "accelerate",
            "lightning", "pytorch-lightning", "speechbrain", "returnn", "dm-tree")


def _optional() -> dict[str, Any]:
    """Each optional package's version, or None when it is not installed (read from the installed metadata:
    nothing is imported)."""
    from importlib import metadata

    out: dict[str, Any] = {}
    for name in OPTIONAL:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def collect(rendezvous: Optional[str] = None) -> dict[str, Any]:
    """The whole report as a dict of sections. Not collective; starts no process group."""
    return {"distkit": _section(_distkit), "python": _section(_python), "torch": _section(_torch),
            "deepspeed": _section(_deepspeed), "horovod": _section(_horovod), "mpi": _section(_mpi),
            "engines": _section(_engines), "launcher": _section(_launcher),
            "network": _section(lambda: _network(rendezvous)), "gpus": _section(_gpus), "optional": _section(_optional)}


def render(report: dict[str, Any]) -> str:
    """The report as text: one block per section, ``key: value`` lines, nested dicts indented."""
    lines: list[str] = []

    def walk(value: Any, indent: int) -> None:
        for key, v in value.items():
            if isinstance(v, dict) and v:
                lines.append(f"{' ' * indent}{key}:")
                walk(v, indent + 2)
            else:
                shown = "yes" if v is True else "no" if v is False else "-" if v in (None, {}, [], "") else v
                lines.append(f"{' ' * indent}{key}: {shown}")

    for section, body in report.items():
        lines.append(f"== {section}")
        if section == "deepspeed" and isinstance(body.get("ops"), dict):  # one line per op, as ds_report
            body = {**body, "ops": {name: f"installed {'yes' if o['installed'] else 'no'}, compatible "
                                          f"{'yes' if o['compatible'] else 'no'}" for name, o in body["ops"].items()}}
        walk(body, 2)
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    report = collect(args.rendezvous)
    print(json.dumps(report, indent=2, default=str) if args.json else render(report), end="\n" if args.json else "")
    return 0
