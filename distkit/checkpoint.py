"""Atomic, verified, resumable checkpoints (DESIGN.md section 6).

Layout under ``output_dir/checkpoints/``::

    step-0000040/rank-00000.pt ... rank-NNNNN.pt, manifest.json   (manifest written last)
    latest                                                         (text: "step-0000040")

Protocol (collective, every rank, :func:`write`): rank 0 makes a hidden temporary directory;
every rank writes its own file (``.part`` then rename) and hashes it; the ranks agree on
success (a failed write, e.g. a full disk, removes the partial files and raises on every
rank); rank 0 writes the manifest (each file's size and sha256, the model's parameter
shapes) and renames the directory to its final name; barrier; then rank 0 replaces
``latest`` by rename (:func:`mark_latest`), deletes leftovers of interrupted saves and keeps
the newest ``keep`` checkpoints. Re-saving an existing step moves the old directory aside
(``.step-N.old``) and deletes it only after the new one is in place; :func:`resolve` finds
the aside copy if a kill came in between. So ``latest`` always names a complete checkpoint.

Resuming (:func:`find_resumable`) verifies every file's size and sha256 and continues from the
newest complete checkpoint, saying so when ``latest`` names another (missing, damaged, not text,
naming an incomplete checkpoint, or stale: a newer one is complete); when checkpoints exist but
none is complete it raises, naming the damaged file. :func:`check_layout` refuses, at start,
a ``checkpoints`` that is a file or a ``latest`` that is a directory.

One run per ``output_dir`` (:func:`lock_output_dir`): the process owning the run holds an
``flock`` on ``output_dir/.distkit.lock`` to its end. :func:`write_json` writes the run's small
JSON files (``summary.json``, ``config.resolved.json``) atomically.

Each rank saves its own state (in param mode ranks differ between syncs, and RNG states always
do). Assumes ``output_dir`` is on a filesystem every rank sees (one node, or a shared FS).
"""
from __future__ import annotations

import atexit
import contextlib
import copy
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from distkit import faults, portable
from distkit.errors import CheckpointError, ConfigError, OutputError

if TYPE_CHECKING:
    from distkit.backends.base import Strategy
    from distkit.config import RunConfig

#: default of the ``keep_checkpoints`` key: complete checkpoints kept (older ones are deleted
#: after a new one is complete)
KEEP = 3
STEP_RE = re.compile(r"^step-(\d+)$")
_ASIDE_RE = re.compile(r"^\.(step-\d+)\.old$")


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def step_name(step: int) -> str:
    return f"step-{step:07d}"


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _agree_on_error(strategy: "Strategy", error: Optional[str]) -> None:
    """Collective: rank 0's error (or None) becomes every rank's, so all ranks raise together (no hang)."""
    error = strategy.broadcast_object(error, 0)
    if error:
        agreed = CheckpointError(error)
        agreed.agreed = True
        raise agreed


#: bytes free on a filesystem below which a short write there is taken for a full disk
_FULL_BELOW = 1 << 20


def _is_no_space(e: BaseException, where: Optional[str] = None) -> bool:
    """A full disk, also when torch reports it as RuntimeError with the OSError as its context, or,
    for a write under ``where``, as a short write with no errno at all (torch's zip writer:
    ``unexpected pos N vs M``), told by that filesystem having less than :data:`_FULL_BELOW` free.
    Call it before the partial files are removed."""
    seen: Optional[BaseException] = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    if "No space left on device" in str(e):
        return True
    if where is not None and "unexpected pos" in str(e):
        try:
            return shutil.disk_usage(_nearest_existing(where)).free < _FULL_BELOW
        except OSError:
            return False
    return False


def _nearest_existing(path: str) -> str:
    """``path`` made absolute, or its nearest parent that exists (the filesystem a new file there lands on)."""
    d = os.path.abspath(path)
    while not os.path.exists(d):
        d = os.path.dirname(d)
    return d


def _previous(parent: str) -> str:
    prev = latest(parent)
    return (f"the previous checkpoint {os.path.basename(prev)} is intact" if prev
            else "no earlier checkpoint exists")


def _write_rank_file(tmp: str, rank: int, state: dict[str, Any], step: int) -> tuple[str, int, str]:
    """This rank's file in ``tmp`` (``.part`` then rename); returns (name, size, sha256)."""
    path = os.path.join(tmp, _rank_file(rank))
    with open(path + ".part", "wb") as f:  # a file object: a full disk surfaces as OSError(ENOSPC)
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    faults.maybe_fire(rank, step, "rank_file")  # the .part is complete, not yet renamed
    os.replace(path + ".part", path)
    return _rank_file(rank), os.path.getsize(path), sha256_file(path)


