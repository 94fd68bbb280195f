"""``digits``: scikit-learn's 1,797 real 8x8 handwritten digits, a small MLP, 10 classes.

Fixed split (independent of the training seed): 1,437 train / 360 eval samples.
Features are scaled to [0, 1] (pixel value / 16).
"""
from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

import numpy as np

import torch
from torch import nn
from torch.utils.data import TensorDataset

from .base import Task

if TYPE_CHECKING:
    from distkit.config import RunConfig

N_EVAL = 360


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def _load() -> tuple[np.ndarray, np.ndarray]:
    """The raw digits: read scikit-learn's shipped CSV directly (importing sklearn.datasets costs ~1.5 s)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            raw = np.loadtxt(path, delimiter=",")
            return raw[:, :-1], raw[:, -1]
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.data, data.target


def datasets() -> tuple[TensorDataset, TensorDataset]:
    features, labels = _load()
    x = torch.tensor(features, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    # A fixed permutation, so the split never depends on the run's seed.
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))
    x, y = x[perm], y[perm]
    return TensorDataset(x[N_EVAL:], y[N_EVAL:]), TensorDataset(x[:N_EVAL], y[:N_EVAL])


def build(cfg: "RunConfig") -> Task:
    train, evl = datasets()
    return Task("digits", make_model, train, evl)
