"""``dk.gather``: every rank's tensors, concatenated in rank order, on every rank (Accelerate's ``gather_for_metrics``).

Built on :meth:`Strategy.all_reduce`, which every engine has: each rank writes its rows into its own slot of a
zero buffer and the sum is the concatenation (a sum with zeros is exact, so the values are the ranks' bit for bit).
Costs ``world_size`` times the data of an all-gather; it is meant for evaluation outputs and metrics, once per
batch, not for the training step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.utils import _pytree as pytree

from distkit.errors import UsageError

if TYPE_CHECKING:
    from distkit.job import Job

#: dtypes an all-reduce sums as they are; others (bool, 16-bit floats) travel as one of these and come back exact
_EXACT = {torch.float32, torch.float64, torch.int32, torch.int64}


def gather(job: "Job", data: Any, keep: Optional[int] = None) -> Any:
    """Collective: ``data`` (a tensor, or tuples, lists and dicts of them) from every rank, each tensor concatenated
    along dim 0 in rank order; ``keep``: keep only the first ``keep`` rows of each (the real samples of a padded last
    batch). Ranks may hold different numbers of rows; the other dimensions and the dtype must agree."""
    leaves, spec = pytree.tree_flatten(data)
    bad = [type(t).__name__ for t in leaves if not isinstance(t, torch.Tensor)]
    if bad:
        raise UsageError(f"dk.gather(data): needs tensors (or tuples, lists, dicts of them), got {bad[0]}: convert "
                         "numbers with torch.tensor(...), or use dk.all_gather_object for other objects")
    shapes = [tuple(t.shape) if t.dim() else (1,) for t in leaves]
    everyone = job.all_gather_object([(s, str(t.dtype)) for s, t in zip(shapes, leaves)])
    out = []
    for i, t in enumerate(leaves):
        theirs = [e[i] for e in everyone]
        if len({(s[1:], d) for s, d in theirs}) > 1:
            raise UsageError(f"dk.gather: tensor {i} differs across ranks beyond its first dimension: "
                             f"{[f'{list(s)} {d}' for s, d in theirs]}; gather tensors of one shape and dtype")
        rows = [s[0] for s, _ in theirs]
        flat = t.reshape(shapes[i])
        wire = flat if flat.dtype in _EXACT else flat.to(torch.float64 if flat.is_floating_point() else torch.int64)
        buf = torch.zeros((sum(rows), *shapes[i][1:]), dtype=wire.dtype, device=t.device)
        lo = sum(rows[:job.rank])
        buf[lo:lo + rows[job.rank]] = wire
        buf = job.all_reduce(buf, op="sum").to(t.dtype)
        out.append(buf[:keep] if keep is not None else buf)
    return pytree.tree_unflatten(out, spec)
