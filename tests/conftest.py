"""Shared test helpers: run the real CLI / launchers as subprocesses, spawn ranks, clean up.

Every subprocess a test starts carries ``DISTKIT_TEST_MARK``; after each test any process
still alive with that mark is killed and the test fails (no leftover ranks).
"""
from __future__ import annotations

import contextlib
import io
import json
import multiprocessing as mp
import os
import queue
import resource
import signal
import socket
import subprocess
import sysconfig
import sys
import tempfile
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import torch

from distkit.launch import ompi_leftovers
from distkit.launch.spawner import free_port  # noqa: F401  (the tests import it from here)

import tiers
from tiers import full_tier, starts_processes

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MARK = f"distkit-test-{uuid.uuid4().hex[:8]}"


# -- a pytest worker that dies says how (make test runs workers with --max-worker-restart 0) -----------------------
def _death_note(controller: int, worker: str) -> Path:
    """Where worker ``worker`` of the pytest run whose controller has pid ``controller`` notes how it ended."""
    return Path(tempfile.gettempdir()) / f"distkit-pytest-{controller}-{worker}.txt"


@pytest.hookimpl(trylast=True)  # after pytest's faulthandler plugin, whose file this replaces in a worker
def pytest_configure(config: pytest.Config) -> None:
    """In an xdist worker: an ``os._exit`` called in the worker process itself (code under test run in-process)
    notes its stack, and a SIGTERM or a fatal signal (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL: a crash in torch
    code run in-process) every thread's stack, before the worker ends; the controller prints the note
    when xdist reports the worker down (:func:`pytest_testnodedown`), where xdist itself says only "Not properly
    terminated" and the test it was running. (The worker's stderr is pytest's capture file of the test: lost with
    the worker. SIGKILL leaves no note: the kernel's log says whether the OOM killer sent it.)"""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return
    import faulthandler

    me, real_exit = os.getpid(), os._exit
    note = open(_death_note(os.getppid(), worker), "w")  # noqa: SIM115 - open for the worker's life (faulthandler)

    def traced_exit(code: int) -> None:
        if os.getpid() == me:  # (a fork of the worker exits as it wants)
            note.write(f"os._exit({code}) called in the worker:\n" + "".join(traceback.format_stack()[-30:]))
            note.flush()
        real_exit(code)

    os._exit = traced_exit  # type: ignore[assignment]
    with contextlib.suppress(ValueError, OSError, AttributeError):
        faulthandler.enable(file=note, all_threads=True)
        faulthandler.register(signal.SIGTERM, file=note, all_threads=True, chain=True)


def pytest_testnodedown(node: Any, error: Any) -> None:
    """(pytest-xdist, in the controller) Print how a worker that died ended, if it noted it; remove the note."""
    note, text = _death_note(os.getpid(), node.gateway.id), ""
    with contextlib.suppress(OSError):
        text = note.read_text()
        note.unlink()
    if not error:
        return
    if not text.strip():  # a SIGKILL: was it the OOM killer? (best effort: the kernel's log may be closed to us)
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout.splitlines()
            text = "no note (SIGKILL?); the kernel's last OOM lines:\n" + "\n".join(
                [ln for ln in log if "oom" in ln.lower() or "killed process" in ln.lower()][-5:])
    node.config.pluginmanager.get_plugin("terminalreporter").write_line(f"[{node.gateway.id}] how it ended:\n{text}")


# -- a failure is named the moment it happens, not only in the summary at the end ------------------------------------
#: where the controller writes each failing test's id and report as it comes in (make test/check: the clone's root)
FAILURES_FILE = ROOT / "tests-failed.txt"


def pytest_sessionstart(session: pytest.Session) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        with contextlib.suppress(OSError):
            FAILURES_FILE.unlink()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """(in the controller, and in a run without workers) A failing test's id in the output at once, and its whole
    report appended to :data:`FAILURES_FILE`. pytest -q prints only an ``F`` until the run ends: a fresh-clone run
    cut short (a session's end) once kept no trace of which test had failed at 39 %."""
    if not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    line = f"FAILED ({report.when}) {report.nodeid}"
    with contextlib.suppress(OSError), open(FAILURES_FILE, "a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n{report.longreprtext}\n{'-' * 80}\n")
    print(f"\n{line}", file=sys.stderr, flush=True)


