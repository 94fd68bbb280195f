"""Evaluation and parameter checksums, collective over all ranks."""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Iterable, Optional

import torch
from torch import nn

from distkit.data import eval_slices, fetch, to_device
from distkit.tasks import Task

if TYPE_CHECKING:
    from distkit.session import Session


def param_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over every parameter in ``named_parameters`` order, as fp32 bytes."""
    h = hashlib.sha256()
    for _, p in named:
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def evaluate(s: "Session", model: nn.Module, task: Task, batch_size: int) -> tuple[Optional[float], Optional[float]]:
    """Collective: loss and accuracy over the whole eval set, every rank a disjoint slice.

    Returns (mean loss, accuracy or None for non-classification tasks), identical on every rank;
    (None, None) without an eval set. Per-batch work is local; the totals are all-reduced once.
    """
    if task.eval is None:
        return None, None
    bare = s.unwrap(model)
    bare.eval()
    totals = torch.zeros(3, dtype=torch.float64)  # loss * n, correct, n
    slices = list(eval_slices(len(task.eval), batch_size, s.rank, s.world_size))  # type: ignore[arg-type]
    n_forward = len(slices)
    if s.forward_is_collective:  # every rank runs as many forwards as the busiest one
        n_forward = int(s.all_reduce(torch.tensor([n_forward]), op="max").item())
    with torch.no_grad():
        for k in range(n_forward):
            if k >= len(slices):  # padding forward on a repeated batch; its output is not counted
                pad = slices[0] if slices else torch.arange(1)
                bare(to_device(fetch(task.eval, pad), s.device)[0])
                continue
            idx = slices[k]
            x, y = to_device(fetch(task.eval, idx), s.device)
            out = bare(x)
            totals[0] += float(task.loss(out, y)) * len(idx)
            if task.classification:
                totals[1] += float((out.argmax(-1) == y).float().mean()) * len(idx)
            totals[2] += len(idx)
    bare.train()
    s.all_reduce(totals, op="sum")
    n = max(float(totals[2]), 1.0)
    return float(totals[0]) / n, (float(totals[1]) / n if task.classification else None)
