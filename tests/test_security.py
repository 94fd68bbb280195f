"""Nothing a user loads runs code (issue 59): hostile checkpoints on every load path.

An attacker who can hand over a checkpoint can also rewrite its manifest (the sizes and sha256 guard against damage,
not against a file made to pass them): every case below rewrites it to match. Each payload is a pickled call of
``open(MARKER, "w")``, which creates the marker file when the file is unpickled the way torch's and Python's default
loaders do. On every path: the marker is never created, the load stops with one line naming the file, exit 2, and
the run's output_dir is unchanged.

And what distkit believes of its network peers (issue 59 item 4, issue 62 item 4): a stranger's records in a running
job's heartbeat store (a real TCP client without the job's token) are ignored in one line and hide no stall; a record
that names a pid, sealed or not, never gets that process killed; a torchft heal reads the live group's state
weights-only.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from conftest import BIN, ROOT, base_env, distkit, ok, run

from distkit import portable
from distkit.commands.convert import _OneProcess
from distkit.errors import CheckpointError
from distkit.health.watchdog import Watchdog
from distkit.launch.netif import host_identity
from distkit.tasks.digits import make_model

RUN = ["++max_steps", "4", "++progress_bar", "False", "++log_every", "2", "++batch_size", "8"]


class Payload:
    """Unpickled by a trusting loader, it creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-rank ddp run with its final checkpoint (step 4)."""
    out = tmp_path_factory.mktemp("sec") / "run"
    ok(distkit("train", "configs/returnn_ddp.py", "--nprocs", "2", "++output_dir", str(out), *RUN, timeout=240))
    return out


def _ckpt(out: Path) -> Path:
    root = out / "checkpoints"
    return root / (root / "latest").read_text().strip()


def _rehash(ckpt: Path) -> None:
    """The attacker's last step: the manifest's files map rewritten to what is on disk now."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    files = {}
    for p in sorted(ckpt.rglob("*")):
        if p.is_file() and p.name != "manifest.json":
            data = p.read_bytes()
            files[str(p.relative_to(ckpt))] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest["files"] = files
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def rank_file(ckpt: Path, marker: str) -> str:
    """rank-00000.pt gains one pickled object."""
    state = torch.load(ckpt / "rank-00000.pt", weights_only=False)  # (the attacker's own, trusted, file)
    state["extra"] = Payload(marker)
    torch.save(state, ckpt / "rank-00000.pt")
    return "rank-00000.pt"


def _rewrite_portable(ckpt: Path, meta_as: Callable[[Any], Any]) -> None:
    entries = portable.read(str(ckpt))
    meta = entries.pop(portable.META)
    shutil.rmtree(ckpt / portable.DIR)
    original = portable._dumps
    portable._dumps = meta_as  # type: ignore[assignment]
    try:
        portable.save(_OneProcess(), str(ckpt / portable.DIR), entries, meta)  # type: ignore[arg-type]
    finally:
        portable._dumps = original  # type: ignore[assignment]


def meta_pickle(ckpt: Path, marker: str) -> str:
    """The portable part's meta: a plain pickle (as earlier distkits wrote it) holding the payload."""
    _rewrite_portable(ckpt, lambda meta: pickle.dumps({**meta, "extra": Payload(marker)}))
    return "meta"


def meta_object(ckpt: Path, marker: str) -> str:
    """The portable part's meta entry is the payload itself (DCP torch.save's it; torch's own loader reads such an
    entry with weights_only=False)."""
    _rewrite_portable(ckpt, lambda meta: Payload(marker))
    return "meta"


def dcp_metadata(ckpt: Path, marker: str) -> str:
    """DCP's .metadata (a plain pickle torch reads with pickle.load) holding the payload."""
    path = ckpt / portable.DIR / ".metadata"
    md = pickle.loads(path.read_bytes())  # (the attacker's own, trusted, file)
    md.planner_data = Payload(marker)
    path.write_bytes(pickle.dumps(md))
    return ".metadata"