def _cpu_s() -> float:
    """CPU seconds of this process and of every child it reaped (their reaped children too: mpirun's ranks, the
    spawner's, torchrun's workers)."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


_CPU_AT_SETUP: dict[str, float] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _CPU_AT_SETUP[item.nodeid] = _cpu_s()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Each test's CPU seconds, its fixtures' set-up included, as the junit property ``cpu_s`` (``--junitxml``): what
    a test costs the suite whatever the load, where its wall time on the 2 shared cores is mostly its neighbours'.
    The suite's wall time is about its CPU over the cores, so this is what a cut of the suite must lower."""
    outcome = yield
    if call.when == "teardown":
        start = _CPU_AT_SETUP.pop(item.nodeid, None)
        if start is not None:
            outcome.get_result().user_properties.append(("cpu_s", f"{_cpu_s() - start:.1f}"))


# -- the two tiers (tests/tiers.py): `make check` runs `-m "not full"`, `make test` everything -------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--tier-report", metavar="PATH", default=None,
                     help="write every collected test's tier, reasons and parity marks as JSON to PATH")


#: this run's collection, each test with its tier (what ``--tier-report`` writes), before ``-m``/``-k`` deselect
TIER_REPORT: list[dict[str, Any]] = []


#: serial test files whose tests run in the lane of the machine-wide ones (one at a time among those, beside the other
#: serial lane, as every serial test runs): the two lanes then take about as long. Quiet make test of 90a45dd,
#: 2026-11-29: machine-wide lane 790 s, the other 1420 s, of which these files 270 s. The lanes are what a whole
#: run waits for last once the other workers' files are done.
MACHINE_LANE_TOO = ("tests/test_deepspeed_backend.py", "tests/test_failures.py")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each full-tier test ``full`` (what it starts decides: tests/tiers.py), and ``serial`` where it must run
    alone (tiers.serial), before ``-m`` deselects. Under ``--dist loadgroup`` (make test) the serial tests form two
    xdist groups, listed first, each run one test at a time by one worker from the start: those that build hosts or
    SLURM daemons (machine-wide names: network namespaces, a SLURM cluster; tiers.MACHINE_WIDE) with those of
    :data:`MACHINE_LANE_TOO`, and the others
    (timeouts, timed runs, lighthouses, kill trials: they mostly wait, and must not wait beside too many runs). The
    other workers run the rest file by file (a group per file, so that a module's fixtures start once)."""
    report, reasons = [], {}
    for item in items:
        tier, why = tiers.tier_of(item)
        reasons[item.nodeid] = why
        if tier == "full" and not any(m.args for m in item.iter_markers("full")):
            item.add_marker(pytest.mark.full(why[0]))
        if tier == "full" and tiers.serial(why):
            item.add_marker(pytest.mark.serial)
        item.user_properties.append(("tier", tier))
        report.append({"nodeid": item.nodeid, "tier": tier, "reasons": why,
                       "parity": [list(m.args) for m in item.iter_markers("parity")]})
    path = config.getoption("--tier-report")
    if path:
        Path(path).write_text(json.dumps(report, indent=1))
    TIER_REPORT[:] = report  # (test_tiers reads it where this run collected the whole suite)
    # (an xdist worker sees dist "no" and its own loadgroup flag)
    if getattr(config.option, "loadgroup", False) or config.getoption("dist", "no") == "loadgroup":
        for item in items:
            serial = item.get_closest_marker("serial") is not None
            machine = serial and (any(r in tiers.MACHINE_WIDE for r in reasons[item.nodeid])
                                  or item.nodeid.split("::")[0] in MACHINE_LANE_TOO)
            item.add_marker(pytest.mark.xdist_group("serial-machine" if machine else "serial" if serial
                                                    else item.nodeid.split("::")[0]))
        # xdist hands out groups in the order of their first test: the serial groups (the longest) first
        items.sort(key=lambda it: it.get_closest_marker("serial") is None)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> Optional[bool]:
    """pytest-timeout's per-test limit (setup.cfg), with what its own handler leaves out: the stacks of every
    process the test started that is still alive (py-spy), then those processes killed, so that a hang is
    diagnosed from its first occurrence and costs the limit, not the rest of the suite."""
    if settings.timeout <= 0 or settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return None  # pytest-timeout's own

    def handler(signum: int, frame: Any) -> None:
        __tracebackhide__ = True
        stacks = stacks_of_marked()
        kill(marked_pids())
        here = "".join(traceback.format_stack(frame)[-8:])
        pytest.fail(f"Timeout: the test ran past the per-test limit of {settings.timeout:.0f} s (setup.cfg).\n"
                    f"The test's own stack:\n{here}\n{stacks}", pytrace=False)

    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    item.cancel_timeout = lambda: (signal.setitimer(signal.ITIMER_REAL, 0),  # type: ignore[attr-defined]
                                   signal.signal(signal.SIGALRM, signal.SIG_DFL))
    return True


def pytest_report_collectionfinish(config: pytest.Config, start_path: Path, items: list[pytest.Item]) -> str:
    fast = sum(1 for i in items if dict(i.user_properties).get("tier") == "fast")
    return f"tiers: {fast} fast, {len(items) - fast} full-only (tests/tiers.py)"


def base_env(**extra: Optional[str]) -> dict[str, str]:
    """os.environ without launcher variables, plus the test mark and Open MPI's root permission; ``extra`` on top
    (a value of None removes the variable)."""
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "DISTKIT_SPAWN_ID", "DISTKIT_FAULT", "PYTEST_ADDOPTS")  # (a pytest a test starts is its own)
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("OMPI_", "PMIX_", "SLURM_"))}
    # OMPI_MCA_mpi_yield_when_idle: an MPI rank waiting for a peer (the mpi engine's collectives, Horovod's MPI
    # controller) polls at 100 % of a core; Open MPI yields only when it sees more ranks than slots, and a test's 2
    # ranks fit the machine's 2 cores, but the suite runs 5 workers on them (the CPU is busy 100 % of a make test:
    # /proc/stat sampled every 5 s). Yielding gives that core to the other tests: a fixed CPU job beside a 2-rank
    # mpi run with one rank waiting 12 s took 5.5 s, 4.0 s with the yield (4.2 s alone). Scheduling only: no result
    # changes.
    env.update(DISTKIT_TEST_MARK=MARK, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OMPI_MCA_mpi_yield_when_idle="1")
    env.update({k: v for k, v in extra.items() if v is not None})
    for k in [k for k, v in extra.items() if v is None]:
        env.pop(k, None)
    return env


