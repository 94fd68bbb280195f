"""Fold the seed spellings into one validated :class:`RunConfig`.

Every check that can fail on user input happens here, before any process group exists
and before anything is written, so bad input costs one line and exit status 2.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from distkit.errors import BackendUnavailable, ConfigError

from .loader import nearest_key, read_text, unknown_key_error
from .schema import (
    ALL_KEYS, DATA_DISTRIBUTIONS, DEVICES, DISTRIBUTED_KEYS, KNOWN_BACKENDS, PRECISIONS,
    PG_BACKENDS, REDUCE_TYPES, DistributedConfig, RunConfig,
)

#: RETURNN's ``torch_distributed`` keys -> canonical ``distributed`` keys.
_TORCH_DISTRIBUTED_KEYS = {
    "reduce_type": "reduce_type", "param_sync_step": "param_sync_step",
    "param_sync_time_diff": "param_sync_time_diff", "options": "options",
    "backend": "pg_backend", "timeout_sec": "timeout_s", "timeout_s": "timeout_s",
    "sync_on_cpu": None,  # accepted (param mode); on CPU it changes nothing
    "class": None,        # only the default DDP class is supported; checked below
}


#: RETURNN's Horovod keys -> canonical ``distributed`` keys (data_distribution is top level).
_HOROVOD_KEYS = {
    "horovod_reduce_type": "reduce_type", "horovod_param_sync_step": "param_sync_step",
    "horovod_param_sync_time_diff": "param_sync_time_diff", "horovod_scale_lr": "scale_lr",
    "horovod_dataset_distribution": "data_distribution", "horovod_avg_grad": "avg_grad",
    "horovod_compression": "compression", "horovod_require": "require_horovod",
}


def _load_deepspeed_config(value: Any) -> dict[str, Any]:
    """A DeepSpeed config given as a dict or a JSON file path."""
    if isinstance(value, dict):
        return dict(value)
    if not isinstance(value, str):
        raise ConfigError(f"'deepspeed_config' must be a JSON file path or a dict, got {value!r}")
    if not os.path.isfile(value):
        raise ConfigError(f"DeepSpeed config file '{value}' does not exist: check the --deepspeed_config path")
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
        target = _HOROVOD_KEYS[key]
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
    return cfg


#: keys whose values are data or objects, not settings: their numbers are not the config's to judge (a
#: dataset given as a list may hold NaN on purpose, and walking it would cost time for nothing)
_NOT_SETTINGS = frozenset({"train_dataset", "eval_dataset", "dataset", "model", "callbacks", "metrics"})


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
        if key not in _TORCH_DISTRIBUTED_KEYS:
            raise unknown_key_error(key, _TORCH_DISTRIBUTED_KEYS, where="torch_distributed")
        target = _TORCH_DISTRIBUTED_KEYS[key]
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


def _int(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"'{name}' must be an integer >= {minimum}, got {value!r}")


def choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        near = nearest_key(str(value), allowed)
        hint = f" (did you mean '{near}'?)" if near else ""
        raise ConfigError(f"'{name}' must be one of {', '.join(allowed)}; got {value!r}{hint}")


def _validate(cfg: RunConfig) -> None:
    d = cfg.distributed
    choice("distributed.backend", d.backend, KNOWN_BACKENDS)
    choice("distributed.reduce_type", d.reduce_type, REDUCE_TYPES)
    _int("distributed.param_sync_step", d.param_sync_step, 1)
    if d.param_sync_time_diff is not None and (
        isinstance(d.param_sync_time_diff, bool) or not isinstance(d.param_sync_time_diff, (int, float))
        or d.param_sync_time_diff <= 0
    ):
        raise ConfigError(f"'param_sync_time_diff' must be a positive number of seconds, got {d.param_sync_time_diff!r}")
    if not isinstance(d.timeout_s, (int, float)) or isinstance(d.timeout_s, bool) or d.timeout_s <= 0:
        raise ConfigError(f"'distributed.timeout_s' must be a positive number of seconds, got {d.timeout_s!r}")
    if not isinstance(d.options, dict):
        raise ConfigError(f"'distributed.options' must be a dict of DistributedDataParallel kwargs, got {d.options!r}")
    if d.pg_backend is not None:
        if d.pg_backend == "mpi":
            raise BackendUnavailable(
                "torch.distributed's 'mpi' backend is not built into the PyTorch wheels: "
                "use backend 'gloo' (or distributed = {'backend': 'mpi'} for distkit's MPI engine)")
        choice("distributed.pg_backend", d.pg_backend, PG_BACKENDS)
    choice("distributed.compression", d.compression, ("none", "fp16"))
    if not isinstance(d.bucket_cap_mb, (int, float)) or isinstance(d.bucket_cap_mb, bool) or d.bucket_cap_mb <= 0:
        raise ConfigError(f"'distributed.bucket_cap_mb' must be a positive number of MiB, got {d.bucket_cap_mb!r}")
    _int("distributed.param_sync_group_size", d.param_sync_group_size, 1)
    for flag in ("scale_lr", "avg_grad", "require_horovod"):
        if not isinstance(getattr(d, flag), (bool, int)):
            raise ConfigError(f"'distributed.{flag}' must be True or False, got {getattr(d, flag)!r}")
    if d.outer_optimizer is not None:
        oo = d.outer_optimizer
        if not isinstance(oo, dict) or oo.get("class") != "nesterov":
            raise ConfigError(f"'param_outer_optimizer' must be like {{'class': 'nesterov', 'lr': 0.7, 'momentum': 0.9}}, got {oo!r}")
        if d.reduce_type != "param":
            raise ConfigError("'param_outer_optimizer' only applies to reduce_type 'param': remove it or set reduce_type")
    _int("batch_size", cfg.batch_size, 1)
    _int("num_epochs", cfg.num_epochs, 1)
    _int("max_steps", cfg.max_steps, 1, optional=True)
    _int("seed", cfg.seed, 0)
    _int("accum_grad_multiple_step", cfg.accum_grad_multiple_step, 1)
    _int("eval_every", cfg.eval_every, 1, optional=True)
    _int("log_every", cfg.log_every, 1)
    _int("checkpoint_every", cfg.checkpoint_every, 1, optional=True)
    _int("nprocs", cfg.nprocs, 1)
    from distkit.launch import check_nprocs

    check_nprocs(cfg.nprocs)  # here, not only where the ranks are started: before anything is written
    _int("charlm_seq_len", cfg.charlm_seq_len, 2)
    choice("device", cfg.device, DEVICES)
    choice("data_distribution", cfg.data_distribution, DATA_DISTRIBUTIONS)
    if not isinstance(cfg.learning_rate, (int, float)) or isinstance(cfg.learning_rate, bool) or cfg.learning_rate <= 0:
        raise ConfigError(f"'learning_rate' must be a positive, finite number, got {cfg.learning_rate!r}")
    if cfg.gradient_clip is not None and (not isinstance(cfg.gradient_clip, (int, float)) or cfg.gradient_clip <= 0):
        raise ConfigError(f"'gradient_clip' must be a positive number (max gradient norm) or None, got {cfg.gradient_clip!r}")
    # names are checked against torch.optim where the model is built (distkit.components.check_components)
    # a bare name is the class ("adamw", "cosine"); "module:function" is a factory
    for key in ("optimizer", "lr_scheduler"):
        value = getattr(cfg, key)
        if isinstance(value, str):
            setattr(cfg, key, _callable(key, value) if ":" in value else {"class": value})
    if not callable(cfg.optimizer) and (not isinstance(cfg.optimizer, dict) or "class" not in cfg.optimizer):
        raise ConfigError(f"'optimizer' must be a dict like {{'class': 'adamw', 'weight_decay': 0.01}} or a factory "
                          f"params -> Optimizer, got {cfg.optimizer!r}")
    if cfg.lr_scheduler is not None and not callable(cfg.lr_scheduler):
        if not isinstance(cfg.lr_scheduler, dict) or "class" not in cfg.lr_scheduler:
            raise ConfigError(f"'lr_scheduler' must be None, a dict like {{'class': 'cosine', 'warmup_steps': 100}} or a "
                              f"factory (optimizer, total_steps) -> scheduler, got {cfg.lr_scheduler!r}")
        _int("lr_scheduler.warmup_steps", cfg.lr_scheduler.get("warmup_steps", 0), 0)
    if cfg.precision in (32, "32-true", "fp32"):
        cfg.precision = "32"
    choice("precision", cfg.precision, PRECISIONS)
    if not isinstance(cfg.callbacks, (list, tuple)):
        raise ConfigError(f"'callbacks' must be a list of callback objects, got {type(cfg.callbacks).__name__}")
    cfg.callbacks = list(cfg.callbacks)
    if not isinstance(cfg.output_dir, str) or not cfg.output_dir:
        raise ConfigError(f"'output_dir' must be a non-empty path, got {cfg.output_dir!r}")
    if cfg.resume not in (None, "auto", "none") and not (isinstance(cfg.resume, str) and os.path.isdir(cfg.resume)):
        raise ConfigError(f"'resume' must be 'auto', 'none' (start fresh) or an existing checkpoint directory, "
                          f"got {cfg.resume!r}")
    _int("keep_checkpoints", cfg.keep_checkpoints, 1)
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("device 'cuda' (compute_setup 'gpu') was asked for but no CUDA device is visible: "
                              "use device = 'auto' or 'cpu'")
    for key in ("model", "dataset", "loss", "collate_fn", "train_step", "eval_step"):
        setattr(cfg, key, _callable(key, getattr(cfg, key)))
    for key in ("train_dataset", "eval_dataset"):  # a dataset or a factory, possibly as "module:name"
        value = getattr(cfg, key)
        if isinstance(value, str):
            setattr(cfg, key, _import(key, value))
    _int("num_workers", cfg.num_workers, 0)
    if cfg.metrics is not None:
        if not isinstance(cfg.metrics, (list, tuple)):
            raise ConfigError(f"'metrics' must be a list like ['accuracy'] or of callables (outputs, targets) -> float, "
                              f"got {cfg.metrics!r}")
        cfg.metrics = [m if m == "accuracy" else _callable("metrics", m) for m in cfg.metrics]
    # Whether the task and the engine can run is checked where they are built (distkit.tasks.check_task,
    # distkit.backends.check_backend): config is data and imports neither (DESIGN.md 2a).


def _callable(key: str, value: Any) -> Optional[Callable[..., Any]]:
    """Accept a callable or a "module:function" string; import it now so typos fail before start."""
    if value is None or callable(value):
        return value
    obj = _import(key, value)
    if not callable(obj):
        raise ConfigError(f"'{key}' = '{value}' is not callable")
    return obj  # type: ignore[no-any-return]


def _import(key: str, value: Any) -> Any:
    """The object a "module:name" string names, imported now so typos fail before start."""
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError(f"'{key}' must be a callable or a 'module:function' string, got {value!r}")
    mod_name, _, attr = value.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # ImportError, or an error inside the user's module
        raise ConfigError(f"'{key}' = '{value}': cannot import module '{mod_name}' ({type(e).__name__}: {e}): check the name and PYTHONPATH") from None
    obj: Any = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"'{key}' = '{value}': module '{mod_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    return obj


def replace(cfg: RunConfig, **changes: Any) -> RunConfig:
    """A copy of ``cfg`` with top-level fields changed (no re-validation)."""
    return dataclasses.replace(cfg, **changes)