OWN_LOOP = '''
import argparse, sys
import torch
import distkit
from distkit.tasks.digits import make_model
parser = argparse.ArgumentParser()
parser.add_argument("ckpt")
distkit.add_arguments(parser)
args = parser.parse_args()
dk = distkit.init(args)
net = make_model()
model, opt = dk.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
dk.load(args.ckpt, {"model": model, "optimizer": opt})
dk.print("loaded")
'''


def _one_line(res: Any, names: str) -> None:
    """Exit 2, one line naming the file (each rank that read it may say it), no traceback."""
    assert res.returncode == 2, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    said = [ln for ln in res.stderr.splitlines() if "would run code" in ln]
    assert said and all(ln.startswith("distkit:") and names in ln for ln in said), res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]


def _snapshot(out: Path) -> dict[str, tuple[int, int]]:
    """Every file's size and mtime, but the run's lock (a resume takes it, naming itself, before it reads)."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != ".distkit.lock"}


@pytest.mark.parametrize("hostile", [rank_file, meta_pickle, meta_object, dcp_metadata],
                         ids=["rank-file", "meta-pickle", "meta-object", "dcp-metadata"])
def test_a_hostile_checkpoint_runs_nothing_on_any_load_path(clean_run: Path, tmp_path: Path,
                                                          hostile: Callable[[Path, str], str]) -> None:
    out = tmp_path / "run"
    shutil.copytree(clean_run, out)
    marker = tmp_path / "PWNED"
    ckpt = _ckpt(out)
    names = hostile(ckpt, str(marker))
    _rehash(ckpt)
    assert not marker.exists()
    before = _snapshot(out)
    script = tmp_path / "own_loop.py"
    script.write_text(OWN_LOOP)
    paths = {
        "inspect": [str(BIN / "python"), "-m", "distkit", "inspect", str(out)],
        "export": [str(BIN / "python"), "-m", "distkit", "export", str(out), str(tmp_path / "model.pt")],
        "convert": [str(BIN / "python"), "-m", "distkit", "convert", str(out), str(tmp_path / "state.pt")],
        # a resume (the run's own output_dir, ++resume auto) and an own loop's dk.load, 2 ranks each
        "resume": [str(BIN / "python"), "-m", "distkit", "train", "configs/returnn_ddp.py", "--nprocs", "2",
                   "++output_dir", str(out), "++resume", "auto", "++max_steps", "8", *RUN[2:]],
        "dk.load": [str(BIN / "python"), str(script), str(ckpt), "--nprocs", "2", "++output_dir",
                    str(tmp_path / "own")],
    }
    for what, cmd in paths.items():
        res = run(cmd, timeout=240)
        assert not marker.exists(), f"{what}: the payload ran"
        _one_line(res, names)
        assert not (tmp_path / "model.pt").exists() and not (tmp_path / "state.pt").exists(), what
    # the library's one-process reader, in this process: it reads the portable part only
    if hostile is rank_file:
        portable.load_into(str(ckpt), make_model())
    else:
        with pytest.raises(CheckpointError) as e:
            portable.load_into(str(ckpt), make_model())
        assert names in str(e.value) and "would run code" in str(e.value)
    assert not marker.exists()
    assert _snapshot(out) == before  # nothing of the run's output_dir changed


def test_a_hostile_single_file_state_is_refused_by_convert(clean_run: Path, tmp_path: Path) -> None:
    """``distkit convert FILE DIR`` (the hand-over file) with a payload: refused, nothing written."""
    state = tmp_path / "state.pt"
    ok(distkit("convert", str(clean_run), str(state)))
    entries = torch.load(state, weights_only=True)
    marker = tmp_path / "PWNED"
    entries["extra"] = Payload(str(marker))
    torch.save(entries, state)
    res = distkit("convert", str(state), str(tmp_path / "back"))
    assert not marker.exists()
    _one_line(res, "state.pt")
    assert not (tmp_path / "back").exists()


SAVES_AN_OBJECT = '''
import torch, distkit
class Settings:  # an object of the script's own: its loading would import and call this module's code
    lr = 0.1
dk = distkit.init({"distributed": {"backend": "ddp"}, "output_dir": "%s"})
net = torch.nn.Linear(2, 1)
model, opt = dk.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
dk.save("%s", {"model": model, "optimizer": opt, "epoch": 3, "extra": {"settings": Settings()}})
'''


def test_dk_save_refuses_an_object_whose_loading_would_run_code(tmp_path: Path) -> None:
    """At save time, one line naming the entry, exit 2, nothing written; plain entries save and load back."""
    script = tmp_path / "save_obj.py"
    target = tmp_path / "ckpt"
    script.write_text(SAVES_AN_OBJECT % (tmp_path / "out", target))
    res = run([str(BIN / "python"), str(script)], timeout=120)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "state['extra']['settings']" in lines[0] and "__main__.Settings" in lines[0], res.stderr
    assert not target.exists()


def test_every_load_site_reads_weights_only() -> None:
    """No module of distkit calls torch.load with weights_only=False except behind portable.check_files, nor
    pickle.load(s)."""
    offenders = []
    for path in sorted((ROOT / "distkit").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0] if "``" not in line else ""  # (docstrings name what others do)
            if ("weights_only=False" in code and "(checked)" not in line) or "pickle.loads(" in code or \
                    "pickle.load(" in code:
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, offenders
    assert os.path.isfile(ROOT / "docs" / "security.md")


def _descendants(root: int) -> set[int]:
    """``root`` and every process below it (from /proc's parent links)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, grew = {root}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in found} - found
        found |= more
        grew = bool(more)
    return found


def _listening(pids: set[int]) -> list[str]:
    """The local addresses (``ip:port``, IPv6 as 32 hex digits) of the TCP sockets in LISTEN that ``pids`` hold."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:["):-1])
        except OSError:
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if parts[3] == "0A" and parts[9] in inodes:  # 0A: LISTEN
                    host, port = parts[1].split(":")
                    ip = (".".join(str(int(host[i:i + 2], 16)) for i in (6, 4, 2, 0)) if len(host) == 8 else host)
                    out.append(f"{ip}:{int(port, 16)}")
    return out


def _listening_once(out: Path, args: list[str], ready: Callable[[], bool]) -> list[str]:
    """The listening sockets of a ``distkit train configs/returnn_ddp.py --nprocs 2`` job (``args`` after those) and
    its descendants, read once ``ready()`` says every server is up; the job is then killed."""
    proc = subprocess.Popen([str(BIN / "python"), "-m", "distkit", "train", "configs/returnn_ddp.py", "--nprocs", "2",
                             "++output_dir", str(out), "++max_steps", "100000", "++progress_bar", "False", *args],
                            cwd=ROOT, env=base_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        while not ready():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.2)
        return _listening(_descendants(proc.pid))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_single_host_job_listens_on_loopback_only(tmp_path: Path) -> None:
    """Every socket a 2-rank ddp job under distkit's spawner listens on (the rendezvous store, the heartbeat store,
    gloo's) is on loopback: before, torch's TCPStore servers listened on every interface (2 of the 4)."""
    out = tmp_path / "run"
    metrics = out / "metrics.jsonl"  # two lines: training, every server is up
    listening = _listening_once(out, ["++log_every", "1"],
                                lambda: metrics.exists() and metrics.read_text().count("\n") >= 2)
    assert len(listening) >= 3, listening  # the rendezvous store, the heartbeat store, gloo's
    assert all(a.startswith("127.") for a in listening), listening


def test_an_edited_manifest_is_damage_on_every_reader(clean_run: Path, tmp_path: Path) -> None:
    """Issue 62 item 3 and issue 59's variants: a manifest whose files map was emptied (and a rank file deleted),
    one naming a file outside the checkpoint, a rank file swapped for a symbolic link, a declared size of 2**60 bytes
    (the file is read against it, never allocated by it): ``inspect`` called the first
    intact and a resume ended in a 34-line traceback. Now every reader finds the damage: verify names it, a resume
    is one line, exit 2."""
    from distkit import checkpoint

    def edited(name: str, change: Callable[[Path, dict[str, Any]], None]) -> Path:
        out = tmp_path / name
        shutil.copytree(clean_run, out)
        ckpt = _ckpt(out)
        manifest = json.loads((ckpt / "manifest.json").read_text())
        change(ckpt, manifest)
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
        return out

    def emptied(ckpt: Path, manifest: dict[str, Any]) -> None:
        manifest["files"] = {}
        (ckpt / "rank-00001.pt").unlink()

    def outside(ckpt: Path, manifest: dict[str, Any]) -> None:
        manifest["files"]["../../../secret"] = {"size": 1, "sha256": "0" * 64}

    def linked(ckpt: Path, manifest: dict[str, Any]) -> None:
        target = tmp_path / "elsewhere.pt"
        shutil.move(str(ckpt / "rank-00001.pt"), target)
        (ckpt / "rank-00001.pt").symlink_to(target)

    def huge(ckpt: Path, manifest: dict[str, Any]) -> None:  # (a reader that trusted it would allocate an exabyte)
        manifest["files"]["rank-00000.pt"]["size"] = 2**60

    cases = {"emptied": (emptied, "lists no rank-00000.pt"), "outside": (outside, "under the checkpoint"),
             "linked": (linked, "rank-00001.pt is a symbolic link"),
             "huge": (huge, f"the manifest says {2**60}")}
    for name, (change, says) in cases.items():
        out = edited(name, change)
        problem = checkpoint.verify(str(_ckpt(out)))
        assert problem is not None and says in problem, (name, problem)
    res = distkit("train", "configs/returnn_ddp.py", "--nprocs", "2", "++output_dir", str(tmp_path / "emptied"),
                  "++resume", "auto", *RUN, timeout=240)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "lists no rank-00000.pt" in res.stderr, res.stderr[-3000:]


def test_links_planted_in_output_dir_write_nothing_outside_it(tmp_path: Path) -> None:
    """Issue 62 item 5: symbolic links planted as a run's own files (.distkit.lock, metrics.jsonl, the temporary
    files of summary.json and config.resolved.json) made distkit overwrite the files they point at (4 of 10). The
    file they point at is never written: the temporary files' links are replaced, the others refused in one line."""
    from distkit import checkpoint
    from distkit.errors import ConfigError, OutputError

    out, victim = tmp_path / "run", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("keep me\n")
    for tmp in (".summary.json.tmp", ".config.resolved.json.tmp"):
        (out / tmp).symlink_to(victim)
    checkpoint.write_json(str(out / "summary.json"), {"ok": 1})
    checkpoint.write_json(str(out / "config.resolved.json"), {"ok": 2})
    assert json.loads((out / "summary.json").read_text()) == {"ok": 1} and not (out / "summary.json").is_symlink()
    (out / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(OutputError, match="metrics.jsonl' is a symbolic link"):
        checkpoint.open_own(str(out / "metrics.jsonl"), "a")
    (out / checkpoint.LOCK_NAME).symlink_to(victim)
    with pytest.raises(ConfigError, match="lock file .* is a symbolic link"):
        checkpoint.lock_output_dir(str(out))
    assert victim.read_text() == "keep me\n"


# -- the heartbeat store: a stranger's records (issue 59 item 4, issue 62 item 4) -----------------------------------
def _sleeper() -> "subprocess.Popen[bytes]":
    """A process of this user that is no rank of any job: what a forged record would have distkit kill."""
    return subprocess.Popen(["sleep", "120"], env=base_env())


def _alive(p: "subprocess.Popen[bytes]") -> bool:
    return p.poll() is None


def test_records_naming_a_pid_never_get_it_killed(capfd: pytest.CaptureFixture[str]) -> None:
    """Issue 62 item 4: the watchdog took the pid it SIGKILLs from ``who/<rank>`` records, which anyone reaching the
    store can write, and parsed them loosely (a bad value: a traceback in its thread). Rank 0's real watchdog on a
    real TCPStore, 5 ranks, rank 1-4's records forged before it learns where they run: an unsealed record (a
    stranger's) and a record sealed with the job's token (a peer that holds it) each name a process of this user
    that is no rank, stopped (what the end of a job ends); the others are not ASCII, or sealed but not
    ``<host> <pid>``, and one counter is no number. The judge names ranks 1-4 (silent) and kills on this host:
    both processes live on, every bad value is one line naming its key, no traceback."""
    delta = datetime.timedelta(seconds=5)
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=delta, wait_for_workers=False)
    victims = [_sleeper(), _sleeper()]
    fired = threading.Event()

    def end_job(code: int) -> None:  # record instead of ending the test process; never return
        fired.set()
        threading.Event().wait()

    w0 = Watchdog(server, 0, 5, 1.0, end_job)  # (its own token: unknown to the stranger)
    try:
        for v in victims:
            os.kill(v.pid, signal.SIGSTOP)
        here = host_identity()
        server.set("who/1", f"{here} {victims[0].pid}")  # the stranger's: no seal
        server.set("who/2", w0._seal.seal("who/2", f"{here} {victims[1].pid}"))  # a peer's: sealed, not its own pid
        server.set("who/3", b"\xff\xfe not text")
        server.set("who/4", w0._seal.seal("who/4", f"{here} -7"))
        for r in (1, 2, 4):
            server.set(f"hb/{r}", w0._seal.seal(f"hb/{r}", "1"))
        server.set("hb/3", "abc")
        w0.run()
        assert fired.wait(15), "the judge never named the silent ranks"
        assert sorted(w0._where) == [0, 1, 2, 3, 4] and all(w0._where[r][1] == 0 for r in (1, 2, 3, 4)), w0._where
        w0.kill_local([1, 2, 3, 4])
        assert w0.reap_local_peers(2.0) == []
        time.sleep(0.5)
        assert all(_alive(v) for v in victims), "a pid named by a record was killed"
    finally:
        w0._stop.set()
        for v in victims:
            v.kill()
            v.wait()
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    said = [ln for ln in err.splitlines() if ln.startswith("distkit: rank 0: ")]
    for key, why in (("who/1", "not sealed"), ("who/3", "not ASCII"), ("who/4", "not '<host identity> <pid>'"),
                     ("hb/3", "not sealed")):
        assert [ln for ln in said if f"ignored {key} in the heartbeat store ({why}" in ln], (key, err)
    assert [ln for ln in said if f"who/2 in the heartbeat store names pid {victims[1].pid} on this host, but no "
            "process here carries rank 2's mark: that pid is never signalled" in ln], err
    assert "ranks 1, 2, 3, 4 stopped responding" in err, err


