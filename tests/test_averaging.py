"""Parameter averaging: closed forms on real gloo process groups."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from conftest import run_ranks


def _strategy(rank: int, world: int, reduce_type: str = "param"):  # type: ignore[no-untyped-def]
    from distkit.backends.ddp import DDPStrategy
    from distkit.config import resolve
    from distkit.env import ClusterEnv

    cfg = resolve({"torch_distributed": {"reduce_type": reduce_type, "param_sync_step": 1}})
    env = ClusterEnv(rank, rank, world, world, 0, 1, None, None, "env", None, None)
    s = DDPStrategy(cfg, env, torch.device("cpu"))
    s.init()  # the process group exists already (run_ranks): init() reuses it
    return s


def _average_rank_ones(rank: int, world: int) -> list[list[float]]:
    s = _strategy(rank, world)
    tensors = [torch.full((3, 2), float(rank)), torch.full((5,), float(rank) * 2)]
    s.average_parameters(tensors)
    return [t.reshape(-1).tolist() for t in tensors]


def test_average_closed_form_2_and_3_ranks(tmp_path: Path) -> None:
    for world in (2, 3):
        mean = sum(range(world)) / world
        for got in run_ranks(_average_rank_ones, world, tmp_path):
            assert got[0] == [mean] * 6
            assert got[1] == [2 * mean] * 5


def _averager_steps(rank: int, world: int, sync_step: int, steps: int) -> tuple[int, list[float]]:
    from distkit.averaging import ParamAverager

    s = _strategy(rank, world)
    p = torch.zeros(4)
    avg = ParamAverager(s, [p], sync_step)
    for _ in range(steps):
        p += rank + 1  # each rank drifts differently
        avg.after_step()
    avg.final_sync()
    return avg.num_syncs, p.tolist()


def test_sync_every_k_steps_and_final_sync(tmp_path: Path) -> None:
    # 7 steps, sync every 3: syncs after steps 3 and 6, then the final sync for step 7.
    res = run_ranks(_averager_steps, 2, tmp_path, 3, 7)
    assert [r[0] for r in res] == [3, 3]
    # every step adds rank+1 = 1 or 2; averaged: 1.5 per step, exactly
    assert res[0][1] == res[1][1] == [1.5 * 7] * 4


def _time_based(rank: int, world: int) -> int:
    from distkit.averaging import ParamAverager

    s = _strategy(rank, world)
    p = torch.zeros(2)
    avg = ParamAverager(s, [p], sync_step=1, sync_time_diff=0.2)
    for _ in range(12):
        time.sleep(0.05 * (rank + 1))  # rank 1's clock would fire at other steps than rank 0's
        p += rank
        avg.after_step()
    return avg.num_syncs


def test_time_based_decision_is_identical_on_all_ranks(tmp_path: Path) -> None:
    syncs = run_ranks(_time_based, 2, tmp_path)
    assert syncs[0] == syncs[1] and syncs[0] >= 2  # same count: otherwise the job would hang


def _outer(rank: int, world: int, lr: float, momentum: float) -> list[float]:
    from distkit.averaging import ParamAverager

    s = _strategy(rank, world)
    p = torch.ones(3)
    avg = ParamAverager(s, [p], 1, outer_optimizer={"class": "nesterov", "lr": lr, "momentum": momentum})
    p -= rank + 1  # local update: rank 0 -> 0, rank 1 -> -1; mean = -0.5, pseudo-gradient 1.5
    avg.after_step()
    return p.tolist()


def test_outer_nesterov_closed_form(tmp_path: Path) -> None:
    # lr 1, momentum 0: plain averaging.
    assert run_ranks(_outer, 2, tmp_path, 1.0, 0.0) == [[-0.5] * 3] * 2
    # Nesterov first step: update = g + momentum * g = 1.9 * 1.5; anchor 1 - 0.7 * 2.85.
    for got in run_ranks(_outer, 2, tmp_path, 0.7, 0.9):
        assert torch.allclose(torch.tensor(got), torch.full((3,), 1 - 0.7 * 1.9 * 1.5))
