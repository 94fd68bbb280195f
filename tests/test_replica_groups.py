"""Replica groups (``distributed.param_sync_group_size``) on every engine: gradients reduced inside a group
every step, the groups averaged every ``param_sync_step`` steps (issue 25, item 1).

One run of ``tests/conformance/replica_steps.py`` per engine (2 groups x 2 ranks, a model with BatchNorm,
AdamW, sync every 3 of 8 steps), which records every rank's parameters and floating buffers after every
step. Proven: the ranks of a group hold the same parameters after every step (bit for bit); all ranks
hold the same parameters and buffers after each sync and at the end; between syncs the groups differ (it
is not grad mode); every engine equals DDP's replica groups at every step, parameters and buffers (the
buffer rule: the group leader's before each training forward, every rank's averaged at a sync). And
the closed form: with plain SGD and a sync after every step, replica groups equal grad mode on 4 ranks.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import ROOT, SHORT, distkit, final_params, max_abs_diff, ok, run, summary

SCRIPT = str(ROOT / "tests" / "conformance" / "replica_steps.py")
ENGINES = {
    "ddp": "'backend': 'ddp'",
    "mpi": "'backend': 'mpi'",
    "horovod": "'backend': 'horovod'",
    "zero2": "'backend': 'deepspeed', 'deepspeed_config': {'zero_optimization': {'stage': 2}}",
}
GROUPS = ", 'reduce_type': 'param', 'param_sync_step': 3, 'param_sync_group_size': 2"
STEPS, SYNCS = 8, (2, 5)  # steps (0-based) after which the groups averaged
TOL = 1e-6  # another engine's sums may round differently from gloo's (seen: bit-identical on this machine)


@functools.lru_cache(maxsize=None)
def _steps(engine: str, out: str) -> list[dict[str, Any]]:
    res = run([sys.executable, SCRIPT, "--out", out, "--steps", str(STEPS), "--nprocs", "4", "++progress_bar", "False",
               "++distributed", "{" + ENGINES[engine] + GROUPS + "}"], timeout=240)
    ok(res)
    return [torch.load(Path(out) / f"rank-{r}.pt", weights_only=False) for r in range(4)]


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> Any:
    base = tmp_path_factory.mktemp("replicas")
    return lambda engine: _steps(engine, str(base / engine))


def _d(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("engine", list(ENGINES))
def test_groups_are_grad_mode_inside_and_param_mode_across(steps: Any, engine: str) -> None:
    ranks = steps(engine)
    assert all(r["world_size"] == 4 for r in ranks)
    for s in range(STEPS):
        p = [r["steps"][s] for r in ranks]
        assert torch.equal(p[0], p[1]) and torch.equal(p[2], p[3]), f"step {s}: a group's ranks differ"
        if s in SYNCS:
            assert all(torch.equal(p[0], q) for q in p[1:]), f"step {s}: not equal after the sync"
            b = [r["buffers"][s] for r in ranks]
            assert all(torch.equal(b[0], q) for q in b[1:]), f"step {s}: buffers not averaged at the sync"
        else:
            assert _d(p[0], p[2]) > 1e-4, f"step {s}: the groups are equal between syncs (grad mode?)"
    assert all(torch.equal(ranks[0]["final"], r["final"]) for r in ranks[1:])
    assert all(torch.equal(ranks[0]["final_buffers"], r["final_buffers"]) for r in ranks[1:])


@pytest.mark.parametrize("engine", [e for e in ENGINES if e != "ddp"])
def test_every_engine_gives_ddps_replica_groups_step_by_step(steps: Any, engine: str) -> None:
    ref, mine = steps("ddp"), steps(engine)
    for r in range(4):
        for s in range(STEPS):
            assert _d(mine[r]["steps"][s], ref[r]["steps"][s]) <= TOL, f"rank {r} step {s}: parameters differ from DDP's"
            assert _d(mine[r]["buffers"][s], ref[r]["buffers"][s]) <= TOL, f"rank {r} step {s}: buffers differ from DDP's"


@pytest.mark.parametrize("engine", ["ddp", "mpi"])
def test_sgd_with_a_sync_every_step_equals_grad_mode_on_all_ranks(tmp_path: Path, engine: str,
                                                                   ddp4_grad: Path) -> None:
    # mean over groups of (p - lr * mean over the group of g) = p - lr * mean over all ranks of g
    out = tmp_path / engine
    over = "{'backend': '%s', 'reduce_type': 'param', 'param_sync_step': 1, 'param_sync_group_size': 2}" % engine
    ok(distkit("train", "configs/returnn_ddp.py", *SHORT, "--nprocs", "4", "++output_dir", str(out), "++distributed", over))
    s = summary(out)
    assert (s["reduce_type"], s["param_sync_step"], s["param_sync_group_size"], s["ranks_in_sync"]) == ("param", 1, 2, True)
    for r in range(4):
        assert max_abs_diff(final_params(out, r), final_params(ddp4_grad)) <= TOL


@pytest.fixture(scope="module")
def ddp4_grad(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp4") / "grad"
    ok(distkit("train", "configs/returnn_ddp.py", *SHORT, "--nprocs", "4", "++output_dir", str(out)))
    return out


def test_sigkill_then_resume_with_replica_groups_is_bit_identical(tmp_path: Path) -> None:
    # killed at step 13, resumed from the checkpoint of step 10, mid-period (sync every 3): each rank's own
    # state (its group's optimizer moments, the averager's counters) is in its rank file, so the continuation
    # equals the uninterrupted run bit for bit
    over = "{'reduce_type': 'param', 'param_sync_step': 3, 'param_sync_group_size': 2}"
    args = ["train", "configs/returnn_ddp.py", *SHORT, "--nprocs", "4", "++distributed", over, "++checkpoint_every", "5",
            "++optimizer", "{'class': 'sgd', 'momentum': 0.9}"]
    ok(distkit(*args, "++output_dir", str(tmp_path / "whole")))
    out = tmp_path / "killed"
    killed = distkit(*args, "++output_dir", str(out), DISTKIT_FAULT="3:13:kill")
    assert killed.returncode != 0 and "rank 3 failed (killed by SIGKILL)" in killed.stderr, killed.stderr[-3000:]
    assert (out / "checkpoints" / "latest").read_text() == "step-0000010"
    resumed = ok(distkit(*args, "++output_dir", str(out), "++resume", "auto"))
    assert "at step 10" in resumed.stdout
    assert summary(out)["param_checksum"] == summary(tmp_path / "whole")["param_checksum"]
    for r in range(4):
        assert max_abs_diff(final_params(out, r), final_params(tmp_path / "whole", r)) == 0.0
