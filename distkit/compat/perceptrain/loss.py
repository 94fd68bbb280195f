"""perceptrain's built-in losses: ``loss_fn(xs, model) -> (loss, metrics)``."""
from __future__ import annotations

from typing import Any, Callable, Union

import torch
from torch import nn

from distkit.config.loader import nearest_key
from distkit.errors import ConfigError

LossFunction = Callable[[Any, nn.Module], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]


def mse_loss(batch: Any, model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean squared error of ``model(inputs)`` against ``labels`` for a batch ``(inputs, labels)``; no metrics."""
    inputs, labels = batch
    return nn.functional.mse_loss(model(inputs), labels), {}


def cross_entropy_loss(batch: Any, model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Cross entropy of ``model(inputs)`` (logits) against ``labels`` for a batch ``(inputs, labels)``; no metrics."""
    inputs, labels = batch
    return nn.functional.cross_entropy(model(inputs), labels), {}


LOSSES = {"mse": mse_loss, "cross_entropy": cross_entropy_loss}


def get_loss(loss_fn: Union[str, LossFunction, None]) -> LossFunction:
    """A callable is used as is; "mse" (also for None) and "cross_entropy" are the built-ins."""
    if loss_fn is None:
        return mse_loss
    if callable(loss_fn):
        return loss_fn
    if isinstance(loss_fn, str) and loss_fn in LOSSES:
        return LOSSES[loss_fn]
    near = nearest_key(loss_fn, LOSSES) if isinstance(loss_fn, str) else None
    hint = f" (did you mean '{near}'?)" if near else ""
    raise ConfigError(f"Trainer(loss_fn={loss_fn!r}){hint}: loss_fn must be 'mse', 'cross_entropy' or a callable "
                      "loss_fn(xs, model) -> (loss, metrics_dict)")
