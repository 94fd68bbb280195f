"""Preemption (issue 25 item 7): a scheduler's SIGTERM or SIGUSR1 stops every rank after the same step with a
checkpoint of it, exit status 75, and ``++resume auto`` continues bit-identically.

Each case trains the digits config for 60 steps on 2 ranks, sends the signal to the launching process while
rank 0 is paused at step 20 (released once it took the signal), and checks: the one line naming the signal, the step and the checkpoint; the
checkpoint ``latest`` names; then the resumed run ends bit for bit where the uninterrupted DDP run ends
(every engine is bit-identical to DDP on this config). The other ranks are wherever the run has them then."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from conftest import BIN, ROOT, base_env, catches, distkit, ok, stacks_of_marked, summary

STEPS = 60  # (the pause at PAUSE_STEP holds the run until the signal came: no need of a long run)
ARGS = ["train", str(ROOT / "configs" / "returnn_ddp.py"), "++max_steps", str(STEPS), "++log_every", "5",
        "++progress_bar", "False"]
ZERO2 = '{"backend": "deepspeed", "deepspeed_config": {"zero_optimization": {"stage": 2}}}'


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """param_checksum of the uninterrupted run (DDP, --nprocs 2)."""
    out = tmp_path_factory.mktemp("preempt_ref")
    ok(distkit(*ARGS, "--nprocs", "2", "++output_dir", str(out)))
    return str(summary(out)["param_checksum"])


#: rank 0 waits at this step (a DISTKIT_FAULT delay) until the test has signalled the launcher and seen rank 0 take
#: the signal: without it a run whose last 185 steps take half a second had ended before the signal under load
#: (torchrun then got it on its way out: fc18, the torchrun case, no "stopped by" line)
PAUSE_STEP = 20


def start(cmd: list[str], out: Path) -> "subprocess.Popen[str]":
    env = base_env(DISTKIT_FAULT=f"0:{PAUSE_STEP}:delay=120", DISTKIT_FAULT_UNTIL=str(out.parent / "release"),
                   DISTKIT_FAULT_STAMP=str(out.parent / "paused"))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def signal_when_paused(p: "subprocess.Popen[str]", out: Path, sig: int, named: Optional[str]) -> tuple[int, str, str]:
    """Send ``sig`` to the launcher while rank 0 is paused at step PAUSE_STEP; once rank 0 has taken the signal
    it names (``named``; None: the signal ends the ranks), release it. The launcher's exit status and output."""
    deadline, stamp = time.time() + 120, out.parent / "paused"
    while not stamp.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert p.poll() is None and stamp.exists(), f"rank 0 never reached step {PAUSE_STEP}: {p.communicate()}"
    rank0 = int(stamp.read_text().split()[0])
    p.send_signal(sig)
    if named is not None:
        got = signal.Signals[named]
        while catches(rank0, got) and p.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert not catches(rank0, got), f"rank 0 never took {named}"
    (out.parent / "release").touch()
    try:
        stdout, stderr = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        stacks = stacks_of_marked()
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        raise AssertionError(f"still running 120 s after the signal\n{stderr[-3000:]}\n{stacks}")
    return p.returncode, stdout, stderr


