"""Atomic checkpoints: a kill in the middle of a save leaves the previous one loadable."""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import distkit, final_params, ok, summary

ARGS = ["train", "configs/returnn_ddp.py", "--nprocs", "2", "++max_steps", "20", "++checkpoint_every", "5",
        "++progress_bar", "False", "++optimizer", "{'class': 'adam'}", "++learning_rate", "0.001"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run both tests' killed and resumed runs must reproduce bit for bit (synchronous checkpoints)."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    ok(distkit(*ARGS, "++output_dir", str(out)))
    return out


def test_kill_during_checkpoint_save_keeps_previous(tmp_path: Path, uninterrupted: Path) -> None:
    out = tmp_path / "run"
    # rank 0 dies after writing its file of step 10 and before the manifest / rename / latest
    res = distkit(*ARGS, "++output_dir", str(out), DISTKIT_FAULT="0:10:kill:checkpoint")
    assert res.returncode != 0 and "rank 0 failed (killed by SIGKILL)" in res.stderr
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text() == "step-0000005"
    partial = ckpts / ".step-0000010.tmp"
    assert partial.is_dir() and not (partial / "manifest.json").exists()
    assert not (ckpts / "step-0000010").exists()
    resumed = ok(distkit(*ARGS, "++output_dir", str(out), "++resume", "auto"))
    assert "at step 5" in resumed.stdout
    a, b = final_params(uninterrupted), final_params(out)
    assert all(a[k].equal(b[k]) for k in a)  # Adam moments restored too
    assert summary(out)["steps"] == 20 and not partial.exists()
    # only the newest 3 complete checkpoints are kept
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step-")) == \
        ["step-0000010", "step-0000015", "step-0000020"]


def test_async_checkpoints_equal_sync_and_a_kill_mid_write_keeps_the_previous(tmp_path: Path,
                                                                             uninterrupted: Path) -> None:
    """checkpoint_async: the files are written in a background thread and each checkpoint becomes `latest`
    at the next one. A rank killed while writing step 10's file in the background leaves step 5 as
    `latest`; the resumed run ends bit-identical to a run with synchronous checkpoints."""
    sync, out = uninterrupted, tmp_path / "async"
    res = distkit(*ARGS, "++checkpoint_async", "True", "++output_dir", str(out), DISTKIT_FAULT="1:10:kill:rank_file")
    assert res.returncode != 0 and "rank 1 failed (killed by SIGKILL)" in res.stderr
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text() == "step-0000005" and not (ckpts / "step-0000010").exists()
    resumed = ok(distkit(*ARGS, "++checkpoint_async", "True", "++output_dir", str(out), "++resume", "auto"))
    assert "at step 5" in resumed.stdout
    a, b = final_params(sync), final_params(out)
    assert all(a[k].equal(b[k]) for k in a)
    s = summary(out)
    assert s["param_checksum"] == summary(sync)["param_checksum"]
    assert s["checkpoints"] == 3 and len(s["checkpoint_stalls_s"]) == 3  # steps 10, 15 and the final 20
    assert abs(s["checkpoint_stall_s"] - sum(s["checkpoint_stalls_s"])) < 1e-5 and min(s["checkpoint_stalls_s"]) > 0
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step-")) == \
        ["step-0000010", "step-0000015", "step-0000020"]
    assert not any(p.name.endswith(".tmp") for p in ckpts.iterdir())  # the interrupted write was cleaned up
