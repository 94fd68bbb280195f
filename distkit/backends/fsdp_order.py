"""The fsdp engine's collectives: FSDP2's own all-gather and reduce-scatter per unit, timed as waiting on
communication, and with ``find_unused_parameters`` checked to be the same unit on every rank.

Why the check: FSDP2 issues one all-gather (forward, and again in backward where a unit freed its parameters) and
one reduce-scatter (backward) per unit that runs. A unit that some ranks run and others skip in a step (a branch on
the data, layer drop) makes the ranks' sequences of collectives part: each rank's next collective then meets another
unit's on the other ranks. Where the two units' sizes differ, gloo aborts the process; where they are the same (two
blocks of one transformer), the gradients of different units are averaged together and the run goes on, silently
wrong. DDP with ``find_unused_parameters`` gives such a step its result (zeros where a rank did not use a
parameter); FSDP2 cannot (a unit no forward ran on a rank has no gradient there to reduce). So where the user
declared that parameters may go unused (``distributed.options = {'find_unused_parameters': True}``: the flag that
script needs under DDP), every collective first exchanges which unit it is for (one 8-byte all-gather on the same
group), and a mismatch stops every rank at once, before the gradients are mixed, with one line naming the units
and the fix. Without the flag, a parameter a rank did not use has no gradient there, and the engine's step stops
on it with DDP's error (:func:`distkit.backends.parts.unused_parameters`), as DDP without the flag does.
"""
from __future__ import annotations

from typing import Any

import torch

from distkit.errors import UsageError

from .parts import SOME_RANKS_FIX

#: what a collective is for: kind * UNITS + unit index
_KINDS = {"all_gather": 1, "reduce_scatter": 2}
_UNITS = 1_000_000


def collectives(strategy: Any, unit: int, names: list[str], check: bool) -> tuple[Any, Any, Any]:
    """The all-gather and reduce-scatter for unit number ``unit`` (``names[unit]`` its qualified name), timed in
    ``strategy.waiting()`` (``compute_fraction`` leaves it out: on gloo FSDP2 runs them synchronously, so the
    call's wall time is the wait; on CUDA they are queued on their own streams and return at once); with ``check``,
    each preceded by the unit exchange (collective on the same group, every rank of it). Third: the all-reduce hook
    for HSDP (``FSDPModule.set_all_reduce_hook``): FSDP2 all-reduces a reduce-scattered shard across the replicas
    with ``dist.all_reduce`` right after the reduce-scatter returns and calls the hook right after it, so the time
    from the one to the other is that all-reduce's, counted as waiting too."""
    import time

    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    scattered: list[float] = []  # when this unit's last reduce-scatter returned

    def all_reduced(_output: torch.Tensor) -> None:
        if scattered:
            strategy.comm_wait_s += time.perf_counter() - scattered.pop()

    class UnitAllGather(DefaultAllGather):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                     async_op: bool = False) -> Any:
            with strategy.waiting():
                if check:
                    same_unit(strategy.rank, "all_gather", unit, names, group, input_tensor.device)
                return super().__call__(output_tensor, input_tensor, group, async_op)

    class UnitReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            with strategy.waiting():
                if check:
                    same_unit(strategy.rank, "reduce_scatter", unit, names, group, input_tensor.device)
                work = super().__call__(output_tensor, input_tensor, group, op, async_op)
            scattered[:] = [time.perf_counter()]
            return work

    return UnitAllGather(), UnitReduceScatter(), all_reduced


def same_unit(rank: int, kind: str, unit: int, names: list[str], group: Any, device: torch.device) -> None:
    """Collective over ``group``: every rank says which unit its next ``kind`` is for; UsageError on every rank
    when they differ, naming each rank's unit (global ranks) and the fix."""
    import torch.distributed as dist

    mine = torch.tensor([_KINDS[kind] * _UNITS + unit], dtype=torch.int64, device=device)
    every = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, mine, group=group)
    codes = every.tolist()
    if len(set(codes)) == 1:
        return

    def what(code: int) -> str:
        k, u = divmod(code, _UNITS)
        verb = "gathers" if k == _KINDS["all_gather"] else "reduces"
        return f"{verb} {names[u] if u < len(names) else u!r}"

    ranks = ", ".join(f"rank {dist.get_global_rank(group, i)} {what(c)}" for i, c in enumerate(codes))
    raise UsageError(f"rank {rank}: the ranks run different modules in this step ({ranks}): backend 'fsdp' needs "
                     "every rank to run the same sharded units in each step, as it reduces a unit's gradients where "
                     f"every rank ran it; {SOME_RANKS_FIX}")
