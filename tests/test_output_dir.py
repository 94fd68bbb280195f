"""output_dir is one run's (issue 23, items 6 and 7): a second run started on it while the first runs stops
with one line naming the holder and writes nothing; the small JSON files the trainer rewrites are replaced
atomically, so a full disk leaves the previous one intact and is one line."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, base_env, distkit, ok, run, summary

ARGS = ["train", str(ROOT / "configs" / "returnn_ddp.py"), "++max_steps", "10", "++checkpoint_every", "5",
        "++log_every", "5", "++progress_bar", "False"]

#: a callback that holds the run after its checkpoint of step 5 (rank 0) until the test creates GATE: the
#: run is then surely alive, has written its files and a checkpoint, while the second run starts
GATED = """\
import os, time

class Gate:
    def on_train_start(self, trainer):
        if trainer.is_main:
            open({started!r}, "w").close()

    def on_checkpoint(self, trainer, path):
        deadline = time.monotonic() + 120
        while trainer.is_main and trainer.step == 5 and not os.path.exists({gate!r}) and time.monotonic() < deadline:
            time.sleep(0.05)

callbacks = [Gate()]
"""


def test_second_run_on_a_busy_output_dir_is_one_line(tmp_path: Path) -> None:
    out, started, gate = tmp_path / "run", tmp_path / "started", tmp_path / "gate"
    cfg = tmp_path / "gate.py"
    cfg.write_text(GATED.format(started=str(started), gate=str(gate)))
    cmd = [sys.executable, "-m", "distkit", *ARGS, str(cfg), "--nprocs", "2", "++output_dir", str(out)]
    first = subprocess.Popen(cmd, cwd=ROOT, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists(), first.communicate()
        while not (out / "checkpoints" / "latest").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # then held right after step-5 is saved
        assert (out / "checkpoints" / "latest").read_text() == "step-0000005"
        before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        # a resume on 2 ranks (which without the lock trains alongside the first run) and a fresh run in one
        # process: both refused
        for extra in (["++resume", "auto", "--nprocs", "2"], []):
            second = distkit(*ARGS, "++output_dir", str(out), *extra)
            assert second.returncode == 2 and second.stdout == "", second.stderr
            assert re.fullmatch(
                rf"distkit: error: output_dir '{re.escape(str(out))}' is in use by another distkit run \(pid "
                rf"{first.pid} on host {re.escape(os.uname().nodename)}, "
                r"started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC\): "
                r"wait for it to end, stop it, or choose another output_dir\n", second.stderr), second.stderr
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing written
        gate.touch()
        stdout, stderr = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.communicate()
    assert first.returncode == 0, stderr
    # the first run's outputs are its own, complete
    assert summary(out)["steps"] == 10
    assert [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()] == [5, 10]
    assert (out / "checkpoints" / "latest").read_text() == "step-0000010"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-0000005", "step-0000010"]
    # the lock ended with the run that held it: the next run there starts (a resume; then one process alone)
    resumed = ok(distkit(*ARGS, "++output_dir", str(out), "++resume", "auto", "--nprocs", "2"))
    assert "at step 10" in resumed.stdout
    ok(distkit(*ARGS, "++output_dir", str(out), "++resume", "none", "++max_steps", "5"))
    assert summary(out)["steps"] == 5


#: a callback that fills the disk (rank 0) when training ended, right before summary.json is written, and
#: adds 12 KB to the summary (more than the pages the previous summary.json frees when it is truncated)
FILL_DISK = """\
import errno, os

class FillDisk:
    def on_train_end(self, trainer, summary):
        summary["notes"] = "x" * 12000
        if not trainer.is_main:
            return
        with open(os.path.join(trainer.cfg.output_dir, "filler"), "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"x" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e

callbacks = [FillDisk()]
"""


def test_full_disk_while_writing_summary_keeps_the_previous_one(tmp_path: Path) -> None:
    from test_checkpoint_integrity import tmpfs

    cfg = tmp_path / "fill.py"
    cfg.write_text(FILL_DISK)
    with tmpfs(tmp_path / "small", "size=2m") as disk:
        out = disk / "run"
        ok(distkit(*ARGS, "--nprocs", "2", "++output_dir", str(out)))
        before = (out / "summary.json").read_bytes()
        assert json.loads(before)["steps"] == 10
        # the finished run resumed (its final checkpoint is saved again), the disk full when summary.json is written
        res = distkit(*ARGS, str(cfg), "--nprocs", "2", "++output_dir", str(out), "++resume", "auto")
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert res.stderr.splitlines() == [
            f"distkit: error: no space left on device writing '{out / 'summary.json'}' (the previous one is intact): "
            f"free space or fix the permissions of '{out}', then continue with ++resume auto"], res.stderr
        assert (out / "summary.json").read_bytes() == before
        assert not (out / ".summary.json.tmp").exists()


def test_full_disk_while_writing_the_deepspeed_config_keeps_the_previous_one(tmp_path: Path) -> None:
    """Issue 23 item 6: DeepSpeed's resolved config is written like the run's other JSON files (write, then
    rename): on a full disk the previous file stays whole and rank 0 says so in one line (it was truncated)."""
    from test_checkpoint_integrity import tmpfs

    with tmpfs(tmp_path / "small", "size=1m") as disk:
        out = disk / "run"
        out.mkdir()
        before = b'{"an earlier run": true}\n'
        (out / "deepspeed_config.resolved.json").write_bytes(before)
        (out / ".distkit.lock").write_text("an earlier run\n")  # the lock's holder line then fits its page
        try:
            with open(disk / "filler", "wb") as f:
                while True:
                    f.write(b"x" * 4096)
                    f.flush()
        except OSError:
            pass  # the disk is full now
        res = distkit(*ARGS, "--nprocs", "2", "++output_dir", str(out), "++resume", "none", "++distributed",
                      '{"backend": "deepspeed", "deepspeed_config": {"zero_optimization": {"stage": 2}}}')
        assert res.returncode != 0
        lines = [ln for ln in res.stderr.splitlines() if "deepspeed_config.resolved.json" in ln]
        assert lines and all("no space left on device writing" in ln and "(the previous one is intact)" in ln
                             for ln in lines), res.stderr[-3000:]
        assert "Traceback" not in res.stderr, res.stderr[-3000:]
        assert (out / "deepspeed_config.resolved.json").read_bytes() == before
        assert not (out / ".deepspeed_config.resolved.json.tmp").exists()


def test_an_output_dir_refusal_under_a_launcher_is_one_line(tmp_path: Path) -> None:
    """(Issue 62 item 6.) 2 ranks of a launcher refused by the same output_dir check: one line, from local rank 0 (was one per rank);
    the other rank ends quietly with the same status."""
    out = tmp_path / "out"
    cfg = tmp_path / "cfg.py"
    cfg.write_text(f"output_dir = {str(out)!r}\ntask = 'digits'\n")
    (out / "checkpoints" / "step-0000005").mkdir(parents=True)
    res = run([str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", "2", "-m", "distkit",
               "train", str(cfg)], timeout=120)
    assert res.returncode != 0
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.startswith("distkit:")]
    assert lines == [f"distkit: error: output_dir '{out}' holds checkpoints of an earlier run (newest: step-0000005): "
                     "continue it with ++resume auto, start over with ++resume none (its checkpoints are then "
                     "replaced), or choose another output_dir"], res.stderr[-3000:]
    assert "exitcode  : 2" in res.stderr, res.stderr[-3000:]  # every rank's status (torchrun's report names one)
