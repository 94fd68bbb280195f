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

import dataclasses
import time
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Optional, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler, Sampler, TensorDataset, default_collate

from distkit.config import RunConfig
from distkit.errors import UsageError


class SessionView(Protocol):
    """What this module reads (and sets) of :class:`distkit.Session`, which has every member: typed by this
    protocol, the module does not import the Session (it sits below it).
    """

    _meter: Any
    cfg: RunConfig

    def _set_gather_tail(self, real: Optional[int]) -> None:
        """Real samples of the newest (padded last) batch, for ``gather``."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Collective: every rank must call it, in the same order."""

    @property
    def device(self) -> torch.device:
        """This rank's device."""

    @property
    def rank(self) -> int:
        """Global rank."""

    @property
    def world_size(self) -> int:
        """Ranks in the job."""


#: RETURNN's per-rank seed offset for random_seed_offset.
RANK_SEED_OFFSET = 16127


class BatchPlan:
    """Deterministic per-rank batch indices for any (epoch, step); no iteration state.

    Because a batch is a pure function of (epoch, step) the data position after a resume
    is restored exactly by starting at the saved step.
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int, mode: str, seed: int,
                 shuffle: bool = True, drop_last: bool = True) -> None:
        self.n, self.b, self.rank, self.world, self.mode, self.seed = num_samples, batch_size, rank, world_size, mode, seed
        self.shuffle = shuffle
        per_step = batch_size * world_size if mode == "shard" else batch_size
        self.full_steps = num_samples // per_step
        #: samples of the incomplete last global batch, kept with ``drop_last`` False (shard mode only: the caller
        #: refuses it elsewhere): :meth:`indices`
        self.tail = 0 if drop_last else num_samples - self.full_steps * per_step
        self.steps_per_epoch = self.full_steps + (self.tail > 0)
        self._cache: tuple[int, torch.Tensor] | None = None  # (epoch, permutation): one randperm per epoch

    def batch_size_at(self, step: int) -> int:
        """This rank's batch size at ``step``: ``b``, or the share of the incomplete last global batch."""
        return self.b if step < self.full_steps else -(-self.tail // self.world)

    def _perm(self, epoch: int) -> torch.Tensor:
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        if not self.shuffle:  # dataset order; random_seed_offset still gives each rank the whole set
            self._cache = (epoch, torch.arange(self.n))
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
            if s >= self.full_steps:  # the incomplete last global batch (drop_last False)
                yield self._tail_indices(perm)
            elif self.mode == "shard":
                lo = s * self.b * self.world + self.rank * self.b
                yield perm[lo:lo + self.b]
            else:
                lo = s * self.b
                yield perm[lo:lo + self.b]

    def _tail_indices(self, perm: torch.Tensor) -> torch.Tensor:
        """The last global batch of ``tail`` samples: shard mode pads it, as ``DistributedSampler`` does, with the
        epoch's first samples to ``k * world`` (``k`` = ceil(tail / world)) and gives rank r the r-th ``k``, so
        every rank takes the same number of samples (no rank waits) and the padded copies come last in rank
        order (:meth:`distkit.Session.gather` drops them); every sample is seen once, the first few twice."""
        rest = perm[self.full_steps * self.b * self.world:]
        k = self.batch_size_at(self.full_steps)
        pad = k * self.world - self.tail
        padded = torch.cat([rest, perm.repeat(-(-pad // self.n))[:pad]]) if pad else rest
        return padded[self.rank * k:(self.rank + 1) * k]


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


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it moved to ``device``: tensors, tuples (named too), lists, dicts,
    dataclasses, and objects with a ``.to(device)`` of their own (Hugging Face ``BatchEncoding``)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    if isinstance(batch, Mapping) and not hasattr(batch, "to"):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: to_device(getattr(batch, f.name), device)
                                             for f in dataclasses.fields(batch) if f.init})
    if hasattr(batch, "to") and callable(batch.to):
        try:
            return batch.to(device)
        except Exception as e:  # e.g. a .to() that takes no device: say which object, not a deep traceback
            raise UsageError(f"a batch item of type {type(batch).__name__} could not be moved to {device} "
                             f"({type(e).__name__}: {e}): return tensors (or containers of tensors) from the dataset "
                             "or collate_fn") from e
    return batch


class PlanSampler(Sampler[list[int]]):
    """A batch sampler over a :class:`BatchPlan`: this rank's batches of one epoch, from ``start``.

    ``steps`` batches per epoch on every rank (agreed by the caller), so no rank waits for another.
    """

    def __init__(self, plan: BatchPlan, steps: int) -> None:
        self.plan, self.steps = plan, steps
        self.epoch, self.start = 0, 0
        self.chosen = False  # set_epoch was called since the last pass began

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start, self.chosen = epoch, start, True

    def index_tensors(self) -> Iterator[torch.Tensor]:
        """This epoch's batches as index tensors (the loader's fast path uses them as they are)."""
        return self.plan.indices(self.epoch, self.start, self.steps)

    def __iter__(self) -> Iterator[list[int]]:
        for idx in self.index_tensors():
            yield idx.tolist()

    def __len__(self) -> int:
        return max(0, self.steps - self.start)


class _TensorRows(Dataset[Any]):
    """A TensorDataset read a batch at a time (one index per tensor, no per-item Python or collate)."""

    def __init__(self, ds: TensorDataset) -> None:
        self.tensors = ds.tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[i] for t in self.tensors)

    def __getitems__(self, idx: list[int]) -> tuple[torch.Tensor, ...]:
        rows = torch.as_tensor(idx)
        return tuple(t[rows] for t in self.tensors)


def _batch_as_is(batch: Any) -> Any:
    return batch


class ShardedLoader(DataLoader[Any]):
    """A real ``torch.utils.data.DataLoader`` whose batch sampler is a :class:`PlanSampler`.

    Yields this rank's batches, moved to ``device``. Call ``set_epoch(epoch)`` before each epoch
    (``set_epoch(epoch, start=k)`` resumes at batch ``k``); without it, a pass that begins after a pass
    that ran to its end takes the next epoch's order (Accelerate's habit: scripts that never call
    ``set_epoch`` get a fresh order each epoch, where they repeated epoch 0's), while a pass begun and left
    (``next(iter(loader))`` for a sample batch) does not count. ``on_batch(n, t)`` is told the number of samples of every batch handed out and the
    ``time.perf_counter()`` at which fetching it began.
    """

    def __init__(self, dataset: "Dataset[Any]", sampler: PlanSampler, device: torch.device,
                 collate_fn: Optional[Callable[[list[Any]], Any]] = None, num_workers: int = 0,
                 pin_memory: bool = False, on_batch: Optional[Callable[[int, float], None]] = None,
                 on_tail: Optional[Callable[[Optional[int]], None]] = None, **kwargs: Any) -> None:
        # In-memory tensors in this process: index them a batch at a time and skip the DataLoader's
        # per-batch machinery (profiler ranges, fetcher, collate), ~0.1 ms a step of pure overhead.
        self._tensors = dataset.tensors if (collate_fn is None and isinstance(dataset, TensorDataset)
                                            and num_workers == 0 and not pin_memory) else None
        if collate_fn is None and isinstance(dataset, TensorDataset):
            dataset, collate_fn = _TensorRows(dataset), _batch_as_is
        super().__init__(dataset, batch_sampler=sampler, collate_fn=collate_fn or default_collate,
                         num_workers=num_workers, pin_memory=pin_memory, **kwargs)
        self.plan_sampler, self.device, self._on_batch, self._on_tail = sampler, device, on_batch, on_tail
        self._own_generator = kwargs.get("generator") is None
        self._ran_to_end = False  # the last pass begun ran to its end: without set_epoch, the next takes the next epoch

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Use ``epoch``'s order (the same on every rank and at any world size), from batch ``start``."""
        self.plan_sampler.set_epoch(epoch, start)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.plan_sampler
        if not sampler.chosen and self._ran_to_end:
            sampler.epoch, sampler.start = sampler.epoch + 1, 0  # a new pass without set_epoch: the next epoch
        sampler.chosen = self._ran_to_end = False
        return self._batches()

    def _batches(self) -> Iterator[Any]:
        move, plan, step = self.device.type != "cpu", self.plan_sampler.plan, self.plan_sampler.start
        tensors = self._tensors
        if tensors is not None:
            it: Iterator[Any] = (tuple(t[idx] for t in tensors) for idx in self.plan_sampler.index_tensors())
        else:
            if self._own_generator:
                # A DataLoader iterator draws its base seed (the workers' seeds) from ``generator``, by default
                # from the global CPU generator: one draw per pass, which moved the random stream the model
                # sees (dropout) once more when a resumed run started its epoch mid-way, so a mid-epoch resume
                # was not the same run (issue 36). The base seed is a function of (seed, epoch, rank) instead:
                # the global stream is the model's alone, and workers get the same seeds after a resume.
                self.generator = torch.Generator().manual_seed(
                    (plan.seed * 1_000_003 + self.plan_sampler.epoch) * 65_537 + plan.rank + 1)
            it = super().__iter__()
        while True:
            t_fetch = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                self._ran_to_end = True
                return
            if self._on_batch is not None:
                self._on_batch(plan.batch_size_at(step), t_fetch)
            if self._on_tail is not None:  # dk.gather drops the padded copies of the last global batch
                self._on_tail(plan.tail if step >= plan.full_steps else None)
            step += 1
            yield to_device(batch, self.device) if move else batch


def sharded_loader(session: SessionView, dataset: Any, batch_size: Optional[int], shuffle: bool,
                   collate_fn: Optional[Callable[[list[Any]], Any]], num_workers: int, pin_memory: bool,
                   drop_last: Optional[bool] = None, **kwargs: Any) -> ShardedLoader:
    """Collective: the loader of :meth:`distkit.Session.dataloader` (see there), for ``session``'s rank.
    ``drop_last`` None: the re-sharded loader's own under ``shard`` (a ``DataLoader``'s default False keeps every
    sample, as ``DistributedSampler`` and Accelerate's prepared loaders do), True otherwise."""
    if isinstance(dataset, DataLoader):
        loader = dataset
        dataset = loader.dataset
        if batch_size is None:
            batch_size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
        shuffle = isinstance(loader.sampler, RandomSampler)
        collate_fn = collate_fn or loader.collate_fn
        num_workers, pin_memory = loader.num_workers, loader.pin_memory
        if drop_last is None and session.cfg.data_distribution == "shard":
            # an evaluation loader's drop_last=False, dropped here, evaluated 64 of 101 samples without a word
            drop_last = bool(getattr(loader.batch_sampler, "drop_last", loader.drop_last))
    drop_last = True if drop_last is None else drop_last
    batch_size = session.cfg.batch_size if batch_size is None else batch_size
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UsageError(f"dk.dataloader: batch_size must be an integer >= 1, got {batch_size!r}")
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise UsageError("dk.dataloader needs a map-style dataset (with __len__ and __getitem__), got "
                         f"{type(dataset).__name__}")
    from distkit.ft.state import data_place

    # fault-tolerant replica groups: group i takes what its ranks would take in one job of all the groups
    rank, world = data_place(session.cfg.fault_tolerance, session.rank, session.world_size)
    if not drop_last and session.cfg.data_distribution != "shard":
        raise UsageError("dk.dataloader(drop_last=False) shares every sample out once across the ranks, which needs "
                         "data_distribution = 'shard' (random_seed_offset gives every rank the whole set)")
    plan = BatchPlan(len(dataset), batch_size, rank, world, session.cfg.data_distribution, session.cfg.seed,
                     shuffle=shuffle, drop_last=drop_last)
    # Ranks may hold different data (per-rank datasets): the minimum never hangs.
    steps = int(session.all_reduce(torch.tensor([plan.steps_per_epoch]), op="min").item())
    if steps == 0:  # (the same on every rank: agreed by the all-reduce above)
        error = UsageError(f"dk.dataloader: {len(dataset)} samples make no full global batch of "
                           f"{batch_size} x {session.world_size} ranks: use a smaller batch_size")
        error.agreed = True
        raise error
    return ShardedLoader(dataset, PlanSampler(plan, steps), session.device, collate_fn=collate_fn,
                         num_workers=num_workers, pin_memory=pin_memory, on_batch=session._meter.batch_handed_out,
                         on_tail=session._set_gather_tail, **kwargs)
