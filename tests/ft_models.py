"""Models the fault-tolerance tests hand to ``distkit train`` as ``++model ft_models:<function>`` (the groups'
processes get ``tests/`` on PYTHONPATH)."""
from __future__ import annotations

from torch import nn


def digits_with_batchnorm() -> nn.Module:
    """The digits task's shape (64 features, 10 classes) with a BatchNorm layer: floating buffers that each rank's
    forward updates (running statistics), which param mode averages at every sync."""
    return nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))
