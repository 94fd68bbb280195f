"""Built-in tasks: a model factory, train/eval datasets and a loss, all deterministic.

A task is what a config names with ``task = "digits"``. User tasks give the same three
pieces through the ``model``, ``dataset`` and ``loss`` keys instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.utils.data import Dataset

    from distkit.config import RunConfig


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position: logits (..., C) against class ids (...)."""
    return nn.functional.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Fraction of positions whose argmax over the last output dim equals the integer target."""
    return float((outputs.argmax(-1) == targets).float().mean())


@dataclass
class Task:
    """What the trainer needs of a task. ``model_fn`` must be deterministic under torch.manual_seed."""

    name: str
    model_fn: Callable[[], nn.Module]
    train: "Dataset[Any]"
    eval: Optional["Dataset[Any]"]
    #: ``loss(outputs, targets)`` for (inputs, targets) batches (dict batches: see ``hf_loss``)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    #: evaluation metrics by name: ``(outputs, targets) -> float``, averaged over samples; for dict batches
    #: (``model(**batch).loss``) outputs = the model output's ``logits``, targets = ``batch["labels"]``
    metrics: dict[str, Callable[[Any, Any], float]] = field(default_factory=lambda: {"accuracy": accuracy})
    #: ``train_step(model, batch) -> loss | (loss, metrics)`` replacing the forward + loss above
    train_step: Optional[Callable[..., Any]] = None
    eval_step: Optional[Callable[..., Any]] = None
    collate_fn: Optional[Callable[..., Any]] = None
    #: dict batches use the Hugging Face convention ``model(**batch).loss`` (no ``loss`` configured)
    hf_loss: bool = True


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

    if cfg.model is not None and (cfg.dataset is not None or cfg.train_dataset is not None):
        return
    if cfg.task is None:
        raise ConfigError("no task: set task = 'digits' (or 'charlm'), or give 'model' and 'dataset' (or 'train_dataset')")
    choice("task", cfg.task, tuple(TASKS))
    from .charlm import CORPORA, SIZES

    choice("charlm_size", cfg.charlm_size, tuple(SIZES))
    choice("charlm_corpus", cfg.charlm_corpus, tuple(CORPORA))


def _dataset(value: Any) -> Any:
    """A dataset given as itself or as a factory."""
    return value() if callable(value) and not hasattr(value, "__getitem__") else value


def make_task(cfg: "RunConfig") -> Task:
    """The built-in task, or the user's ``model`` with ``dataset`` (or ``train_dataset``/``eval_dataset``).

    ``dataset()`` returns a train dataset or a ``(train, eval)`` pair of map-style datasets. Items
    may be ``(inputs, targets)`` (with ``loss``, default cross-entropy) or any structure a
    ``train_step`` or the Hugging Face convention (dict batches, ``model(**batch).loss``) handles.
    A custom task reports only the metrics it is given (``metrics``): no accuracy for a regression.
    """
    if cfg.model is not None and (cfg.dataset is not None or cfg.train_dataset is not None):
        if cfg.train_dataset is not None:
            train, evl = _dataset(cfg.train_dataset), _dataset(cfg.eval_dataset)
        else:
            data = cfg.dataset()
            train, evl = data if isinstance(data, tuple) else (data, None)
        task = Task("custom", cfg.model, train, evl, cfg.loss or cross_entropy, metrics={})
    else:
        task = TASKS[str(cfg.task)](cfg)
        if cfg.model is not None:
            task.model_fn = cfg.model
        if cfg.loss is not None:
            task.loss = cfg.loss
    task.hf_loss = cfg.loss is None  # dict batches without a configured loss: model(**batch).loss
    if cfg.metrics is not None:
        task.metrics = {m if isinstance(m, str) else getattr(m, "__name__", f"metric{i}"): accuracy if m == "accuracy" else m
                        for i, m in enumerate(cfg.metrics)}
    task.train_step, task.eval_step = cfg.train_step, cfg.eval_step or cfg.train_step
    task.collate_fn = cfg.collate_fn or task.collate_fn
    return task
