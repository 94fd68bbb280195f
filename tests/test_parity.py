"""Parity on real processes (DESIGN.md section 8): the math of each mode, not "it ran"."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distkit.tasks.digits import make_model

from conftest import distkit, final_params, max_abs_diff, ok, summary

TOL = 1e-5


def train(tmp_path: Path, name: str, nprocs: int, *overrides: str, **env: str) -> Path:
    out = tmp_path / name
    ok(distkit("train", "configs/returnn_ddp.py", "--nprocs", str(nprocs), "++output_dir", str(out),
               "++max_steps", "20", "++progress_bar", "False", "++log_every", "5", *overrides, **env))
    return out


@pytest.mark.parametrize("extra", [[], ["++gradient_clip", "0.05"], ["++accum_grad_multiple_step", "2"]],
                         ids=["plain", "clipped", "accumulated"])
def test_grad_2_ranks_equals_1_rank_double_batch(tmp_path: Path, extra: list[str]) -> None:
    accum = 2 if "++accum_grad_multiple_step" in extra else 1
    b = 8 // accum
    two = train(tmp_path, "two", 2, "++batch_size", str(b), *extra)
    one = train(tmp_path, "one", 1, "++batch_size", str(2 * b * accum), *[e for e in extra if e not in ("++accum_grad_multiple_step", "2")])
    diff = max_abs_diff(final_params(two), final_params(one))
    assert diff <= TOL, diff
    s2, s1 = summary(two), summary(one)
    assert s2["steps"] == s1["steps"] == 20 and s2["samples"] == s1["samples"] == 20 * 16
    # the runs did train: parameters moved far more than the tolerance from their initial values
    assert max_abs_diff(final_params(two), initial_params()) > 1e-3


def initial_params(seed: int = 42) -> dict[str, torch.Tensor]:
    """The digits model as every rank builds it before training (same seed as the config)."""
    torch.manual_seed(seed)
    return make_model().state_dict()


def test_param_sync_every_step_equals_grad(tmp_path: Path) -> None:
    grad = train(tmp_path, "grad", 2)
    param = train(tmp_path, "param", 2, "++torch_distributed", "{'reduce_type': 'param', 'param_sync_step': 1}")
    assert max_abs_diff(final_params(grad), final_params(param)) <= TOL
    assert summary(param)["reduce_type"] == "param" and summary(param)["param_sync_step"] == 1


def test_param_mode_ranks_in_sync_after_final_sync(tmp_path: Path) -> None:
    # 20 steps, sync every 7: the last sync is at step 14, so only the final sync makes ranks agree.
    out = train(tmp_path, "p7", 2, "++torch_distributed", "{'reduce_type': 'param', 'param_sync_step': 7}")
    s = summary(out)
    assert s["ranks_in_sync"] is True
    assert max_abs_diff(final_params(out, 0), final_params(out, 1)) == 0.0
    # and it is not grad mode: parameters differ from the per-step-synced run
    assert max_abs_diff(final_params(out), final_params(train(tmp_path, "g", 2))) > 1e-4


# param mode (each rank file holds its replica); grad mode's kill and resume is tests/test_kill_trials.py's
@pytest.mark.parametrize("mode", ["{'reduce_type': 'param', 'param_sync_step': 4}"], ids=["param"])
def test_sigkill_then_resume_is_bit_identical(tmp_path: Path, mode: str) -> None:
    common = ["++torch_distributed", mode, "++checkpoint_every", "5", "++optimizer", "{'class': 'sgd', 'momentum': 0.9}"]
    ref = train(tmp_path, "ref", 2, *common)
    out = tmp_path / "killed"
    args = ["train", "configs/returnn_ddp.py", "--nprocs", "2", "++output_dir", str(out), "++max_steps", "20",
            "++progress_bar", "False", *common]
    killed = distkit(*args, DISTKIT_FAULT="1:13:kill")
    assert killed.returncode != 0 and "rank 1 failed (killed by SIGKILL)" in killed.stderr
    assert (out / "checkpoints" / "latest").read_text() == "step-0000010"
    assert not (out / "summary.json").exists()
    resumed = ok(distkit(*args, "++resume", "auto"))
    assert "resumed from" in resumed.stdout and "at step 10" in resumed.stdout
    a, b = final_params(ref), final_params(out)
    assert all(a[k].equal(b[k]) for k in a)  # bit-identical
    assert summary(out)["param_checksum"] == summary(ref)["param_checksum"]
