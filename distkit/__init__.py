"""distkit: one PyTorch training job on DDP, DeepSpeed ZeRO, Horovod or MPI, in grad or param mode.

The training API (``Session``, ``init``, ``add_arguments``, ``Trainer``, ``run_on_main``, ``is_main_process``)
is imported on first use (PEP 562), not with the package: commands that never train (``distkit keys``,
``distkit lighthouse``, a bad config refused with exit 2) then start without importing torch (about 1 s
here), and ``from distkit import Session`` works as before.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from distkit.config import LaunchFlags, RunConfig, load_config
from distkit.env import ClusterEnv, detect
from distkit.errors import (
    BackendUnavailable, CheckpointError, CollectiveTimeout, ConfigError, DistkitError, RankFailure,
    RankLost, RankStalled, UnsupportedCombination, UsageError,
)

if TYPE_CHECKING:
    from distkit.main_process import is_main_process, run_on_main
    from distkit.session import Session, add_arguments, init
    from distkit.trainer import Trainer

__version__ = "0.1.0"

#: the names imported on first use, and their modules
_LAZY = {"Session": "distkit.session", "add_arguments": "distkit.session", "init": "distkit.session",
         "Trainer": "distkit.trainer", "is_main_process": "distkit.main_process",
         "run_on_main": "distkit.main_process"}

__all__ = [
    "BackendUnavailable", "CheckpointError", "ClusterEnv", "CollectiveTimeout", "ConfigError", "DistkitError",
    "LaunchFlags", "RankFailure", "RankLost", "RankStalled", "RunConfig", "Session", "Trainer",
    "UnsupportedCombination", "UsageError",
    "add_arguments", "detect", "init", "is_main_process", "load_config", "run_on_main",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'distkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
