"""Validation of a resolved :class:`RunConfig`: types, ranges, choices, and "module:name" imports.

Split out of :mod:`distkit.config.resolve`, which calls :func:`_validate` once the seed spellings are folded.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any, Callable, Optional

from distkit.errors import BackendUnavailable, ConfigError

from .loader import nearest_key
from .schema import STARTUP_FLOOR_S, DATA_DISTRIBUTIONS, DEVICES, KNOWN_BACKENDS, PG_BACKENDS, PRECISIONS, REDUCE_TYPES, RunConfig


#: ``distributed.timeout_s`` bounds, seconds: below 1 s no rank can even connect (the watchdog beats every
#: timeout_s / 4, at most once a second); above 1e7 s (115 days) torch's timedelta-based timeouts overflow
TIMEOUT_S_RANGE = (1.0, 1e7)
#: the largest ``seed``: numpy's global generator (seeded with it, as torch's and Python's) takes 32 bits
SEED_MAX = 2**32 - 1


#: device "cuda" where no CUDA device is visible (also :func:`distkit.components.ranks_per_gpu_problem`'s line)
NO_CUDA = "device 'cuda' (compute_setup 'gpu') was asked for but no CUDA device is visible: use device = 'auto' or 'cpu'"


def _int(name: str, value: Any, minimum: int, optional: bool = False, maximum: Optional[int] = None) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"'{name}' must be an integer >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"'{name}' must be an integer from {minimum} to {maximum}, got {value!r}")


def choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        near = nearest_key(str(value), allowed)
        hint = f" (did you mean '{near}'?)" if near else ""
        raise ConfigError(f"'{name}' must be one of {', '.join(allowed)}; got {value!r}{hint}")


def _bools(obj: Any, prefix: str = "") -> None:
    """Every bool key of the dataclass ``obj`` (annotated ``bool``) must be True or False, or 1 or 0 as RETURNN
    configs write them (made a bool here): a string such as "maybe" or "False" was taken as true unseen."""
    for f in dataclasses.fields(obj):
        if f.type not in ("bool", bool) or f.metadata.get("internal"):
            continue
        value = getattr(obj, f.name)
        if not isinstance(value, bool) and not (isinstance(value, int) and value in (0, 1)):
            raise ConfigError(f"'{prefix}{f.name}' must be True or False, got {value!r}: write True or False "
                              "(unquoted in Python; true/false in YAML, JSON and ++ overrides)")
        setattr(obj, f.name, bool(value))


def _validate(cfg: RunConfig) -> None:
    d = cfg.distributed
    _bools(cfg)
    _bools(d, "distributed.")
    choice("distributed.backend", d.backend, KNOWN_BACKENDS)
    choice("distributed.reduce_type", d.reduce_type, REDUCE_TYPES)
    _int("distributed.param_sync_step", d.param_sync_step, 1)
    if d.param_sync_time_diff is not None and (
        isinstance(d.param_sync_time_diff, bool) or not isinstance(d.param_sync_time_diff, (int, float))
        or d.param_sync_time_diff <= 0
    ):
        raise ConfigError(f"'param_sync_time_diff' must be a positive number of seconds, got {d.param_sync_time_diff!r}")
    if not isinstance(d.timeout_s, (int, float)) or isinstance(d.timeout_s, bool) or not (
            TIMEOUT_S_RANGE[0] <= d.timeout_s <= TIMEOUT_S_RANGE[1]):
        raise ConfigError(f"'distributed.timeout_s' must be a number of seconds from {TIMEOUT_S_RANGE[0]:g} to "
                          f"{TIMEOUT_S_RANGE[1]:g} (how long a rank waits for the others before the job ends), got "
                          f"{d.timeout_s!r}")
    if d.startup_timeout_s is not None and (
            not isinstance(d.startup_timeout_s, (int, float)) or isinstance(d.startup_timeout_s, bool)
            or not TIMEOUT_S_RANGE[0] <= d.startup_timeout_s <= TIMEOUT_S_RANGE[1]):
        raise ConfigError(f"'distributed.startup_timeout_s' must be a number of seconds from {TIMEOUT_S_RANGE[0]:g} to "
                          f"{TIMEOUT_S_RANGE[1]:g} (how long a rank waits for the others to start), or None (the "
                          f"larger of timeout_s and {STARTUP_FLOOR_S:g}), got {d.startup_timeout_s!r}")
    if not isinstance(d.options, dict):
        raise ConfigError(f"'distributed.options' must be a dict of DistributedDataParallel kwargs, got {d.options!r}")
    if d.fsdp and d.backend != "fsdp":
        raise ConfigError(f"'distributed.fsdp' holds FSDP2's options and applies to backend 'fsdp' only: remove it or "
                          f"set distributed.backend = 'fsdp' (it is {d.backend!r})")
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
    _int("distributed.param_sync_fragments", d.param_sync_fragments, 1)
    from distkit.sync.compression import CODECS

    choice("distributed.param_sync_compression", d.param_sync_compression, CODECS)
    density = d.param_sync_topk_density
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
        raise ConfigError(f"'distributed.param_sync_topk_density' must be a number in (0, 1], got {density!r}")
    if d.param_sync_topk_bits not in (2, 4, 8) or isinstance(d.param_sync_topk_bits, bool):
        raise ConfigError(f"'distributed.param_sync_topk_bits' must be 2, 4 or 8, got {d.param_sync_topk_bits!r}")
    _int("distributed.param_sync_topk_chunk", d.param_sync_topk_chunk, 1, maximum=32768)
    _int("distributed.param_sync_overlap", d.param_sync_overlap, 0)
    # param mode's exchange (issue 26): the three keys apply to param mode only; with fault_tolerance only the codec
    # (distkit.ft.codec_exchange: torchft's Manager syncs the whole model at once, blocking); each set -> how to unset it
    exchange = {"param_sync_overlap": (d.param_sync_overlap > 0, "param_sync_overlap = 0"),
                "param_sync_compression": (d.param_sync_compression != "none", "param_sync_compression = 'none'"),
                "param_sync_fragments": (d.param_sync_fragments > 1, "param_sync_fragments = 1")}
    for key, (is_set, unset) in exchange.items():
        if is_set and d.reduce_type != "param":
            raise ConfigError(f"'distributed.{key}' only applies to reduce_type 'param' (it shapes the exchange at a "
                              f"sync): remove it or set reduce_type = 'param'")
        if is_set and cfg.fault_tolerance is not None and key == "param_sync_compression":
            if isinstance(cfg.fault_tolerance, dict) and cfg.fault_tolerance.get("late") == "merge":
                raise ConfigError("'distributed.param_sync_compression' is not available with fault_tolerance.late = "
                                  "'merge' (its merge sums fp32 weighted pseudo-gradients): set "
                                  "param_sync_compression = 'none' or remove 'late'")
        elif is_set and cfg.fault_tolerance is not None:
            raise ConfigError(f"'distributed.{key}' is not available with fault_tolerance yet (torchft syncs the whole "
                              f"model at once, blocking): set {unset}")
    if d.param_sync_overlap > 0:
        if d.param_sync_time_diff is not None:
            raise ConfigError("'distributed.param_sync_overlap' needs the step rule (param_sync_step): remove "
                              "param_sync_time_diff or set param_sync_overlap = 0")
        if d.param_sync_overlap * d.param_sync_fragments >= d.param_sync_step:
            raise ConfigError(f"'distributed.param_sync_overlap' ({d.param_sync_overlap}) must be less than "
                              f"param_sync_step / param_sync_fragments ({d.param_sync_step} / {d.param_sync_fragments}): "
                              f"a fragment's exchange must end before the next fragment's starts")
    if d.param_sync_fragments > 1 and d.param_sync_time_diff is None and d.param_sync_fragments > d.param_sync_step:
        raise ConfigError(f"'distributed.param_sync_fragments' ({d.param_sync_fragments}) must be at most "
                          f"param_sync_step ({d.param_sync_step}): each fragment syncs every param_sync_step "
                          f"steps, at its own step in that period")
    if d.outer_optimizer is not None:
        oo = d.outer_optimizer
        if not isinstance(oo, dict) or oo.get("class") != "nesterov":
            raise ConfigError(f"'param_outer_optimizer' must be like {{'class': 'nesterov', 'lr': 0.7, 'momentum': 0.9}}, got {oo!r}")
        if d.reduce_type != "param":
            raise ConfigError("'param_outer_optimizer' only applies to reduce_type 'param': remove it or set reduce_type")
    _int("batch_size", cfg.batch_size, 1)
    _int("num_epochs", cfg.num_epochs, 1)
    _int("max_steps", cfg.max_steps, 1, optional=True)
    _int("seed", cfg.seed, 0, maximum=SEED_MAX)
    _int("accum_grad_multiple_step", cfg.accum_grad_multiple_step, 1)
    _int("eval_every", cfg.eval_every, 1, optional=True)
    _int("log_every", cfg.log_every, 1)
    _int("checkpoint_every", cfg.checkpoint_every, 1, optional=True)
    _int("nprocs", cfg.nprocs, 1)
    from distkit.launch.spawner import check_nprocs

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
    cfg.callbacks = [_callback(c) for c in cfg.callbacks]
    from distkit import trackers  # no tracker library is imported here, only looked for

    cfg.loggers = trackers.check(cfg.loggers)
    if not isinstance(cfg.output_dir, str) or not cfg.output_dir:
        raise ConfigError(f"'output_dir' must be a non-empty path, got {cfg.output_dir!r}")
    if cfg.resume not in (None, "auto", "none") and not (isinstance(cfg.resume, str) and os.path.isdir(cfg.resume)):
        raise ConfigError(f"'resume' must be 'auto', 'none' (start fresh) or an existing checkpoint directory, "
                          f"got {cfg.resume!r}")
    _int("keep_checkpoints", cfg.keep_checkpoints, 1)
    if cfg.fault_tolerance is not None:
        from distkit.ft import checks
        from distkit.ft.watch import probe_lighthouse

        if not isinstance(cfg.fault_tolerance, dict):
            raise ConfigError(f"fault_tolerance must be a dict like {{'lighthouse': 'http://HOST:29510', 'replica_id': 0, "
                              f"'num_replicas': 2}}, got {cfg.fault_tolerance!r}")
        checks.check_config(cfg.fault_tolerance, d.reduce_type, d.param_sync_time_diff, d.timeout_s, d.outer_optimizer)
        checks.import_torchft()
        # does it answer, its token, the lighthouse through its gate: before anything is written
        probe_lighthouse(cfg.fault_tolerance["lighthouse"], lambda: checks.token_of(cfg.fault_tolerance or {}))
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(NO_CUDA)
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


#: the hooks distkit.trainer.Trainer calls on each callback
CALLBACK_HOOKS = ("on_train_start", "on_step_end", "on_eval_end", "on_checkpoint", "on_train_end")


def _callback(value: Any) -> Any:
    """A callback object; a "module:Name" string is imported now (a class is instantiated without arguments), and
    an object with none of :data:`CALLBACK_HOOKS` is refused (a string was kept as it was and never called)."""
    obj = _import("callbacks", value) if isinstance(value, str) else value
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as e:  # noqa: BLE001 - the user's constructor
            raise ConfigError(f"'callbacks': {value!r} could not be made without arguments ({type(e).__name__}: {e}): "
                              "put an instance in the list") from None
    if not any(callable(getattr(obj, hook, None)) for hook in CALLBACK_HOOKS):
        raise ConfigError(f"'callbacks': {value!r} has none of the hooks {', '.join(CALLBACK_HOOKS)}: pass an object "
                          "that defines at least one (or 'module:Name' of its class)")
    return obj


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


def uses_muon(optimizer: Any) -> bool:
    """Whether the ``optimizer`` key chooses Muon (``{"class": "muon"}``, any case, or torch.optim.Muon itself):
    :class:`distkit.components.MuonWithAdamW`, which orthogonalises whole matrices, so an engine that flattens or
    partitions the parameters (DeepSpeed ZeRO, its bf16/fp16 optimizers) refuses it before start."""
    if not isinstance(optimizer, dict):
        return False
    name = optimizer.get("class")
    return (isinstance(name, str) and name.lower() == "muon") or (isinstance(name, type) and name.__name__ == "Muon")
