"""The mpi engine (mpi4py, distkit's own bucketed reducer) under real ``mpirun`` processes.

Parity with DDP (same seed, same data), param == grad with sync step 1, closed forms of
the reducer (bucket layout, mean/sum, accumulation), SIGKILL + resume, and failures that
end the job within seconds naming the rank.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import BIN, CLIP_ACCUM, ROOT, SHORT, base_env, distkit, final_params, marked_pids, max_abs_diff, ok, run, summary, seconds_since_last_metrics

TOL = 1e-5
MPIRUN = [str(BIN / "mpirun"), "-np", "2", "--oversubscribe", "--bind-to", "none"]
# the DDP reference config, re-pointed at the mpi engine
MPI = ["++torch_distributed", "None", "++distributed.backend", "mpi"]


def mpirun(*args: str, timeout: float = 180, **env: str) -> Any:
    """``mpirun -np 2 python -m distkit ARGS``."""
    return run([*MPIRUN, sys.executable, "-m", "distkit", *args], timeout=timeout, **env)


def train_mpi(out: Path, *overrides: str, **env: str) -> Path:
    ok(mpirun("train", "configs/returnn_ddp.py", "++output_dir", str(out), *SHORT, *MPI, *overrides, **env))
    return out


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory, ddp_short_ref: Path) -> dict[str, Path]:
    """Runs several tests compare against: DDP grad mode (--nprocs 2) and mpi grad mode."""
    return {"ddp": ddp_short_ref, "mpi": train_mpi(tmp_path_factory.mktemp("ref") / "mpi")}


def test_grad_mode_reproduces_ddp(ref: dict[str, Path]) -> None:
    diff = max_abs_diff(final_params(ref["mpi"]), final_params(ref["ddp"]))
    assert diff <= TOL, diff
    s = summary(ref["mpi"])
    assert (s["backend"], s["launcher"], s["world_size"], s["steps"], s["samples"]) == ("mpi", "openmpi", 2, 20, 320)
    assert s["backend_impl"].startswith("mpi4py ") and "Open MPI" in s["backend_impl"]
    assert s["ranks_in_sync"] is True
    # 20 steps x every gradient (fp32) at least; the reducer counts what it hands to MPI
    n_grad_bytes = sum(t.numel() * 4 for t in final_params(ref["mpi"]).values())
    assert s["comm_bytes"] >= 20 * n_grad_bytes
    # both engines hand the same payload to collectives: the start-up broadcast, 20 gradients, the metrics
    assert s["comm_bytes"] == summary(ref["ddp"])["comm_bytes"]


def test_clipped_and_accumulated_grad_mode_reproduces_ddp(tmp_path: Path, ddp_clip_accum_ref: Path) -> None:
    # clipping must see the reduced gradient (the reducer waits first); accumulation must not send early
    mpi = train_mpi(tmp_path / "mpi", *CLIP_ACCUM)
    assert max_abs_diff(final_params(mpi), final_params(ddp_clip_accum_ref)) <= TOL


def test_tiny_buckets_equal_one_bucket(ref: dict[str, Path], tmp_path: Path) -> None:
    # 0.001 MiB buckets: every parameter in a bucket of its own, all-reduced while backward runs
    tiny = train_mpi(tmp_path / "tiny", "++distributed.bucket_cap_mb", "0.001")
    one = final_params(ref["mpi"])  # default 25 MiB: the whole digits model in one bucket
    assert max_abs_diff(final_params(tiny), one) == 0.0


REDUCER_SCRIPT = r"""
import json, os, sys, torch
from distkit.backends.mpi import MPIStrategy
from distkit.config import resolve
from distkit.env import detect