def test_a_strangers_meeting_mark_meets_no_one(capfd: pytest.CaptureFixture[str]) -> None:
    """The start-up meeting through the store: a stranger's ``meet`` key for rank 1 does not stand for rank 1."""
    from distkit.errors import RankStalled

    delta = datetime.timedelta(seconds=5)
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=delta, wait_for_workers=False)
    w0 = Watchdog(server, 0, 2, 30.0, lambda code: None)
    server.set("meet/1/1", "1")
    with pytest.raises(RankStalled, match=r"^rank 1 did not reach the test's point"):
        w0.meet("the test's point", 0.5)
    assert "ignored meet/1/1 in the heartbeat store (not sealed)" in capfd.readouterr().err


def _stranger(where: Path, victim: int, stamp: Path, done: threading.Event, log: list[str]) -> None:
    """Reach the job's heartbeat store (its address from DISTKIT_FAULT_STORE; not its token): overwrite rank 1's
    ``who`` record with ``victim``'s pid as soon as rank 1 wrote it, and once rank 1 has stopped (``stamp``), keep
    its heartbeat going (a growing counter every 0.1 s, plain and with a made-up seal) until ``done``."""
    try:
        while not where.exists():
            if done.wait(0.05):
                return
        host, port = where.read_text().split()
        store = dist.TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=30))
        store.wait(["who/1"])
        store.set("who/1", f"{host_identity()} {victim}")
        log.append("who")
        while not stamp.exists():
            if done.wait(0.05):
                return
        n = 10**6
        while not done.wait(0.1):
            n += 1
            store.set("hb/1", str(n) if n % 2 else f"{n} #{'0' * 32}")
            if "hb" not in log:  # (said at the first write that went through: the job's end closes the store
                log.append("hb")  # under the next one, before the test has seen it end)
    except Exception as e:  # noqa: BLE001 - the job ended under it (its store is gone)
        log.append(f"{type(e).__name__}")


