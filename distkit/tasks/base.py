"""What every task is: :class:`Task` and the default loss and metric (apart from the registry in
``distkit.tasks``, so the built-in tasks import it without importing the package that loads them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.utils.data import Dataset


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


# Their public home is ``distkit.tasks`` (which re-exports them): a config's resolved record names them
# there ("distkit.tasks:cross_entropy"), as before this module existed.
for _public in (cross_entropy, accuracy, Task):
    _public.__module__ = "distkit.tasks"
