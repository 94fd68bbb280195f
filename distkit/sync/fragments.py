"""param_sync_fragments (Streaming DiLoCo): the cut of the averaged tensors into F fragments and the step rule's
schedule. Arithmetic only, the same on every rank: it depends only on the tensors' sizes, in their fixed order, and on
the step count. (The time rule, the fragments in turn by the maximum elapsed time over ranks, needs an all-reduce: it
is the averager's, :class:`distkit.sync.averager.ParamAverager`.)
"""
from __future__ import annotations

from typing import Optional

from distkit.errors import ConfigError


def check_fragments(fragments: int, sync_step: int, sync_time_diff: Optional[float], count: int) -> None:
    """Refuse ``fragments`` outside 1..``sync_step`` (under the step rule) or over ``count``, the number of tensors
    averaged; the latter is a ConfigError every rank finds at the same point (reported once)."""
    if fragments < 1 or (sync_time_diff is None and fragments > sync_step):
        raise ValueError(f"fragments must be in 1..sync_step ({sync_step}), got {fragments}")
    if fragments > count:
        error = ConfigError(f"'distributed.param_sync_fragments' ({fragments}) is more than the {count} "
                            f"tensors the model averages: set it to at most {count}")
        error.agreed = True  # every rank finds it, at the same point: reported once
        raise error


def cut(sizes: list[int], parts: int) -> list[list[int]]:
    """``range(len(sizes))`` cut into ``parts`` contiguous, non-empty runs of near-equal total size: run k ends
    where the running total comes closest to ``(k+1)/parts`` of the whole (leaving an item for each run after
    it). The same on every rank: it depends only on the sizes, in their fixed order."""
    if not 1 <= parts <= len(sizes):
        raise ValueError(f"cannot cut {len(sizes)} items into {parts} parts")
    total, n = sum(sizes), len(sizes)
    runs: list[list[int]] = []
    run: list[int] = []
    acc = 0  # the running total, times parts below (integers: the same cut on every machine)
    for i, size in enumerate(sizes):
        k = len(runs)
        if run and k < parts - 1:
            target = (k + 1) * total
            # close before item i: the items left are just enough for the runs left, or taking i would overshoot
            # the target by more than stopping here falls short of it
            if n - i == parts - 1 - k or (acc + size) * parts - target > target - acc * parts:
                runs.append(run)
                run = []
        run.append(i)
        acc += size
        k = len(runs)
        if k < parts - 1 and acc * parts >= (k + 1) * total and n - i - 1 >= parts - 1 - k:
            runs.append(run)
            run = []
    runs.append(run)
    return runs


def step_offsets(sync_step: int, fragments: int) -> list[int]:
    """Step rule: fragment i first syncs at step ``i*H//F``, then every H steps (H = ``sync_step``)."""
    return [i * sync_step // fragments for i in range(fragments)]


def due_by_step(steps: int, sync_step: int, fragments: int) -> list[int]:
    """Step rule: the fragments that sync at optimizer step ``steps`` (counted from 1): fragment i at the steps
    ``s >= max(i*H//F, 1)`` with ``(s - i*H//F) % H == 0``."""
    h = sync_step
    return [i for i, o in enumerate(step_offsets(sync_step, fragments)) if steps >= max(o, 1) and (steps - o) % h == 0]


def fragment_indices(fragment_tensors: list[list[int]], fragments: list[int]) -> list[int]:
    """The indices of ``fragments``' tensors (``fragment_tensors``: per fragment, its tensors' indices), in order."""
    return [i for k in fragments for i in fragment_tensors[k]]