def test_a_stranger_in_a_running_jobs_heartbeat_store_hides_no_stall_and_kills_nothing(tmp_path: Path) -> None:
    """Issue 59 item 4: a 2-rank ddp job (``--nprocs``, ``timeout_s`` 4), whose rank 1 stops itself (SIGSTOP) at
    step 5. A stranger who reaches its heartbeat store (a real TCP client, without the job's token) rewrites rank 1's
    ``who`` record to name a process of this user, and after the stop keeps rank 1's heartbeat counter growing (what
    the store's old protocol took for beats: the stall stayed hidden until the engine's own timeout, unnamed). Now:
    rank 1 is named as before, within timeout_s + 5 s of the stop; the stranger's counter is ignored in one line
    naming ``hb/1``; the process it named lives on."""
    out, stamp, where = tmp_path / "run", tmp_path / "stamp", tmp_path / "store"
    victim = _sleeper()
    done, log = threading.Event(), []
    stranger = threading.Thread(target=_stranger, args=(where, victim.pid, stamp, done, log), daemon=True)
    stranger.start()
    try:
        res = run([str(BIN / "python"), "-m", "distkit", "train", "configs/returnn_ddp.py", "--nprocs", "2",
                   "++output_dir", str(out), "++max_steps", "100000", "++progress_bar", "False", "++log_every", "1",
                   "++distributed.timeout_s", "4"], timeout=240, DISTKIT_FAULT="1:5:stop",
                  DISTKIT_FAULT_STAMP=str(stamp), DISTKIT_FAULT_STORE=str(where))
        ended = time.time()
        done.set()
        stranger.join(30)
        assert res.returncode != 0 and stamp.exists(), res.stderr[-3000:]
        assert "distkit: rank 1 stopped responding: no heartbeat for " in res.stderr, res.stderr[-3000:]
        assert ended - float(stamp.read_text().split()[1]) < 4 + 5, res.stderr[-3000:]
        assert "ignored hb/1 in the heartbeat store" in res.stderr, (log, res.stderr[-3000:])
        assert "who" in log and "hb" in log, log
        assert _alive(victim), "the pid the stranger named was killed"
        assert "Traceback" not in res.stderr, res.stderr[-3000:]
    finally:
        done.set()
        victim.kill()
        victim.wait()


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")  # (torchft's tensors on the response's bytes)
def test_a_heal_reads_a_live_groups_state_weights_only(tmp_path: Path) -> None:
    """The torchft heal path: a healing group receives a live group's state over torchft's HTTP transport, which
    reads it with ``weights_only=False`` (a server that sends a pickled call runs it: shown first, with torchft's own
    transport). distkit's transport reads it weights-only: a plain state arrives whole, the payload is refused in one
    line naming what it names, and nothing runs. Its server listens on the address given, not every interface."""
    pytest.importorskip("torchft")
    from torchft.checkpointing.http_transport import HTTPTransport

    from distkit.ft.torchft_parts import heal_transport

    t = datetime.timedelta(seconds=20)
    marker = tmp_path / "PWNED"
    hostile = {"user": {"default": {"model": {"w": torch.ones(2)}, "extra": Payload(str(marker))}}, "torchft": {}}
    plain = {"user": {"default": {"model": {"w": torch.arange(3.0)}, "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}],
                                  "distkit": {"num_steps": 5}}}, "torchft": {"step": 2, "batches_committed": 2}}
    ours = [heal_transport(t, "127.0.0.1") for _ in range(2)]
    theirs = [HTTPTransport(timeout=t, num_chunks=0) for _ in range(2)]
    try:
        theirs[0].send_checkpoint([1], 1, hostile, t)
        theirs[1].recv_checkpoint(0, theirs[0].metadata(), 1, t)
        assert marker.exists(), "torchft's own transport did not run the payload: this test shows nothing"
        marker.unlink()
        assert ours[0]._server.socket.getsockname()[0] == "127.0.0.1" and ours[0].metadata().startswith(
            "http://127.0.0.1:")
        ours[0].send_checkpoint([1], 1, plain, t)
        got = ours[1].recv_checkpoint(0, ours[0].metadata(), 1, t)
        assert torch.equal(got["user"]["default"]["model"]["w"], torch.arange(3.0)) and \
            got["user"]["default"]["groups"] == [{"lr": 0.1, "betas": (0.9, 0.99)}] and got["torchft"]["step"] == 2
        ours[0].send_checkpoint([1], 2, hostile, t)
        with pytest.raises(Exception, match=r"refused the state a live group sent from http://127\.0\.0\.1:\d+/"
                                            r"checkpoint/2/full: loading it would run code \(it names \S*open\)"):
            ours[1].recv_checkpoint(0, ours[0].metadata(), 2, t)
        assert not marker.exists()
    finally:
        for tr in ours + theirs:
            tr.shutdown(wait=False)


