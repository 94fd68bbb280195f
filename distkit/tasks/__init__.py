"""Built-in tasks: a model factory, train/eval datasets and a loss, all deterministic.

A task is what a config names with ``task = "digits"``. User tasks give the same three
pieces through the ``model``, ``dataset`` and ``loss`` keys instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.utils.data import Dataset

    from distkit.config import RunConfig


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position: logits (..., C) against class ids (...)."""
    return nn.functional.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


@dataclass
class Task:
    """What the trainer needs of a task. ``model_fn`` must be deterministic under torch.manual_seed."""

    name: str
    model_fn: Callable[[], nn.Module]
    train: "Dataset[Any]"
    eval: Optional["Dataset[Any]"]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    #: accuracy = argmax of the last output dim against integer targets
    classification: bool = True


def _digits(cfg: "RunConfig") -> Task:
    from .digits import build

    return build(cfg)


def _charlm(cfg: "RunConfig") -> Task:
    from .charlm import build

    return build(cfg)


TASKS: dict[str, Callable[["RunConfig"], Task]] = {"digits": _digits, "charlm": _charlm}


def check_task(cfg: "RunConfig") -> None:
    """Before anything starts: the built-in task named by ``cfg`` exists (unless ``model`` and ``dataset`` are given)."""
    from distkit.config.resolve import choice
    from distkit.errors import ConfigError

    if cfg.model is not None and cfg.dataset is not None:
        return
    if cfg.task is None:
        raise ConfigError("no task: set task = 'digits' (or 'charlm'), or give both 'model' and 'dataset'")
    choice("task", cfg.task, tuple(TASKS))
    from .charlm import SIZES

    choice("charlm_size", cfg.charlm_size, tuple(SIZES))


def make_task(cfg: "RunConfig") -> Task:
    """The built-in task, or the user's ``model``/``dataset``/``loss`` callables.

    ``dataset()`` returns a train dataset or a ``(train, eval)`` pair of map-style
    datasets whose items are ``(inputs, targets)``.
    """
    if cfg.model is not None and cfg.dataset is not None:
        data = cfg.dataset()
        train, evl = data if isinstance(data, tuple) else (data, None)
        return Task("custom", cfg.model, train, evl, cfg.loss or cross_entropy, classification=True)
    task = TASKS[str(cfg.task)](cfg)
    if cfg.model is not None:
        task.model_fn = cfg.model
    if cfg.loss is not None:
        task.loss = cfg.loss
    return task
