"""Fold the seed spellings into one validated :class:`RunConfig`.

Every check that can fail on user input happens here, before any process group exists
and before anything is written, so bad input costs one line and exit status 2.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Optional

from distkit.errors import ConfigError

from .loader import not_a_file, read_text, unknown_key_error
from .schema import ALL_KEYS, DISTRIBUTED_KEYS, HOROVOD_KEYS, TORCH_DISTRIBUTED_KEYS, DistributedConfig, RunConfig
from .validate import _validate, choice  # noqa: F401  (choice: distkit.tasks imports it from here)

def _load_deepspeed_config(value: Any) -> dict[str, Any]:
    """A DeepSpeed config given as a dict or a JSON file path."""
    if isinstance(value, dict):
        return dict(value)
    if not isinstance(value, str):
        raise ConfigError(f"'deepspeed_config' must be a JSON file path or a dict, got {value!r}")
    why = not_a_file(value)
    if why is not None:
        raise ConfigError(f"DeepSpeed config file '{value}' {why}: check the --deepspeed_config path")
    import json

    text = read_text(value)  # not UTF-8: one line naming the file, not a UnicodeDecodeError
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        # DeepSpeed reads its config with hjson (comments, trailing commas: the LUMI guide's
        # ds_config.json has one): what DeepSpeed accepts is accepted here too.
        try:
            import hjson  # type: ignore[import-untyped]

            data = hjson.loads(text)
        except ImportError:  # DeepSpeed (which brings hjson) is not installed: check_backend says so
            raise ConfigError(f"{value}:{e.lineno}: invalid JSON in DeepSpeed config: {e.msg}") from None
        except ValueError:
            raise ConfigError(f"{value}:{e.lineno}: invalid DeepSpeed config (JSON or hjson): {e.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{value}: a DeepSpeed config must be a JSON object")
    return data


#: Top-level spellings that pick an engine, and the engine each picks (``distributed`` picks its "backend").
_SELECTOR_KEYS = {"torch_distributed": "ddp", "use_horovod": "horovod", "deepspeed_config": "deepspeed",
                  "distributed": None}


def _selected_by(key: str, raw: dict[str, Any]) -> Optional[str]:
    """The engine the spelling ``key`` of ``raw`` picks, or None when it picks none."""
    value = raw.get(key)
    if key == "distributed":
        return value.get("backend") if isinstance(value, dict) else None
    if key == "use_horovod":
        return "horovod" if value else None
    return _SELECTOR_KEYS[key] if value is not None else None


def _drop_replaced_selectors(raw: dict[str, Any], flags: LaunchFlags, cli_keys: frozenset[str],
                             notes: list[str]) -> None:
    """Defaults < files < command line, for the engine as for every key: when the command line picks an
    engine, a file's spelling that picks another one is dropped (with its engine-specific keys) and a
    note says so. Spellings on the same level are left for the conflict check."""
    on_cli: dict[str, str] = {}
    for key in _SELECTOR_KEYS:
        chosen = _selected_by(key, raw)
        from_cli = key in cli_keys or (key == "distributed" and "distributed.backend" in cli_keys)
        if chosen is not None and from_cli:
            on_cli[f"++{key}"] = chosen
    if flags.deepspeed or flags.deepspeed_config is not None:
        on_cli["--deepspeed_config" if flags.deepspeed_config is not None else "--deepspeed"] = "deepspeed"
    if not on_cli or len(set(on_cli.values())) > 1:
        return  # nothing on the command line, or a same-level conflict (reported later)
    engine = next(iter(on_cli.values()))
    for key in _SELECTOR_KEYS:
        chosen = _selected_by(key, raw)
        from_cli = f"++{key}" in on_cli or (key == "deepspeed_config" and engine == "deepspeed")
        if chosen is None or chosen == engine or from_cli:
            continue
        if key == "distributed":
            raw["distributed"] = {k: v for k, v in raw["distributed"].items() if k != "backend"}
        else:
            del raw[key]
            if key == "use_horovod":
                for h in [k for k in raw if k.startswith("horovod_")]:
                    del raw[h]
        notes.append(f"the command line ({', '.join(on_cli)}) selects {engine}; it replaces {key} ({chosen}) "
                     f"from the config file" + ("" if key == "distributed" else ", whose settings are ignored"))


@dataclass
class LaunchFlags:
    """Launcher/seed flags from the command line (DESIGN.md section 4)."""

    local_rank: Optional[int] = None
    distributed_backend: Optional[str] = None
    find_unused_parameters: bool = False
    deepspeed: bool = False
    deepspeed_config: Optional[str] = None
    nprocs: Optional[int] = None


def resolve(raw: dict[str, Any], flags: LaunchFlags | None = None, cli_keys: frozenset[str] = frozenset()) -> RunConfig:
    """Validate ``raw`` (files + overrides) and the launcher flags into a RunConfig.

    ``cli_keys``: the (dotted) keys of ``raw`` that came from the command line (``++key value``).
    The command line beats the files for the engine too: an engine spelling on the command line
    (``--deepspeed``, ``++use_horovod``, ``++distributed ...``) replaces one in a file, and the
    config's ``notes`` say so; two spellings on the same level that pick different engines conflict.
    """
    flags = flags or LaunchFlags()
    raw = copy.copy(raw)
    for key in raw:
        if key not in ALL_KEYS:
            raise unknown_key_error(key)
    _refuse_non_finite(raw)
    notes: list[str] = []
    _drop_replaced_selectors(raw, flags, cli_keys, notes)
    selectors: dict[str, str] = {}  # spelling -> backend it selects
    dist_raw = raw.pop("distributed", None)
    dist = DistributedConfig()
    if dist_raw is not None:
        if not isinstance(dist_raw, dict):
            raise ConfigError(f"'distributed' must be a dict like {{'backend': 'ddp'}}, got {dist_raw!r}")
        for key, value in dist_raw.items():
            if key not in DISTRIBUTED_KEYS:
                raise unknown_key_error(key, DISTRIBUTED_KEYS, where="'distributed'")
            setattr(dist, key, value)
        if "backend" in dist_raw:
            selectors["distributed.backend"] = dist_raw["backend"]
    td = raw.pop("torch_distributed", None)
    if td is not None:
        _fold_torch_distributed(td, dist)
        selectors["torch_distributed"] = "ddp"
    if raw.pop("use_horovod", False):
        selectors["use_horovod"] = "horovod"
    horovod_keys = [k for k in list(raw) if k.startswith("horovod_")]
    if horovod_keys and "use_horovod" not in selectors and dist.backend != "horovod":
        raise ConfigError(f"'{horovod_keys[0]}' is set but Horovod is not selected: add use_horovod = True")
    for key in horovod_keys:
        target = HOROVOD_KEYS[key]
        value = raw.pop(key)
        if target == "data_distribution":
            raw.setdefault("data_distribution", value)
        else:
            setattr(dist, target, value)
    ds = raw.pop("deepspeed_config", None)
    if flags.deepspeed_config is not None:
        ds = flags.deepspeed_config
    if ds is not None or flags.deepspeed:
        selectors["deepspeed"] = "deepspeed"
    if len(set(selectors.values())) > 1:
        desc = ", ".join(f"{k} -> {v}" for k, v in selectors.items())
        raise ConfigError(f"two backends selected at once ({desc}): keep only one of these spellings")
    if flags.deepspeed and ds is None:
        raise ConfigError("--deepspeed needs a DeepSpeed config: add --deepspeed_config ds.json "
                          "(or deepspeed_config = 'ds.json' / a dict in the config file)")
    if ds is not None:
        dist.deepspeed_config = _load_deepspeed_config(ds)
    if selectors:
        dist.backend = next(iter(selectors.values()))
    if "param_outer_optimizer" in raw:
        dist.outer_optimizer = raw.pop("param_outer_optimizer")
    pg = raw.pop("backend", None)  # perceptrain's top-level torch.distributed backend
    if flags.distributed_backend is not None:
        pg = flags.distributed_backend
    if pg is not None:
        dist.pg_backend = pg
    if flags.find_unused_parameters:
        dist.options = {**dist.options, "find_unused_parameters": True}
    if "compute_setup" in raw:
        if "device" in raw:
            raise ConfigError("both 'device' and 'compute_setup' are set: keep one (they are the same key)")
        cs = raw.pop("compute_setup")
        raw["device"] = "cuda" if cs == "gpu" else cs
    cfg = RunConfig(distributed=dist)
    for key, value in raw.items():
        setattr(cfg, key, value)
    # Which top-level keys the user wrote (files + overrides), so a backend whose own config can say
    # the same thing (DeepSpeed's batch size, clipping, optimizer) tells "left at the default" from
    # "set to the default value".
    cfg.explicit_keys = frozenset(raw)
    cfg.notes = tuple(notes)
    if flags.nprocs is not None:
        cfg.nprocs = flags.nprocs
    _validate(cfg)
    if cfg.fault_tolerance:  # every replica group is a launch of its own: each writes its own directory
        cfg.output_dir = os.path.join(cfg.output_dir, f"group-{cfg.fault_tolerance['replica_id']}")
    return cfg


#: keys whose values are data or objects, not settings: their numbers are not the config's to judge (a
#: dataset given as a list may hold NaN on purpose, and walking it would cost time for nothing)
_NOT_SETTINGS = frozenset({"train_dataset", "eval_dataset", "dataset", "model", "callbacks", "loggers", "metrics"})


def _refuse_non_finite(value: Any, path: str = "") -> None:
    """ConfigError for the first NaN or infinite number in the config's settings (nested dicts, lists and
    tuples too: optimizer and scheduler arguments, the DeepSpeed dict). ``learning_rate = float("nan")``
    or ``++learning_rate 1e999`` would otherwise pass every ``> 0`` check (NaN compares false) and train
    to the end on NaN, or fail inside torch with a traceback."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not path and key in _NOT_SETTINGS:
                continue
            _refuse_non_finite(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _refuse_non_finite(item, f"{path}[{i}]")
    elif isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) and not math.isfinite(value):
        raise ConfigError(f"'{path}' is {float(value)!r}: config numbers must be finite (no nan or inf): "
                          "set a finite value")