@starts_processes
def run(cmd: list[str], timeout: float = 180, cwd: Optional[Path] = None, **env: Optional[str]) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` to completion (killing its whole process group on timeout)."""
    p = subprocess.Popen(cmd, cwd=cwd or ROOT, env=base_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks = stacks_of_marked()
        os.killpg(p.pid, signal.SIGKILL)
        kill(marked_pids())  # torchrun's workers run in sessions of their own, and hold the pipes
        out, err = p.communicate()
        raise AssertionError(f"timed out after {timeout}s: {cmd}\nstdout:{out[-3000:]}\nstderr:{err[-3000:]}\n{stacks}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def distkit(*args: str, timeout: float = 180, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m distkit ARGS``."""
    return run([sys.executable, "-m", "distkit", *args], timeout=timeout, **env)


def venv_without(where: Path, *names: str) -> Path:
    """A real venv at ``where`` holding this venv's packages (linked; distkit from its editable install), those whose
    names start with one of ``names`` left out: what a user who skipped an install has. Returns its python."""
    venv = where / "venv"
    ok(subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], capture_output=True, text=True))
    site = Path(sysconfig.get_paths()["purelib"])
    target = next(venv.glob("lib/python*/site-packages"))
    for entry in site.iterdir():
        if not entry.name.lower().startswith(names):
            os.symlink(entry, target / entry.name)
    return venv / "bin" / "python"


def ok(res: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert res.returncode == 0, f"exit {res.returncode}\nstdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-4000:]}"
    return res


def summary(out_dir: Path) -> dict[str, Any]:
    return json.loads((out_dir / "summary.json").read_text())


def final_params(out_dir: Path, rank: int = 0) -> dict[str, torch.Tensor]:
    """Model state of ``rank`` in the newest checkpoint (training always saves at the end): its own
    rank file's copy in param mode, the one portable copy in grad mode (where the rank files hold none)."""
    from distkit import portable

    root = out_dir / "checkpoints"
    ckpt = root / (root / "latest").read_text().strip()
    own = torch.load(ckpt / f"rank-{rank:05d}.pt", weights_only=False)["model"]
    return own if own is not None else portable.model_state(portable.read(str(ckpt)))


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].detach().float() - b[k].detach().float()).abs().max()) for k in a)


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (/proc/PID/status SigCgt); False once it is gone.
    distkit's preemption handler gives the signal its default action back when it first gets it, so a test sees
    from here that a rank took the signal."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask >> (sig - 1) & 1)


def seconds_since_last_metrics(out_dir: Path) -> float:
    """Seconds since rank 0 last wrote metrics.jsonl: with a fault a step or two after a log
    step, the time from the fault to now (start-up time on a busy machine excluded)."""
    return time.time() - (out_dir / "metrics.jsonl").stat().st_mtime


def kill(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` that is still there."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def marked_pids() -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if MARK.encode() in f.read():
                    pids.append(int(d))
        except OSError:
            continue
    return pids


