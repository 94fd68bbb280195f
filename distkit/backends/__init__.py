"""The backend registry: one line per engine, imported only when selected.

Adding a backend = one module under ``distkit/backends/`` + one line here. Nothing
else in distkit branches on backend names.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from distkit.errors import BackendUnavailable

if TYPE_CHECKING:
    from distkit.config import RunConfig

    from .base import Strategy

REGISTRY: dict[str, str] = {
    "ddp": "distkit.backends.ddp:DDPStrategy",
    "deepspeed": "distkit.backends.deepspeed:DeepSpeedStrategy",
    "mpi": "distkit.backends.mpi:MPIStrategy",
    "horovod": "distkit.backends.horovod:HorovodStrategy",
    "fsdp": "distkit.backends.fsdp:FSDPStrategy",
}


def strategy_class(name: str) -> "type[Strategy]":
    """The Strategy class registered under ``name`` (imports its module)."""
    if name not in REGISTRY:
        raise BackendUnavailable(
            f"backend '{name}' is not yet available in this version of distkit: "
            f"use one of {', '.join(sorted(REGISTRY))}")
    module, _, cls = REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


def check_backend(cfg: "RunConfig") -> None:
    """Capability checks before any process group exists: raise with the fix if it cannot work."""
    strategy_class(cfg.distributed.backend).check_config(cfg)
