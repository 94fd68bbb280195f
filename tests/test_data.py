"""Data distribution: the shard layout that makes N x B equal 1 x N*B."""
from __future__ import annotations

import torch

from distkit.data import BatchPlan, eval_slices


def test_shard_ranks_partition_the_single_rank_batches() -> None:
    n, b, world = 103, 4, 3
    one = BatchPlan(n, b * world, 0, 1, "shard", seed=7)
    ranks = [BatchPlan(n, b, r, world, "shard", seed=7) for r in range(world)]
    assert one.steps_per_epoch == all(p.steps_per_epoch == 8 for p in ranks) * 8
    for epoch in (0, 1):
        per_rank = [list(p.indices(epoch)) for p in ranks]
        for step, big in enumerate(one.indices(epoch)):
            glued = torch.cat([per_rank[r][step] for r in range(world)])
            assert torch.equal(glued, big)  # same samples, same order
        seen = torch.cat([torch.cat(x) for x in per_rank])
        assert len(set(seen.tolist())) == len(seen)  # disjoint
    assert not torch.equal(torch.cat(list(ranks[0].indices(0))), torch.cat(list(ranks[0].indices(1))))


def test_resume_position_is_pure() -> None:
    p = BatchPlan(50, 5, 1, 2, "shard", seed=3)
    full = list(p.indices(2))
    assert all(torch.equal(a, b) for a, b in zip(full[3:], p.indices(2, start_step=3)))


def test_random_seed_offset_whole_data_per_rank_different_order() -> None:
    a, b = (BatchPlan(40, 8, r, 2, "random_seed_offset", seed=1) for r in (0, 1))
    assert a.steps_per_epoch == b.steps_per_epoch == 5
    ia, ib = torch.cat(list(a.indices(0))), torch.cat(list(b.indices(0)))
    assert sorted(ia.tolist()) == sorted(ib.tolist()) == list(range(40))
    assert not torch.equal(ia, ib)


def test_eval_slices_cover_everything_once_uneven() -> None:
    got = [torch.cat(list(eval_slices(11, 2, r, 3))).tolist() for r in range(3)]
    assert sorted(sum(got, [])) == list(range(11))
    assert [len(g) for g in got] == [3, 4, 4]