def stacks_of_marked(limit: int = 12000) -> str:
    """The Python stacks (py-spy, native frames too) of every process this test session started that is
    still alive: what a timed-out test reports, so that a hang is diagnosed from its first occurrence
    instead of rerun. Best effort; at most ``limit`` characters."""
    spy = BIN / "py-spy"
    if not spy.exists():
        return "(no py-spy: no stacks)"
    parts = []
    for pid in marked_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
            res = subprocess.run([str(spy), "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                                 timeout=20)
            parts.append(f"--- pid {pid}: {cmd}\n{res.stdout[-3000:]}{res.stderr[-500:]}")
        except (OSError, subprocess.SubprocessError) as e:
            parts.append(f"--- pid {pid}: {e}")
    return ("stacks of the test's processes still alive:\n" + "\n".join(parts))[:limit]


#: The short digits run that the engine modules compare their grad mode against (20 steps, 8 per rank).
SHORT = ["++max_steps", "20", "++progress_bar", "False", "++log_every", "5", "++batch_size", "8"]


@pytest.fixture(scope="session")
def ddp_short_ref(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DDP grad mode, ``configs/returnn_ddp.py`` with :data:`SHORT`, 2 ranks (``--nprocs``): the reference
    every engine's grad mode must reproduce. One run per test session, shared by the modules."""
    out = tmp_path_factory.mktemp("ddp_short_ref") / "ddp"
    ok(distkit("train", "configs/returnn_ddp.py", "--nprocs", "2", "++output_dir", str(out), *SHORT))
    return out


#: clipping and accumulation on top of :data:`SHORT` (the engines' grad-mode parity with both at once)
CLIP_ACCUM = ["++gradient_clip", "0.05", "++accum_grad_multiple_step", "2", "++batch_size", "4"]


@pytest.fixture(scope="session")
def ddp_clip_accum_ref(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`ddp_short_ref` with :data:`CLIP_ACCUM`: what the mpi engine and Horovod must reproduce."""
    out = tmp_path_factory.mktemp("ddp_clip_accum_ref") / "ddp"
    ok(distkit("train", "configs/returnn_ddp.py", "--nprocs", "2", "++output_dir", str(out), *SHORT, *CLIP_ACCUM))
    return out


@pytest.fixture(autouse=True)
def _no_leftovers() -> Any:
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    deadline = time.monotonic() + 10  # launchers may still be reaping their children
    while (left := marked_pids()) and time.monotonic() < deadline:
        time.sleep(0.2)
    kill(left)
    # an mpirun the test killed leaves its session directory, which would fail a later mpirun given
    # its pid (distkit clears them too, but only when it starts under or starts mpirun)
    ompi_leftovers.clear()
    assert not left, f"processes left running after the test: {left}"


# -- run_ranks: spawned ranks sharing a FileStore ------------------------------------------
def _rank_main(fn: Callable[..., Any], rank: int, world: int, store: str, q: Any, args: tuple[Any, ...]) -> None:
    os.environ["DISTKIT_TEST_MARK"] = MARK
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
        q.put((rank, "ok", _as_bytes(fn(rank, world, *args))))
        if dist.is_initialized():  # (fn may have closed a distkit session, which destroys the group)
            dist.destroy_process_group()
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def _as_bytes(value: Any) -> bytes:
    """A rank's result as bytes (torch.save): a tensor put into a multiprocessing queue as itself travels as a
    shared-memory file descriptor that the reader fetches from the writing process, so a rank that had already
    exited when the test read its result lost it (under load: the test then waited for a result that never came)."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _rank_context() -> Any:
    """Ranks fork from one server process that imported torch and torch.distributed once per test session
    ("forkserver", preloaded): a spawned rank imports torch again, about 1.5 s of CPU each, which was most of
    the cost of every run_ranks test. The server is a fresh single-threaded interpreter, not pytest's process
    (whose threads a fork would not carry)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "distkit"])
    return ctx


@starts_processes
def run_ranks(fn: Callable[..., Any], world_size: int, tmp_path: Path, *args: Any,
              timeout: Optional[float] = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes with a gloo group.

    Returns each rank's result; raises with every failed rank's traceback; kills hung ranks. ``timeout`` (None:
    pytest-timeout's per-test limit, whose handler dumps every live rank's stack first) bounds a hang. Results
    travel as bytes (:func:`_as_bytes`); only an empty queue is waited on, an error reading a result is raised.
    """
    ctx = _rank_context()
    q = ctx.Queue()
    store = str(tmp_path / f"store-{uuid.uuid4().hex[:6]}")
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, store, q, args)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
    try:
        while len(results) + len(errors) < world_size:
            if errors:  # the others may be stuck in a collective with the failed rank
                deadline = min(deadline, time.monotonic() + 5)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if errors:
                    break
                raise AssertionError(f"ranks hung (>{timeout}s); done: {sorted(results)}")
            try:
                rank, status, value = q.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and q.empty():
                    raise AssertionError(f"a rank died: exit codes {[p.exitcode for p in procs]}")
                continue
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]


# -- a torchft lighthouse (fault_tolerance tests, test_fault_tolerance.py and test_slurm.py) ----------------------
@full_tier("a torchft lighthouse")
def lighthouse_cmd(port: int, min_replicas: int, *extra: str) -> list[str]:
    """``distkit lighthouse`` on ``port``. --join-timeout 30: a quorum waits that long for a group that is alive
    (heartbeating) but late, e.g. one paused by a DISTKIT_FAULT delay; a group paused longer would be left out
    and heal at its next sync."""
    return [sys.executable, "-m", "distkit", "lighthouse", "--port", str(port), "--min-replicas", str(min_replicas),
            "--join-timeout", "30", *extra]


class _Lighthouse(str):
    """The lighthouse's URL, with its process (for a test that kills it) and its log file."""

    def __new__(cls, url: str, proc: "subprocess.Popen[str]", log: Path) -> "_Lighthouse":
        self = super().__new__(cls, url)
        self.proc, self.log = proc, log
        return self

    def tail(self, lines: int = 12) -> str:
        """The last ``lines`` lines of its log, each cut to 240 characters (a quorum's line lists every member)."""
        return "\n".join(line[:240] for line in self.log.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture
@full_tier("a torchft lighthouse")
def lighthouse(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A real lighthouse (``distkit lighthouse``) on a free port; its URL. min_replicas from the test's mark,
    --quiet with the quiet_lighthouse mark, further flags from the lighthouse_args mark.

    Its output goes to a file (``lighthouse.log`` in the test's tmp_path), not a pipe: the lighthouse logs every
    quorum request and status (about 1 KB per sync of three groups), and a pipe nobody reads fills at 64 KiB,
    after which the lighthouse blocks in its logger and answers no quorum: the groups would hang."""
    mark = request.node.get_closest_marker("min_replicas")
    port = free_port()
    log = tmp_path / "lighthouse.log"
    with log.open("w") as sink:
        extra = ["--quiet"] if request.node.get_closest_marker("quiet_lighthouse") else []
        flags = request.node.get_closest_marker("lighthouse_args")
        extra += list(flags.args) if flags else []
        proc = subprocess.Popen(lighthouse_cmd(port, mark.args[0] if mark else 1, *extra), env=base_env(), cwd=ROOT,
                                stdout=sink, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:  # until it answers
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None, f"the lighthouse did not start: {log.read_text()}"
            time.sleep(0.1)
    first = log.read_text().splitlines()[0]
    assert first.startswith("distkit: lighthouse at http://") and f":{port} (min_replicas" in first, first
    yield _Lighthouse(url, proc, log)
    with contextlib.suppress(ProcessLookupError):  # distkit lighthouse and the lighthouse, its child
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
