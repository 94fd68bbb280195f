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

Resuming (:func:`find_resumable`) verifies every file's size and sha256 and falls back to the
newest complete checkpoint when ``latest`` is missing, incomplete or damaged, saying so; when
checkpoints exist but none is complete it raises, naming the damaged file.

Each rank saves its own state (in param mode ranks differ between syncs, and RNG states always
do). Assumes ``output_dir`` is on a filesystem every rank sees (one node, or a shared FS).
"""
from __future__ import annotations

import copy
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from distkit import faults, portable
from distkit.errors import CheckpointError, ConfigError

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
          global_batch: Optional[int] = None, background: bool = True) -> PendingCheckpoint:
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


def latest(root: str) -> Optional[str]:
    """The complete directory ``latest`` points to (see :func:`resolve`), or None (not verified:
    :func:`find_resumable` is what a resume uses)."""
    pointer = os.path.join(root, "latest")
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        name = f.read().strip()
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


def find_resumable(root: str) -> tuple[Optional[str], list[str]]:
    """For ``++resume auto``: the newest verified complete checkpoint under ``root`` and notes on what was
    skipped (``latest`` missing, incomplete or damaged). (None, []) when there is no checkpoint at all.
    Raises :class:`CheckpointError` naming the damaged file when checkpoints exist but none is complete:
    a resume never silently starts from step 0 over an earlier run."""
    if not os.path.isdir(root):
        return None, []
    entries = os.listdir(root)
    names = {e for e in entries if STEP_RE.match(e)} | {m.group(1) for e in entries if (m := _ASIDE_RE.match(e))}
    pointer, named = os.path.join(root, "latest"), None
    if os.path.isfile(pointer):
        with open(pointer) as f:
            named = f.read().strip() or None
    if not names and named is None:
        return None, []
    order = sorted(names, key=_step_of, reverse=True)
    if named is not None:
        order = [named] + [n for n in order if n != named]
    notes: list[str] = []
    first_problem = None
    for name in order:
        path = resolve(root, name)
        problem = verify(path) if path else (
            f"{os.path.join(root, name)} has no manifest.json (an interrupted save)" if os.path.isdir(os.path.join(root, name))
            else f"{os.path.join(root, name)} does not exist")
        if problem is None:
            if name != named:
                why = "names no checkpoint" if named is None else f"names {named}, which is unusable: {first_problem}"
                notes.append(f"checkpoints/latest {why}; resuming from {name}, the newest complete checkpoint")
                if named is None:
                    notes[-1] = f"checkpoints/latest is missing; resuming from {name}, the newest complete checkpoint"
            return path, notes
        first_problem = first_problem or problem
    raise CheckpointError(f"no complete checkpoint in {root} to resume from: {first_problem}; restore the file, "
                          "resume from a checkpoint directory with ++resume DIR, or start over with ++resume none")


def checkpoint_for(cfg: "RunConfig") -> tuple[Optional[str], list[str]]:
    """The checkpoint ``cfg.resume`` asks for, verified, and notes for the user (see :func:`find_resumable`)."""
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


def preflight(cfg: "RunConfig", world_size: int,
              shapes: Optional[Callable[[], Optional[dict[str, list[int]]]]] = None) -> Optional[str]:
    """Before any rank starts or anything is written: a writable ``output_dir``, and for a resume a
    verified checkpoint that fits ``world_size`` ranks and the model (``shapes()``). Returns the
    checkpoint a resume will use (None: a fresh start). Raises ConfigError/CheckpointError (exit 2)."""
    check_output_dir(cfg.output_dir)
    path, _ = checkpoint_for(cfg)
    if path is not None:
        check_fits(path, world_size, shapes)
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