def test_a_fault_tolerant_group_on_one_host_listens_on_loopback_only(lighthouse: str, tmp_path: Path) -> None:
    """torchft starts its Manager server (the group's rank 0) and every rank's heal server on every interface
    (``[::]``): 3 of a 2-rank group's 14 listening sockets were on ``::``. distkit gives them the address the other
    groups are told, loopback when the lighthouse is on this host: every socket of the group is on loopback."""
    out = tmp_path / "ft"
    ft = f"{{'lighthouse': '{lighthouse}', 'replica_id': 0, 'num_replicas': 1}}"
    metrics = out / "group-0" / "metrics.jsonl"  # a sync done: every server is up
    listening = _listening_once(out, ["++log_every", "5", "++distributed", "{'backend': 'ddp', 'reduce_type': 'param', "
                                      "'param_sync_step': 5}", "++fault_tolerance", ft],
                                lambda: metrics.exists() and '"sync"' in metrics.read_text())
    assert len(listening) >= 7, listening  # the stores (rendezvous, heartbeat, group's), Manager, 2 heal, gloo's
    assert all(a.startswith("127.") for a in listening), listening


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")  # (torchft's tensors on the response's bytes)
def test_a_heal_server_serves_only_requests_sealed_with_the_lighthouse_token() -> None:
    """Issue 59 item 4: a heal server (every rank of a fault-tolerant group serves its training state while a group
    heals) served the state to whoever asked. With the lighthouse's token it answers only requests sealed with it:
    a stranger's request, and one sealed with another token, get 403 and no state; the group's own get it."""
    import urllib.error
    import urllib.request

    from distkit.ft.torchft_parts import heal_transport

    t = datetime.timedelta(seconds=20)
    token = os.urandom(32)
    serving, healing, stranger = (heal_transport(t, "127.0.0.1", k) for k in (token, token, os.urandom(32)))
    state = {"user": {"default": {"model": {"w": torch.arange(4.0)}}}, "torchft": {"step": 3, "batches_committed": 3}}
    try:
        serving.send_checkpoint([1], 3, state, t)
        got = healing.recv_checkpoint(0, serving.metadata(), 3, t)
        assert torch.equal(got["user"]["default"]["model"]["w"], torch.arange(4.0)) and got["torchft"]["step"] == 3
        with pytest.raises(urllib.error.HTTPError) as plain:
            urllib.request.urlopen(serving.metadata() + "3/full", timeout=20)
        assert plain.value.code == 403
        with pytest.raises(urllib.error.HTTPError) as other:
            stranger.recv_checkpoint(0, serving.metadata(), 3, t)
        assert other.value.code == 403
    finally:
        for tr in (serving, healing, stranger):
            tr.shutdown(wait=False)


