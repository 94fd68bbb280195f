"""Configuration: load files, apply ``++key value`` overrides, fold seed spellings, validate."""
from __future__ import annotations

from typing import Any

from .loader import load_file, load_raw, parse_value, split_overrides
from .resolve import LaunchFlags, resolve
from .schema import DistributedConfig, RunConfig


def load_config(paths: list[str], overrides: list[tuple[str, Any]] | None = None,
                flags: LaunchFlags | None = None) -> RunConfig:
    """Defaults < files (in order) < overrides: one validated RunConfig."""
    overrides = overrides or []
    return resolve(load_raw(paths, overrides), flags, cli_keys=frozenset(k for k, _ in overrides))


__all__ = ["DistributedConfig", "LaunchFlags", "RunConfig", "load_config", "load_file", "parse_value",
           "resolve", "split_overrides"]
