"""perceptrain's ``TrainConfig``, the fields distkit reads plus perceptrain's others (accepted).

Read by :class:`~distkit.compat.perceptrain.Trainer`: ``max_iter`` (epochs), ``print_every``,
``write_every``, ``checkpoint_every``, ``val_every`` (all in epochs, 0 = off), ``root_folder``,
``nprocs``, ``backend`` (gloo | nccl | mpi), ``compute_setup`` (cpu | gpu | auto), ``dtype``,
``verbose``, ``hyperparams`` (written to ``config.json``), and distkit's own ``distributed``
dict (engine and mode; overrides what ``backend`` picked). Fields for perceptrain features
distkit does not implement (callbacks, plots, best-only checkpoints, stop criteria) are
accepted at their defaults; a non-default value is an
:class:`~distkit.errors.UnsupportedCombination` naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from distkit.config.loader import nearest_key
from distkit.errors import ConfigError, UnsupportedCombination

BACKENDS = ("gloo", "nccl", "mpi")
COMPUTE_SETUPS = ("cpu", "gpu", "auto")
#: perceptrain fields with no distkit counterpart: (name, default-test, why)
_UNSUPPORTED: tuple[tuple[str, Callable[[Any], bool]], ...] = (
    ("callbacks", lambda v: not v),
    ("plot_every", lambda v: not v),
    ("live_plot_every", lambda v: not v),
    ("plotting_functions", lambda v: not v),
    ("checkpoint_best_only", lambda v: not v),
    ("validation_criterion", lambda v: v is None),
    ("trainstop_criterion", lambda v: v is None),
    ("create_subfolder_per_run", lambda v: not v),
)


def install_error_hook() -> None:
    """Uncaught DistkitErrors print one line ``distkit: error: ...`` and exit with their status,
    also for bad input found before ``distkit.init`` runs (the hook ``init`` installs)."""
    from distkit.health.guards import install_excepthook
    from distkit.session import Session

    install_excepthook(lambda: Session.current)


def _choice(name: str, value: Any, allowed: tuple[str, ...], fix: str) -> None:
    if value not in allowed:
        near = nearest_key(str(value), allowed) if isinstance(value, str) else None
        hint = f" (did you mean '{near}'?)" if near else ""
        raise ConfigError(f"TrainConfig({name}={value!r}): {name} must be one of {', '.join(allowed)}{hint}; {fix}")


def _count(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"TrainConfig({name}={value!r}): {name} must be an integer >= {minimum}")


@dataclass
class TrainConfig:
    """perceptrain's training configuration (same field names and defaults), run by distkit."""

    max_iter: int = 10000
    print_every: int = 0
    write_every: int = 0
    checkpoint_every: int = 0
    plot_every: int = 0
    live_plot_every: int = 0
    callbacks: list = field(default_factory=list)
    log_model: bool = False
    root_folder: Path = Path("./qml_logs")
    create_subfolder_per_run: bool = False
    log_folder: Path = Path("./")
    checkpoint_best_only: bool = False
    val_every: int = 0
    val_epsilon: float = 1e-5
    validation_criterion: Optional[Callable] = None
    trainstop_criterion: Optional[Callable] = None
    batch_size: int = 1
    verbose: bool = True
    tracking_tool: Any = None
    hyperparams: dict = field(default_factory=dict)
    plotting_functions: tuple = field(default_factory=tuple)
    nprocs: int = 1
    compute_setup: str = "cpu"
    backend: str = "gloo"
    log_setup: str = "cpu"
    dtype: Optional[torch.dtype] = None
    all_reduce_metrics: bool = False
    #: distkit: the engine and mode, e.g. {"backend": "mpi", "reduce_type": "param", "param_sync_step": 10}
    #: (docs/config.md); its keys override what ``backend`` selected.
    distributed: Optional[dict] = None

    def __post_init__(self) -> None:
        install_error_hook()
        self.validate()

    def validate(self) -> None:
        """ConfigError / UnsupportedCombination for values distkit cannot run, naming the fix."""
        _choice("backend", self.backend, BACKENDS,
                "use 'gloo' (CPU), 'nccl' (GPUs) or 'mpi' (distkit's mpi4py engine)")
        _choice("compute_setup", self.compute_setup, COMPUTE_SETUPS,
                "use 'cpu', 'gpu' (CUDA) or 'auto' (GPU when visible)")
        for name in ("max_iter", "nprocs"):
            _count(name, getattr(self, name), 1)
        for name in ("print_every", "write_every", "checkpoint_every", "val_every"):
            _count(name, getattr(self, name), 0)
        if self.backend == "nccl" and self.compute_setup == "cpu":
            raise UnsupportedCombination("TrainConfig(backend='nccl', compute_setup='cpu'): NCCL runs on GPUs only; "
                                         "use backend='gloo' on the CPU (or compute_setup='gpu')")
        if self.distributed is not None and not isinstance(self.distributed, dict):
            raise ConfigError(f"TrainConfig(distributed={self.distributed!r}) must be a dict like "
                              "{'backend': 'mpi', 'reduce_type': 'param'}")
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise ConfigError(f"TrainConfig(dtype={self.dtype!r}) must be a torch.dtype such as torch.float64, or None")
        for name, is_default in _UNSUPPORTED:
            if not is_default(getattr(self, name)):
                raise UnsupportedCombination(
                    f"TrainConfig({name}=...): perceptrain's {name} is not implemented by distkit.compat.perceptrain; "
                    f"leave it at its default (see docs/perceptrain.md for what is supported)")

    def distributed_config(self) -> dict[str, Any]:
        """distkit's ``distributed`` dict: ``backend`` gloo|nccl -> the ddp engine on that process-group
        backend, mpi -> distkit's mpi engine; then the ``distributed`` field's keys on top."""
        base: dict[str, Any] = ({"backend": "mpi"} if self.backend == "mpi"
                                else {"backend": "ddp", "pg_backend": self.backend})
        user = dict(self.distributed or {})
        if user.get("backend") not in (None, "ddp", "deepspeed"):
            base.pop("pg_backend", None)  # a torch.distributed setting: meaningless on horovod and mpi
        return {**base, **user}

    def device(self) -> str:
        """distkit's ``device`` key for ``compute_setup``."""
        return {"cpu": "cpu", "gpu": "cuda", "auto": "auto"}[self.compute_setup]