def write(strategy: "Strategy", final: str, state: dict[str, Any], model: Any = None, step: int = -1,
          shapes: Optional[dict[str, list[int]]] = None, samples: Optional[int] = None,
          portable_part: Optional[tuple[dict[str, Any], dict[str, Any]]] = None,
          global_batch: Optional[int] = None) -> str:
    """Collective: write this rank's ``state`` as the complete checkpoint directory ``final``, atomically.

    Every rank writes its own file into a hidden temporary sibling (``.part`` then rename) and hashes
    it; the ranks agree on success; rank 0 writes the manifest (size and sha256 of every file,
    ``shapes`` of the model's tensors) and moves the directory into place. An existing ``final`` is
    moved aside first and deleted only after the new one is in place, so a kill at any instant leaves
    a complete checkpoint under ``final``, under its aside name (found by :func:`resolve`), or its
    predecessor intact. Engines with their own format (DeepSpeed) write it through
    ``strategy.save_engine_files`` into the same directory, covered by the same manifest; so is the
    engine-neutral ``portable/`` part (``portable_part``: this rank's tensors and rank 0's meta, see
    :mod:`distkit.portable`), which every rank writes its share of. An
    unwritable location raises :class:`CheckpointError` on every rank before anything is written; a
    full disk raises it on every rank after the partial files are removed.
    """
    pending = start(strategy, final, state, model, step, shapes, samples, portable_part, global_batch, background=False)
    return pending.commit()


