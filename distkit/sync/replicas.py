"""param mode's replica groups: ``distributed.param_sync_group_size = G`` cuts the ranks into groups of G
consecutive ranks (rank r is in group ``r // G`` at position ``r % G``).

Inside a group the engine reduces gradients every step, as in grad mode on a world of G ranks (DDP on a
sub-group, the mpi engine on a split communicator, Horovod on a process set, DeepSpeed on a data-parallel
group of G with ZeRO partitions inside it): the ranks of a group hold the same model after every step.
Across groups, param mode: every ``param_sync_step`` steps (or ``param_sync_time_diff`` seconds) the groups
average, each rank with the rank at its own position in every other group (the *cross* group), so every
link carries one copy of the model, not G. G = 1 is plain param mode (every rank its own replica); G = the
world size is grad mode with no averaging. Only arithmetic here: each engine makes its own groups from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from distkit.errors import UnsupportedCombination


@dataclass(frozen=True)
class ReplicaGroups:
    """Rank ``rank``'s place among ``world_size // size`` replica groups of ``size`` consecutive ranks."""

    rank: int
    world_size: int
    size: int

    @property
    def index(self) -> int:
        """Which replica group this rank is in (0 .. count - 1)."""
        return self.rank // self.size

    @property
    def position(self) -> int:
        """This rank's place inside its group (0 .. size - 1): its partition under ZeRO, its cross group."""
        return self.rank % self.size

    @property
    def count(self) -> int:
        """How many replica groups (what a cross-group average divides by)."""
        return self.world_size // self.size

    @property
    def leader(self) -> int:
        """The global rank of this group's first rank: where the group's buffers come from (DDP's rule)."""
        return self.index * self.size

    def groups(self) -> list[list[int]]:
        """Every replica group's ranks, in group order (every rank makes all of them, in this order)."""
        return [list(range(k * self.size, (k + 1) * self.size)) for k in range(self.count)]

    def crosses(self) -> list[list[int]]:
        """Every cross group's ranks (the ranks at one position in every group), in position order."""
        return [list(range(i, self.world_size, self.size)) for i in range(self.size)]


def replica_groups(reduce_type: str, size: int, rank: int, world_size: int) -> Optional[ReplicaGroups]:
    """The layout for ``distributed.param_sync_group_size = size``: None outside param mode and for
    ``size == 1`` (every rank its own replica). Every rank finds a size that does not divide the world
    before any collective, so the error is agreed (one line, exit 2)."""
    if reduce_type != "param" or size == 1 or world_size == 1:
        return None
    if world_size % size:
        error = UnsupportedCombination(f"param_sync_group_size {size} does not divide the world size {world_size}: "
                                       "use a divisor of the number of ranks")
        error.agreed = True
        raise error
    return ReplicaGroups(rank, world_size, size)
