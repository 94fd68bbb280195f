"""param mode's outer optimizer (``outer_optimizer``, DiLoCo/SlowMo): torch SGD, Nesterov, on the *anchor* (the
averaged tensors as of the last sync, one persistent copy kept by the averager), whose gradient is the
pseudo-gradient ``anchor - mean``, how far the average moved, negated. Not collective: every rank applies the same
step to the same anchor and mean, so the anchors and momentum buffers stay identical on every rank.

Only parameters are stepped. Floating buffers (BatchNorm's running mean and variance) are statistics, not
weights: extrapolating them with momentum (lr 0.7, momentum 0.9) drove a running variance negative and the
validation loss to NaN (issue 57 E). They take the plain average, as the compressed exchange averages them, and
their anchor follows it. Memory: one momentum buffer per parameter anchor, made at its first step.
"""
from __future__ import annotations

from typing import Any

import torch


def outer_sgd(anchor: list[torch.Tensor], config: dict[str, Any]) -> torch.optim.Optimizer:
    """``config`` (``{"class": "nesterov", "lr": 0.7, "momentum": 0.9}``) as torch SGD on the ``anchor`` tensors."""
    momentum = float(config.get("momentum", 0.9))
    # torch refuses nesterov without momentum; with momentum 0 both are plain SGD anyway.
    return torch.optim.SGD(anchor, lr=float(config.get("lr", 0.7)), momentum=momentum, nesterov=momentum > 0)


def outer_step(outer: torch.optim.Optimizer, anchor: list[torch.Tensor], tensors: list[torch.Tensor],
               is_param: list[bool]) -> None:
    """The whole model's outer step, after ``tensors`` were averaged: torch's own SGD step on the parameters'
    ``anchor`` tensors (``is_param``, one flag per tensor) with the pseudo-gradient as their gradient, then each
    parameter set to its anchor; a floating buffer keeps its average, which becomes its anchor."""
    with torch.no_grad():
        for a, t, param in zip(anchor, tensors, is_param, strict=True):
            a.grad = a - t if param else None  # pseudo-gradient: how far the average moved, negated; SGD skips None
        outer.step()
        for a, t, param in zip(anchor, tensors, is_param, strict=True):
            if param:
                t.copy_(a)
            else:
                a.copy_(t)


def outer_update(outer: torch.optim.Optimizer, a: torch.Tensor, g: torch.Tensor) -> None:
    """The outer optimizer's step on one anchor tensor ``a`` (one of ``outer``'s parameters) with pseudo-gradient
    ``g`` (torch SGD's own formula, with its momentum buffer): a fragment's, or an exchange's, sync."""
    group = outer.param_groups[0]
    lr, momentum = group["lr"], group["momentum"]
    state = outer.state[a]
    if "momentum_buffer" not in state:  # torch's first step: the buffer is the gradient
        state["momentum_buffer"] = g.clone()
    else:
        state["momentum_buffer"].mul_(momentum).add_(g)
    buf = state["momentum_buffer"]
    a.add_(g.add(buf, alpha=momentum) if group["nesterov"] else buf, alpha=-lr)