class PendingCheckpoint:
    """A checkpoint whose files are being written (by a background thread with ``background=True``):
    :meth:`commit`, collective, waits for this rank's files and completes the protocol of :func:`write`
    (the ranks agree, rank 0 writes the manifest and moves the directory into place). Until then the
    checkpoint does not exist: a kill leaves only a hidden temporary directory, removed by the next save."""

    def __init__(self, strategy: "Strategy", final: str, tmp: str, step: int, work: Callable[[], Any],
                 job: Optional[portable.Job], manifest: dict[str, Any], background: bool) -> None:
        self._strategy, self.path, self._tmp, self.step = strategy, final, tmp, step
        self._job, self._manifest = job, manifest
        #: called with the seconds :meth:`commit` took (the Session adds them to ``checkpoint_stall_s``)
        self.on_commit: Optional[Callable[[float], None]] = None
        self._result: list[Any] = []
        self._thread: Optional[threading.Thread] = None
        if background:
            self._thread = threading.Thread(target=lambda: self._result.append(work()), name="distkit-checkpoint",
                                            daemon=True)
            self._thread.start()
        else:
            self._result.append(work())

    def done(self) -> bool:
        """Whether this rank's files are written (not collective; :meth:`commit` is still needed)."""
        return self._thread is None or not self._thread.is_alive()

    def commit(self) -> str:
        """Collective: wait for every rank's files, then complete the checkpoint; returns its path."""
        t0 = time.perf_counter()
        try:
            return self._commit()
        finally:
            if self.on_commit is not None:
                self.on_commit(time.perf_counter() - t0)

    def _commit(self) -> str:
        if self._thread is not None:
            self._thread.join()
        strategy, final, tmp, step = self._strategy, self.path, self._tmp, self.step
        faults.maybe_fire(strategy.rank, step, "checkpoint")
        results = strategy.all_gather_object(self._result[0])  # also the barrier: every rank's files are complete
        failed = [m for m, _, _ in results if isinstance(m, str)]
        failed += [_describe(w, os.path.join(final, portable.DIR)) for _, w, _ in results if isinstance(w, BaseException)]
        parent, name = os.path.split(final)
        error = None
        if strategy.is_main:
            try:
                if failed:
                    raise CheckpointError(failed[0])
                if self._job is not None:
                    self._job.finish([w for _, w, _ in results])  # DCP's .metadata
                hashed = {n: {"size": s, "sha256": h} for mine, _, hashes in results for n, s, h in [mine, *hashes]}
                manifest = {**self._manifest, "files": file_entries(tmp, hashed)}
                with open(os.path.join(tmp, "manifest.json.part"), "w") as f:
                    json.dump(manifest, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(os.path.join(tmp, "manifest.json.part"), os.path.join(tmp, "manifest.json"))
                faults.maybe_fire(strategy.rank, step, "manifest")  # complete, still under its temporary name
                aside = os.path.join(parent, f".{name}.old")
                if os.path.isdir(final):  # a re-save: any aside copy is garbage of an earlier re-save
                    shutil.rmtree(aside, ignore_errors=True)
                    os.replace(final, aside)
                # (if final is missing and an aside copy exists, that copy is the complete one: keep it
                # until the new directory is in place)
                faults.maybe_fire(strategy.rank, step, "swap")  # the old one aside, the new one not yet in place
                os.replace(tmp, final)
                shutil.rmtree(aside, ignore_errors=True)
            except Exception as e:
                full = _is_no_space(e, tmp)  # before the partial files go: a short write is told by the free space
                shutil.rmtree(tmp, ignore_errors=True)  # partial files removed
                if isinstance(e, CheckpointError) or full:
                    text = str(e) if isinstance(e, CheckpointError) else \
                        f"no space left on device writing '{os.path.join(final, 'manifest.json')}'"
                else:
                    text = f"{type(e).__name__}: {e} writing '{final}'"
                error = (f"{text}; {_previous(parent)} (partial files removed): free space or lower "
                         "keep_checkpoints, then continue with ++resume auto")
        _agree_on_error(strategy, error)
        return final


def file_entries(directory: str, known: Optional[dict[str, dict[str, Any]]] = None) -> dict[str, dict[str, Any]]:
    """The manifest's ``files``: size and sha256 of every file under ``directory`` by relative path,
    sorted; files in ``known`` (hashed already, by the rank that wrote them) are not read again."""
    files = {}
    for d, _, names in os.walk(directory):
        for f in names:
            full = os.path.join(d, f)
            rel = os.path.relpath(full, directory)
            files[rel] = (known or {}).get(rel) or {"size": os.path.getsize(full), "sha256": sha256_file(full)}
    return dict(sorted(files.items()))


def _describe(e: BaseException, where: str) -> str:
    """One line for an error that stopped writing ``where``."""
    if _is_no_space(e, where):
        return f"no space left on device writing '{where}'"
    if isinstance(e, OSError):
        return f"{e.strerror or e} writing '{where}'"
    return f"{type(e).__name__}: {e} writing '{where}'"


def _cpu_copy(obj: Any) -> Any:
    """``obj`` with every tensor in it (nested dicts, lists, tuples) copied to the CPU: what a background
    write may read while training goes on changing the originals."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


def start(strategy: "Strategy", final: str, state: dict[str, Any], model: Any = None, step: int = -1,
          shapes: Optional[dict[str, list[int]]] = None, samples: Optional[int] = None,
          portable_part: Optional[tuple[dict[str, Any], dict[str, Any]]] = None,
          global_batch: Optional[int] = None, background: bool = True,
          run_id: Optional[str] = None) -> PendingCheckpoint:
    """Collective: the first half of :func:`write`. Makes the temporary directory, writes the engine's own
    files (DeepSpeed: synchronous), plans the portable part, and starts writing this rank's files, in a
    background thread with ``background`` (then ``state`` and the portable tensors are copied first, so
    training may go on). :meth:`PendingCheckpoint.commit` completes it."""
    final = os.path.abspath(final)
    parent, name = os.path.split(final)
    tmp = os.path.join(parent, f".{name}.tmp")
    error = None
    if strategy.is_main:
        try:
            os.makedirs(parent, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = (f"cannot write checkpoint '{final}': {e.strerror or e}: choose a writable directory "
                     f"({_previous(parent)})")
    _agree_on_error(strategy, error)
    failure: Optional[str] = None
    try:
        strategy.save_engine_files(tmp, model)
        if background:
            state = _cpu_copy(state)
    except Exception as e:  # every rank must learn of it, or the others wait in the next collective
        failure = _describe(e, os.path.join(final, _rank_file(strategy.rank)))
    job = None
    if portable_part is not None:  # collective, every rank (also one that failed above): no rank waits alone
        job = portable.plan(strategy, os.path.join(tmp, portable.DIR), *portable_part, copy=background)

    def work() -> tuple[Any, Any, list[tuple[str, int, str]]]:
        mine: Any = failure
        if mine is None:
            try:
                mine = _write_rank_file(tmp, strategy.rank, state, step)
            except Exception as e:
                mine = _describe(e, os.path.join(final, _rank_file(strategy.rank)))
        written = job.write() if job is not None else None
        hashes = []  # this rank's portable files, hashed here (in parallel, in the background) and not by rank 0
        if job is not None and not isinstance(written, BaseException):
            directory = os.path.join(tmp, portable.DIR)
            for f in sorted(os.listdir(directory)):
                if f.startswith(f"__{strategy.rank}_") and f.endswith(".distcp"):
                    full = os.path.join(directory, f)
                    hashes.append((os.path.join(portable.DIR, f), os.path.getsize(full), sha256_file(full)))
        return mine, written, hashes

    d = strategy.cfg.distributed
    manifest = {"format": 3, "step": step, "samples": samples, "global_batch": global_batch,
                "portable": portable_part is not None, "world_size": strategy.world_size,
                "engine": strategy.name, "reduce_type": d.reduce_type,
                "zero_stage": getattr(strategy, "zero_stage", None), "shapes": shapes}
    if run_id is not None:
        manifest["run_id"] = run_id  # which run wrote it (see run_id_note)
    return PendingCheckpoint(strategy, final, tmp, step, work, job, manifest, background)


def mark_latest(root: str, name: str, keep: int = KEEP) -> None:
    """Point ``root/latest`` at checkpoint ``name`` (by rename: atomic), then delete the leftovers of
    interrupted saves, checkpoints of an abandoned timeline (steps after ``name``: a run started over)
    and all but the newest ``keep``. Not collective: rank 0 calls it after :func:`write` returned."""
    step = int(STEP_RE.match(name).group(1))  # type: ignore[union-attr]
    faults.maybe_fire(0, step, "latest")  # the new checkpoint complete, `latest` still the old one
    try:
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(name)
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    except OSError as e:
        try:
            os.unlink(os.path.join(root, "latest.tmp"))
        except OSError:
            pass
        what = "no space left on device" if _is_no_space(e) else (e.strerror or str(e))
        raise CheckpointError(f"{what} writing '{os.path.join(root, 'latest')}'; checkpoint {name} is complete "
                              "but `latest` still names the previous one: ++resume auto uses the newest complete "
                              "checkpoint") from e
    _clean(root, step, keep)


def _clean(root: str, step: int, keep: int) -> None:
    for entry in os.listdir(root):
        path = os.path.join(root, entry)
        m = STEP_RE.match(entry)
        aside = _ASIDE_RE.match(entry)
        if m and int(m.group(1)) > step:  # after the step just saved: an earlier run's, started over
            shutil.rmtree(path, ignore_errors=True)
        elif (aside and _step_of(aside.group(1)) <= step and not os.path.exists(os.path.join(root, aside.group(1)))
              and os.path.isfile(os.path.join(path, "manifest.json"))):
            os.replace(path, os.path.join(root, aside.group(1)))  # an interrupted re-save's only copy: back in place
        elif entry.startswith(".") and (entry.endswith((".tmp", ".old", ".part"))):
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)
        elif entry.endswith((".tmp", ".part")) and os.path.isfile(path):
            os.unlink(path)
    done = sorted((d for d in os.listdir(root) if STEP_RE.match(d)), key=lambda d: int(d[5:]))
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def resolve(root: str, name: str) -> Optional[str]:
    """The directory of checkpoint ``name``: ``root/name``, or its aside copy ``root/.name.old`` when a
    re-save was interrupted between moving the old one aside and putting the new one in place."""
    for path in (os.path.join(root, name), os.path.join(root, f".{name}.old")):
        if os.path.isfile(os.path.join(path, "manifest.json")):
            return path
    return None


def read_latest(root: str) -> tuple[Optional[str], Optional[str]]:
    """``(name, None)``: the checkpoint name ``root/latest`` holds; ``(None, why)`` when it holds none, ``why``
    completing "checkpoints/latest ..." ("is missing", "is damaged (...)"). The pointer is a file of ours, but
    a disk error, a copy gone wrong or a user may have left anything there: bytes that are not text, another
    text, a directory; each is a damaged pointer, never an exception."""
    pointer = os.path.join(root, "latest")
    if not os.path.lexists(pointer):
        return None, "is missing"
    if not os.path.isfile(pointer):
        return None, "is damaged (it is not a file)"
    try:
        with open(pointer, "rb") as f:
            data = f.read(256)  # a checkpoint name is 12 characters: more is damage too, and is not read whole
        name = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, "is damaged (it holds bytes that are not UTF-8 text, not a checkpoint name)"
    except OSError as e:
        return None, f"is damaged (it cannot be read: {e.strerror or e})"
    if not name:
        return None, "is damaged (it is empty)"
    if not STEP_RE.match(name):  # also keeps a NUL byte or a path out of os.path calls
        return None, f"is damaged (it holds {name[:40]!r}, not a checkpoint name)"
    return name, None


def latest(root: str) -> Optional[str]:
    """The complete directory ``latest`` points to (see :func:`resolve`), or None, also when ``latest`` is
    missing or damaged (not verified: :func:`find_resumable` is what a resume uses)."""
    name, _ = read_latest(root)
    return resolve(root, name) if name else None


def read_manifest(path: str) -> dict[str, Any]:
    manifest_path = os.path.join(path, "manifest.json")
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"'{path}' is not a complete distkit checkpoint (no manifest.json): pick another "
                              "or use ++resume auto")
    try:
        with open(manifest_path) as f:
            manifest: dict[str, Any] = json.load(f)
        manifest["world_size"], manifest["files"]  # noqa: B018 (the keys every version has)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint '{path}' is damaged: {manifest_path} cannot be read ({e})") from e
    return manifest


def _check_file(path: str, rel: str, want: Any) -> Optional[str]:
    """What is wrong with file ``rel`` of checkpoint ``path`` (None: it matches the manifest)."""
    full = os.path.join(path, rel)
    if not os.path.isfile(full):
        return f"{full} is missing"
    size = want if isinstance(want, int) else want["size"]  # format 1 recorded sizes only
    if os.path.getsize(full) != size:
        return f"{full} has {os.path.getsize(full)} bytes, the manifest says {size}"
    if isinstance(want, dict) and want.get("sha256"):
        stat = os.stat(full)
        key = (os.path.abspath(full), stat.st_size, stat.st_mtime_ns, want["sha256"])
        if key in _HASHED or _trusted(path):  # hashed once per process; or by the launching command just now
            return None
        if sha256_file(full) != want["sha256"]:
            return f"{full} does not match its sha256 in the manifest"
        _HASHED.add(key)
    return None


#: files whose sha256 this process has checked (path, size, mtime, digest): a resume verifies once
_HASHED: set[tuple[str, int, int, str]] = set()
#: set by the launching command for the ranks it starts: the checkpoint its preflight verified
TRUSTED_ENV = "DISTKIT_VERIFIED_CHECKPOINT"


def _trusted(path: str) -> bool:
    return os.environ.get(TRUSTED_ENV) == os.path.abspath(path)


def verify(path: str, only: Optional[str] = None, under: Optional[str] = None) -> Optional[str]:
    """What is damaged in checkpoint ``path`` (the first file, by name), or None when every file (or
    just file ``only``, or the files in its subdirectory ``under``) has the size and sha256 its
    manifest records."""
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        return str(e)
    for rel, want in sorted(manifest["files"].items()):
        if (only is None or rel == only) and (under is None or rel.startswith(under + os.sep)):
            problem = _check_file(path, rel, want)
            if problem:
                return problem
    return None


def _step_of(name: str) -> int:
    return int(name.rsplit("-", 1)[1].split(".")[0])


def find_resumable(root: str, doing: str = "resuming from") -> tuple[Optional[str], list[str]]:
    """For ``++resume auto``: the newest verified complete checkpoint under ``root`` and notes on why it is
    not the one ``latest`` names (``latest`` missing, damaged, naming an unusable checkpoint, or an older one:
    a save whose ``latest`` update failed or was killed leaves a newer complete checkpoint, the one to
    continue from). ``doing`` words the notes ("resuming from", "inspecting"). (None, []) when there is no
    checkpoint at all. Raises :class:`CheckpointError` naming the damaged file when checkpoints exist but
    none is complete: a resume never silently starts from step 0 over an earlier run."""
    if not os.path.isdir(root):
        return None, []
    entries = os.listdir(root)
    names = {e for e in entries if STEP_RE.match(e)} | {m.group(1) for e in entries if (m := _ASIDE_RE.match(e))}
    named, pointer_problem = read_latest(root)
    if not names and named is None and pointer_problem == "is missing":
        return None, []
    order = sorted(names, key=_step_of, reverse=True)  # newest first, whatever `latest` says
    problems: dict[str, str] = {}
    if named is not None and named not in names:  # (neither the directory nor its aside copy is there)
        problems[named] = f"{os.path.join(root, named)} does not exist"
    for name in order:
        path = resolve(root, name)
        problem = verify(path) if path else (
            f"{os.path.join(root, name)} has no manifest.json (an interrupted save)" if os.path.isdir(os.path.join(root, name))
            else f"{os.path.join(root, name)} does not exist")
        if problem is not None:
            problems[name] = problem
            continue
        if name == named:
            return path, []
        if named is None:
            why = pointer_problem
        elif named in problems:
            why = f"names {named}, which is unusable: {problems[named]}"
        else:  # an older checkpoint (not verified: a newer complete one is there)
            why = f"names {named}, but {name} is newer and complete"
        return path, [f"checkpoints/latest {why}; {doing} {name}, the newest complete checkpoint"]
    first_problem = next(iter(problems.values()), f"checkpoints/latest {pointer_problem}")
    raise CheckpointError(f"no complete checkpoint in {root} to resume from: {first_problem}; restore the file, "
                          "resume from a checkpoint directory with ++resume DIR, or start over with ++resume none")


def check_layout(output_dir: str) -> None:
    """ConfigError unless ``output_dir/checkpoints`` is a directory (or absent) and its ``latest`` a file (or
    absent): anything else would only fail at the first save, after training (and after the run's
    metrics.jsonl was started over). Reads only."""
    root = os.path.join(output_dir, "checkpoints")
    if os.path.lexists(root) and not os.path.isdir(root):
        raise ConfigError(f"'{root}' is a file, where distkit keeps the run's checkpoint directory: move or delete it, "
                          "or choose another output_dir")
    pointer = os.path.join(root, "latest")
    if os.path.isdir(pointer):
        raise ConfigError(f"'{pointer}' is a directory, where distkit keeps the file naming the newest checkpoint: "
                          "move or delete it (++resume auto then finds the newest complete checkpoint), or choose "
                          "another output_dir")


def checkpoint_for(cfg: "RunConfig") -> tuple[Optional[str], list[str]]:
    """The checkpoint ``cfg.resume`` asks for, verified, and notes for the user (see :func:`find_resumable`).
    First :func:`check_layout`, whatever ``resume`` is: every run saves into ``checkpoints/``."""
    check_layout(cfg.output_dir)
    if cfg.resume == "auto":
        return find_resumable(os.path.join(cfg.output_dir, "checkpoints"))
    if cfg.resume is None:  # unset: an earlier run's checkpoints are never replaced without being asked
        root = os.path.join(cfg.output_dir, "checkpoints")
        steps = sorted((e for e in os.listdir(root) if STEP_RE.match(e)), key=_step_of) if os.path.isdir(root) else []
        if steps:
            raise ConfigError(f"output_dir '{cfg.output_dir}' holds checkpoints of an earlier run (newest: {steps[-1]}): "
                              "continue it with ++resume auto, start over with ++resume none (its checkpoints are "
                              "then replaced), or choose another output_dir")
        return None, []
    if cfg.resume == "none":
        return None, []
    path = cfg.resume if os.path.isfile(os.path.join(cfg.resume, "manifest.json")) else \
        resolve(os.path.dirname(os.path.abspath(cfg.resume)), os.path.basename(os.path.abspath(cfg.resume)))
    problem = verify(path or cfg.resume)
    if problem:
        raise CheckpointError(f"cannot resume from '{cfg.resume}': {problem}")
    return path, []


def new_run_id() -> str:
    """A fresh run id: 12 hex digits (48 random bits)."""
    return uuid.uuid4().hex[:12]


def recorded_run_id(output_dir: str) -> Optional[str]:
    """The run id an earlier run recorded in ``output_dir/config.resolved.json`` (None: none there, or
    unreadable). A run that continues from its own checkpoints keeps it, so it names the output_dir's run."""
    try:
        with open(os.path.join(output_dir, "config.resolved.json"), encoding="utf-8") as f:
            value = json.load(f).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def run_id_note(path: str, run_id: str) -> Optional[str]:
    """A note when checkpoint ``path`` was written by another run than ``run_id`` (its manifest records
    the writer's id; checkpoints older than run ids record none and are not questioned)."""
    theirs = read_manifest(path).get("run_id")
    if not theirs or theirs == run_id:
        return None
    return (f"{os.path.basename(os.path.normpath(path))} was written by another run (run id {theirs}; this "
            f"output_dir's run is {run_id}): continuing from it; if it was copied here by mistake, stop and "
            "remove it, or resume from the intended checkpoint with ++resume PATH")


def check_fits(path: str, world_size: int, shapes: Optional[Callable[[], Optional[dict[str, list[int]]]]] = None) -> None:
    """ConfigError unless checkpoint ``path`` can be loaded by ``world_size`` ranks into a model whose
    tensor shapes ``shapes()`` returns (None: not checked)."""
    manifest = read_manifest(path)
    if manifest["world_size"] != world_size and not manifest.get("portable"):
        n = manifest["world_size"]
        ranks = f"{n} rank" + ("s" if n != 1 else "")
        raise ConfigError(
            f"checkpoint '{path}' was written by {ranks}, this run has {world_size}: resume with {ranks} (it predates "
            f"portable checkpoints, which resume on any number of ranks), or take its weights to a fresh run with `distkit export "
            f"{path} model.pt`")
    saved = manifest.get("shapes")
    mine = shapes() if (saved and shapes is not None) else None
    if not saved or mine is None:
        return
    for name, shape in saved.items():
        if name in mine and list(mine[name]) != list(shape):
            raise ConfigError(f"checkpoint '{path}' does not fit the model: parameter '{name}' has shape "
                              f"{list(shape)} in the checkpoint and {list(mine[name])} in the model; resume with the "
                              "model that wrote it, or start over with ++resume none")
    missing = [n for n in saved if n not in mine]
    if missing:
        raise ConfigError(f"checkpoint '{path}' does not fit the model: it has parameter '{missing[0]}', which the "
                          "model lacks; resume with the model that wrote it, or start over with ++resume none")


def model_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """Shapes of a model's state_dict tensors (ZeRO-3 partitioned parameters: their full ``ds_shape``)."""
    full = {n: getattr(p, "ds_shape", None) for n, p in model.named_parameters(remove_duplicate=False)}
    return {k: list(full.get(k) or v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def check_output_dir(output_dir: str) -> None:
    """ConfigError unless ``output_dir`` (or, when it does not exist yet, its nearest existing parent)
    and its ``checkpoints/`` accept a new file: a write probe, so root on a read-only mount is caught
    too. Writes nothing that stays."""
    target = os.path.abspath(output_dir)
    d = _nearest_existing(target)
    probe_dirs = [d]
    if d == target and os.path.isdir(os.path.join(target, "checkpoints")):
        probe_dirs.append(os.path.join(target, "checkpoints"))
    for d in probe_dirs:
        if not os.path.isdir(d):
            raise ConfigError(f"output_dir '{output_dir}' cannot be created: '{d}' is a file; choose another "
                              "output_dir")
        try:
            fd, probe = tempfile.mkstemp(prefix=".distkit-write-probe-", dir=d)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise ConfigError(f"output_dir '{output_dir}' is not writable ({e.strerror or e}: '{d}'): choose a "
                              "writable output_dir or fix its permissions") from None


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` (its directory made if missing) atomically: into a hidden temporary
    sibling, flushed to disk, then renamed over ``path``. A failure (a full disk) removes the temporary file
    and leaves the earlier ``path`` as it was, instead of truncated to 0 bytes by an ``open(path, "w")``.
    Raises :class:`OutputError` with one line naming the file and the fix."""
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.tmp")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
            f.flush()
            os.fsync(f.fileno())  # a full disk surfaces here at the latest, before the old file is replaced
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        what = "no space left on device" if _is_no_space(e) else (e.strerror or str(e))
        before = "the previous one is intact" if os.path.isfile(path) else "it was not written"
        raise OutputError(f"{what} writing '{path}' ({before}): free space or fix the permissions of "
                          f"'{directory}', then continue with ++resume auto") from None


#: the lock file of a run under ``output_dir``: flock-ed by the process that owns the run for its whole life
LOCK_NAME = ".distkit.lock"
#: set by the launching command (``--nprocs``) for the ranks it starts: the output_dir whose lock it holds
LOCK_ENV = "DISTKIT_OUTPUT_DIR_LOCKED"
#: output_dirs (absolute) whose lock this process holds, with the open descriptor that holds it
_LOCKS: dict[str, int] = {}
#: output_dirs this process created for its lock (removed again if nothing else was written in them)
_CREATED: set[str] = set()


def holds_lock(output_dir: str) -> bool:
    """Whether this process holds the run's lock on ``output_dir`` (:func:`lock_output_dir`)."""
    return os.path.abspath(output_dir) in _LOCKS


def unlock_output_dir(output_dir: str) -> None:
    """Release the lock this process holds on ``output_dir`` (if any): a ``Trainer.fit()`` in a process that
    goes on (a notebook) lets the next run there start. The file stays: deleting it could let two runs lock
    two different files of the same name."""
    target = os.path.abspath(output_dir)
    fd = _LOCKS.pop(target, None)
    if fd is not None:
        os.close(fd)  # closing the only descriptor releases the flock
    if target in _CREATED:
        # A run that failed before writing anything (e.g. its engine did not start) leaves nothing behind:
        # the directory it created holds only the lock file.
        _CREATED.discard(target)
        with contextlib.suppress(OSError):
            if os.listdir(target) == [LOCK_NAME]:
                os.remove(os.path.join(target, LOCK_NAME))
                os.rmdir(target)


def lock_output_dir(output_dir: str) -> None:
    """Take the run's lock on ``output_dir`` (created if missing): an exclusive ``flock`` on
    ``output_dir/.distkit.lock``, held until this process ends (the kernel releases it when the process
    dies, so a killed run never leaves a stale lock). Two runs on one output_dir would overwrite each
    other's checkpoints, metrics and summary, and collide in the same temporary checkpoint directory.
    Raises ConfigError (exit 2) naming the holder (pid, host, start time, which the holder writes into
    the file) when another run holds it. A no-op when this process holds it already, or when the
    launching command holds it for this rank (:data:`LOCK_ENV`): ranks of one job never refuse each other.
    Assumes a filesystem whose ``flock`` is seen by every process that may start a run on it (local, or
    a shared FS that supports it)."""
    target = os.path.abspath(output_dir)
    if target in _LOCKS or os.environ.get(LOCK_ENV) == target:
        return
    created = not os.path.isdir(target)
    os.makedirs(target, exist_ok=True)
    path = os.path.join(target, LOCK_NAME)
    # not inheritable across exec (PEP 446): a spawned rank gets LOCK_ENV instead; a forked rank shares it
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        try:
            holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
        except OSError:
            holder = ""
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise ConfigError(f"output_dir '{output_dir}' cannot be locked ({e.strerror or e}: '{path}'): choose an "
                              "output_dir on a filesystem that supports flock") from None
        raise ConfigError(f"output_dir '{output_dir}' is in use by another distkit run "
                          f"({holder or 'its holder has not recorded itself yet'}): wait for it to end, stop it, or "
                          "choose another output_dir") from None
    # who holds it, for the message a second run prints (the lock itself is the flock, not this text)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with contextlib.suppress(OSError):  # best effort (a full disk): the flock is held all the same
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}, started {started}\n".encode(), 0)
    _LOCKS[target] = fd
    if created:
        _CREATED.add(target)
        atexit.register(unlock_output_dir, target)  # (an exit through os._exit leaves the lock file)


def preflight(cfg: "RunConfig", world_size: int,
              shapes: Optional[Callable[[], Optional[dict[str, list[int]]]]] = None,
              lock: bool = False) -> Optional[str]:
    """Before any rank starts or anything is written: a writable ``output_dir``, and for a resume a
    verified checkpoint that fits ``world_size`` ranks and the model (``shapes()``). Returns the
    checkpoint a resume will use (None: a fresh start). Raises ConfigError/CheckpointError (exit 2).
    With ``lock`` (the process that owns the whole run: a single process, or the command that starts the
    ranks) it also takes the run's lock (:func:`lock_output_dir`), held until this process ends."""
    check_output_dir(cfg.output_dir)
    held = holds_lock(cfg.output_dir)
    # An existing output_dir is locked before its checkpoints are read: another run may be writing them,
    # and "in use by another run" is then the one line to print. A new one is created only once every
    # check passed, so bad input leaves no directory behind.
    if lock and os.path.isdir(cfg.output_dir):
        lock_output_dir(cfg.output_dir)
    try:
        path, _ = checkpoint_for(cfg)
        if path is not None:
            check_fits(path, world_size, shapes)
    except BaseException:
        if not held:  # refused: no run follows, the lock must not outlive this call (main() in a longer process)
            unlock_output_dir(cfg.output_dir)
        raise
    if lock:
        lock_output_dir(cfg.output_dir)
    return path


def load(path: str, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's state from a complete checkpoint directory (not collective); its file is verified
    against the manifest (size and sha256) first."""
    manifest = read_manifest(path)
    if manifest["world_size"] != world_size:
        check_fits(path, world_size)
    problem = verify(path, only=_rank_file(rank))
    if problem:
        raise CheckpointError(f"checkpoint '{path}' is damaged: {problem}; resume from another checkpoint "
                              "(++resume auto falls back to the newest complete one)")
    return torch.load(os.path.join(path, _rank_file(rank)), map_location="cpu", weights_only=False)  # type: ignore[no-any-return]
