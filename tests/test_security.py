"""Nothing a user loads runs code (issue 59): hostile checkpoints on every load path.

An attacker who can hand over a checkpoint can also rewrite its manifest (the sizes and sha256 guard against damage,
not against a file made to pass them): every case below rewrites it to match. Each payload is a pickled call of
``open(MARKER, "w")``, which creates the marker file when the file is unpickled the way torch's and Python's default
loaders do. On every path: the marker is never created, the load stops with one line naming the file, exit 2, and
the run's output_dir is unchanged.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from conftest import BIN, ROOT, base_env, distkit, ok, run

from distkit import portable
from distkit.commands.convert import _OneProcess
from distkit.errors import CheckpointError
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


def test_a_single_host_job_listens_on_loopback_only(tmp_path: Path) -> None:
    """Every socket a 2-rank ddp job under distkit's spawner listens on (the rendezvous store, the heartbeat store,
    gloo's) is on loopback: before, torch's TCPStore servers listened on every interface (2 of the 4)."""
    out = tmp_path / "run"
    proc = subprocess.Popen([str(BIN / "python"), "-m", "distkit", "train", "configs/returnn_ddp.py", "--nprocs", "2",
                             "++output_dir", str(out), "++max_steps", "100000", "++progress_bar", "False",
                             "++log_every", "1"], cwd=ROOT, env=base_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # training: every server is up
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.2)
        listening = _listening(_descendants(proc.pid))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert len(listening) >= 3, listening  # the rendezvous store, the heartbeat store, gloo's
    assert all(a.startswith("127.") for a in listening), listening


def test_an_edited_manifest_is_damage_on_every_reader(clean_run: Path, tmp_path: Path) -> None:
    """Issue 62 item 3 and issue 59's variants: a manifest whose files map was emptied (and a rank file deleted),
    one naming a file outside the checkpoint, a rank file swapped for a symbolic link: ``inspect`` called the first
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

    cases = {"emptied": (emptied, "lists no rank-00000.pt"), "outside": (outside, "under the checkpoint"),
             "linked": (linked, "rank-00001.pt is a symbolic link")}
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
