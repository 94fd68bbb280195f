"""``digits``: scikit-learn's 1,797 real 8x8 handwritten digits, a small MLP, 10 classes.

Fixed split (independent of the training seed): 1,437 train / 360 eval samples.
Features are scaled to [0, 1] (pixel value / 16).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.data import TensorDataset

from . import Task

if TYPE_CHECKING:
    from distkit.config import RunConfig

N_EVAL = 360


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def datasets() -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    # A fixed permutation, so the split never depends on the run's seed.
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))
    x, y = x[perm], y[perm]
    return TensorDataset(x[N_EVAL:], y[N_EVAL:]), TensorDataset(x[:N_EVAL], y[:N_EVAL])


def build(cfg: "RunConfig") -> Task:
    train, evl = datasets()
    return Task("digits", make_model, train, evl)