def test_the_lighthouse_lets_in_only_peers_that_prove_its_token(lighthouse: str, tmp_path: Path) -> None:
    """Issue 62 item 4 and issue 59 item 4: one unauthenticated ``POST /replica/<id>/kill`` to the lighthouse ended a
    replica group in 0.18 s, and its /status page named every group to anyone. Now ``distkit lighthouse`` serves its
    address with a gate: a stranger's HTTP request gets no HTTP answer (the gate's greeting) and one line in the
    lighthouse's log; a peer with another token is refused, and a group given it (or none) stops in one line,
    exit 2, nothing written; the holder of the token sees the lighthouse. Its own port is on loopback."""
    import http.client
    import urllib.parse

    from distkit.ft import gate, watch

    port = urllib.parse.urlparse(lighthouse).port
    for method, path in (("POST", "/replica/distkit_group_0/kill"), ("GET", "/status")):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        with pytest.raises(http.client.BadStatusLine, match="distkit-gate"):
            conn.request(method, path)
            conn.getresponse()
        conn.close()
    refused = "refused a connection from 127.0.0.1 port"
    log = lighthouse.log  # type: ignore[attr-defined]
    while log.read_text().count(refused) < 2:  # (the gate says it when it has read the request)
        assert lighthouse.proc.poll() is None, log.read_text()  # type: ignore[attr-defined]
        time.sleep(0.1)
    assert "Current quorum_id" in watch.lighthouse_status(lighthouse, gate.read_token(None))[1]
    why = watch.lighthouse_status(lighthouse, os.urandom(32))[0]
    assert why is not None and "refused this group's token" in why
    other = tmp_path / "other.token"
    other.write_text(os.urandom(32).hex())
    other.chmod(0o600)
    for token_file, says in ((str(other), "refused this group's token: give the groups the token file"),
                             (None, "lets only holders of its token in: give the groups its token file")):
        out = tmp_path / f"out-{token_file is None}"
        ft = {"lighthouse": lighthouse, "replica_id": 0, "num_replicas": 1, "token_file": token_file}
        res = distkit("train", "configs/returnn_ddp.py", "++output_dir", str(out), "++distributed",
                      "{'backend': 'ddp', 'reduce_type': 'param', 'param_sync_step': 5}", "++fault_tolerance", repr(ft),
                      timeout=120)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith(
            "distkit: error: fault_tolerance.lighthouse: ") and says in lines[0], res.stderr[-3000:]
        assert not out.exists()
    lighthouse_sockets = _listening(_descendants(lighthouse.proc.pid) | {lighthouse.proc.pid})  # type: ignore[attr-defined]
    assert len(lighthouse_sockets) == 2 and all(a.startswith("127.") for a in lighthouse_sockets), lighthouse_sockets


