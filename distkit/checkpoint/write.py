"""Writing a checkpoint: the collective protocol of :func:`write` / :func:`start` (see the package
docstring), :func:`mark_latest` and the clean-up of older and interrupted checkpoints."""
from __future__ import annotations

import copy
import json
import os
import shutil
import threading
import time
from typing import Any, Callable, Optional, Protocol

import torch

from distkit import portable
from distkit.config import RunConfig
from distkit.env import Collectives
from distkit.errors import CheckpointError, DistkitError
from distkit.health import faults

from .manifest import latest
from .paths import KEEP, STEP_RE, _ASIDE_RE, _is_no_space, _rank_file, _step_of, sha256_file


class Strategy(Collectives, Protocol):
    """What writing a checkpoint uses of the engine (:class:`distkit.backends.base.Strategy` has it)."""

    name: str
    cfg: RunConfig

    def save_engine_files(self, directory: str, model: Any) -> None:
        """Collective: engines with their own checkpoint format write it into ``directory``."""


def agree_on_error(strategy: "Strategy", error: Optional[str], kind: type[DistkitError] = CheckpointError) -> None:
    """Collective: rank 0's error (or None) becomes every rank's ``kind``, so all ranks raise together (no hang)
    and rank 0 alone prints its line (``agreed``)."""
    error = strategy.broadcast_object(error, 0)
    if error:
        agreed = kind(error)
        agreed.agreed = True
        raise agreed


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
        agree_on_error(strategy, error)
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
    agree_on_error(strategy, error)
    failure: Optional[str] = None
    try:
        strategy.save_engine_files(tmp, model)
        if background:
            state = _cpu_copy(state)
    except Exception as e:  # every rank must learn of it, or the others wait in the next collective
        where = getattr(e, "filename", None)  # an engine file's (DeepSpeed's), named where it would have been
        where = os.path.join(final, os.path.relpath(where, tmp)) if isinstance(where, str) and \
            os.path.abspath(where).startswith(tmp + os.sep) else os.path.join(final, _rank_file(strategy.rank))
        failure = _describe(e, where)
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