cap, avg, out = float(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
cfg = resolve({"distributed": {"backend": "mpi", "bucket_cap_mb": cap, "avg_grad": avg}})
s = MPIStrategy(cfg, detect(os.environ), torch.device("cpu"))
s.init()
r, n = s.rank, s.world_size
torch.manual_seed(100 + r)  # different initial parameters per rank: setup must broadcast rank 0's
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))
model, opt = s.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
init = [p.detach().clone() for p in model.parameters()]

def moved(before):
    # with lr 1 and d loss / d p = const, each element moves by exactly the reduced gradient
    return sorted({round(float(v), 6) for b, p in zip(before, model.parameters()) for v in (b - p).reshape(-1)})

# step 1: loss_r = (r + 1) * sum(params), so each rank's gradient is r + 1 everywhere
s.backward((r + 1) * sum(p.sum() for p in model.parameters()), model)
s.step(model, opt)
step1 = moved(init)
grads_are_views = all(p.grad is v for b in s.reducer.buckets for p, v in zip(b.params, b.views))
grads_zero = all(float(p.grad.abs().max()) == 0.0 for p in model.parameters())
# step 2: two micro-steps, the first under no_sync (nothing sent), then one reduce
before = [p.detach().clone() for p in model.parameters()]
with s.no_sync(model):
    s.backward((r + 1) * sum(p.sum() for p in model.parameters()), model)
s.backward((r + 1) * sum(p.sum() for p in model.parameters()), model)
s.step(model, opt)
step2 = moved(before)
# collectives, closed forms
t = torch.full((5,), float(r)); s.all_reduce(t, op="mean")
mx = torch.tensor([r]); s.all_reduce(mx, op="max")
mn = torch.tensor([r + 3], dtype=torch.int64); s.all_reduce(mn, op="min")
avg_t = [torch.full((3, 2), float(r)), torch.full((4,), 10.0 * r)]; s.average_parameters(avg_t)
res = {"buckets": len(s.reducer.buckets), "step1": step1, "step2": step2, "views": grads_are_views,
       "zeroed": grads_zero, "init": [p.tolist() for p in init][1], "mean": t.tolist(), "max": mx.item(),
       "min": mn.item(), "avg": [avg_t[0].unique().tolist(), avg_t[1].unique().tolist()],
       "gather": s.all_gather_object({"rank": r}), "bcast": s.broadcast_object("from-0" if r == 0 else None),
       "comm_bytes": s.comm_bytes}
s.barrier()
s.teardown(); s.teardown()  # idempotent
with open(os.path.join(out, f"rank{r}.json"), "w") as f:
    json.dump(res, f)