def test_a_lighthouse_token_file_others_can_read_is_refused(tmp_path: Path) -> None:
    """A token file readable by others (a secret anyone can read is none), or one that holds no token: one line,
    exit 2, nothing written; `distkit lighthouse` writes a new token file with mode 0600."""
    loose = tmp_path / "loose.token"
    loose.write_text(os.urandom(32).hex())
    loose.chmod(0o644)
    empty = tmp_path / "empty.token"
    empty.write_text("not a token")
    empty.chmod(0o600)
    for path, says in ((loose, f"is readable by others (mode 644): chmod 600 {loose}"),
                       (empty, "does not hold a token (64 hex digits)"),
                       (tmp_path / "missing.token", "cannot be read (No such file or directory)")):
        out = tmp_path / "out"
        # something must answer at the lighthouse's address for the token to be looked for: this test's own socket
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(4)
            ft = {"lighthouse": f"http://127.0.0.1:{server.getsockname()[1]}", "replica_id": 0, "num_replicas": 1,
                  "token_file": str(path)}
            res = distkit("train", "configs/returnn_ddp.py", "++output_dir", str(out), "++distributed",
                          "{'reduce_type': 'param'}", "++fault_tolerance", repr(ft), timeout=120)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and says in lines[0], res.stderr[-3000:]
        assert not out.exists()