def _fold_torch_distributed(td: Any, dist: DistributedConfig) -> None:
    if not isinstance(td, dict):
        raise ConfigError(f"torch_distributed must be a dict (e.g. {{}} or {{'reduce_type': 'param'}}), got {td!r}")
    for key, value in td.items():
        if key not in TORCH_DISTRIBUTED_KEYS:
            raise unknown_key_error(key, TORCH_DISTRIBUTED_KEYS, where="torch_distributed")
        target = TORCH_DISTRIBUTED_KEYS[key]
        if target is not None:
            setattr(dist, target, value)
    if td.get("class") is not None:
        raise ConfigError("torch_distributed['class']: custom DDP classes are not supported: remove the key")
    reduce_type = td.get("reduce_type", "grad")
    if reduce_type == "grad" and "sync_on_cpu" in td:
        raise ConfigError("torch_distributed['sync_on_cpu'] only applies to reduce_type 'param': remove it")
    if reduce_type == "param" and td.get("options"):
        raise ConfigError("torch_distributed['options'] (DDP kwargs) only apply to reduce_type 'grad': remove them")
    if dist.pg_backend is not None and "," in str(dist.pg_backend):
        # RETURNN's "cpu:gloo,cuda:nccl": pick automatically by device.
        dist.pg_backend = None


def replace(cfg: RunConfig, **changes: Any) -> RunConfig:
    """A copy of ``cfg`` with top-level fields changed (no re-validation)."""
    return dataclasses.replace(cfg, **changes)