"""


@pytest.mark.parametrize("cap,avg,expect", [("0.001", "1", 1.5), ("25", "1", 1.5), ("0.001", "0", 3.0)],
                         ids=["tiny-buckets-mean", "one-bucket-mean", "tiny-buckets-sum"])
def test_reducer_closed_forms(tmp_path: Path, cap: str, avg: str, expect: float) -> None:
    script = tmp_path / "reducer.py"
    script.write_text(REDUCER_SCRIPT)
    ok(run([*MPIRUN, sys.executable, str(script), cap, avg, str(tmp_path)], timeout=120))
    r0, r1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2))
    # 2 ranks with gradients 1 and 2: mean 1.5, sum 3; accumulating two micro-steps doubles it
    assert r0["step1"] == r1["step1"] == [expect]
    assert r0["step2"] == r1["step2"] == [2 * expect]
    # 4 parameters of 8192, 128, 1280, 40 bytes: 0.001 MiB (1048 B) splits them into 4 buckets
    assert r0["buckets"] == (4 if cap == "0.001" else 1)
    assert r0["views"] and r0["zeroed"]
    assert r0["init"] == r1["init"]  # rank 0's initial parameters reached rank 1
    assert r0["mean"] == r1["mean"] == [0.5] * 5
    assert (r0["max"], r1["max"], r0["min"], r1["min"]) == (1, 1, 3, 3)
    assert r0["avg"] == r1["avg"] == [[0.5], [5.0]]  # mean(range(2)) * ones
    assert r0["gather"] == r1["gather"] == [{"rank": 0}, {"rank": 1}]
    assert r0["bcast"] == r1["bcast"] == "from-0"
    assert r0["comm_bytes"] > 0


def test_param_sync_every_step_equals_grad(ref: dict[str, Path], tmp_path: Path) -> None:
    param = train_mpi(tmp_path / "param", "++distributed.reduce_type", "param", "++distributed.param_sync_step", "1")
    assert max_abs_diff(final_params(param), final_params(ref["mpi"])) <= TOL
    s = summary(param)
    assert (s["reduce_type"], s["param_sync_step"], s["ranks_in_sync"]) == ("param", 1, True)


def test_param_mode_ranks_in_sync_after_final_sync(ref: dict[str, Path], tmp_path: Path) -> None:
    # sync every 7 of 20 steps: only the final sync makes the ranks agree
    out = train_mpi(tmp_path / "p7", "++distributed.reduce_type", "param", "++distributed.param_sync_step", "7")
    assert summary(out)["ranks_in_sync"] is True
    assert max_abs_diff(final_params(out, 0), final_params(out, 1)) == 0.0
    assert max_abs_diff(final_params(out), final_params(ref["mpi"])) > 1e-4  # and it is not grad mode


# param mode (each rank file holds its replica); grad mode's same-layout resume reads portable/, as ddp's
# does, which tests/test_kill_trials.py and test_portable's resumes onto the mpi engine cover
@pytest.mark.parametrize("mode", [["++distributed.reduce_type", "param", "++distributed.param_sync_step", "4"]],
                         ids=["param"])
def test_sigkill_then_resume_is_bit_identical(tmp_path: Path, mode: list[str]) -> None:
    common = [*mode, "++checkpoint_every", "5", "++optimizer", "{'class': 'sgd', 'momentum': 0.9}"]
    ref = train_mpi(tmp_path / "ref", *common)
    out = tmp_path / "killed"
    args = ["train", "configs/returnn_ddp.py", "++output_dir", str(out), *SHORT, *MPI, *common]
    killed = mpirun(*args, DISTKIT_FAULT="1:13:kill")
    assert killed.returncode != 0 and "rank 1" in killed.stdout + killed.stderr
    assert (out / "checkpoints" / "latest").read_text() == "step-0000010"
    assert not (out / "summary.json").exists()
    resumed = ok(mpirun(*args, "++resume", "auto"))
    assert "resumed from" in resumed.stdout and "at step 10" in resumed.stdout
    a, b = final_params(ref), final_params(out)
    assert all(a[k].equal(b[k]) for k in a)  # bit-identical
    assert summary(out)["param_checksum"] == summary(ref)["param_checksum"]


@pytest.mark.parametrize("kind", ["raise", "kill", "hang"])
def test_failure_on_one_rank_ends_the_job_quickly(tmp_path: Path, kind: str) -> None:
    # an exception calls MPI_Abort (mpi4py alone would leave rank 0 in a collective forever);
    # a SIGKILL is noticed by mpirun; a hung rank: the waiting rank's watchdog aborts after
    # timeout_s. All: non-zero exit, the failed rank named, well under 30 s.
    t0 = time.monotonic()
    res = mpirun("train", "configs/returnn_ddp.py", "++output_dir", str(tmp_path), *SHORT, *MPI,
                 "++distributed.timeout_s", "5", DISTKIT_FAULT=f"1:7:{kind}", timeout=60)
    wall = time.monotonic() - t0
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-2000:]
    # the contract: every rank gone within 30 s of the fault; start-up (imports) on a busy 2-core
    # machine comes on top of that, hence the looser bound on the whole command
    after_fault = seconds_since_last_metrics(tmp_path)
    assert after_fault < 30 and wall < 60, f"{after_fault:.1f}s after the fault, {wall:.1f}s in all"
    if kind == "raise":
        assert "distkit: rank 1 failed: RuntimeError: injected fault at step 7" in res.stderr
    elif kind == "kill":
        assert "process rank 1" in out and "signal 9" in out
    else:  # MPI cannot tell which rank hangs; the waiting one says what it waited for: the next step's gradient
        # buckets (the preemption check of step 7 runs in the background, read after step 9; the one read after
        # step 7 was started at step 5, by both ranks, and libnbc may still need rank 1 to finish it)
        assert re.search(r"distkit: rank 0: (Iallreduce \(gradient buckets\)|Iallreduce\(max\) in the preemption check "
                         r"after the step \(distkit.health.preemption\)) did not complete within distributed.timeout_s = 5 s",
                         out), out[-3000:]
    assert not (tmp_path / "summary.json").exists()


def test_without_mpi4py_is_one_line_with_the_install_command(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow" / "mpi4py"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('mpi4py shadowed by the test (not installed)')\n")
    res = distkit("train", "configs/returnn_ddp.py", "++output_dir", str(tmp_path / "out"), *MPI,
                  PYTHONPATH=f"{shadow.parent}:{ROOT}")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "pip install 'distkit[mpi]'" in res.stderr
    assert not (tmp_path / "out").exists()


def _killed_mpirun_session_dir(tmpdir: Path) -> Path:
    """SIGKILL a real ``mpirun`` (its $TMPDIR ``tmpdir``) once its PMIx files are written; returns the session
    directory it leaves."""
    p = subprocess.Popen([*MPIRUN[:3], "sleep", "60"], env=base_env(TMPDIR=str(tmpdir)), start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    session = tmpdir / f"ompi.{p.pid}"
    deadline = time.monotonic() + 30
    while not list(session.glob(f"pmix.*.tool.{p.pid}")) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.1)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    for pid in marked_pids():  # its rank, in a process group of its own
        os.kill(pid, signal.SIGKILL)
    assert list(session.glob(f"pmix.*.tool.{p.pid}")), f"mpirun {p.pid} left no {session}/pmix.*.tool.{p.pid}"
    return session


def test_nprocs_starts_the_mpi_engine_under_mpirun(tmp_path: Path) -> None:
    # A SIGKILLed mpirun leaves its session directory; Open MPI 5 (PMIx 5.0) refuses to start when it
    # finds one for its own pid (pids wrap at pid_max 32768 here). Shown by giving the leftover the pid
    # of the next mpirun: a shell that copies it for its own pid, then execs mpirun.
    # Every process here has a $TMPDIR of its own: the suite's other MPI runs clear the dead mpiruns' directories
    # of /tmp as they start (they removed this test's leftover while it was being copied), and a short one, as
    # PMIx's socket paths must fit in 108 bytes.
    tmpdir = Path(tempfile.mkdtemp(prefix="dk"))
    try:
        _leftover_is_cleared(tmp_path, tmpdir)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _leftover_is_cleared(tmp_path: Path, tmpdir: Path) -> None:
    killed = _killed_mpirun_session_dir(tmpdir)
    old = killed.name.split(".")[1]
    reuse = run(["bash", "-c", f'd={killed.parent}/ompi.$$; echo $$; cp -r {killed} $d && '
                 f'for f in $d/pmix.*.tool.{old}; do mv "$f" "${{f%.{old}}}.$$"; done && '
                 f'exec {MPIRUN[0]} -np 1 true'], timeout=60, TMPDIR=str(tmpdir))
    assert reuse.returncode == 213 and "listener thread failed to start" in reuse.stderr, reuse
    dead = int(reuse.stdout.split()[0])  # that shell's pid: the process has ended
    assert not (killed.parent / f"ompi.{dead}").exists()  # that mpirun removed the copy as it failed
    # left alone: a running mpirun's directory (this process stands in for it), and a dead one's of
    # another host (a $TMPDIR shared between hosts)
    live, other = killed.parent / f"ompi.{os.getpid()}", killed.parent / f"ompi.{dead}"
    for d, host, pid in ((live, socket.gethostname(), os.getpid()), (other, "another-host", dead)):
        d.mkdir()
        (d / f"pmix.{host}.tool.{pid}").write_text("in use\n")
    # distkit's own spawner starts ranks MPI does not know about: --nprocs uses mpirun for MPI
    # engines, after clearing the dead mpiruns' directories
    ok(distkit("train", "configs/returnn_ddp.py", "--nprocs", "2", "++output_dir", str(tmp_path), *SHORT, *MPI,
               timeout=120, TMPDIR=str(tmpdir)))
    assert (killed.exists(), live.exists(), other.exists()) == (False, True, True)
    s = summary(tmp_path)
    assert (s["backend"], s["launcher"], s["world_size"], s["ranks_in_sync"]) == ("mpi", "openmpi", 2, True)


def test_a_rank_stopped_inside_its_start_up_guard_is_named_as_the_stopped_one() -> None:
    """The guard of a rank that is itself stopped (SIGSTOP) names it as stopped, not as a rank that waited for
    another; either way it ends the rank (SIGKILL) after the timeout."""
    code = ("import os, signal\nfrom distkit.backends.startup import startup_guard\n"
            "with startup_guard(1, 1.0, 'MPI start-up (MPI_Init, MPI_Comm_dup)'):\n"
            "    os.kill(os.getpid(), signal.SIGSTOP)\n")
    res = run([sys.executable, "-c", code], timeout=60)
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    assert res.stderr.strip() == ("distkit: rank 1: stopped (SIGSTOP, a debugger) during MPI start-up (MPI_Init, "
                                  "MPI_Comm_dup) for 1 s (distributed.startup_timeout_s): ending this rank"), res.stderr


def test_a_rank_stopped_during_start_up_ends_the_job(tmp_path: Path) -> None:
    """Rank 1 stops (SIGSTOP) before MPI_Init: rank 0 waited in MPI's start-up forever (5 of 5 runs). Now the
    start-up guards end it after startup_timeout_s and mpirun ends the job: non-zero, well inside timeout_s +
    start-up, nothing written. Each rank's guard is a process of its own, so the stopped rank's fires too, and
    whichever fires first ends the job (a whole run with five workers saw rank 1's first): rank 0's names rank 1 as
    stopped (it looks for a stopped rank of the job on its host), or what it waited for where it finds none, rank 1's
    that it was stopped, and neither blames another rank for rank 1's stop."""
    t0 = time.monotonic()
    res = mpirun("train", "configs/returnn_ddp.py", "++output_dir", str(tmp_path / "out"), *SHORT, *MPI,
                 "++distributed.timeout_s", "6", "++distributed.startup_timeout_s", "6", DISTKIT_FAULT="1:0:stop:init",
                 timeout=90)
    wall = time.monotonic() - t0
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-2000:]
    waited = ("distkit: rank 0: MPI start-up (MPI_Init, MPI_Comm_dup) did not complete within 6 s "
              "(distributed.startup_timeout_s)")
    stopped = ("distkit: rank 1: stopped (SIGSTOP, a debugger) during MPI start-up (MPI_Init, MPI_Comm_dup) for 6 s "
               "(distributed.startup_timeout_s): ending this rank")
    named = ("distkit: rank 1 stopped responding during start-up: stopped (SIGSTOP, a debugger) while rank 0 waited "
             "for it in MPI start-up")  # (rank 0's guard finds the stopped rank of its job on this host)
    assert waited in out or stopped in out or named in out, out[-3000:]
    assert "distkit: rank 1: MPI start-up" not in out, out[-3000:]  # (the stopped rank never says it waited)
    assert wall < 45, f"{wall:.1f}s"
    assert not (tmp_path / "out" / "summary.json").exists()