CASES = [  # (id, launcher command prefix, overrides, signal sent to the launcher, the signal the ranks name)
    ("ddp-nprocs-SIGTERM", [sys.executable, "-m", "distkit"], ["--nprocs", "2"], signal.SIGTERM, "SIGTERM"),
    # mpirun would end the job itself on SIGTERM: distkit passes it on as SIGUSR1, which mpirun only forwards
    ("mpi-nprocs-SIGTERM", [sys.executable, "-m", "distkit"],
     ["--nprocs", "2", "++torch_distributed", "None", "++distributed.backend", "mpi"], signal.SIGTERM, "SIGUSR1"),
    # a user's own mpirun: SIGUSR1 is forwarded to the ranks (SIGTERM would end the job at once: docs/failures.md)
    ("mpi-mpirun-SIGUSR1", [str(BIN / "mpirun"), "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable,
                            "-m", "distkit"],
     ["++torch_distributed", "None", "++distributed.backend", "mpi"], signal.SIGUSR1, "SIGUSR1"),
    ("zero2-nprocs-SIGUSR1", [sys.executable, "-m", "distkit"], ["--nprocs", "2", "++distributed", ZERO2],
     signal.SIGUSR1, "SIGUSR1"),
    ("ddp-param-torchrun-SIGTERM", [str(BIN / "torchrun"), "--nproc_per_node", "2", "--rdzv-backend", "c10d",
                                    "--rdzv-endpoint", "localhost:0", "-m", "distkit"],
     ["++distributed", "{'reduce_type': 'param', 'param_sync_step': 4}"], signal.SIGTERM, "SIGTERM"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_preempted_run_stops_with_a_checkpoint_and_resumes_bit_identical(
        case: tuple[str, list[str], list[str], int, str], reference: str, tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    name, prefix, over, sig, named = case
    out = tmp_path / "run"
    p = start([*prefix, *ARGS, "++output_dir", str(out), *over], out)
    code, stdout, stderr = signal_when_paused(p, out, sig, named)
    text = stdout + stderr
    lines = re.findall(rf"distkit: stopped by (\w+) after step (\d+) of {STEPS}; checkpoint (step-\d+) written: continue "
                       r"with \+\+resume auto", text)
    assert len(lines) == 1, text[-3000:]
    got, step, ckpt = lines[0]
    assert got == named and ckpt == f"step-{int(step):07d}" and PAUSE_STEP <= int(step) < STEPS, lines
    if name.startswith("ddp-param-torchrun"):
        assert code != 0  # torchrun reports the signal it got itself
    else:
        assert code == 75, text[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == ckpt
    assert not (out / "summary.json").exists()  # the run did not finish
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] <= int(step)
    # the same run continued: under distkit's spawner, on DDP where the run was in param mode (DDP is exact there)
    resume = [*over] if "nprocs" in name else ["--nprocs", "2", *over]
    ok(distkit(*ARGS, "++output_dir", str(out), "++resume", "auto", *resume))
    s = summary(out)
    assert s["steps"] == STEPS and s["ranks_in_sync"] is True
    if "param" in name:
        # param mode: compare with its own uninterrupted run
        ref = tmp_path_factory.mktemp("param_ref")
        ok(distkit(*ARGS, "--nprocs", "2", "++output_dir", str(ref), *over))
        assert s["param_checksum"] == summary(ref)["param_checksum"]
    else:
        assert s["param_checksum"] == reference


def test_without_preemption_the_signal_ends_the_run_at_once(tmp_path: Path) -> None:
    """``preemption = False``: SIGTERM ends the ranks at once, as before (the spawner's status 128 + 15), with
    no checkpoint of the step it came in."""
    out = tmp_path / "run"
    p = start([sys.executable, "-m", "distkit", *ARGS, "--nprocs", "2", "++output_dir", str(out),
               "++preemption", "False"], out)
    code, stdout, stderr = signal_when_paused(p, out, signal.SIGTERM, None)
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    assert "stopped by" not in stdout + stderr
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").glob("step-*"))


ENGINES = {"ddp": [], "mpi": ["++torch_distributed", "None", "++distributed.backend", "mpi"],
           "horovod": ["++torch_distributed", "None", "++use_horovod", "1"]}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_signal_on_one_rank_stops_every_rank_two_steps_later(engine: str, tmp_path: Path) -> None:
    """The check after step s runs in the background (each engine's own non-blocking all-reduce) and is read
    after step s + 2 (``distkit.health.preemption.LAG``): rank 1 alone gets SIGTERM right after step 10, so every rank
    stops after step 12, on every engine, with the checkpoint of that step. Rank 0 is slow on its way out (2 s after
    the engine's teardown): its line is printed before the ranks leave together, so a launcher that ends the job at
    the first rank that exits non-zero (mpirun, under the mpi and horovod engines) cannot cut it off (seen under
    load: rank 1 exited 75 first and prterun killed rank 0 before the line)."""
    out = tmp_path / "run"
    res = distkit(*ARGS[:2], "++max_steps", "30", "++progress_bar", "False", "--nprocs", "2", "++output_dir", str(out), *ENGINES[engine],
                  DISTKIT_FAULT="1:10:term,0:12:delay=2:left")
    text = res.stdout + res.stderr
    assert res.returncode == 75, text[-3000:]
    assert text.count("distkit: stopped by SIGTERM after step 12 of 30; checkpoint step-0000012 written") == 1, \
        text[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-0000012"


MPIRUN = [str(BIN / "mpirun"), "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable, "-m", "distkit"]
MPI = ["++torch_distributed", "None", "++distributed.backend", "mpi"]
#: rank 0's line when mpirun ends the job on its own SIGTERM (distkit.health.preemption.MPIRUN_ENDS)
MPIRUN_ENDS = "distkit: mpirun is ending the job (it was sent SIGTERM or SIGINT"


def _no_checkpoint(out: Path) -> bool:
    return not (out / "checkpoints").exists() or not any((out / "checkpoints").glob("step-*"))


def test_sigterm_to_mpirun_ends_the_job_without_a_checkpoint_and_says_so(tmp_path: Path) -> None:
    """Issue 62 item 7: SIGTERM to a user's mpirun. mpirun (prterun) ends the job itself: SIGCONT and SIGTERM to
    every rank, SIGKILL 0.5 s later, exit status 1. Documented as writing no checkpoint, yet a run whose ranks took
    that SIGTERM as a preemption wrote one when they were fast enough, and nothing said what happened. Now one
    behaviour: no checkpoint, exit status 1, and rank 0's one line saying so (written into mpirun's own stderr)."""
    out = tmp_path / "run"
    p = start([*MPIRUN, *ARGS, "++output_dir", str(out), *MPI], out)
    code, stdout, stderr = signal_when_paused(p, out, signal.SIGTERM, None)
    text = stdout + stderr
    assert code == 1, text[-3000:]
    assert text.count(MPIRUN_ENDS) == 1, text[-3000:]
    assert "stopped by" not in text, text[-3000:]
    assert _no_checkpoint(out), sorted(os.listdir(out / "checkpoints"))


def test_mpiruns_sigcont_and_sigterm_never_start_a_checkpoint(tmp_path: Path) -> None:
    """What mpirun sends each rank when it ends the job (SIGCONT, then SIGTERM), sent here to the ranks themselves,
    so that no SIGKILL follows: the ranks start no checkpoint (before: every rank stopped with one, exit 75, as for a
    preemption, which mpirun's SIGKILL cut off or not, by chance); each ends by itself a few seconds later
    (distkit.health.preemption.ENDS_WITHIN_S), and mpirun with it, non-zero. A SIGTERM alone to a rank is still a
    preemption (test_a_signal_on_one_rank_stops_every_rank_two_steps_later)."""
    from distkit.launch.procfs import children, environ

    out = tmp_path / "run"
    # (a run long enough to be still training when the ranks end themselves: 200 steps take under 3 s)
    p = start([*MPIRUN, *ARGS, "++output_dir", str(out), *MPI, "++max_steps", "100000", "++num_epochs", "1000"], out)
    deadline, stamp = time.time() + 120, out.parent / "paused"
    while not stamp.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert p.poll() is None and stamp.exists(), f"rank 0 never reached step {PAUSE_STEP}: {p.communicate()}"
    rank0 = int(stamp.read_text().split()[0])
    ranks = [pid for pid in children(p.pid) if "OMPI_COMM_WORLD_RANK" in (environ(pid) or {})]
    assert rank0 in ranks and len(ranks) == 2, ranks
    for pid in ranks:
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGTERM)
    while catches(rank0, signal.SIGTERM) and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    (out.parent / "release").touch()
    try:
        stdout, stderr = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        raise AssertionError(f"still running 120 s after the signals\n{stderr[-3000:]}")
    text = stdout + stderr
    assert p.returncode not in (0, 75), text[-3000:]
    assert "stopped by" not in text, text[-3000:]
    assert _no_checkpoint(out), sorted(os.listdir(out / "checkpoints"))
