"""Which samples each rank trains on: ``shard`` and ``random_seed_offset``.

``shard``: every epoch one global permutation (seed + epoch, identical on all ranks) is
cut into global batches of ``world_size * batch_size``; rank r takes the r-th slice of
each. So N ranks x batch B see exactly the samples 1 rank x batch N*B sees, in the same
order, which is what makes grad mode reproduce single-process training. The incomplete
last global batch is dropped, so every rank runs the same number of steps (no hang).

``random_seed_offset`` (RETURNN's recommended mode): every rank iterates the whole data
in its own order, seeded with seed + epoch + rank offset.
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

#: RETURNN's per-rank seed offset for random_seed_offset.
RANK_SEED_OFFSET = 16127


class BatchPlan:
    """Deterministic per-rank batch indices for any (epoch, step); no iteration state.

    Because a batch is a pure function of (epoch, step) the data position after a resume
    is restored exactly by starting at the saved step.
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int, mode: str, seed: int) -> None:
        self.n, self.b, self.rank, self.world, self.mode, self.seed = num_samples, batch_size, rank, world_size, mode, seed
        per_step = batch_size * world_size if mode == "shard" else batch_size
        self.steps_per_epoch = num_samples // per_step
        self._cache: tuple[int, torch.Tensor] | None = None  # (epoch, permutation): one randperm per epoch

    def _perm(self, epoch: int) -> torch.Tensor:
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        seed = self.seed * 1_000_003 + epoch
        if self.mode == "random_seed_offset":
            seed += (self.rank + 1) * RANK_SEED_OFFSET
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(seed))
        self._cache = (epoch, perm)
        return perm

    def indices(self, epoch: int, start_step: int = 0, steps: int | None = None) -> Iterator[torch.Tensor]:
        """Index tensors of this rank's batches for ``epoch``, from ``start_step``."""
        perm = self._perm(epoch)
        end = self.steps_per_epoch if steps is None else min(steps, self.steps_per_epoch)
        for s in range(start_step, end):
            if self.mode == "shard":
                lo = s * self.b * self.world + self.rank * self.b
            else:
                lo = s * self.b
            yield perm[lo:lo + self.b]


def fetch(dataset: "Dataset[Any]", idx: torch.Tensor) -> Any:
    """The batch at ``idx``: tensor indexing for TensorDataset (no per-item Python), else collate."""
    if isinstance(dataset, TensorDataset):
        return tuple(t[idx] for t in dataset.tensors)
    return default_collate([dataset[int(i)] for i in idx])


def eval_slices(num_samples: int, batch_size: int, rank: int, world_size: int) -> Iterator[torch.Tensor]:
    """This rank's eval batches: a contiguous, disjoint slice of the eval set (sizes may differ by one).

    No collective per batch, so uneven slices cannot hang; totals are reduced once after.
    """
    lo = num_samples * rank // world_size
    hi = num_samples * (rank + 1) // world_size
    for s in range(lo, hi, batch_size):
        yield torch.arange(s, min(s + batch_size, hi))


def to_device(batch: Sequence[Any], device: torch.device) -> list[Any]:
    return [t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t for t in batch]
